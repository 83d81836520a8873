"""
Tests of the deployment recipes in ``deploy/``, each run as far as this
machine allows: the systemd units under ``systemd-socket-activate``, the
container recipe's command, health check and stop signal (no container
engine runs here), and nginx in front of three relays with one stopped
mid-run (``bench/cluster.py`` runs the long version).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from .helpers import free_port, twistd
from .test_operations import post, stop, wait_until_up

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
_HELLO = json.dumps(
    {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
).encode()


def unit_settings(path: str) -> dict[str, list[str]]:
    """A systemd unit file's settings: name -> values, in order."""
    settings: dict[str, list[str]] = {}
    for line in open(path, encoding="utf-8"):
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        name, _, value = line.partition("=")
        settings.setdefault(name.strip(), []).append(value.strip())
    return settings


def _seconds(option: str, argv: list[str]) -> float:
    return float(argv[argv.index(option) + 1])


class SystemdRecipeTests(SynchronousTestCase):
    """``deploy/systemd``: the service's own command line, on a socket passed the systemd way."""

    def setUp(self):
        self.activate = shutil.which("systemd-socket-activate") or (
            "/usr/bin/systemd-socket-activate" if os.access("/usr/bin/systemd-socket-activate", os.X_OK) else None
        )
        self.service = unit_settings(os.path.join(DEPLOY, "systemd", "twisted-relay.service"))
        self.socket = unit_settings(os.path.join(DEPLOY, "systemd", "twisted-relay.socket"))

    def test_units_fit_the_relay(self):
        """
        The service listens on the socket unit's socket, writes no pidfile,
        is stopped with SIGTERM and given longer than the drain delay and
        the grace together.
        """
        (exec_start,) = self.service["ExecStart"]
        argv = shlex.split(exec_start)
        self.assertTrue(argv[0].endswith("/twistd"))
        self.assertEqual(argv[1:3], ["-n", "--pidfile="])
        self.assertIn("systemd:domain=INET:index=0", argv[argv.index("--listen") + 1])
        self.assertEqual(len(self.socket["ListenStream"]), 1)
        self.assertEqual(self.service["KillSignal"], ["SIGTERM"])
        (stop_seconds,) = self.service["TimeoutStopSec"]
        self.assertGreater(float(stop_seconds), _seconds("--drain-delay", argv) + _seconds("--shutdown-grace", argv))
        self.assertEqual(self.service["Requires"], ["twisted-relay.socket"])

    def test_socket_activation(self):
        """
        Under ``systemd-socket-activate`` (systemd's own tool for this), the
        service's command line serves on the passed socket: the relay
        starts on the first connection, answers it, logs JSON naming its
        ``systemd:`` address, and stops on SIGTERM.
        """
        if self.activate is None:
            raise SkipTest("systemd-socket-activate is not installed (Debian's systemd package)")
        (exec_start,) = self.service["ExecStart"]
        argv = shlex.split(exec_start)
        # This interpreter's twistd; the embedded simulated upstream; no drain wait in a test.
        argv = twistd(*argv[1:]) + ["--simulate", "strict", "--no-dumps", "--drain-delay", "0"]
        port = free_port()
        folder = os.path.abspath(self.mktemp())
        os.makedirs(folder)
        out_path = os.path.join(folder, "out.log")
        with open(out_path, "wb") as out:
            process = subprocess.Popen(
                # --fdname: systemd itself always names passed sockets (LISTEN_FDNAMES, the
                # socket unit's name by default), and Twisted wants the names with the sockets.
                [self.activate, "-l", "127.0.0.1:%d" % (port,), "--fdname=twisted-relay.socket", *argv],
                cwd=folder, stdout=out, stderr=subprocess.STDOUT,
            )
            self.addCleanup(lambda: process.poll() is None and (process.kill(), process.wait()))
            # systemd-socket-activate listens first; the first connection then starts the
            # relay, and waits in the socket's backlog meanwhile.
            deadline = time.monotonic() + 20
            health = None
            while health is None and time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen("http://127.0.0.1:%d/health" % (port,), timeout=30) as response:
                        health = json.loads(response.read())
                except ConnectionRefusedError:
                    time.sleep(0.05)
                except urllib.error.URLError as e:
                    if not isinstance(e.reason, ConnectionRefusedError):
                        raise
                    time.sleep(0.05)
            self.assertIsNotNone(health)
            # systemd-socket-activate execs the service: the relay is that very process.
            self.assertEqual(health["pid"], process.pid)
            self.assertEqual(post(port, _HELLO)[0], 200)
            self.assertIn(stop(process), (0, -signal.SIGTERM))
        events = [json.loads(line) for line in open(out_path, encoding="utf-8") if line.startswith("{")]
        (start,) = [e for e in events if "listening on" in e["message"]]
        self.assertEqual(start["listen"], "systemd:domain=INET:index=0")


