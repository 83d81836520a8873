# -*- test-case-name: tests.test_translation -*-
"""
The request walk and the response translator: the two directions of the
translation core, kept together because each mirrors the other.

:func:`translate_request` walks one request's whole history for one upstream
(:class:`~twisted_relay.translation.rules.UpstreamRules`) and returns a
:class:`RequestTranslation`: the body to send upstream, and the table
(:mod:`twisted_relay.translation.table`) built when asked.
:meth:`RequestTranslation.response` gives a :class:`ResponseTranslator` that
rewrites, block by block, the ids of the one upstream response to that
request, recording a :class:`Rewrite` per id it changes.

The relay keeps no state between requests. Every decision about a block is a
function of what precedes that block in walk order, so a block's client id and
upstream id never change on later turns, and a response translator continues
the walk exactly where the next request's walk will find it. The id algebra
both directions apply is in :mod:`twisted_relay.translation.ids`;
``docs/id-translation.md`` has the rules and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twisted_relay.translation.ids import (
    DECLARATION,
    ID,
    REFERENCE,
    decode_declaration,
    free_id,
    is_lookalike,
    swap_references,
    encode_id,
    minted_id,
)
from twisted_relay.translation.rules import (
    DEFAULT_RULES,
    SIGNED_FIELDS,
    POLICIES,
    THINKING_MARK,
    UNIQUE,
    UpstreamRules,
    manual_thinking,
    tool_loop_without_thinking,
    mark_signature,
    read_mark,
)
from twisted_relay.translation.table import (
    ROW_ORIGINAL,
    ROW_REPAIRED,
    ROW,
    ROW_UPSTREAM,
    Entry,
    TranslationTable,
    table_from_rows,
)


@dataclass(frozen=True)
class Rewrite:
    """
    One id a :class:`ResponseTranslator` changed in a response.

    :ivar block_type: the ``type`` of the block that carried the id.
    :ivar field: :data:`ID`, :data:`TOOL_USE_ID` or :data:`CALLER_TOOL_ID`.
    :ivar upstream_id: the id the upstream emitted.
    :ivar client_id: the id the client receives.
    :ivar occurrence: declarations: ``k``; references: ``None``.
    :ivar suspected_double_emission: a declaration whose id, name and input
        repeat those of a declaration earlier in the same response. In a
        stream only what ``content_block_start`` carries is compared, and its
        ``input`` is ``{}``, so there the name alone decides.
    :ivar minted: the upstream emitted the declaration with an empty or no id
        (:attr:`upstream_id` is then ``""``) and the relay gave it one.
    """

    block_type: str | None
    field: str
    upstream_id: str
    client_id: str
    occurrence: int | None
    suspected_double_emission: bool = False
    minted: bool = False


class _Union:
    """Membership in either of two containers, without copying either."""

    __slots__ = ("base", "local")

    def __init__(self, base: Any, local: Any) -> None:
        self.base = base
        self.local = local

    def __contains__(self, item: object) -> bool:
        return item in self.local or item in self.base


class _History:
    """
    What the walk of a request leaves for its response: read-only once built.

    :ivar rules: the :class:`UpstreamRules` of the upstream.
    :ivar declared: client id -> offset, in the flat table rows, of the most
        recent declaration with that id.
    :ivar counts: original id -> number of declarations with it.
    :ivar upstream_ids: the upstream ids sent, before any encoding (``unique``,
        and the ids of an ``original`` upstream with ``own_ids``; empty
        otherwise).
    :ivar upstream_to_client: upstream id (as sent, encoded or not) -> client
        id of the most recent declaration sent with it.
    :ivar rows: the walk's table rows (see ``ROW``).
    :ivar thinking: ``(message index, block index, maker, sent)`` per marked
        thinking block.
    """

    __slots__ = ("counts", "declared", "policy", "rows", "rules", "thinking", "upstream_ids",
                 "upstream_to_client")

    def __init__(self, rules: UpstreamRules) -> None:
        self.rules = rules
        self.policy = rules.policy
        self.declared: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        self.upstream_ids: set[str] = set()
        self.upstream_to_client: dict[str, str] = {}
        self.rows: list = []
        self.thinking: list[tuple] = []

    def declarations(self) -> int:
        """How many declarations the history holds (counted when asked: rarely)."""
        rows = self.rows
        return sum(1 for at in range(3, len(rows), ROW) if rows[at] == DECLARATION)


def _writable_block(content: list, copy: list | None, bi: int) -> list:
    """
    The copy of ``content`` (made now if need be) whose block ``bi`` is a copy
    too, so that the client's objects are never written to.
    """
    if copy is None:
        copy = list(content)
    if copy[bi] is content[bi]:
        copy[bi] = dict(content[bi])
    return copy

# Stands, in a copied content list, for a block left out.
_LEFT_OUT = object()


def _walk(messages: list, history: _History) -> tuple[list, list[tuple]]:
    """
    Walk ``messages`` in walk order, filling ``history``.

    :return: the table rows, flat (see ``ROW``); and for every message with
        a changed block, ``(message index, message, content)`` where
        ``content`` is a new list holding copies of the changed blocks and the
        very same objects for the others (without the blocks left out).
    """
    rules = history.rules
    unique = rules.policy == UNIQUE
    accepts = rules.accepted_ids
    accepted = {} if accepts is None else accepts.memo
    own = rules.own_match
    track_sent = unique or own is not None
    declared = history.declared
    counts = history.counts
    upstream_ids = history.upstream_ids
    upstream_to_client = history.upstream_to_client
    thinking = history.thinking
    # (stem, separator) -> j such that every repair candidate below j is taken;
    # the taken sets only grow, so it stays true and keeps repairs linear.
    repair_floor: dict[tuple[str, str], int] = {}
    rows: list = []
    add_row = rows.extend
    rewritten: list[tuple] = []

    def refer(block_type: str | None, field: str, ref: str) -> str:
        # The upstream id of the reference ``ref`` of block ``bi`` of message
        # ``mi``: its declaration's, or (an orphan) ``ref`` itself encoded if
        # need be; recorded as a table row.
        at = declared.get(ref)
        if at is None:
            upstream = ref if accepts is None or accepts(ref) else encode_id(ref)
            add_row((mi, bi, field, REFERENCE, block_type, ref, upstream, None, None, -1, -1,
                     False, None if upstream == ref else ref))
        else:
            upstream = rows[at + ROW_UPSTREAM]
            add_row((mi, bi, field, REFERENCE, block_type, ref, upstream, rows[at + ROW_ORIGINAL],
                     None, rows[at], rows[at + 1], rows[at + ROW_REPAIRED], None))
        return upstream

    for mi, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if not isinstance(content, list):
            continue
        new_content = None
        left_out = False
        for bi, block in enumerate(content):
            if not isinstance(block, dict):
                continue
            block_type = block.get("type")
            if not isinstance(block_type, str):
                block_type = None
            # A block's own references point at earlier blocks, so they are
            # resolved before its declaration (if any) is recorded. (The
            # fields are read here, so that a block with no reference costs
            # no call.)
            ref = block.get("tool_use_id")
            caller = block.get("caller")
            if isinstance(ref, str) or isinstance(caller, dict):
                swapped = swap_references(block, block_type, ref, caller, refer, True)
                if swapped is not None:
                    if new_content is None:
                        new_content = list(content)
                    new_content[bi] = swapped
                if isinstance(caller, dict):
                    # the reference the thinking test below reads
                    ref = caller.get("tool_id")
            if block_type is None or not (block_type == "tool_use" or block_type.endswith("_tool_use")):
                if ref is None and block_type in SIGNED_FIELDS:
                    signed = SIGNED_FIELDS[block_type]
                    value = block.get(signed)
                    if isinstance(value, str) and value.startswith(THINKING_MARK):
                        mark = read_mark(value)
                        if mark is not None:
                            sent = mark[0] == rules.name
                            thinking.append((mi, bi, mark[0], sent))
                            if sent:
                                new_content = _writable_block(content, new_content, bi)
                                new_content[bi][signed] = mark[1]
                            else:
                                if new_content is None:
                                    new_content = list(content)
                                new_content[bi] = _LEFT_OUT
                                left_out = True
                continue
            client_id = block.get("id")
            if not isinstance(client_id, str):
                continue
            separator = "-" if block_type == "tool_use" else "_"
            original = decode_declaration(client_id, separator, counts)
            k = counts.get(original, 0) + 1
            counts[original] = k
            repaired = False
            if not unique and (own is None or own(original) is not None):
                upstream = original
                if track_sent:
                    upstream_ids.add(upstream)
            elif client_id in upstream_ids:
                repaired = True
                key = (client_id, separator)
                upstream, j = free_id(
                    client_id, separator, repair_floor.get(key, 2), declared, upstream_ids
                )
                repair_floor[key] = j + 1
                upstream_ids.add(upstream)
            else:
                upstream = client_id
                upstream_ids.add(upstream)
            encoded_from = None
            if accepts is not None and not (accepted.get(upstream) or accepts(upstream)):
                encoded_from = upstream
                upstream = encode_id(upstream)
            declared[client_id] = len(rows)
            upstream_to_client[upstream] = client_id
            add_row((mi, bi, ID, DECLARATION, block_type, client_id, upstream, original, k, -1, -1, repaired,
                     encoded_from))
            if upstream != client_id:
                new_content = _writable_block(content, new_content, bi)
                new_content[bi]["id"] = upstream
        if new_content is not None:
            if left_out:
                new_content = [b for b in new_content if b is not _LEFT_OUT]
            rewritten.append((mi, message, new_content))
    history.rows = rows
    return rows, rewritten


def _rewritten_body(body: dict, messages: list, rewritten: list[tuple]) -> dict:
    """
    A copy of ``body`` whose messages are those ``rewritten`` names, copied,
    and the very same objects for the others. A message left with no block
    (it held nothing but another upstream's thinking) is left out.
    """
    new_messages = list(messages)
    emptied = False
    for mi, message, content in rewritten:
        if not content and message.get("content"):
            new_messages[mi] = _LEFT_OUT
            emptied = True
            continue
        new_message = new_messages[mi] = dict(message)
        new_message["content"] = content
    if emptied:
        new_messages = [m for m in new_messages if m is not _LEFT_OUT]
    new_body = dict(body)
    new_body["messages"] = new_messages
    return new_body


class ResponseTranslator:
    """
    Rewrites the ids of one upstream response, block by block in response
    order, from upstream ids to client ids.

    It continues the request's walk as if each translated block already stood
    at the end of the history, which is where the client will put it: so the
    next request's walk makes the same decisions about it.

    :ivar rewrites: one :class:`Rewrite` per id changed so far.
    """

    def __init__(self, history: _History) -> None:
        self._policy = history.policy
        self._history = history
        rules = history.rules
        self._mark = rules.name if rules.mark_thinking else None
        #: whether :meth:`translate_delta` can change anything (the SSE gate
        #: reads signature deltas only then)
        self.marks_thinking = rules.mark_thinking
        # the history's declarations, counted when a block needs an id;
        # and this answer's so far
        self._declarations: int | None = None
        self._answered = 0
        self._client_ids: set[str] = set()
        self._upstream_ids: set[str] = set()
        self._counts: dict[str, int] = {}
        self._upstream_to_client: dict[str, str] = {}
        self._declared = _Union(history.declared, self._client_ids)
        self._originals = _Union(history.counts, self._counts)
        self._sent = _Union(history.upstream_ids, self._upstream_ids)
        # upstream id -> [(name, input)] of this response's declarations
        self._emitted: dict[str, list[tuple[Any, Any]]] = {}
        self.rewrites: list[Rewrite] = []

    def translate_block(self, block: Any) -> bool:
        """
        Rewrite, in place, the ids of one content block as the upstream
        emitted it (a ``content_block_start``'s ``content_block``, or one
        element of a message's ``content``).

        :return: whether anything changed.
        """
        if not isinstance(block, dict):
            return False
        block_type = block.get("type")
        if not isinstance(block_type, str):
            block_type = None
        changed = False
        ref = block.get("tool_use_id")
        caller = block.get("caller")
        if isinstance(ref, str) or isinstance(caller, dict):
            changed = swap_references(block, block_type, ref, caller, self._refer, False) is not None
        if block_type is not None:
            if block_type == "tool_use" or block_type.endswith("_tool_use"):
                emitted = block.get("id")
                if isinstance(emitted, str) and emitted:
                    changed = self._declare(block, block_type, emitted) or changed
                else:
                    changed = self._declare(block, block_type, None)
            elif self._mark is not None and block_type in SIGNED_FIELDS:
                signed = SIGNED_FIELDS[block_type]
                value = block.get(signed)
                if isinstance(value, str) and value:
                    block[signed] = mark_signature(self._mark, value)
                    changed = True
        return changed

    def translate_delta(self, delta: Any) -> bool:
        """
        Rewrite, in place, one ``content_block_delta``'s ``delta``: a
        ``signature_delta`` gets this upstream's mark (when its rules say
        so); every other delta is left alone.

        :return: whether anything changed.
        """
        if self._mark is None or not isinstance(delta, dict) or delta.get("type") != "signature_delta":
            return False
        value = delta.get("signature")
        if not isinstance(value, str) or not value:
            return False
        delta["signature"] = mark_signature(self._mark, value)
        return True

    def translate_message(self, message: Any) -> bool:
        """
        Rewrite every block of ``message["content"]`` in order (a
        non-streaming answer, or a ``message_start``'s ``message``).

        :return: whether anything changed.
        """
        if not isinstance(message, dict):
            return False
        content = message.get("content")
        if not isinstance(content, list):
            return False
        changed = False
        for block in content:
            changed = self.translate_block(block) or changed
        return changed

    def _refer(self, block_type: str | None, field: str, upstream_id: str) -> str:
        """
        The client id of the reference ``upstream_id``: that of the most
        recent declaration sent as ``upstream_id`` (recorded as a
        :class:`Rewrite` when it differs), else ``upstream_id`` itself.
        """
        client_id = self._upstream_to_client.get(upstream_id)
        if client_id is None:
            client_id = self._history.upstream_to_client.get(upstream_id)
            if client_id is None:
                return upstream_id
        if client_id != upstream_id:
            self.rewrites.append(Rewrite(block_type, field, upstream_id, client_id, None))
        return client_id

    def _declare(self, block: dict, block_type: str, wire: str | None) -> bool:
        """
        Decide the client id of a declaration the upstream emitted as
        ``wire`` (``None``: with an empty or no id, so the relay mints one).
        """
        separator = "-" if block_type == "tool_use" else "_"
        self._answered += 1
        if wire is None:
            if self._declarations is None:
                self._declarations = self._history.declarations()
            emitted = minted_id(block_type, self._declarations + self._answered)
        else:
            emitted = wire
        declared = self._declared
        originals = self._originals
        if self._policy == UNIQUE:
            taken = self._sent
            collides = emitted in declared or emitted in taken
        else:
            taken = ()
            # Every client id decodes to itself or is a lookalike, so the
            # first test is implied by the others; it is kept (a dict lookup)
            # so that client uniqueness does not rest on that argument alone.
            collides = (
                emitted in declared
                or emitted in originals
                or is_lookalike(emitted, originals)
            )
        client_id = emitted
        if collides:
            k = self._occurrences(emitted) + 1
            client_id, _ = free_id(emitted, separator, max(k, 2), declared, taken)
        # Record the block exactly as the next request's walk will read it.
        original = decode_declaration(client_id, separator, originals)
        k = self._occurrences(original) + 1
        self._counts[original] = k
        self._client_ids.add(client_id)
        if self._policy == UNIQUE:
            self._upstream_ids.add(client_id)
        if wire is None:
            block["id"] = client_id
            self.rewrites.append(Rewrite(block_type, ID, "", client_id, k, minted=True))
            return True
        self._upstream_to_client[emitted] = client_id
        seen = (block.get("name"), block.get("input"))
        earlier = self._emitted.setdefault(emitted, [])
        double = collides and seen in earlier
        earlier.append(seen)
        if client_id == emitted:
            return False
        block["id"] = client_id
        self.rewrites.append(Rewrite(block_type, ID, emitted, client_id, k, double))
        return True

    def _occurrences(self, original: str) -> int:
        """How many declarations so far, history and response, have ``original``."""
        local = self._counts.get(original)
        return self._history.counts.get(original, 0) if local is None else local


class RequestTranslation:
    """
    The translation of one request.

    :ivar policy: :data:`UNIQUE` or :data:`ORIGINAL`.
    :ivar changed: whether any upstream-bound id differs from the client's.
    :ivar upstream_body: the body to send upstream: the client's body itself
        when nothing changed, else a new dict sharing every unchanged object.
    """

    def __init__(self, policy: str, upstream_body: dict, changed: bool,
                 history: _History, rows: list, thinking_disabled: bool = False) -> None:
        self.policy = policy
        self.upstream_body = upstream_body
        self.changed = changed
        self.thinking_disabled = thinking_disabled
        self._history = history
        self._rows = rows
        self._table: TranslationTable | None = None

    @property
    def rules(self) -> UpstreamRules:
        """The :class:`UpstreamRules` this request was translated for."""
        return self._history.rules

    @property
    def table(self) -> TranslationTable:
        """
        The :class:`TranslationTable`; built on first use, since most requests
        never need it (it is for dumps and diagnostics).
        """
        if self._table is None:
            history = self._history
            self._table = table_from_rows(self.policy, self._rows, history.rules, history.thinking,
                                           self.thinking_disabled)
        return self._table

    @property
    def entries(self) -> int:
        """How many ids the table holds (declarations and references)."""
        return len(self._rows) // ROW

    @property
    def repairs(self) -> list[Entry]:
        """The declarations sent upstream under a repaired id."""
        if not any(self._rows[ROW_REPAIRED::ROW]):
            # None (a reference is marked only when its declaration is):
            # no table to build for a large history.
            return []
        return self.table.repairs

    @property
    def orphans(self) -> list[Entry]:
        """The references that point at no earlier declaration."""
        return self.table.orphans

    def forget_body(self) -> None:
        """
        Drop :attr:`upstream_body` (once it is serialised): nothing else in
        the translation needs it, and a large body's objects are freed.
        """
        self.upstream_body = None

    def response(self) -> ResponseTranslator:
        """A fresh :class:`ResponseTranslator` for one response to this request."""
        return ResponseTranslator(self._history)

    def parts(self, size: int = 20_000) -> tuple[tuple, list[tuple]]:
        """
        This translation as plain values, for another process: a head and
        parts of at most ``size`` values each. :meth:`assembled` and
        :meth:`add_part` put it together again a part at a time, in order,
        so that no one step is long. The body is not in them (it is sent as
        bytes).
        """
        history = self._history
        parts: list[tuple] = []
        for name, values in (
            ("rows", self._rows),
            ("thinking", history.thinking),
            ("declared", list(history.declared.items())),
            ("counts", list(history.counts.items())),
            ("upstream_ids", list(history.upstream_ids)),
            ("upstream_to_client", list(history.upstream_to_client.items())),
        ):
            for start in range(0, len(values), size):
                parts.append((name, values[start:start + size]))
        return (self.policy, self.changed, self.thinking_disabled), parts

    @classmethod
    def assembled(cls, rules: UpstreamRules, head: tuple) -> RequestTranslation:
        """
        The translation :meth:`parts` gave ``head`` of, made for ``rules``,
        empty until every part is added (:meth:`add_part`).
        """
        policy, changed, thinking_disabled = head
        history = _History(rules)
        return cls(policy, None, changed, history, history.rows, thinking_disabled)

    def add_part(self, part: tuple) -> None:
        """Add one of the parts :meth:`parts` gave."""
        name, values = part
        history = self._history
        if name in ("rows", "thinking"):
            getattr(history, name).extend(values)
        elif name == "upstream_ids":
            history.upstream_ids.update(values)
        elif name in ("declared", "counts", "upstream_to_client"):
            getattr(history, name).update(values)
        else:
            raise ValueError(f"not a part of a translation: {name!r}")

    def __repr__(self) -> str:
        return "<RequestTranslation policy=%s changed=%s entries=%d>" % (self.policy, self.changed, self.entries)



def translate_request(body: dict, policy: str | UpstreamRules = UNIQUE) -> RequestTranslation:
    """
    Translate one request's ids for the upstream, walking its whole history.

    ``body`` is never mutated. Messages, contents, blocks or ids of an
    unexpected shape carry no usable id and are skipped.

    :param body: the client's request body (a JSON object).
    :param policy: the :class:`UpstreamRules` of the upstream, or just its
        policy (:data:`UNIQUE` or :data:`ORIGINAL`) for the default rules of
        one upstream.
    :raises ValueError: for an unknown policy.
    """
    if isinstance(policy, UpstreamRules):
        rules = policy
    else:
        rules = DEFAULT_RULES.get(policy)
        if rules is None:
            raise ValueError(f"unknown upstream id policy {policy!r}; expected one of {POLICIES}")
    history = _History(rules)
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return RequestTranslation(rules.policy, body, False, history, [])
    rows, rewritten = _walk(messages, history)
    crossing = rules.mark_thinking
    if (crossing or history.thinking) and manual_thinking(body) and tool_loop_without_thinking(
        messages, rewritten, crossing
    ):
        # Anthropic's rule, for manual thinking only: the final assistant
        # message of a tool loop starts with a thinking block. Its block was
        # another upstream's (or it had none), so this one request goes
        # without thinking: the one field deleted, nothing put in its place
        # (docs/id-translation.md, invariant 12). Adaptive, between_tools and
        # unknown thinking have no such rule and are never touched.
        new_body = _rewritten_body(body, messages, rewritten) if rewritten else dict(body)
        del new_body["thinking"]
        return RequestTranslation(rules.policy, new_body, True, history, rows, True)
    if not rewritten:
        return RequestTranslation(rules.policy, body, False, history, rows)
    return RequestTranslation(rules.policy, _rewritten_body(body, messages, rewritten), True, history, rows)
