"""
Fault injection on real sockets on 127.0.0.1: the relay in front of an
upstream that fails on purpose (:mod:`tests.faulty_upstream`), and clients
that misbehave; and upstream streams that end without the blank line after
their last event, as recorded ones do.

Every test asserts what the client receives (status, Anthropic error type,
or an SSE ``error`` event and a clean end) and that nothing is left open
afterwards: no request in flight upstream, no busy connection in the
relay's pool, and as many file descriptors in this process as before the
test began.
"""

from __future__ import annotations

import gc
import os
import re
import socket
import time

import treq
import ujson
from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.protocol import ClientFactory
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.client import Agent, HTTPConnectionPool, ResponseFailed

from twisted_relay.config import RelayConfig, one_upstream
from twisted_relay.service import Relay

from tests.faulty_upstream import (
    Answer,
    FaultyUpstream,
    Hang,
    RawBytes,
    RawClient,
    Reset,
    Stream,
    closed_port_url,
    complete_stream,
    cut_after,
    error_answer,
    garbage_stream,
    message_json,
    oversized_event,
    parse_response,
    silent_mid_stream,
    sse_events,
    trickle,
    truncated_mid_event,
)
from tests.helpers import encode, messages_body, serve_relay

try:
    import anthropic
except ImportError:  # pragma: no cover - the test extra installs it
    anthropic = None

#: Short limits, so that every fault shows within a second or two.
FAST = dict(
    connect_timeout=1.0,
    response_timeout=2.0,
    idle_timeout=2.0,
    ping_interval=0,
    shutdown_grace=0.5,
    request_read_timeout=2.0,
)
RELAY_KEY = "rk-faults-relay-key"
UPSTREAM_KEY = "sk-faults-upstream-key"


def open_fds() -> int:
    """File descriptors this process holds now."""
    return len(os.listdir("/proc/self/fd"))


async def wait_for(condition, timeout: float = 5.0, step: float = 0.01) -> None:
    """Wait on the reactor until ``condition()`` holds; fail after ``timeout`` seconds."""
    deadline = reactor.seconds() + timeout
    while not condition():
        if reactor.seconds() >= deadline:
            raise AssertionError("condition not met within %s s" % (timeout,))
        await deferLater(reactor, step, lambda: None)


async def sleep(seconds: float) -> None:
    """Let the reactor run for ``seconds``."""
    await deferLater(reactor, seconds, lambda: None)


def sse(body: bytes) -> list[tuple[str | None, object]]:
    """The ``(event name, parsed data)`` of each event of an SSE body."""
    events = []
    for raw in body.split(b"\n\n"):
        if not raw.strip():
            continue
        name, data = None, []
        for line in raw.split(b"\n"):
            field, _, value = line.partition(b":")
            value = value[1:] if value.startswith(b" ") else value
            if field == b"event":
                name = value.decode("utf-8")
            elif field == b"data":
                data.append(value)
        try:
            payload = ujson.loads(b"\n".join(data))
        except ValueError:
            payload = None
        events.append((name, payload))
    return events


