# -*- test-case-name: tests.test_signin_oidc -*-
"""
The relay as an OpenID Connect client (relying party) of the company's
identity provider: the browser step of a sign-in and each refresh.

:class:`OIDCProvider` reads the provider's discovery document
(``<issuer>/.well-known/openid-configuration``) and its published keys
(``jwks_uri``) with treq, on the reactor, never blocking it; writes the
authorization URL of the code flow with PKCE ``S256``
(:meth:`~OIDCProvider.authorization_url`); redeems the code the browser
brings back (:meth:`~OIDCProvider.redeem`) and refreshes with the
provider's refresh token (:meth:`~OIDCProvider.refresh`). Every ID token is
checked with joserfc before its claims are believed: the signature under a
published key (RS256, ES256 or PS256 only: never ``none`` nor an HMAC), the
issuer, the audience (``azp`` when there are several), the expiry and
issue time with a small leeway, and the nonce the sign-in sent. A token
signed with a key the cached set lacks makes the keys be fetched again,
once a minute at most (providers rotate their keys).

Failures are :class:`IdPError`, one line that never holds the client
secret, a code, a verifier or a token: :class:`IdPRefused` when the
provider said no to the grant (``invalid_grant``: sign in again),
:class:`IdPUnavailable` when it could not be asked (network, timeout,
5xx, 429: try again later).
"""

from __future__ import annotations

import base64
import binascii
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterable
from urllib.parse import quote

import treq
import ujson
from authlib.common.security import generate_token
from authlib.common.urls import add_params_to_uri
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from joserfc import errors as jose_errors
from joserfc import jwk, jwt
from treq.client import HTTPClient
from twisted.internet.defer import Deferred, DeferredLock
from twisted.internet.interfaces import IReactorTime
from twisted.web.client import Agent

__all__ = [
    "ALLOWED_ALGORITHMS",
    "IdPAnswer",
    "IdPError",
    "IdPRefused",
    "IdPUnavailable",
    "OIDCProvider",
    "new_code_verifier",
    "new_secret_value",
]

#: The ID-token signatures believed (asymmetric only: ``none`` and HS*
#: would let anyone who knows the client secret, or nobody, sign).
ALLOWED_ALGORITHMS = ("RS256", "ES256", "PS256")
#: Seconds of clock difference forgiven on ``exp``, ``iat`` and ``nbf``.
LEEWAY = 60
#: The fewest seconds between two fetches of the keys an unknown ``kid`` asks for.
JWKS_REFETCH_INTERVAL = 60
#: How long the discovery document is kept before it is read again (seconds).
METADATA_LIFETIME = 3600
#: The longest one exchange with the provider may take (seconds).
TIMEOUT = 10.0
#: The largest answer read from the provider.
MAX_ANSWER_BYTES = 1 << 20
#: The client authentications this client can make.
AUTH_METHODS = ("client_secret_post", "client_secret_basic")

_DISCOVERY_PATH = "/.well-known/openid-configuration"


class IdPError(Exception):
    """The identity provider step failed (one line, no secret in it)."""


class IdPRefused(IdPError):
    """The provider refused the grant (``invalid_grant``): the code or the
    refresh token is no good any more, or the user was disabled."""


class IdPUnavailable(IdPError):
    """The provider could not be asked or answered with a failure of its
    own (network, timeout, 5xx, 429): worth trying again later."""


@dataclass(frozen=True)
class IdPAnswer:
    """
    What the provider said about the person.

    :ivar claims: the verified ID token's claims (or ``/userinfo``'s after a
        refresh that answered no ID token).
    :ivar refresh_token: the refresh token to keep: the provider's new one,
        the one refreshed with when it sent none, ``None`` when it gives none.
    """

    claims: dict
    refresh_token: str | None = field(default=None, repr=False)


def new_code_verifier() -> str:
    """A PKCE code verifier: 64 characters of the unreserved alphabet (RFC 7636 4.1)."""
    return generate_token(64)


def new_secret_value() -> str:
    """A ``state`` or ``nonce``: 43 random characters (256 bits)."""
    return secrets.token_urlsafe(32)


