# -*- test-case-name: tests.test_affinity -*-
"""
One account per conversation: which key of a pool a conversation goes to.

A thinking block is bound to the account whose key made it (Sonnet 5.5,
Haiku 5.5: replayed under another account's key it is dropped silently), and
prompt caches are per workspace. So a key pool spreads load by conversation,
not by request: every request of one conversation goes to the same key (its
*home*), while that key is healthy, and when it fails, to a key of the same
account first.

The choice is stateless: a conversation is named by a digest of its first
user message, by value (:func:`conversation_of`), as the *client* sent it;
keys are ordered for it by rendezvous hashing (:func:`key_order`), so every
relay process and worker, before and after a restart or a reload, agrees on
it, and adding or removing a key moves only the conversations of that key.

Why the first user message: it is in every request of the conversation,
unchanged from the first to the last (changing it breaks every thinking
block and the whole cache anyway); the relay's own id rewrites never reach
it (the digest is of the client's body, before translation) and a thread
the relay rebuilds holds it as the client sent it. ``system`` and ``tools``
are left out (a ``defer_loading`` tool or an inline tool change is no edit
of the prefix, and Claude Code's first system block changes with its
version), and so is ``model`` (a conversation that changes model keeps its
account). Claude Code's ``x-claude-code-session-id`` is not used: the SDK
does not send it, and a session holds several conversations (subagents,
side questions) that may well go to different keys.

Pure: no Twisted, no I/O. A key is hashed here and never kept or shown.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

__all__ = ["RecentConversations", "conversation_of", "key_digest", "key_order", "same_account"]


def conversation_of(body: Any) -> str | None:
    """
    The conversation a request body belongs to: a hex digest of its first
    ``user`` message by value (key order and JSON formatting do not
    matter, nor ``cache_control`` markers, which clients move to the newest
    message at each turn, nor a string written as one text block), or
    ``None`` for a body without one (a listing, a malformed body), which
    takes the pool's rotation.
    """
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return None
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                content = [{"type": "text", "text": content}]
            try:
                canonical = json.dumps(
                    _without_cache_control(content), sort_keys=True, separators=(",", ":"), ensure_ascii=False
                )
            except (TypeError, ValueError, RecursionError):
                # Content nested deeper than Python recurses: no conversation of its own.
                return None
            return hashlib.blake2b(canonical.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return None


def _without_cache_control(value: Any) -> Any:
    """``value`` with every ``cache_control`` field left out, at any depth."""
    if isinstance(value, dict):
        return {k: _without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_without_cache_control(v) for v in value]
    return value


def key_digest(key: str) -> str:
    """What :func:`key_order` knows of a key: a digest of it, so nothing keeps the key itself."""
    return hashlib.sha256(("twisted-relay key " + key).encode("utf-8")).hexdigest()


def key_order(conversation: str, keys: Sequence[str], accounts: Sequence[str | None] = ()) -> list[int]:
    """
    The positions of a pool's keys in the order ``conversation`` tries
    them: its home key first (the highest rendezvous score), then the other
    keys of the home key's account, then the rest; by score within each.

    :param keys: the keys' digests (:func:`key_digest`), in pool order.
    :param accounts: the account each key names (``None``: not named, an
        account of its own); empty when none is named.
    """
    scores = [hashlib.sha256((conversation + ":" + k).encode("ascii")).digest() for k in keys]
    by_score = sorted(range(len(keys)), key=lambda i: scores[i], reverse=True)
    if not by_score:
        return []
    home = by_score[0]
    same = [i for i in by_score[1:] if same_account(accounts, home, i)]
    rest = [i for i in by_score[1:] if not same_account(accounts, home, i)]
    return [home] + same + rest


def same_account(accounts: Sequence[str | None], first: int, second: int) -> bool:
    """Keys ``first`` and ``second`` (positions) are known to be of one account (or are one key)."""
    if first == second:
        return True
    if not accounts:
        return False
    return accounts[first] is not None and accounts[first] == accounts[second]


class RecentConversations:
    """
    A bounded memory of conversations (their digests), least recently used
    forgotten first: those whose thinking blocks were found bound to a
    different conversation, so that their later requests carry
    ``drop_block`` from the start (the API does not keep the setting, and
    the edit that caused it stays in the conversation's history).
    """

    def __init__(self, size: int = 10_000):
        self._size = size
        self._held: dict[str, None] = {}

    def add(self, conversation: str) -> None:
        self._held.pop(conversation, None)
        self._held[conversation] = None
        while len(self._held) > self._size:
            del self._held[next(iter(self._held))]

    def __contains__(self, conversation: object) -> bool:
        if conversation not in self._held:
            return False
        self.add(conversation)  # recently used
        return True

    def __len__(self) -> int:
        return len(self._held)
