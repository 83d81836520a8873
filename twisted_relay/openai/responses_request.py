# -*- test-case-name: tests.test_openai_requests -*-
"""
An Anthropic Messages request as a stateless OpenAI Responses request
(issue 33; docs/openai.md, "Requests").

Stateless as OpenAI's own Codex client is: ``store: false``,
``include: ["reasoning.encrypted_content"]``, and every earlier item sent
again, without item ids (an ``rs_`` id under ``store: false`` is a 404).
The reasoning this upstream made travels in thinking blocks' signatures
(:mod:`~twisted_relay.openai.envelope`): each such block becomes its
reasoning items again, as OpenAI sent them, where the block was; every
other thinking block is dropped.

The prefix stays the same from turn to turn, for OpenAI's prefix cache:
the instructions leave out Claude Code's per-request attribution line, the
items of earlier turns are written the same way each time, and the
``prompt_cache_key`` is a digest of the session.
"""

from __future__ import annotations

from typing import Any

from twisted_relay.openai.capabilities import STOP_SEQUENCES, CapabilityRejected, tool_type
from twisted_relay.openai.context import TranslateContext
from twisted_relay.openai.dialects import dialect_of
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

__all__ = ["MIN_OUTPUT_TOKENS", "to_responses"]

#: The least ``max_output_tokens`` the Responses API takes.
MIN_OUTPUT_TOKENS = 16


