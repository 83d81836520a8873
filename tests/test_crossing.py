"""
Named examples of conversations that cross upstreams: the invariants 8-12 of
``docs/id-translation.md`` (ids each upstream accepts, ids left out, thinking
that stays with its maker), one rule at a time. The generated conversations
are in ``test_crossing_properties``.
"""

from __future__ import annotations

import json
import re

from twisted.trial.unittest import SynchronousTestCase

from tests.test_sse import (
    THINKING_STREAM,
    _done,
    _gate,
    _sdk_events,
    _splits,
    _with_endings,
)
from twisted_relay.translation import (
    ANTHROPIC_ID_PATTERN,
    ENCODED_PREFIX,
    ORIGINAL,
    UNIQUE,
    TranslationTable,
    UpstreamRules,
    encode_id,
    mark_signature,
    minted_id,
    read_mark,
    translate_request,
)

ANTHROPIC = re.compile(ANTHROPIC_ID_PATTERN)
KIMI = r"^functions\.[A-Za-z]+:[0-9]+$"


def body_of(messages: list, thinking: bool = False) -> dict:
    body = {"model": "m", "max_tokens": 64, "messages": messages}
    if thinking:
        body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    return body


def tool_turn(tool_id: str, name: str = "Bash") -> list:
    """An assistant tool_use and the user's tool_result for it."""
    return [
        {"role": "assistant", "content": [{"type": "tool_use", "id": tool_id, "name": name, "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": "ok"}]},
    ]


def declared_ids(body: dict) -> list:
    return [b["id"] for m in body["messages"] if isinstance(m.get("content"), list)
            for b in m["content"] if b.get("type", "").endswith("tool_use")]


