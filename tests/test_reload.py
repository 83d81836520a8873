"""
Tests for reloading a running relay's configuration file: L{Relay.reload},
called by an application that embeds the relay or by SIGHUP in a running
``twistd relay`` service.
"""

from __future__ import annotations

import os
import signal

from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.logger import globalLogPublisher
from twisted.python.filepath import FilePath
from twisted.trial.unittest import SynchronousTestCase, TestCase

from twisted_relay import Relay
from twisted_relay.affinity import conversation_of, key_digest, key_order
from twisted_relay.config import RelayConfig, Target, one_upstream
from twisted_relay.settings import read_settings, reload_config
from twisted_relay.tap import Options

SECRET = "sk-ant-reload-secret-0005"

CONFIG = """
[relay]
listen = ["tcp:0:interface=127.0.0.1"]
no-dumps = true
no-gc-tuning = true

[upstreams.local]
url = "http://127.0.0.1:8000"

[upstreams.anthropic]
url = "https://api.anthropic.com"
keys = ["%s"]

[[routes]]
models = ["claude-haiku-*"]
targets = [{ upstream = "local", model = "MODEL" }, { upstream = "anthropic" }]

[[routes]]
targets = [{ upstream = "anthropic" }]
""" % (SECRET,)


class ReloadTests(TestCase):
    """
    A valid file applies to new requests (the relay's configuration and
    router); an invalid one is refused with one log line and the running
    configuration stays.
    """

    def setUp(self):
        folder = FilePath(self.mktemp())
        folder.makedirs()
        self.path = folder.child("relay.toml")
        self.write("small-model")
        options = Options()
        options.parseOptions(["--config", self.path.path, "--key-rest", "300"])
        self.relay = Relay(options.config, reactor, command_line=options.command_line)
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def write(self, model, text=CONFIG):
        self.path.setContent(text.replace("MODEL", model).encode())

    def haiku_target(self):
        plan = self.relay.router.plan({"model": "claude-haiku-4-5"}, 10)
        return plan.first()

    def logged(self):
        from twisted.logger import formatEvent

        return [formatEvent(e) for e in self.events if e.get("log_namespace", "").startswith("twisted_relay")]

    def test_valid_file(self):
        """
        A valid file replaces the routes for new requests, and the router
        keeps what it learned of upstreams that did not change.
        """
        self.assertEqual(self.haiku_target().model, "small-model")
        router = self.relay.router
        for _ in range(3):
            plan = router.plan({"model": "claude-haiku-4-5"}, 10)
            plan.report(plan.first(), error_kind="connect")
        self.assertEqual(router.state("local"), "open")
        self.write("smaller-model")
        result = self.relay.reload()
        self.assertIsNone(result.error)
        self.assertEqual(self.relay.config.routes[0].targets[0], Target("local", "smaller-model"))
        self.assertEqual(self.relay.router.state("local"), "open")
        self.assertTrue(any("Configuration reloaded" in line for line in self.logged()))

    def test_prices_reloaded(self):
        """A ``[prices]`` table read again applies to new answers, with no restart."""
        self.assertIsNone(self.relay.config.prices.price_of("our-model"))
        self.write("small-model", CONFIG + """
[prices.models."our-model"]
input = "1"
output = "2"
cache-write-5m = "1.25"
cache-write-1h = "2"
cache-read = "0.10"
""")
        result = self.relay.reload()
        self.assertEqual((result.error, result.needs_restart), (None, ()))
        self.assertEqual(self.relay.config.prices.price_of("our-model").rates["output_tokens"], 2)

    def test_command_line_still_wins(self):
        """The options the relay was started with still win over the file read again."""
        self.assertEqual(self.relay.config.key_rest, 300.0)
        self.write("small-model", CONFIG.replace("[relay]\n", "[relay]\nbreaker-cooldown = 12\nkey-rest = 60\n"))
        result = self.relay.reload()
        self.assertIsNone(result.error)
        self.assertEqual((self.relay.config.breaker_cooldown, self.relay.config.key_rest), (12.0, 300.0))

    def test_invalid_file(self):
        """
        An invalid file is refused with one log line naming the file, table
        and key; the running configuration and router stay.
        """
        config, router = self.relay.config, self.relay.router
        self.write("x", CONFIG.replace('upstream = "local"', 'upstream = "locl"'))
        result = self.relay.reload()
        self.assertIs(self.relay.config, config)
        self.assertIs(self.relay.router, router)
        lines = [line for line in self.logged() if "not reloaded" in line]
        self.assertEqual(len(lines), 1)
        self.assertIn("%s: [[routes]] #1 targets #1 upstream:" % (self.path.path,), lines[0])
        self.assertIn(result.error, lines[0])
        for line in self.logged():
            self.assertNotIn(SECRET, line)

    async def test_sighup(self):
        """
        In a running relay service, SIGHUP reads the file again; stopping
        the service puts the former SIGHUP handler back.
        """
        former = signal.getsignal(signal.SIGHUP)
        self.relay.service.startService()
        try:
            self.write("after-hangup")
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(100):
                if self.haiku_target().model == "after-hangup":
                    break
                await deferLater(reactor, 0.02, lambda: None)
            self.assertEqual(self.haiku_target().model, "after-hangup")
        finally:
            await self.relay.service.stopService()
        self.assertEqual(signal.getsignal(signal.SIGHUP), former)


