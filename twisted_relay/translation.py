# -*- test-case-name: tests.test_translation -*-
"""
Tool-use id translation: the pure core of the relay.

This module implements ``docs/id-translation.md`` (the contract) without any
I/O and without Twisted: :func:`translate_request` walks one request's whole
history and returns the body to send upstream together with a
:class:`TranslationTable`; :meth:`RequestTranslation.response` gives a
:class:`ResponseTranslator` that rewrites, block by block, the ids of the one
upstream response to that request.

Each request is translated for one upstream, whose rules are a plain
:class:`UpstreamRules` value: its id policy, the id pattern it accepts (an id
outside it goes as :func:`encode_id` of it), the ids an ``original`` upstream
calls its own, and whether thinking is marked with its maker (a conversation
that can cross upstreams). Declarations emitted without an id get one
(:func:`minted_id`). ``docs/id-translation.md`` has the rules and why.

The relay keeps no state between requests. Every decision about a block is a
function of what precedes that block in walk order, so a block's client id and
upstream id never change on later turns, and a response translator continues
the walk exactly where the next request's walk will find it.

The encoding (both policies):

- A *suffix* is a separator (``-`` for ``tool_use``, ``_`` for every other
  declaration type) followed by ASCII digits. An id is a *lookalike* when
  stripping one or more suffixes (of either separator) from its end reaches an
  original id already seen.
- The emitted id ``X`` of a new declaration collides when it is a client id
  already declared; under ``unique`` also when it is an upstream id already
  sent; under ``original`` also when it is an original already seen or a
  lookalike. A colliding ``X`` becomes ``X<sep>j``, ``j`` the smallest integer
  ``>= max(k, 2)`` whose result is free (``k``: the occurrence of ``X``).
- Decoding a client id ``D`` of a block with separator ``s``: when ``D`` is
  ``S + s + digits`` and ``S`` is an original already seen or a lookalike, the
  original is ``S``; otherwise it is ``D`` itself. Because encoder and decoder
  look at the same preceding history, decoding is exact for every id the relay
  produced, including natively emitted ids that end in ``-<digits>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

__all__ = [
    "ANTHROPIC_ID_PATTERN",
    "CALLER_TOOL_ID",
    "DECLARATION",
    "DEFAULT_ID_PATTERN",
    "ENCODED_PREFIX",
    "ID",
    "ORIGINAL",
    "POLICIES",
    "REFERENCE",
    "TOOL_USE_ID",
    "UNIQUE",
    "Entry",
    "RequestTranslation",
    "ResponseTranslator",
    "Rewrite",
    "ThinkingEntry",
    "TranslationTable",
    "UpstreamRules",
    "encode_id",
    "is_declaration",
    "mark_signature",
    "minted_id",
    "read_mark",
    "separator_for",
    "translate_request",
]

#: Upstream receives pairwise distinct ids (the default).
UNIQUE = "unique"
#: Upstream receives the ids it originally emitted.
ORIGINAL = "original"
#: Every accepted value of ``--upstream-ids``.
POLICIES = (UNIQUE, ORIGINAL)

#: :attr:`Entry.kind` of a block that introduces an id.
DECLARATION = "declaration"
#: :attr:`Entry.kind` of a field that points at a declaration.
REFERENCE = "reference"

#: The id field of a declaration.
ID = "id"
#: The reference field of ``tool_result`` and ``*_tool_result`` blocks.
TOOL_USE_ID = "tool_use_id"
#: The reference inside a block's ``caller`` object.
CALLER_TOOL_ID = "caller.tool_id"

_DIGITS = "0123456789"
_SEPARATORS = "-_"
_TABLE_VERSION = 1


def is_declaration(block: Any) -> bool:
    """
    Whether ``block`` introduces a tool-use id: its ``type`` is ``tool_use``
    or ends in ``_tool_use``. The id itself may still be missing or unusable.
    """
    if not isinstance(block, dict):
        return False
    block_type = block.get("type")
    return isinstance(block_type, str) and (
        block_type == "tool_use" or block_type.endswith("_tool_use")
    )


def separator_for(block_type: str) -> str:
    """
    The suffix separator for a declaration type: ``-`` for ``tool_use`` (the
    report's shape), ``_`` for the rest (``server_tool_use`` ids may not hold
    a hyphen; ``_`` is inside every alphabet seen).
    """
    return "-" if block_type == "tool_use" else "_"


def _is_lookalike(candidate: str, originals: Any) -> bool:
    """
    Whether stripping one or more suffixes from ``candidate`` reaches an
    original in ``originals``.
    """
    while True:
        head = candidate.rstrip(_DIGITS)
        if len(head) == len(candidate) or not head or head[-1] not in _SEPARATORS:
            return False
        candidate = head[:-1]
        if candidate in originals:
            return True


def _decode(client_id: str, separator: str, originals: Any) -> str:
    """
    The original id of a declaration whose client id is ``client_id``, given
    the originals seen before it.
    """
    head = client_id.rstrip(_DIGITS)
    if len(head) < len(client_id) and head and head[-1] == separator:
        stem = head[:-1]
        if stem in originals or _is_lookalike(stem, originals):
            return stem
    return client_id


def _free_id(stem: str, separator: str, start: int, taken: Any, also_taken: Any) -> tuple[str, int]:
    """
    The first ``stem<separator>j``, ``j >= start``, in neither ``taken`` nor
    ``also_taken``, and that ``j``. Terminates: every rejected candidate is a
    distinct member of a finite set.
    """
    j = start
    while True:
        candidate = f"{stem}{separator}{j}"
        if candidate not in taken and candidate not in also_taken:
            return candidate, j
        j += 1


# -- ids each upstream accepts ------------------------------------------------

#: The tool-use id pattern Anthropic's API enforces.
ANTHROPIC_ID_PATTERN = r"^[a-zA-Z0-9_-]+$"
#: The value of :attr:`UpstreamRules.id_pattern` that means "the policy's
#: default": :data:`ANTHROPIC_ID_PATTERN` for ``unique``, none for ``original``.
DEFAULT_ID_PATTERN = "default"
#: Every encoded upstream id starts with this; an id that starts with it is
#: always encoded, so encoded and unencoded upstream ids never meet.
ENCODED_PREFIX = "twr_"

_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_ACCEPTED_MEMO_LIMIT = 65536


def encode_id(value: str) -> str:
    """
    The injective encoding of ``value`` into ``[A-Za-z0-9_]``, prefixed with
    :data:`ENCODED_PREFIX`: ASCII letters and digits stay, ``_`` becomes
    ``__``, any other character ``c`` becomes ``_<hex of ord(c)>_``. Each
    token is read unambiguously from the left, so two ids never share an
    encoding.
    """
    out = [ENCODED_PREFIX]
    for ch in value:
        if ch in _ALNUM:
            out.append(ch)
        elif ch == "_":
            out.append("__")
        else:
            out.append(f"_{ord(ch):x}_")
    return "".join(out)


def minted_id(block_type: str, n: int) -> str:
    """
    The id the relay gives the ``n``-th declaration (1-based, walk order) of a
    conversation when the upstream emitted it with no id: ``toolu_relay<n>``
    (``srvtoolu_relay<n>`` for ``server_tool_use``). It ends in digits after
    a letter, so it never reads as a rewrite; taken, it gets a suffix.
    """
    if block_type == "server_tool_use":
        return f"srvtoolu_relay{n}"
    return f"toolu_relay{n}"


# -- thinking stays with its maker --------------------------------------------

#: The start of the mark the relay puts in front of a thinking block's
#: ``signature`` (a ``redacted_thinking`` block's ``data``) on its way to the
#: client: ``relay:<quoted upstream name>:<what the upstream sent>``.
#: Signatures are base64; none holds a ``:``.
THINKING_MARK = "relay:"
#: The block types whose opaque field carries a maker's signature.
_SIGNED_FIELDS = {"thinking": "signature", "redacted_thinking": "data"}


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


def _thinking_on(body: dict) -> bool:
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled")


@dataclass(frozen=True)
class UpstreamRules:
    """
    What one upstream accepts, as a plain value given to
    :func:`translate_request`.

    :ivar name: the upstream's name; marks its thinking blocks.
    :ivar policy: :data:`UNIQUE` or :data:`ORIGINAL`.
    :ivar id_pattern: a regular expression every upstream-bound id must match
        (searched with ``fullmatch``); an id that does not is sent as
        :func:`encode_id` of it. :data:`DEFAULT_ID_PATTERN`:
        :data:`ANTHROPIC_ID_PATTERN` under ``unique``, none under
        ``original``; ``None``: none.
    :ivar own_ids: ``original`` only: a regular expression for the ids this
        upstream makes; only declarations whose original id matches it go back
        as the upstream emitted them, the others go as under ``unique``.
        ``None``: every id is its own.
    :ivar mark_thinking: the conversation may move between upstreams: mark
        the thinking blocks of this upstream's answers with ``name``, so that
        later requests send them to this upstream only; and send a tool loop
        whose final assistant message does not start with thinking without
        ``thinking`` (``docs/id-translation.md``, invariant 12).
    :raises ValueError: for an unknown policy, a pattern that does not
        compile, or an ``id_pattern`` that refuses the encoded ids.
    """

    name: str = "upstream"
    policy: str = UNIQUE
    id_pattern: str | None = DEFAULT_ID_PATTERN
    own_ids: str | None = None
    mark_thinking: bool = False
    _accepts: Any = field(default=None, init=False, repr=False, compare=False)
    _own: Any = field(default=None, init=False, repr=False, compare=False)

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
            object.__setattr__(self, "_accepts", _AcceptedIds(compiled))
        if self.own_ids is not None:
            object.__setattr__(self, "_own", _compile(self.own_ids, "own ids pattern").fullmatch)

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


_DEFAULT_RULES = {policy: UpstreamRules(policy=policy) for policy in POLICIES}


@dataclass(frozen=True)
class Entry:
    """
    One declaration or reference of a request's history.

    :ivar message_index: index of the message in ``messages``.
    :ivar block_index: index of the block in that message's ``content``.
    :ivar field: :data:`ID`, :data:`TOOL_USE_ID` or :data:`CALLER_TOOL_ID`.
    :ivar kind: :data:`DECLARATION` or :data:`REFERENCE`.
    :ivar block_type: the block's ``type``, or ``None`` when it is not a string.
    :ivar client_id: the id as the client sent it.
    :ivar upstream_id: the id as the relay sends it upstream.
    :ivar original_id: declarations: the decoded original id (exact under
        ``original``; under ``unique``, where lookalikes that collide with
        nothing are left alone, a best reading). References: the original id
        of the declaration pointed at, ``None`` for an orphan.
    :ivar occurrence: declarations: ``k``, the occurrence of the original id;
        references: ``None``.
    :ivar points_to: references: ``(message_index, block_index)`` of the
        declaration pointed at, ``None`` for an orphan; declarations: ``None``.
    :ivar repaired: declarations: the client's id repeated an earlier upstream
        id and was sent upstream under a fresh one (``unique`` only).
        References: the declaration pointed at was repaired.
    :ivar encoded_from: the id :attr:`upstream_id` encodes, when the upstream's
        id pattern refused it (:func:`encode_id`); else ``None``.
    :ivar minted: declarations: the client id is one the relay gave a block
        the upstream emitted with no id (:func:`minted_id`).
    """

    message_index: int
    block_index: int
    field: str
    kind: str
    block_type: str | None
    client_id: str
    upstream_id: str
    original_id: str | None
    occurrence: int | None
    points_to: tuple[int, int] | None
    repaired: bool = False
    encoded_from: str | None = None
    minted: bool = False

    @property
    def orphan(self) -> bool:
        """Whether this is a reference to no earlier declaration."""
        return self.kind == REFERENCE and self.points_to is None

    @property
    def changed(self) -> bool:
        """Whether the upstream receives another id than the client sent."""
        return self.upstream_id != self.client_id

    def to_dict(self) -> dict[str, Any]:
        """This entry as a JSON-able dict."""
        return {
            "message_index": self.message_index,
            "block_index": self.block_index,
            "field": self.field,
            "kind": self.kind,
            "block_type": self.block_type,
            "client_id": self.client_id,
            "upstream_id": self.upstream_id,
            "original_id": self.original_id,
            "occurrence": self.occurrence,
            "points_to": None if self.points_to is None else list(self.points_to),
            "repaired": self.repaired,
            "encoded_from": self.encoded_from,
            "minted": self.minted,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Entry:
        """
        The entry that :meth:`to_dict` gave ``data``; unknown keys are ignored.

        :raises ValueError: when a field is missing.
        """
        try:
            points_to = data["points_to"]
            return cls(
                message_index=data["message_index"],
                block_index=data["block_index"],
                field=data["field"],
                kind=data["kind"],
                block_type=data["block_type"],
                client_id=data["client_id"],
                upstream_id=data["upstream_id"],
                original_id=data["original_id"],
                occurrence=data["occurrence"],
                points_to=None if points_to is None else tuple(points_to),
                repaired=data["repaired"],
                encoded_from=data.get("encoded_from"),
                minted=bool(data.get("minted", False)),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a translation table entry: {e!r}") from e


_COLUMNS = (
    ("msg", lambda e: str(e.message_index)),
    ("blk", lambda e: str(e.block_index)),
    ("kind", lambda e: e.kind),
    ("type", lambda e: str(e.block_type)),
    ("field", lambda e: e.field),
    ("client id", lambda e: e.client_id),
    ("upstream id", lambda e: e.upstream_id),
    ("original", lambda e: "" if e.original_id is None else e.original_id),
    ("k", lambda e: "" if e.occurrence is None else str(e.occurrence)),
    ("points to", lambda e: "" if e.points_to is None else "%d.%d" % e.points_to),
    ("note", lambda e: " ".join(
        note for note, on in (
            ("orphan", e.orphan), ("repaired", e.repaired), ("minted", e.minted),
            ("encodes " + str(e.encoded_from), e.encoded_from is not None),
        ) if on)),
)


@dataclass(frozen=True)
class ThinkingEntry:
    """
    What a request's translation did with one marked thinking block.

    :ivar message_index: index of the message in ``messages``.
    :ivar block_index: index of the block in that message's ``content``.
    :ivar maker: the upstream named by the block's mark.
    :ivar sent: whether it went upstream (its mark removed); else it was left
        out, being another upstream's.
    """

    message_index: int
    block_index: int
    maker: str
    sent: bool

    def to_dict(self) -> dict[str, Any]:
        """This entry as a JSON-able dict."""
        return {"message_index": self.message_index, "block_index": self.block_index,
                "maker": self.maker, "sent": self.sent}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ThinkingEntry:
        """
        The entry :meth:`to_dict` gave ``data``.

        :raises ValueError: when a field is missing.
        """
        try:
            return cls(data["message_index"], data["block_index"], data["maker"], data["sent"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a thinking entry: {e!r}") from e


@dataclass(frozen=True)
class TranslationTable:
    """
    The translation table of one request: every declaration and reference of
    its history in walk order. A plain value: equal tables compare equal, and
    :meth:`to_dict` / :meth:`from_dict` round-trip it through JSON.

    :ivar policy: :data:`UNIQUE` or :data:`ORIGINAL`.
    :ivar entries: the :class:`Entry` values, in walk order.
    :ivar rules: the :class:`UpstreamRules` the request was translated for,
        ``None`` in a table from before they existed.
    :ivar thinking: a :class:`ThinkingEntry` per marked thinking block.
    :ivar thinking_disabled: the request went upstream without ``thinking``
        (see ``docs/id-translation.md``, invariant 11).
    """

    policy: str
    entries: tuple[Entry, ...] = ()
    rules: UpstreamRules | None = None
    thinking: tuple[ThinkingEntry, ...] = ()
    thinking_disabled: bool = False

    @property
    def encodings(self) -> list[Entry]:
        """The entries sent upstream under an encoded id."""
        return [e for e in self.entries if e.encoded_from is not None]

    @property
    def minted(self) -> list[Entry]:
        """The declarations whose client id the relay minted."""
        return [e for e in self.entries if e.minted]

    @property
    def repairs(self) -> list[Entry]:
        """The declarations sent upstream under a repaired id."""
        return [e for e in self.entries if e.repaired and e.kind == DECLARATION]

    @property
    def orphans(self) -> list[Entry]:
        """The references that point at no earlier declaration."""
        return [e for e in self.entries if e.orphan]

    def to_dict(self) -> dict[str, Any]:
        """This table as a JSON-able dict."""
        return {
            "version": _TABLE_VERSION,
            "policy": self.policy,
            "rules": None if self.rules is None else self.rules.to_dict(),
            "entries": [e.to_dict() for e in self.entries],
            "thinking": [t.to_dict() for t in self.thinking],
            "thinking_disabled": self.thinking_disabled,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TranslationTable:
        """
        The table that :meth:`to_dict` gave ``data``.

        :raises ValueError: when ``data`` is not such a table.
        """
        if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
            raise ValueError("not a translation table")
        if data.get("version") != _TABLE_VERSION:
            raise ValueError(f"unknown translation table version {data.get('version')!r}")
        if data.get("policy") not in POLICIES:
            raise ValueError(f"unknown policy {data.get('policy')!r}")
        rules = data.get("rules")
        try:
            thinking = tuple(ThinkingEntry.from_dict(t) for t in data.get("thinking") or ())
        except TypeError as e:
            raise ValueError(f"not a translation table: {e}") from e
        return cls(
            data["policy"],
            tuple(Entry.from_dict(e) for e in data["entries"]),
            None if rules is None else UpstreamRules.from_dict(rules),
            thinking,
            bool(data.get("thinking_disabled", False)),
        )

    def format(self) -> str:
        """A human-readable text table with one row per entry."""
        rows = [[text(e) for _, text in _COLUMNS] for e in self.entries]
        header = [name for name, _ in _COLUMNS]
        widths = [max([len(header[i])] + [len(r[i]) for r in rows]) for i in range(len(header))]
        lines = [
            "policy: %s; %d declarations, %d references, %d repaired, %d orphans"
            % (
                self.policy,
                sum(1 for e in self.entries if e.kind == DECLARATION),
                sum(1 for e in self.entries if e.kind == REFERENCE),
                len(self.repairs),
                len(self.orphans),
            )
        ]
        if self.rules is not None:
            rules = self.rules
            lines.append(f"upstream: {rules.name}; id pattern: {rules.id_pattern}; own ids: {rules.own_ids};"
                         f" {len(self.encodings)} encoded, {len(self.minted)} minted")
        for row in [header] + rows:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        for t in self.thinking:
            lines.append(f"thinking {t.message_index}.{t.block_index} made by {t.maker}: "
                         + ("sent" if t.sent else "left out"))
        if self.thinking_disabled:
            lines.append("thinking: the request went upstream without it")
        return "\n".join(lines) + "\n"


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
    :ivar rows: the walk's table rows (see ``_ROW``).
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
        return sum(1 for at in range(3, len(rows), _ROW) if rows[at] == DECLARATION)


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


# A table row is _ROW consecutive items of one flat list, in this order:
# message index, block index, field, kind, block type, client id, upstream id,
# original id, occurrence, pointed-at message index (-1: none), pointed-at
# block index, repaired, encoded from (declarations and orphans; None: not
# encoded; a reference's is read from its declaration's row when the table is
# built). The walk keeps no
# other per-block object alive (a declaration is known by the offset of its
# row), so it gives the cyclic garbage collector nothing to traverse on a
# long history.
_ROW = 13
_UPSTREAM = 6
_ORIGINAL = 7
_REPAIRED = 11

# Stands, in a copied content list, for a block left out.
_LEFT_OUT = object()


def _walk(messages: list, history: _History) -> tuple[list, list[tuple]]:
    """
    Walk ``messages`` in walk order, filling ``history``.

    :return: the table rows, flat (see ``_ROW``); and for every message with
        a changed block, ``(message index, message, content)`` where
        ``content`` is a new list holding copies of the changed blocks and the
        very same objects for the others (without the blocks left out).
    """
    rules = history.rules
    unique = rules.policy == UNIQUE
    accepts = rules._accepts
    accepted = {} if accepts is None else accepts.memo
    own = rules._own
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
            # resolved before its declaration (if any) is recorded.
            ref = block.get("tool_use_id")
            if isinstance(ref, str):
                at = declared.get(ref)
                if at is None:
                    upstream = ref if accepts is None or accepts(ref) else encode_id(ref)
                    add_row((mi, bi, TOOL_USE_ID, REFERENCE, block_type, ref, upstream, None, None, -1, -1,
                             False, None if upstream == ref else ref))
                else:
                    upstream = rows[at + _UPSTREAM]
                    add_row((mi, bi, TOOL_USE_ID, REFERENCE, block_type, ref, upstream, rows[at + _ORIGINAL],
                             None, rows[at], rows[at + 1], rows[at + _REPAIRED], None))
                if upstream != ref:
                    new_content = _writable_block(content, new_content, bi)
                    new_content[bi]["tool_use_id"] = upstream
            caller = block.get("caller")
            if isinstance(caller, dict):
                ref = caller.get("tool_id")
                if isinstance(ref, str):
                    at = declared.get(ref)
                    if at is None:
                        upstream = ref if accepts is None or accepts(ref) else encode_id(ref)
                        add_row((mi, bi, CALLER_TOOL_ID, REFERENCE, block_type, ref, upstream, None, None, -1, -1,
                                 False, None if upstream == ref else ref))
                    else:
                        upstream = rows[at + _UPSTREAM]
                        add_row((mi, bi, CALLER_TOOL_ID, REFERENCE, block_type, ref, upstream,
                                 rows[at + _ORIGINAL], None, rows[at], rows[at + 1], rows[at + _REPAIRED], None))
                    if upstream != ref:
                        new_content = _writable_block(content, new_content, bi)
                        new_caller = dict(caller)
                        new_caller["tool_id"] = upstream
                        new_content[bi]["caller"] = new_caller
            if block_type is None or not (block_type == "tool_use" or block_type.endswith("_tool_use")):
                if ref is None and block_type in _SIGNED_FIELDS:
                    signed = _SIGNED_FIELDS[block_type]
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
            original = _decode(client_id, separator, counts)
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
                upstream, j = _free_id(
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


def _starts_with_thinking(content: Any) -> bool:
    if not isinstance(content, list) or not content or not isinstance(content[0], dict):
        return False
    return content[0].get("type") in _SIGNED_FIELDS


def _tool_loop_without_thinking(messages: list, rewritten: list[tuple], crossing: bool) -> bool:
    """
    Whether the final assistant message, followed by tool results, does not
    start with a thinking block once other upstreams' thinking is left out:
    because a block was left out, or (``crossing``: the conversation may have
    been elsewhere) whatever the reason.
    """
    last = None
    for mi in range(len(messages) - 1, -1, -1):
        message = messages[mi]
        if isinstance(message, dict) and message.get("role") == "assistant":
            last = mi
            break
    if last is None:
        return False
    content = next((c for mi, _, c in rewritten if mi == last), None)
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
        if isinstance(ref, str):
            client_id = self._client_for(ref)
            if client_id is not None and client_id != ref:
                block["tool_use_id"] = client_id
                self.rewrites.append(Rewrite(block_type, TOOL_USE_ID, ref, client_id, None))
                changed = True
        caller = block.get("caller")
        if isinstance(caller, dict):
            ref = caller.get("tool_id")
            if isinstance(ref, str):
                client_id = self._client_for(ref)
                if client_id is not None and client_id != ref:
                    caller["tool_id"] = client_id
                    self.rewrites.append(Rewrite(block_type, CALLER_TOOL_ID, ref, client_id, None))
                    changed = True
        if block_type is not None:
            if block_type == "tool_use" or block_type.endswith("_tool_use"):
                emitted = block.get("id")
                if isinstance(emitted, str) and emitted:
                    changed = self._declare(block, block_type, emitted) or changed
                else:
                    changed = self._declare(block, block_type, None)
            elif self._mark is not None and block_type in _SIGNED_FIELDS:
                signed = _SIGNED_FIELDS[block_type]
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

    def _client_for(self, upstream_id: str) -> str | None:
        """The client id of the most recent declaration sent as ``upstream_id``."""
        client_id = self._upstream_to_client.get(upstream_id)
        if client_id is None:
            client_id = self._history.upstream_to_client.get(upstream_id)
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
                or _is_lookalike(emitted, originals)
            )
        client_id = emitted
        if collides:
            k = self._occurrences(emitted) + 1
            client_id, _ = _free_id(emitted, separator, max(k, 2), declared, taken)
        # Record the block exactly as the next request's walk will read it.
        original = _decode(client_id, separator, originals)
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
            rows = self._rows
            entries = []
            encodings = {}
            n = 0
            for at in range(0, len(rows), _ROW):
                (mi, bi, field, kind, block_type, client_id, upstream, original, k, pmi, pbi,
                 repaired, encoded_from) = rows[at:at + _ROW]
                minted = False
                if kind == DECLARATION:
                    n += 1
                    minted = _is_minted(client_id, block_type, n)
                    encodings[(mi, bi)] = encoded_from
                elif pmi >= 0:
                    encoded_from = encodings[(pmi, pbi)]
                entries.append(Entry(mi, bi, field, kind, block_type, client_id, upstream, original, k,
                                     None if pmi < 0 else (pmi, pbi), repaired, encoded_from, minted))
            history = self._history
            self._table = TranslationTable(
                self.policy, tuple(entries), history.rules,
                tuple(ThinkingEntry(*t) for t in history.thinking), self.thinking_disabled)
        return self._table

    @property
    def repairs(self) -> list[Entry]:
        """The declarations sent upstream under a repaired id."""
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

    def __repr__(self) -> str:
        return "<RequestTranslation policy=%s changed=%s entries=%d>" % (
            self.policy, self.changed, len(self._rows) // _ROW)


def _is_minted(client_id: str, block_type: str | None, n: int) -> bool:
    """Whether ``client_id`` is what the relay mints for the ``n``-th declaration."""
    minted = minted_id(block_type or "", n)
    if client_id == minted:
        return True
    rest = client_id[len(minted) + 1:]
    return (client_id.startswith(minted) and client_id[len(minted)] in _SEPARATORS
            and rest.isdigit() and rest.isascii())


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
        rules = _DEFAULT_RULES.get(policy)
        if rules is None:
            raise ValueError(f"unknown upstream id policy {policy!r}; expected one of {POLICIES}")
    history = _History(rules)
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return RequestTranslation(rules.policy, body, False, history, [])
    rows, rewritten = _walk(messages, history)
    crossing = rules.mark_thinking
    if (crossing or history.thinking) and _thinking_on(body) and _tool_loop_without_thinking(
        messages, rewritten, crossing
    ):
        # Anthropic's rule: with thinking on, the final assistant message of
        # a tool loop starts with a thinking block. Its block was another
        # upstream's (or it had none), so this one request goes without
        # thinking (docs/id-translation.md, invariant 12).
        new_body = _rewritten_body(body, messages, rewritten) if rewritten else dict(body)
        del new_body["thinking"]
        return RequestTranslation(rules.policy, new_body, True, history, rows, True)
    if not rewritten:
        return RequestTranslation(rules.policy, body, False, history, rows)
    return RequestTranslation(rules.policy, _rewritten_body(body, messages, rewritten), True, history, rows)
