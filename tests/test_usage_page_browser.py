"""
The usage page (``/admin/usage``) as people get it: the relay on
127.0.0.1 over the simulated upstream, three named relay keys making
requests, a real SQLite ledger, and the page opened in headless Chromium
(Debian's ``chromium``) with an admin key; the numbers it shows are checked
against the ledger, and a screenshot is kept in the test's folder. Also who
may open it: an admin key only, and never an admin key on ``/v1/messages``.
"""

from __future__ import annotations

import base64
import os
import shutil
import sqlite3
from collections import defaultdict
from decimal import Decimal
from html import escape
from html.parser import HTMLParser

import treq
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import TestCase

from twisted_relay.config import RelayKey
from twisted_relay.usage_page import dollars

from tests.helpers import encode, messages_body, serve_relay_over_simulated

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KEYS = (
    RelayKey("sk-relay-alice-0001", "alice", "platform"),
    RelayKey("sk-relay-bob-0002", "bob", "platform"),
    RelayKey("sk-relay-carol-0003", "carol", "research"),
)
ADMIN = RelayKey("sk-admin-0123456789", "ops")
# The flags a headless Chromium needs on a machine with no network but loopback.
_CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class _Rows(HTMLParser):
    """The page's key rows: ``data-key`` -> {cell class: text}."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self._row = self._cell = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr" and "data-key" in attrs:
            self._row = self.rows.setdefault(attrs["data-key"], {})
        elif tag == "td" and self._row is not None:
            self._cell = (attrs.get("class") or "").split()[0]
            self._row[self._cell] = ""

    def handle_endtag(self, tag):
        if tag == "td":
            self._cell = None
        elif tag == "tr":
            self._row = None

    def handle_data(self, data):
        if self._row is not None and self._cell is not None:
            self._row[self._cell] += data


class UsagePageTests(TestCase):
    """The page, its numbers, and who may see it."""

    def setUp(self):
        folder = self.mktemp()
        os.makedirs(folder)
        self.folder = folder
        self.db = os.path.join(folder, "usage.sqlite")
        self.served = serve_relay_over_simulated(
            self, relay_keys=KEYS, admin_keys=(ADMIN,), usage_db=self.db, usage_flush_interval=0.1
        )

    def post(self, key: str, model: str = "claude-opus-5-5", **headers):
        all_headers = {"content-type": "application/json", "x-api-key": key}
        all_headers.update(headers)
        return treq.post(
            self.served.url + "/v1/messages",
            encode(messages_body(model=model, metadata={"user_id": "u"})),
            headers=all_headers,
            persistent=False,
        )

    def ledger_by_key(self) -> dict[str, tuple[Decimal, int]]:
        """Cost (dollars) and requests by key name, read from the SQLite file itself."""
        totals: dict = defaultdict(lambda: [Decimal(0), 0])
        with sqlite3.connect(self.db) as connection:
            for name, pico in connection.execute("SELECT key_name, cost_pico_usd FROM relay_usage"):
                totals[name][0] += Decimal(pico or 0) / Decimal(10**12)
                totals[name][1] += 1
        return {name: (cost, count) for name, (cost, count) in totals.items()}

    async def test_page_in_chromium_shows_the_ledger(self):
        """
        After requests by three keys (one an unpriced model), the page in
        headless Chromium shows each key's spend, requests and unpriced count
        as the ledger holds them, and the total.
        """
        if CHROMIUM is None:
            raise self.skipTest("no chromium (Debian's package chromium; .ci/run installs it)")
        plan = [(KEYS[0], "claude-opus-5-5")] * 5 + [(KEYS[1], "claude-sonnet-4-5")] * 3
        plan += [(KEYS[2], "claude-haiku-5-5"), (KEYS[2], "claude-mythos-preview")]
        for key, model in plan:
            response = await self.post(key.key, model)
            self.assertEqual(response.code, 200, await response.text())
            await response.content()
        # The answers metered a moment ago, then their rows written.
        self.served.relay.app.batch.run()
        await self.served.relay.ledger.flush()
        ledger = self.ledger_by_key()
        self.assertEqual({name: count for name, (_, count) in ledger.items()}, {"alice": 5, "bob": 3, "carol": 2})

        port = self.served.port
        url = "http://ops:%s@127.0.0.1:%d/admin/usage" % (ADMIN.key, port)
        flags = _CHROMIUM_FLAGS + ["--user-data-dir=" + os.path.join(self.folder, "chromium")]
        out, err, code = await getProcessOutputAndValue(CHROMIUM, flags + ["--dump-dom", url], env=dict(os.environ))
        self.assertEqual(code, 0, err[-2000:])
        page = _Rows()
        page.feed(out.decode("utf-8"))
        self.assertEqual(set(page.rows), {"alice", "bob", "carol"})
        for name, (cost, count) in ledger.items():
            row = page.rows[name]
            self.assertEqual(row["spend"], dollars(cost), name)
            self.assertEqual(row["requests"], str(count), name)
            self.assertEqual(row["group"], {"alice": "platform", "bob": "platform", "carol": "research"}[name])
        self.assertEqual(page.rows["carol"]["unpriced"], "1")
        self.assertEqual(page.rows["alice"]["unpriced"], "0")
        self.assertGreater(ledger["alice"][0], 0)
        total = sum((cost for cost, _ in ledger.values()), Decimal(0))
        self.assertIn('<strong id="total">%s</strong>' % (escape(dollars(total)),), out.decode("utf-8"))

        screenshot = os.path.join(self.folder, "usage-page.png")
        flags = flags + ["--window-size=1200,500", "--screenshot=" + screenshot]
        out, err, code = await getProcessOutputAndValue(CHROMIUM, flags + [url], env=dict(os.environ))
        self.assertEqual(code, 0, err[-2000:])
        with open(screenshot, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    async def test_only_an_admin_key_opens_it(self):
        """No key or a relay key: 401 asking for Basic credentials; the admin key, as a header or a password: 200."""
        page = self.served.url + "/admin/usage"
        for headers in ({}, {"x-api-key": KEYS[0].key}, {"authorization": "Bearer " + KEYS[0].key}):
            response = await treq.get(page, headers=headers, persistent=False)
            self.assertEqual(response.code, 401)
            self.assertIn(b"Basic", response.headers.getRawHeaders(b"www-authenticate")[0])
            self.assertEqual((await response.json())["error"]["type"], "authentication_error")
        basic = "Basic " + base64.b64encode(b"anyone:" + ADMIN.key.encode()).decode()
        for headers in ({"x-api-key": ADMIN.key}, {"authorization": basic}):
            response = await treq.get(page, headers=headers, persistent=False)
            self.assertEqual(response.code, 200)
            self.assertIn(b"Spend by relay key", await response.content())
        response = await treq.get(page + "?days=0", headers={"x-api-key": ADMIN.key}, persistent=False)
        self.assertEqual(response.code, 400)

    async def test_ledger_unreadable(self):
        """A ledger the relay cannot read: 503 in Anthropic's shape, not a traceback."""
        # The answers metered a moment ago, then their rows written.
        self.served.relay.app.batch.run()
        await self.served.relay.ledger.flush()
        with sqlite3.connect(self.db) as connection:
            connection.execute("DROP TABLE relay_usage")
        response = await treq.get(
            self.served.url + "/admin/usage", headers={"x-api-key": ADMIN.key}, persistent=False
        )
        self.assertEqual(response.code, 503)
        body = await response.json()
        self.assertEqual(body["type"], "error")
        self.assertIn("usage ledger cannot be read", body["error"]["message"])
        self.flushLoggedErrors()

    async def test_admin_key_refused_on_messages(self):
        """The admin key is no relay key: 401, never relayed, never in the ledger."""
        response = await self.post(ADMIN.key)
        self.assertEqual(response.code, 401)
        body = await response.json()
        self.assertEqual(body["error"]["type"], "authentication_error")
        self.assertNotIn(ADMIN.key, str(body))
        self.assertEqual(response.headers.getRawHeaders(b"x-should-retry"), [b"false"])
        # The answers metered a moment ago, then their rows written.
        self.served.relay.app.batch.run()
        await self.served.relay.ledger.flush()
        self.assertEqual(self.ledger_by_key(), {})


