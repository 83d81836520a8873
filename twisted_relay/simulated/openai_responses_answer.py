# -*- test-case-name: tests.test_simulated_openai_responses -*-
"""
The answers of the simulated OpenAI Responses API: the fake model's answer
as output items, the usage, the response object and its stream of events.

- :func:`output_items`: reasoning items (a summary when asked; now and then
  a second one before a later item: reason, message, reason, tool), message
  items with ``output_text``, ``function_call`` items (``call_...`` ids,
  ``fc_`` item ids, JSON arguments), each with its output tokens;
  :func:`cut_to` ends them where ``max_output_tokens`` runs out.
- :func:`usage_of`: OpenAI's usage: ``input_tokens`` include the cached and
  the cache-written tokens, ``output_tokens`` the reasoning tokens.
- :func:`stream_events`: the events OpenAI streams, in its order, each with
  its ``sequence_number``, the final ``encrypted_content`` only on
  ``response.output_item.done``; and the quirks a relay must survive
  (arguments only on ``.done``, no ``output_item.added``, ``response.failed``
  or a top-level ``error`` midway).

Pure: no Twisted.
"""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass, field
from typing import Any

import ujson

from twisted_relay.simulated.openai_responses_rules import Settings, to_call_id

__all__ = [
    "FAILURE_MESSAGE",
    "Produced",
    "StreamFault",
    "anthropic_usage",
    "cut_to",
    "new_call_id",
    "new_id",
    "output_items",
    "response_object",
    "stream_events",
    "usage_of",
]

#: The message of a ``server_error`` as OpenAI words it (with the request id).
FAILURE_MESSAGE = ("An error occurred while processing your request. You can retry your request, or contact us "
                   "through our help center at help.openai.com if the error persists. Please include the request "
                   "ID {request_id} in your message.")

_SUMMARIES = (
    "**Planning the next step**\n\nI'll call `{tool}` with what the user gave — {word} first.",
    "**Vérifier les résultats**\n\nLes résultats précédents semblent cohérents ; je continue avec {word}.",
    "**Weighing the tool output**\n\nThe last result mentions {word}; one more check before answering.",
    "**次の手順を検討**\n\n{word} を確認してから答えます。",
)
_WORDS = ("Zürich", "東京", "the report", "São Paulo", "the forecast", "Kraków")
_ALPHANUMERIC = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_EFFORT_SCALE = {"minimal": 0.25, "low": 0.5, "medium": 1.0, "high": 2.0, "xhigh": 3.0, "max": 4.0}


def new_call_id() -> str:
    """A fresh ``call_id``: ``call_`` and 24 letters and digits."""
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


def new_id(prefix: str) -> str:
    """A fresh id as OpenAI makes them: ``resp_``, ``rs_``, ``msg_``, ``fc_`` and 50 hex digits."""
    return prefix + secrets.token_hex(25)


