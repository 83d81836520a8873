# -*- test-case-name: tests.test_signin_tokens -*-
"""
Session tokens: what Claude Code presents as its bearer once signed in.

A session token is an HS256 JWT (made and checked with joserfc) signed with
the ``[signin]`` table's ``session_secret``, which every relay behind one
name shares: ``aud`` ``twisted-relay``, ``iss`` the relay's public URL,
``sub``, ``email`` and ``groups`` as the identity provider gave them,
``jti`` (what a revocation names), ``iat`` and ``exp``; its header's
``kid`` is the first 8 hex digits of the secret's SHA-256, so that a token
of another secret is told apart without a signature check. Claude Code
reads ``sub``, ``email`` and ``groups`` (unverified) for its telemetry.

:class:`SessionTokens` also seals what the relay keeps for a person but
must not be readable in its database (the identity provider's refresh
token): JWE ``dir`` + ``A256GCM`` under a key derived from the same secret.

Pure: no Twisted, no I/O; time comes from the clock it is given.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from dataclasses import dataclass
from typing import Callable

from joserfc import jwe, jwt
from joserfc.errors import JoseError
from joserfc.jwk import OctKey

__all__ = ["AUDIENCE", "SessionClaims", "SessionTokenError", "SessionTokens"]

#: Every session token's ``aud``.
AUDIENCE = "twisted-relay"
_ALGORITHM = "HS256"
# What a JWT's first segment starts with: '{"' in base64url.
_JWT_START = "eyJ"


class SessionTokenError(Exception):
    """A session token that is not good (now): one line saying why, never the token."""


@dataclass(frozen=True)
class SessionClaims:
    """What a good session token says."""

    sub: str
    email: str
    groups: tuple[str, ...]
    jti: str
    iat: int
    exp: int

    def identity(self) -> dict:
        """The person as the identity provider described them: ``sub``, ``email``, ``groups``."""
        return {"sub": self.sub, "email": self.email, "groups": list(self.groups)}


class SessionTokens:
    """
    Mints and checks session tokens of one secret and issuer.

    :param secret: the ``session_secret``.
    :param issuer: the relay's public URL (``iss``).
    :param ttl: seconds a token lasts.
    :param clock: the time now, in seconds since the epoch.
    """

    def __init__(self, secret: str, issuer: str, ttl: float, clock: Callable[[], float]):
        self._key = OctKey.import_key(secret.encode("utf-8"))
        self._seal_key = OctKey.import_key(hashlib.sha256(b"twisted-relay sealed\0" + secret.encode("utf-8")).digest())
        self.kid = hashlib.sha256(secret.encode("utf-8")).hexdigest()[:8]
        self.issuer = issuer
        self.ttl = int(ttl)
        self._clock = clock

    def __repr__(self) -> str:
        return "SessionTokens(issuer=%r, kid=%r, ttl=%r)" % (self.issuer, self.kid, self.ttl)

    def mint(self, identity: dict) -> tuple[str, SessionClaims]:
        """A new token for ``identity`` (``sub``, ``email``, ``groups``), and its claims."""
        now = int(self._clock())
        claims = SessionClaims(
            sub=identity["sub"], email=identity.get("email") or "", groups=tuple(identity.get("groups") or ()),
            jti=secrets.token_urlsafe(16), iat=now, exp=now + self.ttl,
        )
        body = {"aud": AUDIENCE, "iss": self.issuer, **claims.identity(), "jti": claims.jti, "iat": claims.iat,
                "exp": claims.exp}
        token = jwt.encode({"alg": _ALGORITHM, "typ": "JWT", "kid": self.kid}, body, self._key, algorithms=[_ALGORITHM])
        return token, claims

    def is_ours(self, token: str) -> bool:
        """
        Whether ``token`` is meant as one of this secret's session tokens (a
        JWT whose header names our ``kid``): its header read, nothing verified.
        """
        if not token.startswith(_JWT_START) or token.count(".") != 2:
            return False
        head = token.partition(".")[0]
        try:
            header = json.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))
        except (ValueError, TypeError):
            return False
        return isinstance(header, dict) and header.get("kid") == self.kid

    def verify(self, token: str, *, expired_ok: bool = False) -> SessionClaims:
        """
        The claims of a good token of ours: its signature (HS256 only), ``aud``,
        ``iss``, ``exp`` (unless ``expired_ok``: a revocation of an expired
        token), and the claims every token has.

        :raises SessionTokenError: saying why not.
        """
        try:
            decoded = jwt.decode(token, self._key, algorithms=[_ALGORITHM])
        except (JoseError, ValueError, TypeError):
            raise SessionTokenError("the session token's signature does not verify") from None
        claims = decoded.claims
        audience = claims.get("aud")
        if audience != AUDIENCE and not (isinstance(audience, list) and AUDIENCE in audience):
            raise SessionTokenError("the session token is not meant for this relay (aud)")
        if claims.get("iss") != self.issuer:
            raise SessionTokenError("the session token was issued for another address (iss)")
        try:
            found = SessionClaims(
                sub=_text(claims["sub"]), email=_text(claims.get("email", "")), groups=_texts(claims.get("groups", [])),
                jti=_text(claims["jti"]), iat=_number(claims["iat"]), exp=_number(claims["exp"]),
            )
        except (KeyError, TypeError, ValueError):
            raise SessionTokenError("the session token lacks a claim every session token has") from None
        if not expired_ok and found.exp <= self._clock():
            raise SessionTokenError("the session token has expired; sign in again")
        return found

    def seal(self, text: str) -> str:
        """``text`` encrypted (JWE compact, ``dir`` + ``A256GCM``) under a key only the relays know."""
        return jwe.encrypt_compact({"alg": "dir", "enc": "A256GCM"}, text.encode("utf-8"), self._seal_key)

    def unseal(self, sealed: str) -> str:
        """What :meth:`seal` sealed. :raises SessionTokenError: when it was sealed under another secret."""
        try:
            return jwe.decrypt_compact(sealed, self._seal_key).plaintext.decode("utf-8")
        except (JoseError, ValueError, TypeError, UnicodeDecodeError):
            raise SessionTokenError("a sealed value does not open with this session secret") from None


def _text(value) -> str:
    if not isinstance(value, str):
        raise TypeError("not text")
    return value


def _texts(value) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError("not a list of text")
    return tuple(value)


def _number(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("not a number")
    return int(value)
