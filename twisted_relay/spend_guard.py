# -*- test-case-name: tests.test_spend_limits -*-
"""
Spend limits at work: the relay's cached view of the limits and of what
each scope spent (:class:`SpendGuard`), and the admin routes that set them
(``/v1/organizations/spend_limits``, on the shapes of Anthropic's Admin API).

The guard reads the limits and the spend of every key, group and the whole
relay in the current day, week and month from the ledger's database every
refresh interval (``--spend-refresh-interval``), and adds the usage this
process records after each read; a request is checked against that before
anything is sent upstream. So a relay never lets through more than its own
requests in flight past a cap, and several relays on one database at most
what the others spent in one refresh interval plus their requests in flight
(``docs/usage.md``, "Spend limits").

When the database cannot be read, the guard keeps the last limits and
totals it read, adds its own usage to them, and keeps relaying (fails open,
as the gateway protocol's default): a database outage must not stop every
request, and the ledger itself keeps the rows to write them later.
"""

from __future__ import annotations

import json
import time
from decimal import Decimal

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from twisted_relay.admin import admin_of, json_body_of
from twisted_relay.errors import RelayError
from twisted_relay.ledger_sql import LedgerError
from twisted_relay.spend_limits import (
    PERIODS,
    SpendLimit,
    Standing,
    binding,
    check_scope_type,
    limit_body,
    parse_set_body,
    window_end,
    window_start,
)
from twisted_relay.spend_limits_sql import all_limits, delete_limit, set_limit

__all__ = ["DEFAULT_REFRESH_INTERVAL", "SpendGuard", "delete_route", "effective_route", "list_route", "retrieve_route", "set_route"]

#: Seconds between two reads of the limits and the spend from the database.
DEFAULT_REFRESH_INTERVAL = 5.0
_HUNDRED = Decimal(100)


def _read_all(database, starts: dict[str, float]):
    """
    The limits, and for each period some limit caps the spend by key and
    group since its window's start (no query for a period no limit uses).
    """
    limits = all_limits(database)
    used = {limit.period for limit in limits if limit.amount is not None}
    spends = {period: database.totals(["key", "group"], since=start) for period, start in starts.items() if period in used}
    return limits, spends


def _scopes(key_name: str | None, key_group: str | None) -> list[tuple[str, str]]:
    """The scopes a request with that key counts in (as ``_spent`` keys them): its key's, its group's, the relay's."""
    scopes = [("organization", "")]
    if key_name is not None:
        scopes.append(("user", key_name))
    if key_group is not None:
        scopes.append(("workspace", key_group))
    return scopes


