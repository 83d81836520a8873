"""
The request translations to OpenAI's protocols (twisted_relay.openai:
responses_request, chat_request, dialects, capabilities), pure: each mapping
rule, and each peer bug of issue 33 that concerns requests, as a request the
peer got wrong.
"""

from __future__ import annotations

import json
from dataclasses import FrozenInstanceError
import re

from pydantic import TypeAdapter
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.openai.capabilities import CapabilityRejected
from twisted_relay.openai.chat_request import to_chat
from twisted_relay.openai.context import TranslateContext
from twisted_relay.openai.dialects import DIALECTS, GEMINI_SKIP_SIGNATURE, dialect_of
from twisted_relay.openai.envelope import account_of, seal
from twisted_relay.openai.request_parts import TOOL_ERROR_PREFIX
from twisted_relay.openai.responses_request import to_responses

ACCOUNT = account_of("sk-test-one")
OTHER_ACCOUNT = account_of("sk-test-two")
CTX = TranslateContext("gpt", ACCOUNT, "gpt-5.6-luna", session="3f0c9a8e-session")

#: Claude Code's system prompt: its attribution line (a hash that changes
#: with every request), then the prompt.
def system(cch: str = "a1b2c") -> list[dict]:
    return [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.b7f; cc_entrypoint=cli; cch=%s;" % cch},
        {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
         "cache_control": {"type": "ephemeral"}},
    ]


TOOLS = [{
    "name": "Bash",
    "description": "Run a command.",
    "input_schema": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                     "properties": {"command": {"type": "string"}}, "required": ["command"]},
}]

#: A reasoning item as OpenAI sends it on response.output_item.done, id removed.
ITEM = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "**Listing** the files"}],
        "encrypted_content": "gAAAAABpZ3Vlc3Mtbm90LXJlYWwtZW5jcnlwdGVkLWNvbnRlbnQ_" + "x" * 40}
PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")


def thinking(payload, upstream="gpt", account=ACCOUNT, text="**Listing** the files") -> dict:
    return {"type": "thinking", "thinking": text, "signature": seal(upstream, account, payload)}


def responses_thinking(*items, **kwargs) -> dict:
    return thinking({"kind": "responses", "items": list(items)}, **kwargs)


def tool_use(call_id: str, command: str = "ls") -> dict:
    return {"type": "tool_use", "id": call_id, "name": "Bash", "input": {"command": command}}


def tool_result(call_id: str, content="file.txt", **extra) -> dict:
    return dict({"type": "tool_result", "tool_use_id": call_id, "content": content}, **extra)


def request(messages, **extra) -> dict:
    body = {"model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True, "system": system(),
            "tools": TOOLS, "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
            "messages": messages}
    body.update(extra)
    return body


def tool_loop(turns: int, make_thinking=None) -> list[dict]:
    """A user prompt and ``turns`` assistant tool calls with their results."""
    messages = [{"role": "user", "content": "List the files."}]
    for turn in range(turns):
        content = [make_thinking(turn)] if make_thinking else []
        content.append(tool_use("toolu_%02d" % turn, "ls %d" % turn))
        messages.append({"role": "assistant", "content": content})
        messages.append({"role": "user", "content": [tool_result("toolu_%02d" % turn)]})
    return messages


def as_bytes(value) -> bytes:
    return json.dumps(value, sort_keys=False, separators=(",", ":")).encode("utf-8")


def rejected(test, capability, call, *args):
    error = test.assertRaises(CapabilityRejected, call, *args)
    test.assertEqual(error.capability, capability)
    test.assertTrue(error.message)
    return error


