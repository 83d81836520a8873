# -*- test-case-name: tests.test_openai_requests -*-
"""
An Anthropic Messages request as a Chat Completions request, in the
dialect of the upstream (:mod:`~twisted_relay.openai.dialects`; docs/openai.md,
"Requests" and "Dialects").

Messages: the system prompt (without Claude Code's per-request attribution
line) first; a user message's tool results as ``role: "tool"`` messages
right after the assistant message that called them, then its text and
images (and the images of its tool results, which a tool message cannot
hold: claude-code-proxy PR #59) as one user message; an assistant message
with its text, its ``tool_calls`` and the reasoning the dialect takes back,
opened from this upstream's envelopes in its thinking blocks.
"""

from __future__ import annotations

from typing import Any

from twisted_relay.openai.capabilities import (
    DOCUMENT_BLOCK,
    STOP_SEQUENCES,
    STRUCTURED_OUTPUTS,
    CapabilityRejected,
    tool_type,
)
from twisted_relay.openai.context import TranslateContext
from twisted_relay.openai.dialects import (
    GEMINI_SKIP_SIGNATURE,
    REASONING_CONTENT,
    REASONING_DETAILS,
    THOUGHT_SIGNATURES,
    Dialect,
    dialect_of,
)
from twisted_relay.openai.request_parts import (
    arguments_of,
    cache_key_of,
    content_blocks,
    document_source,
    function_tools,
    image_url,
    opened_reasoning,
    requested_effort,
    system_text,
    tool_parameters,
    tool_result_parts,
    user_digest,
)

__all__ = ["MAX_STOP_SEQUENCES", "to_chat"]

#: The most stop sequences Chat Completions takes.
MAX_STOP_SEQUENCES = 4


def to_chat(body: dict, ctx: TranslateContext) -> dict:
    """
    The Chat Completions request for the Messages request ``body``, in the
    dialect ``ctx.dialect``.

    :raises CapabilityRejected: for what this dialect cannot carry: a PDF
        (``document_block``), an image without vision (``image_block``), a
        server tool (``tool_type:<type>``), JSON-schema output
        (``structured_outputs_unsupported``), stop sequences it does not take.
    """
    dialect = dialect_of(ctx.dialect)
    messages: list[dict] = []
    system = system_text(body)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for message in body.get("messages") if isinstance(body.get("messages"), list) else ():
        if not isinstance(message, dict):
            continue
        blocks = content_blocks(message.get("content"))
        if message.get("role") == "assistant":
            assistant = _assistant_message(blocks, ctx, dialect)
            if assistant is not None:
                messages.append(assistant)
        else:
            _user_messages(blocks, "system" if message.get("role") == "system" else "user", dialect, messages)
    request: dict[str, Any] = {"model": ctx.model, "messages": [dialect.without_refused(m) for m in messages]}
    tools = [_tool(tool, dialect) for _, tool in function_tools(body, web_search=False)]
    if tools:
        request["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        mapped = _tool_choice(choice)
        if mapped is not None:
            request["tool_choice"] = mapped
        if choice.get("disable_parallel_tool_use") is True and dialect.parallel_tool_calls and tools:
            request["parallel_tool_calls"] = False
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        request[dialect.max_tokens_field] = max_tokens
    effort = dialect.effort(requested_effort(body))
    if effort is not None:
        request[dialect.effort_field] = {"effort": effort} if dialect.effort_field == "reasoning" else effort
    if dialect.sampling_with_effort or effort == "none":
        for name in ("temperature", "top_p"):
            if isinstance(body.get(name), (int, float)) and not isinstance(body.get(name), bool):
                request[name] = body[name]
    stop = body.get("stop_sequences")
    if stop:
        if not dialect.stop or not isinstance(stop, list) or len(stop) > MAX_STOP_SEQUENCES:
            raise CapabilityRejected(STOP_SEQUENCES, "this upstream takes at most %d stop sequences"
                                     % (MAX_STOP_SEQUENCES if dialect.stop else 0,))
        request["stop"] = list(stop)
    response_format = _response_format(body.get("output_config"), dialect)
    if response_format is not None:
        request["response_format"] = response_format
    if body.get("stream") is True:
        request["stream"] = True
        if dialect.stream_usage:
            request["stream_options"] = {"include_usage": True}
    cache_key = cache_key_of(ctx)
    if cache_key is not None and dialect.prompt_cache_key:
        request["prompt_cache_key"] = cache_key
    user = user_digest(body)
    if user is not None and dialect.user_field is not None:
        request[dialect.user_field] = user
    return dialect.without_refused(request)


def _tool(tool: dict, dialect: Dialect) -> dict:
    function: dict[str, Any] = {"name": tool.get("name")}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    function["parameters"] = tool_parameters(tool.get("input_schema"), dialect.schema_fields)
    return {"type": "function", "function": function}


def _tool_choice(choice: dict) -> Any:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return None


def _response_format(config: Any, dialect: Dialect) -> dict | None:
    fmt = config.get("format") if isinstance(config, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return None
    if not dialect.json_schema:
        raise CapabilityRejected(STRUCTURED_OUTPUTS, "the %s dialect takes no JSON schema for its output"
                                 % (dialect.name,))
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema") or {},
                                                   "strict": False}}


