# -*- test-case-name: tests.test_openai_answers -*-
"""
Anthropic's stream events for one message, written in the order Anthropic
writes them: the writer both answer translations use
(:mod:`~twisted_relay.openai.responses_answer`,
:mod:`~twisted_relay.openai.chat_answer`), and a whole message read back
from such events (their non-streamed answers are these events, gathered).

The writer keeps the grammar the clients rely on: ``message_start`` once
and first; one block open at a time, each with the next index, started,
given only the deltas of its own type (never a thinking delta inside a text
block: litellm #32357), stopped; ``message_delta`` and ``message_stop`` at
the end; or an ``error`` event, after which nothing is written. A delta of
the wrong type for the open block is a fault of the caller and raises.

Events are ``(name, payload)`` pairs; the payload is the event's JSON
object, its ``type`` equal to the name. Pure: no Twisted, no I/O.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from twisted_relay.openai.errors import AnthropicError, UpstreamFailed
from twisted_relay.openai.usage import ZERO_USAGE

__all__ = ["MessageEvents", "message_id_of", "message_of_events"]

Event = tuple[str, dict]

# A delta type -> the block type it belongs to.
_BLOCK_OF_DELTA = {
    "text_delta": "text",
    "thinking_delta": "thinking",
    "signature_delta": "thinking",
    "input_json_delta": "tool_use",
}
_UPSTREAM_PREFIXES = ("resp_", "chatcmpl-", "chatcmpl_", "msg_")
_NOT_ID = re.compile(r"[^A-Za-z0-9_-]")


def message_id_of(upstream_id: Any) -> str:
    """The ``msg_...`` id of a message made of the upstream's answer ``upstream_id`` (a new one when it gave none)."""
    text = upstream_id if isinstance(upstream_id, str) else ""
    for prefix in _UPSTREAM_PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    text = _NOT_ID.sub("", text)[:100]
    return "msg_" + (text or uuid.uuid4().hex)


class MessageEvents:
    """
    The events of one Anthropic message, written in order and taken by
    the caller (:meth:`take`) as they come.

    :ivar started: ``message_start`` was written.
    :ivar ended: ``message_stop`` or ``error`` was written: nothing more will be.
    :ivar open_type: the type of the open block (``text``, ``thinking``,
        ``tool_use``), or ``None``.
    :ivar tool_uses: how many ``tool_use`` blocks were started.
    :ivar failure: the error written as the ``error`` event, if one was.
    """

    def __init__(self):
        self._events: list[Event] = []
        self._index = -1
        self.started = False
        self.ended = False
        self.open_type: str | None = None
        self.tool_uses = 0
        self.failure: AnthropicError | None = None

    def take(self) -> list[Event]:
        """The events written since the last call."""
        events, self._events = self._events, []
        return events

    def start(self, message_id: str, model: str) -> None:
        """Write ``message_start`` (once: never a second one)."""
        if self.started or self.ended:
            return
        self.started = True
        self._events.append(("message_start", {
            "type": "message_start",
            "message": {
                "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": dict(ZERO_USAGE),
            },
        }))

    def open(self, block: dict) -> None:
        """Start ``block`` (``{"type": "text", "text": ""}``...) at the next index, the open one stopped first."""
        self.close()
        self._index += 1
        self.open_type = block["type"]
        if self.open_type == "tool_use":
            self.tool_uses += 1
        self._events.append(("content_block_start", {
            "type": "content_block_start", "index": self._index, "content_block": block}))

    def open_text(self) -> None:
        self.open({"type": "text", "text": ""})

    def open_thinking(self) -> None:
        self.open({"type": "thinking", "thinking": "", "signature": ""})

    def open_tool_use(self, tool_id: str, name: str) -> None:
        self.open({"type": "tool_use", "id": tool_id, "name": name, "input": {}})

    def delta(self, delta: dict) -> None:
        """Write ``delta`` to the open block, whose type must be the delta's."""
        if self.open_type is None or _BLOCK_OF_DELTA.get(delta["type"]) != self.open_type:
            raise ValueError("a %s for a %s block" % (delta["type"], self.open_type))
        self._events.append(("content_block_delta", {
            "type": "content_block_delta", "index": self._index, "delta": delta}))

    def text(self, text: str) -> None:
        if text:
            self.delta({"type": "text_delta", "text": text})

    def thinking(self, text: str) -> None:
        if text:
            self.delta({"type": "thinking_delta", "thinking": text})

    def signature(self, signature: str) -> None:
        self.delta({"type": "signature_delta", "signature": signature})

    def input_json(self, partial: str) -> None:
        if partial:
            self.delta({"type": "input_json_delta", "partial_json": partial})

    def close(self) -> None:
        """Stop the open block, if one is."""
        if self.open_type is not None:
            self._events.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
            self.open_type = None

    def finish(self, stop_reason: str, usage: dict) -> None:
        """The message's end: the open block stopped, ``message_delta`` (with the usage), ``message_stop``."""
        if self.ended:
            return
        self.close()
        self._events.append(("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None}, "usage": usage}))
        self._events.append(("message_stop", {"type": "message_stop"}))
        self.ended = True

    def fail(self, error: AnthropicError) -> None:
        """An ``error`` event, and nothing after it (no block stopped, no ``message_stop``)."""
        if self.ended:
            return
        self._events.append(("error", {"type": "error", "error": {"type": error.error_type, "message": error.message}}))
        self.open_type = None
        self.ended = True
        self.failure = error


def _input_of(partial_json: str) -> dict:
    """A tool call's arguments (the JSON text of its deltas) as the ``tool_use`` block's input."""
    if not partial_json.strip():
        return {}
    try:
        value = json.loads(partial_json)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise UpstreamFailed(AnthropicError(
            502, "api_error", "The upstream's tool call arguments are not a JSON object: %s" % (partial_json[:200],)))
    return value


def message_of_events(events: list[Event]) -> dict:
    """
    The whole message that ``events`` (as :class:`MessageEvents` writes
    them) stream. An ``error`` event raises
    :class:`~twisted_relay.openai.errors.UpstreamFailed` with its error.
    """
    message: dict | None = None
    content: list[dict] = []
    arguments: dict[int, list[str]] = {}
    for name, payload in events:
        if name == "error":
            error = payload["error"]
            status = {"rate_limit_error": 429, "overloaded_error": 529, "invalid_request_error": 400,
                      "timeout_error": 504, "not_found_error": 404}.get(error["type"], 500)
            raise UpstreamFailed(AnthropicError(status, error["type"], error["message"]))
        if name == "message_start":
            message = dict(payload["message"], usage=dict(payload["message"]["usage"]))
        elif name == "content_block_start":
            content.append(dict(payload["content_block"]))
        elif name == "content_block_delta":
            block, delta = content[payload["index"]], payload["delta"]
            kind = delta["type"]
            if kind == "text_delta":
                block["text"] += delta["text"]
            elif kind == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif kind == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                arguments.setdefault(payload["index"], []).append(delta["partial_json"])
        elif name == "content_block_stop":
            block = content[payload["index"]]
            if block["type"] == "tool_use":
                block["input"] = _input_of("".join(arguments.pop(payload["index"], ())))
        elif name == "message_delta" and message is not None:
            message["stop_reason"] = payload["delta"]["stop_reason"]
            message["stop_sequence"] = payload["delta"]["stop_sequence"]
            message["usage"].update(payload["usage"])
    if message is None:
        raise UpstreamFailed(AnthropicError(502, "api_error", "The upstream's answer held no message."))
    message["content"] = content
    return message