class EncodingTests(SynchronousTestCase):
    """Invariant 8: an id the upstream's pattern refuses goes in an injective encoding."""

    def test_encoding_shape(self):
        """
        Letters and digits stay, ``_`` doubles, anything else is its code
        point in hex between underscores, after the ``twr_`` prefix.
        """
        self.assertEqual(encode_id("functions.Bash:3"), "twr_functions_2e_Bash_3a_3")
        self.assertEqual(encode_id("a_b-2"), "twr_a__b_2d_2")
        self.assertEqual(encode_id(""), ENCODED_PREFIX)
        self.assertEqual(encode_id("é"), "twr__e9_")

    def test_encoding_is_injective(self):
        """Ids built to meet in a naive encoding never share one here."""
        ids = ["a.b", "a_b", "a__b", "a_2e_b", "a:b", "a_3a_b", "twr_a", "twr__a", "a-b", "a_2d_b", "", "_",
               "__", "a\nb", "a_a_b"]
        encoded = [encode_id(i) for i in ids]
        self.assertEqual(len(set(encoded)), len(ids))
        for e in encoded:
            self.assertTrue(ANTHROPIC.fullmatch(e), e)
            self.assertTrue(re.fullmatch(r"^[A-Za-z0-9_]+$", e), e)

    def test_declarations_and_every_reference(self):
        """
        A Kimi-style id in the history reaches a strict upstream encoded in its
        declaration, its tool_result, a caller and a server tool result, and
        the client's body is left alone.
        """
        messages = [
            {"role": "assistant", "content": [
                {"type": "server_tool_use", "id": "srv.1", "name": "code_execution", "input": {}},
                {"type": "tool_use", "id": "functions.Bash:0", "name": "Bash", "input": {},
                 "caller": {"type": "code_execution_20250825", "tool_id": "srv.1"}},
                {"type": "code_execution_tool_result", "tool_use_id": "srv.1", "content": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "functions.Bash:0", "content": "ok"},
                {"type": "tool_result", "tool_use_id": "gone:1", "content": "?"},
            ]},
        ]
        body = body_of(messages)
        before = json.dumps(body)
        t = translate_request(body, UNIQUE)
        self.assertEqual(json.dumps(body), before)
        up = t.upstream_body["messages"]
        self.assertEqual(up[0]["content"][0]["id"], "twr_srv_2e_1")
        self.assertEqual(up[0]["content"][1]["id"], "twr_functions_2e_Bash_3a_0")
        self.assertEqual(up[0]["content"][1]["caller"]["tool_id"], "twr_srv_2e_1")
        self.assertEqual(up[0]["content"][2]["tool_use_id"], "twr_srv_2e_1")
        self.assertEqual(up[1]["content"][0]["tool_use_id"], "twr_functions_2e_Bash_3a_0")
        # an orphan is encoded the same way, so it can never meet a declaration
        self.assertEqual(up[1]["content"][1]["tool_use_id"], "twr_gone_3a_1")
        table = t.table
        self.assertEqual([e.encoded_from for e in table.encodings],
                         ["srv.1", "srv.1", "functions.Bash:0", "srv.1", "functions.Bash:0", "gone:1"])
        dumped = table.to_dict()
        self.assertEqual(dumped["entries"][1]["encoded_from"], "srv.1")
        self.assertEqual(dumped["rules"]["id_pattern"], ANTHROPIC_ID_PATTERN)
        self.assertIn("encodes functions.Bash:0", table.format())

    def test_native_prefix_is_encoded_too(self):
        """
        A client id that already looks encoded is encoded again, so that it
        never meets the encoding of another id.
        """
        messages = tool_turn("functions.Bash:0") + tool_turn("twr_functions_2e_Bash_3a_0")
        ids = declared_ids(translate_request(body_of(messages), UNIQUE).upstream_body)
        self.assertEqual(ids, ["twr_functions_2e_Bash_3a_0", "twr_twr__functions__2e__Bash__3a__0"])

    def test_answer_refers_back(self):
        """
        The upstream's answer that refers to an encoded id (a server tool result
        for an earlier call) reaches the client with the client's id.
        """
        messages = [{"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srv:9", "name": "web_search", "input": {}}]},
            {"role": "user", "content": "go on"}]
        r = translate_request(body_of(messages), UNIQUE).response()
        block = {"type": "web_search_tool_result", "tool_use_id": "twr_srv_3a_9", "content": []}
        self.assertTrue(r.translate_block(block))
        self.assertEqual(block["tool_use_id"], "srv:9")

    def test_clean_history_untouched(self):
        """Ids that match the pattern go as they are: the very same body."""
        body = body_of(tool_turn("toolu_01abc") + tool_turn("toolu_01abc-2"))
        self.assertIs(translate_request(body, UNIQUE).upstream_body, body)

    def test_separators_stay(self):
        """
        Under a pattern without ``-`` the relay's ``X-2`` is encoded, not
        renamed: the client still sees the ``-k`` suffix.
        """
        rules = UpstreamRules(policy=UNIQUE, id_pattern=r"^[A-Za-z0-9_]+$")
        messages = tool_turn("toolu_a") + tool_turn("toolu_a-2")
        self.assertEqual(declared_ids(translate_request(body_of(messages), rules).upstream_body),
                         ["toolu_a", "twr_toolu__a_2d_2"])
        r = translate_request(body_of(messages), rules).response()
        block = {"type": "tool_use", "id": "toolu_a", "name": "Bash", "input": {}}
        r.translate_block(block)
        self.assertEqual(block["id"], "toolu_a-3")

    def test_defaults_and_refusals(self):
        """
        ``unique`` defaults to Anthropic's pattern, ``original`` to none; a
        policy name alone means those rules; bad patterns are refused.
        """
        self.assertEqual(UpstreamRules().id_pattern, ANTHROPIC_ID_PATTERN)
        self.assertIsNone(UpstreamRules(policy=ORIGINAL).id_pattern)
        body = body_of(tool_turn("functions.Bash:0"))
        self.assertEqual(translate_request(body, UNIQUE).upstream_body,
                         translate_request(body, UpstreamRules()).upstream_body)
        self.assertIs(translate_request(body, ORIGINAL).upstream_body, body)
        self.assertRaises(ValueError, UpstreamRules, policy="both")
        self.assertRaises(ValueError, UpstreamRules, id_pattern="(")
        self.assertRaises(ValueError, UpstreamRules, own_ids="[", policy=ORIGINAL)
        # a pattern that refuses every encoded id can never be met
        self.assertRaises(ValueError, UpstreamRules, id_pattern=r"^call_[0-9]+$")
        self.assertRaises(ValueError, translate_request, body, "both")
        rules = UpstreamRules(name="k", policy=ORIGINAL, own_ids=KIMI, mark_thinking=True)
        self.assertEqual(UpstreamRules.from_dict(json.loads(json.dumps(rules.to_dict()))), rules)