class OpenRelayAdminKeyTests(TestCase):
    """A relay open to every client (no relay keys) still refuses an admin key on /v1/messages."""

    async def test_admin_key_never_sent_upstream(self):
        served = serve_relay_over_simulated(self, admin_keys=(ADMIN,))
        response = await treq.post(
            served.url + "/v1/messages",
            encode(messages_body()),
            headers={"content-type": "application/json", "authorization": "Bearer " + ADMIN.key},
            persistent=False,
        )
        self.assertEqual(response.code, 401)
        # As a browser's Basic password too (the admin routes take it so).
        basic = "Basic " + base64.b64encode(b"x:" + ADMIN.key.encode()).decode()
        response = await treq.post(
            served.url + "/v1/messages",
            encode(messages_body()),
            headers={"content-type": "application/json", "authorization": basic},
            persistent=False,
        )
        self.assertEqual(response.code, 401)
        # Without the admin key, the open relay relays.
        response = await treq.post(
            served.url + "/v1/messages", encode(messages_body()), headers={"content-type": "application/json"},
            persistent=False,
        )
        self.assertEqual(response.code, 200)

    async def test_admin_routes_off_without_admin_keys(self):
        served = serve_relay_over_simulated(self)
        response = await treq.get(served.url + "/admin/usage", persistent=False)
        self.assertEqual(response.code, 404)
        self.assertEqual((await response.json())["error"]["type"], "not_found_error")
