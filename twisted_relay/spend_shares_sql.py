# -*- test-case-name: tests.test_spend_shares -*-
"""
Spend shares in the ledger's database (:mod:`twisted_relay.ledger_sql`):
the ``relay_spend_shares`` table (made with the ledger's tables, schema 3)
and the one transaction that takes a share (:func:`take_shares`).

A relay process (a *holder*) may let requests under a cap through without
asking the database only within a share it took here. Its row says what it
may still add to the ledger against that cap in that window: its own rows
not written yet plus its share, until the row's lease ends. A share is
taken under a lock of the cap, from what neither the ledger's rows nor the
other holders' rows take up, so that the rows and every holder's row never
add up past the cap (``docs/usage.md``, "Several relays, and the overshoot
bound"). A holder's row counts its rows not yet written as they were when it
took the share; once written they count twice (in the ledger too) until its
next share: the sum errs high, never low. Every call blocks and runs on the
ledger's thread, after the writes handed to it before: the asker's rows in
such a write are looked up by request id, counted in the ledger if there
and as unwritten if not. No Twisted here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["SCHEMA", "ShareAsked", "ShareTaken", "take_shares"]

#: The table's statements, run with the ledger's schema.
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS relay_spend_shares ("
    "limit_id TEXT NOT NULL, window_start DOUBLE PRECISION NOT NULL, holder TEXT NOT NULL, "
    "held_pico BIGINT NOT NULL, expires_at DOUBLE PRECISION NOT NULL, "
    "PRIMARY KEY (limit_id, window_start, holder))",
)
#: A share is this part of what is free (rounded up: never none while something is).
SHARE_PART = 4
_SCOPE_COLUMNS = {"user": "key_name", "workspace": "key_group"}
_IDS_A_QUERY = 400


@dataclass(frozen=True)
class ShareAsked:
    """
    One cap's share, asked by a holder.

    :ivar unwritten_pico: the holder's own usage in the cap's scope and
        window that no write has taken yet (pico-USD).
    :ivar keep: take a new share; ``False``: give up the one held (the row
        keeps only the usage not yet written).
    """

    limit_id: str
    scope_type: str
    scope_id: str
    window_start: float
    window_end: float
    unwritten_pico: int
    keep: bool = True


@dataclass(frozen=True)
class ShareTaken:
    """
    What the database said of one :class:`ShareAsked` (pico-USD).

    :ivar amount_pico: the cap now, or ``None`` when the limit is gone or has
        no amount (nothing was taken).
    :ivar spent_pico: the ledger's rows in the cap's scope and window.
    :ivar others_pico: what the other holders' live rows hold.
    :ivar unwritten_pico: the asker's usage in the scope and window not in
        the ledger when the transaction ran.
    :ivar share_pico: the share taken (0: none).
    """

    asked: ShareAsked
    amount_pico: int | None
    spent_pico: int
    others_pico: int
    unwritten_pico: int
    share_pico: int

    @property
    def free_pico(self) -> int:
        """What neither the ledger, the other holders nor the asker's unwritten rows take up (may be below 0)."""
        if self.amount_pico is None:
            return 0
        return self.amount_pico - self.spent_pico - self.others_pico - self.unwritten_pico

    @property
    def reached(self) -> bool:
        """Whether the ledger's rows and the asker's own unwritten ones reach the cap (others' rows aside)."""
        return self.amount_pico is not None and self.spent_pico + self.unwritten_pico >= self.amount_pico


