"""
Tests for the relay's operational guards: metrics, request body limits at
the HTTP layer, ``retry-after`` parsing, JSON logs, and URLs without
credentials in what the relay writes.
"""

from __future__ import annotations

import io
import json
import socket

import treq
import ujson
from prometheus_client import generate_latest
from twisted.internet import reactor
from twisted.internet.testing import MemoryReactorClock
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.http_headers import Headers
from twisted.web.server import Site

from tests.helpers import UPSTREAM_URL, InMemoryRelay, encode, messages_body
from twisted_relay.app import _retry_after
from twisted_relay.config import RelayConfig, one_upstream
from twisted_relay.logs import json_stdout
from twisted_relay.service import Relay
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.site import RelaySite
from twisted_relay.upstream import display_url


class MetricsTests(SynchronousTestCase):
    """
    The metrics say what the relay did: requests by route and status, ids
    rewritten, repairs.
    """

    def test_rewrites_and_requests_counted(self):
        """
        A streamed answer whose id collides with the history is counted as a
        rewrite, and the request as a 200 on the messages route.
        """
        clock = MemoryReactorClock()
        sim = SimulatedUpstream(mode="strict", seed=2, reuse_every=1, reactor=clock)
        relay = InMemoryRelay(
            sim.resource(), RelayConfig(listen=(), upstreams=one_upstream(UPSTREAM_URL), dump_dir=None), clock=clock
        )
        history = [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_01AAAAAAAAAAAAAAAAAAAAAA",
                        "name": "get_weather",
                        "input": {},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01AAAAAAAAAAAAAAAAAAAAAA", "content": "ok"}
                ],
            },
        ]
        d = relay.post("/v1/messages", messages_body(history, stream=True))
        # The request reaches the relay, which sends it upstream (not answered yet).
        relay.network.flush()
        during = generate_latest(relay.app.metrics.registry).decode()
        self.assertIn("relay_active_requests 1.0", during)
        relay.flush()
        response = self.successResultOf(d)
        body = response.content()
        relay.flush()
        text = self.successResultOf(body).decode()
        self.assertIn("toolu_01AAAAAAAAAAAAAAAAAAAAAA-2", text)
        exposition = generate_latest(relay.app.metrics.registry).decode()
        self.assertIn('relay_ids_rewritten_total{block_type="tool_use"} 1.0', exposition)
        self.assertIn('relay_requests_total{route="messages",status="200"} 1.0', exposition)
        self.assertIn("relay_active_streams 0.0", exposition)
        self.assertIn("relay_active_requests 0.0", exposition)

    def test_repairs_counted(self):
        """
        A raw duplicate in the client's history, repaired on the way up, is
        counted.
        """
        relay = InMemoryRelay(SimulatedUpstream(mode="strict", seed=2).resource())
        use = {"type": "tool_use", "id": "toolu_dup", "name": "get_weather", "input": {}}
        history = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [use]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_dup", "content": "1"}],
            },
            {"role": "assistant", "content": [dict(use)]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_dup", "content": "2"}],
            },
        ]
        d = relay.post("/v1/messages", messages_body(history))
        relay.flush()
        self.assertEqual(self.successResultOf(d).code, 200)
        exposition = generate_latest(relay.app.metrics.registry).decode()
        self.assertIn("relay_repairs_total 1.0", exposition)


class RetryAfterTests(SynchronousTestCase):
    """
    The wait an upstream asks for is read from ``retry-after-ms`` or
    ``retry-after``, in seconds or as a date.
    """

    def test_forms(self):
        """
        Milliseconds win; seconds and HTTP dates are read; garbage is ignored.
        """
        self.assertEqual(_retry_after(Headers({b"retry-after-ms": [b"1500"], b"retry-after": [b"9"]})), 1.5)
        self.assertEqual(_retry_after(Headers({b"retry-after": [b"3"]})), 3.0)
        self.assertEqual(_retry_after(Headers({b"retry-after": [b"Thu, 01 Jan 1970 00:00:00 GMT"]})), 0.0)
        self.assertIsNone(_retry_after(Headers({b"retry-after": [b"soon"]})))
        self.assertIsNone(_retry_after(Headers()))


