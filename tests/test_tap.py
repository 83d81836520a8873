"""
Tests for the ``twistd relay`` options and the service they make.
"""

from twisted.application.service import IServiceCollection
from twisted.python.usage import UsageError
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.config import DEFAULT_LISTEN, DEFAULT_UPSTREAM, MiB, RelayConfig
from twisted_relay.tap import Options, makeService


def parse(*argv):
    options = Options()
    options.parseOptions(list(argv))
    return options


class OptionsTests(SynchronousTestCase):
    """
    ``twistd relay`` options parse into a L{RelayConfig}, and bad values are
    usage errors at start, never tracebacks later.
    """

    def test_defaults(self):
        """
        With no options the relay listens on loopback port 8080, forwards to
        Anthropic, passes the client's credentials through and accepts
        Anthropic's own 32 MiB body limit.
        """
        config = parse().config
        self.assertEqual(config.listen, (DEFAULT_LISTEN,))
        self.assertEqual(config.listen, ("tcp:8080:interface=127.0.0.1",))
        self.assertEqual(config.upstreams[0].url, DEFAULT_UPSTREAM)
        self.assertEqual(config.upstreams[0].keys, ())
        self.assertEqual(config.upstreams[0].ids, "unique")
        self.assertEqual(config.max_body, 32 * MiB)
        self.assertIsNone(config.simulate)
        self.assertTrue(config.gc_tuning)
        # twistd-only defaults: the process-wide GC tuning, and a drain a load balancer sees.
        self.assertEqual(config.drain_delay, 5.0)
        self.assertEqual(
            config, RelayConfig(simulate_options=config.simulate_options, gc_tuning=True, drain_delay=5.0)
        )

    def test_every_option(self):
        """
        Each documented option lands in the configuration.
        """
        config = parse(
            "--listen", "tcp:9000:interface=127.0.0.1",
            "--listen", "unix:/tmp/relay.sock",
            "--upstream", "http://127.0.0.1:8081/",
            "--upstream-key", "sk-test-upstream",
            "--upstream-ids", "original",
            "--connect-timeout", "2.5",
            "--response-timeout", "30",
            "--idle-timeout", "45",
            "--ping-interval", "0",
            "--max-body", "1M",
            "--max-upstream-connections", "64",
            "--dump-dir", "dumps",
            "--dump-max-bytes", "2M",
            "--dump-retention-days", "7",
            "--dump-retention-bytes", "100M",
            "--simulate", "stateful",
            "--simulate-seed", "9",
            "--simulate-reuse-every", "4",
        ).config
        self.assertEqual(
            config.listen, ("tcp:9000:interface=127.0.0.1", "unix:/tmp/relay.sock")
        )
        self.assertEqual(config.upstreams[0].url, "http://127.0.0.1:8081")
        self.assertEqual(config.upstreams[0].keys, ("sk-test-upstream",))
        self.assertEqual(config.upstreams[0].ids, "original")
        self.assertEqual(config.connect_timeout, 2.5)
        self.assertEqual(config.response_timeout, 30)
        self.assertEqual(config.idle_timeout, 45)
        self.assertEqual(config.ping_interval, 0)
        self.assertEqual(config.max_body, MiB)
        self.assertEqual(config.max_upstream_connections, 64)
        self.assertEqual(config.dump_dir, "dumps")
        self.assertEqual(config.dump_max_bytes, 2 * MiB)
        self.assertEqual(config.dump_retention_days, 7)
        self.assertEqual(config.dump_retention_bytes, 100 * MiB)
        self.assertEqual(config.simulate, "stateful")
        self.assertEqual(config.simulate_options["seed"], 9)
        self.assertEqual(config.simulate_options["reuse_every"], 4)

    def test_thinking_binding_recovery(self):
        """Recovery from the "bound to a different conversation" 400 is on by default; off turns it off."""
        self.assertEqual(parse().config.thinking_binding_recovery, "drop_block")
        self.assertEqual(parse("--thinking-binding-recovery", "off").config.thinking_binding_recovery, "off")

    def test_no_dumps(self):
        """
        ``--no-dumps`` turns the dump writer off.
        """
        self.assertIsNone(parse("--no-dumps").config.dump_dir)

    def test_upstream_with_credentials_query_or_fragment(self):
        """
        An upstream URL may not carry a user name, password, query or
        fragment; the error does not repeat the URL (it may hold a key).
        """
        for url in ("https://user:sk-secret@api.example.test", "https://api.example.test/?x=1",
                    "https://api.example.test/#top"):
            with self.assertRaises(UsageError) as caught:
                parse("--upstream", url)
            self.assertNotIn("sk-secret", str(caught.exception))

    def test_no_gc_tuning(self):
        """
        ``--no-gc-tuning`` leaves the garbage collector as Python sets it.
        """
        self.assertFalse(parse("--no-gc-tuning").config.gc_tuning)

    def test_upstream_key_from_environment(self):
        """
        The upstream key can come from the environment, so it never shows in
        the process list.
        """
        self.patch(
            __import__("os").environ, "get",
            lambda name, default=None: "sk-from-env" if name == "TWISTED_RELAY_UPSTREAM_KEY" else default,
        )
        self.assertEqual(parse().config.upstreams[0].keys, ("sk-from-env",))

    def test_bad_values(self):
        """
        Every bad value is a L{UsageError} whose message names the option.
        """
        cases = [
            (["--upstream", "ftp://example"], "--upstream"),
            (["--upstream", "not a url"], "--upstream"),
            (["--upstream-ids", "random"], "--upstream-ids"),
            (["--connect-timeout", "soon"], "--connect-timeout"),
            (["--response-timeout", "0"], "--response-timeout"),
            (["--idle-timeout", "-1"], "--idle-timeout"),
            (["--ping-interval", "x"], "--ping-interval"),
            (["--max-body", "lots"], "--max-body"),
            (["--max-body", "0"], "--max-body"),
            (["--listen", "nonsense:1"], "--listen"),
            (["--simulate", "chaotic"], "--simulate"),
            (["--simulate-seed", "x"], "--simulate-seed"),
            (["--max-upstream-connections", "0"], "--max-upstream-connections"),
            (["--thinking-binding-recovery", "retry"], "--thinking-binding-recovery"),
        ]
        for argv, name in cases:
            with self.assertRaises(UsageError, msg=repr(argv)) as raised:
                parse(*argv)
            self.assertIn(name, str(raised.exception), argv)

    def test_units_named(self):
        """A value that is no number is refused in the option's own unit: days for dump retention."""
        for argv, unit in ((["--dump-retention-days", "soon"], "days"), (["--connect-timeout", "soon"], "seconds")):
            with self.assertRaises(UsageError) as raised:
                parse(*argv)
            self.assertIn("must be a number of %s" % (unit,), str(raised.exception))

    def test_sizes(self):
        """
        Sizes accept plain bytes and K, M, G suffixes (with or without ``iB``).
        """
        self.assertEqual(parse("--max-body", "1048576").config.max_body, MiB)
        self.assertEqual(parse("--max-body", "512K").config.max_body, 512 * 1024)
        self.assertEqual(parse("--max-body", "2MiB").config.max_body, 2 * MiB)
        self.assertEqual(parse("--max-body", "1G").config.max_body, 1024 * MiB)