class OwnIdsTests(SynchronousTestCase):
    """Invariant 9: an ``original`` upstream gets back only ids of its own form as it emitted them."""

    def test_own_decoded_foreign_unique(self):
        """
        Kimi's repeated ``functions.Bash:0`` goes back as emitted; Anthropic's
        ``toolu_a`` and the relay's ``toolu_a-2`` reach it unique.
        """
        rules = UpstreamRules(name="kimi", policy=ORIGINAL, own_ids=KIMI)
        messages = (tool_turn("functions.Bash:0") + tool_turn("toolu_a") + tool_turn("functions.Bash:0-2")
                    + tool_turn("toolu_a-2"))
        t = translate_request(body_of(messages), rules)
        self.assertEqual(declared_ids(t.upstream_body),
                         ["functions.Bash:0", "toolu_a", "functions.Bash:0", "toolu_a-2"])
        refs = [m["content"][0]["tool_use_id"] for m in t.upstream_body["messages"][1::2]]
        self.assertEqual(refs, declared_ids(t.upstream_body))
        # every id its own (the default): all decoded, as before
        t = translate_request(body_of(messages), ORIGINAL)
        self.assertEqual(declared_ids(t.upstream_body),
                         ["functions.Bash:0", "toolu_a", "functions.Bash:0", "toolu_a"])

    def test_foreign_raw_duplicate_repaired(self):
        """A raw duplicate among foreign ids reaches an ``original`` upstream repaired."""
        rules = UpstreamRules(name="kimi", policy=ORIGINAL, own_ids=KIMI)
        messages = tool_turn("call_1") + tool_turn("call_1")
        t = translate_request(body_of(messages), rules)
        self.assertEqual(declared_ids(t.upstream_body), ["call_1", "call_1-2"])
        self.assertEqual(t.upstream_body["messages"][3]["content"][0]["tool_use_id"], "call_1-2")


class MintedTests(SynchronousTestCase):
    """Invariant 10: a declaration emitted with an empty or no id gets one."""

    def test_missing_and_empty(self):
        """
        Each block without a usable id gets ``toolu_relay<n>``, n its place
        among the conversation's declarations; taken ids take a suffix.
        """
        messages = tool_turn("toolu_x") + tool_turn("toolu_relay3")
        r = translate_request(body_of(messages)).response()
        blocks = [{"type": "tool_use", "name": "Bash", "input": {}},
                  {"type": "tool_use", "id": "", "name": "Bash", "input": {}},
                  {"type": "server_tool_use", "id": None, "name": "web_search", "input": {}},
                  {"type": "tool_use", "id": 5, "name": "Bash", "input": {}}]
        for block in blocks:
            self.assertTrue(r.translate_block(block))
        self.assertEqual([b["id"] for b in blocks],
                         ["toolu_relay3-2", "toolu_relay4", "srvtoolu_relay5", "toolu_relay6"])
        self.assertEqual([(w.upstream_id, w.client_id, w.minted) for w in r.rewrites][:2],
                         [("", "toolu_relay3-2", True), ("", "toolu_relay4", True)])

    def test_same_request_same_ids(self):
        """A retried request (a fresh translation of the same body) mints the same ids."""
        body = body_of(tool_turn("toolu_x"))
        ids = []
        for _ in range(2):
            r = translate_request(json.loads(json.dumps(body))).response()
            message = {"content": [{"type": "tool_use", "name": "A", "input": {}},
                                   {"type": "tool_use", "id": "", "name": "B", "input": {}}]}
            r.translate_message(message)
            ids.append([b["id"] for b in message["content"]])
        self.assertEqual(ids[0], ids[1])
        self.assertEqual(ids[0], ["toolu_relay2", "toolu_relay3"])

    def test_then_an_ordinary_id(self):
        """
        The minted id goes upstream as the client's id and the table says it
        was minted.
        """
        body = body_of([{"role": "user", "content": "hi"}])
        r = translate_request(body).response()
        block = {"type": "tool_use", "name": "Bash", "input": {}}
        r.translate_block(block)
        messages = body["messages"] + [{"role": "assistant", "content": [block]},
                                       {"role": "user", "content": [
                                           {"type": "tool_result", "tool_use_id": block["id"], "content": "ok"}]}]
        for policy in (UNIQUE, ORIGINAL):
            t = translate_request(body_of(messages), policy)
            self.assertIs(t.upstream_body["messages"], messages)
            self.assertEqual([e.client_id for e in t.table.minted], [minted_id("tool_use", 1)])
            self.assertTrue(t.table.to_dict()["entries"][0]["minted"])


