# -*- test-case-name: tests.test_signin_flow -*-
"""
The authorization server Claude Code's gateway sign-in speaks to
(``docs/signin.md``; what the CLI sends and reads:
``claude-code-signin.md``, section 1.3):

- ``GET /.well-known/oauth-authorization-server``: RFC 8414 metadata, its
  endpoints absolute under the public URL (the CLI takes same-origin ones only);
- ``POST /oauth/device_authorization``: a new device grant (RFC 8628), for
  the body ``surface=claude_code`` (no ``client_id``, no scope);
- ``POST /oauth/token``: the device-code grant polled, and the refresh
  grant (the relay's own refresh token, rotated at each use, re-checking
  the person with the identity provider);
- ``POST /oauth/revoke``: RFC 7009, a session token (revoked until it
  expires) or a refresh token (forgotten).

Every answer is JSON with ``Cache-Control: no-store``; errors are OAuth's
``{"error", "error_description"}`` (400, and 401 ``invalid_grant`` when
the person must sign in again). Each route is ``async (signin, request)``.
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs

from twisted.logger import Logger

from twisted_relay.ledger_sql import LedgerError
from twisted_relay.signin.device_flow import APPROVED, DEVICE_CODE_LIFETIME, digest, new_grant, new_secret
from twisted_relay.signin.oidc import IdPError, IdPRefused
from twisted_relay.signin.people import Refusal, identity_of, person_of
from twisted_relay.signin.tokens import SessionTokenError

__all__ = [
    "DEVICE_CODE_GRANT",
    "OAuthError",
    "client_address",
    "device_authorization_route",
    "form_of",
    "metadata_route",
    "revoke_route",
    "token_route",
]

DEVICE_CODE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
#: The largest form body an OAuth endpoint reads.
_MAX_FORM = 16 * 1024
_log = Logger()


class OAuthError(Exception):
    """An OAuth error answer: ``{"error", "error_description"}`` with its status."""

    def __init__(self, status: int, error: str, description: str):
        super().__init__(description)
        self.status = status
        self.error = error
        self.description = description


def client_address(request) -> str:
    """The address a request came from (what the rate limits count)."""
    address = request.getClientAddress()
    return getattr(address, "host", None) or str(address)


def form_of(request) -> dict[str, str]:
    """
    A form-encoded body's fields, each given once (RFC 6749 3.2).

    :raises OAuthError: 400 ``invalid_request`` otherwise.
    """
    content = request.content
    content.seek(0)
    raw = content.read(_MAX_FORM + 1)
    if len(raw) > _MAX_FORM:
        raise OAuthError(400, "invalid_request", "The form is larger than %d bytes." % (_MAX_FORM,))
    try:
        fields = parse_qs(raw.decode("utf-8"), keep_blank_values=True, strict_parsing=bool(raw))
    except (UnicodeDecodeError, ValueError):
        raise OAuthError(400, "invalid_request", "The body is not a form (application/x-www-form-urlencoded).")
    repeated = sorted(name for name, values in fields.items() if len(values) > 1)
    if repeated:
        raise OAuthError(400, "invalid_request", "A parameter is given more than once: %s." % (repeated[0][:64],))
    return {name: values[0] for name, values in fields.items()}


def _json(request, value: dict, status: int = 200) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"cache-control", b"no-store")
    request.setHeader(b"pragma", b"no-cache")
    return json.dumps(value).encode("utf-8")


def _error(request, error: OAuthError) -> bytes:
    return _json(request, {"error": error.error, "error_description": error.description}, error.status)


async def _answered(request, work) -> bytes:
    """``work()``'s answer, its :class:`OAuthError` (or a database that cannot be used: 503) as OAuth's error."""
    try:
        return await work()
    except OAuthError as e:
        return _error(request, e)
    except LedgerError as e:
        _log.error("Sign-in: its database cannot be used: {reason}", reason=str(e))
        return _error(request, OAuthError(503, "temporarily_unavailable", "The relay's sign-in database cannot be used now."))


async def metadata_route(signin, request) -> bytes:
    """``GET /.well-known/oauth-authorization-server``."""
    base = signin.config.public_url
    return _json(request, {
        "issuer": base,
        "device_authorization_endpoint": base + "/oauth/device_authorization",
        "token_endpoint": base + "/oauth/token",
        "revocation_endpoint": base + "/oauth/revoke",
        "grant_types_supported": [DEVICE_CODE_GRANT, "refresh_token"],
        "response_types_supported": [],
        "token_endpoint_auth_methods_supported": ["none"],
        "revocation_endpoint_auth_methods_supported": ["none"],
        "gateway_protocol_version": 1,
    })


async def device_authorization_route(signin, request) -> bytes:
    """
    ``POST /oauth/device_authorization``: Claude Code sends ``surface=claude_code``;
    unknown parameters (a later client's, a ``client_id`` or ``scope``) are
    ignored, as RFC 8628 and the gateway protocol ask, but the body must be a form.
    """

    async def work():
        form_of(request)
        if not signin.device_authorizations.allow(client_address(request), signin.now()):
            raise OAuthError(429, "slow_down", "Too many sign-ins from this address; wait a few minutes.")
        config = signin.config
        for _ in range(5):
            device_code, grant = new_grant(signin.now(), config.poll_interval)
            if await signin.store.add_grant(grant, signin.now()):
                break
        else:
            raise OAuthError(503, "temporarily_unavailable", "No free user code was found; try again.")
        page = config.public_url + "/device"
        answer = {
            "device_code": device_code,
            "user_code": grant.user_code,
            "verification_uri": page,
            "verification_uri_complete": page + "?user_code=" + grant.user_code,
            "expires_in": DEVICE_CODE_LIFETIME,
            "interval": grant.interval,
        }
        if config.login_notice:
            answer["login_notice"] = config.login_notice
        return _json(request, answer)

    return await _answered(request, work)


async def token_route(signin, request) -> bytes:
    """``POST /oauth/token``: the device-code grant and the refresh grant."""

    async def work():
        form = form_of(request)
        grant_type = form.get("grant_type")
        if grant_type == DEVICE_CODE_GRANT:
            return await _device_code_grant(signin, request, form)
        if grant_type == "refresh_token":
            return await _refresh_grant(signin, request, form)
        raise OAuthError(400, "unsupported_grant_type",
                         "The relay takes the device_code and refresh_token grants only.")

    return await _answered(request, work)


_POLL_ERRORS = {
    "authorization_pending": "The person has not finished signing in in the browser yet.",
    "slow_down": "Polled sooner than the interval; the interval is 5 seconds longer now.",
    "access_denied": "Sign-in was denied.",
    "expired_token": "The sign-in code has expired; start the sign-in again.",
    "invalid_grant": "The relay knows no such device code (used, expired or never given).",
}


async def _device_code_grant(signin, request, form) -> bytes:
    device_code = form.get("device_code")
    if not device_code:
        raise OAuthError(400, "invalid_request", "The device_code is missing.")
    refresh_token = new_secret()
    now = signin.now()
    verdict, grant = await signin.store.poll_grant(
        digest(device_code), now, (digest(refresh_token), now + signin.config.refresh_ttl))
    if verdict != APPROVED:
        raise OAuthError(400, verdict, _POLL_ERRORS[verdict])
    person = person_of(grant.identity, signin.config)
    if isinstance(person, Refusal):
        raise OAuthError(400, "access_denied", person.reason)
    _log.info("Sign-in: {user} ({group}) signed in", user=person.name, group=person.group or "no group")
    return _session_answer(signin, request, grant.identity, refresh_token if grant.idp_refresh is not None else None)


def _session_answer(signin, request, identity: dict, refresh_token: str | None) -> bytes:
    access_token, claims = signin.tokens.mint(identity)
    answer = {"access_token": access_token, "token_type": "Bearer", "expires_in": signin.tokens.ttl}
    if refresh_token is not None:
        answer["refresh_token"] = refresh_token
    if claims.email:
        answer["email"] = claims.email
    return _json(request, answer)


async def _refresh_grant(signin, request, form) -> bytes:
    """
    A refresh: the identity provider is asked again (with its refresh
    token, kept sealed); a person it refuses, or who may no longer sign in,
    must sign in again (401 ``invalid_grant``); the relay's refresh token
    is replaced by a new one.
    """
    presented = form.get("refresh_token")
    if not presented:
        raise OAuthError(400, "invalid_request", "The refresh_token is missing.")
    old_hash, store, now = digest(presented), signin.store, signin.now()
    kept = await store.refresh_of(old_hash, now)
    if kept is None:
        raise OAuthError(401, "invalid_grant", "The refresh token is not valid (used, revoked or expired); sign in again.")
    identity, sealed = kept
    try:
        answer = await signin.provider.refresh(signin.tokens.unseal(sealed), expected_sub=identity["sub"])
    except (IdPRefused, SessionTokenError):
        await store.delete_refresh(old_hash)
        raise OAuthError(401, "invalid_grant", "The identity provider no longer accepts this session; sign in again.")
    except IdPError as e:
        _log.warn("Sign-in: a refresh could not ask the identity provider: {reason}", reason=str(e))
        raise OAuthError(503, "temporarily_unavailable", "The identity provider cannot be asked now; try again.")
    # The person as the provider sees them now (their groups may have changed).
    fresh = identity_of(answer.claims, signin.config)
    if isinstance(fresh, Refusal):
        await store.delete_refresh(old_hash)
        raise OAuthError(401, "invalid_grant", fresh.reason + " Sign in again.")
    identity = fresh
    person = person_of(identity, signin.config)
    if isinstance(person, Refusal):
        await store.delete_refresh(old_hash)
        raise OAuthError(401, "invalid_grant", person.reason + " Sign in again.")
    idp_refresh = signin.tokens.seal(answer.refresh_token) if answer.refresh_token else sealed
    new_token = new_secret()
    if not await store.rotate_refresh(old_hash, digest(new_token), identity, idp_refresh, now + signin.config.refresh_ttl):
        raise OAuthError(401, "invalid_grant", "The refresh token was used meanwhile; sign in again.")
    return _session_answer(signin, request, identity, new_token)


async def revoke_route(signin, request) -> bytes:
    """
    ``POST /oauth/revoke`` (RFC 7009, no client authentication): a session
    token is revoked until it expires, a refresh token forgotten; 200
    whatever the token was.
    """

    async def work():
        token = form_of(request).get("token")
        if not token:
            raise OAuthError(400, "invalid_request", "The token is missing.")
        if signin.tokens.is_ours(token):
            try:
                claims = signin.tokens.verify(token, expired_ok=True)
            except SessionTokenError:
                claims = None
            if claims is not None and claims.exp > signin.now():
                await signin.revoke(claims)
        else:
            await signin.store.delete_refresh(digest(token))
        return _json(request, {})

    return await _answered(request, work)
