# -*- test-case-name: tests.test_translation -*-
"""
The id algebra of the translation core: what an id is, where it sits in a
block, and how the relay makes new ones. Pure functions, no state.

Where ids sit: a block *declares* an id when :func:`is_declaration` (its
``id`` field, :data:`ID`); it *references* one in its ``tool_use_id``
(:data:`TOOL_USE_ID`) and in its ``caller``'s ``tool_id``
(:data:`CALLER_TOOL_ID`). :func:`swap_references` is the one place that
reads and rewrites references, for the request walk and the response
translator alike.

The occurrence suffixes (both policies):

- A *suffix* is a separator (``-`` for ``tool_use``, ``_`` for every other
  declaration type, :func:`separator_for`) followed by ASCII digits. An id is
  a *lookalike* when stripping one or more suffixes (of either separator)
  from its end reaches an original id already seen (:func:`is_lookalike`).
- The emitted id ``X`` of a new declaration collides when it is a client id
  already declared; under ``unique`` also when it is an upstream id already
  sent; under ``original`` also when it is an original already seen or a
  lookalike. A colliding ``X`` becomes ``X<sep>j``, ``j`` the smallest integer
  ``>= max(k, 2)`` whose result is free (``k``: the occurrence of ``X``;
  :func:`free_id`).
- Decoding a client id ``D`` of a block with separator ``s`` (:func:`decode_declaration`):
  when ``D`` is ``S + s + digits`` and ``S`` is an original already seen or a
  lookalike, the original is ``S``; otherwise it is ``D`` itself. Because
  encoder and decoder look at the same preceding history, decoding is exact
  for every id the relay produced, including natively emitted ids that end in
  ``-<digits>``.

New ids: :func:`encode_id` (an id an upstream's pattern refuses, written in
``[A-Za-z0-9_]`` behind :data:`ENCODED_PREFIX`) and :func:`minted_id` (a
declaration the upstream emitted with no id).
"""

from __future__ import annotations

from typing import Any, Callable

#: :attr:`~twisted_relay.translation.Entry.kind` of a block that introduces an id.
DECLARATION = "declaration"
#: :attr:`~twisted_relay.translation.Entry.kind` of a field that points at a declaration.
REFERENCE = "reference"

#: The id field of a declaration.
ID = "id"
#: The reference field of ``tool_result`` and ``*_tool_result`` blocks.
TOOL_USE_ID = "tool_use_id"
#: The reference inside a block's ``caller`` object.
CALLER_TOOL_ID = "caller.tool_id"

_DIGITS = "0123456789"
_SEPARATORS = "-_"

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


def is_lookalike(candidate: str, originals: Any) -> bool:
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


def decode_declaration(client_id: str, separator: str, originals: Any) -> str:
    """
    The original id of a declaration whose client id is ``client_id``, given
    the originals seen before it.
    """
    head = client_id.rstrip(_DIGITS)
    if len(head) < len(client_id) and head and head[-1] == separator:
        stem = head[:-1]
        if stem in originals or is_lookalike(stem, originals):
            return stem
    return client_id


def free_id(stem: str, separator: str, start: int, taken: Any, also_taken: Any) -> tuple[str, int]:
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


def swap_references(block: dict, block_type: str | None, tool_use_id: Any, caller: Any,
                     resolve: Callable[[str | None, str, str], str], copy: bool) -> dict | None:
    """
    Put in place of each reference ``block`` carries the id ``resolve(block_type,
    field, reference)`` gives for it: first its ``tool_use_id``
    (:data:`TOOL_USE_ID`), then its ``caller``'s ``tool_id``
    (:data:`CALLER_TOOL_ID`), each when it is a string. ``resolve`` records
    what it needs and returns the reference itself to leave it.

    :param tool_use_id: ``block.get("tool_use_id")``, as the caller read it.
    :param caller: ``block.get("caller")``, as the caller read it.
    :param copy: leave ``block`` untouched and write into a copy (and a copy
        of its ``caller``); else write into ``block`` itself.
    :return: the block holding the new ids (``block`` itself unless
        ``copy``); ``None`` when none changed.
    """
    swapped = None
    if isinstance(tool_use_id, str):
        new_id = resolve(block_type, TOOL_USE_ID, tool_use_id)
        if new_id != tool_use_id:
            swapped = dict(block) if copy else block
            swapped["tool_use_id"] = new_id
    if isinstance(caller, dict):
        ref = caller.get("tool_id")
        if isinstance(ref, str):
            new_id = resolve(block_type, CALLER_TOOL_ID, ref)
            if new_id != ref:
                if swapped is None:
                    swapped = dict(block) if copy else block
                if copy:
                    caller = swapped["caller"] = dict(caller)
                caller["tool_id"] = new_id
    return swapped


#: Every encoded upstream id starts with this; an id that starts with it is
#: always encoded, so encoded and unencoded upstream ids never meet.
ENCODED_PREFIX = "twr_"

_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


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


def is_minted(client_id: str, block_type: str | None, n: int) -> bool:
    """Whether ``client_id`` is what the relay mints for the ``n``-th declaration."""
    minted = minted_id(block_type or "", n)
    if client_id == minted:
        return True
    rest = client_id[len(minted) + 1:]
    return (client_id.startswith(minted) and client_id[len(minted)] in _SEPARATORS
            and rest.isdigit() and rest.isascii())
