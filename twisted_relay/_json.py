"""JSON serialisation for bytes on the wire, shared by the relay's parts."""

from __future__ import annotations

import ujson

__all__ = ["to_json"]


def to_json(value) -> bytes:
    """
    Serialise ``value`` as compact UTF-8 JSON. A lone surrogate (a valid
    JSON escape with no UTF-8 form) makes the whole value fall back to ASCII
    escapes instead of failing.
    """
    try:
        return ujson.dumps(value, ensure_ascii=False, escape_forward_slashes=False).encode("utf-8")
    except UnicodeEncodeError:
        return ujson.dumps(value, ensure_ascii=True, escape_forward_slashes=False).encode("ascii")
