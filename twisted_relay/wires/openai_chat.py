# -*- test-case-name: tests.test_openai_wires -*-
"""
The ``openai-chat`` wire: models that speak OpenAI's Chat Completions
(Gemini's OpenAI-compatible endpoint, Mistral, Groq, xAI, OpenRouter,
DeepSeek, Kimi, GPT), each upstream with its dialect (``dialect``
setting: which reasoning goes back, which fields it refuses, its ids;
:mod:`twisted_relay.openai.dialects`).

Out: ``POST {url}/chat/completions``, the upstream's ``url`` being what
OpenAI's SDK calls its base URL (``https://api.mistral.ai/v1``,
``https://generativelanguage.googleapis.com/v1beta/openai``,
``https://api.groq.com/openai/v1``, ``https://openrouter.ai/api/v1``), the key as ``Authorization: Bearer``,
the body translated as it is serialised. ``count_tokens``: no Chat upstream
counts, so the relay answers itself with an estimate that never undercounts
(:func:`twisted_relay.openai.counting.estimate_input_tokens`). Back: the
stream (``data:`` lines and ``[DONE]``) through
:class:`~twisted_relay.wires.openai_stream.OpenAIStreamToSSE`, a whole answer
mapped, OpenAI's errors into Anthropic's envelope.
"""

from __future__ import annotations

from twisted.web.http_headers import Headers

from twisted_relay.body_form import BodyForm
from twisted_relay.openai.context import TranslateContext
from twisted_relay.wires.base import Outgoing
from twisted_relay.wires.openai_responses import OpenAIResponsesWire, openai_headers

__all__ = ["COUNTED_HERE", "OpenAIChatWire"]

#: The path of a request the relay answers itself (``count_tokens``): never sent.
COUNTED_HERE = None


class OpenAIChatWire(OpenAIResponsesWire):
    """OpenAI's Chat Completions for one upstream, in its dialect."""

    name = "openai-chat"

    def outgoing(self, kind: str, path: str, headers: Headers, model: str | None, stream: bool, *,
                 key: str | None = None, session: str | None = None, requested: str | None = None) -> Outgoing:
        context = self.context(model, key, session, requested)
        if kind == "count_tokens":
            return Outgoing(COUNTED_HERE, headers, BodyForm(translate="openai-chat-count", context=context))
        form = BodyForm(translate="openai-chat", context=context)
        return Outgoing("/chat/completions", openai_headers(headers, key, stream), form)

    def counted(self, response):
        """The relay's own estimate (:data:`COUNTED_HERE`), already Anthropic's answer."""
        return response

    def stream_translator(self, ctx: TranslateContext):
        from twisted_relay.openai.chat_answer import ChatStream

        return ChatStream(ctx)

    def whole_translation(self, answer: dict, ctx: TranslateContext) -> dict:
        from twisted_relay.openai.chat_answer import message_of_completion

        return message_of_completion(answer, ctx)
