# -*- test-case-name: tests.test_relay_keys -*-
"""
Relay keys and who they belong to.

A :class:`RelayKey` is a key clients present to the relay, with the name of
its user and their group (a team): names, never keys, go into logs,
metrics, dumps and usage records (``docs/usage.md``). :func:`parse_key_file`
reads the ``--relay-keys`` file's lines (``KEY``, ``NAME = KEY`` or ``NAME
GROUP = KEY``); :func:`unique_relay_keys` checks a set of keys, whatever
their source.

Pure: no Twisted, no I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from dataclasses import dataclass, field

__all__ = ["RelayKey", "key_name_problem", "key_pairs", "key_presented", "parse_key_file", "presented_keys", "unique_relay_keys"]

#: What a relay key's name and group may hold: a letter or digit, then
#: letters, digits, ``.``, ``_``, ``@`` and ``-`` (so that a name is a
#: metric label, a log field and a file name as it is).
_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


def key_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a relay key (or its group), or ``None`` when it can."""
    if not isinstance(name, str) or not _KEY_NAME.fullmatch(name):
        return (
            "must be 1 to 64 letters, digits, '.', '_', '@' or '-', starting with a letter or digit"
        )
    return None


@dataclass(frozen=True)
class RelayKey:
    """
    A key clients present to the relay, and who it belongs to.

    :ivar key: the key itself. Never shown by ``repr``, never logged.
    :ivar name: the user it belongs to, as logs, metrics, dumps and the
        ledger name it; a key given without one is named by a short digest
        of itself (:meth:`unnamed`).
    :ivar group: the group (a team) of its user, or ``None``.
    """

    key: str = field(repr=False)
    name: str
    group: str | None = None

    @classmethod
    def unnamed(cls, key: str) -> "RelayKey":
        """A key of the one-key-a-line format: named ``key-`` and 8 hex digits of its SHA-256."""
        return cls(key, "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:8])


def unique_relay_keys(keys) -> tuple[RelayKey, ...]:
    """
    ``keys`` as a tuple, checked: no key given twice (but a line repeated
    whole counts once), no name given to two keys (a user with several keys
    names each differently).

    :raises ValueError: naming the name at fault, never a key.
    """
    keys = tuple(dict.fromkeys(keys))  # the same key under the same name, once
    names: set[str] = set()
    seen: set[str] = set()
    for relay_key in keys:
        if relay_key.key in seen:
            raise ValueError("the key named %s is given twice" % (relay_key.name,))
        if relay_key.name in names:
            raise ValueError("two keys are named %s; each key needs a name of its own" % (relay_key.name,))
        seen.add(relay_key.key)
        names.add(relay_key.name)
    return keys


def parse_key_file(text: str) -> tuple[RelayKey, ...]:
    """
    The keys of a relay keys file: one a line, either alone (named by a
    short digest of itself) or as ``NAME = KEY`` or ``NAME GROUP = KEY``;
    blank lines and ``#`` comments skipped.

    :raises ValueError: naming the line at fault, never its key.
    """
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        words = text.split()
        if len(words) == 1:
            keys.append(RelayKey.unnamed(text))
            continue
        # A key holds no space, so "=" alone between spaces is the separator
        # (a key may hold "=" itself, as base64 does).
        if len(words) not in (3, 4) or words[-2] != "=":
            raise ValueError("line %d: write KEY, NAME = KEY or NAME GROUP = KEY (a key holds no space)" % (number,))
        key, names = words[-1], words[:-2]
        if not key.isprintable():
            raise ValueError("line %d: the key holds control characters, which no key holds" % (number,))
        for word in names:
            problem = key_name_problem(word)
            if problem is not None:
                raise ValueError("line %d: a name or group %s" % (number, problem))
        keys.append(RelayKey(key, names[0], names[1] if len(names) == 2 else None))
    if not keys:
        raise ValueError("holds no key")
    return unique_relay_keys(keys)


def presented_keys(headers, *, basic: bool = False) -> list[bytes]:
    """
    The keys a request presents: ``x-api-key`` and ``Authorization: Bearer``
    (what the SDKs send), and with ``basic`` the password of
    ``Authorization: Basic`` (what a browser sends after asking its user).
    ``headers`` is Twisted's :class:`~twisted.web.http_headers.Headers`.
    """
    presented = list(headers.getRawHeaders(b"x-api-key", []))
    for value in headers.getRawHeaders(b"authorization", []):
        scheme, _, token = value.partition(b" ")
        scheme = scheme.lower()
        if scheme == b"bearer":
            presented.append(token.strip())
        elif basic and scheme == b"basic":
            try:
                user_and_password = base64.b64decode(token.strip(), validate=True)
            except (binascii.Error, ValueError):
                continue
            presented.append(user_and_password.partition(b":")[2])
    return presented


def key_presented(keys: tuple[tuple[bytes, RelayKey], ...], headers, *, basic: bool = False) -> RelayKey | None:
    """
    Which of ``keys`` (each as bytes, with its :class:`RelayKey`) the request
    presents (:func:`presented_keys`), or ``None``. Every presented key is
    compared with every key in constant time, and the search never stops early.
    """
    found = None
    for candidate in presented_keys(headers, basic=basic):
        for key, relay_key in keys:
            if hmac.compare_digest(candidate, key) and found is None:
                found = relay_key
    return found


def key_pairs(keys) -> tuple[tuple[bytes, RelayKey], ...]:
    """``keys`` (:class:`RelayKey`) as the (bytes, key) pairs :func:`key_presented` compares."""
    return tuple((relay_key.key.encode("utf-8"), relay_key) for relay_key in keys)