def _text_of(block: dict) -> str | None:
    """The text a text block, or a plain-text document, stands for; ``None`` for any other block."""
    kind = block.get("type")
    if kind == "text":
        return block.get("text") if isinstance(block.get("text"), str) else None
    if kind == "document":
        form, value = document_source(block)
        if form != "text":
            raise CapabilityRejected(DOCUMENT_BLOCK, "Chat Completions upstreams take no PDF documents")
        return value
    return None


def _user_messages(blocks: list[dict], role: str, dialect: Dialect, messages: list[dict]) -> None:
    """
    A user message: its tool results as tool messages (first: they answer
    the assistant message before), then one message with its text, its
    images and its tool results' images, labelled with their call.
    """
    parts: list[dict] = []
    result_images: list[dict] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "tool_result":
            texts, images = _tool_result(block, dialect)
            messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": texts})
            if images:
                result_images.append({"type": "text", "text": "[images of tool result %s]" % (block.get("tool_use_id"),)})
                result_images.extend(images)
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": image_url(block, dialect.images)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            text = _text_of(block)
            if text is None:
                raise CapabilityRejected("%s_block" % (kind,), "a %s block cannot be sent to Chat Completions" % (kind,))
            if text:
                parts.append({"type": "text", "text": text})
    parts = result_images + parts
    if not parts:
        return
    if all(part["type"] == "text" for part in parts):
        messages.append({"role": role, "content": "\n\n".join(part["text"] for part in parts)})
    else:
        messages.append({"role": role, "content": parts})


def _tool_result(block: dict, dialect: Dialect) -> tuple[str, list[dict]]:
    """A tool result's text (a tool message's content) and its images."""
    texts = []
    images = []
    for kind, value in tool_result_parts(block):
        if kind == "text":
            texts.append(value)
        elif kind == "image":
            images.append({"type": "image_url", "image_url": {"url": image_url(value, dialect.images)}})
        else:
            texts.append(_text_of(value) or "")
    return "\n".join(texts), images


def _assistant_message(blocks: list[dict], ctx: TranslateContext, dialect: Dialect) -> dict | None:
    """An assistant message in the dialect; ``None`` when nothing of it is left to send."""
    texts: list[str] = []
    calls: list[dict] = []
    payloads: list[dict] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            if isinstance(block.get("text"), str):
                texts.append(block["text"])
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": arguments_of(block.get("input"))}})
        elif kind in ("thinking", "redacted_thinking"):
            payload = opened_reasoning(block, ctx, "chat")
            if payload is not None:
                payloads.append(payload)
        elif kind == "server_tool_use":
            if block.get("name") != "web_search":
                raise CapabilityRejected(tool_type(str(block.get("name"))),
                                         "Chat Completions has no %s tool" % (block.get("name"),))
            query = block.get("input", {}).get("query") if isinstance(block.get("input"), dict) else None
            texts.append("[web search: %s]\n" % (query,))
        elif kind == "web_search_tool_result":
            continue
        else:
            raise CapabilityRejected("%s_block" % (kind,), "a %s block cannot be sent to Chat Completions" % (kind,))
    if not texts and not calls:
        return None
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    if dialect.reasoning == REASONING_CONTENT:
        reasoning = "".join(p["reasoning_content"] for p in payloads if isinstance(p.get("reasoning_content"), str))
        if reasoning or (calls and dialect.reasoning_on_every_tool_call):
            message["reasoning_content"] = reasoning
    elif dialect.reasoning == REASONING_DETAILS:
        details = [d for p in payloads if isinstance(p.get("reasoning_details"), list) for d in p["reasoning_details"]]
        if details:
            message["reasoning_details"] = _details_for(details, calls)
    elif dialect.reasoning == THOUGHT_SIGNATURES and calls:
        _sign_calls(calls, payloads)
    return message


def _details_for(details: list, calls: list[dict]) -> list:
    """
    OpenRouter's ``reasoning_details`` as they came, but for an encrypted
    entry's ``id``, which must name a tool call of its message (Roo-Code PR
    #10310): the relay may have renamed that call since (a repeated id made
    unique, an id fitted to the upstream), so an ``id`` naming none of them
    names the first.
    """
    ids = {call.get("id") for call in calls}
    if not calls or all(not isinstance(d, dict) or d.get("id") is None or d.get("id") in ids for d in details):
        return details
    first = calls[0].get("id")
    return [dict(d, id=first) if isinstance(d, dict) and d.get("id") is not None and d.get("id") not in ids else d
            for d in details]


def _sign_calls(calls: list[dict], payloads: list[dict]) -> None:
    """
    Gemini's thought signatures on a step's tool calls: each call the
    upstream signed gets its signature back (by its id, else the step's
    unclaimed signature goes to the first call, the one Gemini signs); a
    first call without one gets the documented dummy
    (:data:`~twisted_relay.openai.dialects.GEMINI_SKIP_SIGNATURE`), as a
    call of another model's history. Every step gets the same each time,
    whether or not it is in the current turn: the prefix stays the same.
    """
    signatures: dict[str, str] = {}
    for payload in payloads:
        found = payload.get("thought_signatures")
        if isinstance(found, dict):
            signatures.update((k, v) for k, v in found.items() if isinstance(v, str))
    unclaimed = [sig for key, sig in signatures.items() if not any(call["id"] == key for call in calls)]
    for index, call in enumerate(calls):
        signature = signatures.get(call["id"]) if isinstance(call["id"], str) else None
        if signature is None and index == 0:
            signature = unclaimed[0] if unclaimed else GEMINI_SKIP_SIGNATURE
        if signature is not None:
            call["extra_content"] = {"google": {"thought_signature": signature}}
