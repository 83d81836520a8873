"""
Tests for the ``--config`` file (L{twisted_relay.configfile}) and its place
in ``twistd relay``'s options: the file's settings, the command line winning
over them, one-line errors that never show a key, and reload.
"""

import os
import subprocess
import sys
import textwrap

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.python.filepath import FilePath
from twisted.python.usage import UsageError
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.config import RelayConfig, Route, Target, Upstream, one_upstream
from twisted_relay.configfile import ConfigFileError, load
from twisted_relay.settings import SettingsError, config_from, option_kinds, read_settings, reload_config
from twisted_relay.tap import Options
from twisted_relay.workers import config_from_json, config_to_json

# Keys of every kind the file can give; none may ever be shown.
ENV_KEY = "sk-ant-from-environment-0001"
FILE_KEY = "sk-ant-from-key-file-0002"
LITERAL_KEY = "sk-ant-literal-in-file-0003"
RELAY_KEY = "sk-ant-relay-upstream-key-0004"
ALL_KEYS = (ENV_KEY, FILE_KEY, LITERAL_KEY, RELAY_KEY)

EXAMPLE = """
[relay]
listen = ["tcp:0:interface=127.0.0.1"]
dump-dir = "dumps-here"
connect-timeout = 4
retries = 2
retry-statuses = [429, 529]
no-metrics = true

[upstreams.anthropic]
url = "https://api.anthropic.com/"
keys = ["env:RELAY_TEST_KEY_A", "file:anthropic.key", "%(literal)s"]
ids = "unique"
response-timeout = 90

[upstreams.local]
url = "http://127.0.0.1:8000"
ids = "original"
max-connections = 8

[[routes]]
models = ["claude-3-5-haiku*", "claude-haiku-*"]
targets = [{ upstream = "local", model = "qwen3-coder" },
           { upstream = "anthropic" }]

[[routes]]
thinking = true
images = false
body-over = "200K"
targets = [{ upstream = "anthropic" }]

[[routes]]
targets = [{ upstream = "anthropic" }]
""" % {"literal": LITERAL_KEY}


class FileTestCase(SynchronousTestCase):
    """Writes configuration files in a fresh folder with a key file beside them."""

    def setUp(self):
        self.folder = FilePath(self.mktemp())
        self.folder.makedirs()
        self.folder.child("anthropic.key").setContent(FILE_KEY.encode() + b"\n")
        self.patch(os, "environ", dict(os.environ, RELAY_TEST_KEY_A=ENV_KEY))

    def write(self, text, name="relay.toml"):
        path = self.folder.child(name)
        path.setContent(textwrap.dedent(text).encode("utf-8"))
        return path.path

    def parse(self, *argv):
        options = Options()
        options.parseOptions(list(argv))
        return options.config

    def refused(self, text, *argv):
        """The one-line error a file (and command line) gets; it never shows a key."""
        path = self.write(text)
        with self.assertRaises(UsageError) as caught:
            self.parse("--config", path, *argv)
        message = str(caught.exception)
        self.assertNotIn("\n", message)
        for key in ALL_KEYS:
            self.assertNotIn(key, message)
        return message


