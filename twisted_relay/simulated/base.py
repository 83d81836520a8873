# -*- test-case-name: tests.test_simulated -*-
"""
What every part of the simulated upstream shares: its error, the walk over a
request's messages and blocks, the canonical JSON form of a value and the
seeded random generators.  Pure: no Twisted.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Sequence

import ujson

__all__ = [
    "Rejection",
    "blocks_of",
    "canonical",
    "conversation_key",
    "declaration_ids",
    "declares_tool_use",
    "invalid",
    "is_reference",
    "messages_of",
    "seeded_rng",
]

class Rejection(Exception):
    """
    A request the simulated upstream refuses, as an Anthropic error.

    :ivar status: the HTTP status.
    :ivar error_type: the Anthropic ``error.type``.
    :ivar message: the ``error.message``, in Anthropic's wording where known.
    """

    def __init__(self, status: int, error_type: str, message: str):
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message


def invalid(message: str) -> Rejection:
    """A 400 ``invalid_request_error`` with ``message``."""
    return Rejection(400, "invalid_request_error", message)


def messages_of(body: Any) -> list:
    """The request's ``messages``, or none when it has no list of them."""
    messages = body.get("messages") if isinstance(body, dict) else None
    return messages if isinstance(messages, list) else []


def blocks_of(message: Any) -> list[dict]:
    """A message's content blocks that are objects (none for a string content)."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return []
    return [block for block in content if isinstance(block, dict)]


def declares_tool_use(block: dict) -> bool:
    """Whether ``block`` declares a tool use (``tool_use`` or any ``*_tool_use``)."""
    kind = block.get("type")
    return isinstance(kind, str) and (kind == "tool_use" or kind.endswith("_tool_use"))


def is_reference(block: dict) -> bool:
    """Whether ``block`` refers to a tool use by ``tool_use_id``."""
    return not declares_tool_use(block) and "tool_use_id" in block


def declaration_ids(messages: Sequence[Any], kind: str | None = None) -> list[str]:
    """
    The ids of the declarations in ``messages``, in walk order.

    :param kind: only declarations of this block type (all when ``None``).
    """
    return [
        block.get("id")
        for message in messages
        for block in blocks_of(message)
        if declares_tool_use(block) and (kind is None or block.get("type") == kind)
    ]


def canonical(value: Any) -> bytes:
    """``value`` as JSON bytes whose form depends on its value alone (sorted keys)."""
    # ASCII escapes: a lone surrogate (valid JSON) has no UTF-8 form.
    return ujson.dumps(value, sort_keys=True, ensure_ascii=True).encode("ascii")


def conversation_key(session_id: str | None, body: Any) -> str:
    """
    The key a stateful backend files a conversation under.

    :param session_id: the ``x-claude-code-session-id`` header, if sent.
    :param body: the parsed request; without a session id its first message
        is hashed.
    """
    if session_id:
        return "session:" + session_id
    messages = messages_of(body)
    first = messages[0] if messages else None
    return "first:" + hashlib.sha256(canonical(first)).hexdigest()


def seeded_rng(*parts: Any) -> random.Random:
    """A random generator that is a function of ``parts`` (JSON values) alone."""
    digest = hashlib.sha256(canonical(list(parts))).digest()
    return random.Random(int.from_bytes(digest[:16], "big"))
