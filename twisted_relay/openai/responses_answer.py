# -*- test-case-name: tests.test_openai_answers -*-
"""
A Responses API answer as Anthropic's (issue 33, item 2): the stream's
events, one at a time (:class:`ResponsesStream`), and a whole response
(:func:`message_of_response`, the same rules: it is the stream of a
response whose items all come done).

The stream: ``message_start`` once (its usage zeros, the id ``msg_...`` of
the response's, the model the client asked for); then one block per output
item, in order, one open at a time:

- a ``reasoning`` item is a thinking block (one per item: a turn that
  reasons, calls, reasons again has two, each at its own index:
  claude-code-router #1725), its summary (or raw reasoning text) as
  ``thinking_delta`` (parts joined by a blank line), and at
  ``output_item.done`` (the only event whose ``encrypted_content`` is
  final) the item, without its id, sealed in the relay's envelope
  (:mod:`~twisted_relay.openai.envelope`) as the ``signature_delta``; a
  reasoning item with no summary is a thinking block with empty text and
  the signature;
- a ``message`` item is a text block (opened at its first text that is
  not only white space: Anthropic refuses an empty or white-space text
  block sent back), a ``refusal`` part's words included (the stop reason
  is then ``refusal``);
- a ``function_call`` item is a ``tool_use`` block (``id`` the
  ``call_id``, ``input_json_delta`` from the argument deltas, keyed by
  ``item_id``); arguments given only by ``.done`` or ``output_item.done``
  are written then; an item whose ``output_item.added`` never came is
  started when its call id and name are known;
- other items (server tools) are not Anthropic blocks here and are skipped.

Items come one after another; the events of an item that come while
another is open (Codex interleaves parallel calls) wait until it is done,
then are written in order. Texts that only a ``.done`` event (or the
terminal response) carries are written then, and only what was not
streamed already.

The end: ``response.completed`` or ``response.incomplete`` (the items
that were never streamed or never done taken from its ``output``) is
``message_delta`` (the stop reason: ``tool_use`` when a function was
called, ``max_tokens`` for an incomplete response but one stopped by the
content filter, which is ``refusal`` as a refusal part is, else
``end_turn``; the usage mapped by :mod:`~twisted_relay.openai.usage`) and
``message_stop``. ``response.failed``, ``response.cancelled``, a
top-level ``error`` event and a body that ends before the terminal event
(:meth:`ResponsesStream.close`) are an Anthropic ``error`` event, and
nothing follows it: never a normal end (sub2api PR #6923).

Pure: no Twisted, no I/O.
"""

from __future__ import annotations

import json
from typing import Any

from twisted_relay.openai.context import TranslateContext
from twisted_relay.openai.envelope import seal
from twisted_relay.openai.errors import AnthropicError, UpstreamFailed, failure_of
from twisted_relay.openai.message_events import Event, MessageEvents, message_id_of, message_of_events
from twisted_relay.openai.usage import usage_of_responses

__all__ = ["ResponsesStream", "message_of_response"]

# Output item types made into blocks.
_KINDS = {"reasoning": "reasoning", "message": "message", "function_call": "function_call"}