class FileSettingsTests(FileTestCase):
    """A valid file lands in the configuration."""

    def test_example(self):
        """
        The documented example gives its upstreams, keys (from the
        environment, a file beside the configuration, or the file itself),
        id policies, per-upstream settings and routes.
        """
        config = self.parse("--config", self.write(EXAMPLE))
        anthropic, local = config.upstreams
        self.assertEqual(
            anthropic,
            Upstream(
                "anthropic",
                "https://api.anthropic.com",
                keys=(ENV_KEY, FILE_KEY, LITERAL_KEY),
                ids="unique",
                response_timeout=90.0,
            ),
        )
        self.assertEqual(local, Upstream("local", "http://127.0.0.1:8000", ids="original", max_connections=8))
        self.assertEqual(
            config.routes,
            (
                Route(
                    models=("claude-3-5-haiku*", "claude-haiku-*"),
                    targets=(Target("local", "qwen3-coder"), Target("anthropic")),
                ),
                Route(targets=(Target("anthropic"),), thinking=True, images=False, body_over=200 * 1024),
                Route(targets=(Target("anthropic"),)),
            ),
        )
        self.assertEqual(config.settings_for(anthropic).connect_timeout, 4.0)
        self.assertEqual(config.settings_for(local).max_connections, 8)
        self.assertEqual(config.config_file, os.path.abspath(self.folder.child("relay.toml").path))
        # The first upstream is the file's, not a default.
        self.assertEqual(
            (config.upstreams[0].url, config.upstreams[0].keys[0], config.upstreams[0].ids),
            ("https://api.anthropic.com", ENV_KEY, "unique"),
        )
        reversed_file = self.write(EXAMPLE.replace("[upstreams.anthropic]", "[upstreams.first]", 1)
                                   .replace('upstream = "anthropic"', 'upstream = "first"')
                                   .replace("[upstreams.local]", "[upstreams.z]").replace('"local"', '"z"'), "b.toml")
        self.assertEqual(self.parse("--config", reversed_file).upstreams[0].name, "first")

    def test_relay_table(self):
        """``[relay]`` holds command-line options by their long names."""
        config = self.parse("--config", self.write(EXAMPLE))
        self.assertEqual(config.listen, ("tcp:0:interface=127.0.0.1",))
        self.assertEqual(config.dump_dir, "dumps-here")
        self.assertEqual(config.connect_timeout, 4.0)
        self.assertEqual(config.retries, 2)
        self.assertEqual(config.retry_statuses, (429, 529))
        self.assertFalse(config.metrics)

    def test_command_line_wins(self):
        """
        An option on the command line wins over the file's, even when it
        gives the default value; options the command line leaves out keep
        the file's.
        """
        config = self.parse(
            "--config", self.write(EXAMPLE), "--connect-timeout", "10", "--listen", "tcp:0", "--dump-dir", "x"
        )
        self.assertEqual(config.connect_timeout, 10.0)
        self.assertEqual(config.listen, ("tcp:0",))
        self.assertEqual(config.dump_dir, "x")
        self.assertEqual(config.retries, 2)

    def test_command_line_wins_in_every_spelling(self):
        """
        ``--name=value``, a short alias (``-l``, ``-u`` with its value
        joined or apart) and an abbreviated long name win over the file's
        values as ``--name value`` does.
        """
        config = self.parse(
            "--config", self.write(EXAMPLE), "--connect-timeout=10", "-ltcp:0", "--retrie", "0",
            "--dump-dir=x", "-u", "http://127.0.0.1:9",
        )
        self.assertEqual(config.connect_timeout, 10.0)
        self.assertEqual(config.listen, ("tcp:0",))
        self.assertEqual(config.retries, 0)
        self.assertEqual(config.dump_dir, "x")
        self.assertEqual([(u.name, u.url) for u in config.upstreams], [("default", "http://127.0.0.1:9")])
        self.assertEqual(config.retry_statuses, (429, 529))

    def test_upstream_on_command_line(self):
        """
        ``--upstream URL`` keeps meaning one upstream for every model: it
        wins over the file's upstreams and routes.
        """
        config = self.parse("--config", self.write(EXAMPLE), "--upstream", "http://127.0.0.1:9")
        self.assertEqual([(u.name, u.url) for u in config.upstreams], [("default", "http://127.0.0.1:9")])
        self.assertEqual(config.routes, (Route(targets=(Target("default"),)),))
        self.assertEqual(config.retries, 2)

    def test_one_upstream_in_relay_table(self):
        """
        A file without ``[upstreams]`` may give the one upstream in
        ``[relay]``, its key from the environment, and routes over it
        (``default``) that rename models.
        """
        config = self.parse(
            "--config",
            self.write(
                """
                [relay]
                upstream = "http://127.0.0.1:8001"
                upstream-key = "env:RELAY_TEST_KEY_A"

                [[routes]]
                models = ["claude-haiku-*"]
                targets = [{ upstream = "default", model = "small" }]
                """
            ),
        )
        self.assertEqual(config.upstreams, (Upstream("default", "http://127.0.0.1:8001", keys=(ENV_KEY,)),))
        self.assertEqual(config.routes, (Route(models=("claude-haiku-*",), targets=(Target("default", "small"),)),))

    def test_key_accounts(self):
        """
        A key may name its account (``{key = ..., account = ...}``) beside
        plain keys; the pool keeps its order, and a pool of plain keys names none.
        """
        config = self.parse(
            "--config",
            self.write(
                """
                [upstreams.pool]
                url = "http://127.0.0.1:1"
                keys = [{ key = "env:RELAY_TEST_KEY_A", account = "team-a" }, "file:anthropic.key",
                        { key = "%s", account = "team-a" }]
                [upstreams.plain]
                url = "http://127.0.0.1:2"
                keys = ["env:RELAY_TEST_KEY_A"]
                """ % (LITERAL_KEY,)
            ),
        )
        pool, plain = config.upstreams
        self.assertEqual(pool.keys, (ENV_KEY, FILE_KEY, LITERAL_KEY))
        self.assertEqual(pool.accounts, ("team-a", None, "team-a"))
        self.assertEqual(plain.accounts, ())
        self.assertEqual(config.from_dict(config.to_dict()).upstreams, config.upstreams)

    def test_thinking_binding_recovery_in_relay_table(self):
        config = self.parse("--config", self.write('[relay]\nthinking-binding-recovery = "off"\n'))
        self.assertEqual(config.thinking_binding_recovery, "off")

    def test_key_account_refused(self):
        for item, said in (
            ('{ key = "k", team = "a" }', "takes key and account only"),
            ('{ account = "a" }', "needs key"),
            ('{ key = "k", account = "" }', "account must be a name"),
            ("3", "must be a list of strings"),
        ):
            message = self.refused('[upstreams.a]\nurl = "http://127.0.0.1:1"\nkeys = [%s]\n' % (item,))
            self.assertIn(said, message)
            self.assertNotIn('"k"', message)

    def test_no_routes(self):
        """Upstreams without routes: every model goes to every upstream, in file order."""
        config = self.parse(
            "--config",
            self.write(
                """
                [upstreams.b]
                url = "http://127.0.0.1:2"
                [upstreams.a]
                url = "http://127.0.0.1:1"
                """
            ),
        )
        self.assertEqual(config.routes, (Route(targets=(Target("b"), Target("a"))),))

    def test_workers_get_the_same(self):
        """A worker process rebuilds exactly the configuration of the file."""
        config = self.parse("--config", self.write(EXAMPLE))
        again = config_from_json(config_to_json(config))
        self.assertEqual(again, config)
        one = RelayConfig(upstreams=one_upstream("http://127.0.0.1:5"))
        self.assertEqual(
            config_from_json(config_to_json(one)).with_changes(upstreams=one_upstream("http://127.0.0.1:6")).upstreams,
            (Upstream("default", "http://127.0.0.1:6"),),
        )

    def test_no_key_in_repr(self):
        """No repr of the parsed file or the configuration shows a key."""
        path = self.write(EXAMPLE.replace("[relay]", '[relay]\nrelay-keys = "keys.txt"'))
        self.folder.child("keys.txt").setContent(RELAY_KEY.encode())
        settings = load(path, option_kinds())
        config = self.parse("--config", path, "--relay-keys", self.folder.child("keys.txt").path)
        shown = repr(settings) + repr(config) + repr(config.upstreams) + str(config)
        for key in ALL_KEYS:
            self.assertNotIn(key, shown)
        self.assertIn(RELAY_KEY, [relay_key.key for relay_key in config.relay_keys])
        self.assertEqual(set(config.secrets()), {ENV_KEY, FILE_KEY, LITERAL_KEY, RELAY_KEY})


