"""
Named relay keys: the ``--relay-keys`` file (one key a line still works,
each key named by a digest; ``NAME = KEY`` and ``NAME GROUP = KEY``), the
``[relay-keys]`` table of a ``--config`` file, what ``RelayConfig`` holds
of them (never shown), and the identity each request gets from its key.
"""

from __future__ import annotations

import hashlib
import os
import textwrap

from twisted.python.filepath import FilePath
from twisted.python.usage import UsageError
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.config import RelayConfig, RelayKey, one_upstream
from twisted_relay.prices import DEFAULT_PRICES
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.tap import Options
from twisted_relay.workers import config_from_json, config_to_json

from tests.helpers import UPSTREAM_URL, InMemoryRelay, RecordingLedger, messages_body
from tests.test_app import result

KEYS = ("sk-relay-plain-0001", "sk-relay-alice-0002", "sk-relay-bob-0003", "c2stcmVsYXktYmFzZTY0==")


class KeyFileTests(SynchronousTestCase):
    """``--relay-keys FILE``."""

    def setUp(self) -> None:
        self.folder = FilePath(self.mktemp())
        self.folder.makedirs()

    def keys(self, text: str) -> tuple[RelayKey, ...]:
        path = self.folder.child("keys")
        path.setContent(textwrap.dedent(text).encode("utf-8"))
        options = Options()
        options.parseOptions(["--relay-keys", path.path])
        return options.config.relay_keys

    def refused(self, text: str) -> str:
        with self.assertRaises(UsageError) as caught:
            self.keys(text)
        message = str(caught.exception)
        for key in KEYS:
            self.assertNotIn(key, message)
        return message

    def test_names_and_groups(self) -> None:
        """A key alone is named by the first 8 hex digits of its SHA-256; NAME = KEY and
        NAME GROUP = KEY name it; a key may hold "=" (base64); comments and blank lines go."""
        keys = self.keys("""
            # the team's keys
            %s

            alice = %s
            bob platform = %s
            carol@example.com research = %s
        """ % KEYS)
        digest = "key-" + hashlib.sha256(KEYS[0].encode()).hexdigest()[:8]
        self.assertEqual([(k.key, k.name, k.group) for k in keys], [
            (KEYS[0], digest, None), (KEYS[1], "alice", None), (KEYS[2], "bob", "platform"),
            (KEYS[3], "carol@example.com", "research"),
        ])

    def test_one_key_a_line_keeps_working(self) -> None:
        """The old format: keys alone, a repeated line counted once."""
        keys = self.keys("%s\n%s\n%s\n" % (KEYS[0], KEYS[1], KEYS[0]))
        self.assertEqual([k.key for k in keys], [KEYS[0], KEYS[1]])

    def test_mistakes(self) -> None:
        """Each mistake names its line and never shows a key."""
        self.assertIn("line 2: write KEY, NAME = KEY or NAME GROUP = KEY",
                      self.refused("%s\nalice %s\n" % (KEYS[0], KEYS[1])))
        self.assertIn("line 1: a name or group must be", self.refused("al/ice = %s\n" % (KEYS[1],)))
        self.assertIn("line 1: write", self.refused("a b c = %s\n" % (KEYS[1],)))
        self.assertIn("two keys are named alice", self.refused("alice = %s\nalice = %s\n" % KEYS[1:3]))
        self.assertIn("the key named bob is given twice", self.refused("alice = %s\nbob = %s\n" % (KEYS[1], KEYS[1])))
        self.assertIn("holds no key", self.refused("# nothing\n"))


