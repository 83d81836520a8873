# -*- test-case-name: tests.test_dispatch_contract -*-
"""
The relayed routes' direct dispatch answers exactly as Klein's render does.

``POST /v1/messages``, ``POST /v1/messages/count_tokens`` and ``GET
/v1/models`` run their Klein endpoints through ``Klein.execute_endpoint``
without Klein's render (``twisted_relay.app``, docs/architecture.md, "Two
dispatch paths, one set of routes"); everything else still goes through
Klein's render. Each case here is sent, byte for byte, to a relay that
dispatches directly and to one whose every route goes through Klein's
render (``RelayApp.resource(direct=False)``), and both answers must be the
same bytes: status line, headers in order, body (only the ``Date`` header
and the relay's random request ids are set aside).
"""

from __future__ import annotations

import re

from twisted.test import iosim
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.config import RelayConfig, Upstream
from twisted_relay.relayed_request import RelayedRequest
from twisted_relay.site import RelaySite

from tests.test_garbage import MessagesUpstream, TcpLikeTransport, exchange, request_bytes
from tests.helpers import InMemoryRelay, encode, messages_body

_MESSAGE = encode(messages_body())
_STREAMED = encode(messages_body(stream=True))

# (what, method, path, body, Host header)
CASES = [
    ("message", b"POST", b"/v1/messages", _MESSAGE, b"relay.test"),
    ("streamed message", b"POST", b"/v1/messages", _STREAMED, b"relay.test"),
    ("message with a query", b"POST", b"/v1/messages?beta=true", _MESSAGE, b"relay.test"),
    ("message, body not JSON", b"POST", b"/v1/messages", b'{"model": ', b"relay.test"),
    ("message, no body", b"POST", b"/v1/messages", b"", b"relay.test"),
    ("message, doubled slash", b"POST", b"//v1/messages", _MESSAGE, b"relay.test"),
    ("message, slash encoded", b"POST", b"/v1%2Fmessages", _MESSAGE, b"relay.test"),
    ("message, trailing slash", b"POST", b"/v1/messages/", _MESSAGE, b"relay.test"),
    ("token count", b"POST", b"/v1/messages/count_tokens", _MESSAGE, b"relay.test"),
    ("model list", b"GET", b"/v1/models", b"", b"relay.test"),
    ("model list with a query", b"GET", b"/v1/models?limit=1", b"", b"relay.test"),
    ("one model", b"GET", b"/v1/models/m", b"", b"relay.test"),
    ("405 GET messages", b"GET", b"/v1/messages", b"", b"relay.test"),
    ("405 PUT count", b"PUT", b"/v1/messages/count_tokens", _MESSAGE, b"relay.test"),
    ("405 POST models", b"POST", b"/v1/models", _MESSAGE, b"relay.test"),
    ("HEAD messages", b"HEAD", b"/v1/messages", b"", b"relay.test"),
    ("HEAD models", b"HEAD", b"/v1/models", b"", b"relay.test"),
    ("HEAD /", b"HEAD", b"/", b"", b"relay.test"),
    ("404", b"GET", b"/nothing/here", b"", b"relay.test"),
    ("404 POST", b"POST", b"/v1/message", _MESSAGE, b"relay.test"),
    ("bad UTF-8 path", b"POST", b"/v1/messages%ff", _MESSAGE, b"relay.test"),
    ("bad UTF-8 Host", b"POST", b"/v1/messages", _MESSAGE, b"relay\xff.test"),
    ("health", b"GET", b"/health", b"", b"relay.test"),
    ("ready", b"GET", b"/ready", b"", b"relay.test"),
    ("hello", b"GET", b"/api/hello", b"", b"relay.test"),
    ("metrics (off)", b"GET", b"/metrics", b"", b"relay.test"),
]


