"""
Spend limits as people use them: the official SDK's admin client
(``client.beta.organization.spend_limits``) against the relay on 127.0.0.1
with a real SQLite ledger, and the official SDK as the relay keys' client
over the simulated upstream: a key at its daily cap is refused before the
upstream (429 ``billing_error``, not retried by the SDK), others keep
working, a raised cap lets it through at once; a group cap and the relay's
cap likewise; the ``anthropic-ratelimit-unified-*`` headers on the answers.
Also the pure rules: windows, the binding cap, the headers.
"""

from __future__ import annotations

import base64
import json
import os
import time
from datetime import datetime, timezone
from decimal import Decimal

import anthropic
import treq
import httpx2
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site

from twisted_relay.config import RelayConfig, RelayKey, Route, Target, one_upstream
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.spend_limits import SpendLimit, Standing, binding, standing_headers, window_end, window_start

from tests import postgres_server
from tests.helpers import serve_relay

KEYS = (
    RelayKey("sk-relay-alice-0001", "alice", "platform"),
    RelayKey("sk-relay-bob-0002", "bob", "platform"),
    RelayKey("sk-relay-carol-0003", "carol", "research"),
)
ADMIN = RelayKey("sk-admin-0123456789", "ops")
UNIFIED = "anthropic-ratelimit-unified-"


class Calls:
    """An SDK client over the relay that counts the HTTP requests it sends (its retries included)."""

    def __init__(self, url: str, key: str):
        self.sent = 0
        http = httpx2.Client(event_hooks={"request": [self._count]}, timeout=30)
        self.client = anthropic.Anthropic(api_key=key, base_url=url, http_client=http)

    def _count(self, request) -> None:
        self.sent += 1

    def message(self):
        """One Messages call: the raw response, or the SDK's error."""
        try:
            return self.client.messages.with_raw_response.create(
                model="claude-opus-5-5", max_tokens=512, messages=[{"role": "user", "content": "Tell me a long story " * 40}]
            )
        except anthropic.APIStatusError as e:
            return e
        finally:
            self.client.close()