class FileErrorTests(FileTestCase):
    """
    Each mistake is one line naming the file, the table and the key, and
    never the value of a key.
    """

    def assertNamed(self, message, *parts):
        self.assertTrue(message.startswith(self.folder.child("relay.toml").path + ": "), message)
        for part in parts:
            self.assertIn(part, message)

    def test_unknown_keys(self):
        """An unknown key, table or option is named where it is."""
        self.assertNamed(
            self.refused('[upstreams.a]\nurl = "http://h"\nkey = "%s"\n' % LITERAL_KEY), "[upstreams.a] key:",
            "unknown key",
        )
        self.assertNamed(
            self.refused('[upstreams.a]\nurl = "http://h"\n[[routes]]\nmodel = "x"\ntargets = [{upstream = "a"}]\n'),
            "[[routes]] #1 model:", "unknown key",
        )
        self.assertNamed(
            self.refused('[upstreams.a]\nurl = "http://h"\n[[routes]]\ntargets = [{upstream = "a", keys = 1}]\n'),
            "[[routes]] #1 targets #1 keys:",
        )
        self.assertNamed(self.refused("[relay]\nconect-timeout = 3\n"), "[relay] conect-timeout:", "unknown option")
        self.assertNamed(self.refused("[relays]\nx = 1\n"), "unknown table [relays]")
        self.assertNamed(self.refused('url = "http://h"\n'), "unknown key url")
        self.assertNamed(self.refused('[relay]\nconfig = "other.toml"\n'), "[relay] config:")

    def test_undefined_upstream(self):
        """A route naming an upstream that is not defined is refused, with the names defined."""
        message = self.refused(
            '[upstreams.local]\nurl = "http://h"\n[[routes]]\ntargets = [{upstream = "local"}]\n'
            '[[routes]]\ntargets = [{upstream = "local"}, {upstream = "anthropic"}]\n'
        )
        self.assertNamed(message, "[[routes]] #2 targets #2 upstream:", "anthropic", "defined: local")

    def test_bad_urls(self):
        """A bad or missing URL is refused without repeating it (it may hold a key)."""
        for url in ("ftp://h", "not a url", "https://user:%s@h" % LITERAL_KEY, "https://h/?key=%s" % LITERAL_KEY,
                    "http://h:99999", "https:///path"):
            message = self.refused('[upstreams.a]\nurl = "%s"\n' % url)
            self.assertNamed(message, "[upstreams.a] url:")
            self.assertNotIn(url, message)
        self.assertNamed(self.refused("[upstreams.a]\nids = \"original\"\n"), "[upstreams.a] url:", "missing")

    def test_key_sources(self):
        """
        An unset ``env:`` variable, an unreadable or empty ``file:``, an
        empty pool or a repeated key are refused by the key's position.
        """
        self.patch(os, "environ", {})
        self.assertNamed(
            self.refused('[upstreams.a]\nurl = "http://h"\nkeys = ["env:RELAY_TEST_KEY_A"]\n'),
            "[upstreams.a] keys #1:", "RELAY_TEST_KEY_A is not set",
        )
        self.assertNamed(
            self.refused('[upstreams.a]\nurl = "http://h"\nkeys = ["%s", "file:missing.key"]\n' % LITERAL_KEY),
            "[upstreams.a] keys #2:", "missing.key",
        )
        self.folder.child("empty.key").setContent(b"\n")
        self.assertNamed(
            self.refused('[upstreams.a]\nurl = "http://h"\nkeys = ["file:empty.key"]\n'), "keys #1:", "empty",
        )
        self.assertNamed(self.refused('[upstreams.a]\nurl = "http://h"\nkeys = []\n'), "[upstreams.a] keys:")
        self.assertNamed(
            self.refused('[upstreams.a]\nurl = "http://h"\nkeys = ["%s", "%s"]\n' % (LITERAL_KEY, LITERAL_KEY)),
            "keys #2:", "same key as keys #1",
        )
        self.assertNamed(
            self.refused('[relay]\nupstream-key = "env:RELAY_TEST_UNSET"\n'), "[relay] upstream-key:", "not set",
        )
        self.assertNamed(
            self.refused('[upstreams.a]\nurl = "http://h"\nkeys = ["%s with a space"]\n' % LITERAL_KEY), "keys #1:",
        )

    def test_bad_values(self):
        """Every other bad value is named by its table and key."""
        up = '[upstreams.a]\nurl = "http://h"\n'
        cases = [
            (up + 'ids = "random"\n', "[upstreams.a] ids:"),
            (up + "connect-timeout = 0\n", "[upstreams.a] connect-timeout:"),
            (up + 'idle-timeout = "long"\n', "[upstreams.a] idle-timeout:"),
            (up + "max-connections = 1.5\n", "[upstreams.a] max-connections:"),
            ('[upstreams."a b"]\nurl = "http://h"\n', "[upstreams.a b]"),
            (up + "[[routes]]\n", "[[routes]] #1 targets:"),
            (up + "[[routes]]\ntargets = []\n", "[[routes]] #1 targets:"),
            (up + '[[routes]]\nmodels = [1]\ntargets = [{upstream = "a"}]\n', "[[routes]] #1 models:"),
            (up + '[[routes]]\nthinking = "yes"\ntargets = [{upstream = "a"}]\n', "[[routes]] #1 thinking:"),
            (up + '[[routes]]\nbody-over = "big"\ntargets = [{upstream = "a"}]\n', "[[routes]] #1 body-over:"),
            (up + '[[routes]]\ntargets = [{upstream = "a", model = ""}]\n', "[[routes]] #1 targets #1 model:"),
            ("[relay]\nconnect-timeout = \"soon\"\n", "[relay] connect-timeout"),
            ("[relay]\nmax-body = 0\n", "[relay] max-body"),
            ("[relay]\nno-dumps = 1\n", "[relay] no-dumps:"),
            ("[relay]\nlisten = 8080\n", "[relay] listen:"),
            ('[relay]\nupstream = "http://u:%s@h"\n' % LITERAL_KEY, "[relay] upstream"),
            (up + '[relay]\nupstream = "http://h"\n', "[relay] upstream:"),
        ]
        for text, named in cases:
            self.assertNamed(self.refused(text), named)

    def test_not_toml(self):
        """A file that is not TOML, or cannot be read, is one line too."""
        self.assertNamed(self.refused('[upstreams.a]\nurl = "http://h\n'), "not valid TOML", "line 2")
        with self.assertRaises(UsageError) as caught:
            self.parse("--config", self.folder.child("absent.toml").path)
        self.assertIn("absent.toml: cannot read it", str(caught.exception))

    def test_key_options_beside_upstreams(self):
        """
        ``--upstream-key`` on the command line names the one upstream of
        ``--upstream``; beside a file's upstreams it is refused, not ignored.
        """
        message = self.refused(EXAMPLE, "--upstream-key", LITERAL_KEY)
        self.assertIn("--upstream-key", message)

    def test_twistd_prints_one_line(self):
        """
        ``twistd relay --config`` with a bad file ends with the one line,
        and no traceback.
        """
        self.patch(os, "environ", dict(os.environ))
        os.environ.pop("RELAY_TEST_KEY_A", None)
        path = self.write(EXAMPLE)
        result = subprocess.run(
            [sys.executable, "-m", "twisted", "relay", "--config", path],
            capture_output=True, text=True, timeout=60, env=os.environ,
        )
        output = result.stdout + result.stderr
        self.assertNotEqual(result.returncode, 0)
        self.assertNotIn("Traceback", output)
        self.assertIn(
            "%s: [upstreams.anthropic] keys #1: the environment variable RELAY_TEST_KEY_A is not set" % (path,),
            output,
        )
        for key in ALL_KEYS:
            self.assertNotIn(key, output)

    def test_direct_load_errors(self):
        """L{load} raises L{ConfigFileError} itself, for callers other than twistd."""
        path = self.write('[upstreams.a]\nurl = "ftp://h"\n')
        self.assertRaises(ConfigFileError, load, path, {})


