"""
The few top-level edits of a Messages body that a wire asks for
(:mod:`twisted_relay.wires`), made while the body is serialised for an
attempt (:func:`twisted_relay.body_work.prepare`), in the relay's process
or in a body worker's: plain values, no Twisted, no I/O.
"""

from __future__ import annotations

import base64
from typing import Any, NamedTuple

import ujson

__all__ = ["NO_EDIT", "BodyForm"]


class BodyForm(NamedTuple):
    """
    The top-level edits of a Messages body a wire asks for, applied to the
    translated body just before it is serialised: plain values, so that a
    body worker process can apply them too.

    :ivar drop: fields removed (``model``, ``stream``).
    :ivar add: fields set, replacing the client's (``anthropic_version``).
    :ivar defaults: fields set only where the client gave none.
    :ivar envelope: the serialised body is wrapped again: ``"bedrock-count"``
        puts it, base64, in Bedrock's CountTokens shape.
    :ivar translate: the body becomes another protocol's
        (:func:`twisted_relay.openai.to_upstream_protocol`: ``openai-responses``,
        ``openai-responses-count``, ``openai-chat``, ``openai-chat-count``).
    :ivar context: the translation's
        :class:`~twisted_relay.openai.context.TranslateContext`, as a tuple.
    """

    drop: tuple[str, ...] = ()
    add: tuple[tuple[str, Any], ...] = ()
    defaults: tuple[tuple[str, Any], ...] = ()
    envelope: str | None = None
    translate: str | None = None
    context: tuple = ()

    def __bool__(self) -> bool:
        return bool(self.drop or self.add or self.defaults or self.envelope or self.translate)

    def apply(self, body: dict) -> dict:
        """``body`` with the edits made (a shallow copy; ``body`` is not changed)."""
        edited = dict(body)
        for name in self.drop:
            edited.pop(name, None)
        for name, value in self.defaults:
            edited.setdefault(name, value)
        for name, value in self.add:
            edited[name] = value
        return edited

    def wrap(self, data: bytes) -> bytes:
        """The bytes to send for the serialised body ``data``."""
        if self.envelope == "bedrock-count":
            inner = base64.b64encode(data).decode("ascii")
            return ujson.dumps({"input": {"invokeModel": {"body": inner}}}).encode("utf-8")
        return data


#: No edit: the body goes as the translation made it.
NO_EDIT = BodyForm()
