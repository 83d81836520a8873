# -*- test-case-name: tests.test_openai_requests -*-
"""
What both request translations (:mod:`~twisted_relay.openai.responses_request`,
:mod:`~twisted_relay.openai.chat_request`) read of an Anthropic Messages
request the same way: the system text without Claude Code's per-request
attribution line, the reasoning effort asked for, the conversation's cache
key, the end user's digest, tools, images and documents, tool results, and
the reasoning of a thinking block this upstream made.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterator

from twisted_relay.openai.capabilities import (
    DOCUMENT_BLOCK,
    IMAGE_BLOCK,
    CapabilityRejected,
    tool_type,
)
from twisted_relay.openai.context import TranslateContext
from twisted_relay.openai.envelope import open_envelope

__all__ = [
    "ATTRIBUTION_LINE",
    "TOOL_ERROR_PREFIX",
    "WEB_SEARCH_TYPES",
    "arguments_of",
    "cache_key_of",
    "content_blocks",
    "document_source",
    "image_url",
    "opened_reasoning",
    "requested_effort",
    "schema_within",
    "system_text",
    "tool_parameters",
    "tool_result_parts",
    "user_digest",
]

#: The start of Claude Code's attribution line (the first system block):
#: ``x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=...;``.
#: Its ``cch`` changes with every request, so it is left out of what these
#: upstreams get: their caches match exact prefixes (ccproxy-api #61).
ATTRIBUTION_LINE = "x-anthropic-billing-header:"

#: What a failed tool result's output begins with: neither protocol has an
#: ``is_error`` field, and a failure must not read as a success (sub2api PR #6923).
TOOL_ERROR_PREFIX = "[tool error] "

#: Anthropic's web search tool types (a server tool the Responses API has).
WEB_SEARCH_TYPES = ("web_search_20250305", "web_search_20260209")

#: A thinking budget -> the effort of the same order (the budget below each bound).
_BUDGET_EFFORTS = ((4096, "low"), (16384, "medium"), (32000, "high"), (64000, "xhigh"))


def content_blocks(content: Any) -> list[dict]:
    """A message's ``content`` as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [block for block in content if isinstance(block, dict)]
    return []


def system_text(body: dict) -> str | None:
    """
    The request's system prompt as one text: its blocks' texts joined by a
    blank line, every line of Claude Code's attribution
    (:data:`ATTRIBUTION_LINE`) left out; ``None`` when nothing is left.
    """
    texts = []
    for block in content_blocks(body.get("system")):
        text = block.get("text")
        if not isinstance(text, str):
            continue
        if ATTRIBUTION_LINE in text:
            text = "\n".join(line for line in text.split("\n") if not line.startswith(ATTRIBUTION_LINE)).strip("\n")
        if text:
            texts.append(text)
    return "\n\n".join(texts) if texts else None


def requested_effort(body: dict) -> str | None:
    """
    The reasoning effort the request asks for, as Anthropic names it
    (:data:`~twisted_relay.openai.dialects.EFFORTS`), or ``None`` (the
    upstream's default): thinking disabled is ``none``; ``output_config.effort``
    as it is (adaptive thinking, or none said); a thinking budget the effort
    of its order (below 4,096 tokens ``low``, 16,384 ``medium``, 32,000
    ``high``, 64,000 ``xhigh``, else ``max``: Claude Code's default 31,999 is
    ``high``).
    """
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return "none"
    config = body.get("output_config")
    effort = config.get("effort") if isinstance(config, dict) else None
    if isinstance(effort, str) and effort in ("low", "medium", "high", "xhigh", "max"):
        return effort
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, int) and not isinstance(budget, bool):
            for bound, level in _BUDGET_EFFORTS:
                if budget < bound:
                    return level
            return "max"
    return None


def cache_key_of(ctx: TranslateContext) -> str | None:
    """
    The conversation's ``prompt_cache_key``: a digest of Claude Code's
    session id (``x-claude-code-session-id``), the same for every request of
    the session (a random key per request never hits, ccproxy-api #61);
    ``None`` without a session.
    """
    if not ctx.session:
        return None
    return "trs-" + hashlib.sha256(("twisted-relay session " + ctx.session).encode("utf-8")).hexdigest()[:40]


