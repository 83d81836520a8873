# -*- test-case-name: tests.test_simulated_idp -*-
"""
A simulated OpenID Connect provider: the company's identity provider for
tests and the keyless demo, in the role ``--simulate`` plays for upstreams.

It behaves as Keycloak, Okta, Entra ID or Google do for a confidential
client using the authorization code flow with PKCE:

- ``GET /.well-known/openid-configuration``: the discovery document (OpenID
  Connect Discovery 1.0), its ``issuer`` the URL it is served under (a mount
  prefix included, ``http://host:port/_idp``) unless one is given.
- ``GET /jwks``: the public signing keys (RS256, generated at start with a
  ``kid``; :meth:`SimulatedIdP.rotate_key` makes a new one).
- ``GET /authorize``: the request checked (client, exact registered
  ``redirect_uri``, ``response_type=code``, ``openid`` in ``scope``, a PKCE
  ``S256`` challenge) and a page to pick which user signs in; the form's
  ``POST`` (fields ``request``, ``email``, ``action=sign_in|deny``) sends the
  browser back to the client with ``code`` and ``state``, or
  ``error=access_denied``. ``login_hint=<email>`` preselects a user. Before
  the client and ``redirect_uri`` are known good, errors are a page (RFC
  6749 4.1.2.1: never a redirect to an unchecked URI); after, a redirect.
- ``POST /token``: ``authorization_code`` (single use, bound to its client and
  ``redirect_uri``, ``code_verifier`` checked) and ``refresh_token`` (the user
  re-checked: disabled or removed is ``invalid_grant``; the ID token carries
  their groups as they are now); the client authenticated by
  ``client_secret_basic`` or ``client_secret_post``; errors as RFC 6749 5.2.
- ``GET``/``POST /userinfo``: the user's claims for a bearer access token.

ID tokens are RS256 JWTs signed with joserfc. Users (:class:`IdPUser`) and
clients (:class:`IdPClient`) can be added, disabled or changed while it
runs. Times are on the injected reactor's clock. Tests can make it misbehave
through :attr:`SimulatedIdP.id_token_edit` (a wrong audience, an expired
token, a bad signature, ``alg: none``). See docs/simulated.md.
"""

from __future__ import annotations

import base64
import hashlib
import html
import secrets
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable
from urllib.parse import parse_qs, unquote_plus, urlencode, urlsplit, urlunsplit

from joserfc import jwk, jwt
from twisted.internet.interfaces import IReactorTime
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource

from twisted_relay._json import to_json

__all__ = ["IdPClient", "IdPUser", "SimulatedIdP"]

#: How long an authorization code, a pending sign-in page, an access token
#: and an ID token live (seconds), Keycloak's defaults or near them.
CODE_LIFETIME = 60
PAGE_LIFETIME = 600
ACCESS_TOKEN_LIFETIME = 300
ID_TOKEN_LIFETIME = 300
REFRESH_TOKEN_LIFETIME = 30 * 24 * 3600
#: The most pending pages, codes and tokens kept: a bound on memory.
MAX_KEPT = 10000

_NO_STORE = ((b"cache-control", b"no-store"), (b"pragma", b"no-cache"))


@dataclass(frozen=True)
class IdPUser:
    """
    A user of the identity provider.

    :ivar email: their email address (how the picker and ``login_hint`` name them).
    :ivar sub: their stable subject id.
    :ivar groups: their groups, the ``groups`` claim.
    :ivar name: their display name.
    :ivar enabled: a disabled user cannot sign in or refresh.
    """

    email: str
    sub: str
    groups: tuple[str, ...] = ()
    name: str = ""
    enabled: bool = True

    def claims(self) -> dict:
        """The claims the ID token and ``/userinfo`` carry about them."""
        return {
            "sub": self.sub,
            "email": self.email,
            "email_verified": True,
            "name": self.name or self.email,
            "groups": list(self.groups),
        }


@dataclass(frozen=True)
class IdPClient:
    """
    A client (relying party) registered with the provider.

    :ivar client_id: its id, the ID tokens' ``aud``.
    :ivar secret: its secret; ``None``: a public client (PKCE only, no
        client authentication).
    :ivar redirect_uris: the redirect URIs it registered, matched exactly.
    """

    client_id: str
    secret: str | None = field(default=None, repr=False)
    redirect_uris: tuple[str, ...] = ()


