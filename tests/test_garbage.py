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
- The in-memory transport loses a connection as
  ``twisted.internet.tcp.Connection`` does: it stops its producer before
  its protocol hears of the loss, and then lets go of the protocol (``del
  self.protocol``); ``iosim.FakeTransport`` does neither, and keeps a
  cycle a real socket does not make. The simulated upstream's ``Site`` parses no form bodies, as
  the relay's does not (Twisted's form parsing makes a class per request in
  ``email.headerregistry``).
"""

from __future__ import annotations

import gc
from collections import Counter

from twisted.internet import reactor, tcp
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater
from twisted.test import iosim
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import URI
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site
from zope.interface import implementer

from twisted_relay.config import RelayConfig, Route, Target, Upstream as UpstreamConfig
from twisted_relay.upstream import UpstreamClient

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


def _label(thing) -> str:
    kind = type(thing).__name__
    if kind in ("function", "type"):
        return thing.__qualname__
    if kind == "method":
        return thing.__func__.__qualname__ + " (bound)"
    if kind == "frame":
        return "frame of " + thing.f_code.co_qualname
    return kind


def _cycles(garbage: list) -> list[str]:
    """The reference cycles among ``garbage``, one line each, starting at objects that are not containers."""
    among = {id(thing) for thing in garbage}
    found, lines = set(), []
    for start in garbage:
        if type(start).__name__ in ("list", "tuple", "dict", "cell"):
            continue
        previous, queue = {id(start): None}, [start]
        while queue:
            thing = queue.pop(0)
            if any(referent is start for referent in gc.get_referents(thing)):
                path = [thing]
                while previous[id(path[-1])] is not None:
                    path.append(previous[id(path[-1])])
                key = frozenset(map(id, path))
                if key not in found:
                    found.add(key)
                    lines.append(" -> ".join(_label(step) for step in reversed(path)) + " -> (back)")
                break
            for referent in gc.get_referents(thing):
                if id(referent) in among and id(referent) not in previous:
                    previous[id(referent)] = thing
                    queue.append(referent)
    return lines


class MessagesUpstream(Resource):
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

    def render_GET(self, request):
        request.setHeader(b"content-type", b"application/json")
        return encode({"data": [{"type": "model", "id": "m", "display_name": "M", "created_at": "2026-01-01T00:00:00Z"}],
                       "has_more": False, "first_id": "m", "last_id": "m"})


@implementer(IPushProducer)
class TcpLikeTransport(iosim.FakeTransport):
    """
    An in-memory transport that loses its connection as TCP's does
    (``tcp.Connection.connectionLost``): its producer (an HTTP channel
    registers itself with a push-producing transport, as a TCP one is) is
    stopped first, then the protocol hears of the loss, then the transport
    lets go of it.
    """

    def reportDisconnect(self):
        if self.producer is not None:
            self.producer.stopProducing()
            self.producer = None
        super().reportDisconnect()
        del self.protocol


class RawClient(Protocol):
    """
    A client writing one HTTP/1.1 request (``Connection: close``) and reading
    the answer's bytes; with ``leave``, it closes its connection once the
    first bytes of the answer's body have come (``"at once"``: as soon as
    its request is written).
    """

    def __init__(self, request: bytes, leave):
        self.request, self.leave = request, leave
        self.received = b""
        self.closed = False

    def connectionMade(self):
        self.transport.write(self.request)
        if self.leave == "at once":
            self.transport.loseConnection()

    def dataReceived(self, data):
        self.received += data
        if self.leave and b"\r\n\r\n" in self.received and not self.received.endswith(b"\r\n\r\n"):
            self.transport.loseConnection()

    def connectionLost(self, reason):
        self.closed = True


class OneClient(Factory):
    def __init__(self, client):
        self.client = client

    def buildProtocol(self, addr):
        return self.client


def request_bytes(method: bytes, path: bytes, body: bytes = b"", host: bytes = b"relay.test") -> bytes:
    """An HTTP/1.1 request (``Connection: close``) with a client's key, and a JSON body if any."""
    head = b"%s %s HTTP/1.1\r\nHost: %s\r\nx-api-key: sk-test-client\r\nConnection: close\r\n" % (method, path, host)
    if body:
        head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % (len(body),)
    return head + b"\r\n" + body


