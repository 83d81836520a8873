"""
Several machines, shown on one: three relays behind a real nginx load
balancer, long tool-use sessions through the official ``anthropic`` SDK, and
one relay stopped with SIGTERM mid-run while it has a request in flight.

Run from the work tree's root (nginx must be installed: Debian's ``nginx``
or ``nginx-light`` package)::

    python bench/cluster.py                        # 4 sessions of 200 turns
    python bench/cluster.py --sessions 2 --turns 50
    python bench/cluster.py --threads              # the same with message threads


Every process is started here, on 127.0.0.1 and free ports only: one
simulated upstream (``twisted-relay-simulated --mode strict``, which refuses
a history whose tool-use ids repeat), three relays (``twistd -n relay``), and
nginx with its own configuration (``deploy/nginx/twisted-relay-proxy.conf``
included as it is, in front of an upstream block of the three relays with
``keepalive``). The sessions send each turn's whole history through nginx,
as Claude Code does, with the SDK's own retries off, so every failure shows.
Once a third of the turns are done, the script waits until one relay has a
request in flight (its ``/ready`` says so) and sends it SIGTERM. Every turn
must still succeed. nginx's access log says which relay served each turn.

With ``--threads`` a ``redis-server`` (its own folder, no persistence) is
started too, the three relays keep message threads in it
(``--thread-store redis://...``), and each session is the SDK's default tool
runner (threads on): one ``create``, then one ``continue`` per turn with the
tool results only, each landing on whichever relay nginx picks, not
necessarily the one that kept the thread. A ``continue`` the relay cannot
serve is answered as the API does (404 ``thread_not_found``, ...), the SDK
replays the whole conversation under a new thread, and the run counts these
answers; each relay's ``/metrics`` gives its thread hits and misses.

``tests/test_deploy.py`` runs a shorter version of the same run in CI.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROXY_SNIPPET = os.path.join(ROOT, "deploy", "nginx", "twisted-relay-proxy.conf")
MODEL = "claude-sonnet-4-5"
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather at a place.",
        "input_schema": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]},
    }
]


def find_nginx() -> str | None:
    """The nginx binary, or ``None`` when nginx is not installed."""
    return shutil.which("nginx") or next(
        (path for path in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(path, os.X_OK)), None
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str, timeout: float = 2.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _wait_for(url: str, process: subprocess.Popen, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("%s ended at start (status %s)" % (process.args[:3], process.returncode))
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("nothing answered at %s within %g s" % (url, seconds))


_NGINX_CONF = """\
daemon off;
worker_processes 1;
pid {folder}/nginx.pid;
error_log {folder}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
    log_format turns '$upstream_addr $status $request_method $uri $request_time';
    access_log {folder}/access.log turns;
    client_body_temp_path {folder}/tmp/body;
    proxy_temp_path {folder}/tmp/proxy;
    fastcgi_temp_path {folder}/tmp/fastcgi;
    uwsgi_temp_path {folder}/tmp/uwsgi;
    scgi_temp_path {folder}/tmp/scgi;
    upstream twisted_relay {{
{servers}
        keepalive 32;
        keepalive_timeout 60s;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            include {snippet};
        }}
    }}
}}
"""


@dataclass
class Report:
    """What a run showed."""

    turns: int = 0
    failed: list = field(default_factory=list)
    served_by: dict = field(default_factory=dict)
    served_by_stopped_before_stop: int = 0
    resent_by_nginx: int = 0
    resend_reasons: dict = field(default_factory=dict)
    stopped: str = ""
    in_flight_at_stop: int = 0
    in_flight_after_delay: int = 0
    stopped_exit_status: int | None = None
    stop_seconds: float = 0.0
    seconds: float = 0.0
    threads: bool = False
    thread_lookups: dict = field(default_factory=dict)
    other_answers: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        served = ", ".join("%s: %d" % (addr, count) for addr, count in sorted(self.served_by.items()))
        return [
            "turns: %d, failed: %d" % (self.turns, len(self.failed)),
            "served by: %s" % (served,),
            "relay stopped with SIGTERM: %s, with %d request(s) in flight at the signal (its /ready) and "
            "%d after the drain delay (its log); it had served %d turns; "
            "it exited with status %s, %.1f s after the signal"
            % (self.stopped, self.in_flight_at_stop, self.in_flight_after_delay,
               self.served_by_stopped_before_stop, self.stopped_exit_status, self.stop_seconds),
            "requests nginx sent to a second relay: %d (nginx's reasons: %s)"
            % (self.resent_by_nginx, ", ".join("%s: %d" % item for item in sorted(self.resend_reasons.items()))
               or "none"),
            "wall time: %.1f s" % (self.seconds,),
        ] + ([
            "thread continues per relay (its /metrics; the stopped one's as late as it answered): %s"
            % (", ".join("%s: %d hits, %d misses" % (addr, found.get("hit", 0), found.get("miss", 0))
                         for addr, found in sorted(self.thread_lookups.items())),),
            "answers other than 200 (each one a replay by the SDK): %s"
            % (", ".join("%s: %d" % item for item in sorted(self.other_answers.items())) or "none",),
        ] if self.threads else []) + ["failure: %s" % (f,) for f in self.failed[:10]]


class Cluster:
    """
    The upstream, the relays (three by default) and nginx, all started (and
    stopped) here.

    :param relay_options: more options for every relay's command line (a
        ``--config FILE`` whose ``[relay]`` table sets ``usage-db``, a
        ``[signin]`` table, ...); with ``--dump-dir`` the relays write dumps,
        else ``--no-dumps``.
    :param environ: more environment variables for the relays (the
        ``env:VAR`` secrets of a config file).
    :param nginx: put nginx in front; ``False``: the relays alone.
    :ivar relay_ports: where the relays listen, and
    :ivar nginx_port: where nginx listens, chosen before the start (a
        config file's ``public_url`` can name them).
    """

    def __init__(self, folder: str, relays: int = 3, event_delay: float = 0.003, drain_delay: float = 2.0,
                 threads: bool = False, relay_options: tuple[str, ...] = (), environ: dict | None = None,
                 nginx: bool = True):
        self.folder = folder
        self.threads = threads
        self.count = relays
        self.event_delay = event_delay
        self.drain_delay = drain_delay
        self.relay_options = list(relay_options)
        self.environ = dict(environ or {})
        self.nginx = nginx
        self.processes: list[subprocess.Popen] = []
        self.relays: list[tuple[int, subprocess.Popen, str]] = []
        self.relay_ports = [free_port() for _ in range(relays)]
        self.nginx_port = free_port()

    def _spawn(self, args: list[str], log_name: str, environ: dict | None = None) -> subprocess.Popen:
        log = open(os.path.join(self.folder, log_name), "wb")
        try:
            process = subprocess.Popen(args, cwd=self.folder, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, **environ} if environ else None)
        finally:
            log.close()
        self.processes.append(process)
        return process

    def relay_url(self, number: int) -> str:
        """The URL of one relay, past nginx."""
        return "http://127.0.0.1:%d" % (self.relays[number][0],)

    def start(self) -> None:
        # nginx's workers run as an unprivileged user when nginx starts as root:
        # they must reach the folder (mkdtemp makes it private) and write its tmp/.
        os.chmod(self.folder, 0o755)
        nginx = find_nginx()
        if nginx is None and self.nginx:
            raise RuntimeError("nginx is not installed (apt-get install nginx-light)")
        bindir = os.path.dirname(sys.executable)
        relay_options = list(self.relay_options)
        if "--dump-dir" not in relay_options:
            relay_options.append("--no-dumps")
        if self.threads:
            relay_options += ["--thread-store", self._start_redis()]
        upstream_port = free_port()
        simulated = os.path.join(bindir, "twisted-relay-simulated")
        command = [simulated] if os.access(simulated, os.X_OK) else [
            sys.executable, "-c", "from twisted_relay.simulated.cli import main; main()"
        ]
        upstream = self._spawn(
            command + ["--listen", "tcp:%d:interface=127.0.0.1" % (upstream_port,), "--mode", "strict",
                       "--event-delay", str(self.event_delay)],
            "upstream.log",
        )
        for i, port in enumerate(self.relay_ports):
            log_name = "relay-%d.log" % (i,)
            process = self._spawn(
                [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "--pidfile=",
                 "relay", "--upstream", "http://127.0.0.1:%d" % (upstream_port,),
                 "--listen", "tcp:%d:interface=127.0.0.1" % (port,),
                 "--drain-delay", str(self.drain_delay), "--shutdown-grace", "20"] + relay_options,
                log_name,
                self.environ,
            )
            self.relays.append((port, process, log_name))
        _wait_for("http://127.0.0.1:%d/v1/models" % (upstream_port,), upstream)
        for port, process, _ in self.relays:
            _wait_for("http://127.0.0.1:%d/health" % (port,), process)
        if not self.nginx:
            return
        for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            os.makedirs(os.path.join(self.folder, "tmp", sub), exist_ok=True)
        os.chmod(os.path.join(self.folder, "tmp"), 0o777)
        for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            os.chmod(os.path.join(self.folder, "tmp", sub), 0o777)
        servers = "\n".join(
            "        server 127.0.0.1:%d max_fails=1 fail_timeout=10s;" % (port,) for port, _, _ in self.relays
        )
        conf = os.path.join(self.folder, "nginx.conf")
        with open(conf, "w") as f:
            f.write(_NGINX_CONF.format(folder=self.folder, servers=servers, port=self.nginx_port,
                                       snippet=PROXY_SNIPPET))
        nginx_process = self._spawn(
            [nginx, "-e", os.path.join(self.folder, "nginx-error.log"), "-p", self.folder, "-c", conf],
            "nginx.out",
        )
        _wait_for("http://127.0.0.1:%d/health" % (self.nginx_port,), nginx_process)

    def _start_redis(self) -> str:
        """A ``redis-server`` on a free port, in its own folder, nothing saved; its URL once it answers."""
        server = shutil.which("redis-server")
        if server is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        folder = os.path.join(self.folder, "redis")
        os.makedirs(folder, exist_ok=True)
        port = free_port()
        process = self._spawn(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", folder, "--save", "",
             "--appendonly", "no", "--protected-mode", "yes"],
            "redis.log",
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return "redis://127.0.0.1:%d" % (port,)
            except OSError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("redis-server did not start (see redis.log)")
            time.sleep(0.05)

    @property
    def base_url(self) -> str:
        return "http://127.0.0.1:%d" % (self.nginx_port,)

    def stop(self) -> None:
        """Stop every process started here, by its pid: SIGTERM, then SIGKILL after 25 s."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 25
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def served_by(self) -> tuple[dict, int]:
        """Turns per relay address from nginx's access log, and how many nginx sent to a second relay."""
        counts: dict[str, int] = {}
        resent = 0
        with open(os.path.join(self.folder, "access.log")) as f:
            for line in f:
                tried = re.match(r"^((?:127\.0\.0\.1:\d+(?:, )?)+) \d+ POST /v1/messages ", line)
                if not tried:
                    continue
                addresses = [a for a in tried.group(1).split(", ") if a]
                if len(addresses) > 1:
                    resent += 1
                counts[addresses[-1]] = counts.get(addresses[-1], 0) + 1
        return counts, resent

    def other_answers(self) -> dict:
        """``POST /v1/messages`` answered by nginx with a status other than 200: status -> count."""
        statuses: dict[str, int] = {}
        with open(os.path.join(self.folder, "access.log")) as f:
            for line in f:
                found = re.match(r"^\S.*? (\d{3}) POST /v1/messages ", line)
                if found and found.group(1) != "200":
                    statuses[found.group(1)] = statuses.get(found.group(1), 0) + 1
        return statuses

    def resend_reasons(self) -> dict:
        """Why nginx gave up on a relay for a request, from its error log: reason -> count."""
        reasons: dict[str, int] = {}
        with open(os.path.join(self.folder, "nginx-error.log")) as f:
            for line in f:
                found = re.search(r"\[error\] \S+ \*\d+ (.*?)(?: while |, client:)", line)
                if found:
                    reasons[found.group(1)] = reasons.get(found.group(1), 0) + 1
        return reasons


def _session(base_url: str, turns: int, number: int, progress: list, failures: list) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=base_url, api_key="sk-cluster-demo", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Session %d: check the weather in many cities, one call at a time." % (number,)}]
    seen: set[str] = set()
    try:
        for turn in range(turns):
            try:
                with client.messages.stream(model=MODEL, max_tokens=256, messages=messages, tools=TOOLS) as events:
                    message = events.get_final_message()
            except Exception as e:  # every kind of failure counts, and the turn is not retried
                failures.append("session %d turn %d: %s: %s" % (number, turn, type(e).__name__, str(e)[:300]))
                return
            content = [block.model_dump(exclude_none=True) for block in message.content]
            uses = [block for block in content if block["type"] == "tool_use"]
            for block in uses:
                if block["id"] in seen:
                    failures.append("session %d turn %d: the client saw id %s twice" % (number, turn, block["id"]))
                seen.add(block["id"])
            messages.append({"role": "assistant", "content": content})
            messages.append({
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": block["id"], "content": "sunny, 21 C"} for block in uses
                ] or "Go on.",
            })
            progress.append(1)
    finally:
        client.close()


