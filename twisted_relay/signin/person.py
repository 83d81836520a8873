# -*- test-case-name: tests.test_signin_person -*-
"""
Who a session token speaks for.

A :class:`Person` is a signed-in human as the identity provider described
them (``sub``, ``email``, ``groups``), with the two names the rest of the
relay meters and caps by: ``name`` (the user, as a relay key's name is) and
``group`` (their team, the IdP group the ``[signin]`` table maps to one).
It stands wherever a :class:`~twisted_relay.relay_keys.RelayKey` does
(metering, dumps, spend limits read ``name`` and ``group`` only).

Pure: no Twisted, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Person"]


@dataclass(frozen=True)
class Person:
    """
    A signed-in person.

    :ivar sub: the identity provider's subject (stable id).
    :ivar email: their email address, lower case.
    :ivar groups: their IdP groups, as the ID token listed them.
    :ivar name: the user they are metered and capped as (a relay key
        name's alphabet: their email when it fits, else ``person-`` and a
        digest of ``sub``).
    :ivar group: the relay group their IdP groups map to, or ``None``.
    :ivar session_id: the id of the session token they presented (its
        ``jti``), what a revocation names; ``None`` outside a request.
    """

    sub: str
    email: str
    groups: tuple[str, ...] = ()
    name: str = ""
    group: str | None = None
    session_id: str | None = None
