"""
Tests for worker processes: shared listening ports, the workers' life
(started, restarted, stopped with the first process) and their configuration.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.request

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase, TestCase

from twisted_relay.config import RelayConfig
from twisted_relay.tap import Options
from twisted_relay.workers import config_from_json, config_to_json, listen_reuseport

from .helpers import free_port, pids_answering, start_twistd


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie has ended)."""
    try:
        with open("/proc/%d/status" % (pid,)) as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


class _Count(Protocol):
    def connectionMade(self):
        self.factory.accepted.append(self.factory.name)
        self.transport.loseConnection()


class ReusePortTests(TestCase):
    """Two listeners on one port, as two workers have."""

    async def test_both_listeners_accept(self):
        ports = []
        accepted = []
        first = None
        for name in ("a", "b"):
            factory = Factory.forProtocol(_Count)
            factory.name, factory.accepted = name, accepted
            port = listen_reuseport(
                reactor, "tcp:%d:interface=127.0.0.1" % (first or 0,), factory
            )
            first = first or port.getHost().port
            ports.append(port)
            self.addCleanup(port.stopListening)
        self.assertEqual(ports[1].getHost().port, first)
        for _ in range(60):
            with socket.create_connection(("127.0.0.1", first)):
                pass
        while len(accepted) < 60:
            d = Deferred()
            reactor.callLater(0.01, d.callback, None)
            await d
        # The kernel spreads connections over both: 60 to one alone is 2**-59.
        self.assertEqual(set(accepted), {"a", "b"})

    def test_only_tcp(self):
        self.assertRaises(ValueError, listen_reuseport, reactor, "unix:/tmp/relay-test.sock", Factory())


class TCPPartsTests(SynchronousTestCase):
    """Workers read ``tcp:``/``tcp6:`` endpoint strings themselves, as Twisted reads them."""

    def test_forms(self):
        """Positional and named parts, escapes and defaults give the address to bind."""
        from twisted_relay.workers import tcp_listen_parts

        cases = {
            "tcp:8080": (socket.AF_INET, 8080, "", 50),
            "tcp:port=8080:interface=127.0.0.1": (socket.AF_INET, 8080, "127.0.0.1", 50),
            "tcp6:8443:interface=\\:\\:1:backlog=100": (socket.AF_INET6, 8443, "::1", 100),
            "tcp:0:127.0.0.1:7": (socket.AF_INET, 0, "127.0.0.1", 7),
            "tcp:backlog=5:port=1": (socket.AF_INET, 1, "", 5),
        }
        for description, expected in cases.items():
            self.assertEqual(tcp_listen_parts(description), expected, description)

    def test_refused(self):
        """Other endpoints, and malformed ones, are refused with a ValueError."""
        from twisted_relay.workers import tcp_listen_parts

        for description in ("unix:/tmp/x.sock", "ssl:443", "tcp:", "tcp:1:a:2:3", "tcp:1:nope=2", "tcp:x"):
            self.assertRaises(ValueError, tcp_listen_parts, description)


class WorkerConfigTests(SynchronousTestCase):
    def test_round_trip(self):
        """A worker gets the whole configuration, tuples and all."""
        config = RelayConfig(
            listen=("tcp:1:interface=127.0.0.1", "tcp6:2:interface=\\:\\:1"),
            relay_keys=("k1", "k2"),
            retry_statuses=(429, 529),
            simulate="strict",
            simulate_options={"seed": 3},
            workers=4,
            dump_dir=None,
        )
        self.assertEqual(config_from_json(config_to_json(config)), config)

    def test_options(self):
        options = Options()
        options.parseOptions(["--workers", "3"])
        self.assertEqual(options.config.workers, 3)
        for bad in (["--workers", "0"], ["--workers", "x"], ["--workers", "2", "--listen", "unix:/tmp/r.sock"]):
            self.assertRaises(usage.UsageError, Options().parseOptions, bad)


