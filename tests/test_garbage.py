# -*- test-case-name: tests.test_garbage -*-
"""
A relayed request leaves no cyclic garbage (issue 22, item 1).

Reference cycles are freed only by the garbage collector, and the oldest
generation only by a full collection, which stops every stream for as long
as it takes (about 90 ms at 1,000 streams in issue 13's run). So each test
here relays requests in memory on the production path (the relay's own
``RelaySite``, its dispatch, treq, its pool and its gate; only the sockets
are in memory), with the collector off and ``gc.DEBUG_SAVEALL`` on, and then
asks ``gc.collect()`` what it would have freed: nothing, whatever the
outcome (an answer, whole or streamed; an upstream error passed through; a
failover; a client gone; the deadline).

Two things around the relay are made to behave as they do outside a test,
so that what is found is the relay's:

- The client is a plain protocol writing HTTP/1.1 bytes, as a client in
  another process would be: Twisted's own HTTP client (the test stub's)
  leaves its parser and chunked decoder in a cycle, which is the client's
  garbage, not the relay's.
- The in-memory transport lets go of its protocol once the connection is
  lost, as ``twisted.internet.tcp.Connection`` does (``del
  self.protocol``); ``iosim.FakeTransport`` keeps it, a cycle a real socket
  does not make. The simulated upstream's ``Site`` parses no form bodies, as
  the relay's does not (Twisted's form parsing makes a class per request in
  ``email.headerregistry``).
"""

from __future__ import annotations

import gc
from collections import Counter

from twisted.internet.protocol import Factory, Protocol
from twisted.test import iosim
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import URI
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from twisted_relay.config import RelayConfig, Route, Target, Upstream

from tests.helpers import InMemoryRelay, encode, messages_body

_WHOLE = encode({
    "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
    "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
    "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1},
})


def _event(data: dict) -> bytes:
    return b"event: " + data["type"].encode() + b"\ndata: " + encode(data) + b"\n\n"