class SpendLimitTests(TestCase):
    """The admin API and the caps, end to end."""

    def setUp(self):
        folder = self.mktemp()
        os.makedirs(folder)
        self.upstream = SimulatedUpstream(mode="lenient")
        listening = reactor.listenTCP(0, Site(self.upstream.resource()), interface="127.0.0.1")
        self.addCleanup(listening.stopListening)
        config = RelayConfig(
            listen=(),
            upstreams=one_upstream("http://127.0.0.1:%d" % (listening.getHost().port,)),
            dump_dir=os.path.join(folder, "dumps"),
        ).with_changes(
            relay_keys=KEYS, admin_keys=(ADMIN,), usage_db=os.path.join(folder, "usage.sqlite"), usage_flush_interval=0.1,
            metrics=True,
            # An alias the relay sends upstream as a priced model, and one as a model without a price.
            routes=(
                Route(models=("fast",), targets=(Target("default", "claude-haiku-4-5"),)),
                Route(models=("cheap",), targets=(Target("default", "claude-unpriced-9"),)),
                Route(targets=(Target("default"),)),
            ),
        )
        self.db = config.usage_db
        self.dumps = config.dump_dir
        self.logged: list[str] = []
        observer = lambda event: self.logged.append(formatEvent(event) + repr(event))  # noqa: E731
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        self.served = serve_relay(self, config, reactor)
        self.admin = anthropic.Anthropic(api_key=ADMIN.key, base_url=self.served.url, max_retries=0)
        self.limits = self.admin.beta.organization.spend_limits
        self.addCleanup(self.closed, self.admin)

    async def closed(self, client) -> None:
        """Close an SDK client and give the relay a moment to see its connections end."""
        client.close()
        await deferLater(reactor, 0.2, lambda: None)

    def call(self, function, *args, **kwargs):
        return deferToThread(function, *args, **kwargs)

    async def message(self, key: RelayKey) -> tuple[object, int, int]:
        """A Messages call by ``key``: its answer, the HTTP requests the SDK sent, those the upstream got."""
        calls = Calls(self.served.url, key.key)
        before = len(self.upstream.requests)
        answer = await self.call(calls.message)
        return answer, calls.sent, len(self.upstream.requests) - before

    async def until_refused(self, key: RelayKey, most: int = 40):
        """Calls by ``key`` until one is refused (at most ``most``); the successes' headers and the refusal."""
        headers = []
        for _ in range(most):
            answer, sent, upstream = await self.message(key)
            if isinstance(answer, anthropic.APIStatusError):
                return headers, answer, sent, upstream
            self.assertEqual(upstream, 1)
            headers.append(answer.headers)
        self.fail("%s was never refused in %d calls" % (key.name, most))

    async def test_admin_client_and_a_daily_user_cap(self):
        """
        The SDK's admin client sets, lists, retrieves and deletes limits; a
        key at its daily cap gets a 429 the SDK does not retry, with the
        gateway's headers; another key keeps working; raising the cap lets
        it through at once.
        """
        limit = await self.call(self.limits.set, amount="2", period="daily", scope={"type": "user", "user_id": "alice"})
        self.assertTrue(limit.id.startswith("spl_"))
        self.assertEqual((limit.amount, limit.period, limit.currency, limit.scope.type, limit.scope.user_id), ("2", "daily", "USD", "user", "alice"))
        again = await self.call(self.limits.set, amount="3", period="daily", scope={"type": "user", "user_id": "alice"})
        self.assertEqual((again.id, again.amount), (limit.id, "3"))
        org = await self.call(self.limits.set, amount=None, period="monthly", scope={"type": "organization"})
        listed = await self.call(lambda: list(self.limits.list(scope_type=["user"])))
        self.assertEqual([item.id for item in listed], [limit.id])
        everything = await self.call(lambda: list(self.limits.list(limit=1)))
        self.assertEqual([item.id for item in everything], [limit.id, org.id])
        self.assertEqual((await self.call(self.limits.retrieve, limit.id)).amount, "3")
        deleted = await self.call(self.limits.delete, org.id)
        self.assertEqual((deleted.id, deleted.type), (org.id, "spend_limit_deleted"))

        headers, refused, sent, upstream = await self.until_refused(KEYS[0])
        self.assertTrue(headers, "the first call was already refused")
        self.assertEqual(headers[0][UNIFIED + "status"], "allowed")
        self.assertEqual(headers[0][UNIFIED + "representative-claim"], "overage")
        for each in headers:
            self.assertLess(float(each[UNIFIED + "overage-utilization"]), 1)
        self.assertEqual((refused.status_code, refused.body["error"]["type"], sent, upstream), (429, "billing_error", 1, 0))
        message = refused.body["error"]["message"]
        self.assertTrue(message.startswith("spend limit reached \u00b7 resets "), message)
        self.assertIn("your daily spend limit is $0.03", message)
        got = refused.response.headers
        tomorrow = window_end("daily", datetime.now(timezone.utc).timestamp())
        self.assertEqual(got["x-should-retry"], "false")
        self.assertEqual(
            {name: got.get(UNIFIED + name) for name in ("status", "overage-utilization", "overage-surpassed-threshold", "overage-period", "overage-disabled-reason", "representative-claim", "overage-status", "reset")},
            {"status": "rejected", "overage-utilization": "1", "overage-surpassed-threshold": "1", "overage-period": "daily", "overage-disabled-reason": "org_spend_cap_reached", "representative-claim": None, "overage-status": None, "reset": str(int(tomorrow))},
        )
        self.assertLess(abs(int(got["retry-after"]) - (tomorrow - datetime.now(timezone.utc).timestamp())), 60)

        # Bob (no cap of his own) keeps working, and hears of no cap.
        answer, sent, upstream = await self.message(KEYS[1])
        self.assertEqual((answer.http_response.status_code, upstream), (200, 1))
        self.assertFalse([name for name in answer.headers if name.startswith("anthropic-ratelimit-")])

        # Raised: through at once.
        await self.call(self.limits.set, amount="100000", period="daily", scope={"type": "user", "user_id": "alice"})
        answer, sent, upstream = await self.message(KEYS[0])
        self.assertEqual((answer.http_response.status_code, upstream), (200, 1))
        self.assertEqual(answer.headers[UNIFIED + "status"], "allowed")

        # The usage page draws alice's cap bar from the limit, bob has none.
        page = await treq.get(self.served.url + "/admin/usage", headers={"x-api-key": ADMIN.key}, persistent=False)
        html = (await page.content()).decode("utf-8")
        alice = html[html.index('data-key="alice"'):]
        self.assertIn("of $1,000.00 daily", alice[: alice.index("</tr>")])
        bob = html[html.index('data-key="bob"'):]
        self.assertIn("no cap", bob[: bob.index("</tr>")])

    async def test_a_capped_key_cannot_use_a_model_without_a_price(self):
        """
        An answer of a model the price table does not know costs nothing
        against a cap: a key a cap applies to is refused such a model (400,
        not retried, nothing sent upstream), as its route would send it
        upstream; a key without a cap uses it, metered in tokens.
        """
        await self.call(self.limits.set, amount="100000", period="daily", scope={"type": "user", "user_id": "alice"})

        def ask(key, model="claude-unpriced-9"):
            client = anthropic.Anthropic(api_key=key.key, base_url=self.served.url, max_retries=2)
            try:
                return client.messages.create(model=model, max_tokens=16, messages=[{"role": "user", "content": "hi"}])
            except anthropic.APIStatusError as e:
                return e
            finally:
                client.close()

        before = len(self.upstream.requests)
        refused = await self.call(ask, KEYS[0])
        self.assertIsInstance(refused, anthropic.BadRequestError)
        self.assertIn("no price for the model claude-unpriced-9", refused.body["error"]["message"])
        self.assertEqual(refused.response.headers["x-should-retry"], "false")
        self.assertEqual(len(self.upstream.requests), before)
        answered = await self.call(ask, KEYS[1])
        self.assertEqual(answered.type, "message")
        # What the route sends upstream is what is priced: an alias of a priced model goes through.
        self.assertEqual((await self.call(ask, KEYS[0], "fast")).model, "claude-haiku-4-5")
        renamed = await self.call(ask, KEYS[0], "cheap")
        self.assertIn("no price for the model claude-unpriced-9", renamed.body["error"]["message"])

    async def test_group_and_relay_caps(self):
        """A group's cap stops its keys only; the relay's cap stops every key; deleting one lifts it."""
        group = await self.call(self.limits.set, amount="2", period="weekly", scope={"type": "workspace", "workspace_id": "platform"})
        headers, refused, sent, upstream = await self.until_refused(KEYS[0])
        self.assertEqual((refused.status_code, sent, upstream), (429, 1, 0))
        self.assertEqual(refused.response.headers[UNIFIED + "overage-scope"], "group_pool")
        self.assertEqual(refused.response.headers[UNIFIED + "overage-period"], "weekly")
        answer, sent, upstream = await self.message(KEYS[1])
        self.assertEqual((getattr(answer, "status_code", None), upstream), (429, 0))
        answer, sent, upstream = await self.message(KEYS[2])
        self.assertEqual((answer.http_response.status_code, upstream), (200, 1))
        # The effective report: the group's cap binds alice and bob; carol has none.
        rows = await self.call(lambda: list(self.limits.effective.list(limit=1)))
        self.assertEqual(
            [(row.actor.user_id, row.period, row.source.type, row.spend_limit_id, row.amount) for row in rows],
            [("alice", "weekly", "workspace", group.id, "2"), ("bob", "weekly", "workspace", group.id, "2")],
        )
        self.assertGreater(Decimal(rows[0].period_to_date_spend), 0)
        self.assertEqual(rows[1].period_to_date_spend, "0")
        await self.call(self.limits.delete, group.id)
        answer, sent, upstream = await self.message(KEYS[1])
        self.assertEqual((answer.http_response.status_code, upstream), (200, 1))

        relay = await self.call(self.limits.set, amount="1", period="monthly", scope={"type": "organization"})
        for key in KEYS:
            answer, sent, upstream = await self.message(key)
            self.assertEqual((getattr(answer, "status_code", None), sent, upstream), (429, 1, 0), key.name)
        await self.call(self.limits.delete, relay.id)
        answer, sent, upstream = await self.message(KEYS[2])
        self.assertEqual((answer.http_response.status_code, upstream), (200, 1))

    async def test_who_may_use_the_admin_routes_and_errors(self):
        """A relay key never opens the admin routes; bad input gets Anthropic's envelope."""
        relay_client = anthropic.Anthropic(api_key=KEYS[0].key, base_url=self.served.url, max_retries=0)
        self.addCleanup(self.closed, relay_client)
        with self.assertRaises(anthropic.AuthenticationError):
            await self.call(lambda: list(relay_client.beta.organization.spend_limits.list()))
        with self.assertRaises(anthropic.AuthenticationError):
            await self.call(relay_client.beta.organization.spend_limits.set, amount="1", scope={"type": "organization"})
        with self.assertRaises(anthropic.BadRequestError) as bad:
            await self.call(self.limits.set, amount="1", scope={"type": "rbac_group", "rbac_group_id": "x"})
        self.assertEqual(bad.exception.body["error"]["type"], "invalid_request_error")
        with self.assertRaises(anthropic.BadRequestError):
            await self.call(lambda: list(self.limits.list(scope_type=["seat_tier"])))
        with self.assertRaises(anthropic.BadRequestError):
            await self.call(self.limits.set, amount="1.5", scope={"type": "organization"})
        for name in ("ali\x00ce", "alice\n", "a" * 65, ""):
            with self.assertRaises(anthropic.BadRequestError) as bad:
                await self.call(self.limits.set, amount="1", scope={"type": "user", "user_id": name})
            self.assertIn("scope.user_id: the relay key's name must be", bad.exception.body["error"]["message"])
        deep = await treq.post(
            self.served.url + "/v1/organizations/spend_limits", b"[" * 100_000,
            headers={"x-api-key": [ADMIN.key], "content-type": ["application/json"]}, persistent=False,
        )
        self.assertEqual((deep.code, (await deep.json())["error"]["type"]), (400, "invalid_request_error"))
        with self.assertRaises(anthropic.NotFoundError) as missing:
            await self.call(self.limits.retrieve, "spl_nothing")
        self.assertEqual(missing.exception.body["error"]["type"], "not_found_error")
        with self.assertRaises(anthropic.NotFoundError):
            await self.call(self.limits.delete, "spl_nothing")
        # The admin key is refused where messages go.
        calls = Calls(self.served.url, ADMIN.key)
        answer = await self.call(calls.message)
        self.assertEqual(answer.status_code, 401)

    async def admin_request(self, method: str, path: str, body: bytes | None = None, **headers):
        """An admin route asked with exactly ``headers`` (``_`` for ``-`` in names): its status and error type."""
        response = await treq.request(
            method, self.served.url + path, data=body,
            headers={name.replace("_", "-"): value for name, value in headers.items()}, persistent=False,
        )
        answer = await response.json()
        return response.code, answer["error"]["type"] if answer.get("type") == "error" else answer

    BASIC = "Basic " + base64.b64encode(b"ops:" + ADMIN.key.encode()).decode()
    SET_BODY = json.dumps({"scope": {"type": "organization"}, "period": "daily", "amount": "0"}).encode()
    LIMITS = "/v1/organizations/spend_limits"

    async def amounts(self) -> list[str]:
        return [each.amount for each in await self.call(lambda: list(self.limits.list()))]

    async def test_admin_writes_take_only_json_bodies(self):
        """
        A cross-site form can post text/plain (whose body may be JSON),
        urlencoded or multipart bodies, never application/json: a write
        takes only the last (415 otherwise, the admin key notwithstanding).
        """
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            headers = {"x_api_key": ADMIN.key}
            if content_type is not None:
                headers["content_type"] = content_type
            self.assertEqual(
                await self.admin_request("POST", self.LIMITS, self.SET_BODY, **headers), (415, "invalid_request_error"), content_type
            )
        self.assertEqual(await self.amounts(), [])
        status, limit = await self.admin_request(
            "POST", self.LIMITS, self.SET_BODY, x_api_key=ADMIN.key, content_type="Application/JSON; charset=utf-8"
        )
        self.assertEqual((status, limit["amount"]), (200, "0"))

    async def test_basic_credentials_open_reads_not_writes(self):
        """
        A browser keeps the Basic credentials it opened the usage page with
        and sends them with any request to the relay: they open the reads,
        never a write (401, without asking the browser for Basic credentials).
        """
        response = await treq.post(
            self.served.url + self.LIMITS, self.SET_BODY, persistent=False,
            headers={"authorization": self.BASIC, "content-type": "application/json"},
        )
        self.assertEqual(response.code, 401)
        self.assertEqual((await response.json())["error"]["type"], "authentication_error")
        self.assertNotIn(b"Basic", b"".join(response.headers.getRawHeaders(b"www-authenticate", [])))
        self.assertEqual(await self.amounts(), [])
        limit = await self.call(self.limits.set, amount="500", period="daily", scope={"type": "organization"})
        self.assertEqual(
            await self.admin_request("DELETE", self.LIMITS + "/" + limit.id, authorization=self.BASIC), (401, "authentication_error")
        )
        self.assertEqual(await self.amounts(), ["500"])
        status, listed = await self.admin_request("GET", self.LIMITS, authorization=self.BASIC)
        self.assertEqual((status, [each["amount"] for each in listed["data"]]), (200, ["500"]))
        status, one = await self.admin_request("GET", self.LIMITS + "/" + limit.id, authorization=self.BASIC)
        self.assertEqual((status, one["id"]), (200, limit.id))

    async def test_another_sites_origin_opens_no_admin_route(self):
        """
        A request whose Origin is not the relay's own (another host, scheme
        or port, or "null") is refused on every admin route, the admin key
        notwithstanding (403); one from the relay's own origin, as its Host
        header names it, is let in.
        """
        limit = await self.call(self.limits.set, amount="500", period="daily", scope={"type": "organization"})
        own = "http://127.0.0.1:%d" % (self.served.port,)
        routes = (
            ("POST", self.LIMITS, self.SET_BODY), ("DELETE", self.LIMITS + "/" + limit.id, None), ("GET", self.LIMITS, None),
            ("GET", self.LIMITS + "/" + limit.id, None), ("GET", self.LIMITS + "/effective", None), ("GET", "/admin/usage", None),
        )
        for origin in ("http://evil.example", "null", own.replace("http:", "https:"), own + "0"):
            for method, route, data in routes:
                self.assertEqual(
                    await self.admin_request(method, route, data, x_api_key=ADMIN.key, content_type="application/json", origin=origin),
                    (403, "permission_error"), (origin, method, route),
                )
        # A cross-site form post with the browser's Basic credentials: refused first for its Origin.
        self.assertEqual(
            await self.admin_request(
                "POST", self.LIMITS, self.SET_BODY, authorization=self.BASIC, content_type="text/plain", origin="http://evil.example"
            ),
            (403, "permission_error"),
        )
        self.assertEqual(await self.amounts(), ["500"])
        status, changed = await self.admin_request(
            "POST", self.LIMITS, self.SET_BODY.replace(b'"0"', b'"700"'), x_api_key=ADMIN.key, content_type="application/json",
            origin=own,
        )
        self.assertEqual((status, changed["amount"]), (200, "700"))
        page = await treq.get(self.served.url + "/admin/usage", headers={"x-api-key": ADMIN.key, "origin": own}, persistent=False)
        self.assertEqual(page.code, 200)
        await page.content()

    async def test_no_key_in_logs_metrics_database_or_dumps(self):
        """
        After limits set, answers, refusals and an upstream 400 (dumped), no
        admin or relay key is in a log line, the metrics, the database or a dump.
        """
        await self.call(self.limits.set, amount="1", period="daily", scope={"type": "user", "user_id": "alice"})
        await self.until_refused(KEYS[0])
        await self.message(KEYS[1])
        # A request the upstream refuses (no max_tokens) is dumped, with the
        # relay key and the admin key among its headers.
        refused = await treq.post(
            self.served.url + "/v1/messages",
            b'{"model": "claude-opus-5-5", "messages": [{"role": "user", "content": "hi"}]}',
            headers={"content-type": "application/json", "x-api-key": KEYS[1].key, "x-admin-echo": ADMIN.key},
            persistent=False,
        )
        self.assertEqual(refused.code, 400)
        await refused.content()
        dumped = b""
        # The dump is written off the reactor (its folder may be there first).
        for _ in range(500):
            dumped = b""
            for folder, _, files in os.walk(self.dumps):
                for name in files:
                    if name.startswith("."):  # a dump being written (then renamed)
                        continue
                    with open(os.path.join(folder, name), "rb") as f:
                        dumped += f.read()
            if b"max_tokens" in dumped:
                break
            await deferLater(reactor, 0.02, lambda: None)
        self.assertIn(b"max_tokens", dumped)
        metrics = await treq.get(self.served.url + "/metrics", persistent=False)
        text = (await metrics.content()).decode("utf-8")
        self.assertIn("relay_usage", text)
        await self.served.relay.ledger.flush()
        stored = b""
        for path in (self.db, self.db + "-wal"):  # (the rows may still be in the write-ahead log)
            if os.path.exists(path):
                with open(path, "rb") as f:
                    stored += f.read()
        self.assertIn(b"alice", stored)
        self.assertTrue(self.logged)
        for key in (ADMIN, *KEYS):
            self.assertNotIn(key.key, text)
            self.assertNotIn(key.key.encode(), stored)
            self.assertNotIn(key.key.encode(), dumped)
            self.assertFalse([line for line in self.logged if key.key in line], key.name)


