"""
Defects found by driving the relay from outside as users and attackers
would (raw sockets, the official SDK, the README read as a newcomer reads
it), each with the behaviour a user now relies on. Real sockets on
127.0.0.1, the faulty upstream of :mod:`tests.faulty_upstream`.
"""

from __future__ import annotations

import gc
import io
import os
import socket
import subprocess
import sys
import tracemalloc

import treq
import ujson
from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from twisted_relay._version import __version__
from twisted_relay.config import one_upstream
from twisted_relay.dumps import DumpRequest, build_dump, render_dump, write_once
from twisted_relay.replay import main as replay_main
from twisted_relay.simulated.cli import build_parser
from twisted_relay.tap import Options as TapOptions

from tests.faulty_upstream import (
    Answer,
    Hang,
    RawBytes,
    Stream,
    closed_port_url,
    error_answer,
    parse_response,
    sse_events,
)
from tests.helpers import encode, messages_body
from tests.test_dumps import SETTINGS, exchange
from tests.test_faults import UPSTREAM_KEY, FaultTestCase, sleep, wait_for

try:
    import anthropic
except ImportError:  # pragma: no cover - the test extra installs it
    anthropic = None

#: Paths that try to leave ``/v1/models/`` (and the upstream's base path).
ESCAPING_MODEL_PATHS = [
    b"/v1/models/../../admin",
    b"/v1/models/..%2F..%2F..%2Fadmin",
    b"/v1/models/%2e%2e/%2e%2e/admin",
    b"/v1/models/%2E%2E",
    b"/v1/models/x/../../../../admin?y=1",
    b"/v1/models/..\\..\\admin",
    b"/v1/models/..",
    b"/v1/models/.",
    b"/v1/models/%252e%252e",
    b"/v1/models/a%2Fb",
    b"/v1/models/a%5Cb",
    b"/v1/models/./x",
    b"/v1/./models",
    b"/v1/models/..?beta=true",
]


