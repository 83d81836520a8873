"""
Tests for :mod:`twisted_relay.signin.oidc`, the relay's OpenID Connect
client, against the simulated identity provider on 127.0.0.1 (real
sockets, treq on the reactor): the code flow with PKCE, the ID token's
checks (nonce, audience, expiry, signature, unknown key after a rotation,
``alg: none`` and HMAC refused), refreshes (a disabled user is
:class:`IdPRefused`), the provider unreachable or failing
(:class:`IdPUnavailable`), and no secret in any error.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from urllib.parse import parse_qs, urlsplit

from joserfc import jwk, jwt
from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from twisted_relay.signin.oidc import (
    IdPAnswer,
    IdPError,
    IdPRefused,
    IdPUnavailable,
    OIDCProvider,
    new_code_verifier,
    new_secret_value,
)
from twisted_relay.simulated.idp import ID_TOKEN_LIFETIME, IdPClient, IdPUser, SimulatedIdP

from tests.test_simulated_idp import picker_request_id

CALLBACK = "https://relay.example/oauth/callback"
SECRET = "client-secret-never-shown"
ADA = IdPUser("ada@example.com", "sub-ada", ("eng",), "Ada")


def unsigned(header: dict, claims: dict) -> str:
    """A JWT with ``alg: none`` and no signature."""
    def part(value: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    return part({**header, "alg": "none"}) + "." + part(claims) + "."


class RelyingPartyTests(TestCase):
    """:class:`OIDCProvider` against the simulated provider."""

    def setUp(self) -> None:
        self.idp = SimulatedIdP(users=[ADA], clients=[IdPClient("twisted-relay", SECRET, (CALLBACK,))])
        root = Resource()
        root.putChild(b"_idp", self.idp.resource())
        port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.issuer = "http://127.0.0.1:%d/_idp" % port.getHost().port
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.http = HTTPClient(Agent(reactor, pool=pool))
        self.clock = reactor

    def provider(self, **kwargs) -> OIDCProvider:
        settings = {"http": self.http, "clock": self.clock, **kwargs}
        issuer = settings.pop("issuer", self.issuer)
        return OIDCProvider(issuer, "twisted-relay", SECRET, ["openid", "email", "profile"], CALLBACK, **settings)

    async def browse(self, url: str, email: str = ADA.email) -> str:
        """The browser at the provider: the picker page, ``email`` picked; the code it sends back."""
        page = await self.http.get(url, allow_redirects=False)
        self.assertEqual(page.code, 200)
        form = {"request": picker_request_id((await page.text()).strip()), "email": email, "action": "sign_in"}
        back = await self.http.post(url.split("?")[0], data=form, allow_redirects=False)
        await back.content()
        self.assertEqual(back.code, 302)
        location = back.headers.getRawHeaders(b"location")[0].decode()
        self.assertTrue(location.startswith(CALLBACK + "?"), location)
        return parse_qs(urlsplit(location).query)["code"][0]

    async def sign_in(self, provider: OIDCProvider, nonce: str = "nonce-ok") -> IdPAnswer:
        await provider.discover()
        verifier = new_code_verifier()
        code = await self.browse(provider.authorization_url(new_secret_value(), "nonce-ok", verifier))
        return await provider.redeem(code, verifier, nonce)

    async def refused(self, provider: OIDCProvider, error=IdPError, **sign_in) -> str:
        """The one-line message of the error the sign-in fails with."""
        try:
            await self.sign_in(provider, **sign_in)
        except error as failure:
            message = str(failure)
            self.assertNotIn("\n", message)
            self.assertNotIn(SECRET, message)
            return message
        self.fail("the sign-in was not refused")

    async def test_happy_path(self) -> None:
        """Discovery, the authorization URL with PKCE S256, the code redeemed, the ID token's claims."""
        provider = self.provider()
        metadata = await provider.discover()
        self.assertEqual(metadata["issuer"], self.issuer)
        verifier, state = new_code_verifier(), new_secret_value()
        url = provider.authorization_url(state, "nonce-1", verifier, login_hint=ADA.email)
        query = parse_qs(urlsplit(url).query)
        challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
        self.assertEqual(query["code_challenge"], [challenge])
        self.assertEqual(query["code_challenge_method"], ["S256"])
        self.assertEqual((query["state"], query["nonce"], query["client_id"]), ([state], ["nonce-1"], ["twisted-relay"]))
        self.assertEqual(query["redirect_uri"], [CALLBACK])
        self.assertEqual(query["scope"], ["openid email profile"])
        answer = await provider.redeem(await self.browse(url), verifier, "nonce-1")
        self.assertEqual(answer.claims["sub"], ADA.sub)
        self.assertEqual(answer.claims["email"], ADA.email)
        self.assertEqual(answer.claims["groups"], ["eng"])
        self.assertTrue(answer.refresh_token)
        self.assertNotIn(answer.refresh_token, repr(answer))
        self.assertNotIn(SECRET, repr(provider))
        self.assertEqual(self.idp.requests["discovery"], 1, "the discovery document is cached")

    async def test_both_client_authentications(self) -> None:
        """client_secret_post and client_secret_basic both redeem; a wrong secret is an IdPError without it."""
        for method in ("client_secret_post", "client_secret_basic"):
            answer = await self.sign_in(self.provider(auth_method=method))
            self.assertEqual(answer.claims["sub"], ADA.sub)
        wrong = OIDCProvider(self.issuer, "twisted-relay", "wrong-secret-xyz", ["openid"], CALLBACK,
                             http=self.http, clock=self.clock)
        message = await self.refused(wrong)
        self.assertIn("invalid_client", message)
        self.assertNotIn("wrong-secret-xyz", message)
        self.assertNotIsInstance(await self._failure_of(wrong), IdPRefused)

    async def _failure_of(self, provider: OIDCProvider) -> Exception:
        try:
            await self.sign_in(provider)
        except IdPError as failure:
            return failure
        self.fail("no failure")

    async def test_wrong_nonce(self) -> None:
        """An ID token whose nonce is not the sign-in's is refused."""
        self.assertIn("nonce", await self.refused(self.provider(), nonce="another-nonce"))

    async def test_wrong_audience(self) -> None:
        """A token for another client is refused; several audiences need azp to be ours."""
        self.idp.id_token_edit = lambda header, claims: claims.update(aud="another-client", azp="another-client")
        self.assertIn("aud", await self.refused(self.provider()))
        self.idp.id_token_edit = lambda header, claims: claims.update(aud=["twisted-relay", "other"], azp=None)
        self.assertIn("azp", await self.refused(self.provider()))
        self.idp.id_token_edit = lambda header, claims: claims.update(aud=["other", "twisted-relay"])
        answer = await self.sign_in(self.provider())
        self.assertEqual(answer.claims["azp"], "twisted-relay")

    async def test_wrong_issuer(self) -> None:
        """A discovery document naming another issuer, or an ID token from another, is refused."""
        answer = await self.sign_in(self.provider(issuer=self.issuer + "/"))
        self.assertEqual(answer.claims["iss"], self.issuer, "a trailing slash names the same issuer")
        self.idp.issuer = "https://elsewhere.example"
        self.assertIn("discovery document names the issuer", await self.refused(self.provider()))
        self.idp.issuer = None
        self.idp.id_token_edit = lambda header, claims: claims.update(iss="https://elsewhere.example")
        self.assertIn("iss", await self.refused(self.provider()))

    async def test_expired_token(self) -> None:
        """A token past its exp (and the leeway) is refused; within the leeway it is taken."""
        late = Clock()
        late.advance(time.time() + ID_TOKEN_LIFETIME + 30)
        answer = await self.sign_in(self.provider(clock=late))
        self.assertEqual(answer.claims["sub"], ADA.sub)
        later = Clock()
        later.advance(time.time() + ID_TOKEN_LIFETIME + 90)
        self.assertIn("expired", await self.refused(self.provider(clock=later)))
        self.idp.id_token_edit = lambda header, claims: claims.pop("exp") and None
        self.assertIn("exp", await self.refused(self.provider()), "a token without exp never expires: refused")

    async def test_tampered_signature(self) -> None:
        """A changed signature, or claims changed after signing, do not verify."""

        def flipped(header, claims):
            head, body, signature = self.idp.sign(header, claims).split(".")
            return ".".join((head, body, ("A" if signature[0] != "A" else "B") + signature[1:]))

        self.idp.id_token_edit = flipped
        self.assertIn("signature", await self.refused(self.provider()))

        def claims_changed(header, claims):
            head, _, signature = self.idp.sign(header, claims).split(".")
            forged = base64.urlsafe_b64encode(json.dumps({**claims, "groups": ["admins"]}).encode()).rstrip(b"=")
            return ".".join((head, forged.decode(), signature))

        self.idp.id_token_edit = claims_changed
        self.assertIn("signature", await self.refused(self.provider()))

    async def test_alg_none_and_hmac_refused(self) -> None:
        """``alg: none`` and an HS256 token signed with the client secret (key confusion) are refused."""
        self.idp.id_token_edit = unsigned
        self.assertIn("alg none", await self.refused(self.provider()))

        def hmac_with_secret(header, claims):
            return jwt.encode({"alg": "HS256", "kid": header["kid"]}, claims, jwk.OctKey.import_key(SECRET))

        self.idp.id_token_edit = hmac_with_secret
        self.assertIn("alg HS256", await self.refused(self.provider()))

    async def test_unknown_kid_after_rotation(self) -> None:
        """A token under a key the cached set lacks makes the keys be fetched again, once a minute at most."""
        clock = Clock()
        clock.advance(time.time())
        provider = self.provider(clock=clock)
        await self.sign_in(provider)
        self.assertEqual(self.idp.requests["jwks"], 1)
        await self.sign_in(provider)
        self.assertEqual(self.idp.requests["jwks"], 1, "the keys are cached")
        self.idp.rotate_key(keep_old=False)
        answer = await self.sign_in(provider)
        self.assertEqual(answer.claims["sub"], ADA.sub)
        self.assertEqual(self.idp.requests["jwks"], 2, "fetched again for the new kid")
        self.idp.rotate_key(keep_old=False)
        self.assertIn("kid", await self.refused(provider))
        self.assertEqual(self.idp.requests["jwks"], 2, "not again within the minute")
        clock.advance(61)
        answer = await self.sign_in(provider)
        self.assertEqual(self.idp.requests["jwks"], 3)

    async def test_refresh(self) -> None:
        """A refresh tells the groups as they are now; a disabled user is IdPRefused."""
        provider = self.provider()
        answer = await self.sign_in(provider)
        self.idp.update_user(ADA.email, groups=["eng", "leads"])
        refreshed = await provider.refresh(answer.refresh_token, expected_sub=ADA.sub)
        self.assertEqual(refreshed.claims["groups"], ["eng", "leads"])
        self.assertEqual(refreshed.claims["sub"], ADA.sub)
        self.assertTrue(refreshed.refresh_token)
        with self.assertRaises(IdPError) as caught:
            await provider.refresh(refreshed.refresh_token, expected_sub="sub-of-someone-else")
        self.assertIn("another subject", str(caught.exception))
        self.idp.disable_user(ADA.email)
        with self.assertRaises(IdPRefused) as caught:
            await provider.refresh(refreshed.refresh_token)
        self.assertIn("invalid_grant", str(caught.exception))
        self.assertNotIn(refreshed.refresh_token, str(caught.exception))

    async def test_refresh_without_id_token(self) -> None:
        """A provider whose refresh answers no ID token is asked ``/userinfo``; the old refresh token is kept
        when it sends no new one."""
        self.idp.refresh_id_tokens = False
        provider = self.provider()
        answer = await self.sign_in(provider)
        self.idp.update_user(ADA.email, groups=["ops"])
        refreshed = await provider.refresh(answer.refresh_token)
        self.assertEqual((refreshed.claims["sub"], refreshed.claims["groups"]), (ADA.sub, ["ops"]))
        self.assertEqual(self.idp.requests["userinfo"], 1)

    async def test_bad_code_is_refused_without_secrets(self) -> None:
        """A code the provider does not know is IdPRefused; the message holds neither code nor verifier."""
        provider = self.provider()
        await provider.discover()
        with self.assertRaises(IdPRefused) as caught:
            await provider.redeem("code-that-is-not-real", "verifier-that-is-secret", "n")
        message = str(caught.exception)
        for secret in ("code-that-is-not-real", "verifier-that-is-secret", SECRET):
            self.assertNotIn(secret, message)

    async def test_discovery_kept_while_the_provider_is_down(self) -> None:
        """The discovery document is read again after an hour; when that fails the old one is kept."""
        clock = Clock()
        clock.advance(time.time())
        provider = self.provider(clock=clock)
        first = await provider.discover()
        clock.advance(3601)
        await provider.discover()
        self.assertEqual(self.idp.requests["discovery"], 2)
        self.patch(self.idp, "discovery", lambda issuer: 1 / 0)  # the provider fails: a 500
        clock.advance(3601)
        self.assertEqual(await provider.discover(), first)
        self.flushLoggedErrors(ZeroDivisionError)

    async def test_unreachable(self) -> None:
        """No provider listening: IdPUnavailable, one line."""
        port = reactor.listenTCP(0, Site(Resource()), interface="127.0.0.1")
        number = port.getHost().port
        await port.stopListening()
        provider = self.provider(issuer="http://127.0.0.1:%d" % number)
        with self.assertRaises(IdPUnavailable) as caught:
            await provider.discover()
        self.assertNotIn("\n", str(caught.exception))