def _threads_session(base_url: str, turns: int, number: int, progress: list, failures: list) -> None:
    """The SDK's default tool runner (threads on) for ``turns`` turns; an error ends it and is counted."""
    try:
        from bench.threads_today import tool_runner_session
    except ImportError:  # run as a script: bench/ itself is on the path
        from threads_today import tool_runner_session

    try:
        result = tool_runner_session(
            base_url, turns, on_turn=lambda completed: progress.append(1),
            # Its own first message: the simulated upstream's answer ids follow
            # from the request, and the same ids would be the same threads.
            prompt="Session %d: weather everywhere, one call at a time." % (number,),
        )
    except Exception as e:  # a connection error or a timeout: the turn is not retried
        failures.append("session %d: %s: %s" % (number, type(e).__name__, str(e)[:300]))
        return
    if result["error"]:
        failures.append("session %d turn %d: %s" % (number, result["completed"], result["error"]))
    elif result["completed"] != turns:
        failures.append("session %d: the runner stopped after %d turns" % (number, result["completed"]))
    if result["duplicates"]:
        failures.append("session %d: the client saw %d ids more than once" % (number, result["duplicates"]))


def thread_lookups(port: int) -> dict:
    """A relay's thread continues by outcome (``hit``, ``miss``), read from its ``/metrics``."""
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % (port,), timeout=2) as response:
            text = response.read().decode()
    except (OSError, http.client.HTTPException):
        # Refused, or cut short as the relay exits (prometheus_client serves
        # /metrics from the reactor's thread pool, which stops with it).
        return {}
    return {
        outcome: int(float(value))
        for outcome, value in re.findall(r'^relay_thread_lookups_total\{outcome="(\w+)"\} (\S+)$', text, re.M)
    }


