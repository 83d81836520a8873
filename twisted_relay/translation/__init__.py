# -*- test-case-name: tests.test_translation -*-
"""
Tool-use id translation: the pure core of the relay.

This package implements ``docs/id-translation.md`` (the contract) without any
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

Every public name is importable from here; they live in:

- :mod:`twisted_relay.translation.ids`: the id algebra (occurrence suffixes,
  decoding, :func:`encode_id`, :func:`minted_id`) and where ids sit in a
  block (:func:`is_declaration`, the field names, the one reference helper);
- :mod:`twisted_relay.translation.rules`: :class:`UpstreamRules`, the
  policies and id patterns, and the thinking marks;
- :mod:`twisted_relay.translation.table`: :class:`TranslationTable` and its
  entries, the value dumps store and replay rebuilds;
- :mod:`twisted_relay.translation.walk`: :func:`translate_request` (the
  request walk) and :class:`ResponseTranslator` (its mirror on the answer).

Each module imports only those listed before it.
"""

from twisted_relay.translation.ids import (
    CALLER_TOOL_ID,
    DECLARATION,
    ENCODED_PREFIX,
    ID,
    REFERENCE,
    TOOL_USE_ID,
    encode_id,
    is_declaration,
    minted_id,
    separator_for,
)
from twisted_relay.translation.rules import (
    ANTHROPIC_ID_PATTERN,
    DEFAULT_ID_PATTERN,
    MANUAL_THINKING,
    ORIGINAL,
    POLICIES,
    THINKING_MARK,
    UNIQUE,
    UpstreamRules,
    mark_signature,
    read_mark,
)
from twisted_relay.translation.table import Entry, ThinkingEntry, TranslationTable
from twisted_relay.translation.walk import RequestTranslation, ResponseTranslator, Rewrite, translate_request

__all__ = [
    "ANTHROPIC_ID_PATTERN",
    "CALLER_TOOL_ID",
    "DECLARATION",
    "DEFAULT_ID_PATTERN",
    "ENCODED_PREFIX",
    "ID",
    "MANUAL_THINKING",
    "ORIGINAL",
    "POLICIES",
    "REFERENCE",
    "THINKING_MARK",
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
