"""
Tests for :mod:`twisted_relay.translation` against today's types
(``docs/id-translation.md``, "Passing what it does not know"): every
id-bearing place of the installed ``anthropic`` SDK's content blocks is
translated the way ``tool_use``/``tool_result`` are (declarations and
references), and everything else (unknown block types, ``role: "system"``
messages, ``fallback``, ``compaction``, fields and values the relay does not
know, ``msg_`` ids) passes by value, in place.
"""

from __future__ import annotations

import copy
import inspect
import typing

import anthropic.types as sdk_types
import anthropic.types.beta as sdk_beta
import ujson
from pydantic import BaseModel
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.translation import (
    ORIGINAL,
    UNIQUE,
    UpstreamRules,
    encode_id,
    is_declaration,
    mark_signature,
    translate_request,
)

KIMI_ID = "functions.Bash:1"
STRICT = UpstreamRules(name="strict", policy=UNIQUE, mark_thinking=True)
KIMI = UpstreamRules(name="kimi", policy=ORIGINAL, own_ids=r"^functions\.[A-Za-z]+:[0-9]+$", mark_thinking=True)


def _literal(annotation) -> str | None:
    """The first ``Literal`` value inside ``annotation`` (through ``Required``/``Optional``)."""
    while True:
        if typing.get_origin(annotation) is typing.Literal:
            return typing.get_args(annotation)[0]
        args = typing.get_args(annotation)
        if not args:
            return None
        annotation = args[0]


def sdk_id_places() -> dict[str, set[str]]:
    """
    Every content block ``type`` of the installed SDK (responses and request
    params, beta included) -> which of ``id``, ``tool_use_id`` and ``caller``
    it carries.
    """
    places: dict[str, set[str]] = {}
    for module in (sdk_types, sdk_beta):
        for name in dir(module):
            cls = getattr(module, name)
            if not inspect.isclass(cls):
                continue
            if issubclass(cls, BaseModel) and name.endswith("Block"):
                fields = {k: f.annotation for k, f in cls.model_fields.items()}
            elif name.endswith("BlockParam") and hasattr(cls, "__annotations__"):
                try:
                    fields = typing.get_type_hints(cls)
                except Exception:  # a forward reference the SDK leaves open
                    continue
            else:
                continue
            kind = _literal(fields.get("type"))
            if isinstance(kind, str):
                places.setdefault(kind, set()).update(k for k in ("id", "tool_use_id", "caller") if k in fields)
    return places


def declaration(kind: str, block_id: str, **extra) -> dict:
    block = {"type": kind, "id": block_id, "name": "web_search" if kind == "server_tool_use" else "Bash",
             "input": {"q": 1}}
    if kind == "mcp_tool_use":
        block["server_name"] = "files"
    block.update(extra)
    return block


def reference(kind: str, block_id: str) -> dict:
    return {"type": kind, "tool_use_id": block_id, "content": [], "extra_field": {"kept": [1, 2]}}


def every_block_of_today() -> list:
    """One assistant message's worth of every block type that carries no id, with fields of today."""
    return [
        {"type": "text", "text": "t", "citations": None, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"type": "fallback", "from": {"model": "claude-fable-5-1"}, "to": {"model": "claude-opus-5-5"},
         "trigger": {"type": "refusal", "category": "cyber"}},
        {"type": "compaction", "content": "summary", "encrypted_content": "ENC", "signature": "CSIG",
         "tool_changes": [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "Bash"}}]},
        {"type": "mcp_tool_listing", "mcp_server_name": "files", "tools": [{"name": "read", "input_schema": {}}]},
        {"type": "container_upload", "file_id": "file_011"},
        {"type": "connector_text", "text": "x", "id": "not-a-tool-id"},
        {"type": "hologram", "id": "h1", "frames": [{"id": "f1"}], "future": True},
    ]