class ReloadTests(FileTestCase):
    """
    Reading the file again gives the new configuration, or one line saying
    why not while the running one stays.
    """

    def test_valid(self):
        """
        A valid file's upstreams and routes are taken; the command line
        still wins; a setting that needs a restart keeps its running value
        and is named.
        """
        path = self.write(EXAMPLE)
        options = Options()
        options.parseOptions(["--config", path, "--retries", "1"])
        running = options.config
        self.write(
            EXAMPLE.replace('model = "qwen3-coder"', 'model = "qwen3-coder-next"')
            .replace('listen = ["tcp:0:interface=127.0.0.1"]', 'listen = ["tcp:1:interface=127.0.0.1"]')
            .replace("retries = 2", "retries = 5")
        )
        result = reload_config(running, options.command_line)
        self.assertIsNone(result.error)
        self.assertEqual(result.config.routes[0].targets[0], Target("local", "qwen3-coder-next"))
        self.assertEqual(result.config.listen, running.listen)
        self.assertEqual(result.config.retries, 1)
        self.assertEqual(result.needs_restart, ("listen",))
        self.assertEqual(result.config.upstreams, running.upstreams)

    def test_invalid(self):
        """An invalid file is refused with one line; the running configuration stays."""
        path = self.write(EXAMPLE)
        running = self.parse("--config", path)
        self.write(EXAMPLE.replace('upstream = "local", model', 'upstream = "locl", model'))
        result = reload_config(running)
        self.assertIs(result.config, running)
        self.assertIn("[[routes]] #1 targets #1 upstream:", result.error)
        self.assertNotIn("\n", result.error)
        self.patch(os, "environ", {})
        self.write(EXAMPLE)
        result = reload_config(running)
        self.assertIs(result.config, running)
        self.assertIn("RELAY_TEST_KEY_A is not set", result.error)
        for key in ALL_KEYS:
            self.assertNotIn(key, result.error + repr(result))

    def test_no_file(self):
        """A relay started without ``--config`` has nothing to read again."""
        running = self.parse()
        result = reload_config(running)
        self.assertIs(result.config, running)
        self.assertIn("--config", result.error)


