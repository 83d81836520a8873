"""
Tests of what is about the network, on real sockets on 127.0.0.1: streaming
is incremental (whole events pass, only the event still arriving is held),
flow control reaches the upstream, unreachable upstreams.
"""

from __future__ import annotations

import ujson
import treq
from twisted.internet import defer, reactor
from twisted.internet.protocol import ClientFactory, Protocol
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted_relay._twisted import TwistedChunkedDecoder
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site
from zope.interface import implementer
from twisted.internet.interfaces import IPushProducer

from twisted_relay.config import RelayConfig, one_upstream

from tests.faulty_upstream import Stream, parse_response, sse_events
from tests.helpers import encode, messages_body, readme, serve_relay
from tests.test_faults import FaultTestCase, sleep

MESSAGE_START = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
    b'"role":"assistant","content":[],"model":"m","stop_reason":null,"stop_sequence":null,'
    b'"usage":{"input_tokens":1,"output_tokens":1}}}\n\n'
)
REST = (
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hello"}}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn",'
    b'"stop_sequence":null},"usage":{"output_tokens":2}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)
DELTA = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"' + b"x" * 60 + b'"}}\n\n'
)


async def wait_for(condition, timeout=10.0, step=0.01):
    """Wait on the reactor until ``condition()`` holds; fail after ``timeout``."""
    waited = 0.0
    while not condition():
        if waited >= timeout:
            raise AssertionError("condition not met within %s s" % (timeout,))
        await deferLater(reactor, step, lambda: None)
        waited += step


