# -*- test-case-name: tests.test_openai_answers -*-
"""
An OpenAI-protocol upstream's usage as Anthropic's (issue 33, item 5).

The two count differently:

- OpenAI's input count *includes* the tokens read from its prompt cache
  (``input_tokens_details.cached_tokens`` on Responses,
  ``prompt_tokens_details.cached_tokens`` on Chat Completions, DeepSeek's
  ``prompt_cache_hit_tokens``, Moonshot's top-level ``cached_tokens``) and
  those written to it where the upstream reports writes
  (``cache_write_tokens``); Anthropic's ``input_tokens`` *exclude* both,
  which are ``cache_read_input_tokens`` and ``cache_creation_input_tokens``.
  Both are subtracted here (LiteLLM reported cache reads as 0 for a year:
  litellm #28354). An upstream whose reads and writes are more than its
  input count reports input without them: its count is kept as it is.
- Reasoning tokens are output on both sides: OpenAI's output count holds
  them already. xAI counts them beside it (its ``total_tokens`` is input +
  output + reasoning): when the total says so, they are added.

Every count is a whole number, zero or more; anything else reads as 0.
Pure: no Twisted, no I/O.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ZERO_USAGE", "usage_of_chat", "usage_of_responses"]

#: The usage of a ``message_start`` before anything is counted: every field
#: Claude Code reads, zero (litellm #24176: it is sensitive to the shape).
ZERO_USAGE = {
    "input_tokens": 0,
    "output_tokens": 0,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 0,
}


def _count(value: Any) -> int:
    """A reported count: a whole number, zero or more; anything else is 0."""
    return value if type(value) is int and value > 0 else 0


def _details(usage: dict, name: str) -> dict:
    found = usage.get(name)
    return found if isinstance(found, dict) else {}


def _anthropic(input_total: int, read: int, written: int, output: int, reasoning: int, total: Any) -> dict:
    if reasoning and type(total) is int and total == input_total + output + reasoning:
        output += reasoning
    cached = read + written
    return {
        "input_tokens": input_total - cached if cached <= input_total else input_total,
        "output_tokens": output,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": read,
    }


def usage_of_responses(usage: Any) -> dict:
    """A Responses ``usage`` object as Anthropic's usage (all four counts; zeros for none)."""
    if not isinstance(usage, dict):
        return dict(ZERO_USAGE)
    details = _details(usage, "input_tokens_details")
    return _anthropic(
        _count(usage.get("input_tokens")),
        _count(details.get("cached_tokens")),
        _count(details.get("cache_write_tokens")),
        _count(usage.get("output_tokens")),
        _count(_details(usage, "output_tokens_details").get("reasoning_tokens")),
        usage.get("total_tokens"),
    )


def usage_of_chat(usage: Any) -> dict:
    """A Chat Completions ``usage`` object (any dialect's) as Anthropic's usage."""
    if not isinstance(usage, dict):
        return dict(ZERO_USAGE)
    details = _details(usage, "prompt_tokens_details")
    if type(details.get("cached_tokens")) is int:
        read = _count(details["cached_tokens"])
    elif type(usage.get("prompt_cache_hit_tokens")) is int:  # DeepSeek
        read = _count(usage["prompt_cache_hit_tokens"])
    else:  # Moonshot (Kimi) reports it beside the counts
        read = _count(usage.get("cached_tokens"))
    return _anthropic(
        _count(usage.get("prompt_tokens")),
        read,
        _count(details.get("cache_write_tokens")),
        _count(usage.get("completion_tokens")),
        _count(_details(usage, "completion_tokens_details").get("reasoning_tokens")),
        usage.get("total_tokens"),
    )
