"""
Nothing one client sends stalls the others (issue 22).

The timers that judge the upstream (its connect, its headers) are not
fooled by a relay that was itself busy: what the upstream did meanwhile is
read before they are judged. Real sockets on 127.0.0.1; the relay's reactor
is kept busy on purpose, inside a socket's read (where a large body's work
used to run), while an upstream served from a thread (which runs while the
reactor's thread sleeps) does its part.

The flood (:class:`FloodTests`): paced streams through the relay keep their
pace while large bodies of tiny messages arrive.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import TestCase
from twisted.web.client import URI
from twisted.web.http_headers import Headers

from tests.helpers import serve_relay
from twisted_relay.config import RelayConfig, one_upstream
from twisted_relay.upstream import UpstreamClient, read_body
from twisted_relay.upstream_agent import UpstreamEndpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sleep(seconds: float) -> Deferred:
    """A Deferred that fires ``seconds`` from now, on the reactor."""
    return deferLater(reactor, seconds, lambda: None)


class _Busy(Protocol):
    """Runs the factory's ``on_read`` inside the reactor's read of this connection."""

    def dataReceived(self, data):
        self.factory.on_read()


class BusyReactorTestCase(TestCase):
    """A connection whose read keeps the reactor busy (:meth:`busy_inside_a_read`)."""

    async def busy_inside_a_read(self, work) -> None:
        """
        Run ``work`` inside the reactor's read of a socket (after which the
        reactor runs its due timers before it reads its sockets again), and
        return once it has run.
        """
        done = Deferred()
        factory = Factory.forProtocol(_Busy)

        def on_read():
            work()
            done.callback(None)

        factory.on_read = on_read
        port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory)
        self.addCleanup(port.stopListening)
        client = await TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port).connect(
            Factory.forProtocol(Protocol)
        )
        self.addCleanup(client.transport.loseConnection)
        client.transport.write(b"x")
        await done

    def thread_upstream(self, on_request=None) -> str:
        """
        An HTTP upstream served from a thread: it calls ``on_request()`` as a
        request comes, then answers ``{"ok": true}``. Its URL.
        """

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                if on_request is not None:
                    on_request()
                body = b'{"ok": true}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()

        def stop():
            server.shutdown()
            server.server_close()
            thread.join(10)

        self.addCleanup(stop)
        return "http://127.0.0.1:%d" % (server.server_address[1],)


class UpstreamTimerTests(BusyReactorTestCase):
    """The connect and headers timers judge the upstream, not the relay's own pauses."""

    async def test_connect_made_while_busy(self):
        """
        A connection to the upstream started just before the relay is busy
        for longer than the connect timeout is made, not failed with
        "Timed out connecting": the reactor reads that it was made before the
        timer is judged.
        """
        port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Factory.forProtocol(Protocol))
        self.addCleanup(port.stopListening)
        endpoint = UpstreamEndpoints(reactor, 0.2).endpointForURI(
            URI.fromBytes(b"http://127.0.0.1:%d/" % (port.getHost().port,))
        )
        connecting = []

        def connect_then_work():
            connecting.append(endpoint.connect(Factory.forProtocol(Protocol)))
            time.sleep(0.5)

        await self.busy_inside_a_read(connect_then_work)
        connected = await connecting[0]
        connected.transport.loseConnection()

    async def test_headers_arrived_while_busy(self):
        """
        An upstream that answers at once while the relay is busy for longer
        than the response timeout gets its answer relayed, not a 504 "no
        response within": its headers are read before the timer is judged.
        """
        asked = threading.Event()
        url = self.thread_upstream(on_request=lambda: (asked.set(), time.sleep(0.1)))
        client = UpstreamClient(reactor, url, response_timeout=0.5)
        self.addCleanup(client.close)
        answer = client.request(b"POST", "/v1/messages", Headers({b"content-type": [b"application/json"]}), b"{}")
        for _ in range(1000):
            if asked.is_set():
                break
            await sleep(0.01)
        self.assertTrue(asked.is_set(), "the upstream was never asked")
        # The upstream answers 0.1 s after it was asked; the relay is busy
        # from now for a second, past the 0.5 s the headers may take.
        await self.busy_inside_a_read(lambda: time.sleep(1.0))
        response = await answer
        self.assertEqual(response.code, 200)
        self.assertEqual(json.loads(await read_body(response, reactor, None)), {"ok": True})


