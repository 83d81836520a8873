# -*- test-case-name: tests.test_usage_page_browser -*-
"""
The relay's admin side: who may use it, and the usage page.

Admin routes (``/admin/...``) take an admin key (``--admin-keys``) in
``x-api-key``, ``Authorization: Bearer`` or, so that a person can open the
page in a browser, as the password of ``Authorization: Basic`` (the browser
asks for it). A relay key opens none of them; an admin key is refused on the
Messages routes (:mod:`twisted_relay.relayed_request`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from decimal import Decimal

from twisted_relay.errors import RelayError
from twisted_relay.ledger_sql import LedgerError
from twisted_relay.relay_keys import RelayKey, key_presented
from twisted_relay.usage_page import Cap, KeyUsage, render_usage_page

__all__ = ["NO_KEY_NAME", "admin_of", "usage_page"]

#: How the page names the requests made without a relay key (an open relay).
NO_KEY_NAME = "(no key)"
#: Days the page shows unless ``?days=`` says otherwise, and the most it shows.
_DAYS, _MOST_DAYS = 30, 366
_HTML = b"text/html; charset=utf-8"


def admin_of(context, request) -> RelayKey:
    """
    The admin key ``request`` presents, or a :class:`RelayError`: 404 when
    the relay has no admin key (its admin routes are off), 401 (asking a
    browser for it) when the request presents none of them.
    """
    if not context.admin_keys:
        raise RelayError(404, "The relay's admin routes are off: start it with --admin-keys.")
    admin = key_presented(context.admin_keys, request.requestHeaders, basic=True)
    if admin is None:
        request.setHeader(b"www-authenticate", b'Basic realm="twisted-relay admin", charset="UTF-8"')
        raise RelayError(401, "This route takes an admin key (--admin-keys).", should_retry=False)
    return admin


async def usage_page(context, request) -> bytes:
    """
    ``GET /admin/usage[?days=N]``: spend per relay key and per day over the
    last N days (UTC, today included) from the ledger, as HTML.
    """
    admin_of(context, request)
    ledger = context.ledger
    if ledger is None or not hasattr(ledger, "totals"):
        raise RelayError(404, "The relay keeps no usage ledger: start it with --usage-db.")
    days = _days_asked(request)
    today = datetime.now(timezone.utc).date()
    shown = [(today - timedelta(days=back)).isoformat() for back in range(days - 1, -1, -1)]
    since = datetime.fromisoformat(shown[0]).replace(tzinfo=timezone.utc).timestamp()
    # The rows this process still holds go first, so the page shows them.
    await ledger.flush()
    try:
        totals = await ledger.totals(["key", "group", "day"], since=since)
    except LedgerError as e:
        raise RelayError(503, "The usage ledger cannot be read now: %s." % (e,)) from None
    keys = [replace(key, cap=await _cap_of(context, key)) for key in _key_usage(totals, shown)]
    request.setHeader(b"content-type", _HTML)
    request.setHeader(b"cache-control", b"no-store")
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return render_usage_page(keys, shown, generated=generated)


async def _cap_of(context, key: KeyUsage) -> Cap | None:
    """The spend cap that binds ``key`` now (:mod:`twisted_relay.spend_guard`), for its bar."""
    if context.spend is None or key.name == NO_KEY_NAME:
        return None
    standing = await context.spend.standing(key.name, key.group)
    if standing is None:
        return None
    limit = standing.limit
    return Cap(Decimal(limit.amount) / 100, limit.period, standing.spent_cents / 100, limit.scope_type)


def _days_asked(request) -> int:
    values = request.args.get(b"days")
    if not values:
        return _DAYS
    try:
        days = int(values[0])
    except ValueError:
        days = 0
    if not 1 <= days <= _MOST_DAYS:
        raise RelayError(400, "days: a whole number from 1 to %d." % (_MOST_DAYS,))
    return days


def _key_usage(totals, days: list[str]) -> list[KeyUsage]:
    """The ledger's totals by key, group and day as the page's lines."""
    by_day: dict = defaultdict(dict)
    counts: dict = defaultdict(lambda: [0, 0, 0])
    groups: dict = {}
    shown = set(days)
    for total in totals:
        name = total.group["key"] or NO_KEY_NAME
        day = total.group["day"]
        groups[name] = total.group["group"]
        if day in shown:
            by_day[name][day] = by_day[name].get(day, Decimal(0)) + total.cost
        counts[name][0] += total.requests
        counts[name][1] += sum(count for kind, count in total.tokens.items() if kind.endswith("_tokens"))
        counts[name][2] += total.unpriced
    return [
        KeyUsage(name, groups[name], dict(by_day[name]), requests, tokens, unpriced)
        for name, (requests, tokens, unpriced) in counts.items()
    ]
