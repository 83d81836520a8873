"""
The usage ledger across real processes: a relay killed with SIGKILL loses at
most the rows of its last flush interval and leaves SQLite whole; two relays
write one PostgreSQL ledger, every row of each kept through SIGTERM; a
ledger the relay cannot open, or a missing optional driver, stops
``twistd relay`` at start with one line.

The relays here are ``tests/ledger_writer.py`` processes (the production
``Relay`` and its ledger, recording a row every few milliseconds in place
of metering) and ``twistd relay`` itself.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request

from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.ledger_sql import open_ledger

from . import postgres_server
from .helpers import encode, free_port, messages_body, twistd
from .test_ledger import rows_in

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The writers' flush interval, and the slack a loaded machine may add
#: (scheduling, the write itself): the bound a test holds them to.
INTERVAL = 0.25
SLACK = 0.75


class _Writer:
    """One ``tests.ledger_writer`` process, its output in a file."""

    def __init__(self, testcase, name: str, *relay_options: str):
        folder = testcase.mktemp()
        os.makedirs(folder)
        self.output = os.path.join(folder, "out.txt")
        self.log = os.path.join(folder, "err.txt")
        environment = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(self.output, "wb") as out, open(self.log, "wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.ledger_writer", "--name", name, "--", *relay_options],
                cwd=ROOT, stdout=out, stderr=err, env=environment,
            )

        def end():
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()

        testcase.addCleanup(end)

    def lines(self) -> list[str]:
        with open(self.output, encoding="utf-8") as f:
            return f.read().splitlines()

    def recorded(self) -> dict[str, float]:
        """Each request id recorded so far, and when."""
        found = {}
        for line in self.lines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "recorded":
                found[parts[1]] = float(parts[2])
        return found

    def wait_for(self, condition, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline or self.process.poll() is not None and not condition():
                with open(self.log, encoding="utf-8", errors="replace") as f:
                    raise AssertionError("writer: not within %gs; its log:\n%s" % (timeout, f.read()[-3000:]))
            time.sleep(0.02)


def _ids(target: str) -> list[str]:
    return rows_in(target)


class _KillTests:
    """SIGKILL of a relay writing its ledger, on each database."""

    def new_target(self) -> str:
        raise NotImplementedError

    def kill_and_check(self, target: str, name: str) -> int:
        """Run a writer, SIGKILL it mid-run, and hold the ledger to the bound; return the rows it wrote."""
        writer = _Writer(self, name, "--usage-db", target, "--usage-flush-interval", str(INTERVAL))
        writer.wait_for(lambda: len(writer.recorded()) >= 200)
        killed_at = time.time()
        os.kill(writer.process.pid, signal.SIGKILL)
        writer.process.wait()
        recorded = writer.recorded()
        stored = [row for row in _ids(target) if row.startswith(name + "-")]
        # Written in order, whole batches: the rows kept are the first ones recorded.
        self.assertEqual(stored, sorted(recorded)[: len(stored)])
        self.assertGreater(len(stored), 0)
        lost = [recorded[i] for i in recorded if i not in set(stored)]
        # What was lost had been recorded within the last interval (and the slack) before the kill.
        self.assertTrue(
            all(at >= killed_at - INTERVAL - SLACK for at in lost),
            "lost rows recorded %.3fs before the kill" % (killed_at - min(lost, default=killed_at),),
        )
        return len(stored)

    def test_sigkill_loses_at_most_the_interval(self):
        """
        A relay killed outright loses only the rows recorded in its last
        flush interval; the ledger stays whole, and the next relay writes
        to it as before.
        """
        target = self.new_target()
        first = self.kill_and_check(target, "first")
        second = self.kill_and_check(target, "second")
        self.assertEqual(len(_ids(target)), first + second)
        self.check_whole(target)
        database = open_ledger(target)
        self.addCleanup(database.close)
        database.open()
        self.assertEqual(database.totals()[0].requests, first + second)

    def check_whole(self, target: str) -> None:
        pass


class SQLiteKillTests(_KillTests, SynchronousTestCase):
    """SIGKILL over an SQLite ledger."""

    def new_target(self) -> str:
        folder = os.path.abspath(self.mktemp())
        os.makedirs(folder)
        return os.path.join(folder, "usage.sqlite")

    def check_whole(self, target: str) -> None:
        """The file (and its write-ahead log, left by the kill) passes SQLite's integrity check."""
        with sqlite3.connect(target) as connection:
            self.assertEqual(connection.execute("PRAGMA integrity_check").fetchall(), [("ok",)])


