# -*- test-case-name: tests.test_signin_flow -*-
"""
The browser step of a sign-in: the verification page and the identity
provider's way back.

- ``GET /device``: a form where the person types the user code Claude Code
  shows (or confirms it, when the link carried it: the page never submits
  a code by itself, so a link alone signs nobody in), with the login notice;
- ``POST /device``: the code checked (at most 10 tries per address in 10
  minutes), then the browser is sent to the identity provider with PKCE,
  ``state`` and ``nonce``, all kept by the relay (the store: any relay
  behind the name may get the way back), and bound to this browser by a
  cookie (HttpOnly, SameSite=Lax, Secure on https);
- ``GET /oauth/callback``: the ``state`` and the cookie checked, the code
  redeemed (:mod:`twisted_relay.signin.oidc`), who may sign in applied
  (:mod:`twisted_relay.signin.people`); the grant is approved, or denied
  so that Claude Code stops with "Sign-in was denied".

Pages are plain HTML: no script, every value escaped.
"""

from __future__ import annotations

import hmac
from html import escape
from urllib.parse import urlsplit

from twisted.logger import Logger

from twisted_relay.ledger_sql import LedgerError
from twisted_relay.signin.authorization import OAuthError, client_address, form_of
from twisted_relay.signin.device_flow import BROWSER_LOGIN_LIFETIME, BrowserLogin, digest, new_secret, normalized_user_code
from twisted_relay.signin.oidc import IdPError
from twisted_relay.signin.people import Refusal, identity_of, person_of

__all__ = ["COOKIE", "callback_route", "device_page_route", "device_submit_route"]

