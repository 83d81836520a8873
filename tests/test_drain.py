"""
Tests for the drain a load balancer can see: on stop, ``/ready`` says 503 at
once while the relay goes on accepting for ``drain_delay`` seconds; requests
on connections kept alive are served, each with ``Connection: close``; the
requests in flight finish; then the relay stops accepting. ``/ready`` is 200
while the relay takes requests; an error answer during a drain still says
``Connection: close``; the grace period bounds a client that stopped reading.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import treq
import ujson
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase, TestCase

from twisted_relay.config import RelayConfig
from twisted_relay.service import Relay
from twisted_relay.tap import Options

from .faulty_upstream import RawBytes, Stream, parse_response, sse_events
from .helpers import encode, messages_body, serve_relay, serve_relay_over_simulated
from .test_faults import FaultTestCase, wait_for


class _Connection:
    """One client connection, kept alive between requests, read with ``http.client``'s parser."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    def ask(self, method: str, path: str, body: bytes | None = None) -> tuple[int, dict, bytes]:
        """Send one request; return the answer's status, headers (lower-case names) and body."""
        head = "%s %s HTTP/1.1\r\nHost: relay\r\nanthropic-version: 2023-06-01\r\n" % (method, path)
        if body is not None:
            head += "content-type: application/json\r\ncontent-length: %d\r\n" % (len(body),)
        self.sock.sendall(head.encode("ascii") + b"\r\n" + (body or b""))
        response = http.client.HTTPResponse(self.sock)
        response.begin()
        data = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data

    def closed_by_relay(self) -> bool:
        """Whether the relay has closed this connection (end of file within 5 s)."""
        self.sock.settimeout(5)
        try:
            return self.sock.recv(1) == b""
        except OSError:
            return False

    def close(self) -> None:
        self.sock.close()


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


class DrainTests(TestCase):
    """The relay's own listener, the embedded simulated upstream, real sockets on 127.0.0.1."""

    timeout = 30

    def start(self, drain_delay: float) -> Relay:
        config = RelayConfig(
            simulate="strict",
            simulate_options={"event_delay": 0.02},
            dump_dir=None,
            drain_delay=drain_delay,
            shutdown_grace=10,
        )
        served = serve_relay(self, config, reactor)
        self.port = served.port
        return served.relay

    def call(self, f, *args):
        return deferToThread(f, *args)

    async def stream_in_flight(self, relay: Relay):
        """
        Start a stream of about 30 events 20 ms apart on a new connection;
        return, once the relay has it in flight, the connection and what
        fires with its answer.
        """
        conn = await self.call(_Connection, self.port)
        self.addCleanup(conn.close)
        body = encode(messages_body(stream=True, tools=False, max_tokens=30))
        done = self.call(conn.ask, "POST", "/v1/messages", body)
        for _ in range(100):
            if relay.app.in_flight:
                break
            await deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(relay.app.in_flight, 1)
        return conn, done

    async def test_drain_visible_to_a_load_balancer(self):
        """
        On stop: ``/ready`` says 503 at once; during the delay a new
        connection is still accepted and served; a request on a connection
        kept alive since before is served with ``Connection: close`` and
        the connection then closes; a stream in flight ends whole; after
        the delay, connections are refused; the stop completes.
        """
        relay = self.start(drain_delay=2.0)
        kept = await self.call(_Connection, self.port)
        self.addCleanup(kept.close)
        status, headers, _ = await self.call(kept.ask, "GET", "/ready")
        self.assertEqual(status, 200)
        self.assertNotEqual(headers.get("connection"), "close")

        # In flight when the stop begins.
        streaming, stream_done = await self.stream_in_flight(relay)

        started = time.monotonic()
        stopped = relay.service.stopService()

        fresh = await self.call(_Connection, self.port)
        self.addCleanup(fresh.close)
        status, headers, body = await self.call(fresh.ask, "GET", "/ready")
        self.assertEqual((status, json.loads(body)["status"]), (503, "draining"))
        self.assertEqual(headers.get("connection"), "close")
        self.assertTrue(await self.call(fresh.closed_by_relay))

        status, headers, body = await self.call(
            kept.ask, "POST", "/v1/messages", encode(messages_body(tools=False))
        )
        self.assertEqual(status, 200)
        self.assertEqual(json.loads(body)["type"], "message")
        self.assertEqual(headers.get("connection"), "close")
        self.assertTrue(await self.call(kept.closed_by_relay))

        status, _, stream = await stream_done
        self.assertEqual(status, 200)
        self.assertIn(b"event: message_stop", stream)
        self.assertTrue(await self.call(streaming.closed_by_relay))

        # Still accepting within the delay.
        self.assertLess(time.monotonic() - started, 1.8)
        late = await self.call(_Connection, self.port)
        self.addCleanup(late.close)
        status, headers, _ = await self.call(late.ask, "GET", "/health")
        self.assertEqual((status, headers.get("connection")), (200, "close"))

        await stopped
        self.assertGreaterEqual(time.monotonic() - started, 2.0)
        self.assertTrue(await self.call(_refused, self.port))

    async def test_no_delay_stops_accepting_at_once(self):
        """
        With a drain delay of 0 the relay stops accepting as soon as it is
        told to stop (its port closes on the reactor's next turn), while a
        stream in flight goes on to its end.
        """
        relay = self.start(drain_delay=0)
        _, stream_done = await self.stream_in_flight(relay)
        stopped = relay.service.stopService()
        await deferLater(reactor, 0.05, lambda: None)
        self.assertTrue(await self.call(_refused, self.port))
        self.assertEqual(relay.app.in_flight, 1)
        status, _, stream = await stream_done
        self.assertEqual(status, 200)
        self.assertIn(b"event: message_stop", stream)
        await stopped


class DrainOptionTests(SynchronousTestCase):
    """``twistd relay --drain-delay``."""

    def test_default_and_values(self):
        """The delay is 5 s unless given; 0 is allowed; a negative or non-number is refused."""
        options = Options()
        options.parseOptions([])
        self.assertEqual(options.config.drain_delay, 5.0)
        options = Options()
        options.parseOptions(["--drain-delay", "0"])
        self.assertEqual(options.config.drain_delay, 0.0)
        for bad in ("-1", "soon"):
            with self.assertRaises(usage.UsageError):
                Options().parseOptions(["--drain-delay", bad])


class ReadyTests(TestCase):
    """``/ready`` while the relay takes requests, on real sockets."""

    def serve(self, **settings):
        served = serve_relay_over_simulated(self, "lenient", **settings)
        return served.port, served.relay

    async def test_ready(self):
        """
        ``GET /ready`` is 200 while the relay takes requests.
        """
        port, _ = self.serve()
        response = await treq.get("http://127.0.0.1:%d/ready" % (port,), persistent=False)
        self.assertEqual(response.code, 200)
        self.assertEqual(ujson.loads(await response.content())["status"], "ready")


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
        (request,) = self.relay.app.requests.active
        await wait_for(lambda: request.channel.transport.producerPaused)
        await self.relay.app.drain(0.2)
        await wait_for(lambda: self.relay.app.in_flight == 0, timeout=2)
        stalled.close()
        await self.assert_clean()