def take_shares(
    database, holder: str, asked: list[ShareAsked], lease: float, writing: Sequence[tuple[str, Sequence[int]]] = ()
) -> list[ShareTaken]:
    """
    In one transaction, under a lock of each cap asked: for each, the cap,
    the ledger's spend and the other holders' live rows; then the share
    (:data:`SHARE_PART` of what is free) and this holder's row (its unwritten
    usage and the share, for ``lease`` seconds of the database's clock).
    Rows whose lease has ended are deleted on the way.

    :param writing: the asker's rows in a write handed to the ledger's
        thread before this: each one's request id and its cost in each cap
        asked (in ``asked``'s order). Those not in the ledger now count as
        unwritten.
    """
    limit = database.sql("SELECT amount_cents FROM relay_spend_limits WHERE id = ?")
    others = database.sql(
        "SELECT COALESCE(SUM(held_pico), 0) FROM relay_spend_shares "
        "WHERE limit_id = ? AND window_start = ? AND holder <> ? AND expires_at > ?"
    )
    expired = database.sql("DELETE FROM relay_spend_shares WHERE limit_id = ? AND expires_at <= ?")
    keep = database.sql(
        "INSERT INTO relay_spend_shares (limit_id, window_start, holder, held_pico, expires_at) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (limit_id, window_start, holder) DO UPDATE SET held_pico = excluded.held_pico, "
        "expires_at = excluded.expires_at"
    )
    drop = database.sql("DELETE FROM relay_spend_shares WHERE limit_id = ? AND window_start = ? AND holder = ?")

    def take(connection):
        cursor = connection.cursor()
        database.serialize(cursor, sorted({ask.limit_id for ask in asked}))
        now = database.clock(cursor)
        written = _in_ledger(database, cursor, [request_id for request_id, costs in writing if any(costs)])
        taken = []
        for index, ask in enumerate(asked):
            unwritten = ask.unwritten_pico + sum(costs[index] for request_id, costs in writing if request_id not in written)
            cursor.execute(expired, (ask.limit_id, now))
            cursor.execute(limit, (ask.limit_id,))
            found = cursor.fetchone()
            amount = None if found is None or found[0] is None else int(found[0]) * 10**10
            spent = _spent(database, cursor, ask)
            cursor.execute(others, (ask.limit_id, ask.window_start, holder, now))
            held_elsewhere = int(cursor.fetchone()[0])
            free = 0 if amount is None else amount - spent - held_elsewhere - unwritten
            share = -(-free // SHARE_PART) if ask.keep and free > 0 else 0
            held = unwritten + share
            if amount is not None and held > 0:
                cursor.execute(keep, (ask.limit_id, ask.window_start, holder, held, now + lease))
            else:
                cursor.execute(drop, (ask.limit_id, ask.window_start, holder))
            taken.append(ShareTaken(ask, amount, spent, held_elsewhere, unwritten, share))
        return taken

    return database.run(take)


def _in_ledger(database, cursor, request_ids: list[str]) -> set[str]:
    """Which of ``request_ids`` the ledger holds (a few hundred at a time)."""
    found: set[str] = set()
    for first in range(0, len(request_ids), _IDS_A_QUERY):
        chunk = request_ids[first:first + _IDS_A_QUERY]
        cursor.execute(
            database.sql("SELECT request_id FROM relay_usage WHERE request_id IN (%s)" % (", ".join("?" * len(chunk)),)), chunk
        )
        found.update(row[0] for row in cursor.fetchall())
    return found


def _spent(database, cursor, ask: ShareAsked) -> int:
    """The ledger's rows in the scope and window of ``ask`` (in two sums: SQLite's SUM fails past 64 bits)."""
    column = _SCOPE_COLUMNS.get(ask.scope_type)
    query = (
        "SELECT COALESCE(SUM(cost_pico_usd / 1000000), 0), COALESCE(SUM(cost_pico_usd - cost_pico_usd / 1000000 * 1000000), 0) "
        "FROM relay_usage WHERE at >= ? AND at < ?"
    )
    parameters: tuple = (ask.window_start, ask.window_end)
    if column is not None:
        query += " AND %s = ?" % (column,)
        parameters += (ask.scope_id,)
    cursor.execute(database.sql(query), parameters)
    micros, picos = cursor.fetchone()
    return int(micros) * 1_000_000 + int(picos)
