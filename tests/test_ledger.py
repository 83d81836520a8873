"""
Tests for twisted_relay.ledger: the ledger service on the real reactor and
its own writer thread, over a real SQLite file or a real PostgreSQL server
(stopped and started again under it); and the relay that runs it.
"""

from __future__ import annotations

import os
import sqlite3
import time
from decimal import Decimal

import treq
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import TestCase

from twisted_relay.ledger import Ledger
from twisted_relay.ledger_sql import SQLiteLedger, open_ledger

from . import postgres_server
from .helpers import encode, messages_body, serve_relay_over_simulated
from .ledger_records import usage_record


async def until(condition, timeout: float = 20.0, step: float = 0.02) -> None:
    """Wait on the reactor until ``condition()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("not within %gs: %r" % (timeout, condition))
        await deferLater(reactor, step, lambda: None)


def rows_in(target: str) -> list[str]:
    """The request ids in a ledger, in order, read with the database's own driver."""
    query = "SELECT request_id FROM relay_usage ORDER BY request_id"
    if target.startswith("postgresql://"):
        with postgres_server.psycopg.connect(target) as connection:
            return [row[0] for row in connection.execute(query)]
    with sqlite3.connect(target) as connection:
        return [row[0] for row in connection.execute(query)]


class _LogLines:
    """Every log event's formatted text while a test runs."""

    def __init__(self, testcase):
        from twisted.logger import formatEvent

        self.lines: list[str] = []
        observer = lambda event: self.lines.append(formatEvent(event))  # noqa: E731
        globalLogPublisher.addObserver(observer)
        testcase.addCleanup(globalLogPublisher.removeObserver, observer)

    def text(self) -> str:
        return "\n".join(self.lines)


