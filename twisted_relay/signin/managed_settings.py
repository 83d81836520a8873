# -*- test-case-name: tests.test_signin_managed_settings -*-
"""
Managed settings: ``GET /managed/settings``, the settings an admin pushes
to every signed-in Claude Code, from a JSON file the admin writes.

The answer is the gateway protocol's ``{"uuid", "checksum", "settings"}``.
The checksum is Claude Code's own (2.1.332's ``s1``, read in its bundle):
``sha256:`` and the hex digest of ``JSON.stringify`` of the settings with
the keys of every object sorted (JavaScript's default sort: by UTF-16 code
unit). Claude Code recomputes it on what it received and sends it back as
``x-claude-code-managed-settings-checksum``, and polls with
``If-None-Match: "<checksum>"``, so :func:`canonical_json` writes exactly
what ``JSON.stringify`` writes: no whitespace, non-ASCII characters as they
are (UTF-8), control characters and lone surrogates as lower-case ``\\u``
escapes, numbers as JavaScript prints a double (``1.0`` is ``1``, ``1e21``
is ``1e+21``, an integer past 2**53 rounded to a double), and the keys that
are array indices (``"0"``, ``"10"``) first in numeric order, as a
JavaScript object holds them. The settings are served as those very bytes,
so what Claude Code parses hashes to the checksum served. ``uuid`` is the
checksum, as the first-party gateway has it.

:class:`ManagedSettings` reads the file at start (a file that is not a JSON
object is refused there, in one line: as a relay's service it reads it when
the service starts, after the start checks tried it) and again when its
size, change time or inode changes, looked at on each request (one
``stat``); a file gone bad after a change keeps the last good settings, and
says so in the log. The
file is at most :data:`MAX_SETTINGS_BYTES` and read on the reactor: a
local file of that size reads in well under a millisecond, and it is read
only when it changed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from decimal import Decimal

from twisted.application.service import Service
from twisted.logger import Logger

from twisted_relay.errors import RelayError

__all__ = [
    "MAX_SETTINGS_BYTES",
    "ManagedSettings",
    "SettingsDocument",
    "SettingsFileError",
    "canonical_json",
    "managed_settings_route",
    "read_settings_document",
    "settings_checksum",
]

#: The largest settings file the relay serves (Claude Code's own managed
#: settings are a few kilobytes).
MAX_SETTINGS_BYTES = 1 << 20
_ARRAY_INDEX = re.compile(r"(?:0|[1-9][0-9]*)\Z")
_LARGEST_INDEX = 2**32 - 2
_SAFE_INTEGER = 2**53
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class SettingsFileError(ValueError):
    """The managed settings file cannot be served; the message is one line naming the file."""


def _quoted(text: str) -> str:
    # json.dumps escapes what JSON.stringify escapes (", \\, \b \f \n \r \t,
    # the other control characters as lower-case \u00xx); a lone surrogate
    # (which JSON's \ud800 can make) JSON.stringify writes as an escape too.
    quoted = json.dumps(text, ensure_ascii=False)
    return _LONE_SURROGATE.sub(lambda found: "\\u%04x" % (ord(found.group()),), quoted)


def _js_number(value) -> str:
    """``value`` as JavaScript's ``Number.prototype.toString`` writes the double it parses to."""
    if isinstance(value, int) and -_SAFE_INTEGER <= value <= _SAFE_INTEGER:
        return str(value)
    number = float(value)  # (an integer past 2**53 is a rounded double in JavaScript too)
    if not math.isfinite(number):
        raise ValueError("a number too large for a double")
    if number == 0:
        return "0"
    sign = "-" if number < 0 else ""
    # repr is the shortest text that reads back as the same double, as
    # JavaScript's is; only the layout differs (ECMA-262 Number::toString).
    digits_tuple, exponent = Decimal(repr(abs(number))).normalize().as_tuple()[1:]
    digits = "".join(map(str, digits_tuple))
    k = len(digits)
    n = k + exponent  # value = 0.digits * 10**n
    if k <= n <= 21:
        text = digits + "0" * (n - k)
    elif 0 < n <= 21:
        text = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        text = "0." + "0" * (-n) + digits
    else:
        power = n - 1
        mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
        text = "%se%s%d" % (mantissa, "+" if power >= 0 else "-", abs(power))
    return sign + text


