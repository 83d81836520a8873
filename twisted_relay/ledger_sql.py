# -*- test-case-name: tests.test_ledger_sql -*-
"""
The usage ledger's database: its schema, its writes and its reads, the same
for SQLite (the standard library's ``sqlite3``, the embedded default) and
PostgreSQL (psycopg 3, ``pip install 'twisted-relay[postgres]'``).

One row a relayed request (:class:`~twisted_relay.usage.UsageRecord`), keyed
by the relay's request id, so that a batch written again after a failure
that left its outcome unknown counts nothing twice. :func:`open_ledger` names
a database by the ``--usage-db`` value (a file path, ``sqlite:PATH`` or a
``postgresql://`` URL); :class:`LedgerDatabase` writes batches
(:meth:`~LedgerDatabase.write`), prunes old rows and adds up usage by key,
group, model, session, day, upstream or platform over a time range
(:meth:`~LedgerDatabase.totals`).

Every call blocks: the ledger service (:mod:`twisted_relay.ledger`) makes
them on its own thread, ``twisted-relay-usage`` directly. No Twisted here.
Errors are :class:`LedgerError`, one line that never holds a password.
"""

from __future__ import annotations

import os
import sqlite3
import time
import zlib
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Iterable, Sequence
from urllib.parse import unquote, urlsplit


from twisted_relay.redact import redact_text
from twisted_relay.spend_limits_sql import SCHEMA as _SPEND_LIMITS_SCHEMA
from twisted_relay.spend_shares_sql import SCHEMA as _SPEND_SHARES_SCHEMA
from twisted_relay.signin_sql import SCHEMA as _SIGNIN_SCHEMA
from twisted_relay.ledger_rows import batch_of, dollars_of
from twisted_relay.usage import TOKEN_KINDS, UsageRecord

__all__ = [
    "GROUPINGS",
    "POSTGRES_EXTRA",
    "SCHEMA_VERSION",
    "LedgerDatabase",
    "LedgerError",
    "RowsRefused",
    "Totals",
    "batch_of",
    "describe_database",
    "is_postgres",
    "open_ledger",
]

#: Version of the tables' layout, kept in the database; bumped on any change
#: (2: the spend limits' table, :mod:`twisted_relay.spend_limits_sql`; 3: the
#: spend shares' table, :mod:`twisted_relay.spend_shares_sql`; 4: the ``platform``
#: column; 5: sign-in's tables, :mod:`twisted_relay.signin_sql`). A relay opening
#: an older ledger brings it up to date.
SCHEMA_VERSION = 5
#: What installs the PostgreSQL driver.
POSTGRES_EXTRA = "pip install 'twisted-relay[postgres]'"
#: What a report may add up by, and the column each reads.
GROUPINGS = {
    "key": "key_name",
    "group": "key_group",
    "model": "model",
    "session": "session_id",
    "agent": "agent_id",
    "upstream": "upstream",
    "platform": "platform",
    "day": "day",
}

# One cost unit is a millionth of a millionth of a US dollar: integers add up
# exactly in both databases (SQLite has no decimal type), and every product
# of today's prices and their multipliers (a cache read at a tenth of
# $0.80 per million tokens, times 1.1 for US-only inference: 8.8e-8 a token)
# is a whole number of them. A 64-bit integer holds 9.2 million dollars of
# them: a row holds at most that (_picos), and sums are made in two parts
# (totals), since SQLite's SUM of a column fails past it.
_POSTGRES_SCHEMES = ("postgresql", "postgres")
# Seconds to connect to PostgreSQL, and to wait for SQLite's write lock.
_CONNECT_TIMEOUT = 5
_BUSY_TIMEOUT_MS = 5000
# Milliseconds PostgreSQL may leave sent data unacknowledged before the
# connection counts as broken.
_TCP_USER_TIMEOUT_MS = 15000
# Serialises schema creation among relays starting at once (any constant).
_SCHEMA_LOCK = 7_337_004_217
# The first key of the locks of serialize() (any constant: a class of locks).
_NAMED_LOCKS = 733_700_422

