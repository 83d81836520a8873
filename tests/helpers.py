"""
Test helpers: the relay wired in memory, the relay served on 127.0.0.1 as
``twistd relay`` builds it (:func:`serve_relay`), and bodies of Messages
requests.

The in-memory relay is the production stack with its sockets in memory: the
relay's own ``RelaySite`` serves its Klein resource, its own
``UpstreamClient`` (treq, the relay's pool and connections) reaches the
upstream through an endpoint factory that connects in memory
(:class:`MemoryNetwork`, over ``twisted.test.iosim`` pumps), and the test
talks to the relay with treq over a Twisted ``Agent`` the same way. Nothing
is mocked; time is a ``MemoryReactorClock``.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import ujson
from twisted.application.internet import StreamServerEndpointService
from twisted.internet.address import IPv4Address
from twisted.internet.defer import fail, succeed
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.testing import MemoryReactorClock
from twisted.test import iosim
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.iweb import IAgentEndpointFactory
from twisted.web.server import Site
from treq.client import HTTPClient
from zope.interface import implementer

from twisted_relay.app import RelayApp
from twisted_relay.config import RelayConfig, one_upstream
from twisted_relay.service import Relay, StartupError
from twisted_relay.site import RelaySite
from twisted_relay.upstream import UpstreamClients
from twisted_relay.upstream_agent import BytesProducer

UPSTREAM_URL = "http://upstream.test"
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def twistd(*args: str) -> list[str]:
    """The command line of ``twistd ARGS`` with this interpreter."""
    return [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", *args]


def start_twistd(testcase, *args: str) -> tuple[subprocess.Popen, str]:
    """
    Start ``twistd ARGS`` in a new folder of ``testcase``, its output going
    to ``relay.log`` there; the process is killed at the test's cleanup if
    it still runs. Returns the process and the log's path.
    """
    folder = testcase.mktemp()
    os.makedirs(folder)
    log_path = os.path.join(folder, "relay.log")
    log = open(log_path, "wb")
    testcase.addCleanup(log.close)
    process = subprocess.Popen(twistd(*args), cwd=folder, stdout=log, stderr=subprocess.STDOUT)

    def stop():
        if process.poll() is None:
            process.kill()
            process.wait()

    testcase.addCleanup(stop)
    return process, log_path


def self_signed_pem(name: str) -> bytes:
    """A self-signed certificate and its key, as PEM (made with cryptography, on any Twisted)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )


def pids_answering(port: int, want: int, seconds: float = 30.0) -> set[int]:
    """The pids answering ``/health`` on ``port``, over fresh connections, until ``want`` are seen."""
    pids: set[int] = set()
    deadline = time.monotonic() + seconds
    while len(pids) < want and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/health" % (port,), timeout=2) as response:
                pids.add(ujson.loads(response.read())["pid"])
        except OSError:
            time.sleep(0.05)
    return pids


def messages_body(messages=None, *, stream=False, tools=True, **extra) -> dict:
    """A Messages request body."""
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 256,
        "messages": messages if messages is not None else [{"role": "user", "content": "Hello"}],
    }
    if tools:
        body["tools"] = TOOLS
    if stream:
        body["stream"] = True
    body.update(extra)
    return body


def encode(body) -> bytes:
    """Serialise a body the way a client would."""
    return ujson.dumps(body).encode("utf-8")


@implementer(IAgentEndpointFactory)
class MemoryNetwork:
    """
    Servers reached in memory: an endpoint factory (as ``Agent`` and the
    relay's upstream client take) whose endpoints connect a client protocol
    to a listening factory through an ``iosim`` pump, one per connection.

    :ivar connections: how many connections were made.
    """

    def __init__(self, clock):
        self.clock = clock
        self._servers: dict[tuple[bytes, int], object] = {}
        self._pumps: list = []
        self._ports = itertools.count(40000)
        self.connections = 0

    def listen(self, host: bytes, port: int, factory) -> None:
        """Serve ``factory`` at ``host:port``."""
        factory.doStart()
        self._servers[(host, port)] = factory

    def stop_listening(self, host: bytes, port: int) -> None:
        """Serve nothing at ``host:port`` any more: connections there are refused."""
        self._servers.pop((host, port)).doStop()

    def endpointForURI(self, uri):
        """The endpoint of ``uri``'s host and port."""
        return _MemoryEndpoint(self, uri.host, uri.port)

    def _connect(self, host: bytes, port: int, factory):
        server_factory = self._servers.get((host, port))
        if server_factory is None:
            return fail(ConnectionRefusedError("nothing listens at %r:%d in memory" % (host, port)))
        server_address = IPv4Address("TCP", "127.0.0.1", port)
        client_address = IPv4Address("TCP", "127.0.0.1", next(self._ports))
        client = factory.buildProtocol(server_address)
        server = server_factory.buildProtocol(client_address)
        client_io = iosim.FakeTransport(client, False, client_address, server_address)
        server_io = iosim.FakeTransport(server, True, server_address, client_address)
        self._pumps.append(iosim.connect(server, server_io, client, client_io, greet=False, clock=self.clock))
        self.connections += 1
        return succeed(client)

    def flush(self) -> bool:
        """Move bytes on every connection until none moves; return whether any did."""
        moved = False
        for pump in list(self._pumps):
            moved |= pump.flush()
            if pump.clientIO.disconnected and pump.serverIO.disconnected:
                self._pumps.remove(pump)
        return moved