class ConfigTableTests(SynchronousTestCase):
    """``[relay-keys]`` in a ``--config`` file."""

    def setUp(self) -> None:
        self.folder = FilePath(self.mktemp())
        self.folder.makedirs()
        self.folder.child("bob.key").setContent(KEYS[2].encode() + b"\n")
        self.patch(os, "environ", dict(os.environ, ALICE_RELAY_KEY=KEYS[1]))

    def config(self, text: str, *argv: str) -> RelayConfig:
        path = self.folder.child("relay.toml")
        path.setContent(textwrap.dedent(text).encode("utf-8"))
        options = Options()
        options.parseOptions(["--config", path.path, *argv])
        return options.config

    def test_sources_and_groups(self) -> None:
        """A name's key from the environment, a file or the file itself, with a group or not;
        added to --relay-keys's."""
        keys_file = self.folder.child("keys")
        keys_file.setContent(("ops = %s\n" % (KEYS[0],)).encode())
        config = self.config("""
            [relay-keys]
            alice = "env:ALICE_RELAY_KEY"
            bob = { key = "file:bob.key", group = "platform" }
            carol = { key = "%s", group = "research" }
        """ % (KEYS[3],), "--relay-keys", keys_file.path)
        self.assertEqual([(k.name, k.group, k.key) for k in config.relay_keys], [
            ("ops", None, KEYS[0]), ("alice", None, KEYS[1]), ("bob", "platform", KEYS[2]),
            ("carol", "research", KEYS[3]),
        ])
        self.assertEqual(set(config.secrets()), set(KEYS))

    def test_mistakes(self) -> None:
        """A bad name, an unknown field, a key given twice (with --relay-keys too): one line
        naming the file, the table and the name, never the key."""
        keys_file = self.folder.child("keys")
        keys_file.setContent(("alice = %s\n" % (KEYS[1],)).encode())
        cases = [
            ('[relay-keys]\n"al ice" = "%s"\n' % (KEYS[0],), (), "[relay-keys] al ice: a name must be"),
            ('[relay-keys]\nbob = { key = "%s", team = "x" }\n' % (KEYS[0],), (), "takes key and group only"),
            ('[relay-keys]\nbob = { key = "%s", group = "a b" }\n' % (KEYS[0],), (), "bob: group must be"),
            ('[relay-keys]\nbob = 3\n', (), 'bob: must be "env:VAR"'),
            ('[relay-keys]\nbob = "env:NOT_SET_ANYWHERE"\n', (), "NOT_SET_ANYWHERE is not set"),
            ('[relay-keys]\nbob = "%s"\n' % (KEYS[1],), ("--relay-keys", keys_file.path), "given twice"),
            ('[relay-keys]\nalice = "%s"\n' % (KEYS[0],), ("--relay-keys", keys_file.path), "two keys are named"),
        ]
        for text, argv, words in cases:
            with self.assertRaises(UsageError) as caught:
                self.config(text, *argv)
            message = str(caught.exception)
            self.assertIn(words, message, text)
            self.assertNotIn("\n", message)
            for key in KEYS:
                self.assertNotIn(key, message)

    def test_prices_table(self) -> None:
        """``[prices]`` adds to the shipped table; a mistake is one line naming it."""
        config = self.config("""
            [prices.models."our-model"]
            input = "1"
            output = "2"
            cache-write-5m = "1.25"
            cache-write-1h = "2"
            cache-read = "0.1"
        """)
        self.assertIsNotNone(config.prices.price_of("our-model"))
        self.assertEqual(config.prices.price_of("claude-opus-5-5"), DEFAULT_PRICES.price_of("claude-opus-5-5"))
        with self.assertRaises(UsageError) as caught:
            self.config('[prices.models.m]\ninput = "1"\n')
        self.assertIn("[prices] models.m needs every rate", str(caught.exception))


class ConfigValueTests(SynchronousTestCase):
    """What ``RelayConfig`` holds."""

    def test_plain_strings_and_repr(self) -> None:
        """A plain string is a key named by its digest; no repr shows a key."""
        config = RelayConfig(relay_keys=(KEYS[0], RelayKey(KEYS[1], "alice")))
        self.assertEqual([k.name for k in config.relay_keys][1], "alice")
        self.assertTrue(config.relay_keys[0].name.startswith("key-"))
        for text in (repr(config), repr(config.relay_keys)):
            for key in KEYS:
                self.assertNotIn(key, text)

    def test_workers_receive_them(self) -> None:
        """Names, groups and prices cross to worker processes whole."""
        config = RelayConfig(relay_keys=(RelayKey(KEYS[2], "bob", "platform"),))
        again = config_from_json(config_to_json(config))
        self.assertEqual(again.relay_keys, config.relay_keys)
        self.assertEqual(again.prices, config.prices)


class IdentityTests(SynchronousTestCase):
    """Each request carries the identity of the key it presented."""

    def test_header_or_bearer(self) -> None:
        """x-api-key or Authorization: Bearer: the record names the key that matched."""
        ledger = RecordingLedger()
        config = RelayConfig(listen=(), upstreams=one_upstream(UPSTREAM_URL), dump_dir=None,
                             relay_keys=(RelayKey(KEYS[1], "alice"), RelayKey(KEYS[2], "bob", "platform")))
        relay = InMemoryRelay(SimulatedUpstream(mode="lenient").resource(), config, ledger=ledger)
        for headers in ({"x-api-key": [KEYS[2]]}, {"authorization": ["Bearer " + KEYS[1]]},
                        {"x-api-key": ["sk-wrong"], "authorization": ["Bearer " + KEYS[2]]}):
            response = result(self, relay, relay.post("/v1/messages", messages_body(), headers=headers))
            self.assertEqual(response.code, 200)
            relay.flush()
        self.assertEqual([(r.key_name, r.key_group) for r in ledger.records],
                         [("bob", "platform"), ("alice", None), ("bob", "platform")])