def to_responses(body: dict, ctx: TranslateContext) -> dict:
    """
    The Responses request for the Messages request ``body``.

    :param ctx: the attempt: the upstream and account whose reasoning goes
        back, the model, the session (the cache key).
    :raises CapabilityRejected: for what the Responses API cannot carry:
        ``stop_sequences``, a server tool other than web search
        (``tool_type:<type>``), an image or document it cannot reach.
    """
    dialect = dialect_of(ctx.dialect)
    stop = body.get("stop_sequences")
    if stop:
        raise CapabilityRejected(STOP_SEQUENCES, "the Responses API has no stop sequences")
    request: dict[str, Any] = {"model": ctx.model}
    instructions = system_text(body)
    if instructions is not None:
        request["instructions"] = instructions
    request["input"] = _input_items(body.get("messages"), ctx, dialect.images)
    tools = [_tool(kind, tool) for kind, tool in function_tools(body, web_search=True)]
    if tools:
        request["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        mapped = _tool_choice(choice, tools)
        if mapped is not None:
            request["tool_choice"] = mapped
        if choice.get("disable_parallel_tool_use") is True:
            request["parallel_tool_calls"] = False
    effort = requested_effort(body)
    if effort is not None:
        request["reasoning"] = {"effort": effort} if effort == "none" else {"effort": effort, "summary": "auto"}
    else:
        # The model's default effort: ask for summaries, so that thinking shows.
        request["reasoning"] = {"summary": "auto"}
    if effort == "none":
        for name in ("temperature", "top_p"):
            if isinstance(body.get(name), (int, float)) and not isinstance(body.get(name), bool):
                request[name] = body[name]
    request["include"] = ["reasoning.encrypted_content"]
    request["store"] = False
    request["stream"] = body.get("stream") is True
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        request["max_output_tokens"] = max(MIN_OUTPUT_TOKENS, max_tokens)
    text_format = _text_format(body.get("output_config"))
    if text_format is not None:
        request["text"] = {"format": text_format}
    cache_key = cache_key_of(ctx)
    if cache_key is not None:
        request["prompt_cache_key"] = cache_key
    user = user_digest(body)
    if user is not None:
        request["safety_identifier"] = user
    return request


def _tool(kind: str, tool: dict) -> dict:
    if kind == "web_search":
        search: dict[str, Any] = {"type": "web_search"}
        if isinstance(tool.get("allowed_domains"), list):
            search["filters"] = {"allowed_domains": tool["allowed_domains"]}
        location = tool.get("user_location")
        if isinstance(location, dict):
            search["user_location"] = dict(location, type="approximate")
        return search
    function: dict[str, Any] = {"type": "function", "name": tool.get("name")}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    # strict is true by default, and then every property becomes required.
    function["parameters"] = tool_parameters(tool.get("input_schema"))
    function["strict"] = False
    return function


def _tool_choice(choice: dict, tools: list[dict]) -> Any:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        name = choice.get("name")
        if any(tool["type"] == "web_search" for tool in tools) and not any(
                tool.get("name") == name for tool in tools):
            return {"type": "web_search"}
        return {"type": "function", "name": name}
    return None


def _text_format(config: Any) -> dict | None:
    fmt = config.get("format") if isinstance(config, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return None
    return {"type": "json_schema", "name": "output", "schema": fmt.get("schema") or {}, "strict": False}


def _input_items(messages: Any, ctx: TranslateContext, images: bool) -> list[dict]:
    items: list[dict] = []
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        blocks = content_blocks(message.get("content"))
        if role == "assistant":
            _assistant_items(blocks, ctx, items)
        else:
            _user_items(blocks, "system" if role == "system" else "user", images, items)
    return items


def _user_items(blocks: list[dict], role: str, images: bool, items: list[dict]) -> None:
    """A user (or mid-conversation system) message: its tool results as
    ``function_call_output`` items, the rest as messages, in their order."""
    parts: list[dict] = []

    def flush() -> None:
        if parts:
            items.append({"type": "message", "role": role, "content": list(parts)})
            parts.clear()

    for block in blocks:
        kind = block.get("type")
        if kind == "tool_result":
            flush()
            items.append({"type": "function_call_output", "call_id": block.get("tool_use_id"),
                          "output": _output(block, images)})
        else:
            part = _input_part(block, images)
            if part is not None:
                parts.append(part)
    flush()


def _input_part(block: dict, images: bool) -> dict | None:
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        return {"type": "input_text", "text": text} if isinstance(text, str) and text else None
    if kind == "image":
        return {"type": "input_image", "image_url": image_url(block, images), "detail": "auto"}
    if kind == "document":
        return _file_part(block)
    if kind in ("thinking", "redacted_thinking"):
        return None
    raise CapabilityRejected("%s_block" % (kind,), "a %s block cannot be sent to the Responses API" % (kind,))


def _file_part(block: dict) -> dict:
    form, value = document_source(block)
    if form == "text":
        return {"type": "input_text", "text": value}
    if form == "url":
        return {"type": "input_file", "file_url": value}
    title = block.get("title")
    return {"type": "input_file", "filename": title if isinstance(title, str) and title else "document.pdf",
            "file_data": value}


def _output(block: dict, images: bool) -> Any:
    """A tool result's output: a string, or an array when it holds images or files."""
    parts = tool_result_parts(block)
    if all(kind == "text" for kind, _ in parts):
        return "\n".join(value for _, value in parts)
    output = []
    for kind, value in parts:
        if kind == "text":
            output.append({"type": "input_text", "text": value})
        elif kind == "image":
            output.append({"type": "input_image", "image_url": image_url(value, images), "detail": "auto"})
        else:
            output.append(_file_part(value))
    return output


def _assistant_items(blocks: list[dict], ctx: TranslateContext, items: list[dict]) -> None:
    """
    An assistant message: its text as messages (a string each, as the SDK's
    ``EasyInputMessage``), tool uses as function
    calls, the reasoning of this upstream's thinking blocks where the blocks
    were; a reasoning item left with no item after it in the message is not
    sent (the API refuses one without its following item).
    """
    texts: list[str] = []
    pending: list[dict] = []

    def emit(item: dict) -> None:
        items.extend(pending)
        pending.clear()
        items.append(item)

    def flush() -> None:
        if texts:
            emit({"type": "message", "role": "assistant", "content": "".join(texts)})
            texts.clear()

    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            if isinstance(block.get("text"), str) and block["text"]:
                texts.append(block["text"])
        elif kind == "tool_use":
            flush()
            emit({"type": "function_call", "call_id": block.get("id"), "name": block.get("name"),
                  "arguments": arguments_of(block.get("input"))})
        elif kind in ("thinking", "redacted_thinking"):
            flush()
            payload = opened_reasoning(block, ctx, "responses")
            pending.extend(_reasoning_items(payload))
        elif kind == "server_tool_use":
            if block.get("name") != "web_search":
                raise CapabilityRejected(tool_type(str(block.get("name"))),
                                         "the Responses API has no %s tool" % (block.get("name"),))
            flush()
            query = block.get("input", {}).get("query") if isinstance(block.get("input"), dict) else None
            emit({"type": "web_search_call", "status": "completed",
                  "action": {"type": "search", "query": query if isinstance(query, str) else ""}})
        elif kind == "web_search_tool_result":
            # The search's results are the upstream's own, held by its web_search_call.
            continue
        else:
            raise CapabilityRejected("%s_block" % (kind,), "a %s block cannot be sent to the Responses API" % (kind,))
    flush()


def _reasoning_items(payload: dict | None) -> list[dict]:
    """The reasoning items of an opened envelope, as OpenAI sent them (without an id)."""
    if payload is None:
        return []
    found = []
    for item in payload.get("items") or ():
        if not isinstance(item, dict) or item.get("type") != "reasoning":
            continue
        if "id" in item or "summary" not in item:
            item = {key: value for key, value in item.items() if key != "id"}
            item.setdefault("summary", [])
        found.append(item)
    return found
