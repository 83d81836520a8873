"""
Tests for ``twisted-relay-usage`` (twisted_relay.ledger_report): the table,
CSV and JSON of a ledger of known rows, its time range and filters, its
errors; and the ``--usage-*`` settings of ``twistd relay``.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from decimal import Decimal

from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.config import RelayConfig
from twisted_relay.ledger_report import main, parse_time
from twisted_relay.ledger_sql import open_ledger
from twisted_relay.settings import SettingsError, config_from, read_settings

from .ledger_records import DECEMBER_FIRST, usage_record


def _ledger(testcase) -> str:
    """An SQLite ledger of six known requests over two days, two keys, two models, two upstreams, three platforms."""
    folder = testcase.mktemp()
    os.makedirs(folder)
    path = os.path.join(folder, "usage.sqlite")
    database = open_ledger(path)
    database.open()
    database.write(
        [
            usage_record(1, key_name="alice", model="claude-sonnet-4-5", upstream="bedrock",
                         platform="bedrock:us-east-1"),
            usage_record(2, key_name="alice", model="claude-haiku-4-5", session_id="session-2"),
            usage_record(3, key_name="bob", key_group="team-b", model="claude-sonnet-4-5", partial=True,
                         upstream="bedrock", platform="bedrock:global"),
            usage_record(25, key_name="alice", model="claude-sonnet-4-5", upstream="bedrock",
                         platform="bedrock:us-east-1"),
            usage_record(26, key_name=None, key_group=None, model="mystery-1", cost=None),
            usage_record(27, key_name="bob", key_group="team-b", model="claude-sonnet-4-5"),
        ]
    )
    database.close()
    return path


def _run(*argv: str, environ=None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = main(list(argv), out, err)
    return status, out.getvalue(), err.getvalue()


class ReportTests(SynchronousTestCase):
    """What the command prints for a ledger of known rows."""

    def setUp(self):
        self.path = _ledger(self)

    def test_table_by_key(self):
        """The default: one line a key (no key shown as such), a total line, the unpriced request noted."""
        status, out, err = _run("--usage-db", self.path)
        self.assertEqual((status, err), (0, ""))
        lines = out.splitlines()
        self.assertEqual(
            lines[0].split(),
            ["key", "requests", "input", "output", "cache_write_5m", "cache_write_1h", "cache_read",
             "web_searches", "web_fetches", "cost_usd", "unpriced", "partial"],
        )
        self.assertEqual(lines[1].split(), ["(no", "key)", "1"] + ["26"] * 7 + ["0.000000", "1", "0"])
        self.assertEqual(lines[2].split(), ["alice", "3"] + ["28"] * 7 + ["0.003444", "0", "0"])
        self.assertEqual(lines[3].split(), ["bob", "2"] + ["30"] * 7 + ["0.003690", "0", "1"])
        self.assertEqual(set(lines[4].replace(" ", "")), {"-"})
        self.assertEqual(lines[5].split(), ["total", "6"] + ["84"] * 7 + ["0.007134", "1", "1"])
        self.assertIn("1 request of models without a price", lines[6])

    def test_csv_by_day_and_model(self):
        """CSV: full column names, exact costs, UTC days, first and last times."""
        status, out, _ = _run("--usage-db", self.path, "--by", "day,model", "--format", "csv")
        self.assertEqual(status, 0)
        rows = list(csv.DictReader(io.StringIO(out)))
        self.assertEqual(
            [(r["day"], r["model"], r["requests"], r["cost_usd"]) for r in rows],
            [
                ("2026-12-01", "claude-haiku-4-5", "1", "0.000246"),
                ("2026-12-01", "claude-sonnet-4-5", "2", "0.000492"),
                ("2026-12-02", "claude-sonnet-4-5", "2", "0.006396"),
                ("2026-12-02", "mystery-1", "1", "0"),
            ],
        )
        self.assertEqual(rows[0]["cache_creation_1h_tokens"], "2")
        self.assertEqual(rows[3]["unpriced"], "1")
        self.assertEqual((rows[1]["first"], rows[1]["last"]), ("2026-12-01T01:00:00Z", "2026-12-01T03:00:00Z"))

    def test_json_by_group_and_session(self):
        """JSON: the groupings by name (null for none), tokens by kind, the cost as an exact decimal string, a total."""
        status, out, _ = _run("--usage-db", self.path, "--by", "group", "--by", "session", "--format", "json")
        self.assertEqual(status, 0)
        document = json.loads(out)
        self.assertEqual(document["by"], ["group", "session"])
        self.assertEqual(
            [(r["group"], r["session"], r["requests"], r["cost_usd"]) for r in document["rows"]],
            [
                (None, "session-1", 1, "0"),
                ("team-a", "session-1", 2, "0.003198"),
                ("team-a", "session-2", 1, "0.000246"),
                ("team-b", "session-1", 2, "0.00369"),
            ],
        )
        self.assertEqual(document["rows"][3]["tokens"]["web_fetch_requests"], 30)
        self.assertEqual(document["total"]["requests"], 6)
        self.assertEqual(Decimal(document["total"]["cost_usd"]), Decimal("0.007134"))

    def test_table_by_platform(self):
        """By platform (the endpoint that served each request), and by upstream and platform."""
        status, out, err = _run("--usage-db", self.path, "--by", "platform")
        self.assertEqual((status, err), (0, ""))
        lines = out.splitlines()
        self.assertEqual(lines[0].split()[:2], ["platform", "requests"])
        self.assertEqual(lines[1].split(), ["anthropic", "3"] + ["55"] * 7 + ["0.003567", "1", "0"])
        self.assertEqual(lines[2].split(), ["bedrock:global", "1"] + ["3"] * 7 + ["0.000369", "0", "1"])
        self.assertEqual(lines[3].split(), ["bedrock:us-east-1", "2"] + ["26"] * 7 + ["0.003198", "0", "0"])
        self.assertEqual(lines[5].split(), ["total", "6"] + ["84"] * 7 + ["0.007134", "1", "1"])
        _, out, _ = _run("--usage-db", self.path, "--by", "upstream,platform", "--format", "json")
        self.assertEqual(
            [(r["upstream"], r["platform"], r["requests"], r["cost_usd"]) for r in json.loads(out)["rows"]],
            [("bedrock", "bedrock:global", 1, "0.000369"), ("bedrock", "bedrock:us-east-1", 2, "0.003198"),
             ("default", "anthropic", 3, "0.003567")],
        )

    def test_a_ledger_before_platforms(self):
        """A ledger no relay of this version opened yet: read by upstream as it is; by platform,
        one line saying why not (a report changes nothing)."""
        import sqlite3

        from .test_ledger_sql import SCHEMA_2, SCHEMA_2_ROW

        path = os.path.join(os.path.dirname(self.path), "schema-2.sqlite")
        with sqlite3.connect(path) as connection:
            for statement in SCHEMA_2 + (SCHEMA_2_ROW,):
                connection.execute(statement)
            connection.execute("INSERT INTO relay_usage_meta (name, value) VALUES ('schema_version', '2')")
        status, out, _ = _run("--usage-db", path, "--by", "upstream", "--format", "csv")
        self.assertEqual((status, out.splitlines()[1].split(",")[:2]), (0, ["default", "1"]))
        status, out, err = _run("--usage-db", path, "--by", "platform")
        self.assertEqual((status, out, len(err.splitlines())), (2, "", 1))
        self.assertIn("written before relays recorded the platform (ledger schema 2)", err)

    def test_round_costs_in_plain_figures(self):
        """A cost of whole dollars is written as such (20, not 2E+1) in CSV and JSON."""
        database = open_ledger(self.path)
        database.open()
        database.write([usage_record(40, key_name="carol", cost=Decimal(20))])
        database.close()
        _, out, _ = _run("--usage-db", self.path, "--key", "carol", "--format", "csv")
        self.assertEqual([row["cost_usd"] for row in csv.DictReader(io.StringIO(out))], ["20"])
        _, out, _ = _run("--usage-db", self.path, "--key", "carol", "--format", "json")
        self.assertEqual(json.loads(out)["total"]["cost_usd"], "20")

    def test_time_range_and_filters(self):
        """``--since`` included, ``--until`` excluded (UTC); ``--key`` and ``--group`` narrow."""
        _, out, _ = _run("--usage-db", self.path, "--since", "2026-12-02", "--format", "json")
        self.assertEqual([r["key"] for r in json.loads(out)["rows"]], [None, "alice", "bob"])
        _, out, _ = _run("--usage-db", self.path, "--until", "2026-12-01T03:00", "--format", "json")
        self.assertEqual(json.loads(out)["total"]["requests"], 2)
        _, out, _ = _run("--usage-db", self.path, "--key", "bob", "--by", "model", "--format", "json")
        self.assertEqual([(r["model"], r["requests"]) for r in json.loads(out)["rows"]], [("claude-sonnet-4-5", 2)])
        _, out, _ = _run("--usage-db", self.path, "--group", "team-a", "--format", "json")
        self.assertEqual(json.loads(out)["total"]["requests"], 3)
        status, out, _ = _run("--usage-db", self.path, "--since", "2030-01-01")
        self.assertEqual((status, out), (0, "No requests in the ledger since 2030-01-01T00:00:00Z.\n"))

    def test_database_from_the_environment(self):
        """``$TWISTED_RELAY_USAGE_DB`` names the ledger when ``--usage-db`` does not ."""
        result = subprocess.run(
            [sys.executable, "-m", "twisted_relay.ledger_report", "--format", "csv"],
            env=dict(os.environ, TWISTED_RELAY_USAGE_DB=self.path), capture_output=True, text=True, timeout=60,
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(len(result.stdout.splitlines()), 4)


class ReportErrorTests(SynchronousTestCase):
    """What goes wrong is one line and exit status 2."""

    def test_no_such_file(self):
        status, out, err = _run("--usage-db", "no/such/usage.sqlite")
        self.assertEqual((status, out), (2, ""))
        self.assertEqual(len(err.splitlines()), 1)
        self.assertIn("twisted-relay-usage: sqlite:", err)
        self.assertIn("no such file", err)
        self.assertFalse(os.path.exists("no/such/usage.sqlite"))

    def test_not_a_ledger(self):
        path = self.mktemp()
        with open(path, "wb"):
            pass
        status, _, err = _run("--usage-db", path)
        self.assertEqual(status, 2)
        self.assertIn("holds no usage ledger", err)

    def test_bad_arguments(self):
        for argv in (["--by", "colour"], ["--since", "last tuesday"], ["--format", "xml"], ["--since", "99999999w"]):
            error = io.StringIO()
            with self.assertRaises(SystemExit) as raised:
                sys.stderr, saved = error, sys.stderr
                try:
                    main(argv, io.StringIO(), error)
                finally:
                    sys.stderr = saved
            self.assertEqual(raised.exception.code, 2)

    def test_parse_time(self):
        self.assertEqual(parse_time("2026-12-01"), DECEMBER_FIRST)
        self.assertEqual(parse_time("2026-12-01T01:30:00+01:00"), DECEMBER_FIRST + 1800)
        self.assertEqual(parse_time("2026-12-01T00:00:00Z"), DECEMBER_FIRST)
        self.assertEqual(parse_time("7d", now=DECEMBER_FIRST), DECEMBER_FIRST - 7 * 86400)
        self.assertEqual(parse_time("90m", now=DECEMBER_FIRST), DECEMBER_FIRST - 5400)
        self.assertRaises(ValueError, parse_time, "soon")


class UsageSettingsTests(SynchronousTestCase):
    """The ``--usage-*`` options of ``twistd relay``, on the command line and in the ``--config`` file."""

    def test_defaults(self):
        config = config_from({})
        self.assertEqual(
            (config.usage_db, config.usage_flush_interval, config.usage_retention_days, config.usage_max_queue),
            (None, 1.0, 400.0, 50_000),
        )

    def test_sqlite_path_made_absolute(self):
        for given in ("usage.sqlite", "sqlite:usage.sqlite"):
            self.assertEqual(config_from({"usage-db": given}).usage_db, os.path.abspath("usage.sqlite"))

    def test_postgres_url_kept_and_never_shown(self):
        url = "postgresql://relay:hunter2-pw@db.example:5432/relay"
        config = config_from({"usage-db": url, "usage-flush-interval": "0.5", "usage-retention-days": "0"})
        self.assertEqual((config.usage_db, config.usage_flush_interval, config.usage_retention_days), (url, 0.5, 0.0))
        self.assertNotIn("hunter2-pw", repr(config))
        self.assertIn("postgresql://relay:***@db.example:5432/relay", repr(config))

    def test_errors(self):
        for given, words in (
            ({"usage-db": "mysql://db/x"}, "--usage-db must be an SQLite file's path or a postgresql:// URL"),
            ({"usage-db": "postgresql://u:pw-in-url@h:99999/x"}, "--usage-db is not a valid postgresql:// URL"),
            ({"usage-flush-interval": "0"}, "--usage-flush-interval must be more than zero"),
            ({"usage-retention-days": "-1"}, "--usage-retention-days must be zero or more"),
            ({"usage-max-queue": "0"}, "--usage-max-queue must be 1 or more"),
        ):
            error = self.assertRaises(SettingsError, config_from, given)
            self.assertIn(words, str(error))
            self.assertNotIn("pw-in-url", str(error))

    def test_config_file(self):
        """The file's ``[relay]`` table takes them by their long names; the command line wins."""
        path = self.mktemp()
        with open(path, "w") as f:
            f.write('[relay]\nusage-db = "ledger.sqlite"\nusage-flush-interval = 2\nusage-retention-days = 30\n')
        config = read_settings({}, path)
        self.assertEqual(
            (config.usage_db, config.usage_flush_interval, config.usage_retention_days),
            (os.path.abspath("ledger.sqlite"), 2.0, 30.0),
        )
        self.assertEqual(read_settings({"usage-db": "other.sqlite"}, path).usage_db, os.path.abspath("other.sqlite"))

    def test_workers_carry_it(self):
        """A worker process gets the same ledger settings (its configuration travels as JSON)."""
        from twisted_relay.workers import config_from_json, config_to_json

        config = RelayConfig(usage_db="/srv/usage.sqlite", usage_flush_interval=0.5)
        again = config_from_json(config_to_json(config))
        self.assertEqual((again.usage_db, again.usage_flush_interval), ("/srv/usage.sqlite", 0.5))
