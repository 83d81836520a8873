"""
Soak the relay: many concurrent streaming sessions for minutes, with random
client disconnects and random upstream faults, and watch that the relay's
memory and file descriptors do not grow.

Run from the work tree's root::

    python bench/soak.py            # 3 minutes, 200 sessions at a time
    python bench/soak.py --quick    # 40 seconds, 100 at a time

It starts the relay as its own process (``twistd -n relay``) in front of the
fault-injecting upstream of ``tests/faulty_upstream.py``, which runs in this
process with the clients. Every session carries an id; the upstream picks
its fault from that id, so the client knows what it must see and any other
outcome is counted as an anomaly. At the end it prints the outcomes, the
relay's RSS and open file descriptors sampled over the run, what the
relay's ``/metrics`` counted, and how long the relay took to stop.

Bounded in time and count: the run stops at ``--duration`` seconds or
``--requests`` sessions, whichever comes first, and every session has its
own deadline.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import ujson  # noqa: E402
from twisted.internet import reactor  # noqa: E402
from twisted.internet.defer import Deferred, ensureDeferred  # noqa: E402
from twisted.internet.protocol import ClientFactory  # noqa: E402
from twisted.internet.task import deferLater  # noqa: E402

from tests.faulty_upstream import (  # noqa: E402
    Answer,
    Fault,
    FaultyUpstream,
    Hang,
    Reset,
    Stream,
    RawClient,
    cut_after,
    error_answer,
    garbage_stream,
    parse_response,
    sse_events,
    truncated_mid_event,
)

#: The relay's limits in the soak: short, so that faults resolve quickly.
RELAY_OPTIONS = [
    "--idle-timeout", "1.0",
    "--ping-interval", "0.4",
    "--response-timeout", "2",
    "--connect-timeout", "2",
    "--retries", "1",
    "--max-retry-wait", "1",
    "--shutdown-grace", "3",
    "--request-read-timeout", "10",
    "--no-dumps",
]
SESSION_DEADLINE = 15.0
SOAK_ID = b"x-soak-id"

#: Upstream faults for streaming requests -> (weight, what the client must see).
STREAM_FAULTS = {
    "complete": (50, "stream_ok"),
    "slow_but_fine": (6, "stream_ok"),  # silent past ping_interval, under idle_timeout
    "cut": (6, "stream_error:api_error"),
    # A reset that overtakes the events (the relay had not read them yet)
    # is a reset before headers to the relay: sent again, and a whole stream.
    "reset_mid_stream": (4, ("stream_error:api_error", "stream_ok")),
    "truncated": (4, "stream_error:api_error"),
    "garbage": (3, "stream_error:api_error"),
    "silent_too_long": (3, "stream_error:timeout_error"),
    "reset_before_headers": (4, "stream_ok"),  # retried once, then a whole stream
    "overloaded_then_ok": (5, "stream_ok"),  # 529 retry-after-ms, retried
    "bad_request": (4, "http_400:invalid_request_error"),
    "no_headers": (2, "http_504:timeout_error"),
}
#: The same for non-streaming requests.
JSON_FAULTS = {
    "answer": (70, "json_ok"),
    "server_error_then_ok": (10, "json_ok"),
    "bad_request": (10, "http_400:invalid_request_error"),
    "headers_then_silence": (5, "http_504:timeout_error"),
    "reset_before_headers": (5, "json_ok"),
}


def _paced(rng: random.Random, deltas: int, gap: float) -> Stream:
    return Stream([(rng.uniform(0, gap), event) for event in sse_events(deltas)])


def _stream_fault(kind: str, rng: random.Random) -> Fault:
    events = sse_events(rng.randint(4, 24))
    if kind == "complete":
        return _paced(rng, rng.randint(4, 24), 0.02)
    if kind == "slow_but_fine":
        return Stream([(0.0, e) for e in events[:3]] + [(0.6, events[3])] + [(0.0, e) for e in events[4:]])
    if kind == "cut":
        return cut_after(rng.randint(1, 6))
    if kind == "reset_mid_stream":
        return cut_after(rng.randint(1, 6), how="abort")
    if kind == "truncated":
        return truncated_mid_event(rng.randint(1, 6))
    if kind == "garbage":
        # No line ending at all: no event ever ends, none reaches the client.
        return garbage_stream(bytes(rng.randrange(256) for _ in range(300)).replace(b"\n", b"").replace(b"\r", b""))
    if kind == "silent_too_long":
        return Stream([(0.0, e) for e in events[:3]] + [(1.6, events[3])])
    if kind == "reset_before_headers":
        return Reset()
    if kind == "overloaded_then_ok":
        return error_answer(529, "overloaded_error", retry_after_ms="30")
    if kind == "bad_request":
        return error_answer(400, "invalid_request_error", "messages.0: soak says no")
    if kind == "no_headers":
        return Hang()
    raise ValueError(kind)


def _json_fault(kind: str, rng: random.Random) -> Fault:
    if kind == "answer":
        return Answer()
    if kind == "server_error_then_ok":
        return error_answer(503, "overloaded_error", retry_after_ms="20")
    if kind == "bad_request":
        return error_answer(400, "invalid_request_error", "soak says no")
    if kind == "headers_then_silence":
        return Hang(headers=True, content_type=b"application/json")
    if kind == "reset_before_headers":
        return Reset()
    raise ValueError(kind)


class SessionFaults(Fault):
    """
    The upstream's behaviour: the fault planned for the request's session
    on its first attempt, a clean answer on a retry.
    """

    def __init__(self, plans: dict[bytes, tuple[bool, str]], seed: int):
        self._plans = plans
        self._attempts: Counter = Counter()
        self._rng = random.Random(seed)

    def respond(self, request, exchange):
        session = (request.requestHeaders.getRawHeaders(SOAK_ID) or [b""])[0]
        stream, kind = self._plans.get(session, (False, "answer"))
        self._attempts[session] += 1
        if self._attempts[session] > 1:
            fault = _paced(self._rng, 6, 0.01) if stream else Answer()
        elif stream:
            fault = _stream_fault(kind, self._rng)
        else:
            fault = _json_fault(kind, self._rng)
        return fault.respond(request, exchange)

    def attempts(self, session: bytes) -> int:
        """Requests of ``session`` the upstream received so far."""
        return self._attempts[session]

    def forget(self, session: bytes) -> None:
        """Drop what is kept of a finished session."""
        self._plans.pop(session, None)
        self._attempts.pop(session, None)


def error_message(raw: bytes) -> str:
    """The ``error.message`` in an answer, if there is one."""
    found = re.findall(rb'"message":"((?:[^"\\]|\\.)*)"', parse_response(raw).body)
    return found[-1].decode("utf-8", "replace") if found else ""


def classify(raw: bytes) -> str:
    """What a client got: ``stream_ok``, ``stream_error:<type>``, ``json_ok``, ``http_<status>:<type>``, ..."""
    response = parse_response(raw)
    if response.status == 0:
        return "no_response"
    if not response.complete:
        return "incomplete_%d" % (response.status,)
    content_type = response.header(b"content-type") or b""
    if response.status == 200 and content_type.startswith(b"text/event-stream"):
        names = re.findall(rb"^event: (\S+)", response.body, re.M)
        if names and names[-1] == b"message_stop" and names[0] == b"message_start":
            return "stream_ok"
        if names and names[-1] == b"error":
            error = ujson.loads(response.body.rsplit(b"data: ", 1)[1])
            return "stream_error:" + error["error"]["type"]
        return "stream_malformed"
    try:
        body = ujson.loads(response.body)
    except ValueError:
        return "http_%d:not_json" % (response.status,)
    if response.status == 200:
        return "json_ok" if body.get("type") == "message" else "json_malformed"
    return "http_%d:%s" % (response.status, body.get("error", {}).get("type"))


def relay_rss_kib(pid: int) -> int:
    """The relay's resident set size in KiB."""
    with open("/proc/%d/status" % (pid,)) as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS for %d" % (pid,))