class _RawUpstream:
    """
    An upstream on a bare non-blocking socket, polled by the test, for
    races that need bytes to be sent while the reactor is not running.

    :ivar requests: for each accepted connection, in order, the number of
        whole requests received on it.
    """

    def __init__(self):
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self._listener.setblocking(False)
        self.url = "http://127.0.0.1:%d" % (self._listener.getsockname()[1],)
        self._connections: list[socket.socket] = []
        self._buffers: list[bytearray] = []
        self.requests: list[int] = []

    def poll(self) -> int:
        """Accept and read what is there; return the number of whole requests received so far."""
        while True:
            try:
                connection = self._listener.accept()[0]
            except BlockingIOError:
                break
            connection.setblocking(False)
            self._connections.append(connection)
            self._buffers.append(bytearray())
            self.requests.append(0)
        for n, connection in enumerate(self._connections):
            try:
                self._buffers[n] += connection.recv(65536)
            except (BlockingIOError, OSError):
                pass
            while True:
                head, sep, rest = bytes(self._buffers[n]).partition(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                if not sep or length is None or len(rest) < int(length.group(1)):
                    break
                del self._buffers[n][: len(head) + 4 + int(length.group(1))]
                self.requests[n] += 1
        return sum(self.requests)

    def send(self, n: int, data: bytes) -> None:
        """Write on the ``n``-th connection accepted."""
        self._connections[n].sendall(data)

    def close(self) -> None:
        """Close every socket."""
        for sock in self._connections + [self._listener]:
            sock.close()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FaultTestCase(TestCase):
    """
    A faulty upstream, relays in front of it, a non-persistent client, and
    the checks that nothing leaked.
    """

    async def setUp(self):
        # Twisted reserves a descriptor at the first listenTCP of the
        # process and opens a SIGCHLD pipe while the reactor runs: count
        # after both.
        await closed_port_url(reactor)
        # Files an earlier test left for the collector to close (a database
        # connection, a log file) are closed now, not in the middle of this one.
        gc.collect()
        self.fds_before = open_fds()
        self.upstream = FaultyUpstream(reactor)
        self.upstream_url = self.upstream.listen()
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.http = HTTPClient(Agent(reactor, pool=self.pool))
        self.relays = []
        self.raw_clients = []
        self.addCleanup(lambda: ensureDeferred(self.stop_all()))

    def start_relay(self, upstream_url: str | None = None, **settings) -> Relay:
        """Start a relay on 127.0.0.1 in front of the faulty upstream (or ``upstream_url``)."""
        config = RelayConfig(listen=(), upstreams=one_upstream(upstream_url or self.upstream_url), dump_dir=None)
        served = serve_relay(self, config.with_changes(**{**FAST, **settings}), reactor)
        self.relays.append(served.relay)
        self.relay = served.relay
        self.relay_port = served.port
        self.relay_url = served.url
        self.site = served.site
        return served.relay

    def post(self, body=None, headers=None, path="/v1/messages"):
        """POST a Messages body to the relay; fires with the unbuffered response."""
        data = body if isinstance(body, bytes) else encode(body if body is not None else messages_body(tools=False))
        all_headers = {"content-type": ["application/json"], "x-api-key": ["sk-test-client"]}
        all_headers.update(headers or {})
        return self.http.post(self.relay_url + path, data=data, headers=all_headers, unbuffered=True)

    def stream(self, **headers):
        """POST a streaming Messages request."""
        return self.post(messages_body(stream=True, tools=False), headers=headers or None)

    def raw(self, request: bytes, **options) -> RawClient:
        """Connect a :class:`RawClient` to the relay."""
        client = RawClient(request, reactor, **options)
        reactor.connectTCP("127.0.0.1", self.relay_port, ClientFactory.forProtocol(lambda: client))
        self.raw_clients.append(client)
        return client

    def raw_post(self, body: bytes | None = None) -> bytes:
        """The bytes of a whole HTTP/1.1 streaming POST to the relay."""
        body = body if body is not None else encode(messages_body(stream=True, tools=False))
        return (
            b"POST /v1/messages HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (len(body),)
        ) + body

    # -- what the client got ---------------------------------------------------

    async def error_of(self, response, status: int, error_type: str) -> dict:
        """Assert an Anthropic-shaped error answer; return its body."""
        raw = await treq.content(response)
        self.assertEqual(response.code, status, raw)
        self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])
        body = ujson.loads(raw)
        self.assertEqual(body["type"], "error")
        self.assertEqual(body["error"]["type"], error_type)
        self.assertIsInstance(body["error"]["message"], str)
        return body

    async def stream_error_of(self, response, error_type: str) -> tuple[bytes, dict]:
        """
        Assert a stream that began (200) and ended cleanly with one SSE
        ``error`` event of ``error_type`` as its last event; return the
        bytes before that event and the error payload.
        """
        self.assertEqual(response.code, 200)
        body = await treq.content(response)  # fails unless the chunked body ended properly
        events = sse(body)
        self.assertEqual(events[-1][0], "error", body[-300:])
        payload = events[-1][1]
        self.assertEqual(payload["type"], "error")
        self.assertEqual(payload["error"]["type"], error_type)
        self.assertIsInstance(payload["error"]["message"], str)
        self.assertEqual([name for name, _ in events].count("error"), 1)
        return body[: body.rindex(b"event: error")], payload

    def upstream_bytes(self, stream: Stream) -> bytes:
        """Everything a scripted stream writes."""
        return b"".join(piece for _, piece in stream.pieces)

    # -- nothing left open ---------------------------------------------------

    def idle_pooled(self) -> int:
        """Idle connections the relay's upstream pool holds (all others are busy)."""
        return sum(len(connections) for connections in self.relay.client._pool._connections.values())

    async def assert_clean(self) -> None:
        """
        Assert that no upstream request is in flight and that every open
        upstream connection is idle in the relay's pool; then stop
        everything and assert that no connection and no file descriptor
        is left.
        """
        await wait_for(lambda: not self.upstream.in_flight, timeout=3)
        await wait_for(lambda: self.upstream.open_connections == self.idle_pooled(), timeout=3)
        await self.stop_all()
        self.assertEqual(self.upstream.open_connections, 0)
        try:
            await wait_for(lambda: open_fds() <= self.fds_before, timeout=3)
        except AssertionError:
            pass
        self.assertEqual(open_fds(), self.fds_before)

    async def stop_all(self) -> None:
        """Stop relays (and their listeners), clients and the upstream; safe to call twice."""
        for client in self.raw_clients:
            if client.transport is not None and client.closed_at is None:
                client.abort()
        for relay in self.relays:
            if relay.service.running:
                await relay.service.stopService()
        await self.pool.closeCachedConnections()
        await self.upstream.stop()
        for client in self.raw_clients:
            if client.transport is not None:
                await client.done
        self.raw_clients = []