_COLUMNS = (
    ("request_id", "TEXT PRIMARY KEY"),
    ("at", "DOUBLE PRECISION NOT NULL"),
    ("day", "TEXT NOT NULL"),
    ("key_name", "TEXT"),
    ("key_group", "TEXT"),
    ("session_id", "TEXT"),
    ("agent_id", "TEXT"),
    ("parent_agent_id", "TEXT"),
    ("upstream", "TEXT NOT NULL"),
    # NULL in the rows written before schema 3.
    ("platform", "TEXT"),
    ("model", "TEXT NOT NULL"),
    ("status", "INTEGER NOT NULL"),
    ("stream", "SMALLINT NOT NULL"),
    ("partial", "SMALLINT NOT NULL"),
    *((kind, "BIGINT NOT NULL") for kind in TOKEN_KINDS),
    ("cost_pico_usd", "BIGINT"),
    ("usage_json", "TEXT NOT NULL"),
)
# The columns added since schema 1, which opening an older ledger adds.
_ADDED_COLUMNS = (("platform", "TEXT"),)
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS relay_usage_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS relay_usage (%s)" % (", ".join("%s %s" % c for c in _COLUMNS),),
    "CREATE INDEX IF NOT EXISTS relay_usage_at ON relay_usage (at)",
    "CREATE INDEX IF NOT EXISTS relay_usage_key_at ON relay_usage (key_name, at)",
    "CREATE INDEX IF NOT EXISTS relay_usage_group_at ON relay_usage (key_group, at)",
    *_SPEND_LIMITS_SCHEMA,
    *_SPEND_SHARES_SCHEMA,
    *_SIGNIN_SCHEMA,
)
# A batch is written by one statement with one parameter, its rows as one
# JSON text (an array of arrays, made on the reactor thread), which the
# database takes apart: the writer thread runs next to no Python, so it
# barely contends for the interpreter lock while the database works. Before,
# SQLite took a statement a row (S3 18 % fewer requests/s), then 400 rows a
# statement with a parameter a value (2 to 5 % fewer; a flat list made on the
# reactor, 1.5 to 3 %); psycopg adapted each value in Python (47 us of the
# relay's CPU a row on PostgreSQL, now 5). SQLite's JSON functions cost its
# writer about 10 us more a row, off the reactor and without the lock
# (docs/benchmarks.md, "The ledger's writes, side by side").
_COLUMN_NAMES = ", ".join(name for name, _ in _COLUMNS)
_SQLITE_INSERT = (
    "INSERT INTO relay_usage (%s) SELECT %s FROM json_each(?) WHERE true ON CONFLICT (request_id) DO NOTHING"
    % (_COLUMN_NAMES, ", ".join("json_extract(value, '$[%d]')" % (n,) for n in range(len(_COLUMNS))))
)
_POSTGRES_INSERT = (
    "INSERT INTO relay_usage (%s) SELECT %s FROM json_array_elements(%%s::json) AS item ON CONFLICT (request_id) DO NOTHING"
    % (
        _COLUMN_NAMES,
        ", ".join(
            "(item ->> %d)::%s" % (n, kind.replace(" PRIMARY KEY", "").replace(" NOT NULL", ""))
            for n, (_, kind) in enumerate(_COLUMNS)
        ),
    )
)


class LedgerError(Exception):
    """
    The ledger's database cannot be used (unreachable, refused, a driver
    missing, not a ledger); its text is one line and holds no password.
    """


class RowsRefused(LedgerError):
    """
    The database is there but refused the data of a write (a value out of
    range, a missing one): trying the same rows again cannot succeed.
    """


@dataclass(frozen=True)
class Totals:
    """
    The usage of a group of requests.

    :ivar group: the value of each grouping asked for, by name
        (:data:`GROUPINGS`); ``None`` where the requests had none (no key).
    :ivar requests: how many requests.
    :ivar tokens: a sum for every kind of :data:`~twisted_relay.usage.TOKEN_KINDS`.
    :ivar cost: their cost in US dollars (of the priced ones).
    :ivar unpriced: requests whose model had no price (not in :attr:`cost`).
    :ivar partial: requests whose answer ended early.
    :ivar first: when the first arrived (Unix time).
    :ivar last: when the last arrived.
    """

    group: dict
    requests: int
    tokens: dict = field(default_factory=dict)
    cost: Decimal = Decimal(0)
    unpriced: int = 0
    partial: int = 0
    first: float | None = None
    last: float | None = None


def is_postgres(target: str) -> bool:
    """Whether a ``--usage-db`` value names a PostgreSQL database."""
    return target.split("://", 1)[0].lower() in _POSTGRES_SCHEMES and "://" in target


