"""
The usage ledger's rows as its table stores them: a :class:`~twisted_relay.usage.UsageRecord`
as the table's columns, and a batch of them as the one JSON text a batch is
written with (:mod:`twisted_relay.ledger_sql`). Pure: no database, no Twisted.
"""

from __future__ import annotations

import time
from decimal import ROUND_HALF_EVEN, Decimal
from functools import lru_cache
from typing import Sequence

import ujson

from twisted_relay.usage import TOKEN_KINDS, UsageRecord, storable_text

__all__ = ["batch_of", "day_named", "day_of", "dollars_of", "picos_of", "row_of"]

_PICO = Decimal("1e-12")
_MOST_PICOS = 2**63 - 1


def day_of(at: float) -> str:
    """The UTC day of a Unix time, ``YYYY-MM-DD``."""
    # Unix time has no leap seconds: a UTC day is 86,400 of them.
    return day_named(int(at // 86400))


@lru_cache(maxsize=4)
def day_named(number: int) -> str:
    """The UTC day of a day's number since the epoch, ``YYYY-MM-DD``."""
    return time.strftime("%Y-%m-%d", time.gmtime(number * 86400))


def picos_of(cost: Decimal | None) -> int | None:
    """A cost in US dollars as the column stores it: whole picodollars (``None``: no price)."""
    if cost is None:
        return None
    # Past the 64-bit column only from absurd counts (many iterations of 2**32
    # tokens): stored as the most it holds, never a batch the database refuses.
    return min(int(cost.scaleb(12).to_integral_value(ROUND_HALF_EVEN)), _MOST_PICOS)


def dollars_of(picos) -> Decimal:
    """Picodollars as US dollars."""
    return (Decimal(int(picos or 0)) * _PICO).normalize() if picos else Decimal(0)


def batch_of(records: Sequence[UsageRecord]) -> str:
    """``records`` as the table's rows, in the one JSON text :meth:`LedgerDatabase.write_batch` takes."""
    return ujson.dumps([row_of(record) for record in records])


def row_of(record: UsageRecord) -> tuple:
    """A record as the table's columns, in order."""
    # Text as it came (a client's headers, an upstream's answer): one NUL in
    # it would have PostgreSQL refuse the batch, again and again.
    return (
        record.request_id,  # the relay's own
        float(record.at),
        day_of(record.at),
        storable_text(record.key_name),
        storable_text(record.key_group),
        storable_text(record.session_id),
        storable_text(record.agent_id),
        storable_text(record.parent_agent_id),
        storable_text(record.upstream),
        storable_text(record.platform),
        storable_text(record.model),
        int(record.status),
        int(bool(record.stream)),
        int(bool(record.partial)),
        *[record.tokens.get(kind, 0) for kind in TOKEN_KINDS],
        picos_of(record.cost),
        record.usage or "",
    )