class SdkTypesTests(SynchronousTestCase):
    """Every id-bearing place of the installed SDK's content blocks."""

    def test_the_sdk_places_are_known(self):
        """
        Every block type of the SDK with an ``id`` is a declaration to the
        core, every other is not; references sit in ``tool_use_id`` and
        ``caller`` only (the list below is the SDK's, read from its types).
        """
        places = sdk_id_places()
        declarations = {kind for kind, fields in places.items() if "id" in fields}
        self.assertEqual(declarations, {"tool_use", "server_tool_use", "mcp_tool_use"})
        for kind in places:
            self.assertEqual(is_declaration({"type": kind}), kind in declarations, kind)
        references = {kind for kind, fields in places.items() if "tool_use_id" in fields}
        self.assertTrue({"tool_result", "mcp_tool_result", "advisor_tool_result", "web_search_tool_result",
                         "web_fetch_tool_result", "code_execution_tool_result", "tool_search_tool_result",
                         "bash_code_execution_tool_result", "text_editor_code_execution_tool_result"}
                        <= references, references)
        self.assertEqual({kind for kind, fields in places.items() if "caller" in fields},
                         {"tool_use", "server_tool_use", "web_search_tool_result", "web_fetch_tool_result"})

    def test_every_reference_follows_its_declaration_upstream(self):
        """
        A Kimi id on its way to a strict upstream is encoded in its
        declaration and in every reference of every SDK type that can carry
        one, ``caller.tool_id`` included.
        """
        places = sdk_id_places()
        encoded = encode_id(KIMI_ID)
        for kind in sorted(k for k, f in places.items() if "tool_use_id" in f):
            body = {"model": "m", "max_tokens": 8, "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [declaration("tool_use", KIMI_ID)]},
                {"role": "user" if kind == "tool_result" else "assistant", "content": [reference(kind, KIMI_ID)]},
            ]}
            up = translate_request(body, STRICT).upstream_body["messages"]
            self.assertEqual(up[1]["content"][0]["id"], encoded)
            self.assertEqual(up[2]["content"][0], dict(reference(kind, KIMI_ID), tool_use_id=encoded), kind)
        for caller_type in ("code_execution_20250825", "code_execution_20260120"):
            for kind in ("tool_use", "server_tool_use", "web_search_tool_result", "web_fetch_tool_result"):
                block = {"type": kind, "caller": {"type": caller_type, "tool_id": KIMI_ID}}
                body = {"model": "m", "max_tokens": 8, "messages": [
                    {"role": "assistant", "content": [declaration("server_tool_use", KIMI_ID), block]}]}
                got = translate_request(body, STRICT).upstream_body["messages"][0]["content"][1]
                self.assertEqual(got["caller"], {"type": caller_type, "tool_id": encoded}, kind)

    def test_every_declaration_type_collides_and_is_repaired(self):
        """
        A history holding each declaration type twice with one id goes to a
        ``unique`` upstream with the repeat renamed (``-2`` for ``tool_use``,
        ``_2`` for the rest) and the references after it following.
        """
        for kind, ref_kind, block_id, repaired in (
            ("tool_use", "tool_result", "toolu_1", "toolu_1-2"),
            ("server_tool_use", "web_search_tool_result", "srvtoolu_1", "srvtoolu_1_2"),
            ("server_tool_use", "advisor_tool_result", "srvtoolu_1", "srvtoolu_1_2"),
            ("mcp_tool_use", "mcp_tool_result", "mcptoolu_1", "mcptoolu_1_2"),
        ):
            turn = [{"role": "assistant", "content": [declaration(kind, block_id)]},
                    {"role": "user", "content": [reference(ref_kind, block_id)]}]
            body = {"model": "m", "max_tokens": 8, "messages": copy.deepcopy(turn + turn)}
            up = translate_request(body, UNIQUE).upstream_body["messages"]
            self.assertEqual([up[2]["content"][0]["id"], up[3]["content"][0]["tool_use_id"]], [repaired] * 2)
            self.assertEqual(up[:2], turn)

    def test_every_declaration_type_renamed_in_an_answer(self):
        """
        An answer that reuses history ids of every declaration type reaches
        the client renamed, each reference in the same answer (results,
        ``caller.tool_id``) following; nothing else changes.
        """
        history = [{"role": "user", "content": "go"}, {"role": "assistant", "content": [
            declaration("server_tool_use", "srvtoolu_a"), reference("web_search_tool_result", "srvtoolu_a"),
            declaration("mcp_tool_use", "mcptoolu_a"), reference("mcp_tool_result", "mcptoolu_a"),
            declaration("tool_use", "toolu_a")]},
            {"role": "user", "content": [reference("tool_result", "toolu_a")]}]
        answer = [
            declaration("server_tool_use", "srvtoolu_a", name="code_execution"),
            declaration("tool_use", "toolu_a", caller={"type": "code_execution_20260120", "tool_id": "srvtoolu_a"}),
            reference("code_execution_tool_result", "srvtoolu_a"),
            declaration("server_tool_use", "srvtoolu_b", name="advisor"),
            {"type": "advisor_tool_result", "tool_use_id": "srvtoolu_b",
             "content": {"type": "advisor_redacted_result", "encrypted_content": "E"}},
            declaration("mcp_tool_use", "mcptoolu_a"), reference("mcp_tool_result", "mcptoolu_a"),
        ] + every_block_of_today()
        for rules in (UpstreamRules(), UpstreamRules(policy=ORIGINAL), STRICT):
            message = {"id": "msg_01abc", "type": "message", "role": "assistant", "content": copy.deepcopy(answer)}
            translator = translate_request({"messages": history}, rules).response()
            self.assertTrue(translator.translate_message(message))
            got = message["content"]
            self.assertEqual(message["id"], "msg_01abc")
            self.assertEqual([got[0]["id"], got[1]["caller"]["tool_id"], got[2]["tool_use_id"]], ["srvtoolu_a_2"] * 3)
            self.assertEqual(got[1]["id"], "toolu_a-2")
            self.assertEqual([got[5]["id"], got[6]["tool_use_id"]], ["mcptoolu_a_2"] * 2)
            self.assertEqual(got[3:5], answer[3:5])
            self.assertEqual(got[7:], every_block_of_today())


