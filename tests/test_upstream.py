"""
Tests for the header rules between client, relay and upstream.
"""

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from twisted_relay.upstream import UpstreamClient
from twisted_relay.upstream_headers import client_response_headers, upstream_request_headers


def headers(**pairs):
    h = Headers()
    for name, value in pairs.items():
        h.addRawHeader(name.replace("_", "-").encode(), value.encode())
    return h


class UpstreamRequestHeadersTests(SynchronousTestCase):
    """
    What the upstream receives of the client's headers.
    """

    def test_end_to_end_headers_pass_verbatim(self):
        """
        ``anthropic-*``, ``x-claude-code-*``, ``user-agent``, ``content-type``,
        the SDK's telemetry and custom headers pass through unchanged.
        """
        client = headers(
            anthropic_version="2023-06-01",
            anthropic_beta="a,b,c",
            anthropic_dangerous_direct_browser_access="true",
            x_claude_code_session_id="sess-1",
            x_app="cli",
            user_agent="claude-cli/2.0 (external, cli)",
            content_type="application/json",
            x_stainless_lang="python",
            x_custom="kept",
        )
        sent = upstream_request_headers(client, None)
        for name, values in client.getAllRawHeaders():
            self.assertEqual(sent.getRawHeaders(name), values, name)

    def test_hop_by_hop_dropped(self):
        """
        Hop-by-hop headers, those named in ``Connection``, ``host``,
        ``content-length`` and ``accept-encoding`` are not forwarded: the
        relay sets its own and must read uncompressed bytes.
        """
        client = headers(
            connection="keep-alive, x-private-hop",
            keep_alive="timeout=5",
            x_private_hop="secret-hop",
            transfer_encoding="chunked",
            te="trailers",
            upgrade="h2c",
            proxy_authorization="Basic abc",
            host="relay.local",
            content_length="12",
            accept_encoding="gzip",
            anthropic_version="2023-06-01",
        )
        sent = upstream_request_headers(client, None)
        self.assertEqual(
            [name for name, _ in sent.getAllRawHeaders()], [b"Anthropic-Version"]
        )

    def test_client_credentials_pass_through_without_upstream_key(self):
        """
        With no upstream key configured the client's own ``x-api-key`` and
        ``Authorization`` reach the upstream untouched.
        """
        client = headers(x_api_key="sk-client", authorization="Bearer tok")
        sent = upstream_request_headers(client, None)
        self.assertEqual(sent.getRawHeaders(b"x-api-key"), [b"sk-client"])
        self.assertEqual(sent.getRawHeaders(b"authorization"), [b"Bearer tok"])

    def test_upstream_key_replaces_client_credentials(self):
        """
        With an upstream key, the client's credentials are removed and the
        relay's key is sent as ``x-api-key``.
        """
        client = headers(x_api_key="sk-client", authorization="Bearer tok")
        sent = upstream_request_headers(client, "sk-upstream")
        self.assertEqual(sent.getRawHeaders(b"x-api-key"), [b"sk-upstream"])
        self.assertIsNone(sent.getRawHeaders(b"authorization"))


class ClientResponseHeadersTests(SynchronousTestCase):
    """
    What the client receives of the upstream's response headers.
    """

    def test_anthropic_headers_returned(self):
        """
        ``request-id``, rate-limit headers, ``retry-after`` and
        ``x-should-retry`` reach the client.
        """
        upstream = headers(
            request_id="req_123",
            anthropic_ratelimit_requests_remaining="99",
            anthropic_ratelimit_tokens_reset="2026-01-01T00:00:00Z",
            retry_after="3",
            x_should_retry="true",
            content_type="application/json",
        )
        returned = client_response_headers(upstream)
        for name, values in upstream.getAllRawHeaders():
            self.assertEqual(returned.getRawHeaders(name), values, name)

    def test_connection_headers_not_returned(self):
        """
        Hop-by-hop headers, ``content-length`` (the relay may rewrite the
        body), ``date`` and ``server`` are the relay's own.
        """
        upstream = headers(
            connection="close",
            transfer_encoding="chunked",
            content_length="10",
            date="Mon, 01 Jan 2026 00:00:00 GMT",
            server="upstream/1.0",
            request_id="req_1",
        )
        returned = client_response_headers(upstream)
        self.assertEqual([n for n, _ in returned.getAllRawHeaders()], [b"Request-Id"])