class _Refused(Exception):
    """An OAuth error: ``error``, its description and the HTTP status."""

    def __init__(self, error: str, description: str, status: int = 400):
        super().__init__(description)
        self.error = error
        self.description = description
        self.status = status


@dataclass
class _Pending:
    """An authorization request waiting for its user to be picked."""

    client_id: str
    redirect_uri: str
    state: str | None
    nonce: str | None
    challenge: str
    scope: str
    login_hint: str
    expires_at: float


@dataclass
class _Code:
    client_id: str
    redirect_uri: str
    challenge: str
    nonce: str | None
    sub: str
    scope: str
    auth_time: int
    expires_at: float
    #: the refresh token this code was redeemed for: revoked if it is replayed.
    refresh_token: str | None = None
    used: bool = False


@dataclass
class _Grant:
    """What an access or refresh token stands for."""

    client_id: str
    sub: str
    scope: str
    auth_time: int
    expires_at: float


class SimulatedIdP:
    """
    The simulated OpenID Connect provider.

    :param reactor: the clock codes and tokens live by; the global reactor
        when ``None``.
    :param users: its users.
    :param clients: its registered clients.
    :param issuer: its issuer URL; ``None``: the URL each request came to, up
        to where the resource is mounted (``http://127.0.0.1:8080/_idp``).
    :param rotate_refresh_tokens: a refresh token is single use and each
        refresh answers a new one (Okta's rotation, Keycloak's "revoke
        refresh token"); by default a refresh answers a new one and the old
        one stays good (Keycloak's and Entra ID's default).
    :param refresh_id_tokens: a refresh answers an ID token too (Keycloak,
        Google, Entra ID); ``False``: only an access token, the client asks
        ``/userinfo`` (OAuth 2 providers without OpenID on refresh).

    :ivar requests: how many requests each endpoint answered
        (``discovery``, ``jwks``, ``authorize``, ``token``, ``userinfo``).
    :ivar auto_sign_in: the email of a user the browser is already signed
        in as (an IdP session): ``/authorize`` then sends it straight back
        with a code, no page, unless ``prompt=login`` (scripted tests, the
        demo); ``None``: the page every time.
    :ivar id_token_edit: a test's fault: called with copies of each ID
        token's header and claims, which it may change in place; it returns
        ``None`` to have them signed with the provider's key, or the compact
        token to answer as it is (a bad signature, ``alg: none``).
    """

    def __init__(
        self,
        reactor: IReactorTime | None = None,
        users: tuple[IdPUser, ...] | list[IdPUser] = (),
        clients: tuple[IdPClient, ...] | list[IdPClient] = (),
        *,
        issuer: str | None = None,
        rotate_refresh_tokens: bool = False,
        refresh_id_tokens: bool = True,
    ):
        self._reactor = reactor
        self.issuer = issuer.rstrip("/") if issuer else None
        self.rotate_refresh_tokens = rotate_refresh_tokens
        self.refresh_id_tokens = refresh_id_tokens
        self._users: dict[str, IdPUser] = {}
        for user in users:
            self.add_user(user)
        self._clients = {client.client_id: client for client in clients}
        self._keys: list[jwk.RSAKey] = []
        self.rotate_key()
        self._pending: dict[str, _Pending] = {}
        self._codes: dict[str, _Code] = {}
        self._access: dict[str, _Grant] = {}
        self._refresh: dict[str, _Grant] = {}
        self.requests: Counter = Counter()
        self.id_token_edit: Callable[[dict, dict], str | None] | None = None
        self.auto_sign_in: str | None = None

    @property
    def reactor(self) -> IReactorTime:
        if self._reactor is None:
            from twisted.internet import reactor

            self._reactor = reactor  # type: ignore[assignment]
        return self._reactor  # type: ignore[return-value]

    def now(self) -> int:
        return int(self.reactor.seconds())

    # -- users, clients, keys -----------------------------------------------

    @property
    def users(self) -> tuple[IdPUser, ...]:
        """Its users, in the order added."""
        return tuple(self._users.values())

    def user(self, email: str) -> IdPUser | None:
        """The user with that email (any case), or ``None``."""
        return self._users.get(email.lower())

    def add_user(self, user: IdPUser) -> None:
        """Add a user (or replace the one with the same email)."""
        self._users[user.email.lower()] = user

    def update_user(
        self,
        email: str,
        *,
        groups: tuple[str, ...] | list[str] | None = None,
        enabled: bool | None = None,
        name: str | None = None,
    ) -> IdPUser:
        """Change a user's groups, name or whether they are enabled; the next
        refresh and ``/userinfo`` see it. :raises KeyError: no such user."""
        user = self._users[email.lower()]
        changes: dict = {}
        if groups is not None:
            changes["groups"] = tuple(groups)
        if enabled is not None:
            changes["enabled"] = enabled
        if name is not None:
            changes["name"] = name
        self._users[email.lower()] = user = replace(user, **changes)
        return user

    def disable_user(self, email: str) -> IdPUser:
        """Disable a user: no more sign-ins or refreshes."""
        return self.update_user(email, enabled=False)

    def remove_user(self, email: str) -> None:
        """Forget a user (their refreshes then fail too)."""
        self._users.pop(email.lower(), None)

    def add_client(self, client: IdPClient) -> None:
        """Register a client (or replace the one with the same id)."""
        self._clients[client.client_id] = client

    def rotate_key(self, keep_old: bool = True) -> str:
        """
        Sign from now on with a new RSA key; the JWKS publishes it, and the
        previous keys too when ``keep_old`` (as providers do for a while).
        Returns the new key's ``kid``.
        """
        kid = secrets.token_hex(8)
        key = jwk.RSAKey.generate_key(2048, parameters={"kid": kid, "use": "sig", "alg": "RS256"})
        self._keys = [key] + (self._keys if keep_old else [])
        return kid

    @property
    def kid(self) -> str:
        """The ``kid`` of the key it signs with now."""
        return self._keys[0].kid  # type: ignore[return-value]

    def jwks(self) -> dict:
        """The JSON Web Key Set it publishes (public parts only)."""
        return {"keys": [key.as_dict(private=False) for key in self._keys]}

    def sign(self, header: dict, claims: dict) -> str:
        """``claims`` as a JWT signed with the current key (the header's
        ``alg`` and ``kid`` as given, RS256 and the current ``kid`` when absent)."""
        header = {"alg": "RS256", "kid": self.kid, "typ": "JWT", **header}
        return jwt.encode(header, claims, self._keys[0], algorithms=[header["alg"]])

    # -- the protocol --------------------------------------------------------

    def discovery(self, issuer: str) -> dict:
        """The discovery document of the provider at ``issuer``."""
        return {
            "issuer": issuer,
            "authorization_endpoint": issuer + "/authorize",
            "token_endpoint": issuer + "/token",
            "userinfo_endpoint": issuer + "/userinfo",
            "jwks_uri": issuer + "/jwks",
            "scopes_supported": ["openid", "email", "profile", "groups", "offline_access"],
            "response_types_supported": ["code"],
            "response_modes_supported": ["query"],
            "grant_types_supported": ["authorization_code", "refresh_token"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": ["RS256"],
            "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post", "none"],
            "code_challenge_methods_supported": ["S256"],
            "claims_supported": ["iss", "sub", "aud", "exp", "iat", "auth_time", "nonce", "azp",
                                 "email", "email_verified", "name", "groups"],
        }

    def start_authorization(self, query: dict[str, str]) -> tuple[str, str | None]:
        """
        Check an authorization request.

        :return: ``(request id, None)`` for a request to show the picker
            for, or ``("", redirect URL)`` for an error the client is told of.
        :raises _Refused: an error shown as a page (client or redirect URI
            unknown: nobody to send it to).
        """
        client = self._clients.get(query.get("client_id", ""))
        if client is None:
            raise _Refused("invalid_client", "Unknown client_id.")
        redirect_uri = query.get("redirect_uri", "")
        if redirect_uri not in client.redirect_uris:
            raise _Refused("invalid_request", "redirect_uri is not one the client registered.")
        state = query.get("state")

        def back(error: str, description: str) -> tuple[str, str]:
            return "", _with_query(redirect_uri, error=error, error_description=description, state=state)

        if query.get("response_type") != "code":
            return back("unsupported_response_type", "Only response_type=code is supported.")
        scope = query.get("scope", "")
        if "openid" not in scope.split():
            return back("invalid_scope", "The scope must include openid.")
        challenge, method = query.get("code_challenge", ""), query.get("code_challenge_method", "")
        if not challenge:
            return back("invalid_request", "PKCE is required: code_challenge is missing.")
        if method != "S256":
            return back("invalid_request", "code_challenge_method must be S256.")
        if not 43 <= len(challenge) <= 128:
            return back("invalid_request", "code_challenge is malformed.")
        session = self.user(self.auto_sign_in or "")
        if session is not None and not session.enabled:
            session = None
        if query.get("prompt") == "none" and session is None:
            return back("login_required", "The user must sign in.")
        now = self.now()
        _forget_expired(self._pending, now)
        request_id = secrets.token_urlsafe(24)
        self._pending[request_id] = _Pending(
            client.client_id, redirect_uri, state, query.get("nonce"), challenge, scope,
            query.get("login_hint", ""), now + PAGE_LIFETIME,
        )
        if session is not None and query.get("prompt") != "login":
            return "", self.finish_authorization({"request": request_id, "email": session.email})
        return request_id, None

    def finish_authorization(self, form: dict[str, str]) -> str:
        """
        The user picked on the page (form fields ``request``, ``email``,
        ``action``): the redirect URL back to the client.

        :raises _Refused: an unknown or expired page, an unknown or disabled user.
        """
        pending = self._pending.get(form.get("request", ""))
        if pending is None or pending.expires_at <= self.now():
            raise _Refused("invalid_request", "This sign-in page has expired; start again.")
        state = pending.state
        if form.get("action") == "deny":
            del self._pending[form["request"]]
            return _with_query(pending.redirect_uri, error="access_denied",
                               error_description="The user denied the request.", state=state)
        user = self.user(form.get("email", ""))
        if user is None:
            raise _Refused("invalid_request", "Pick a user.")
        if not user.enabled:
            raise _Refused("access_denied", "Account is disabled, contact your administrator.", 403)
        del self._pending[form["request"]]
        now = self.now()
        _forget_expired(self._codes, now)
        code = secrets.token_urlsafe(32)
        self._codes[code] = _Code(
            pending.client_id, pending.redirect_uri, pending.challenge, pending.nonce, user.sub,
            pending.scope, now, now + CODE_LIFETIME,
        )
        return _with_query(pending.redirect_uri, code=code, state=state)

    def token(self, form: dict[str, str], authorization: str, issuer: str) -> dict:
        """
        Answer a token request (form fields, the ``Authorization`` header).

        :raises _Refused: as RFC 6749 5.2 says.
        """
        client = self._client_authenticated(form, authorization)
        grant_type = form.get("grant_type", "")
        if grant_type == "authorization_code":
            return self._redeem(client, form, issuer)
        if grant_type == "refresh_token":
            return self._refreshed(client, form, issuer)
        if not grant_type:
            raise _Refused("invalid_request", "grant_type is missing.")
        raise _Refused("unsupported_grant_type", "Unsupported grant_type: %s." % grant_type[:40])

    def userinfo(self, access_token: str) -> dict:
        """The claims for a bearer access token. :raises _Refused: ``invalid_token`` (401)."""
        grant = self._access.get(access_token)
        if grant is None or grant.expires_at <= self.now():
            raise _Refused("invalid_token", "The access token is invalid or expired.", 401)
        user = self._user_by_sub(grant.sub)
        if user is None or not user.enabled:
            raise _Refused("invalid_token", "The user is disabled.", 401)
        return user.claims()

    def _client_authenticated(self, form: dict[str, str], authorization: str) -> IdPClient:
        basic = None
        if authorization[:6].lower() == "basic ":
            try:
                decoded = base64.b64decode(authorization[6:].strip(), validate=True).decode("utf-8")
            except ValueError:
                raise _Refused("invalid_client", "Malformed Basic credentials.", 401)
            client_id, colon, secret = decoded.partition(":")
            if not colon:
                raise _Refused("invalid_client", "Malformed Basic credentials.", 401)
            basic = (unquote_plus(client_id), unquote_plus(secret))
        if basic is not None and "client_secret" in form:
            raise _Refused("invalid_request", "Use one client authentication method, not two.")
        if basic is not None:
            client_id, secret = basic
            if form.get("client_id", client_id) != client_id:
                raise _Refused("invalid_request", "client_id differs from the authenticated client.")
        else:
            client_id, secret = form.get("client_id", ""), form.get("client_secret")
        client = self._clients.get(client_id)
        if client is None:
            raise _Refused("invalid_client", "Client authentication failed.", 401)
        if client.secret is not None:
            if secret is None or not secrets.compare_digest(secret.encode("utf-8"), client.secret.encode("utf-8")):
                raise _Refused("invalid_client", "Client authentication failed.", 401)
        return client

    def _redeem(self, client: IdPClient, form: dict[str, str], issuer: str) -> dict:
        code_text = form.get("code", "")
        if not code_text:
            raise _Refused("invalid_request", "code is missing.")
        code = self._codes.get(code_text)
        now = self.now()
        if code is None or code.expires_at <= now:
            raise _Refused("invalid_grant", "The authorization code is invalid or expired.")
        if code.used:
            # RFC 6749 4.1.2: a replayed code revokes what it was redeemed for.
            if code.refresh_token is not None:
                self._refresh.pop(code.refresh_token, None)
            raise _Refused("invalid_grant", "The authorization code was already used.")
        if code.client_id != client.client_id:
            raise _Refused("invalid_grant", "The authorization code was issued to another client.")
        if form.get("redirect_uri") != code.redirect_uri:
            raise _Refused("invalid_grant", "redirect_uri differs from the authorization request's.")
        verifier = form.get("code_verifier", "")
        if not verifier:
            raise _Refused("invalid_request", "code_verifier is missing.")
        if not secrets.compare_digest(_s256(verifier).encode("ascii"), code.challenge.encode("ascii", "replace")):
            raise _Refused("invalid_grant", "PKCE verification failed.")
        code.used = True
        user = self._user_by_sub(code.sub)
        if user is None or not user.enabled:
            raise _Refused("invalid_grant", "The user is disabled.")
        grant = _Grant(client.client_id, user.sub, code.scope, code.auth_time, 0)
        answer = self._tokens(grant, user, issuer, code.nonce)
        code.refresh_token = answer["refresh_token"]
        return answer

    def _refreshed(self, client: IdPClient, form: dict[str, str], issuer: str) -> dict:
        presented = form.get("refresh_token", "")
        if not presented:
            raise _Refused("invalid_request", "refresh_token is missing.")
        grant = self._refresh.get(presented)
        if grant is None or grant.expires_at <= self.now():
            raise _Refused("invalid_grant", "The refresh token is invalid or expired.")
        if grant.client_id != client.client_id:
            raise _Refused("invalid_grant", "The refresh token was issued to another client.")
        user = self._user_by_sub(grant.sub)
        if user is None or not user.enabled:
            self._refresh.pop(presented, None)
            raise _Refused("invalid_grant", "The user is disabled.")
        if self.rotate_refresh_tokens:
            del self._refresh[presented]
        answer = self._tokens(grant, user, issuer, None)
        if not self.refresh_id_tokens:
            del answer["id_token"]
        return answer

    def _tokens(self, grant: _Grant, user: IdPUser, issuer: str, nonce: str | None) -> dict:
        now = self.now()
        _forget_expired(self._access, now)
        _forget_expired(self._refresh, now)
        access_token = secrets.token_urlsafe(32)
        refresh_token = secrets.token_urlsafe(48)
        self._access[access_token] = replace(grant, expires_at=now + ACCESS_TOKEN_LIFETIME)
        self._refresh[refresh_token] = replace(grant, expires_at=now + REFRESH_TOKEN_LIFETIME)
        claims = {
            "iss": issuer,
            "aud": grant.client_id,
            "azp": grant.client_id,
            "iat": now,
            "exp": now + ID_TOKEN_LIFETIME,
            "auth_time": grant.auth_time,
            **user.claims(),
        }
        if nonce is not None:
            claims["nonce"] = nonce
        return {
            "access_token": access_token,
            "token_type": "Bearer",
            "expires_in": ACCESS_TOKEN_LIFETIME,
            "refresh_token": refresh_token,
            "refresh_expires_in": REFRESH_TOKEN_LIFETIME,
            "id_token": self._id_token(claims),
            "scope": grant.scope,
        }

    def _id_token(self, claims: dict) -> str:
        header = {"alg": "RS256", "kid": self.kid, "typ": "JWT"}
        if self.id_token_edit is not None:
            answered = self.id_token_edit(header, claims)
            if answered is not None:
                return answered
        return self.sign(header, claims)

    def _user_by_sub(self, sub: str) -> IdPUser | None:
        for user in self._users.values():
            if user.sub == sub:
                return user
        return None

    def resource(self) -> IResource:
        """The provider as a Twisted resource: the root of a ``Site``, or
        mounted under a path (``root.putChild(b"_idp", idp.resource())``)."""
        return _IdPResource(self)


