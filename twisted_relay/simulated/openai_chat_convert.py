# -*- test-case-name: tests.test_simulated_openai_chat -*-
"""
The simulated Chat Completions upstream's own converters, both ways, between
a Chat request and the fake model's Anthropic Messages request, and between
the fake model's answer and a chat completion (whole, or as its stream's
chunks).  They are the simulator's, not the relay's ``openai/``
translators: a test of the relay against the simulator must not be the
translator checked against itself.  Pure: no Twisted.

Ids: the fake model reads the history's tool call ids as they were sent,
so the ids it copies come out as they went in; the ids it makes fresh
(``toolu_01X``) take the dialect's shape (:func:`dialect_id`).  Usage:
:func:`chat_usage` (what the dialect reports) and :func:`metered` (the same in
Anthropic's terms: what a relay's ledger should hold).
"""

from __future__ import annotations

import hashlib
import random
import uuid
from typing import Any

import ujson

from twisted_relay._json import to_json
from twisted_relay.simulated.openai_chat_dialects import Dialect, stream_error
from twisted_relay.simulated.openai_chat_reasoning import Reasoning

__all__ = [
    "TOOL_INDEX_MODES",
    "calls_of",
    "chat_usage",
    "completion_id",
    "completion_of",
    "dialect_id",
    "encode_stream",
    "history_ids",
    "metered",
    "one_call",
    "stream_chunks",
    "text_of",
    "to_anthropic",
]

#: How tool calls carry their ``index`` in a stream: ``present`` (one per
#: call), ``missing`` (none), ``duplicated`` (every call ``0``).
TOOL_INDEX_MODES = ("present", "missing", "duplicated")

_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_FRESH = "toolu_01"
_FINISH = {"tool_use": "tool_calls", "end_turn": "stop", "max_tokens": "length", "refusal": "content_filter",
           "stop_sequence": "stop"}


# -- the request, for the fake model --------------------------------------------


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return "".join(part.get("text", "") for part in parts if isinstance(part, dict) and part.get("type") == "text")


def _block_of(part: Any) -> dict:
    if isinstance(part, dict) and part.get("type") == "text":
        return {"type": "text", "text": str(part.get("text", ""))}
    if isinstance(part, dict) and part.get("type") == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        url = url if isinstance(url, str) else ""
        if url.startswith("data:") and ";base64," in url:
            media_type, _, data = url[5:].partition(";base64,")
            return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
        return {"type": "image", "source": {"type": "url", "url": url}}
    # Audio, files...: read as their JSON (the fake model only counts them).
    return {"type": "text", "text": to_json(part).decode("utf-8")}


def _blocks_of(content: Any) -> list[dict]:
    if isinstance(content, list):
        return [_block_of(part) for part in content]
    return [{"type": "text", "text": content if isinstance(content, str) else to_json(content).decode("utf-8")}]


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            parsed = ujson.loads(value)
        except ValueError:
            return {"arguments": value}
        return parsed if isinstance(parsed, dict) else {"arguments": parsed}
    return value if isinstance(value, dict) else {}


def _assistant_blocks(message: dict) -> list[dict]:
    blocks = []
    text = _text_of(message.get("content"))
    if text:
        blocks.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        function = function if isinstance(function, dict) else {}
        blocks.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                       "input": _arguments(function.get("arguments"))})
    return blocks or [{"type": "text", "text": ""}]


def _tools(tools: Any) -> list[dict]:
    converted = []
    for tool in tools if isinstance(tools, list) else ():
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            schema = function.get("parameters")
            converted.append({"name": function["name"], "description": str(function.get("description") or ""),
                              "input_schema": schema if isinstance(schema, dict) else {"type": "object"}})
    return converted


def _tool_choice(choice: Any) -> dict | None:
    if choice in ("auto", "none"):
        return {"type": choice}
    if choice == "required":
        return {"type": "any"}
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        return {"type": "tool", "name": choice["function"].get("name")}
    return None