def relay_fds(pid: int) -> int:
    """File descriptors the relay holds."""
    return len(os.listdir("/proc/%d/fd" % (pid,)))


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(port: int, path: str) -> tuple[int, bytes]:
    """A plain blocking GET to the relay (used outside the load only)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET %s HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n" % (path.encode(),))
        chunks = []
        while True:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
    response = parse_response(b"".join(chunks))
    return response.status, response.body


class Soak:
    """One soak run: the upstream, the relay process, the sessions, the samples."""

    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.plans: dict[bytes, tuple[bool, str]] = {}
        self.faults = SessionFaults(self.plans, args.seed)
        self.upstream = FaultyUpstream(reactor, default=self.faults)
        self.outcomes: Counter = Counter()
        self.injected: Counter = Counter()
        self.anomalies: list[str] = []
        self.samples: list[tuple[float, int, int, int]] = []
        self.sent = 0
        self.active = 0
        self.started = 0.0

    # -- the relay process ---------------------------------------------------

    def start_relay(self, upstream_url: str, workdir: str) -> None:
        self.port = free_port()
        self.logfile = os.path.join(workdir, "relay.log")
        command = [
            sys.executable, "-c", "from twisted.scripts.twistd import run; run()",
            "-n", "--pidfile=", "--logfile", self.logfile,
            "relay", "--listen", "tcp:%d:interface=127.0.0.1" % (self.port,), "--upstream", upstream_url,
        ] + RELAY_OPTIONS
        env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT))
        self.process = subprocess.Popen(command, cwd=workdir, env=env)
        deadline = time.monotonic() + 20
        while True:
            try:
                if http_get(self.port, "/ready")[0] == 200:
                    return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the relay did not start; see %s" % (self.logfile,))
            time.sleep(0.1)

    def stop_relay(self) -> tuple[float, int]:
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        return time.monotonic() - started, code

    def sample(self) -> None:
        pid = self.process.pid
        self.samples.append(
            (reactor.seconds() - self.started, relay_rss_kib(pid), relay_fds(pid), self.upstream.open_connections)
        )

    # -- the sessions ----------------------------------------------------------

    def plan(self) -> tuple[bytes, bool, str]:
        session = b"s%d" % (self.sent,)
        stream = self.rng.random() < 0.85
        faults = STREAM_FAULTS if stream else JSON_FAULTS
        kinds = list(faults)
        kind = self.rng.choices(kinds, weights=[faults[k][0] for k in kinds])[0]
        self.plans[session] = (stream, kind)
        return session, stream, kind

    async def session(self) -> None:
        session, stream, kind = self.plan()
        expected = (STREAM_FAULTS if stream else JSON_FAULTS)[kind][1]
        body = ujson.dumps(
            {
                "model": "claude-sonnet-4-5",
                "max_tokens": 64,
                "stream": stream,
                "messages": [{"role": "user", "content": "soak %s" % (session.decode(),)}],
            }
        ).encode()
        request = (
            b"POST /v1/messages HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
            b"x-api-key: sk-soak\r\n%s: %s\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
            % (SOAK_ID, session, len(body), body)
        )
        # One session in ten hangs up early: before any answer, or mid-answer.
        disconnect = self.rng.random() < 0.10
        abort_after = self.rng.randint(150, 1500) if disconnect and self.rng.random() < 0.7 else None
        client = RawClient(request, reactor, abort_after=abort_after)
        reactor.connectTCP("127.0.0.1", self.port, ClientFactory.forProtocol(lambda: client))
        timers = []
        if disconnect and abort_after is None:
            timers.append(reactor.callLater(self.rng.uniform(0.0, 0.05), _abort_quietly, client))
        timers.append(reactor.callLater(SESSION_DEADLINE, _abort_quietly, client))
        try:
            raw = await client.done
        finally:
            for timer in timers:
                if timer.active():
                    timer.cancel()
        self.injected[("stream " if stream else "json ") + kind] += 1
        if disconnect:
            self.outcomes["client_disconnect"] += 1
        else:
            got = classify(raw)
            self.outcomes[got] += 1
            acceptable = expected if isinstance(expected, tuple) else (expected,)
            if got not in acceptable and self.args.trace:
                self.trace(session, kind)
            if got not in acceptable and len(self.anomalies) < 1000:
                self.anomalies.append(
                    "%s %s: expected %s, got %s after %d upstream attempts %s"
                    % (session.decode(), kind, expected, got, self.faults.attempts(session), error_message(raw)[:120])
                )
        self.faults.forget(session)
        if len(self.upstream.received) > 5000:
            self.upstream.forget_finished()

    def trace(self, session: bytes, kind: str) -> None:
        """Print each upstream attempt of a session, and what else its connection carried."""
        for record in self.upstream.received:
            if record.header(SOAK_ID) != [session]:
                continue
            print("trace %s (%s): connection %d, arrived %.3f s, %s %.3f s later"
                  % (session.decode(), kind, record.connection, record.at - self.started, record.outcome,
                     (record.ended_at or record.at) - record.at))
            for other in self.upstream.received:
                if other.connection == record.connection and other is not record:
                    print("    same connection: %s, arrived %.3f s, %s"
                          % (b"".join(other.header(SOAK_ID)).decode(), other.at - self.started, other.outcome))

    async def run(self) -> None:
        args = self.args
        self.started = reactor.seconds()
        deadline = self.started + args.duration
        sample_every = max(1.0, args.duration / 10.0)
        next_sample = self.started
        done = Deferred()

        def launch() -> None:
            while self.active < args.concurrency and self.sent < args.requests and reactor.seconds() < deadline:
                self.sent += 1
                self.active += 1
                ensureDeferred(self.session()).addBoth(finished)

        def finished(result) -> None:
            self.active -= 1
            if result is not None:
                print("session failed:", result, file=sys.stderr)
            if self.active == 0 and (self.sent >= args.requests or reactor.seconds() >= deadline):
                if not done.called:
                    done.callback(None)
            else:
                reactor.callLater(0, launch)

        launch()
        while not done.called:
            if reactor.seconds() >= next_sample:
                self.sample()
                next_sample += sample_every
            await deferLater(reactor, 0.2, lambda: None)
        # Let the last connections close, then count again.
        await deferLater(reactor, 2.5, lambda: None)
        self.sample()


def _abort_quietly(client: RawClient) -> None:
    if client.transport is not None and client.closed_at is None:
        client.abort()


def _metric_lines(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]


def report(soak: Soak, elapsed: float, metrics: str, stop_seconds: float, exit_code: int) -> None:
    args = soak.args
    print()
    print("soak: %.0f s, %d sessions at a time, seed %d (relay pid %d)" % (elapsed, args.concurrency, args.seed,
                                                                           soak.process.pid))
    print()
    print("%-44s %8s" % ("client outcome", "count"))
    for outcome, count in sorted(soak.outcomes.items(), key=lambda item: -item[1]):
        print("%-44s %8d" % (outcome, count))
    print("%-44s %8d" % ("total sessions", sum(soak.outcomes.values())))
    print("%-44s %8.0f" % ("sessions per second", sum(soak.outcomes.values()) / elapsed))
    print("%-44s %8d" % ("anomalies (outcome other than expected)", len(soak.anomalies)))
    for line in soak.anomalies[:10]:
        print("    " + line)
    print()
    print("%-44s %8s" % ("upstream fault injected", "count"))
    for kind, count in sorted(soak.injected.items(), key=lambda item: -item[1]):
        print("%-44s %8d" % (kind, count))
    print("%-44s %8d" % ("upstream requests received (retries incl.)", soak.upstream.request_count))
    print("%-44s %8d" % ("upstream requests still in flight at end", len(soak.upstream.in_flight)))
    print()
    print("%10s %12s %8s %24s" % ("t (s)", "RSS (MiB)", "fds", "upstream connections"))
    for at, rss, fds, upstream in soak.samples:
        print("%10.1f %12.1f %8d %24d" % (at, rss / 1024.0, fds, upstream))
    start_fds, end_fds, pooled = soak.samples[0][2], soak.samples[-1][2], soak.samples[-1][3]
    print()
    print("relay fds: %d at start, %d at end, of which %d idle pooled upstream connections: %+d otherwise"
          % (start_fds, end_fds, pooled, end_fds - pooled - start_fds))
    print("relay RSS: %.1f MiB at start, %.1f MiB at end, peak %.1f MiB"
          % (soak.samples[0][1] / 1024.0, soak.samples[-1][1] / 1024.0, max(s[1] for s in soak.samples) / 1024.0))
    print()
    print("relay /metrics:")
    for name in ("relay_requests_total", "relay_upstream_failures_total", "relay_upstream_retries_total",
                 "relay_active_requests", "relay_active_streams"):
        for line in _metric_lines(metrics, name):
            print("    " + line)
    print()
    print("relay stopped on SIGTERM in %.2f s, exit status %d" % (stop_seconds, exit_code))


async def main(args) -> int:
    soak = Soak(args)
    upstream_url = soak.upstream.listen()
    with tempfile.TemporaryDirectory(prefix="relay-soak-") as workdir:
        await deferLater(reactor, 0, lambda: None)
        from twisted.internet.threads import deferToThread

        await deferToThread(soak.start_relay, upstream_url, workdir)
        begun = time.monotonic()
        await soak.run()
        elapsed = time.monotonic() - begun
        status, metrics = await deferToThread(http_get, soak.port, "/metrics")
        stop_seconds, exit_code = await deferToThread(soak.stop_relay)
        # twistd rotates its log every megabyte: read every part, oldest first.
        parts = sorted(glob.glob(soak.logfile + ".*"), key=lambda name: -int(name.rsplit(".", 1)[1]))
        log_text = ""
        for name in parts + [soak.logfile]:
            with open(name, errors="replace") as log:
                log_text += log.read()
        if args.log:
            with open(args.log, "w") as copy:
                copy.write(log_text)
    await soak.upstream.stop()
    report(soak, elapsed, metrics.decode(), stop_seconds, exit_code)
    log_errors = log_text.count("Traceback") + log_text.count("Unhandled")
    stopped_cleanly = "Main loop terminated." in log_text and exit_code in (0, -signal.SIGTERM)
    print("relay shut down cleanly (main loop terminated): %s" % ("yes" if stopped_cleanly else "NO"))
    print("tracebacks or unhandled errors in the relay's log: %d" % (log_errors,))
    return 1 if soak.anomalies or log_errors or not stopped_cleanly else 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="40 s, 100 sessions at a time")
    parser.add_argument("--duration", type=float, default=None, help="seconds of load (default 180)")
    parser.add_argument("--concurrency", type=int, default=None, help="sessions at a time (default 200)")
    parser.add_argument("--requests", type=int, default=200000, help="most sessions in all")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log", help="keep a copy of the relay's log here")
    parser.add_argument("--trace", action="store_true", help="print the upstream's view of each anomaly")
    args = parser.parse_args(argv)
    if args.duration is None:
        args.duration = 40.0 if args.quick else 180.0
    if args.concurrency is None:
        args.concurrency = 100 if args.quick else 200
    return args


if __name__ == "__main__":
    arguments = parse_args()
    result = []

    def run():
        d = ensureDeferred(main(arguments))
        d.addBoth(lambda value: (result.append(value), reactor.stop()))

    reactor.callWhenRunning(run)
    reactor.run()
    outcome = result[0] if result else 1
    if not isinstance(outcome, int):
        print(outcome, file=sys.stderr)
        outcome = 1
    sys.exit(outcome)