def dockerfile_instructions(path: str) -> list[tuple[str, str]]:
    """A Dockerfile's instructions, continuation lines joined: (INSTRUCTION, arguments)."""
    instructions = []
    pending = ""
    for line in open(path, encoding="utf-8"):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = pending + stripped
        pending = ""
        name, _, arguments = whole.partition(" ")
        instructions.append((name.upper(), arguments.strip()))
    return instructions


class ContainerRecipeTests(SynchronousTestCase):
    """
    ``deploy/container/Dockerfile``, checked against what the relay needs
    and its command run as the container would run it.
    """

    def setUp(self):
        self.path = os.path.join(DEPLOY, "container", "Dockerfile")
        self.instructions = dockerfile_instructions(self.path)

    def one(self, name: str) -> str:
        (value,) = [arguments for instruction, arguments in self.instructions if instruction == name]
        return value

    def test_recipe_fits_the_relay(self):
        """
        Non-root; ``twistd -n ... relay`` as the command, without a pidfile
        (the relay is process 1), listening on every interface of the
        container on the exposed port; SIGTERM as the stop signal; a
        health check on ``/health`` of that port; the build context leaves
        out the virtualenv and the git folder.
        """
        user = self.one("USER")
        self.assertNotIn(user, ("root", "0", ""))
        command = json.loads(self.one("CMD"))
        self.assertEqual(command[:2], ["twistd", "-n"])
        self.assertIn("--pidfile=", command[: command.index("relay")])
        listen = command[command.index("--listen") + 1]
        port = int(re.match(r"tcp:(\d+):interface=0\.0\.0\.0$", listen).group(1))
        self.assertEqual(self.one("EXPOSE"), str(port))
        self.assertEqual(self.one("STOPSIGNAL"), "SIGTERM")
        healthcheck = self.one("HEALTHCHECK")
        self.assertIn("http://127.0.0.1:%d/health" % (port,), healthcheck)
        ignored = open(os.path.join(DEPLOY, "container", "Dockerfile.dockerignore")).read().split()
        self.assertIn(".venv", ignored)
        self.assertIn(".git", ignored)

    def test_command_health_check_and_stop(self):
        """
        The image's command (on 127.0.0.1 and a free port here, with the
        embedded simulated upstream) serves; the health check's own command
        exits 0 against it; the stop signal ends it cleanly, well within the
        stop timeout the recipe asks for.
        """
        command = json.loads(self.one("CMD"))
        port = free_port()
        listen_at = command.index("--listen") + 1
        command[listen_at] = "tcp:%d:interface=127.0.0.1" % (port,)
        argv = twistd(*command[1:]) + ["--simulate", "strict", "--drain-delay", "0.5"]
        workdir = os.path.abspath(self.mktemp())
        os.makedirs(workdir)
        process = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(lambda: process.poll() is None and (process.kill(), process.wait()))
        wait_until_up(port, process)
        health = json.loads(re.search(r"CMD (\[.*\])$", self.one("HEALTHCHECK")).group(1))
        self.assertEqual(health[0], "python")
        health_argv = [sys.executable] + [arg.replace(":8080/", ":%d/" % (port,)) for arg in health[1:]]
        self.assertEqual(subprocess.run(health_argv, timeout=10).returncode, 0)
        self.assertEqual(post(port, _HELLO)[0], 200)
        started = time.monotonic()
        process.send_signal(getattr(signal, self.one("STOPSIGNAL")))
        self.assertIn(process.wait(timeout=30), (0, -signal.SIGTERM))
        self.assertLess(time.monotonic() - started, 45)
        # Nothing written in the working folder but the dump folder (made
        # at start, when the relay checks that it takes files; no dump here).
        self.assertEqual(os.listdir(workdir), ["relay-dumps"])
        self.assertEqual(os.listdir(os.path.join(workdir, "relay-dumps")), [])

    def test_install_step(self):
        """
        ``pip install`` of the build context (the image's install step)
        builds a package that holds the relay and its twistd plugin.
        """
        runs = " ".join(arguments for instruction, arguments in self.instructions if instruction == "RUN")
        self.assertIn("pip install --no-cache-dir /tmp/twisted-relay", runs)
        out = os.path.abspath(self.mktemp())
        result = subprocess.run(
            # As the image's pip builds it: in an isolated build environment.
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", out, ROOT],
            capture_output=True, timeout=120,
        )
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        (wheel,) = os.listdir(out)
        import zipfile

        names = zipfile.ZipFile(os.path.join(out, wheel)).namelist()
        self.assertIn("twisted/plugins/relay_plugin.py", names)
        self.assertIn("twisted_relay/logs.py", names)
        self.assertFalse([name for name in names if name.startswith((".venv", "tests/"))])