_BAD_VALUES = st.sampled_from(
    ['"x"', '""', "0", "-1", "1.5", "true", "[]", '["env:RELAY_TEST_UNSET"]', '["file:none.key"]',
     "{ a = 1 }", '"ftp://h"', '"https://u:%s@h"' % LITERAL_KEY, '["%s", "%s"]' % (LITERAL_KEY, LITERAL_KEY),
     '[{ upstream = "nowhere" }]', '"%s"' % LITERAL_KEY]
)


class MutatedFileTests(FileTestCase):
    """Whatever one value of a good file is changed to, the result is a configuration or one clean line."""

    @given(line=st.integers(0, 200), value=_BAD_VALUES)
    @settings(max_examples=150, deadline=None)
    def test_one_value_changed(self, line, value):
        """
        Replacing any one value of the example by a bad one gives either a
        valid configuration or a one-line error naming the file, never a
        traceback and never a key.
        """
        lines = EXAMPLE.splitlines()
        assignments = [i for i, text in enumerate(lines) if " = " in text]
        index = assignments[line % len(assignments)]
        name = lines[index].split(" = ", 1)[0]
        lines[index] = "%s = %s" % (name, value)
        path = self.write("\n".join(lines))
        try:
            self.parse("--config", path)
        except UsageError as e:
            message = str(e)
            self.assertNotIn("\n", message)
            for key in ALL_KEYS:
                self.assertNotIn(key, message)
            self.assertTrue(message.startswith(path) or message.startswith("--"), message)


