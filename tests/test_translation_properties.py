"""
Property tests for :mod:`twisted_relay.translation`: the invariants 1-7 of
``docs/id-translation.md``, checked on every turn of long generated
conversations.

Hypothesis generates a *script* (what each turn's response contains, and
which id each block takes from a small pool or from the history); a model
upstream written here, independent of the code under test, turns the script
into responses from the upstream-bound request it is sent, and records the
ground truth: the id it emitted for every declaration and the block every
reference of its own was meant to point at. The client side feeds every
translated response back as the next turn's history, as a client would.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import ujson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.translation import (
    ORIGINAL,
    UNIQUE,
    TranslationTable,
    UpstreamRules,
    translate_request,
)

# Small pools so that collisions are frequent: ids that already end in
# -<digits> / _<digits>, lookalike chains, Kimi-style ids, cross-type reuse.
TOOL_POOL = (
    "toolu_a", "toolu_a-2", "toolu_a-2-2", "toolu_a-3", "toolu_b", "toolu_b_2",
    "functions.Bash:0", "functions.Bash:1", "functions.Bash:1-2", "functions.Read:0",
    "call_7", "call-7", "x", "x-1", "x-02", "srvtoolu_a",
)
SERVER_POOL = (
    "srvtoolu_a", "srvtoolu_a_2", "srvtoolu_a_2_2", "srvtoolu_b", "srvtoolu_b_3",
    "srvtoolu_1", "srvtoolu_1_2", "toolu_a-2", "x_1",
)
MCP_POOL = ("mcptoolu_a", "mcptoolu_a_2", "toolu_a", "srvtoolu_a")
# A history that began elsewhere. Under ``original`` its raw duplicates go
# upstream unchanged, so its pool holds no lookalikes (ground truth is then
# the raw id); under ``unique`` anything goes.
RAW_POOL_ORIGINAL = ("toolu_a", "toolu_b", "functions.Bash:1", "call_x")
RAW_POOL_UNIQUE = ("toolu_a", "toolu_a-2", "toolu_b", "toolu_a-2-2", "functions.Bash:1", "x")

DECLARATION_TYPES = ("tool_use", "server_tool_use", "mcp_tool_use")
NAMES = ("Bash", "Read", "Edit")
SUFFIX = re.compile(r"[-_][0-9]+$")

# kinds of scripted response items
TOOL_USE, WEB_SEARCH, CODE_EXECUTION, MCP, HISTORY_RESULT, TEXT, REPEAT, HISTORY_CALLER = range(8)

block_spec = st.tuples(st.integers(0, 7), st.integers(0, 255), st.integers(0, 255))
turn_spec = st.tuples(st.lists(block_spec, max_size=3), st.integers(0, 15))


def turns(min_size: int = 30, max_size: int = 32):
    """A conversation script: one spec per turn."""
    return st.lists(turn_spec, min_size=min_size, max_size=max_size)


def walk_ids(messages: list) -> tuple[list, list]:
    """
    The contract's walk, written independently of the code under test.

    :return: declarations ``(position, id, type)`` and references
        ``(position, field, id, target position or None)``, in walk order.
    """
    declarations, references, latest = [], [], {}
    for mi, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for bi, block in enumerate(content):
            if not isinstance(block, dict):
                continue
            value = block.get("tool_use_id")
            if isinstance(value, str):
                references.append(((mi, bi), "tool_use_id", value, latest.get(value)))
            caller = block.get("caller")
            if isinstance(caller, dict) and isinstance(caller.get("tool_id"), str):
                value = caller["tool_id"]
                references.append(((mi, bi), "caller.tool_id", value, latest.get(value)))
            kind = block.get("type")
            if (
                isinstance(kind, str)
                and (kind == "tool_use" or kind.endswith("_tool_use"))
                and isinstance(block.get("id"), str)
            ):
                declarations.append(((mi, bi), block["id"], kind))
                latest[block["id"]] = (mi, bi)
    return declarations, references


def looks_like_rewrite(candidate: str, seen: set) -> bool:
    """
    The contract's lookalike: stripping trailing ``-<digits>``/``_<digits>``
    suffixes reaches an id seen before.
    """
    while SUFFIX.search(candidate):
        candidate = SUFFIX.sub("", candidate)
        if candidate in seen:
            return True
    return False


def declaration(kind: str, block_id: str, name: str, input_: dict) -> dict:
    return {"type": kind, "id": block_id, "name": name, "input": input_}


@dataclass
class Truth:
    """What the model upstream and the client know, by client position."""

    emitted: dict = field(default_factory=dict)  # (mi, bi) -> id the upstream emitted
    intent: dict = field(default_factory=dict)  # (mi, bi, field) -> target (mi, bi) or None
    relay_made: set = field(default_factory=set)  # positions whose client id the relay chose
    emitted_ids: set = field(default_factory=set)  # every id emitted or raw so far
    clean: bool = True  # no collision (and no lookalike) so far


class ModelUpstream:
    """
    A scripted upstream that invents its own ids.

    :param fresh: emit ids that never repeat anything (for the no-op
        property) instead of drawing them from the small pools.
    """

    def __init__(self, fresh: bool = False) -> None:
        self.fresh = fresh
        self.counter = 0

    def pick(self, pool: tuple, choice: int, seen_upstream: list, seen_client: list, kind: str) -> str:
        if self.fresh:
            self.counter += 1
            n = self.counter
            if kind == "tool_use":
                # shapes that look suffixed but whose stems were never seen
                return ("toolu_f%dz" % n, "functions.Bash:%d" % n, "toolu_q%d-2" % n)[choice % 3]
            return ("srvtoolu_f%dz" % n, "srvtoolu_q%d_2" % n)[choice % 2]
        # The model may echo any id it was sent, and, adversarially, any id
        # the client holds (e.g. an ``X-2`` the relay made).
        candidates = pool + tuple(seen_upstream) + tuple(seen_client)
        return candidates[choice % len(candidates)]

    def respond(self, declarations: list, client_ids: list, spec: tuple, mi: int) -> tuple:
        """
        Answer one turn.

        :param declarations: the declarations of the request it was sent, as
            :func:`walk_ids` reads them.
        :param mi: the index the client will give the assistant message.
        :return: the blocks (upstream ids), and for each block its truths:
            ``{"id": emitted}`` and/or ``{field: intended target}``.
        """
        items, _ = spec
        latest = {block_id: pos for pos, block_id, _ in declarations}
        seen = [block_id for _, block_id, _ in declarations]
        servers = [block_id for _, block_id, kind in declarations if kind == "server_tool_use"]
        blocks, truths = [], []
        tool_uses = []

        def emit(block: dict, truth: dict) -> None:
            for name, target_id in truth.pop("_refs", ()):
                truth[name] = latest.get(target_id)
            if "id" in block and block["type"] in DECLARATION_TYPES:
                truth["id"] = block["id"]
                latest[block["id"]] = (mi, len(blocks))
            blocks.append(block)
            truths.append(truth)

        for kind, a, b in items:
            if kind == REPEAT and tool_uses and not self.fresh:
                # one call emitted twice, as a mis-assembled stream would
                block = dict(tool_uses[a % len(tool_uses)])
                refs = [("caller.tool_id", block["caller"]["tool_id"])] if "caller" in block else []
                emit(block, {"_refs": refs})
            elif kind in (TOOL_USE, REPEAT):
                block = declaration("tool_use", self.pick(TOOL_POOL, a, seen, client_ids, "tool_use"),
                                    NAMES[b % 3], {"n": b % 2})
                tool_uses.append(block)
                emit(block, {})
            elif kind == WEB_SEARCH:
                sid = self.pick(SERVER_POOL, a, seen, client_ids, "server_tool_use")
                emit(declaration("server_tool_use", sid, "web_search", {"query": "q%d" % (b % 2)}), {})
                emit({"type": "web_search_tool_result", "tool_use_id": sid, "content": []},
                     {"_refs": [("tool_use_id", sid)]})
            elif kind == CODE_EXECUTION:
                sid = self.pick(SERVER_POOL, a, seen, client_ids, "server_tool_use")
                emit(declaration("server_tool_use", sid, "code_execution", {"code": "run()"}), {})
                block = declaration("tool_use", self.pick(TOOL_POOL, b, seen, client_ids, "tool_use"),
                                    NAMES[a % 3], {"n": a % 2})
                block["caller"] = {"type": "code_execution_20250825", "tool_id": sid}
                tool_uses.append(block)
                emit(block, {"_refs": [("caller.tool_id", sid)]})
                emit({"type": "code_execution_tool_result", "tool_use_id": sid, "content": {}},
                     {"_refs": [("tool_use_id", sid)]})
            elif kind == MCP and not self.fresh:
                mid = self.pick(MCP_POOL, a, seen, client_ids, "mcp_tool_use")
                emit(declaration("mcp_tool_use", mid, "fetch", {}), {})
                emit({"type": "mcp_tool_result", "tool_use_id": mid, "content": []},
                     {"_refs": [("tool_use_id", mid)]})
            elif kind == HISTORY_RESULT and servers:
                # e.g. after pause_turn: a server result for an earlier call
                sid = servers[a % len(servers)]
                emit({"type": "web_search_tool_result", "tool_use_id": sid, "content": []},
                     {"_refs": [("tool_use_id", sid)]})
            elif kind == HISTORY_CALLER and servers:
                sid = servers[a % len(servers)]
                block = declaration("tool_use", self.pick(TOOL_POOL, b, seen, client_ids, "tool_use"),
                                    "Bash", {})
                block["caller"] = {"type": "code_execution_20260120", "tool_id": sid}
                tool_uses.append(block)
                emit(block, {"_refs": [("caller.tool_id", sid)]})
            else:
                emit({"type": "text", "text": "t%d" % a}, {})
        return blocks, truths


def raw_prefix(picks: list, pool: tuple, truth: Truth) -> list:
    """A history made without the relay: tool_use/tool_result pairs, duplicates allowed."""
    messages = []
    for choice in picks:
        raw = pool[choice % len(pool)]
        mi = len(messages)
        truth.emitted[(mi, 0)] = raw
        truth.intent[(mi + 1, 0, "tool_use_id")] = (mi, 0)
        if raw in truth.emitted_ids:
            truth.clean = False
        truth.emitted_ids.add(raw)
        messages.append({"role": "assistant", "content": [declaration("tool_use", raw, "Bash", {})]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": raw, "content": "ok"}]})
    return messages


class Conversation:
    """
    One generated conversation, driven turn by turn, checking every
    invariant as it goes. The upstream has no id pattern: these are the
    invariants of collisions alone (``test_crossing`` adds the patterns).
    """

    def __init__(self, case: SynchronousTestCase, policy: str, model: ModelUpstream,
                 messages: list | None = None, truth: Truth | None = None) -> None:
        self.case = case
        self.policy = policy
        self.rules = UpstreamRules(policy=policy, id_pattern=None)
        self.model = model
        self.messages = messages if messages is not None else []
        self.truth = truth if truth is not None else Truth()
        self.previous_upstream = ujson.dumps([])
        self.rewrites = 0

    def run(self, script: list) -> None:
        for number, spec in enumerate(script):
            self.turn(spec, check_table=number % 8 == 0 or number == len(script) - 1)

    def turn(self, spec: tuple, check_table: bool) -> None:
        case = self.case
        body = {"model": "m", "max_tokens": 64, "messages": self.messages}
        before = ujson.dumps(body)
        t = translate_request(body, self.rules)
        after = ujson.dumps(body)
        case.assertEqual(after, before, "the client's body was mutated")
        upstream = t.upstream_body
        upstream_json = after if upstream is body else ujson.dumps(upstream)
        case.assertEqual(t.changed, upstream is not body)
        case.assertEqual(t.changed, upstream_json != before)

        # 5. statelessness and 7. idempotence: the same request's bytes, sent
        # again to a relay that kept nothing, give the same upstream request
        fresh = translate_request(ujson.loads(before), self.rules)
        case.assertEqual(ujson.dumps(fresh.upstream_body), upstream_json)
        if check_table:
            again = translate_request(body, self.rules)
            case.assertEqual(ujson.dumps(again.upstream_body), upstream_json)
            case.assertEqual(fresh.table, t.table)
            case.assertEqual(again.table, t.table)
            dumped = ujson.loads(ujson.dumps(t.table.to_dict()))
            case.assertEqual(TranslationTable.from_dict(dumped), t.table)

        # 4. stability: the upstream-bound history is byte-stable, so the
        # previous turn's serialisation (without its closing bracket) is a
        # prefix of this one's
        messages_json = ujson.dumps(upstream["messages"])
        case.assertTrue(
            messages_json.startswith(self.previous_upstream[:-1]), "upstream-bound history changed"
        )
        self.previous_upstream = messages_json

        client_decls, up_decls = self.check_request(upstream)
        # 6. no-op when clean
        if self.truth.clean:
            case.assertIs(upstream, body)
            case.assertFalse(t.changed)

        if spec[1] & 2:
            self.messages.append({"role": "system", "content": "turn note"})
        mi = len(self.messages)
        client_ids = [block_id for _, block_id, _ in client_decls]
        blocks, truths = self.model.respond(up_decls, client_ids, spec, mi)
        self.note_emissions(blocks)
        translated = self.translate_response(t, blocks, streaming=bool(spec[1] & 1))
        self.check_response(client_ids, translated, mi)
        for bi, truth in enumerate(truths):
            if "id" in truth:
                self.truth.emitted[(mi, bi)] = truth["id"]
                self.truth.relay_made.add((mi, bi))
            for name, target in truth.items():
                if name != "id":
                    self.truth.intent[(mi, bi, name)] = target
        self.client_answers(translated, mi, spec[1])

    def note_emissions(self, blocks: list) -> None:
        """Keep the ground-truth 'clean' flag: no repeat, and (original) no lookalike."""
        truth = self.truth
        for block in blocks:
            if block["type"] in DECLARATION_TYPES:
                emitted = block["id"]
                if emitted in truth.emitted_ids or (
                    self.policy == ORIGINAL and looks_like_rewrite(emitted, truth.emitted_ids)
                ):
                    truth.clean = False
                truth.emitted_ids.add(emitted)

    def translate_response(self, t, blocks: list, streaming: bool) -> list:
        """Run one response through a fresh translator, checking its answers."""
        case = self.case
        r = t.response()
        seen = []
        if streaming:
            case.assertFalse(r.translate_message({"role": "assistant", "content": []}))
            translated = []
            for block in blocks:
                start = ujson.loads(ujson.dumps(block))
                if start["type"] in DECLARATION_TYPES:
                    start["input"] = {}  # content_block_start carries no input yet
                before = ujson.dumps(start)
                changed = r.translate_block(start)
                case.assertEqual(changed, ujson.dumps(start) != before)
                seen.append(ujson.loads(before))
                if start["type"] in DECLARATION_TYPES:
                    start["input"] = block["input"]  # the client assembles the deltas
                translated.append(start)
        else:
            message = {"role": "assistant", "content": ujson.loads(ujson.dumps(blocks))}
            before = ujson.dumps(message)
            seen = ujson.loads(before)["content"]
            changed = r.translate_message(message)
            case.assertEqual(changed, ujson.dumps(message) != before)
            translated = message["content"]
        # every changed id, in the order translate_block meets them
        expected = []
        for i, (upstream_block, client_block) in enumerate(zip(seen, translated)):
            pairs = [("tool_use_id", upstream_block.get("tool_use_id"), client_block.get("tool_use_id"))]
            if "caller" in upstream_block:
                pairs.append(("caller.tool_id", upstream_block["caller"]["tool_id"],
                              client_block["caller"]["tool_id"]))
            if upstream_block["type"] in DECLARATION_TYPES:
                pairs.append(("id", upstream_block["id"], client_block["id"]))
            for name, upstream_id, client_id in pairs:
                if upstream_id == client_id:
                    continue
                double = name == "id" and any(
                    earlier["type"] in DECLARATION_TYPES and earlier["id"] == upstream_id
                    and earlier["name"] == upstream_block["name"]
                    and earlier["input"] == upstream_block["input"]
                    for earlier in seen[:i])
                expected.append((name, upstream_id, client_id, double))
        case.assertEqual(
            [(rw.field, rw.upstream_id, rw.client_id, rw.suspected_double_emission) for rw in r.rewrites],
            expected)
        if self.truth.clean:
            case.assertEqual(r.rewrites, [])
        self.rewrites += len(r.rewrites)
        return translated

    def check_response(self, client_ids: list, translated: list, mi: int) -> None:
        """1. client uniqueness: new ids repeat nothing earlier, nor each other."""
        earlier = set(client_ids)
        for block in translated:
            if block["type"] in DECLARATION_TYPES:
                self.case.assertNotIn(block["id"], earlier)
                earlier.add(block["id"])

    def client_answers(self, translated: list, mi: int, flags: int) -> None:
        """Append the answer and the client's tool results, as a client would."""
        self.messages.append({"role": "assistant", "content": translated})
        results = []
        for bi, block in enumerate(translated):
            if block["type"] == "tool_use":
                self.truth.intent[(mi + 1, len(results), "tool_use_id")] = (mi, bi)
                results.append({"type": "tool_result", "tool_use_id": block["id"], "content": "ok"})
        if flags & 4:
            # an orphan: X-97 when X was declared is still an orphan
            orphan = (translated[0].get("id") or "toolu_none") + "-97" if translated else "toolu_gone"
            self.truth.intent[(mi + 1, len(results), "tool_use_id")] = None
            results.append({"type": "tool_result", "tool_use_id": orphan, "content": "?"})
        if results:
            self.messages.append({"role": "user", "content": results})
        elif flags & 8:
            self.messages.append({"role": "user", "content": "go on"})
        else:
            self.messages.append({"role": "user", "content": [{"type": "text", "text": "go on"}]})

    def check_request(self, upstream: dict) -> None:
        """Invariants 1-3 on one request and its upstream-bound form."""
        case = self.case
        truth = self.truth
        client_decls, client_refs = walk_ids(self.messages)
        up_decls, up_refs = walk_ids(upstream["messages"])
        case.assertEqual([p for p, _, _ in client_decls], [p for p, _, _ in up_decls])
        case.assertEqual([(p, f) for p, f, _, _ in client_refs], [(p, f) for p, f, _, _ in up_refs])

        # 1. ids the relay chose repeat no earlier declaration
        earlier = set()
        for pos, block_id, _ in client_decls:
            if pos in truth.relay_made:
                case.assertNotIn(block_id, earlier)
            earlier.add(block_id)
        # every reference of the client points where the model meant it to
        case.assertEqual(
            [t for _, _, _, t in client_refs],
            [truth.intent[pos + (name,)] for pos, name, _, _ in client_refs],
        )

        if self.policy == UNIQUE:
            # 2. pairwise distinct, and references point at the same blocks
            ids = [block_id for _, block_id, _ in up_decls]
            case.assertEqual(len(ids), len(set(ids)), "duplicate upstream declaration ids")
            # the relay's own ids are already unique: only raw ones get repaired
            case.assertEqual(
                [up for (pos, up, _), (_, client, _) in zip(up_decls, client_decls) if pos in truth.relay_made],
                [client for pos, client, _ in client_decls if pos in truth.relay_made])
            case.assertEqual([t for _, _, _, t in up_refs], [t for _, _, _, t in client_refs])
        else:
            # 3. exactly the ids the upstream emitted, references included
            case.assertEqual(
                [block_id for _, block_id, _ in up_decls], [truth.emitted[pos] for pos, _, _ in up_decls]
            )
            case.assertEqual(
                [up_id for _, _, up_id, _ in up_refs],
                [
                    client_id if target is None else truth.emitted[target]
                    for _, _, client_id, target in client_refs
                ],
            )
        return client_decls, up_decls


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class ColliderTests(SynchronousTestCase):
    """
    An upstream that reuses ids from a small pool, echoes the ids it is sent
    and the client's rewritten ones, emits lookalikes and Kimi-style ids.
    """

    @settings(max_examples=600, **SETTINGS)
    @given(script=turns())
    def test_unique(self, script: list) -> None:
        """
        Under ``unique`` every invariant holds on every turn of a 30+ turn
        session with frequent collisions: the session never breaks.
        """
        Conversation(self, UNIQUE, ModelUpstream()).run(script)

    @settings(max_examples=600, **SETTINGS)
    @given(script=turns())
    def test_original(self, script: list) -> None:
        """
        Under ``original`` the upstream always gets back exactly the ids it
        emitted, even those that end in ``-<digits>``.
        """
        Conversation(self, ORIGINAL, ModelUpstream()).run(script)