class _MemoryEndpoint:
    def __init__(self, network: MemoryNetwork, host: bytes, port: int):
        self._network, self._host, self._port = network, host, port

    def connect(self, factory):
        return self._network._connect(self._host, self._port, factory)


class InMemoryRelay:
    """
    A relay in front of an upstream resource, both in memory, each served by
    a real site (the relay by its own ``RelaySite``).

    :ivar clock: the relay's reactor (timers).
    :ivar stub: a ``treq.HTTPClient`` to talk to the relay with.
    :ivar agent: a bare ``Agent`` to the relay (no cookies, no decoding).
    """

    def __init__(
        self, upstream_resource, config: RelayConfig | None = None, *, dumps=None, clock=None, more_upstreams=None,
        ledger=None,
    ):
        self.clock = clock if clock is not None else MemoryReactorClock()
        self.config = config or RelayConfig(listen=(), upstreams=one_upstream(UPSTREAM_URL), dump_dir=None)
        self.network = MemoryNetwork(self.clock)
        self.network.listen(b"upstream.test", 80, Site(upstream_resource, reactor=self.clock))
        # Each other upstream of the configuration at its own host (``http://NAME.test``).
        for host, resource in (more_upstreams or {}).items():
            self.network.listen(host, 80, Site(resource, reactor=self.clock))
        # One client per upstream, as the relay's service makes them.
        self.clients = UpstreamClients(self.clock, self.config, endpoint_factory=self.network)
        # The first upstream's client.
        self.client = self.clients[self.config.upstreams[0].name]
        self.app = RelayApp(self.config, self.clients, reactor=self.clock, dumps=dumps, ledger=ledger)
        # The site production builds (RelaySite.for_config), on the test's clock.
        self.site = RelaySite.for_config(self.app.resource(), self.config, reactor=self.clock)
        self.network.listen(b"relay.test", 80, self.site)
        self.agent = Agent.usingEndpointFactory(
            self.clock, self.network, pool=HTTPConnectionPool(self.clock, persistent=False)
        )
        # Bodies written at once, not by the global reactor's cooperator.
        self.stub = HTTPClient(self.agent, data_to_body_producer=BytesProducer)

    def flush(self, rounds: int = 30) -> None:
        """Move bytes both ways until nothing is left to move; then meter the answers that ended."""
        for _ in range(rounds):
            self.clock.advance(0)
            if not self.network.flush():
                self.clock.advance(0)
                if not self.network.flush():
                    break
        self.app.batch.run()

    def post(self, path: str, body, headers=None):
        """Start a POST; the returned Deferred fires after :meth:`flush`."""
        data = body if isinstance(body, bytes) else encode(body)
        all_headers = {"content-type": ["application/json"], "x-api-key": ["sk-test-client"]}
        all_headers.update(headers or {})
        return self.stub.request("POST", "http://relay.test" + path, data=data, headers=all_headers)

    def raw_post(self, path: str, body, headers=None):
        """A POST through the bare agent; fires with an ``IResponse``."""
        from twisted.web.http_headers import Headers

        all_headers = Headers({b"content-type": [b"application/json"]})
        for name, values in (headers or {}).items():
            all_headers.setRawHeaders(name, values)
        data = body if isinstance(body, bytes) else encode(body)
        return self.agent.request(b"POST", b"http://relay.test" + path.encode(), all_headers, BytesProducer(data))

    def get(self, path: str, headers=None):
        """Start a GET; the returned Deferred fires after :meth:`flush`."""
        return self.stub.request("GET", "http://relay.test" + path, headers=headers or {})


@dataclass(frozen=True)
class ServedRelay:
    """
    A relay serving on 127.0.0.1, built and started as ``twistd relay``
    builds and starts it.

    :ivar relay: the :class:`twisted_relay.service.Relay` (its ``app``,
        ``metrics``, ``dumps``, ``clients``, ``service``...).
    :ivar port: the TCP port it listens on.
    :ivar site: the site its listener serves (the one production builds).
    """

    relay: Relay
    port: int
    site: RelaySite

    @property
    def url(self) -> str:
        """The relay's base URL, ``http://127.0.0.1:PORT``."""
        return "http://127.0.0.1:%d" % (self.port,)


