"""
Tests for the answers of :mod:`twisted_relay.openai`: a Responses stream or
response and a Chat Completions stream or completion as Anthropic's events
and message, OpenAI's usage and errors as Anthropic's.

The upstream's side is built from OpenAI's documented event shapes, each
event (but ``response.cancelled``, which the SDK does not list) checked
with the official ``openai`` SDK's types; the relay's side is checked
against Anthropic's stream grammar (:func:`check_grammar`) and read by the
official ``anthropic`` SDK's stream accumulator (the events served as SSE
over an in-memory HTTP transport), which must give the expected final
message. Each peer bug of issue 33 about answers has a test named after it.
"""

from __future__ import annotations

import json

import anthropic
import httpx2
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.openai.chat_answer import ChatStream, message_of_completion
from twisted_relay.openai.context import TranslateContext
from twisted_relay.openai.envelope import account_of, open_envelope
from twisted_relay.openai.errors import PROMPT_TOO_LONG, UpstreamFailed, anthropic_error_of
from twisted_relay.openai.message_events import MessageEvents
from twisted_relay.openai.responses_answer import ResponsesStream, message_of_response
from twisted_relay.openai.usage import usage_of_chat, usage_of_responses

ACCOUNT = account_of("sk-test-key")
CTX = TranslateContext("gpt", ACCOUNT, "gpt-5.5", requested_model="claude-opus-4-6")
_EVENT = TypeAdapter(ResponseStreamEvent)

# -- the Anthropic side: its grammar and the SDK's reading -----------------------------

_DELTA_BLOCK = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "thinking",
                "input_json_delta": "tool_use"}


def check_grammar(test: SynchronousTestCase, events: list) -> None:
    """
    ``events`` as Anthropic streams them: ``message_start`` once and first;
    blocks one at a time at consecutive indices, each given only deltas of
    its type; ``message_delta`` then ``message_stop`` last, or an ``error``
    last and nothing after it.
    """
    test.assertTrue(events, "no events")
    for name, payload in events:
        test.assertEqual(payload["type"], name)
    names = [name for name, _ in events]
    if names[-1] == "error":
        test.assertEqual(names.count("error"), 1)
        test.assertNotIn("message_stop", names)
        test.assertNotIn("message_delta", names)
    else:
        test.assertEqual(names[-2:], ["message_delta", "message_stop"])
        test.assertEqual(names.count("message_delta"), 1)
    if names[0] != "error":
        test.assertEqual(names[0], "message_start")
    test.assertLessEqual(names.count("message_start"), 1)
    open_index, open_type, next_index = None, None, 0
    for name, payload in events:
        if name == "content_block_start":
            test.assertIsNone(open_index, "a block started while another was open")
            test.assertEqual(payload["index"], next_index)
            open_index, open_type = payload["index"], payload["content_block"]["type"]
            next_index += 1
        elif name == "content_block_delta":
            test.assertEqual(payload["index"], open_index)
            test.assertEqual(_DELTA_BLOCK[payload["delta"]["type"]], open_type,
                             "a %s inside a %s block" % (payload["delta"]["type"], open_type))
        elif name == "content_block_stop":
            test.assertEqual(payload["index"], open_index)
            open_index = open_type = None
        elif name == "message_delta":
            test.assertIsNone(open_index, "message_delta with a block open")


def sse_of(events: list) -> bytes:
    return b"".join(
        b"event: %s\ndata: %s\n\n" % (name.encode(), json.dumps(payload).encode()) for name, payload in events)


def sdk_final_message(events: list):
    """The final Message the official SDK's stream accumulator makes of ``events`` served as SSE."""
    body = sse_of(events)

    def serve(request):
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    client = anthropic.Anthropic(api_key="test", base_url="http://relay.test", max_retries=0,
                                 http_client=httpx2.Client(transport=httpx2.MockTransport(serve)))
    with client.messages.stream(model="claude-opus-4-6", max_tokens=1000,
                                messages=[{"role": "user", "content": "hi"}]) as stream:
        return stream.get_final_message()