# The item events, by the kind of item they belong to.
_EVENT_KINDS = {
    "response.output_text.delta": "message",
    "response.output_text.done": "message",
    "response.refusal.delta": "message",
    "response.refusal.done": "message",
    "response.reasoning_summary_part.added": "reasoning",
    "response.reasoning_summary_part.done": "reasoning",
    "response.reasoning_summary_text.delta": "reasoning",
    "response.reasoning_summary_text.done": "reasoning",
    "response.reasoning_text.delta": "reasoning",
    "response.reasoning_text.done": "reasoning",
    "response.function_call_arguments.delta": "function_call",
    "response.function_call_arguments.done": "function_call",
}
# The text events: the part whose text they carry (the name of its key, and the
# field of its index with the index's default), the field of the text, and
# whether that is the part's whole text (.done) or a piece of it (.delta).
_CONTENT = ("content", "content_index", 0)
_SUMMARY = ("summary", "summary_index", None)
_TEXT_EVENTS = {
    "response.output_text.delta": (_CONTENT, "delta", False),
    "response.output_text.done": (_CONTENT, "text", True),
    "response.refusal.delta": (_CONTENT, "delta", False),
    "response.refusal.done": (_CONTENT, "refusal", True),
    "response.reasoning_text.delta": (_CONTENT, "delta", False),
    "response.reasoning_text.done": (_CONTENT, "text", True),
    "response.reasoning_summary_text.delta": (_SUMMARY, "delta", False),
    "response.reasoning_summary_text.done": (_SUMMARY, "text", True),
}
_REFUSALS = frozenset({"response.refusal.delta", "response.refusal.done"})
_STARTS = frozenset({"response.created", "response.in_progress", "response.queued"})
_ENDS = frozenset({"response.completed", "response.incomplete"})
_FAILURES = frozenset({"response.failed", "response.cancelled"})

_CUT = "The upstream's stream ended before the response was complete."
_NO_CALL_ID = "The upstream's function call came without its call_id or name."


def _kind_of(event: dict, kind: str) -> str | None:
    """The kind of item an item event belongs to (``None``: not one made into a block)."""
    found = _EVENT_KINDS.get(kind)
    if found is not None:
        return found
    if kind in ("response.output_item.added", "response.output_item.done"):
        item = event.get("item")
        return _KINDS.get(item.get("type")) if isinstance(item, dict) else None
    if kind in ("response.content_part.added", "response.content_part.done"):
        part = event.get("part")
        part_type = part.get("type") if isinstance(part, dict) else None
        return "reasoning" if part_type == "reasoning_text" else "message"
    return None


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


class _Item:
    """What the stream knows of one output item."""

    __slots__ = ("kind", "item_id", "output_index", "call_id", "name", "arguments", "parts", "last_part",
                 "space", "opened", "done", "pending")

    def __init__(self, kind: str):
        self.kind = kind
        self.item_id: str | None = None
        self.output_index: int | None = None
        self.call_id: str | None = None
        self.name: str | None = None
        # Pieces, joined only when a whole text is compared with them (joining
        # at each delta would cost the square of an answer's length).
        self.arguments: list[str] = []  # a call's arguments so far (written once its block started)
        self.parts: dict[tuple, list[str]] = {}  # a text part (its key) -> the text written of it
        self.last_part: tuple | None = None
        self.space = ""  # a message's white space before its first text
        self.opened = False  # its block was started
        self.done = False
        self.pending: list[dict] = []  # its events that came while another item was open