def sqlite_path(target: str) -> str:
    """
    The file a ``--usage-db`` value that is not PostgreSQL names: ``PATH``
    or ``sqlite:PATH`` (``sqlite:///abs/path`` too).

    :raises LedgerError: for another ``scheme://``.
    """
    if target.startswith("sqlite:"):
        rest = target[len("sqlite:"):]
        path = rest[2:] if rest.startswith("//") else rest
    elif "://" in target:
        raise LedgerError(
            "--usage-db must be a file path (SQLite) or a postgresql:// URL, not a %s:// URL"
            % (target.split("://", 1)[0][:20],)
        )
    else:
        path = target
    if not path:
        raise LedgerError("--usage-db sqlite: names no file")
    return path


def describe_database(target: str) -> str:
    """A ``--usage-db`` value fit for logs: no password, no query (which may hold one)."""
    if not is_postgres(target):
        try:
            return "sqlite:" + os.path.abspath(sqlite_path(target))
        except LedgerError:
            return "(not a database)"
    parts = urlsplit(target)
    try:
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "%s://(not a URL)" % (parts.scheme,)
    user = "%s@" % (parts.username,) if parts.username else ""
    if ":" in host:
        host = "[%s]" % (host,)
    return "%s://%s%s%s%s" % (parts.scheme, user, host, ":%d" % port if port else "", parts.path)


def open_ledger(target: str, *, create: bool = True) -> "LedgerDatabase":
    """
    The ledger ``target`` (a ``--usage-db`` value) names, not yet connected
    (:meth:`LedgerDatabase.open` connects).

    :param create: the relay's: make the file and the tables if missing.
        ``False`` (reports): the ledger must exist already.
    :raises LedgerError: for a value that names no database, or
        ``postgresql://`` without psycopg installed.
    """
    if is_postgres(target):
        return PostgresLedger(target, create=create)
    return SQLiteLedger(sqlite_path(target), create=create)