class ThinkingTests(SynchronousTestCase):
    """Invariants 11 and 12: thinking goes only to its maker, and the request stays valid."""

    A = UpstreamRules(name="anthropic", policy=UNIQUE, mark_thinking=True)
    K = UpstreamRules(name="kimi", policy=ORIGINAL, own_ids=KIMI, mark_thinking=True)

    def answer(self, rules, body, blocks):
        r = translate_request(body, rules).response()
        message = {"role": "assistant", "content": blocks}
        r.translate_message(message)
        return message

    def test_mark_and_read(self):
        """A mark names the maker and gives back the signature exactly."""
        self.assertEqual(read_mark(mark_signature("a:b%", "Eq+/=")), ("a:b%", "Eq+/="))
        self.assertIsNone(read_mark("EqQBCg=="))
        self.assertIsNone(read_mark("relay:nocolon"))

    def test_marked_for_client_restored_for_maker(self):
        """
        The client receives the signature marked; its maker receives it as it
        sent it; another upstream does not receive the block at all.
        """
        body = body_of([{"role": "user", "content": "hi"}], thinking=True)
        message = self.answer(self.A, body, [
            {"type": "thinking", "thinking": "hmm", "signature": "SIG"},
            {"type": "redacted_thinking", "data": "DATA"},
            {"type": "text", "text": "hello"}])
        self.assertEqual(message["content"][0]["signature"], mark_signature("anthropic", "SIG"))
        self.assertEqual(message["content"][1]["data"], mark_signature("anthropic", "DATA"))
        body["messages"] += [message, {"role": "user", "content": "more"}]
        home = translate_request(body, self.A)
        self.assertEqual(home.upstream_body["messages"][1]["content"][:2], [
            {"type": "thinking", "thinking": "hmm", "signature": "SIG"},
            {"type": "redacted_thinking", "data": "DATA"}])
        away = translate_request(body, self.K)
        self.assertEqual(away.upstream_body["messages"][1]["content"], [{"type": "text", "text": "hello"}])
        self.assertIn("thinking", away.upstream_body)
        self.assertEqual([(t.maker, t.sent) for t in away.table.thinking], [("anthropic", False)] * 2)
        self.assertIn("left out", away.table.format())

    def test_unmarked_and_unmarking_rules(self):
        """
        Thinking without a mark (made before the relay) goes everywhere as it
        is, and rules without ``mark_thinking`` add no mark.
        """
        block = {"type": "thinking", "thinking": "t", "signature": "SIG"}
        body = body_of([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [dict(block)]},
                        {"role": "user", "content": "go"}])
        self.assertIs(translate_request(body, self.K).upstream_body, body)
        message = self.answer(UpstreamRules(), body_of([]), [dict(block)])
        self.assertEqual(message["content"][0], block)

    def test_tool_loop_goes_without_thinking(self):
        """
        With thinking on, a tool loop whose final assistant message started
        with another upstream's thinking goes without ``thinking``; the same
        history at its maker keeps it, and so does a finished turn.
        """
        body = body_of([{"role": "user", "content": "hi"}], thinking=True)
        message = self.answer(self.A, body, [
            {"type": "thinking", "thinking": "t", "signature": "SIG"},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}])
        body["messages"] += [message, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}]
        away = translate_request(body, self.K)
        self.assertNotIn("thinking", away.upstream_body)
        self.assertTrue(away.thinking_disabled)
        self.assertTrue(away.table.to_dict()["thinking_disabled"])
        self.assertEqual(away.upstream_body["messages"][1]["content"][0]["type"], "tool_use")
        home = translate_request(body, self.A)
        self.assertIn("thinking", home.upstream_body)
        # the next answer of the other upstream (without thinking) still closes
        # a loop without a thinking block: still without thinking
        body["messages"] += [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "functions.Bash:0", "name": "Bash", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "functions.Bash:0",
                                          "content": "ok"}]}]
        self.assertNotIn("thinking", translate_request(body, self.A).upstream_body)
        # a plain user turn ends the loop: thinking stays on
        body["messages"].append({"role": "assistant", "content": [{"type": "text", "text": "done"}]})
        body["messages"].append({"role": "user", "content": "thanks"})
        self.assertIn("thinking", translate_request(body, self.K).upstream_body)

    def test_message_of_foreign_thinking_only(self):
        """An assistant message that held only another upstream's thinking is left out."""
        marked = {"type": "thinking", "thinking": "t", "signature": mark_signature("anthropic", "S")}
        body = body_of([{"role": "user", "content": "a"}, {"role": "assistant", "content": [marked]},
                        {"role": "user", "content": "b"}])
        up = translate_request(body, self.K).upstream_body
        self.assertEqual([m["content"] for m in up["messages"]], ["a", "b"])
        self.assertEqual(len(body["messages"]), 3)

    def test_table_round_trip(self):
        """The table with rules, thinking and encodings survives JSON."""
        body = body_of([{"role": "assistant", "content": [
            {"type": "thinking", "thinking": "t", "signature": mark_signature("kimi", "S")},
            {"type": "tool_use", "id": "functions.Bash:0", "name": "Bash", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "functions.Bash:0",
                                          "content": "ok"}]}], thinking=True)
        table = translate_request(body, self.A).table
        self.assertEqual(TranslationTable.from_dict(json.loads(json.dumps(table.to_dict()))), table)
        self.assertTrue(table.thinking_disabled)
        self.assertRaises(ValueError, TranslationTable.from_dict, dict(table.to_dict(), thinking=5))

    def test_stream_signature_marked(self):
        """
        Through the SSE gate, however the stream is split, the signature_delta
        carries the mark and every other event keeps its bytes.
        """
        splits = [[THINKING_STREAM[i:i + size] for i in range(0, len(THINKING_STREAM), size)]
                  for size in (1, 7, 64, 300, len(THINKING_STREAM))]
        splits += [chunks for label, chunks in _splits(THINKING_STREAM, randoms=5) if label.startswith("random")]
        # other line endings take the gate's event-by-event path
        splits += [[_with_endings(THINKING_STREAM, ending)] for ending in ("\r\n", "\r", "mixed")]
        for data in splits:
            r = translate_request(body_of([{"role": "user", "content": "hi"}]), self.A).response()
            gate, sink, _, _ = _gate(r)
            for piece in data:
                gate.dataReceived(piece)
            gate.connectionLost(_done())
            out = sink.value()
            sent = _sdk_events(out)
            got = _sdk_events(b"".join(data))
            self.assertEqual(len(sent), len(got))
            for (name, payload), (_, original) in zip(sent, got):
                if "signature_delta" in original:
                    delta = json.loads(payload)["delta"]
                    self.assertEqual(read_mark(delta["signature"]),
                                     ("anthropic", json.loads(original)["delta"]["signature"]))
                else:
                    self.assertEqual(payload, original)
        # without marking rules the stream passes byte for byte
        gate, sink, _, _ = _gate(translate_request(body_of([])).response())
        gate.dataReceived(THINKING_STREAM)
        gate.connectionLost(_done())
        self.assertEqual(sink.value(), THINKING_STREAM)