def user_digest(body: dict) -> str | None:
    """A digest (32 hex) of ``metadata.user_id`` for the upstream's end-user field, or ``None``."""
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(user, str) or not user:
        return None
    return hashlib.sha256(("twisted-relay user " + user).encode("utf-8")).hexdigest()[:32]


def arguments_of(tool_input: Any) -> str:
    """A ``tool_use``'s input as the function call's ``arguments``: compact JSON, the same bytes each time."""
    return json.dumps({} if tool_input is None else tool_input, ensure_ascii=False, separators=(",", ":"))


def tool_parameters(schema: Any, fields: frozenset | None = None) -> dict:
    """
    A tool's ``input_schema`` as a function's ``parameters``: an object
    schema (``type`` and ``properties`` added where missing), without
    ``$schema``; with ``fields`` (a dialect's :attr:`~.dialects.Dialect.schema_fields`)
    written in those alone (:func:`schema_within`).
    """
    parameters = dict(schema) if isinstance(schema, dict) else {}
    parameters.pop("$schema", None)
    if fields is not None:
        parameters = schema_within(parameters, fields)
    parameters.setdefault("type", "object")
    if parameters["type"] == "object":
        parameters.setdefault("properties", {})
    return parameters


# The formats Gemini's Schema takes (others are refused): numbers', integers' and strings'.
_SCHEMA_FORMATS = frozenset({"float", "double", "int32", "int64", "enum", "date-time"})


def schema_within(schema: dict, fields: frozenset) -> dict:
    """
    A JSON Schema written in ``fields`` alone, at every level (``properties``'
    values, ``items``, ``anyOf``), for an upstream whose function parameters
    are a subset of OpenAPI 3.0 (Gemini's ``Schema``): an exclusive bound as
    an inclusive one (an integer's moved by one, a number's kept: the client
    checks the tool's input anyway), ``const`` as a one-value ``enum``,
    ``oneOf`` as ``anyOf``, a list of types as one type (``nullable`` for
    ``"null"``) or an ``anyOf`` of them; other keywords
    (``additionalProperties``, ``$ref``...) and formats it lacks left out.
    """
    kept: dict[str, Any] = {}
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [item for item in kind if item != "null"]
        if "null" in kind:
            kept["nullable"] = True
        if len(kinds) == 1:
            kind = kinds[0]
        else:
            kind = None
            kept["anyOf"] = [{"type": item} for item in kinds]
    if kind is not None:
        kept["type"] = kind
    for bound, inclusive, step in (("exclusiveMinimum", "minimum", 1), ("exclusiveMaximum", "maximum", -1)):
        value = schema.get(bound)
        if type(value) in (int, float) and inclusive not in schema:
            kept[inclusive] = value + step if kind == "integer" else value
    if isinstance(schema.get("const"), str) and "enum" not in schema:
        kept["enum"] = [schema["const"]]
    for name, value in schema.items():
        if name == "oneOf" and "anyOf" not in schema:
            name = "anyOf"
        if name not in fields or name in kept or name == "type" or (name == "format" and value not in _SCHEMA_FORMATS):
            continue
        if name == "properties" and isinstance(value, dict):
            value = {key: schema_within(item, fields) if isinstance(item, dict) else item
                     for key, item in value.items()}
        elif name == "items" and isinstance(value, dict):
            value = schema_within(value, fields)
        elif name == "anyOf" and isinstance(value, list):
            value = [schema_within(item, fields) if isinstance(item, dict) else item for item in value]
        kept[name] = value
    return kept


def function_tools(body: dict, web_search: bool) -> Iterator[tuple[str, dict]]:
    """
    The request's tools as ``("function", tool)`` or, when ``web_search``,
    ``("web_search", tool)``.

    :raises CapabilityRejected: for a server tool without a counterpart
        (``tool_type:<type>``).
    """
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else ():
        if not isinstance(tool, dict):
            continue
        kind = tool.get("type")
        if kind in (None, "custom"):
            yield "function", tool
        elif web_search and kind in WEB_SEARCH_TYPES:
            yield "web_search", tool
        else:
            raise CapabilityRejected(
                tool_type(str(kind)), "this upstream has no counterpart of the %s tool" % (kind,))


