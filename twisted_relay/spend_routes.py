# -*- test-case-name: tests.test_spend_limits -*-
"""
The spend limits' admin routes (``/v1/organizations/spend_limits``, on the
shapes of Anthropic's Admin API): set, list, read and delete limits, and the
cap that binds each relay key. They take an admin key
(:func:`twisted_relay.admin.admin_of`; a write takes it in a header and a
JSON body only), keep the limits in the ledger's database
(:mod:`twisted_relay.spend_limits_sql`) and tell this relay's
:class:`~twisted_relay.spend_guard.SpendGuard` at once.
"""

from __future__ import annotations

import json
from decimal import Decimal

from twisted_relay.admin import admin_of, json_body_of
from twisted_relay.errors import RelayError
from twisted_relay.spend_guard import SpendGuard
from twisted_relay.spend_limits import PERIODS, SpendLimit, check_scope_type, limit_body, parse_set_body
from twisted_relay.spend_limits_sql import all_limits, delete_limit, set_limit

__all__ = ["delete_route", "effective_route", "list_route", "retrieve_route", "set_route"]


def _guard_of(context) -> SpendGuard:
    guard = getattr(context, "spend", None)
    if guard is None:
        raise RelayError(404, "The relay keeps no spend limits: start it with --usage-db.")
    return guard


def _answer(request, value: dict) -> bytes:
    request.setHeader(b"content-type", b"application/json")
    return json.dumps(value).encode("utf-8")


async def set_route(context, request) -> bytes:
    """``POST /v1/organizations/spend_limits``: set the limit of a scope and period."""
    admin_of(context, request, write=True)
    guard = _guard_of(context)
    body = json_body_of(request)
    scope_type, scope_id, period, amount = parse_set_body(body)
    limit = await context.ledger.on_database(set_limit, scope_type, scope_id, period, amount)
    guard.know(limit)
    return _answer(request, limit_body(limit))


async def list_route(context, request) -> bytes:
    """``GET /v1/organizations/spend_limits``: the limits, a page at a time (cursor: the last id)."""
    admin_of(context, request)
    _guard_of(context)
    args = request.args
    types = [t.decode("utf-8", "replace") for t in args.get(b"scope_type", []) + args.get(b"scope_type[]", [])]
    for scope_type in types:
        check_scope_type(scope_type)
    workspace = (args.get(b"workspace_id") or [None])[0]
    size = _page_size(args)
    after = (args.get(b"page") or [b""])[0].decode("utf-8", "replace")
    limits = await context.ledger.on_database(all_limits)
    chosen = [
        limit for limit in limits
        if (not types or limit.scope_type in types)
        and (workspace is None or (limit.scope_type == "workspace" and limit.scope_id == workspace.decode("utf-8", "replace")))
    ]
    if after:
        ids = [limit.id for limit in chosen]
        chosen = chosen[ids.index(after) + 1:] if after in ids else []
    page = chosen[:size]
    more = len(chosen) > size
    return _answer(request, {"data": [limit_body(limit) for limit in page], "next_page": page[-1].id if more else None})


async def effective_route(context, request) -> bytes:
    """
    ``GET /v1/organizations/spend_limits/effective``: for each relay key
    (member) and period, the cap that binds it and what it spent, a page
    of keys at a time (cursor: the last key's name).
    """
    admin_of(context, request)
    guard = _guard_of(context)
    args = request.args
    periods = [p.decode("utf-8", "replace") for p in args.get(b"period", []) + args.get(b"period[]", [])] or list(PERIODS)
    if any(period not in PERIODS for period in periods):
        raise RelayError(400, "period: each one of %s." % (", ".join(PERIODS),))
    wanted = {u.decode("utf-8", "replace") for u in args.get(b"user_ids", []) + args.get(b"user_ids[]", [])}
    size = _page_size(args)
    after = (args.get(b"page") or [b""])[0].decode("utf-8", "replace")
    members = {}
    for _, key in context.relay_keys:
        if (not wanted or key.name in wanted) and key.name > after:
            members.setdefault(key.name, key.group)
    names = sorted(members)
    page, more = names[:size], len(names) > size
    data = []
    for name in page:
        for standing, spent in await guard.report(name, members[name], periods):
            limit = standing.limit
            data.append({
                "actor": {"type": "user_actor", "user_id": name, "name": name, "email_address": None, "deleted": False},
                "scope": {"type": "user", "user_id": name},
                "source": limit_body(limit)["scope"],
                "spend_limit_id": limit.id,
                "period": limit.period,
                "amount": str(limit.amount),
                "currency": "USD",
                "period_to_date_spend": _cents(spent),
            })
    return _answer(request, {"data": data, "next_page": page[-1] if more else None})


def _page_size(args) -> int:
    try:
        size = int((args.get(b"limit") or [b"20"])[0])
    except ValueError:
        size = 0
    if not 1 <= size <= 1000:
        raise RelayError(400, "limit: a whole number from 1 to 1000.")
    return size


def _cents(value: Decimal) -> str:
    """Cents with up to three decimals, as the API writes spend."""
    text = format(value.quantize(Decimal("0.001")), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


async def _find(context, limit_id: str) -> SpendLimit:
    for limit in await context.ledger.on_database(all_limits):
        if limit.id == limit_id:
            return limit
    raise RelayError(404, "No spend limit has the id %r." % (limit_id[:80],))


async def retrieve_route(context, request, limit_id: str) -> bytes:
    """``GET /v1/organizations/spend_limits/{id}``."""
    admin_of(context, request)
    _guard_of(context)
    return _answer(request, limit_body(await _find(context, limit_id)))


async def delete_route(context, request, limit_id: str) -> bytes:
    """``DELETE /v1/organizations/spend_limits/{id}``: the cap no longer applies."""
    admin_of(context, request, write=True)
    guard = _guard_of(context)
    if not await context.ledger.on_database(delete_limit, limit_id):
        raise RelayError(404, "No spend limit has the id %r." % (limit_id[:80],))
    guard.know(None, forget=limit_id)
    return _answer(request, {"id": limit_id, "type": "spend_limit_deleted"})