class _ChunkyUpstream(Protocol):
    """Answers each request with a chunked body of many small chunks, in one write."""

    CHUNKS = [b"event: content_block_delta\ndata: {\"n\": %d}\n\n" % i for i in range(200)]

    def connectionMade(self):
        self.factory.connections += 1
        self._buffer = b""

    def dataReceived(self, data):
        self._buffer += data
        while b"\r\n\r\n" in self._buffer:
            _, self._buffer = self._buffer.split(b"\r\n\r\n", 1)
            body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in self.CHUNKS) + b"0\r\n\r\n"
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + body
            )


class _Collect(Protocol):
    def __init__(self):
        self.calls = []
        self.done = Deferred()

    def dataReceived(self, data):
        self.calls.append(data)

    def connectionLost(self, reason):
        self.done.callback(reason.value)


class CoalescedBodyTests(TestCase):
    """On a real socket, the pool's connections read chunked bodies a read at a time."""

    async def test_many_chunks_one_callback_per_read(self):
        factory = Factory.forProtocol(_ChunkyUpstream)
        factory.connections = 0
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        client = UpstreamClient(reactor, "http://127.0.0.1:%d" % (port.getHost().port,))
        self.addCleanup(client.close)
        for _ in range(2):
            response = await client.request(b"POST", "/v1/messages", Headers(), b"{}")
            collector = _Collect()
            response.deliverBody(collector)
            reason = await collector.done
            self.assertIsInstance(reason, ResponseDone)
            self.assertEqual(b"".join(collector.calls), b"".join(_ChunkyUpstream.CHUNKS))
            # 200 chunks, a few reads: never a callback per chunk.
            self.assertLess(len(collector.calls), 20)
        # The second request reused the first one's connection.
        self.assertEqual(factory.connections, 1)


class _RecordingUpstream(Protocol):
    """Records the raw bytes of each request; answers each with an empty 200."""

    def connectionMade(self):
        self._buffer = b""

    def dataReceived(self, data):
        self._buffer += data
        while b"\r\n\r\n" in self._buffer:
            head, rest = self._buffer.split(b"\r\n\r\n", 1)
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            self.factory.requests.append(head + b"\r\n\r\n" + rest[:length])
            self._buffer = rest[length:]
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")


