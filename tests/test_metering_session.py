"""
Issue 23's "who spent what", end to end: a 300-turn run of the official
``anthropic`` SDK through the relay on 127.0.0.1, over three named relay
keys, in front of the simulated upstream reporting every usage field (the
prompt cache, fast mode, US-only inference, server tools, refusals served by
a fallback model, compactions), cutting some streams and ending others with
an error event, while the client abandons others midway. The totals per key
and model the relay hands its ledger, and those of ``/metrics``, equal the
sums the upstream reported (its tally), tokens exactly; the cost is the price
table's arithmetic, done again here from the upstream's own report.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter, defaultdict
from decimal import Decimal

from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.server import Site

from twisted_relay.config import RelayConfig, RelayKey, one_upstream
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.usage import TOKEN_KINDS
from twisted_relay.usage_page import dollars

from tests.helpers import TOOLS, RecordingLedger, serve_relay

try:
    import anthropic
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:  # pragma: no cover - the test extra installs them
    anthropic = None

#: The admin key that opens /admin/usage.
ADMIN_KEY = "sk-admin-session-0001"
#: The three users: name, group, relay key.
USERS = (
    ("alice", "platform", "sk-relay-alice-0001"),
    ("bob", "platform", "sk-relay-bob-0002"),
    ("carol", "research", "sk-relay-carol-0003"),
)
#: The models the run uses; the last one is in no price table.
MODELS = (
    "claude-fable-5-2",
    "claude-opus-5-5",
    "claude-sonnet-5-5",
    "claude-haiku-5-5",
    "claude-sonnet-4-5",
    "claude-mythos-preview",
)
UPSTREAM_KEY = "sk-ant-upstream-metered-0009"
WEB_FETCH = [{"type": "web_fetch_20250910", "name": "web_fetch"}]
SESSION_ID = "session-metered-run"
FALLBACK_BETA = "server-side-fallback-2026-07-01"
# A system prompt long enough to be cached (over 512 tokens), for an hour.
SYSTEM = [{
    "type": "text",
    "text": "You check the weather for a travel desk. " * 80,
    "cache_control": {"type": "ephemeral", "ttl": "1h"},
}]

# The price table's arithmetic, written again from docs/usage.md: US dollars
# per million tokens (input, output, 5-minute write, 1-hour write, cache
# read) and the fast-mode multiplier (None: no fast mode).
RATES = {
    "claude-fable-5-2": ("8", "40", "10", "16", "0.20", "2"),
    "claude-opus-5-5": ("4", "20", "5", "8", "0.20", "2"),
    "claude-sonnet-5-5": ("2", "10", "2.50", "4", "0.10", None),
    "claude-sonnet-5": ("2", "10", "2.50", "4", "0.20", None),
    "claude-haiku-5-5": ("0.10", "0.50", "0.125", "0.20", "0.01", None),
    "claude-sonnet-4-5": ("3", "15", "3.75", "6", "0.30", None),
}
WEB_SEARCH = Decimal("0.01")
US_ONLY = Decimal("1.1")


def expected_cost(model: str, usage: dict) -> Decimal | None:
    """What an answer the upstream reported costs, or ``None`` when no rate prices it."""
    entries = usage.get("iterations") or [usage]
    factor = US_ONLY if usage.get("inference_geo") == "us" else Decimal(1)
    total = Decimal(0)
    for entry in entries:
        rates = RATES.get(entry.get("model") or model)
        if rates is None:
            return None
        rate_in, rate_out, rate_5m, rate_1h, rate_read, fast = (
            None if value is None else Decimal(value) for value in rates
        )
        speed = factor
        if usage.get("speed") == "fast":
            if fast is None:
                return None
            speed *= fast
        one_hour = (entry.get("cache_creation") or {}).get("ephemeral_1h_input_tokens", 0)
        five_minutes = (entry.get("cache_creation_input_tokens") or 0) - one_hour
        total += speed * (
            entry.get("input_tokens", 0) * rate_in
            + entry.get("output_tokens", 0) * rate_out
            + five_minutes * rate_5m
            + one_hour * rate_1h
            + entry.get("cache_read_input_tokens", 0) * rate_read
        ) / 1_000_000
    searches = (usage.get("server_tool_use") or {}).get("web_search_requests", 0)
    return total + searches * WEB_SEARCH


def _marked(messages: list) -> list:
    """The history with a 5-minute cache breakpoint on its last block (as Claude Code sends it)."""
    last = dict(messages[-1])
    content = last["content"]
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    content = [*content[:-1], dict(content[-1], cache_control={"type": "ephemeral"})]
    return [*messages[:-1], dict(last, content=content)]


def _feed_back(messages: list, message) -> None:
    content = [block.model_dump(exclude_none=True) for block in message.content]
    uses = [block for block in content if block["type"] == "tool_use"]
    messages.append({"role": "assistant", "content": content})
    results = [{"type": "tool_result", "tool_use_id": block["id"], "content": "sunny, 21 C"} for block in uses]
    messages.append({"role": "user", "content": results or "Go on."})


def metered_run(base_url: str, turns: int, conversation_turns: int = 6) -> Counter:
    """
    Drive ``turns`` turns through the relay, in conversations of
    ``conversation_turns`` turns, each of one user and one model (users in
    turn; models change every three conversations): a whole answer, a
    stream read to its end, and a stream the client abandons after its
    first content delta, in turn. Fast mode on Fable 5.2 and Opus 5.5 every
    other turn, US-only inference every fifth (not on year-old models),
    ``fallbacks`` on Sonnet 5.5. A failed turn is sent again by the next.

    Runs in a thread. Returns what the client saw, by outcome.
    """
    clients = {
        name: anthropic.Anthropic(
            base_url=base_url, api_key=key, max_retries=0, timeout=30,
            default_headers={"x-claude-code-session-id": SESSION_ID},
        )
        for name, _, key in USERS
    }
    seen: Counter = Counter()
    try:
        for conversation in range(math.ceil(turns / conversation_turns)):
            name = USERS[conversation % len(USERS)][0]
            model = MODELS[(conversation // len(USERS)) % len(MODELS)]
            client = clients[name]
            messages = [{"role": "user", "content": "Conversation %d: the weather, city by city." % (conversation,)}]
            for step in range(conversation_turns):
                turn = conversation * conversation_turns + step
                if turn >= turns:
                    break
                params = dict(
                    model=model, max_tokens=256, system=SYSTEM, messages=_marked(messages), tools=TOOLS + WEB_FETCH,
                    metadata={"user_id": name},
                )
                if model in ("claude-fable-5-2", "claude-opus-5-5") and turn % 2:
                    params["speed"] = "fast"
                if turn % 5 == 0 and model not in ("claude-sonnet-4-5", "claude-mythos-preview"):
                    params["inference_geo"] = "us"
                if model == "claude-sonnet-5-5":
                    params["extra_body"] = {"fallbacks": "default"}
                    params["extra_headers"] = {"anthropic-beta": FALLBACK_BETA}
                seen[_turn(client, params, messages, ("json", "stream", "abandon")[turn % 3])] += 1
    finally:
        for client in clients.values():
            client.close()
    return seen


def _turn(client, params: dict, messages: list, kind: str) -> str:
    """One turn of ``kind``; what became of it."""
    try:
        if kind == "json":
            _feed_back(messages, client.messages.create(**params))
            return "answered"
        if kind == "stream":
            with client.messages.stream(**params) as stream:
                _feed_back(messages, stream.get_final_message())
            return "streamed"
        stream = client.messages.create(stream=True, **params)
        try:
            for event in stream:
                if event.type == "content_block_delta":
                    return "abandoned"
            return "ended before the client left"
        finally:
            stream.close()
    except anthropic.APIStatusError as e:
        # After a 200, an error event (the upstream's, or the relay's for a cut).
        return "stream failed" if e.status_code == 200 else "refused %d" % (e.status_code,)
    except anthropic.APIError:
        return "stream failed"


def _scrape(text: str) -> dict:
    """The usage samples of ``/metrics``: ``{(metric, key, group, model, kind): value}``."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("relay_usage_") or not sample.name.endswith("_total"):
                continue
            labels = sample.labels
            kind = labels.get("kind") or labels.get("tool") or "/".join(
                "%s=%s" % (name, labels[name]) for name in ("complete", "priced") if name in labels
            )
            found[(sample.name, labels["key"], labels["group"], labels["model"], kind)] = sample.value
    return found