def _limit(scope_type="user", period="daily", amount=100, scope_id="alice"):
    return SpendLimit("spl_x", scope_type, scope_id, period, amount, 0.0, 0.0)


class RuleTests(SynchronousTestCase):
    """Windows, the binding cap and the headers, as the gateway computes them."""

    def test_windows(self):
        at = datetime(2026, 12, 3, 15, 30, tzinfo=timezone.utc).timestamp()  # a Thursday
        utc = lambda *parts: datetime(*parts, tzinfo=timezone.utc).timestamp()  # noqa: E731
        self.assertEqual(window_start("daily", at), utc(2026, 12, 3))
        self.assertEqual(window_end("daily", at), utc(2026, 12, 4))
        self.assertEqual(window_start("weekly", at), utc(2026, 11, 30))
        self.assertEqual(window_end("weekly", at), utc(2026, 12, 7))
        self.assertEqual(window_start("monthly", at), utc(2026, 12, 1))
        self.assertEqual(window_end("monthly", at), utc(2027, 1, 1))

    def test_headers_by_utilization(self):
        def headers(spent):
            return {k.decode(): v.decode() for k, v in standing_headers(Standing(_limit(), Decimal(spent), 1000.0))}

        low = headers(50)
        self.assertEqual((low[UNIFIED + "status"], low[UNIFIED + "overage-utilization"]), ("allowed", "0.5"))
        self.assertNotIn(UNIFIED + "overage-surpassed-threshold", low)
        warned = headers(80)
        self.assertEqual((warned[UNIFIED + "status"], warned[UNIFIED + "overage-surpassed-threshold"]), ("allowed_warning", "0.75"))
        self.assertEqual(warned[UNIFIED + "overage-status"], "allowed_warning")
        nearly = headers("99.7")
        self.assertEqual((nearly[UNIFIED + "overage-surpassed-threshold"], nearly[UNIFIED + "overage-utilization"]), ("0.95", "0.99"))
        self.assertEqual(headers(100)[UNIFIED + "status"], "rejected")

    def test_binding(self):
        full = Standing(_limit(), Decimal(90), 100.0)
        empty = Standing(_limit(period="monthly"), Decimal(10), 300.0)
        over_soon = Standing(_limit(), Decimal(100), 100.0)
        over_late = Standing(_limit(period="weekly"), Decimal(200), 200.0)
        self.assertIs(binding([empty, full]), full)
        self.assertIs(binding([full, over_soon, empty]), over_soon)
        self.assertIs(binding([over_soon, over_late]), over_late)
        self.assertIsNone(binding([]))


