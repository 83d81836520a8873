# -*- test-case-name: tests.test_signin_config -*-
"""
The ``[signin]`` table of the ``--config`` file: who may sign in, through
which identity provider, and how long a session lasts (``docs/signin.md``).

:func:`signin_table` checks the table and gives a :class:`SignInConfig`
(:mod:`twisted_relay.configfile` calls it, handing it how the file reads a
secret: ``env:VAR``, ``file:PATH`` or the value written out). A mistake is a
:class:`SignInConfigError` naming the key, never a value.

Pure: no Twisted, no I/O but the secrets' files the reader opens.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field, fields
from typing import Callable
from urllib.parse import urlsplit

from twisted_relay.relay_keys import key_name_problem

__all__ = ["SIGNIN_KEYS", "SignInConfig", "SignInConfigError", "loopback_public_url", "signin_table"]

#: The keys ``[signin]`` takes (and its ``[signin.groups]`` table).
SIGNIN_KEYS = (
    "public_url", "issuer", "client_id", "client_secret", "scopes", "allowed_email_domains", "allowed_groups",
    "groups_claim", "session_secret", "session_ttl", "refresh_ttl", "login_notice", "managed_settings",
    "telemetry_endpoint", "revocation_poll", "poll_interval", "groups",
)
#: The shortest session secret (HS256 wants at least its own 256 bits).
MIN_SECRET_LENGTH = 32
#: The longest session token (seconds): a day.
MAX_SESSION_TTL = 86400
#: Claude Code shows at most this much of a login notice.
MAX_LOGIN_NOTICE = 500
_DEFAULT_SCOPES = ("openid", "profile", "email", "offline_access")


class SignInConfigError(ValueError):
    """A ``[signin]`` table that cannot be used: :attr:`key` names where, the message says why (never a value)."""

    def __init__(self, key: str | None, problem: str):
        super().__init__(problem)
        self.key = key
        self.problem = problem


@dataclass(frozen=True)
class SignInConfig:
    """
    Sign-in with the company's identity provider.

    :ivar public_url: the relay's URL as developers reach it (their
        ``forceLoginGatewayUrl``): the metadata's endpoints, the
        verification page and the IdP's redirect are under it, and it is
        the ``iss`` of session tokens. No trailing slash.
    :ivar issuer: the OIDC provider's issuer URL.
    :ivar client_id: the relay's client id at the provider.
    :ivar client_secret: its secret, or ``None`` (a public client). Never shown.
    :ivar scopes: asked of the provider.
    :ivar allowed_email_domains: an email in one of these domains may sign
        in; empty: any.
    :ivar allowed_groups: a person in one of these IdP groups may sign in;
        empty: any.
    :ivar groups_claim: the ID token's claim listing the person's groups.
    :ivar groups: IdP group -> relay group (metering, spend limits), in
        order: a person's relay group is that of the first listed IdP group
        they are in.
    :ivar session_secret: the key session tokens are signed with; every
        relay behind one name shares it. Never shown.
    :ivar session_ttl: seconds a session token lasts.
    :ivar refresh_ttl: seconds a refresh token lasts unused.
    :ivar login_notice: shown by Claude Code at sign-in, or ``None``.
    :ivar managed_settings: the managed settings file (absolute), or ``None``.
    :ivar telemetry_endpoint: the OTLP/HTTP collector's base URL, or ``None``.
    :ivar revocation_poll: seconds between two reads of the revocations:
        the bound for a revocation on one relay to reach every relay.
    :ivar poll_interval: seconds Claude Code waits between two polls of
        the token endpoint while a person signs in.
    """

    public_url: str
    issuer: str
    client_id: str
    session_secret: str = field(repr=False)
    client_secret: str | None = field(default=None, repr=False)
    scopes: tuple[str, ...] = _DEFAULT_SCOPES
    allowed_email_domains: tuple[str, ...] = ()
    allowed_groups: tuple[str, ...] = ()
    groups_claim: str = "groups"
    groups: tuple[tuple[str, str], ...] = ()
    session_ttl: float = 3600.0
    refresh_ttl: float = 30 * 86400.0
    login_notice: str | None = None
    managed_settings: str | None = None
    telemetry_endpoint: str | None = None
    revocation_poll: float = 2.0
    poll_interval: int = 5

    def __post_init__(self):
        for name in ("scopes", "allowed_email_domains", "allowed_groups"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "groups", tuple(tuple(pair) for pair in self.groups))

    @property
    def redirect_uri(self) -> str:
        """Where the provider sends the browser back (register it at the provider)."""
        return self.public_url + "/oauth/callback"

    def secrets(self) -> tuple[str, ...]:
        """The secrets of this table, for redaction."""
        return tuple(s for s in (self.session_secret, self.client_secret) if s)

    def to_dict(self) -> dict:
        """Every setting as plain JSON-able values (secrets included: keep it private)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, values: dict) -> "SignInConfig":
        """The settings :meth:`to_dict` described."""
        return cls(**{name: tuple(value) if isinstance(value, list) else value for name, value in values.items()})


