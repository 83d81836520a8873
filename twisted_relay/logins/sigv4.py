# -*- test-case-name: tests.test_sigv4 -*-
"""
AWS Signature Version 4 over exactly the bytes the relay sends: pure (no
Twisted, no botocore), tested against botocore's ``SigV4Auth``.

What is signed (docs/aws.md):

- the method and the URL as it goes on the wire: its path encoded once more
  for the canonical request, as botocore does for every service but S3 (an
  ARN's ``/`` goes out as ``%2F`` and is signed as ``%252F``; a ``:`` that
  goes out raw is signed as ``%3A``, one sent as ``%3A`` as ``%253A``);
- the query, each name and value encoded as AWS canonicalizes them (for a
  query already in that form, botocore's result from the URL);
- ``host`` as Twisted's HTTP client writes it (the host, and ``:port`` for
  a port not the scheme's default) unless the request carries its own;
- every header the request carries but those an HTTP stack may add,
  duplicate or rewrite (:data:`UNSIGNED`: ``content-length``,
  ``connection``, ``user-agent``, ``transfer-encoding``...), values trimmed
  and inner runs of spaces made one, several values joined by commas;
- the SHA-256 of the body.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable
from functools import lru_cache
from urllib.parse import quote, unquote_to_bytes

__all__ = [
    "ALGORITHM",
    "EMPTY_SHA256",
    "UNSIGNED",
    "SigV4Signer",
    "amz_date",
    "canonical_path",
    "canonical_query",
    "canonical_url",
    "wire_host",
]

ALGORITHM = "AWS4-HMAC-SHA256"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()

#: Headers never signed: botocore's list (hop-by-hop headers, tracing) and
#: those the relay's HTTP stack writes or rewrites itself after signing
#: (Twisted writes ``content-length``; treq adds, the relay's agent removes,
#: ``accept-encoding``). ``authorization`` is what the signature goes in.
UNSIGNED = frozenset(
    {
        b"accept-encoding",
        b"authorization",
        b"baggage",
        b"connection",
        b"content-length",
        b"expect",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"traceparent",
        b"tracestate",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"user-agent",
        b"x-amzn-trace-id",
    }
)

_DEFAULT_PORTS = {"http": 80, "https": 443}


@lru_cache(maxsize=4)
def _amz_date_of_second(second: int) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(second))


def amz_date(seconds: float) -> str:
    """The ``x-amz-date`` value of a Unix time: ``20261204T101500Z`` (kept for the last seconds asked)."""
    return _amz_date_of_second(int(seconds))


def wire_host(scheme: str, netloc: str) -> str:
    """
    The ``Host`` header Twisted's HTTP client writes for a URL's scheme and
    network location (``Agent._computeHostValue``): the host, with
    ``:port`` when the port is not the scheme's default; an IPv6 address in
    brackets. Lower case, as the relay's URLs are made (hyperlink) and as
    botocore signs it.
    """
    host, port = netloc, None
    if ":" in netloc:
        before, _, after = netloc.rpartition(":")
        if after.isdigit():
            host, port = before, int(after)
    host = host.strip("[]").lower()
    if ":" in host:
        host = "[%s]" % (host,)
    if port is None or port == _DEFAULT_PORTS.get(scheme):
        return host
    return "%s:%d" % (host, port)


def canonical_path(path: str) -> str:
    """
    The path as the canonical request has it: dot segments and empty
    segments removed, then percent-encoded once more, ``/`` and ``~`` kept
    (botocore's ``normalize_url_path`` and ``quote(path, safe='/~')``).
    """
    if not path:
        return "/"
    kept: list[str] = []
    for segment in path.split("/"):
        if segment == "..":
            if kept:
                kept.pop()
        elif segment and segment != ".":
            kept.append(segment)
    normal = ("/" if path[0] == "/" else "") + "/".join(kept) + ("/" if path[-1] == "/" and kept else "")
    return quote(normal, safe="/~")


def canonical_query(query: str) -> str:
    """
    The query as the canonical request has it: each name and value decoded
    and encoded again leaving only ``A-Za-z0-9-_.~`` as they are, the pairs
    sorted (by name, then value).
    """
    if not query:
        return ""
    pairs = []
    for pair in query.split("&"):
        name, _, value = pair.partition("=")
        pairs.append((quote(unquote_to_bytes(name), safe="-_.~"), quote(unquote_to_bytes(value), safe="-_.~")))
    pairs.sort()
    return "&".join("%s=%s" % pair for pair in pairs)


@lru_cache(maxsize=256)
def canonical_url(url: str) -> tuple[bytes, bytes, bytes]:
    """
    The canonical path, the canonical query and the ``host`` of a URL as it
    goes on the wire (:func:`canonical_path`, :func:`canonical_query`,
    :func:`wire_host`), kept for the last URLs signed: an upstream sends to
    a few URLs (one per model and kind), and this is a third of a
    signature's work.
    """
    scheme, netloc, path, query = _split_url(url)
    return (
        canonical_path(path).encode("ascii"),
        canonical_query(query).encode("ascii"),
        wire_host(scheme, netloc).encode("ascii"),
    )


def _split_url(url: str) -> tuple[str, str, str, str]:
    """scheme, netloc, path, query of a URL (a fragment is never sent)."""
    scheme, _, rest = url.partition("://")
    rest = rest.partition("#")[0]
    rest, _, query = rest.partition("?")
    slash = rest.find("/")
    if slash < 0:
        return scheme.lower(), rest, "", query
    return scheme.lower(), rest[:slash], rest[slash:], query


class SigV4Signer:
    """
    Signs requests for one service in one region; keeps the signing key of
    the day (four HMACs) for the secret in force.

    :param service: the signing name (``bedrock``, ``bedrock-mantle``,
        ``aws-external-anthropic``).
    :param region: the endpoint's region (``us-east-1``).
    """

    def __init__(self, service: str, region: str):
        self.service = service
        self.region = region
        self._key_for: tuple[str, str] | None = None
        self._key = b""

    def __repr__(self) -> str:
        return "SigV4Signer(%r, %r)" % (self.service, self.region)

    def signing_key(self, secret_access_key: str, day: str) -> bytes:
        """The key of ``day`` (``YYYYMMDD``), kept until the day or the secret changes."""
        if self._key_for != (secret_access_key, day):
            key = ("AWS4" + secret_access_key).encode("utf-8")
            for part in (day, self.region, self.service, "aws4_request"):
                key = hmac.new(key, part.encode("utf-8"), hashlib.sha256).digest()
            self._key_for, self._key = (secret_access_key, day), key
        return self._key

    def canonical_request(
        self, method: bytes, url: str, headers: Iterable[tuple[bytes, list[bytes]]], payload_hash: str
    ) -> tuple[bytes, bytes]:
        """
        The canonical request and its signed-header list, for ``headers`` as
        Twisted's ``Headers.getAllRawHeaders()`` gives them (each name once,
        with its values), which must already hold ``x-amz-date`` (and
        ``x-amz-security-token`` with session credentials).
        """
        path, query, host = canonical_url(url)
        signed: dict[bytes, bytes] = {}
        for name, values in headers:
            lowered = name.lower()
            if lowered in UNSIGNED:
                continue
            if len(values) == 1:
                value = b" ".join(values[0].split())
            else:
                value = b",".join([b" ".join(v.split()) for v in values])
            signed[lowered] = signed[lowered] + b"," + value if lowered in signed else value
        if b"host" not in signed:
            signed[b"host"] = host
        names = sorted(signed)
        signed_headers = b";".join(names)
        lines = [
            method.upper(),
            path,
            query,
            b"".join([b"%s:%s\n" % (name, signed[name]) for name in names]),
            signed_headers,
            payload_hash.encode("ascii"),
        ]
        return b"\n".join(lines), signed_headers

    def authorization(
        self,
        method: bytes,
        url: str,
        headers: Iterable[tuple[bytes, list[bytes]]],
        body: bytes | None,
        access_key_id: str,
        secret_access_key: str,
        date: str,
        payload_hash: str | None = None,
    ) -> bytes:
        """
        The ``Authorization`` header's value for one request.

        :param date: the request's ``x-amz-date`` (see :func:`amz_date`), which
            ``headers`` carries too.
        :param payload_hash: the body's SHA-256 in hex, when already known.
        """
        if payload_hash is None:
            payload_hash = hashlib.sha256(body).hexdigest() if body else EMPTY_SHA256
        canonical, signed_headers = self.canonical_request(method, url, headers, payload_hash)
        day = date[:8]
        scope = "%s/%s/%s/aws4_request" % (day, self.region, self.service)
        string_to_sign = "%s\n%s\n%s\n%s" % (ALGORITHM, date, scope, hashlib.sha256(canonical).hexdigest())
        signature = hmac.digest(self.signing_key(secret_access_key, day), string_to_sign.encode("ascii"), "sha256").hex()
        return b"%s Credential=%s/%s, SignedHeaders=%s, Signature=%s" % (
            ALGORITHM.encode("ascii"),
            access_key_id.encode("utf-8"),
            scope.encode("ascii"),
            signed_headers,
            signature.encode("ascii"),
        )
