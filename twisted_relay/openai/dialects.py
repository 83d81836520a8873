# -*- test-case-name: tests.test_openai_requests -*-
"""
The dialects of Chat Completions (issue 33): one protocol, contradictory
rules. Each upstream of the ``openai-chat`` wire names one (``dialect =``
in its settings), and :func:`~twisted_relay.openai.chat_request.to_chat`
writes the request as that dialect takes it; ``openai`` is also the
dialect of the ``openai-responses`` wire (its ids and vision).

What differs (docs/openai.md, "Dialects"; the sources in the research
brief, section 3):

- the reasoning that must go back (:attr:`Dialect.reasoning`): DeepSeek and
  Kimi refuse an assistant message with tool calls that lacks
  ``reasoning_content`` (400 "The reasoning_content in the thinking mode
  must be passed back", "reasoning_content is missing in assistant tool
  call message at index N"), even when it is empty; GLM keeps its
  interleaved thinking when it is sent back; Gemini 3 refuses the first
  function call of a step without its ``extra_content.google.
  thought_signature`` (a call of another model's history takes the
  documented ``skip_thought_signature_validator``); OpenRouter wants
  ``reasoning_details`` back unmodified; Groq refuses any reasoning field
  on a message, and any field it does not know;
- the ids it takes (:attr:`Dialect.id_pattern`, applied by the relay's id
  core): Mistral's are exactly nine letters or digits;
- images, ``stream_options.include_usage``, the name of the token limit,
  the reasoning effort's field and values, ``prompt_cache_key``, the end
  user's field, ``parallel_tool_calls``, JSON-schema output, stop sequences;
- fields it refuses (:attr:`Dialect.refused`): never sent, whatever the
  translation made;
- the JSON Schema it takes for function parameters
  (:attr:`Dialect.schema_fields`): Gemini's is a subset of OpenAPI 3.0, and
  a keyword it lacks (Claude Code's ``Read`` tool has
  ``additionalProperties`` and ``exclusiveMinimum``) is a 400 "Invalid JSON
  payload received. Unknown name ...: Cannot find field." (llmgateway #1763,
  pi #4932).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DIALECTS",
    "EFFORTS",
    "GEMINI_SCHEMA_FIELDS",
    "GEMINI_SKIP_SIGNATURE",
    "MISTRAL_ID_PATTERN",
    "RESPONSES_ID_PATTERN",
    "Dialect",
    "dialect_of",
]

#: Anthropic's effort levels (``output_config.effort``), lowest first, and
#: ``none`` for thinking disabled.
EFFORTS = ("none", "low", "medium", "high", "xhigh", "max")

#: The reasoning fields a dialect takes back on an assistant message.
NO_REASONING = "none"
REASONING_CONTENT = "reasoning_content"
THOUGHT_SIGNATURES = "thought_signatures"
REASONING_DETAILS = "reasoning_details"

#: Gemini's documented dummy signature for function calls it did not make.
GEMINI_SKIP_SIGNATURE = "skip_thought_signature_validator"
#: The fields of Gemini's ``Schema`` (the Gemini API's, generativelanguage
#: v1beta), which a function's ``parameters`` become on its OpenAI-compatible
#: endpoint too.
GEMINI_SCHEMA_FIELDS = frozenset({
    "anyOf", "default", "description", "enum", "example", "format", "items", "maxItems", "maxLength",
    "maxProperties", "maximum", "minItems", "minLength", "minProperties", "minimum", "nullable", "pattern",
    "properties", "propertyOrdering", "required", "title", "type",
})
#: Mistral's tool-call ids: "must be a-z, A-Z, 0-9, with a length of 9".
MISTRAL_ID_PATTERN = r"^[A-Za-z0-9]{9}$"
#: A Responses ``call_id``: at most 64 characters.
RESPONSES_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


@dataclass(frozen=True)
class Dialect:
    """
    How one Chat Completions upstream (or, for ``openai``, the Responses
    API) wants a request written.

    :ivar name: the dialect's name (``dialect =`` in the settings).
    :ivar reasoning: the reasoning sent back on assistant messages:
        ``reasoning_content``, ``thought_signatures`` (per tool call, in
        ``extra_content.google``), ``reasoning_details`` or ``none``.
    :ivar reasoning_on_every_tool_call: ``reasoning_content`` goes on every
        assistant message with tool calls, ``""`` where the relay has none of
        this upstream's (another upstream's turn, a dropped block).
    :ivar images: takes image parts (vision); an image to one that does not
        is refused (``capability_rejected: image_block``).
    :ivar stream_usage: takes ``stream_options: {"include_usage": true}``
        (without it a stream reports no usage).
    :ivar max_tokens_field: ``max_tokens`` or ``max_completion_tokens``.
    :ivar effort_field: where the reasoning effort goes: ``reasoning_effort``,
        ``reasoning`` (OpenRouter's ``{"effort": ...}``) or ``None`` (the
        model's own default; the request's effort is not sent).
    :ivar efforts: Anthropic's effort (:data:`EFFORTS`) -> the dialect's value;
        a level it lacks is not sent.
    :ivar sampling_with_effort: takes ``temperature`` and ``top_p`` beside a
        reasoning effort other than ``none`` (OpenAI's reasoning models do not).
    :ivar prompt_cache_key: takes ``prompt_cache_key``.
    :ivar user_field: the field for the end user's digest (``metadata.user_id``):
        ``safety_identifier``, ``user`` or ``None``.
    :ivar parallel_tool_calls: takes ``parallel_tool_calls``.
    :ivar json_schema: takes ``response_format`` of type ``json_schema``.
    :ivar stop: takes ``stop`` (at most four sequences).
    :ivar id_pattern: the tool-call ids it takes (a regular expression for the
        relay's id core, :class:`~twisted_relay.translation.UpstreamRules`);
        ``None``: the relay's default.
    :ivar own_ids: the ids it makes and must get back unchanged (the id
        core's ``original`` policy), or ``None``.
    :ivar refused: fields never sent, at the top of the body or on a message
        (the dialect refuses them, or refuses every field it does not know).
    :ivar schema_fields: the JSON Schema keywords its function parameters
        take (:func:`~twisted_relay.openai.request_parts.schema_within`);
        ``None``: any.
    """

    name: str
    reasoning: str = NO_REASONING
    reasoning_on_every_tool_call: bool = False
    images: bool = True
    stream_usage: bool = True
    max_tokens_field: str = "max_tokens"
    effort_field: str | None = None
    efforts: tuple[tuple[str, str], ...] = ()
    sampling_with_effort: bool = True
    prompt_cache_key: bool = False
    user_field: str | None = None
    parallel_tool_calls: bool = False
    json_schema: bool = True
    stop: bool = True
    id_pattern: str | None = None
    own_ids: str | None = None
    refused: frozenset = field(default_factory=frozenset)
    schema_fields: frozenset | None = None

    def effort(self, anthropic_effort: str | None) -> str | None:
        """The dialect's value for ``anthropic_effort``, or ``None`` (not sent)."""
        if anthropic_effort is None or self.effort_field is None:
            return None
        return dict(self.efforts).get(anthropic_effort)

    def without_refused(self, value: dict[str, Any]) -> dict[str, Any]:
        """``value`` (a body or a message) without the fields this dialect refuses."""
        if not self.refused or self.refused.isdisjoint(value):
            return value
        return {name: item for name, item in value.items() if name not in self.refused}


_OPENAI_EFFORTS = tuple((level, level) for level in EFFORTS)

DIALECTS: dict[str, Dialect] = {
    dialect.name: dialect
    for dialect in (
        # GPT through Chat Completions (and the Responses API's ids and vision).
        Dialect(
            "openai",
            max_tokens_field="max_completion_tokens",
            effort_field="reasoning_effort",
            efforts=_OPENAI_EFFORTS,
            sampling_with_effort=False,
            prompt_cache_key=True,
            user_field="safety_identifier",
            parallel_tool_calls=True,
            id_pattern=RESPONSES_ID_PATTERN,
        ),
        # DeepSeek V4: reasoning_content back on every tool-call turn; no images;
        # effort low/high/max (api-docs.deepseek.com, thinking mode).
        Dialect(
            "deepseek",
            reasoning=REASONING_CONTENT,
            reasoning_on_every_tool_call=True,
            images=False,
            effort_field="reasoning_effort",
            efforts=(("low", "low"), ("medium", "high"), ("high", "high"), ("xhigh", "high"), ("max", "max")),
            json_schema=False,
        ),
        # Kimi K2.x: reasoning_content on every assistant tool-call message; its
        # ids (functions.<name>:<n>) must come back as it made them.
        Dialect(
            "kimi",
            reasoning=REASONING_CONTENT,
            reasoning_on_every_tool_call=True,
            json_schema=False,
            own_ids=r"functions\.[A-Za-z0-9_.-]+:[0-9]+",
        ),
        # GLM (Z.ai): interleaved thinking kept when sent back.
        Dialect("glm", reasoning=REASONING_CONTENT, images=False, json_schema=False),
        # Gemini through its OpenAI-compatible endpoint: thought signatures per call.
        Dialect(
            "gemini",
            reasoning=THOUGHT_SIGNATURES,
            effort_field="reasoning_effort",
            efforts=(("low", "low"), ("medium", "high"), ("high", "high"), ("xhigh", "high"), ("max", "high")),
            schema_fields=GEMINI_SCHEMA_FIELDS,
        ),
        # Groq: strict unknown-field validation, no reasoning field on messages.
        Dialect(
            "groq",
            max_tokens_field="max_completion_tokens",
            user_field="user",
            parallel_tool_calls=True,
            refused=frozenset({
                "reasoning_content", "reasoning", "reasoning_details", "extra_content",
                "store", "prompt_cache_key", "metadata", "safety_identifier",
            }),
        ),
        # Mistral: nine-character ids; unknown fields refused (422).
        Dialect(
            "mistral",
            stream_usage=False,
            parallel_tool_calls=True,
            id_pattern=MISTRAL_ID_PATTERN,
            refused=frozenset({
                "reasoning_content", "reasoning", "reasoning_details", "extra_content", "stream_options",
                "prompt_cache_key", "reasoning_effort", "user", "safety_identifier", "metadata", "store",
            }),
        ),
        # OpenRouter (non-Anthropic models): reasoning_details back unmodified.
        Dialect(
            "openrouter",
            reasoning=REASONING_DETAILS,
            effort_field="reasoning",
            efforts=(("none", "none"), ("low", "low"), ("medium", "medium"), ("high", "high"),
                     ("xhigh", "xhigh"), ("max", "xhigh")),
            user_field="user",
            parallel_tool_calls=True,
        ),
        # xAI: no reasoning on Chat (encrypted reasoning only on Responses); its
        # reasoning models take no stop sequences.
        Dialect("xai", parallel_tool_calls=True, stop=False),
    )
}


def dialect_of(name: str) -> Dialect:
    """
    The dialect called ``name``.

    :raises ValueError: for a name :data:`DIALECTS` does not hold.
    """
    try:
        return DIALECTS[name]
    except KeyError:
        raise ValueError("unknown dialect %r; expected one of %s" % (name, ", ".join(sorted(DIALECTS)))) from None