def signin_table(table, read_secret: Callable[[str, str], str], folder: str) -> SignInConfig:
    """
    The :class:`SignInConfig` of a ``[signin]`` table.

    :param read_secret: ``read_secret(key, source)`` gives the secret a
        source names (``env:VAR``, ``file:PATH`` or the value itself), or
        raises the file's own error.
    :param folder: where a relative ``managed_settings`` path starts.
    :raises SignInConfigError: at the first mistake.
    """
    if not isinstance(table, dict):
        raise SignInConfigError(None, "must be a table, [signin]")
    for key in table:
        if key not in SIGNIN_KEYS:
            raise SignInConfigError(_shown(key), "unknown key (known: %s)" % (", ".join(SIGNIN_KEYS),))
    for key in ("public_url", "issuer", "client_id", "session_secret"):
        if key not in table:
            raise SignInConfigError(key, "missing: sign-in needs public_url, issuer, client_id and session_secret")
    public_url = _url(table, "public_url", path=False)
    session_secret = read_secret("session_secret", _text(table, "session_secret"))
    if len(session_secret) < MIN_SECRET_LENGTH:
        raise SignInConfigError("session_secret", "must be at least %d characters" % (MIN_SECRET_LENGTH,))
    client_secret = read_secret("client_secret", _text(table, "client_secret")) if "client_secret" in table else None
    notice = table.get("login_notice")
    if notice is not None and (not isinstance(notice, str) or len(notice) > MAX_LOGIN_NOTICE):
        raise SignInConfigError("login_notice", "must be text of at most %d characters" % (MAX_LOGIN_NOTICE,))
    managed = table.get("managed_settings")
    if managed is not None:
        managed = os.path.join(folder, os.path.expanduser(_text(table, "managed_settings")))
    scopes = _words(table, "scopes", _DEFAULT_SCOPES)
    if "openid" not in scopes:
        raise SignInConfigError("scopes", "must hold openid")
    return SignInConfig(
        public_url=public_url,
        issuer=_url(table, "issuer", path=True),
        client_id=_text(table, "client_id"),
        client_secret=client_secret,
        session_secret=session_secret,
        scopes=scopes,
        allowed_email_domains=tuple(d.lower().lstrip("@") for d in _words(table, "allowed_email_domains", ())),
        allowed_groups=_words(table, "allowed_groups", ()),
        groups_claim=_text(table, "groups_claim") if "groups_claim" in table else "groups",
        groups=_group_map(table.get("groups")),
        # At most a day: a revocation a relay could not read (its database away)
        # and a person the provider no longer admits are refused by then at the latest.
        session_ttl=_seconds(table, "session_ttl", 3600.0, least=30, most=MAX_SESSION_TTL),
        refresh_ttl=_seconds(table, "refresh_ttl", 30 * 86400.0, least=60),
        login_notice=notice or None,
        managed_settings=managed,
        telemetry_endpoint=_url(table, "telemetry_endpoint", path=True) if "telemetry_endpoint" in table else None,
        revocation_poll=_seconds(table, "revocation_poll", 2.0, least=0.1),
        poll_interval=int(_seconds(table, "poll_interval", 5, least=1)),
    )