class UnreachableUpstreamTests(FaultTestCase):
    """
    An upstream that cannot be reached, or that drops the request, gets the
    client a clear Anthropic-shaped error before any stream begins.
    """

    async def test_refused(self):
        """A closed port is a 502 ``api_error`` naming the upstream."""
        dead = await closed_port_url(reactor)
        self.start_relay(dead)
        body = await self.error_of(await self.post(), 502, "api_error")
        self.assertIn(dead, body["error"]["message"])
        self.assertTrue(body["request_id"].startswith("rly_"))
        await self.assert_clean()

    async def test_reset_before_headers(self):
        """A connection reset before any header is a 502 ``api_error``, sent once without retries."""
        self.start_relay()
        self.upstream.script(Reset())
        body = await self.error_of(await self.post(), 502, "api_error")
        self.assertIn("closed the connection", body["error"]["message"])
        self.assertEqual(self.upstream.request_count, 1)
        await self.assert_clean()

    async def test_garbage_instead_of_http(self):
        """Bytes that are not HTTP, where a status line should be, are a 502 ``api_error``."""
        self.start_relay()
        self.upstream.script(RawBytes(b"\x00\xffthis is not HTTP\r\n\r\n"))
        await self.error_of(await self.post(), 502, "api_error")
        await self.assert_clean()

    async def test_no_headers_in_time(self):
        """
        An upstream that never answers is a 504 ``timeout_error`` after
        ``response_timeout``, and its connection is closed.
        """
        self.start_relay(response_timeout=0.3)
        self.upstream.script(Hang())
        started = reactor.seconds()
        await self.error_of(await self.post(), 504, "timeout_error")
        self.assertGreaterEqual(reactor.seconds() - started, 0.25)
        await wait_for(lambda: self.upstream.received[0].outcome == "lost", timeout=1)
        await self.assert_clean()

    async def test_headers_then_silence_in_a_stream(self):
        """
        An upstream that sends stream headers and then nothing ends the
        stream with an SSE ``timeout_error`` after ``idle_timeout``, and its
        connection is closed.
        """
        self.start_relay(idle_timeout=0.3)
        self.upstream.script(Hang(headers=True))
        before, _ = await self.stream_error_of(await self.stream(), "timeout_error")
        self.assertEqual(before, b"")
        await wait_for(lambda: self.upstream.received[0].outcome == "lost", timeout=1)
        await self.assert_clean()

    async def test_headers_then_silence_in_a_json_answer(self):
        """
        An upstream that sends the headers of a JSON answer and then
        nothing: with ``total_timeout`` set, the client still gets a 504
        ``timeout_error`` within it, and the upstream connection is closed.
        """
        self.start_relay(total_timeout=0.5, response_timeout=0.3)
        self.upstream.script(Hang(headers=True, content_type=b"application/json"))
        started = reactor.seconds()
        # A relay that never gives up leaves the client waiting: bound it.
        answer = ensureDeferred(self.whole_answer(self.post()))
        guard = reactor.callLater(3, answer.cancel)
        self.addCleanup(lambda: guard.active() and guard.cancel())
        try:
            status, raw = await answer
        except Exception as e:
            self.fail("no answer within 3 s (%s)" % (e.__class__.__name__,))
        self.assertLess(reactor.seconds() - started, 2)
        self.assertEqual(status, 504, raw)
        self.assertEqual(ujson.loads(raw)["error"]["type"], "timeout_error")
        await self.assert_clean()

    async def whole_answer(self, response_d) -> tuple[int, bytes]:
        """The status and body of a response."""
        response = await response_d
        return response.code, await treq.content(response)

    async def test_refused_connection_message(self):
        """A refused upstream connection is one sentence with one final period."""
        self.start_relay(await closed_port_url(reactor))
        body = await self.error_of(await self.post(), 502, "api_error")
        message = body["error"]["message"]
        self.assertIn("refused", message)
        self.assertNotIn("..", message)
        self.assertTrue(message.endswith("."), message)
        await self.stop_all()


