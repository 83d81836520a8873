# -*- test-case-name: tests.test_spend_limits -*-
"""
Spend limits in the ledger's database (:mod:`twisted_relay.ledger_sql`):
the ``relay_spend_limits`` table (made with the ledger's tables, since schema 2),
and its reads and writes. One row per (scope type, scope, period): setting
a limit again changes it. Every call blocks and runs on the ledger's
thread (:meth:`twisted_relay.ledger.Ledger.on_database`). No Twisted here.
"""

from __future__ import annotations

import time

from twisted_relay.spend_limits import SpendLimit, new_limit_id

__all__ = ["SCHEMA", "all_limits", "delete_limit", "set_limit"]

#: The table's statements, run with the ledger's schema.
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS relay_spend_limits ("
    "id TEXT PRIMARY KEY, scope_type TEXT NOT NULL, scope_id TEXT NOT NULL, period TEXT NOT NULL, "
    "amount_cents BIGINT, created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL, "
    "UNIQUE (scope_type, scope_id, period))",
)
_COLUMNS = "id, scope_type, scope_id, period, amount_cents, created_at, updated_at"


def _limit(row) -> SpendLimit:
    return SpendLimit(row[0], row[1], row[2], row[3], None if row[4] is None else int(row[4]), float(row[5]), float(row[6]))


def all_limits(database) -> list[SpendLimit]:
    """Every limit, oldest first."""

    def select(connection):
        cursor = connection.cursor()
        cursor.execute("SELECT %s FROM relay_spend_limits ORDER BY created_at, id" % (_COLUMNS,))
        return cursor.fetchall()

    return [_limit(row) for row in database.run(select)]


def set_limit(database, scope_type: str, scope_id: str, period: str, amount: int | None) -> SpendLimit:
    """Set the limit of a scope and period (made, or changed in place: its id stays); return it."""
    now = time.time()
    upsert = database.sql(
        "INSERT INTO relay_spend_limits (%s) VALUES (?, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (scope_type, scope_id, period) DO UPDATE SET amount_cents = excluded.amount_cents, "
        "updated_at = excluded.updated_at" % (_COLUMNS,)
    )
    select = database.sql(
        "SELECT %s FROM relay_spend_limits WHERE scope_type = ? AND scope_id = ? AND period = ?" % (_COLUMNS,)
    )

    def write(connection):
        cursor = connection.cursor()
        cursor.execute(upsert, (new_limit_id(), scope_type, scope_id, period, amount, now, now))
        cursor.execute(select, (scope_type, scope_id, period))
        return cursor.fetchone()

    return _limit(database.run(write))


def delete_limit(database, limit_id: str) -> bool:
    """Delete a limit; whether there was one by that id."""
    delete = database.sql("DELETE FROM relay_spend_limits WHERE id = ?")

    def remove(connection):
        cursor = connection.cursor()
        cursor.execute(delete, (limit_id,))
        return cursor.rowcount > 0

    return database.run(remove)