class RequestBytesTests(TestCase):
    """
    What goes on the wire to the upstream, byte for byte: the request line
    with the base URL's path, one Host header, the body's length, the headers.
    """

    def setUp(self):
        factory = Factory.forProtocol(_RecordingUpstream)
        factory.requests = []
        self.requests = factory.requests
        self.port = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)

    async def send(self, base_path, method, path, body, **extra):
        client = UpstreamClient(reactor, "http://127.0.0.1:%d%s" % (self.port.getHost().port, base_path))
        self.addCleanup(client.close)
        response = await client.request(method, path, headers(anthropic_version="2023-06-01", **extra), body)
        collector = _Collect()
        response.deliverBody(collector)
        await collector.done
        self.assertEqual(b"".join(collector.calls), b"{}")
        return self.requests[-1]

    async def test_post(self):
        sent = await self.send("", b"POST", "/v1/messages?beta=true", b'{"a":1}')
        host = b"127.0.0.1:%d" % (self.port.getHost().port,)
        self.assertEqual(
            sent,
            b"POST /v1/messages?beta=true HTTP/1.1\r\nHost: " + host + b"\r\nContent-Length: 7\r\n"
            b"Anthropic-Version: 2023-06-01\r\n\r\n{\"a\":1}",
        )

    async def test_base_path_and_bodiless_requests(self):
        """
        A base URL's path prefixes every request; a GET carries no length, a
        POST without a body says it is empty.
        """
        sent = await self.send("/proxy/anthropic", b"GET", "/v1/models", None)
        self.assertTrue(sent.startswith(b"GET /proxy/anthropic/v1/models HTTP/1.1\r\n"), sent)
        self.assertNotIn(b"Content-Length", sent)
        sent = await self.send("/proxy/anthropic", b"POST", "/v1/messages/count_tokens", None)
        self.assertIn(b"\r\nContent-Length: 0\r\n", sent)

    async def test_host_given_by_the_caller(self):
        """A Host header given with the request is the only one sent."""
        sent = await self.send("", b"POST", "/v1/messages", b"{}", host="api.example.test")
        self.assertEqual(sent.count(b"Host:"), 1)
        self.assertIn(b"\r\nHost: api.example.test\r\n", sent)

    async def test_large_body(self):
        """A body larger than the socket takes at once arrives whole, in order."""
        body = bytes(range(256)) * 40000
        sent = await self.send("", b"POST", "/v1/messages", body)
        self.assertTrue(sent.endswith(b"\r\n\r\n" + body))

    async def test_bad_request_line(self):
        """
        A path that would break the request line never does: treq sends the
        bytes a URI may not hold percent-encoded, so no header is injected.
        """
        sent = await self.send("", b"POST", "/v1/messages\r\nX-Injected: 1", b"{}")
        self.assertTrue(sent.startswith(b"POST /v1/messages%0D%0AX-Injected:%201 HTTP/1.1\r\n"), sent)
        self.assertNotIn(b"\r\nX-Injected", sent)

    async def test_no_compression_asked(self):
        """
        The relay never asks the upstream for compression (treq's decoding
        agent would ask for gzip on every request).
        """
        sent = await self.send("", b"POST", "/v1/messages", b"{}")
        self.assertNotIn(b"accept-encoding", sent.lower())

    async def test_fragment_not_sent(self):
        """A client's ``#fragment`` is its own: the upstream never sees it."""
        sent = await self.send("", b"GET", "/v1/models?x=1#part", None)
        self.assertTrue(sent.startswith(b"GET /v1/models?x=1 HTTP/1.1\r\n"), sent)


class HostValueTests(SynchronousTestCase):
    """The Host header of an upstream, as Twisted's Agent would send it."""

    def test_values(self):
        from twisted_relay.upstream_agent import _host_value

        self.assertEqual(_host_value(b"https", b"api.anthropic.com", 443), b"api.anthropic.com")
        self.assertEqual(_host_value(b"http", b"127.0.0.1", 80), b"127.0.0.1")
        self.assertEqual(_host_value(b"http", b"127.0.0.1", 8080), b"127.0.0.1:8080")
        self.assertEqual(_host_value(b"https", b"::1", 8443), b"[::1]:8443")


class UpstreamEndpointTests(SynchronousTestCase):
    """The pool's endpoints: one per upstream host, no resolver for IP addresses."""

    def endpoint(self, url: bytes):
        from twisted.internet.testing import MemoryReactorClock
        from twisted.web.client import URI

        from twisted_relay.upstream_agent import UpstreamEndpoints

        factory = getattr(self, "factory", None)
        if factory is None:
            factory = self.factory = UpstreamEndpoints(MemoryReactorClock(), 5.0)
        return factory.endpointForURI(URI.fromBytes(url))

    def test_one_endpoint_per_host(self):
        first = self.endpoint(b"http://127.0.0.1:8081/v1/messages")
        self.assertIs(self.endpoint(b"http://127.0.0.1:8081/v1/models?x=1"), first)
        self.assertIsNot(self.endpoint(b"http://127.0.0.1:8082/v1/messages"), first)

    def test_kinds(self):
        """
        An IP address needs no resolver; the connect timeout is the relay's
        own (:class:`~twisted_relay.upstream_agent.TimedEndpoint`), around
        each kind.
        """
        from twisted.internet.endpoints import HostnameEndpoint, TCP4ClientEndpoint, TCP6ClientEndpoint

        from twisted_relay.upstream_agent import TimedEndpoint

        def inner(url):
            endpoint = self.endpoint(url)
            self.assertIsInstance(endpoint, TimedEndpoint)
            return endpoint.endpoint

        self.assertIsInstance(inner(b"http://127.0.0.1:1/"), TCP4ClientEndpoint)
        self.assertIsInstance(inner(b"http://[::1]:1/"), TCP6ClientEndpoint)
        self.assertIsInstance(inner(b"http://localhost:1/"), HostnameEndpoint)
        tls = self.endpoint(b"https://api.anthropic.com/v1/messages")
        self.assertNotIsInstance(tls, (HostnameEndpoint, TCP4ClientEndpoint, TimedEndpoint))
        self.assertIs(self.endpoint(b"https://api.anthropic.com/v1/models"), tls)

    def test_unsupported_scheme(self):
        from twisted.web.error import SchemeNotSupported

        self.assertRaises(SchemeNotSupported, self.endpoint, b"ftp://127.0.0.1:1/")


