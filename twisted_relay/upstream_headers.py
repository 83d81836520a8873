# -*- test-case-name: tests.test_upstream -*-
"""
The header rules of the upstream leg: which of a client's headers go
upstream (credentials replaced or stripped, hop-by-hop ones and those the
relay sets itself dropped, control bytes refused), and which of an
upstream's answer headers reach the client.

Pure functions of ``Headers``: no connection, no I/O.
"""

from __future__ import annotations

import re
from typing import Iterable

from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from twisted_relay.errors import RelayError
from twisted_relay.redact import redact_text

__all__ = [
    "ATTRIBUTION_HEADERS",
    "HOP_BY_HOP",
    "attribution_of",
    "client_response_headers",
    "connection_tokens",
    "upstream_request_headers",
]

#: Headers that describe one connection, never the message (RFC 9110 7.6.1).
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)

# Not hop-by-hop, but the relay sets them itself on each side: the length of
# a body it may rewrite, the host it talks to, and no compression, because
# the relay must read the bytes it forwards.
_NOT_FORWARDED_UPSTREAM = HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"accept-encoding",
    b"expect",
}
_NOT_FORWARDED_TO_CLIENT = HOP_BY_HOP | {
    b"content-length",
    b"date",
    b"server",
}
# Azure's SDKs and Foundry's send a key in api-key too.
_CREDENTIALS = (b"x-api-key", b"authorization", b"api-key")

#: Claude Code's attribution headers (its gateway protocol): a gateway may
#: consume them for cost and tracing and need not forward them. The relay
#: records them (log line, dumps) and forwards them only when told to
#: (``--forward-attribution``).
ATTRIBUTION_HEADERS = (
    b"x-app",
    b"x-claude-code-session-id",
    b"x-claude-code-agent-id",
    b"x-claude-code-parent-agent-id",
    b"x-claude-code-prompt-id",
    b"x-claude-code-managed-settings-checksum",
)
_NOT_FORWARDED_UPSTREAM_NOR_ATTRIBUTION = _NOT_FORWARDED_UPSTREAM | frozenset(ATTRIBUTION_HEADERS)
# The most characters of one attribution value the relay records.
_ATTRIBUTION_CHARS = 200


def attribution_of(headers: Headers, secrets: Iterable[str] = ()) -> dict[str, str]:
    """
    The attribution headers a client sent, by name (``x-claude-code-session-id``
    ...), each its first value as text, ``secrets`` and keys removed
    (:func:`~twisted_relay.redact.redact_text`), then cut at 200 characters:
    what the log line, the dumps and the usage ledger record.
    """
    found = {}
    for name in ATTRIBUTION_HEADERS:
        values = headers.getRawHeaders(name)
        if values:
            # Redacted whole: a key cut in two would no longer be found.
            text = redact_text(values[0].decode("latin-1"), secrets)
            if len(text) > _ATTRIBUTION_CHARS:
                text = text[:_ATTRIBUTION_CHARS] + "...(%d chars)" % (len(text),)
            found[name.decode("ascii")] = text
    return found


def _connection_tokens(headers: Headers) -> set[bytes]:
    """Header names listed in ``Connection``: hop-by-hop for this message."""
    tokens = set()
    for value in headers.getRawHeaders(b"connection", []):
        for token in value.split(b","):
            token = token.strip().lower()
            if token:
                tokens.add(token)
    return tokens


def _copy_headers(headers: Headers, skip: Iterable[bytes]) -> Headers:
    skip = set(skip) | _connection_tokens(headers)
    copied = Headers()
    for name, values in headers.getAllRawHeaders():
        if name.lower() not in skip:
            copied.setRawHeaders(name, list(values))
    return copied


# What RFC 9110 5.5 does not allow in a field value: control bytes other
# than horizontal tab, and DEL. (Twisted's server refuses CR, LF and NUL itself.)
_CONTROL_BYTES = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def _refuse_control_bytes(headers: Headers) -> None:
    """
    Refuse (400) headers whose values hold control bytes: forwarded, they
    could be read differently by each server on the way.
    """
    for name, values in headers.getAllRawHeaders():
        for value in values:
            if _CONTROL_BYTES.search(value) is not None:
                raise RelayError(
                    400,
                    "The value of header %s holds a control character, which HTTP does not allow."
                    % (name.decode("latin-1")[:100],),
                )


def upstream_request_headers(
    client_headers: Headers,
    upstream_key: str | None,
    *,
    strip_credentials: bool = False,
    forward_attribution: bool = True,
) -> Headers:
    """
    The headers to send upstream for a client's request.

    Every end-to-end header passes through verbatim (``anthropic-*``,
    ``user-agent``, ``content-type``, ...). With an upstream key configured,
    the client's own credentials are replaced by it; with
    ``strip_credentials`` (the client's key is a relay key) they are never
    forwarded; without ``forward_attribution``, Claude Code's attribution
    headers (:data:`ATTRIBUTION_HEADERS`) stay with the relay.

    :raises RelayError: 400 for a forwarded value holding a control byte.
    """
    skipped = _NOT_FORWARDED_UPSTREAM if forward_attribution else _NOT_FORWARDED_UPSTREAM_NOR_ATTRIBUTION
    headers = _copy_headers(client_headers, skipped)
    _refuse_control_bytes(headers)
    if upstream_key or strip_credentials:
        for name in _CREDENTIALS:
            headers.removeHeader(name)
    if upstream_key:
        headers.setRawHeaders(b"x-api-key", [upstream_key.encode("utf-8")])
    return headers


def client_response_headers(upstream_headers: Headers, connection_tokens: Iterable[bytes] = ()) -> Headers:
    """
    The upstream's response headers as the client should get them.

    ``request-id``, rate-limit headers, ``retry-after`` and
    ``x-should-retry`` pass through; hop-by-hop headers, those the upstream's
    ``Connection`` header names (``connection_tokens``, see
    :func:`connection_tokens`) and those the relay's own server writes do not.
    """
    return _copy_headers(upstream_headers, _NOT_FORWARDED_TO_CLIENT | frozenset(connection_tokens))


def connection_tokens(response: IResponse) -> frozenset[bytes]:
    """
    The header names, lower-cased, that an upstream response's
    ``Connection`` header lists: hop-by-hop for that response alone
    (RFC 9110 7.6.1). Twisted keeps ``Connection`` apart from
    ``response.headers``; the relay's connections note its tokens
    (``_twisted``, ``connection_header``). Empty where they could not.
    """
    # Under treq's wrappers (its response, a decoder's) is Twisted's response.
    while response is not None:
        tokens = getattr(response, "relay_connection_tokens", None)
        if tokens is not None:
            return tokens
        response = getattr(response, "original", None)
    return frozenset()