class SQLiteLedgerServiceTests(TestCase):
    """The ledger service over an SQLite file."""

    def target(self) -> str:
        folder = self.mktemp()
        os.makedirs(folder)
        return os.path.join(folder, "usage.sqlite")

    def started(self, target, database=None, **options) -> Ledger:
        ledger = Ledger(database or open_ledger(target), reactor=reactor, **options)
        ledger.startService()
        self.addCleanup(lambda: ledger.stopService() if ledger.running else None)
        return ledger

    async def test_written_within_the_interval(self):
        """Recorded rows reach the database at the next flush interval, without being asked."""
        target = self.target()
        ledger = self.started(target, flush_interval=0.1)
        for n in range(1, 21):
            ledger.record(usage_record(n))
        self.assertEqual(ledger.pending, 20)
        started = time.monotonic()
        await until(lambda: ledger.written == 20)
        self.assertLess(time.monotonic() - started, 5.0)
        self.assertEqual(ledger.pending, 0)
        self.assertEqual(len(rows_in(target)), 20)

    async def test_a_full_batch_is_written_at_once(self):
        """A full batch does not wait for the interval."""
        target = self.target()
        ledger = self.started(target, flush_interval=3600, batch_size=10)
        for n in range(1, 26):
            ledger.record(usage_record(n))
        await until(lambda: ledger.written == 20)
        self.assertEqual(ledger.pending, 5)
        self.assertTrue(await ledger.flush())
        self.assertEqual(ledger.written, 25)

    async def test_stop_writes_what_is_queued(self):
        """Stopping the service (SIGTERM under twistd) writes every queued row first."""
        target = self.target()
        ledger = self.started(target, flush_interval=3600)
        for n in range(1, 101):
            ledger.record(usage_record(n))
        await ledger.stopService()
        self.assertEqual(len(rows_in(target)), 100)
        # Past the stop, a row is dropped and counted, never raised.
        ledger.record(usage_record(101))
        self.assertEqual(ledger.dropped, 1)

    async def test_failing_writes_are_tried_again(self):
        """
        While the database refuses writes (another process holds its lock),
        rows wait, in order, and recording never blocks; once it is free
        they are written, each once; the outage is logged once, without a
        traceback.
        """
        target = self.target()
        log = _LogLines(self)
        ledger = self.started(target, SQLiteLedger(target, busy_timeout_ms=0), flush_interval=0.05)
        blocker = sqlite3.connect(target, isolation_level=None)
        self.addCleanup(blocker.close)
        blocker.execute("BEGIN EXCLUSIVE")
        for n in range(1, 11):
            before = time.monotonic()
            ledger.record(usage_record(n))
            self.assertLess(time.monotonic() - before, 0.05)
        await until(lambda: ledger.failures >= 3)
        self.assertEqual((ledger.written, ledger.pending), (0, 10))
        blocker.execute("ROLLBACK")
        await until(lambda: ledger.written == 10)
        self.assertEqual(rows_in(target), ["rly_test_%06d" % n for n in range(1, 11)])
        self.assertEqual(log.text().count("Cannot write the usage ledger"), 1)
        self.assertIn("Usage ledger written again", log.text())
        self.assertNotIn("Traceback", log.text())

    async def test_a_row_that_cannot_be_made_is_dropped_alone(self):
        """
        A record that cannot be made a row (a value no JSON holds: a bug
        upstream of the ledger) is dropped, counted and logged; the rest of
        its batch is written, and writing goes on.
        """
        target = self.target()
        log = _LogLines(self)
        ledger = self.started(target, flush_interval=3600)
        ledger.record(usage_record(1))
        ledger.record(usage_record(2, session_id=object()))
        ledger.record(usage_record(3))
        self.assertTrue(await ledger.flush())
        self.assertEqual((ledger.written, ledger.dropped, ledger.pending), (2, 1, 0))
        self.assertEqual(rows_in(target), ["rly_test_000001", "rly_test_000003"])
        self.assertIn("Dropped the usage row of rly_test_000002", log.text())
        self.assertEqual(len(self.flushLoggedErrors(TypeError)), 1)
        ledger.record(usage_record(4))
        self.assertTrue(await ledger.flush())
        self.assertEqual(ledger.written, 3)

    async def test_a_row_the_database_refuses_is_dropped_alone(self):
        """
        A row the database refuses for its data (here a missing upstream,
        which no answer lacks: a bug) would be refused at every retry: the
        batch is written again row by row, that row dropped, counted and
        logged, the others written; writing goes on.
        """
        target = self.target()
        log = _LogLines(self)
        ledger = self.started(target, flush_interval=3600)
        for n in range(1, 6):
            ledger.record(usage_record(n, upstream=None if n == 3 else "default"))
        self.assertTrue(await ledger.flush())
        self.assertEqual((ledger.written, ledger.dropped, ledger.pending, ledger.failures), (4, 1, 0, 0))
        self.assertEqual(rows_in(target), ["rly_test_%06d" % n for n in (1, 2, 4, 5)])
        self.assertIn("The usage ledger refused the row of rly_test_000003, dropped:", log.text())
        self.assertIn("NOT NULL constraint failed: relay_usage.upstream", log.text())
        ledger.record(usage_record(6))
        self.assertTrue(await ledger.flush())
        self.assertEqual(ledger.written, 5)

    async def test_bounded_queue(self):
        """Past ``max_queue`` rows waiting, more are dropped and counted (and logged), never held."""
        target = self.target()
        log = _LogLines(self)
        ledger = self.started(target, SQLiteLedger(target, busy_timeout_ms=0), flush_interval=0.05, max_queue=10)
        blocker = sqlite3.connect(target, isolation_level=None)
        self.addCleanup(blocker.close)
        blocker.execute("BEGIN EXCLUSIVE")
        for n in range(1, 16):
            ledger.record(usage_record(n))
        self.assertEqual((ledger.pending, ledger.dropped), (10, 5))
        await until(lambda: "Dropped 5 usage rows" in log.text())
        blocker.execute("ROLLBACK")
        await until(lambda: ledger.written == 10)
        self.assertEqual(rows_in(target), ["rly_test_%06d" % n for n in range(1, 11)])

    async def test_retention(self):
        """Rows older than the retention are deleted at start (and hourly), the others kept."""
        target = self.target()
        database = open_ledger(target)
        database.open()
        now = time.time()
        database.write([usage_record(1, at=now - 10 * 86400), usage_record(2, at=now - 86400), usage_record(3, at=now)])
        database.close()
        ledger = self.started(target, retention_days=5)
        await until(lambda: ledger.pruned == 1)
        self.assertEqual(rows_in(target), ["rly_test_000002", "rly_test_000003"])

    async def test_spent_counts_every_row_once(self):
        """
        What a key spent is the written rows (``totals``, read on the
        ledger's thread) plus the rows still in memory (``unwritten``, taken
        when the read is back), each once, wherever they are when asked: what
        the spend limits add up.
        """
        target = self.target()
        ledger = self.started(target, flush_interval=3600)
        ledger.record(usage_record(1, key_name="bob"))
        for n in range(2, 6):
            ledger.record(usage_record(n))
        self.assertTrue(await ledger.flush())
        for n in range(6, 9):
            ledger.record(usage_record(n))
        ledger.record(usage_record(9, cost=None))
        self.assertEqual(await _spent(ledger, key_name="alice"), Decimal("0.000123") * sum(range(2, 9)))
        self.assertEqual(await _spent(ledger), Decimal("0.000123") * sum(range(1, 9)))
        since = usage_record(7).at
        self.assertEqual(await _spent(ledger, since, key_group="team-a"), Decimal("0.000123") * (7 + 8))
        # A write under way when asked is counted once too.
        write = ledger.flush()
        spent = await _spent(ledger)
        await write
        self.assertEqual(spent, Decimal("0.000123") * sum(range(1, 9)))
        totals = await ledger.totals(["key"])
        self.assertEqual([(t.group["key"], t.requests) for t in totals], [("alice", 8), ("bob", 1)])


