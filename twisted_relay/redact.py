# -*- test-case-name: tests.test_dumps -*-
"""
Keep secrets out of everything the relay writes down.

Header redaction works on names (``x-api-key``, ``authorization``, anything
whose name contains ``key``, ``token``, ``secret`` or ``auth``); text
redaction removes given secret values, in every form they take once written
into JSON or a URL, and anything shaped like an Anthropic key, wherever it
appears.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from collections.abc import Iterable
from urllib.parse import parse_qsl, quote, quote_plus, urlencode, urlsplit, urlunsplit

__all__ = [
    "REDACTED",
    "MIN_HARVESTED_SECRET",
    "is_sensitive_header",
    "header_secrets",
    "redact_headers",
    "redact_text",
    "redact_url",
]

#: What a removed secret is replaced with.
REDACTED = "[REDACTED]"

#: Credentials harvested from a request's headers shorter than this are not
#: scrubbed from the text around them: a client sending ``Bearer x`` must not
#: turn every ``x`` of a dump into ``[REDACTED]``. (The header itself is
#: always redacted, and configured secrets are scrubbed whatever their length.)
MIN_HARVESTED_SECRET = 8

_SENSITIVE_NAMES = frozenset(
    {"x-api-key", "authorization", "proxy-authorization", "cookie", "set-cookie"}
)
_SENSITIVE_PARTS = ("key", "token", "secret", "auth")
# Rate-limit headers name token budgets, not credentials, and they are what
# a 429 dump is read for; their values still go through text redaction.
_HARMLESS_PREFIXES = ("anthropic-ratelimit-",)
_ANTHROPIC_KEY = r"sk-ant-[A-Za-z0-9_-]{10,}"
_ANTHROPIC_KEY_RE = re.compile(_ANTHROPIC_KEY)
_AUTH_SCHEME = re.compile(r"^\s*[A-Za-z][A-Za-z0-9._~+/-]*\s+(\S+)\s*$")


def _text(value: bytes | str) -> str:
    # Header bytes are latin-1 on the wire; decoding them so round-trips exactly.
    return value.decode("latin-1") if isinstance(value, bytes) else value


def _pairs(pairs: Iterable) -> Iterable[tuple[bytes | str, bytes | str]]:
    # Accept Twisted's ``getAllRawHeaders()`` shape, (name, [values]), too.
    for name, value in pairs:
        if isinstance(value, (list, tuple)):
            for one in value:
                yield name, one
        else:
            yield name, value


def is_sensitive_header(name: bytes | str) -> bool:
    """
    Whether a header's value is a credential and must never be written down.
    """
    lowered = _text(name).lower()
    if lowered in _SENSITIVE_NAMES:
        return True
    if lowered.startswith(_HARMLESS_PREFIXES):
        return False
    return any(part in lowered for part in _SENSITIVE_PARTS)


def header_secrets(pairs: Iterable[tuple[bytes | str, bytes | str]]) -> list[str]:
    """
    The credentials carried by sensitive headers, to scrub from the text
    around them: each whole value, and the token after an auth scheme
    (``Bearer <token>``). Values shorter than :data:`MIN_HARVESTED_SECRET`
    are left out.
    """
    found = []
    for name, value in _pairs(pairs):
        if not is_sensitive_header(name):
            continue
        text = _text(value).strip()
        found.append(text)
        scheme = _AUTH_SCHEME.match(text)
        if scheme:
            found.append(scheme.group(1))
    return [s for s in found if len(s) >= MIN_HARVESTED_SECRET]


def redact_headers(
    pairs: Iterable[tuple[bytes | str, bytes | str]], secrets: Iterable[str] = ()
) -> list[tuple[str, str]]:
    """
    Headers as ``(name, value)`` text pairs, order and repeats kept (a
    ``(name, [values])`` pair gives one pair per value), with
    the value of every sensitive header replaced by :data:`REDACTED` and the
    given secrets removed from the others.
    """
    pattern = _pattern(tuple(secrets))
    redacted = []
    for name, value in _pairs(pairs):
        name_text = _text(name)
        if is_sensitive_header(name_text):
            redacted.append((name_text, REDACTED))
        else:
            redacted.append((name_text, pattern.sub(REDACTED, _text(value))))
    return redacted


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """
    ``text`` with every secret removed: each given secret as it is, as JSON
    escapes it and as a URL quotes it, and every Anthropic-looking key
    (``sk-ant-...``). Empty secrets are ignored.
    """
    return _pattern(tuple(secrets)).sub(REDACTED, text)


def redact_url(url: str, secrets: Iterable[str] = ()) -> str:
    """
    A URL with the values of query parameters that look like credentials
    (by the same name rule as headers) replaced, then text-redacted.
    """
    parts = urlsplit(url)
    if parts.query:
        query = [
            (name, REDACTED if is_sensitive_header(name) else value)
            for name, value in parse_qsl(parts.query, keep_blank_values=True)
        ]
        # Only rebuild when something changed, so a clean URL stays byte for byte.
        if any(value == REDACTED for _, value in query):
            url = urlunsplit(parts._replace(query=urlencode(query, safe="[]")))
    return redact_text(url, secrets)


def _forms(secret: str) -> set[str]:
    """Every spelling a secret can take in a serialised dump."""
    escaped = json.dumps(secret, ensure_ascii=True)[1:-1]
    return {
        secret,
        json.dumps(secret, ensure_ascii=False)[1:-1],
        escaped,
        # Some serialisers (ujson's default) escape "/" too.
        escaped.replace("/", "\\/"),
        quote(secret, safe=""),
        quote_plus(secret, safe=""),
    }


# Logs call with the same few secrets again and again.
@lru_cache(maxsize=64)
def _pattern(secrets: tuple[str, ...]) -> re.Pattern[str]:
    forms = set()
    for secret in secrets:
        if secret:
            forms |= _forms(secret)
    # Longest first, so a secret that contains another is removed whole.
    alternatives = [re.escape(f) for f in sorted(forms, key=lambda f: (-len(f), f))]
    if not alternatives:
        return _ANTHROPIC_KEY_RE
    return re.compile("|".join(alternatives + [_ANTHROPIC_KEY]))
