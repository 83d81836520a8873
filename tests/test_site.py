"""
Tests for the relay's HTTP server side: how answers are written, and how a
request's body over ``max_body`` is kept out of memory.
"""

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from twisted_relay.site import RelaySite


class _CountingTransport(StringTransport):
    """A transport in memory that counts the writes it is given."""

    def __init__(self):
        super().__init__()
        self.writes = 0

    def write(self, data):
        self.writes += 1
        super().write(data)

    def writeSequence(self, seq):
        self.writes += 1
        super().write(b"".join(seq))


class _Answer(Resource):
    isLeaf = True

    def __init__(self, how):
        super().__init__()
        self.how = how

    def render(self, request):
        return self.how(request)


def serve(how, request=b"GET / HTTP/1.1\r\nHost: relay.test\r\n\r\n"):
    site = RelaySite(_Answer(how))
    channel = site.buildProtocol(None)
    # Timers on a clock of the test's own, never the global reactor's.
    channel.callLater = Clock().callLater
    transport = _CountingTransport()
    channel.makeConnection(transport)
    channel.dataReceived(request)
    return transport


class AnswerWriteTests(SynchronousTestCase):
    """
    A whole answer leaves with its headers in one write; headers written
    without a body leave at once.
    """

    def test_whole_answer_one_write(self):
        def whole(request):
            request.setHeader(b"content-length", b"5")
            return b"hello"

        transport = serve(whole)
        value = transport.value()
        self.assertTrue(value.startswith(b"HTTP/1.1 200 OK\r\n"), value)
        self.assertTrue(value.endswith(b"\r\n\r\nhello"), value)
        self.assertIn(b"\r\nContent-Length: 5\r\n", value)
        self.assertEqual(transport.writes, 1)

    def test_chunked_answer(self):
        """Without a length the body is chunked, the headers still leave with the first chunk."""
        def chunked(request):
            request.write(b"abc")
            request.write(b"de")
            request.finish()
            return NOT_DONE_YET

        transport = serve(chunked)
        head, _, body = transport.value().partition(b"\r\n\r\n")
        self.assertIn(b"Transfer-Encoding: chunked", head)
        self.assertEqual(body, b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        self.assertEqual(transport.writes, 3)

    def test_headers_alone_leave_at_once(self):
        """
        A stream's headers, written with no body yet, are on the wire before
        any event.
        """
        requests = []

        def stream(request):
            requests.append(request)
            request.write(b"")
            return NOT_DONE_YET

        transport = serve(stream)
        self.assertTrue(transport.value().endswith(b"\r\n\r\n"), transport.value())
        event = b"event: ping\ndata: {}\n\n"
        requests[0].write(event)
        self.assertTrue(transport.value().endswith(b"\r\n\r\n%x\r\n%s\r\n" % (len(event), event)))

    def test_head_and_no_body_statuses(self):
        """HEAD answers and 204s send their headers, and nothing of a body."""
        def whole(request):
            request.setHeader(b"content-length", b"5")
            return b"hello"

        transport = serve(whole, b"HEAD / HTTP/1.1\r\nHost: relay.test\r\n\r\n")
        value = transport.value()
        self.assertTrue(value.startswith(b"HTTP/1.1 200 OK\r\n"), value)
        self.assertTrue(value.endswith(b"\r\n\r\n"), value)

        def no_content(request):
            request.setResponseCode(204)
            return b"ignored"

        transport = serve(no_content)
        value = transport.value()
        self.assertTrue(value.startswith(b"HTTP/1.1 204 No Content\r\n"), value)
        self.assertTrue(value.endswith(b"\r\n\r\n"), value)

    def test_write_after_finish(self):
        """Writing after the answer is finished is Twisted's error, as before."""
        raised = []

        def late(request):
            request.setHeader(b"content-length", b"0")
            request.finish()
            raised.append(self.assertRaises(RuntimeError, request.write, b"late"))
            return NOT_DONE_YET

        serve(late)
        # The resource ran, and its late write raised (an assertion failing
        # inside it would leave nothing here).
        self.assertEqual(len(raised), 1)
        self.assertIsInstance(raised[0], RuntimeError)

    def test_empty_answer(self):
        """An empty answer with a length sends its headers when it finishes."""
        def empty(request):
            request.setHeader(b"content-length", b"0")
            return b""

        value = serve(empty).value()
        self.assertTrue(value.startswith(b"HTTP/1.1 200 OK\r\n"), value)
        self.assertTrue(value.endswith(b"Content-Length: 0\r\n\r\n"), value)


class HostAddressTests(SynchronousTestCase):
    """The channel asks its transport for its own address once, however many requests it carries."""

    def test_asked_once(self):
        asked = []
        transport = _CountingTransport()
        real = transport.getHost

        def get_host():
            asked.append(True)
            return real()

        transport.getHost = get_host
        site = RelaySite(_Answer(lambda request: request.getHost().type.encode("ascii")))
        channel = site.buildProtocol(None)
        channel.callLater = Clock().callLater
        channel.makeConnection(transport)
        for _ in range(3):
            channel.dataReceived(b"GET / HTTP/1.1\r\nHost: relay.test\r\n\r\n")
        self.assertEqual(transport.value().count(b"HTTP/1.1 200 OK"), 3)
        self.assertEqual(transport.value().count(b"\r\n\r\nTCP"), 3)
        self.assertEqual(len(asked), 1)


class HeaderPairsTests(SynchronousTestCase):
    """Headers given as pairs (Twisted's older form) are written Twisted's way, sanitised."""

    def test_pairs(self):
        site = RelaySite(_Answer(lambda request: b""))
        channel = site.buildProtocol(None)
        channel.callLater = Clock().callLater
        transport = _CountingTransport()
        channel.makeConnection(transport)
        channel.writeHeaders(b"HTTP/1.1", b"200", b"OK", [(b"X-A", b"1\r\nX-Injected: 2")])
        value = transport.value()
        self.assertTrue(value.startswith(b"HTTP/1.1 200 OK\r\n"), value)
        self.assertNotIn(b"\r\nX-Injected", value)


class BodyLimitTests(SynchronousTestCase):
    """
    The relay's request never stores a body over the site's ``max_body``.
    """

    def request(self, max_body):
        from twisted.web.resource import Resource
        from twisted.web.test.requesthelper import DummyChannel

        from twisted_relay.site import _BodyLimitedRequest

        channel = DummyChannel()
        channel.site = RelaySite(Resource(), max_body=max_body)
        return _BodyLimitedRequest(channel)

    def test_declared_length(self):
        """
        A declared length over the limit marks the request and stores nothing.
        """
        request = self.request(1000)
        request.gotLength(5000)
        request.handleContentChunk(b"x" * 5000)
        self.assertTrue(request.body_too_large)
        self.assertEqual(request.content.getvalue(), b"")

    def test_growing_body(self):
        """
        A body with no declared length is stored until it passes the limit,
        then dropped.
        """
        request = self.request(1000)
        request.gotLength(None)
        request.handleContentChunk(b"x" * 600)
        self.assertFalse(request.body_too_large)
        request.handleContentChunk(b"x" * 600)
        request.handleContentChunk(b"x" * 600)
        self.assertTrue(request.body_too_large)
        self.assertEqual(request.content.getvalue(), b"")

    def test_within_limit(self):
        """
        A body within the limit is stored whole.
        """
        request = self.request(1000)
        request.gotLength(10)
        request.handleContentChunk(b"0123456789")
        self.assertFalse(request.body_too_large)
        request.content.seek(0)
        self.assertEqual(request.content.read(), b"0123456789")