def _stop_one_in_flight(cluster: Cluster, report: Report, progress: list, after_turns: int, done: threading.Event):
    """Once ``after_turns`` are done, SIGTERM a relay the moment it has a request in flight."""
    while len(progress) < after_turns and not done.is_set():
        time.sleep(0.01)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not done.is_set():
        for port, process, log_name in cluster.relays:
            try:
                status, ready = _get_json("http://127.0.0.1:%d/ready" % (port,), timeout=1)
            except OSError:
                continue
            if status == 200 and ready.get("active_requests", 0) >= 1:
                started = time.monotonic()
                process.send_signal(signal.SIGTERM)
                # In flight when the signal left (the relay's own count, read
                # just before): the drain must finish these.
                report.in_flight_at_stop = ready["active_requests"]
                report.stopped = "127.0.0.1:%d" % (port,)
                report.served_by_stopped_before_stop = sum(
                    1 for line in open(os.path.join(cluster.folder, "access.log"))
                    if line.startswith(report.stopped + " ") and " POST /v1/messages " in line
                )
                if cluster.threads:
                    # Its thread lookups as late as it answers (it serves /metrics while it drains).
                    while process.poll() is None and time.monotonic() - started < 60:
                        report.thread_lookups[report.stopped] = (
                            thread_lookups(port) or report.thread_lookups.get(report.stopped, {})
                        )
                        time.sleep(0.05)
                report.stopped_exit_status = process.wait(timeout=60)
                report.stop_seconds = time.monotonic() - started
                text = open(os.path.join(cluster.folder, log_name), encoding="utf-8", errors="replace").read()
                found = re.search(r"then finishing (\d+) requests in flight", text)
                report.in_flight_after_delay = int(found.group(1)) if found else 0
                return
        time.sleep(0.002)