class FileUpstreamsTests(TestCase):
    """
    A relay started with a file of upstreams (and no routes) sends every
    model to the file's first upstream, with the first key of its pool:
    not to the default upstream, and never without the key it was given.
    """

    async def test_first_upstream_serves(self):
        """A request through the relay reaches the first upstream, carrying its key."""
        import treq
        from twisted.web.resource import Resource
        from twisted.web.server import Site

        from twisted_relay.simulated import SimulatedUpstream

        sim = SimulatedUpstream(mode="lenient", require_key=SECRET)
        sim_port = reactor.listenTCP(0, Site(sim.resource()), interface="127.0.0.1")
        self.addCleanup(sim_port.stopListening)
        probe = reactor.listenTCP(0, Site(Resource()), interface="127.0.0.1")
        relay_port = probe.getHost().port
        await probe.stopListening()
        folder = FilePath(self.mktemp())
        folder.makedirs()
        path = folder.child("relay.toml")
        path.setContent(
            (
                '[relay]\nlisten = "tcp:%d:interface=127.0.0.1"\nno-dumps = true\n\n'
                '[upstreams.sim]\nurl = "http://127.0.0.1:%d"\nkeys = ["env:RELAY_TODAY_KEY", "sk-ant-second"]\n\n'
                '[upstreams.other]\nurl = "http://127.0.0.1:9"\n'
                % (relay_port, sim_port.getHost().port)
            ).encode()
        )
        self.patch(os, "environ", dict(os.environ, RELAY_TODAY_KEY=SECRET))
        options = Options()
        options.parseOptions(["--config", path.path, "--no-gc-tuning"])
        relay = Relay(options.config, reactor)
        relay.service.startService()
        self.addCleanup(relay.service.stopService)
        # A conversation whose own key is the pool's first (keys go by conversation).
        pool = [key_digest(SECRET), key_digest("sk-ant-second")]
        words = next(w for w in ("hello", "hi", "hey", "good day", "greetings")
                     if key_order(conversation_of({"messages": [{"role": "user", "content": w}]}), pool)[0] == 0)
        response = await treq.post(
            "http://127.0.0.1:%d/v1/messages" % (relay_port,),
            data=b'{"model": "claude-sonnet-4-5", "max_tokens": 16, "messages": [{"role": "user", "content": "%s"}]}'
            % (words.encode("ascii"),),
            headers={"content-type": ["application/json"], "x-api-key": ["sk-ant-client-own"]},
            persistent=False,
        )
        self.assertEqual(response.code, 200, await response.text())
        await response.content()
        self.assertEqual(len(sim.requests), 1)