class MakeServiceTests(SynchronousTestCase):
    """
    ``makeService`` builds a service collection from the options.
    """

    def test_service_collection(self):
        """
        The service is a collection holding a listener per ``--listen``.
        """
        from twisted.application.internet import StreamServerEndpointService
        from twisted.internet.testing import MemoryReactorClock

        options = parse(
            "--listen", "tcp:0:interface=127.0.0.1",
            "--listen", "tcp:0:interface=127.0.0.1",
            "--no-dumps",
        )
        service = makeService(options, MemoryReactorClock())
        self.assertTrue(IServiceCollection.providedBy(service))
        listeners = [s for s in service if isinstance(s, StreamServerEndpointService)]
        self.assertEqual(len(listeners), 2)


class BreakerOptionsTests(SynchronousTestCase):
    """The circuit breaker's settings are options like any other."""

    def test_values(self):
        """``--breaker-failures``, ``--breaker-cooldown`` and ``--key-rest`` land in the configuration."""
        config = parse("--breaker-failures", "5", "--breaker-cooldown", "12.5", "--key-rest", "60").config
        self.assertEqual((config.breaker_failures, config.breaker_cooldown, config.key_rest), (5, 12.5, 60.0))
        default = parse().config
        self.assertEqual((default.breaker_failures, default.breaker_cooldown, default.key_rest), (3, 30.0, 600.0))

    def test_bad_values(self):
        """Bad values are usage errors naming the option."""
        for argv, name in (
            (["--breaker-failures", "0"], "--breaker-failures"),
            (["--breaker-failures", "many"], "--breaker-failures"),
            (["--breaker-cooldown", "0"], "--breaker-cooldown"),
            (["--key-rest", "-5"], "--key-rest"),
        ):
            with self.assertRaises(UsageError) as raised:
                parse(*argv)
            self.assertIn(name, str(raised.exception))


