# -*- test-case-name: tests.test_openai_ids -*-
"""
Tool-call ids an OpenAI-protocol upstream takes (issue 33, item 4).

The relay's id core (:mod:`twisted_relay.translation`) has already made the
ids an upstream gets pairwise distinct; some upstreams also limit their
shape: Mistral takes exactly nine letters or digits, OpenAI's Responses a
``call_id`` of at most 64 characters, its Chat Completions a
``tool_call_id`` of at most 40. An id that does not fit is replaced, in the
translated request only, by a digest of it that does (the same id always
gives the same digest, so a call and its result stay paired, turn after
turn); an id that fits goes as it is, so an upstream's own ids come back to
it unchanged. Nothing is kept: an answer's new ids are the upstream's own,
and fit already.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

__all__ = ["ID_PROFILES", "fit_id", "fit_ids"]

_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"

#: What each profile takes: ``(pattern of an id taken as it is, how one that is not is made)``.
ID_PROFILES = {
    "responses": (re.compile(r".{1,64}", re.S), "long"),
    "chat": (re.compile(r".{1,40}", re.S), "long"),
    "mistral": (re.compile(r"[A-Za-z0-9]{9}"), "nine"),
}


def _base62(data: bytes, length: int) -> str:
    number = int.from_bytes(data, "big")
    out = []
    for _ in range(length):
        number, digit = divmod(number, 62)
        out.append(_BASE62[digit])
    return "".join(out)


def fit_id(value: str, profile: str) -> str:
    """``value`` as the profile takes it: itself when it fits, else its digest in the profile's shape."""
    pattern, kind = ID_PROFILES[profile]
    if pattern.fullmatch(value):
        return value
    digest = hashlib.sha256(value.encode("utf-8")).digest()
    if kind == "nine":
        return _base62(digest, 9)
    limit = 64 if profile == "responses" else 40
    # Readable where it can be: the id's start, then a digest of the whole.
    return value[: limit - 17] + "_" + digest.hex()[:16]


def fit_ids(body: dict, profile: str) -> dict:
    """``body`` with every ``tool_use`` id and ``tool_result`` reference fitted (a copy where changed)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return body
    fitted = [_fit_message(message, profile) for message in messages]
    if all(new is old for new, old in zip(fitted, messages)):
        return body
    return dict(body, messages=fitted)


def _fit_message(message: Any, profile: str) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    changed = False
    blocks = []
    for block in content:
        if isinstance(block, dict):
            for name in ("id", "tool_use_id"):
                value = block.get(name)
                if isinstance(value, str) and block.get("type") in ("tool_use", "tool_result"):
                    new = fit_id(value, profile)
                    if new != value:
                        block = dict(block, **{name: new})
                        changed = True
        blocks.append(block)
    return dict(message, content=blocks) if changed else message