_STREAM_START = _event({
    "type": "message_start",
    "message": {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}},
}) + _event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}) + _event(
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}}
)
_STREAM = _STREAM_START + _event({"type": "content_block_stop", "index": 0}) + _event(
    {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": {"output_tokens": 1}}
) + _event({"type": "message_stop"})


class _Upstream(Resource):
    """
    A Messages upstream that answers every request the same way: ``"ok"``
    (a message, whole or streamed), a status with an error body, or
    ``"hang"`` (nothing more: a streamed answer stops after its first
    events).
    """

    isLeaf = True

    def __init__(self, answer):
        super().__init__()
        self.answer = answer

    def render_POST(self, request):
        streamed = b'"stream":true' in request.content.read()
        if isinstance(self.answer, int):
            request.setResponseCode(self.answer)
            request.setHeader(b"content-type", b"application/json")
            return encode({"type": "error", "error": {"type": "api_error", "message": "no"}})
        request.setHeader(b"content-type", b"text/event-stream" if streamed else b"application/json")
        if self.answer == "hang":
            if streamed:
                request.write(_STREAM_START)
            return NOT_DONE_YET
        return _STREAM if streamed else _WHOLE


class _TcpLikeTransport(iosim.FakeTransport):
    """An in-memory transport that lets go of its protocol once the connection is lost, as TCP's does."""

    def reportDisconnect(self):
        super().reportDisconnect()
        del self.protocol


class _RawClient(Protocol):
    """
    A client writing one HTTP/1.1 request (``Connection: close``) and reading
    the answer's bytes; with ``leave``, it closes its connection once the
    first bytes of the answer's body have come.
    """

    def __init__(self, request: bytes, leave: bool):
        self.request, self.leave = request, leave
        self.received = b""
        self.closed = False

    def connectionMade(self):
        self.transport.write(self.request)

    def dataReceived(self, data):
        self.received += data
        if self.leave and b"\r\n\r\n" in self.received and not self.received.endswith(b"\r\n\r\n"):
            self.transport.loseConnection()

    def connectionLost(self, reason):
        self.closed = True


class _OneClient(Factory):
    def __init__(self, client):
        self.client = client

    def buildProtocol(self, addr):
        return self.client


class NoCyclicGarbageTests(SynchronousTestCase):
    """Relayed requests, with the collector off: ``gc.collect()`` finds nothing a request made."""

    def setUp(self):
        self.patch(iosim, "FakeTransport", _TcpLikeTransport)
        self.addCleanup(gc.enable if gc.isenabled() else gc.disable)
        self.addCleanup(gc.set_debug, gc.get_debug())

    def relay(self, answer, *, second=None, **settings) -> InMemoryRelay:
        """
        The relay in front of an upstream answering ``answer``; with
        ``second``, in front of two upstreams, ``first`` answering ``answer``
        and ``second`` answering ``second``, tried in that order.
        """
        if second is None:
            upstreams = {b"upstream.test": _Upstream(answer)}
            config = RelayConfig(listen=(), dump_dir=None, upstreams=(Upstream("up", "http://upstream.test"),), **settings)
        else:
            upstreams = {b"first.test": _Upstream(answer), b"second.test": _Upstream(second)}
            config = RelayConfig(
                listen=(), dump_dir=None,
                upstreams=(Upstream("first", "http://first.test"), Upstream("second", "http://second.test")),
                routes=(Route(targets=(Target("first"), Target("second"))),),
                breaker_failures=1000, **settings,
            )
        relay = InMemoryRelay(Resource(), config, more_upstreams=upstreams)
        for host, resource in upstreams.items():
            relay.network.stop_listening(host, 80)
            relay.network.listen(host, 80, Site(resource, reactor=relay.clock, parsePOSTFormSubmission=False))
        return relay

    def exchange(self, relay, *, stream=False, leave=False, wait=0.0, path="/v1/messages") -> bytes:
        """One request from a client of its own; what it received once its connection closed."""
        body = encode(messages_body(stream=stream))
        client = _RawClient(
            b"POST %s HTTP/1.1\r\nHost: relay.test\r\nContent-Type: application/json\r\n"
            b"x-api-key: sk-test-client\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (path.encode(), len(body), body),
            leave,
        )
        relay.network.endpointForURI(URI.fromBytes(b"http://relay.test/")).connect(_OneClient(client))
        relay.flush()
        if wait:
            relay.clock.advance(wait)
            relay.flush()
        self.assertTrue(client.closed)
        return client.received

    def assertNoGarbage(self, relay, expected_status: bytes, n=4, **exchange):
        """
        After two requests (caches filled, pool connections made), ``n``
        more with the collector off leave nothing for ``gc.collect()``.
        """
        for _ in range(2):
            self.assertTrue(self.exchange(relay, **exchange).startswith(b"HTTP/1.1 " + expected_status), expected_status)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        for _ in range(n):
            received = self.exchange(relay, **exchange)
            self.assertTrue(received.startswith(b"HTTP/1.1 " + expected_status), received[:200])
        gc.collect()
        garbage = list(gc.garbage)
        del gc.garbage[:]
        gc.set_debug(0)
        kinds = Counter(getattr(o, "__qualname__", None) or type(o).__qualname__ for o in garbage)
        self.assertEqual(kinds.most_common(), [])

    def test_whole(self):
        """A whole answer."""
        self.assertNoGarbage(self.relay("ok"), b"200")

    def test_streamed(self):
        """A streamed answer."""
        self.assertNoGarbage(self.relay("ok"), b"200", stream=True)

    def test_count_tokens(self):
        """A token count."""
        self.assertNoGarbage(self.relay("ok"), b"200", path="/v1/messages/count_tokens")

    def test_upstream_client_error(self):
        """An upstream's 400, passed through, whole or streamed."""
        relay = self.relay(400)
        self.assertNoGarbage(relay, b"400")
        self.assertNoGarbage(relay, b"400", stream=True)

    def test_upstream_error_no_failover(self):
        """An upstream's 503 with no other upstream: passed through, whole or streamed."""
        relay = self.relay(503, retries=0)
        self.assertNoGarbage(relay, b"503")
        self.assertNoGarbage(relay, b"503", stream=True)

    def test_failover_whole(self):
        """The first upstream's 503, then the second's answer."""
        self.assertNoGarbage(self.relay(503, second="ok"), b"200")

    def test_failover_streamed(self):
        """The first upstream's 503, then the second's stream."""
        self.assertNoGarbage(self.relay(503, second="ok"), b"200", stream=True)

    def test_client_gone_mid_stream(self):
        """A client that leaves once its stream has begun."""
        self.assertNoGarbage(self.relay("hang"), b"200", stream=True, leave=True)

    def test_deadline_whole(self):
        """An upstream that never answers: the deadline's 504."""
        self.assertNoGarbage(self.relay("hang", total_timeout=1.0), b"504", wait=1.5)

    def test_deadline_streamed(self):
        """A stream that stops: the deadline ends it (an error event)."""
        self.assertNoGarbage(self.relay("hang", total_timeout=1.0), b"200", stream=True, wait=1.5)