def blocks_of(events: list) -> list[dict]:
    """The content blocks ``events`` make, by hand: each block's deltas joined."""
    blocks: list[dict] = []
    for name, payload in events:
        if name == "content_block_start":
            blocks.append(dict(payload["content_block"], json=""))
        elif name == "content_block_delta":
            block, delta = blocks[payload["index"]], payload["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                block["json"] += delta["partial_json"]
    return blocks


def opened(signature: str, ctx: TranslateContext = CTX):
    return open_envelope(signature, ctx.upstream, ctx.account)


# -- the upstream's side: Responses events as OpenAI documents them ---------------------


class Responses:
    """One Responses stream's events, each checked with the ``openai`` SDK's types."""

    def __init__(self, response_id: str = "resp_68b1c2d3e4f5", model: str = "gpt-5.5-2026-11-01"):
        self.response_id = response_id
        self.model = model
        self.sequence = 0

    def event(self, **fields) -> dict:
        fields["sequence_number"] = self.sequence
        self.sequence += 1
        if fields["type"] != "response.cancelled":
            _EVENT.validate_python(fields)
        return fields

    def response(self, status: str, output=(), usage=None, incomplete=None, error=None) -> dict:
        body = {
            "id": self.response_id, "object": "response", "created_at": 1764892800, "model": self.model,
            "status": status, "output": list(output), "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "store": False, "usage": usage, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
        }
        Response.model_validate(body)
        return body

    def created(self) -> dict:
        return self.event(type="response.created", response=self.response("in_progress"))

    def in_progress(self) -> dict:
        return self.event(type="response.in_progress", response=self.response("in_progress"))

    @staticmethod
    def usage(input_tokens=1200, cached=0, written=0, output=80, reasoning=30) -> dict:
        return {
            "input_tokens": input_tokens, "output_tokens": output, "total_tokens": input_tokens + output,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
            "output_tokens_details": {"reasoning_tokens": reasoning},
        }

    def completed(self, output, usage=None) -> dict:
        return self.event(type="response.completed", response=self.response("completed", output, usage or self.usage()))

    def incomplete(self, output, reason: str) -> dict:
        return self.event(type="response.incomplete",
                          response=self.response("incomplete", output, self.usage(), incomplete=reason))

    def failed(self, output, code: str, message: str) -> dict:
        return self.event(type="response.failed",
                          response=self.response("failed", output, None, error={"code": code, "message": message}))

    def cancelled(self, output) -> dict:
        return self.event(type="response.cancelled", response=self.response("cancelled", output))

    def error(self, code: str, message: str) -> dict:
        return self.event(type="error", code=code, message=message, param=None)

    def reasoning(self, index: int, item_id: str, summaries=(), encrypted="gAAAAB-final", snapshot="gAAAAB-part"):
        """A reasoning item streamed: its summary parts' deltas; the final encrypted content only when done."""
        item = {"id": item_id, "type": "reasoning", "summary": []}
        events = [self.event(type="response.output_item.added", output_index=index,
                             item=dict(item, encrypted_content=snapshot))]
        for number, text in enumerate(summaries):
            common = {"item_id": item_id, "output_index": index, "summary_index": number}
            events.append(self.event(type="response.reasoning_summary_part.added",
                                     part={"type": "summary_text", "text": ""}, **common))
            half = len(text) // 2
            for piece in (text[:half], text[half:]):
                events.append(self.event(type="response.reasoning_summary_text.delta", delta=piece, **common))
            events.append(self.event(type="response.reasoning_summary_text.done", text=text, **common))
            events.append(self.event(type="response.reasoning_summary_part.done",
                                     part={"type": "summary_text", "text": text}, **common))
        done = dict(item, encrypted_content=encrypted,
                    summary=[{"type": "summary_text", "text": text} for text in summaries])
        events.append(self.event(type="response.output_item.done", output_index=index, item=done))
        return events, done

    def message(self, index: int, item_id: str, text: str, pieces: int = 3, part=None):
        """A message item streamed: one output_text (or given) part, its deltas, the dones."""
        part = part or {"type": "output_text", "text": text, "annotations": []}
        kind = "refusal" if part["type"] == "refusal" else "output_text"
        events = [self.event(type="response.output_item.added", output_index=index,
                             item={"id": item_id, "type": "message", "role": "assistant",
                                   "status": "in_progress", "content": []})]
        common = {"item_id": item_id, "output_index": index, "content_index": 0}
        empty = dict(part, **{"refusal" if kind == "refusal" else "text": ""})
        events.append(self.event(type="response.content_part.added", part=empty, **common))
        size = max(1, -(-len(text) // pieces))
        for start in range(0, len(text), size):
            if kind == "refusal":
                events.append(self.event(type="response.refusal.delta", delta=text[start:start + size], **common))
            else:
                events.append(self.event(type="response.output_text.delta", delta=text[start:start + size],
                                         logprobs=[], **common))
        if kind == "refusal":
            events.append(self.event(type="response.refusal.done", refusal=text, **common))
        else:
            events.append(self.event(type="response.output_text.done", text=text, logprobs=[], **common))
        events.append(self.event(type="response.content_part.done", part=part, **common))
        done = {"id": item_id, "type": "message", "role": "assistant", "status": "completed", "content": [part]}
        events.append(self.event(type="response.output_item.done", output_index=index, item=done))
        return events, done

    def call(self, index: int, item_id: str, call_id: str, name: str, arguments: str,
             added=True, deltas=True, arguments_done=True):
        """A function_call item streamed: its argument deltas keyed by item_id, the dones."""
        item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": "",
                "status": "in_progress"}
        events = []
        if added:
            events.append(self.event(type="response.output_item.added", output_index=index, item=item))
        common = {"item_id": item_id, "output_index": index}
        if deltas:
            for start in range(0, len(arguments), 7):
                events.append(self.event(type="response.function_call_arguments.delta",
                                         delta=arguments[start:start + 7], **common))
        if arguments_done:
            events.append(self.event(type="response.function_call_arguments.done", arguments=arguments, **common))
        done = dict(item, arguments=arguments, status="completed")
        events.append(self.event(type="response.output_item.done", output_index=index, item=done))
        return events, done


def run(stream, events, close=True) -> list:
    out = []
    for event in events:
        out.extend(stream.feed(event))
    if close:
        out.extend(stream.close())
    return out


class ResponsesStreamTests(SynchronousTestCase):
    """A Responses stream as Anthropic's events."""

    def setUp(self):
        self.up = Responses()

    def translate(self, events, ctx=CTX, close=True):
        out = run(ResponsesStream(ctx), events, close)
        check_grammar(self, out)
        return out

    def test_text(self):
        """A text answer: message_start (zeros, every usage field), one text block, end_turn, the usage mapped."""
        text_events, item = self.up.message(0, "msg_a1", "Hello from GPT.")
        usage = Responses.usage(input_tokens=1000, cached=600, output=12, reasoning=0)
        out = self.translate([self.up.created(), self.up.in_progress(), *text_events,
                              self.up.completed([item], usage)])
        start = out[0][1]["message"]
        self.assertEqual(start["id"], "msg_68b1c2d3e4f5")
        self.assertEqual(start["model"], "claude-opus-4-6")
        self.assertEqual(start["usage"], {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0,
                                          "cache_read_input_tokens": 0})
        self.assertEqual(blocks_of(out), [{"type": "text", "text": "Hello from GPT.", "json": ""}])
        final = sdk_final_message(out)
        self.assertEqual(final.content[0].text, "Hello from GPT.")
        self.assertEqual(final.stop_reason, "end_turn")
        self.assertEqual((final.usage.input_tokens, final.usage.cache_read_input_tokens,
                          final.usage.cache_creation_input_tokens, final.usage.output_tokens), (400, 600, 0, 12))

    def test_model_of_the_response_when_none_was_asked(self):
        text_events, item = self.up.message(0, "msg_a1", "Hi")
        out = self.translate([self.up.created(), *text_events, self.up.completed([item])],
                             ctx=CTX._replace(requested_model=None))
        self.assertEqual(out[0][1]["message"]["model"], "gpt-5.5-2026-11-01")

    def test_claude_code_router_1725_each_reasoning_item_its_own_block(self):
        """
        Reason, call, reason, call: each reasoning item is a thinking block at
        its own index (claude-code-router put the second on the previous
        block's index: "Content block is not a thinking block"), each
        signature the envelope of its own item, without its id.
        """
        first, first_done = self.up.reasoning(0, "rs_1", ["Look at the file."], encrypted="enc-one")
        call1, call1_done = self.up.call(1, "fc_1", "call_Aa1", "Read", '{"file_path": "/a.py"}')
        second, second_done = self.up.reasoning(2, "rs_2", ["Now the other one."], encrypted="enc-two")
        call2, call2_done = self.up.call(3, "fc_2", "call_Bb2", "Read", '{"file_path": "/b.py"}')
        out = self.translate([self.up.created(), *first, *call1, *second, *call2,
                              self.up.completed([first_done, call1_done, second_done, call2_done])])
        blocks = blocks_of(out)
        self.assertEqual([b["type"] for b in blocks], ["thinking", "tool_use", "thinking", "tool_use"])
        deltas_of_second = [p["index"] for n, p in out if n == "content_block_delta"
                            and p["delta"].get("thinking") == "Now the other one."[:9]]
        self.assertEqual(deltas_of_second, [2])
        self.assertEqual(opened(blocks[0]["signature"]), {"kind": "responses", "items": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Look at the file."}],
             "encrypted_content": "enc-one"}]})
        self.assertEqual(opened(blocks[2]["signature"])["items"][0]["encrypted_content"], "enc-two")
        final = sdk_final_message(out)
        self.assertEqual([b.type for b in final.content], ["thinking", "tool_use", "thinking", "tool_use"])
        self.assertEqual(final.content[2].thinking, "Now the other one.")
        self.assertEqual((final.content[1].id, final.content[1].input), ("call_Aa1", {"file_path": "/a.py"}))
        self.assertEqual((final.content[3].id, final.content[3].input), ("call_Bb2", {"file_path": "/b.py"}))
        self.assertEqual(final.stop_reason, "tool_use")

    def test_encrypted_content_only_from_output_item_done(self):
        """The added item's encrypted_content is a snapshot: the envelope holds the done item's."""
        events, done = self.up.reasoning(0, "rs_1", ["Plan."], encrypted="enc-final", snapshot="enc-snapshot")
        out = self.translate([self.up.created(), *events, self.up.completed([done])])
        signatures = [p["delta"]["signature"] for n, p in out if p.get("delta", {}).get("type") == "signature_delta"]
        self.assertEqual(len(signatures), 1)
        self.assertEqual(opened(signatures[0])["items"][0]["encrypted_content"], "enc-final")
        # The signature comes before its block's stop.
        names = [n for n, _ in out]
        at = next(i for i, (n, p) in enumerate(out) if p.get("delta", {}).get("type") == "signature_delta")
        self.assertEqual(names[at + 1], "content_block_stop")

    def test_reasoning_without_summary(self):
        """A reasoning item with no summary: a thinking block with empty text and the signature."""
        events, done = self.up.reasoning(0, "rs_1", [], encrypted="enc-quiet")
        text_events, item = self.up.message(1, "msg_1", "Done.")
        out = self.translate([self.up.created(), *events, *text_events, self.up.completed([done, item])])
        blocks = blocks_of(out)
        self.assertEqual((blocks[0]["type"], blocks[0]["thinking"]), ("thinking", ""))
        self.assertEqual(opened(blocks[0]["signature"])["items"], [
            {"type": "reasoning", "summary": [], "encrypted_content": "enc-quiet"}])
        final = sdk_final_message(out)
        self.assertEqual((final.content[0].thinking, final.content[1].text), ("", "Done."))

    def test_summary_parts_joined_in_one_block(self):
        events, done = self.up.reasoning(0, "rs_1", ["First part.", "Second part."])
        out = self.translate([self.up.created(), *events, self.up.completed([done])])
        self.assertEqual(blocks_of(out)[0]["thinking"], "First part.\n\nSecond part.")

    def test_arguments_only_on_done(self):
        """An upstream that sends the arguments only with ``.done``: written once, whole."""
        events, done = self.up.call(0, "fc_1", "call_1", "Bash", '{"command": "ls"}', deltas=False)
        out = self.translate([self.up.created(), *events, self.up.completed([done])])
        self.assertEqual(blocks_of(out)[0]["json"], '{"command": "ls"}')
        self.assertEqual(sdk_final_message(out).content[0].input, {"command": "ls"})

    def test_arguments_only_on_output_item_done(self):
        events, done = self.up.call(0, "fc_1", "call_1", "Bash", '{"command": "ls"}', deltas=False,
                                    arguments_done=False)
        out = self.translate([self.up.created(), *events, self.up.completed([done])])
        self.assertEqual(sdk_final_message(out).content[0].input, {"command": "ls"})

    def test_done_after_deltas_adds_nothing_twice(self):
        events, done = self.up.call(0, "fc_1", "call_1", "Bash", '{"command": "ls -la /tmp"}')
        out = self.translate([self.up.created(), *events, self.up.completed([done])])
        self.assertEqual(blocks_of(out)[0]["json"], '{"command": "ls -la /tmp"}')

    def test_missing_output_item_added(self):
        """Deltas (keyed by item_id) before any output_item.added: the blocks are started for them."""
        call_events, call_done = self.up.call(0, "fc_1", "call_1", "Read", '{"file_path": "/x"}', added=False)
        text = [self.up.event(type="response.output_text.delta", item_id="msg_2", output_index=1, content_index=0,
                              delta="Reading.", logprobs=[])]
        item = {"id": "msg_2", "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "Reading.", "annotations": []}]}
        out = self.translate([self.up.created(), *call_events, *text, self.up.completed([call_done, item])])
        final = sdk_final_message(out)
        self.assertEqual([b.type for b in final.content], ["tool_use", "text"])
        self.assertEqual(final.content[0].input, {"file_path": "/x"})
        self.assertEqual(final.content[1].text, "Reading.")

    def test_interleaved_parallel_calls_wait_their_turn(self):
        """Codex interleaves parallel calls' events: each call's block is written whole, in order."""
        up = self.up
        a = {"id": "fc_a", "type": "function_call", "call_id": "call_a", "name": "Read", "arguments": ""}
        b = {"id": "fc_b", "type": "function_call", "call_id": "call_b", "name": "Glob", "arguments": ""}
        events = [
            up.created(),
            up.event(type="response.output_item.added", output_index=0, item=a),
            up.event(type="response.output_item.added", output_index=1, item=b),
            up.event(type="response.function_call_arguments.delta", item_id="fc_b", output_index=1, delta='{"pat'),
            up.event(type="response.function_call_arguments.delta", item_id="fc_a", output_index=0, delta='{"file'),
            up.event(type="response.function_call_arguments.delta", item_id="fc_b", output_index=1,
                     delta='tern": "*.py"}'),
            up.event(type="response.function_call_arguments.delta", item_id="fc_a", output_index=0,
                     delta='_path": "/a"}'),
            up.event(type="response.output_item.done", output_index=0, item=dict(a, arguments='{"file_path": "/a"}')),
            up.event(type="response.output_item.done", output_index=1, item=dict(b, arguments='{"pattern": "*.py"}')),
        ]
        output = [dict(a, arguments='{"file_path": "/a"}'), dict(b, arguments='{"pattern": "*.py"}')]
        out = self.translate(events + [up.completed(output)])
        final = sdk_final_message(out)
        self.assertEqual([(b.id, b.input) for b in final.content],
                         [("call_a", {"file_path": "/a"}), ("call_b", {"pattern": "*.py"})])

    def test_calls_only_in_the_terminal_output(self):
        """Items never streamed (only in ``response.completed``'s output) are written before the end."""
        _, reasoning = self.up.reasoning(0, "rs_1", ["Think."], encrypted="enc-x")
        _, call = self.up.call(1, "fc_1", "call_1", "Read", '{"file_path": "/y"}')
        out = self.translate([self.up.created(), self.up.completed([reasoning, call])])
        final = sdk_final_message(out)
        self.assertEqual([b.type for b in final.content], ["thinking", "tool_use"])
        self.assertEqual(final.content[0].thinking, "Think.")
        self.assertEqual(opened(final.content[0].signature)["items"][0]["encrypted_content"], "enc-x")
        self.assertEqual(final.stop_reason, "tool_use")

    def test_sub2api_6923_refusal_kept(self):
        """A refusal part's words are a text block, and the stop reason is refusal (sub2api lost the text)."""
        events, item = self.up.message(0, "msg_1", "I can't help with that.", part={"type": "refusal", "refusal":
                                                                                    "I can't help with that."})
        out = self.translate([self.up.created(), *events, self.up.completed([item])])
        final = sdk_final_message(out)
        self.assertEqual(final.content[0].text, "I can't help with that.")
        self.assertEqual(final.stop_reason, "refusal")

    def test_incomplete(self):
        for reason, stop in (("max_output_tokens", "max_tokens"), ("content_filter", "refusal")):
            up = Responses()
            events, item = up.message(0, "msg_1", "Cut sh")
            out = self.translate([up.created(), *events, up.incomplete([item], reason)])
            self.assertEqual(sdk_final_message(out).stop_reason, stop)

    def test_whitespace_message_is_no_block(self):
        events, item = self.up.message(0, "msg_1", "\n\n", pieces=2)
        call_events, call = self.up.call(1, "fc_1", "call_1", "Read", "{}")
        out = self.translate([self.up.created(), *events, *call_events, self.up.completed([item, call])])
        self.assertEqual([b["type"] for b in blocks_of(out)], ["tool_use"])

    def test_sub2api_6923_failed_is_an_error(self):
        """``response.failed`` is an Anthropic ``error`` event, never a normal end (sub2api reported success)."""
        events, _ = self.up.message(0, "msg_1", "Partial answ")
        out = self.translate([self.up.created(), *events[:3],
                              self.up.failed([], "server_error", "The model crashed.")])
        self.assertEqual(out[-1], ("error", {"type": "error", "error": {"type": "api_error",
                                                                         "message": "The model crashed."}}))
        with self.assertRaises(anthropic.APIStatusError) as raised:
            sdk_final_message(out)
        self.assertEqual(raised.exception.body["error"]["message"], "The model crashed.")

    def test_sub2api_6923_cancelled_is_an_error(self):
        out = self.translate([self.up.created(), self.up.cancelled([])])
        self.assertEqual(out[-1][0], "error")
        self.assertIn("cancelled", out[-1][1]["error"]["message"])
        with self.assertRaises(anthropic.APIStatusError):
            sdk_final_message(out)

    def test_error_event_and_nothing_after(self):
        stream = ResponsesStream(CTX)
        events, item = self.up.message(0, "msg_1", "Some text")
        out = run(stream, [self.up.created(), *events[:3], self.up.error("rate_limit_exceeded", "Slow down.")],
                  close=False)
        check_grammar(self, out)
        self.assertEqual(out[-1][1]["error"], {"type": "rate_limit_error", "message": "Slow down."})
        self.assertEqual(run(stream, [*events[3:], self.up.completed([item])]), [])

    def test_cut_stream_is_an_error(self):
        events, _ = self.up.message(0, "msg_1", "Some text")
        out = self.translate([self.up.created(), *events[:4]])
        self.assertEqual(out[-1][0], "error")
        self.assertEqual(out[-1][1]["error"]["type"], "api_error")

    def test_done_line(self):
        """A ``[DONE]`` line (compatible upstreams send one) ends nothing: after the terminal event it adds nothing."""
        events, item = self.up.message(0, "msg_1", "Fine.")
        stream = ResponsesStream(CTX)
        out = run(stream, [self.up.created(), *events, self.up.completed([item])], close=False)
        self.assertEqual(stream.done() + stream.close(), [])
        self.assertEqual(sdk_final_message(out).content[0].text, "Fine.")
        cut = ResponsesStream(CTX)
        run(cut, [self.up.created(), *events[:3]], close=False)
        self.assertEqual([n for n, _ in cut.done()], ["error"])

    def test_litellm_32357_one_message_start_no_thinking_in_text(self):
        """
        A second ``response.created`` makes no second ``message_start``; a
        reasoning item after a text item opens its own thinking block (litellm
        wrote its deltas into the text block: empty content in Claude Code).
        """
        text_events, text_item = self.up.message(0, "msg_1", "Let me check.")
        reasoning_events, reasoning_item = self.up.reasoning(1, "rs_1", ["Checking the file."])
        call_events, call = self.up.call(2, "fc_1", "call_1", "Read", '{"file_path": "/c"}')
        again = self.up.event(type="response.created", response=self.up.response("in_progress"))
        out = self.translate([self.up.created(), again, *text_events, *reasoning_events, *call_events,
                              self.up.completed([text_item, reasoning_item, call])])
        self.assertEqual([n for n, _ in out].count("message_start"), 1)
        final = sdk_final_message(out)
        self.assertEqual([b.type for b in final.content], ["text", "thinking", "tool_use"])
        self.assertEqual(final.content[0].text, "Let me check.")
        self.assertEqual(final.content[1].thinking, "Checking the file.")

    def test_litellm_28354_cache_reads_and_writes(self):
        """Cached and cache-write tokens out of input, in their own fields (litellm reported reads as 0)."""
        events, item = self.up.message(0, "msg_1", "Hi")
        usage = Responses.usage(input_tokens=50000, cached=41000, written=6000, output=900, reasoning=400)
        out = self.translate([self.up.created(), *events, self.up.completed([item], usage)])
        self.assertEqual(out[-2][1]["usage"], {"input_tokens": 3000, "output_tokens": 900,
                                               "cache_creation_input_tokens": 6000, "cache_read_input_tokens": 41000})
        final = sdk_final_message(out)
        self.assertEqual(final.usage.cache_read_input_tokens, 41000)


class ResponseMessageTests(SynchronousTestCase):
    """A whole Responses answer as an Anthropic message."""

    def test_as_the_stream_gives_it(self):
        up = Responses()
        _, reasoning = up.reasoning(0, "rs_1", ["Why."], encrypted="enc-1")
        _, text = up.message(1, "msg_1", "Because.")
        _, call = up.call(2, "fc_1", "call_9", "Read", '{"file_path": "/z"}')
        response = up.response("completed", [reasoning, text, call], Responses.usage(1000, 200, 0, 50, 10))
        message = message_of_response(response, CTX)
        self.assertEqual(message["id"], "msg_68b1c2d3e4f5")
        self.assertEqual(message["model"], "claude-opus-4-6")
        self.assertEqual([b["type"] for b in message["content"]], ["thinking", "text", "tool_use"])
        self.assertEqual(opened(message["content"][0]["signature"])["items"][0]["encrypted_content"], "enc-1")
        self.assertEqual(message["content"][1], {"type": "text", "text": "Because."})
        self.assertEqual(message["content"][2], {"type": "tool_use", "id": "call_9", "name": "Read",
                                                 "input": {"file_path": "/z"}})
        self.assertEqual(message["stop_reason"], "tool_use")
        self.assertEqual(message["usage"], {"input_tokens": 800, "output_tokens": 50,
                                            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 200})
        anthropic.types.Message.model_validate(message)

    def test_incomplete(self):
        up = Responses()
        _, text = up.message(0, "msg_1", "Cut")
        response = up.response("incomplete", [text], Responses.usage(), incomplete="max_output_tokens")
        self.assertEqual(message_of_response(response, CTX)["stop_reason"], "max_tokens")

    def test_failed_raises(self):
        response = Responses().response("failed", [], None, error={"code": "rate_limit_exceeded",
                                                                   "message": "Too many."})
        with self.assertRaises(UpstreamFailed) as raised:
            message_of_response(response, CTX)
        self.assertEqual(tuple(raised.exception.error), (429, "rate_limit_error", "Too many."))


# -- Chat Completions ------------------------------------------------------------------


class Chat:
    """One Chat Completions stream's chunks, each checked with the ``openai`` SDK's ChatCompletionChunk."""

    def __init__(self, chunk_id: str = "chatcmpl-9xYz", model: str = "deepseek-v4-pro"):
        self.chunk_id = chunk_id
        self.model = model

    def chunk(self, delta=None, finish=None, usage=None, choices=True, checked=True, **extra) -> dict:
        """
        One chunk; ``checked=False`` for the chunks the SDK's type refuses
        but upstreams send: Gemini's tool calls without ``index``
        (THU-MAIC/OpenMAIC #1556, AstrBot #6661).
        """
        body = {"id": self.chunk_id, "object": "chat.completion.chunk", "created": 1764892800, "model": self.model,
                "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}] if choices else [],
                **extra}
        if usage is not None:
            body["usage"] = usage
        if checked:
            ChatCompletionChunk.model_validate(body)
        return body

    def role(self) -> dict:
        return self.chunk({"role": "assistant", "content": ""})

    def reasoning(self, text: str, field: str = "reasoning_content") -> list:
        return [self.chunk({field: text[i:i + 5]}) for i in range(0, len(text), 5)]

    def text(self, text: str) -> list:
        return [self.chunk({"content": text[i:i + 5]}) for i in range(0, len(text), 5)]

    def call(self, index, call_id, name, arguments, pieces=3, **extra) -> list:
        first = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""},
                 **extra}
        size = max(1, -(-len(arguments) // pieces))
        rest = [{"index": index, "function": {"arguments": arguments[i:i + size]}}
                for i in range(0, len(arguments), size)]
        return [self.chunk({"tool_calls": [first]})] + [self.chunk({"tool_calls": [piece]}) for piece in rest]

    @staticmethod
    def usage(prompt=2000, completion=150, **extra) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                **extra}


def run_chat(stream: ChatStream, chunks, end: str = "done") -> list:
    out = []
    for chunk in chunks:
        out.extend(stream.feed(chunk))
    if end == "done":
        out.extend(stream.done())
    if end in ("done", "close"):
        out.extend(stream.close())
    return out


class ChatStreamTests(SynchronousTestCase):
    """A Chat Completions stream, in each dialect, as Anthropic's events."""

    def translate(self, chunks, ctx=CTX, end="done"):
        out = run_chat(ChatStream(ctx), chunks, end)
        check_grammar(self, out)
        return out

    def test_deepseek_reasoning_sealed_whole_and_tool_call(self):
        """DeepSeek's reasoning_content is a thinking block whose envelope holds its whole text (it must go back)."""
        ctx = CTX._replace(upstream="deepseek", dialect="deepseek")
        up = Chat()
        usage = Chat.usage(2000, 150, prompt_cache_hit_tokens=1536, prompt_cache_miss_tokens=464,
                           completion_tokens_details={"reasoning_tokens": 90})
        out = self.translate([up.role(), *up.reasoning("The user wants the file read."),
                              *up.call(0, "call_00_abc", "Read", '{"file_path": "/etc/hosts"}'),
                              up.chunk(finish="tool_calls"), up.chunk(choices=False, usage=usage)], ctx)
        final = sdk_final_message(out)
        self.assertEqual([b.type for b in final.content], ["thinking", "tool_use"])
        self.assertEqual(final.content[0].thinking, "The user wants the file read.")
        self.assertEqual(opened(final.content[0].signature, ctx),
                         {"kind": "chat", "reasoning_content": "The user wants the file read."})
        self.assertEqual((final.content[1].id, final.content[1].input), ("call_00_abc", {"file_path": "/etc/hosts"}))
        self.assertEqual(final.stop_reason, "tool_use")
        self.assertEqual((final.usage.input_tokens, final.usage.cache_read_input_tokens, final.usage.output_tokens),
                         (464, 1536, 150))
        self.assertEqual(final.id, "msg_9xYz")

    def test_kimi_ids_as_given(self):
        """Kimi's ``functions.<name>:<n>`` ids are copied as they are (the id core handles repeats)."""
        ctx = CTX._replace(upstream="kimi", dialect="kimi")
        up = Chat(model="kimi-k3")
        out = self.translate([*up.reasoning("Two files."), *up.text("Reading both."),
                              *up.call(0, "functions.Read:0", "Read", '{"file_path": "/a"}'),
                              *up.call(1, "functions.Read:1", "Read", '{"file_path": "/b"}'),
                              up.chunk(finish="tool_calls", usage=Chat.usage(100, 20, cached_tokens=64))], ctx)
        final = sdk_final_message(out)
        self.assertEqual([b.type for b in final.content], ["thinking", "text", "tool_use", "tool_use"])
        self.assertEqual([b.id for b in final.content[2:]], ["functions.Read:0", "functions.Read:1"])
        self.assertEqual(final.usage.cache_read_input_tokens, 64)

    def test_gemini_thought_signature_before_its_call(self):
        """
        Gemini's thought signature of each call (its calls come whole, without
        an index) is sealed by call id in a thinking block right before the
        call's tool_use (CLIProxyAPI #2098: a lost signature is a 400 at the
        next turn).
        """
        ctx = CTX._replace(upstream="gemini", dialect="gemini")
        up = Chat(chunk_id="", model="gemini-3.5-pro")

        def call(call_id, path, signature):
            entry = {"id": call_id, "type": "function", "function": {"name": "Read",
                                                                     "arguments": json.dumps({"file_path": path})}}
            if signature:
                entry["extra_content"] = {"google": {"thought_signature": signature}}
            return up.chunk({"role": "assistant", "tool_calls": [entry]}, checked=False)

        # Gemini's stream ends a turn with calls with finish_reason "stop" (python-genai #2868).
        out = self.translate([*up.text("I'll read them."), call("function-call-1", "/a", "CiQB-sig-one"),
                              call("function-call-2", "/b", "CiQB-sig-two"), up.chunk(finish="stop")], ctx)
        final = sdk_final_message(out)
        self.assertEqual([b.type for b in final.content], ["text", "thinking", "tool_use", "thinking", "tool_use"])
        self.assertEqual(opened(final.content[1].signature, ctx),
                         {"kind": "chat", "thought_signatures": {"function-call-1": "CiQB-sig-one"}})
        self.assertEqual(opened(final.content[3].signature, ctx),
                         {"kind": "chat", "thought_signatures": {"function-call-2": "CiQB-sig-two"}})
        self.assertEqual(final.content[4].input, {"file_path": "/b"})
        self.assertEqual(final.stop_reason, "tool_use")

    def test_gemini_split_arguments_and_signature_alone(self):
        """
        Gemini's indexless deltas: arguments split over entries with no id
        (the call before them), a signature in a delta of its own, before
        the call or after it.
        """
        ctx = CTX._replace(upstream="gemini", dialect="gemini")
        up = Chat(model="gemini-3.5-flash")

        def entry(**fields):
            return up.chunk({"tool_calls": [fields]}, checked=False)

        google = {"google": {"thought_signature": "sig-early"}}
        chunks = [entry(extra_content=google),
                  entry(id="fc-1", type="function", function={"name": "Read", "arguments": '{"file_'}),
                  entry(function={"arguments": 'path": "/s"}'}),
                  entry(id="fc-2", type="function", function={"name": "Glob", "arguments": "{}"}),
                  entry(extra_content={"google": {"thought_signature": "sig-late"}}),
                  up.chunk(finish="stop")]
        final = sdk_final_message(self.translate(chunks, ctx))
        self.assertEqual([b.type for b in final.content], ["thinking", "tool_use", "tool_use", "thinking"])
        self.assertEqual(opened(final.content[0].signature, ctx)["thought_signatures"], {"fc-1": "sig-early"})
        self.assertEqual(final.content[1].input, {"file_path": "/s"})
        self.assertEqual(opened(final.content[3].signature, ctx)["thought_signatures"], {"fc-2": "sig-late"})

    def test_gemini_signature_joins_open_reasoning(self):
        ctx = CTX._replace(upstream="gemini", dialect="gemini")
        up = Chat(model="gemini-3.5-pro")
        entry = {"index": 0, "id": "fc-1", "type": "function", "function": {"name": "Glob", "arguments": "{}"},
                 "extra_content": {"google": {"thought_signature": "sig-A"}}}
        out = self.translate([*up.reasoning("Find files.", field="reasoning_content"),
                              up.chunk({"tool_calls": [entry]}), up.chunk(finish="tool_calls")], ctx)
        final = sdk_final_message(out)
        self.assertEqual([b.type for b in final.content], ["thinking", "tool_use"])
        self.assertEqual(opened(final.content[0].signature, ctx),
                         {"kind": "chat", "reasoning_content": "Find files.", "thought_signatures": {"fc-1": "sig-A"}})

    def test_openrouter_reasoning_details_kept(self):
        """OpenRouter's reasoning_details: the stream's fragments joined as its SDK joins them, else unchanged."""
        ctx = CTX._replace(upstream="openrouter", dialect="openrouter")
        up = Chat(chunk_id="gen-1764-abc", model="google/gemini-3.5-pro")
        fragments = [
            {"type": "reasoning.text", "text": "Step one. ", "index": 0, "format": "google-gemini-v1"},
            {"type": "reasoning.text", "text": "Step two.", "index": 0, "format": "google-gemini-v1"},
        ]
        encrypted = {"type": "reasoning.encrypted", "data": "CiQB-enc", "id": "tool_Read_1", "index": 0,
                     "format": "google-gemini-v1"}
        chunks = [up.chunk({"role": "assistant", "reasoning": "Step one. ", "reasoning_details": fragments[:1]}),
                  up.chunk({"reasoning": "Step two.", "reasoning_details": fragments[1:]}),
                  up.chunk({"reasoning_details": [encrypted], "tool_calls": [
                      {"index": 0, "id": "tool_Read_1", "type": "function",
                       "function": {"name": "Read", "arguments": '{"file_path": "/r"}'}}]}),
                  up.chunk(finish="tool_calls")]
        final = sdk_final_message(self.translate(chunks, ctx))
        self.assertEqual([b.type for b in final.content], ["thinking", "tool_use"])
        self.assertEqual(final.content[0].thinking, "Step one. Step two.")
        self.assertEqual(opened(final.content[0].signature, ctx), {
            "kind": "chat", "reasoning_content": "Step one. Step two.",
            "reasoning_details": [{"type": "reasoning.text", "text": "Step one. Step two.", "index": 0,
                                   "format": "google-gemini-v1"}, encrypted]})

    def test_groq_reasoning_field(self):
        ctx = CTX._replace(upstream="groq", dialect="groq")
        up = Chat(model="openai/gpt-oss-120b")
        both = up.chunk({"reasoning_content": "", "reasoning": " More."})  # an empty field beside the other
        final = sdk_final_message(self.translate([*up.reasoning("Short.", field="reasoning"), both,
                                                  *up.text("Answer."), up.chunk(finish="stop")], ctx))
        self.assertEqual((final.content[0].thinking, final.content[1].text), ("Short. More.", "Answer."))
        self.assertEqual(final.stop_reason, "end_turn")

    def test_mistral_thinking_parts(self):
        ctx = CTX._replace(upstream="mistral", dialect="mistral")
        up = Chat(model="magistral-medium-2609")
        chunks = [up.chunk({"role": "assistant", "content": ""}),
                  {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "magistral",
                   "choices": [{"index": 0, "delta": {"content": [
                       {"type": "thinking", "thinking": [{"type": "text", "text": "Hmm."}]}]}}]},
                  up.chunk({"content": "Yes."}), up.chunk(finish="stop")]
        final = sdk_final_message(self.translate(chunks, ctx))
        self.assertEqual((final.content[0].thinking, final.content[1].text), ("Hmm.", "Yes."))

    def test_late_id_and_name(self):
        """A call whose first deltas carry only arguments: its block starts when its id and name come."""
        up = Chat()
        chunks = [up.chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}),
                  up.chunk({"tool_calls": [{"index": 0, "id": "call_late", "function": {"name": "Tool",
                                                                                        "arguments": ": 1}"}}]}),
                  up.chunk(finish="tool_calls")]
        final = sdk_final_message(self.translate(chunks))
        self.assertEqual((final.content[0].id, final.content[0].name, final.content[0].input),
                         ("call_late", "Tool", {"a": 1}))

    def test_id_never_sent_is_made(self):
        up = Chat()
        chunks = [up.chunk({"tool_calls": [{"index": 0, "function": {"name": "Tool", "arguments": "{}"}}]}),
                  up.chunk(finish="tool_calls")]
        final = sdk_final_message(self.translate(chunks))
        self.assertTrue(final.content[0].id.startswith("call_"))
        self.assertEqual(final.stop_reason, "tool_use")

    def test_duplicated_index(self):
        """Two calls sent with the same index (and their own ids) are two tool_use blocks."""
        up = Chat()
        chunks = [*up.call(0, "call_1", "Read", '{"file_path": "/1"}'),
                  *up.call(0, "call_2", "Read", '{"file_path": "/2"}'), up.chunk(finish="tool_calls")]
        final = sdk_final_message(self.translate(chunks))
        self.assertEqual([(b.id, b.input) for b in final.content],
                         [("call_1", {"file_path": "/1"}), ("call_2", {"file_path": "/2"})])

    def test_missing_index(self):
        """Entries without an index: a new id is a new call, none continues the call before."""
        up = Chat()
        chunks = [up.chunk({"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "A",
                                                                                         "arguments": '{"x":'}}]},
                           checked=False),
                  up.chunk({"tool_calls": [{"function": {"arguments": " 1}"}}]}, checked=False),
                  up.chunk({"tool_calls": [{"id": "c2", "type": "function", "function": {"name": "B",
                                                                                         "arguments": "{}"}}]},
                           checked=False),
                  up.chunk(finish="tool_calls")]
        final = sdk_final_message(self.translate(chunks))
        self.assertEqual([(b.id, b.name, b.input) for b in final.content], [("c1", "A", {"x": 1}), ("c2", "B", {})])

    def test_interleaved_arguments_are_an_error(self):
        up = Chat()
        chunks = [*up.call(0, "call_1", "A", '{"x": 1}', pieces=1), *up.call(1, "call_2", "B", "{}", pieces=1),
                  up.chunk({"tool_calls": [{"index": 0, "function": {"arguments": "more"}}]})]
        out = self.translate(chunks, end=None)
        self.assertEqual(out[-1][0], "error")

    def test_finish_reasons(self):
        for finish, stop in (("stop", "end_turn"), ("length", "max_tokens"), ("content_filter", "refusal")):
            up = Chat()
            final = sdk_final_message(self.translate([*up.text("Some words"), up.chunk(finish=finish)]))
            self.assertEqual(final.stop_reason, stop)

    def test_refusal(self):
        up = Chat(model="gpt-5.5")
        final = sdk_final_message(self.translate([up.chunk({"refusal": "No."}), up.chunk(finish="stop")]))
        self.assertEqual((final.content[0].text, final.stop_reason), ("No.", "refusal"))

    def test_whitespace_before_a_call_is_no_block(self):
        up = Chat()
        final = sdk_final_message(self.translate([*up.text("\n\n"), *up.call(0, "call_1", "A", "{}"),
                                                  up.chunk(finish="tool_calls")]))
        self.assertEqual([b.type for b in final.content], ["tool_use"])

    def test_whitespace_kept_before_text(self):
        up = Chat()
        final = sdk_final_message(self.translate([*up.text("\n"), *up.text("Hi"), up.chunk(finish="stop")]))
        self.assertEqual(final.content[0].text, "\nHi")

    def test_usage_from_the_last_chunk(self):
        """With include_usage the usage comes in a last chunk without choices; OpenAI's cached tokens out of input."""
        up = Chat(model="gpt-5.5")
        usage = Chat.usage(9000, 300, prompt_tokens_details={"cached_tokens": 8192},
                           completion_tokens_details={"reasoning_tokens": 120})
        out = self.translate([*up.text("Hi"), up.chunk(finish="stop"), up.chunk(choices=False, usage=usage)])
        self.assertEqual(out[-2][1]["usage"], {"input_tokens": 808, "output_tokens": 300,
                                               "cache_creation_input_tokens": 0, "cache_read_input_tokens": 8192})

    def test_error_chunk(self):
        """An error chunk mid-stream is an ``error`` event, and nothing follows it (not even at [DONE])."""
        up = Chat(chunk_id="gen-1", model="x-ai/grok-5")
        stream = ChatStream(CTX)
        out = run_chat(stream, [*up.text("Part"), {"id": "gen-1", "object": "chat.completion.chunk",
                                                  "error": {"code": 502, "message": "Provider returned error"},
                                                  "choices": [{"index": 0, "delta": {}, "finish_reason": "error"}]}],
                       end=None)
        check_grammar(self, out)
        self.assertEqual(out[-1][1]["error"]["type"], "api_error")
        self.assertEqual(stream.done() + stream.close(), [])
        with self.assertRaises(anthropic.APIStatusError):
            sdk_final_message(out)

    def test_cut_before_finish_is_an_error(self):
        up = Chat()
        out = self.translate([*up.text("Half an ans")], end="close")
        self.assertEqual(out[-1][0], "error")

    def test_end_after_finish_without_done(self):
        up = Chat()
        out = self.translate([*up.text("Whole."), up.chunk(finish="stop")], end="close")
        self.assertEqual(sdk_final_message(out).content[0].text, "Whole.")

    def test_done_with_nothing_is_an_error(self):
        out = ChatStream(CTX).done()
        self.assertEqual([n for n, _ in out], ["error"])