def _key_order(keys) -> list[str]:
    """Sorted by UTF-16 code unit, array indices first in numeric order (a JavaScript object's own order)."""
    indices = sorted(
        (key for key in keys if _ARRAY_INDEX.match(key) and int(key) <= _LARGEST_INDEX), key=int
    )
    chosen = set(indices)
    others = sorted((key for key in keys if key not in chosen), key=lambda key: key.encode("utf-16-be", "surrogatepass"))
    return indices + others


def canonical_json(value) -> str:
    """
    ``value`` (parsed JSON) as Claude Code's checksum serialises it: its
    ``JSON.stringify`` after sorting every object's keys.

    :raises ValueError: for a value JSON cannot hold (NaN, infinities,
        numbers past a double's range).
    """
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return _quoted(value)
    if isinstance(value, (int, float)):
        return _js_number(value)
    if isinstance(value, list):
        return "[" + ",".join(canonical_json(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(_quoted(key) + ":" + canonical_json(value[key]) for key in _key_order(value)) + "}"
    raise ValueError("not a JSON value: %r" % (type(value),))


def settings_checksum(settings: dict) -> str:
    """Claude Code's checksum of ``settings``: ``sha256:`` and the hex digest of :func:`canonical_json`."""
    return "sha256:" + hashlib.sha256(canonical_json(settings).encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class SettingsDocument:
    """
    What ``GET /managed/settings`` answers.

    :ivar checksum: ``sha256:...`` (also the ``uuid``).
    :ivar body: ``{"uuid","checksum","settings"}``, serialised.
    :ivar etag: the ``ETag`` header's value: the checksum quoted.
    """

    checksum: str
    body: bytes
    etag: bytes


def _refuse_constant(name: str):
    raise ValueError("%s is not a JSON number" % (name,))


def _check_keys(value, path: str = "") -> None:
    """A ``__proto__`` key: JavaScript's sort-and-copy drops it, so the checksums could not agree."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "__proto__":
                raise ValueError("it has a key named __proto__ (at %s), which Claude Code cannot hold" % (path or "the top",))
            _check_keys(item, path + "." + key if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_keys(item, "%s[%d]" % (path, index))


def read_settings_document(data: bytes, where: str) -> SettingsDocument:
    """
    The document served for the settings file's bytes ``data``.

    :param where: the file, as the error names it.
    :raises SettingsFileError: the file is not one JSON object Claude Code can take.
    """
    if len(data) > MAX_SETTINGS_BYTES:
        raise SettingsFileError("managed settings file %s: %d bytes, over the %d the relay serves" % (where, len(data), MAX_SETTINGS_BYTES))
    try:
        settings = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError:
        raise SettingsFileError("managed settings file %s: not UTF-8 text" % (where,)) from None
    except (ValueError, RecursionError) as e:
        raise SettingsFileError("managed settings file %s: not valid JSON (%s)" % (where, str(e).splitlines()[0])) from None
    if not isinstance(settings, dict):
        raise SettingsFileError(
            "managed settings file %s: must hold a JSON object (the settings, as in managed-settings.json), not %s"
            % (where, type(settings).__name__ if settings is not None else "null")
        )
    try:
        _check_keys(settings)
        text = canonical_json(settings)
    except (ValueError, RecursionError) as e:
        raise SettingsFileError("managed settings file %s: %s" % (where, e)) from None
    encoded = text.encode("utf-8", "surrogatepass")
    checksum = "sha256:" + hashlib.sha256(encoded).hexdigest()
    head = ('{"uuid":"%s","checksum":"%s","settings":' % (checksum, checksum)).encode("ascii")
    return SettingsDocument(checksum, head + encoded + b"}", b'"' + checksum.encode("ascii") + b'"')


class ManagedSettings(Service):
    """
    The managed settings file, read again when it changes.

    A service: with ``read=False`` the file is first read when the service
    starts (the relay's, in the folder and as the user the relay runs as);
    :meth:`read` raises there for a file that cannot be served.

    :param path: the JSON file the admin writes.
    :param read: read it now.
    :raises SettingsFileError: the file cannot be read, or is not a JSON
        object (one line, for the relay's start to print).
    """

    log = Logger()

    def __init__(self, path: str, *, read: bool = True):
        self.path = path
        self._seen = None
        self.document: SettingsDocument | None = None
        if read:
            self.read()

    def read(self) -> SettingsDocument:
        """
        Read the file now.

        :raises SettingsFileError: it cannot be read, or is not settings
            (the settings read before, if any, are kept).
        """
        seen = self._identity()
        document = read_settings_document(self._read(), self.path)
        self._seen, self.document = seen, document
        return document

    def startService(self):
        Service.startService(self)
        if self.document is None:
            self.read()

    def _identity(self) -> tuple[int, int, int, int]:
        try:
            found = os.stat(self.path)
        except OSError as e:
            raise SettingsFileError("managed settings file %s: %s" % (self.path, e.strerror)) from None
        return (found.st_mtime_ns, found.st_ctime_ns, found.st_size, found.st_ino)

    def _read(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                return f.read(MAX_SETTINGS_BYTES + 1)
        except OSError as e:
            raise SettingsFileError("managed settings file %s: %s" % (self.path, e.strerror)) from None

    def current(self) -> SettingsDocument:
        """
        The settings to serve now: the file's, read again if it changed
        since (the last good ones if it went bad).

        :raises SettingsFileError: it was never read, and cannot be now.
        """
        if self.document is None:
            return self.read()
        try:
            seen = self._identity()
            if seen == self._seen:
                return self.document
            self._seen = seen
            document = read_settings_document(self._read(), self.path)
        except SettingsFileError as e:
            self.log.warn("{problem}; still serving the settings read before ({checksum})", problem=str(e), checksum=self.document.checksum)
            return self.document
        if document.checksum != self.document.checksum:
            self.log.info("Managed settings read again from {path}: now {checksum}", path=self.path, checksum=document.checksum)
        self.document = document
        return document


def _matches(if_none_match: bytes | None, checksum: str) -> bool:
    """Whether an ``If-None-Match`` names the checksum (weakly or strongly; ``*`` is not taken for it)."""
    if not if_none_match:
        return False
    for tag in if_none_match.split(b","):
        tag = tag.strip()
        if tag.startswith(b"W/"):
            tag = tag[2:]
        if tag == b'"' + checksum.encode("ascii") + b'"':
            return True
    return False


async def managed_settings_route(context, request, who) -> bytes:
    """
    ``GET /managed/settings`` for ``who`` (a signed-in person or a relay
    key): the settings document with its ``ETag``, or a 304 to an
    ``If-None-Match`` naming it; a 404 when the relay has no settings file
    (Claude Code: no policy).
    """
    settings = getattr(context, "managed_settings", None)
    if settings is None:
        request.setHeader(b"cache-control", b"no-store")
        raise RelayError(404, "The relay serves no managed settings (its [signin] table names no managed_settings file).")
    try:
        document = settings.current()
    except SettingsFileError:
        # (Never read yet: the relay's start reads the file before it serves.)
        raise RelayError(503, "The relay's managed settings cannot be read now.", error_type="api_error") from None
    request.setHeader(b"etag", document.etag)
    # Each person may revalidate, never reuse it unasked; no shared cache keeps it.
    request.setHeader(b"cache-control", b"private, no-cache")
    request.setHeader(b"vary", b"authorization, x-api-key")
    if _matches(request.getHeader(b"if-none-match"), document.checksum):
        request.setResponseCode(304)
        return b""
    request.setHeader(b"content-type", b"application/json")
    return document.body