class RecordingLedger:
    """
    A ledger that keeps in a list every usage record the relay hands it
    (``record(UsageRecord)``, as the relay's ledgers take them), for tests
    to read.

    :ivar records: the :class:`~twisted_relay.usage.UsageRecord` handed over, in order.
    :ivar then: a ledger each record is handed on to (a real one), or ``None``.
    """

    def __init__(self):
        self.records: list = []
        self.then = None

    def record(self, row) -> None:
        """Keep ``row`` (and hand it on to :attr:`then`)."""
        self.records.append(row)
        if self.then is not None:
            self.then.record(row)

    def __getattr__(self, name):
        # The rest of a ledger (its totals, for the usage page) is the real one's.
        if name == "then" or self.then is None:
            raise AttributeError(name)
        return getattr(self.then, name)


def serve_relay(testcase, config: RelayConfig, reactor=None, *, ledger=None) -> ServedRelay:
    """
    Serve the relay of ``config`` on 127.0.0.1 the way ``twistd relay`` does:
    the public :class:`~twisted_relay.service.Relay` built from ``config``
    with its ``listen`` replaced by one free port on 127.0.0.1 (so the same
    ``RelaySite`` and the same services as production), its service started
    (privileged start, then start), and stopped, with its drain, at the
    test's cleanup unless the test stopped it already.

    :param ledger: where the relay hands each usage record (e.g. a
        :class:`RecordingLedger`).
    """
    if reactor is None:
        from twisted.internet import reactor
    for attempt in range(5):
        port = free_port()
        relay = Relay(config.with_changes(listen=("tcp:%d:interface=127.0.0.1" % (port,),)), reactor, ledger=ledger)
        try:
            relay.service.privilegedStartService()
            relay.service.startService()
        except StartupError:
            # Someone else took the port between the probe and the listen.
            if attempt == 4:
                raise
            continue
        break
    testcase.addCleanup(lambda: relay.service.stopService() if relay.service.running else None)
    (site,) = [service.factory for service in relay.service if isinstance(service, StreamServerEndpointService)]
    return ServedRelay(relay, port, site)


def serve_relay_over_simulated(testcase, mode: str = "lenient", **settings) -> ServedRelay:
    """
    A :class:`~twisted_relay.simulated.SimulatedUpstream` of ``mode`` served
    on 127.0.0.1 by a plain ``Site``, and the relay in front of it
    (:func:`serve_relay`, no dumps, ``settings`` changed); both stopped at
    the test's cleanup.
    """
    from twisted.internet import reactor

    from twisted_relay.simulated import SimulatedUpstream

    upstream = reactor.listenTCP(0, Site(SimulatedUpstream(mode=mode).resource()), interface="127.0.0.1")
    testcase.addCleanup(upstream.stopListening)
    url = "http://127.0.0.1:%d" % (upstream.getHost().port,)
    return serve_relay(testcase, RelayConfig(listen=(), upstreams=one_upstream(url), dump_dir=None).with_changes(**settings), reactor)


def readme() -> str:
    """The project's README, its lines joined (sentences wrap)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        return " ".join(f.read().split())


def check_cli_rounds(testcase, figures: dict, rounds: int, max_turns: int) -> None:
    """
    What every run of the real Claude Code CLI through the relay must show
    (``bench.claude_code.run_rounds``' figures): each round ended at its turn
    limit (the simulated model calls a tool whenever it has one) with no API
    error and not killed; as many tool calls as turns, each with its result,
    only the tools given; no id the CLI saw twice though the upstream reused
    some (the relay renamed them); a thinking block each turn; nothing
    reached outside 127.0.0.1.
    """
    for run in figures["rounds"]:
        testcase.assertFalse(run["timed_out"], run)
        testcase.assertIsNone(run["api_error_status"], run)
        testcase.assertEqual((run["subtype"], run["terminal_reason"]), ("error_max_turns", "max_turns"), run)
    testcase.assertEqual(figures["outside"], [])
    testcase.assertGreaterEqual(figures["tool_uses"], rounds * max_turns)
    testcase.assertEqual(figures["tool_results"], figures["tool_uses"])
    testcase.assertLessEqual(set(figures["tools"]), {"Read", "Glob"})
    testcase.assertEqual(figures["duplicate_ids"], 0)
    testcase.assertGreater(figures["ids_renamed"], 0)
    testcase.assertGreaterEqual(figures["thinking_blocks"], rounds * max_turns)
