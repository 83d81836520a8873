"""
Property tests for conversations that move between upstreams of different
rules (``docs/id-translation.md``, invariants 8-12).

Hypothesis draws two or three upstreams and a 30+ turn script: which upstream
answers each turn (the conversation moves every few turns), whether thinking
is off, manual or adaptive, and what each answer holds. Three model upstreams, written here
independently of the code under test, each check every request they are sent
the way their real counterparts would, and answer it:

- ``strict``: ``unique``, Anthropic's id pattern, reuses ids from a small
  pool, server tools, signed thinking, and Anthropic's tool-loop rule;
- ``kimi``: ``original`` with its own ids ``functions.NAME:N`` (N restarts
  every answer), signed thinking;
- ``blank``: ``unique``, ids ``^[A-Za-z0-9_]+$``, emits empty, missing and
  colliding (``call_0``) ids, signed thinking, the tool-loop rule.

The client feeds every translated answer back, with its tool results, as a
client would. Truth is kept by declaration order (declarations are never
left out, so the k-th declaration is the same block on both sides).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

import ujson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.translation import (
    ORIGINAL,
    THINKING_MARK,
    UNIQUE,
    UpstreamRules,
    translate_request,
)

KIMI_FORM = r"^functions\.[A-Za-z]+:[0-9]+$"
NAMES = ("Bash", "Read", "Edit")
SIGNED = ("thinking", "redacted_thinking")


def sign(secret: bytes, text: str) -> str:
    return hmac.new(secret, text.encode("utf-8"), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Model:
    """One model upstream: its rules and how it behaves."""

    rules: UpstreamRules
    style: str
    pattern: str | None
    tool_loop_rule: bool

    @property
    def secret(self) -> bytes:
        return b"secret of " + self.rules.name.encode()


MODELS = {
    "strict": Model(UpstreamRules("strict", UNIQUE, mark_thinking=True), "strict",
                    r"^[a-zA-Z0-9_-]+$", True),
    "kimi": Model(UpstreamRules("kimi", ORIGINAL, own_ids=KIMI_FORM, mark_thinking=True), "kimi", None, False),
    "blank": Model(UpstreamRules("blank", UNIQUE, id_pattern=r"^[A-Za-z0-9_]+$", mark_thinking=True), "blank",
                   r"^[A-Za-z0-9_]+$", True),
}
STRICT_POOL = ("toolu_a", "toolu_b", "toolu_a-2", "toolu_c_1", "toolu_relay3")
SERVER_POOL = ("srvtoolu_a", "srvtoolu_a_2", "srvtoolu_b")

TOOL, SERVER, TEXT, HISTORY_RESULT = range(4)
item = st.tuples(st.integers(0, 3), st.integers(0, 255))
turn = st.tuples(st.integers(0, 255), st.lists(item, max_size=3), st.integers(0, 15))


def walk(messages: list) -> tuple[list, list]:
    """Declarations ``(id, type)`` and references ``(id, target ordinal or None)`` in walk order."""
    declarations, references, latest = [], [], {}
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for block in content:
            if "tool_use_id" in block:
                references.append((block["tool_use_id"], latest.get(block["tool_use_id"])))
            kind = block.get("type", "")
            if kind == "tool_use" or kind.endswith("_tool_use"):
                latest[block.get("id")] = len(declarations)
                declarations.append((block.get("id"), kind))
    return declarations, references


class Crossing:
    """One generated conversation, checked on every turn."""

    def __init__(self, case: SynchronousTestCase, models: list, thinking: str | None) -> None:
        self.case = case
        self.models = models
        self.thinking = thinking
        self.messages: list = []
        self.makers: list = []  # per declaration ordinal: (maker name, emitted id or None)
        self.intent: list = []  # per reference ordinal: target declaration ordinal
        self.client_ids: set = set()
        self.previous: tuple | None = None  # (upstream name, upstream-bound messages JSON)
        self.moves = 0
        self.encoded = self.minted = self.left_out = self.disabled = 0

    def run(self, script: list) -> None:
        at = 0
        for number, (move, items, flags) in enumerate(script):
            if move % 4 == 0 and number:
                at = (at + 1 + move // 4 % (len(self.models) - 1 or 1)) % len(self.models)
                self.moves += 1
            self.turn(self.models[at], number, items, flags)

    def body(self) -> dict:
        body = {"model": "m", "max_tokens": 64, "messages": self.messages}
        if self.thinking == "enabled":
            body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
        elif self.thinking is not None:
            body["thinking"] = {"type": self.thinking}
        return body

    def turn(self, model: Model, number: int, items: list, flags: int) -> None:
        case = self.case
        body = self.body()
        before = ujson.dumps(body)
        t = translate_request(body, model.rules)
        case.assertEqual(ujson.dumps(body), before, "the client's body was mutated")
        upstream = t.upstream_body
        # the same request again, to a relay that kept nothing: the same bytes
        retry = translate_request(ujson.loads(before), model.rules)
        case.assertEqual(ujson.dumps(retry.upstream_body), ujson.dumps(upstream))
        self.check_request(model, upstream)
        table = t.table
        self.encoded += len(table.encodings)
        self.minted += len(table.minted)
        self.left_out += sum(1 for e in table.thinking if not e.sent)
        self.disabled += t.thinking_disabled
        # the relay touches nothing outside messages, and thinking only when manual
        outside = {k: v for k, v in body.items() if k != "messages"}
        if t.thinking_disabled:
            case.assertEqual(self.thinking, "enabled", "thinking other than manual was deleted")
            del outside["thinking"]
        case.assertEqual({k: v for k, v in upstream.items() if k != "messages"}, outside)

        # the upstream-bound history is byte-stable while the conversation stays
        messages_json = ujson.dumps(upstream["messages"])
        if self.previous is not None and self.previous[0] == model.rules.name:
            case.assertTrue(messages_json.startswith(self.previous[1][:-1]),
                            "upstream-bound history changed at " + model.rules.name)
        self.previous = (model.rules.name, messages_json)

        blocks, makers, intents = self.respond(model, upstream, number, items)
        streaming = bool(flags & 1)
        answer = self.translate(t, blocks, streaming)
        # a retried request mints and renames exactly alike
        again = self.translate(retry, ujson.loads(ujson.dumps(blocks)), not streaming)
        case.assertEqual(again, answer)
        self.check_answer(model.rules.name, answer, makers, intents)
        self.client_turn(answer, flags)

    # -- the upstream's side --------------------------------------------------

    def check_request(self, model: Model, upstream: dict) -> None:
        """Everything the model upstream would check, and the relay's promises to it."""
        case = self.case
        name = model.rules.name
        messages = upstream["messages"]
        declarations, references = walk(messages)
        case.assertEqual(len(declarations), len(self.makers), "a declaration was lost")
        case.assertEqual(len(references), len(self.intent), "a reference was lost")
        wire = [block_id for block_id, _ in declarations]
        for block_id in wire:
            case.assertIsInstance(block_id, str)
            case.assertTrue(block_id)
            if model.pattern is not None:
                case.assertTrue(re.fullmatch(model.pattern, block_id), f"{name} refuses {block_id!r}")
        if model.rules.policy == UNIQUE:
            case.assertEqual(len(wire), len(set(wire)), f"duplicate ids at {name}")
            case.assertEqual([target for _, target in references], self.intent)
        else:
            own = [j for j, (maker, emitted) in enumerate(self.makers)
                   if emitted is not None and re.fullmatch(KIMI_FORM, emitted)]
            for j in own:
                case.assertEqual(wire[j], self.makers[j][1], "kimi did not get its own id back")
            foreign = [wire[j] for j in range(len(wire)) if j not in own]
            case.assertEqual(len(foreign), len(set(foreign)), "foreign ids meet at kimi")
            case.assertFalse(set(foreign) & {wire[j] for j in own})
            case.assertEqual([ref for ref, _ in references], [wire[j] for j in self.intent])
        # thinking: only this upstream's, with its own signature, all of it
        seen = 0
        for message in messages:
            content = message.get("content")
            case.assertTrue(content, "empty message content")
            if not isinstance(content, list):
                continue
            for block in content:
                if block["type"] in SIGNED:
                    value = block["signature" if block["type"] == "thinking" else "data"]
                    case.assertFalse(value.startswith(THINKING_MARK))
                    text = block.get("thinking", "redacted")
                    case.assertEqual(value, sign(model.secret, text), f"Invalid signature in thinking block at {name}")
                    seen += 1
        case.assertEqual(seen, self.thinking_by.get(name, 0), "thinking kept from its maker")
        # Anthropic's rule: with manual thinking, a tool loop's final
        # assistant message starts with a thinking block
        if model.tool_loop_rule and upstream.get("thinking", {}).get("type") == "enabled":
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant") if any(
                m["role"] == "assistant" for m in messages) else None
            tail = messages[last + 1:] if last is not None else []
            if last is not None and any(isinstance(m["content"], list) and any(
                    b["type"] == "tool_result" for b in m["content"]) for m in tail):
                case.assertIn(messages[last]["content"][0]["type"], SIGNED, f"{name}: final assistant "
                              "message must start with a thinking block")

    @property
    def thinking_by(self) -> dict:
        counts: dict = {}
        for message in self.messages:
            content = message.get("content")
            if isinstance(content, list):
                for block in content:
                    if block["type"] in SIGNED:
                        maker = (block.get("signature") or block.get("data")).split(":")[1]
                        counts[maker] = counts.get(maker, 0) + 1
        return counts

    def respond(self, model: Model, upstream: dict, number: int, items: list) -> tuple:
        """The model's answer (upstream ids), and per block its truth."""
        declarations, _ = walk(upstream["messages"])
        servers = [(j, block_id) for j, (block_id, kind) in enumerate(declarations) if kind == "server_tool_use"]
        blocks, makers, intents = [], [], []
        base = len(self.makers)
        latest: dict = {}
        if "thinking" in upstream:
            text = f"thinking {number} at {model.rules.name}"
            if number % 5 == 4:
                blocks.append({"type": "redacted_thinking", "data": sign(model.secret, "redacted")})
            else:
                blocks.append({"type": "thinking", "thinking": text, "signature": sign(model.secret, text)})
        calls = 0
        for kind, a in items:
            if kind == TOOL or (kind != TEXT and model.style != "strict"):
                name = NAMES[a % 3]
                if model.style == "strict":
                    ids = STRICT_POOL + tuple(block_id for block_id, _ in declarations[-3:])
                    emitted = ids[a % len(ids)]
                elif model.style == "kimi":
                    emitted = f"functions.{name}:{calls}"
                else:
                    emitted = (None, "", f"call_{calls}")[a % 3]
                block = {"type": "tool_use", "name": name, "input": {"n": a}}
                if emitted is not None:
                    block["id"] = emitted
                calls += 1
                latest[emitted] = base + len(makers)
                makers.append((model.rules.name, emitted or None))
                blocks.append(block)
            elif kind == SERVER:
                emitted = SERVER_POOL[a % len(SERVER_POOL)]
                latest[emitted] = base + len(makers)
                makers.append((model.rules.name, emitted))
                blocks.append({"type": "server_tool_use", "id": emitted, "name": "web_search", "input": {}})
                blocks.append({"type": "web_search_tool_result", "tool_use_id": emitted, "content": []})
                intents.append(latest[emitted])
            elif kind == HISTORY_RESULT and servers:
                j, block_id = servers[a % len(servers)]
                if block_id in latest:
                    continue
                blocks.append({"type": "web_search_tool_result", "tool_use_id": block_id, "content": []})
                intents.append(j)
            else:
                blocks.append({"type": "text", "text": f"t{a}"})
        if not any(b["type"] not in SIGNED for b in blocks):
            blocks.append({"type": "text", "text": "nothing to do"})
        return blocks, makers, intents

    # -- the client's side ----------------------------------------------------

    def translate(self, t, blocks: list, streaming: bool) -> list:
        """The answer as the client receives it."""
        r = t.response()
        blocks = ujson.loads(ujson.dumps(blocks))
        if not streaming:
            message = {"role": "assistant", "content": blocks}
            r.translate_message(message)
            return message["content"]
        out = []
        for block in blocks:
            start = dict(block)
            signature = None
            if start["type"] == "thinking":
                signature, start["signature"], start["thinking"] = start["signature"], "", ""
            elif start["type"] == "tool_use":
                start["input"] = {}
            r.translate_block(start)
            if signature is not None:
                delta = {"type": "signature_delta", "signature": signature}
                r.translate_delta(delta)
                start["thinking"], start["signature"] = block["thinking"], delta["signature"]
            elif start["type"] == "tool_use":
                start["input"] = block["input"]
            out.append(start)
        return out

    def check_answer(self, name: str, answer: list, makers: list, intents: list) -> None:
        """The client never sees an id twice; every reference resolves where the model meant it."""
        case = self.case
        client_latest = {}
        for j, (block_id, _) in enumerate(walk(self.messages)[0]):
            client_latest[block_id] = j
        n = len(self.makers)
        references = []
        for block in answer:
            if "tool_use_id" in block:
                references.append(client_latest.get(block["tool_use_id"]))
            if block["type"].endswith("tool_use"):
                block_id = block.get("id")
                case.assertIsInstance(block_id, str)
                case.assertTrue(block_id)
                case.assertNotIn(block_id, self.client_ids, "the client saw an id twice")
                self.client_ids.add(block_id)
                client_latest[block_id] = n
                n += 1
            if block["type"] in SIGNED:
                value = block["signature" if block["type"] == "thinking" else "data"]
                case.assertTrue(value.startswith(THINKING_MARK + name + ":"), "thinking not marked")
        case.assertEqual(references, intents)
        self.makers.extend(makers)
        self.intent.extend(intents)

    def client_turn(self, answer: list, flags: int) -> None:
        self.messages.append({"role": "assistant", "content": answer})
        results = []
        for block in answer:
            if block["type"] == "tool_use":
                results.append({"type": "tool_result", "tool_use_id": block["id"], "content": "ok"})
        ordinals = walk(self.messages)[0]
        latest = {block_id: j for j, (block_id, _) in enumerate(ordinals)}
        for result in results:
            self.intent.append(latest[result["tool_use_id"]])
        if results:
            self.messages.append({"role": "user", "content": results})
        else:
            self.messages.append({"role": "user", "content": "go on" if flags & 2 else [
                {"type": "text", "text": "go on"}]})


SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
scripts = st.lists(turn, min_size=30, max_size=34)


class CrossingTests(SynchronousTestCase):
    """Conversations that move between upstreams every few turns."""

    @settings(max_examples=25, **SETTINGS)
    @given(order=st.permutations(sorted(MODELS)), thinking=st.sampled_from([None, "enabled", "adaptive"]),
           script=scripts)
    def test_three_upstreams(self, order: list, thinking: str | None, script: list) -> None:
        """
        Between all three upstreams, every request is valid where it goes,
        the client never sees an id twice, every reference resolves, and each
        upstream's history is byte-stable while the conversation stays.
        """
        conversation = Crossing(self, [MODELS[name] for name in order], thinking)
        conversation.run(script)

    @settings(max_examples=25, **SETTINGS)
    @given(pair=st.sampled_from([("strict", "kimi"), ("kimi", "blank"), ("blank", "strict")]),
           thinking=st.sampled_from([None, "enabled", "adaptive"]), script=scripts)
    def test_two_upstreams(self, pair: tuple, thinking: str | None, script: list) -> None:
        """The same between two upstreams of different rules."""
        Crossing(self, [MODELS[name] for name in pair], thinking).run(script)

    def test_the_properties_exercise_every_rule(self) -> None:
        """
        A fixed long session meets every rule at least once: encodings,
        minted ids, thinking left out, and a tool loop sent without thinking.
        """
        conversation = Crossing(self, [MODELS["strict"], MODELS["kimi"], MODELS["blank"]], "enabled")
        script = [(4 if n % 3 == 0 else 1, [(TOOL, n), (SERVER, n), (TOOL, n + 1), (HISTORY_RESULT, n)], n)
                  for n in range(40)]
        conversation.run(script)
        self.assertGreater(conversation.moves, 10)
        self.assertGreater(conversation.encoded, 0)
        self.assertGreater(conversation.minted, 0)
        self.assertGreater(conversation.left_out, 0)
        self.assertGreater(conversation.disabled, 0)

    def test_adaptive_never_goes_without_thinking(self) -> None:
        """
        The same long session with adaptive thinking: thinking is left out
        where it is another upstream's, and no request ever goes without
        ``thinking``.
        """
        conversation = Crossing(self, [MODELS["strict"], MODELS["kimi"], MODELS["blank"]], "adaptive")
        script = [(4 if n % 3 == 0 else 1, [(TOOL, n), (SERVER, n), (TOOL, n + 1), (HISTORY_RESULT, n)], n)
                  for n in range(40)]
        conversation.run(script)
        self.assertGreater(conversation.left_out, 0)
        self.assertEqual(conversation.disabled, 0)
