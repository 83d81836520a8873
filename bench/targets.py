# -*- test-case-name: bench.test_harness -*-
"""
The processes a benchmark run starts: the fake upstream and every target in
front of it, with what the run measures of each (CPU seconds, resident and
peak memory, from ``/proc``).

Targets: ``direct`` (the fake upstream itself), ``nginx`` (Debian's package,
buffering off), ``plain`` (``twisted.web.proxy``), ``aiohttp`` (a plain
asyncio proxy, aiohttp on uvloop, from its own virtual environment),
``relay`` (``twistd -n relay``, optionally from a patched copy of the
package; ``relay-routed``, ``relay-ledger``, ``relay-bedrock`` and
``relay-responses`` are variants of its settings) and ``litellm`` (LiteLLM's proxy as an Anthropic pass-through, from
its own virtual environment). Every one binds 127.0.0.1 and is stopped by
its pid.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

__all__ = [
    "BENCH_DIR",
    "AiohttpProxy",
    "BedrockRelay",
    "Direct",
    "FakeUpstreamProcess",
    "LiteLLM",
    "Nginx",
    "PlainProxy",
    "Relay",
    "ResponsesRelay",
    "Target",
    "cpu_seconds",
    "free_port",
    "peak_rss_kib",
    "reset_peak",
    "rss_kib",
    "tree_pids",
]

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- /proc -----------------------------------------------------------------


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants that are alive."""
    found = []
    todo = [pid]
    while todo:
        p = todo.pop()
        if not os.path.exists("/proc/%d" % (p,)):
            continue
        found.append(p)
        try:
            for task in os.listdir("/proc/%d/task" % (p,)):
                with open("/proc/%d/task/%s/children" % (p, task)) as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return found


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU seconds of these processes."""
    total = 0
    for pid in pids:
        try:
            with open("/proc/%d/stat" % (pid,)) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / _CLK_TCK


def _status_kib(pids: list[int], key: str) -> int:
    total = 0
    for pid in pids:
        try:
            with open("/proc/%d/status" % (pid,)) as f:
                for line in f:
                    if line.startswith(key):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total


def rss_kib(pids: list[int]) -> int:
    """Resident memory (``VmRSS``) of these processes, in KiB."""
    return _status_kib(pids, "VmRSS:")


def peak_rss_kib(pids: list[int]) -> int:
    """Peak resident memory (``VmHWM``) since the last :func:`reset_peak`, in KiB."""
    return _status_kib(pids, "VmHWM:")


def reset_peak(pids: list[int]) -> None:
    """Restart the peak-memory count of these processes (Linux ``clear_refs``)."""
    for pid in pids:
        try:
            with open("/proc/%d/clear_refs" % (pid,), "w") as f:
                f.write("5")
        except OSError:
            pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _preexec(cpus: set[int] | None):
    def setup() -> None:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        if cpus:
            os.sched_setaffinity(0, cpus)
        os.setpgrp()

    return setup


# -- processes ---------------------------------------------------------------


class _Process:
    """A child process with a log file, stopped by its pid."""

    name = "process"

    def __init__(self, workdir: str, cpus: set[int] | None = None):
        self.workdir = workdir
        self.cpus = cpus
        self.process: subprocess.Popen | None = None

    def _spawn(self, argv: list[str], env: dict | None = None, cwd: str | None = None) -> None:
        log = open(os.path.join(self.workdir, self.name + ".log"), "wb")
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=cwd or self.workdir,
            preexec_fn=_preexec(self.cpus),
        )
        log.close()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def pids(self) -> list[int]:
        """The processes whose CPU and memory count for this one."""
        return tree_pids(self.pid) if self.pid else []

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, grace: float = 15.0) -> None:
        """Stop the process (and its children) by pid: ``sig``, then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return
        children = self.pids()[1:]
        self.process.send_signal(sig)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class FakeUpstreamProcess(_Process):
    """``bench/fake_upstream.py`` on an ephemeral port."""

    name = "upstream"

    def start(self) -> None:
        port_file = os.path.join(self.workdir, "upstream.port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        self._spawn([sys.executable, os.path.join(BENCH_DIR, "fake_upstream.py"), "--port-file", port_file])
        deadline = time.monotonic() + 20
        while not os.path.exists(port_file):
            if time.monotonic() > deadline or not self.alive():
                raise RuntimeError("the fake upstream did not start; see its log in " + self.workdir)
            time.sleep(0.05)
        with open(port_file) as f:
            self.port = int(f.read())


class Target(_Process):
    """
    Something the load generator talks to.

    :ivar name: the target's name in tables.
    :ivar path: the Messages path on it.
    :ivar port: its port on 127.0.0.1.
    """

    path = "/v1/messages"
    description = ""
    #: The wire the target speaks to the fake upstream: ``bedrock`` streams
    #: come back to the client without the ``ping`` (Bedrock sends none).
    wire = "anthropic"
    #: Whether its collector is watched (``bench/gcwatch.py``): a Python process of one.
    watches_gc = False

    def __init__(self, workdir: str, upstream: FakeUpstreamProcess, cpus: set[int] | None = None):
        super().__init__(workdir, cpus)
        self.upstream = upstream
        self.port = 0

    @property
    def gc_file(self) -> str:
        """Where its collector's figures are written (``bench/gcwatch.py``)."""
        return os.path.join(self.workdir, self.name + "-gc.json")

    def gc_reset(self) -> None:
        """Count its collections afresh from now (``SIGUSR2``)."""
        if self.watches_gc and self.alive():
            os.kill(self.pid, signal.SIGUSR2)

    def gc_read(self, timeout: float = 5.0) -> dict | None:
        """
        Its collections since :meth:`gc_reset`, per generation (``SIGUSR1``):
        counts, seconds, the longest; ``None`` when it is not watched.
        """
        if not self.watches_gc or not self.alive():
            return None
        if os.path.exists(self.gc_file):
            os.unlink(self.gc_file)
        os.kill(self.pid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.gc_file):
            if time.monotonic() > deadline or not self.alive():
                return None
            time.sleep(0.01)
        with open(self.gc_file) as f:
            return json.load(f)

    def start(self) -> None:
        """Start, and return once a request has gone through."""
        self.port = free_port()
        self._launch()
        self._wait_ready(self._startup_seconds)

    _startup_seconds = 30.0

    def _launch(self) -> None:
        raise NotImplementedError

    def _wait_ready(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        error = None
        while time.monotonic() < deadline:
            if self.process is not None and not self.alive():
                break
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request(
                    "POST",
                    self.path,
                    b'{"model":"bench:json","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}',
                    {"content-type": "application/json", "x-api-key": "sk-bench", "anthropic-version": "2023-06-01"},
                )
                response = conn.getresponse()
                response.read()
                conn.close()
                if response.status == 200:
                    return
                error = "status %d" % (response.status,)
            except OSError as e:
                error = str(e)
            time.sleep(0.2)
        raise RuntimeError("%s did not answer (%s); see %s.log in %s" % (self.name, error, self.name, self.workdir))


class Direct(Target):
    """No proxy: the load generator talks to the fake upstream itself."""

    name = "direct"
    description = "the fake upstream itself"

    def start(self) -> None:
        self.port = self.upstream.port
        self._wait_ready(10)

    def pids(self) -> list[int]:
        return []

    def stop(self, *args, **kwargs) -> None:
        pass


class Relay(Target):
    """
    ``twistd -n relay`` in front of the fake upstream, relay pings off.

    :param tree: a folder holding a (patched) copy of ``twisted_relay`` to run
        instead of the work tree's; ``None`` for the work tree.
    :param launcher: a command line that runs the relay's Python (e.g.
        ``valgrind --tool=callgrind``; its collector is then not watched).
    """

    name = "relay"
    description = "twistd -n relay --no-dumps --ping-interval 0"

    def __init__(self, workdir, upstream, cpus=None, *, tree: str | None = None, name: str | None = None,
                 profile: str | None = None, workers: int = 1, launcher: list[str] | None = None):
        super().__init__(workdir, upstream, cpus)
        self.tree = tree or REPO_ROOT
        if name:
            self.name = name
        self.profile = profile
        self.workers = workers
        self.launcher = launcher
        self.watches_gc = workers == 1 and not launcher
        if launcher:
            self._startup_seconds = 300.0
        if workers > 1:
            self.description = "%s --workers %d" % (Relay.description, workers)

    def _launch(self) -> None:
        self._spawn_relay(
            "--upstream", "http://127.0.0.1:%d" % (self.upstream.port,),
            "--workers", str(self.workers),
        )

    def _spawn_relay(self, *options: str, env: dict | None = None) -> None:
        """
        ``twistd -n relay`` from this target's tree, listening on its port,
        with ``options`` (and ``env`` added to its environment).
        """
        twistd = os.path.join(os.path.dirname(sys.executable), "twistd")
        twistd = twistd if os.path.exists(twistd) else shutil.which("twistd") or "twistd"
        if self.launcher:
            argv = [*self.launcher, sys.executable, twistd]
        elif self.watches_gc:
            # twistd, its collector watched (one process: workers have their own).
            argv = [sys.executable, os.path.join(BENCH_DIR, "gcwatch.py"), self.gc_file, "--"]
        else:
            argv = [twistd]
        argv += [
            "-n",
            "-l", os.path.join(self.workdir, self.name + "-twistd.log"),
            "--pidfile", os.path.join(self.workdir, self.name + ".pid"),
        ]
        if self.profile:
            # twistd's own profiler: it writes when the reactor stops (a
            # `python -m cProfile` around twistd never writes, since twistd
            # ends itself with the signal that stopped it).
            argv += ["--profile", self.profile, "--profiler", "cprofile", "--savestats"]
        argv += [
            "relay",
            "--listen", "tcp:%d:interface=127.0.0.1:backlog=4096" % (self.port,),
            "--no-dumps",
            "--ping-interval", "0",
            *options,
        ]
        pythonpath = self.tree + os.pathsep + os.environ.get("PYTHONPATH", "")
        self._spawn(argv, env={**(env or {}), "PYTHONPATH": pythonpath}, cwd=self.tree)


_ROUTED_CONFIG = """\
# Two upstreams, two routes; every request the bench sends goes to the first.
[upstreams.first]
url = "http://127.0.0.1:%(port)d"

[upstreams.second]
url = "http://127.0.0.1:9"
ids = "original"

[[routes]]
models = ["claude-haiku-*"]
targets = [{ upstream = "second", model = "small" }, { upstream = "first" }]

[[routes]]
targets = [{ upstream = "first" }, { upstream = "second" }]
"""


class RoutedRelay(Relay):
    """
    The relay with ``--config`` of two upstreams and two routes, every
    request routed to the first (the fake upstream): beside ``relay``, it
    shows what routing costs per request and per event.
    """

    name = "relay-routed"
    description = "twistd -n relay --config (2 upstreams, 2 routes) --no-dumps --ping-interval 0"

    def _launch(self) -> None:
        path = os.path.join(self.workdir, self.name + ".toml")
        with open(path, "w") as f:
            f.write(_ROUTED_CONFIG % {"port": self.upstream.port})
        self._spawn_relay("--config", path)


_BEDROCK_CONFIG = """\
# One upstream on Bedrock's InvokeModel wire (the fake upstream answers its
# routes), every request signed with SigV4 by keys from the environment.
[upstreams.bedrock]
wire = "bedrock"
url = "http://127.0.0.1:%(port)d"
region = "us-east-1"
login = { kind = "aws", access-key-id = "env:BENCH_AWS_ACCESS_KEY_ID", secret-access-key = "env:BENCH_AWS_SECRET_ACCESS_KEY" }

[[routes]]
targets = [{ upstream = "bedrock" }]
"""


class BedrockRelay(Relay):
    """
    The relay with ``--config`` of one upstream on the ``bedrock`` wire: the
    fake upstream's InvokeModel routes, each request signed (SigV4, an
    ``aws`` login with keys made up for the run, from environment variables
    set for the relay's process only), each stream's event-stream frames
    turned back into Anthropic's SSE. Beside ``relay``, what the Bedrock
    wire costs per event, per MB and per request.
    """

    name = "relay-bedrock"
    wire = "bedrock"
    description = "twistd -n relay --config (1 upstream, wire bedrock, aws login) --no-dumps --ping-interval 0"

    def _launch(self) -> None:
        path = os.path.join(self.workdir, self.name + ".toml")
        with open(path, "w") as f:
            f.write(_BEDROCK_CONFIG % {"port": self.upstream.port})
        keys = {
            # Made up per run: the fake upstream does not check signatures.
            "BENCH_AWS_ACCESS_KEY_ID": "AKIA" + secrets.token_hex(8).upper(),
            "BENCH_AWS_SECRET_ACCESS_KEY": secrets.token_urlsafe(30),
        }
        self._spawn_relay("--config", path, env=keys)


_RESPONSES_CONFIG = """\
# One upstream on OpenAI's Responses wire (the fake upstream answers
# /v1/responses); no model map, so that the bench's model (bench:paced:...)
# reaches the fake upstream, which answers by it.
[upstreams.gpt]
wire = "openai-responses"
url = "http://127.0.0.1:%(port)d/v1"
keys = ["env:BENCH_OPENAI_KEY"]

[[routes]]
targets = [{ upstream = "gpt" }]
"""


class ResponsesRelay(Relay):
    """
    The relay with ``--config`` of one upstream on the ``openai-responses``
    wire: each request translated into a Responses request, each stream's
    Responses events translated into Anthropic's SSE. Beside ``relay``,
    what the Responses wire costs per event, per MB and per request.
    """

    name = "relay-responses"
    wire = "responses"
    description = "twistd -n relay --config (1 upstream, wire openai-responses) --no-dumps --ping-interval 0"

    def _launch(self) -> None:
        path = os.path.join(self.workdir, self.name + ".toml")
        with open(path, "w") as f:
            f.write(_RESPONSES_CONFIG % {"port": self.upstream.port})
        # Made up per run: the fake upstream does not check keys.
        self._spawn_relay("--config", path, env={"BENCH_OPENAI_KEY": "sk-bench-" + secrets.token_urlsafe(24)})


class LedgerRelay(Relay):
    """
    The relay with the usage ledger on (``--usage-db``, an SQLite file in
    the work folder): beside ``relay``, what keeping the ledger costs.
    """

    name = "relay-ledger"
    description = "twistd -n relay --usage-db usage.sqlite --no-dumps --ping-interval 0"

    def _launch(self) -> None:
        self._spawn_relay(
            "--upstream", "http://127.0.0.1:%d" % (self.upstream.port,),
            "--usage-db", os.path.join(self.workdir, self.name + "-usage.sqlite"),
        )


class PlainProxy(Target):
    """``twisted.web.proxy.ReverseProxyResource`` served by a Twisted ``Site``."""

    name = "plain"
    description = "twisted.web.proxy.ReverseProxyResource"
    watches_gc = True

    def _launch(self) -> None:
        self._spawn(
            [
                sys.executable,
                os.path.join(BENCH_DIR, "plain_proxy.py"),
                "--listen", "tcp:%d:interface=127.0.0.1:backlog=4096" % (self.port,),
                "--upstream-port", str(self.upstream.port),
            ],
            env={"BENCH_GC_WATCH": self.gc_file},
        )


class AiohttpProxy(Target):
    """
    ``bench/aiohttp_proxy.py``: aiohttp on uvloop, no parsing, a keep-alive
    pool to the upstream; the other Python floor.

    :param python: the interpreter of its own virtual environment, where
        aiohttp and uvloop are installed.
    """

    name = "aiohttp"
    description = "aiohttp on uvloop, plain pass-through (bench/aiohttp_proxy.py)"
    watches_gc = True

    def __init__(self, workdir, upstream, cpus=None, *, python: str):
        super().__init__(workdir, upstream, cpus)
        self.python = python

    def _launch(self) -> None:
        self._spawn(
            [
                self.python,
                os.path.join(BENCH_DIR, "aiohttp_proxy.py"),
                "--port", str(self.port),
                "--upstream-port", str(self.upstream.port),
            ],
            env={"BENCH_GC_WATCH": self.gc_file},
        )


_NGINX_CONF = """\
daemon off;
master_process on;
user root;
worker_processes 1;
worker_rlimit_nofile {nofile};
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{
    worker_connections {connections};
    multi_accept on;
}}
http {{
    access_log {workdir}/nginx-access.log combined buffer=64k;
    client_body_temp_path {workdir}/nginx-body;
    proxy_temp_path {workdir}/nginx-proxy;
    fastcgi_temp_path {workdir}/nginx-fastcgi;
    uwsgi_temp_path {workdir}/nginx-uwsgi;
    scgi_temp_path {workdir}/nginx-scgi;
    client_max_body_size 64m;
    keepalive_requests 1000000;
    upstream fake {{
        server 127.0.0.1:{upstream};
        keepalive 1024;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://fake;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
            proxy_send_timeout 600s;
        }}
    }}
}}
"""


class Nginx(Target):
    """Debian's nginx, one worker, buffering off, keep-alive to the upstream."""

    name = "nginx"
    description = "nginx, 1 worker, proxy_buffering off, upstream keepalive"

    @staticmethod
    def available() -> str | None:
        """The nginx binary, or ``None``."""
        return shutil.which("nginx") or (os.path.exists("/usr/sbin/nginx") and "/usr/sbin/nginx") or None

    def _launch(self) -> None:
        import resource

        conf = os.path.join(self.workdir, "nginx.conf")
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        with open(conf, "w") as f:
            f.write(
                _NGINX_CONF.format(
                    workdir=self.workdir,
                    port=self.port,
                    upstream=self.upstream.port,
                    nofile=nofile,
                    connections=max(1024, nofile // 2 - 64),
                )
            )
        self._spawn([self.available(), "-c", conf, "-p", self.workdir])

    def stop(self, *args, **kwargs) -> None:
        super().stop(signal.SIGQUIT)


class LiteLLM(Target):
    """
    LiteLLM's proxy (``litellm --config``), one uvicorn worker, using its
    Anthropic pass-through route against the fake upstream.

    :param binary: the ``litellm`` script of its own virtual environment.
    """

    name = "litellm"
    path = "/anthropic/v1/messages"
    description = "LiteLLM proxy, Anthropic pass-through (/anthropic/v1/messages)"
    _startup_seconds = 120.0

    def __init__(self, workdir, upstream, cpus=None, *, binary: str):
        super().__init__(workdir, upstream, cpus)
        self.binary = binary

    def _launch(self) -> None:
        conf = os.path.join(self.workdir, "litellm.yaml")
        with open(conf, "w") as f:
            f.write("model_list: []\nlitellm_settings:\n  telemetry: false\ngeneral_settings: {}\n")
        self._spawn(
            [self.binary, "--config", conf, "--host", "127.0.0.1", "--port", str(self.port), "--num_workers", "1"],
            env={
                "ANTHROPIC_API_BASE": "http://127.0.0.1:%d" % (self.upstream.port,),
                "ANTHROPIC_API_KEY": "sk-bench",
                # Offline: the bundled model price list, no telemetry.
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "LITELLM_TELEMETRY": "False",
            },
        )
