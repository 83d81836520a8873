# -*- test-case-name: tests.test_logins_keys -*-
"""
A static key in named headers: the login of an upstream whose key never
changes while the relay runs.

Microsoft Foundry takes its key in ``x-api-key`` or ``api-key`` (Anthropic's
SDK sends both); Claude Platform on AWS takes it in ``x-api-key`` with the
workspace in ``anthropic-workspace-id`` on every request. :class:`KeyLogin`
says which headers get the key and which fixed headers go with it; whatever
credentials the client sent are removed first, so the client's own key never
reaches the upstream beside the relay's.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from twisted.web.http_headers import Headers

from twisted_relay.logins.base import Login

__all__ = [
    "ANTHROPIC_AWS_KEY_HEADERS",
    "CLIENT_CREDENTIAL_HEADERS",
    "FOUNDRY_KEY_HEADERS",
    "KeyLogin",
    "clear_credentials",
]

#: The headers a client may carry its own credentials in; every login removes
#: them before it puts its own on (``api-key`` is Azure's name).
CLIENT_CREDENTIAL_HEADERS = (b"x-api-key", b"authorization", b"api-key")
#: Microsoft Foundry reads either header; the SDK sends both (the SDK's
#: issue 1661: a gateway that read only one refused the other).
FOUNDRY_KEY_HEADERS = ("x-api-key", "api-key")
#: Claude Platform on AWS takes an API key in ``x-api-key`` (not as a bearer).
ANTHROPIC_AWS_KEY_HEADERS = ("x-api-key",)


def clear_credentials(headers: Headers) -> None:
    """Remove every credential a client sent (:data:`CLIENT_CREDENTIAL_HEADERS`)."""
    for name in CLIENT_CREDENTIAL_HEADERS:
        headers.removeHeader(name)


def _header_value(value: str, what: str) -> bytes:
    """``value`` as header bytes; refused, without being shown, when it cannot be one."""
    if not value.isascii() or not value.isprintable():
        raise ValueError("%s holds a character a header value cannot carry" % (what,))
    return value.encode("ascii")


class KeyLogin(Login):
    """
    Put one static key in named headers, and fixed headers beside it.

    :param key: the key; never shown by ``repr`` nor in any error.
    :param headers: the header names that carry the key
        (:data:`FOUNDRY_KEY_HEADERS`, :data:`ANTHROPIC_AWS_KEY_HEADERS`).
    :param fixed: header names and values sent with every request
        (``{"anthropic-workspace-id": "wrkspc_..."}``); not secrets: shown
        by ``repr``.
    """

    name = "key"

    def __init__(self, key: str, headers: Iterable[str] = ("x-api-key",), fixed: Mapping[str, str] | None = None):
        names = tuple(headers)
        if not key:
            raise ValueError("the key is empty")
        if not names:
            raise ValueError("name at least one header for the key")
        fixed = dict(fixed or {})
        self._check_names(names + tuple(fixed))
        self._key = [_header_value(key, "the key")]
        self._names = tuple(name.lower().encode("ascii") for name in names)
        self._fixed = tuple(
            (name.lower().encode("ascii"), [_header_value(value, name)]) for name, value in fixed.items()
        )
        self._shown_names = names
        self._shown_fixed = fixed

    @staticmethod
    def _check_names(names: Iterable[str]) -> None:
        for name in names:
            if not name or not name.isascii() or any(c in name for c in " :\r\n\t"):
                raise ValueError("%r is not a header name" % (name,))

    @classmethod
    def foundry(cls, key: str) -> "KeyLogin":
        """Microsoft Foundry's key login: the key in ``x-api-key`` and ``api-key``."""
        return cls(key, FOUNDRY_KEY_HEADERS)

    @classmethod
    def anthropic_aws(cls, key: str, workspace_id: str) -> "KeyLogin":
        """Claude Platform on AWS with an API key: ``x-api-key`` and ``anthropic-workspace-id``."""
        if not workspace_id:
            raise ValueError("Claude Platform on AWS needs a workspace id")
        return cls(key, ANTHROPIC_AWS_KEY_HEADERS, {"anthropic-workspace-id": workspace_id})

    def authorize(self, method: bytes, url: str, headers: Headers, body: bytes | None) -> None:
        """Replace the client's credentials with the key, and set the fixed headers."""
        clear_credentials(headers)
        for name in self._names:
            headers.setRawHeaders(name, self._key)
        for name, value in self._fixed:
            headers.setRawHeaders(name, value)

    def __repr__(self) -> str:
        return "KeyLogin(<hidden>, headers=%r, fixed=%r)" % (self._shown_names, self._shown_fixed)
