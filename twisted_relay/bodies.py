# -*- test-case-name: tests.test_routing -*-
"""
What the relay reads in a client's request body to decide about it, without
changing it: whether it holds an image (a route's ``images``), and whether
an upstream's 400 says a thinking block in it is bound to a different
conversation, with the body that recovers from it (issue 25, item 5).

Pure: no Twisted, no I/O.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["BINDING_BETA", "bound_elsewhere", "droppable", "dropping_blocks", "holds_image", "with_beta"]


def holds_image(messages: Any) -> bool:
    """A request's ``messages`` hold an image (in a message, or in a ``tool_result``)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and _blocks_hold_image(content):
            return True
    return False


def _blocks_hold_image(blocks: list) -> bool:
    for block in blocks:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "image":
            return True
        inner = block.get("content")
        if kind == "tool_result" and isinstance(inner, list) and _blocks_hold_image(inner):
            return True
    return False


#: The fixed part of the API's 400 for a thinking block whose prefix changed
#: (``messages.{i}.content.{j}: Invalid `signature` in `thinking` block. The
#: block is bound to a different conversation. Remove the block, or set ...``);
#: what follows it (the setting, the beta it needs, what changed) is never
#: matched. A bad signature stops before "The block is bound": no match.
_BOUND_ELSEWHERE = re.compile(
    r"Invalid `signature` in `(?:redacted_)?thinking` block\. The block is bound to a different conversation\."
)
#: The beta value ``thinking.block_binding`` needs.
BINDING_BETA = "thinking-binding-controls-2026-08-01"
#: The ``thinking`` types a request may add ``block_binding`` to (none:
#: adaptive, the default of every model with preserved thinking); never
#: ``between_tools``, which takes no other field.
_BINDABLE = ("adaptive", "enabled")


def bound_elsewhere(answer: bytes | None) -> bool:
    """An upstream's 400 body says a thinking block is bound to a different conversation."""
    try:
        error = json.loads(answer or b"").get("error")
    except (ValueError, AttributeError):
        return False
    if not isinstance(error, dict) or error.get("type") != "invalid_request_error":
        return False
    message = error.get("message")
    return isinstance(message, str) and _BOUND_ELSEWHERE.search(message) is not None


def droppable(body: Any) -> bool:
    """
    ``body`` may be sent again with ``prefix_mismatch_behavior: "drop_block"``:
    its thinking is absent (adaptive), ``adaptive`` or ``enabled``, and it
    sets no ``block_binding`` of its own (the client's choice, or a body
    already sent with it: never sent again).
    """
    if not isinstance(body, dict):
        return False
    thinking = body.get("thinking")
    if thinking is None:
        return True
    return isinstance(thinking, dict) and thinking.get("type") in _BINDABLE and "block_binding" not in thinking


def dropping_blocks(body: dict) -> dict:
    """``body`` with ``thinking.block_binding.prefix_mismatch_behavior: "drop_block"`` (the rest unchanged)."""
    thinking = dict(body.get("thinking") or {"type": "adaptive"})
    thinking["block_binding"] = {"prefix_mismatch_behavior": "drop_block"}
    return dict(body, thinking=thinking)


def with_beta(values: list[bytes] | None, beta: str = BINDING_BETA) -> bytes:
    """An ``anthropic-beta`` header value: the request's values, then ``beta`` unless it is there."""
    given = [v.strip() for value in values or () for v in value.decode("latin-1").split(",") if v.strip()]
    if beta not in given:
        given.append(beta)
    return ",".join(given).encode("latin-1")
