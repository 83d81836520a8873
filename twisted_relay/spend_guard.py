# -*- test-case-name: tests.test_spend_limits -*-
"""
Spend limits at work: the relay's view of the limits and of what each scope
spent (:class:`SpendGuard`), and its shares of the caps. The admin routes
that set the limits are :mod:`twisted_relay.spend_routes`.

The guard reads the limits and the spend of every key, group and the whole
relay in the current day, week and month from the ledger's database every
refresh interval (``--spend-refresh-interval``; on a timer while it runs as
a service, and on the request that finds the last read too old otherwise),
and adds the usage this process records after each read: the headers an
answer carries, and a refusal once that view reaches a cap.

What lets a request through is a **share** of each cap that applies to it
(:mod:`twisted_relay.spend_shares_sql`): a part of what the ledger's rows,
the other relays' shares and this relay's rows not written yet leave free,
taken in the database under a lock of the cap. While this process's own
usage since it took a share stays below it, requests pass with no database
work; one that finds the share used up (or its lease over) waits for a new
one, and is refused when the cap is reached. So every relay together lets
through at most the cap plus the requests each one had in flight when its
own usage passed its share (``docs/usage.md``, "Several relays, and the
overshoot bound"), however busy they are. A share is a quarter of what is
free: far from a cap, one is taken every so many requests, ahead of need;
near it, one a request. Every refresh interval each share is taken again
(used since the last one) or given back (not used), so an idle relay holds
nothing and its own rows count once written.

When the database cannot be used, the guard keeps the last limits and
totals it read, adds its own usage to them, and keeps relaying (fails open,
as the gateway protocol's default): a database outage must not stop every
request, and the ledger itself keeps the rows to write them later.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from decimal import Decimal

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import Logger

from twisted_relay.ledger_sql import LedgerError
from twisted_relay.spend_limits import PERIODS, SpendLimit, Standing, binding, window_end, window_start
from twisted_relay.spend_limits_sql import all_limits
from twisted_relay.spend_shares_sql import ShareAsked, take_shares

__all__ = ["DEFAULT_REFRESH_INTERVAL", "LEASE_INTERVALS", "SpendGuard"]

#: Seconds between two reads of the limits and the spend from the database.
DEFAULT_REFRESH_INTERVAL = 5.0
#: A share's lease, in refresh intervals (and at least :data:`_SHORTEST_LEASE`
#: seconds): a relay renews the shares it uses every interval; a relay gone
#: holds its rows for this long.
LEASE_INTERVALS = 3
_SHORTEST_LEASE = 10.0
#: How many times a request waits (a tenth of a refresh interval each: a
#: refresh interval and a half in all) for the other relays' rows of shares
#: to free what they hold, before it is refused: a relay gives back its
#: shares unused within an interval, and its usage written since its last
#: share counts twice until its next one.
_WAITS = 15
#: How many shares a request takes at most besides its waits (each used up
#: by the requests in flight before it came back) before it is refused.
_MOST_TAKES = 8
#: Caps a renewal's transaction takes shares of at most.
_CAPS_A_TAKE = 32
_HUNDRED = Decimal(100)
_PICOS = Decimal(10) ** 12


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


@dataclass
class _Share:
    """
    This relay's share of one cap in one window: it may let requests
    through while its own usage there stays below ``base + size`` (dollars),
    until ``valid_until`` (reactor seconds).

    :ivar mark: its own usage at the last renewal, and ``admitted`` the
        requests let through on it since: renewed again only if either moved.
    """

    base: Decimal
    size: Decimal
    valid_until: float
    mark: Decimal
    admitted: int = 0


class SpendGuard(Service):
    """
    The limits and the spend against them, as this relay knows them now,
    and its shares of the caps. Started as a service, it reads the database
    and renews its shares every refresh interval.

    :param ledger: the :class:`~twisted_relay.ledger.Ledger`.
    :param refresh_interval: seconds between two reads of the database.
    :ivar holder: this process's name in the shares' table.
    :ivar takes: the share transactions it made (taking and giving back).
    """

    log = Logger()

    def __init__(self, ledger, *, reactor, refresh_interval: float = DEFAULT_REFRESH_INTERVAL, clock=time.time):
        self._ledger = ledger
        self._reactor = reactor
        self._interval = refresh_interval
        self._lease = max(LEASE_INTERVALS * refresh_interval, _SHORTEST_LEASE)
        self._clock = clock
        self._limits: dict[str, SpendLimit] = {}
        # Whether some limit has an amount: usage is added up only then.
        self._capped = False
        # (period, window start) -> {(scope type, scope id): dollars}
        self._spent: dict[tuple[str, float], dict[tuple[str, str], Decimal]] = {}
        # The usage recorded since the last read, added up as _spent is (one
        # dict look-up a request, however many answers came since).
        self._recent: dict[tuple[str, float], dict[tuple[str, str], Decimal]] = {}
        # This process's usage since it began adding up, kept the same way
        # and never read again: what its shares are measured against.
        self._own: dict[tuple[str, float], dict[tuple[str, str], Decimal]] = {}
        # period -> (start, end) of the window the last recorded usage fell
        # in; and of the window the last request fell in.
        self._windows: dict[str, tuple[float, float]] = {}
        self._now_windows: dict[str, tuple[float, float]] = {}
        self._read_at: float | None = None
        self._reading: Deferred | None = None
        self._failing = False
        self.holder = "relay-" + secrets.token_hex(8)
        # (limit id, window start) -> this relay's share; the shares being
        # taken; the caps found reached since the last read (spend found, cents).
        self._shares: dict[tuple[str, float], _Share] = {}
        self._taking: dict[tuple[str, float], Deferred] = {}
        self._reached: dict[tuple[str, float], Decimal] = {}
        self._timer: LoopingCall | None = None
        self.takes = 0
        ledger.listeners.append(self._recorded)

    # -- the service

    def startService(self) -> None:
        """Read the database now, then every refresh interval (and renew or give back the shares held)."""
        Service.startService(self)
        self._timer = LoopingCall(self._tick)
        self._timer.clock = self._reactor
        self._timer.start(self._interval, now=True).addErrback(
            lambda failure: self.log.failure("The spend limits' timer stopped", failure)
        )

    def stopService(self) -> None:
        Service.stopService(self)
        if self._timer is not None and self._timer.running:
            self._timer.stop()
        self._timer = None

    def _tick(self) -> None:
        if self._reading is None:
            self._refresh()
        if not self._failing:
            self._renew()

    def _due(self) -> bool:
        """Not started as a service: whether a read is due (the request that finds it so starts one)."""
        return self._timer is None and self._reading is None and self._reactor.seconds() - self._read_at >= self._interval

    # -- what the request path asks

    def uncapped(self) -> bool:
        """
        Whether no cap applies to any request now: the limits were read and
        none has an amount. The request path then asks nothing more.
        """
        if self._read_at is None:
            return False
        if self._due():
            self._refresh()
        return not self._capped

    async def standing(self, key_name: str | None, key_group: str | None) -> Standing | None:
        """The cap that describes a request by that key now, or ``None`` for a key with no cap (no share taken)."""
        applying, now = await self._applying(key_name, key_group)
        return binding([self._standing_of(limit, now) for limit in applying])

    async def admit(self, key_name: str | None, key_group: str | None) -> Standing | None:
        """
        :meth:`standing`, once this relay holds a share of every cap that
        applies (taken now if it holds none, or none left): an exceeded one
        (the request is refused) when a cap is reached, or when the other
        relays' shares still hold what is left after :data:`_WAITS` waits.
        """
        applying, now = await self._applying(key_name, key_group)
        waits = 0
        for _ in range(_MOST_TAKES + _WAITS):
            standing = binding([self._standing_of(limit, now) for limit in applying])
            if standing is None or standing.exceeded or self._failing:
                return standing
            at = self._reactor.seconds()
            caps = [(limit, self._window(limit.period, now)[0]) for limit in applying]
            rooms = [self._room(limit, start, at) for limit, start in caps]
            short = [cap for cap, room in zip(caps, rooms) if room <= 0]
            if not short:
                for limit, start in caps:
                    self._shares[(limit.id, start)].admitted += 1
                self._renew_ahead(caps, rooms)
                return standing
            await self._take(short)
            now = self._clock()
            if self._failing:
                continue  # (the database cannot be used: judged on what was read, above)
            held = [(limit, start) for limit, start in short if (limit.id, start) not in self._shares and (limit.id, start) not in self._reached]
            if held and waits < _WAITS:
                # What is free is held by other relays' shares: each renews
                # or gives back its shares every refresh interval.
                waits += 1
                await deferLater(self._reactor, self._interval / 10, lambda: None)
                now = self._clock()
            elif held:
                for limit, start in held:
                    # The relays' shares together hold the rest of the cap.
                    self._reached[(limit.id, start)] = Decimal(limit.amount)
        # Shares taken again and again, each used up by the requests in
        # flight before it came back: the cap is spent as fast as it is shared.
        for limit, start in short:
            self._reached.setdefault((limit.id, start), Decimal(limit.amount))
        return binding([self._standing_of(limit, now) for limit in applying])

    async def _applying(self, key_name: str | None, key_group: str | None) -> tuple[list[SpendLimit], float]:
        """The limits with an amount that apply to that key, and the time they were found by; read first if need be."""
        if self._read_at is None:
            # The first read: every request waits for it (one read for all).
            await self._read_done()
        elif self._due():
            self._refresh()
        now = self._clock()
        applying = [limit for limit in self._limits.values() if limit.amount is not None and limit.applies_to(key_name, key_group)]
        if not self._failing and any((limit.period, self._window(limit.period, now)[0]) not in self._spent for limit in applying):
            # A cap whose period's spend was not read yet (just set, or a
            # new window): wait for a read rather than count from zero.
            await self._read_done()
            now = self._clock()
            applying = [
                limit for limit in self._limits.values() if limit.amount is not None and limit.applies_to(key_name, key_group)
            ]
        return applying, now

    def _window(self, period: str, now: float) -> tuple[float, float]:
        """The start and end of the window of ``period`` holding ``now`` (kept: it changes once a day at most)."""
        window = self._now_windows.get(period)
        if window is None or not window[0] <= now < window[1]:
            window = self._now_windows[period] = (window_start(period, now), window_end(period, now))
        return window

    def _standing_of(self, limit: SpendLimit, now: float) -> Standing:
        start, end = self._window(limit.period, now)
        spent = self._spent_on(limit, start) * _HUNDRED
        reached = self._reached.get((limit.id, start))
        if reached is not None and reached > spent:
            spent = reached
        return Standing(limit, spent, end)

    async def _read_done(self) -> None:
        """Wait for the read under way, or a new one."""
        await _fired(self._reading if self._reading is not None else self._refresh())

    async def report(self, key_name: str, key_group: str | None, periods) -> list[tuple[Standing, Decimal]]:
        """
        For each period in ``periods`` with a cap on that key: the cap that
        binds it in that period, and what the key itself spent in it (cents).
        """
        await self.standing(key_name, key_group)  # (reads the database first if never read)
        now = self._clock()
        rows = []
        for period in periods:
            start, end = self._window(period, now)
            standings = [
                Standing(limit, self._spent_on(limit, start) * _HUNDRED, end)
                for limit in self._limits.values()
                if limit.period == period and limit.amount is not None and limit.applies_to(key_name, key_group)
            ]
            chosen = binding(standings)
            if chosen is not None:
                own = SpendLimit("", "user", key_name, period, None, 0.0, 0.0)
                rows.append((chosen, self._spent_on(own, start) * _HUNDRED))
        return rows

    def know(self, limit: SpendLimit | None, *, forget: str | None = None) -> None:
        """A limit set (or deleted, ``forget``) here applies at once (this relay's share of it taken again)."""
        was_capped = self._capped
        limits = dict(self._limits)
        if forget is not None:
            limits.pop(forget, None)
        if limit is not None:
            limits[limit.id] = limit
        self._know_limits(limits.values())
        changed = {forget, limit.id if limit is not None else None}
        self._forget_shares(lambda limit_id: limit_id in changed)
        if self._capped and not was_capped:
            # Nothing was added up while no cap was set: the spend is read
            # again before this cap is enforced, what is not written yet counted.
            self._spent = {}
            self._recount()

    def _spent_on(self, limit: SpendLimit, start: float) -> Decimal:
        """What the scope of ``limit`` spent in the window from ``start``: the last read, and this relay's usage since."""
        scope = (limit.scope_type, limit.scope_id)
        window = (limit.period, start)
        return self._spent.get(window, {}).get(scope, Decimal(0)) + self._recent.get(window, {}).get(scope, Decimal(0))

    def _own_on(self, limit: SpendLimit, start: float) -> Decimal:
        """This relay's own usage in the scope of ``limit`` and the window from ``start`` (since it began adding up)."""
        return self._own.get((limit.period, start), {}).get((limit.scope_type, limit.scope_id), Decimal(0))

    def _recorded(self, record) -> None:
        if self._capped and record.cost is not None:
            self._add_recent(record.at, record.key_name, record.key_group, record.cost, (self._recent, self._own))

    def _add_recent(self, at: float, key_name: str | None, key_group: str | None, cost: Decimal, into) -> None:
        windows = self._windows
        for period in PERIODS:
            window = windows.get(period)
            if window is None or not window[0] <= at < window[1]:
                window = windows[period] = (window_start(period, at), window_end(period, at))
                for past in [each for each in self._own if each[0] == period and each[1] < window[0]]:
                    del self._own[past]
            for sums_by_window in into:
                sums = sums_by_window.setdefault((period, window[0]), {})
                for scope in _scopes(key_name, key_group):
                    sums[scope] = sums.get(scope, Decimal(0)) + cost

    def _know_limits(self, limits) -> None:
        self._limits = {limit.id: limit for limit in limits}
        self._capped = any(limit.amount is not None for limit in self._limits.values())

    def _recount(self) -> None:
        """What the last read did not see: the rows this process has not written yet."""
        self._recent = {}
        if self._capped:
            for record in self._ledger.unwritten():
                if record.cost is not None:
                    self._add_recent(record.at, record.key_name, record.key_group, record.cost, (self._recent,))

    # -- shares

    def _room(self, limit: SpendLimit, start: float, at: float) -> Decimal:
        """What this relay's share of ``limit`` in the window from ``start`` has left (0: none, or its lease is over)."""
        share = self._shares.get((limit.id, start))
        if share is None or at >= share.valid_until:
            return Decimal(0)
        return share.size - (self._own_on(limit, start) - share.base)

    async def _take(self, caps: list[tuple[SpendLimit, float]]) -> None:
        """Take a share of each of ``caps`` (joining a taking under way), and wait for them."""
        new = [(limit, start) for limit, start in caps if (limit.id, start) not in self._taking]
        if new:
            self._start_taking(new, [True] * len(new))
        takings = {id(d): d for d in (self._taking.get((limit.id, start)) for limit, start in caps) if d is not None}
        for taking in takings.values():
            await _fired(taking)

    def _renew_ahead(self, caps: list[tuple[SpendLimit, float]], rooms: list[Decimal]) -> None:
        """Take again, in the background, each share of ``caps`` (with what each has left) half used."""
        half_used = [
            (limit, start) for (limit, start), room in zip(caps, rooms)
            if room * 2 < self._shares[(limit.id, start)].size and (limit.id, start) not in self._taking
        ]
        if half_used:
            self._start_taking(half_used, [True] * len(half_used))

    def _renew(self) -> None:
        """Every refresh interval: take again every share used since the last time, give back the others."""
        now = self._clock()
        chosen, keep = [], []
        for (limit_id, start), share in list(self._shares.items()):
            limit = self._limits.get(limit_id)
            if (limit_id, start) in self._taking:
                continue
            if limit is None or limit.amount is None or self._window(limit.period, now)[0] != start:
                # Gone, or a window past: its row's lease ends it.
                del self._shares[(limit_id, start)]
                continue
            own = self._own_on(limit, start)
            used = own != share.mark or share.admitted > 0
            chosen.append((limit, start))
            keep.append(used)
            if used:
                share.mark, share.admitted = own, 0
            else:
                # Given back now: no request goes through on it meanwhile.
                del self._shares[(limit_id, start)]
        # A transaction locks each of its caps: a few dozen at a time (PostgreSQL's lock table is bounded).
        for first in range(0, len(chosen), _CAPS_A_TAKE):
            self._start_taking(chosen[first:first + _CAPS_A_TAKE], keep[first:first + _CAPS_A_TAKE])

    def _start_taking(self, caps: list[tuple[SpendLimit, float]], keep: list[bool]) -> None:
        """One transaction for the shares of ``caps`` (``keep`` false: give it back), with this relay's rows not written yet."""
        windows = [(start, window_end(limit.period, start)) for limit, start in caps]
        by_scope: dict[tuple[str, str], list[int]] = {}
        for index, (limit, _) in enumerate(caps):
            by_scope.setdefault((limit.scope_type, limit.scope_id), []).append(index)

        def costs_of(record) -> list[int]:
            costs = [0] * len(caps)
            if record.cost is not None:
                for scope in _scopes(record.key_name, record.key_group):
                    for index in by_scope.get(scope, ()):
                        if windows[index][0] <= record.at < windows[index][1]:
                            costs[index] += int(record.cost * _PICOS)
            return costs

        # The rows in the write under way may be in the ledger by the time
        # the transaction runs (it runs after it): it looks them up.
        writing = [(record.request_id, costs_of(record)) for record in self._ledger.being_written()]
        queued = [0] * len(caps)
        for record in self._ledger.unwritten()[len(writing):]:
            for index, cost in enumerate(costs_of(record)):
                queued[index] += cost
        asked = [
            ShareAsked(limit.id, limit.scope_type, limit.scope_id, start, end, owed, each)
            for (limit, _), (start, end), owed, each in zip(caps, windows, queued, keep)
        ]
        bases = [self._own_on(limit, start) for limit, start in caps]
        valid_until = self._reactor.seconds() + self._lease
        self.takes += 1
        d = self._ledger.on_database(take_shares, self.holder, asked, self._lease, writing)
        for (limit, start), each in zip(caps, keep):
            if each:
                # (A share given back is gone here already: a request that
                # needs one takes it, after the giving back.)
                self._taking[(limit.id, start)] = d
        d.addCallbacks(self._took, self._not_taken, callbackArgs=(d, caps, bases, valid_until), errbackArgs=(d, caps))

    def _took(self, taken, d, caps, bases, valid_until) -> None:
        for (limit, start), base, each in zip(caps, bases, taken):
            key = (limit.id, start)
            if each.reached:
                self._reached[key] = Decimal(each.spent_pico + each.unwritten_pico) / _PICOS * _HUNDRED
            if self._taking.get(key) is not d:
                continue  # given back
            del self._taking[key]
            if each.amount_pico is None:
                # No cap any more: the next read forgets it.
                self._shares[key] = _Share(base, Decimal("Infinity"), valid_until, base)
            elif each.share_pico > 0:
                self._shares[key] = _Share(base, Decimal(each.share_pico) / _PICOS, valid_until, base)
            else:
                self._shares.pop(key, None)

    def _not_taken(self, failure, d, caps) -> None:
        for limit, start in caps:
            if self._taking.get((limit.id, start)) is d:
                del self._taking[(limit.id, start)]
        self._cannot_read(failure)

    def _forget_shares(self, which) -> None:
        """Drop this relay's shares of the limits ``which(limit_id)`` says (their rows count until taken again or over)."""
        for key in [key for key in self._shares if which(key[0])]:
            del self._shares[key]
        for key in [key for key in self._reached if which(key[0])]:
            del self._reached[key]

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
        before = self._limits
        self._know_limits(limits)
        # A cap changed or deleted elsewhere: its shares go (taken again under the new amount).
        self._forget_shares(lambda limit_id: self._limits.get(limit_id) != before.get(limit_id))
        self._reached = {}
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
        self._cannot_read(failure)

    def _cannot_read(self, failure) -> None:
        if not self._failing:
            self._failing = True
            self.log.warn(
                "Cannot read the spend limits and spend ({error}): relaying with the last known totals "
                "plus this relay's own usage (caps fail open)",
                error=failure.getErrorMessage() if failure.check(LedgerError) else repr(failure.value),
            )


def _fired(d: Deferred) -> Deferred:
    """A Deferred that fires (with ``None``) once ``d`` has, leaving ``d``'s result to its own callbacks."""
    waiting: Deferred = Deferred()
    d.addBoth(lambda result: waiting.callback(None) or result)
    return waiting