def normalised(raw: bytes) -> bytes:
    """An answer's bytes without its ``Date`` header, its request ids made the same."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"date:")]
    return re.sub(rb"rly_[0-9A-Za-z]+", b"rly_ID", b"\r\n".join(lines) + b"\r\n\r\n" + body)


class DispatchContractTests(SynchronousTestCase):
    """Every route and error case: the same answer through the direct dispatch and through Klein's render."""

    def setUp(self):
        self.patch(iosim, "FakeTransport", TcpLikeTransport)

    def relays(self, answer="ok", **settings) -> dict[str, InMemoryRelay]:
        """Two relays in front of the same kind of upstream: ``direct`` and ``klein``."""
        config = RelayConfig(listen=(), dump_dir=None, upstreams=(Upstream("up", "http://upstream.test"),), **settings)
        relays = {}
        for name in ("direct", "klein"):
            relay = relays[name] = InMemoryRelay(MessagesUpstream(answer), config)
            if name == "klein":
                relay.network.stop_listening(b"relay.test", 80)
                site = RelaySite.for_config(relay.app.resource(direct=False), config, reactor=relay.clock)
                relay.network.listen(b"relay.test", 80, site)
        return relays

    def assertSameAnswers(self, relays, cases, **exchanged) -> dict[str, bytes]:
        """Each case to both relays: the same bytes back. Returns the answers by case."""
        answers, differ = {}, []
        for what, method, path, body, host in cases:
            got = {
                name: normalised(exchange(relay, request_bytes(method, path, body, host), **exchanged).received)
                for name, relay in relays.items()
            }
            if got["direct"] != got["klein"]:
                differ.append("%s:\n  direct: %r\n  klein:  %r" % (what, got["direct"], got["klein"]))
            answers[what] = got["direct"]
        self.assertEqual(differ, [], "\n".join(differ))
        for relay in relays.values():
            self.assertEqual(relay.app.in_flight, 0)
        return answers

    def test_routes_and_errors(self):
        """Every route, wrong methods, HEAD, unknown paths, bad UTF-8 in the path or Host."""
        answers = self.assertSameAnswers(self.relays(), CASES)
        # The cases are what they say.
        status = {what: answer.split(b"\r\n", 1)[0] for what, answer in answers.items()}
        self.assertEqual(status["message"], b"HTTP/1.1 200 OK")
        self.assertEqual(status["streamed message"], b"HTTP/1.1 200 OK")
        self.assertIn(b"event: message_stop", answers["streamed message"])
        self.assertEqual(status["model list"], b"HTTP/1.1 200 OK")
        self.assertEqual(status["405 GET messages"], b"HTTP/1.1 405 Method Not Allowed")
        self.assertEqual(status["404"], b"HTTP/1.1 404 Not Found")
        self.assertEqual(status["bad UTF-8 path"], b"HTTP/1.1 400 Bad Request")
        self.assertEqual(status["bad UTF-8 Host"], b"HTTP/1.1 400 Bad Request")
        self.assertEqual(status["message, body not JSON"], b"HTTP/1.1 400 Bad Request")

    def test_upstream_errors(self):
        """An upstream's 400 and 529, passed through; the deadline's 504."""
        self.assertSameAnswers(self.relays(400), CASES[:2])
        self.assertSameAnswers(self.relays(529, retries=0), CASES[:2])
        answers = self.assertSameAnswers(self.relays("hang", total_timeout=1.0), CASES[:2], wait=1.5)
        self.assertTrue(answers["message"].startswith(b"HTTP/1.1 504"))
        self.assertIn(b"event: error", answers["streamed message"])

    def test_endpoint_failure(self):
        """An endpoint that raises: Twisted's 500 page on both paths, the error logged once by each."""

        def broken(self):
            raise RuntimeError("broken endpoint")

        self.patch(RelayedRequest, "run", broken)
        answers = self.assertSameAnswers(self.relays(), CASES[:1] + CASES[8:10])
        self.assertTrue(answers["message"].startswith(b"HTTP/1.1 500"))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 6)

    def test_client_gone(self):
        """A client that leaves mid-stream, or at once: the same bytes until then, nothing left in flight."""
        relays = self.relays("hang")
        self.assertSameAnswers(relays, CASES[1:2], leave=True)
        self.assertSameAnswers(relays, CASES[:2], leave="at once")
        self.assertEqual(self.flushLoggedErrors(), [])
