"""
The contract between the relay and the Twisted internals it uses
(``twisted_relay._twisted``): each assumption holds on the Twisted the suite
runs on, each one that does not is switched off, and with all of them off
the relay still relays correctly through Twisted's public path.

This module, with ``_twisted`` itself, is where private Twisted names may
appear: it checks them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import ujson
from twisted.internet import reactor
from twisted.internet.protocol import Factory
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web import client as web_client
from twisted.web import http
from twisted.web.server import Site

from twisted_relay import _twisted
from twisted_relay.config import RelayConfig, one_upstream
from twisted_relay.simulated import SimulatedUpstream

from tests.helpers import encode, messages_body, serve_relay


class ContractTests(SynchronousTestCase):
    """
    Every assumption the relay makes of Twisted's internals holds here. A
    Twisted release that breaks one fails this test (the relay itself would
    fall back to the public path and only log it).
    """

    def test_all_hold(self):
        """The probes find every assumption true on this Twisted, and the relay uses them all."""
        held, why = _twisted.probe()
        self.assertEqual(why, {})
        self.assertEqual(held.off(), [])
        self.assertEqual(_twisted.active(), held)

    def test_write_through(self):
        """
        ``FileDescriptor`` holds back exactly ``dataBuffer[offset:]`` and
        ``_tempDataLen`` bytes (``send_now`` sends only when both are empty).
        """
        self.assertIsNone(_twisted._probe_write_through())

    def test_pool_hooks(self):
        """The pool builds connections with ``_factory`` and takes them back through ``_putConnection``."""
        self.assertIsNone(_twisted._probe_pool_hooks())

    def test_coalescing_decoder(self):
        """
        The client parser reads a chunked body with the decoder in
        ``_transferDecoders`` set after ``request()``; a cut body is ``_DataLoss``.
        """
        self.assertIsNone(_twisted._probe_coalescing_decoder())

    def test_one_send_request(self):
        """A ``Request`` subclass's ``writeTo`` writes the request, and its answer is read."""
        self.assertIsNone(_twisted._probe_one_send_request())

    def test_connection_header(self):
        """
        Twisted files an answer's ``Connection`` header in the parser's
        ``connHeaders``, apart from its headers, and pools no connection
        whose answer says ``close`` among other tokens once they are split.
        """
        self.assertIsNone(_twisted._probe_connection_header())

    def test_copied_constant(self):
        """The chunk-extension characters copied from Twisted are still Twisted's."""
        from twisted_relay import chunked

        self.assertEqual(chunked.CHUNK_EXTENSION_CHARS, http._chunkExtChars)

    def test_each_name_guards(self):
        """Hiding any one private name switches off what relies on it, and nothing else."""
        relies = {
            "write_through": {"_aborting", "_writeDisconnected", "_tempDataLen", "dataBuffer", "offset", "socket"},
            "pool_hooks": {"_HTTP11ClientFactory", "_factory", "_putConnection", "_quiescentCallback"},
            "coalescing_decoder": {"_ChunkedTransferDecoder", "_DataLoss", "_transferDecoders", "_parser",
                                   "_currentRequest"},
            "one_send_request": {"_newclient.Request"},
            "connection_header": {"connHeaders"},
        }
        # Without it the relay only does less: a lost upstream connection's cycles are not all cut.
        optional = {"_connector"}
        self.assertEqual(set().union(*relies.values()) | optional, set(_twisted.PRIVATE_NAMES))
        for name in _twisted.PRIVATE_NAMES:
            held, why = _twisted.probe(hide=[name])
            expected = {assumption for assumption, names in relies.items() if name in names}
            if "pool_hooks" in expected:
                expected |= {"coalescing_decoder", "one_send_request", "connection_header"}
            self.assertEqual(set(held.off()), expected, name)
            self.assertEqual(set(why), expected, name)

    def test_pool_reads_chunked_bodies_with_the_decoder_given(self):
        """The caller chooses the chunked decoder (``_twisted`` knows none of the relay's)."""

        class Given(_twisted.TwistedChunkedDecoder):
            pass

        pool = _twisted.connection_pool(MemoryReactorClock(), Given)
        self.assertEqual(pool._factory(None, None).decoders, {b"chunked": Given})
        pool = _twisted.connection_pool(MemoryReactorClock())
        self.assertIsNone(pool._factory(None, None).decoders)

    def test_pool_keeps_no_closing_connection(self):
        """The relay's pool keeps no connection that is closing, over TCP or TLS."""
        from twisted.internet.ssl import optionsForClientTLS
        from twisted.protocols.tls import TLSMemoryBIOFactory

        pool = _twisted.connection_pool(MemoryReactorClock())
        self.assertIsInstance(pool, _twisted._RelayConnectionPool)
        for tls in (False, True):
            for closing in (False, True):
                connection = _twisted._HTTP11ClientProtocol()
                tcp = StringTransport()
                tcp.setTcpNoDelay = lambda enabled: None
                if tls:
                    # The connection's transport is the TLS layer over the socket.
                    factory = TLSMemoryBIOFactory(
                        optionsForClientTLS("upstream.example"), True, Factory.forProtocol(lambda: connection)
                    )
                    factory.buildProtocol(None).makeConnection(tcp)
                else:
                    connection.makeConnection(tcp)
                if closing:
                    # What stopProducing does when a client leaves mid-stream.
                    tcp.loseConnection()
                key = (b"https" if tls else b"http", closing)
                pool._putConnection(key, connection)
                kept = pool._connections.get(key, [])
                self.assertEqual(connection in kept, not closing, (tls, closing))
        pool.closeCachedConnections()