class UpstreamTLSTests(TestCase):
    """An https upstream is reached over TLS and its certificate is checked."""

    async def test_unverifiable_certificate(self):
        """
        An upstream whose certificate does not verify (self-signed here) is a
        502 that says so, not retried, instead of "closed the connection".
        """
        from twisted.internet import ssl
        from twisted.web.resource import Resource
        from twisted.web.server import Site

        from twisted_relay.errors import RelayError

        from tests.helpers import self_signed_pem

        certificate = ssl.PrivateCertificate.loadPEM(self_signed_pem("localhost"))
        port = reactor.listenSSL(0, Site(Resource()), certificate.options(), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        client = UpstreamClient(reactor, "https://127.0.0.1:%d" % (port.getHost().port,))
        self.addCleanup(client.close)
        try:
            await client.request(b"POST", "/v1/messages", Headers(), b"{}")
        except RelayError as e:
            error = e
        else:
            self.fail("an unverifiable upstream was accepted")
        self.assertEqual((error.status, error.kind), (502, "tls"))
        self.assertIn("TLS handshake", error.message)
        self.assertIn("certificate verify failed", error.message)
        # Twisted logs the verification failure itself.
        self.flushLoggedErrors()


class _GzipStream(Resource):
    """
    An upstream that compresses its SSE answer although nobody asked, each
    event flushed on its own (``Z_SYNC_FLUSH``), and sends the next event
    only when the test says so.
    """

    isLeaf = True

    def __init__(self, events):
        super().__init__()
        self.events = list(events)
        self.request = None
        self.received_headers = None

    def render(self, request):
        import zlib

        self.received_headers = request.requestHeaders
        self.request = request
        self.compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"content-encoding", b"gzip")
        request.write(b"")
        return NOT_DONE_YET

    def send_next(self):
        import zlib

        event = self.events.pop(0)
        self.request.write(self.compressor.compress(event) + self.compressor.flush(zlib.Z_SYNC_FLUSH))
        if not self.events:
            self.request.write(self.compressor.flush())
            self.request.finish()


