# -*- test-case-name: tests.test_translation -*-
"""
The translation table: what a request's translation did, as a plain value.

The request walk writes one flat row per declaration and reference (the
layout is ``ROW`` below); :func:`table_from_rows` turns those rows, when a
dump, a log line or ``twisted-relay-replay`` asks, into a
:class:`TranslationTable` of :class:`Entry` and :class:`ThinkingEntry`
values, which :meth:`TranslationTable.to_dict` and
:meth:`TranslationTable.from_dict` round-trip through JSON (dumps and
replay) and :meth:`TranslationTable.format` prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twisted_relay.translation.ids import DECLARATION, REFERENCE, is_minted
from twisted_relay.translation.rules import POLICIES, UpstreamRules

_TABLE_VERSION = 1


# A table row is ROW consecutive items of one flat list, in this order:
# message index, block index, field, kind, block type, client id, upstream id,
# original id, occurrence, pointed-at message index (-1: none), pointed-at
# block index, repaired, encoded from (declarations and orphans; None: not
# encoded; a reference's is read from its declaration's row when the table is
# built). The walk keeps no other per-block object alive (a declaration is
# known by the offset of its row), so it gives the cyclic garbage collector
# nothing to traverse on a long history.
ROW = 13
ROW_UPSTREAM = 6
ROW_ORIGINAL = 7
ROW_REPAIRED = 11


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
        id pattern refused it (:func:`~twisted_relay.translation.ids.encode_id`);
        else ``None``.
    :ivar minted: declarations: the client id is one the relay gave a block
        the upstream emitted with no id
        (:func:`~twisted_relay.translation.ids.minted_id`).
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




def table_from_rows(policy: str, rows: list, rules: UpstreamRules, thinking: list[tuple],
                     thinking_disabled: bool) -> TranslationTable:
    """
    The :class:`TranslationTable` of a walk's flat ``rows`` (see ``ROW``)
    and its ``(message index, block index, maker, sent)`` thinking tuples.
    """
    entries = []
    encodings = {}
    n = 0
    for at in range(0, len(rows), ROW):
        (mi, bi, field, kind, block_type, client_id, upstream, original, k, pmi, pbi,
         repaired, encoded_from) = rows[at:at + ROW]
        minted = False
        if kind == DECLARATION:
            n += 1
            minted = is_minted(client_id, block_type, n)
            encodings[(mi, bi)] = encoded_from
        elif pmi >= 0:
            encoded_from = encodings[(pmi, pbi)]
        entries.append(Entry(mi, bi, field, kind, block_type, client_id, upstream, original, k,
                             None if pmi < 0 else (pmi, pbi), repaired, encoded_from, minted))
    return TranslationTable(
        policy, tuple(entries), rules, tuple(ThinkingEntry(*t) for t in thinking), thinking_disabled)
