# -*- test-case-name: tests.test_signin_usage_api -*-
"""
``GET /api/oauth/usage``: what Claude Code's ``/usage`` and status line
show a signed-in person (or a relay key's holder) of their spend and caps,
in the shape the first-party gateway answers (Claude Code 2.1.332's
bundle, functions ``A_`` and ``T_``).

With a cap on them (:meth:`~twisted_relay.spend_guard.SpendGuard.report`:
the cap that binds them in each period), ``limits`` has a row a period,
``{"kind": "spend", "group": <period>, "percent", "resets_at", "severity",
"is_active"}``, and ``extra_usage`` describes the cap that binds them
overall (the one the ``anthropic-ratelimit-unified-*`` headers of their
answers describe, :func:`~twisted_relay.spend_limits.binding`): its amount
(``monthly_limit``, whatever its period, as the first-party gateway
names it), the spend against it (``used_credits``), both in cents, and
``utilization`` in percent. ``percent`` and ``utilization`` are the
headers' ``overage-utilization`` times 100 (so below 100 until the cap
refuses, then 100); ``resets_at`` is the headers' ``overage-reset``, in
ISO 8601 (``2027-01-01T00:00:00.000Z``); ``severity`` is ``critical`` past
95 % (or at the cap), ``warning`` past 75 %, else ``normal``.

Without a cap, ``limits`` is empty and ``extra_usage`` has no limit and
no utilization, and their own spend this month, with ``daily`` and
``weekly`` objects for today's and this week's (UTC), read from the
usage ledger.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from decimal import Decimal

from twisted_relay._json import to_json
from twisted_relay.errors import RelayError
from twisted_relay.ledger_sql import LedgerError
from twisted_relay.spend_limits import PERIODS, Standing, binding, window_start

__all__ = ["capped_usage", "uncapped_usage", "usage_route"]


def _percent(standing: Standing) -> int:
    # JavaScript's Math.round, as the first-party gateway rounds.
    return math.floor(standing.shown_utilization() * 100 + 0.5)


def _severity(standing: Standing) -> str:
    if standing.exceeded or standing.utilization > 0.95:
        return "critical"
    return "warning" if standing.utilization > 0.75 else "normal"


def _iso(at: float) -> str:
    return datetime.fromtimestamp(int(at), timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def capped_usage(standings: list[Standing]) -> dict:
    """The answer for someone with caps: ``standings``, the cap that binds them in each period."""
    chosen = binding(standings)
    return {
        "extra_usage": {
            "is_enabled": True,
            "monthly_limit": chosen.limit.amount,
            "used_credits": math.floor(chosen.spent_cents),
            "utilization": _percent(chosen),
            "currency": "USD",
        },
        "limits": [
            {
                "kind": "spend",
                "group": standing.limit.period,
                "percent": _percent(standing),
                "resets_at": _iso(standing.resets_at),
                "severity": _severity(standing),
                "is_active": standing is chosen,
            }
            for standing in standings
        ],
    }


def uncapped_usage(spent_cents: dict[str, Decimal]) -> dict:
    """The answer for someone with no cap, from their own spend in each period (cents)."""

    def cents(period: str) -> int:
        return math.floor(spent_cents.get(period, Decimal(0)))

    return {
        "extra_usage": {
            "is_enabled": True,
            "monthly_limit": None,
            "used_credits": cents("monthly"),
            "utilization": None,
            "currency": "USD",
            "daily": {"limit": None, "used_credits": cents("daily"), "utilization": None},
            "weekly": {"limit": None, "used_credits": cents("weekly"), "utilization": None},
        },
        "limits": [],
    }


async def _own_spend(ledger, name: str, now: float) -> dict[str, Decimal]:
    """What the user ``name`` spent in the day, week and month holding ``now`` (cents), from the ledger's days."""
    starts = {period: window_start(period, now) for period in PERIODS}
    await ledger.flush()
    totals = await ledger.totals(["day"], since=min(starts.values()), key_name=name)
    spent = {period: Decimal(0) for period in PERIODS}
    for line in totals:
        day = datetime.fromisoformat(line.group["day"]).replace(tzinfo=timezone.utc).timestamp()
        for period, start in starts.items():
            if day >= start:
                spent[period] += line.cost * 100
    return spent


async def usage_route(context, request, who) -> bytes:
    """
    ``GET /api/oauth/usage`` for ``who`` (a signed-in person or a relay
    key: metered and capped as its ``name`` and ``group``).
    """
    ledger = context.ledger
    if ledger is None or not hasattr(ledger, "totals"):
        raise RelayError(404, "The relay keeps no usage ledger: start it with --usage-db.")
    if context.batch is not None:
        # The answers metered a moment ago count.
        context.batch.run()
    standings = []
    if context.spend is not None:
        standings = [standing for standing, _ in await context.spend.report(who.name, who.group, PERIODS)]
    if standings:
        answer = capped_usage(standings)
    else:
        now = datetime.now(timezone.utc).timestamp()
        try:
            answer = uncapped_usage(await _own_spend(ledger, who.name, now))
        except LedgerError as e:
            raise RelayError(503, "The usage ledger cannot be read now: %s." % (e,)) from None
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"cache-control", b"no-store")
    return to_json(answer)