def to_anthropic(body: dict, messages: list) -> dict:
    """
    The fake model's request for a (checked) Chat request: system and
    developer messages as ``system``, tool messages as ``tool_result``
    blocks, consecutive messages of one side merged, function tools as
    tools, and a cache breakpoint on the last block (OpenAI-protocol
    upstreams cache every prompt's prefix without being asked).
    """
    system: list[dict] = []
    turns: list[dict] = []
    for message in messages:
        role = message["role"]
        if role in ("system", "developer"):
            system.extend(block for block in _blocks_of(message.get("content")) if block["type"] == "text")
            continue
        if role == "assistant":
            side, blocks = "assistant", _assistant_blocks(message)
        elif role in ("tool", "function"):
            content = message.get("content")
            result = _blocks_of(content) if isinstance(content, list) else _text_of(content)
            side, blocks = "user", [{"type": "tool_result", "tool_use_id": message.get("tool_call_id"),
                                     "content": result}]
        else:
            side, blocks = "user", _blocks_of(message.get("content"))
        if turns and turns[-1]["role"] == side:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": side, "content": list(blocks)})
    if turns and turns[-1]["content"]:
        turns[-1]["content"][-1] = dict(turns[-1]["content"][-1], cache_control={"type": "ephemeral"})
    maximum = body.get("max_completion_tokens") or body.get("max_tokens")
    request: dict = {
        "model": body["model"],
        "max_tokens": maximum if isinstance(maximum, int) and not isinstance(maximum, bool) and maximum > 0 else 4096,
        "messages": turns,
    }
    if system:
        request["system"] = system
    tools = _tools(body.get("tools"))
    if tools:
        request["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        request["tool_choice"] = choice
    return request


def history_ids(messages: list) -> frozenset:
    """The tool call ids of a request's history."""
    found = set()
    for message in messages:
        for call in message.get("tool_calls") or () if message.get("role") == "assistant" else ():
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                found.add(call["id"])
    return frozenset(found)


# -- the answer -------------------------------------------------------------------


def _digits(value: str, length: int, alphabet: str) -> str:
    number = int.from_bytes(hashlib.sha256(value.encode("utf-8")).digest(), "big")
    out = []
    for _ in range(length):
        number, rest = divmod(number, len(alphabet))
        out.append(alphabet[rest])
    return "".join(out)


def dialect_id(dialect: Dialect, value: Any, position: int, history: frozenset) -> Any:
    """
    The id a dialect gives a tool call the fake model made: a copy of an id of
    the history as it is; a fresh ``toolu_01X``: ``call_X`` (OpenAI, Groq,
    OpenRouter), ``call_0N_X`` (DeepSeek, N the call's position),
    ``function-call-<digits>`` (Gemini), 9 letters and digits (Mistral).
    Kimi's are the fake model's own (``functions.<name>:<n>``).  An empty or
    left out id stays so.
    """
    if not isinstance(value, str) or not value or value in history or dialect.name == "kimi":
        return value
    if not value.startswith(_FRESH):
        # A look-alike of a history id: Mistral takes only its shape.
        return _digits(value, 9, _BASE62) if dialect.name == "mistral" else value
    tail = value[len(_FRESH):]
    if dialect.name == "deepseek":
        return f"call_{position:02d}_{tail}"
    if dialect.name == "gemini":
        return "function-call-" + _digits(tail, 19, "0123456789")
    if dialect.name == "mistral":
        return tail[:9]
    return "call_" + tail


def completion_id(dialect: Dialect) -> str:
    """A fresh id for one answer, of the dialect's shape."""
    if dialect.name == "deepseek":
        return str(uuid.uuid4())
    if dialect.name == "mistral":
        return uuid.uuid4().hex
    if dialect.name == "openrouter":
        return f"gen-{_digits(uuid.uuid4().hex, 10, '0123456789')}-{_digits(uuid.uuid4().hex, 20, _BASE62)}"
    return "chatcmpl-" + _digits(uuid.uuid4().hex, 29, _BASE62)


def calls_of(message: dict, dialect: Dialect, history: frozenset) -> list[dict]:
    """The fake model's ``tool_use`` blocks as the dialect's ``tool_calls``."""
    calls = []
    for block in message["content"]:
        if block.get("type") != "tool_use":
            continue
        call: dict = {"type": "function", "function": {"name": block["name"], "arguments": to_json(
            block["input"]).decode("utf-8")}}
        if "id" in block:
            call = {"id": dialect_id(dialect, block["id"], len(calls), history), **call}
        calls.append(call)
    return calls


def one_call(message: dict) -> dict:
    """The fake model's answer with its first tool call alone
    (``parallel_tool_calls: false``)."""
    calls = [n for n, block in enumerate(message["content"]) if block.get("type") == "tool_use"]
    if len(calls) < 2:
        return message
    return dict(message, content=message["content"][: calls[0] + 1])


def text_of(message: dict) -> str:
    """The fake model's text blocks, joined."""
    return "".join(block["text"] for block in message["content"] if block.get("type") == "text")


def _assistant(dialect: Dialect, text: str, calls: list[dict], reasoning: Reasoning | None,
               reasoning_format: Any) -> dict:
    message: dict = {"role": "assistant", "content": text}
    if dialect.name in ("openai", "openrouter"):
        message["refusal"] = None
    if reasoning is not None and dialect.reasoning == "reasoning_content":
        message["reasoning_content"] = reasoning.text
    elif reasoning is not None and dialect.reasoning == "reasoning":
        if reasoning_format == "parsed":
            message["reasoning"] = reasoning.text
    elif reasoning is not None and dialect.reasoning == "details":
        message["reasoning"] = reasoning.text
        message["reasoning_details"] = reasoning.details(calls[0].get("id") if calls else None)
    if calls:
        calls = [dict(call) for call in calls]
        if reasoning is not None and dialect.reasoning == "signature":
            calls[0]["extra_content"] = {"google": {"thought_signature": reasoning.signature}}
        message["tool_calls"] = calls
    elif reasoning is not None and dialect.reasoning == "signature":
        message["extra_content"] = {"google": {"thought_signature": reasoning.signature}}
    return message


def completion_of(dialect: Dialect, message: dict, calls: list[dict], reasoning: Reasoning | None,
                  usage: dict, *, model: str, created: int, answer_id: str, reasoning_format: Any = None) -> dict:
    """The chat completion of the fake model's ``message`` (non-streaming)."""
    text = text_of(message)
    if reasoning is not None and dialect.reasoning == "reasoning" and reasoning_format == "raw":
        text = f"<think>{reasoning.text}</think>\n{text}"
    completion: dict = {
        "id": answer_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": _assistant(dialect, text, calls, reasoning, reasoning_format),
            "logprobs": None,
            "finish_reason": _FINISH.get(message.get("stop_reason"), "stop"),
        }],
        "usage": usage,
    }
    if dialect.name in ("openai", "deepseek", "groq"):
        completion["system_fingerprint"] = "fp_" + _digits(dialect.name + model, 10, "0123456789abcdef")
    if dialect.name == "openai":
        completion["service_tier"] = "default"
    elif dialect.name == "openrouter":
        completion["provider"] = "Google AI Studio"
    elif dialect.name == "groq":
        completion["x_groq"] = {"id": "req_" + answer_id[-26:].lower()}
    return completion