class DisplayURLTests(SynchronousTestCase):
    """
    An upstream URL with credentials in it never shows them in what the
    relay writes.
    """

    def test_credentials_removed(self):
        """
        ``user:password@`` is dropped, the rest kept.
        """
        self.assertEqual(
            display_url("https://me:s3cret@host.example:8443/base"), "https://host.example:8443/base"
        )
        self.assertEqual(display_url("https://host.example"), "https://host.example")


class JSONLogTests(SynchronousTestCase):
    """
    ``twistd --logger twisted_relay.logs.json_stdout`` writes one JSON object
    a line with the event's named fields.
    """

    def test_json_lines(self):
        """
        A relay log event comes out as JSON carrying its fields.
        """
        out = io.StringIO()
        self.patch(__import__("sys"), "stdout", out)
        observer = json_stdout()
        Logger(observer=observer).info(
            "{method} {path} {status}", method="POST", path="/v1/messages", status=200
        )
        line = out.getvalue().strip().strip("\x1e")
        event = json.loads(line)
        self.assertEqual((event["method"], event["status"]), ("POST", 200))


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


class SiteTests(TestCase):
    """
    The relay's ``Site`` guards the HTTP layer, on real sockets.
    """

    def serve(self, **settings):
        sim_port = reactor.listenTCP(
            0, Site(SimulatedUpstream(mode="lenient").resource()), interface="127.0.0.1"
        )
        self.addCleanup(sim_port.stopListening)
        config = RelayConfig(
            listen=(), upstreams=one_upstream("http://127.0.0.1:%d" % (sim_port.getHost().port,)), dump_dir=None
        ).with_changes(**settings)
        relay = Relay(config, reactor)
        relay.service.startService()
        self.addCleanup(relay.service.stopService)
        site = RelaySite(
            relay.resource(), max_body=config.max_body, request_read_timeout=config.request_read_timeout
        )
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return port.getHost().port, relay

    async def test_declared_length_over_limit(self):
        """
        A body whose ``Content-Length`` is over ``max_body`` gets a 413
        ``request_too_large``; the relay does not store it.
        """
        port, _ = self.serve(max_body=1000)
        response = await treq.post(
            "http://127.0.0.1:%d/v1/messages" % (port,),
            data=encode(messages_body([{"role": "user", "content": "x" * 5000}])),
            headers={"content-type": ["application/json"]},
            persistent=False,
        )
        self.assertEqual(response.code, 413)
        body = ujson.loads(await response.content())
        self.assertEqual(body["error"]["type"], "request_too_large")

    async def test_chunked_body_over_limit(self):
        """
        A chunked body (no length declared) that grows past ``max_body`` also
        gets a 413.
        """
        port, _ = self.serve(max_body=1000)
        payload = encode(messages_body([{"role": "user", "content": "y" * 5000}]))

        def send():
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(
                    b"POST /v1/messages HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                )
                for i in range(0, len(payload), 700):
                    piece = payload[i : i + 700]
                    s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                s.sendall(b"0\r\n\r\n")
                answer = b""
                while True:
                    data = s.recv(65536)
                    if not data:
                        return answer
                    answer += data

        answer = await deferToThread(send)
        self.assertTrue(answer.startswith(b"HTTP/1.1 413"), answer[:80])
        self.assertIn(b'"request_too_large"', answer)

    async def test_metrics_page(self):
        """
        ``GET /metrics`` serves Prometheus' text format; ``--no-metrics``
        turns it off.
        """
        port, _ = self.serve()
        response = await treq.get("http://127.0.0.1:%d/metrics" % (port,), persistent=False)
        self.assertEqual(response.code, 200)
        self.assertIn(b"relay_requests_total", await response.content())
        port, _ = self.serve(metrics=False)
        response = await treq.get("http://127.0.0.1:%d/metrics" % (port,), persistent=False)
        self.assertEqual(response.code, 404)
        await response.content()

    async def test_ready(self):
        """
        ``GET /ready`` is 200 while the relay takes requests.
        """
        port, _ = self.serve()
        response = await treq.get("http://127.0.0.1:%d/ready" % (port,), persistent=False)
        self.assertEqual(response.code, 200)
        self.assertEqual(ujson.loads(await response.content())["status"], "ready")
