# -*- test-case-name: tests.test_openai_envelope -*-
"""
The relay's envelope for an upstream's reasoning, carried in a thinking
block's ``signature`` (issue 33, item 3).

OpenAI's protocols give reasoning the client cannot keep as it comes:
encrypted reasoning items (Responses), ``reasoning_content`` (DeepSeek,
Kimi), Gemini's thought signatures, OpenRouter's ``reasoning_details``. The
relay seals each in a thinking block's ``signature``, which every client
sends back unchanged, naming the upstream and the account (a digest of the
key) it came from. On the way back it opens only envelopes of that upstream
and that account: an envelope of another, a damaged one, or a signature of
Anthropic's own is not reasoning this upstream can take, and its block is
dropped (as thinking from another upstream is).

Form: ``trr1.<upstream>.<account>.<payload>.<check>``: the upstream's name
(letters, digits, ``-``, ``_``), the account's digest (16 hex), the
payload's JSON in unpadded base64url, and a check (8 hex of a SHA-256 of
the rest) that finds a damaged envelope. Not a secret and not a signature:
the upstream checks its own reasoning (OpenAI refuses encrypted content of
another organisation); the check only keeps a truncated envelope from
reaching it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from typing import Any

__all__ = ["PREFIX", "account_of", "open_envelope", "seal"]

#: What every envelope of this version begins with.
PREFIX = "trr1."
_FORM = re.compile(r"trr1\.([A-Za-z0-9_-]+)\.([0-9a-f]{16})\.([A-Za-z0-9_-]*)\.([0-9a-f]{8})")


def account_of(key: str | None) -> str:
    """The account an envelope names for ``key``: 16 hex of its SHA-256 (``"none"`` hashed for no key)."""
    return hashlib.sha256(("twisted-relay account " + (key or "")).encode("utf-8")).hexdigest()[:16]


def _check(text: str) -> str:
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:8]


def seal(upstream: str, account: str, payload: Any) -> str:
    """``payload`` (JSON-able) sealed for ``upstream`` and ``account`` (:func:`account_of`)."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body = "%s%s.%s.%s" % (PREFIX, upstream, account, base64.urlsafe_b64encode(data).decode("ascii").rstrip("="))
    return "%s.%s" % (body, _check(body))


def open_envelope(signature: Any, upstream: str, account: str) -> Any | None:
    """
    The payload of ``signature`` when it is an envelope of ``upstream`` and
    ``account``, whole; ``None`` otherwise (another upstream's, another
    account's, damaged, or not an envelope at all).
    """
    if not isinstance(signature, str) or not signature.startswith(PREFIX):
        return None
    found = _FORM.fullmatch(signature)
    if found is None or found.group(1) != upstream or found.group(2) != account:
        return None
    body = signature[: -len(found.group(4)) - 1]
    if _check(body) != found.group(4):
        return None
    data = found.group(3)
    try:
        return json.loads(base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)))
    except ValueError:
        return None