# -- usage --------------------------------------------------------------------------


def chat_usage(dialect: Dialect, usage: dict, reasoning_tokens: int) -> dict:
    """
    The usage ``dialect`` reports for the fake model's (Anthropic) ``usage``
    and the reasoning it added: ``prompt_tokens`` counts the cached and the
    written tokens, ``completion_tokens`` the reasoning.  Cache reads in
    ``prompt_tokens_details.cached_tokens``; DeepSeek's
    ``prompt_cache_hit_tokens``/``prompt_cache_miss_tokens``; Kimi's
    ``cached_tokens``; writes (OpenAI, OpenRouter) in ``cache_write_tokens``.
    """
    read = usage.get("cache_read_input_tokens") or 0
    written = usage.get("cache_creation_input_tokens") or 0
    prompt = (usage.get("input_tokens") or 0) + read + written
    completion = (usage.get("output_tokens") or 0) + reasoning_tokens
    details: dict = {"cached_tokens": read}
    if dialect.writes_reported:
        details["cache_write_tokens"] = written
    if dialect.name == "openai":
        details["audio_tokens"] = 0
    reported: dict = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": details}
    if dialect.name != "mistral":
        reported["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    if dialect.name == "deepseek":
        reported.update(prompt_cache_hit_tokens=read, prompt_cache_miss_tokens=prompt - read)
    elif dialect.name == "kimi":
        reported["cached_tokens"] = read
    elif dialect.name == "openrouter":
        reported.update(cost=round(prompt * 2e-6 + completion * 12e-6, 8), is_byok=False)
    elif dialect.name == "groq":
        reported.update(queue_time=0.01, prompt_time=round(prompt / 50000, 6),
                        completion_time=round(completion / 500, 6))
    return reported


def metered(dialect: Dialect, reported: dict) -> dict:
    """
    What ``reported`` (:func:`chat_usage`) is in Anthropic's terms, as a
    relay should meter it: cached and reported cache-write tokens out of the
    input, reasoning in the output.  A dialect that does not report its
    writes bills them as input.
    """
    details = reported.get("prompt_tokens_details") or {}
    read = details.get("cached_tokens") or 0
    written = details.get("cache_write_tokens") or 0
    return {"input_tokens": reported["prompt_tokens"] - read - written, "output_tokens": reported["completion_tokens"],
            "cache_read_input_tokens": read, "cache_creation_input_tokens": written}


# -- the stream ------------------------------------------------------------------------


def _pieces(text: str, rng: random.Random) -> list[str]:
    """``text`` cut at 1 to 3 places (whole characters)."""
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 3))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _call_deltas(dialect: Dialect, number: int, call: dict, rng: random.Random, index_mode: str,
                 late_ids: bool) -> list[dict]:
    """The deltas of one tool call: whole (Gemini, Mistral) or its id and name
    first, then the arguments in pieces; ``index`` as ``index_mode`` says;
    with ``late_ids`` the id comes with the second delta."""
    head: dict = {} if index_mode == "missing" else {"index": 0 if index_mode == "duplicated" else number}
    function = call["function"]
    arguments = function["arguments"]
    if dialect.whole_calls:
        first = {**head, **{key: value for key, value in call.items() if key != "id"}}
        deltas = [first]
    else:
        first = {**head, "type": "function", "function": {"name": function["name"], "arguments": ""}}
        deltas = [first] + [{**head, "function": {"arguments": piece}} for piece in _pieces(arguments, rng)]
    if "id" in call:
        if late_ids:
            if len(deltas) == 1:
                deltas.append(dict(head))
            deltas[1] = {**head, "id": call["id"], **{k: v for k, v in deltas[1].items() if k not in head}}
        else:
            deltas[0] = {**head, "id": call["id"], **{k: v for k, v in deltas[0].items() if k not in head}}
    return [{"tool_calls": [delta]} for delta in deltas]