class StreamFaultTests(FaultTestCase):
    """
    A failure after the stream began becomes one SSE ``error`` event and a
    clean end of the response; what the upstream sent before reaches the
    client intact.
    """

    async def test_cut_after_some_events(self):
        """The connection closed after three events: those three, then an ``api_error`` event."""
        self.start_relay()
        self.upstream.script(cut_after(3))
        before, payload = await self.stream_error_of(await self.stream(), "api_error")
        self.assertEqual(before, b"".join(sse_events()[:3]))
        self.assertIn("before message_stop", payload["error"]["message"])
        await self.assert_clean()

    async def test_reset_mid_stream(self):
        """A reset after three events: those three, then an ``api_error`` event."""
        self.start_relay()
        self.upstream.script(cut_after(3, how="abort"))
        before, _ = await self.stream_error_of(await self.stream(), "api_error")
        self.assertEqual(before, b"".join(sse_events()[:3]))
        await self.assert_clean()

    async def test_truncated_mid_event(self):
        """
        A stream cut in the middle of an event: the client never gets the
        half event, only the whole ones and an ``api_error`` event.
        """
        self.start_relay()
        self.upstream.script(truncated_mid_event(3))
        before, payload = await self.stream_error_of(await self.stream(), "api_error")
        self.assertEqual(before, b"".join(sse_events()[:3]))
        self.assertIn("middle of an event", payload["error"]["message"])
        await self.assert_clean()

    async def test_garbage_body(self):
        """
        A body of bytes that are not SSE (no event ever ends) becomes an
        ``api_error`` event when the upstream finishes; none of the garbage
        reaches the client.
        """
        self.start_relay()
        self.upstream.script(garbage_stream(b"\x00\xff\xfe garbage \x80\x81 no blank line" * 64))
        before, _ = await self.stream_error_of(await self.stream(), "api_error")
        self.assertEqual(before, b"")
        await self.assert_clean()

    async def test_invalid_sse_passes_through(self):
        """
        Events the relay cannot read (a ``content_block_start`` whose data
        is not JSON, an event with no name, comments) pass through byte for
        byte; the stream ends normally at ``message_stop``.
        """
        self.start_relay()
        events = sse_events()
        odd = [
            events[0],
            b"event: content_block_start\ndata: {not json\n\n",
            b": a comment line\n\n",
            b"data: an event with no name\n\n",
            b"event: content_block_start\ndata: [1, 2, 3]\n\n",
            b"event: content_block_start\ndata: {\"content_block\": \"a string\"}\n\n",
            events[-1],
        ]
        stream = Stream([(0.0, event) for event in odd])
        self.upstream.script(stream)
        response = await self.stream()
        self.assertEqual(response.code, 200)
        self.assertEqual(await treq.content(response), self.upstream_bytes(stream))
        await self.assert_clean()

    async def test_oversized_event(self):
        """
        An event over the relay's 8 MiB limit: the events before it, then an
        ``api_error`` event; the relay hangs up on the upstream instead of
        buffering more.
        """
        self.start_relay()
        self.upstream.script(oversized_event(9 * 1024 * 1024, before=2, pause=30.0))
        before, payload = await self.stream_error_of(await self.stream(), "api_error")
        self.assertEqual(before, b"".join(sse_events()[:2]))
        self.assertIn("larger than", payload["error"]["message"])
        await wait_for(lambda: self.upstream.received[0].outcome == "lost", timeout=2)
        await self.assert_clean()

    async def test_silence_under_idle_timeout_gets_pings(self):
        """
        An upstream silent for longer than ``ping_interval`` (but not
        ``idle_timeout``): the relay sends its own ``ping`` events meanwhile,
        between whole events, and the stream completes intact.
        """
        self.start_relay(ping_interval=0.1, idle_timeout=2.0)
        stream = silent_mid_stream(0.55, after=3)
        self.upstream.script(stream)
        response = await self.stream()
        body = await treq.content(response)
        ping = b'event: ping\ndata: {"type": "ping"}\n\n'
        self.assertGreaterEqual(body.count(ping), 3)
        self.assertEqual(body.replace(ping, b""), self.upstream_bytes(stream))
        self.assertEqual([name for name, _ in sse(body)][-1], "message_stop")
        await self.assert_clean()

    async def test_silence_over_idle_timeout(self):
        """
        An upstream silent for longer than ``idle_timeout`` mid-stream: the
        events so far, then a ``timeout_error`` event, and the upstream's
        connection is closed.
        """
        self.start_relay(idle_timeout=0.3)
        self.upstream.script(silent_mid_stream(5.0, after=3))
        started = reactor.seconds()
        before, _ = await self.stream_error_of(await self.stream(), "timeout_error")
        self.assertLess(reactor.seconds() - started, 2)
        self.assertEqual(before, b"".join(sse_events()[:3]))
        await wait_for(lambda: self.upstream.received[0].outcome == "lost", timeout=1)
        await self.assert_clean()

    async def test_slow_trickle(self):
        """
        An upstream that trickles a few bytes at a time, each gap under
        ``idle_timeout`` but the whole stream longer: the stream arrives
        intact, byte for byte.
        """
        self.start_relay(idle_timeout=0.25)
        stream = trickle(48, 0.01)
        self.upstream.script(stream)
        started = reactor.seconds()
        response = await self.stream()
        body = await treq.content(response)
        self.assertGreater(reactor.seconds() - started, 0.25)
        self.assertEqual(body, self.upstream_bytes(stream))
        await self.assert_clean()