def exchange(relay: InMemoryRelay, request: bytes, *, leave=None, wait: float = 0.0) -> RawClient:
    """
    Send ``request`` to the relay from a client of its own (a
    :class:`RawClient`), move the bytes, then ``wait`` seconds on the
    relay's clock; the client.
    """
    client = RawClient(request, leave)
    relay.network.endpointForURI(URI.fromBytes(b"http://relay.test/")).connect(OneClient(client))
    relay.flush()
    if wait:
        relay.clock.advance(wait)
        relay.flush()
    return client


class GarbageTestCase(SynchronousTestCase):
    """Relayed requests in memory, and what ``gc.collect()`` finds after them with the collector off."""

    def setUp(self):
        self.patch(iosim, "FakeTransport", TcpLikeTransport)
        self.addCleanup(gc.enable if gc.isenabled() else gc.disable)
        self.addCleanup(gc.set_debug, gc.get_debug())

    def relay(self, answer, *, second=None, **settings) -> InMemoryRelay:
        """
        The relay in front of an upstream answering ``answer``; with
        ``second``, in front of two upstreams, ``first`` answering ``answer``
        and ``second`` answering ``second``, tried in that order.
        """
        if second is None:
            upstreams = {b"upstream.test": MessagesUpstream(answer)}
            config = RelayConfig(listen=(), dump_dir=None, upstreams=(UpstreamConfig("up", "http://upstream.test"),), **settings)
        else:
            upstreams = {b"first.test": MessagesUpstream(answer), b"second.test": MessagesUpstream(second)}
            config = RelayConfig(
                listen=(), dump_dir=None,
                upstreams=(UpstreamConfig("first", "http://first.test"), UpstreamConfig("second", "http://second.test")),
                routes=(Route(targets=(Target("first"), Target("second"))),),
                breaker_failures=1000, **settings,
            )
        relay = InMemoryRelay(Resource(), config, more_upstreams=upstreams)
        for host, resource in upstreams.items():
            relay.network.stop_listening(host, 80)
            relay.network.listen(host, 80, Site(resource, reactor=relay.clock, parsePOSTFormSubmission=False))
        return relay

    def exchange(self, relay, *, stream=False, leave=None, wait=0.0, path="/v1/messages") -> bytes:
        """One Messages request from a client of its own; what it received once its connection closed."""
        body = encode(messages_body(stream=stream))
        client = exchange(relay, request_bytes(b"POST", path.encode(), body), leave=leave, wait=wait)
        self.assertTrue(client.closed)
        return client.received

    def assertNoGarbage(self, relay, expected_status: bytes, n=4, **exchange):
        """
        After two requests (caches filled, pool connections made), ``n``
        more with the collector off leave nothing for ``gc.collect()``.
        """

        def one():
            received = self.exchange(relay, **exchange)
            self.assertTrue(received.startswith(b"HTTP/1.1 " + expected_status), received[:200])

        self.assertNoGarbageFrom(one, n)

    def garbageFrom(self, one, n=4) -> list:
        """``one()`` twice, then ``n`` times with the collector off: what ``gc.collect()`` then frees."""
        for _ in range(2):
            one()
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        for _ in range(n):
            one()
        gc.collect()
        garbage = list(gc.garbage)
        del gc.garbage[:]
        gc.set_debug(0)
        return garbage

    def assertNoGarbageFrom(self, one, n=4):
        """``one()`` twice, then ``n`` times with the collector off: nothing for ``gc.collect()``."""
        garbage = self.garbageFrom(one, n)
        kinds = Counter(getattr(o, "__qualname__", None) or type(o).__qualname__ for o in garbage)
        self.assertEqual(sorted(kinds.items()), [], "\n".join(_cycles(garbage)))

class NoCyclicGarbageTests(GarbageTestCase):
    """Relayed requests, with the collector off: ``gc.collect()`` finds nothing a request made."""

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

    def test_client_gone_waiting(self):
        """A client that leaves while the relay waits for the upstream's answer."""
        relay = self.relay("hang")
        self.assertNoGarbageFrom(lambda: self.assertEqual(self.exchange(relay, leave="at once"), b""))
        self.assertEqual(relay.app.in_flight, 0)

    def test_deadline_whole(self):
        """An upstream that never answers: the deadline's 504."""
        self.assertNoGarbage(self.relay("hang", total_timeout=1.0), b"504", wait=1.5)

    def test_deadline_streamed(self):
        """A stream that stops: the deadline ends it (an error event)."""
        self.assertNoGarbage(self.relay("hang", total_timeout=1.0), b"200", stream=True, wait=1.5)

    def test_probes(self):
        """``/health``, ``/ready`` and ``/api/hello``, which load balancers ask often."""
        relay = self.relay("ok")
        for path in (b"/health", b"/ready", b"/api/hello"):
            self.assertNoGarbageFrom(
                lambda: self.assertTrue(exchange(relay, request_bytes(b"GET", path)).received.startswith(b"HTTP/1.1 200"))
            )