class _Misbehaving(Resource):
    """A provider that answers discovery, then fails the token endpoint in one way: ``status`` (with an
    error body echoing the form it got), or never answering."""

    isLeaf = True

    def __init__(self, status: int | None):
        super().__init__()
        self.status = status
        self.base = ""
        self.hanging: list = []

    def render(self, request):
        if request.postpath[-1] == b"openid-configuration":
            request.setHeader(b"content-type", b"application/json")
            return json.dumps({"issuer": self.base, "authorization_endpoint": self.base + "/authorize",
                               "token_endpoint": self.base + "/token", "jwks_uri": self.base + "/jwks"}).encode()
        if self.status is None:
            self.hanging.append(request)
            return NOT_DONE_YET
        request.setResponseCode(self.status)
        request.setHeader(b"content-type", b"application/json")
        echoed = request.content.read().decode() + " " + (request.getHeader(b"authorization") or b"").decode()
        error = "invalid_grant" if self.status == 400 else "server_error"
        return json.dumps({"error": error, "error_description": "you sent " + echoed}).encode()


class ProviderFailureTests(TestCase):
    """How a failing provider is reported."""

    def serve(self, status: int | None) -> OIDCProvider:
        resource = _Misbehaving(status)
        port = reactor.listenTCP(0, Site(resource), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        resource.base = "http://127.0.0.1:%d" % port.getHost().port
        http = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))
        return OIDCProvider(resource.base, "twisted-relay", SECRET, ["openid"], CALLBACK, http=http,
                            clock=reactor, timeout=0.5, auth_method="client_secret_basic")

    async def test_echoed_secrets_are_scrubbed(self) -> None:
        """A provider that echoes the request in its error: the refresh token, code, verifier and secret are
        taken out of the message."""
        provider = self.serve(400)
        with self.assertRaises(IdPRefused) as caught:
            await provider.refresh("refresh-token-secret-value")
        message = str(caught.exception)
        self.assertIn("you sent", message)
        self.assertNotIn("refresh-token-secret-value", message)
        with self.assertRaises(IdPRefused) as caught:
            await provider.redeem("the-code-value", "the-verifier-value", "n")
        self.assertNotIn("the-code-value", str(caught.exception))
        self.assertNotIn("the-verifier-value", str(caught.exception))

    async def test_server_error(self) -> None:
        """A 5xx from the token endpoint is IdPUnavailable."""
        provider = self.serve(503)
        with self.assertRaises(IdPUnavailable) as caught:
            await provider.refresh("refresh-token-secret-value")
        self.assertIn("HTTP 503", str(caught.exception))

    async def test_timeout(self) -> None:
        """A provider that never answers: IdPUnavailable after the timeout."""
        provider = self.serve(None)
        with self.assertRaises(IdPUnavailable) as caught:
            await provider.refresh("refresh-token-secret-value")
        self.assertIn("did not answer within 0.5 s", str(caught.exception))

    async def test_authorization_url_needs_discovery(self) -> None:
        """Asking for the URL before the discovery document is read is an IdPError, not a KeyError."""
        provider = self.serve(400)
        with self.assertRaises(IdPError):
            provider.authorization_url("s", "n", new_code_verifier())
