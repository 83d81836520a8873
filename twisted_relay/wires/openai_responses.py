# -*- test-case-name: tests.test_openai_wires -*-
"""
The ``openai-responses`` wire: models that speak OpenAI's Responses API
(GPT, and Codex models, which speak only it), stateless: every request
sends the whole conversation again, its reasoning items included
(:mod:`twisted_relay.openai.responses_request`), and every answer comes
back as Anthropic's (:mod:`twisted_relay.openai.responses_answer`).

Out: ``POST {url}/responses`` (``{url}/responses/input_tokens`` for
``count_tokens``), the upstream's ``url`` being what OpenAI's SDK calls its
base URL (``https://api.openai.com/v1``), the key as ``Authorization: Bearer``; the body
translated as it is serialised (a :class:`~twisted_relay.body_form.BodyForm`
naming the translation and its context). Back: the stream through
:class:`~twisted_relay.wires.openai_stream.OpenAIStreamToSSE`, a whole answer
mapped, OpenAI's errors into Anthropic's envelope.
"""

from __future__ import annotations

import ujson
from twisted.web.http_headers import Headers

from twisted_relay._json import to_json
from twisted_relay.body_form import BodyForm
from twisted_relay.openai.context import TranslateContext
from twisted_relay.openai.envelope import account_of
from twisted_relay.wires.base import Outgoing, Refusal, WholeBodyMapped, Wire, forwarded
from twisted_relay.wires.openai_stream import OpenAIStreamAnswer, openai_refusal

__all__ = ["OpenAIResponsesWire", "openai_headers"]

# The client's headers an OpenAI upstream gets: the rest are Anthropic's.
_FORWARDED = (b"user-agent",)


def openai_headers(headers: Headers, key: str | None, stream: bool) -> Headers:
    """The headers of a request to an OpenAI upstream: its key as a bearer token, JSON, SSE for a stream."""
    sent = forwarded(headers, _FORWARDED)
    sent.setRawHeaders(b"content-type", [b"application/json"])
    sent.setRawHeaders(b"accept", [b"text/event-stream" if stream else b"application/json"])
    if key:
        sent.setRawHeaders(b"authorization", [b"Bearer " + key.encode("utf-8")])
    return sent


class OpenAIResponsesWire(Wire):
    """OpenAI's Responses API for one upstream."""

    name = "openai-responses"
    reads_errors = True
    lists_models = False
    recovers_bindings = False

    def context(self, model: str | None, key: str | None, session: str | None, requested: str | None) -> tuple:
        """The translation's context for one attempt, as the body's form carries it."""
        return tuple(TranslateContext(self.upstream.name, account_of(key), model or "",
                                      self.upstream.dialect or "openai", session, requested))

    def outgoing(self, kind: str, path: str, headers: Headers, model: str | None, stream: bool, *,
                 key: str | None = None, session: str | None = None, requested: str | None = None) -> Outgoing:
        context = self.context(model, key, session, requested)
        if kind == "count_tokens":
            form = BodyForm(translate="openai-responses-count", context=context)
            return Outgoing("/responses/input_tokens", openai_headers(headers, key, False), form)
        form = BodyForm(translate="openai-responses", context=context)
        return Outgoing("/responses", openai_headers(headers, key, stream), form)

    def answered(self, kind: str, stream: bool, response, context: tuple = ()):
        ctx = TranslateContext(*context)
        if kind == "count_tokens":
            return self.counted(response)
        content_type = (response.headers.getRawHeaders(b"content-type") or [b""])[0]
        if stream and content_type.startswith(b"text/event-stream"):
            return OpenAIStreamAnswer(response, self.stream_translator(ctx))
        return WholeBodyMapped(response, lambda body: to_json(self.whole_translation(ujson.loads(body), ctx)))

    def counted(self, response):
        """``count_tokens``' answer as Anthropic's: Responses' ``input_tokens`` object mapped."""
        return WholeBodyMapped(response, _counted)

    def stream_translator(self, ctx: TranslateContext):
        """What turns this protocol's stream into Anthropic's events (:mod:`twisted_relay.openai.responses_answer`)."""
        from twisted_relay.openai.responses_answer import ResponsesStream

        return ResponsesStream(ctx)

    def whole_translation(self, answer: dict, ctx: TranslateContext) -> dict:
        """This protocol's whole answer as Anthropic's message."""
        from twisted_relay.openai.responses_answer import message_of_response

        return message_of_response(answer, ctx)

    def refusal(self, kind: str, status: int, headers: Headers, body: bytes, model: str | None) -> Refusal:
        return openai_refusal(status, headers, body)


def _counted(body: bytes) -> bytes:
    """``{"object": "response.input_tokens", "input_tokens": N}`` as Anthropic's ``count_tokens`` answer."""
    # An answer that is not input_tokens' is a broken one (WholeBodyMapped: a 502).
    return to_json({"input_tokens": int(ujson.loads(body)["input_tokens"])})