class NginxRecipeTests(SynchronousTestCase):
    """``deploy/nginx``: the recipe as nginx reads it, and three relays behind it."""

    def setUp(self):
        from bench.cluster import find_nginx

        self.nginx = find_nginx()
        if self.nginx is None:
            raise SkipTest("nginx is not installed (apt-get install nginx-light; .ci/run installs it)")

    def test_recipe_is_valid_nginx(self):
        """``nginx -t`` accepts the site file with its proxy snippet, as installed in /etc/nginx."""
        prefix = os.path.abspath(self.mktemp())
        os.makedirs(os.path.join(prefix, "snippets"))
        os.makedirs(os.path.join(prefix, "conf.d"))
        shutil.copy(os.path.join(DEPLOY, "nginx", "twisted-relay-proxy.conf"), os.path.join(prefix, "snippets"))
        shutil.copy(os.path.join(DEPLOY, "nginx", "twisted-relay.conf"), os.path.join(prefix, "conf.d"))
        with open(os.path.join(prefix, "nginx.conf"), "w") as f:
            f.write(
                "pid %s/nginx.pid;\nerror_log %s/error.log;\nevents {}\n"
                "http { access_log off; client_body_temp_path %s/tmp; proxy_temp_path %s/tmp;"
                " fastcgi_temp_path %s/tmp; uwsgi_temp_path %s/tmp; scgi_temp_path %s/tmp;"
                " include conf.d/twisted-relay.conf; }\n" % ((prefix,) * 7)
            )
        result = subprocess.run(
            [self.nginx, "-t", "-q", "-p", prefix, "-e", os.path.join(prefix, "error.log"),
             "-c", os.path.join(prefix, "nginx.conf")],
            capture_output=True, timeout=30,
        )
        self.assertEqual(result.returncode, 0, result.stderr + open(os.path.join(prefix, "error.log"), "rb").read())
        snippet = open(os.path.join(DEPLOY, "nginx", "twisted-relay-proxy.conf")).read()
        self.assertIn("proxy_buffering off;", snippet)
        read_timeout = int(re.search(r"proxy_read_timeout (\d+)s;", snippet).group(1))
        self.assertGreater(read_timeout, 600)  # --response-timeout, and --idle-timeout (300)
        self.assertIn("keepalive ", open(os.path.join(DEPLOY, "nginx", "twisted-relay.conf")).read())

    def cluster_run(self, run, **options):
        """
        ``bench.cluster.run`` (3 relays behind nginx, 3 sessions of 20 turns,
        one relay stopped mid-run), checked for what every variant must
        show: no turn failed, every relay served, one stopped with a
        request in flight. Returns the report and its text.
        """
        folder = os.path.abspath(self.mktemp())
        os.makedirs(folder)
        sessions, turns = 3, 20
        report = run(folder, sessions, turns, event_delay=0.01, drain_delay=1.0, **options)
        detail = "\n".join(report.lines())
        self.assertEqual(report.failed, [], detail)
        self.assertEqual(report.turns, sessions * turns, detail)
        self.assertEqual(len(report.served_by), 3, detail)
        self.assertTrue(all(count > 0 for count in report.served_by.values()), detail)
        self.assertGreaterEqual(report.in_flight_at_stop, 1, detail)
        return report, detail

    def test_three_relays_one_stopped_mid_run(self):
        """
        Three relays behind nginx (upstream keepalive), SDK sessions whose
        turns land on all three; one relay gets SIGTERM while it has a
        request in flight: no turn fails.
        """
        from bench.cluster import run

        report, detail = self.cluster_run(run)
        self.assertGreater(report.served_by_stopped_before_stop, 0, detail)
        self.assertIn(report.stopped_exit_status, (0, -signal.SIGTERM), detail)

    def test_three_relays_sharing_threads_one_stopped_mid_run(self):
        """
        With message threads: three relays on one Redis thread store behind
        nginx, sessions of the SDK's default tool runner (threads on) whose
        continues land on all three, one relay SIGTERMed with a request in
        flight: no turn fails, and continues kept by one relay are found by
        the others.
        """
        from bench.cluster import run

        from .redis_server import SKIP_REASON

        if SKIP_REASON:
            raise SkipTest(SKIP_REASON)
        report, detail = self.cluster_run(run, threads=True)
        self.assertEqual(len(report.thread_lookups), 3, detail)
        # Each relay found threads (the surviving ones, most of them kept by another relay).
        self.assertTrue(all(found.get("hit", 0) > 0 for found in report.thread_lookups.values()), detail)