class SharedPostgresTests(TestCase):
    """
    Two relays on one PostgreSQL ledger share a cap within the stated bound;
    with PostgreSQL stopped a relay keeps relaying against the last totals
    it read plus its own usage (caps fail open, counting what it saw).
    """

    skip = postgres_server.SKIP_REASON
    REFRESH, FLUSH = 0.5, 0.1

    def setUp(self):
        self.server = postgres_server.PostgresServer()
        self.server.start()
        self.addCleanup(self.server.destroy)
        self.upstream = SimulatedUpstream(mode="lenient")
        listening = reactor.listenTCP(0, Site(self.upstream.resource()), interface="127.0.0.1")
        self.addCleanup(listening.stopListening)
        self.config = RelayConfig(
            listen=(), upstreams=one_upstream("http://127.0.0.1:%d" % (listening.getHost().port,)), dump_dir=None
        ).with_changes(
            relay_keys=KEYS, admin_keys=(ADMIN,), usage_db=self.server.new_database(),
            usage_flush_interval=self.FLUSH, spend_refresh_interval=self.REFRESH,
        )

    def relay(self):
        served = serve_relay(self, self.config, reactor)
        admin = anthropic.Anthropic(api_key=ADMIN.key, base_url=served.url, max_retries=0)
        self.addCleanup(SpendLimitTests.closed, self, admin)
        return served, admin.beta.organization.spend_limits

    async def message(self, served, key: RelayKey):
        calls = Calls(served.url, key.key)
        return await deferToThread(calls.message)

    def spent_cents(self) -> Decimal:
        with postgres_server.psycopg.connect(self.config.usage_db) as connection:
            picos = connection.execute("SELECT COALESCE(SUM(cost_pico_usd), 0) FROM relay_usage").fetchone()[0]
        return Decimal(picos) / Decimal(10**10)

    async def test_two_relays_share_a_cap(self):
        """
        Requests one after the other, alternating between two relays, stop
        on both; with one request in flight at a time, the spend passes the
        shared cap by less than one request on each relay (the bound of
        docs/usage.md, "Several relays, and the overshoot bound";
        tests/test_spend_shares.py holds it with both relays busy).
        """
        (first, limits), (second, _) = self.relay(), self.relay()
        cap = 5
        await deferToThread(limits.set, amount=str(cap), period="monthly", scope={"type": "organization"})
        # The second relay reads the new cap within its refresh interval.
        await deferLater(reactor, self.REFRESH * 2, lambda: None)
        refused = set()
        for n in range(60):
            if len(refused) == 2:
                break
            served = (first, second)[n % 2]
            answer = await self.message(served, KEYS[n % 3])
            if isinstance(answer, anthropic.APIStatusError):
                self.assertEqual(answer.status_code, 429)
                refused.add(served.port)
        self.assertEqual(len(refused), 2, "both relays refused in the end")
        for served in (first, second):
            served.relay.app.batch.run()
            await served.relay.ledger.flush()
        with postgres_server.psycopg.connect(self.config.usage_db) as connection:
            costliest = Decimal(connection.execute("SELECT MAX(cost_pico_usd) FROM relay_usage").fetchone()[0]) / Decimal(10**10)
        spent = self.spent_cents()
        print("\nshared cap %d cents: spent %.4f cents (overshoot %.4f cents; a request costs up to %.4f)" % (cap, spent, spent - cap, costliest))
        self.assertGreaterEqual(spent, cap)
        self.assertLess(spent, cap + 2 * costliest)

    async def test_postgres_stopped_keeps_the_last_totals(self):
        """With PostgreSQL stopped, a relay relays on, counting its own usage onto what it last read, until the cap."""
        served, limits = self.relay()
        await deferToThread(limits.set, amount="4", period="daily", scope={"type": "user", "user_id": "alice"})
        answer = await self.message(served, KEYS[0])
        self.assertEqual(answer.http_response.status_code, 200)
        before = float(answer.headers[UNIFIED + "overage-utilization"])
        await deferLater(reactor, self.REFRESH * 2, lambda: None)
        self.server.stop()
        utilizations, refusal = [], None
        for _ in range(30):
            answer = await self.message(served, KEYS[0])
            if isinstance(answer, anthropic.APIStatusError):
                refusal = answer
                break
            utilizations.append(float(answer.headers[UNIFIED + "overage-utilization"]))
        self.assertTrue(utilizations, "relayed while PostgreSQL was down")
        self.assertGreaterEqual(utilizations[0], before)
        self.assertEqual(utilizations, sorted(utilizations))
        self.assertIsNotNone(refusal, "the cap still stops alice with the database down")
        self.assertEqual(refusal.status_code, 429)
        answer = await self.message(served, KEYS[2])
        self.assertEqual(answer.http_response.status_code, 200)


