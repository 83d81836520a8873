"""
Tests for running the relay as services: under twistd's service tree, and
mounted in another application's ``Site``, on real sockets on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import treq
import ujson
from twisted.application.service import IServiceMaker, MultiService
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.logger import formatEvent, globalLogPublisher
from twisted.plugin import getPlugins
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site
from twisted.web.static import Data

from twisted_relay import Relay, RelayConfig, make_service
from twisted_relay.config import one_upstream
from twisted_relay.signin.managed_settings import settings_checksum
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.tap import Options

from tests.helpers import encode, free_port, messages_body
from tests.test_signin_telemetry import Collector


async def post_json(url: str, body) -> tuple[int, dict]:
    response = await treq.post(
        url, data=encode(body), headers={"content-type": ["application/json"]}, persistent=False
    )
    return response.code, ujson.loads(await response.content())


class EmbeddingTests(TestCase):
    """
    Another Twisted application can run the relay inside its own service
    tree and its own ``Site``, as ``docs/relay.tac`` does.
    """

    async def test_mounted_in_existing_site(self):
        """
        The relay's resource, mounted under ``/relay`` beside the
        application's own page, relays Messages requests; its service,
        parented under the application, starts and stops with it.
        """
        sim_port = reactor.listenTCP(0, Site(SimulatedUpstream(mode="strict").resource()), interface="127.0.0.1")
        self.addCleanup(sim_port.stopListening)

        application = MultiService()
        relay = Relay(
            RelayConfig(listen=(), upstreams=one_upstream("http://127.0.0.1:%d" % (sim_port.getHost().port,)), dump_dir=None),
            reactor,
        )
        relay.service.setServiceParent(application)
        root = Resource()
        root.putChild(b"", Data(b"my application\n", "text/plain"))
        root.putChild(b"relay", relay.resource())
        port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        application.startService()
        self.addCleanup(lambda: application.running and application.stopService())
        self.assertTrue(relay.service.running)

        base = "http://127.0.0.1:%d" % (port.getHost().port,)
        code, message = await post_json(base + "/relay/v1/messages", messages_body())
        self.assertEqual(code, 200)
        self.assertEqual(message["type"], "message")
        own = await treq.get(base + "/", persistent=False)
        self.assertEqual(await own.content(), b"my application\n")

        await application.stopService()
        self.assertFalse(relay.service.running)

    async def test_make_service_listens(self):
        """
        ``make_service`` gives a service that listens on ``config.listen``
        and relays to the upstream once started.
        """
        sim_port = reactor.listenTCP(0, Site(SimulatedUpstream(mode="lenient").resource()), interface="127.0.0.1")
        self.addCleanup(sim_port.stopListening)
        # Find a free port for the relay, then give it to the endpoint string.
        probe = reactor.listenTCP(0, Site(Resource()), interface="127.0.0.1")
        relay_port = probe.getHost().port
        await probe.stopListening()
        service = make_service(
            RelayConfig(
                listen=("tcp:%d:interface=127.0.0.1" % (relay_port,),),
                upstreams=one_upstream("http://127.0.0.1:%d" % (sim_port.getHost().port,)),
                dump_dir=None,
            ),
            reactor,
        )
        service.startService()
        self.addCleanup(service.stopService)
        code, message = await post_json("http://127.0.0.1:%d/v1/messages" % (relay_port,), messages_body())
        self.assertEqual(code, 200)
        self.assertEqual(message["role"], "assistant")

    async def test_simulate_mode(self):
        """
        ``--simulate strict`` runs the simulated upstream inside the relay's
        own service and relays to it: no key and no network needed.
        """
        probe = reactor.listenTCP(0, Site(Resource()), interface="127.0.0.1")
        relay_port = probe.getHost().port
        await probe.stopListening()
        service = make_service(
            RelayConfig(
                listen=("tcp:%d:interface=127.0.0.1" % (relay_port,),),
                simulate="strict",
                simulate_options={"seed": 1, "reuse_every": 2},
                dump_dir=None,
            ),
            reactor,
        )
        service.startService()
        self.addCleanup(service.stopService)
        code, message = await post_json("http://127.0.0.1:%d/v1/messages" % (relay_port,), messages_body())
        self.assertEqual(code, 200)
        self.assertEqual(message["content"][-1]["type"], "tool_use")


SIGNIN_CONFIG = """
[relay]
listen = ["tcp:PORT:interface=127.0.0.1"]
upstream = "http://127.0.0.1:9"
no-dumps = true
no-gc-tuning = true
drain-delay = 0

