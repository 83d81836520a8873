"""
Tests for twisted_relay.ledger_sql: the ledger's tables, writes and sums,
the same on SQLite and on a real PostgreSQL server (tests/postgres_server.py).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from decimal import Decimal

from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.ledger_sql import (
    SCHEMA_VERSION,
    LedgerError,
    RowsRefused,
    SQLiteLedger,
    batch_of,
    describe_database,
    open_ledger,
)
from twisted_relay.usage import TOKEN_KINDS

from . import postgres_server
from .ledger_records import DECEMBER_FIRST, usage_record


class _LedgerDatabaseTests:
    """What both databases do the same; ``new_target()`` names an empty ledger."""

    def new_target(self) -> str:
        raise NotImplementedError

    def execute(self, target: str, statement: str) -> None:
        """Run one statement on the database, with its own driver."""
        raise NotImplementedError

    def opened(self, target=None, **options):
        database = open_ledger(target or self.new_target(), **options)
        self.addCleanup(database.close)
        database.open()
        return database

    def test_write_and_add_up(self):
        """Written rows add up by key: requests, every token kind, the exact cost, the time range."""
        database = self.opened()
        records = [usage_record(n, key_name="alice" if n % 2 else "bob") for n in range(1, 11)]
        self.assertEqual(database.write(records), 10)
        alice, bob = database.totals(["key"])
        self.assertEqual(alice.group, {"key": "alice"})
        self.assertEqual(alice.requests, 5)
        self.assertEqual(alice.tokens, {kind: 1 + 3 + 5 + 7 + 9 for kind in TOKEN_KINDS})
        self.assertEqual(alice.cost, Decimal("0.000123") * 25)
        self.assertEqual((alice.first, alice.last), (DECEMBER_FIRST + 3600, DECEMBER_FIRST + 9 * 3600))
        self.assertEqual(bob.requests, 5)
        self.assertEqual(bob.cost, Decimal("0.000123") * 30)

    def test_every_column_reads_back_as_written(self):
        """
        A row reads back exactly as it was recorded, whatever its text holds
        (quotes, backslashes, non-ASCII past the BMP, JSON of its own), its
        time to the microsecond, integers past a double's 53 bits, and
        empty columns as NULL.
        """
        database = self.opened()
        odd = usage_record(
            1,
            at=DECEMBER_FIRST + 0.123456,
            key_name='o\'brien "ü" \\ 名前',
            key_group=None,
            session_id="5e3c-\u2028-é-😀",
            agent_id=None,
            parent_agent_id="agent-😀",
            tokens={kind: 2**62 - n for n, kind in enumerate(TOKEN_KINDS)},
            cost=Decimal("9000.123456789013"),
            usage='{"input_tokens": 1, "note": "a \\"quoted\\" \\\\ text"}',
            partial=True,
        )
        unpriced = usage_record(2, cost=None, stream=False, status=529)
        self.assertEqual(database.write([odd, unpriced]), 2)
        columns = (
            "request_id, at, day, key_name, key_group, session_id, agent_id, parent_agent_id, upstream, model, "
            "status, stream, partial"
        )
        kinds = ", ".join(TOKEN_KINDS)

        def read(connection):
            cursor = connection.cursor()
            cursor.execute(
                "SELECT %s, %s, cost_pico_usd, usage_json FROM relay_usage ORDER BY request_id" % (columns, kinds)
            )
            return cursor.fetchall()

        first, second = database.run(read)
        self.assertEqual(
            tuple(first),
            (
                "rly_test_000001", DECEMBER_FIRST + 0.123456, "2026-12-01", odd.key_name, None, odd.session_id, None,
                "agent-😀", "default", "claude-sonnet-4-5", 200, 1, 1,
                *[2**62 - n for n in range(len(TOKEN_KINDS))],
                9_000_123_456_789_013, odd.usage,
            ),
        )
        self.assertEqual((second[10], second[11], second[-2]), (529, 0, None))

    def test_text_no_database_takes_is_escaped(self):
        """
        A NUL or a lone surrogate in any text column (a client's header, an
        upstream's model name) is written as a backslash escape, in the same
        batch as the rows beside it: PostgreSQL refuses both in text (one
        such row would fail every batch after), SQLite keeps a surrogate as
        bytes no reader can decode.
        """
        database = self.opened()
        odd = usage_record(
            1,
            key_name="al\x00ice",
            key_group="te\udc80am",
            session_id="s\x00",
            agent_id="a\ud800",
            parent_agent_id="p\x00\udfff",
            upstream="up\x00",
            model="claude-\x00-\ud800",
        )
        self.assertEqual(database.write([usage_record(2), odd, usage_record(3)]), 3)

        def read(connection):
            cursor = connection.cursor()
            cursor.execute(
                "SELECT request_id, key_name, key_group, session_id, agent_id, parent_agent_id, upstream, model "
                "FROM relay_usage WHERE key_name <> 'alice'"
            )
            return cursor.fetchall()

        self.assertEqual(
            [tuple(row) for row in database.run(read)],
            [("rly_test_000001", "al\\x00ice", "te\\udc80am", "s\\x00", "a\\ud800", "p\\x00\\udfff", "up\\x00",
              "claude-\\x00-\\ud800")],
        )
        (everything,) = database.totals()
        self.assertEqual(everything.requests, 3)

    def test_a_cost_past_the_column_is_stored_as_its_most(self):
        """A cost no 64-bit column holds (only absurd counts make one) is stored as the most it
        holds, in a batch the database takes, with the rows beside it."""
        database = self.opened()
        self.assertEqual(database.write([usage_record(1), usage_record(2, cost=Decimal(10**8))]), 2)

        def read(connection):
            cursor = connection.cursor()
            cursor.execute("SELECT cost_pico_usd FROM relay_usage ORDER BY request_id")
            return [row[0] for row in cursor.fetchall()]

        self.assertEqual(database.run(read), [123_000_000, 2**63 - 1])

    def test_sums_past_64_bits(self):
        """Costs whose sum no 64-bit integer holds (two at a column's most, from absurd counts) add
        up exactly, for every reader of totals (the page, the report, the spend limits)."""
        database = self.opened()
        database.write([usage_record(1, cost=Decimal(10**8)), usage_record(2, cost=Decimal(10**8)), usage_record(3)])
        (everything,) = database.totals()
        self.assertEqual(everything.cost, 2 * (Decimal(2**63 - 1) / 10**12) + Decimal("0.000369"))

    def test_a_row_refused_for_its_data(self):
        """A batch the database refuses for a row's data (no retry mends it) raises RowsRefused;
        written row by row, only that row is refused."""
        database = self.opened()
        rows = [usage_record(1), usage_record(2, upstream=None), usage_record(3)]
        self.assertRaises(RowsRefused, database.write, rows)
        added, refused = database.write_each([batch_of([row]) for row in rows])
        self.assertEqual((added, list(refused)), (2, [1]))
        self.assertIn("upstream", refused[1])
        (everything,) = database.totals()
        self.assertEqual(everything.requests, 2)

    def test_a_batch_written_again_counts_once(self):
        """A request already in the ledger (the same request id) is not added again: a retried batch double-counts nothing."""
        database = self.opened()
        self.assertEqual(database.write([usage_record(n) for n in range(1, 6)]), 5)
        self.assertEqual(database.write([usage_record(n) for n in range(3, 9)]), 3)
        (everything,) = database.totals()
        self.assertEqual(everything.requests, 8)
        self.assertEqual(everything.tokens["input_tokens"], sum(range(1, 9)))

    def test_groupings(self):
        """Every grouping reads its own field; a missing key is None; lines are sorted, None first."""
        database = self.opened()
        database.write(
            [
                usage_record(1, key_name=None, key_group=None, model="claude-haiku-4-5", session_id="s-b", agent_id="a1"),
                usage_record(2, model="claude-opus-4-5", session_id="s-a", upstream="backup"),
                usage_record(30, session_id="s-a"),
            ]
        )
        self.assertEqual([t.group["key"] for t in database.totals(["key"])], [None, "alice"])
        self.assertEqual([t.group["group"] for t in database.totals(["group"])], [None, "team-a"])
        self.assertEqual(
            [t.group["model"] for t in database.totals(["model"])],
            ["claude-haiku-4-5", "claude-opus-4-5", "claude-sonnet-4-5"],
        )
        self.assertEqual([(t.group["session"], t.requests) for t in database.totals(["session"])], [("s-a", 2), ("s-b", 1)])
        self.assertEqual([t.group["agent"] for t in database.totals(["agent"])], [None, "a1"])
        self.assertEqual([t.group["upstream"] for t in database.totals(["upstream"])], ["backup", "default"])
        # Request 30 arrived 30 hours after 2026-12-01T00:00Z: the next day (UTC).
        self.assertEqual(
            [(t.group["day"], t.requests) for t in database.totals(["day"])], [("2026-12-01", 2), ("2026-12-02", 1)]
        )
        self.assertEqual(
            [tuple(t.group.values()) for t in database.totals(["day", "model"])],
            [("2026-12-01", "claude-haiku-4-5"), ("2026-12-01", "claude-opus-4-5"), ("2026-12-02", "claude-sonnet-4-5")],
        )
        self.assertRaises(LedgerError, database.totals, ["colour"])

    def test_time_range_and_key(self):
        """``since`` is included, ``until`` excluded; a key or a group narrows the sum."""
        database = self.opened()
        database.write([usage_record(n, key_group="team-b" if n > 6 else "team-a") for n in range(1, 11)])
        (found,) = database.totals(since=DECEMBER_FIRST + 3 * 3600, until=DECEMBER_FIRST + 5 * 3600)
        self.assertEqual(found.requests, 2)
        (found,) = database.totals(key_group="team-b")
        self.assertEqual(found.requests, 4)
        self.assertEqual(database.totals(key_name="nobody"), [])
        self.assertEqual(_cost(database, key_group="team-b"), Decimal("0.000123") * (7 + 8 + 9 + 10))
        self.assertEqual(_cost(database, since=DECEMBER_FIRST + 10 * 3600), Decimal("0.00123"))
        self.assertEqual(_cost(database, key_name="nobody"), Decimal(0))

    def test_unpriced_and_partial(self):
        """A request without a price counts its tokens, not a cost, and is counted as unpriced; partial ones are counted."""
        database = self.opened()
        database.write([usage_record(1), usage_record(2, cost=None), usage_record(3, partial=True)])
        (found,) = database.totals()
        self.assertEqual((found.requests, found.unpriced, found.partial), (3, 1, 1))
        self.assertEqual(found.cost, Decimal("0.000123") * 4)
        self.assertEqual(found.tokens["output_tokens"], 6)

    def test_cost_is_exact(self):
        """Costs add up exactly to the billionth of a dollar (a million tiny costs do not drift)."""
        database = self.opened()
        database.write([usage_record(n, cost=Decimal("0.000000003")) for n in range(1, 1001)])
        database.write([usage_record(5000, cost=Decimal("12345.678901234"))])
        self.assertEqual(_cost(database), Decimal("12345.678904234"))

    def test_prune(self):
        """Rows of requests older than the given instant are deleted, the others kept."""
        database = self.opened()
        database.write([usage_record(n) for n in range(1, 11)])
        self.assertEqual(database.prune(DECEMBER_FIRST + 4 * 3600), 3)
        (found,) = database.totals()
        self.assertEqual(found.requests, 7)

    def test_open_twice_and_schema_version(self):
        """Opening is idempotent (rows stay); a ledger of a newer schema is refused in one line."""
        target = self.new_target()
        first = self.opened(target)
        first.write([usage_record(1)])
        first.close()
        second = self.opened(target)
        self.assertEqual(second.totals()[0].requests, 1)
        second.close()
        self.execute(target, "UPDATE relay_usage_meta SET value = '%d' WHERE name = 'schema_version'" % (SCHEMA_VERSION + 1,))
        error = self.assertRaises(LedgerError, open_ledger(target).open)
        self.assertIn("newer twisted-relay", str(error))

    def test_reading_needs_a_ledger(self):
        """A report (create=False) on a database no relay wrote to says so and makes nothing."""
        target = self.new_target()
        reader = open_ledger(target, create=False)
        self.addCleanup(reader.close)
        error = self.assertRaises(LedgerError, reader.open)
        self.assertNotIn("Traceback", str(error))
        self.opened(target).write([usage_record(1)])
        self.assertEqual(reader.totals()[0].requests, 1)


    def test_by_platform(self):
        """Each row keeps the platform that served it; usage adds up by platform, and by upstream and platform."""
        database = self.opened()
        database.write([
            usage_record(1, upstream="bedrock", platform="bedrock:global"),
            usage_record(2, upstream="bedrock", platform="bedrock:us-east-1"),
            usage_record(3, upstream="bedrock", platform="bedrock:us-east-1"),
            usage_record(4),
        ])
        found = {t.group["platform"]: (t.requests, t.cost) for t in database.totals(["platform"])}
        self.assertEqual(found, {
            "anthropic": (1, Decimal("0.000123") * 4),
            "bedrock:global": (1, Decimal("0.000123")),
            "bedrock:us-east-1": (2, Decimal("0.000123") * 5),
        })
        self.assertEqual([tuple(t.group.values()) for t in database.totals(["upstream", "platform"])],
                         [("bedrock", "bedrock:global"), ("bedrock", "bedrock:us-east-1"), ("default", "anthropic")])

    def test_a_ledger_of_schema_2_gains_the_platform(self):
        """
        A ledger the relay of schema 2 wrote: a report reads it as it is (by platform: one line
        saying why not); a relay of this version opening it adds the platform column, keeps its
        rows (their platform empty) and writes new ones with theirs.
        """
        target = self.new_target()
        for statement in SCHEMA_2:
            self.execute(target, statement)
        self.execute(target, "INSERT INTO relay_usage_meta (name, value) VALUES ('schema_version', '2')")
        self.execute(target, SCHEMA_2_ROW)
        reader = open_ledger(target, create=False)
        self.addCleanup(reader.close)
        reader.open()
        self.assertEqual([(t.group, t.requests) for t in reader.totals(["upstream"])], [({"upstream": "default"}, 1)])
        error = self.assertRaises(LedgerError, reader.totals, ["platform"])
        self.assertIn("written before relays recorded the platform (ledger schema 2)", str(error))
        reader.close()
        database = self.opened(target)
        database.write([usage_record(2, platform="vertex:us")])
        found = [(t.group["platform"], t.requests, t.cost) for t in database.totals(["platform"])]
        self.assertEqual(found, [(None, 1, Decimal("0.000123")), ("vertex:us", 1, Decimal("0.000246"))])
        database.close()
        self.opened(target)  # opened again: nothing left to add
        reader = open_ledger(target, create=False)
        self.addCleanup(reader.close)
        reader.open()
        self.assertEqual(len(reader.totals(["platform"])), 2)

        def version(connection):
            cursor = connection.cursor()
            cursor.execute("SELECT value FROM relay_usage_meta WHERE name = 'schema_version'")
            return cursor.fetchone()[0]

        self.assertEqual(reader.run(version), str(SCHEMA_VERSION))


#: The tables as the relay of ledger schema 2 made them (twisted-relay before
#: the platform column), and one row as it wrote it.
SCHEMA_2 = (
    "CREATE TABLE IF NOT EXISTS relay_usage_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS relay_usage (request_id TEXT PRIMARY KEY, at DOUBLE PRECISION NOT NULL, "
    "day TEXT NOT NULL, key_name TEXT, key_group TEXT, session_id TEXT, agent_id TEXT, parent_agent_id TEXT, "
    "upstream TEXT NOT NULL, model TEXT NOT NULL, status INTEGER NOT NULL, stream SMALLINT NOT NULL, "
    "partial SMALLINT NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL, "
    "cache_creation_5m_tokens BIGINT NOT NULL, cache_creation_1h_tokens BIGINT NOT NULL, "
    "cache_read_tokens BIGINT NOT NULL, web_search_requests BIGINT NOT NULL, web_fetch_requests BIGINT NOT NULL, "
    "cost_pico_usd BIGINT, usage_json TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS relay_usage_at ON relay_usage (at)",
    "CREATE INDEX IF NOT EXISTS relay_usage_key_at ON relay_usage (key_name, at)",
    "CREATE INDEX IF NOT EXISTS relay_usage_group_at ON relay_usage (key_group, at)",
    "CREATE TABLE IF NOT EXISTS relay_spend_limits (id TEXT PRIMARY KEY, scope_type TEXT NOT NULL, "
    "scope_id TEXT NOT NULL, period TEXT NOT NULL, amount_cents BIGINT, created_at DOUBLE PRECISION NOT NULL, "
    "updated_at DOUBLE PRECISION NOT NULL, UNIQUE (scope_type, scope_id, period))",
)
SCHEMA_2_ROW = (
    "INSERT INTO relay_usage (request_id, at, day, key_name, key_group, session_id, agent_id, parent_agent_id, "
    "upstream, model, status, stream, partial, input_tokens, output_tokens, cache_creation_5m_tokens, "
    "cache_creation_1h_tokens, cache_read_tokens, web_search_requests, web_fetch_requests, cost_pico_usd, "
    "usage_json) VALUES ('rly_test_000001', %r, '2026-12-01', 'alice', 'team-a', 'session-1', NULL, NULL, "
    "'default', 'claude-sonnet-4-5', 200, 1, 0, 1, 1, 1, 1, 1, 1, 1, 123000000, '{\"input_tokens\": 1}')"
    % (DECEMBER_FIRST + 3600,)
)


class SQLiteLedgerTests(_LedgerDatabaseTests, SynchronousTestCase):
    """The ledger in an SQLite file."""

    def new_target(self) -> str:
        folder = self.mktemp()
        os.makedirs(folder)
        return os.path.join(folder, "usage.sqlite")

    def execute(self, target: str, statement: str) -> None:
        with sqlite3.connect(target) as connection:
            connection.execute(statement)

    def test_wal_mode(self):
        """The file is in WAL mode: whole after a crash, readers never wait for the writer."""
        target = self.new_target()
        self.opened(target).write([usage_record(1)])
        with sqlite3.connect(target) as connection:
            self.assertEqual(connection.execute("PRAGMA journal_mode").fetchone()[0], "wal")

    def test_forms_of_the_path(self):
        """``PATH`` and ``sqlite:PATH`` name the same file; another scheme is refused."""
        target = self.new_target()
        self.opened(target).write([usage_record(1)])
        self.assertEqual(self.opened("sqlite:" + target).totals()[0].requests, 1)
        self.assertEqual(self.opened("sqlite://" + os.path.abspath(target)).totals()[0].requests, 1)
        self.assertRaises(LedgerError, open_ledger, "mysql://db/usage")

    def test_missing_file_for_a_report(self):
        """A report on a file that does not exist says so, and does not create it."""
        target = self.new_target()
        error = self.assertRaises(LedgerError, open_ledger(target, create=False).open)
        self.assertIn("no such file", str(error))
        self.assertFalse(os.path.exists(target))

    def test_locked_database_fails_in_one_line(self):
        """A write that cannot get the lock fails with a LedgerError, and the next one succeeds once it is free."""
        target = self.new_target()
        self.opened(target)
        database = SQLiteLedger(target, busy_timeout_ms=0)  # a test of the failure, not of waiting
        self.addCleanup(database.close)
        database.open()
        blocker = sqlite3.connect(target, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        self.assertRaises(LedgerError, database.write, [usage_record(1)])
        blocker.execute("ROLLBACK")
        blocker.close()
        self.assertEqual(database.write([usage_record(1)]), 1)


class PostgresLedgerTests(_LedgerDatabaseTests, SynchronousTestCase):
    """The ledger in a real PostgreSQL server, one server for the class, a new database a test."""

    skip = postgres_server.SKIP_REASON

    def setUp(self):
        self.server = postgres_server.shared_server()

    def new_target(self) -> str:
        return self.server.new_database()

    def execute(self, target: str, statement: str) -> None:
        with postgres_server.psycopg.connect(target) as connection:
            connection.execute(statement)

    def test_a_database_not_in_utf8_is_refused(self):
        """A database in another encoding would refuse every batch holding non-ASCII text: refused at start."""
        target = self.server.new_database(encoding="SQL_ASCII")
        error = self.assertRaises(LedgerError, open_ledger(target).open)
        self.assertIn("the database's encoding is SQL_ASCII; the ledger needs a UTF8 database", str(error))

    def test_password_never_shown(self):
        """Neither the description nor an error holds the URL's password."""
        target = self.new_target()
        self.assertNotIn(postgres_server.PASSWORD, describe_database(target))
        self.assertIn("127.0.0.1:%d" % (self.server.port,), describe_database(target))
        wrong = target.replace(postgres_server.PASSWORD, "wrong-password-9x")
        error = self.assertRaises(LedgerError, open_ledger(wrong).open)
        self.assertIn("password authentication failed", str(error))
        self.assertNotIn("wrong-password-9x", str(error))

    def test_relays_starting_at_once(self):
        """Several relays creating the tables at the same moment all start (the creation is serialised)."""
        target = self.new_target()
        errors = []

        def start():
            database = open_ledger(target)
            try:
                database.open()
                database.write([usage_record(1)])
            except Exception as e:  # collected, asserted below
                errors.append(e)
            finally:
                database.close()

        threads = [threading.Thread(target=start) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        self.assertEqual(errors, [])
        self.assertEqual(self.opened(target).totals()[0].requests, 1)

    def test_unreachable(self):
        """A server that does not answer is a one-line LedgerError naming the database, not the password."""
        from .helpers import free_port

        url = "postgresql://relay:%s@127.0.0.1:%d/x" % (postgres_server.PASSWORD, free_port())
        error = self.assertRaises(LedgerError, open_ledger(url).open)
        self.assertIn("127.0.0.1", str(error))
        self.assertNotIn(postgres_server.PASSWORD, str(error))
        self.assertEqual(len(str(error).splitlines()), 1)


def _cost(database, **conditions) -> Decimal:
    """What the priced rows matching ``conditions`` cost, as the ledger adds it up."""
    return sum((found.cost for found in database.totals(**conditions)), Decimal(0))