class FloodTests(TestCase):
    """
    Paced streams keep their pace while large bodies of tiny messages come
    (``bench/flood.py`` measures it from another process; the bench's
    ``flood`` scenario runs it at full size).
    """

    #: Paced streams, and the pace of their events (ms).
    STREAMS = 20
    PACE_MS = 50
    #: Large bodies, and their size: three 12 MB bodies of tiny messages,
    #: parsed and translated in the reactor one after the other, stop every
    #: stream for well over a second before this work (three 8 MB ones: 0.77 s
    #: on the machine of docs/benchmarks.md, three 4 MB ones 0.39 s); now
    #: 80 to 100 ms on a quiet machine.
    BODIES = 3
    BODY_BYTES = 12_000_000
    #: How much longer than its pace a stream's gap between two events may
    #: grow. The bench holds the issue's 250 ms (docs/benchmarks.md, flood);
    #: here the suite may run beside another trial worker on two cores, which
    #: took a gap to 367 ms once with 8 MB bodies, so the test asks what it is
    #: for: that no body stops the others for anything near the time its work
    #: takes (over a second).
    GAP_ALLOWED_MS = 550

    async def test_paced_streams_keep_their_pace(self):
        """
        While three 12 MB bodies of about 135,000 tiny tool_use / tool_result
        messages each arrive at once, no paced stream through the same relay
        waits more than 550 ms beyond its pace between two events, or for
        its first one, and every large body gets an answer (200, or 529 when
        the relay had no room for it), none a 504.
        """
        upstream = await self.fake_upstream()
        config = RelayConfig(listen=(), upstreams=one_upstream(upstream), dump_dir=None, ping_interval=0)
        served = serve_relay(self, config)
        out, err, code = await getProcessOutputAndValue(
            sys.executable,
            [os.path.join(ROOT, "bench", "flood.py"), "--port", str(served.port),
             "--streams", str(self.STREAMS), "--pace-ms", str(self.PACE_MS), "--events", "20",
             "--bodies", str(self.BODIES), "--body-bytes", str(self.BODY_BYTES), "--warmup", "1",
             "--timeout", "60"],
            env=dict(os.environ), path=ROOT,
        )
        self.assertEqual(code, 0, err.decode(errors="replace")[-2000:])
        figures = json.loads(out.decode().strip().splitlines()[-1])
        paced = figures["paced"]
        self.assertGreater(paced["streams"], self.STREAMS)
        self.assertEqual(paced["errors"], 0, paced)
        allowed = self.PACE_MS + self.GAP_ALLOWED_MS
        self.assertLessEqual(paced["worst_gap_ms"], allowed, figures)
        self.assertLessEqual(paced["worst_first_event_ms"], allowed, figures)
        statuses = figures["bodies"]["statuses"]
        self.assertEqual(sum(statuses.values()), self.BODIES, figures)
        self.assertTrue(set(statuses) <= {"200", "529"}, figures)
        self.assertIn("200", statuses, figures)

    async def fake_upstream(self) -> str:
        """The bench's fake upstream (paced streams; a large body costs it one scan), in its own process."""
        import subprocess

        port_file = self.mktemp()
        process = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "bench", "fake_upstream.py"), "--port", "0", "--port-file", port_file],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

        def stop():
            process.terminate()
            process.wait(10)

        self.addCleanup(stop)
        for _ in range(200):
            if os.path.exists(port_file) and open(port_file).read().strip():
                return "http://127.0.0.1:%d" % (int(open(port_file).read()),)
            await sleep(0.05)
        self.fail("the fake upstream did not start")