class ActivationTests(SynchronousTestCase):
    """
    ``_twisted`` is the bottom layer: it imports nothing of the relay's, and
    probes nothing at import; the probes run once, when the service starts
    (``activate``) or on the first use of what needs them.
    """

    def test_activate_once(self):
        """``activate`` probes once; later calls give the assumptions in use, probing nothing."""
        held = _twisted.activate()

        def probe(hide=()):
            raise AssertionError("probed again")

        self.patch(_twisted, "probe", probe)
        self.assertIs(_twisted.activate(), held)
        self.assertIs(_twisted.activate(), _twisted.active())

    def test_probes_on_first_use_not_at_import(self):
        """
        Importing the relay's modules probes nothing; whichever use comes
        first (in a fresh process) probes, and takes the private path where
        the assumptions hold: what in-memory tests, which start no service, rely on.
        """
        script = textwrap.dedent(
            """
            import importlib, json
            from twisted.internet.task import Clock
            from twisted.web.http_headers import Headers
            from twisted_relay import _twisted as t
            import twisted_relay.service, twisted_relay.site, twisted_relay.upstream
            from twisted_relay.chunked import CoalescingChunkedDecoder
            from twisted_relay.upstream import UpstreamClient

            seen = {"import": [t._activated]}
            first_uses = {
                "activate": t.activate,
                "active": t.active,
                "send_now": lambda: t.send_now(object(), [b"x"]) is False,
                "one_send_request": lambda: t.one_send_request(b"GET", b"/", Headers(), None, b"h") is not None,
                "connection_pool": lambda: type(t.connection_pool(Clock())) is t._RelayConnectionPool,
                "UpstreamClient": lambda: UpstreamClient(Clock(), "http://upstream.test")._pool._factory(
                    None, None).decoders == {b"chunked": CoalescingChunkedDecoder},
            }
            for name, use in first_uses.items():
                importlib.reload(t)
                before = t._activated
                result = use()
                seen[name] = [before, t._activated, t._active.off(), bool(result)]
            print(json.dumps(seen))
            """
        )
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 0, done.stderr)
        seen = ujson.loads(done.stdout)
        self.assertEqual(seen.pop("import"), [False])
        for name, (before, after, off, result) in seen.items():
            self.assertEqual((before, after, off, result), (False, True, [], True), name)