class PassingThroughTests(SynchronousTestCase):
    """What the relay does not know passes by value, in place."""

    def history(self) -> list:
        return [
            {"role": "system", "content": [{"type": "tool_addition", "tool": {"type": "tool_definition",
                                            "definition": {"name": "Grep", "input_schema": {}}}}]},
            {"role": "user", "content": [{"type": "text", "text": "go", "future_field": 1}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "a", "signature": mark_signature("strict", "S1")},
                declaration("tool_use", "toolu_1", toolset_name="browser"),
            ] + every_block_of_today()},
            {"role": "system", "clear_at": "next_user_message", "content": [
                {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "Grep"}}]},
            {"role": "user", "content": [reference("tool_result", "toolu_1")]},
            {"role": "narrator", "content": [{"type": "aside", "id": "toolu_1"}]},
        ]

    def body(self, messages: list) -> dict:
        return {"model": "m", "max_tokens": 8, "messages": messages, "future": {"x": [1]},
                "diagnostics": {"previous_message_id": "msg_01prev"},
                "thread": {"type": "continue", "previous_message_id": "msg_01prev"},
                "fallbacks": "default", "fallback_credit_token": "fct_1", "thinking": {"type": "adaptive"}}

    def test_clean_history_of_today_is_the_very_body(self):
        """
        A clean history holding every block of today, ``role: "system"``
        messages and a role the relay does not know goes as the very object,
        to every kind of upstream.
        """
        messages = self.history()
        messages[2]["content"][0]["signature"] = "S1"  # made before the relay: no mark
        body = self.body(messages)
        for rules in (UpstreamRules(), UpstreamRules(policy=ORIGINAL), STRICT, KIMI):
            self.assertIs(translate_request(body, rules).upstream_body, body)

    def test_only_ids_and_foreign_thinking_change(self):
        """
        With a collision repaired and another upstream's thinking left out,
        every other block, field, value and message is as the client sent
        it, in its place (``fallback`` and ``compaction`` included), and
        ``msg_`` ids are never rewritten.
        """
        messages = self.history()
        messages = messages[:2] + [{"role": "assistant", "content": [declaration("tool_use", "toolu_1")]},
                                   {"role": "user", "content": [reference("tool_result", "toolu_1")]}] + messages[2:]
        body = self.body(messages)
        before = ujson.dumps(body)
        up = translate_request(body, KIMI).upstream_body
        self.assertEqual(ujson.dumps(body), before)
        expected = ujson.loads(before)
        # the repeat of toolu_1 and its result; strict's thinking left out
        assistant = expected["messages"][4]["content"]
        assistant[1]["id"] = "toolu_1-2"
        expected["messages"][6]["content"][0]["tool_use_id"] = "toolu_1-2"
        del assistant[0]
        self.assertEqual(up, expected)
        # its maker gets its block, and only its mark removed
        home = translate_request(body, STRICT).upstream_body["messages"][4]["content"]
        self.assertEqual(home[0], {"type": "thinking", "thinking": "a", "signature": "S1"})
        self.assertEqual(home[2:], every_block_of_today())