#: The cookie that binds a browser to its way through the identity provider.
COOKIE = b"relay_signin"
_log = Logger()

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>%(title)s</title>
<style>body{font-family:system-ui,sans-serif;max-width:36em;margin:3em auto;padding:0 1em;line-height:1.5}
input{font-size:1.4em;letter-spacing:.1em;text-transform:uppercase;width:9em}button{font-size:1.1em}
.notice{border-left:3px solid #888;padding-left:.8em;color:#333}.error{color:#a00}</style></head>
<body><h1>%(title)s</h1>%(body)s</body></html>
"""


def _page(request, status: int, title: str, body: str) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"text/html; charset=utf-8")
    request.setHeader(b"cache-control", b"no-store")
    request.setHeader(b"x-frame-options", b"DENY")
    request.setHeader(b"content-security-policy", b"default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'")
    # same-origin, not no-referrer: a browser sends a form posted from a
    # no-referrer page with "Origin: null", which _same_origin refuses; the
    # identity provider (another origin) is sent no referrer either way.
    request.setHeader(b"referrer-policy", b"same-origin")
    return (_PAGE % {"title": escape(title), "body": body}).encode("utf-8")


def _form(signin, user_code: str, error: str | None = None) -> str:
    notice = signin.config.login_notice
    parts = []
    if notice:
        parts.append('<p class="notice">%s</p>' % (escape(notice),))
    if error:
        parts.append('<p class="error">%s</p>' % (escape(error),))
    parts.append(
        "<p>Enter the code Claude Code shows, or check that it is the one shown here. Continue only if you "
        "started this sign-in yourself.</p>"
        '<form method="post" action="/device"><p><input name="user_code" value="%s" autocomplete="off" '
        'autocapitalize="characters" spellcheck="false" maxlength="12" placeholder="XXXX-XXXX" required> '
        '<button type="submit">Continue</button></p></form>' % (escape(user_code),)
    )
    return "".join(parts)


async def device_page_route(signin, request) -> bytes:
    """``GET /device``: the form, the code of ``?user_code=`` filled in (never sent by itself)."""
    given = (request.args.get(b"user_code") or [b""])[0].decode("utf-8", "replace")
    code = normalized_user_code(given) or ""
    return _page(request, 200, "Sign in to Claude Code", _form(signin, code))


def _same_origin(signin, request) -> bool:
    """A form posted from another site is refused (its ``Origin`` names that site)."""
    origin = request.getHeader(b"origin")
    if origin is None or origin == b"null":
        return origin is None
    parts = urlsplit(signin.config.public_url)
    return origin.decode("latin-1").rstrip("/").lower() == "%s://%s" % (parts.scheme, parts.netloc.lower())


async def device_submit_route(signin, request) -> bytes:
    """``POST /device``: check the code, then send the browser to the identity provider."""
    if not _same_origin(signin, request):
        return _page(request, 403, "Sign-in refused", "<p>This form was sent from another site.</p>")
    if not signin.verifications.allow(client_address(request), signin.now()):
        return _page(request, 429, "Too many tries",
                     "<p>Too many codes were tried from this address; wait ten minutes and try again.</p>")
    try:
        typed = form_of(request).get("user_code", "")
    except OAuthError as e:
        return _page(request, 400, "Sign in to Claude Code", _form(signin, "", e.description))
    user_code = normalized_user_code(typed)
    if user_code is None:
        return _page(request, 400, "Sign in to Claude Code",
                     _form(signin, "", "A code is eight letters, such as BCDF-GHJK."))
    now = signin.now()
    state, nonce, verifier, cookie = new_secret(), new_secret(), new_secret(), new_secret()
    login = BrowserLogin(digest(state), digest(cookie), verifier, nonce, now + BROWSER_LOGIN_LIFETIME)
    try:
        started = await signin.store.start_login(user_code, login, now)
        if started:
            await signin.provider.discover()
            url = signin.provider.authorization_url(state, nonce, verifier)
    except LedgerError as e:
        _log.error("Sign-in: its database cannot be used: {reason}", reason=str(e))
        return _page(request, 503, "Sign-in unavailable", "<p>The relay cannot sign anyone in just now; try again.</p>")
    except IdPError as e:
        _log.error("Sign-in: the identity provider cannot be used: {reason}", reason=str(e))
        return _page(request, 502, "Sign-in unavailable", "<p>The identity provider cannot be reached just now; try again.</p>")
    if not started:
        return _page(request, 400, "Sign in to Claude Code",
                     _form(signin, "", "No sign-in is waiting for this code: it may have expired. Start again in Claude Code."))
    request.addCookie(COOKIE, cookie.encode("ascii"), path=b"/oauth/callback", max_age=str(BROWSER_LOGIN_LIFETIME),
                      httpOnly=True, sameSite="lax", secure=signin.config.public_url.startswith("https:"))
    request.setResponseCode(303)
    request.setHeader(b"location", url.encode("utf-8"))
    request.setHeader(b"cache-control", b"no-store")
    return b""


async def callback_route(signin, request) -> bytes:
    """``GET /oauth/callback``: the identity provider's answer for the browser's sign-in."""
    args = request.args
    state = (args.get(b"state") or [b""])[0].decode("utf-8", "replace")
    code = (args.get(b"code") or [b""])[0].decode("utf-8", "replace")
    if not state:
        return _page(request, 400, "Sign-in failed", "<p>The identity provider's answer names no sign-in (state).</p>")
    try:
        return await _callback(signin, request, state, code)
    except LedgerError as e:
        _log.error("Sign-in: its database cannot be used: {reason}", reason=str(e))
        return _page(request, 503, "Sign-in unavailable", "<p>The relay cannot sign anyone in just now; try again.</p>")


async def _callback(signin, request, state: str, code: str) -> bytes:
    store = signin.store
    grant = await store.take_login(digest(state))
    cookie = request.getCookie(COOKIE) or b""
    # The cookie is spent either way.
    request.addCookie(COOKIE, b"", path=b"/oauth/callback", max_age="0", httpOnly=True, sameSite="lax")
    again = "<p>Start the sign-in again in Claude Code.</p>"
    if grant is None or grant.login is None or grant.login.expires_at <= signin.now() or not grant.pending:
        return _page(request, 400, "Sign-in failed", "<p>This sign-in has expired or was finished already.</p>" + again)
    if not hmac.compare_digest(digest(cookie.decode("latin-1")), grant.login.browser_hash):
        return _page(request, 400, "Sign-in failed",
                     "<p>This sign-in was started in another browser; finish it in the browser that started it.</p>")
    if not code:
        # The person declined at the provider (error=access_denied...): Claude Code stops.
        await store.settle_grant(grant.device_hash, None, None)
        return _page(request, 403, "Sign-in cancelled", "<p>The identity provider did not sign you in.</p>")
    try:
        answer = await signin.provider.redeem(code, grant.login.code_verifier, grant.login.nonce)
    except IdPError as e:
        _log.warn("Sign-in: the identity provider's answer could not be used: {reason}", reason=str(e))
        return _page(request, 502, "Sign-in failed",
                     "<p>The identity provider's answer could not be used.</p>" + again)
    identity = identity_of(answer.claims, signin.config)
    person = identity if isinstance(identity, Refusal) else person_of(identity, signin.config)
    if isinstance(person, Refusal):
        await store.settle_grant(grant.device_hash, None, None)
        _log.info("Sign-in refused for {sub}: {reason}", sub=answer.claims.get("sub"), reason=person.reason)
        return _page(request, 403, "Sign-in refused", "<p>%s</p>" % (escape(person.reason),))
    sealed = signin.tokens.seal(answer.refresh_token) if answer.refresh_token else None
    if not await store.settle_grant(grant.device_hash, identity, sealed):
        return _page(request, 400, "Sign-in failed", "<p>This sign-in has expired or was finished already.</p>" + again)
    return _page(
        request, 200, "Signed in",
        "<p>Signed in as <strong>%s</strong>. Go back to Claude Code; you may close this window.</p>"
        % (escape(person.email or person.name),),
    )