class SpendGuard:
    """
    The limits and the spend against them, as this relay knows them now.

    :param ledger: the :class:`~twisted_relay.ledger.Ledger`.
    :param refresh_interval: seconds between two reads of the database.
    """

    log = Logger()

    def __init__(self, ledger, *, reactor, refresh_interval: float = DEFAULT_REFRESH_INTERVAL, clock=time.time):
        self._ledger = ledger
        self._reactor = reactor
        self._interval = refresh_interval
        self._clock = clock
        self._limits: dict[str, SpendLimit] = {}
        # Whether some limit has an amount: usage is added up only then.
        self._capped = False
        # (period, window start) -> {(scope type, scope id): dollars}
        self._spent: dict[tuple[str, float], dict[tuple[str, str], Decimal]] = {}
        # The usage recorded since the last read, added up as _spent is (one
        # dict look-up a request, however many answers came since).
        self._recent: dict[tuple[str, float], dict[tuple[str, str], Decimal]] = {}
        # period -> (start, end) of the window the last recorded usage fell in.
        self._windows: dict[str, tuple[float, float]] = {}
        self._read_at: float | None = None
        self._reading: Deferred | None = None
        self._failing = False
        ledger.listeners.append(self._recorded)

    # -- what the request path asks

    def uncapped(self) -> bool:
        """
        Whether no cap applies to any request now: the limits were read and
        none has an amount. The request path then asks nothing more (and a
        refresh that is due starts here).
        """
        if self._read_at is None:
            return False
        if self._reactor.seconds() - self._read_at >= self._interval and self._reading is None:
            self._refresh()
        return not self._capped

    async def standing(self, key_name: str | None, key_group: str | None) -> Standing | None:
        """The cap that describes a request by that key now, or ``None`` for a key with no cap."""
        if self._read_at is None:
            # The first read: every request waits for it (one read for all).
            await self._read_done()
        elif self._reactor.seconds() - self._read_at >= self._interval and self._reading is None:
            self._refresh()
        now = self._clock()
        applying = [limit for limit in self._limits.values() if limit.amount is not None and limit.applies_to(key_name, key_group)]
        if not self._failing and any((limit.period, window_start(limit.period, now)) not in self._spent for limit in applying):
            # A cap whose period's spend was not read yet (just set, or a
            # new window): wait for a read rather than count from zero.
            await self._read_done()
            now = self._clock()
            applying = [
                limit for limit in self._limits.values() if limit.amount is not None and limit.applies_to(key_name, key_group)
            ]
        standings = [
            Standing(limit, self._spent_on(limit, now) * _HUNDRED, window_end(limit.period, now)) for limit in applying
        ]
        return binding(standings)

    async def _read_done(self) -> None:
        """Wait for the read under way, or a new one."""
        reading = self._reading if self._reading is not None else self._refresh()
        waiting: Deferred = Deferred()
        reading.addBoth(lambda result: waiting.callback(None) or result)
        await waiting

    async def report(self, key_name: str, key_group: str | None, periods) -> list[tuple[Standing, Decimal]]:
        """
        For each period in ``periods`` with a cap on that key: the cap that
        binds it in that period, and what the key itself spent in it (cents).
        """
        await self.standing(key_name, key_group)  # (reads the database first if never read)
        now = self._clock()
        rows = []
        for period in periods:
            standings = [
                Standing(limit, self._spent_on(limit, now) * _HUNDRED, window_end(period, now))
                for limit in self._limits.values()
                if limit.period == period and limit.amount is not None and limit.applies_to(key_name, key_group)
            ]
            chosen = binding(standings)
            if chosen is not None:
                own = SpendLimit("", "user", key_name, period, None, 0.0, 0.0)
                rows.append((chosen, self._spent_on(own, now) * _HUNDRED))
        return rows

    def know(self, limit: SpendLimit | None, *, forget: str | None = None) -> None:
        """A limit set (or deleted, ``forget``) here applies at once."""
        was_capped = self._capped
        limits = dict(self._limits)
        if forget is not None:
            limits.pop(forget, None)
        if limit is not None:
            limits[limit.id] = limit
        self._know_limits(limits.values())
        if self._capped and not was_capped:
            # Nothing was added up while no cap was set: the spend is read
            # again before this cap is enforced, what is not written yet counted.
            self._spent = {}
            self._recount()

    def _spent_on(self, limit: SpendLimit, now: float) -> Decimal:
        start = window_start(limit.period, now)
        scope = (limit.scope_type, limit.scope_id)
        window = (limit.period, start)
        return self._spent.get(window, {}).get(scope, Decimal(0)) + self._recent.get(window, {}).get(scope, Decimal(0))

    def _recorded(self, record) -> None:
        if self._capped and record.cost is not None:
            self._add_recent(record.at, record.key_name, record.key_group, record.cost)

    def _add_recent(self, at: float, key_name: str | None, key_group: str | None, cost: Decimal) -> None:
        windows = self._windows
        for period in PERIODS:
            window = windows.get(period)
            if window is None or not window[0] <= at < window[1]:
                window = windows[period] = (window_start(period, at), window_end(period, at))
            sums = self._recent.setdefault((period, window[0]), {})
            for scope in _scopes(key_name, key_group):
                sums[scope] = sums.get(scope, Decimal(0)) + cost

    def _know_limits(self, limits) -> None:
        self._limits = {limit.id: limit for limit in limits}
        self._capped = any(limit.amount is not None for limit in self._limits.values())

    def _recount(self) -> None:
        """What the last read did not see: the rows this process has not written yet."""
        self._recent = {}
        for record in self._ledger.unwritten():
            self._recorded(record)

    # -- reading the database

    def _refresh(self) -> Deferred:
        now = self._clock()
        starts = {period: window_start(period, now) for period in PERIODS}
        d = self._reading = self._ledger.on_database(_read_all, starts)
        d.addCallbacks(self._read, self._not_read, callbackArgs=(starts,))
        return d

    def _read(self, found, starts) -> None:
        limits, spends = found
        self._reading = None
        self._read_at = self._reactor.seconds()
        self._know_limits(limits)
        spent = {}
        for period, totals in spends.items():
            scopes: dict[tuple[str, str], Decimal] = {}
            for line in totals:
                name, group = line.group["key"], line.group["group"]
                for scope in _scopes(name, group):
                    scopes[scope] = scopes.get(scope, Decimal(0)) + line.cost
            spent[(period, starts[period])] = scopes
        self._spent = spent
        self._recount()
        if self._failing:
            self._failing = False
            self.log.info("Spend limits read again from the usage ledger")

    def _not_read(self, failure) -> None:
        self._reading = None
        self._read_at = self._reactor.seconds()
        if not self._failing:
            self._failing = True
            self.log.warn(
                "Cannot read the spend limits and spend ({error}): relaying with the last known totals "
                "plus this relay's own usage (caps fail open)",
                error=failure.getErrorMessage() if failure.check(LedgerError) else repr(failure.value),
            )


# -- the admin routes ------------------------------------------------------------


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
