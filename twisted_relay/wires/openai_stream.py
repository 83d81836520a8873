# -*- test-case-name: tests.test_openai_wires -*-
"""
What the two OpenAI wires share: an OpenAI stream (SSE whose events carry
their JSON in ``data:``; Chat's end in ``data: [DONE]``) turned into
Anthropic's SSE before the gate, a whole answer mapped to Anthropic's, an
error into Anthropic's envelope, and an answer the relay makes itself (a
Chat upstream's ``count_tokens``, which none of them serves).

The translations are :mod:`twisted_relay.openai`'s (pure); this module
only frames them: bytes in, the translator's events out, as bytes again.
"""

from __future__ import annotations

import ujson
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH

from twisted_relay._json import to_json
from twisted_relay.sse_events import EventFramer, EventTooLarge, event_data_at, sse_event
from twisted_relay.wires.base import Refusal, anthropic_error

__all__ = ["OpenAIStreamAnswer", "OpenAIStreamToSSE", "gate_events", "openai_refusal", "sse_of"]


# The event most of a stream is: a text delta, as sse_event writes one (its
# payload as MessageEvents makes it), with only its text left to serialise.
_TEXT_DELTA = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
    b'"delta":{"type":"text_delta","text":%s}}\n\n'
)


def gate_events(events) -> list[tuple[bytes, dict, bytes]]:
    """
    Anthropic's events, ``(name, payload)``, as the SSE gate takes them
    (:meth:`~twisted_relay.sse.SSEGate.eventsReceived`): ``(name, payload,
    raw)``, the name in bytes and the event serialised.
    """
    framed = []
    for name, payload in events:
        if name == "content_block_delta" and payload["delta"]["type"] == "text_delta":
            raw = _TEXT_DELTA % (payload["index"], to_json(payload["delta"]["text"]))
            framed.append((b"content_block_delta", payload, raw))
        else:
            name = name.encode("ascii")
            framed.append((name, payload, sse_event(name, payload)))
    return framed


def sse_of(events) -> bytes:
    """Anthropic's events, ``(name, payload)``, as SSE bytes."""
    return b"".join([raw for _, _, raw in gate_events(events)])


class OpenAIStreamToSSE(Protocol):
    """
    An OpenAI stream as Anthropic's SSE, for ``inner`` (the relay's gate):
    each read's complete events translated by ``translator`` (a
    :class:`~twisted_relay.openai.responses_answer.ResponsesStream` or
    :class:`~twisted_relay.openai.chat_answer.ChatStream`) and handed on in
    one call: to the gate as events, already parsed and serialised
    (:func:`gate_events`), so that it neither frames nor parses them again;
    to any other protocol (a whole body's reader) as SSE bytes. The
    upstream's transport is the gate's, so that its pauses reach the
    upstream. A stream cut before its end becomes an ``error`` event (the
    translator's ``close``), never a normal end.
    """

    def __init__(self, inner, translator):
        self._inner = inner
        self._translator = translator
        self._framer = EventFramer()
        self._failed = False
        self._events_received = getattr(inner, "eventsReceived", None)

    def makeConnection(self, transport) -> None:
        Protocol.makeConnection(self, transport)
        self._inner.makeConnection(transport)

    def dataReceived(self, data: bytes) -> None:
        if self._failed:
            return
        framer, translator = self._framer, self._translator
        framer.append(data)
        buf, cr = framer.buffer, framer.line_ends_vary
        events = []
        try:
            while True:
                start = framer.position
                end = framer.next_end()
                if end < 0:
                    break
                text = event_data_at(buf, start, end, cr)
                if not text:
                    continue
                if text.strip() == b"[DONE]":
                    events.extend(translator.done())
                else:
                    events.extend(translator.feed(ujson.loads(text)))
        except EventTooLarge as e:
            self._hand_on(events)
            self._fail("an event of the upstream's stream is too large (%d bytes)" % (e.size,))
            return
        except ValueError as e:
            self._hand_on(events)
            self._fail("the upstream sent an event that is not JSON (%s)" % (str(e)[:100],))
            return
        framer.compact()
        # An empty read still tells the gate that the upstream is alive.
        self._hand_on(events)

    def _hand_on(self, events: list) -> None:
        """Hand Anthropic's events on: to the gate as events, to any other protocol as SSE bytes."""
        if self._events_received is not None:
            self._events_received(gate_events(events))
        else:
            self._inner.dataReceived(sse_of(events))

    def _fail(self, why: str) -> None:
        self._failed = True
        error = {"type": "error", "error": {"type": "api_error", "message": "The upstream's stream was malformed: " + why}}
        self._hand_on([("error", error)])
        if self.transport is not None:
            self.transport.stopProducing()

    def connectionLost(self, reason=None) -> None:
        if not self._failed:
            tail = self._translator.close()
            if tail:
                self._hand_on(tail)
        self._inner.connectionLost(reason if reason is not None else Failure(ResponseDone()))


class OpenAIStreamAnswer:
    """An OpenAI stream as the relay reads it: Anthropic's SSE, translated on the way."""

    def __init__(self, response, translator):
        self.original = response
        self.code = response.code
        self.phrase = getattr(response, "phrase", b"OK")
        self.length = UNKNOWN_LENGTH
        headers = response.headers.copy()
        headers.setRawHeaders(b"content-type", [b"text/event-stream; charset=utf-8"])
        self.headers = headers
        self._translator = translator

    def __getattr__(self, name):
        return getattr(self.original, name)

    def deliverBody(self, protocol) -> None:
        self.original.deliverBody(OpenAIStreamToSSE(protocol, self._translator))


def openai_refusal(status: int, headers: Headers, body: bytes) -> Refusal:
    """An OpenAI error answer, as the client gets it (:func:`twisted_relay.openai.errors.anthropic_error_of`)."""
    from twisted_relay.openai.errors import anthropic_error_of

    mapped, error_type, message = anthropic_error_of(status, body)
    request_id = (headers.getRawHeaders(b"x-request-id") or [b""])[0].decode("latin-1") or None
    return Refusal(mapped, anthropic_error(error_type, message, request_id))
