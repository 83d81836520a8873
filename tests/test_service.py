"""
Tests for running the relay as services: under twistd's service tree, and
mounted in another application's ``Site``, on real sockets on 127.0.0.1.
"""

from __future__ import annotations

import os
import subprocess
import sys

import treq
import ujson
from twisted.application.service import IServiceMaker, MultiService
from twisted.internet import reactor
from twisted.plugin import getPlugins
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site
from twisted.web.static import Data

from twisted_relay import Relay, RelayConfig, make_service
from twisted_relay.config import one_upstream
from twisted_relay.simulated import SimulatedUpstream

from tests.helpers import encode, messages_body


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