def stream_chunks(dialect: Dialect, completion: dict, rng: random.Random, *, include_usage: bool,
                  index_mode: str = "present", late_ids: bool = False, cut: bool = False) -> list:
    """
    The stream of ``completion`` (:func:`completion_of`): data chunks (dicts)
    and comment lines (strings), in order, without the final ``[DONE]``.

    The role first, the reasoning and the text in pieces, then each tool
    call (Gemini's signature on the first), the chunk with the
    ``finish_reason``, and the usage: with ``include_usage`` (always for
    Mistral and OpenRouter) a last chunk with no choices (Mistral: on the
    finish chunk).  OpenAI sends ``"usage": null`` on the others when asked.

    :param cut: end after the first pieces with the dialect's error chunk.
    """
    choice = completion["choices"][0]
    message = choice["message"]
    base = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
            "model": completion["model"]}
    for name in ("system_fingerprint", "service_tier", "provider"):
        if name in completion:
            base[name] = completion[name]
    usage_wanted = include_usage or dialect.always_usage
    if dialect.name == "openai" and include_usage:
        base["usage"] = None

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    deltas: list[dict] = [{"role": "assistant", "content": ""}]
    if message.get("reasoning_content"):
        deltas += [{"content": None, "reasoning_content": piece} for piece in _pieces(message["reasoning_content"], rng)]
    elif "reasoning_details" in message:
        text_entry = message["reasoning_details"][0]
        # The first piece of an entry carries its fields; the others its
        # type, index and text (merged by index, the text joined).
        pieces = _pieces(text_entry["text"], rng)
        deltas += [{"content": "", "reasoning": piece, "reasoning_details": [
            dict(text_entry, text=piece) if n == 0 else {"type": text_entry["type"], "text": piece, "index": 0}]}
            for n, piece in enumerate(pieces)]
        deltas += [{"content": "", "reasoning_details": [entry]} for entry in message["reasoning_details"][1:]]
    elif message.get("reasoning"):
        deltas += [{"reasoning": piece} for piece in _pieces(message["reasoning"], rng)]
    text_deltas = [{"content": piece} for piece in _pieces(message["content"], rng)] if message["content"] else []
    if text_deltas and "extra_content" in message:
        text_deltas[0]["extra_content"] = message["extra_content"]
    deltas += text_deltas
    for number, call in enumerate(message.get("tool_calls") or ()):
        deltas += _call_deltas(dialect, number, call, rng, index_mode, late_ids)
    chunks: list = [": OPENROUTER PROCESSING"] if dialect.name == "openrouter" else []
    chunks += [chunk(delta) for delta in deltas]
    if cut:
        error = stream_error(dialect.name)
        return chunks[: 1 + len(chunks) // 3] + [{**base, **error} if "choices" in error else error]
    finish = chunk({}, choice["finish_reason"])
    if dialect.usage_on_finish:
        finish["usage"] = completion["usage"]
    chunks.append(finish)
    if usage_wanted and not dialect.usage_on_finish:
        chunks.append({**base, "choices": [], "usage": completion["usage"]})
    return chunks


def encode_stream(chunks: list, line_ending: str = "\n", done: bool = True) -> tuple[bytes, list[int]]:
    """
    The bytes of a stream (``data: <chunk>`` events, ``: comment`` lines,
    ``data: [DONE]`` when ``done``) and where each event starts.
    """
    parts, starts, offset = [], [], 0
    for item in [*chunks, "[DONE]"] if done else chunks:
        if isinstance(item, dict):
            line = "data: " + to_json(item).decode("utf-8")
        elif item == "[DONE]":
            line = "data: [DONE]"
        else:
            line = item
        encoded = (line + line_ending + line_ending).encode("utf-8")
        starts.append(offset)
        parts.append(encoded)
        offset += len(encoded)
    return b"".join(parts), starts