class RawHistoryTests(SynchronousTestCase):
    """A session that began elsewhere: its history already holds duplicates."""

    @settings(max_examples=250, **SETTINGS)
    @given(prefix=st.lists(st.integers(0, 255), min_size=2, max_size=8), script=turns())
    def test_unique_repairs(self, prefix: list, script: list) -> None:
        """
        Under ``unique`` raw duplicates are repaired (distinct upstream ids,
        references remapped), and the session then goes on like any other.
        """
        truth = Truth()
        messages = raw_prefix(prefix, RAW_POOL_UNIQUE, truth)
        Conversation(self, UNIQUE, ModelUpstream(), messages, truth).run(script)

    @settings(max_examples=250, **SETTINGS)
    @given(prefix=st.lists(st.integers(0, 255), min_size=2, max_size=8), script=turns())
    def test_original_unchanged(self, prefix: list, script: list) -> None:
        """
        Under ``original`` raw duplicates go upstream unchanged, and later
        rewrites still decode exactly.
        """
        truth = Truth()
        messages = raw_prefix(prefix, RAW_POOL_ORIGINAL, truth)
        Conversation(self, ORIGINAL, ModelUpstream(), messages, truth).run(script)


class CleanTests(SynchronousTestCase):
    """An upstream whose ids never repeat: the relay must not touch anything."""

    @settings(max_examples=150, **SETTINGS)
    @given(script=turns())
    def test_unique(self, script: list) -> None:
        """Under ``unique`` a clean session reaches the upstream untouched."""
        conversation = Conversation(self, UNIQUE, ModelUpstream(fresh=True))
        conversation.run(script)
        self.assertTrue(conversation.truth.clean)
        self.assertEqual(conversation.rewrites, 0)

    @settings(max_examples=150, **SETTINGS)
    @given(script=turns())
    def test_original(self, script: list) -> None:
        """
        Under ``original`` a clean session whose ids merely end in
        ``-<digits>`` (stems never seen) reaches the upstream untouched.
        """
        conversation = Conversation(self, ORIGINAL, ModelUpstream(fresh=True))
        conversation.run(script)
        self.assertTrue(conversation.truth.clean)
        self.assertEqual(conversation.rewrites, 0)