class PathEscapeTests(FaultTestCase):
    """No route sends a path outside the upstream's base path, with the relay's key or not."""

    async def get(self, path: bytes):
        client = self.raw(b"GET " + path + b" HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
        return parse_response(await client.done)

    async def test_dot_segments_refused(self):
        """
        A model id that is not one plain path segment (dot segments, an
        encoded slash or backslash, percent-encoded once or twice) gets an
        Anthropic-shaped 404 and nothing reaches the upstream.
        """
        self.start_relay(upstreams=one_upstream(self.upstream_url + "/base", key=UPSTREAM_KEY))
        for path in ESCAPING_MODEL_PATHS:
            response = await self.get(path)
            self.assertIn(response.status, (400, 404), path)
            body = ujson.loads(response.body)
            self.assertEqual(body["type"], "error", path)
            self.assertIn(body["error"]["type"], ("not_found_error", "invalid_request_error"), path)
        self.assertEqual([record.path for record in self.upstream.received], [])
        await self.assert_clean()

    async def test_plain_model_id_relayed(self):
        """A plain model id (and the model list) still reach the upstream, under its base path."""
        self.start_relay(upstreams=one_upstream(self.upstream_url + "/base", key=UPSTREAM_KEY))
        for path in (b"/v1/models/claude-sonnet-4-5", b"/v1/models/claude-3.5%20x?beta=true", b"/v1/models"):
            response = await self.get(path)
            self.assertEqual(response.status, 200, path)
        self.assertEqual(
            [record.path for record in self.upstream.received],
            [b"/base/v1/models/claude-sonnet-4-5", b"/base/v1/models/claude-3.5%20x?beta=true", b"/base/v1/models"],
        )
        await self.assert_clean()


class NonUtf8PathTests(FaultTestCase):
    """A path that is not UTF-8 gets the relay's own error answer."""

    async def test_non_utf8_path_refused(self):
        """
        ``/v1/models/%FF`` gets an Anthropic-shaped 400 with its request id
        (in the header and the body) and its length, and nothing reaches
        the upstream.
        """
        self.start_relay()
        client = self.raw(b"GET /v1/models/%FF HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
        response = parse_response(await client.done)
        self.assertEqual(response.status, 400)
        self.assertTrue(response.complete)
        self.assertEqual(response.header(b"content-type"), b"application/json")
        body = ujson.loads(response.body)
        self.assertEqual(body["error"]["type"], "invalid_request_error")
        self.assertEqual(body["request_id"].encode("ascii"), response.header(b"x-relay-request-id"))
        self.assertEqual(self.upstream.request_count, 0)
        await self.assert_clean()


class HopByHopTests(FaultTestCase):
    """Headers the upstream's ``Connection`` header names stay on the upstream's connection."""

    async def test_connection_tokens_dropped(self):
        """
        ``Connection: close, x-foo`` with ``X-Foo`` (RFC 9110 7.6.1): the
        client gets the answer and its end-to-end headers, never ``X-Foo``;
        and the relay does not keep the connection the upstream closes.
        """
        body = b'{"type":"message","id":"msg_1","role":"assistant","content":[]}'
        self.upstream.script(
            RawBytes(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close, X-Foo\r\n"
                b"X-Foo: upstream-connection-only\r\nX-Keep: yes\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
        )
        self.start_relay()
        response = await self.post()
        self.assertEqual(response.code, 200)
        self.assertEqual(ujson.loads(await treq.content(response))["id"], "msg_1")
        self.assertEqual(response.headers.getRawHeaders(b"x-keep"), [b"yes"])
        self.assertIsNone(response.headers.getRawHeaders(b"x-foo"))
        await self.assert_clean()


class ControlByteHeaderTests(FaultTestCase):
    """A request header value with control bytes is refused, never forwarded."""

    async def test_control_bytes_refused(self):
        """
        ``X-Evil: a<DEL><SOH><ESC>b`` gets an Anthropic-shaped 400 and
        nothing reaches the upstream; a tab, which HTTP allows, passes.
        """
        self.start_relay()
        body = encode(messages_body(tools=False))
        for value in (b"a\x7f\x01\x1bb", b"\x1b[31mred", b"a\x08b", b"\x7f"):
            client = self.raw(
                b"POST /v1/messages HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
                b"X-Evil: " + value + b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            response = parse_response(await client.done)
            self.assertEqual(response.status, 400, value)
            self.assertEqual(ujson.loads(response.body)["error"]["type"], "invalid_request_error")
        self.assertEqual(self.upstream.request_count, 0)
        response = await self.post(headers={"x-tabbed": ["a\tb"]})
        self.assertEqual(response.code, 200)
        await treq.content(response)
        self.assertEqual(self.upstream.received[0].header(b"x-tabbed"), [b"a\tb"])
        await self.assert_clean()


class EchoedKeyTests(FaultTestCase):
    """An upstream error that repeats a configured key never shows it to the client."""

    async def test_key_in_error_body_replaced(self):
        """
        A 401 whose message repeats the upstream key (as it is and JSON
        escaped) reaches the client with its status, shape and type, the key
        replaced by ``[REDACTED]``; a relay key echoed in a 500 too.
        """
        relay_key = "rk-fixes-relay/key"
        self.start_relay(upstreams=one_upstream(self.upstream_url, key=UPSTREAM_KEY), relay_keys=(relay_key,))
        self.upstream.script(
            error_answer(401, "authentication_error", "invalid x-api-key: %s" % (UPSTREAM_KEY,)),
            Answer(500, b'{"type":"error","error":{"type":"api_error","message":"got rk-fixes-relay\\/key"}}'),
        )
        body = await self.error_of(await self.post(headers={"x-api-key": [relay_key]}), 401, "authentication_error")
        self.assertNotIn(UPSTREAM_KEY, ujson.dumps(body))
        self.assertEqual(body["error"]["message"], "invalid x-api-key: [REDACTED]")
        response = await self.post(headers={"x-api-key": [relay_key]})
        self.assertEqual(response.code, 500)
        raw = await treq.content(response)
        self.assertNotIn(b"rk-fixes-relay", raw)
        self.assertEqual(ujson.loads(raw)["error"]["message"], "got [REDACTED]")
        await self.assert_clean()

    async def test_key_in_stream_error_and_headers_replaced(self):
        """
        A stream whose upstream repeats the key in a response header and in
        its ``error`` event (as it is and JSON-escaped) reaches the client
        with the error event's type and shape kept, the key nowhere: not in
        the headers, not in the body.
        """
        self.start_relay(upstreams=one_upstream(self.upstream_url, key=UPSTREAM_KEY))
        error = ujson.dumps(
            {"type": "error", "error": {"type": "overloaded_error", "message": "busy for key %s" % (UPSTREAM_KEY,)}}
        ).encode("utf-8")
        body = sse_events()[0] + b"event: error\ndata: " + error + b"\n\n"
        self.upstream.script(
            RawBytes(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
                b"X-Echo: sent x-api-key=%s\r\nRequest-Id: req_echo\r\n\r\n%s"
                % (UPSTREAM_KEY.encode("ascii"), body)
            )
        )
        response = await self.stream()
        _, payload = await self.stream_error_of(response, "overloaded_error")
        self.assertEqual(payload["error"]["message"], "busy for key [REDACTED]")
        headers = list(response.headers.getAllRawHeaders())
        self.assertNotIn(UPSTREAM_KEY.encode("ascii"), repr(headers).encode("ascii"))
        self.assertEqual(response.headers.getRawHeaders(b"x-echo"), [b"sent x-api-key=[REDACTED]"])
        self.assertEqual(response.headers.getRawHeaders(b"request-id"), [b"req_echo"])
        await self.assert_clean()


def tiny_messages(count: int) -> list[dict]:
    """Many tiny alternating messages, ending on a user turn: the costliest body to parse per byte."""
    messages = [{"role": "user" if n % 2 == 0 else "assistant", "content": "m%d" % (n,)} for n in range(count)]
    return messages if count % 2 else messages[:-1]


class BodyMemoryTests(FaultTestCase):
    """The bytes of request bodies in flight are bounded, and a waiting request holds no parsed copy."""

    async def test_budget_refuses_then_frees(self):
        """
        With room for two bodies, a third large request gets a 529
        ``overloaded_error`` and never reaches the upstream; the room comes
        back when a request ends, including one whose client hangs up half-way
        through its body.
        """
        body = encode(messages_body(tiny_messages(3001), stream=True, tools=False))
        self.start_relay(max_bodies_in_flight=int(len(body) * 2.5))
        self.upstream.script(Hang(headers=True), Hang(headers=True))
        first, second = self.raw(self.raw_post(body)), self.raw(self.raw_post(body))
        await wait_for(lambda: first.received and second.received)
        self.assertEqual(self.site.body_budget.held, 2 * len(body))
        body_error = await self.error_of(await self.post(body), 529, "overloaded_error")
        self.assertIn("memory", body_error["error"]["message"])
        self.assertEqual(self.upstream.request_count, 2)
        # A small request still fits.
        response = await self.post()
        self.assertEqual(response.code, 200)
        await treq.content(response)
        first.abort()
        await wait_for(lambda: self.site.body_budget.held == len(body))
        # A client that leaves in the middle of its body gives its room back.
        half = self.raw(self.raw_post(body), send_only=len(body) // 2)
        await wait_for(lambda: self.site.body_budget.held == 2 * len(body))
        half.abort()
        await wait_for(lambda: self.site.body_budget.held == len(body))
        response = await self.post(body)
        self.assertEqual(response.code, 200)
        await treq.content(response)
        second.abort()
        await wait_for(lambda: self.site.body_budget.held == 0)
        await self.assert_clean()

    async def test_chunked_body_counted(self):
        """A chunked body (no declared length) is counted as it comes, and refused once over the budget."""
        body = encode(messages_body(tiny_messages(3001), stream=True, tools=False))
        self.start_relay(max_bodies_in_flight=int(len(body) * 1.5))
        self.upstream.script(Hang(headers=True))
        first = self.raw(self.raw_post(body))
        await wait_for(lambda: first.received)
        head = b"POST /v1/messages HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
        chunked = self.raw(
            head + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )
        response = parse_response(await chunked.done)
        self.assertEqual(response.status, 529)
        self.assertEqual(ujson.loads(response.body)["error"]["type"], "overloaded_error")
        self.assertEqual(self.upstream.request_count, 1)
        first.abort()
        await wait_for(lambda: self.site.body_budget.held == 0)
        await self.assert_clean()

    async def test_lone_body_over_budget_let_in_either_framing(self):
        """
        With nothing else held, one body larger than the whole budget is let
        in, whether it declares its length or comes in several chunks: its
        own earlier chunks never count against it.
        """
        body = encode(messages_body(tiny_messages(3001), stream=False, tools=False))
        self.start_relay(max_bodies_in_flight=len(body) // 3)
        head = b"POST /v1/messages HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
        quarter = len(body) // 4 + 1
        chunks = b"".join(
            b"%x\r\n%s\r\n" % (len(piece), piece)
            for piece in (body[n:n + quarter] for n in range(0, len(body), quarter))
        )
        for request in (
            head + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunks + b"0\r\n\r\n",
            head + b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body),
        ):
            response = parse_response(await self.raw(request).done)
            self.assertEqual(response.status, 200, response.body[:300])
            await wait_for(lambda: self.site.body_budget.held == 0)
        self.assertEqual(self.upstream.request_count, 2)
        await self.assert_clean()

    async def test_waiting_request_holds_no_parsed_body(self):
        """
        While a large request waits on the upstream, the relay holds its
        bytes, not the parsed objects (ten times larger for tiny messages).
        """
        body = encode(messages_body(tiny_messages(40001), stream=True, tools=False))
        self.start_relay()
        self.upstream.script(Hang(headers=True))
        gc.collect()
        tracemalloc.start()
        self.addCleanup(tracemalloc.stop)
        before = tracemalloc.get_traced_memory()[0]
        client = self.raw(self.raw_post(body))
        await wait_for(lambda: client.received, timeout=30)
        del body
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        # The body is in this process three times (the test's copy, the
        # raw client's, the upstream's record) and once in the relay.
        body_size = len(self.upstream.received[0].body)
        self.assertLess(held, 5.5 * body_size, "%d bytes held for a %d-byte body" % (held, body_size))
        client.abort()
        await self.assert_clean()


#: Streams recorded in Anthropic's SDK repositories that end without the blank line after their last event.
RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "recorded-sse")


def _sdk_final_message(base_url: str) -> dict:
    """Stream one request with the official SDK; the message it accumulated. Runs in a thread."""
    with anthropic.Anthropic(base_url=base_url, api_key="sk-test-sdk", max_retries=0, timeout=30) as client:
        with client.messages.stream(
            model="claude-sonnet-4-5", max_tokens=64, messages=[{"role": "user", "content": "Hi"}]
        ) as stream:
            for _ in stream:
                pass
            return stream.get_final_message().model_dump(mode="json", warnings=False)


class UnterminatedLastEventTests(FaultTestCase):
    """A stream whose last event lacks its blank line, then ends cleanly, reaches the client whole."""

    async def test_recorded_streams_through_the_sdk(self):
        """
        Each recorded stream that ends without its blank line, served in
        97-byte pieces with a proper end of body: the official SDK
        accumulates the same message through the relay as directly, and the
        relay's stream ends with that last event, terminated.
        """
        if anthropic is None:
            raise SkipTest("the anthropic SDK is not installed")
        names = sorted(name for name in os.listdir(RECORDED) if not name.endswith(".md"))
        self.assertGreaterEqual(len(names), 6)
        self.start_relay()
        for name in names:
            with open(os.path.join(RECORDED, name), "rb") as f:
                recorded = f.read()
            self.assertFalse(recorded.endswith(b"\n\n"), name)
            pieces = [(0.0, recorded[at:at + 97]) for at in range(0, len(recorded), 97)]
            self.upstream.script(Stream(pieces), Stream(pieces))
            direct = await deferToThread(_sdk_final_message, self.upstream_url)
            relayed = await deferToThread(_sdk_final_message, self.relay_url)
            self.assertEqual(relayed, direct, name)
        self.upstream.script(Stream([(0.0, recorded)]))
        response = await self.stream()
        body = await treq.content(response)
        self.assertTrue(body.endswith(b'data: {"type":"message_stop"}\n\n'), body[-80:])
        self.assertNotIn(b"event: error", body)
        await self.assert_clean()

    async def test_cut_event_still_an_error(self):
        """A clean end of body after half an event's JSON is still a cut stream: an SSE ``error`` event."""
        self.start_relay()
        events = sse_events()
        half = events[-1][: len(events[-1]) // 2 + 5].rstrip(b"\n")
        self.upstream.script(Stream([(0.0, event) for event in events[:-1]] + [(0.0, half)]))
        _, payload = await self.stream_error_of(await self.stream(), "api_error")
        self.assertIn("middle of an event", payload["error"]["message"])
        await self.assert_clean()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme() -> str:
    """The README, its lines joined (sentences wrap)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return " ".join(f.read().split())


class EventHoldingTests(FaultTestCase):
    """What the README says of buffering is what the relay does: it holds the event still arriving, no more."""

    async def test_half_event_held_whole_events_passed(self):
        """
        Whole events reach the client while the next one is still arriving;
        the half-arrived event does not, until its blank line comes. The
        README says so, and no longer says "without buffering".
        """
        text = readme()
        self.assertNotIn("without buffering", text)
        self.assertIn("holds only the event still arriving, until its blank line (at most one event", text)
        events = sse_events()
        half = len(events[3]) // 2
        self.upstream.script(
            Stream([(0.0, b"".join(events[:3])), (0.0, events[3][:half]), (2.0, events[3][half:])]
                   + [(0.0, event) for event in events[4:]])
        )
        self.start_relay(idle_timeout=5.0)
        client = self.raw(self.raw_post())
        await wait_for(lambda: events[2] in bytes(client.received), timeout=1.5)
        await sleep(0.3)
        self.assertEqual(parse_response(bytes(client.received)).body, b"".join(events[:3]))
        response = parse_response(await client.done)
        self.assertEqual(response.status, 200)
        self.assertIn(events[3], response.body)
        await self.assert_clean()


class DrainErrorAnswerTests(FaultTestCase):
    """While the relay drains, an error answer still tells the client the connection closes."""

    async def test_error_answer_keeps_connection_close(self):
        """
        A request on a kept-alive connection during a drain whose upstream
        answer is cut after its headers gets the relay's 502 with
        ``Connection: close`` (the drain's), and the connection closes.
        """
        self.start_relay()
        self.relay.app.begin_draining()
        self.upstream.script(
            RawBytes(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                b"X-Upstream: yes\r\n\r\n{\"type\":"
            )
        )
        body = encode(messages_body(tools=False))
        client = self.raw(
            b"POST /v1/messages HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        response = parse_response(await client.done)
        self.assertEqual(response.status, 502, response.body)
        self.assertEqual(ujson.loads(response.body)["type"], "error")
        self.assertEqual(response.header(b"connection"), b"close")
        self.assertIsNone(response.header(b"x-upstream"))
        self.assertIsNotNone(response.header(b"x-relay-request-id"))
        await self.assert_clean()


class DrainDeadlineTests(FaultTestCase):
    """The shutdown grace bounds how long a client that stopped reading keeps its connection."""

    async def test_stalled_reader_cut_at_the_deadline(self):
        """
        A streaming client that stops reading while megabytes are still to
        come, its connection's buffers full: when the drain's grace is over
        the relay drops the connection at once (its unsent bytes with it),
        the request ends and nothing is left open.
        """
        self.start_relay()
        text = "x" * (256 * 1024)
        delta = b"event: content_block_delta\ndata: " + ujson.dumps(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
        ).encode("ascii") + b"\n\n"
        # About 12 MB: more than the socket buffers on both sides hold.
        self.upstream.script(Stream([(0.0, event) for event in sse_events()[:2] + [delta] * 48], end="hang"))
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.addCleanup(stalled.close)
        stalled.connect(("127.0.0.1", self.relay_port))
        stalled.sendall(self.raw_post())
        await wait_for(lambda: self.relay.app.in_flight == 1)
        (request,) = self.relay.app._active
        await wait_for(lambda: request.channel.transport.producerPaused)
        await self.relay.app.drain(0.2)
        await wait_for(lambda: self.relay.app.in_flight == 0, timeout=2)
        stalled.close()
        await self.assert_clean()


class RequestIdEverywhereTests(FaultTestCase):
    """Every answer carries ``x-relay-request-id``, as the README says."""

    async def test_every_route(self):
        """``/health``, ``/ready``, ``/metrics``, ``HEAD /`` and ``HEAD /api/hello`` too, each id its own."""
        self.assertIn("every answer carries an `x-relay-request-id` header", readme())
        self.start_relay()
        ids = set()
        for method, path in ((b"GET", b"/health"), (b"GET", b"/ready"), (b"GET", b"/metrics"),
                             (b"HEAD", b"/"), (b"HEAD", b"/api/hello"), (b"GET", b"/api/hello"),
                             (b"GET", b"/nowhere"), (b"GET", b"/v1/models")):
            client = self.raw(method + b" " + path + b" HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
            response = parse_response(await client.done)
            self.assertLess(response.status, 500, path)
            request_id = response.header(b"x-relay-request-id")
            self.assertIsNotNone(request_id, path)
            self.assertTrue(request_id.startswith(b"rly_"), request_id)
            ids.add(request_id)
        self.assertEqual(len(ids), 8)
        await self.assert_clean()


class HugeHeaderTests(FaultTestCase):
    """An upstream header too large to read is a 502 that says so in words."""

    async def test_64k_header(self):
        """A 64 KB upstream response header: a 502 ``api_error`` naming the cause, no Python repr."""
        self.start_relay()
        self.upstream.script(
            RawBytes(b"HTTP/1.1 200 OK\r\nX-Huge: " + b"a" * 65536 + b"\r\nContent-Length: 2\r\n\r\n{}")
        )
        body = await self.error_of(await self.post(), 502, "api_error")
        message = body["error"]["message"]
        self.assertNotIn("<", message)
        self.assertNotIn("Failure", message)
        self.assertIn("header line longer than the relay reads", message)


class ReplayNonDumpTests(SynchronousTestCase):
    """``twisted-relay-replay`` refuses a JSON file that is not a dump, as docs/dumps.md says (exit 2)."""

    def test_not_a_dump(self):
        """``{}``, a list, and an object without the dump's sections: exit 2, a sentence, no ``None`` fields."""
        for content in ("{}", "[]", '{"format": 1, "relay_request_id": "rly_1"}', '"text"'):
            path = self.mktemp()
            with open(path, "w") as f:
                f.write(content)
            out, err = io.StringIO(), io.StringIO()
            for argv in ([path], [path, "--check"]):
                self.assertEqual(replay_main(argv, stdout=out, stderr=err), 2, content)
            self.assertEqual(out.getvalue(), "")
            self.assertIn("is not a relay dump", err.getvalue())


class SmallThingsTests(FaultTestCase):
    """What a newcomer trips on: the version, the simulator's seed, error wording, the documented grep."""

    def test_version(self):
        """``twistd -n relay --version`` prints the relay's version (and Twisted's), and exits 0."""
        done = subprocess.run(
            [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "relay", "--version"],
            cwd=self.mktemp_dir(), capture_output=True, timeout=60, check=False,
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn(b"twisted-relay version: " + __version__.encode(), done.stdout)
        self.assertIn(b"Twisted version:", done.stdout)

    def mktemp_dir(self) -> str:
        path = self.mktemp()
        os.makedirs(path)
        return path

    def test_simulated_seeds_agree(self):
        """``--simulate`` and the standalone simulator start from the same seed by default."""
        options = TapOptions()
        options.parseOptions(["--simulate", "strict"])
        self.assertEqual(options.config.simulate_options["seed"], build_parser().parse_args([]).seed)

    async def test_refused_connection_message(self):
        """A refused upstream connection is one sentence with one final period."""
        self.start_relay(await closed_port_url(reactor))
        body = await self.error_of(await self.post(), 502, "api_error")
        message = body["error"]["message"]
        self.assertIn("refused", message)
        self.assertNotIn("..", message)
        self.assertTrue(message.endswith("."), message)
        await self.stop_all()

    def test_documented_duplicate_grep(self):
        """
        The grep that docs/dumps.md gives for refusals about duplicate ids
        finds a dump of Anthropic's own wording and of the other backends'.
        """
        with open(os.path.join(ROOT, "docs", "dumps.md"), encoding="utf-8") as f:
            lines = f.read().splitlines()
        at = next(n for n, line in enumerate(lines) if line.startswith("# Every refusal that complained about a duplicate"))
        command = next(line for line in lines[at:] if line.startswith("grep"))
        folder = self.mktemp_dir()
        for message in ("messages.3.content.0: `tool_use` ids must be unique", "duplicate tool_call id toolu_001",
                        "max_tokens: Field required"):
            error = {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
            request = DumpRequest(**exchange(response_body=ujson.dumps(error).encode()))
            data = render_dump(build_dump(request, SETTINGS), [], 64 * 1024 * 1024)
            write_once(os.path.join(folder, "relay-dumps"), request.received_at, request.relay_request_id, data)
        done = subprocess.run(["sh", "-c", command], cwd=folder, capture_output=True, timeout=30, check=False)
        self.assertIn(b"must be unique", done.stdout)
        self.assertIn(b"duplicate tool_call id", done.stdout)
        self.assertNotIn(b"Field required", done.stdout)
