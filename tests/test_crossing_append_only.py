"""
Property tests of append-only toward each upstream (``docs/id-translation.md``,
invariant 13): for one conversation, every request the relay sends an
upstream carries, up to each of that upstream's own thinking blocks, exactly
the prefix, by value, it sent when the block was made.

Hypothesis draws a conversation that alternates every few turns between two
model upstreams of different rules, with adaptive thinking (explicit or
``thinking`` left out) or manual thinking:

- ``kimi``: ``original``, its own ids ``functions.NAME:N`` (N restarts every
  answer, so they repeat), which a strict upstream's pattern refuses;
- ``strict``: ``unique``, Anthropic's pattern, server tools with thinking
  between them (adaptive), ids of its own history reused now and then, and,
  under manual thinking, Anthropic's tool-loop rule.

Each model signs a thinking block over the prefix it was made on (``system``,
``tools``, the messages it was sent, and the blocks of its answer before it),
compared as JSON values (key order and formatting do not matter), and checks
every request as a prefix-checking upstream does: every thinking block it
gets back must verify against the prefix the request itself gives it. And,
literally, each request's body must extend, as a JSON value, the body of each
earlier turn at which that upstream made a thinking block, followed by its
answer up to that block.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.translation import ORIGINAL, THINKING_MARK, UNIQUE, UpstreamRules, translate_request

KIMI = UpstreamRules("kimi", ORIGINAL, own_ids=r"^functions\.[A-Za-z]+:[0-9]+$", mark_thinking=True)
STRICT = UpstreamRules("strict", UNIQUE, mark_thinking=True)
SIGNED = {"thinking": "signature", "redacted_thinking": "data"}
SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"}, {"type": "text", "text": "Be brief."}]
TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}}, {"type": "web_search_20250305", "name": "web_search"}]
REGIMES = {"adaptive": {"type": "adaptive"}, "left out": None,
           "manual": {"type": "enabled", "budget_tokens": 1024}}

TOOL, SERVER, TEXT, THINK = range(4)
turn = st.tuples(st.integers(0, 255), st.lists(st.tuples(st.integers(0, 3), st.integers(0, 255)), max_size=4),
                 st.integers(0, 7))


def value(obj) -> str:
    """A JSON value's canonical form: key order and formatting do not matter."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def chain(body: dict) -> list:
    """
    ``chain[i]``: the digest of ``system``, ``tools`` and the first ``i``
    messages of ``body``, each compared as a JSON value.
    """
    digest = hashlib.sha256(value([body.get("system"), body.get("tools")]).encode()).digest()
    out = [digest]
    for message in body["messages"]:
        digest = hashlib.sha256(digest + value(message).encode()).digest()
        out.append(digest)
    return out