class PostgresLedgerServiceTests(TestCase):
    """The ledger service over a real PostgreSQL server, stopped and started under it."""

    skip = postgres_server.SKIP_REASON

    def setUp(self):
        # A server of this class's own: the test stops it.
        self.server = postgres_server.PostgresServer()
        self.addCleanup(self.server.destroy)
        self.server.start()

    async def test_database_down_mid_run(self):
        """
        With PostgreSQL stopped mid-run the relay goes on relaying (its
        answers unchanged), recording queues the rows, and once the server
        is back they are written, none lost and none twice.
        """
        target = self.server.new_database()
        log = _LogLines(self)
        served = serve_relay_over_simulated(self, usage_db=target, usage_flush_interval=0.1)
        ledger = served.relay.ledger
        self.assertIs(served.relay.app._context.ledger, ledger)  # the seam metering records through
        for n in range(1, 11):
            ledger.record(usage_record(n))
        await until(lambda: ledger.written == 10)

        self.server.stop()
        relayed = []
        for _ in range(10):
            response = await treq.post(
                served.url + "/v1/messages", encode(messages_body()), headers={"content-type": "application/json"},
                persistent=False,
            )
            self.assertEqual(response.code, 200)
            self.assertEqual((await response.json())["type"], "message")
            # Metered by the relay itself: one row each, queued while the database is away.
            relayed.append(response.headers.getRawHeaders(b"x-relay-request-id")[0].decode("ascii"))
        await until(lambda: ledger.failures >= 2)
        self.assertEqual(ledger.pending, 10)
        # What an operator's alert reads: rows waiting, writes failing.
        figures = await _ledger_metrics(served.url)
        self.assertEqual((figures["written"], figures["pending"]), (10, 10))
        self.assertGreaterEqual(figures["failures"], 2)

        self.server.start()
        await until(lambda: ledger.written == 20, timeout=30)
        figures = await _ledger_metrics(served.url)
        self.assertEqual((figures["written"], figures["pending"], figures["dropped"]), (20, 0, 0))
        self.assertEqual(sorted(rows_in(target)), sorted(["rly_test_%06d" % n for n in range(1, 11)] + relayed))
        self.assertEqual(log.text().count("Cannot write the usage ledger"), 1)
        self.assertNotIn(postgres_server.PASSWORD, log.text())


async def _ledger_metrics(url: str) -> dict:
    """The usage ledger's figures on the relay's ``/metrics`` page, by their short names."""
    response = await treq.get(url + "/metrics", persistent=False)
    text = (await response.content()).decode("utf-8")
    names = {
        "relay_ledger_rows_written_total": "written",
        "relay_ledger_rows_dropped_total": "dropped",
        "relay_ledger_write_failures_total": "failures",
        "relay_ledger_rows_pending": "pending",
    }
    figures = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            figures[names[name]] = int(float(value))
    return figures


async def _spent(ledger, since=None, *, key_name=None, key_group=None) -> Decimal:
    """Written and unwritten cost since ``since`` of one key, one group or all, as the spend guard reads it."""
    written = await ledger.totals((), since=since, key_name=key_name, key_group=key_group)
    total = sum((found.cost for found in written), Decimal(0))
    for record in ledger.unwritten():
        if record.cost is None or (since is not None and record.at < since):
            continue
        if (key_name is None or record.key_name == key_name) and (key_group is None or record.key_group == key_group):
            total += record.cost
    return total