class ThinkingRegimeTests(SynchronousTestCase):
    """
    Invariant 12 by regime: the tool-loop rule is manual thinking's only;
    adaptive, ``between_tools`` and unknown thinking are never touched, and
    the relay never touches sampling parameters or ``tool_choice``.
    """

    A = UpstreamRules(name="anthropic", policy=UNIQUE, mark_thinking=True)
    K = UpstreamRules(name="kimi", policy=ORIGINAL, own_ids=KIMI, mark_thinking=True)
    UNTOUCHED = (
        {"type": "adaptive"},
        {"type": "adaptive", "display": "summarized"},
        {"type": "between_tools"},
        {"type": "deliberate", "depth": 3},
        {"mode": "on"},
        "adaptive",
        None,
    )

    def crossing_loop(self, thinking) -> dict:
        """A tool loop whose final assistant message starts with the strict upstream's thinking."""
        body = {"model": "m", "max_tokens": 64, "temperature": 0.3, "top_p": 0.9, "top_k": 5,
                "tool_choice": {"type": "auto"}, "output_config": {"effort": "high"},
                "messages": [{"role": "user", "content": "hi"}]}
        if thinking is not None:
            body["thinking"] = thinking
        body["messages"] += [
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "t", "signature": mark_signature("anthropic", "SIG")},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]},
        ]
        return body

    def test_adaptive_and_unknown_never_touched(self):
        """
        Adaptive (explicit or left out), ``between_tools`` and any thinking
        the relay does not know keep ``thinking`` exactly as sent in a tool
        loop whose thinking was left out; nothing else at the top level moves.
        """
        for thinking in self.UNTOUCHED:
            body = self.crossing_loop(thinking)
            sent = json.loads(json.dumps(body))
            t = translate_request(body, self.K)
            self.assertFalse(t.thinking_disabled, thinking)
            self.assertFalse(t.table.thinking_disabled)
            up = t.upstream_body
            self.assertEqual({k: v for k, v in up.items() if k != "messages"},
                             {k: v for k, v in sent.items() if k != "messages"}, thinking)
            self.assertEqual(up["messages"][1]["content"], [sent["messages"][1]["content"][1]])
            self.assertEqual(body, sent, "the client's body was mutated")

    def test_manual_loses_only_thinking(self):
        """
        Manual thinking in the same loop goes without ``thinking`` and
        nothing else: the messages are those adaptive gets, and sampling
        parameters, ``tool_choice`` and every other field are as sent.
        """
        manual = self.crossing_loop({"type": "enabled", "budget_tokens": 1024})
        t = translate_request(manual, self.K)
        self.assertTrue(t.thinking_disabled)
        expected = {k: v for k, v in manual.items() if k not in ("thinking", "messages")}
        self.assertEqual({k: v for k, v in t.upstream_body.items() if k != "messages"}, expected)
        adaptive = translate_request(self.crossing_loop({"type": "adaptive"}), self.K)
        self.assertEqual(t.upstream_body["messages"], adaptive.upstream_body["messages"])
        # its maker gets the loop whole, with thinking
        self.assertEqual(translate_request(manual, self.A).upstream_body["thinking"], manual["thinking"])

    def test_manual_without_marks_untouched(self):
        """Without a crossing (no marks, rules that do not mark), manual thinking is left alone too."""
        body = self.crossing_loop({"type": "enabled", "budget_tokens": 1024})
        body["messages"][1]["content"][0]["signature"] = "SIG"
        for rules in (UpstreamRules(), UpstreamRules(policy=ORIGINAL)):
            self.assertIs(translate_request(body, rules).upstream_body, body)

    def session(self, thinking, turns: int = 120, every: int = 3) -> dict:
        """
        A perpetual agent loop alternating every ``every`` turns between the
        strict and the Kimi-style upstream, each thinking whenever its
        request carries thinking (or, adaptive, leaves it out), as the issue
        measured; per upstream, how many answers thought and how many of its
        own thinking blocks each request carried back.
        """
        messages = [{"role": "user", "content": "work"}]
        stats = {"answers": 0, "thought": 0, "kept": 0, "own": 0, "disabled": 0}
        for n in range(turns):
            rules = (self.A, self.K)[n // every % 2]
            body = {"model": "m", "max_tokens": 64, "messages": messages}
            if thinking is not None:
                body["thinking"] = thinking
            t = translate_request(body, rules)
            up = t.upstream_body
            stats["disabled"] += t.thinking_disabled
            own = sum(1 for e in t.table.thinking if e.maker == rules.name)
            carried = sum(1 for m in up["messages"] if isinstance(m["content"], list)
                          for b in m["content"] if b["type"] == "thinking")
            self.assertEqual(carried, own, "an upstream got thinking not its own")
            stats["own"] += own
            stats["kept"] += carried
            # a model of today thinks adaptively when ``thinking`` is left
            # out; one of manual thinking does not think without it
            left_out = {"type": "adaptive" if thinking is None else "disabled"}
            think = up.get("thinking", left_out)["type"] in ("adaptive", "enabled")
            blocks = [{"type": "thinking", "thinking": f"{n}", "signature": f"S{n}"}] if think else []
            tool_id = f"functions.Bash:{n % 2}" if rules is self.K else f"toolu_{n}"
            blocks.append({"type": "tool_use", "id": tool_id, "name": "Bash", "input": {}})
            message = {"role": "assistant", "content": blocks}
            t.response().translate_message(message)
            stats["answers"] += 1
            stats["thought"] += think
            messages = messages + [message, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": message["content"][-1]["id"], "content": "ok"}]}]
        return stats

    def test_adaptive_session_keeps_thinking(self):
        """
        The issue's measurement: 120 turns of one tool loop, alternating
        every 3 turns. Adaptive (explicit or left out): every answer thinks
        and every request carries back all of its upstream's own thinking.
        """
        for thinking in ({"type": "adaptive"}, None):
            stats = self.session(thinking)
            self.assertEqual(stats["disabled"], 0)
            self.assertEqual(stats["thought"], stats["answers"])
            # turn n carries back every earlier block of its upstream
            self.assertEqual(stats["own"], sum(n // 6 * 3 + (n % 6 if n % 6 < 3 else n % 6 - 3)
                                               for n in range(120)))

    def test_manual_thinking_comes_back_when_the_loop_closes(self):
        """
        Manual thinking in the same loop is deleted from the first switch on
        (Anthropic's rule for one assistant turn), and comes back with the
        first request whose loop is closed by a plain user turn, at either
        upstream.
        """
        manual = {"type": "enabled", "budget_tokens": 1024}
        stats = self.session(manual, turns=12)
        self.assertEqual(stats["thought"], 3)
        self.assertEqual(stats["disabled"], 9)
        body = self.crossing_loop(manual)
        body["messages"] += [{"role": "assistant", "content": [{"type": "text", "text": "done"}]},
                             {"role": "user", "content": [{"type": "text", "text": "next task"}]}]
        for rules in (self.A, self.K):
            t = translate_request(body, rules)
            self.assertFalse(t.thinking_disabled)
            self.assertEqual(t.upstream_body["thinking"], manual)

    def test_loop_behind_a_message_left_out(self):
        """
        When the client's final assistant message held only another
        upstream's thinking (a max_tokens stop), it is left out, and the
        upstream's final assistant message is the one before it: a manual
        tool loop still open there goes without ``thinking``.
        """
        manual = {"type": "enabled", "budget_tokens": 1024}
        body = {"model": "m", "max_tokens": 64, "thinking": manual, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "t", "signature": mark_signature("anthropic", "SIG")}]},
            {"role": "user", "content": [{"type": "text", "text": "go on"}]},
        ]}
        t = translate_request(body, self.K)
        self.assertEqual([m["role"] for m in t.upstream_body["messages"]], ["user", "assistant", "user", "user"])
        self.assertTrue(t.thinking_disabled)
        self.assertNotIn("thinking", t.upstream_body)
        # at its maker the final assistant message is its own thinking, and the loop is closed
        home = translate_request(body, self.A)
        self.assertFalse(home.thinking_disabled)
        self.assertEqual(home.upstream_body["thinking"], manual)
