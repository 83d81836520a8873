"""
The per-upstream id rules as settings: ``id-pattern`` and ``own-ids`` in a
``[upstreams.NAME]`` table, ``--upstream-id-pattern`` and
``--upstream-own-ids`` for the one upstream, each mistake one line naming
where it is, and :func:`~twisted_relay.config.rules_for` turning an upstream
into the :class:`~twisted_relay.translation.UpstreamRules` its requests are
translated with.
"""

from __future__ import annotations

from twisted.python.usage import UsageError
from twisted.trial.unittest import SynchronousTestCase

from tests.test_configfile import FileTestCase
from twisted_relay.config import RelayConfig, Upstream, rules_for
from twisted_relay.settings import reload_config
from twisted_relay.tap import Options
from twisted_relay.translation import ANTHROPIC_ID_PATTERN, translate_request
from twisted_relay.workers import config_from_json, config_to_json

KIMI_OWN = r"functions\.[A-Za-z_]+:[0-9]+"

TWO_UPSTREAMS = """
[upstreams.kimi]
url = "http://127.0.0.1:8001"
ids = "original"
own-ids = '%s'

[upstreams.strict]
url = "http://127.0.0.1:8002"
id-pattern = '^[A-Za-z0-9_]+$'

[upstreams.open]
url = "http://127.0.0.1:8003"
id-pattern = "none"
""" % (KIMI_OWN,)

UP = '[upstreams.a]\nurl = "http://h"\n'


class FileKeysTests(FileTestCase):
    """``id-pattern`` and ``own-ids`` in upstream tables reach the upstreams and their rules."""

    def test_keys_reach_the_upstreams(self):
        """Each table's keys land in its ``Upstream``; left out, the policy's default stays."""
        config = self.parse("--config", self.write(TWO_UPSTREAMS))
        kimi, strict, open_ = config.upstreams
        self.assertEqual((kimi.ids, kimi.id_pattern, kimi.own_ids), ("original", "default", KIMI_OWN))
        self.assertEqual((strict.ids, strict.id_pattern, strict.own_ids), ("unique", "^[A-Za-z0-9_]+$", None))
        self.assertIsNone(open_.id_pattern)

    def test_rules_of_each_upstream(self):
        """
        ``rules_for`` maps the settings, resolves ``default`` by policy, and
        marks thinking since the configuration has more than one upstream.
        """
        config = self.parse("--config", self.write(TWO_UPSTREAMS))
        kimi, strict, open_ = (rules_for(u, config) for u in config.upstreams)
        self.assertEqual((kimi.name, kimi.policy, kimi.id_pattern, kimi.own_ids), ("kimi", "original", None, KIMI_OWN))
        self.assertEqual((strict.name, strict.id_pattern), ("strict", "^[A-Za-z0-9_]+$"))
        self.assertIsNone(open_.id_pattern)
        self.assertTrue(kimi.mark_thinking and strict.mark_thinking and open_.mark_thinking)
        self.assertIs(rules_for(config.upstreams[1], config), strict, "the same settings give the same rules")

    def test_rules_encode_for_their_upstream(self):
        """A Kimi id is encoded for the strict upstream's pattern and goes as it is to the one without a pattern."""
        config = self.parse("--config", self.write(TWO_UPSTREAMS))
        body = {
            "model": "m",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "functions.echo:1", "name": "echo",
                                                   "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "functions.echo:1"}]},
            ],
        }
        _, strict, open_ = config.upstreams
        sent = translate_request(body, rules_for(strict, config)).upstream_body["messages"]
        self.assertEqual(sent[1]["content"][0]["id"], "twr_functions_2e_echo_3a_1")
        self.assertEqual(sent[2]["content"][0]["tool_use_id"], "twr_functions_2e_echo_3a_1")
        self.assertFalse(translate_request(body, rules_for(open_, config)).changed)

    def test_survives_workers_and_reload(self):
        """The keys pass to worker processes, and a reload takes changed ones."""
        path = self.write(TWO_UPSTREAMS)
        config = self.parse("--config", path)
        self.assertEqual(config_from_json(config_to_json(config)).upstreams, config.upstreams)
        self.write(TWO_UPSTREAMS.replace("^[A-Za-z0-9_]+$", "^[A-Za-z0-9_.]+$"))
        result = reload_config(config)
        self.assertIsNone(result.error)
        self.assertEqual(result.config.upstream_named("strict").id_pattern, "^[A-Za-z0-9_.]+$")