class PostgresProcessTests(_KillTests, SynchronousTestCase):
    """Relays writing one PostgreSQL ledger."""

    skip = postgres_server.SKIP_REASON

    def setUp(self):
        self.server = postgres_server.shared_server()

    def new_target(self) -> str:
        return self.server.new_database()

    def test_two_relays_one_ledger(self):
        """
        Two relays (each relaying as usual) write one ledger; stopped with
        SIGTERM, each writes its queued rows before it exits: every row
        recorded by either is there, once.
        """
        target = self.new_target()
        ports = [free_port(), free_port()]
        writers = [
            _Writer(self, name, "--usage-db", target, "--usage-flush-interval", "0.2",
                    "--listen", "tcp:%d:interface=127.0.0.1" % (port,))
            for name, port in zip(("relay-a", "relay-b"), ports)
        ]
        for writer in writers:
            writer.wait_for(lambda writer=writer: "started" in writer.lines())
        relayed = []
        for port in ports:
            request = urllib.request.Request(
                "http://127.0.0.1:%d/v1/messages" % (port,), data=encode(messages_body()),
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as answer:
                self.assertEqual(answer.status, 200)
                # Metered by the relay itself (no relay keys: no key name).
                relayed.append(answer.headers["x-relay-request-id"])
        for writer in writers:
            writer.wait_for(lambda writer=writer: len(writer.recorded()) >= 100)
        for writer in writers:
            writer.process.send_signal(signal.SIGTERM)
        for writer in writers:
            writer.process.wait(timeout=60)
            self.assertIn("stopped", writer.lines())
        recorded = sorted([*writers[0].recorded(), *writers[1].recorded(), *relayed])
        self.assertEqual(_ids(target), recorded)
        database = open_ledger(target, create=False)
        self.addCleanup(database.close)
        by_key = {t.group["key"]: t.requests for t in database.totals(["key"])}
        self.assertEqual(
            by_key, {"relay-a": len(writers[0].recorded()), "relay-b": len(writers[1].recorded()), None: len(relayed)}
        )


    def test_every_worker_writes(self):
        """
        ``twistd relay --workers 2 --usage-db postgresql://...``: each process
        opens the ledger itself (one connection each), and lets go on SIGTERM.
        """
        target = self.new_target()
        database = target.rsplit("/", 1)[1]
        folder = self.mktemp()
        os.makedirs(folder)
        process = subprocess.Popen(
            twistd("-n", "--pidfile=", "relay", "--simulate", "strict", "--no-dumps", "--drain-delay", "0",
                   "--workers", "2", "--listen", "tcp:%d:interface=127.0.0.1" % (free_port(),), "--usage-db", target),
            cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        self.addCleanup(lambda: process.poll() is None and (process.kill(), process.wait()))

        def connections() -> int:
            with postgres_server.psycopg.connect(self.server.url()) as connection:
                return connection.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'twisted-relay' AND datname = %s",
                    (database,),
                ).fetchone()[0]

        deadline = time.monotonic() + 60
        while connections() < 2 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        self.assertEqual(connections(), 2)
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0].decode("utf-8", "replace")
        # (twistd ends itself with the signal that stopped it.)
        self.assertIn(process.returncode, (0, -signal.SIGTERM), output)
        self.assertNotIn(postgres_server.PASSWORD, output)
        self.assertEqual(output.count("Usage ledger: postgresql://relay@127.0.0.1:%d/" % (self.server.port,)), 2)
        # The server forgets a closed connection a moment after the client's exit (under load, not at once).
        deadline = time.monotonic() + 10
        while connections() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertEqual(connections(), 0)


class StartErrorTests(SynchronousTestCase):
    """A ledger ``twistd relay`` cannot open, or a driver it lacks: one line, exit status 1."""

    def run_relay(self, *args: str, hide: str | None = None) -> tuple[int, str]:
        folder = self.mktemp()
        os.makedirs(folder)
        command = twistd("-n", "--pidfile=", "relay", "--simulate", "strict", "--no-dumps",
                         "--listen", "tcp:0:interface=127.0.0.1", *args)
        if hide is not None:
            # The interpreter as it is when the package is not installed: importing it fails.
            command[2] = "import sys; sys.modules[%r] = None; %s" % (hide, command[2])
        result = subprocess.run(command, cwd=folder, capture_output=True, timeout=60)
        return result.returncode, (result.stdout + result.stderr).decode("utf-8", "replace")

    def assertOneLine(self, output: str, expected: str) -> None:
        self.assertNotIn("Traceback", output)
        errors = [line for line in output.splitlines() if "twistd relay:" in line]
        self.assertEqual(len(errors), 1, output)
        self.assertIn(expected, errors[0])

    def test_unreachable_postgres(self):
        """A PostgreSQL server that does not answer: one line naming it, never its password."""
        url = "postgresql://relay:start-secret-4k@127.0.0.1:%d/relay" % (free_port(),)
        status, output = self.run_relay("--usage-db", url)
        self.assertEqual(status, 1, output)
        self.assertOneLine(output, "twistd relay: cannot open the usage ledger: postgresql://relay@127.0.0.1:")
        self.assertNotIn("start-secret-4k", output)

    def test_sqlite_in_a_missing_folder(self):
        """An SQLite file in a folder that does not exist: one line naming it."""
        status, output = self.run_relay("--usage-db", "no/such/folder/usage.sqlite")
        self.assertEqual(status, 1, output)
        self.assertOneLine(output, "twistd relay: cannot open the usage ledger: sqlite:")
        self.assertIn("no/such/folder/usage.sqlite", output)

    def test_missing_postgres_driver(self):
        """``--usage-db postgresql://`` without psycopg names the extra to install, and the password nowhere."""
        status, output = self.run_relay("--usage-db", "postgresql://relay:driver-secret-8@127.0.0.1:1/relay",
                                        hide="psycopg")
        self.assertEqual(status, 1, output)
        self.assertOneLine(output, "pip install 'twisted-relay[postgres]'")
        self.assertNotIn("driver-secret-8", output)

    def test_missing_redis_driver(self):
        """``--thread-store redis://`` without txredisapi names the extra to install (it was a traceback)."""
        status, output = self.run_relay("--thread-store", "redis://127.0.0.1:1", hide="txredisapi")
        self.assertEqual(status, 1, output)
        self.assertOneLine(output, "pip install 'twisted-relay[redis]'")