class LedgerDatabase:
    """
    One connection to a ledger, made again after a failure. Not thread-safe:
    one thread at a time (the ledger service's writer).

    :ivar description: the database, fit for logs (:func:`describe_database`).
    """

    #: The driver's placeholder for a parameter.
    placeholder = "?"
    # The INSERT of a batch (write_batch), one parameter: the rows' JSON text.
    _insert: str

    def __init__(self, description: str, *, create: bool = True, secrets: Sequence[str] = ()):
        self.description = description
        self._create = create
        self._secrets = tuple(s for s in secrets if s)
        self._connection = None
        # The version of the ledger's tables, once opened.
        self._schema_version = SCHEMA_VERSION

    # -- what each database does its own way

    def _connect(self):
        raise NotImplementedError

    def _errors(self) -> tuple[type[BaseException], ...]:
        raise NotImplementedError

    def _refusals(self) -> tuple[type[BaseException], ...]:
        """Those of :meth:`_errors` that refuse a write's data, not the connection."""
        raise NotImplementedError

    def _lock_schema(self, cursor) -> None:
        """Keep other relays from creating the tables at the same time (inside the transaction)."""

    def _has_table(self, cursor) -> bool:
        raise NotImplementedError

    def _column_names(self, cursor) -> set[str]:
        """The columns ``relay_usage`` has."""
        raise NotImplementedError

    def _check_json(self, cursor) -> None:
        """Refuse a database that cannot take a batch (:meth:`write_batch`) apart."""

    def serialize(self, cursor, names: Sequence[str]) -> None:
        """
        Hold, until the transaction ends, a lock of each of ``names``
        against every transaction of any process that locks one of them
        (taken in one order, whatever the order given: no deadlock). The
        first statement of a transaction.
        """
        raise NotImplementedError

    def clock(self, cursor) -> float:
        """The time (Unix seconds) by the database's clock: one clock for every relay on it."""
        return time.time()

    # -- the same for both

    def open(self) -> None:
        """Connect, and make the tables if they are missing (idempotent)."""
        self.run(self._check_schema)

    def close(self) -> None:
        """Let go of the connection (the next call connects again)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                # First: a failed statement still held (by its error's
                # traceback) would keep SQLite's write lock past close().
                connection.rollback()
            except Exception:
                pass
            try:
                connection.close()
            except Exception:
                pass

    def write(self, records: Sequence[UsageRecord]) -> int:
        """
        Write ``records`` in one transaction; a request already in the
        ledger (the same request id) is left as it is.

        :return: the rows added.
        """
        return self.write_batch(batch_of(records))

    def write_batch(self, batch: str) -> int:
        """:meth:`write` of rows already made (:func:`batch_of`): the writer thread runs next to no Python."""

        def insert(connection):
            cursor = connection.cursor()
            cursor.execute(self._insert, (batch,))
            return max(cursor.rowcount, 0)

        return self.run(insert)

    def write_each(self, rows: Sequence[str]) -> tuple[int, dict[int, str]]:
        """
        Each of ``rows`` (one record's :func:`batch_of` each) written in a
        transaction of its own: the rows added, and why the database refused
        those it refused, by index. Raises :class:`LedgerError` when the
        database fails otherwise.
        """
        added, refused = 0, {}
        for index, row in enumerate(rows):
            try:
                added += self.write_batch(row)
            except RowsRefused as e:
                refused[index] = str(e)
        return added, refused

    def prune(self, before: float) -> int:
        """Delete the rows of requests that arrived before ``before`` (Unix time); return how many."""

        def delete(connection):
            cursor = connection.cursor()
            cursor.execute(self.sql("DELETE FROM relay_usage WHERE at < ?"), (float(before),))
            return max(cursor.rowcount, 0)

        return self.run(delete)

    def totals(
        self,
        by: Iterable[str] = (),
        *,
        since: float | None = None,
        until: float | None = None,
        key_name: str | None = None,
        key_group: str | None = None,
    ) -> list[Totals]:
        """
        Usage added up by the groupings ``by`` (names of :data:`GROUPINGS`,
        in order; none: one line for everything), over the requests that
        arrived in ``[since, until)`` (Unix times; ``None``: unbounded), of
        one key or group if given; sorted by the groupings' values.

        :raises LedgerError: for an unknown grouping.
        """
        by = tuple(by)
        unknown = [name for name in by if name not in GROUPINGS]
        if unknown:
            raise LedgerError(
                "cannot add up usage by %s (known: %s)" % (", ".join(unknown), ", ".join(GROUPINGS))
            )
        if "platform" in by and self._schema_version < 4:
            raise LedgerError(
                "%s was written before relays recorded the platform (ledger schema %d): a relay of this "
                "version adds the column when it opens the ledger" % (self.description, self._schema_version)
            )
        columns = [GROUPINGS[name] for name in by]
        where, parameters = _conditions(since, until, key_name, key_group)
        sums = ", ".join("SUM(%s)" % (kind,) for kind in TOKEN_KINDS)
        query = (
            # The cost in two sums, millionths of a dollar and the picos past
            # them: SQLite's SUM of one column fails past 64 bits ($9.2M).
            "SELECT %s COUNT(*), %s, SUM(cost_pico_usd / 1000000), "
            "SUM(cost_pico_usd - cost_pico_usd / 1000000 * 1000000), "
            "SUM(CASE WHEN cost_pico_usd IS NULL THEN 1 ELSE 0 END), SUM(partial), MIN(at), MAX(at) "
            "FROM relay_usage%s%s"
        ) % (
            "".join(column + ", " for column in columns),
            sums,
            where,
            " GROUP BY " + ", ".join(columns) if columns else "",
        )

        def select(connection):
            cursor = connection.cursor()
            cursor.execute(self.sql(query), parameters)
            return cursor.fetchall()

        found = []
        for row in self.run(select):
            group = dict(zip(by, row[: len(by)]))
            row = row[len(by):]
            if not row[0]:
                continue  # no request at all: no line
            kinds = row[1 : 1 + len(TOKEN_KINDS)]
            micros, picos, unpriced, partial, first, last = row[1 + len(TOKEN_KINDS):]
            found.append(
                Totals(
                    group=group,
                    requests=int(row[0]),
                    tokens={kind: int(value or 0) for kind, value in zip(TOKEN_KINDS, kinds)},
                    cost=dollars_of(int(micros or 0) * 1_000_000 + int(picos or 0)),
                    unpriced=int(unpriced or 0),
                    partial=int(partial or 0),
                    first=first,
                    last=last,
                )
            )
        found.sort(key=lambda t: tuple((v is not None, v or "") for v in t.group.values()))
        return found

    def sql(self, text: str) -> str:
        """``text`` with its ``?`` placeholders as this database's driver takes them."""
        return text if self.placeholder == "?" else text.replace("?", self.placeholder)

    def _check_schema(self, connection) -> None:
        cursor = connection.cursor()
        if not self._create:
            if not self._has_table(cursor):
                raise LedgerError("%s holds no usage ledger (no relay has written to it)" % (self.description,))
        else:
            self._lock_schema(cursor)
            for statement in _SCHEMA:
                cursor.execute(statement)
        if self._create:
            self._check_json(cursor)
        cursor.execute(self.sql("SELECT value FROM relay_usage_meta WHERE name = ?"), ("schema_version",))
        found = cursor.fetchone()
        if found is None and self._create:
            cursor.execute(
                self.sql("INSERT INTO relay_usage_meta (name, value) VALUES (?, ?)"), ("schema_version", str(SCHEMA_VERSION))
            )
        elif found is not None and int(found[0]) < SCHEMA_VERSION and self._create:
            # The new tables were made above; the old one gains its new
            # columns, in the same transaction (a relay of this version that
            # made the table first has them already).
            present = self._column_names(cursor)
            for name, kind in _ADDED_COLUMNS:
                if name not in present:
                    cursor.execute("ALTER TABLE relay_usage ADD COLUMN %s %s" % (name, kind))
            cursor.execute(
                self.sql("UPDATE relay_usage_meta SET value = ? WHERE name = ?"), (str(SCHEMA_VERSION), "schema_version")
            )
        elif found is not None and int(found[0]) > SCHEMA_VERSION:
            raise LedgerError(
                "%s was written by a newer twisted-relay (ledger schema %s; this one knows %d)"
                % (self.description, found[0], SCHEMA_VERSION)
            )
        self._schema_version = SCHEMA_VERSION if found is None or self._create else int(found[0])
        connection.commit()

    def run(self, work):
        """
        Run ``work(connection)`` in one transaction, committed; on a database
        error, drop the connection and raise :class:`LedgerError` (for the
        database's other tables too: :mod:`twisted_relay.spend_limits_sql`).
        """
        try:
            if self._connection is None:
                self._connection = self._connect()
            result = work(self._connection)
            self._connection.commit()
            return result
        except LedgerError:
            self.close()
            raise
        except self._refusals() as e:
            # The connection is sound: only this transaction goes.
            try:
                self._connection.rollback()
            except self._errors():
                self.close()
            raise RowsRefused(self._one_line(e)) from None
        except self._errors() as e:
            self.close()
            raise LedgerError(self._one_line(e)) from None
        except BaseException:
            # Anything else (a bug in ``work``) must not leave its transaction, and its locks, open.
            if self._connection is not None:
                try:
                    self._connection.rollback()
                except self._errors():
                    self.close()
            raise

    def _one_line(self, error: BaseException) -> str:
        text = " ".join(str(error).split()) or error.__class__.__name__
        return "%s: %s" % (self.description, redact_text(text, self._secrets))


def _conditions(since, until, key_name, key_group) -> tuple[str, tuple]:
    clauses, parameters = [], []
    for clause, value in (("at >= ?", since), ("at < ?", until), ("key_name = ?", key_name), ("key_group = ?", key_group)):
        if value is not None:
            clauses.append(clause)
            parameters.append(float(value) if clause.startswith("at") else value)
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), tuple(parameters)


