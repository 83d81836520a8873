# -*- test-case-name: tests.test_ledger -*-
"""
The usage ledger: one row a relayed request, written off the reactor thread
in batches (``--usage-db``; ``docs/usage.md``).

:class:`Ledger` is a service. The request path hands it each answer's
:class:`~twisted_relay.usage.UsageRecord` (:meth:`Ledger.record`), which only
queues it: it never blocks and never raises. Every flush interval, or as
soon as a batch is full, the queued records go to the database in one
transaction, on the ledger's own thread (one writer a process keeps the
order). A write that fails leaves its rows at the head of the queue, tried
again at the next interval; one the database refuses for a row's data
(which no retry mends) is written again row by row, the refused rows
dropped, counted and logged. The queue is bounded (rows past it are dropped,
counted and logged), so a database down for long costs memory up to that
bound and never stops relaying. On stop the queue is written out; a process
killed outright loses what it had not written yet: at most the rows of
the last flush interval while the database answers.

The database side is :mod:`twisted_relay.ledger_sql`.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from twisted.application.service import Service
from twisted.internet.defer import Deferred, ensureDeferred, fail, succeed
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from twisted_relay.ledger_sql import LedgerDatabase, LedgerError, RowsRefused, Totals, batch_of
from twisted_relay.usage import UsageRecord

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_FLUSH_INTERVAL",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_RETENTION_DAYS",
    "RETENTION_INTERVAL",
    "Ledger",
]

#: Seconds between two writes of the queued rows.
DEFAULT_FLUSH_INTERVAL = 1.0
#: Rows written in one transaction at most; a full batch is written at once.
DEFAULT_BATCH_SIZE = 500
#: Rows held in memory at most (queued or being written); more are dropped.
DEFAULT_MAX_QUEUE = 50_000
#: Rows of requests older than this many days are deleted (0: kept forever).
DEFAULT_RETENTION_DAYS = 400.0
#: Seconds between two retention passes.
RETENTION_INTERVAL = 3600.0


class Ledger(Service):
    """
    Writes :class:`~twisted_relay.usage.UsageRecord` rows to a ledger
    database in batches, off the reactor thread.

    :ivar database: the :class:`~twisted_relay.ledger_sql.LedgerDatabase`.
    :ivar written: rows written (a request already in the ledger not counted).
    :ivar dropped: rows dropped: the queue was full, the ledger had stopped,
        or the database refused the row.
    :ivar failures: writes that failed (each one's rows were kept and tried again).
    :ivar pruned: rows deleted by retention.
    """

    log = Logger()

    def __init__(
        self,
        database: LedgerDatabase,
        *,
        reactor,
        flush_interval: float = DEFAULT_FLUSH_INTERVAL,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_queue: int = DEFAULT_MAX_QUEUE,
        retention_days: float = DEFAULT_RETENTION_DAYS,
    ):
        """
        :param flush_interval: seconds between two writes of what is queued
            (and between two tries while the database fails).
        :param batch_size: rows a transaction holds at most.
        :param max_queue: rows held in memory at most.
        :param retention_days: age past which rows are deleted; 0 keeps
            every row.
        """
        self.database = database
        self._reactor = reactor
        self._flush_interval = flush_interval
        self._batch_size = max(1, batch_size)
        self._max_queue = max(1, max_queue)
        self._max_age = retention_days * 86400.0
        self._queue: deque[UsageRecord] = deque()
        # The batch being written, and the write's Deferred.
        self._batch: list[UsageRecord] = []
        self._writing: Deferred | None = None
        self._pool: ThreadPool | None = None
        self._flusher: LoopingCall | None = None
        self._retention: LoopingCall | None = None
        self._closed = False
        # Whether the last write failed (an outage is logged once).
        self._failing = False
        self._dropped_unlogged = 0
        self.written = 0
        self.dropped = 0
        self.failures = 0
        self.pruned = 0
        #: Called with each record queued (the spend limits' own count).
        self.listeners: list = []

    @property
    def pending(self) -> int:
        """Rows not written yet: queued, or in the write under way."""
        return len(self._queue) + len(self._batch)

    # -- the request path's side

    def record(self, record: UsageRecord) -> None:
        """
        Queue one request's usage, to be written within the flush interval.
        Call it on the reactor thread; it never blocks and never raises.
        """
        try:
            if self._closed or self.pending >= self._max_queue:
                self.dropped += 1
                self._dropped_unlogged += 1
                if self._closed:
                    self._log_dropped()
                return
            self._queue.append(record)
            for listener in self.listeners:
                listener(record)
            if len(self._queue) >= self._batch_size and self._writing is None and self._pool is not None:
                self._write_next()
        except Exception:
            self.log.failure("Could not queue the usage of {relay_request_id}", relay_request_id=getattr(record, "request_id", None))

    # -- the service

    def startService(self) -> None:
        """
        Connect to the database and make its tables if missing (at once, on
        this thread: a database the relay cannot use stops the start, with
        :class:`~twisted_relay.ledger_sql.LedgerError`), then write every
        flush interval and prune every hour.
        """
        self.database.open()
        Service.startService(self)
        self._closed = False
        self._pool = ThreadPool(0, 1, name="twisted-relay-ledger")
        self._pool.start()
        self.log.info(
            "Usage ledger: {database} (written every {interval:g}s, {retention})",
            database=self.database.description,
            interval=self._flush_interval,
            retention="rows kept %g days" % (self._max_age / 86400.0,) if self._max_age else "rows kept forever",
        )
        self._flusher = LoopingCall(self._tick)
        self._flusher.clock = self._reactor
        self._flusher.start(self._flush_interval, now=False).addErrback(self._loop_failed)
        if self._max_age:
            self._retention = LoopingCall(self._retain)
            self._retention.clock = self._reactor
            self._retention.start(RETENTION_INTERVAL, now=True).addErrback(self._loop_failed)

    def stopService(self) -> Deferred:
        """Write every queued row (stopping at the first write that fails), then let go of the database."""
        Service.stopService(self)
        for loop in (self._flusher, self._retention):
            if loop is not None and loop.running:
                loop.stop()
        self._flusher = self._retention = None
        d = ensureDeferred(self._write_all())
        d.addBoth(self._close)
        return d

    async def _write_all(self) -> None:
        await self._flush_all()
        self._closed = True
        if self.pending:
            self.dropped += self.pending
            self.log.error(
                "{pending} usage rows were not written to {database} before stopping",
                pending=self.pending,
                database=self.database.description,
            )
            self._queue.clear()

    def _settled(self, d: Deferred) -> Deferred:
        """Fires with whether the write succeeded, once it has (and its callbacks have run)."""
        settled: Deferred = Deferred()
        d.addBoth(lambda ok: settled.callback(bool(ok)) or ok)
        return settled

    def _close(self, result):
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is None:
            return None
        d = deferToThreadPool(self._reactor, pool, self.database.close)
        d.addErrback(lambda _: None)
        d.addCallback(lambda _: pool.stop())
        return d

    # -- writing

    def flush(self) -> Deferred:
        """
        Write what is queued now, batch after batch; fires with whether every
        write succeeded (the one under way included). For tests and for
        callers that must see their rows in the database.
        """
        return ensureDeferred(self._flush_all())

    async def _flush_all(self) -> bool:
        # One write at a time: a full batch may start the next by itself.
        while self._pool is not None and (self._writing is not None or self._queue):
            write = self._writing if self._writing is not None else self._write_next()
            if not await self._settled(write):
                return False
        return True

    def _tick(self) -> None:
        if self._dropped_unlogged:
            self._log_dropped()
        if self._writing is None and self._queue:
            self._write_next()

    def _write_next(self) -> Deferred:
        """Write the batch at the head of the queue; fires ``True`` when written, ``False`` when it failed."""
        take = min(self._batch_size, len(self._queue))
        self._batch = [self._queue.popleft() for _ in range(take)]
        # The rows are made here, not on the writer thread, whose Python code
        # would hold the interpreter lock against the reactor.
        try:
            batch = batch_of(self._batch)
        except Exception:
            batch = self._without_unwritable_rows()
        d = deferToThreadPool(self._reactor, self._pool, self.database.write_batch, batch)
        d.addErrback(self._write_one_by_one)
        d.addCallbacks(self._written, self._failed)
        self._writing = d
        return d

    def _write_one_by_one(self, failure: Failure) -> Deferred:
        """The database refused a row of the batch: write each row alone, and drop those it refuses."""
        failure.trap(RowsRefused)
        rows = [batch_of([record]) for record in self._batch]
        d = deferToThreadPool(self._reactor, self._pool, self.database.write_each, rows)
        d.addCallback(self._drop_refused)
        return d

    def _drop_refused(self, written: tuple[int, dict[int, str]]) -> int:
        added, refused = written
        for index, why in sorted(refused.items()):
            self.dropped += 1
            self.log.error(
                "The usage ledger refused the row of {relay_request_id}, dropped: {why}",
                relay_request_id=self._batch[index].request_id,
                why=why,
            )
        return added

    def _without_unwritable_rows(self) -> str:
        """The batch without the records that cannot be made rows of (a bug): each dropped, counted and logged."""
        kept = []
        for record in self._batch:
            try:
                batch_of([record])
            except Exception:
                self.dropped += 1
                self.log.failure("Dropped the usage row of {relay_request_id}", relay_request_id=record.request_id)
            else:
                kept.append(record)
        self._batch = kept
        return batch_of(kept)

    def _written(self, added: int) -> bool:
        self._batch, self._writing = [], None
        self.written += added
        if self._failing:
            self._failing = False
            self.log.info(
                "Usage ledger written again to {database}; {pending} rows wait",
                database=self.database.description,
                pending=self.pending,
            )
        if len(self._queue) >= self._batch_size and self._pool is not None and not self._closed:
            self._write_next()
        return True

    def _failed(self, failure: Failure) -> bool:
        batch, self._batch, self._writing = self._batch, [], None
        # Back at the head, in order: tried again at the next interval.
        self._queue.extendleft(reversed(batch))
        self.failures += 1
        if not self._failing:
            self._failing = True
            if failure.check(LedgerError):
                self.log.error(
                    "Cannot write the usage ledger: {error}; {pending} rows wait, tried again every {interval:g}s",
                    error=failure.getErrorMessage(),
                    pending=self.pending,
                    interval=self._flush_interval,
                )
            else:
                self.log.failure("Writing the usage ledger failed", failure)
        return False

    def _log_dropped(self) -> None:
        count, self._dropped_unlogged = self._dropped_unlogged, 0
        self.log.warn(
            "Dropped {count} usage rows ({dropped} in all): {why}",
            count=count,
            dropped=self.dropped,
            why="the ledger has stopped"
            if self._closed
            else "%d rows already wait for %s (--usage-max-queue)" % (self.pending, self.database.description),
        )

    # -- retention

    def _retain(self) -> None:
        if self._pool is None or not self._max_age:
            return
        before = self._reactor.seconds() - self._max_age
        d = deferToThreadPool(self._reactor, self._pool, self.database.prune, before)
        d.addCallbacks(self._pruned, self._prune_failed)

    def _pruned(self, removed: int) -> None:
        self.pruned += removed
        if removed:
            self.log.info(
                "Usage ledger retention deleted {removed} rows older than {days:g} days",
                removed=removed,
                days=self._max_age / 86400.0,
            )

    def _prune_failed(self, failure: Failure) -> None:
        if failure.check(LedgerError):
            self.log.warn("Usage ledger retention failed (tried again in an hour): {error}", error=failure.getErrorMessage())
        else:
            self.log.failure("Usage ledger retention failed", failure)

    def _loop_failed(self, failure: Failure) -> None:
        self.log.failure("The usage ledger's timer stopped", failure)

    # -- reading

    def totals(self, by: Iterable[str] = (), **conditions) -> "Deferred[list[Totals]]":
        """
        :meth:`LedgerDatabase.totals <twisted_relay.ledger_sql.LedgerDatabase.totals>`
        on the ledger's thread, after the writes already queued there.
        Rows still in memory are not in it (see :meth:`unwritten`).
        """
        if self._pool is None:
            return succeed([])
        return deferToThreadPool(self._reactor, self._pool, self.database.totals, tuple(by), **conditions)

    def unwritten(self) -> list[UsageRecord]:
        """This process's records not written yet (queued, or in the write under way)."""
        return [*self._batch, *self._queue]

    def being_written(self) -> list[UsageRecord]:
        """
        Those of :meth:`unwritten` in the write under way (handed to the
        ledger's thread: work given to :meth:`on_database` now runs after it).
        """
        return list(self._batch)

    def on_database(self, work, *args) -> Deferred:
        """
        ``work(database, *args)`` on the ledger's thread, after the writes
        queued there (the spend limits' table, :mod:`twisted_relay.spend_limits_sql`);
        fails with :class:`~twisted_relay.ledger_sql.LedgerError` when the
        ledger is not running.
        """
        if self._pool is None:
            return fail(LedgerError("the usage ledger is not running"))
        return deferToThreadPool(self._reactor, self._pool, work, self.database, *args)