class ManualStream(Resource):
    """An SSE upstream that the test drives by hand."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.requests = []

    def render(self, request):
        request.setHeader(b"content-type", b"text/event-stream")
        self.requests.append(request)
        return NOT_DONE_YET


@implementer(IPushProducer)
class FloodingProducer:
    """Writes SSE events to a request as fast as it may, up to a total."""

    def __init__(self, request, total: int):
        self.request = request
        self.total = total
        self.produced = 0
        self.paused = False
        self.pauses = 0
        self.produced_at_first_pause = None
        self.finished = False
        self._chunk = DELTA * 512

    def start(self):
        self.request.registerProducer(self, True)
        self.request.write(MESSAGE_START)
        self._schedule()

    def _schedule(self):
        reactor.callLater(0, self._write_some)

    def _write_some(self):
        if self.finished or self.paused:
            return
        for _ in range(8):
            if self.paused or self.produced >= self.total:
                break
            self.request.write(self._chunk)
            self.produced += len(self._chunk)
        if self.produced >= self.total:
            self.finished = True
            self.request.unregisterProducer()
            self.request.write(REST)
            self.request.finish()
        elif not self.paused:
            self._schedule()

    def pauseProducing(self):
        if not self.paused:
            self.pauses += 1
            if self.produced_at_first_pause is None:
                self.produced_at_first_pause = self.produced
        self.paused = True

    def resumeProducing(self):
        if self.paused:
            self.paused = False
            self._schedule()

    def stopProducing(self):
        self.finished = True


class FloodingStream(Resource):
    isLeaf = True

    def __init__(self, total):
        super().__init__()
        self.total = total
        self.producers = []

    def render(self, request):
        request.setHeader(b"content-type", b"text/event-stream")
        producer = FloodingProducer(request, self.total)
        self.producers.append(producer)
        producer.start()
        return NOT_DONE_YET


class RawClient(Protocol):
    """An HTTP/1.1 client that can stop reading, as a slow client does."""

    def __init__(self, request: bytes):
        self.request = request
        self.received = bytearray()
        self.done = defer.Deferred()

    def connectionMade(self):
        self.transport.write(self.request)

    def dataReceived(self, data):
        self.received += data

    def connectionLost(self, reason):
        self.done.callback(bytes(self.received))


class NetworkTestMixin:
    def serve(self, resource) -> str:
        port = reactor.listenTCP(0, Site(resource), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return "http://127.0.0.1:%d" % (port.getHost().port,)

    def start_relay(self, upstream_url: str, **settings) -> str:
        config = RelayConfig(listen=(), upstreams=one_upstream(upstream_url), dump_dir=None)
        return serve_relay(self, config.with_changes(**settings), reactor).url


class IncrementalStreamingTests(NetworkTestMixin, TestCase):
    """
    Each event reaches the client as soon as the upstream sends it.
    """

    async def test_first_event_before_upstream_finishes(self):
        """
        The client has ``message_start`` while the upstream has not sent
        anything more: the relay does not buffer the stream.
        """
        upstream = ManualStream()
        relay_url = self.start_relay(self.serve(upstream))
        response_d = treq.post(
            relay_url + "/v1/messages",
            data=encode(messages_body(stream=True, tools=False)),
            headers={"content-type": ["application/json"]},
            unbuffered=True,
            persistent=False,
        )
        await wait_for(lambda: upstream.requests)
        upstream.requests[0].write(MESSAGE_START)
        response = await response_d
        self.assertEqual(response.code, 200)
        received = []
        collected = treq.collect(response, received.append)
        await wait_for(lambda: b"".join(received) == MESSAGE_START)
        self.assertFalse(collected.called)
        upstream.requests[0].write(REST)
        upstream.requests[0].finish()
        await collected
        self.assertEqual(b"".join(received), MESSAGE_START + REST)


class FlowControlTests(NetworkTestMixin, TestCase):
    """
    A slow client slows the upstream down: the relay never buffers a fast
    upstream without bound.
    """

    async def test_paused_client_pauses_upstream(self):
        """
        When the client stops reading, the upstream's writes are paused
        (through the relay's gate) long before the whole stream is produced;
        when the client reads again, the stream completes intact.
        """
        total = 96 * 1024 * 1024
        upstream = FloodingStream(total)
        relay_url = self.start_relay(self.serve(upstream))
        port = int(relay_url.rsplit(":", 1)[1])
        body = encode(messages_body(stream=True, tools=False))
        request = (
            b"POST /v1/messages HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (len(body),)
        ) + body
        client = RawClient(request)
        factory = ClientFactory.forProtocol(lambda: client)
        reactor.connectTCP("127.0.0.1", port, factory)
        await wait_for(lambda: len(client.received) > 0)
        client.transport.pauseProducing()
        await wait_for(lambda: upstream.producers and upstream.producers[0].paused, timeout=30)
        producer = upstream.producers[0]
        # Kernel socket buffers on two loopback hops hold some megabytes;
        # the relay itself holds no more than its transport's buffer.
        self.assertLess(producer.produced_at_first_pause, total // 2)
        self.assertFalse(producer.finished)
        client.transport.resumeProducing()
        raw = await client.done
        self.assertTrue(producer.finished)
        self.assertGreaterEqual(producer.pauses, 1)
        self.assertIn(b"event: message_stop", raw[-200:])
        # Every delta the upstream produced arrived (chunked framing aside).
        self.assertEqual(raw.count(b"event: content_block_delta"), producer.produced // len(DELTA) + 1)
        # Byte for byte, once Twisted's own decoder has removed the framing:
        # writes cut anywhere by a full socket lose and repeat nothing.
        head, _, framed = raw.partition(b"\r\n\r\n")
        self.assertIn(b"Transfer-Encoding: chunked", head)
        decoded, ended = [], []
        decoder = TwistedChunkedDecoder(decoded.append, ended.append)
        decoder.dataReceived(framed)
        self.assertEqual(ended, [b""])
        self.assertEqual(b"".join(decoded), MESSAGE_START + DELTA * (producer.produced // len(DELTA)) + REST)


class _BigAnswer(Resource):
    """An upstream whose JSON answer is large."""

    isLeaf = True

    def __init__(self, body: bytes):
        super().__init__()
        self.body = body

    def render(self, request):
        request.setHeader(b"content-type", b"application/json")
        return self.body


class LargeWriteTests(NetworkTestMixin, TestCase):
    """
    The relay sends what it can at once and buffers the rest: an answer far
    larger than the socket buffers reaches a client that stops reading for
    a while byte for byte.
    """

    async def test_large_answer_to_a_pausing_client(self):
        text = "".join(chr(0x41 + i % 26) for i in range(12 * 1024 * 1024))
        answer = ujson.dumps(
            {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
             "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
             "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
        ).encode()
        relay_url = self.start_relay(self.serve(_BigAnswer(answer)))
        port = int(relay_url.rsplit(":", 1)[1])
        body = encode(messages_body(tools=False))
        request = (
            b"POST /v1/messages HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (len(body),)
        ) + body
        client = RawClient(request)
        reactor.connectTCP("127.0.0.1", port, ClientFactory.forProtocol(lambda: client))
        await wait_for(lambda: len(client.received) > 0)
        client.transport.pauseProducing()
        await deferLater(reactor, 0.3, lambda: None)
        client.transport.resumeProducing()
        raw = await client.done
        head, _, received_body = raw.partition(b"\r\n\r\n")
        self.assertIn(b"Content-Length: %d" % (len(answer),), head)
        self.assertEqual(received_body, answer)


class UnreachableUpstreamTests(NetworkTestMixin, TestCase):
    """
    An upstream that cannot be reached gets the client a clear 502.
    """

    async def test_connection_refused(self):
        """
        A refused connection is a 502 ``api_error`` naming the upstream.
        """
        port = reactor.listenTCP(0, Site(Resource()), interface="127.0.0.1")
        dead_url = "http://127.0.0.1:%d" % (port.getHost().port,)
        await port.stopListening()
        relay_url = self.start_relay(dead_url)
        response = await treq.post(
            relay_url + "/v1/messages",
            data=encode(messages_body()),
            headers={"content-type": ["application/json"]},
            persistent=False,
        )
        self.assertEqual(response.code, 502)
        body = ujson.loads(await response.content())
        self.assertEqual(body["error"]["type"], "api_error")
        self.assertIn(dead_url, body["error"]["message"])


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