class OIDCProvider:
    """
    The company's OpenID Connect provider, as the relay uses it.

    :param issuer: the provider's issuer URL (discovery is at
        ``issuer + "/.well-known/openid-configuration"``).
    :param client_id: the relay's client id there (the ID tokens' ``aud``).
    :param client_secret: the relay's client secret.
    :param scopes: the scopes asked for (``openid`` is added when missing).
    :param redirect_uri: where the provider sends the browser back (the
        relay's callback), as registered there.
    :param http: the treq client to use; ``None``: one over a plain ``Agent``
        on the global reactor (no connection kept between exchanges: the
        provider is asked at sign-in and refresh only).
    :param clock: what times are judged by and timeouts run on; the global
        reactor when ``None``.
    :param auth_method: ``client_secret_post`` or ``client_secret_basic``;
        ``None``: the first of those the provider lists
        (``client_secret_basic``, the OpenID default, when it lists none).
    :param timeout: the longest one exchange with the provider may take.
    :param leeway: seconds of clock difference forgiven.
    """

    def __init__(
        self,
        issuer: str,
        client_id: str,
        client_secret: str,
        scopes: Iterable[str],
        redirect_uri: str,
        *,
        http: HTTPClient | None = None,
        clock: IReactorTime | None = None,
        auth_method: str | None = None,
        timeout: float = TIMEOUT,
        leeway: int = LEEWAY,
    ):
        if auth_method is not None and auth_method not in AUTH_METHODS:
            raise ValueError("auth_method must be one of %s" % ", ".join(AUTH_METHODS))
        from twisted.internet import reactor

        if clock is None:
            clock = reactor  # type: ignore[assignment]
        self.issuer = issuer
        self.client_id = client_id
        self._client_secret = client_secret
        scopes = list(scopes)
        self.scopes = tuple(scopes if "openid" in scopes else ["openid"] + scopes)
        self.redirect_uri = redirect_uri
        self._clock = clock
        self._http = http if http is not None else HTTPClient(Agent(reactor))  # type: ignore[arg-type]
        self._auth_method = auth_method
        self.timeout = timeout
        self.leeway = leeway
        self._lock = DeferredLock()
        self._metadata: dict | None = None
        self._metadata_at = 0.0
        self._keys: jwk.KeySet | None = None
        self._keys_refetched_at: float | None = None

    def __repr__(self) -> str:
        return "OIDCProvider(issuer=%r, client_id=%r)" % (self.issuer, self.client_id)

    # -- discovery and keys --------------------------------------------------

    @property
    def metadata(self) -> dict | None:
        """The discovery document last read, or ``None`` before :meth:`discover`."""
        return self._metadata

    async def discover(self) -> dict:
        """
        The provider's discovery document, read once an hour at most; when
        a re-read fails the one read before is kept (and the read tried
        again a minute later).

        :raises IdPError: it could not be read, or it is not this issuer's.
        """
        async with self._lock:
            now = self._clock.seconds()
            if self._metadata is not None and now - self._metadata_at < METADATA_LIFETIME:
                return self._metadata
            try:
                metadata = await self._fetch_metadata()
            except IdPUnavailable:
                if self._metadata is None:
                    raise
                # try again in a minute, not on every sign-in while it is down
                self._metadata_at = now - METADATA_LIFETIME + JWKS_REFETCH_INTERVAL
                return self._metadata
            self._metadata, self._metadata_at = metadata, now
            return metadata

    async def _fetch_metadata(self) -> dict:
        url = self.issuer.rstrip("/") + _DISCOVERY_PATH
        metadata = await self._get_json(url, "discovery document")
        issuer = metadata.get("issuer")
        if not isinstance(issuer, str) or issuer.rstrip("/") != self.issuer.rstrip("/"):
            raise IdPError(
                "the identity provider's discovery document names the issuer %s, not %s"
                % (_short(issuer), self.issuer)
            )
        for name in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
            value = metadata.get(name)
            if not isinstance(value, str) or not value.startswith(("https://", "http://")):
                raise IdPError("the identity provider's discovery document has no usable %s" % name)
        methods = metadata.get("code_challenge_methods_supported")
        if isinstance(methods, list) and "S256" not in methods:
            raise IdPError("the identity provider does not support PKCE S256 (code_challenge_methods_supported)")
        return metadata

    async def _key_set(self, kid: str | None) -> jwk.KeySet:
        """The published keys, fetched again (rate-limited) when ``kid`` is not among them."""
        metadata = await self.discover()
        if self._keys is None:
            self._keys = await self._fetch_keys(metadata["jwks_uri"])
        elif kid is not None and kid not in _kids(self._keys):
            now = self._clock.seconds()
            if self._keys_refetched_at is None or now - self._keys_refetched_at >= JWKS_REFETCH_INTERVAL:
                self._keys_refetched_at = now
                self._keys = await self._fetch_keys(metadata["jwks_uri"])
        return self._keys

    async def _fetch_keys(self, url: str) -> jwk.KeySet:
        document = await self._get_json(url, "keys (jwks_uri)")
        keys = []
        for data in document.get("keys") or ():
            if not isinstance(data, dict) or data.get("use", "sig") != "sig" or data.get("kty") == "oct":
                continue
            try:
                # one key at a time, so that one odd key does not lose the others
                keys.extend(jwk.KeySet.import_key_set({"keys": [data]}).keys)
            except (jose_errors.JoseError, ValueError, TypeError):
                continue  # a key of a kind joserfc cannot use is not one we verify with
        if not keys:
            raise IdPError("the identity provider publishes no signing key joserfc can use at %s" % url)
        return jwk.KeySet(keys)

    # -- the code flow -------------------------------------------------------

    def authorization_url(self, state: str, nonce: str, code_verifier: str, *, login_hint: str | None = None) -> str:
        """
        Where to send the browser: the provider's authorization endpoint
        with the code flow's parameters and the PKCE ``S256`` challenge.

        :raises IdPError: :meth:`discover` has not succeeded yet.
        """
        if self._metadata is None:
            raise IdPError("the identity provider's discovery document has not been read yet")
        params = [
            ("response_type", "code"),
            ("client_id", self.client_id),
            ("redirect_uri", self.redirect_uri),
            ("scope", " ".join(self.scopes)),
            ("state", state),
            ("nonce", nonce),
            ("code_challenge", create_s256_code_challenge(code_verifier)),
            ("code_challenge_method", "S256"),
        ]
        if login_hint:
            params.append(("login_hint", login_hint))
        return add_params_to_uri(self._metadata["authorization_endpoint"], params)

    async def redeem(self, code: str, code_verifier: str, nonce: str) -> IdPAnswer:
        """
        Redeem the authorization code the browser brought back.

        :raises IdPRefused: the provider refused the code (expired, used, not ours).
        :raises IdPUnavailable: it could not be asked.
        :raises IdPError: anything else, a bad ID token included.
        """
        form = {"grant_type": "authorization_code", "code": code, "redirect_uri": self.redirect_uri,
                "code_verifier": code_verifier}
        answer = await self._token_request(form, (code, code_verifier))
        id_token = answer.get("id_token")
        if not isinstance(id_token, str):
            raise IdPError("the identity provider's token answer has no id_token (is 'openid' among the scopes?)")
        claims = await self._verified_claims(id_token, nonce)
        refresh_token = answer.get("refresh_token")
        return IdPAnswer(claims, refresh_token if isinstance(refresh_token, str) else None)

    async def refresh(self, refresh_token: str, *, expected_sub: str | None = None) -> IdPAnswer:
        """
        Ask the provider again about the person, with their refresh token:
        it re-checks them (a disabled user is refused) and tells their
        groups as they are now.

        :param expected_sub: the ``sub`` the person signed in as: an answer
            about anyone else is refused (OpenID Connect Core 12.2).

        :raises IdPRefused: ``invalid_grant``: sign in again.
        :raises IdPUnavailable: it could not be asked.
        :raises IdPError: anything else.
        """
        form = {"grant_type": "refresh_token", "refresh_token": refresh_token}
        answer = await self._token_request(form, (refresh_token,))
        id_token = answer.get("id_token")
        if isinstance(id_token, str):
            claims = await self._verified_claims(id_token, None)
        else:
            claims = await self._userinfo(answer.get("access_token"))
        if expected_sub is not None and claims.get("sub") != expected_sub:
            raise IdPRefused("the identity provider's refresh answered for another subject")
        renewed = answer.get("refresh_token")
        return IdPAnswer(claims, renewed if isinstance(renewed, str) else refresh_token)

    async def _userinfo(self, access_token: Any) -> dict:
        metadata = await self.discover()
        url = metadata.get("userinfo_endpoint")
        if not isinstance(access_token, str) or not isinstance(url, str):
            raise IdPError("the identity provider's refresh answered no id_token and there is no userinfo to ask")
        claims = await self._get_json(url, "userinfo", headers={"authorization": "Bearer " + access_token})
        if not isinstance(claims.get("sub"), str):
            raise IdPError("the identity provider's userinfo has no sub")
        return claims

    async def _token_request(self, form: dict[str, str], hidden: tuple[str, ...]) -> dict:
        metadata = await self.discover()
        headers = {"accept": "application/json"}
        if self._auth_method_for(metadata) == "client_secret_basic":
            pair = "%s:%s" % (quote(self.client_id, safe=""), quote(self._client_secret, safe=""))
            headers["authorization"] = "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")
        else:
            form = {**form, "client_id": self.client_id, "client_secret": self._client_secret}
        status, body = await self._exchange("POST", metadata["token_endpoint"], "token endpoint",
                                            data=form, headers=headers)
        hidden = hidden + (self._client_secret,)
        answer = _json_object(body)
        if status == 200 and answer is not None:
            return answer
        if status >= 500 or status == 429:
            raise IdPUnavailable("the identity provider's token endpoint answered HTTP %d" % status)
        error = answer.get("error") if answer is not None else None
        description = answer.get("error_description") if answer is not None else None
        said = "HTTP %d" % status if not isinstance(error, str) else _scrubbed(error, hidden)
        if isinstance(description, str) and description:
            said += ": " + _scrubbed(description, hidden)
        if error == "invalid_grant":
            raise IdPRefused("the identity provider refused the grant (%s)" % said)
        if error == "temporarily_unavailable":
            raise IdPUnavailable("the identity provider is unavailable (%s)" % said)
        raise IdPError("the identity provider's token endpoint refused the request (%s)" % said)

    def _auth_method_for(self, metadata: dict) -> str:
        if self._auth_method is not None:
            return self._auth_method
        listed = metadata.get("token_endpoint_auth_methods_supported")
        if not isinstance(listed, list):
            return "client_secret_basic"
        for method in AUTH_METHODS:
            if method in listed:
                return method
        return "client_secret_basic"

    # -- the ID token --------------------------------------------------------

    async def _verified_claims(self, id_token: str, nonce: str | None) -> dict:
        header = _header_of(id_token)
        alg = header.get("alg")
        if alg not in ALLOWED_ALGORITHMS:
            raise IdPError("the ID token is signed with alg %s, not one of %s"
                           % (_short(alg), ", ".join(ALLOWED_ALGORITHMS)))
        kid = header.get("kid")
        keys = await self._key_set(kid if isinstance(kid, str) else None)
        if isinstance(kid, str) and kid not in _kids(keys):
            raise IdPError("the ID token's key (kid %s) is not among the identity provider's keys" % _short(kid))
        try:
            token = jwt.decode(id_token, keys, algorithms=list(ALLOWED_ALGORITHMS))
        except jose_errors.BadSignatureError:
            raise IdPError("the ID token's signature does not verify")
        except (jose_errors.JoseError, ValueError, TypeError) as failure:
            raise IdPError("the ID token cannot be read (%s)" % type(failure).__name__)
        claims = token.claims
        metadata = self._metadata or {}
        registry = jwt.JWTClaimsRegistry(
            now=int(self._clock.seconds()),
            leeway=self.leeway,
            iss={"essential": True, "value": metadata.get("issuer", self.issuer)},
            sub={"essential": True},
            exp={"essential": True},
            iat={"essential": True},
        )
        try:
            registry.validate(claims)
        except jose_errors.ExpiredTokenError:
            raise IdPError("the ID token has expired")
        except jose_errors.JoseError as failure:
            # joserfc's description names the claim: 'Invalid claim: "iss"', 'Missing claim: "sub"'
            raise IdPError("the ID token's claims are refused (%s)" % _short(failure.description or type(failure).__name__))
        self._check_audience(claims)
        if nonce is not None:
            presented = claims.get("nonce")
            if not isinstance(presented, str) or not secrets.compare_digest(presented.encode(), nonce.encode()):
                raise IdPError("the ID token's nonce is not the one this sign-in sent")
        return claims

    def _check_audience(self, claims: dict) -> None:
        aud = claims.get("aud")
        audiences = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
        if self.client_id not in audiences:
            raise IdPError("the ID token is for another client (aud), not %s" % self.client_id)
        azp = claims.get("azp")
        if len(audiences) > 1 and azp is None:
            raise IdPError("the ID token has several audiences and no azp")
        if azp is not None and azp != self.client_id:
            raise IdPError("the ID token was issued to another client (azp), not %s" % self.client_id)

    # -- HTTP ----------------------------------------------------------------

    async def _get_json(self, url: str, what: str, headers: dict | None = None) -> dict:
        status, body = await self._exchange("GET", url, what, headers=headers or {"accept": "application/json"})
        if status >= 500 or status == 429:
            raise IdPUnavailable("the identity provider's %s answered HTTP %d" % (what, status))
        if status != 200:
            raise IdPError("the identity provider's %s answered HTTP %d (%s)" % (what, status, url))
        document = _json_object(body)
        if document is None:
            raise IdPError("the identity provider's %s is not a JSON object (%s)" % (what, url))
        return document

    async def _exchange(self, method: str, url: str, what: str, **kwargs: Any) -> tuple[int, bytes]:
        """One request and its whole answer: ``(status, body)``, within :attr:`timeout`."""
        exchange = Deferred.fromCoroutine(self._send(method, url, **kwargs))
        # A cancelled request fails with treq's own wrapping of the
        # cancellation, so the timeout is known by this flag, not the error.
        expired: list[bool] = []

        def expire() -> None:
            expired.append(True)
            exchange.cancel()

        deadline = self._clock.callLater(self.timeout, expire)
        try:
            return await exchange
        except Exception as failure:
            if expired:
                raise IdPUnavailable("the identity provider's %s did not answer within %g s" % (what, self.timeout))
            if isinstance(failure, IdPError):
                raise
            raise IdPUnavailable("the identity provider's %s could not be reached (%s)" % (what, _reason(failure)))
        finally:
            if deadline.active():
                deadline.cancel()

    async def _send(self, method: str, url: str, **kwargs: Any) -> tuple[int, bytes]:
        response = await self._http.request(method, url, allow_redirects=False, **kwargs)
        chunks: list[bytes] = []
        size = [0]

        def collect(data: bytes) -> None:
            size[0] += len(data)
            if size[0] > MAX_ANSWER_BYTES:
                raise IdPError("the identity provider's answer is larger than %d bytes" % MAX_ANSWER_BYTES)
            chunks.append(data)

        await treq.collect(response, collect)
        return response.code, b"".join(chunks)


def _kids(keys: jwk.KeySet) -> set:
    return {key.kid for key in keys.keys}


def _header_of(token: str) -> dict:
    """A compact JWS's protected header, before anything is verified."""
    try:
        encoded = token.split(".")[0]
        header = ujson.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    except (ValueError, binascii.Error, IndexError):
        raise IdPError("the ID token is not a signed JWT")
    if not isinstance(header, dict) or token.count(".") != 2:
        raise IdPError("the ID token is not a signed JWT")
    return header


def _json_object(body: bytes) -> dict | None:
    try:
        value = ujson.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _scrubbed(text: str, hidden: tuple[str, ...]) -> str:
    """What the provider said, on one short line, with any secret of ours taken out."""
    for value in hidden:
        if value:
            text = text.replace(value, "[redacted]")
    return _short(text, 200)


def _short(value: Any, limit: int = 80) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reason(failure: Exception) -> str:
    """An exception in a few words; treq's ``ResponseFailed`` names the reasons it holds."""
    reasons = getattr(failure, "reasons", None)
    if reasons:
        return ", ".join(_reason(reason.value) for reason in reasons)
    return _short(failure, 80) or type(failure).__name__