class SchemaTests(SynchronousTestCase):
    """A ledger of schema 1 or 2 gains the limits' and the shares' tables (and the platform column) when a relay of this version opens it."""

    def test_upgrade_from_schemas_1_and_2(self):
        import sqlite3

        from twisted_relay.ledger_sql import SCHEMA_VERSION, open_ledger
        from twisted_relay.spend_limits_sql import all_limits, set_limit
        from twisted_relay.spend_shares_sql import ShareAsked, take_shares

        for version, dropped in ((1, ("relay_spend_limits", "relay_spend_shares")), (2, ("relay_spend_shares",))):
            folder = self.mktemp()
            os.makedirs(folder)
            path = os.path.join(folder, "usage.sqlite")
            database = open_ledger(path)
            database.open()
            database.close()
            with sqlite3.connect(path) as connection:
                for table in dropped:
                    connection.execute("DROP TABLE %s" % (table,))
                connection.execute("UPDATE relay_usage_meta SET value = ? WHERE name = 'schema_version'", (str(version),))
            database = open_ledger(path)
            database.open()
            limit = set_limit(database, "user", "alice", "daily", 100)
            self.assertEqual([each.id for each in all_limits(database)], [limit.id])
            (taken,) = take_shares(database, "relay-a", [ShareAsked(limit.id, "user", "alice", 0.0, 86400.0, 0)], 10.0)
            self.assertEqual(taken.share_pico, 25 * 10**10)
            database.close()
            with sqlite3.connect(path) as connection:
                found = connection.execute("SELECT value FROM relay_usage_meta WHERE name = 'schema_version'").fetchone()
            self.assertEqual((SCHEMA_VERSION, found[0]), (5, "5"))