class UpstreamErrorTests(FaultTestCase):
    """Upstream error answers reach the client byte for byte, headers included."""

    async def test_server_errors_pass_through(self):
        """
        500, 503 and 529, with and without ``retry-after``, pass through
        unchanged when retries are off; each is sent upstream once.
        """
        self.start_relay()
        cases = [
            (500, "api_error", None),
            (503, "overloaded_error", None),
            (529, "overloaded_error", None),
            (500, "api_error", "3"),
            (503, "overloaded_error", "7"),
            (529, "overloaded_error", "1"),
        ]
        for status, error_type, retry_after in cases:
            answer = error_answer(status, error_type, "Upstream %d" % (status,), retry_after=retry_after)
            self.upstream.script(answer)
            response = await self.post()
            self.assertEqual(response.code, status)
            self.assertEqual(await treq.content(response), answer.body)
            expected = None if retry_after is None else [retry_after.encode()]
            self.assertEqual(response.headers.getRawHeaders(b"retry-after"), expected)
        self.assertEqual(self.upstream.request_count, len(cases))
        await self.assert_clean()

    async def test_bad_request_passes_through_and_is_never_retried(self):
        """A 400 passes through byte for byte and is sent once, even with retries on."""
        self.start_relay(retries=3)
        answer = error_answer(400, "invalid_request_error", "messages.0: bad")
        self.upstream.script(answer)
        response = await self.post()
        self.assertEqual(response.code, 400)
        self.assertEqual(await treq.content(response), answer.body)
        self.assertEqual(self.upstream.request_count, 1)
        await self.assert_clean()


    async def test_unreadable_retry_after_passes_through(self):
        """An upstream error whose ``retry-after`` is a date past any clock reaches the client as sent."""
        self.start_relay(retries=2)
        # The 400 is sent once; the 503 is retried twice (no wait can be read: the backoff's).
        for status, error_type, sent in ((400, "invalid_request_error", 1), (503, "overloaded_error", 3)):
            answer = error_answer(status, error_type, retry_after="1 Jan 99999999999 00:00:00")
            self.upstream.script(*[answer] * sent)
            response = await self.post()
            self.assertEqual(response.code, status)
            self.assertEqual(await treq.content(response), answer.body)
        await self.assert_clean()


class RetryTests(FaultTestCase):
    """
    With ``retries``, failures before any byte reached the client are sent
    again; nothing else is.
    """

    async def test_overloaded_then_ok(self):
        """
        A 529 without ``retry-after`` and then a 200: the client gets the
        200, after the relay's default pause (half a second).
        """
        self.start_relay(retries=1)
        self.upstream.script(error_answer(529, "overloaded_error"), Answer())
        response = await self.post()
        self.assertEqual(response.code, 200)
        self.assertEqual(ujson.loads(await treq.content(response))["type"], "message")
        self.assertEqual(self.upstream.request_count, 2)
        gap = self.upstream.received[1].at - self.upstream.received[0].at
        self.assertTrue(0.4 <= gap < 2.0, gap)
        await self.assert_clean()

    async def test_retry_after_honoured(self):
        """A ``retry-after: 1`` makes the relay wait about a second before sending again."""
        self.start_relay(retries=1)
        self.upstream.script(error_answer(529, "overloaded_error", retry_after="1"), complete_stream())
        response = await self.stream()
        self.assertEqual(response.code, 200)
        self.assertEqual(sse(await treq.content(response))[-1][0], "message_stop")
        gap = self.upstream.received[1].at - self.upstream.received[0].at
        self.assertTrue(0.9 <= gap < 2.5, gap)
        await self.assert_clean()

    async def test_retry_after_ms_honoured(self):
        """A ``retry-after-ms`` wins over ``retry-after``: 30 ms, not 10 s."""
        self.start_relay(retries=1)
        self.upstream.script(
            error_answer(503, "overloaded_error", retry_after="10", retry_after_ms="30"), Answer()
        )
        response = await self.post()
        self.assertEqual(response.code, 200)
        await treq.content(response)
        gap = self.upstream.received[1].at - self.upstream.received[0].at
        self.assertTrue(0.02 <= gap < 0.5, gap)
        await self.assert_clean()

    async def test_retry_after_too_long_is_passed_on(self):
        """
        A ``retry-after`` over ``max_retry_wait`` is not waited out: the
        client gets the 529 and its ``retry-after`` at once.
        """
        self.start_relay(retries=2, max_retry_wait=0.5)
        answer = error_answer(529, "overloaded_error", retry_after="30")
        self.upstream.script(answer)
        response = await self.post()
        self.assertEqual(response.code, 529)
        self.assertEqual(response.headers.getRawHeaders(b"retry-after"), [b"30"])
        self.assertEqual(await treq.content(response), answer.body)
        self.assertEqual(self.upstream.request_count, 1)
        await self.assert_clean()

    async def test_retries_exhausted(self):
        """After ``retries`` more attempts the last upstream error passes through."""
        self.start_relay(retries=2)
        answers = [error_answer(503, "overloaded_error", "try %d" % (n,), retry_after_ms="10") for n in range(3)]
        self.upstream.script(*answers)
        response = await self.post()
        self.assertEqual(response.code, 503)
        self.assertEqual(await treq.content(response), answers[-1].body)
        self.assertEqual(self.upstream.request_count, 3)
        metrics = await treq.content(await self.http.get(self.relay_url + "/metrics"))
        self.assertIn(b"relay_upstream_retries_total 2.0", metrics)
        await self.assert_clean()

    async def test_reset_then_ok(self):
        """A connection reset before any header is a connection failure: sent again, and the client gets 200."""
        self.start_relay(retries=1)
        self.upstream.script(Reset(), Answer())
        response = await self.post()
        self.assertEqual(response.code, 200)
        await treq.content(response)
        self.assertEqual(self.upstream.request_count, 2)
        await self.assert_clean()

    async def test_bad_request_never_retried_even_if_listed(self):
        """
        A 400 will fail again: the relay never sends it twice, even when an
        embedding application lists 400 in ``retry_statuses``.
        """
        self.start_relay(retries=2, retry_statuses=(400, 529))
        answer = error_answer(400, "invalid_request_error", retry_after_ms="10")
        self.upstream.script(answer, answer, answer)
        response = await self.post()
        self.assertEqual(response.code, 400)
        self.assertEqual(await treq.content(response), answer.body)
        self.assertEqual(self.upstream.request_count, 1)
        await self.assert_clean()

    async def test_no_retry_after_first_byte(self):
        """
        A stream cut after it began is never sent again, whatever
        ``retries`` says: the client gets the events and an error event.
        """
        self.start_relay(retries=3)
        self.upstream.script(cut_after(2), complete_stream())
        await self.stream_error_of(await self.stream(), "api_error")
        await sleep(0.1)
        self.assertEqual(self.upstream.request_count, 1)
        await self.assert_clean()

    async def test_client_gone_during_retry_pause(self):
        """A client that hangs up while the relay waits to retry: the retry is never sent."""
        self.start_relay(retries=1)
        self.upstream.script(error_answer(529, "overloaded_error", retry_after="1"))
        client = self.raw(self.raw_post())
        await wait_for(lambda: self.upstream.request_count == 1)
        await sleep(0.1)
        client.abort()
        await client.done
        await sleep(1.3)
        self.assertEqual(self.upstream.request_count, 1)
        await self.assert_clean()