def run(folder: str, sessions: int, turns: int, *, event_delay: float = 0.003, drain_delay: float = 2.0,
        stop_after: float = 1 / 3, threads: bool = False) -> Report:
    """Start the cluster in ``folder``, drive the sessions, stop one relay mid-run; always stop everything."""
    report = Report(threads=threads)
    cluster = Cluster(folder, event_delay=event_delay, drain_delay=drain_delay, threads=threads)
    session = _threads_session if threads else _session
    started = time.monotonic()
    try:
        cluster.start()
        progress: list = []
        failures: list = []
        done = threading.Event()
        stopper = threading.Thread(
            target=_stop_one_in_flight,
            args=(cluster, report, progress, int(sessions * turns * stop_after), done),
            daemon=True,
        )
        stopper.start()
        threads = [
            threading.Thread(target=session, args=(cluster.base_url, turns, i, progress, failures), daemon=True)
            for i in range(sessions)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=1800)
        done.set()
        stopper.join(timeout=90)
        report.turns = len(progress)
        report.failed = failures
        report.served_by, report.resent_by_nginx = cluster.served_by()
        report.resend_reasons = cluster.resend_reasons()
        report.other_answers = cluster.other_answers()
        if threads:
            for port, process, _ in cluster.relays:
                if process.poll() is None:
                    report.thread_lookups["127.0.0.1:%d" % (port,)] = thread_lookups(port)
    finally:
        cluster.stop()
        report.seconds = time.monotonic() - started
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--event-delay", type=float, default=0.01, help="seconds between the upstream's events")
    parser.add_argument("--drain-delay", type=float, default=2.0)
    parser.add_argument("--threads", action="store_true",
                        help="message threads: a Redis thread store shared by the relays, the SDK's tool runner")
    parser.add_argument("--keep", action="store_true", help="keep the folder of logs")
    options = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="relay-cluster-")
    report = run(folder, options.sessions, options.turns, event_delay=options.event_delay,
                 drain_delay=options.drain_delay, threads=options.threads)
    for line in report.lines():
        print(line)
    if options.keep:
        print("logs in", folder)
    else:
        shutil.rmtree(folder, ignore_errors=True)
    expected = options.sessions * options.turns
    ok = report.turns == expected and not report.failed and len(report.served_by) == 3 and report.in_flight_at_stop >= 1
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