class FileKeyErrorTests(FileTestCase):
    """Each bad ``id-pattern`` or ``own-ids`` is one line naming the file, the table and the key."""

    def assertRefused(self, text, *parts):
        message = self.refused(text)
        self.assertTrue(message.startswith(self.folder.child("relay.toml").path + ": "), message)
        for part in parts:
            self.assertIn(part, message)

    def test_bad_regex(self):
        """A pattern that does not compile is named with the reason."""
        self.assertRefused(UP + "id-pattern = '^[a-z'\n", "[upstreams.a] id-pattern:", "not a regular expression")
        self.assertRefused(UP + "ids = \"original\"\nown-ids = '('\n", "[upstreams.a] own-ids:",
                           "not a regular expression")

    def test_pattern_refusing_encoded_ids(self):
        """A pattern the relay's encoded ids cannot match is refused when the file is read, not at a request."""
        self.assertRefused(UP + "id-pattern = '^[a-z]+$'\n", "[upstreams.a] id-pattern:", "refuses the relay's encoded")
        self.assertRefused(UP + "id-pattern = 'default_'\n", "[upstreams.a] id-pattern:")

    def test_wrong_types(self):
        """Not a string, an empty one, or own ids for a ``unique`` upstream."""
        self.assertRefused(UP + "id-pattern = 3\n", "[upstreams.a] id-pattern:", "regular expression")
        self.assertRefused(UP + 'id-pattern = ""\n', "[upstreams.a] id-pattern:")
        self.assertRefused(UP + 'ids = "original"\nown-ids = ["x"]\n', "[upstreams.a] own-ids:")
        self.assertRefused(UP + "own-ids = 'x'\n", "[upstreams.a] own-ids:", 'ids = "original" only')

    def test_one_upstream_options_beside_upstreams(self):
        """The one-upstream options are refused beside ``[upstreams]``, in the file and on the command line."""
        self.assertRefused(UP + "[relay]\nupstream-id-pattern = 'none'\n", "[relay] upstream-id-pattern:")
        message = self.refused(UP, "--upstream-id-pattern", "none")
        self.assertIn("--upstream-id-pattern", message)


class CommandLineTests(SynchronousTestCase):
    """``--upstream-id-pattern`` and ``--upstream-own-ids`` describe the one upstream."""

    def parse(self, *argv) -> RelayConfig:
        options = Options()
        options.parseOptions(list(argv))
        return options.config

    def test_defaults(self):
        """Without them, the one upstream has Anthropic's pattern and no mark on thinking (one upstream)."""
        config = self.parse()
        rules = rules_for(config.upstreams[0], config)
        self.assertEqual((rules.id_pattern, rules.own_ids, rules.mark_thinking), (ANTHROPIC_ID_PATTERN, None, False))
        config = self.parse("--upstream-ids", "original")
        self.assertIsNone(rules_for(config.upstreams[0], config).id_pattern)

    def test_given(self):
        """Given, they reach the one upstream, and survive a change of another setting."""
        config = self.parse("--upstream-ids", "original", "--upstream-id-pattern", "^[A-Za-z0-9_.:-]+$",
                            "--upstream-own-ids", KIMI_OWN)
        self.assertEqual(config.upstreams[0].id_pattern, "^[A-Za-z0-9_.:-]+$")
        self.assertEqual(config.with_changes(retries=2).upstreams[0].own_ids, KIMI_OWN)
        self.assertIsNone(self.parse("--upstream-id-pattern", "none").upstreams[0].id_pattern)

    def test_errors(self):
        """Each mistake is one line naming the option."""
        cases = [
            (("--upstream-id-pattern", "[a-z"), "--upstream-id-pattern: id pattern '[a-z' is not a regular expression"),
            (("--upstream-id-pattern", "^[a-z]+$"), "refuses the relay's encoded ids"),
            (("--upstream-own-ids", "x"), "--upstream-own-ids applies to --upstream-ids original only"),
            (("--upstream-ids", "original", "--upstream-own-ids", "("), "--upstream-own-ids: own ids pattern"),
        ]
        for argv, expected in cases:
            with self.assertRaises(UsageError) as caught:
                self.parse(*argv)
            self.assertIn(expected, str(caught.exception))
            self.assertNotIn("\n", str(caught.exception))

    def test_one_upstream_marks_no_thinking(self):
        """A configuration of two upstreams marks thinking; one does not."""
        one = RelayConfig(listen=())
        two = RelayConfig(listen=(), upstreams=(Upstream("a", "http://a"), Upstream("b", "http://b")))
        self.assertFalse(rules_for(one.upstreams[0], one).mark_thinking)
        self.assertTrue(rules_for(two.upstreams[0], two).mark_thinking)