class Upstream:
    """A model upstream that signs its thinking over its prefix and checks it, as today's API does."""

    def __init__(self, case: SynchronousTestCase, rules: UpstreamRules, manual: bool) -> None:
        self.case = case
        self.rules = rules
        # what ``thinking`` left out means: adaptive on a model of today,
        # off on one of manual thinking
        self.left_out = {"type": "disabled" if manual else "adaptive"}
        self.secret = b"key of " + rules.name.encode()
        # per thinking block made: (turn, how many messages were sent then,
        # the digest of the body sent then, how many blocks of the answer up
        # to and including the block, and their value)
        self.made: list = []
        self.fresh = 0

    def sign(self, prefix: bytes, before: list, text: str) -> str:
        return hmac.new(self.secret, prefix + value([before, text]).encode(), hashlib.sha256).hexdigest()

    def check(self, body: dict, number: int) -> None:
        case, name = self.case, self.rules.name
        messages = body["messages"]
        prefixes = chain(body)
        for mi, message in enumerate(messages):
            content = message["content"]
            for bi, block in enumerate(content if isinstance(content, list) else ()):
                field = SIGNED.get(block["type"])
                if field is not None:
                    case.assertFalse(block[field].startswith(THINKING_MARK), f"a mark reached {name}")
                    expected = self.sign(prefixes[mi], content[:bi], block.get("thinking", ""))
                    case.assertEqual(block[field], expected, f"turn {number}: messages.{mi}.content.{bi}: "
                                     f"Invalid `signature` in `thinking` block at {name}: bound to a different "
                                     "conversation")
        # literally: this body extends, as a JSON value, the body of every
        # turn at which this upstream made a thinking block, up to that block
        for made_at, n, digest, count, answer in self.made:
            case.assertTrue(len(messages) > n and prefixes[n] == digest and value(
                messages[n]["content"][:count]) == answer,
                f"turn {number} at {name} does not extend turn {made_at} up to its thinking")
        # Anthropic's rule, manual thinking only
        if body.get("thinking", {}).get("type") == "enabled":
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            if last is not None and any(isinstance(m["content"], list) and any(
                    b["type"] == "tool_result" for b in m["content"]) for m in messages[last + 1:]):
                case.assertIn(messages[last]["content"][0]["type"], SIGNED,
                              f"{name}: a final assistant message must start with a thinking block")

    def answer(self, body: dict, number: int, items: list, history_ids: list) -> list:
        """
        The answer to ``body``, thinking signed over its prefix: thinking,
        text and server tools (with thinking between them, adaptive), then
        the client tools, which end an answer.
        """
        thinking = body.get("thinking", self.left_out)
        manual = thinking.get("type") == "enabled"
        thinks = manual or thinking.get("type") == "adaptive"
        prefix = chain(body)[-1]
        n = len(body["messages"])
        blocks: list = []
        tools: list = []

        def think(kind: str) -> None:
            text = f"thought {number}.{len(blocks)} at {self.rules.name}"
            block = {"type": "thinking", "thinking": text} if kind == "thinking" else {"type": kind}
            block[SIGNED[kind]] = self.sign(prefix, blocks, block.get("thinking", ""))
            blocks.append(block)
            self.made.append((number, n, prefix, len(blocks), value(blocks)))

        if thinks:
            think("redacted_thinking" if number % 7 == 6 else "thinking")
        for kind, a in items:
            if kind == THINK and thinks and not manual:
                think("thinking")
            elif kind == SERVER and self.rules is STRICT:
                self.fresh += 1
                server_id = f"srvtoolu_{self.rules.name}{self.fresh}"
                blocks.append({"type": "server_tool_use", "id": server_id, "name": "web_search", "input": {"q": a}})
                blocks.append({"type": "web_search_tool_result", "tool_use_id": server_id, "content": []})
            elif kind == TOOL:
                if self.rules is KIMI:
                    tool_id = f"functions.Bash:{len(tools)}"
                elif history_ids and a % 3 == 0:
                    tool_id = history_ids[a % len(history_ids)]  # a strict upstream that reuses an id
                else:
                    self.fresh += 1
                    tool_id = f"toolu_{self.fresh:04d}"
                tools.append({"type": "tool_use", "id": tool_id, "name": "Bash", "input": {"n": a}})
            else:
                blocks.append({"type": "text", "text": f"text {a}"})
        blocks += tools
        # now and then an answer of thinking only (a max_tokens stop), which
        # the other upstream's requests leave out whole
        if not any(b["type"] not in SIGNED for b in blocks) and not (blocks and number % 4 == 1):
            blocks.append({"type": "text", "text": "done"})
        return blocks


def through_relay(t, blocks: list, streaming: bool, stats: dict) -> list:
    """The answer as the client receives it, whole or as a stream would carry it."""
    r = t.response()
    blocks = json.loads(json.dumps(blocks))
    if not streaming:
        message = {"role": "assistant", "content": blocks}
        r.translate_message(message)
        stats["renamed"] += len(r.rewrites)
        return message["content"]
    out = []
    for block in blocks:
        start = dict(block)
        if start["type"] == "thinking":
            start["signature"] = ""
        r.translate_block(start)
        if block["type"] == "thinking":
            delta = {"type": "signature_delta", "signature": block["signature"]}
            r.translate_delta(delta)
            start["signature"] = delta["signature"]
        out.append(start)
    stats["renamed"] += len(r.rewrites)
    return out


