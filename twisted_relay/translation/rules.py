# -*- test-case-name: tests.test_upstream_id_rules -*-
"""
What one upstream accepts, and thinking that stays with its maker.

:class:`UpstreamRules` is the plain value a request is translated for: the
upstream's name, its id policy (:data:`UNIQUE` or :data:`ORIGINAL`), the id
pattern it accepts (an id outside it goes as
:func:`~twisted_relay.translation.ids.encode_id` of it), the ids an
``original`` upstream calls its own, and whether thinking is marked with its
maker (a conversation that can cross upstreams).

Thinking marks: :func:`mark_signature` puts the maker's name in front of a
thinking block's signature on its way to the client, :func:`read_mark` reads
it back on the way up; :func:`tool_loop_without_thinking` is Anthropic's
rule, under manual thinking only (:data:`MANUAL_THINKING`), for a tool loop
whose thinking was left out (``docs/id-translation.md``, invariant 12).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from twisted_relay.translation.ids import ENCODED_PREFIX, encode_id

#: Upstream receives pairwise distinct ids (the default).
UNIQUE = "unique"
#: Upstream receives the ids it originally emitted.
ORIGINAL = "original"
#: Every accepted value of ``--upstream-ids``.
POLICIES = (UNIQUE, ORIGINAL)

# -- ids each upstream accepts ------------------------------------------------

#: The tool-use id pattern Anthropic's API enforces.
ANTHROPIC_ID_PATTERN = r"^[a-zA-Z0-9_-]+$"
#: The value of :attr:`UpstreamRules.id_pattern` that means "the policy's
#: default": :data:`ANTHROPIC_ID_PATTERN` for ``unique``, none for ``original``.
DEFAULT_ID_PATTERN = "default"

_ACCEPTED_MEMO_LIMIT = 65536


@dataclass(frozen=True)
class UpstreamRules:
    """
    What one upstream accepts, as a plain value given to
    :func:`~twisted_relay.translation.translate_request`.

    :ivar name: the upstream's name; marks its thinking blocks.
    :ivar policy: :data:`UNIQUE` or :data:`ORIGINAL`.
    :ivar id_pattern: a regular expression every upstream-bound id must match
        (searched with ``fullmatch``); an id that does not is sent as
        :func:`~twisted_relay.translation.ids.encode_id` of it.
        :data:`DEFAULT_ID_PATTERN`: :data:`ANTHROPIC_ID_PATTERN` under
        ``unique``, none under ``original``; ``None``: none.
    :ivar own_ids: ``original`` only: a regular expression for the ids this
        upstream makes; only declarations whose original id matches it go back
        as the upstream emitted them, the others go as under ``unique``.
        ``None``: every id is its own.
    :ivar mark_thinking: the conversation may move between upstreams: mark
        the thinking blocks of this upstream's answers with ``name``, so that
        later requests send them to this upstream only; and send a tool loop
        whose final assistant message does not start with thinking without
        ``thinking`` when the request asks for manual thinking
        (``docs/id-translation.md``, invariant 12).
    :ivar accepted_ids: made from ``id_pattern``: whether an id is one the
        upstream accepts, with a memo of those seen; ``None`` without a pattern.
    :ivar own_match: made from ``own_ids``: its ``fullmatch``, or ``None``.
    :raises ValueError: for an unknown policy, a pattern that does not
        compile, or an ``id_pattern`` that refuses the encoded ids.
    """

    name: str = "upstream"
    policy: str = UNIQUE
    id_pattern: str | None = DEFAULT_ID_PATTERN
    own_ids: str | None = None
    mark_thinking: bool = False
    accepted_ids: Any = field(default=None, init=False, repr=False, compare=False)
    own_match: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown upstream id policy {self.policy!r}; expected one of {POLICIES}")
        pattern = self.id_pattern
        if pattern == DEFAULT_ID_PATTERN:
            pattern = ANTHROPIC_ID_PATTERN if self.policy == UNIQUE else None
            object.__setattr__(self, "id_pattern", pattern)
        if pattern is not None:
            compiled = _compile(pattern, "id pattern")
            for probe in ("functions.Bash:3", "", ENCODED_PREFIX):
                if not compiled.fullmatch(encode_id(probe)):
                    raise ValueError(
                        f"id pattern {pattern!r} refuses the relay's encoded ids "
                        f"(such as {encode_id(probe)!r})")
            object.__setattr__(self, "accepted_ids", _AcceptedIds(compiled))
        if self.own_ids is not None:
            object.__setattr__(self, "own_match", _compile(self.own_ids, "own ids pattern").fullmatch)

    def to_dict(self) -> dict[str, Any]:
        """These rules as a JSON-able dict."""
        return {
            "name": self.name,
            "policy": self.policy,
            "id_pattern": self.id_pattern,
            "own_ids": self.own_ids,
            "mark_thinking": self.mark_thinking,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UpstreamRules:
        """
        The rules :meth:`to_dict` gave ``data``.

        :raises ValueError: when ``data`` is not such rules.
        """
        try:
            get = data.get
        except AttributeError as e:
            raise ValueError("not upstream rules") from e
        return cls(
            name=get("name", "upstream"),
            policy=get("policy", UNIQUE),
            id_pattern=get("id_pattern"),
            own_ids=get("own_ids"),
            mark_thinking=bool(get("mark_thinking", False)),
        )


def _compile(pattern: str, what: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except (re.error, TypeError) as e:
        raise ValueError(f"{what} {pattern!r} is not a regular expression: {e}") from e


class _AcceptedIds:
    """
    Whether an id goes upstream as it is: it matches the pattern and does not
    start with :data:`ENCODED_PREFIX`. Remembered per id (a dictionary lookup
    costs a fifth of a regular-expression match), forgotten all at once when
    the memo is full.
    """

    __slots__ = ("fullmatch", "memo")

    def __init__(self, compiled: re.Pattern) -> None:
        self.fullmatch = compiled.fullmatch
        self.memo: dict[str, bool] = {}

    def __call__(self, value: str) -> bool:
        known = self.memo.get(value)
        if known is None:
            known = not value.startswith(ENCODED_PREFIX) and self.fullmatch(value) is not None
            memo = self.memo
            if len(memo) >= _ACCEPTED_MEMO_LIMIT:
                memo.clear()
            memo[value] = known
        return known


DEFAULT_RULES = {policy: UpstreamRules(policy=policy) for policy in POLICIES}


# -- thinking stays with its maker --------------------------------------------

#: The start of the mark the relay puts in front of a thinking block's
#: ``signature`` (a ``redacted_thinking`` block's ``data``) on its way to the
#: client: ``relay:<quoted upstream name>:<what the upstream sent>``.
#: Signatures are base64; none holds a ``:``.
THINKING_MARK = "relay:"
#: The block types whose opaque field carries a maker's signature.
SIGNED_FIELDS = {"thinking": "signature", "redacted_thinking": "data"}


def mark_signature(name: str, signature: str) -> str:
    """``signature`` marked as made by the upstream called ``name``."""
    return THINKING_MARK + quote(name, safe="") + ":" + signature


def read_mark(value: str) -> tuple[str, str] | None:
    """
    ``(maker, signature as the maker sent it)`` for a marked ``value``,
    ``None`` when ``value`` carries no mark.
    """
    if not value.startswith(THINKING_MARK):
        return None
    name, colon, signature = value[len(THINKING_MARK):].partition(":")
    if not colon:
        return None
    return unquote(name), signature


#: The one ``thinking.type`` under which Anthropic requires a tool loop's final
#: assistant message to start with a thinking block: manual (extended)
#: thinking. Adaptive thinking (``{"type": "adaptive"}``, or ``thinking``
#: left out, which means adaptive on current models), ``between_tools`` and
#: any type the relay does not know have no such rule, and the relay never
#: touches them.
MANUAL_THINKING = "enabled"


def manual_thinking(body: dict) -> bool:
    """Whether ``body`` asks for manual thinking: ``{"type": "enabled", ...}``."""
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") == MANUAL_THINKING


def _starts_with_thinking(content: Any) -> bool:
    if not isinstance(content, list) or not content or not isinstance(content[0], dict):
        return False
    return content[0].get("type") in SIGNED_FIELDS


def tool_loop_without_thinking(messages: list, rewritten: list[tuple], crossing: bool) -> bool:
    """
    Whether the final assistant message the upstream gets, followed by tool
    results, does not start with a thinking block once other upstreams'
    thinking is left out: because a block was left out, or (``crossing``: the
    conversation may have been elsewhere) whatever the reason. An assistant
    message left out whole is not the upstream's final one: the one before
    it is.
    """
    changed = {mi: c for mi, _, c in rewritten}
    last = content = None
    for mi in range(len(messages) - 1, -1, -1):
        message = messages[mi]
        if isinstance(message, dict) and message.get("role") == "assistant":
            content = changed.get(mi)
            if content is not None and not content and message.get("content"):
                # left out whole (it held only other upstreams' thinking):
                # the upstream's final assistant message is an earlier one
                continue
            last = mi
            break
    if last is None:
        return False
    if content is None:
        content = messages[last].get("content")
    elif not crossing and not _starts_with_thinking(messages[last].get("content")):
        return False
    if _starts_with_thinking(content):
        return False
    for message in messages[last + 1:]:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") == "tool_result" for b in content
        ):
            return True
    return False