class EmbeddedReloadTests(TestCase):
    """
    An application that embeds the relay (no twistd, no command line)
    reloads its configuration file through L{Relay.reload}.
    """

    async def test_reload_takes_effect(self):
        """
        A relay built in code with a C{config_file} takes the file's
        upstreams and routes on reload: the next request goes to the new
        upstream, with its key and the route's model; a setting the file
        leaves alone (C{listen}, empty for a mounted relay) is no change.
        """
        import treq
        from twisted.web.server import Site

        from tests.helpers import serve_relay
        from twisted_relay.simulated import SimulatedUpstream

        sim = SimulatedUpstream(mode="lenient", require_key=SECRET)
        sim_port = reactor.listenTCP(0, Site(sim.resource()), interface="127.0.0.1")
        self.addCleanup(sim_port.stopListening)
        folder = FilePath(self.mktemp())
        folder.makedirs()
        path = folder.child("relay.toml")
        path.setContent(b"")
        config = RelayConfig(
            listen=(), dump_dir=None, upstreams=one_upstream("http://127.0.0.1:1"), config_file=path.path
        )
        served = serve_relay(self, config, reactor)
        relay = served.relay

        async def post():
            response = await treq.post(
                served.url + "/v1/messages",
                data=b'{"model": "claude-haiku-4-5", "max_tokens": 16, '
                b'"messages": [{"role": "user", "content": "hi"}]}',
                headers={"content-type": ["application/json"], "x-api-key": ["sk-ant-client-own"]},
                persistent=False,
            )
            await response.content()
            return response

        self.assertNotEqual((await post()).code, 200)
        self.assertEqual(len(sim.requests), 0)
        path.setContent(
            (
                '[upstreams.sim]\nurl = "http://127.0.0.1:%d"\nkeys = ["%s"]\n\n'
                '[[routes]]\nmodels = ["claude-haiku-*"]\ntargets = [{ upstream = "sim", model = "small-model" }]\n'
                % (sim_port.getHost().port, SECRET)
            ).encode()
        )
        listening = relay.config.listen
        result = relay.reload()
        self.assertIsNone(result.error)
        self.assertEqual(result.needs_restart, ())
        self.assertEqual([u.name for u in relay.config.upstreams], ["sim"])
        self.assertEqual(relay.config.listen, listening)
        self.assertEqual((await post()).code, 200)
        self.assertEqual(len(sim.requests), 1)
        self.assertEqual(sim.requests[0].body["model"], "small-model")
        self.assertEqual(sim.requests[0].headers["x-api-key"], SECRET)


class ReloadWithCommandLineTests(SynchronousTestCase):
    """
    ``settings.reload_config`` under ``twistd relay``: the command line and
    the file are read together, as at start.
    """

    def write(self, text: str) -> str:
        path = FilePath(self.mktemp())
        path.setContent(text.encode("utf-8"))
        return path.path

    def test_command_line_relying_on_the_file(self):
        """A command-line option valid only with the file's value reloads as it started."""
        command_line = {"upstream-own-ids": "^toolu_"}
        path = self.write('[relay]\nupstream-ids = "original"\n')
        running = read_settings(command_line, path)
        result = reload_config(running, command_line)
        self.assertIsNone(result.error)
        self.assertEqual(result.config.upstreams[0].own_ids, "^toolu_")

    def test_restart_setting_taken_out_of_the_file(self):
        """A restart-only setting deleted from the file is reported as one that needs a restart."""
        path = self.write('[relay]\nmax-body = "64M"\n')
        running = read_settings({}, path)
        self.assertEqual(running.max_body, 64 * 1024 * 1024)
        FilePath(path).setContent(b"")
        result = reload_config(running, {})
        self.assertIsNone(result.error)
        self.assertEqual(result.needs_restart, ("max_body",))
        self.assertEqual(result.config.max_body, 64 * 1024 * 1024)