class SQLiteLedger(LedgerDatabase):
    """
    A ledger in one SQLite file, in WAL mode: a process killed mid-write
    leaves the file whole (the batch it was writing is not in it), and
    several processes (``--workers``) write to it in turn.
    """

    _insert = _SQLITE_INSERT

    def __init__(self, path: str, *, create: bool = True, busy_timeout_ms: int = _BUSY_TIMEOUT_MS):
        super().__init__("sqlite:" + os.path.abspath(path), create=create)
        self.path = path
        self._busy_timeout_ms = busy_timeout_ms

    def _connect(self):
        from urllib.parse import quote

        mode = "rwc" if self._create else "rw"
        uri = "file:%s?mode=%s" % (quote(os.path.abspath(self.path)), mode)
        try:
            connection = sqlite3.connect(uri, uri=True, timeout=self._busy_timeout_ms / 1000.0, check_same_thread=False)
        except sqlite3.OperationalError as e:
            if not self._create and not os.path.exists(self.path):
                raise LedgerError("%s: no such file" % (self.description,)) from None
            raise LedgerError(self._one_line(e)) from None
        try:
            # WAL: whole after a crash, readers never wait for the writer.
            # NORMAL: a committed batch survives a process killed at any
            # point; only a power loss may undo the last ones.
            if self._create:
                connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            connection.execute("PRAGMA busy_timeout=%d" % (int(self._busy_timeout_ms),))
        except sqlite3.Error:
            connection.close()
            raise
        return connection

    def _errors(self):
        return (sqlite3.Error, OSError)

    def _refusals(self):
        return (sqlite3.IntegrityError, sqlite3.DataError)

    def _lock_schema(self, cursor) -> None:
        cursor.execute("BEGIN IMMEDIATE")

    def serialize(self, cursor, names: Sequence[str]) -> None:
        # One machine, one file: the file's write lock stands for every name.
        cursor.execute("BEGIN IMMEDIATE")

    def _check_json(self, cursor) -> None:
        try:
            cursor.execute("SELECT json_extract('[1]', '$[0]')")
        except sqlite3.OperationalError:
            raise LedgerError(
                "%s: this SQLite (%s) has no JSON functions, which the ledger writes with (3.38 and later "
                "have them built in)" % (self.description, sqlite3.sqlite_version)
            ) from None

    def _has_table(self, cursor) -> bool:
        cursor.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'relay_usage'")
        return cursor.fetchone() is not None

    def _column_names(self, cursor) -> set[str]:
        cursor.execute("PRAGMA table_info(relay_usage)")
        return {row[1] for row in cursor.fetchall()}


