"""
Caps shared by several relays hold (``docs/usage.md``, "Several relays, and
the overshoot bound"): two relays on one real PostgreSQL ledger, both busy
with requests of a known cost, let through past a shared cap no more than
the requests they had in flight; a relay idle for long admits nothing on the
totals it read before. Also the shares' transaction itself
(:func:`~twisted_relay.spend_shares_sql.take_shares`) on SQLite, and the
guard over two ledgers on one SQLite file, with a ``Clock`` for its time.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from decimal import Decimal

import treq
from twisted.internet import reactor
from twisted.internet.defer import DeferredList, ensureDeferred
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from twisted_relay.config import RelayConfig, RelayKey, one_upstream

from tests import postgres_server
from tests.helpers import serve_relay
from tests.ledger_records import usage_record

KEYS = (
    RelayKey("sk-relay-alice-0001", "alice", "platform"),
    RelayKey("sk-relay-bob-0002", "bob", "platform"),
)
ADMIN = RelayKey("sk-admin-0123456789", "ops")
#: What one answer of the upstream below costs: 1,000 input and 100 output
#: tokens of claude-opus-5-5 ($4 and $20 a million), in cents.
CENTS_A_REQUEST = Decimal("0.6")
PICOS_A_CENT = 10**10


class _SlowFixedCostUpstream(Resource):
    """
    Answers every Messages request whole, after 20 to 120 ms (seeded), with
    the same usage: every answer costs :data:`CENTS_A_REQUEST`.
    """

    isLeaf = True

    def __init__(self):
        super().__init__()
        self._random = random.Random(31)
        self.answered = 0

    def render_POST(self, request):
        def answer():
            if request.finished or request._disconnected:
                return
            self.answered += 1
            request.setHeader(b"content-type", b"application/json")
            request.write(json.dumps({
                "id": "msg_%d" % (self.answered,), "type": "message", "role": "assistant", "model": "claude-opus-5-5",
                "content": [{"type": "text", "text": "Hello"}], "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": 1000, "output_tokens": 100},
            }).encode("utf-8"))
            request.finish()

        reactor.callLater(self._random.uniform(0.02, 0.12), answer)
        return NOT_DONE_YET


class _Clients:
    """``count`` clients of one relay, each sending one request after another until one is refused."""

    def __init__(self, url: str, key: RelayKey, count: int):
        self.url, self.key, self.count = url, key, count
        self.in_flight = 0
        self.most_in_flight = 0
        self.admitted = 0
        self.refusals: list[tuple[int, str]] = []

    async def one_client(self, most: int, deadline: float) -> None:
        body = json.dumps({"model": "claude-opus-5-5", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]})
        for _ in range(most):
            if time.monotonic() > deadline:
                return
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                response = await treq.post(
                    self.url + "/v1/messages", body.encode(), persistent=False,
                    headers={"x-api-key": self.key.key, "content-type": "application/json"},
                )
                answer = await response.json()
            finally:
                self.in_flight -= 1
            if response.code == 200:
                self.admitted += 1
                continue
            self.refusals.append((response.code, answer["error"]["type"]))
            return

    def run(self, most: int = 200, seconds: float = 60.0):
        deadline = time.monotonic() + seconds
        return DeferredList([ensureDeferred(self.one_client(most, deadline)) for _ in range(self.count)], fireOnOneErrback=True)


class SharedCapTests(TestCase):
    """Two relays in this process on one PostgreSQL ledger, as two machines would share it."""

    skip = postgres_server.SKIP_REASON

    def setUp(self):
        self.server = postgres_server.shared_server()
        self.upstream = _SlowFixedCostUpstream()
        listening = reactor.listenTCP(0, Site(self.upstream), interface="127.0.0.1")
        self.addCleanup(listening.stopListening)
        self.config = RelayConfig(
            listen=(), upstreams=one_upstream("http://127.0.0.1:%d" % (listening.getHost().port,)), dump_dir=None
        ).with_changes(relay_keys=KEYS, admin_keys=(ADMIN,), usage_db=self.server.new_database())

    async def set_cap(self, served, scope: dict, cents: int) -> None:
        response = await treq.post(
            served.url + "/v1/organizations/spend_limits",
            json.dumps({"scope": scope, "period": "daily", "amount": str(cents)}).encode(),
            headers={"x-api-key": ADMIN.key, "content-type": "application/json"}, persistent=False,
        )
        self.assertEqual(response.code, 200, await response.text())
        await response.content()

    async def ledger_rows(self, *relays) -> list[Decimal]:
        """Every row's cost in the database (cents), once each relay's rows are written."""
        for served in relays:
            served.relay.app.batch.run()
            await served.relay.ledger.flush()
        with postgres_server.psycopg.connect(self.config.usage_db) as connection:
            rows = connection.execute("SELECT cost_pico_usd FROM relay_usage").fetchall()
        return [Decimal(pico) / PICOS_A_CENT for (pico,) in rows]

    async def test_two_busy_relays_pass_a_shared_cap_by_at_most_their_requests_in_flight(self):
        """
        Six clients on each relay send requests of one known cost (0.6 cent)
        until refused, under one shared daily cap of 25 cents, with the
        default refresh (5 s) and flush (1 s) intervals. Both relays are
        refused in the end (429 billing_error), the cap was reached, and what
        they let through past it is less than the requests they had in
        flight together: the spend stays below the cap plus that many
        requests' cost, however fast they went.
        """
        cap = 25
        first = serve_relay(self, self.config, reactor)
        await self.set_cap(first, {"type": "organization"}, cap)
        # Started with the cap set (a cap set through one relay reaches the others at their next read).
        second = serve_relay(self, self.config, reactor)
        clients = [_Clients(first.url, KEYS[0], 6), _Clients(second.url, KEYS[1], 6)]
        started = time.monotonic()
        await DeferredList([each.run() for each in clients], fireOnOneErrback=True)
        took = time.monotonic() - started
        for each in clients:
            self.assertEqual(len(each.refusals), each.count, "every client ended refused")
            self.assertEqual({refusal for refusal in each.refusals}, {(429, "billing_error")})
            self.assertGreater(each.admitted, 5, "both relays were busy")
        rows = await self.ledger_rows(first, second)
        self.assertEqual(set(rows), {CENTS_A_REQUEST})
        admitted = sum(each.admitted for each in clients)
        self.assertEqual(len(rows), admitted)
        spent = sum(rows, Decimal(0))
        in_flight = sum(each.most_in_flight for each in clients)
        # Past the cap: the requests after the one that reached it.
        past = admitted - math.ceil(cap / CENTS_A_REQUEST)
        print(
            "\nshared cap %d cents, %s cents a request, %d clients: %d requests let through (%d past the cap, "
            "%s cents spent) in %.2f s; shares taken: %d and %d"
            % (cap, CENTS_A_REQUEST, in_flight, admitted, past, spent, took,
               *(getattr(getattr(served.relay.app, "spend", None), "takes", -1) for served in (first, second)))
        )
        self.assertGreaterEqual(spent, cap, "refused before the cap was reached")
        self.assertLess(spent, cap + in_flight * CENTS_A_REQUEST)
        self.assertLess(past, in_flight)

    async def test_a_relay_idle_for_long_admits_nothing_on_old_totals(self):
        """
        A relay that last read the spend before it went idle, while another
        relay spent a key's cap, refuses that key's next request (nothing
        sent upstream), although its last read is many refresh intervals old.
        """
        config = self.config.with_changes(spend_refresh_interval=0.5, usage_flush_interval=0.1)
        busy = serve_relay(self, config, reactor)
        await self.set_cap(busy, {"type": "user", "user_id": "alice"}, 3)
        idle = serve_relay(self, config, reactor)
        once = _Clients(idle.url, KEYS[0], 1)
        await once.run(most=1)
        self.assertEqual(once.admitted, 1)
        spender = _Clients(busy.url, KEYS[0], 1)
        await spender.run()
        self.assertEqual(spender.refusals, [(429, "billing_error")])
        # Idle for six refresh intervals, then one request.
        await deferLater(reactor, 3.0, lambda: None)
        before = self.upstream.answered
        late = _Clients(idle.url, KEYS[0], 1)
        await late.run(most=1)
        self.assertEqual((late.admitted, late.refusals, self.upstream.answered), (0, [(429, "billing_error")], before))
        # Bob has no cap: the idle relay lets him through.
        bob = _Clients(idle.url, KEYS[1], 1)
        await bob.run(most=1)
        self.assertEqual(bob.admitted, 1)


class TakeSharesTests(SynchronousTestCase):
    """The shares' transaction on a real SQLite ledger."""

    def setUp(self):
        from twisted_relay.ledger_sql import open_ledger
        from twisted_relay.spend_limits_sql import set_limit

        folder = self.mktemp()
        os.makedirs(folder)
        self.database = open_ledger(os.path.join(folder, "usage.sqlite"))
        self.database.open()
        self.addCleanup(self.database.close)
        # 100 cents a day for the whole relay, in the window of the records below.
        self.limit = set_limit(self.database, "organization", "", "daily", 100)
        self.start = usage_record(0).at
        self.cap = 100 * PICOS_A_CENT

    def take(self, holder: str, unwritten: int = 0, keep: bool = True, lease: float = 60.0):
        from twisted_relay.spend_shares_sql import ShareAsked, take_shares

        asked = ShareAsked(self.limit.id, "organization", "", self.start, self.start + 86400, unwritten, keep)
        (taken,) = take_shares(self.database, holder, [asked], lease)
        return taken

    def held(self) -> dict[str, int]:
        def select(connection):
            return connection.execute("SELECT holder, held_pico FROM relay_spend_shares").fetchall()

        return dict(self.database.run(select))

    def test_the_ledger_and_the_shares_never_add_up_past_the_cap(self):
        """
        Each share is a quarter of what the ledger's rows, the other
        holders' rows and the asker's unwritten usage leave free; right
        after each, the rows and every holder's row add up to no more than
        the cap. A holder's row holds its unwritten usage and its share.
        """
        first = self.take("a")
        self.assertEqual((first.share_pico, first.spent_pico, first.others_pico), (self.cap // 4, 0, 0))
        second = self.take("b")
        self.assertEqual((second.others_pico, second.share_pico), (self.cap // 4, (self.cap - self.cap // 4) // 4))
        # "a" has spent 40 cents it has not written yet.
        third = self.take("a", unwritten=40 * PICOS_A_CENT)
        free = self.cap - second.share_pico - 40 * PICOS_A_CENT
        self.assertEqual(third.share_pico, free // 4)
        self.assertEqual(self.held(), {"a": 40 * PICOS_A_CENT + free // 4, "b": second.share_pico})
        # Its 40 cents written: they count in the ledger, and in its row until it takes a share again.
        self.database.write([usage_record(1, at=self.start + 60, cost=Decimal("0.40"))])
        fourth = self.take("b", unwritten=5 * PICOS_A_CENT)
        self.assertEqual(fourth.spent_pico, 40 * PICOS_A_CENT)
        self.assertEqual(fourth.others_pico, 40 * PICOS_A_CENT + free // 4)
        self.assertLessEqual(fourth.spent_pico + sum(self.held().values()), self.cap)
        again = self.take("a")
        self.assertEqual(again.others_pico, self.held()["b"])
        self.assertLessEqual(again.spent_pico + sum(self.held().values()), self.cap)

    def test_reached_held_elsewhere_given_back_and_lapsed(self):
        """
        The cap reached by the ledger's rows and the asker's own unwritten
        usage: no share, and it says so. Free usage held by another holder:
        no share, not reached. A share given back leaves only the unwritten
        usage in the row (no row without any); a row whose lease ended counts
        for nobody and is deleted.
        """
        self.database.write([usage_record(1, at=self.start + 60, cost=Decimal("0.90"))])
        other = self.take("b", unwritten=2 * PICOS_A_CENT)
        self.assertEqual(other.share_pico, 2 * PICOS_A_CENT)  # a quarter of the 8 cents free
        held = self.take("a", unwritten=5 * PICOS_A_CENT)
        self.assertEqual((held.share_pico, held.reached, held.free_pico), (PICOS_A_CENT // 4, False, PICOS_A_CENT))
        full = self.take("a", unwritten=10 * PICOS_A_CENT)
        self.assertEqual((full.share_pico, full.reached), (0, True))
        self.assertEqual(self.held()["a"], 10 * PICOS_A_CENT)
        given = self.take("a", keep=False)
        self.assertEqual(given.share_pico, 0)
        self.assertNotIn("a", self.held())
        self.take("b", unwritten=4 * PICOS_A_CENT, lease=0.0)  # a lease already over
        after = self.take("a")
        self.assertEqual((after.others_pico, after.share_pico), (0, -(-10 * PICOS_A_CENT // 4)))
        self.assertEqual(set(self.held()), {"a"})

    def test_rows_of_a_write_handed_over_before_count_once(self):
        """
        The asker's rows in a write handed to the ledger's thread before the
        transaction: those the ledger holds when it runs count in the
        ledger's spend, the others as the asker's unwritten usage.
        """
        from twisted_relay.spend_shares_sql import ShareAsked, take_shares

        self.database.write([usage_record(1, at=self.start + 60, cost=Decimal("0.30"))])
        asked = ShareAsked(self.limit.id, "organization", "", self.start, self.start + 86400, 10 * PICOS_A_CENT)
        writing = [("rly_test_000001", [30 * PICOS_A_CENT]), ("rly_test_000002", [20 * PICOS_A_CENT])]
        (taken,) = take_shares(self.database, "a", [asked], 60.0, writing)
        self.assertEqual((taken.spent_pico, taken.unwritten_pico), (30 * PICOS_A_CENT, 30 * PICOS_A_CENT))
        self.assertEqual(taken.share_pico, 40 * PICOS_A_CENT // 4)
        self.assertEqual(self.held(), {"a": 30 * PICOS_A_CENT + 10 * PICOS_A_CENT})

    def test_a_deleted_limit_takes_nothing(self):
        from twisted_relay.spend_limits_sql import delete_limit

        delete_limit(self.database, self.limit.id)
        taken = self.take("a", unwritten=PICOS_A_CENT)
        self.assertEqual((taken.amount_pico, taken.share_pico, taken.reached), (None, 0, False))
        self.assertEqual(self.held(), {})


class GuardSharesTests(TestCase):
    """Two guards, as two relays, each with its own ledger service on one SQLite file; time from a ``Clock``."""

    def setUp(self):
        folder = self.mktemp()
        os.makedirs(folder)
        self.path = os.path.join(folder, "usage.sqlite")

    def ledger(self, flush_interval: float = 60.0):
        from twisted_relay.ledger import Ledger
        from twisted_relay.ledger_sql import open_ledger

        ledger = Ledger(open_ledger(self.path), reactor=reactor, flush_interval=flush_interval)
        ledger.startService()
        self.addCleanup(ledger.stopService)
        return ledger

    def guard(self, ledger, clock, started: bool = True):
        from twisted_relay.spend_guard import SpendGuard

        guard = SpendGuard(ledger, reactor=clock, refresh_interval=5.0)
        if started:
            guard.startService()
            self.addCleanup(guard.stopService)
        return guard

    async def settled(self, ledger) -> None:
        """Once every transaction queued on ``ledger``'s thread is done (and its callbacks have run)."""
        await ledger.on_database(lambda database: None)

    async def first_reads_done(self, *ledgers) -> None:
        """
        Once the guards' first reads (made as they start, before any cap
        is set) are done: one that ended after ``know(limit)`` would put
        back what the database held before the cap.
        """
        for ledger in ledgers:
            await self.settled(ledger)

    async def until_waiting(self, clock) -> None:
        """Until a guard on ``clock`` waits a tenth of its refresh interval (at most 5 s of real time)."""
        for _ in range(500):
            if any(0 < call.getTime() - clock.seconds() <= 0.5 for call in clock.getDelayedCalls() if call.active()):
                return
            await deferLater(reactor, 0.01, lambda: None)
        self.fail("the guard never waited")

    async def set_cap(self, ledger, cents: int):
        from twisted_relay.spend_limits_sql import set_limit

        return await ledger.on_database(set_limit, "user", "alice", "daily", cents)

    async def test_an_idle_relay_admits_nothing_on_old_totals(self):
        """
        Relay B read the spend and took a share of alice's cap, then sat
        idle for an hour while relay A spent the cap: its timer read the
        spend again meanwhile, and it refuses alice; so does a relay that
        runs no timer (its share's lease is over: it asks the database).
        """
        first, second, third = self.ledger(0.05), self.ledger(), self.ledger()
        spender = self.guard(first, Clock())
        clock, lazy_clock = Clock(), Clock()
        idle, lazy = self.guard(second, clock), self.guard(third, lazy_clock, started=False)
        limit = await self.set_cap(first, 100)
        for guard in (spender, idle, lazy):
            guard.know(limit)
            standing = await guard.admit("alice", "platform")
            self.assertEqual((standing.limit.id, standing.exceeded), (limit.id, False))
        self.assertEqual(lazy.takes, 1)
        first.record(usage_record(1, at=time.time(), key_name="alice", key_group="platform", cost=Decimal("1.00")))
        await first.flush()
        self.assertTrue((await spender.admit("alice", "platform")).exceeded)
        clock.advance(3600)
        lazy_clock.advance(3600)
        await self.settled(second)
        for guard in (idle, lazy):
            standing = await guard.admit("alice", "platform")
            self.assertTrue(standing.exceeded, standing)
            self.assertEqual(standing.spent_cents, 100)
        self.assertEqual(lazy.takes, 2)

    async def test_unwritten_usage_counts_for_its_relay_and_through_its_share_for_others(self):
        """
        Nothing is written (a long flush interval): relay A's own usage
        counts against the cap for A at once; relay B learns of it through
        A's row of shares (its unwritten usage when it last took a share),
        so B's share is what A's usage and share leave.
        """
        first, second = self.ledger(), self.ledger()
        a, b = self.guard(first, Clock()), self.guard(second, Clock())
        await self.first_reads_done(first, second)
        limit = await self.set_cap(first, 10)
        for guard in (a, b):
            guard.know(limit)
        self.assertFalse((await a.admit("alice", None)).exceeded)  # A's share: 2.5 cents
        first.record(usage_record(1, at=time.time(), key_name="alice", key_group=None, cost=Decimal("0.09")))
        self.assertFalse((await a.admit("alice", None)).exceeded)  # A's share again: 9 cents A's, 0.25 its share
        self.assertEqual(a.takes, 2)
        standing = await b.admit("alice", None)
        self.assertFalse(standing.exceeded)
        (row,) = await second.on_database(lambda database: database.run(
            lambda connection: connection.cursor().execute(
                "SELECT held_pico FROM relay_spend_shares WHERE holder = ?", (b.holder,)
            ).fetchall()
        ))
        self.assertEqual(row[0], (10 - 9 - Decimal("0.25")) * PICOS_A_CENT / 4)
        first.record(usage_record(2, at=time.time(), key_name="alice", key_group=None, cost=Decimal("0.01")))
        self.assertTrue((await a.admit("alice", None)).exceeded)

    async def test_what_another_relay_holds_is_waited_for_not_refused(self):
        """
        Relay B's row still counts usage it has written since (twice, with
        the ledger's rows): nothing looks free to relay A, though the cap is
        not reached. A's request waits, not refused, until B's next renewal
        (a refresh interval later) frees it, then goes through.
        """
        first, second = self.ledger(), self.ledger()
        clock_a, clock_b = Clock(), Clock()
        a, b = self.guard(first, clock_a), self.guard(second, clock_b)
        await self.first_reads_done(first, second)
        limit = await self.set_cap(first, 10)
        for guard in (a, b):
            guard.know(limit)
        self.assertFalse((await b.admit("alice", None)).exceeded)
        second.record(usage_record(1, at=time.time(), key_name="alice", key_group=None, cost=Decimal("0.095")))
        self.assertFalse((await b.admit("alice", None)).exceeded)  # B's row: 9.5 cents unwritten and a share
        await second.flush()
        waiting = ensureDeferred(a.admit("alice", None))
        await self.until_waiting(clock_a)
        self.assertEqual(a.takes, 1)
        clock_a.advance(0.5)  # a tenth of the refresh interval: asked again, still held
        await self.until_waiting(clock_a)
        self.assertEqual(a.takes, 2)
        self.assertNoResult(waiting)
        clock_b.advance(5.0)  # B's renewal: its row holds its share only
        await self.settled(second)
        clock_a.advance(0.5)
        standing = await waiting
        self.assertFalse(standing.exceeded)
        self.assertEqual(a.takes, 3)

    async def test_far_from_a_cap_requests_ask_the_database_rarely(self):
        """
        800 requests of 0.1 cent under a $1 cap (up to 80 % of it): each is
        let through on a share, and shares are taken a few times (each a
        quarter of what is free, taken again ahead of need when half used),
        not once a request; a request waited for one only at the first.
        """
        ledger = self.ledger()
        guard = self.guard(ledger, Clock())
        limit = await self.set_cap(ledger, 100)
        guard.know(limit)
        waited = 0
        for number in range(800):
            takes = guard.takes
            admitted = ensureDeferred(guard.admit("alice", None))
            if not admitted.called:
                waited += 1
            standing = await admitted
            self.assertFalse(standing.exceeded, (number, standing, guard._shares, guard._reached, guard.takes))
            ledger.record(usage_record(number, at=time.time(), key_name="alice", key_group=None, cost=Decimal("0.001")))
            if guard.takes > takes:
                await self.settled(ledger)  # (as a relay's requests would, a moment later)
        print("\n800 requests up to 80 %% of a cap: %d share transactions, %d requests waited" % (guard.takes, waited))
        self.assertLessEqual(guard.takes, 20)
        self.assertLessEqual(waited, 2)
