# -*- test-case-name: tests.test_signin_device_flow -*-
"""
The device grant (RFC 8628) as Claude Code's sign-in uses it.

Claude Code asks for a grant (``POST /oauth/device_authorization``) and gets
a *device code* (its secret: 256 random bits, kept by the relay only as a
digest, good for one sign-in) and a *user code* (``XXXX-XXXX`` of
:data:`USER_CODE_ALPHABET`: no vowels, no look-alikes) that the person
types or confirms at the verification page. It then polls the token
endpoint every ``interval`` seconds: :func:`poll` says what each poll gets
(``authorization_pending``, ``slow_down`` with the interval 5 s longer,
``access_denied``, ``expired_token``, or the approved grant) and how the
grant changes.

:class:`DeviceGrant` is one grant as the store keeps it, the browser step's
pieces included (:class:`BrowserLogin`: the PKCE verifier, ``state`` and
``nonce`` of the redirect to the identity provider, bound to one browser).

Pure: no Twisted, no I/O; time is given.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field, replace

__all__ = [
    "APPROVED",
    "DEVICE_CODE_LIFETIME",
    "SLOW_DOWN_STEP",
    "USER_CODE_ALPHABET",
    "BrowserLogin",
    "RateLimit",
    "DeviceGrant",
    "digest",
    "new_grant",
    "new_user_code",
    "new_secret",
    "normalized_user_code",
    "poll",
]

#: Letters of user codes: consonants only (no word is spelt), no look-alikes.
USER_CODE_ALPHABET = "BCDFGHJKMNPQRSTVWXYZ"
#: Seconds a grant (and its user code) lives.
DEVICE_CODE_LIFETIME = 600
#: Seconds added to the interval at each ``slow_down`` (RFC 8628 3.5).
SLOW_DOWN_STEP = 5
#: Seconds a poll may come early, for the network's jitter, before it is ``slow_down``.
POLL_SLACK = 0.5
#: Seconds the browser has from the verification page to the identity provider's answer.
BROWSER_LOGIN_LIFETIME = 600
#: What :func:`poll` says of an approved grant (the others are RFC 8628's error codes).
APPROVED = "approved"

PENDING, DENIED = "pending", "denied"


def new_secret() -> str:
    """A new secret of 256 random bits, URL-safe (device codes, refresh tokens, state, cookies)."""
    return secrets.token_urlsafe(32)


def digest(secret: str) -> str:
    """What the relay keeps of a secret: its SHA-256, in hex."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def new_user_code() -> str:
    """``XXXX-XXXX`` from :data:`USER_CODE_ALPHABET` (about 34.6 bits)."""
    letters = "".join(secrets.choice(USER_CODE_ALPHABET) for _ in range(8))
    return letters[:4] + "-" + letters[4:]


def normalized_user_code(text: str) -> str | None:
    """A user code as a person may type it (any case, spaces, with or without the dash), or ``None``."""
    letters = "".join(c for c in text.upper() if c not in " -\t")
    if len(letters) != 8 or any(c not in USER_CODE_ALPHABET for c in letters):
        return None
    return letters[:4] + "-" + letters[4:]


@dataclass(frozen=True)
class BrowserLogin:
    """
    One browser's way through the identity provider for a grant.

    :ivar state_hash: digest of the ``state`` sent to the provider.
    :ivar browser_hash: digest of the cookie that binds it to the browser.
    :ivar code_verifier: the PKCE verifier. Never shown.
    :ivar nonce: the ID token's expected ``nonce``.
    :ivar expires_at: when it is no longer accepted.
    """

    state_hash: str
    browser_hash: str
    code_verifier: str = field(repr=False)
    nonce: str
    expires_at: float


@dataclass(frozen=True)
class DeviceGrant:
    """
    One device grant.

    :ivar device_hash: digest of its device code.
    :ivar user_code: ``XXXX-XXXX``.
    :ivar expires_at: when it ends, approved or not.
    :ivar interval: seconds Claude Code must wait between two polls.
    :ivar last_poll: when it was last polled, or ``None``.
    :ivar status: ``pending``, ``approved`` or ``denied``.
    :ivar identity: the approved person's ``sub``, ``email``, ``groups``.
    :ivar idp_refresh: the provider's refresh token, sealed; never shown.
    :ivar login: the browser step under way, or ``None``.
    """

    device_hash: str
    user_code: str
    expires_at: float
    interval: int
    last_poll: float | None = None
    status: str = PENDING
    identity: dict | None = None
    idp_refresh: str | None = field(default=None, repr=False)
    login: BrowserLogin | None = None

    @property
    def pending(self) -> bool:
        return self.status == PENDING

    def approved(self, identity: dict, idp_refresh: str | None) -> "DeviceGrant":
        return replace(self, status=APPROVED, identity=identity, idp_refresh=idp_refresh, login=None)

    def denied(self) -> "DeviceGrant":
        return replace(self, status=DENIED, login=None)


def new_grant(now: float, interval: int) -> tuple[str, DeviceGrant]:
    """A new device code and its grant."""
    device_code = new_secret()
    return device_code, DeviceGrant(digest(device_code), new_user_code(), now + DEVICE_CODE_LIFETIME, interval)


def poll(grant: DeviceGrant, now: float) -> tuple[str, DeviceGrant | None]:
    """
    What a poll of ``grant`` at ``now`` gets, and the grant as it is kept
    afterwards (``None``: it is done with, deleted).
    """
    if now >= grant.expires_at:
        return "expired_token", None
    if grant.last_poll is not None and now - grant.last_poll < grant.interval - POLL_SLACK:
        return "slow_down", replace(grant, interval=grant.interval + SLOW_DOWN_STEP, last_poll=now)
    if grant.status == DENIED:
        return "access_denied", None
    if grant.status == APPROVED:
        return APPROVED, None
    return "authorization_pending", replace(grant, last_poll=now)


class RateLimit:
    """
    At most ``most`` attempts per address in each ``window`` seconds (a
    fixed window per address). Holds at most ``addresses`` addresses: past
    that, those whose window has ended are forgotten, then all.
    """

    def __init__(self, most: int, window: float, addresses: int = 10_000):
        self.most = most
        self.window = window
        self._addresses = addresses
        self._seen: dict[str, tuple[float, int]] = {}

    def allow(self, address: str, now: float) -> bool:
        """Count an attempt from ``address``; whether it is let through."""
        start, count = self._seen.get(address, (now, 0))
        if now - start >= self.window:
            start, count = now, 0
        if count >= self.most:
            return False
        if address not in self._seen and len(self._seen) >= self._addresses:
            self._seen = {a: seen for a, seen in self._seen.items() if now - seen[0] < self.window}
            if len(self._seen) >= self._addresses:
                self._seen.clear()
        self._seen[address] = (start, count + 1)
        return True