class ClientDisconnectTests(FaultTestCase):
    """A client that goes away cancels its upstream request at once."""

    async def test_disconnect_before_headers(self):
        """
        The client hangs up while the upstream has not answered: the
        upstream sees its connection closed promptly.
        """
        self.start_relay()
        self.upstream.script(Hang())
        client = self.raw(self.raw_post())
        await wait_for(lambda: self.upstream.request_count == 1)
        client.abort()
        gone = reactor.seconds()
        await wait_for(lambda: self.upstream.received[0].outcome == "lost", timeout=1)
        self.assertLess(self.upstream.received[0].ended_at - gone, 0.5)
        await self.assert_clean()

    async def test_disconnect_while_connecting_upstream(self):
        """
        The client hangs up while the relay is still connecting to the
        upstream: that is a client gone (499), not an upstream failure,
        and the connection attempt is dropped.
        """
        # A listener that never accepts, its backlog already full: a
        # connection attempt to it hangs.
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        fillers = []
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(listener.getsockname())
            fillers.append(filler)
        self.start_relay("http://127.0.0.1:%d" % (listener.getsockname()[1],), connect_timeout=5)
        client = self.raw(self.raw_post())
        await sleep(0.3)
        client.abort()
        await client.done
        await wait_for(lambda: not self.relay.app.requests.active, timeout=1)
        metrics = await treq.content(await self.http.get(self.relay_url + "/metrics"))
        self.assertIn(b'relay_requests_total{route="messages",status="499"} 1.0', metrics)
        self.assertNotIn(b"relay_upstream_failures_total{", metrics)
        for sock in fillers + [listener]:
            sock.close()
        await self.assert_clean()

    # Known relay bug, open in issue 5's note: when the client hangs up in
    # the reactor turn in which its stream ends, the closing upstream
    # connection goes back to the pool and the next request is cut.
    async def test_client_gone_as_its_stream_ends(self):
        """
        A client that hangs up in the very reactor turn in which the last
        bytes of its stream arrive: the relay closes that upstream
        connection, and must not also put it back in its pool, where the
        next request would be written on it and then cut (a 502 "closed the
        connection before answering" for an innocent request).
        """
        upstream = _RawUpstream()
        self.addCleanup(upstream.close)
        self.start_relay(upstream.url)
        events = sse_events()
        first = socket.create_connection(("127.0.0.1", self.relay_port))
        self.addCleanup(first.close)
        first.sendall(self.raw_post())
        await wait_for(lambda: upstream.poll() == 1)
        upstream.send(0, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        upstream.send(0, b"".join(_chunk(event) for event in events[:-1]))
        first.setblocking(False)

        def first_got_bytes() -> bool:
            try:
                return bool(first.recv(65536))
            except BlockingIOError:
                return False

        await wait_for(first_got_bytes)
        second = socket.create_connection(("127.0.0.1", self.relay_port))
        self.addCleanup(second.close)
        await sleep(0.1)
        # Without letting the reactor run: the client hangs up, its stream
        # ends, and the next request comes, so that the relay's next turn
        # sees all three at once, in that order.
        first.close()
        time.sleep(0.02)
        upstream.send(0, _chunk(events[-1]) + b"0\r\n\r\n")
        time.sleep(0.02)
        second.sendall(self.raw_post(encode(messages_body(tools=False))))
        time.sleep(0.02)
        await wait_for(lambda: upstream.poll() == 2, timeout=3)
        self.assertEqual(upstream.requests[0], 1, "the next request was written on a connection being closed")
        answer = ujson.dumps(message_json()).encode()
        upstream.send(1, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(answer), answer))
        second.setblocking(False)
        answered = bytearray()

        def second_answered() -> bool:
            try:
                answered.extend(second.recv(65536))
            except BlockingIOError:
                pass
            return parse_response(bytes(answered)).complete

        await wait_for(second_answered)
        self.assertEqual(parse_response(bytes(answered)).status, 200)
        second.close()
        await wait_for(lambda: not self.relay.app.requests.active, timeout=1)
        # The pool's idle connections go to this upstream, not the usual one.
        await self.relay.client.close()
        upstream.close()
        await self.assert_clean()

    async def test_disconnect_while_sending_the_body(self):
        """
        The client hangs up half-way through its body: nothing is sent
        upstream, and the relay keeps nothing open.
        """
        self.start_relay()
        request = self.raw_post()
        client = self.raw(request, send_only=len(request) - 20)
        await sleep(0.1)
        client.abort()
        await client.done
        await sleep(0.1)
        self.assertEqual(self.upstream.request_count, 0)
        await self.assert_clean()

    async def test_disconnect_mid_stream(self):
        """
        The client hangs up after the first events of a stream the
        upstream is still sending: the upstream sees its connection closed
        promptly.
        """
        self.start_relay()
        self.upstream.script(complete_stream(deltas=50, delay=0.05))
        client = self.raw(self.raw_post(), abort_after=400)
        await client.done
        gone = reactor.seconds()
        self.assertIn(b"event: message_start", client.received)
        await wait_for(lambda: self.upstream.received[0].outcome == "lost", timeout=1)
        self.assertLess(self.upstream.received[0].ended_at - gone, 0.5)
        await self.assert_clean()