def loopback_public_url(listen: str) -> str:
    """
    ``http://127.0.0.1:PORT``, the public URL of a relay whose ``--listen``
    description is ``listen`` (``tcp:PORT``, on all interfaces or on
    127.0.0.1): what ``--simulate-idp`` signs people in at (Claude Code
    takes ``http://`` on loopback only).

    :raises ValueError: any other ``listen`` (the message says what is needed).
    """
    fields = listen.split(":")
    options = dict(field.partition("=")[::2] for field in fields[2:])
    if (fields[0] != "tcp" or len(fields) < 2 or not fields[1].isdigit() or int(fields[1]) == 0
            or options.get("interface") != "127.0.0.1"):
        # Its user picker asks no password: on any other interface anyone who
        # reaches the port could sign in as a demo user and spend the upstream.
        raise ValueError(
            "--simulate-idp serves Claude Code at http://127.0.0.1:PORT and signs anyone in without a password: "
            "the first --listen must be tcp:PORT:interface=127.0.0.1 with a fixed port, not %r." % (listen,)
        )
    return "http://127.0.0.1:%d" % (int(fields[1]),)


def _shown(name: object) -> str:
    text = str(name)
    text = text if text.isprintable() else text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= 64 else text[:64] + "..."


def _text(table: dict, key: str) -> str:
    value = table.get(key)
    if not isinstance(value, str) or not value.strip() or not value.isprintable():
        raise SignInConfigError(key, "must be text that is not empty")
    return value.strip()


def _url(table: dict, key: str, *, path: bool) -> str:
    # The value is never repeated in an error.
    value = table.get(key)
    if not isinstance(value, str):
        raise SignInConfigError(key, "must be an http:// or https:// URL")
    url = value.strip().rstrip("/")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError:
        raise SignInConfigError(key, "is not a URL")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SignInConfigError(key, "must be an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise SignInConfigError(key, "may hold no user name, password, query or fragment")
    if not path and parts.path:
        raise SignInConfigError(key, "must be the relay's origin only (scheme, host and port), without a path")
    if parts.scheme == "http" and not _is_loopback(parts.hostname):
        # Over http off loopback the client secret, the codes and the provider's keys
        # would cross the network in clear (and Claude Code refuses such a gateway).
        raise SignInConfigError(key, "must be an https:// URL (http:// only on loopback: 127.0.0.1, ::1, localhost)")
    return url


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _words(table: dict, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
    value = table.get(key)
    if value is None:
        return default
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() and v.isprintable() for v in value):
        raise SignInConfigError(key, "must be a list of strings")
    return tuple(v.strip() for v in value)


def _seconds(table: dict, key: str, default: float, *, least: float, most: float | None = None) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < least:
        raise SignInConfigError(key, "must be a number of seconds, at least %g" % (least,))
    if most is not None and value > most:
        raise SignInConfigError(key, "must be at most %g seconds" % (most,))
    return float(value)


def _group_map(value) -> tuple[tuple[str, str], ...]:
    """``[signin.groups]``: IdP group -> relay group, in file order; a relay group is named as a relay key's group."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise SignInConfigError("groups", 'must be a table, [signin.groups], of "IdP group" = "relay group"')
    pairs = []
    for idp_group, group in value.items():
        if not isinstance(group, str) or key_name_problem(group) is not None:
            raise SignInConfigError("groups " + _shown(idp_group), "the relay group %s" % (key_name_problem(group),))
        pairs.append((idp_group, group))
    return tuple(pairs)