def _tokens(value: Any) -> int:
    # The simulator's tokenizer, as the fake model's: four characters of JSON a token.
    return max(1, len(ujson.dumps(value, ensure_ascii=False)) // 4)


@dataclass
class Produced:
    """One output item and the output tokens it cost (reasoning tokens for a reasoning item)."""

    item: dict
    tokens: int
    reasoning: bool = False
    summary: list[str] = field(default_factory=list)
    payload: dict | None = None


def _reasoning_item(rng: random.Random, settings: Settings, tools: list[str]) -> Produced:
    parts = []
    if settings.summary is not None:
        for _ in range(rng.choice((1, 1, 2))):
            parts.append(rng.choice(_SUMMARIES).format(tool=rng.choice(tools or ["search"]), word=rng.choice(_WORDS)))
    tokens = int((24 + rng.randrange(200)) * _EFFORT_SCALE.get(settings.effort or "medium", 1.0)) + 1
    item = {"id": new_id("rs_"), "type": "reasoning", "summary": [{"type": "summary_text", "text": text}
                                                                   for text in parts]}
    return Produced(item, tokens, reasoning=True, summary=parts)


def output_items(answer: dict, settings: Settings, rng: random.Random, splits: float,
                 history: frozenset = frozenset()) -> list[Produced]:
    """
    The output items of the fake model's ``answer`` (a Messages answer),
    in order.

    :param rng: seeded by the answer: the reasoning it draws repeats.
    :param splits: the share of answers with two reasoning items (the second
        before a later item).
    :param history: the tool-use ids of the request the model read: an id it
        copied from there is that call's ``call_id`` again; any other is a
        fresh ``call_`` id (one per id in the answer), as OpenAI's are.
    """
    items: list[Produced] = []
    fresh: dict[str, str] = {}
    calls = 0
    for block in answer["content"]:
        kind = block.get("type")
        if kind == "text":
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": block["text"]}
            item = {"id": new_id("msg_"), "type": "message", "status": "completed", "content": [part],
                    "role": "assistant"}
            items.append(Produced(item, _tokens(block["text"])))
        elif kind == "tool_use":
            if calls and not settings.parallel:
                continue
            calls += 1
            arguments = ujson.dumps(block["input"], ensure_ascii=False, escape_forward_slashes=False)
            item = {"id": new_id("fc_"), "type": "function_call", "status": "completed", "arguments": arguments,
                    "name": block["name"]}
            if "id" in block:
                model_id = block["id"]
                if model_id in history or not model_id:
                    item["call_id"] = to_call_id(model_id)
                else:
                    item["call_id"] = fresh.setdefault(model_id, new_call_id())
            items.append(Produced(item, _tokens([block["name"], arguments])))
    if settings.effort is None or not items:
        return items
    tools = [tool["name"] for tool in settings.tools]
    at = [0]
    if len(items) > 1 and rng.random() < splits:
        at.append(rng.randrange(1, len(items)))
    for position in reversed(at):
        items.insert(position, _reasoning_item(rng, settings, tools))
    return items


def cut_to(items: list[Produced], limit: int | None) -> tuple[list[Produced], bool]:
    """
    The items that fit in ``limit`` output tokens, and whether any was cut:
    a message cut short (``incomplete``), a function call left out, a
    reasoning item kept whole up to the limit.
    """
    if limit is None or sum(produced.tokens for produced in items) <= limit:
        return items, False
    kept, spent = [], 0
    for produced in items:
        room = limit - spent
        if produced.tokens <= room:
            kept.append(produced)
            spent += produced.tokens
            continue
        if produced.reasoning and room > 0:
            kept.append(Produced(dict(produced.item), room, True, produced.summary))
        elif produced.item["type"] == "message" and room > 0:
            text = produced.item["content"][0]["text"]
            part = dict(produced.item["content"][0], text=text[: max(1, len(text) * room // produced.tokens)])
            kept.append(Produced(dict(produced.item, status="incomplete", content=[part]), room))
        break
    return kept, True


def usage_of(answer_usage: dict, items: list[Produced], cache_writes: bool = True) -> dict:
    """
    OpenAI's usage of an answer: the fake model's prompt (its cache reads and
    writes) and the items' output tokens.

    :param cache_writes: report ``cache_write_tokens`` (else they count as
        plain input, as OpenAI's usage did before it reported them).
    """
    read = answer_usage.get("cache_read_input_tokens") or 0
    split = answer_usage.get("cache_creation") or {}
    short = split.get("ephemeral_5m_input_tokens", answer_usage.get("cache_creation_input_tokens") or 0)
    long = split.get("ephemeral_1h_input_tokens", 0)
    total = answer_usage["input_tokens"] + read + short + long
    if not cache_writes:
        short = long = 0
    output = sum(produced.tokens for produced in items)
    reasoning = sum(produced.tokens for produced in items if produced.reasoning)
    return {
        "input_tokens": total,
        "input_tokens_details": {"cached_tokens": read, "cache_write_tokens": short + long,
                                 "cache_write_tokens_details": {"ttl_30m_tokens": short, "ttl_12h_tokens": long}},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": total + output,
    }


def anthropic_usage(usage: dict) -> dict:
    """OpenAI's usage in the Messages API's terms (input without the cache;
    30-minute writes as 5-minute ones, 12-hour as 1-hour), for the upstream's tally."""
    details = usage["input_tokens_details"]
    split = details["cache_write_tokens_details"]
    return {
        "input_tokens": usage["input_tokens"] - details["cached_tokens"] - details["cache_write_tokens"],
        "cache_read_input_tokens": details["cached_tokens"],
        "cache_creation_input_tokens": details["cache_write_tokens"],
        "cache_creation": {"ephemeral_5m_input_tokens": split["ttl_30m_tokens"],
                           "ephemeral_1h_input_tokens": split["ttl_12h_tokens"]},
        "output_tokens": usage["output_tokens"],
        "output_tokens_details": {"thinking_tokens": usage["output_tokens_details"]["reasoning_tokens"]},
    }


def response_object(response_id: str, settings: Settings, created_at: int, *, status: str, output: list[dict],
                    usage: dict | None = None, incomplete: str | None = None, error: dict | None = None,
                    previous: str | None = None, transformations: list[dict] | None = None) -> dict:
    """The ``response`` object, as OpenAI returns and streams it."""
    response = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "completed_at": created_at + 1 if status == "completed" else None,
        "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": settings.instructions,
        "max_output_tokens": settings.max_output_tokens,
        "max_tool_calls": settings.echo.get("max_tool_calls"),
        "model": settings.model,
        "output": output,
        "parallel_tool_calls": settings.parallel,
        "previous_response_id": previous,
        "prompt_cache_key": settings.prompt_cache_key,
        "prompt_cache_retention": settings.retention,
        "reasoning": {"effort": settings.effort or ("none" if settings.spec.reasons else None),
                      "summary": settings.summary},
        "safety_identifier": settings.echo.get("safety_identifier"),
        "service_tier": "default",
        "store": settings.store,
        "temperature": settings.echo.get("temperature") if settings.echo.get("temperature") is not None else 1.0,
        "text": settings.echo.get("text") or {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": settings.tool_choice,
        "tools": settings.echo.get("tools") or [],
        "top_logprobs": settings.echo.get("top_logprobs") or 0,
        "top_p": settings.echo.get("top_p") if settings.echo.get("top_p") is not None else 1.0,
        "truncation": settings.echo.get("truncation") or "disabled",
        "usage": usage,
        "user": settings.echo.get("user"),
        "metadata": settings.echo.get("metadata") or {},
    }
    if transformations:
        response["input_transformations"] = transformations
    return response


@dataclass(frozen=True)
class StreamFault:
    """
    How a stream breaks: after ``after_events`` events (``None``: after the
    first item's ``response.output_item.done``), a ``response.failed``
    (``kind="failed"``) or a top-level ``error`` event (``kind="error"``)
    with ``code`` and ``message``, and nothing more.
    """

    kind: str
    after_events: int | None
    code: str
    message: str


def _pieces(text: str, rng: random.Random) -> list[str]:
    """``text`` cut at 1 to 3 places (whole characters)."""
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 3))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _item_events(index: int, produced: Produced, rng: random.Random, *, argument_deltas: bool,
                 announce: bool) -> list[dict]:
    item = produced.item
    kind = item["type"]
    where = {"item_id": item["id"], "output_index": index}
    events: list[dict] = []
    if kind == "reasoning":
        sealed = item.get("encrypted_content")
        # The added item's encrypted content is a snapshot: not the one to send back.
        added = dict(item, summary=[], **({"encrypted_content": sealed[: len(sealed) * 2 // 3]} if sealed else {}))
        events.append({"type": "response.output_item.added", "output_index": index, "item": added})
        for number, text in enumerate(produced.summary):
            part = {"type": "summary_text", "text": ""}
            events.append({"type": "response.reasoning_summary_part.added", **where, "summary_index": number,
                           "part": part})
            events += [{"type": "response.reasoning_summary_text.delta", **where, "summary_index": number,
                        "delta": piece} for piece in _pieces(text, rng)]
            events.append({"type": "response.reasoning_summary_text.done", **where, "summary_index": number,
                           "text": text})
            events.append({"type": "response.reasoning_summary_part.done", **where, "summary_index": number,
                           "part": dict(part, text=text)})
    elif kind == "message":
        if announce:
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": dict(item, status="in_progress", content=[])})
        part = item["content"][0]
        where = dict(where, content_index=0)
        events.append({"type": "response.content_part.added", **where, "part": dict(part, text="")})
        events += [{"type": "response.output_text.delta", **where, "delta": piece, "logprobs": []}
                   for piece in _pieces(part["text"], rng)]
        events.append({"type": "response.output_text.done", **where, "text": part["text"], "logprobs": []})
        events.append({"type": "response.content_part.done", **where, "part": part})
    else:
        if announce:
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": dict(item, status="in_progress", arguments="")})
        if argument_deltas:
            events += [{"type": "response.function_call_arguments.delta", **where, "delta": piece}
                       for piece in _pieces(item["arguments"], rng)]
        events.append({"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]})
    events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    return events


def stream_events(response: dict, produced: list[Produced], rng: random.Random, *, argument_deltas: bool = True,
                  announce_items: bool = True, obfuscation: bool = True,
                  fault: StreamFault | None = None) -> list[tuple[str, dict]]:
    """
    The events that stream ``response`` (its final form: status, output,
    usage), as ``(name, data)`` with their ``sequence_number``.

    :param obfuscation: pad each delta event with an ``obfuscation`` field of
        random length, as the API does unless
        ``stream_options.include_obfuscation`` is false.

    :param argument_deltas: stream function arguments in deltas (else only
        ``response.function_call_arguments.done``).
    :param announce_items: send ``response.output_item.added`` for messages
        and function calls.
    :param fault: break the stream (see :class:`StreamFault`).
    """
    started = dict(response, status="in_progress", output=[], usage=None, completed_at=None,
                   incomplete_details=None, error=None)
    events = [{"type": "response.created", "response": started},
              {"type": "response.in_progress", "response": started}]
    for index, item in enumerate(produced):
        events += _item_events(index, item, rng, argument_deltas=argument_deltas, announce=announce_items)
    terminal = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed"}[response["status"]]
    events.append({"type": terminal, "response": response})
    after = None if fault is None else fault.after_events
    if fault is not None and after is None:
        after = 1 + next(n for n, event in enumerate(events) if event["type"] in (
            "response.output_item.done", terminal))
    if fault is not None and after < len(events) - 1:
        events = events[:after]
        done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
        if fault.kind == "failed":
            failed = dict(response, status="failed", output=done, usage=None, completed_at=None,
                          error={"code": fault.code, "message": fault.message})
            events.append({"type": "response.failed", "response": failed})
        else:
            events.append({"type": "error", "code": fault.code, "message": fault.message, "param": None})
    if obfuscation:
        for event in events:
            if event["type"].endswith(".delta"):
                event["obfuscation"] = "".join(rng.choice(_ALPHANUMERIC) for _ in range(rng.randrange(16)))
    return [(event["type"], dict(event, sequence_number=number)) for number, event in enumerate(events)]
