"""
What the relay opens or checks before it listens (issue 31): for each
resource, a ``twistd relay`` that cannot use it never accepts a connection
on its port, exits with status 1 and says so in one line, and leaves no
process behind (no daemon, no worker); an embedded relay's start raises
:class:`~twisted_relay.start_checks.StartupError` and listens on nothing.

The process tests run real ``twistd`` processes, each a second or so; the
resources are real ones (a closed port where a database or Redis should
be, a dump folder under a file, TLS files that do not load, a login's
variables not set).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

from twisted.internet import reactor
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.config import RelayConfig, one_upstream
from twisted_relay.service import Relay
from twisted_relay.signin.config import SignInConfig
from twisted_relay.start_checks import StartupError, run_start_checks, start_checks_for
from twisted_relay.workers import config_to_json

from tests import postgres_server, redis_server
from tests.helpers import free_port, self_signed_pem, twistd

#: Seconds a process that fails its start may take to end (it takes about one).
_END_WITHIN = 20.0

#: A ``[signin]`` table whose managed settings file is ``SETTINGS`` (the identity provider is never asked).
SIGNIN_TABLE = """
[signin]
public_url = "http://127.0.0.1:8080"
issuer = "http://127.0.0.1:9"
client_id = "twisted-relay"
session_secret = "a-session-secret-of-forty-characters-xx"
managed_settings = "SETTINGS"
"""


def _processes_in(folder: str) -> list[int]:
    """The processes whose working folder is ``folder``: a test's relay and anything it started there."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.path.realpath(os.readlink("/proc/%s/cwd" % (name,))) == folder:
                found.append(int(name))
        except OSError:
            continue  # gone, or another user's
    return found