class _RateLimitedUpstream(Resource):
    """An upstream answering every Messages request whole, with the account-wide rate-limit headers today's API sends."""

    isLeaf = True

    def render_POST(self, request):
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"anthropic-ratelimit-requests-remaining", b"49")
        request.setHeader(b"anthropic-ratelimit-unified-status", b"allowed")
        request.setHeader(b"anthropic-ratelimit-unified-overage-utilization", b"0.10")
        return json.dumps({
            "id": "msg_01", "type": "message", "role": "assistant", "model": "claude-opus-5-5",
            "content": [{"type": "text", "text": "Hello"}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 1000, "output_tokens": 100},
        }).encode("utf-8")


class UpstreamHeaderTests(TestCase):
    """For a key with a cap, the upstream's own anthropic-ratelimit-* headers never reach the client; for others they pass."""

    async def test_capped_key_gets_only_its_own_standing(self):
        folder = self.mktemp()
        os.makedirs(folder)
        listening = reactor.listenTCP(0, Site(_RateLimitedUpstream()), interface="127.0.0.1")
        self.addCleanup(listening.stopListening)
        config = RelayConfig(
            listen=(), upstreams=one_upstream("http://127.0.0.1:%d" % (listening.getHost().port,)), dump_dir=None
        ).with_changes(relay_keys=KEYS, admin_keys=(ADMIN,), usage_db=os.path.join(folder, "usage.sqlite"))
        served = serve_relay(self, config, reactor)
        limit = await treq.post(
            served.url + "/v1/organizations/spend_limits",
            json.dumps({"scope": {"type": "user", "user_id": "alice"}, "period": "monthly", "amount": "100000"}).encode(),
            headers={"x-api-key": ADMIN.key, "content-type": "application/json"}, persistent=False,
        )
        self.assertEqual(limit.code, 200)
        await limit.content()

        async def headers_of(key):
            response = await treq.post(
                served.url + "/v1/messages",
                json.dumps({"model": "claude-opus-5-5", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}).encode(),
                headers={"x-api-key": key.key, "content-type": "application/json"}, persistent=False,
            )
            await response.content()
            self.assertEqual(response.code, 200)
            return {
                name.decode().lower(): values
                for name, values in response.headers.getAllRawHeaders()
                if name.lower().startswith(b"anthropic-ratelimit-")
            }

        capped = await headers_of(KEYS[0])
        self.assertNotIn("anthropic-ratelimit-requests-remaining", capped)
        self.assertEqual(capped[UNIFIED + "status"], [b"allowed"])
        self.assertEqual(capped[UNIFIED + "overage-utilization"], [b"0"])
        uncapped = await headers_of(KEYS[1])
        self.assertEqual(uncapped["anthropic-ratelimit-requests-remaining"], [b"49"])