class CompletionMessageTests(SynchronousTestCase):
    """A whole Chat Completions answer as an Anthropic message."""

    def completion(self, message, finish="tool_calls", usage=None, model="deepseek-v4-pro") -> dict:
        body = {"id": "chatcmpl-77", "object": "chat.completion", "created": 1764892800, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": usage or Chat.usage()}
        ChatCompletion.model_validate(body)
        return body

    def test_deepseek(self):
        ctx = CTX._replace(upstream="deepseek", dialect="deepseek")
        message = {"role": "assistant", "content": "Reading.", "reasoning_content": "Need the file.",
                   "tool_calls": [{"id": "call_0", "type": "function",
                                   "function": {"name": "Read", "arguments": '{"file_path": "/q"}'}}]}
        result = message_of_completion(self.completion(message, usage=Chat.usage(
            100, 10, prompt_cache_hit_tokens=64, prompt_cache_miss_tokens=36)), ctx)
        self.assertEqual([b["type"] for b in result["content"]], ["thinking", "text", "tool_use"])
        self.assertEqual(opened(result["content"][0]["signature"], ctx),
                         {"kind": "chat", "reasoning_content": "Need the file."})
        self.assertEqual(result["content"][2]["input"], {"file_path": "/q"})
        self.assertEqual(result["stop_reason"], "tool_use")
        self.assertEqual(result["usage"]["cache_read_input_tokens"], 64)
        self.assertEqual(result["usage"]["input_tokens"], 36)
        anthropic.types.Message.model_validate(result)

    def test_openrouter_details_not_joined(self):
        ctx = CTX._replace(upstream="openrouter", dialect="openrouter")
        details = [{"type": "reasoning.text", "text": "A", "index": 0}, {"type": "reasoning.text", "text": "B",
                                                                        "index": 1}]
        message = {"role": "assistant", "content": "Ok.", "reasoning": "AB", "reasoning_details": details}
        result = message_of_completion(self.completion(message, finish="stop"), ctx)
        self.assertEqual(opened(result["content"][0]["signature"], ctx)["reasoning_details"], details)

    def test_error_raises(self):
        with self.assertRaises(UpstreamFailed) as raised:
            message_of_completion({"error": {"message": "overloaded", "type": "server_error"}}, CTX)
        self.assertEqual(raised.exception.error.error_type, "overloaded_error")


# -- usage and errors -------------------------------------------------------------------


class UsageTests(SynchronousTestCase):
    """OpenAI's usage as Anthropic's, exactly."""

    def test_responses(self):
        usage = {"input_tokens": 1000, "input_tokens_details": {"cached_tokens": 700, "cache_write_tokens": 200},
                 "output_tokens": 50, "output_tokens_details": {"reasoning_tokens": 20}, "total_tokens": 1050}
        self.assertEqual(usage_of_responses(usage), {"input_tokens": 100, "output_tokens": 50,
                                                     "cache_creation_input_tokens": 200,
                                                     "cache_read_input_tokens": 700})

    def test_chat_dialects(self):
        self.assertEqual(usage_of_chat(Chat.usage(100, 5, prompt_tokens_details={"cached_tokens": 60}))
                         ["input_tokens"], 40)
        self.assertEqual(usage_of_chat(Chat.usage(100, 5, prompt_cache_hit_tokens=80, prompt_cache_miss_tokens=20))
                         ["cache_read_input_tokens"], 80)
        self.assertEqual(usage_of_chat(Chat.usage(100, 5, cached_tokens=30))["input_tokens"], 70)
        self.assertEqual(usage_of_chat(Chat.usage(100, 5, prompt_tokens_details={
            "cached_tokens": 10, "cache_write_tokens": 50}))["cache_creation_input_tokens"], 50)

    def test_reasoning_counted_beside_output(self):
        """xAI counts reasoning beside completion tokens (total = prompt + completion + reasoning): added."""
        xai = {"prompt_tokens": 279, "completion_tokens": 6, "total_tokens": 374,
               "completion_tokens_details": {"reasoning_tokens": 89}}
        self.assertEqual(usage_of_chat(xai)["output_tokens"], 95)
        openai = {"prompt_tokens": 279, "completion_tokens": 95, "total_tokens": 374,
                  "completion_tokens_details": {"reasoning_tokens": 89}}
        self.assertEqual(usage_of_chat(openai)["output_tokens"], 95)

    def test_nothing_reported(self):
        zero = {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        self.assertEqual(usage_of_chat(None), zero)
        self.assertEqual(usage_of_responses({"input_tokens": "many", "output_tokens": -3}), zero)

    def test_reads_beyond_the_input_count(self):
        """An upstream whose cache reads exceed its input count reports input without them: kept as it is."""
        self.assertEqual(usage_of_chat(Chat.usage(10, 5, prompt_tokens_details={"cached_tokens": 900}))
                         ["input_tokens"], 10)


def body(error) -> bytes:
    return json.dumps({"error": error}).encode()


class ErrorTests(SynchronousTestCase):
    """OpenAI's error answers as the statuses clients behave on."""

    def test_rate_limit(self):
        self.assertEqual(tuple(anthropic_error_of(429, body({"message": "Rate limit reached", "type": "requests",
                                                             "code": "rate_limit_exceeded"}))),
                         (429, "rate_limit_error", "Rate limit reached"))

    def test_server_errors(self):
        self.assertEqual(anthropic_error_of(500, body({"message": "boom", "type": "server_error"}))[:2],
                         (500, "api_error"))
        self.assertEqual(anthropic_error_of(503, b"Service Unavailable")[:2], (529, "overloaded_error"))
        self.assertEqual(anthropic_error_of(500, body({"message": "The engine is currently overloaded."}))[:2],
                         (529, "overloaded_error"))
        self.assertEqual(anthropic_error_of(504, b"")[:2], (504, "timeout_error"))

    def test_bad_request_keeps_the_words(self):
        message = "Invalid value for 'tool_choice': 'required' is not supported with thinking."
        self.assertEqual(tuple(anthropic_error_of(400, body({"message": message, "type": "invalid_request_error",
                                                             "param": "tool_choice", "code": None}))),
                         (400, "invalid_request_error", message))
        self.assertEqual(anthropic_error_of(422, b'{"detail": "bad"}'), (400, "invalid_request_error", "bad"))

    def test_relay_credentials_are_not_the_clients(self):
        """A 401/403 (or an exhausted quota) of the relay's key is 502, never the client's 401; no key text."""
        status, kind, message = anthropic_error_of(401, body({
            "message": "Incorrect API key provided: sk-proj-****************************abcd.",
            "type": "invalid_request_error", "code": "invalid_api_key"}))
        self.assertEqual((status, kind), (502, "api_error"))
        self.assertNotIn("sk-proj", message)
        self.assertNotIn("abcd", message)
        self.assertEqual(anthropic_error_of(403, body({"message": "Project lacks access"}))[:2], (502, "api_error"))
        self.assertEqual(anthropic_error_of(429, body({"message": "You exceeded your current quota",
                                                       "code": "insufficient_quota"}))[:2], (502, "api_error"))

    def test_context_length_in_anthropic_words(self):
        """Claude Code compacts on Anthropic's 'prompt is too long: N tokens > M maximum'."""
        status, kind, message = anthropic_error_of(400, body({
            "message": "This model's maximum context length is 400000 tokens. However, your messages resulted "
                       "in 412345 tokens. Please reduce the length of the messages.",
            "type": "invalid_request_error", "code": "context_length_exceeded"}))
        self.assertEqual((status, kind), (400, "invalid_request_error"))
        self.assertTrue(message.startswith("prompt is too long: 412345 tokens > 400000 maximum"), message)
        vllm = anthropic_error_of(400, body({"message": "The input (345516 tokens) is longer than the model's "
                                                        "context length (262144 tokens)."}))
        self.assertTrue(vllm.message.startswith("prompt is too long: 345516 tokens > 262144 maximum"), vllm.message)
        words = anthropic_error_of(400, body({"message": "Your input exceeds the context window of this model.",
                                              "code": "context_length_exceeded"}))
        self.assertEqual(words.message, PROMPT_TOO_LONG + ": Your input exceeds the context window of this model.")

    def test_gemini_list_and_plain_bodies(self):
        gemini = json.dumps([{"error": {"code": 400, "message": "Function call is missing a thought_signature",
                                        "status": "INVALID_ARGUMENT"}}]).encode()
        self.assertEqual(tuple(anthropic_error_of(400, gemini)),
                         (400, "invalid_request_error", "Function call is missing a thought_signature"))
        self.assertEqual(anthropic_error_of(404, b"<html>Not Found</html>")[:2], (404, "not_found_error"))
        self.assertEqual(anthropic_error_of(400, b"")[2], "The upstream answered 400 with no message.")
        self.assertEqual(anthropic_error_of(413, b"{}")[:2], (413, "request_too_large"))


class WriterTests(SynchronousTestCase):
    """The writer refuses to break Anthropic's grammar."""

    def test_thinking_delta_in_text_block_raises(self):
        writer = MessageEvents()
        writer.start("msg_1", "m")
        writer.open_text()
        self.assertRaises(ValueError, writer.thinking, "x")

    def test_nothing_after_an_error(self):
        from twisted_relay.openai.errors import AnthropicError
        writer = MessageEvents()
        writer.start("msg_1", "m")
        writer.fail(AnthropicError(500, "api_error", "x"))
        writer.finish("end_turn", {})
        writer.start("msg_2", "m")
        self.assertEqual([n for n, _ in writer.take()], ["message_start", "error"])
