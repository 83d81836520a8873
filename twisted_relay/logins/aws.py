# -*- test-case-name: tests.test_login_aws -*-
"""
AWS logins: SigV4 (:class:`AwsSigV4Login`, for Bedrock, Bedrock Mantle and
Claude Platform on AWS) with credentials from botocore's standard chain or
from keys the configuration names; and a Bedrock API key sent as a bearer
token (:class:`BedrockApiKeyLogin`).

Credentials are fetched on :class:`~twisted_relay.logins.base.LoginThreads`
by a :class:`~twisted_relay.logins.base.CredentialSource`, never on the
reactor; each request is signed on the reactor (CPU only: the canonical
request's hash and one HMAC, the day's key kept; the body's SHA-256 is made
with the body, off the reactor for a large one) with the key triple in
force, read whole, so a refresh between two requests never mixes two triples.

botocore is needed only for the standard chain (``pip install
'twisted-relay[aws]'``); keys from the environment and the signer
(:mod:`twisted_relay.logins.sigv4`) need nothing but the standard library.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from twisted.web.http_headers import Headers

from twisted_relay.logins.base import DEFAULT_MARGIN, Credentials, CredentialSource, Login, LoginError, LoginThreads
from twisted_relay.logins.sigv4 import SigV4Signer, amz_date

__all__ = [
    "AWS_SERVICES",
    "AwsKeys",
    "AwsSigV4Login",
    "BedrockApiKeyLogin",
    "aws_login",
    "chain_fetch",
    "chain_source",
    "environment_keys_fetch",
    "environment_keys_source",
    "require_botocore",
]

#: The SigV4 signing names of the surfaces that serve Claude on AWS:
#: Bedrock's runtime (InvokeModel and ``/anthropic``), Bedrock Mantle,
#: Claude Platform on AWS.
AWS_SERVICES = ("bedrock", "bedrock-mantle", "aws-external-anthropic")

#: What :meth:`AwsSigV4Login.authorize` writes itself: any earlier value (a
#: retried attempt's, a client's) is removed first, so none is sent twice.
_SIGNATURE_HEADERS = (b"authorization", b"x-amz-date", b"x-amz-security-token", b"x-amz-content-sha256")

_INSTALL = "pip install 'twisted-relay[aws]'"

#: How far ahead :func:`_seconds_left` looks for an expiry: ten years.
_FAR = 10 * 365 * 86400


class AwsKeys:
    """An access key id, its secret and a session token (or ``None``): one triple, never changed."""

    __slots__ = ("access_key_id", "secret_access_key", "session_token")

    def __init__(self, access_key_id: str, secret_access_key: str, session_token: str | None = None):
        self.access_key_id = access_key_id
        self.secret_access_key = secret_access_key
        self.session_token = session_token or None

    def __repr__(self) -> str:
        return "AwsKeys(<hidden>, session_token=%s)" % ("<hidden>" if self.session_token else "None",)


def require_botocore() -> None:
    """
    Raise :class:`LoginError` (one line, saying what to install) when
    botocore, which the standard credential chain needs, is missing. The
    relay calls it at start for each upstream whose login reads the chain.
    """
    try:
        import botocore.session  # noqa: F401
    except ImportError:
        raise LoginError("AWS credentials from the standard chain need botocore: %s" % (_INSTALL,)) from None


def _seconds_left(found) -> float | None:
    """
    Seconds until botocore credentials expire (``None``: they do not).

    botocore keeps a refreshable credential's expiry in a private
    attribute; its public ``refresh_needed(refresh_in)`` says whether fewer
    than ``refresh_in`` seconds are left, so the expiry is found by halving
    (to the second, in about thirty calls, off the reactor).
    """
    needed = getattr(found, "refresh_needed", None)
    if needed is None or not needed(_FAR):
        return None
    if needed(0):
        return 0.0
    enough, short = 0, _FAR
    while short - enough > 1:
        middle = (enough + short) // 2
        if needed(middle):
            short = middle
        else:
            enough = middle
    return float(enough)


def chain_fetch(profile: str | None = None) -> Callable[[], Credentials]:
    """
    A fetch (for :class:`CredentialSource`) that asks botocore's standard
    chain afresh each time: environment, shared credentials and config
    files (``profile``, else ``AWS_PROFILE``), SSO, web identity, the
    container and instance metadata endpoints. Blocking: run it only on
    :class:`LoginThreads`.
    """

    def fetch() -> Credentials:
        import botocore.session

        try:
            found = botocore.session.Session(profile=profile).get_credentials()
            if found is None:
                raise LoginError(
                    "no credentials found (environment, shared files, SSO, web identity, container or instance metadata)"
                )
            frozen = found.get_frozen_credentials()
            left = _seconds_left(found)
        except LoginError:
            raise
        except Exception as e:
            # botocore's messages name files, profiles and endpoints, never a key.
            raise LoginError("%s: %s" % (type(e).__name__, e)) from None
        keys = AwsKeys(frozen.access_key, frozen.secret_key, frozen.token)
        return Credentials(keys, None if left is None else time.time() + left)

    return fetch


def chain_source(
    reactor, threads: LoginThreads, profile: str | None = None, margin: float = DEFAULT_MARGIN
) -> CredentialSource:
    """
    Credentials from botocore's standard chain (:func:`chain_fetch`),
    refreshed ``margin`` seconds before they expire. Raises
    :class:`LoginError` at once when botocore is missing.
    """
    require_botocore()
    where = "profile %s" % (profile,) if profile else "the default profile"
    return CredentialSource(
        reactor, threads, chain_fetch(profile), "AWS credentials from the standard chain (%s)" % (where,), margin
    )


def environment_keys_fetch(
    access_key_id_env: str = "AWS_ACCESS_KEY_ID",
    secret_access_key_env: str = "AWS_SECRET_ACCESS_KEY",
    session_token_env: str | None = None,
) -> Callable[[], Credentials]:
    """
    A fetch that reads static keys from the environment variables the
    configuration names (the session token's is optional). The keys never
    expire for the relay; a fetch after the upstream refused them reads the
    variables again. Needs no botocore.
    """

    def fetch() -> Credentials:
        values = []
        for variable in (access_key_id_env, secret_access_key_env, session_token_env):
            value = os.environ.get(variable, "") if variable else ""
            if variable and variable != session_token_env and not value:
                raise LoginError("the environment variable %s is not set" % (variable,))
            values.append(value)
        return Credentials(AwsKeys(*values), None)

    return fetch


def environment_keys_source(
    reactor,
    threads: LoginThreads,
    access_key_id_env: str = "AWS_ACCESS_KEY_ID",
    secret_access_key_env: str = "AWS_SECRET_ACCESS_KEY",
    session_token_env: str | None = None,
) -> CredentialSource:
    """Static keys from named environment variables (:func:`environment_keys_fetch`)."""
    names = "$%s, $%s" % (access_key_id_env, secret_access_key_env)
    if session_token_env:
        names += ", $%s" % (session_token_env,)
    return CredentialSource(
        reactor,
        threads,
        environment_keys_fetch(access_key_id_env, secret_access_key_env, session_token_env),
        "AWS keys from %s" % (names,),
    )


class AwsSigV4Login(Login):
    """
    AWS Signature Version 4 on every request, with the credentials that
    ``source`` keeps (their ``value`` an :class:`AwsKeys`).

    :param reactor: gives the time each signature carries (``x-amz-date``).
    :param service: the signing name, one of :data:`AWS_SERVICES`.
    :param region: the endpoint's region.
    """

    name = "aws-sigv4"
    signs_body = True

    def __init__(self, reactor, source: CredentialSource, service: str, region: str):
        if service not in AWS_SERVICES:
            raise LoginError("unknown AWS signing name %r (one of: %s)" % (service, ", ".join(AWS_SERVICES)))
        if not region:
            raise LoginError("an AWS login needs a region")
        self._reactor = reactor
        self.source = source
        self._signer = SigV4Signer(service, region)

    def __repr__(self) -> str:
        return "AwsSigV4Login(%r, %r, %s)" % (self._signer.service, self._signer.region, self.source.describe)


    def authorize(
        self, method: bytes, url: str, headers: Headers, body: bytes | None, body_sha256: str | None = None
    ) -> None:
        """
        Sign one request: ``x-amz-date``, ``x-amz-security-token`` (with
        session credentials) and ``authorization`` set on ``headers``, any
        earlier values removed.

        :param url: the URL exactly as it goes on the wire (the upstream
            client's prepared URL: path and query encoded, host lower case).
        :param body_sha256: the body's SHA-256 in hex when already computed
            (the request path has it made with the body: off the reactor for
            a large one): the hash is most of a large body's signing cost.
        """
        credentials = self.source.current
        if credentials is None:
            raise LoginError("%s: none fetched yet" % (self.source.describe,))
        keys: AwsKeys = credentials.value
        for name in _SIGNATURE_HEADERS:
            headers.removeHeader(name)
        date = amz_date(self._reactor.seconds())
        headers.setRawHeaders(b"x-amz-date", [date.encode("ascii")])
        if keys.session_token:
            headers.setRawHeaders(b"x-amz-security-token", [keys.session_token.encode("utf-8")])
        signature = self._signer.authorization(
            method, url, headers.getAllRawHeaders(), body, keys.access_key_id, keys.secret_access_key, date, body_sha256
        )
        headers.setRawHeaders(b"authorization", [signature])


def aws_login(
    reactor,
    threads: LoginThreads,
    region: str | None,
    service: str = "bedrock",
    profile: str | None = None,
    access_key_id_env: str | None = None,
    secret_access_key_env: str | None = None,
    session_token_env: str | None = None,
) -> AwsSigV4Login:
    """
    An upstream's SigV4 login, not started: keys from the named environment
    variables when the access key id's and the secret's are both named (no
    botocore needed), else botocore's standard chain (``profile``, else the
    default). One-line :class:`LoginError` for a setting that cannot work:
    one key variable without the other, a profile beside key variables, no
    region, an unknown signing name, the chain without botocore.
    """
    if service not in AWS_SERVICES:
        raise LoginError("unknown AWS signing name %r (one of: %s)" % (service, ", ".join(AWS_SERVICES)))
    if not region:
        raise LoginError("an AWS login needs a region")
    if (access_key_id_env is None) != (secret_access_key_env is None):
        raise LoginError("AWS keys from the environment need both the access key id's and the secret's variable")
    if access_key_id_env is not None:
        if profile is not None:
            raise LoginError("an AWS login takes either a profile or key variables, not both")
        source = environment_keys_source(reactor, threads, access_key_id_env, secret_access_key_env, session_token_env)
    elif session_token_env is not None:
        raise LoginError("a session token's variable needs the access key id's and the secret's too")
    else:
        source = chain_source(reactor, threads, profile)
    return AwsSigV4Login(reactor, source, service, region)


class BedrockApiKeyLogin(Login):
    """
    A Bedrock API key (long-term, or a short-term ``bedrock-api-key-...``
    token) sent as ``Authorization: Bearer``, as the Anthropic SDK and
    Claude Code send ``AWS_BEARER_TOKEN_BEDROCK``.
    """

    name = "bedrock-api-key"

    def __init__(self, api_key: str):
        api_key = api_key.strip()
        if not api_key or any(c in api_key for c in "\r\n\0") or not api_key.isascii():
            raise LoginError("a Bedrock API key must be one line of ASCII")
        self._value = b"Bearer " + api_key.encode("ascii")

    @classmethod
    def from_environment(cls, variable: str = "AWS_BEARER_TOKEN_BEDROCK") -> "BedrockApiKeyLogin":
        """The key in an environment variable; :class:`LoginError` naming it when it is not set."""
        value = os.environ.get(variable, "")
        if not value.strip():
            raise LoginError("the environment variable %s is not set" % (variable,))
        try:
            return cls(value)
        except LoginError as e:
            raise LoginError("%s: %s" % (variable, e)) from None

    def __repr__(self) -> str:
        return "BedrockApiKeyLogin(<hidden>)"

    def authorize(self, method: bytes, url: str, headers: Headers, body: bytes | None) -> None:
        for name in _SIGNATURE_HEADERS:
            headers.removeHeader(name)
        headers.setRawHeaders(b"authorization", [self._value])