class _StartRun:
    """One process run to its end while its port is tried: its status, output, and whether the port ever accepted."""

    def __init__(self, testcase: SynchronousTestCase, argv: list[str], port: int, *, folder: str | None = None,
                 env: dict | None = None):
        self.folder = folder or os.path.realpath(testcase.mktemp())
        os.makedirs(self.folder, exist_ok=True)
        output_path = os.path.realpath(testcase.mktemp())
        testcase.addCleanup(self._end_what_is_left)
        with open(output_path, "wb") as output:
            process = subprocess.Popen(argv, cwd=self.folder, stdout=output, stderr=subprocess.STDOUT, env=env)
            self.accepted = False
            deadline = time.monotonic() + _END_WITHIN
            while process.poll() is None and time.monotonic() < deadline and not self.accepted:
                self.accepted = _accepts(port)
                time.sleep(0.02)
            if process.poll() is None:
                process.kill()
            self.status = process.wait()
        with open(output_path, "rb") as output:
            self.output = output.read().decode("utf-8", "replace")
        self.left = _processes_in(self.folder)

    def _end_what_is_left(self) -> None:
        for pid in _processes_in(self.folder):
            try:
                os.kill(pid, 9)
            except OSError:
                pass


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class TwistdStartTests(SynchronousTestCase):
    """``twistd relay`` and each resource it cannot use: refused before it listens."""

    def refused(self, *args: str, says: str, listen: int | None = None, twistd_options=("-n",), folder=None,
                upstream=("--upstream", "http://127.0.0.1:9")) -> _StartRun:
        """
        Run ``twistd [twistd_options] relay ARGS`` (with dumps on, their
        default, whose thread kept the process alive before) and check what
        any refused start must be; ``says``: how its one line begins after
        ``twistd relay: ``.
        """
        port = free_port()
        listen_args = () if listen is not None else ("--listen", "tcp:%d:interface=127.0.0.1" % (port,))
        run = _StartRun(
            self,
            twistd(*twistd_options, "--pidfile=relay.pid", "relay", *upstream, *listen_args, *args),
            listen if listen is not None else port,
            folder=folder,
        )
        self.assertFalse(run.accepted, "the port accepted a connection:\n" + run.output)
        self.assertEqual(run.status, 1, run.output)
        self.assertEqual(run.left, [], "a process was left:\n" + run.output)
        lines = run.output.splitlines()
        self.assertEqual(len(lines), 1, run.output)
        self.assertTrue(lines[0].startswith("twistd relay: " + says), run.output)
        self.assertFalse(os.path.exists(os.path.join(run.folder, "relay.pid")))
        return run

    def test_usage_ledger_sqlite(self):
        """An SQLite ledger in a folder that does not exist (the issue's first report)."""
        run = self.refused("--usage-db", "no/such/folder/ledger.sqlite", says="cannot open the usage ledger: sqlite:")
        self.assertIn("no/such/folder/ledger.sqlite", run.output)

    def test_usage_ledger_postgres(self):
        """A PostgreSQL ledger nobody answers for (the issue's second report): named, never its password."""
        if postgres_server.psycopg is None:
            self.skipTest("psycopg is not installed")
        url = "postgresql://relay:start-check-secret-5@127.0.0.1:%d/relay" % (free_port(),)
        run = self.refused("--usage-db", url, says="cannot open the usage ledger: postgresql://relay@127.0.0.1:")
        self.assertNotIn("start-check-secret-5", run.output)

    def test_thread_store(self):
        """A Redis thread store nobody answers for: named, never its password."""
        port = free_port()
        run = self.refused(
            "--thread-store", "redis://:store-secret-7@127.0.0.1:%d/2" % (port,),
            says="cannot reach the thread store: redis://127.0.0.1:%d/2: Connection refused" % (port,),
        )
        self.assertNotIn("store-secret-7", run.output)

    def test_dump_folder(self):
        """A dump folder that cannot be made (its parent is a file)."""
        folder = os.path.realpath(self.mktemp())
        os.makedirs(folder)
        open(os.path.join(folder, "taken"), "w").close()
        self.refused(
            "--dump-dir", "taken/dumps", folder=folder,
            says="cannot write dumps to %s: Not a directory" % (os.path.join(folder, "taken", "dumps"),),
        )

    def test_key_files(self):
        """A relay key file and an admin key file that cannot be read (read with the options)."""
        for option in ("--relay-keys", "--admin-keys"):
            self.refused(option, "missing-keys.txt", says="%s: cannot read 'missing-keys.txt'" % (option,))

    def test_config_file(self):
        """A configuration file missing, and one that is not TOML (read with the options)."""
        folder = os.path.realpath(self.mktemp())
        os.makedirs(folder)
        with open(os.path.join(folder, "broken.toml"), "w") as f:
            f.write("[relay\n")
        self.refused("--config", "missing.toml", says="missing.toml: cannot read it")
        self.refused("--config", "broken.toml", says="broken.toml:", folder=folder)

    def test_tls_files(self):
        """An ``ssl:`` endpoint whose key does not load, and one whose key is not its certificate's (a traceback before)."""
        folder = os.path.realpath(self.mktemp())
        os.makedirs(folder)
        marker = b"-----BEGIN RSA PRIVATE KEY-----"
        first, second = self_signed_pem("localhost"), self_signed_pem("localhost")
        files = {
            "cert.pem": first[: first.index(marker)],
            "other-key.pem": second[second.index(marker):],
            "garbage.pem": b"not a key\n",
        }
        for name, data in files.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        for key, says in (("garbage.pem", "TLS key or certificate:"), ("other-key.pem", "TLS key or certificate: Certificate public and private keys do not match")):
            port = free_port()
            listen = "ssl:%d:interface=127.0.0.1:privateKey=%s:certKey=cert.pem" % (port, key)
            run = self.refused("--listen", listen, listen=port, folder=folder, says="--listen %r: " % (listen,))
            self.assertIn(says, run.output)

    def test_upstream_login(self):
        """
        An upstream whose login cannot get its credentials (AWS keys from
        variables that are not set): named, and the relay does not start
        (it started, and failed that upstream's requests, before); set, the
        same configuration starts.
        """
        folder = os.path.realpath(self.mktemp())
        os.makedirs(folder)
        with open(os.path.join(folder, "relay.toml"), "w") as f:
            f.write(
                '[upstreams.bedrock]\nurl = "http://127.0.0.1:9"\nwire = "bedrock"\nregion = "us-east-1"\n'
                'login = { kind = "aws", access-key-id = "env:START_CHECK_KEY_ID", '
                'secret-access-key = "env:START_CHECK_SECRET" }\n'
            )
        self.refused(
            "--config", "relay.toml", folder=folder, upstream=(),
            says="cannot log in to upstream bedrock: AWS keys from $START_CHECK_KEY_ID, $START_CHECK_SECRET: "
                 "the environment variable START_CHECK_KEY_ID is not set",
        )
        port = free_port()
        env = dict(os.environ, START_CHECK_KEY_ID="AKIDEXAMPLE", START_CHECK_SECRET="start-check-secret-2")
        process = subprocess.Popen(
            twistd("-n", "--pidfile=", "relay", "--config", "relay.toml", "--no-dumps", "--drain-delay", "0",
                   "--listen", "tcp:%d:interface=127.0.0.1" % (port,)),
            cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.addCleanup(lambda: process.poll() is None and (process.kill(), process.wait()))
        deadline = time.monotonic() + _END_WITHIN
        while not _accepts(port) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertTrue(_accepts(port), "the relay did not start with its login's keys set")
        process.terminate()
        process.wait(timeout=_END_WITHIN)

    def test_managed_settings(self):
        """
        The ``[signin]`` table's managed settings file missing, and one that
        is not settings (a JSON array): named, and the relay does not start
        (it started, and answered 404 at ``/managed/settings``, before).
        """
        folder = os.path.realpath(self.mktemp())
        os.makedirs(folder)
        with open(os.path.join(folder, "array.json"), "w") as f:
            f.write("[1, 2]\n")
        for name, why in (("missing.json", "No such file or directory"), ("array.json", "must hold a JSON object")):
            with open(os.path.join(folder, "relay.toml"), "w") as f:
                f.write(SIGNIN_TABLE.replace("SETTINGS", name))
            run = self.refused(
                "--config", "relay.toml", folder=folder,
                says="cannot serve the managed settings: managed settings file %s: " % (os.path.join(folder, name),),
            )
            self.assertIn(why, run.output)

    def test_daemon(self):
        """Without ``-n`` (a daemon): the same one line and status, and no daemon left holding the port."""
        self.refused("--usage-db", "no/such/folder/ledger.sqlite", twistd_options=(), says="cannot open the usage ledger:")

    def test_workers(self):
        """With ``--workers 2``: the same, and no worker process started or left."""
        self.refused("--workers", "2", "--usage-db", "no/such/folder/ledger.sqlite", says="cannot open the usage ledger:")


class WorkerProcessStartTests(SynchronousTestCase):
    """A worker process tries the resources again before it shares the ports."""

    def test_ledger_gone_since_the_first_process_started(self):
        """
        A worker (``python -m twisted_relay.worker_process``) that cannot open
        the ledger: one line its first process logs, status 1, its port
        never accepting (it used to end with a traceback, after binding).
        """
        port = free_port()
        config = RelayConfig(
            listen=("tcp:%d:interface=127.0.0.1" % (port,),), upstreams=one_upstream("http://127.0.0.1:9"),
            usage_db="no/such/folder/ledger.sqlite",
        )
        env = dict(os.environ, TWISTED_RELAY_WORKER_CONFIG=config_to_json(config))
        run = _StartRun(self, [sys.executable, "-m", "twisted_relay.worker_process", "worker-1"], port, env=env)
        self.assertFalse(run.accepted, run.output)
        self.assertEqual(run.status, 1, run.output)
        self.assertEqual(run.left, [])
        (line,) = [line for line in run.output.splitlines() if "twistd relay" in line]
        self.assertTrue(line.startswith("twistd relay worker-1: cannot open the usage ledger: sqlite:"), run.output)
        self.assertNotIn("Traceback", run.output)


class EmbeddedStartTests(SynchronousTestCase):
    """A ``Relay`` in another application: its service's start raises, and nothing listens."""

    def relay(self, **settings) -> tuple[Relay, int]:
        port = free_port()
        settings.setdefault("listen", ("tcp:%d:interface=127.0.0.1" % (port,),))
        config = RelayConfig(upstreams=one_upstream("http://127.0.0.1:9"), dump_dir=self.mktemp(), **settings)
        return Relay(config, reactor), port

    def assertNothingRuns(self, relay: Relay, port: int) -> None:
        self.assertFalse(relay.service.running)
        self.assertFalse(_accepts(port))
        self.assertEqual([t.name for t in threading.enumerate() if "twisted-relay" in t.name], [])

    def test_ledger(self):
        """A ledger that cannot be opened: ``privilegedStartService`` and ``startService`` raise, one line."""
        relay, port = self.relay(usage_db="no/such/folder/ledger.sqlite")
        for start in (relay.service.privilegedStartService, relay.service.startService):
            error = self.assertRaises(StartupError, start)
            self.assertTrue(str(error).startswith("cannot open the usage ledger: sqlite:"), str(error))
            self.assertNotIn("\n", str(error))
            self.assertNothingRuns(relay, port)

    def test_tls_files(self):
        """A TLS key that does not load is the service's start error, not the constructor's."""
        folder = os.path.realpath(self.mktemp())
        os.makedirs(folder)
        key = os.path.join(folder, "garbage.pem")
        with open(key, "wb") as f:
            f.write(b"not a key\n")
        port = free_port()
        listen = "ssl:%d:interface=127.0.0.1:privateKey=%s:certKey=%s" % (port, key, key)
        relay, _ = self.relay(listen=(listen,))
        error = self.assertRaises(StartupError, relay.service.privilegedStartService)
        self.assertTrue(str(error).startswith("cannot listen on %s: TLS key or certificate:" % (listen,)), str(error))
        self.assertNothingRuns(relay, port)

    def test_managed_settings(self):
        """
        A managed settings file that is not settings: the service's start
        raises, one line; so does a start whose checks were made before
        (``twistd relay``'s) when the file went bad since: the relay's
        service reads it as it starts.
        """
        path = os.path.join(os.path.realpath(self.mktemp()))
        with open(path, "w") as f:
            f.write("not json")
        signin = SignInConfig(public_url="http://127.0.0.1:8080", issuer="http://127.0.0.1:9", client_id="twisted-relay",
                              session_secret="a-session-secret-of-forty-characters-xx", managed_settings=path)
        relay, port = self.relay(signin=signin)
        for start in (relay.service.privilegedStartService, relay.service.startService):
            error = self.assertRaises(StartupError, start)
            self.assertTrue(str(error).startswith("cannot serve the managed settings: managed settings file %s: not valid JSON" % (path,)),
                            str(error))
            self.assertNotIn("\n", str(error))
            self.assertNothingRuns(relay, port)
        checked = Relay(RelayConfig(listen=(), upstreams=one_upstream("http://127.0.0.1:9"), dump_dir=None, signin=signin),
                        reactor, start_checks=())
        error = self.assertRaises(StartupError, checked.service.startService)
        self.assertTrue(str(error).startswith("cannot serve the managed settings: "), str(error))

    def test_failure_after_the_checks_leaves_no_thread(self):
        """
        A ledger that fails only when the service opens it (the checks
        passed, or were made before, as ``twistd relay`` makes them): the
        start raises before any service that starts a thread (the dump
        writer's kept the process alive).
        """
        config = RelayConfig(
            listen=(), upstreams=one_upstream("http://127.0.0.1:9"), dump_dir=self.mktemp(),
            usage_db="no/such/folder/ledger.sqlite",
        )
        relay = Relay(config, reactor, start_checks=())
        self.assertRaises(StartupError, relay.service.startService)
        self.assertEqual([t.name for t in threading.enumerate() if "twisted-relay" in t.name], [])


class ThreadStoreCheckTests(SynchronousTestCase):
    """The thread store's start check against a real ``redis-server``."""

    if redis_server.SKIP_REASON is not None:
        skip = redis_server.SKIP_REASON

    def setUp(self):
        self.server = redis_server.RedisServer(password="check-secret-3")
        self.server.start()
        self.addCleanup(self.server.stop)

    def check(self, url: str) -> str | None:
        """The one line the check of ``url`` fails with, or ``None``."""
        config = RelayConfig(listen=(), dump_dir=None, thread_store=url)
        try:
            run_start_checks(start_checks_for(config, reactor))
        except StartupError as e:
            return str(e)
        return None

    def test_answers(self):
        """With its password (and a user, and a database), the store answers."""
        self.assertIsNone(self.check("redis://:check-secret-3@127.0.0.1:%d" % (self.server.port,)))
        self.assertIsNone(self.check("redis://default:check-secret-3@127.0.0.1:%d/3" % (self.server.port,)))

    def test_refusals(self):
        """No password, a wrong one, a database out of range: each named, the password never."""
        address = "127.0.0.1:%d" % (self.server.port,)
        for url, says in (
            ("redis://%s" % (address,), "refused PING: NOAUTH"),
            ("redis://:wrong-secret-9@%s" % (address,), "refused AUTH: WRONGPASS"),
            ("redis://:check-secret-3@%s/999" % (address,), "refused SELECT: ERR DB index is out of range"),
        ):
            line = self.check(url)
            self.assertIsNotNone(line, url)
            self.assertTrue(line.startswith("cannot reach the thread store: redis://%s" % (address,)), line)
            self.assertIn(says, line)
            self.assertNotIn("secret", line)


class SimulatedBedrockCheckTests(SynchronousTestCase):
    """``--simulate bedrock`` without botocore (the README's plain install): one line at start, not a 500 a request."""

    def test_botocore_missing(self):
        import sys

        from twisted_relay.config import RelayConfig
        from twisted_relay.start_checks import StartupError, run_start_checks, start_checks_for

        config = RelayConfig(listen=(), dump_dir=None, simulate="bedrock")
        # A module set to None in sys.modules cannot be imported: botocore as if not installed.
        import botocore.session

        sys.modules["botocore.session"] = None
        self.addCleanup(sys.modules.__setitem__, "botocore.session", botocore.session)
        with self.assertRaises(StartupError) as caught:
            run_start_checks(start_checks_for(config, logins=False))
        self.assertIn("cannot run the simulated Bedrock", str(caught.exception))
        self.assertIn("pip install 'twisted-relay[aws]'", str(caught.exception))
        self.assertEqual(len(str(caught.exception).splitlines()), 1)
