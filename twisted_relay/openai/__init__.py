"""
OpenAI's protocols as the relay speaks them to an upstream (issue 33): the
Responses API and Chat Completions (with its dialects), translated from
and to Anthropic's Messages. Pure: no Twisted, no I/O, so that a body
worker process can translate a large request as it serialises it.
``envelope``, ``context``, ``capabilities`` <- ``dialects`` <- the
requests' and the answers' translations.
"""

from __future__ import annotations

from twisted_relay.openai.capabilities import CapabilityRejected
from twisted_relay.openai.context import TranslateContext
from twisted_relay.openai.ids import fit_ids

__all__ = ["TRANSLATIONS", "CapabilityRejected", "TranslateContext", "to_upstream_protocol"]

#: The translations a wire may ask for (:class:`~twisted_relay.body_form.BodyForm`'s ``translate``).
TRANSLATIONS = ("openai-responses", "openai-responses-count", "openai-chat", "openai-chat-count")

# What POST /v1/responses/input_tokens takes of a Responses body.
_COUNTED_FIELDS = ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "reasoning",
                   "text", "truncation", "conversation", "previous_response_id")


def to_upstream_protocol(name: str, context: tuple, body: dict) -> dict:
    """
    ``body`` (an Anthropic Messages body, its ids already the upstream's)
    as the upstream's protocol takes it.

    :raises CapabilityRejected: for what the upstream cannot take.
    """
    ctx = TranslateContext(*context)
    if name.startswith("openai-responses"):
        body = fit_ids(body, "responses")
    elif ctx.dialect == "mistral":
        body = fit_ids(body, "mistral")
    else:
        body = fit_ids(body, "chat")
    if name in ("openai-responses", "openai-responses-count"):
        from twisted_relay.openai.responses_request import to_responses

        translated = to_responses(body, ctx)
        if name == "openai-responses-count":
            translated = {key: value for key, value in translated.items() if key in _COUNTED_FIELDS}
        return translated
    if name == "openai-chat":
        from twisted_relay.openai.chat_request import to_chat

        return to_chat(body, ctx)
    if name == "openai-chat-count":
        # No Chat upstream counts: the relay's own estimate, never under.
        from twisted_relay.openai.counting import estimate_input_tokens

        return {"input_tokens": estimate_input_tokens(body, ctx)}
    raise ValueError("unknown translation %r" % (name,))