class ResponsesStatelessTests(SynchronousTestCase):
    """The stateless Responses request: nothing referenced, everything sent again."""

    def test_stateless_fields(self):
        sent = to_responses(request(tool_loop(2, lambda t: responses_thinking(ITEM))), CTX)
        self.assertEqual(sent["store"], False)
        self.assertEqual(sent["include"], ["reasoning.encrypted_content"])
        self.assertEqual(sent["model"], "gpt-5.6-luna")
        self.assertIs(sent["stream"], True)
        self.assertNotIn("previous_response_id", sent)
        # Every earlier item sent again, none by an id (rs_ ids are a 404 under store: false).
        self.assertEqual([item["type"] for item in sent["input"]],
                         ["message"] + ["reasoning", "function_call", "function_call_output"] * 2)
        for item in sent["input"]:
            self.assertNotIn("id", item)

    def test_items_are_the_sdk_types(self):
        from openai.types.responses.function_tool import FunctionTool
        from openai.types.responses.response_input_item import ResponseInputItem

        messages = tool_loop(1, lambda t: responses_thinking(ITEM))
        messages.append({"role": "assistant", "content": [{"type": "text", "text": "Done."}]})
        messages.append({"role": "user", "content": [
            {"type": "text", "text": "And this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}},
        ]})
        messages.append({"role": "assistant", "content": [tool_use("toolu_img")]})
        messages.append({"role": "user", "content": [tool_result("toolu_img", [
            {"type": "text", "text": "a screenshot"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}])]})
        sent = to_responses(request(messages), CTX)
        items = TypeAdapter(ResponseInputItem)
        for item in sent["input"]:
            if item["type"] != "reasoning":  # the SDK's type wants the id a stateless replay leaves out
                items.validate_python(item)
        for tool in sent["tools"]:
            FunctionTool.model_validate(tool)


class ResponsesCacheTests(SynchronousTestCase):
    """A prefix that stays the same from turn to turn (ccproxy-api #61)."""

    def test_instructions_leave_out_the_attribution_line(self):
        first = to_responses(request([{"role": "user", "content": "hi"}], system=system("00001")), CTX)
        second = to_responses(request([{"role": "user", "content": "hi"}], system=system("f9e8d")), CTX)
        self.assertEqual(first["instructions"], "You are Claude Code, Anthropic's official CLI for Claude.")
        self.assertEqual(as_bytes(first), as_bytes(second))
        self.assertNotIn(b"x-anthropic-billing-header", as_bytes(first))

    def test_attribution_line_left_out_of_a_longer_block(self):
        body = request([{"role": "user", "content": "hi"}], system=(
            "x-anthropic-billing-header: cc_version=2.1; cch=1;\nYou are helpful.\nBe brief."))
        self.assertEqual(to_responses(body, CTX)["instructions"], "You are helpful.\nBe brief.")

    def test_cache_key_from_the_session(self):
        body = request([{"role": "user", "content": "hi"}])
        key = to_responses(body, CTX)["prompt_cache_key"]
        self.assertEqual(to_responses(request([{"role": "user", "content": "again"}]), CTX)["prompt_cache_key"], key)
        self.assertNotEqual(to_responses(body, CTX._replace(session="another"))["prompt_cache_key"], key)
        self.assertLessEqual(len(key), 64)
        self.assertNotIn(CTX.session, key)
        self.assertNotIn("prompt_cache_key", to_responses(body, CTX._replace(session=None)))

    def test_earlier_items_byte_identical_across_turns(self):
        def turn_item(t):
            return dict(ITEM, encrypted_content="gAAAA-turn-%d" % t)

        messages = tool_loop(3, lambda t: responses_thinking(turn_item(t)))
        before = to_responses(request(messages, system=system("11111")), CTX)
        messages += [{"role": "assistant", "content": [responses_thinking(turn_item(3)), tool_use("toolu_03")]},
                     {"role": "user", "content": [tool_result("toolu_03")]}]
        after = to_responses(request(messages, system=system("22222")), CTX)
        self.assertEqual(before["instructions"], after["instructions"])
        self.assertEqual(as_bytes(before["input"]), as_bytes(after["input"][:len(before["input"])]))
        self.assertEqual(as_bytes(before["tools"]), as_bytes(after["tools"]))
        self.assertEqual(len(after["input"]), len(before["input"]) + 3)


class ResponsesReasoningTests(SynchronousTestCase):
    """Only this upstream's and account's reasoning goes back, as OpenAI sent it."""

    def test_encrypted_item_replayed_byte_for_byte(self):
        # litellm #40288 rebuilt reasoning from the summary text each turn and lost encrypted_content.
        block = responses_thinking(ITEM)
        sent = to_responses(request(tool_loop(1, lambda t: block)), CTX)
        self.assertEqual(as_bytes(sent["input"][1]), as_bytes(ITEM))
        # The visible thinking text plays no part: the envelope is replayed.
        edited = dict(block, thinking="something else entirely")
        again = to_responses(request(tool_loop(1, lambda t: edited)), CTX)
        self.assertEqual(as_bytes(again), as_bytes(sent))

    def test_an_item_id_is_left_out(self):
        sent = to_responses(request(tool_loop(1, lambda t: responses_thinking(dict(ITEM, id="rs_123")))), CTX)
        self.assertEqual(sent["input"][1], ITEM)

    def test_reasoning_where_each_block_was(self):
        first, second = dict(ITEM, encrypted_content="gAAAA-1"), dict(ITEM, encrypted_content="gAAAA-2")
        messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": [
            responses_thinking(first), {"type": "text", "text": "Looking."},
            responses_thinking(second), tool_use("toolu_1")]},
            {"role": "user", "content": [tool_result("toolu_1")]}]
        sent = to_responses(request(messages), CTX)
        self.assertEqual(sent["input"][1:5], [
            first, {"type": "message", "role": "assistant", "content": "Looking."},
            second, {"type": "function_call", "call_id": "toolu_1", "name": "Bash", "arguments": '{"command":"ls"}'}])

    def test_several_items_in_one_block(self):
        first, second = dict(ITEM, encrypted_content="gAAAA-1"), dict(ITEM, encrypted_content="gAAAA-2")
        sent = to_responses(request(tool_loop(1, lambda t: responses_thinking(first, second))), CTX)
        self.assertEqual(sent["input"][1:3], [first, second])
        self.assertEqual(sent["input"][3]["type"], "function_call")

    def test_reasoning_without_a_following_item_is_not_sent(self):
        messages = [{"role": "user", "content": "go"},
                    {"role": "assistant", "content": [{"type": "text", "text": "Hm."}, responses_thinking(ITEM)]},
                    {"role": "user", "content": "and?"}]
        sent = to_responses(request(messages), CTX)
        self.assertEqual([item["type"] for item in sent["input"]], ["message", "message", "message"])

    def test_foreign_and_damaged_envelopes_dropped(self):
        good = seal("gpt", ACCOUNT, {"kind": "responses", "items": [ITEM]})
        damaged = good[:40] + ("A" if good[40] != "A" else "B") + good[41:]
        blocks = [
            responses_thinking(ITEM, upstream="gpt-eu"),  # another upstream's
            responses_thinking(ITEM, account=OTHER_ACCOUNT),  # another account's (invalid_encrypted_content)
            {"type": "thinking", "thinking": "x", "signature": damaged},
            {"type": "thinking", "thinking": "x", "signature": good[:-3]},  # truncated
            {"type": "thinking", "thinking": "x", "signature": "EqQBCkgIARABGAIiQL2x"},  # Anthropic's own
            {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"},
            thinking({"kind": "chat", "reasoning_content": "other protocol"}),
        ]
        for block in blocks:
            sent = to_responses(request(tool_loop(1, lambda t: block)), CTX)
            self.assertEqual([item["type"] for item in sent["input"]],
                             ["message", "function_call", "function_call_output"], block)
            self.assertNotIn(b"gAAAA", as_bytes(sent))

    def test_redacted_thinking_with_an_envelope(self):
        block = {"type": "redacted_thinking", "data": seal("gpt", ACCOUNT, {"kind": "responses", "items": [ITEM]})}
        sent = to_responses(request(tool_loop(1, lambda t: block)), CTX)
        self.assertEqual(sent["input"][1], ITEM)


class ResponsesMappingTests(SynchronousTestCase):
    """Each field of the Messages request, as the Responses API takes it."""

    def test_tool_use_and_result(self):
        sent = to_responses(request(tool_loop(1)), CTX)
        self.assertEqual(sent["input"][1:], [
            {"type": "function_call", "call_id": "toolu_00", "name": "Bash", "arguments": '{"command":"ls 0"}'},
            {"type": "function_call_output", "call_id": "toolu_00", "output": "file.txt"}])

    def test_image_in_a_tool_result(self):
        # claude-code-proxy PR #59: images in tool results were dropped.
        content = [{"type": "text", "text": "screenshot"},
                   {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]
        messages = [{"role": "user", "content": "look"}, {"role": "assistant", "content": [tool_use("toolu_1")]},
                    {"role": "user", "content": [tool_result("toolu_1", content)]}]
        output = to_responses(request(messages), CTX)["input"][2]["output"]
        self.assertEqual(output, [{"type": "input_text", "text": "screenshot"},
                                  {"type": "input_image", "image_url": "data:image/png;base64," + PNG, "detail": "auto"}])

    def test_failed_tool_result_says_so(self):
        # sub2api PR #6923: a failed tool result reached the model as a success.
        messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": [tool_use("toolu_1")]},
                    {"role": "user", "content": [tool_result("toolu_1", "command not found: lss", is_error=True)]}]
        output = to_responses(request(messages), CTX)["input"][2]["output"]
        self.assertEqual(output, TOOL_ERROR_PREFIX + "command not found: lss")
        ok = to_responses(request(tool_loop(1)), CTX)["input"][2]["output"]
        self.assertFalse(ok.startswith(TOOL_ERROR_PREFIX))
        image = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]
        messages[2]["content"] = [tool_result("toolu_1", image, is_error=True)]
        output = to_responses(request(messages), CTX)["input"][2]["output"]
        self.assertEqual(output[0], {"type": "input_text", "text": TOOL_ERROR_PREFIX.rstrip()})

    def test_tokens_and_effort(self):
        sent = to_responses(request([{"role": "user", "content": "hi"}], temperature=0.2, top_p=0.9), CTX)
        self.assertEqual(sent["max_output_tokens"], 32000)
        self.assertEqual(sent["reasoning"], {"effort": "high", "summary": "auto"})
        self.assertNotIn("temperature", sent)
        self.assertNotIn("top_p", sent)
        self.assertEqual(to_responses(request([], max_tokens=1), CTX)["max_output_tokens"], 16)
        for budget, effort in ((1024, "low"), (8000, "medium"), (31999, "high"), (40000, "xhigh"), (100000, "max")):
            body = request([], thinking={"type": "enabled", "budget_tokens": budget})
            del body["output_config"]
            self.assertEqual(to_responses(body, CTX)["reasoning"]["effort"], effort, budget)
        body = request([], thinking={"type": "adaptive"}, output_config={"effort": "max"})
        self.assertEqual(to_responses(body, CTX)["reasoning"]["effort"], "max")
        disabled = request([], thinking={"type": "disabled"}, temperature=0.2)
        del disabled["output_config"]
        sent = to_responses(disabled, CTX)
        self.assertEqual(sent["reasoning"], {"effort": "none"})
        self.assertEqual(sent["temperature"], 0.2)
        unsaid = request([])
        del unsaid["output_config"], unsaid["thinking"]
        self.assertEqual(to_responses(unsaid, CTX)["reasoning"], {"summary": "auto"})

    def test_tool_choice(self):
        for choice, expected in (({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
                                 ({"type": "tool", "name": "Bash"}, {"type": "function", "name": "Bash"})):
            self.assertEqual(to_responses(request([], tool_choice=choice), CTX)["tool_choice"], expected)
        sent = to_responses(request([], tool_choice={"type": "auto", "disable_parallel_tool_use": True}), CTX)
        self.assertIs(sent["parallel_tool_calls"], False)
        self.assertNotIn("parallel_tool_calls", to_responses(request([]), CTX))

    def test_custom_tools(self):
        tools = [TOOLS[0], {"name": "Empty", "input_schema": {}, "cache_control": {"type": "ephemeral"}}]
        sent = to_responses(request([], tools=tools), CTX)["tools"]
        self.assertEqual(sent, [
            {"type": "function", "name": "Bash", "description": "Run a command.", "strict": False,
             "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
            {"type": "function", "name": "Empty", "parameters": {"type": "object", "properties": {}}, "strict": False}])

    def test_web_search(self):
        tool = {"type": "web_search_20250305", "name": "web_search", "allowed_domains": ["example.com"]}
        sent = to_responses(request([], tools=[tool], tool_choice={"type": "tool", "name": "web_search"}), CTX)
        self.assertEqual(sent["tools"], [{"type": "web_search", "filters": {"allowed_domains": ["example.com"]}}])
        self.assertEqual(sent["tool_choice"], {"type": "web_search"})

    def test_what_cannot_be_carried(self):
        rejected(self, "stop_sequences", to_responses, request([], stop_sequences=["END"]), CTX)
        for kind in ("web_fetch_20250910", "code_execution_20250825", "bash_20250124"):
            rejected(self, "tool_type:" + kind, to_responses, request([], tools=[{"type": kind, "name": "x"}]), CTX)
        file_image = {"type": "image", "source": {"type": "file", "file_id": "file_1"}}
        rejected(self, "image_block", to_responses, request([{"role": "user", "content": [file_image]}]), CTX)

    def test_images_and_documents(self):
        content = [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
            {"type": "document", "title": "spec.pdf",
             "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "plain words"}},
        ]
        sent = to_responses(request([{"role": "user", "content": content}]), CTX)
        self.assertEqual(sent["input"][0]["content"], [
            {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"},
            {"type": "input_file", "filename": "spec.pdf", "file_data": "data:application/pdf;base64,JVBERi0x"},
            {"type": "input_text", "text": "plain words"}])

    def test_user_and_structured_output(self):
        body = request([], metadata={"user_id": '{"device_id":"d1","session_id":"s1"}'},
                       output_config={"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}})
        sent = to_responses(body, CTX)
        self.assertEqual(len(sent["safety_identifier"]), 32)
        self.assertNotIn("device_id", as_bytes(sent).decode())
        self.assertEqual(sent["text"], {"format": {"type": "json_schema", "name": "output",
                                                   "schema": {"type": "object"}, "strict": False}})


def chat_ctx(dialect: str) -> TranslateContext:
    return TranslateContext(dialect + "-up", ACCOUNT, "model-x", dialect=dialect, session="3f0c9a8e-session")


def chat_thinking(dialect: str, payload: dict, **kwargs) -> dict:
    return thinking(dict(payload, kind="chat"), upstream=kwargs.pop("upstream", dialect + "-up"), **kwargs)


def assistants(sent: dict) -> list[dict]:
    return [m for m in sent["messages"] if m["role"] == "assistant"]


class ChatReasoningTests(SynchronousTestCase):
    """The reasoning each dialect wants back, and none where it is refused."""

    def test_deepseek_gets_reasoning_content_back(self):
        # litellm #28045: reasoning_content never sent back -> 400 at the first tool_use in history.
        ctx = chat_ctx("deepseek")
        messages = tool_loop(2, lambda t: chat_thinking("deepseek", {"reasoning_content": "I list %d." % t}))
        sent = to_chat(request(messages), ctx)
        self.assertEqual([m["reasoning_content"] for m in assistants(sent)], ["I list 0.", "I list 1."])

    def test_deepseek_empty_reasoning_on_foreign_tool_turns(self):
        messages = tool_loop(1, lambda t: responses_thinking(ITEM))  # a turn another upstream answered
        messages += [{"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
                     {"role": "user", "content": "thanks"}]
        sent = to_chat(request(messages), chat_ctx("deepseek"))
        first, second = assistants(sent)
        self.assertEqual(first["reasoning_content"], "")
        self.assertNotIn("reasoning_content", second)  # no tool calls: not asked for

    def test_kimi_every_tool_turn_carries_reasoning(self):
        # new-api #3121: "reasoning_content is missing in assistant tool call message at index 7".
        def block(turn):
            if turn % 3 == 0:
                return chat_thinking("kimi", {"reasoning_content": "turn %d" % turn})
            if turn % 3 == 1:
                return chat_thinking("kimi", {"reasoning_content": "lost"}, account=OTHER_ACCOUNT)
            return {"type": "thinking", "thinking": "from Claude", "signature": "EqQBCkgIARAB"}

        sent = to_chat(request(tool_loop(9, block)), chat_ctx("kimi"))
        calls = [m for m in sent["messages"] if m.get("tool_calls")]
        self.assertEqual(len(calls), 9)
        for index, message in enumerate(calls):
            self.assertIn("reasoning_content", message, index)
        self.assertEqual(calls[6]["reasoning_content"], "turn 6")
        self.assertEqual(calls[7]["reasoning_content"], "")

    def test_gemini_thought_signatures(self):
        # CLIProxyAPI #2098: the first function call of a step without its thought_signature -> 400.
        ctx = chat_ctx("gemini")
        signed = {"role": "assistant", "content": [
            chat_thinking("gemini", {"thought_signatures": {"call_a": "sig-A"}}),
            {"type": "tool_use", "id": "call_a", "name": "Bash", "input": {}},
            {"type": "tool_use", "id": "call_b", "name": "Bash", "input": {}}]}
        foreign = {"role": "assistant", "content": [tool_use("toolu_from_claude")]}
        messages = [{"role": "user", "content": "go"}, foreign,
                    {"role": "user", "content": [tool_result("toolu_from_claude")]}, signed,
                    {"role": "user", "content": [tool_result("call_a"), tool_result("call_b")]}]
        sent = to_chat(request(messages), ctx)
        first, second = assistants(sent)
        self.assertEqual(first["tool_calls"][0]["extra_content"],
                         {"google": {"thought_signature": GEMINI_SKIP_SIGNATURE}})
        self.assertEqual(second["tool_calls"][0]["extra_content"], {"google": {"thought_signature": "sig-A"}})
        self.assertNotIn("extra_content", second["tool_calls"][1])
        # A new user turn changes none of it: the prefix stays.
        later = to_chat(request(messages + [{"role": "user", "content": "more"}]), ctx)
        self.assertEqual(as_bytes(later["messages"][:len(sent["messages"])]), as_bytes(sent["messages"]))

    def test_gemini_signature_of_a_renamed_call_goes_to_the_first(self):
        signed = {"role": "assistant", "content": [
            chat_thinking("gemini", {"thought_signatures": {"upstream-id": "sig-A"}}), tool_use("toolu_renamed")]}
        sent = to_chat(request([{"role": "user", "content": "go"}, signed]), chat_ctx("gemini"))
        self.assertEqual(assistants(sent)[0]["tool_calls"][0]["extra_content"]["google"]["thought_signature"], "sig-A")

    def test_groq_gets_no_reasoning_field(self):
        # freellmapi #1070: reasoning_content sent to Groq -> 400 "property 'reasoning_content' is unsupported".
        ctx = chat_ctx("groq")
        messages = tool_loop(2, lambda t: chat_thinking("groq", {"reasoning_content": "thought"}))
        sent = to_chat(request(messages, metadata={"user_id": "u1"}), ctx)
        text = as_bytes(sent).decode()
        for name in ("reasoning_content", "reasoning", "reasoning_details", "prompt_cache_key", "store"):
            self.assertNotIn('"%s"' % name, text)
        self.assertEqual(len(sent["user"]), 32)

    def test_openrouter_reasoning_details_unmodified(self):
        details = [{"type": "reasoning.encrypted", "data": "opaque==", "id": "call_1", "format": "google-gemini-v1",
                    "index": 0}, {"type": "reasoning.text", "text": "Let me", "signature": None, "index": 1}]
        messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": [
            chat_thinking("openrouter", {"reasoning_details": details}), tool_use("call_1")]}]
        sent = to_chat(request(messages), chat_ctx("openrouter"))
        self.assertEqual(as_bytes(assistants(sent)[0]["reasoning_details"]), as_bytes(details))
        self.assertEqual(sent["reasoning"], {"effort": "high"})

    def test_foreign_envelopes_give_nothing(self):
        for block in (chat_thinking("deepseek", {"reasoning_content": "x"}, upstream="deepseek-other"),
                      chat_thinking("deepseek", {"reasoning_content": "x"}, account=OTHER_ACCOUNT)):
            sent = to_chat(request(tool_loop(1, lambda t: block)), chat_ctx("deepseek"))
            self.assertEqual(assistants(sent)[0]["reasoning_content"], "")

    def test_no_reasoning_field_for_dialects_without_one(self):
        for dialect in ("openai", "mistral", "xai"):
            block = chat_thinking(dialect, {"reasoning_content": "x"})
            sent = to_chat(request(tool_loop(1, lambda t: block)), chat_ctx(dialect))
            self.assertNotIn(b"reasoning_content", as_bytes(sent), dialect)


class ChatMappingTests(SynchronousTestCase):
    """Messages, tools and fields as each dialect takes them."""

    def test_messages(self):
        messages = tool_loop(1) + [{"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
                                   {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
        sent = to_chat(request(messages, system=system("12345")), chat_ctx("openai"))
        self.assertEqual(sent["messages"], [
            {"role": "system", "content": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "toolu_00", "type": "function", "function": {"name": "Bash", "arguments": '{"command":"ls 0"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_00", "content": "file.txt"},
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "a\n\nb"}])

    def test_messages_are_the_sdk_types(self):
        from openai.types.chat.chat_completion_message_param import ChatCompletionMessageParam
        from openai.types.chat.chat_completion_tool_param import ChatCompletionToolParam

        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
        messages = tool_loop(1) + [{"role": "assistant", "content": [tool_use("toolu_2")]},
                                   {"role": "user", "content": [tool_result("toolu_2", [image]),
                                                                {"type": "text", "text": "see"}]}]
        sent = to_chat(request(messages), chat_ctx("openai"))
        adapter = TypeAdapter(ChatCompletionMessageParam)
        for message in sent["messages"]:
            adapter.validate_python(message)
        for tool in sent["tools"]:
            TypeAdapter(ChatCompletionToolParam).validate_python(tool)

    def test_images_of_tool_results_follow_the_tool_messages(self):
        # claude-code-proxy PR #59: images inside tool_result were replaced by placeholders.
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
        messages = [{"role": "user", "content": "look"},
                    {"role": "assistant", "content": [tool_use("toolu_1"), tool_use("toolu_2")]},
                    {"role": "user", "content": [tool_result("toolu_1", [{"type": "text", "text": "shot"}, image]),
                                                 tool_result("toolu_2"), {"type": "text", "text": "next"}]}]
        sent = to_chat(request(messages), chat_ctx("gemini"))
        self.assertEqual([m["role"] for m in sent["messages"]], ["system", "user", "assistant", "tool", "tool", "user"])
        self.assertEqual(sent["messages"][3]["content"], "shot")
        self.assertEqual(sent["messages"][5]["content"], [
            {"type": "text", "text": "[images of tool result toolu_1]"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}},
            {"type": "text", "text": "next"}])
        rejected(self, "image_block", to_chat, request(messages), chat_ctx("deepseek"))

    def test_failed_tool_result_says_so(self):
        messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": [tool_use("toolu_1")]},
                    {"role": "user", "content": [tool_result("toolu_1", "boom", is_error=True)]}]
        sent = to_chat(request(messages), chat_ctx("mistral"))
        self.assertEqual(sent["messages"][-1], {"role": "tool", "tool_call_id": "toolu_1",
                                                "content": TOOL_ERROR_PREFIX + "boom"})

    def test_stream_usage(self):
        self.assertEqual(to_chat(request([]), chat_ctx("deepseek"))["stream_options"], {"include_usage": True})
        self.assertNotIn("stream_options", to_chat(request([], stream=False), chat_ctx("deepseek")))
        self.assertNotIn("stream", to_chat(request([], stream=False), chat_ctx("deepseek")))
        self.assertNotIn("stream_options", to_chat(request([]), chat_ctx("mistral")))

    def test_fields_per_dialect(self):
        body = request([{"role": "user", "content": "hi"}], temperature=0.3, tool_choice={"type": "any"},
                       metadata={"user_id": "u1"})
        openai = to_chat(body, chat_ctx("openai"))
        self.assertEqual(openai["max_completion_tokens"], 32000)
        self.assertEqual(openai["reasoning_effort"], "high")
        self.assertNotIn("temperature", openai)  # GPT's reasoning models refuse it
        self.assertEqual(len(openai["prompt_cache_key"]), len(to_responses(body, CTX)["prompt_cache_key"]))
        self.assertIn("safety_identifier", openai)
        self.assertEqual(openai["tool_choice"], "required")
        deepseek = to_chat(body, chat_ctx("deepseek"))
        self.assertEqual((deepseek["max_tokens"], deepseek["reasoning_effort"], deepseek["temperature"]),
                         (32000, "high", 0.3))
        self.assertNotIn("prompt_cache_key", deepseek)
        mistral = to_chat(body, chat_ctx("mistral"))
        self.assertEqual(set(mistral), {"model", "messages", "tools", "tool_choice", "max_tokens", "temperature",
                                        "stream"})
        choice = {"type": "tool", "name": "Bash", "disable_parallel_tool_use": True}
        sent = to_chat(request([], tool_choice=choice), chat_ctx("groq"))
        self.assertEqual(sent["tool_choice"], {"type": "function", "function": {"name": "Bash"}})
        self.assertIs(sent["parallel_tool_calls"], False)
        self.assertEqual(sent["tools"][0]["function"]["parameters"],
                         {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]})

    def test_what_cannot_be_carried(self):
        pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}}
        for dialect in DIALECTS:
            rejected(self, "document_block", to_chat, request([{"role": "user", "content": [pdf]}]), chat_ctx(dialect))
            rejected(self, "tool_type:web_search_20250305", to_chat,
                     request([], tools=[{"type": "web_search_20250305", "name": "web_search"}]), chat_ctx(dialect))
        text_document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "words"}}
        sent = to_chat(request([{"role": "user", "content": [text_document]}]), chat_ctx("deepseek"))
        self.assertEqual(sent["messages"][-1], {"role": "user", "content": "words"})
        schema = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
        rejected(self, "structured_outputs_unsupported", to_chat, request([], output_config=schema), chat_ctx("deepseek"))
        self.assertEqual(to_chat(request([], output_config=schema), chat_ctx("openai"))["response_format"]["type"],
                         "json_schema")
        rejected(self, "stop_sequences", to_chat, request([], stop_sequences=["END"]), chat_ctx("xai"))
        rejected(self, "stop_sequences", to_chat, request([], stop_sequences=list("abcde")), chat_ctx("openai"))
        self.assertEqual(to_chat(request([], stop_sequences=["END"]), chat_ctx("openai"))["stop"], ["END"])

    def test_prefix_stable_across_turns(self):
        ctx = chat_ctx("deepseek")
        messages = tool_loop(3, lambda t: chat_thinking("deepseek", {"reasoning_content": "r%d" % t}))
        before = to_chat(request(messages, system=system("aaaaa")), ctx)
        messages += tool_loop(1)[1:]
        after = to_chat(request(messages, system=system("bbbbb")), ctx)
        self.assertEqual(as_bytes(before["messages"]), as_bytes(after["messages"][:len(before["messages"])]))
        self.assertNotIn(b"billing-header", as_bytes(after))


class DialectTests(SynchronousTestCase):
    """The dialects' own rules."""

    def test_mistral_ids(self):
        # openclaw #57672: "Tool call id was toolu_01... but must be a-z, A-Z, 0-9, with a length of 9."
        pattern = re.compile(DIALECTS["mistral"].id_pattern)
        self.assertTrue(pattern.fullmatch("a1B2c3D4e"))
        for refused in ("toolu_01ABCDEFGH", "a1B2c3D4", "a1B2c3D4e5", "a1B2c3D4_"):
            self.assertIsNone(pattern.fullmatch(refused), refused)

    def test_responses_call_ids(self):
        pattern = re.compile(DIALECTS["openai"].id_pattern)
        self.assertTrue(pattern.fullmatch("toolu_" + "a" * 58))
        self.assertIsNone(pattern.fullmatch("toolu_" + "a" * 59))

    def test_kimi_ids_come_back_unchanged(self):
        own = re.compile(DIALECTS["kimi"].own_ids)
        self.assertTrue(own.fullmatch("functions.Bash:3"))
        self.assertIsNone(own.fullmatch("toolu_01ABC"))

    def test_gemini_function_schema(self):
        # Gemini's function parameters are its Schema, a subset of OpenAPI 3.0: Claude Code's Read tool as
        # it sends it was a 400 "Invalid JSON payload received. Unknown name \"additionalProperties\" ...",
        # then "exclusiveMinimum" (llmgateway #1763, pi #4932).
        read = {"name": "Read", "description": "Reads a file.", "input_schema": {
            "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
            "properties": {
                "file_path": {"description": "The absolute path to the file to read", "type": "string"},
                "offset": {"type": "integer", "minimum": 0, "maximum": 9007199254740991},
                "limit": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9007199254740991},
                "ratio": {"type": "number", "exclusiveMaximum": 1.5},
                "url": {"type": "string", "format": "uri"},
                "mode": {"const": "lines"},
                "tags": {"type": "array", "items": {"type": ["string", "null"], "propertyNames": {"pattern": "x"}}},
                "either": {"oneOf": [{"type": "string"}, {"type": ["integer", "boolean"]}]},
                "ref": {"$ref": "#/$defs/Other", "description": "Elsewhere."},
            },
            "required": ["file_path"], "additionalProperties": False, "$defs": {"Other": {"type": "string"}}}}
        sent = to_chat(request(tool_loop(1), tools=[read]), chat_ctx("gemini"))
        self.assertEqual(sent["tools"][0]["function"]["parameters"], {
            "type": "object",
            "properties": {
                "file_path": {"description": "The absolute path to the file to read", "type": "string"},
                "offset": {"type": "integer", "minimum": 0, "maximum": 9007199254740991},
                "limit": {"type": "integer", "minimum": 1, "maximum": 9007199254740991},
                "ratio": {"type": "number", "maximum": 1.5},
                "url": {"type": "string"},
                "mode": {"enum": ["lines"]},
                "tags": {"type": "array", "items": {"nullable": True, "type": "string"}},
                "either": {"anyOf": [{"type": "string"}, {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}]},
                "ref": {"description": "Elsewhere."},
            },
            "required": ["file_path"]})
        # Every other dialect, and the Responses API, take JSON Schema as it is (without $schema).
        expected = {k: v for k, v in read["input_schema"].items() if k != "$schema"}
        self.assertEqual(to_chat(request(tool_loop(1), tools=[read]), chat_ctx("deepseek"))["tools"][0]["function"]
                         ["parameters"], expected)
        self.assertEqual(to_responses(request(tool_loop(1), tools=[read]), CTX)["tools"][0]["parameters"], expected)

    def test_every_dialect(self):
        self.assertEqual(set(DIALECTS), {"openai", "deepseek", "kimi", "glm", "gemini", "groq", "mistral",
                                         "openrouter", "xai"})
        for name, dialect in DIALECTS.items():
            self.assertEqual(dialect.name, name)
            self.assertRaises(FrozenInstanceError, setattr, dialect, "images", False)
        self.assertRaises(ValueError, dialect_of, "cohere")
        self.assertEqual(DIALECTS["deepseek"].effort("medium"), "high")
        self.assertIsNone(DIALECTS["kimi"].effort("high"))


class CrossUpstreamHistoryTests(SynchronousTestCase):
    """Blocks an Anthropic upstream left in the history."""

    def history(self, name: str) -> list[dict]:
        return [{"role": "user", "content": "find it"},
                {"role": "assistant", "content": [
                    {"type": "server_tool_use", "id": "srvtoolu_1", "name": name, "input": {"query": "twisted"}},
                    {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
                    {"type": "text", "text": "Found."}]},
                {"role": "user", "content": "thanks"}]

    def test_web_search_replayed(self):
        sent = to_responses(request(self.history("web_search")), CTX)
        self.assertEqual(sent["input"][1:3], [
            {"type": "web_search_call", "status": "completed", "action": {"type": "search", "query": "twisted"}},
            {"type": "message", "role": "assistant", "content": "Found."}])
        chat = to_chat(request(self.history("web_search")), chat_ctx("gemini"))
        self.assertEqual(assistants(chat)[0]["content"], "[web search: twisted]\nFound.")

    def test_other_server_tools_refused(self):
        rejected(self, "tool_type:web_fetch", to_responses, request(self.history("web_fetch")), CTX)
        rejected(self, "tool_type:web_fetch", to_chat, request(self.history("web_fetch")), chat_ctx("openai"))