class RelayKeyTests(FaultTestCase):
    """Relay keys keep strangers out, and never travel upstream."""

    async def test_relay_keys(self):
        """
        No key or a wrong key is a 401 ``authentication_error`` that never
        reaches the upstream; the right key, in ``x-api-key`` or as a
        bearer token, is let through and replaced by the upstream key.
        """
        self.start_relay(relay_keys=(RELAY_KEY,), upstreams=one_upstream(self.upstream_url, key=UPSTREAM_KEY))
        for headers in (
            {"x-api-key": [""]},
            {"x-api-key": ["rk-wrong"]},
            {"x-api-key": [RELAY_KEY + "x"]},
            {"authorization": ["Bearer rk-wrong"]},
            {"authorization": ["Basic " + RELAY_KEY]},
        ):
            body = await self.error_of(await self.post(headers=headers), 401, "authentication_error")
            self.assertNotIn(RELAY_KEY, ujson.dumps(body))
        self.assertEqual(self.upstream.request_count, 0)
        for headers in (
            {"x-api-key": [RELAY_KEY]},
            {"x-api-key": ["sk-other"], "authorization": ["Bearer " + RELAY_KEY]},
        ):
            response = await self.post(headers=headers)
            self.assertEqual(response.code, 200)
            await treq.content(response)
        self.assertEqual(self.upstream.request_count, 2)
        for record in self.upstream.received:
            self.assertEqual(record.header(b"x-api-key"), [UPSTREAM_KEY.encode()])
            self.assertEqual(record.header(b"authorization"), [])
            self.assertNotIn(RELAY_KEY.encode(), repr(record.headers).encode() + record.body)
        await self.assert_clean()

    async def test_relay_key_stripped_without_upstream_key(self):
        """Without an upstream key, a relay key is stripped, not forwarded as the client's credential."""
        self.start_relay(relay_keys=(RELAY_KEY,))
        response = await self.post(headers={"x-api-key": [RELAY_KEY]})
        self.assertEqual(response.code, 200)
        await treq.content(response)
        record = self.upstream.received[0]
        self.assertEqual(record.header(b"x-api-key"), [])
        self.assertNotIn(RELAY_KEY.encode(), repr(record.headers).encode())
        await self.assert_clean()


class ConcurrencyLimitTests(FaultTestCase):
    """Past ``max_concurrent`` the relay refuses at once, and frees the slot when a request ends."""

    async def test_over_the_limit(self):
        """
        With one request in flight and ``max_concurrent=1``, the next gets a
        529 ``overloaded_error`` without reaching the upstream; once the
        first is gone, a new one is served.
        """
        self.start_relay(max_concurrent=1)
        self.upstream.script(Hang(headers=True))
        first = self.raw(self.raw_post())
        await wait_for(lambda: first.received)
        self.assertEqual(parse_response(bytes(first.received)).status, 200)
        await self.error_of(await self.post(), 529, "overloaded_error")
        self.assertEqual(self.upstream.request_count, 1)
        first.abort()
        await wait_for(lambda: self.upstream.received[0].outcome == "lost", timeout=1)
        await wait_for(lambda: not self.relay.app.requests.active, timeout=1)
        response = await self.post()
        self.assertEqual(response.code, 200)
        await treq.content(response)
        await self.assert_clean()


