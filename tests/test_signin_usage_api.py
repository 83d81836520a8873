"""
``GET /api/oauth/usage`` over HTTP on 127.0.0.1, from a real SQLite ledger
and spend limits set through the admin routes: a capped key's rows (one a
period, the binding one active, ``resets_at`` the ``overage-reset`` its
answers carry), an uncapped key's own spend by day, week and month; and the
pure shapes.
"""

from __future__ import annotations

import json
import math
import os
import time
from datetime import datetime, timezone
from decimal import Decimal

import treq
from twisted.internet import reactor
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Site

from twisted_relay.config import RelayConfig, RelayKey, one_upstream
from twisted_relay.signin.usage_api import capped_usage, uncapped_usage
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.spend_limits import SpendLimit, Standing, window_end, window_start

from tests.helpers import serve_relay
from tests.ledger_records import usage_record

ALICE = RelayKey("sk-relay-alice-0001", "alice", "platform")
BOB = RelayKey("sk-relay-bob-0002", "bob", "research")
ADMIN = RelayKey("sk-admin-0123456789", "ops")
UNIFIED = "anthropic-ratelimit-unified-"


class UsageRouteTests(TestCase):
    """The route, end to end."""

    def setUp(self):
        folder = self.mktemp()
        os.makedirs(folder)
        upstream = SimulatedUpstream(mode="lenient")
        listening = reactor.listenTCP(0, Site(upstream.resource()), interface="127.0.0.1")
        self.addCleanup(listening.stopListening)
        config = RelayConfig(
            listen=(), upstreams=one_upstream("http://127.0.0.1:%d" % (listening.getHost().port,)), dump_dir=None,
        ).with_changes(
            relay_keys=(ALICE, BOB), admin_keys=(ADMIN,), usage_db=os.path.join(folder, "usage.sqlite"), usage_flush_interval=0.1,
        )
        self.served = serve_relay(self, config, reactor)
        self.ledger = self.served.relay.ledger

    async def request(self, method: str, path: str, key: RelayKey, body=None):
        headers = {"authorization": "Bearer " + key.key, "content-type": "application/json", "anthropic-version": "2023-06-01"}
        response = await treq.request(
            method, self.served.url + path, headers=headers, data=None if body is None else json.dumps(body).encode(), persistent=False
        )
        return response, await response.content()

    async def set_limit(self, scope: dict, period: str, cents: int) -> None:
        response, body = await self.request("POST", "/v1/organizations/spend_limits", ADMIN, {"scope": scope, "period": period, "amount": str(cents)})
        self.assertEqual(response.code, 200, body)

    async def usage(self, key: RelayKey) -> dict:
        response, body = await self.request("GET", "/api/oauth/usage", key)
        self.assertEqual(response.code, 200, body)
        self.assertEqual(response.headers.getRawHeaders("cache-control"), ["no-store"])
        return json.loads(body)

    async def test_capped_rows_and_resets_at_equal_to_overage_reset(self):
        now = time.time()
        self.ledger.record(usage_record(1, key_name="alice", key_group="platform", at=now, cost=Decimal("1.00")))
        await self.ledger.flush()
        await self.set_limit({"type": "user", "user_id": "alice"}, "daily", 400)
        await self.set_limit({"type": "workspace", "workspace_id": "platform"}, "monthly", 125)

        response, _ = await self.request(
            "POST", "/v1/messages", ALICE, {"model": "claude-opus-5-5", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
        )
        self.assertEqual(response.code, 200)
        overage_reset = int(response.headers.getRawHeaders(UNIFIED + "overage-reset")[0])
        self.assertEqual(overage_reset, int(window_end("monthly", now)))  # the group's monthly cap binds

        usage = await self.usage(ALICE)
        await self.ledger.flush()  # (the answer, metered as the route asked)
        month_spent = sum(line.cost for line in await self.ledger.totals(since=window_start("monthly", now), key_group="platform")) * 100
        self.assertGreater(month_spent, 100)
        self.assertEqual(
            usage["extra_usage"],
            {"is_enabled": True, "monthly_limit": 125, "used_credits": math.floor(month_spent),
             "utilization": min(99, math.floor(float(month_spent) / 125 * 100 + 0.5)), "currency": "USD"},
        )
        by_period = {row["group"]: row for row in usage["limits"]}
        self.assertEqual(set(by_period), {"daily", "monthly"})
        monthly = by_period["monthly"]
        self.assertEqual((monthly["kind"], monthly["is_active"], monthly["severity"]), ("spend", True, "warning"))
        self.assertEqual(
            datetime.strptime(monthly["resets_at"], "%Y-%m-%dT%H:%M:%S.000Z").replace(tzinfo=timezone.utc).timestamp(), overage_reset
        )
        daily = by_period["daily"]
        self.assertEqual((daily["is_active"], daily["severity"]), (False, "normal"))
        self.assertEqual(daily["percent"], math.floor(float(month_spent) / 400 * 100 + 0.5))  # alice's own spend is the group's
        self.assertEqual(daily["resets_at"], datetime.fromtimestamp(window_end("daily", now), timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z"))

    async def test_uncapped_spend_by_day_week_and_month(self):
        now = time.time()
        ago = [0, 3 * 86400, 9 * 86400, 40 * 86400]
        for number, back in enumerate(ago, 1):
            self.ledger.record(usage_record(number, key_name="bob", key_group="research", at=now - back, cost=Decimal("0.12345") * number))
        self.ledger.record(usage_record(9, key_name="alice", key_group="platform", at=now, cost=Decimal("5")))
        await self.ledger.flush()
        # A cap on someone else changes nothing for bob.
        await self.set_limit({"type": "user", "user_id": "alice"}, "daily", 100000)

        def spent(period: str) -> int:
            start = window_start(period, now)
            return math.floor(sum(Decimal("12.345") * number for number, back in enumerate(ago, 1) if now - back >= start))

        usage = await self.usage(BOB)
        self.assertEqual(usage, {
            "extra_usage": {
                "is_enabled": True, "monthly_limit": None, "used_credits": spent("monthly"), "utilization": None, "currency": "USD",
                "daily": {"limit": None, "used_credits": spent("daily"), "utilization": None},
                "weekly": {"limit": None, "used_credits": spent("weekly"), "utilization": None},
            },
            "limits": [],
        })
        self.assertEqual(spent("daily"), 12)

    async def test_no_key_refused(self):
        response = await treq.get(self.served.url + "/api/oauth/usage", persistent=False)
        self.assertEqual((response.code, response.headers.getRawHeaders("x-should-retry")), (401, ["false"]))
        self.assertEqual(json.loads(await response.content())["error"]["type"], "authentication_error")


class ShapeTests(SynchronousTestCase):
    """The answers' shapes from standings and spend."""

    def standing(self, period: str, amount: int, spent: str) -> Standing:
        limit = SpendLimit("spl_" + period, "user", "alice", period, amount, 0.0, 0.0)
        return Standing(limit, Decimal(spent), window_end(period, 1796083200.0))

    def test_capped(self):
        daily, weekly = self.standing("daily", 1000, "960.7"), self.standing("weekly", 5000, "960.7")
        answer = capped_usage([daily, weekly])
        self.assertEqual(answer["extra_usage"], {"is_enabled": True, "monthly_limit": 1000, "used_credits": 960, "utilization": 96, "currency": "USD"})
        self.assertEqual(answer["limits"], [
            {"kind": "spend", "group": "daily", "percent": 96, "resets_at": "2026-12-02T00:00:00.000Z", "severity": "critical", "is_active": True},
            {"kind": "spend", "group": "weekly", "percent": 19, "resets_at": "2026-12-07T00:00:00.000Z", "severity": "normal", "is_active": False},
        ])
        over = capped_usage([self.standing("monthly", 100, "130")])
        self.assertEqual((over["extra_usage"]["utilization"], over["limits"][0]["percent"], over["limits"][0]["severity"]), (100, 100, "critical"))

    def test_uncapped(self):
        answer = uncapped_usage({"daily": Decimal("1.9"), "weekly": Decimal("20.5"), "monthly": Decimal("99.99")})
        self.assertEqual(answer["limits"], [])
        self.assertEqual((answer["extra_usage"]["used_credits"], answer["extra_usage"]["daily"]["used_credits"]), (99, 1))