class ResponsesStream:
    """
    One Responses stream, translated event by event (the module's rules).

    :param ctx: the attempt's :class:`~twisted_relay.openai.context.TranslateContext`.
    """

    def __init__(self, ctx: TranslateContext):
        self._ctx = ctx
        self._out = MessageEvents()
        self._items: list[_Item] = []
        # (kind, item_id) and (kind, output_index) -> the item.
        self._by_id: dict[tuple, _Item] = {}
        self._by_index: dict[tuple, _Item] = {}
        self._current: _Item | None = None
        self._refused = False

    @property
    def failure(self) -> AnthropicError | None:
        """The error the stream ended with, if it did."""
        return self._out.failure

    def feed(self, event: dict) -> list[Event]:
        """The Anthropic events of one parsed Responses event (the JSON of a ``data:`` line)."""
        kind = event.get("type") if isinstance(event, dict) else None
        if not self._out.ended and isinstance(kind, str):
            # The item events first: a stream is mostly their deltas.
            item_kind = _EVENT_KINDS.get(kind) or _kind_of(event, kind)
            if item_kind is not None:
                self._item_event(event, kind, item_kind)
            elif kind in _STARTS:
                self._start(event.get("response"))
            elif kind in _ENDS:
                self._end(event.get("response"), kind)
            elif kind in _FAILURES:
                self._failed(event.get("response"), kind)
            elif kind == "error":
                error = event.get("error")
                self._out.fail(failure_of(error if isinstance(error, dict) else event, "The upstream reported an error."))
        return self._out.take()

    def done(self) -> list[Event]:
        """
        ``data: [DONE]``, which OpenAI's Responses streams do not send but
        some compatible upstreams do: nothing after the terminal event, an
        ``error`` event before it (as at :meth:`close`).
        """
        return self.close()

    def close(self) -> list[Event]:
        """The upstream's body ended: an ``error`` event unless the stream had its end."""
        self._out.fail(AnthropicError(502, "api_error", _CUT))
        return self._out.take()

    # -- the message ----------------------------------------------------------------

    def _start(self, response: Any) -> None:
        if self._out.started:
            return
        response = response if isinstance(response, dict) else {}
        model = self._ctx.requested_model or _str(response.get("model")) or self._ctx.model
        self._out.start(message_id_of(response.get("id")), model)

    def _failed(self, response: Any, kind: str) -> None:
        response = response if isinstance(response, dict) else {}
        cancelled = kind == "response.cancelled" or response.get("status") == "cancelled"
        default = "The upstream cancelled the response." if cancelled else "The upstream's response failed."
        self._out.fail(failure_of(response.get("error"), default))

    def _end(self, response: Any, kind: str) -> None:
        response = response if isinstance(response, dict) else {}
        if response.get("status") in ("failed", "cancelled"):
            self._failed(response, kind)
            return
        self._start(response)
        output = response.get("output")
        for index, whole in enumerate(output if isinstance(output, list) else ()):
            item_kind = _KINDS.get(whole.get("type")) if isinstance(whole, dict) else None
            if item_kind is None:
                continue
            item = self._item_for(whole.get("id"), index, item_kind)
            if not item.done:
                self._settle(item, whole)
            if self._out.ended:
                return
        for item in self._items:
            if not item.done:
                self._settle(item, None)
            if self._out.ended:
                return
        incomplete = kind == "response.incomplete" or response.get("status") == "incomplete"
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        if incomplete:
            stop = "refusal" if reason == "content_filter" else "max_tokens"
        elif self._out.tool_uses:
            stop = "tool_use"
        else:
            stop = "refusal" if self._refused else "end_turn"
        self._out.finish(stop, usage_of_responses(response.get("usage")))

    # -- items ------------------------------------------------------------------------

    def _item_for(self, item_id: Any, index: Any, kind: str) -> _Item:
        """The item an event names (by ``item_id``, else ``output_index``), a new one if none is known."""
        item_id = item_id if isinstance(item_id, str) and item_id else None
        index = index if type(index) is int else None
        found = self._by_id.get((kind, item_id)) if item_id else None
        if found is None and index is not None:
            found = self._by_index.get((kind, index))
            if found is not None and found.item_id and item_id and found.item_id != item_id:
                found = None
        if found is None and item_id is None and index is None and self._current and self._current.kind == kind:
            found = self._current
        if found is None:
            found = _Item(kind)
            self._items.append(found)
        if item_id and found.item_id is None:
            found.item_id = item_id
            self._by_id.setdefault((kind, item_id), found)
        if index is not None and found.output_index is None:
            found.output_index = index
            self._by_index.setdefault((kind, index), found)
        return found

    def _item_event(self, event: dict, kind: str, item_kind: str) -> None:
        if not self._out.started:
            self._start(None)
        item_id = event.get("item_id")
        if not item_id:
            whole = event.get("item")
            item_id = whole.get("id") if isinstance(whole, dict) else None
        item = self._item_for(item_id, event.get("output_index"), item_kind)
        if item.done:
            return
        if self._current is None:
            self._current = item
        if item is not self._current:
            item.pending.append(event)
            return
        self._apply(item, event, kind)
        # The items whose events waited, each in turn.
        while self._current is None and not self._out.ended:
            waiting = next((other for other in self._items if other.pending and not other.done), None)
            if waiting is None:
                break
            self._current = waiting
            self._replay(waiting)

    def _replay(self, item: _Item) -> None:
        events, item.pending = item.pending, []
        for event in events:
            if item.done or self._out.ended:
                break
            self._apply(item, event, event["type"])

    def _settle(self, item: _Item, whole: dict | None) -> None:
        """At the end: ``item`` completed (from the response's ``output``), or closed with what it has."""
        current = self._current
        if current is not None and current is not item and not current.done:
            self._replay(current)
            if not current.done:
                self._close_unfinished(current)
        if self._out.ended:
            return
        self._current = item
        self._replay(item)
        if item.done or self._out.ended:
            return
        if whole is None:
            self._close_unfinished(item)
        else:
            self._begin(item)
            self._complete(item, whole)

    def _begin(self, item: _Item) -> None:
        """A reasoning item's thinking block starts with the item."""
        if item.kind == "reasoning" and not item.opened:
            self._out.open_thinking()
            item.opened = True

    def _apply(self, item: _Item, event: dict, kind: str) -> None:
        """One event of the open item."""
        if not item.opened:
            self._begin(item)
        text_event = _TEXT_EVENTS.get(kind)
        if text_event is not None:
            # The text events: .delta (a piece), .done (the whole part).
            (part, index_field, index_default), field, whole = text_event
            if kind in _REFUSALS:
                self._refused = True
            self._text(item, (part, event.get(index_field, index_default)), event.get(field), whole)
        elif kind == "response.output_item.added":
            self._added(item, event["item"])
        elif kind == "response.output_item.done":
            self._complete(item, event["item"])
        elif kind == "response.function_call_arguments.delta":
            delta = _str(event.get("delta"))
            item.arguments.append(delta)
            if item.opened:
                self._out.input_json(delta)
        elif kind == "response.function_call_arguments.done":
            self._arguments(item, event.get("arguments"))
        elif kind in ("response.content_part.added", "response.content_part.done"):
            part = event.get("part") if isinstance(event.get("part"), dict) else {}
            text = part.get("refusal") if part.get("type") == "refusal" else part.get("text")
            if part.get("type") == "refusal":
                self._refused = True
            if kind.endswith(".done") or text:
                self._text(item, _part_key(item, event), text, whole=True)
        elif kind.startswith("response.reasoning_summary_part."):
            part = event.get("part")
            text = part.get("text") if isinstance(part, dict) else None
            if kind.endswith(".done") or text:
                self._text(item, ("summary", event.get("summary_index")), text, whole=True)

    def _added(self, item: _Item, whole: dict) -> None:
        if item.kind != "function_call":
            return
        item.call_id = item.call_id or _str(whole.get("call_id")) or None
        item.name = item.name or _str(whole.get("name")) or None
        arguments = _arguments_text(whole.get("arguments"))
        if arguments and not item.arguments:
            item.arguments = [arguments]
        self._open_call(item)

    def _open_call(self, item: _Item) -> bool:
        """Start a call's ``tool_use`` block once its call id and name are known, with the arguments so far."""
        if item.opened:
            return True
        if not (item.call_id and item.name):
            return False
        self._out.open_tool_use(item.call_id, item.name)
        item.opened = True
        self._out.input_json("".join(item.arguments))
        return True

    def _arguments(self, item: _Item, arguments: Any) -> None:
        """A call's whole arguments: what was not written yet of them (or all, before its block starts)."""
        arguments = _arguments_text(arguments)
        if arguments is None:
            return
        if item.opened:
            written = "".join(item.arguments)
            if not arguments.startswith(written):
                return  # the streamed arguments stand: they cannot be taken back
            self._out.input_json(arguments[len(written):])
        item.arguments = [arguments]

    def _text(self, item: _Item, key: tuple, text: Any, whole: bool) -> None:
        """
        Text of a message or reasoning part: a ``.delta``'s piece, or a
        part's whole text of which only what was not written yet is.
        """
        if not isinstance(text, str):
            return
        pieces = item.parts.setdefault(key, [])
        if whole:
            written = "".join(pieces)
            if not text.startswith(written):
                return  # the streamed text stands: it cannot be taken back
            text = text[len(written):]
            pieces[:] = [written]
        if not text:
            return
        if item.kind == "reasoning":
            separated = item.last_part is not None and item.last_part != key
            self._out.thinking("\n\n" + text if separated else text)
        elif item.opened:
            self._out.text(text)
        elif not text.strip():
            item.space += text  # no block of white space only: Anthropic refuses one sent back
        else:
            self._out.open_text()
            item.opened = True
            self._out.text(item.space + text)
        pieces.append(text)
        item.last_part = key

    def _complete(self, item: _Item, whole: dict) -> None:
        """An item done (``output_item.done`` or the terminal response's): the rest written, its block stopped."""
        if item.kind == "reasoning":
            for index, part in enumerate(_list(whole.get("summary"))):
                if isinstance(part, dict):
                    self._text(item, ("summary", index), part.get("text"), whole=True)
            for index, part in enumerate(_list(whole.get("content"))):
                if isinstance(part, dict):
                    self._text(item, ("content", index), part.get("text"), whole=True)
            kept = {name: value for name, value in whole.items() if name != "id"}
            self._out.signature(seal(self._ctx.upstream, self._ctx.account, {"kind": "responses", "items": [kept]}))
        elif item.kind == "message":
            for index, part in enumerate(_list(whole.get("content"))):
                if not isinstance(part, dict):
                    continue
                if part.get("type") == "refusal":
                    self._refused = True
                    self._text(item, ("content", index), part.get("refusal"), whole=True)
                elif part.get("type") == "output_text":
                    self._text(item, ("content", index), part.get("text"), whole=True)
        else:
            item.call_id = item.call_id or _str(whole.get("call_id")) or None
            item.name = item.name or _str(whole.get("name")) or None
            self._arguments(item, whole.get("arguments"))
            if not self._open_call(item):
                self._out.fail(AnthropicError(502, "api_error", _NO_CALL_ID))
                return
        self._done(item)

    def _close_unfinished(self, item: _Item) -> None:
        """
        An item the upstream never finished, at the end: closed with what
        it has (a reasoning item without its final encrypted content has
        no signature: it cannot be sent back).
        """
        if item.kind == "function_call" and not self._open_call(item):
            self._out.fail(AnthropicError(502, "api_error", _NO_CALL_ID))
            return
        self._done(item)

    def _done(self, item: _Item) -> None:
        item.done = True
        if item.opened:
            self._out.close()
        if self._current is item:
            self._current = None


def _part_key(item: _Item, event: dict) -> tuple:
    return ("content", event.get("content_index", 0))


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _arguments_text(arguments: Any) -> str | None:
    """A call's arguments as JSON text (an upstream that sends an object gets it written)."""
    if isinstance(arguments, str):
        return arguments
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    return None


def message_of_response(response: dict, ctx: TranslateContext) -> dict:
    """
    A whole Responses answer as an Anthropic message (the stream's rules).
    A failed or cancelled response raises
    :class:`~twisted_relay.openai.errors.UpstreamFailed`.
    """
    if not isinstance(response, dict):
        raise UpstreamFailed(AnthropicError(502, "api_error", "The upstream's answer is not a response."))
    terminal = {
        "incomplete": "response.incomplete", "failed": "response.failed", "cancelled": "response.cancelled",
    }.get(response.get("status"), "response.completed")
    if response.get("error") and terminal == "response.completed":
        terminal = "response.failed"
    stream = ResponsesStream(ctx)
    events = stream.feed({"type": "response.created", "response": response})
    events += stream.feed({"type": terminal, "response": response})
    if stream.failure is not None:
        raise UpstreamFailed(stream.failure)
    return message_of_events(events)
