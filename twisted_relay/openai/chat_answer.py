# -*- test-case-name: tests.test_openai_answers -*-
"""
A Chat Completions answer as Anthropic's (issue 33, item 2), whatever the
dialect: the stream's chunks one at a time (:class:`ChatStream`), and a
whole completion (:func:`message_of_completion`, the same rules: it is the
stream of one chunk holding the whole message).

Every dialect's fields are read; which of them go back upstream is the
request's side (:mod:`twisted_relay.openai.dialects`). The stream:
``message_start`` at the first chunk (once), then blocks one at a time, in
the order their deltas come:

- ``delta.reasoning_content`` (DeepSeek, Kimi, GLM, xAI) or
  ``delta.reasoning`` (Groq, OpenRouter), and Mistral's ``thinking``
  content parts, are a thinking block; when it ends, its signature is the
  relay's envelope (:mod:`~twisted_relay.openai.envelope`) of
  ``{"kind": "chat", "reasoning_content": <the block's whole text>}``
  (DeepSeek and Kimi refuse a tool-call turn sent back without it);
- OpenRouter's ``reasoning_details`` are kept as they came (the fragments
  of a stream joined as OpenRouter's own SDK joins them: consecutive
  ``reasoning.text`` or ``reasoning.summary`` pieces of one index make one
  entry) and Gemini's ``extra_content.google.thought_signature`` of a tool
  call is kept by the call's id (as the upstream sent it); both go in the
  payload of a thinking block (``"reasoning_details": [...]``,
  ``"thought_signatures": {id: sig}``): the one open when they come, else
  a thinking block with empty text written right before the ``tool_use``
  block the signature belongs to (or at the end of the message). A
  payload holds the keys it has: ``kind`` always, ``reasoning_content``
  for a block of reasoning text, the other two when there were any;
- ``delta.content`` (and ``refusal``, with the stop reason ``refusal``)
  is a text block, opened at the first text that is not only white space
  (Anthropic refuses a white-space text block sent back);
- ``delta.tool_calls`` are ``tool_use`` blocks by ``index`` (an entry
  without one: by its ``id``, else the call before it; an ``index`` seen
  with another ``id``: a new call), the arguments as ``input_json_delta``;
  a call's block starts once its id and name are known (its arguments so
  far written then; an id that never comes is made), a call starts after
  the calls before it; a signature that comes alone belongs to the call
  before it, or to the next one when no call came yet. The stop reason
  of a turn with calls is ``tool_use`` whatever the finish reason says
  (Gemini's stream says ``stop``: python-genai #2868). Arguments for a call whose block a later block
  closed are an ``error``: the upstream interleaved its calls.

The end: the chunk with ``finish_reason`` ends the blocks; ``[DONE]``
(:meth:`ChatStream.done`), or the body's end after that chunk
(:meth:`ChatStream.close`), is ``message_delta`` (the stop reason:
``max_tokens`` for ``length``, ``refusal`` for ``content_filter`` or a
refusal, ``tool_use`` when a tool was called, else ``end_turn``; the usage
of the last chunk that had one, mapped by :mod:`~twisted_relay.openai.usage`)
and ``message_stop``. An ``error`` chunk (or ``finish_reason: "error"``),
or a body cut before the finish, is an Anthropic ``error`` event, and
nothing follows it.

Pure: no Twisted, no I/O.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from twisted_relay.openai.context import TranslateContext
from twisted_relay.openai.envelope import seal
from twisted_relay.openai.errors import AnthropicError, UpstreamFailed, failure_of
from twisted_relay.openai.message_events import Event, MessageEvents, message_id_of, message_of_events
from twisted_relay.openai.usage import usage_of_chat

__all__ = ["ChatStream", "message_of_completion"]

_CUT = "The upstream's stream ended before the answer was complete."
_EMPTY = "The upstream's stream ended with no answer."
_NO_NAME = "The upstream's tool call came without its function name."
_INTERLEAVED = "The upstream's stream interleaved the arguments of its tool calls."
# Fragments of these reasoning_details types are joined: the field that grows.
_JOINED_DETAILS = {"reasoning.text": "text", "reasoning.summary": "summary"}


class _Call:
    """What the stream knows of one tool call."""

    __slots__ = ("id", "name", "arguments", "signature", "opened", "closed")

    def __init__(self):
        self.id: str | None = None
        self.name: str | None = None
        self.arguments: list[str] = []  # the arguments before its block started
        self.signature: str | None = None
        self.opened = False
        self.closed = False


def _arguments_text(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    return ""


def _thought_signature(call: dict) -> str | None:
    extra = call.get("extra_content")
    google = extra.get("google") if isinstance(extra, dict) else None
    signature = google.get("thought_signature") if isinstance(google, dict) else None
    return signature if isinstance(signature, str) and signature else None


class ChatStream:
    """
    One Chat Completions stream, translated chunk by chunk (the module's rules).

    :param ctx: the attempt's :class:`~twisted_relay.openai.context.TranslateContext`.
    :param fragments: ``reasoning_details`` come as a stream's fragments, to
        be joined; ``False`` for a whole completion's, kept entry by entry.
    """

    def __init__(self, ctx: TranslateContext, fragments: bool = True):
        self._ctx = ctx
        self._fragments = fragments
        self._out = MessageEvents()
        self._calls: list[_Call] = []
        self._by_index: dict[int, _Call] = {}
        self._by_id: dict[str, _Call] = {}
        self._last_call: _Call | None = None
        self._open_call: _Call | None = None
        self._reasoning: list[str] | None = None  # the open thinking block's text
        self._details: list[dict] = []  # reasoning_details not yet sealed
        self._growing: list[str] | None = None  # the pieces of the last one's growing text
        self._signatures: dict[str, str] = {}  # thought signatures not yet sealed
        self._next_signature: str | None = None  # a signature that came before its call
        self._space = ""  # white space before a text block's first text
        self._finish: str | None = None
        self._usage: Any = None
        self._refused = False

    @property
    def failure(self) -> AnthropicError | None:
        """The error the stream ended with, if it did."""
        return self._out.failure

    def feed(self, chunk: dict) -> list[Event]:
        """The Anthropic events of one parsed chunk (the JSON of a ``data:`` line)."""
        if self._out.ended or not isinstance(chunk, dict):
            return self._out.take()
        error = chunk.get("error")
        if error is not None:
            self._fail(error)
            return self._out.take()
        if not self._out.started:
            model = self._ctx.requested_model or chunk.get("model") or self._ctx.model
            self._out.start(message_id_of(chunk.get("id")), model if isinstance(model, str) else self._ctx.model)
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        choices = chunk.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        delta = choice.get("delta")
        if isinstance(delta, dict):
            self._delta(delta)
        finish = choice.get("finish_reason")
        if finish == "error":
            self._fail(None)
        elif isinstance(finish, str) and finish and not self._out.ended:
            self._finish = finish
            self._settle()
        return self._out.take()

    def done(self) -> list[Event]:
        """``data: [DONE]``: the message's end."""
        if not self._out.ended:
            if not self._out.started:
                self._out.fail(AnthropicError(502, "api_error", _EMPTY))
            else:
                self._end()
        return self._out.take()

    def close(self) -> list[Event]:
        """The upstream's body ended: the message's end after the finish chunk, else an ``error`` event."""
        if not self._out.ended:
            if self._finish is not None:
                self._end()
            else:
                self._out.fail(AnthropicError(502, "api_error", _CUT))
        return self._out.take()

    # -- the message ----------------------------------------------------------------

    def _fail(self, error: Any) -> None:
        if isinstance(error, str):
            error = {"message": error}
        self._out.fail(failure_of(error, "The upstream's answer failed."))

    def _end(self) -> None:
        self._settle()
        if self._out.ended:
            return
        if self._finish == "length":
            stop = "max_tokens"
        elif self._finish == "content_filter":
            stop = "refusal"
        elif self._out.tool_uses:
            stop = "tool_use"
        else:
            stop = "refusal" if self._refused else "end_turn"
        self._out.finish(stop, usage_of_chat(self._usage))

    def _settle(self) -> None:
        """The blocks ended (at the finish chunk, or the end): calls not yet started started, the carry sealed."""
        self._start_calls(None)
        if self._out.ended:
            return
        self._close_block()
        if self._details or self._signatures:
            self._out.open_thinking()
            self._reasoning = None
            self._close_block()

    def _delta(self, delta: dict) -> None:
        reasoning = delta.get("reasoning_content")
        if not (isinstance(reasoning, str) and reasoning):
            reasoning = delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            self._think(reasoning)
        details = delta.get("reasoning_details")
        if isinstance(details, list):
            self._keep_details(details)
        content = delta.get("content")
        if isinstance(content, str):
            self._say(content)
        elif isinstance(content, list):  # Mistral's parts: text, and thinking (a list of texts)
            for part in content:
                if not isinstance(part, dict):
                    continue
                if part.get("type") == "text":
                    self._say(part.get("text") if isinstance(part.get("text"), str) else "")
                elif part.get("type") == "thinking":
                    thinking = part.get("thinking")
                    pieces = thinking if isinstance(thinking, list) else [{"text": thinking}]
                    text = "".join(p["text"] for p in pieces if isinstance(p, dict) and isinstance(p.get("text"), str))
                    if text:
                        self._think(text)
        refusal = delta.get("refusal")
        if isinstance(refusal, str) and refusal:
            self._refused = True
            self._say(refusal)
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                if isinstance(call, dict) and not self._out.ended:
                    self._tool_call(call)

    # -- blocks -----------------------------------------------------------------------

    def _close_block(self) -> None:
        """Stop the open block: a thinking block sealed first (its text and the carry)."""
        if self._out.open_type == "thinking":
            payload: dict = {"kind": "chat"}
            if self._reasoning is not None:
                payload["reasoning_content"] = "".join(self._reasoning)
            if self._details:
                payload["reasoning_details"] = self._joined_details()
                self._details = []
            if self._signatures:
                payload["thought_signatures"] = self._signatures
                self._signatures = {}
            self._out.signature(seal(self._ctx.upstream, self._ctx.account, payload))
            self._reasoning = None
        elif self._out.open_type == "tool_use" and self._open_call is not None:
            self._open_call.closed = True
            self._open_call = None
        self._out.close()

    def _think(self, text: str) -> None:
        self._start_calls(None)
        if self._out.ended:
            return
        if self._out.open_type != "thinking" or self._reasoning is None:
            self._close_block()
            self._out.open_thinking()
            self._reasoning = []
        self._reasoning.append(text)
        self._out.thinking(text)

    def _say(self, text: str) -> None:
        if not text:
            return
        if self._out.open_type != "text":
            if not text.strip():
                self._space += text
                return
            self._start_calls(None)
            if self._out.ended:
                return
            self._close_block()
            self._out.open_text()
            text, self._space = self._space + text, ""
        self._out.text(text)

    def _keep_details(self, details: list) -> None:
        for entry in details:
            if not isinstance(entry, dict):
                continue
            last = self._details[-1] if self._details else None
            grows = _JOINED_DETAILS.get(entry.get("type"))
            if (self._fragments and grows and last is not None and self._growing is not None
                    and last.get("type") == entry.get("type") and last.get("index") == entry.get("index")):
                piece = entry.get(grows)
                self._growing.append(piece if isinstance(piece, str) else "")
                for name, value in entry.items():
                    if name == "signature" and value:
                        last[name] = value
                    elif name != grows and value is not None and last.get(name) is None:
                        last[name] = value
            else:
                self._joined_details()
                self._details.append(dict(entry))
                if self._fragments and grows and isinstance(entry.get(grows), str):
                    self._growing = [entry[grows]]

    def _joined_details(self) -> list[dict]:
        """The details kept, the last one's growing text joined (joined once, not at each fragment)."""
        if self._growing is not None:
            last = self._details[-1]
            last[_JOINED_DETAILS[last["type"]]] = "".join(self._growing)
            self._growing = None
        return self._details

    # -- tool calls -------------------------------------------------------------------

    def _tool_call(self, entry: dict) -> None:
        index = entry.get("index") if type(entry.get("index")) is int else None
        call_id = entry.get("id") if isinstance(entry.get("id"), str) and entry.get("id") else None
        call = None
        if index is not None:
            call = self._by_index.get(index)
            if call is not None and call_id and call.id and call_id != call.id:
                call = None  # the index again, for another call
        elif call_id:
            call = self._by_id.get(call_id)
        else:
            call = self._last_call
        function = entry.get("function") if isinstance(entry.get("function"), dict) else {}
        signature = _thought_signature(entry)
        if call is None:
            if not (call_id or function.get("name") or function.get("arguments")):
                if signature:  # Gemini's signature alone, before its call
                    self._next_signature = signature
                return
            call = _Call()
            call.signature, self._next_signature = self._next_signature, None
            self._calls.append(call)
            if index is not None:
                self._by_index[index] = call
        self._last_call = call
        if call_id and call.id is None:
            call.id = call_id
            self._by_id.setdefault(call_id, call)
        name = function.get("name")
        if isinstance(name, str) and name and call.name is None:
            call.name = name
        arguments = _arguments_text(function.get("arguments"))
        if signature:
            if call.opened:
                self._signatures[call.id] = signature  # type: ignore[index]
            else:
                call.signature = signature
        if call.closed:
            if arguments:
                self._out.fail(AnthropicError(502, "api_error", _INTERLEAVED))
            return
        if call.opened:
            self._out.input_json(arguments)
            return
        call.arguments.append(arguments)
        if call.id and call.name:
            self._start_calls(call)

    def _start_calls(self, last: _Call | None) -> None:
        """Start the calls not yet started, in order, up to ``last`` (``None``: all; an id made for one without)."""
        for call in self._calls:
            if not call.opened and not call.closed:
                if call.name is None:
                    self._out.fail(AnthropicError(502, "api_error", _NO_NAME))
                    return
                if call.id is None:
                    call.id = "call_" + uuid.uuid4().hex[:24]
                self._open_tool_use(call)
            if call is last:
                return

    def _open_tool_use(self, call: _Call) -> None:
        if call.signature:
            self._signatures[call.id] = call.signature  # type: ignore[index]
            call.signature = None
        self._close_block()
        if self._signatures or self._details:
            # A thinking block of its own carries them, right before the call.
            self._out.open_thinking()
            self._reasoning = None
            self._close_block()
        self._out.open_tool_use(call.id, call.name)  # type: ignore[arg-type]
        call.opened = True
        self._open_call = call
        self._out.input_json("".join(call.arguments))
        call.arguments = []


def message_of_completion(completion: dict, ctx: TranslateContext) -> dict:
    """
    A whole Chat Completions answer as an Anthropic message (the stream's
    rules). A completion holding an ``error``, or finished by one, raises
    :class:`~twisted_relay.openai.errors.UpstreamFailed`.
    """
    if not isinstance(completion, dict):
        raise UpstreamFailed(AnthropicError(502, "api_error", "The upstream's answer is not a completion."))
    choices = completion.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    delta = dict(message)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(calls) if isinstance(call, dict)]
    stream = ChatStream(ctx, fragments=False)
    events = stream.feed({
        "id": completion.get("id"), "model": completion.get("model"), "error": completion.get("error"),
        "usage": completion.get("usage"),
        "choices": [{"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason") or "stop"}],
    })
    events += stream.done()
    if stream.failure is not None:
        raise UpstreamFailed(stream.failure)
    return message_of_events(events)