class ThreadOptionsTests(SynchronousTestCase):
    """The thread options reach the configuration; bad values are refused with the option named."""

    def test_options(self):
        """Each thread option sets its field."""
        options = Options()
        options.parseOptions([
            "--threads", "upstream", "--thread-store", "redis://127.0.0.1:6390/2", "--thread-ttl", "60",
            "--thread-max-count", "50", "--thread-max-bytes", "8M",
        ])
        config = options.config
        self.assertEqual(
            (config.threads, config.thread_store, config.thread_ttl, config.thread_max_count, config.thread_max_bytes),
            ("upstream", "redis://127.0.0.1:6390/2", 60.0, 50, 8 * 1024 * 1024),
        )

    def test_defaults(self):
        """Threads are held by the relay, in memory, 5 minutes, 10,000 threads, 512 MiB."""
        options = Options()
        options.parseOptions([])
        config = options.config
        self.assertEqual(
            (config.threads, config.thread_store, config.thread_ttl, config.thread_max_count, config.thread_max_bytes),
            ("relay", "memory", 300.0, 10_000, 512 * 1024 * 1024),
        )

    def test_refused(self):
        """Unknown modes and stores, and empty bounds, are usage errors naming the option."""
        for argv, named in (
            (["--threads", "off"], "--threads"),
            (["--thread-store", "memcached://x"], "--thread-store"),
            (["--thread-max-count", "0"], "--thread-max-count"),
            (["--thread-ttl", "-1"], "--thread-ttl"),
            (["--thread-ttl", "0", "--thread-store", "redis://127.0.0.1"], "--thread-ttl"),
        ):
            options = Options()
            error = self.assertRaises(UsageError, options.parseOptions, argv)
            self.assertIn(named, str(error))


class SettingsModesTests(SynchronousTestCase):
    """The settings check thread modes without importing the Twisted modules that use them."""

    def test_same_modes(self):
        """``--simulate-threads`` takes the modes the simulated upstream knows (``--threads`` reads the model's)."""
        from twisted_relay import settings
        from twisted_relay.simulated.message_threads import THREAD_MODES as SIMULATED_THREAD_MODES
        from twisted_relay.simulated.today import APIS

        self.assertEqual(settings._SIMULATED_THREAD_MODES, SIMULATED_THREAD_MODES)
        self.assertEqual(settings._SIMULATED_APIS, APIS)

    def test_simulate_api(self):
        """``--simulate-api`` reaches the simulated upstream; today's API is the default."""
        self.assertEqual(parse("--simulate", "strict").config.simulate_options["api"], "2026-12")
        self.assertEqual(parse("--simulate", "strict", "--simulate-api", "2025").config.simulate_options["api"], "2025")
        with self.assertRaises(UsageError):
            parse("--simulate", "strict", "--simulate-api", "2024")