class WorkerProcessTests(SynchronousTestCase):
    """
    ``twistd -n relay --workers 2`` on a real socket: two processes answer on
    one port, a worker that dies is started again, and stopping the first
    process stops every worker.
    """

    def setUp(self):
        self.port = free_port()
        self.relay, self.log_path = start_twistd(
            self,
            "-n", "--pidfile=", "relay",
            "--simulate", "strict", "--workers", "2", "--no-dumps",
            "--listen", "tcp:%d:interface=127.0.0.1" % (self.port,),
        )

    def test_workers_share_serve_restart_and_stop(self):
        pids = pids_answering(self.port, 2, seconds=20)
        self.assertEqual(len(pids), 2, open(self.log_path, "rb").read().decode(errors="replace")[-2000:])
        self.assertIn(self.relay.pid, pids)
        (worker,) = pids - {self.relay.pid}

        # A whole Messages request through whichever process answers.
        body = json.dumps(
            {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
        ).encode()
        for _ in range(10):
            request = urllib.request.Request(
                "http://127.0.0.1:%d/v1/messages" % (self.port,),
                data=body,
                headers={"content-type": "application/json", "anthropic-version": "2023-06-01"},
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                self.assertEqual(response.status, 200)
                self.assertEqual(json.loads(response.read())["type"], "message")

        # A worker that dies is started again.
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = pids_answering(self.port, 2, seconds=20)
        self.assertEqual(len(pids), 2)
        (new_worker,) = pids - {self.relay.pid}
        self.assertNotEqual(new_worker, worker)

        # Stopping the first process stops its workers.
        self.relay.send_signal(signal.SIGTERM)
        # twistd ends by the signal it was stopped with, once shut down cleanly.
        self.assertIn(self.relay.wait(timeout=30), (0, -signal.SIGTERM))
        deadline = time.monotonic() + 10
        while _alive(new_worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(_alive(new_worker))
        log = open(self.log_path, "rb").read()
        # Worker log events reach the first process's log, tagged.
        self.assertIn(b"[worker-1]", log)
        self.assertIn(b"POST /v1/messages 200", log)
        self.assertIn(b"Server Shut Down.", log)

    def test_workers_stop_when_the_first_process_vanishes(self):
        """A worker whose first process is killed outright stops by itself."""
        pids = pids_answering(self.port, 2, seconds=20)
        self.assertEqual(len(pids), 2)
        (worker,) = pids - {self.relay.pid}
        self.relay.kill()
        self.relay.wait()
        deadline = time.monotonic() + 15
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(_alive(worker))


_RELOAD_CONFIG = """
[relay]
no-dumps = true

[upstreams.local]
url = "http://127.0.0.1:9"
keys = ["sk-ant-worker-reload-secret"]

[[routes]]
targets = [{ upstream = "local", model = "MODEL" }]
"""


class WorkerReloadTests(SynchronousTestCase):
    """
    ``twistd -n relay --config FILE --workers 2``: SIGHUP to the first
    process reloads every process; an invalid file is refused by the first
    process and the workers keep running as they were.
    """

    def test_every_process_reloads(self):
        """
        A valid file is taken by the first process and then by the worker
        (told by SIGHUP); an invalid one is refused with one log line, and no
        worker is disturbed.
        """
        port = free_port()
        config_path = os.path.abspath(self.mktemp() + ".toml")
        with open(config_path, "w") as f:
            f.write(_RELOAD_CONFIG.replace("MODEL", "one"))
        relay, log_path = start_twistd(
            self,
            "-n", "--pidfile=", "relay", "--config", config_path, "--workers", "2",
            "--listen", "tcp:%d:interface=127.0.0.1" % (port,),
        )

        def read() -> bytes:
            with open(log_path, "rb") as f:
                return f.read()

        def wait_for(text: bytes, count: int = 1) -> bytes:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                content = read()
                if content.count(text) >= count:
                    return content
                time.sleep(0.05)
            self.fail("%r not logged %d times:\n%s" % (text, count, read().decode(errors="replace")[-3000:]))

        wait_for(b"[worker-1] RelaySite starting on %d" % (port,))
        with open(config_path, "w") as f:
            f.write(_RELOAD_CONFIG.replace("MODEL", "two"))
        relay.send_signal(signal.SIGHUP)
        wait_for(b"Configuration reloaded", 2)
        content = wait_for(b"[worker-1] Configuration reloaded")

        with open(config_path, "w") as f:
            f.write(_RELOAD_CONFIG.replace('upstream = "local"', 'upstream = "lokal"'))
        relay.send_signal(signal.SIGHUP)
        content = wait_for(b"Configuration not reloaded")
        self.assertEqual(content.count(b"Configuration not reloaded"), 1)
        self.assertIn(b"[[routes]] #1 targets #1 upstream: no upstream is named lokal", content)
        self.assertNotIn(b"[worker-1] Relay worker-1 ended", content)
        self.assertNotIn(b"ended (", content)

        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=30)
        content = read()
        self.assertNotIn(b"sk-ant-worker-reload-secret", content)
        self.assertNotIn(b"Traceback", content)
        # A worker listens where the first process bound, by design: no restart to ask for.
        self.assertNotIn(b"take effect only at restart", content)
