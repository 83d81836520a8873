"""
Tests for :mod:`twisted_relay.translation`: named vectors of
``docs/id-translation.md``. The invariants over generated conversations are
in ``tests.test_translation_properties``.
"""

from __future__ import annotations

import copy
import re

import ujson
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.translation import (
    ORIGINAL,
    POLICIES,
    UNIQUE,
    Entry,
    TranslationTable,
    is_declaration,
    separator_for,
    translate_request,
)


def tool_use(block_id, name="Bash", input_=None, **extra):
    block = {"type": "tool_use", "id": block_id, "name": name,
             "input": {"command": "ls"} if input_ is None else input_}
    block.update(extra)
    return block


def tool_result(block_id):
    return {"type": "tool_result", "tool_use_id": block_id, "content": "ok"}


def body_of(messages):
    return {"model": "m", "max_tokens": 1024, "messages": messages}


def upstream_ids(body):
    """Every declaration id and reference id of a body, in walk order."""
    found = []
    for message in body["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            if not isinstance(block, dict):
                continue
            if "tool_use_id" in block:
                found.append(block["tool_use_id"])
            if isinstance(block.get("caller"), dict):
                found.append(block["caller"]["tool_id"])
            if is_declaration(block):
                found.append(block["id"])
    return found


class Session:
    """
    A client in front of the relay: each answer of the (scripted) upstream
    goes through the response translator and into the history, followed by
    a user message with a ``tool_result`` for every ``tool_use``.
    """

    def __init__(self, policy, messages=None):
        self.policy = policy
        self.messages = list(messages or [])
        self.sent = []  # upstream-bound messages, serialised turn by turn

    def request(self):
        # a copy of the list: a clean body goes upstream as the very object
        t = translate_request(body_of(list(self.messages)), self.policy)
        self.sent.append(ujson.dumps(t.upstream_body["messages"]))
        return t

    def answer(self, blocks, streaming=False):
        """Send the history, let the upstream answer ``blocks``; return the rewrites."""
        r = self.request().response()
        blocks = copy.deepcopy(blocks)
        if streaming:
            for block in blocks:
                r.translate_block(block)
        else:
            r.translate_message({"role": "assistant", "content": blocks})
        self.messages.append({"role": "assistant", "content": blocks})
        results = [tool_result(b["id"]) for b in blocks if b.get("type") == "tool_use"]
        self.messages.append({"role": "user", "content": results or "go on"})
        return r.rewrites

    def client_ids(self):
        return [b["id"] for m in self.messages if isinstance(m["content"], list)
                for b in m["content"] if is_declaration(b)]


WORKED = [
    {"role": "assistant", "content": [tool_use("toolu_abc123")]},
    {"role": "user", "content": [tool_result("toolu_abc123")]},
    {"role": "assistant", "content": [tool_use("toolu_abc123-2")]},
    {"role": "user", "content": [tool_result("toolu_abc123-2")]},
]


class WorkedExampleTests(SynchronousTestCase):
    """The worked example of the contract, row by row."""

    def test_unique(self):
        """
        Under ``unique`` the history goes upstream as the client has it, and
        a third ``toolu_abc123`` from the upstream reaches the client as
        ``toolu_abc123-3``.
        """
        body = body_of(copy.deepcopy(WORKED))
        t = translate_request(body, UNIQUE)
        self.assertFalse(t.changed)
        self.assertIs(t.upstream_body, body)
        self.assertEqual(
            [(e.message_index, e.kind, e.client_id, e.upstream_id, e.original_id, e.occurrence)
             for e in t.table.entries],
            [(0, "declaration", "toolu_abc123", "toolu_abc123", "toolu_abc123", 1),
             (1, "reference", "toolu_abc123", "toolu_abc123", "toolu_abc123", None),
             (2, "declaration", "toolu_abc123-2", "toolu_abc123-2", "toolu_abc123", 2),
             (3, "reference", "toolu_abc123-2", "toolu_abc123-2", "toolu_abc123", None)])
        r = t.response()
        block = tool_use("toolu_abc123")
        self.assertTrue(r.translate_block(block))
        self.assertEqual(block["id"], "toolu_abc123-3")
        [rewrite] = r.rewrites
        self.assertEqual((rewrite.upstream_id, rewrite.client_id, rewrite.occurrence),
                         ("toolu_abc123", "toolu_abc123-3", 3))

    def test_original(self):
        """
        Under ``original`` the upstream-id column reads ``toolu_abc123`` on
        every row, and the answer is rewritten as under ``unique``.
        """
        body = body_of(copy.deepcopy(WORKED))
        t = translate_request(body, ORIGINAL)
        self.assertTrue(t.changed)
        self.assertEqual(upstream_ids(t.upstream_body), ["toolu_abc123"] * 4)
        self.assertEqual([e.upstream_id for e in t.table.entries], ["toolu_abc123"] * 4)
        self.assertEqual([e.points_to for e in t.table.entries], [None, (0, 0), None, (2, 0)])
        block = tool_use("toolu_abc123")
        t.response().translate_block(block)
        self.assertEqual(block["id"], "toolu_abc123-3")

    def test_session_reaches_the_example(self):
        """
        A session whose upstream emits ``toolu_abc123`` three times gives the
        client ``toolu_abc123``, ``-2``, ``-3``, under both policies.
        """
        for policy in POLICIES:
            s = Session(policy)
            for _ in range(3):
                s.answer([tool_use("toolu_abc123")])
            self.assertEqual(s.client_ids(), ["toolu_abc123", "toolu_abc123-2", "toolu_abc123-3"])


class ResponseTests(SynchronousTestCase):
    """Outbound rewriting of one upstream response."""

    def test_parallel_same_id(self):
        """
        Two parallel ``tool_use`` blocks with one id in one response become
        ``X`` and ``X-2``; with equal name and input the second is flagged as
        a suspected double emission.
        """
        for policy in POLICIES:
            r = translate_request(body_of([]), policy).response()
            first, second = tool_use("toolu_x"), tool_use("toolu_x")
            self.assertFalse(r.translate_block(first))
            self.assertTrue(r.translate_block(second))
            self.assertEqual((first["id"], second["id"]), ("toolu_x", "toolu_x-2"))
            [rewrite] = r.rewrites
            self.assertTrue(rewrite.suspected_double_emission)
            self.assertEqual(rewrite.occurrence, 2)

    def test_parallel_same_id_different_calls(self):
        """
        Two different calls that share an id are renamed but not flagged.
        """
        r = translate_request(body_of([]), UNIQUE).response()
        message = {"content": [tool_use("toolu_x", input_={"a": 1}), tool_use("toolu_x", input_={"a": 2})]}
        self.assertTrue(r.translate_message(message))
        self.assertEqual([b["id"] for b in message["content"]], ["toolu_x", "toolu_x-2"])
        self.assertFalse(r.rewrites[0].suspected_double_emission)

    def test_streaming_double_emission_by_name(self):
        """
        In a stream ``content_block_start`` carries ``input: {}``, so there
        the suspicion rests on the name alone (the documented limit).
        """
        r = translate_request(body_of([]), UNIQUE).response()
        blocks = [tool_use("toolu_x", input_={}), tool_use("toolu_x", input_={}),
                  tool_use("toolu_x", name="Read", input_={})]
        for block in blocks:
            r.translate_block(block)
        self.assertEqual([b["id"] for b in blocks], ["toolu_x", "toolu_x-2", "toolu_x-3"])
        self.assertEqual([rw.suspected_double_emission for rw in r.rewrites], [True, False])

    def test_server_tool_and_its_result(self):
        """
        A ``server_tool_use`` repeating an earlier id is rewritten with ``_``
        (its alphabet has no hyphen), and the ``web_search_tool_result`` that
        follows it in the same answer points at the new id.
        """
        history = [{"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srvtoolu_01A", "name": "web_search", "input": {}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_01A", "content": []}]}]
        for policy in POLICIES:
            r = translate_request(body_of(copy.deepcopy(history)), policy).response()
            message = {"content": [
                {"type": "text", "text": "Searching."},
                {"type": "server_tool_use", "id": "srvtoolu_01A", "name": "web_search", "input": {"q": 1}},
                {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_01A", "content": []}]}
            self.assertTrue(r.translate_message(message))
            server, result = message["content"][1:]
            self.assertEqual(server["id"], "srvtoolu_01A_2")
            self.assertRegex(server["id"], r"^srvtoolu_[a-zA-Z0-9_]+$")
            self.assertEqual(result["tool_use_id"], "srvtoolu_01A_2")
            self.assertEqual([(rw.field, rw.client_id) for rw in r.rewrites],
                             [("id", "srvtoolu_01A_2"), ("tool_use_id", "srvtoolu_01A_2")])

    def test_result_for_an_earlier_turn(self):
        """
        A server-tool result for a call of an earlier turn (after
        ``pause_turn``) is mapped to that call's client id.
        """
        s = Session(ORIGINAL)
        server = {"type": "server_tool_use", "id": "srvtoolu_a", "name": "web_search", "input": {}}
        s.answer([server])
        s.answer([server])
        self.assertEqual(s.client_ids(), ["srvtoolu_a", "srvtoolu_a_2"])
        r = s.request().response()
        result = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_a", "content": []}
        self.assertTrue(r.translate_block(result))
        self.assertEqual(result["tool_use_id"], "srvtoolu_a_2")

    def test_caller_reference_in_response(self):
        """
        A ``tool_use`` called from code execution points through
        ``caller.tool_id`` at the (rewritten) ``server_tool_use`` that made it.
        """
        history = [{"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srvtoolu_c", "name": "code_execution", "input": {}}]}]
        r = translate_request(body_of(history), UNIQUE).response()
        server = {"type": "server_tool_use", "id": "srvtoolu_c", "name": "code_execution", "input": {}}
        call = tool_use("toolu_k", caller={"type": "code_execution_20250825", "tool_id": "srvtoolu_c"})
        r.translate_block(server)
        self.assertTrue(r.translate_block(call))
        self.assertEqual(call["caller"]["tool_id"], "srvtoolu_c_2")
        self.assertEqual(call["id"], "toolu_k")

    def test_clean_response_untouched(self):
        """
        Blocks that collide with nothing are left alone and reported as
        unchanged, so the gate can forward their bytes as they came.
        """
        t = translate_request(body_of(copy.deepcopy(WORKED)), UNIQUE)
        r = t.response()
        blocks = [{"type": "text", "text": "hi"}, tool_use("toolu_new"),
                  {"type": "server_tool_use", "id": "srvtoolu_new", "name": "web_search", "input": {}},
                  {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_new", "content": []},
                  {"type": "web_search_tool_result", "tool_use_id": "toolu_abc123", "content": []}]
        before = copy.deepcopy(blocks)
        self.assertEqual([r.translate_block(b) for b in blocks], [False] * 5)
        self.assertEqual(blocks, before)
        self.assertEqual(r.rewrites, [])

    def test_each_response_is_fresh(self):
        """
        Two translators of one request (a retried response) do not see each
        other's blocks.
        """
        t = translate_request(body_of([]), UNIQUE)
        first, second = t.response(), t.response()
        a, b = tool_use("toolu_x"), tool_use("toolu_x")
        first.translate_block(a)
        second.translate_block(b)
        self.assertEqual((a["id"], b["id"]), ("toolu_x", "toolu_x"))

    def test_kimi_ids(self):
        """
        Kimi-style ids (``functions.Bash:3``) keep their shape and take a
        ``-k`` suffix.
        """
        for policy in POLICIES:
            s = Session(policy)
            s.answer([tool_use("functions.Bash:3")])
            s.answer([tool_use("functions.Bash:3")])
            self.assertEqual(s.client_ids(), ["functions.Bash:3", "functions.Bash:3-2"])
            if policy == ORIGINAL:
                self.assertEqual(upstream_ids(s.request().upstream_body), ["functions.Bash:3"] * 4)

    def test_future_declaration_type(self):
        """
        Any ``*_tool_use`` type is a declaration, with the ``_`` separator.
        """
        block = {"type": "future_tool_use", "id": "ftu_1", "name": "n", "input": {}}
        self.assertTrue(is_declaration(block))
        self.assertEqual(separator_for("future_tool_use"), "_")
        self.assertEqual(separator_for("tool_use"), "-")
        history = [{"role": "assistant", "content": [dict(block)]}]
        r = translate_request(body_of(history), UNIQUE).response()
        self.assertTrue(r.translate_block(block))
        self.assertEqual(block["id"], "ftu_1_2")

    def test_odd_blocks(self):
        """Blocks of odd shapes are skipped by the response translator."""
        r = translate_request(body_of([]), UNIQUE).response()
        for odd in (None, "text", 3, [], {"type": 7, "id": "x"}, {"tool_use_id": ["x"]}, {"caller": "x"},
                    {"caller": {"tool_id": 1}}):
            self.assertFalse(r.translate_block(odd))
        for odd in (None, {}, {"content": "text"}, {"content": None}, {"content": [1, None]}):
            self.assertFalse(r.translate_message(odd))


class RequestTests(SynchronousTestCase):
    """Inbound translation of one request's history."""

    def test_orphan(self):
        """
        A ``tool_result`` whose id no earlier block declared goes upstream
        unchanged and is recorded; ``X-7`` is an orphan even when ``X`` was
        declared.
        """
        messages = [{"role": "assistant", "content": [tool_use("toolu_x")]},
                    {"role": "user", "content": [tool_result("toolu_x-7"), tool_result("toolu_gone")]},
                    {"role": "assistant", "content": [tool_use("toolu_gone")]}]
        for policy in POLICIES:
            body = body_of(messages)
            t = translate_request(body, policy)
            self.assertIs(t.upstream_body, body)
            self.assertEqual([(e.client_id, e.upstream_id, e.points_to, e.original_id) for e in t.orphans],
                             [("toolu_x-7", "toolu_x-7", None, None),
                              ("toolu_gone", "toolu_gone", None, None)])

    def test_raw_duplicate_unique_repaired(self):
        """
        Under ``unique`` a history already holding a duplicate the relay did
        not make is repaired: the repeat goes upstream as ``X-2`` (the first
        stays), the references after it follow, and ``X-2`` already taken
        pushes the next repair to ``X-3``.
        """
        messages = [
            {"role": "assistant", "content": [tool_use("toolu_x")]},
            {"role": "user", "content": [tool_result("toolu_x")]},
            {"role": "assistant", "content": [tool_use("toolu_x")]},
            {"role": "user", "content": [tool_result("toolu_x")]},
            {"role": "assistant", "content": [tool_use("toolu_x")]},
            {"role": "user", "content": [tool_result("toolu_x")]},
        ]
        body = body_of(messages)
        before = copy.deepcopy(body)
        t = translate_request(body, UNIQUE)
        self.assertTrue(t.changed)
        self.assertEqual(upstream_ids(t.upstream_body),
                         ["toolu_x", "toolu_x", "toolu_x-2", "toolu_x-2", "toolu_x-3", "toolu_x-3"])
        self.assertEqual([(e.message_index, e.upstream_id) for e in t.repairs], [(2, "toolu_x-2"), (4, "toolu_x-3")])
        self.assertEqual([e.repaired for e in t.table.entries], [False, False, True, True, True, True])
        self.assertEqual(body, before)
        # the session goes on: a new emission of toolu_x needs no repair later
        r = t.response()
        block = tool_use("toolu_x")
        r.translate_block(block)
        self.assertEqual(block["id"], "toolu_x-4")

    def test_repair_skips_taken_ids(self):
        """A repair takes the smallest ``X-j`` not yet used, client or upstream."""
        messages = [{"role": "assistant", "content": [tool_use("x"), tool_use("x-2"), tool_use("x")]}]
        t = translate_request(body_of(messages), UNIQUE)
        self.assertEqual(upstream_ids(t.upstream_body), ["x", "x-2", "x-3"])

    def test_emitted_repair_id_is_rewritten(self):
        """
        Under ``unique`` an emitted id equal to a repaired upstream id is
        rewritten, so that the next request needs no further repair.
        """
        messages = [{"role": "assistant", "content": [tool_use("x"), tool_use("x")]}]
        t = translate_request(body_of(messages), UNIQUE)
        block = tool_use("x-2")
        self.assertTrue(t.response().translate_block(block))
        self.assertEqual(block["id"], "x-2-2")
        messages.append({"role": "assistant", "content": [block]})
        self.assertEqual(upstream_ids(translate_request(body_of(messages), UNIQUE).upstream_body),
                         ["x", "x-2", "x-2-2"])

    def test_raw_duplicate_original_unchanged(self):
        """Under ``original`` raw duplicates go upstream unchanged."""
        messages = [{"role": "assistant", "content": [tool_use("toolu_x")]},
                    {"role": "user", "content": [tool_result("toolu_x")]},
                    {"role": "assistant", "content": [tool_use("toolu_x")]},
                    {"role": "user", "content": [tool_result("toolu_x")]}]
        body = body_of(messages)
        t = translate_request(body, ORIGINAL)
        self.assertIs(t.upstream_body, body)
        self.assertEqual(t.repairs, [])
        self.assertEqual([e.occurrence for e in t.table.entries if e.kind == "declaration"], [1, 2])
        self.assertEqual([e.points_to for e in t.table.entries if e.kind == "reference"], [(0, 0), (2, 0)])

    def test_native_suffix_unique(self):
        """
        Under ``unique`` a natively emitted ``X-2`` that repeats nothing passes
        unchanged (no-op when clean), and a later ``X`` skips the taken ``X-2``.
        """
        s = Session(UNIQUE)
        s.answer([tool_use("toolu_x")])
        self.assertEqual(s.answer([tool_use("toolu_x-2")]), [])
        s.answer([tool_use("toolu_x")])
        self.assertEqual(s.client_ids(), ["toolu_x", "toolu_x-2", "toolu_x-3"])
        body = body_of(s.messages)
        self.assertIs(translate_request(body, UNIQUE).upstream_body, body)

    def test_native_suffix_original(self):
        """
        Under ``original`` a natively emitted ``X-2`` after ``X`` looks like a
        rewrite, so it is rewritten (``X-2-2``), and decodes back exactly.
        """
        s = Session(ORIGINAL)
        s.answer([tool_use("toolu_x")])
        s.answer([tool_use("toolu_x-2")])
        self.assertEqual(s.client_ids(), ["toolu_x", "toolu_x-2-2"])
        self.assertEqual(upstream_ids(s.request().upstream_body), ["toolu_x", "toolu_x", "toolu_x-2", "toolu_x-2"])

    def test_suffix_the_relay_never_makes(self):
        """
        Under ``original`` a ``tool_use`` id ending in ``_<digits>`` is not a
        rewrite (the relay suffixes ``tool_use`` ids with ``-``): a history
        holding one goes upstream unchanged.
        """
        messages = [{"role": "assistant", "content": [tool_use("toolu_x"), tool_use("toolu_x_2")]},
                    {"role": "user", "content": [tool_result("toolu_x"), tool_result("toolu_x_2")]}]
        body = body_of(messages)
        t = translate_request(body, ORIGINAL)
        self.assertIs(t.upstream_body, body)
        self.assertEqual(t.table.entries[1].original_id, "toolu_x_2")

    def test_cross_type_lookalike(self):
        """
        Under ``original`` a ``tool_use`` that echoes a rewritten
        ``server_tool_use`` id (``srv_2``) is rewritten with ``-`` and still
        decodes exactly: lookalikes are recognised across separators.
        """
        s = Session(ORIGINAL)
        server = {"type": "server_tool_use", "id": "srv", "name": "web_search", "input": {}}
        s.answer([server])
        s.answer([server])
        s.answer([tool_use("srv_2")])
        self.assertEqual(s.client_ids(), ["srv", "srv_2", "srv_2-2"])
        self.assertEqual(upstream_ids(s.request().upstream_body), ["srv", "srv", "srv_2", "srv_2"])

    def test_lookalike_chain(self):
        """
        A chain of lookalikes (``X``, native ``X-2``, native ``X-2-2``, then
        ``X`` again) decodes exactly under ``original``; the second ``X`` may
        take the free ``X-2``, since the native one went to ``X-2-2``.
        """
        emitted = ["x", "x-2", "x-2-2", "x", "x-2"]
        s = Session(ORIGINAL)
        for block_id in emitted:
            s.answer([tool_use(block_id)])
        self.assertEqual(s.client_ids(), ["x", "x-2-2", "x-2-2-2", "x-2", "x-2-3"])
        self.assertEqual(len(set(s.client_ids())), len(emitted))
        sent = upstream_ids(s.request().upstream_body)
        self.assertEqual(sent[::2], emitted)
        self.assertEqual(sent[1::2], emitted)

    def test_caller_reference_inbound(self):
        """
        ``caller.tool_id`` references are translated back like
        ``tool_use_id`` ones, without touching the client's blocks.
        """
        call = tool_use("toolu_k", caller={"type": "code_execution_20250825", "tool_id": "srvtoolu_c_2"})
        messages = [{"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srvtoolu_c", "name": "code_execution", "input": {}},
            {"type": "server_tool_use", "id": "srvtoolu_c_2", "name": "code_execution", "input": {}},
            call]}]
        body = body_of(messages)
        t = translate_request(body, ORIGINAL)
        sent = t.upstream_body["messages"][0]["content"][2]
        self.assertEqual(sent["caller"]["tool_id"], "srvtoolu_c")
        self.assertEqual(call["caller"]["tool_id"], "srvtoolu_c_2")
        [ref] = [e for e in t.table.entries if e.field == "caller.tool_id"]
        self.assertEqual((ref.points_to, ref.original_id, ref.upstream_id), ((0, 1), "srvtoolu_c", "srvtoolu_c"))

    def test_system_messages_walked(self):
        """
        ``role: "system"`` messages inside ``messages`` are walked like any
        other: an id declared there counts.
        """
        messages = [{"role": "system", "content": [tool_use("toolu_s")]},
                    {"role": "assistant", "content": [tool_use("toolu_s")]},
                    {"role": "system", "content": [tool_result("toolu_s")]}]
        t = translate_request(body_of(messages), UNIQUE)
        self.assertEqual(upstream_ids(t.upstream_body), ["toolu_s", "toolu_s-2", "toolu_s-2"])
        self.assertEqual(t.table.entries[2].points_to, (1, 0))

    def test_string_content(self):
        """A message whose content is a string has no blocks."""
        messages = [{"role": "user", "content": "hello toolu_x"},
                    {"role": "assistant", "content": [tool_use("toolu_x")]}]
        t = translate_request(body_of(messages), UNIQUE)
        self.assertEqual([(e.message_index, e.block_index) for e in t.table.entries], [(1, 0)])

    def test_odd_shapes(self):
        """
        Odd messages, contents, blocks and ids carry no usable id: they are
        skipped and never raise.
        """
        messages = [
            None, "text", 3, [], {}, {"role": "user"}, {"content": None}, {"content": {"type": "text"}},
            {"content": [None, 1, "s", [], {"type": None}, {"type": 5, "id": "a"},
                         {"type": "tool_use", "id": 7}, {"type": "tool_use"}, {"tool_use_id": None},
                         {"tool_use_id": 12}, {"caller": "x"}, {"caller": {"tool_id": []}},
                         {"type": "tool_use", "id": "ok", "caller": None}]},
            {"content": [{"type": "tool_use", "id": "ok"}, {"type": ["x"], "tool_use_id": "ok"}]},
        ]
        for policy in POLICIES:
            body = body_of(copy.deepcopy(messages))
            before = copy.deepcopy(body)
            t = translate_request(body, policy)
            self.assertEqual(body, before)
            self.assertEqual([(e.message_index, e.block_index, e.kind, e.upstream_id) for e in t.table.entries],
                             [(8, 12, "declaration", "ok"), (9, 0, "declaration", "ok" if policy == ORIGINAL else "ok-2"),
                              (9, 1, "reference", "ok" if policy == ORIGINAL else "ok-2")])
            self.assertIsNone(t.table.entries[2].block_type)
            t.table.format()
        for odd in ({}, {"messages": None}, {"messages": "x"}, {"messages": {}}, [], None):
            t = translate_request(odd, UNIQUE)
            self.assertIs(t.upstream_body, odd)
            self.assertFalse(t.changed)
            self.assertEqual(t.table.entries, ())

    def test_unknown_policy(self):
        """An unknown policy is a configuration error."""
        self.assertRaises(ValueError, translate_request, body_of([]), "both")

    def test_body_never_mutated_and_shared(self):
        """
        The client's body is never written to; the upstream body copies only
        the messages and blocks it rewrites and shares everything else.
        """
        messages = copy.deepcopy(WORKED) + [{"role": "user", "content": [{"type": "text", "text": "x"}]}]
        body = body_of(messages)
        body["tools"] = [{"name": "Bash"}]
        before = ujson.dumps(body)
        t = translate_request(body, ORIGINAL)
        self.assertEqual(ujson.dumps(body), before)
        up = t.upstream_body
        self.assertIsNot(up, body)
        self.assertIs(up["tools"], body["tools"])
        self.assertIs(up["messages"][0], messages[0])
        self.assertIs(up["messages"][4], messages[4])
        self.assertIsNot(up["messages"][2], messages[2])
        self.assertIs(up["messages"][2]["content"][0]["input"], messages[2]["content"][0]["input"])

    def test_clean_is_identity(self):
        """A history without collisions goes upstream as the very same object."""
        for policy in POLICIES:
            s = Session(policy)
            for n in range(5):
                self.assertEqual(s.answer([tool_use("toolu_%d" % n), {"type": "text", "text": "t"}]), [])
            body = body_of(s.messages)
            t = translate_request(body, policy)
            self.assertIs(t.upstream_body, body)
            self.assertFalse(t.changed)

    def test_upstream_history_byte_stable(self):
        """
        The upstream-bound history of each turn is a byte prefix of the
        next turn's, so the upstream's prompt cache keeps hitting.
        """
        script = ["x", "x", "x-2", "srv", "x", "x-2-2", "srv", "functions.Bash:1", "functions.Bash:1"]
        for policy in POLICIES:
            s = Session(policy)
            for block_id in script:
                kind = "server_tool_use" if block_id == "srv" else "tool_use"
                s.answer([{"type": kind, "id": block_id, "name": "n", "input": {}}])
            s.request()
            dumps = s.sent
            for earlier, later in zip(dumps, dumps[1:]):
                self.assertTrue(later.startswith(earlier[:-1]), policy)
            if policy == ORIGINAL:
                # the check is about rewritten histories, not untouched ones
                self.assertNotEqual(dumps[-1], ujson.dumps(s.messages))


class TableTests(SynchronousTestCase):
    """The translation table as a value."""

    def table(self):
        messages = copy.deepcopy(WORKED) + [
            {"role": "assistant", "content": [tool_use("toolu_abc123")]},
            {"role": "user", "content": [tool_result("toolu_abc123"), tool_result("toolu_nobody")]}]
        return translate_request(body_of(messages), UNIQUE).table

    def test_round_trip(self):
        """
        A table survives ``to_dict`` / JSON / ``from_dict`` unchanged, so a
        replay can compare a recomputed table with a dumped one.
        """
        table = self.table()
        dumped = ujson.loads(ujson.dumps(table.to_dict()))
        self.assertEqual(TranslationTable.from_dict(dumped), table)
        self.assertEqual(TranslationTable.from_dict(dumped).entries[3].points_to, (2, 0))
        self.assertNotEqual(TranslationTable.from_dict(dumped), translate_request(body_of(WORKED), UNIQUE).table)

    def test_equal_by_value(self):
        """Two translations of one request give equal tables."""
        self.assertEqual(self.table(), self.table())
        self.assertEqual(hash(self.table()), hash(self.table()))

    def test_from_dict_rejects(self):
        """Anything that is not a dumped table is refused with ValueError."""
        good = self.table().to_dict()
        for bad in (None, {}, dict(good, version=99), dict(good, policy="x"),
                    dict(good, entries=[{"message_index": 0}])):
            self.assertRaises(ValueError, TranslationTable.from_dict, bad)

    def test_format_shows_every_entry(self):
        """
        ``format()`` prints one row per entry, with its position, ids, and
        the repair and orphan marks.
        """
        table = self.table()
        text = table.format()
        lines = text.splitlines()
        self.assertEqual(len(lines), 3 + len(table.entries))
        self.assertIn("repaired", lines[8])
        self.assertIn("orphan", lines[-1])
        for line, entry in zip(lines[3:], table.entries):
            cells = re.split(r"\s{2,}", line.strip())
            self.assertEqual(cells[:3], [str(entry.message_index), str(entry.block_index), entry.kind])
            self.assertIn(entry.client_id, cells)
            self.assertIn(entry.upstream_id, cells)
        self.assertIn("1 repaired, 1 orphans", lines[0])

    def test_entry_flags(self):
        """``Entry.orphan`` and ``Entry.changed`` read the entry's fields."""
        entry = Entry(0, 0, "tool_use_id", "reference", "tool_result", "a", "b", None, None, None)
        self.assertTrue(entry.orphan)
        self.assertTrue(entry.changed)