class MeteredRunTests(TestCase):
    """The 300-turn run of the issue's "Done when"."""

    timeout = 300

    def setUp(self) -> None:
        if anthropic is None:  # pragma: no cover
            raise SkipTest("the anthropic SDK is not installed")
        self.upstream = SimulatedUpstream(
            mode="lenient",
            event_delay=0.004,
            server_tools=True,
            refusals=0.15,
            compactions=0.05,
            stream_errors=0.05,
            stream_cuts=0.1,
            keep_reports=10_000,
            require_key=UPSTREAM_KEY,
        )
        port = reactor.listenTCP(0, Site(self.upstream.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        config = RelayConfig(
            listen=(),
            upstreams=one_upstream("http://127.0.0.1:%d" % (port.getHost().port,), key=UPSTREAM_KEY),
            dump_dir=None,
            relay_keys=tuple(RelayKey(key, name, group) for name, group, key in USERS),
            admin_keys=(RelayKey(ADMIN_KEY, "ops"),),
            usage_db=os.path.join(self.mktemp() + "-usage.sqlite"),
            usage_flush_interval=0.2,
        )
        self.ledger = RecordingLedger()
        self.relay = serve_relay(self, config, reactor, ledger=self.ledger)
        # Every record goes on to the relay's own ledger (the SQLite file of --usage-db).
        self.ledger.then = self.relay.relay.ledger
        self.usage_db = config.usage_db

    async def _settled(self, answers: int) -> None:
        """Wait until the relay has recorded ``answers`` answers and the upstream has told
        its tally of as many (an abandoned stream's ends once its connection is gone)."""
        for _ in range(200):
            if len(self.ledger.records) >= answers and len(self.upstream.reported.answers) >= answers:
                return
            await deferLater(reactor, 0.025, lambda: None)

    async def test_totals_equal_what_the_upstream_reported(self) -> None:
        """Per key and model: the ledger's tokens equal the upstream's tally, aborted and cut
        streams included; their cost is the price table's arithmetic on what the upstream
        reported (an unpriced model is flagged, not guessed); /metrics says the same."""
        seen = await deferToThread(metered_run, self.relay.url, 300)
        await self._settled(sum(seen.values()))
        records = self.ledger.records
        # Every turn got an answer from the upstream (a refusal served by a fallback too).
        self.assertEqual(sum(seen.values()), 300, seen)
        self.assertEqual(len(records), 300)
        self.assertEqual(len(self.upstream.reported.answers), 300)

        # The run went through every path that matters.
        self.assertGreater(seen["abandoned"], 50, seen)
        self.assertGreater(seen["stream failed"], 0, seen)
        partial = [r for r in records if r.partial]
        # A stream the client leaves after its last event reached the relay ends complete.
        left = len([r for r in partial if r.status == 499])
        self.assertTrue(0 < left <= seen["abandoned"], (left, seen))
        self.assertGreater(len([r for r in partial if r.status == 200]), 0)
        self.assertTrue(all(r.stream for r in partial))
        self.assertTrue(all(r.tokens["input_tokens"] + r.tokens["cache_read_tokens"] > 0 for r in partial))
        usages = [a.usage for a in self.upstream.reported.answers]
        self.assertTrue(any(u.get("speed") == "fast" for u in usages))
        self.assertTrue(any(u.get("inference_geo") == "us" for u in usages))
        self.assertTrue(any(i["type"] == "fallback_message" for u in usages for i in u.get("iterations", ())))
        self.assertTrue(any(i["type"] == "compaction" for u in usages for i in u.get("iterations", ())))

        # Names, groups and Claude Code's session, never keys.
        groups = {name: group for name, group, _ in USERS}
        self.assertEqual({r.key_name for r in records}, set(groups))
        self.assertTrue(all(r.key_group == groups[r.key_name] for r in records))
        self.assertTrue(all(r.session_id == SESSION_ID for r in records))
        self.assertTrue(all(r.upstream == "default" for r in records))

        # Tokens: the relay's records against the upstream's own tally.
        ledger_tokens: dict = defaultdict(lambda: dict.fromkeys(TOKEN_KINDS, 0))
        for record in records:
            totals = ledger_tokens[(record.key_name, record.model)]
            for kind in TOKEN_KINDS:
                totals[kind] += record.tokens[kind]
        self.assertEqual(dict(ledger_tokens), self.upstream.reported.totals())
        self.assertEqual({model for _, model in ledger_tokens} >= set(MODELS) - {"claude-sonnet-5-5"}, True)
        for kind in TOKEN_KINDS:
            self.assertGreater(sum(t[kind] for t in ledger_tokens.values()), 0, kind)

        # Cost: the price table's arithmetic on what the upstream reported.
        expected: dict = defaultdict(Decimal)
        unpriced: Counter = Counter()
        for answer in self.upstream.reported.answers:
            cost = expected_cost(answer.model, answer.usage)
            if cost is None:
                unpriced[(answer.user, answer.model)] += 1
            else:
                expected[(answer.user, answer.model)] += cost
        ledger_cost: dict = defaultdict(Decimal)
        ledger_unpriced: Counter = Counter()
        for record in records:
            if record.cost is None:
                ledger_unpriced[(record.key_name, record.model)] += 1
            else:
                ledger_cost[(record.key_name, record.model)] += record.cost
        self.assertEqual(dict(ledger_cost), dict(expected))
        self.assertEqual(ledger_unpriced, unpriced)
        self.assertEqual({model for _, model in unpriced}, {"claude-mythos-preview"})

        # /metrics agrees: tokens exactly, cost to a float's precision.
        text = await deferToThread(_get, self.relay.url + "/metrics")
        for _, _, key in USERS:
            self.assertNotIn(key, text)
        scraped = _scrape(text)
        labels = {"input_tokens": "input", "output_tokens": "output", "cache_creation_5m_tokens": "cache_write_5m",
                  "cache_creation_1h_tokens": "cache_write_1h", "cache_read_tokens": "cache_read"}
        tools = {"web_search_requests": "web_search", "web_fetch_requests": "web_fetch"}
        from_ledger = {}
        for (name, model), totals in ledger_tokens.items():
            for kind, count in totals.items():
                if count:
                    metric, label = (
                        ("relay_usage_tokens_total", labels[kind]) if kind in labels
                        else ("relay_usage_server_tool_requests_total", tools[kind])
                    )
                    from_ledger[(metric, name, groups[name], model, label)] = count
        counted = {k: v for k, v in scraped.items() if k[0] != "relay_usage_cost_usd_total"
                   and k[0] != "relay_usage_answers_total"}
        self.assertEqual(counted, {k: float(v) for k, v in from_ledger.items()})
        for (name, model), cost in ledger_cost.items():
            self.assertAlmostEqual(scraped[("relay_usage_cost_usd_total", name, groups[name], model, "")],
                                   float(cost), delta=1e-9 * max(1.0, float(cost)))
        await self._ledger_report_and_page_agree(ledger_tokens, ledger_cost, ledger_unpriced)
        answers = Counter()
        for (metric, name, _, model, outcome), value in scraped.items():
            if metric == "relay_usage_answers_total":
                answers[(name, model, outcome)] += value
        self.assertEqual(
            answers,
            Counter(
                (r.key_name, r.model, "complete=%s/priced=%s" % (str(not r.partial).lower(), str(r.priced).lower()))
                for r in records
            ),
        )

    async def _ledger_report_and_page_agree(self, tokens: dict, cost: dict, unpriced: Counter) -> None:
        """The SQLite ledger, ``twisted-relay-usage`` and ``/admin/usage`` hold the same totals."""
        ledger = self.relay.relay.ledger
        self.assertTrue(await ledger.flush())
        stored = {(t.group["key"], t.group["model"]): t for t in await ledger.totals(["key", "model"])}
        self.assertEqual({pair: dict(t.tokens) for pair, t in stored.items()}, tokens)
        self.assertEqual({pair: t.cost for pair, t in stored.items() if pair in cost}, cost)
        self.assertEqual(Counter({pair: t.unpriced for pair, t in stored.items() if t.unpriced}), unpriced)

        done = await deferToThread(
            subprocess.run,
            [sys.executable, "-m", "twisted_relay.ledger_report", "--usage-db", self.usage_db,
             "--by", "key,model", "--format", "json"],
            capture_output=True, timeout=60,
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        report = json.loads(done.stdout)
        self.assertEqual({(r["key"], r["model"]): r["tokens"] for r in report["rows"]}, tokens)
        self.assertEqual({(r["key"], r["model"]): Decimal(r["cost_usd"]) for r in report["rows"] if (r["key"], r["model"]) in cost}, cost)

        page = await deferToThread(_get, self.relay.url + "/admin/usage", {"x-api-key": ADMIN_KEY})
        by_key: dict = defaultdict(Decimal)
        for (name, _), amount in cost.items():
            by_key[name] += amount
        for name, amount in by_key.items():
            self.assertIn('<td class="name">%s</td>' % (name,), page)
            self.assertIn('<td class="spend num">%s</td>' % (dollars(amount),), page)


def _get(url: str, headers: dict | None = None) -> str:
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
        return response.read().decode("utf-8")