class SlowClientTests(FaultTestCase):
    """A client that takes too long to send its request is answered 408 and cut."""

    async def check_slow(self, client: RawClient, timeout: float) -> None:
        started = reactor.seconds()
        raw = await client.done
        self.assertLess(client.closed_at - started, timeout + 1.0)
        response = parse_response(raw)
        self.assertEqual(response.status, 408)
        body = ujson.loads(response.body)
        self.assertEqual(body["type"], "error")
        self.assertEqual(body["error"]["type"], "timeout_error")
        # A slow client may well be faster next time (docs/gateway.md).
        self.assertEqual(response.header(b"x-should-retry"), b"true")
        self.assertEqual(self.upstream.request_count, 0)
        await self.assert_clean()

    async def test_trickled_headers(self):
        """Headers sent a byte every 50 ms (slowloris): 408 ``timeout_error`` after ``request_read_timeout``."""
        self.start_relay(request_read_timeout=0.3)
        client = self.raw(self.raw_post(), trickle=(1, 0.05))
        await self.check_slow(client, 0.3)

    async def test_trickled_body(self):
        """A body sent ten bytes every 50 ms: 408 ``timeout_error`` after ``request_read_timeout``."""
        self.start_relay(request_read_timeout=0.3)
        request = self.raw_post()
        head = request.index(b"\r\n\r\n") + 4
        client = self.raw(request[:head])
        client.trickle = (10, 0.05)
        client.request = request
        await self.check_slow(client, 0.3)

    async def test_silent_connection(self):
        """
        A client that connects and sends nothing at all is cut after
        ``request_read_timeout`` too, not left holding a connection.
        """
        self.start_relay(request_read_timeout=0.3)
        client = self.raw(b"")
        started = reactor.seconds()
        done = client.done
        guard = reactor.callLater(3, lambda: client.closed_at is None and client.abort())
        self.addCleanup(lambda: guard.active() and guard.cancel())
        await done
        self.assertLess(client.closed_at - started, 1.5, "connection still open after 1.5 s")
        await self.assert_clean()


class TotalTimeoutTests(FaultTestCase):
    """``total_timeout`` bounds a whole request, stream included."""

    async def test_stream_over_total_timeout(self):
        """
        A stream still going at ``total_timeout``: the events so far, then a
        ``timeout_error`` event, and the upstream connection is closed.
        """
        self.start_relay(total_timeout=0.4)
        self.upstream.script(complete_stream(deltas=40, delay=0.05))
        started = reactor.seconds()
        before, payload = await self.stream_error_of(await self.stream(), "timeout_error")
        self.assertLess(reactor.seconds() - started, 1.5)
        self.assertIn(b"event: message_start", before)
        self.assertIn("longer than", payload["error"]["message"])
        await wait_for(lambda: self.upstream.received[0].outcome == "lost", timeout=1)
        await self.assert_clean()

    async def test_no_headers_within_total_timeout(self):
        """An upstream that does not answer within ``total_timeout`` (shorter than ``response_timeout``) is a 504."""
        self.start_relay(total_timeout=0.3, response_timeout=5)
        self.upstream.script(Hang())
        started = reactor.seconds()
        await self.error_of(await self.post(), 504, "timeout_error")
        self.assertLess(reactor.seconds() - started, 1.5)
        await self.assert_clean()


class ShutdownTests(FaultTestCase):
    """Stopping the relay lets streams in flight finish within ``shutdown_grace``, and no longer."""

    async def test_stream_finishes_within_grace(self):
        """
        A stream in flight when the relay is told to stop completes; while
        it drains (still accepting for its drain delay), ``/ready`` says
        503, and a new request is served with ``Connection: close`` (a load
        balancer does not resend a refused POST); the stop completes when
        the stream ends.
        """
        self.start_relay(shutdown_grace=3.0, drain_delay=1.0)
        stream = complete_stream(deltas=10, delay=0.05)
        self.upstream.script(stream)
        response = await self.stream()
        self.assertEqual(response.code, 200)
        stopped = self.relay.service.stopService()
        ready = await self.http.get(self.relay_url + "/ready")
        self.assertEqual(ready.code, 503)
        self.assertEqual(ujson.loads(await treq.content(ready))["status"], "draining")
        late = await self.post()
        # (Twisted's client keeps Connection out of response.headers; test_drain reads it.)
        self.assertEqual(late.code, 200)
        await treq.content(late)
        body = await treq.content(response)
        self.assertEqual(body, self.upstream_bytes(stream))
        await stopped
        self.assertEqual(self.upstream.request_count, 2)
        await self.assert_clean()

    async def test_stream_cut_after_grace(self):
        """
        A stream still going when ``shutdown_grace`` is over is cut: the
        client's response ends incomplete, the upstream connection is
        closed, and the stop completes soon after the grace.
        """
        self.start_relay(shutdown_grace=0.3, idle_timeout=10)
        self.upstream.script(silent_mid_stream(30.0, after=2))
        response = await self.stream()
        self.assertEqual(response.code, 200)
        started = reactor.seconds()
        await self.relay.service.stopService()
        self.assertTrue(0.25 <= reactor.seconds() - started < 1.5)
        with self.assertRaises(ResponseFailed):
            await treq.content(response)
        await wait_for(lambda: self.upstream.received[0].outcome == "lost", timeout=1)
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