class AppendOnlyTests(SynchronousTestCase):
    """Each upstream gets, up to each of its thinking blocks, the prefix it made it on."""

    def converse(self, regime: str, script: list) -> dict:
        upstreams = [Upstream(self, KIMI, regime == "manual"), Upstream(self, STRICT, regime == "manual")]
        messages: list = [{"role": "user", "content": "start"}]
        at, stats = 0, {"own back": 0, "disabled": 0, "moves": 0, "renamed": 0, "encoded": 0}
        for number, (move, items, flags) in enumerate(script):
            if move % 3 == 0 and number:
                at, stats["moves"] = 1 - at, stats["moves"] + 1
            upstream = upstreams[at]
            body = {"model": "m", "max_tokens": 64, "system": SYSTEM, "tools": TOOLS,
                    "tool_choice": {"type": "auto"}, "messages": messages}
            if REGIMES[regime] is not None:
                body["thinking"] = REGIMES[regime]
            before = value(body)
            t = translate_request(body, upstream.rules)
            self.assertEqual(value(body), before, "the client's body was mutated")
            sent = t.upstream_body
            # nothing but messages changes, and thinking only under manual thinking
            fields = {k: v for k, v in body.items() if k != "messages"}
            if t.thinking_disabled:
                self.assertEqual(regime, "manual")
                del fields["thinking"]
                stats["disabled"] += 1
            self.assertEqual(value({k: v for k, v in sent.items() if k != "messages"}), value(fields))
            upstream.check(sent, number)
            own = sum(1 for m in messages if isinstance(m["content"], list) for b in m["content"]
                      if b["type"] in SIGNED and b[SIGNED[b["type"]]].startswith(
                          THINKING_MARK + upstream.rules.name + ":"))
            carried = sum(1 for m in sent["messages"] if isinstance(m["content"], list)
                          for b in m["content"] if b["type"] in SIGNED)
            self.assertEqual(carried, own, "an upstream did not get all of its own thinking back")
            stats["own back"] += carried
            history_ids = [b["id"] for m in sent["messages"] if isinstance(m["content"], list)
                           for b in m["content"] if b["type"] == "tool_use"]
            blocks = upstream.answer(sent, number, items, history_ids)
            stats["encoded"] += len(t.table.encodings)
            answer = through_relay(t, blocks, bool(flags & 1), stats)
            messages = messages + [{"role": "assistant", "content": answer}]
            results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "ok"}
                       for b in answer if b["type"] == "tool_use"]
            if results:
                if flags & 2:
                    results.append({"type": "text", "text": "<system-reminder>keep going</system-reminder>"})
                messages.append({"role": "user", "content": results})
            else:
                messages.append({"role": "user", "content": [{"type": "text", "text": "next"}]})
        return stats

    @settings(max_examples=40, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(regime=st.sampled_from(sorted(REGIMES)), script=st.lists(turn, min_size=20, max_size=30))
    def test_append_only_toward_each_upstream(self, regime: str, script: list) -> None:
        """
        Between a Kimi-style and a strict upstream, adaptive or manual, every
        request verifies at its upstream: each of its thinking blocks comes
        back on exactly the prefix it was made on.
        """
        stats = self.converse(regime, script)
        if regime != "manual":
            self.assertEqual(stats["disabled"], 0)

    def test_a_long_alternating_session(self) -> None:
        """
        A fixed 120-turn tool loop alternating every 3 turns, with server
        tools and thinking between them: each upstream gets back, at every
        turn, every thinking block it made, on its prefix.
        """
        script = [(0 if n % 3 == 0 else 1, [(TOOL, n), (SERVER, n), (THINK, n), (TOOL, n + 3)], n % 4)
                  for n in range(120)]
        for regime in ("adaptive", "left out"):
            stats = self.converse(regime, script)
            self.assertEqual(stats["disabled"], 0)
            self.assertGreater(stats["moves"], 30)
            self.assertGreater(stats["own back"], 3000)
            self.assertGreater(stats["renamed"], 10)
            self.assertGreater(stats["encoded"], 100)
        stats = self.converse("manual", script)
        self.assertGreater(stats["disabled"], 100)
        # every other answer without tools: some of thinking only, which the
        # other upstream's requests leave out whole
        script = [(0 if n % 3 == 0 else 1, [] if n % 2 else [(TOOL, n)], n % 4) for n in range(60)]
        for regime in REGIMES:
            self.converse(regime, script)

    def test_the_upstream_refuses_an_edited_prefix(self) -> None:
        """
        The model upstream is a real check: the same conversation, with one
        earlier message edited on its way, or one of its thinking blocks
        left out of the middle, is refused.
        """
        upstream = Upstream(self, STRICT, False)
        body = {"model": "m", "max_tokens": 8, "system": SYSTEM, "tools": TOOLS,
                "messages": [{"role": "user", "content": "a"}]}
        first = upstream.answer(body, 0, [(TEXT, 1)], [])
        body["messages"] = body["messages"] + [{"role": "assistant", "content": first},
                                               {"role": "user", "content": "b"}]
        second = upstream.answer(body, 1, [(TEXT, 2)], [])
        body["messages"] = body["messages"] + [{"role": "assistant", "content": second},
                                               {"role": "user", "content": "c"}]
        upstream.check(body, 2)
        edited = json.loads(json.dumps(body))
        edited["messages"][0]["content"] = "A"
        self.assertRaises(self.failureException, upstream.check, edited, 2)
        middle = json.loads(json.dumps(body))
        del middle["messages"][1]["content"][0]
        self.assertRaises(self.failureException, upstream.check, middle, 2)
        reordered = json.loads(json.dumps(body))
        reordered["messages"][0] = {"content": "a", "role": "user"}
        upstream.check(reordered, 2)  # key order is not an edit