class _Redirect(Resource):
    """An upstream that answers every request with a redirect, and counts them."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.paths = []

    def render(self, request):
        self.paths.append(request.path)
        request.setResponseCode(307)
        request.setHeader(b"location", b"http://upstream.test/elsewhere")
        request.setHeader(b"content-type", b"application/json")
        return b'{"moved": true}'


class TreqLegTests(SynchronousTestCase):
    """
    The upstream leg goes through treq, with what a relay must not do
    turned off: no redirect followed, no compression asked for (and an
    answer compressed anyway still streams event by event).
    """

    def test_redirect_not_followed(self):
        """
        An upstream's 307 reaches the client as it is; the relay never sends
        the request to the ``Location`` (treq follows redirects by default).
        """
        from tests.helpers import InMemoryRelay, messages_body

        upstream = _Redirect()
        relay = InMemoryRelay(upstream)
        d = relay.raw_post("/v1/messages", messages_body())
        relay.flush()
        response = self.successResultOf(d)
        self.assertEqual(response.code, 307)
        self.assertEqual(response.headers.getRawHeaders(b"location"), [b"http://upstream.test/elsewhere"])
        self.assertEqual(upstream.paths, [b"/v1/messages"])

    def test_compressed_stream_still_streams_event_by_event(self):
        """
        The relay asks for no compression; an upstream that gzips its SSE
        answer anyway is decoded as it comes: each event reaches the client,
        uncompressed, before the upstream sends the next one.
        """
        from tests.helpers import InMemoryRelay, messages_body

        events = [
            b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
            b'"role":"assistant","content":[],"model":"m","usage":{"input_tokens":1,"output_tokens":0}}}\n\n',
            b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
            b'"content_block":{"type":"text","text":""}}\n\n',
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"Hello"}}\n\n',
            b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n',
            b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
        ]
        upstream = _GzipStream(events)
        relay = InMemoryRelay(upstream)
        d = relay.raw_post("/v1/messages", messages_body(stream=True))
        relay.flush()
        self.assertIsNone(upstream.received_headers.getRawHeaders(b"accept-encoding"))
        response = self.successResultOf(d)
        self.assertEqual(response.code, 200)
        self.assertIsNone(response.headers.getRawHeaders(b"content-encoding"))
        collector = _Collect()
        response.deliverBody(collector)
        for i in range(len(events)):
            upstream.send_next()
            relay.flush()
            self.assertEqual(b"".join(collector.calls), b"".join(events[: i + 1]), i)
        self.assertIsInstance(self.successResultOf(collector.done), ResponseDone)


class UnreachableInMemoryTests(SynchronousTestCase):
    """An upstream nobody listens for, in memory: the production client's error path."""

    def test_refused_is_a_502_that_says_so(self):
        """A refused connection is an Anthropic-shaped 502 naming the upstream, not a traceback."""
        import ujson

        from tests.helpers import UPSTREAM_URL, InMemoryRelay, messages_body

        relay = InMemoryRelay(Resource())
        relay.network.stop_listening(b"upstream.test", 80)
        d = relay.post("/v1/messages", messages_body())
        relay.flush()
        response = self.successResultOf(d)
        self.assertEqual(response.code, 502)
        d = response.content()
        relay.flush()
        error = ujson.loads(self.successResultOf(d))["error"]
        self.assertEqual(error["type"], "api_error")
        self.assertIn("Could not connect to the upstream at " + UPSTREAM_URL, error["message"])


class _PlainStream(Resource):
    """An upstream that streams SSE events, chunked, and ends."""

    isLeaf = True

    def __init__(self, events):
        super().__init__()
        self.events = events

    def render(self, request):
        request.setHeader(b"content-type", b"text/event-stream")
        for event in self.events:
            request.write(event)
        request.finish()
        return NOT_DONE_YET


class NoCycleTests(SynchronousTestCase):
    """
    A finished upstream answer is freed by reference counting: under load,
    what waits for the garbage collector's full collection makes each one
    longer (a pause of every stream). The relay's own chunked decoder, which
    holds the client parser's callbacks, must not keep it in a cycle.
    """

    def test_finished_stream_leaves_no_upstream_cycle(self):
        import gc

        from tests.helpers import InMemoryRelay, messages_body
        from twisted_relay._twisted import active
        from twisted_relay.chunked import CoalescingChunkedDecoder

        if not active().coalescing_decoder:
            raise SkipTest("the coalescing decoder is off on this Twisted")
        events = [
            b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
            b'"role":"assistant","content":[],"model":"m","usage":{"input_tokens":1,"output_tokens":0}}}\n\n',
            b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
        ]
        relay = InMemoryRelay(_PlainStream(events))
        gc.collect()
        self.addCleanup(gc.set_debug, gc.get_debug())
        gc.set_debug(gc.DEBUG_SAVEALL)
        already = len(gc.garbage)
        self.addCleanup(gc.garbage.__delitem__, slice(already, None))
        d = relay.raw_post("/v1/messages", messages_body(stream=True))
        relay.flush()
        collector = _Collect()
        self.successResultOf(d).deliverBody(collector)
        relay.flush()
        self.assertEqual(b"".join(collector.calls), b"".join(events))
        del d, collector
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage[already:] if isinstance(o, CoalescingChunkedDecoder)]
        self.assertEqual(left, [])
