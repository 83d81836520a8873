# -*- test-case-name: tests.test_usage_page_browser -*-
"""
The relay's admin side: who may use it, and the usage page.

Admin routes (``/admin/...`` and the spend limits') take an admin key
(``--admin-keys``) in ``x-api-key`` or ``Authorization: Bearer``; a route
that only reads takes it as the password of ``Authorization: Basic`` too, so
that a person can open the page in a browser (which asks for it). A write
(setting or deleting a limit) takes no Basic credentials and only a JSON
body: a browser keeps Basic credentials and sends them with any request to
the relay, a cross-site form post included, and such a form can send
neither a header of its own nor ``content-type: application/json``. A
request whose ``Origin`` is not the relay's own (a browser sends it with a
cross-site request) opens no admin route. A relay key opens none of them; an
admin key is refused on the Messages routes (:mod:`twisted_relay.relayed_request`).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from decimal import Decimal

from twisted_relay.errors import RelayError
from twisted_relay.ledger_sql import LedgerError
from twisted_relay.relay_keys import RelayKey, key_presented
from twisted_relay.usage_page import Cap, KeyUsage, render_usage_page

__all__ = ["NO_KEY_NAME", "admin_of", "json_body_of", "usage_page"]

#: How the page names the requests made without a relay key (an open relay).
NO_KEY_NAME = "(no key)"
#: Days the page shows unless ``?days=`` says otherwise, and the most it shows.
_DAYS, _MOST_DAYS = 30, 366
_HTML = b"text/html; charset=utf-8"
_JSON = b"application/json"


def admin_of(context, request, *, write: bool = False) -> RelayKey:
    """
    The admin key ``request`` presents, or a :class:`RelayError`: 404 when
    the relay has no admin key (its admin routes are off), 403 when the
    request comes from another site (:func:`_check_origin`), 401 when it
    presents no admin key (asking a browser for one, unless ``write``: a
    write takes the key in ``x-api-key`` or ``Authorization: Bearer`` only).
    """
    if not context.admin_keys:
        raise RelayError(404, "The relay's admin routes are off: start it with --admin-keys.")
    _check_origin(request)
    admin = key_presented(context.admin_keys, request.requestHeaders, basic=not write)
    if admin is None:
        if write:
            request.setHeader(b"www-authenticate", b'Bearer realm="twisted-relay admin"')
            raise RelayError(
                401,
                "This route changes the relay: it takes an admin key (--admin-keys) in x-api-key or "
                "Authorization: Bearer, not as a browser's Basic password.",
                should_retry=False,
            )
        request.setHeader(b"www-authenticate", b'Basic realm="twisted-relay admin", charset="UTF-8"')
        raise RelayError(401, "This route takes an admin key (--admin-keys).", should_retry=False)
    return admin


def _check_origin(request) -> None:
    """
    A 403 for a request whose ``Origin`` is not the relay's own (the
    connection's scheme and the ``Host`` it was asked as): a page of another
    site. A browser sends ``Origin`` with such requests; the SDKs, curl and a
    browser opening the page send none.
    """
    origins = request.requestHeaders.getRawHeaders(b"origin")
    if not origins:
        return
    own = (b"https://" if request.isSecure() else b"http://") + (request.getHeader(b"host") or b"").strip().lower()
    if any(origin.strip().lower() != own for origin in origins):
        raise RelayError(
            403, "The relay's admin routes take no request from another site's page (its Origin is not the relay's).",
            should_retry=False,
        )


def json_body_of(request) -> object:
    """
    The JSON body of an admin write, or a :class:`RelayError`: 415 unless
    it says ``content-type: application/json`` (which a cross-site form
    cannot send), 400 when it is not JSON.
    """
    content_type = (request.getHeader(b"content-type") or b"").partition(b";")[0].strip().lower()
    if content_type != _JSON:
        raise RelayError(415, "This route takes a JSON body: content-type: application/json.", should_retry=False)
    try:
        return json.loads(request.content.read() or b"null")
    except (ValueError, RecursionError):  # (nested past the parser's depth)
        raise RelayError(400, "The body is not valid JSON.") from None


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
