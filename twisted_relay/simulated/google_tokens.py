# -*- test-case-name: tests.test_simulated_vertex -*-
"""
A simulated Google OAuth2 token endpoint, and the token routes of a GCE
metadata server: where the simulated Vertex AI's bearer tokens come from.

``POST /token`` takes the RFC 7523 grant a service account makes
(``grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer&assertion=<JWT>``,
form-encoded), checks the assertion as Google does (RS256 signature under
the public key of a service account it knows, ``iss``, ``aud``, ``scope``,
``iat``/``exp``) and answers ``{access_token, expires_in, token_type}`` with
a lifetime of its own (short in tests, to force refreshes). Refusals are
OAuth2 errors, ``{"error": "invalid_grant", "error_description": ...}``,
which google-auth turns into ``RefreshError("invalid_grant: ...")``.

With ``metadata_account`` set it also answers as the metadata server of a
VM whose default service account that is (``Metadata-Flavor: Google``
required): ``/`` (the ping), ``.../service-accounts/default/`` (its email
and scopes), ``.../service-accounts/default/token`` and
``/computeMetadata/v1/project/project-id``.

Signatures are checked with ``cryptography`` (Twisted's TLS extra brings
it), times on the simulator's clock. Only tokens it minted, unexpired, are
good: :meth:`SimulatedGoogleTokens.check`.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from typing import Any, NamedTuple
from urllib.parse import parse_qs

import ujson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from twisted.internet.interfaces import IReactorTime
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource

from twisted_relay._json import to_json

__all__ = [
    "CLOUD_PLATFORM",
    "GOOGLE_TOKEN_URI",
    "JWT_BEARER",
    "GrantRefused",
    "IssuedToken",
    "ServiceAccount",
    "headers_of",
    "SimulatedGoogleTokens",
    "make_service_account",
]

#: The scope Vertex AI needs.
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
#: Google's token endpoint: the ``aud`` every service-account assertion
#: names, whatever ``token_uri`` it is posted to (google-auth).
GOOGLE_TOKEN_URI = "https://oauth2.googleapis.com/token"
#: RFC 7523's grant type.
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
#: The longest an assertion may live (Google: one hour), and the clock skew allowed.
MAX_ASSERTION_LIFE = 3600
CLOCK_SKEW = 300

_SHORT_LIVED = (
    "Invalid JWT: Token must be a short-lived token (60 minutes) and in a reasonable timeframe. "
    "Check your iat and exp values in the JWT claim."
)
_METADATA_PREFIX = "/computeMetadata/v1/"


class IssuedToken(NamedTuple):
    """
    An access token the simulator minted.

    :ivar account: the service account it was minted for.
    :ivar scopes: the scopes granted.
    :ivar expires_at: when it stops being good (the simulator's clock).
    """

    account: str
    scopes: frozenset
    expires_at: float


class ServiceAccount(NamedTuple):
    """
    A test service account: ``info`` is its key file's content (what
    ``google.oauth2.service_account.Credentials.from_service_account_info``
    and ``GOOGLE_APPLICATION_CREDENTIALS`` take), ``public_key`` the PEM the
    simulated endpoint checks its assertions with.
    """

    info: dict
    public_key: bytes

    @property
    def email(self) -> str:
        return self.info["client_email"]


def make_service_account(email: str, project_id: str, token_uri: str) -> ServiceAccount:
    """
    A new service account with a fresh 2048-bit RSA key, whose key file
    sends google-auth to ``token_uri`` (the simulated endpoint's ``/token``).
    """
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode("ascii")
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    info = {
        "type": "service_account",
        "project_id": project_id,
        "private_key_id": secrets.token_hex(20),
        "private_key": private,
        "client_email": email,
        "client_id": str(secrets.randbelow(10**20)),
        "token_uri": token_uri,
    }
    return ServiceAccount(info, public)


class GrantRefused(Exception):
    def __init__(self, error: str, description: str):
        super().__init__(description)
        self.error = error
        self.description = description


class SimulatedGoogleTokens:
    """
    Google's token endpoint (and a metadata server) for tests.

    :param reactor: the clock tokens and assertions are judged by; the
        global reactor when ``None``.
    :param service_accounts: service-account email -> its public key (PEM
        bytes or text, or a ``cryptography`` RSA public key).
    :param lifetime: the seconds an access token lives (Google's: 3599).
    :param metadata_account: the email of the metadata server's default
        service account; ``None``: no metadata routes.
    :param metadata_scopes: the scopes of that account.
    :param project_id: what the metadata server says the project is.

    :ivar minted: how many access tokens were minted (every grant counts).
    """

    def __init__(
        self,
        reactor: IReactorTime | None = None,
        service_accounts: dict[str, Any] | None = None,
        *,
        lifetime: int = 3599,
        metadata_account: str | None = None,
        metadata_scopes: tuple[str, ...] = (CLOUD_PLATFORM,),
        project_id: str | None = None,
    ):
        if lifetime < 1:
            raise ValueError("lifetime must be 1 second or more")
        self._reactor = reactor
        self._keys = {email: _public_key(key) for email, key in (service_accounts or {}).items()}
        self.lifetime = lifetime
        self.metadata_account = metadata_account
        self.metadata_scopes = tuple(metadata_scopes)
        self.project_id = project_id
        self._issued: dict[str, IssuedToken] = {}
        self.minted = 0

    @property
    def reactor(self) -> IReactorTime:
        if self._reactor is None:
            from twisted.internet import reactor

            self._reactor = reactor  # type: ignore[assignment]
        return self._reactor  # type: ignore[return-value]

    def add_service_account(self, email: str, public_key: Any) -> None:
        """Know one more service account."""
        self._keys[email] = _public_key(public_key)

    def resource(self) -> IResource:
        """``/token`` and, with a metadata account, the metadata routes."""
        return _TokenResource(self)

    def serves(self, path: str, headers: dict[str, str]) -> bool:
        """Whether a request for ``path`` is this endpoint's (a Site that
        serves Vertex too asks this first)."""
        if path == "/token":
            return True
        if self.metadata_account is None:
            return False
        return path.startswith(_METADATA_PREFIX) or (path == "/" and "metadata-flavor" in headers)

    # -- tokens ---------------------------------------------------------------

    def issue(self, account: str, scopes) -> tuple[str, int]:
        """Mint an access token for ``account``: ``(token, expires_in)``."""
        now = self.reactor.seconds()
        # Forget what has expired: the table stays as small as the tokens alive.
        for token in [t for t, issued in self._issued.items() if issued.expires_at <= now]:
            del self._issued[token]
        token = "ya29.c." + secrets.token_urlsafe(48)
        self._issued[token] = IssuedToken(account, frozenset(scopes), now + self.lifetime)
        self.minted += 1
        return token, self.lifetime

    def check(self, token: str) -> IssuedToken | None:
        """The token as minted, or ``None`` when it never was. An expired
        token is returned: its ``expires_at`` says so (see :meth:`expired`)."""
        return self._issued.get(token)

    def expired(self, issued: IssuedToken) -> bool:
        return self.reactor.seconds() >= issued.expires_at

    def grant(self, form: dict[str, list[str]], own_uri: str | None = None) -> dict:
        """
        Answer one form-encoded token request.

        :param own_uri: the URL the request came to, a good ``aud`` too.

        :raises GrantRefused: as Google refuses it.
        """
        grant_type = form.get("grant_type", [""])[0]
        if grant_type != JWT_BEARER:
            raise GrantRefused("unsupported_grant_type", "Invalid grant_type: " + grant_type)
        assertion = form.get("assertion", [""])[0]
        if not assertion:
            raise GrantRefused("invalid_request", "Missing required parameter: assertion")
        claims = self._verified_claims(assertion, own_uri)
        scope = claims.get("scope")
        if not isinstance(scope, str) or not scope.split():
            raise GrantRefused("invalid_scope", "Invalid OAuth scope or ID token audience provided.")
        token, expires_in = self.issue(claims["iss"], scope.split())
        return {"access_token": token, "expires_in": expires_in, "token_type": "Bearer"}

    def _verified_claims(self, assertion: str, own_uri: str | None) -> dict:
        parts = assertion.split(".")
        if len(parts) != 3:
            raise GrantRefused("invalid_grant", "Invalid JWT: the assertion is not a signed JWT.")
        try:
            header = ujson.loads(_unbase64(parts[0]))
            claims = ujson.loads(_unbase64(parts[1]))
            signature = _unbase64(parts[2])
        except (ValueError, binascii.Error):
            raise GrantRefused("invalid_grant", "Invalid JWT: the assertion is not a signed JWT.")
        if not isinstance(header, dict) or not isinstance(claims, dict) or header.get("alg") != "RS256":
            raise GrantRefused("invalid_grant", "Invalid JWT: the assertion is not an RS256 JWT.")
        key = self._keys.get(claims.get("iss"))  # type: ignore[arg-type]
        if key is None:
            raise GrantRefused("invalid_grant", "Invalid grant: account not found")
        signed = (parts[0] + "." + parts[1]).encode("ascii")
        try:
            key.verify(signature, signed, padding.PKCS1v15(), hashes.SHA256())
        except InvalidSignature:
            raise GrantRefused("invalid_grant", "Invalid JWT Signature.")
        if claims.get("aud") not in (GOOGLE_TOKEN_URI, own_uri):
            raise GrantRefused(
                "invalid_grant", "Invalid JWT: Failed audience check. The right audience is " + GOOGLE_TOKEN_URI
            )
        iat, exp, now = claims.get("iat"), claims.get("exp"), self.reactor.seconds()
        if not isinstance(iat, (int, float)) or not isinstance(exp, (int, float)):
            raise GrantRefused("invalid_grant", _SHORT_LIVED)
        if exp - iat > MAX_ASSERTION_LIFE or iat > now + CLOCK_SKEW or exp < now - CLOCK_SKEW:
            raise GrantRefused("invalid_grant", _SHORT_LIVED)
        return claims

    # -- the metadata server --------------------------------------------------

    def metadata(self, path: str, query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        """``(status, content type, body)`` for a metadata-server GET."""
        if path == "/":
            return 200, "application/text", b"computeMetadata/\n"
        account_path = _METADATA_PREFIX + "instance/service-accounts/"
        for name in ("default", self.metadata_account):
            if path in (account_path + f"{name}/", account_path + f"{name}"):
                info = {"aliases": ["default"], "email": self.metadata_account, "scopes": list(self.metadata_scopes)}
                return 200, "application/json", to_json(info)
            if path == account_path + f"{name}/token":
                wanted = ",".join(query.get("scopes", [])) or ",".join(self.metadata_scopes)
                token, expires_in = self.issue(str(self.metadata_account), wanted.split(","))
                body = {"access_token": token, "expires_in": expires_in, "token_type": "Bearer"}
                return 200, "application/json", to_json(body)
        if path == _METADATA_PREFIX + "project/project-id" and self.project_id is not None:
            return 200, "application/text", self.project_id.encode("utf-8")
        return 404, "text/html", b"Not Found\n"


def _public_key(key: Any) -> rsa.RSAPublicKey:
    if isinstance(key, str):
        key = key.encode("ascii")
    if isinstance(key, bytes):
        key = serialization.load_pem_public_key(key)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("a service account's key must be an RSA public key")
    return key


def _unbase64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def headers_of(request: IRequest) -> dict[str, str]:
    """A request's headers: lower-case names, repeated ones joined with ``", "``."""
    return {
        name.decode("latin-1").lower(): ", ".join(value.decode("latin-1") for value in values)
        for name, values in request.requestHeaders.getAllRawHeaders()
    }


class _TokenResource(Resource):
    isLeaf = True

    def __init__(self, tokens: SimulatedGoogleTokens):
        super().__init__()
        self._tokens = tokens

    def render(self, request: IRequest) -> bytes:
        path = request.path.decode("utf-8", "replace")
        headers = headers_of(request)
        tokens = self._tokens
        if not tokens.serves(path, headers):
            return _answer(request, 404, "text/html", b"Not Found\n")
        if path != "/token":
            request.setHeader(b"metadata-flavor", b"Google")
            if headers.get("metadata-flavor") != "Google":
                return _answer(request, 403, "text/html", b"Missing required header: Metadata-Flavor\n")
            if request.method != b"GET":
                return _answer(request, 405, "text/html", b"Method Not Allowed\n")
            query = parse_qs(request.uri.decode("utf-8", "replace").partition("?")[2])
            return _answer(request, *tokens.metadata(path, query))
        if request.method != b"POST":
            return _answer(request, 405, "text/html", b"Method Not Allowed\n")
        if not headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
            refusal = {"error": "invalid_request", "error_description": "Invalid request: expected a form body."}
            return _answer(request, 400, "application/json", to_json(refusal))
        raw = request.content.read() if request.content is not None else b""
        form = parse_qs(raw.decode("utf-8", "replace"))
        scheme = "https" if request.isSecure() else "http"
        try:
            answer = tokens.grant(form, "%s://%s/token" % (scheme, headers.get("host", "")))
        except GrantRefused as refused:
            refusal = {"error": refused.error, "error_description": refused.description}
            return _answer(request, 400, "application/json", to_json(refusal))
        request.setHeader(b"cache-control", b"no-cache, no-store, max-age=0, must-revalidate")
        return _answer(request, 200, "application/json", to_json(answer))


def _answer(request: IRequest, status: int, content_type: str, body: bytes) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", content_type.encode("ascii") + b"; charset=utf-8")
    return body