class FallbackTests(TestCase):
    """
    With every private name hidden (as on a Twisted that renamed them all),
    the relay takes Twisted's public path and still relays correctly, over
    real sockets.
    """

    def setUp(self):
        held, why = _twisted.probe(hide=_twisted.PRIVATE_NAMES)
        self.assertEqual(
            set(why), {"write_through", "pool_hooks", "coalescing_decoder", "one_send_request", "connection_header"}
        )
        before = _twisted.use(held)
        self.addCleanup(_twisted.use, before)

    async def test_relays_through_the_public_path(self):
        """
        Streamed and whole answers, tool-use ids translated, arrive intact
        through Twisted's pool, decoder and ``Agent`` and plain writes; the
        pool's connection is reused.
        """
        import treq


        sim = SimulatedUpstream(mode="strict", seed=2, reuse_every=1)
        upstream_site = Site(sim.resource())
        accepted = []
        build = upstream_site.buildProtocol
        upstream_site.buildProtocol = lambda addr: (accepted.append(addr), build(addr))[1]
        upstream_port = reactor.listenTCP(0, upstream_site, interface="127.0.0.1")
        self.addCleanup(upstream_port.stopListening)
        config = RelayConfig(
            listen=(), upstreams=one_upstream("http://127.0.0.1:%d" % (upstream_port.getHost().port,)), dump_dir=None
        )
        served = serve_relay(self, config, reactor)
        relay = served.relay
        self.assertIs(type(relay.client._pool), web_client.HTTPConnectionPool)
        self.assertFalse(_twisted.send_now(object(), [b"x"]))
        self.assertIsNone(_twisted.one_send_request(b"GET", b"/", None, None, b"h"))
        url = served.url + "/v1/messages"

        # The upstream copies the history's id into its answer (reuse_every=1):
        # the client must get it translated, in streams and whole answers.
        history = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_01AAAAAAAAAAAAAAAAAAAAAA", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01AAAAAAAAAAAAAAAAAAAAAA", "content": "ok"}]},
        ]  # fmt: skip
        for stream in (True, False, True):
            response = await treq.post(
                url,
                data=encode(messages_body(history, stream=stream)),
                headers={"content-type": ["application/json"]},
                persistent=False,
            )
            self.assertEqual(response.code, 200)
            body = await treq.content(response)
            if stream:
                events = [e for e in body.split(b"\n\n") if e]
                self.assertTrue(events[0].startswith(b"event: message_start\n"), events[0])
                self.assertTrue(events[-1].startswith(b"event: message_stop\n"), events[-1])
                blocks = [
                    ujson.loads(e.split(b"data: ", 1)[1])["content_block"]
                    for e in events
                    if e.startswith(b"event: content_block_start\n")
                ]
            else:
                message = ujson.loads(body)
                self.assertEqual(message["type"], "message")
                blocks = message["content"]
            ids = [block["id"] for block in blocks if block["type"] == "tool_use"]
            self.assertEqual(ids, ["toolu_01AAAAAAAAAAAAAAAAAAAAAA-2"])
        self.assertEqual(len(sim.requests), 3)
        # One upstream connection for the three requests: the pool reused it.
        self.assertEqual(len(accepted), 1)


class ConnectionHeaderFallbackTests(TestCase):
    """With ``connection_header`` off, what still holds of hop-by-hop headers, over real sockets."""

    def setUp(self):
        held, why = _twisted.probe(hide={"connHeaders"})
        self.assertEqual(set(why), {"connection_header"})
        before = _twisted.use(held)
        self.addCleanup(_twisted.use, before)

    async def test_standard_hop_by_hop_headers_still_dropped(self):
        """
        The standard hop-by-hop headers never reach the client; a header
        only the upstream's ``Connection`` header names does (as the module
        docstring and the start-up warning say), and end-to-end ones pass.
        """
        import treq

        from tests.faulty_upstream import FaultyUpstream, RawBytes

        upstream = FaultyUpstream(reactor)
        upstream_url = upstream.listen()
        self.addCleanup(upstream.stop)
        body = b'{"type":"message","id":"msg_1","role":"assistant","content":[]}'
        upstream.script(
            RawBytes(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close, X-Foo\r\n"
                b"Keep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nProxy-Authenticate: Basic\r\n"
                b"Trailer: X-Sum\r\nUpgrade: h2c\r\nTE: trailers\r\nX-Foo: connection-only\r\n"
                b"X-Keep: yes\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
        )
        served = serve_relay(self, RelayConfig(listen=(), upstreams=one_upstream(upstream_url), dump_dir=None), reactor)
        response = await treq.post(
            served.url + "/v1/messages",
            data=encode(messages_body(tools=False)),
            headers={"content-type": ["application/json"]},
            persistent=False,
        )
        self.assertEqual(ujson.loads(await treq.content(response))["id"], "msg_1")
        for name in (b"keep-alive", b"proxy-connection", b"proxy-authenticate", b"trailer", b"upgrade", b"te"):
            self.assertIsNone(response.headers.getRawHeaders(name), name)
        self.assertEqual(response.headers.getRawHeaders(b"x-keep"), [b"yes"])
        self.assertEqual(response.headers.getRawHeaders(b"x-foo"), [b"connection-only"])
        self.assertIn("connection_header", _twisted.COST_WHEN_OFF)


class ListenErrorTests(TestCase):
    """``raise_listen_errors``: a port in use fails the listening service's start at once."""

    def test_port_in_use_raises(self):
        """The service's start raises Twisted's ``CannotListenError`` (twistd then stops with it)."""
        from twisted.application.internet import StreamServerEndpointService
        from twisted.internet.endpoints import TCP4ServerEndpoint
        from twisted.internet.error import CannotListenError

        taken = reactor.listenTCP(0, Factory(), interface="127.0.0.1")
        self.addCleanup(taken.stopListening)
        service = StreamServerEndpointService(
            TCP4ServerEndpoint(reactor, taken.getHost().port, interface="127.0.0.1"), Factory()
        )
        _twisted.raise_listen_errors(service)
        self.assertRaises(CannotListenError, service.privilegedStartService)