def image_url(block: dict, takes_images: bool) -> str:
    """
    An ``image`` block's source as an image URL (a ``data:`` URL for base64).

    :raises CapabilityRejected: ``image_block`` when the upstream takes no
        images, or for a source it cannot reach (a Files API id).
    """
    if not takes_images:
        raise CapabilityRejected(IMAGE_BLOCK, "this upstream takes no images")
    source = block.get("source")
    source = source if isinstance(source, dict) else {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        return "data:%s;base64,%s" % (source.get("media_type") or "image/png", source["data"])
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise CapabilityRejected(IMAGE_BLOCK, "an image whose source is %r cannot be sent to this upstream"
                             % (source.get("type"),))


def document_source(block: dict) -> tuple[str, str]:
    """
    A ``document`` block as ``("text", text)`` (a plain-text or content
    source), ``("data", data URL)`` (base64) or ``("url", url)``.

    :raises CapabilityRejected: ``document_block`` for a source no upstream
        of these protocols can reach (a Files API id).
    """
    source = block.get("source")
    source = source if isinstance(source, dict) else {}
    kind = source.get("type")
    if kind == "text" and isinstance(source.get("data"), str):
        return "text", source["data"]
    if kind == "content":
        texts = [part.get("text") for part in content_blocks(source.get("content"))]
        return "text", "\n".join(text for text in texts if isinstance(text, str))
    if kind == "base64" and isinstance(source.get("data"), str):
        return "data", "data:%s;base64,%s" % (source.get("media_type") or "application/pdf", source["data"])
    if kind == "url" and isinstance(source.get("url"), str):
        return "url", source["url"]
    raise CapabilityRejected(DOCUMENT_BLOCK, "a document whose source is %r cannot be sent to this upstream"
                             % (kind,))


def tool_result_parts(block: dict) -> list[tuple[str, Any]]:
    """
    A ``tool_result``'s content as parts: ``("text", str)``, ``("image",
    block)``, ``("document", block)``; a failed result's first text begins
    with :data:`TOOL_ERROR_PREFIX` (a text part is added when it has none).
    """
    parts: list[tuple[str, Any]] = []
    for item in content_blocks(block.get("content")):
        kind = item.get("type")
        if kind == "text" and isinstance(item.get("text"), str):
            parts.append(("text", item["text"]))
        elif kind in ("image", "document"):
            parts.append((kind, item))
        elif kind == "tool_reference":
            parts.append(("text", "[Loaded tool: %s]" % (item.get("tool_name") or item.get("name") or "",)))
        elif kind == "search_result":
            texts = [part.get("text") for part in content_blocks(item.get("content"))]
            parts.append(("text", "\n".join([str(item.get("title") or ""), str(item.get("source") or "")]
                                            + [text for text in texts if isinstance(text, str)])))
        else:
            parts.append(("text", json.dumps(item, ensure_ascii=False, separators=(",", ":"))))
    if block.get("is_error") is True:
        if parts and parts[0][0] == "text":
            parts[0] = ("text", TOOL_ERROR_PREFIX + parts[0][1])
        else:
            parts.insert(0, ("text", TOOL_ERROR_PREFIX.rstrip()))
    return parts


def opened_reasoning(block: dict, ctx: TranslateContext, kind: str) -> dict | None:
    """
    The reasoning a ``thinking`` (``signature``) or ``redacted_thinking``
    (``data``) block carries for this upstream and account: the envelope's
    payload when it opens (:func:`~twisted_relay.openai.envelope.open_envelope`)
    and is of ``kind`` (``responses`` or ``chat``); ``None`` for any other
    block: Anthropic's own thinking, another upstream's or account's, a
    damaged envelope. Such a block is dropped, never sent.
    """
    field = {"thinking": "signature", "redacted_thinking": "data"}.get(block.get("type"))
    if field is None:
        return None
    payload = open_envelope(block.get(field), ctx.upstream, ctx.account)
    if not isinstance(payload, dict) or payload.get("kind") != kind:
        return None
    return payload