class PostgresLedger(LedgerDatabase):
    """A ledger in a PostgreSQL database, which several relays share."""

    placeholder = "%s"
    _insert = _POSTGRES_INSERT

    def __init__(self, url: str, *, create: bool = True):
        parts = urlsplit(url)
        password = unquote(parts.password) if parts.password else None
        super().__init__(describe_database(url), create=create, secrets=(password,) if password else ())
        self.url = url
        try:
            import psycopg
        except ImportError:
            raise LedgerError(
                "--usage-db postgresql://... needs the PostgreSQL driver, psycopg: %s" % (POSTGRES_EXTRA,)
            ) from None
        self._psycopg = psycopg

    def _connect(self):
        # A server that vanishes mid-write (a network cut) fails the write
        # within seconds instead of the system's TCP timeout, so that the
        # writer goes back to queueing and a stop is not held up for long.
        return self._psycopg.connect(
            self.url,
            connect_timeout=_CONNECT_TIMEOUT,
            application_name="twisted-relay",
            autocommit=False,
            keepalives=1,
            keepalives_idle=10,
            keepalives_interval=5,
            keepalives_count=3,
            tcp_user_timeout=_TCP_USER_TIMEOUT_MS,
        )

    def _errors(self):
        return (self._psycopg.Error, OSError)

    def _refusals(self):
        return (self._psycopg.IntegrityError, self._psycopg.DataError)

    def _lock_schema(self, cursor) -> None:
        cursor.execute("SELECT pg_advisory_xact_lock(%d)" % (_SCHEMA_LOCK,))

    def serialize(self, cursor, names: Sequence[str]) -> None:
        # Two names of one digest share a lock: they wait for each other, no more.
        for key in sorted({zlib.crc32(name.encode("utf-8")) - 2**31 for name in names}):
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", (_NAMED_LOCKS, key))

    def clock(self, cursor) -> float:
        cursor.execute("SELECT extract(epoch FROM clock_timestamp())")
        return float(cursor.fetchone()[0])

    def _check_json(self, cursor) -> None:
        # A batch's JSON holds non-ASCII text as \uXXXX escapes, which only a
        # UTF8 database turns back into text: elsewhere a batch with one fails.
        cursor.execute("SHOW server_encoding")
        (encoding,) = cursor.fetchone()
        if isinstance(encoding, bytes):  # psycopg gives SQL_ASCII's text as bytes
            encoding = encoding.decode("ascii", "replace")
        if encoding != "UTF8":
            raise LedgerError(
                "%s: the database's encoding is %s; the ledger needs a UTF8 database "
                "(CREATE DATABASE ... ENCODING 'UTF8')" % (self.description, encoding)
            )

    def _has_table(self, cursor) -> bool:
        cursor.execute("SELECT to_regclass('relay_usage') IS NOT NULL")
        return bool(cursor.fetchone()[0])

    def _column_names(self, cursor) -> set[str]:
        # The table the unqualified name finds: the first schema of the search path that has one.
        cursor.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass('relay_usage') "
            "AND attnum > 0 AND NOT attisdropped"
        )
        return {row[0] for row in cursor.fetchall()}