class LeftToKleinTests(GarbageTestCase):
    """
    What is left: a request Klein's render still dispatches (an unknown path,
    a wrong method, ``HEAD``, ``/v1/models/{id}``, ``/metrics``) leaves
    Klein's and werkzeug's cycles, and nothing else. ``KleinResource.render``
    makes a ``processing_failed`` closure that calls itself, so refers to
    itself and to the request (Klein issue #101); werkzeug's
    ``StateMachineMatcher.match`` a ``_match`` closure that does the same.
    Neither can be broken without Klein's or werkzeug's private names; these
    requests are rare (errors, probes), the relayed ones go around them.
    """

    def test_unknown_path(self):
        """A 404: only Klein's and werkzeug's closures, and what they hold."""
        relay = self.relay("ok")
        garbage = self.garbageFrom(
            lambda: self.assertTrue(exchange(relay, request_bytes(b"GET", b"/nothing")).received.startswith(b"HTTP/1.1 404"))
        )
        named = [thing for thing in garbage if getattr(thing, "__qualname__", None) in (
            "KleinResource.render.<locals>.processing_failed", "StateMachineMatcher.match.<locals>._match")]
        self.assertEqual(len(named), 8)
        # Everything else is held by those closures.
        held, queue = {id(thing) for thing in named}, list(named)
        among = {id(thing) for thing in garbage}
        while queue:
            for referent in gc.get_referents(queue.pop()):
                if id(referent) in among and id(referent) not in held:
                    held.add(id(referent))
                    queue.append(referent)
        self.assertEqual([_label(thing) for thing in garbage if id(thing) not in held], [])


class _ClosingUpstream(Protocol):
    """Answers a request with a small 200 and ``Connection: close``, then closes, as an upstream may."""

    def connectionMade(self):
        self.received = b""

    def dataReceived(self, data):
        self.received += data
        if b"\r\n\r\n" in self.received and self.received.endswith(b"{}"):
            self.transport.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}")
            self.transport.loseConnection()


class _Body(Protocol):
    def __init__(self):
        self.done = Deferred()

    def connectionLost(self, reason):
        self.done.callback(None)


class ClosedUpstreamConnectionTests(TestCase):
    """
    An upstream connection that closes leaves no cyclic garbage either.
    Real sockets on 127.0.0.1: the cycles were those of Twisted's TCP client
    connection, its connector and its endpoint's factory, which the
    in-memory tests above do not make. Without the relay's cut
    (``_twisted.forget_connector``), every closed upstream connection (an
    upstream's ``Connection: close``, a reset, an idle timeout: thousands a
    minute in the soak) waited for a full collection.
    """

    async def test_closed_connection(self):
        port = reactor.listenTCP(0, Factory.forProtocol(_ClosingUpstream), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        client = UpstreamClient(reactor, "http://127.0.0.1:%d" % (port.getHost().port,))
        self.addCleanup(client.close)

        async def one():
            response = await client.request(b"POST", "/v1/messages", Headers(), b"{}")
            body = _Body()
            response.deliverBody(body)
            await body.done

        async def closed():
            # Bounded: the client hears of the close within a few reactor turns.
            for _ in range(500):
                if all(not o.connected for o in gc.get_objects() if isinstance(o, tcp.Client)):
                    return
                await deferLater(reactor, 0.01, lambda: None)
            self.fail("the upstream connections were not closed")

        await one()
        await closed()
        self.addCleanup(gc.enable if gc.isenabled() else gc.disable)
        self.addCleanup(gc.set_debug, gc.get_debug())
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        already = len(gc.garbage)
        for _ in range(4):
            await one()
        await closed()
        gc.collect()
        garbage = gc.garbage[already:]
        del gc.garbage[already:]
        gc.set_debug(0)
        kinds = Counter(getattr(o, "__qualname__", None) or type(o).__qualname__ for o in garbage)
        self.assertEqual(sorted(kinds.items()), [], "\n".join(_cycles(garbage)))