def _s256(verifier: str) -> str:
    digest = hashlib.sha256(verifier.encode("ascii", "replace")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _with_query(uri: str, **params: str | None) -> str:
    """``uri`` with ``params`` (the ``None`` ones left out) added to its query."""
    parts = urlsplit(uri)
    added = urlencode({name: value for name, value in params.items() if value is not None})
    query = parts.query + "&" + added if parts.query else added
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))


def _forget_expired(table: dict, now: float) -> None:
    """Drop what has expired; past :data:`MAX_KEPT`, the oldest too."""
    for key in [key for key, value in table.items() if value.expires_at <= now]:
        del table[key]
    while len(table) >= MAX_KEPT:
        del table[next(iter(table))]


def _single_values(pairs: dict[str, list[str]]) -> dict[str, str]:
    """A form or query's parameters; a repeated one is refused (RFC 6749 3.1)."""
    values = {}
    for name, found in pairs.items():
        if len(found) > 1:
            raise _Refused("invalid_request", "Parameter %s is repeated." % name[:40])
        values[name] = found[0]
    return values


class _IdPResource(Resource):
    isLeaf = True

    def __init__(self, idp: SimulatedIdP):
        super().__init__()
        self._idp = idp

    def render(self, request: IRequest) -> bytes:
        route = "/" + "/".join(segment.decode("utf-8", "replace") for segment in request.postpath)
        routes = {
            "/.well-known/openid-configuration": ("discovery", (b"GET",), self._discovery),
            "/jwks": ("jwks", (b"GET",), self._jwks),
            "/authorize": ("authorize", (b"GET", b"POST"), self._authorize),
            "/token": ("token", (b"POST",), self._token),
            "/userinfo": ("userinfo", (b"GET", b"POST"), self._userinfo),
        }
        if route not in routes:
            return _answer(request, 404, "text/plain", b"Not Found\n")
        name, methods, serve = routes[route]
        self._idp.requests[name] += 1
        if request.method not in methods:
            request.setHeader(b"allow", b", ".join(methods))
            return _answer(request, 405, "text/plain", b"Method Not Allowed\n")
        try:
            return serve(request)
        except _Refused as refused:
            if name == "authorize":
                return _page(request, refused.status, "Sign-in error", "<p>%s</p>" % html.escape(refused.description))
            if name == "userinfo":
                request.setHeader(b"www-authenticate", b'Bearer error="%s"' % refused.error.encode("ascii"))
            elif refused.status == 401 and _header(request, b"authorization")[:6].lower() == "basic ":
                request.setHeader(b"www-authenticate", b'Basic realm="simulated-idp"')
            body = {"error": refused.error, "error_description": refused.description}
            for header, value in _NO_STORE:
                request.setHeader(header, value)
            return _answer(request, refused.status, "application/json", to_json(body))

    def _issuer(self, request: IRequest) -> str:
        if self._idp.issuer:
            return self._idp.issuer
        scheme = "https" if request.isSecure() else "http"
        host = _header(request, b"host") or "%s:%d" % (request.getHost().host, request.getHost().port)
        prefix = "".join("/" + segment.decode("utf-8", "replace") for segment in request.prepath)
        return "%s://%s%s" % (scheme, host, prefix)

    def _discovery(self, request: IRequest) -> bytes:
        return _answer(request, 200, "application/json", to_json(self._idp.discovery(self._issuer(request))))

    def _jwks(self, request: IRequest) -> bytes:
        return _answer(request, 200, "application/json", to_json(self._idp.jwks()))

    def _authorize(self, request: IRequest) -> bytes:
        if request.method == b"POST":
            location = self._idp.finish_authorization(_single_values(_form_of(request)))
            return _redirect(request, location)
        query = _single_values(parse_qs(urlsplit(request.uri.decode("utf-8", "replace")).query))
        request_id, location = self._idp.start_authorization(query)
        if location is not None:
            return _redirect(request, location)
        hint = query.get("login_hint", "").lower()
        users = self._idp.users
        chosen = hint if any(u.email.lower() == hint for u in users) else (users[0].email.lower() if users else "")
        rows = []
        for user in users:
            rows.append(
                '<li><label><input type="radio" name="email" value="%s"%s%s> %s &lt;%s&gt;%s</label></li>'
                % (
                    html.escape(user.email),
                    " checked" if user.email.lower() == chosen else "",
                    "" if user.enabled else " disabled",
                    html.escape(user.name or user.email),
                    html.escape(user.email),
                    "" if user.enabled else " (disabled)",
                )
            )
        client = html.escape(query.get("client_id", ""))
        body = (
            '<p>Sign in to <b>%s</b> as:</p><form method="post" action="">'
            '<input type="hidden" name="request" value="%s"><ul>%s</ul>'
            '<button type="submit" name="action" value="sign_in">Sign in</button> '
            '<button type="submit" name="action" value="deny">Deny</button></form>'
            % (client, html.escape(request_id), "".join(rows))
        )
        return _page(request, 200, "Simulated identity provider", body)

    def _token(self, request: IRequest) -> bytes:
        if not _header(request, b"content-type").startswith("application/x-www-form-urlencoded"):
            raise _Refused("invalid_request", "The body must be application/x-www-form-urlencoded.")
        form = _single_values(_form_of(request))
        answer = self._idp.token(form, _header(request, b"authorization"), self._issuer(request))
        for header, value in _NO_STORE:
            request.setHeader(header, value)
        return _answer(request, 200, "application/json", to_json(answer))

    def _userinfo(self, request: IRequest) -> bytes:
        authorization = _header(request, b"authorization")
        if authorization[:7].lower() != "bearer ":
            raise _Refused("invalid_token", "A bearer access token is required.", 401)
        return _answer(request, 200, "application/json", to_json(self._idp.userinfo(authorization[7:].strip())))


def _header(request: IRequest, name: bytes) -> str:
    value = request.getHeader(name)
    return value.decode("latin-1") if value else ""


def _form_of(request: IRequest) -> dict[str, list[str]]:
    raw = request.content.read() if request.content is not None else b""
    return parse_qs(raw.decode("utf-8", "replace"))


def _redirect(request: IRequest, location: str) -> bytes:
    request.setHeader(b"location", location.encode("utf-8"))
    return _answer(request, 302, "text/plain", b"")


def _page(request: IRequest, status: int, title: str, body: str) -> bytes:
    text = "<!doctype html><html><head><meta charset=\"utf-8\"><title>%s</title></head><body><h1>%s</h1>%s</body></html>" % (
        html.escape(title), html.escape(title), body,
    )
    request.setHeader(b"x-frame-options", b"DENY")
    return _answer(request, status, "text/html", text.encode("utf-8"))


def _answer(request: IRequest, status: int, content_type: str, body: bytes) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", content_type.encode("ascii") + b"; charset=utf-8")
    return body
