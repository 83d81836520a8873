"""
Tests for running the relay as a service, as a new user would: ``twistd
relay`` as its own process on 127.0.0.1, its JSON log as a log shipper
reads it, its start-up line, its start-up failures, and twistd's pidfile.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import sqlite3
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.logs import event_as_json

from .helpers import free_port, pids_answering, start_twistd, twistd


def wait_until_up(port: int, process: subprocess.Popen, seconds: float = 20.0) -> None:
    """Wait until ``/health`` answers on ``port``; fail if the process ends first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError("the relay ended at start, status %s" % (process.returncode,))
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/health" % (port,), timeout=2):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the relay did not answer on port %d within %g s" % (port, seconds))


def stop(process: subprocess.Popen, seconds: float = 20.0) -> int:
    """SIGTERM, then SIGKILL after ``seconds``; the exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


def post(port: int, body: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    """POST a Messages body; the status and the body, errors included."""
    request = urllib.request.Request(
        "http://127.0.0.1:%d/v1/messages" % (port,),
        data=body,
        headers={"content-type": "application/json", "anthropic-version": "2023-06-01", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


_HELLO = json.dumps(
    {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
).encode()


class JSONLogRunTests(SynchronousTestCase):
    """``twistd -n --logger twisted_relay.logs.json_stdout relay``, read the way a log shipper does."""

    def test_every_line_is_json(self):
        """
        A whole run (start, answered and refused requests, an upstream 4xx
        dumped, SIGTERM, drain, stop): every line of standard output
        parses with ``json.loads`` into an object with an ISO 8601 time, a
        level and a message, and no Twisted internals; the start-up line
        names the listen address, the upstream, the id policy, whether keys
        are set, the dump folder and the workers; no key appears anywhere.
        """
        folder = os.path.abspath(self.mktemp())
        os.makedirs(folder)
        with open(os.path.join(folder, "keys"), "w") as f:
            f.write("relay-key-0123456789\n")
        port = free_port()
        out_path = os.path.join(folder, "out.log")
        with open(out_path, "wb") as out:
            process = subprocess.Popen(
                twistd(
                    "-n", "--pidfile=", "--logger", "twisted_relay.logs.json_stdout", "relay",
                    "--simulate", "strict", "--listen", "tcp:%d:interface=127.0.0.1" % (port,),
                    "--relay-keys", "keys", "--dump-dir", "dumps", "--drain-delay", "0.2",
                ),
                cwd=folder,
                stdout=out,
                stderr=subprocess.PIPE,
                env={**os.environ, "TWISTED_RELAY_UPSTREAM_KEY": "upstream-key-9876543210"},
            )
            self.addCleanup(lambda: process.poll() is None and (process.kill(), process.wait()))
            wait_until_up(port, process)
            key = {"x-api-key": "relay-key-0123456789"}
            self.assertEqual(post(port, _HELLO, key)[0], 200)
            self.assertEqual(post(port, _HELLO)[0], 401)
            self.assertEqual(post(port, b"{not json", key)[0], 400)
            # A history whose tool-use ids repeat: the strict upstream refuses it, the relay dumps it.
            duplicate = {"type": "tool_use", "id": "toolu_same", "name": "f", "input": {}}
            history = json.dumps({
                "model": "claude-sonnet-4-5", "max_tokens": 64,
                "messages": [
                    {"role": "user", "content": "go"},
                    {"role": "assistant", "content": [duplicate, duplicate]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_same", "content": "x"},
                        {"type": "tool_result", "tool_use_id": "toolu_same", "content": "y"},
                    ]},
                ],
            }).encode()
            post(port, history, key)
            self.assertIn(stop(process), (0, -signal.SIGTERM))
            errors = process.stderr.read()
            process.stderr.close()
        self.assertEqual(errors, b"")
        text = open(out_path, "rb").read().decode("utf-8")
        lines = text.splitlines()
        self.assertGreater(len(lines), 5)
        events = []
        for line in lines:
            event = json.loads(line)  # raises on any line that is not JSON
            self.assertIsInstance(event, dict)
            self.assertEqual(set(event) & {"log_logger", "log_flattened", "log_format", "__class_uuid__"}, set())
            self.assertFalse([k for k in event if k.startswith("log_")], event)
            self.assertRegex(event["time"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?\+00:00$")
            self.assertIn(event["level"], ("debug", "info", "warn", "error", "critical"))
            self.assertIsInstance(event["message"], str)
            events.append(event)
        self.assertNotIn("\x1e", text)
        self.assertNotIn("relay-key-0123456789", text)
        self.assertNotIn("upstream-key-9876543210", text)

        (start,) = [e for e in events if e["message"].startswith("twisted-relay ") and "listening on" in e["message"]]
        self.assertEqual(start["listen"], "tcp:%d:interface=127.0.0.1" % (port,))
        self.assertRegex(start["upstream"], r"^simulated:strict at http://127\.0\.0\.1:\d+$")
        self.assertEqual(start["upstream_ids"], "unique")
        self.assertIs(start["upstream_key_set"], True)
        self.assertEqual(start["relay_key_count"], 1)
        self.assertEqual(start["dump_dir"], os.path.join(folder, "dumps"))
        self.assertEqual(start["workers"], 1)
        # The relay's own request events keep their named fields.
        statuses = {e["status"] for e in events if e.get("method") == "POST" and "status" in e}
        self.assertEqual(statuses, {200, 400, 401})
        self.assertTrue(any(e["message"].startswith("Draining:") for e in events))


class JSONEventTests(SynchronousTestCase):
    """:func:`event_as_json` on odd events."""

    def test_odd_values_and_failures(self):
        """
        Values JSON cannot hold become their text; a failure adds its
        traceback; a legacy ``log.msg`` event gives its text as the message.
        """
        from twisted.logger import LogLevel
        from twisted.python.failure import Failure

        try:
            raise ZeroDivisionError("a failure to log")
        except ZeroDivisionError:
            failure = Failure()
        event = {
            "log_format": "odd {thing}", "log_level": LogLevel.error, "log_time": 0.0,
            "log_namespace": "t", "thing": object(), "nested": {"a": [1, {2}]}, "log_failure": failure,
        }
        record = json.loads(event_as_json(event))
        self.assertEqual(record["time"], "1970-01-01T00:00:00.000+00:00")
        self.assertEqual(record["level"], "error")
        self.assertTrue(record["message"].startswith("odd <object"))
        self.assertIsInstance(record["nested"], str)
        self.assertIn("ZeroDivisionError", record["traceback"])
        legacy = {"message": ("plain text",), "isError": 0, "system": "-", "time": 0.0,
                  "log_time": 0.0, "log_level": LogLevel.info, "log_format": "{log_text}", "log_text": "plain text"}
        record = json.loads(event_as_json(legacy))
        self.assertEqual(record["message"], "plain text")
        self.assertEqual(set(record), {"time", "level", "message", "namespace"})


class StartupFailureTests(SynchronousTestCase):
    """What a user can get wrong at start is one clear line, never a traceback."""

    def run_relay(self, *args: str, folder: str | None = None) -> tuple[int, str]:
        folder = folder or os.path.abspath(self.mktemp())
        os.makedirs(folder, exist_ok=True)
        result = subprocess.run(
            twistd("-n", "--pidfile=", "relay", "--simulate", "strict", *args),
            cwd=folder, capture_output=True, timeout=30,
        )
        return result.returncode, (result.stdout + result.stderr).decode("utf-8", "replace")

    def test_port_in_use(self):
        """
        A port already taken, with one process or with workers (whose
        dumps' thread must not keep the process alive): exit status 1 and
        one line naming the address and the reason.
        """
        for extra in ((), ("--workers", "2")):
            with socket.socket() as taken:
                taken.bind(("127.0.0.1", 0))
                taken.listen()
                port = taken.getsockname()[1]
                status, output = self.run_relay(
                    "--listen", "tcp:%d:interface=127.0.0.1" % (port,), *extra
                )
            self.assertEqual(status, 1, output)
            self.assertNotIn("Traceback", output)
            errors = [line for line in output.splitlines() if "twistd relay:" in line]
            self.assertEqual(len(errors), 1, output)
            self.assertIn(
                "twistd relay: cannot listen on tcp:%d:interface=127.0.0.1: Address already in use" % (port,),
                errors[0],
            )

    def test_unix_socket_in_a_missing_folder(self):
        """A unix socket whose folder does not exist: one line naming it."""
        status, output = self.run_relay("--listen", "unix:no/such/folder/relay.sock")
        self.assertEqual(status, 1)
        self.assertNotIn("Traceback", output)
        self.assertIn("twistd relay: cannot listen on unix:no/such/folder/relay.sock: No such file", output)

    def test_option_errors(self):
        """
        A bad option value, an unknown option, a missing TLS certificate, a
        ``systemd:`` address with no socket passed: exit status 1 and one
        line that says what is wrong (not twistd's whole help).
        """
        env_free = {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}
        cases = [
            (("--upstream", "ftp://example"), "--upstream must be an http:// or https:// URL"),
            (("--no-such-option",), "no-such-option"),
            (("--listen", "ssl:0:privateKey=missing.pem:certKey=missing.pem"), "No such file or directory"),
            (("--listen", "systemd:domain=INET:index=0"), "systemd passed no socket"),
        ]
        for args, words in cases:
            result = subprocess.run(
                twistd("-n", "--pidfile=", "relay", *args), capture_output=True, timeout=30, env=env_free,
            )
            output = (result.stdout + result.stderr).decode()
            self.assertEqual(result.returncode, 1, output)
            self.assertNotIn("Traceback", output)
            lines = output.splitlines()
            self.assertEqual(len(lines), 1, output)
            self.assertTrue(lines[0].startswith("twistd relay: "), output)
            self.assertIn(words, lines[0])


class PidfileTests(SynchronousTestCase):
    """Two relays in one folder, as docs/operations.md tells."""

    def test_second_relay_in_one_folder(self):
        """
        twistd's default pidfile (``twistd.pid``) keeps a second relay in the
        same folder from starting; with ``--pidfile=`` (or its own pidfile) it runs.
        """
        folder = os.path.abspath(self.mktemp())
        os.makedirs(folder)
        first_port, second_port = free_port(), free_port()
        common = ("relay", "--simulate", "strict", "--no-dumps", "--drain-delay", "0")
        first = subprocess.Popen(
            twistd("-n", *common, "--listen", "tcp:%d:interface=127.0.0.1" % (first_port,)),
            cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.addCleanup(lambda: first.poll() is None and (first.kill(), first.wait()))
        wait_until_up(first_port, first)
        refused = subprocess.run(
            twistd("-n", *common, "--listen", "tcp:%d:interface=127.0.0.1" % (second_port,)),
            cwd=folder, capture_output=True, timeout=30,
        )
        self.assertEqual(refused.returncode, 1)
        self.assertIn(b"Another twistd server is running", refused.stdout + refused.stderr)
        second = subprocess.Popen(
            twistd("-n", "--pidfile=second.pid", *common, "--listen", "tcp:%d:interface=127.0.0.1" % (second_port,)),
            cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.addCleanup(lambda: second.poll() is None and (second.kill(), second.wait()))
        wait_until_up(second_port, second)
        self.assertTrue(os.path.exists(os.path.join(folder, "second.pid")))
        self.assertIn(stop(second), (0, -signal.SIGTERM))
        self.assertIn(stop(first), (0, -signal.SIGTERM))
        self.assertFalse(os.path.exists(os.path.join(folder, "twistd.pid")))


def _scrape(port: int) -> str:
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % (port,), timeout=5) as response:
        return response.read().decode("utf-8")


def _sample(exposition: str, line_start: str) -> float | None:
    """The value of the first sample whose line starts with ``line_start``."""
    for line in exposition.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


class MetricsAcrossWorkersTests(SynchronousTestCase):
    """``/metrics`` under ``twistd relay --workers 2``: any process answers with the totals."""

    def test_totals_whichever_process_answers(self):
        """
        After N requests spread over both processes, every scrape, over a
        fresh connection each (so either process answers), shows N; the
        shared folder starts empty of earlier runs' files; a worker killed
        outright loses its live gauges there but not its counts; the folder
        is removed when the relay stops, if the relay made it.
        """
        folder = os.path.abspath(self.mktemp())
        metrics_folder = os.path.join(folder, "metrics")
        os.makedirs(metrics_folder)
        stale = os.path.join(metrics_folder, "counter_999999.db")
        with open(stale, "wb") as f:
            f.write(b"left by an earlier run")
        port = free_port()
        log_path = os.path.join(folder, "relay.log")
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                twistd(
                    "-n", "--pidfile=", "relay", "--simulate", "strict", "--workers", "2", "--no-dumps",
                    "--drain-delay", "0", "--listen", "tcp:%d:interface=127.0.0.1" % (port,),
                ),
                cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_folder},
            )
            self.addCleanup(lambda: process.poll() is None and (process.kill(), process.wait()))
            pids = pids_answering(port, 2)
            self.assertEqual(len(pids), 2)
            self.assertFalse(os.path.exists(stale))

            n = 24
            for _ in range(n):
                self.assertEqual(post(port, _HELLO)[0], 200)
            text = open(log_path, "rb").read()
            by_worker = text.count(b"[worker-1] POST /v1/messages 200")
            self.assertTrue(0 < by_worker < n, "the kernel sent all %d requests to one process" % (n,))
            series = 'relay_requests_total{route="messages",status="200"}'
            seen = [_sample(_scrape(port), series) for _ in range(12)]
            self.assertEqual(seen, [float(n)] * 12)
            attempts = 'relay_upstream_attempts_total{upstream="default"}'
            self.assertEqual(_sample(_scrape(port), attempts), float(n))
            # The breaker gauges are copied to the shared files every second.
            breaker = 'relay_upstream_breaker_state{upstream="default"}'
            deadline = time.monotonic() + 5
            while _sample(_scrape(port), breaker) is None and time.monotonic() < deadline:
                time.sleep(0.1)
            self.assertEqual(_sample(_scrape(port), breaker), 0.0)

            (worker,) = pids - {process.pid}
            self.assertTrue(glob_one(metrics_folder, "gauge_livesum_%d.db" % (worker,)))
            os.kill(worker, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while glob_one(metrics_folder, "gauge_livesum_%d.db" % (worker,)) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertFalse(glob_one(metrics_folder, "gauge_livesum_%d.db" % (worker,)))
            self.assertTrue(glob_one(metrics_folder, "counter_%d.db" % (worker,)))
            self.assertEqual(_sample(_scrape(port), series), float(n))
            self.assertIn(stop(process), (0, -signal.SIGTERM))
        # The folder was the user's: kept (its files are the next start's to clear).
        self.assertTrue(os.path.isdir(metrics_folder))

    def test_a_stopped_workers_last_ledger_rows_stay_counted(self):
        """
        ``--workers 2`` over one SQLite ledger, rows written only as a
        process stops: a worker stopped with SIGTERM writes its rows then,
        and ``/metrics`` counts them after it is gone (its ledger's figures
        are copied to the shared files once the ledger has stopped).
        """
        port = free_port()
        process, log_path = start_twistd(
            self,
            "-n", "--pidfile=", "relay", "--simulate", "strict", "--workers", "2", "--no-dumps",
            "--drain-delay", "0", "--listen", "tcp:%d:interface=127.0.0.1" % (port,),
            "--usage-db", "usage.sqlite", "--usage-flush-interval", "600",
        )
        folder = os.path.dirname(log_path)
        pids = pids_answering(port, 2)
        self.assertEqual(len(pids), 2)
        (worker,) = pids - {process.pid}
        n = 24
        for _ in range(n):
            self.assertEqual(post(port, _HELLO)[0], 200)

        os.kill(worker, signal.SIGTERM)
        deadline = time.monotonic() + 30
        answering = pids_answering(port, 2, seconds=5)
        while (worker in answering or len(answering) < 2) and time.monotonic() < deadline:
            time.sleep(0.1)
            answering = pids_answering(port, 2, seconds=5)
        self.assertEqual(len(answering - {worker}), 2)  # a new worker in its place
        with sqlite3.connect(os.path.join(folder, "usage.sqlite")) as connection:
            written = connection.execute("SELECT count(*) FROM relay_usage").fetchone()[0]
        # The worker's rows, written as it stopped; the first process's still wait.
        self.assertGreater(written, 0, "the stopped worker's rows were not written (or it served none)")
        self.assertLess(written, n, "the kernel sent all %d requests to the worker" % (n,))
        text = _scrape(port)
        self.assertEqual(_sample(text, "relay_ledger_rows_written_total"), float(written))
        self.assertEqual(_sample(text, "relay_ledger_rows_pending"), float(n - written))
        self.assertIn(stop(process), (0, -signal.SIGTERM))

    def test_own_folder_removed(self):
        """Without ``$PROMETHEUS_MULTIPROC_DIR`` the first process makes a folder and removes it at the end."""
        folder = os.path.abspath(self.mktemp())
        os.makedirs(folder)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k.upper() != "PROMETHEUS_MULTIPROC_DIR"}
        with open(os.path.join(folder, "relay.log"), "wb") as log:
            process = subprocess.Popen(
                twistd(
                    "-n", "--pidfile=", "relay", "--simulate", "strict", "--workers", "2", "--no-dumps",
                    "--drain-delay", "0", "--listen", "tcp:%d:interface=127.0.0.1" % (port,),
                ),
                cwd=folder, stdout=log, stderr=subprocess.STDOUT, env=env,
            )
            self.addCleanup(lambda: process.poll() is None and (process.kill(), process.wait()))
            wait_until_up(port, process)
            self.assertEqual(post(port, _HELLO)[0], 200)
            made = [
                path for path in glob.glob(os.path.join(tempfile.gettempdir(), "twisted-relay-metrics-*"))
                if glob_one(path, "*_%d.db" % (process.pid,))
            ]
            self.assertEqual(len(made), 1)
            self.assertIn(stop(process), (0, -signal.SIGTERM))
        self.assertFalse(os.path.exists(made[0]))


def glob_one(folder: str, pattern: str) -> bool:
    """Whether ``folder`` holds a file matching ``pattern``."""
    return bool(glob.glob(os.path.join(folder, pattern)))