class GuardTests(TestCase):
    """The guard over a real SQLite ledger."""

    def started_ledger(self, flush_interval: float):
        """A ledger service on an SQLite file of the test's own, stopped at cleanup."""
        from twisted_relay.ledger import Ledger
        from twisted_relay.ledger_sql import open_ledger

        folder = self.mktemp()
        os.makedirs(folder)
        ledger = Ledger(open_ledger(os.path.join(folder, "usage.sqlite")), reactor=reactor, flush_interval=flush_interval)
        ledger.startService()
        self.addCleanup(ledger.stopService)
        return ledger

    async def test_a_new_cap_counts_what_was_spent_before_it(self):
        """
        A cap set on a key that already spent in the period counts that
        spend at once (the guard reads it before answering), though the
        guard's last read had no period to add up.
        """
        from twisted_relay.spend_guard import SpendGuard
        from twisted_relay.spend_limits_sql import set_limit

        from tests.ledger_records import usage_record

        ledger = self.started_ledger(0.05)
        guard = SpendGuard(ledger, reactor=reactor, refresh_interval=0.1)
        self.assertIsNone(await guard.standing("bob", None))
        ledger.record(usage_record(1, key_name="bob", key_group=None, at=time.time(), cost=Decimal("0.05")))
        await ledger.flush()
        await deferLater(reactor, 0.15, lambda: None)
        self.assertIsNone(await guard.standing("bob", None))  # starts a read: the row leaves the guard's own count
        await deferLater(reactor, 0.15, lambda: None)
        limit = await ledger.on_database(set_limit, "user", "bob", "weekly", 1)
        guard.know(limit)
        standing = await guard.standing("bob", None)
        self.assertEqual((standing.exceeded, standing.spent_cents), (True, Decimal(5)))

    async def test_usage_while_nothing_was_capped_counts_for_a_new_cap(self):
        """
        With no cap set the guard adds nothing up; a cap set again after one
        was deleted counts what was spent meanwhile, written to the ledger or
        not yet, though the period was read while the first cap stood.
        """
        from twisted_relay.spend_guard import SpendGuard
        from twisted_relay.spend_limits_sql import delete_limit, set_limit

        from tests.ledger_records import usage_record

        ledger = self.started_ledger(60)
        guard = SpendGuard(ledger, reactor=reactor, refresh_interval=60)
        first = await ledger.on_database(set_limit, "user", "carol", "daily", 1000)
        guard.know(first)
        self.assertEqual((await guard.standing("carol", None)).spent_cents, 0)
        await ledger.on_database(delete_limit, first.id)
        guard.know(None, forget=first.id)
        self.assertTrue(guard.uncapped())
        ledger.record(usage_record(1, key_name="carol", key_group=None, at=time.time(), cost=Decimal("0.04")))
        await ledger.flush()
        ledger.record(usage_record(2, key_name="carol", key_group=None, at=time.time(), cost=Decimal("0.03")))
        again = await ledger.on_database(set_limit, "user", "carol", "daily", 1000)
        guard.know(again)
        self.assertFalse(guard.uncapped())
        self.assertEqual((await guard.standing("carol", None)).spent_cents, Decimal(7))

    async def test_usage_not_yet_written_counts_in_its_own_window(self):
        """
        What this relay recorded since its last read counts in the window it
        fell in, by key, group and relay: a daily cap leaves out yesterday's
        usage, a weekly one keeps it; another key counts only in the relay's.
        """
        from twisted_relay.spend_guard import SpendGuard
        from twisted_relay.spend_limits import window_start
        from twisted_relay.spend_limits_sql import delete_limit, set_limit

        from tests.ledger_records import usage_record

        # Rows stay unwritten: only the guard's own count sees them.
        ledger = self.started_ledger(60)
        # Two hours into a Wednesday (UTC).
        today = window_start("daily", time.time())
        while time.gmtime(today).tm_wday != 2:
            today -= 86400
        now = today + 7200
        guard = SpendGuard(ledger, reactor=reactor, refresh_interval=60, clock=lambda: now)
        self.assertIsNone(await guard.standing("alice", "team-a"))
        for number, (at, name, group, dollars) in enumerate([
            (now - 3 * 3600, "alice", "team-a", "0.10"),  # yesterday
            (now - 3600, "alice", "team-a", "0.05"),
            (now - 1800, "bob", None, "0.02"),
        ]):
            ledger.record(usage_record(number, at=at, key_name=name, key_group=group, cost=Decimal(dollars)))
        expected = {
            ("user", "alice", "daily"): 5, ("user", "alice", "weekly"): 15,
            ("workspace", "team-a", "daily"): 5, ("organization", "", "daily"): 7,
            ("organization", "", "weekly"): 17,
        }
        for (scope, scope_id, period), cents in expected.items():
            limit = await ledger.on_database(set_limit, scope, scope_id, period, 1000)
            guard.know(limit)
            standing = await guard.standing("alice", "team-a")
            self.assertEqual((standing.limit.id, standing.spent_cents), (limit.id, Decimal(cents)), (scope, period))
            await ledger.on_database(delete_limit, limit.id)
            guard.know(None, forget=limit.id)