class UpstreamThreadsTests(FileTestCase):
    """An upstream's ``threads`` key: how message threads are carried to it."""

    def test_read(self):
        """``threads = "upstream"`` lands on the upstream, and on the relay when it is the file's first."""
        config = self.parse("--config", self.write('''
            [upstreams.anthropic]
            url = "https://api.anthropic.com"
            threads = "upstream"

            [upstreams.local]
            url = "http://127.0.0.1:8000"
            '''))
        self.assertEqual([u.threads for u in config.upstreams], ["upstream", None])
        self.assertEqual(config.threads, "upstream")

    def test_command_line_wins(self):
        """``--threads`` given on the command line wins over the file's first upstream."""
        path = self.write('''
            [upstreams.anthropic]
            url = "https://api.anthropic.com"
            threads = "upstream"
            ''')
        self.assertEqual(self.parse("--config", path, "--threads", "relay").threads, "relay")

    def test_refused(self):
        """Another value is refused, naming the table and the key."""
        message = self.refused('''
            [upstreams.local]
            url = "http://127.0.0.1:8000"
            threads = "off"
            ''')
        self.assertIn("threads", message)
        self.assertIn("relay or upstream", message)


class SettingsFunctionTests(FileTestCase):
    """
    L{read_settings} and L{config_from} build what C{twistd relay} builds,
    from the options given and the file, with no command line to parse.
    """

    def test_same_as_twistd(self):
        """The same options and file give the same configuration as the parsed command line."""
        path = self.write(EXAMPLE)
        options = Options()
        options.parseOptions(["--config", path, "--retries", "1", "-l", "tcp:0", "--no-dumps"])
        self.assertEqual(options.command_line, {"retries": "1", "listen": ["tcp:0"], "no-dumps": True})
        self.assertEqual(read_settings({"retries": "1", "listen": ["tcp:0"], "no-dumps": True}, path), options.config)
        self.assertEqual(config_from(options.command_line, load(path, option_kinds())), options.config)

    def test_same_errors(self):
        """A mistake is a L{SettingsError} with the line C{twistd relay} shows."""
        path = self.write(EXAMPLE.replace("retries = 2", 'retries = "many"'))
        with self.assertRaises(UsageError) as parsed:
            self.parse("--config", path)
        with self.assertRaises(SettingsError) as built:
            read_settings({}, path)
        self.assertEqual(str(built.exception), str(parsed.exception))
        self.assertIn("[relay] retries", str(built.exception))
