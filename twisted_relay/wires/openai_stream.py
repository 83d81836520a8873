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
from twisted_relay.sse_events import EventFramer, EventTooLarge, parse_event
from twisted_relay.wires.base import Refusal, anthropic_error

__all__ = ["OpenAIStreamAnswer", "OpenAIStreamToSSE", "openai_refusal", "sse_of"]


def sse_of(events) -> bytes:
    """Anthropic's events, ``(name, payload)``, as SSE bytes."""
    return b"".join(b"event: %s\ndata: %s\n\n" % (name.encode("ascii"), to_json(payload)) for name, payload in events)


class OpenAIStreamToSSE(Protocol):
    """
    An OpenAI stream as Anthropic's SSE, for ``inner`` (the relay's gate):
    each read's complete events translated by ``translator`` (a
    :class:`~twisted_relay.openai.responses_answer.ResponsesStream` or
    :class:`~twisted_relay.openai.chat_answer.ChatStream`) and handed on in
    one ``dataReceived``; the upstream's transport is the gate's, so that
    its pauses reach the upstream. A stream cut before its end becomes an
    ``error`` event (the translator's ``close``), never a normal end.
    """

    def __init__(self, inner, translator):
        self._inner = inner
        self._translator = translator
        self._framer = EventFramer()
        self._failed = False

    def makeConnection(self, transport) -> None:
        Protocol.makeConnection(self, transport)
        self._inner.makeConnection(transport)

    def dataReceived(self, data: bytes) -> None:
        if self._failed:
            return
        try:
            raws = self._framer.feed(data)
        except EventTooLarge as e:
            self._fail("an event of the upstream's stream is too large (%d bytes)" % (e.size,))
            return
        events = []
        try:
            for raw in raws:
                _, text = parse_event(raw)
                if not text:
                    continue
                if text.strip() == "[DONE]":
                    events.extend(self._translator.done())
                else:
                    events.extend(self._translator.feed(ujson.loads(text)))
        except ValueError as e:
            self._fail("the upstream sent an event that is not JSON (%s)" % (str(e)[:100],))
            return
        # An empty read still tells the gate that the upstream is alive.
        self._inner.dataReceived(sse_of(events))

    def _fail(self, why: str) -> None:
        self._failed = True
        error = {"type": "error", "error": {"type": "api_error", "message": "The upstream's stream was malformed: " + why}}
        self._inner.dataReceived(sse_of([("error", error)]))
        if self.transport is not None:
            self.transport.stopProducing()

    def connectionLost(self, reason=None) -> None:
        if not self._failed:
            tail = self._translator.close()
            if tail:
                self._inner.dataReceived(sse_of(tail))
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