[relay-keys]
alice = { key = "sk-relay-alice-0001", group = "platform" }

[signin]
public_url = "http://127.0.0.1:PORT"
issuer = "http://127.0.0.1:9"
client_id = "twisted-relay"
session_secret = "a-session-secret-of-forty-characters-xx"
managed_settings = "managed-settings.json"
telemetry_endpoint = "COLLECTOR"
"""

LOG_EXPORT = {"resourceLogs": [{"resource": {"attributes": [{"key": "user.id", "value": {"stringValue": "ceo"}}]},
                                "scopeLogs": [{"logRecords": [{"body": {"stringValue": "claude_code.api_request"}}]}]}]}


class SignInPartsTests(TestCase):
    """
    A relay whose ``[signin]`` table names a managed settings file and a
    collector, started as ``twistd relay --config`` makes it: it serves the
    file at ``/managed/settings`` and forwards the OTLP exports it takes to
    the collector; a reload (SIGHUP) keeps both (the table takes effect at
    restart, and says so), and the file is read again when it changes.
    """

    def setUp(self):
        self.folder = os.path.realpath(self.mktemp())
        os.makedirs(self.folder)
        self.port = free_port()
        self.url = "http://127.0.0.1:%d" % (self.port,)
        self.collector, self.other_collector = Collector(), Collector()
        self.config_path = os.path.join(self.folder, "relay.toml")
        self.collector_url = self.collector.serve(self)
        self.write_config(self.collector_url)
        self.settings = {"env": {"CLAUDE_CODE_ENABLE_TELEMETRY": "1"}, "permissions": {"deny": ["Bash(rm:*)"]}}
        self.write_settings(self.settings)
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def write_config(self, collector: str) -> None:
        with open(self.config_path, "w") as f:
            f.write(SIGNIN_CONFIG.replace("PORT", str(self.port)).replace("COLLECTOR", collector))

    def write_settings(self, settings: dict) -> None:
        with open(os.path.join(self.folder, "managed-settings.json"), "w") as f:
            json.dump(settings, f, indent=2)

    def logged(self) -> list[str]:
        return [formatEvent(e) for e in self.events if e.get("log_namespace", "").startswith("twisted_relay")]

    async def get_settings(self) -> tuple[int, dict]:
        response = await treq.get(self.url + "/managed/settings", headers={"authorization": "Bearer sk-relay-alice-0001"},
                                  persistent=False)
        return response.code, json.loads(await response.content())

    async def export_logs(self) -> int:
        response = await treq.post(self.url + "/v1/logs", data=json.dumps(LOG_EXPORT).encode(), persistent=False,
                                   headers={"authorization": "Bearer sk-relay-alice-0001", "content-type": "application/json"})
        await response.content()
        return response.code

    async def received(self, collector: Collector, count: int) -> list:
        for _ in range(250):  # 5 s at most
            if len(collector.received) >= count:
                break
            await deferLater(reactor, 0.02, lambda: None)
        return collector.received

    async def test_served_forwarded_and_kept_across_a_reload(self):
        options = Options()
        options.parseOptions(["--config", self.config_path])
        relay = Relay(options.config, reactor, command_line=options.command_line)
        relay.service.privilegedStartService()
        relay.service.startService()
        self.addCleanup(lambda: relay.service.stopService() if relay.service.running else None)
        (start_line,) = [line for line in self.logged() if line.startswith("twisted-relay ")]
        self.assertIn("sign-in: %s (issuer http://127.0.0.1:9; managed settings %s; telemetry to %s)"
                      % (self.url, os.path.join(self.folder, "managed-settings.json"), self.collector_url), start_line)

        code, served = await self.get_settings()
        self.assertEqual((code, served["settings"], served["checksum"]), (200, self.settings, settings_checksum(self.settings)))
        self.assertEqual(await self.export_logs(), 200)
        (path, headers, export, _), = await self.received(self.collector, 1)
        attributes = {a["key"]: a["value"]["stringValue"] for a in export["resourceLogs"][0]["resource"]["attributes"]}
        self.assertEqual((path, attributes), (b"/v1/logs", {"user.id": "alice", "identity.source": "relay-key"}))
        self.assertNotIn(b"authorization", headers)

        # The table names another collector: taken at the next start, not by a reload.
        self.write_config(self.other_collector.serve(self))
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(250):
            if any("take effect only at restart" in line for line in self.logged()):
                break
            await deferLater(reactor, 0.02, lambda: None)
        (restart,) = [line for line in self.logged() if "take effect only at restart" in line]
        self.assertIn("signin", restart)
        self.assertEqual(await self.export_logs(), 200)
        self.assertEqual(len(await self.received(self.collector, 2)), 2)
        self.assertEqual(self.other_collector.received, [])
        # The settings file changed: served at once, no reload needed.
        self.settings["env"]["OTEL_LOGS_EXPORTER"] = "otlp"
        self.write_settings(self.settings)
        code, served = await self.get_settings()
        self.assertEqual((code, served["checksum"]), (200, settings_checksum(self.settings)))

        await relay.service.stopService()
        self.assertFalse(relay.telemetry.running)


class PluginTests(SynchronousTestCase):
    """
    ``twistd relay`` is found by Twisted's plugin system.
    """

    def test_plugin_discovered(self):
        """
        The ``relay`` tap is among the ``IServiceMaker`` plugins.
        """
        makers = {p.tapname: p for p in getPlugins(IServiceMaker)}
        self.assertIn("relay", makers)
        self.assertEqual(makers["relay"].options.__module__, "twisted_relay.tap")

    def test_twistd_lists_relay(self):
        """
        ``twistd --help``, run from a folder outside the source tree, lists
        ``relay``: the installed package ships its plugin.
        """
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        scratch = self.mktemp()
        os.makedirs(scratch)
        found = subprocess.run(
            [sys.executable, "-c", "import twisted_relay"], cwd=scratch, env=env, capture_output=True
        )
        if found.returncode != 0:
            self.skipTest("twisted_relay is not installed; run the tests after pip install")
        out = subprocess.run(
            [sys.executable, "-m", "twisted", "--help"], cwd=scratch, env=env, capture_output=True, text=True
        )
        self.assertIn("relay", out.stdout.split())

    def test_relay_help(self):
        """
        ``twistd relay --help`` shows the relay's options.
        """
        scratch = self.mktemp()
        os.makedirs(scratch)
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        out = subprocess.run(
            [sys.executable, "-m", "twisted", "relay", "--help"], cwd=scratch, env=env, capture_output=True, text=True
        )
        if "Unknown command: relay" in out.stdout + out.stderr:
            self.skipTest("twisted_relay is not installed; run the tests after pip install")
        for option in ("--listen", "--upstream", "--upstream-key", "--upstream-ids", "--max-body", "--simulate"):
            self.assertIn(option, out.stdout)


class SettingsLayerTests(SynchronousTestCase):
    """
    The settings are built without Twisted (that no module imports another
    in a circle is tests.test_layout's).
    """

    def test_settings_without_twisted(self):
        """Building a configuration from a command line and a file loads no Twisted module."""
        code = (
            "import sys\n"
            "from twisted_relay.settings import read_settings\n"
            "read_settings({'upstream': 'http://127.0.0.1:9', 'retries': '2'})\n"
            "print(sorted(m for m in sys.modules if m == 'twisted' or m.startswith('twisted.')))\n"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout.strip(), "[]")
