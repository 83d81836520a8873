"""
Tests for :mod:`twisted_relay.simulated.idp`, the simulated OpenID Connect
provider.

The oracle is a real OIDC client: authlib's ``OAuth2Session`` (requests)
runs the code flow with PKCE in a thread against the provider served on
127.0.0.1 (mounted under ``/_idp``, as the demo mounts it), a plain
``requests.Session`` plays the browser at the user picker, and the ID tokens
are verified with joserfc against the published keys. The rules about codes,
users and time are tested on the provider object with a ``Clock``.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlsplit

import requests
from authlib.common.security import generate_token
from authlib.integrations.base_client.errors import OAuthError
from authlib.integrations.requests_client import OAuth2Session
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from joserfc import jwk, jwt
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site

from twisted_relay.simulated.idp import CODE_LIFETIME, IdPClient, IdPUser, SimulatedIdP

CALLBACK = "http://127.0.0.1:1/oauth/callback"
ADA = IdPUser("ada@example.com", "sub-ada", ("eng", "eng-platform"), "Ada Lovelace")
BOB = IdPUser("bob@example.com", "sub-bob", ("sales",), "Bob")
CLIENT = IdPClient("twisted-relay", "s3cret-of-the-relay", (CALLBACK,))


def picker_request_id(page: str) -> str:
    """The hidden ``request`` field of the user picker's form."""
    found = re.search(r'name="request" value="([^"]+)"', page)
    assert found, page
    return found.group(1)


def browser() -> requests.Session:
    session = requests.Session()
    session.headers["Connection"] = "close"  # no connection outlives a test
    return session


def oauth_session(method: str = "client_secret_basic", secret: str = CLIENT.secret) -> OAuth2Session:
    session = OAuth2Session(
        CLIENT.client_id, secret, scope="openid email profile", redirect_uri=CALLBACK,
        code_challenge_method="S256", token_endpoint_auth_method=method,
    )
    session.headers["Connection"] = "close"
    return session


class ServedIdPTests(TestCase):
    """The provider on 127.0.0.1 under ``/_idp``, driven by authlib and requests in a thread."""

    def setUp(self) -> None:
        self.idp = SimulatedIdP(users=[ADA, BOB], clients=[CLIENT])
        root = Resource()
        root.putChild(b"_idp", self.idp.resource())
        port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.issuer = "http://127.0.0.1:%d/_idp" % port.getHost().port

    def metadata(self) -> dict:
        with browser() as b:
            return b.get(self.issuer + "/.well-known/openid-configuration", timeout=10).json()

    def sign_in(self, session: OAuth2Session, email: str = ADA.email, nonce: str = "nonce-1") -> tuple[dict, dict]:
        """The whole code flow for ``email``: ``(token answer, discovery)``."""
        metadata = self.metadata()
        verifier = generate_token(48)
        url, state = session.create_authorization_url(
            metadata["authorization_endpoint"], code_verifier=verifier, nonce=nonce, login_hint=email
        )
        with browser() as b:
            page = b.get(url, allow_redirects=False, timeout=10)
            assert page.status_code == 200, page.text
            back = b.post(metadata["authorization_endpoint"], allow_redirects=False, timeout=10,
                          data={"request": picker_request_id(page.text), "email": email, "action": "sign_in"})
        assert back.status_code == 302, back.text
        answer = session.fetch_token(
            metadata["token_endpoint"], authorization_response=back.headers["location"],
            code_verifier=verifier, state=state,
        )
        return answer, metadata

    def verified(self, metadata: dict, id_token: str) -> dict:
        with browser() as b:
            keys = jwk.KeySet.import_key_set(b.get(metadata["jwks_uri"], timeout=10).json())
        token = jwt.decode(id_token, keys, algorithms=["RS256"])
        self.assertEqual(token.header["kid"], self.idp.kid)
        return token.claims

    async def test_discovery(self) -> None:
        """The discovery document names the issuer with its mount prefix and the endpoints under it."""
        metadata = await deferToThread(self.metadata)
        self.assertEqual(metadata["issuer"], self.issuer)
        for name, path in (("authorization_endpoint", "/authorize"), ("token_endpoint", "/token"),
                           ("jwks_uri", "/jwks"), ("userinfo_endpoint", "/userinfo")):
            self.assertEqual(metadata[name], self.issuer + path)
        self.assertEqual(metadata["response_types_supported"], ["code"])
        self.assertEqual(metadata["code_challenge_methods_supported"], ["S256"])
        self.assertEqual(metadata["id_token_signing_alg_values_supported"], ["RS256"])
        self.assertIn("client_secret_post", metadata["token_endpoint_auth_methods_supported"])
        self.assertIn("refresh_token", metadata["grant_types_supported"])

    async def test_code_flow_with_pkce(self) -> None:
        """authlib signs in with code + PKCE; the ID token verifies under the JWKS with every claim a client reads."""

        def flow():
            session = oauth_session()
            answer, metadata = self.sign_in(session)
            claims = self.verified(metadata, answer["id_token"])
            userinfo = session.get(metadata["userinfo_endpoint"], timeout=10).json()
            return answer, claims, userinfo

        answer, claims, userinfo = await deferToThread(flow)
        self.assertEqual(answer["token_type"], "Bearer")
        self.assertTrue(answer["refresh_token"])
        self.assertEqual(claims["iss"], self.issuer)
        self.assertEqual(claims["aud"], CLIENT.client_id)
        self.assertEqual(claims["sub"], ADA.sub)
        self.assertEqual(claims["email"], ADA.email)
        self.assertIs(claims["email_verified"], True)
        self.assertEqual(claims["name"], ADA.name)
        self.assertEqual(claims["groups"], list(ADA.groups))
        self.assertEqual(claims["nonce"], "nonce-1")
        self.assertLess(claims["iat"], claims["exp"])
        self.assertLessEqual(claims["auth_time"], claims["iat"])
        self.assertEqual(userinfo["sub"], ADA.sub)
        self.assertEqual(userinfo["groups"], list(ADA.groups))

    async def test_client_secret_post(self) -> None:
        """The client may authenticate in the form body too."""
        answer, _ = await deferToThread(self.sign_in, oauth_session("client_secret_post"), BOB.email)
        self.assertTrue(answer["access_token"])

    async def test_wrong_client_secret(self) -> None:
        """A wrong secret is ``invalid_client``, whichever way it is sent."""
        for method in ("client_secret_basic", "client_secret_post"):
            with self.assertRaises(OAuthError) as caught:
                await deferToThread(self.sign_in, oauth_session(method, "not-the-secret"))
            self.assertEqual(caught.exception.error, "invalid_client")

    async def test_refresh_reads_the_user_now(self) -> None:
        """A refresh answers a fresh ID token with the groups as they are now; once disabled, ``invalid_grant``."""

        def flow():
            session = oauth_session()
            answer, metadata = self.sign_in(session)
            reactor.callFromThread(self.idp.update_user, ADA.email, groups=["eng", "leads"])
            refreshed = session.refresh_token(metadata["token_endpoint"], refresh_token=answer["refresh_token"])
            claims = self.verified(metadata, refreshed["id_token"])
            reactor.callFromThread(self.idp.disable_user, ADA.email)
            try:
                session.refresh_token(metadata["token_endpoint"], refresh_token=refreshed["refresh_token"])
            except OAuthError as refused:
                return claims, refused.error
            return claims, None

        claims, refused = await deferToThread(flow)
        self.assertEqual(claims["groups"], ["eng", "leads"])
        self.assertNotIn("nonce", claims)
        self.assertEqual(refused, "invalid_grant")

    async def test_code_is_single_use(self) -> None:
        """A code redeemed twice is refused with ``invalid_grant``, and the refresh token it gave is revoked."""

        def flow():
            session = oauth_session()
            metadata = self.metadata()
            verifier = generate_token(48)
            url, state = session.create_authorization_url(metadata["authorization_endpoint"], code_verifier=verifier)
            with browser() as b:
                page = b.get(url, timeout=10)
                back = b.post(metadata["authorization_endpoint"], allow_redirects=False, timeout=10,
                              data={"request": picker_request_id(page.text), "email": ADA.email})
            first = session.fetch_token(metadata["token_endpoint"], authorization_response=back.headers["location"],
                                        code_verifier=verifier)
            errors = []
            for attempt in (
                lambda: session.fetch_token(metadata["token_endpoint"],
                                            authorization_response=back.headers["location"], code_verifier=verifier),
                lambda: session.refresh_token(metadata["token_endpoint"], refresh_token=first["refresh_token"]),
            ):
                try:
                    attempt()
                except OAuthError as refused:
                    errors.append(refused.error)
            return errors

        self.assertEqual(await deferToThread(flow), ["invalid_grant", "invalid_grant"])

    async def test_wrong_code_verifier(self) -> None:
        """A verifier that does not hash to the challenge is ``invalid_grant``."""

        def flow():
            session = oauth_session()
            metadata = self.metadata()
            url, _ = session.create_authorization_url(metadata["authorization_endpoint"],
                                                      code_verifier=generate_token(48))
            with browser() as b:
                page = b.get(url, timeout=10)
                back = b.post(metadata["authorization_endpoint"], allow_redirects=False, timeout=10,
                              data={"request": picker_request_id(page.text), "email": ADA.email})
            try:
                session.fetch_token(metadata["token_endpoint"], authorization_response=back.headers["location"],
                                    code_verifier=generate_token(48))
            except OAuthError as refused:
                return refused.error, refused.description
            return None, None

        error, description = await deferToThread(flow)
        self.assertEqual(error, "invalid_grant")
        self.assertIn("PKCE", description)

    async def test_picker_page(self) -> None:
        """The page lists every user, ``login_hint`` preselects one, a disabled one cannot be picked; deny redirects
        with ``access_denied`` and the state."""
        self.idp.disable_user(BOB.email)

        def flow():
            metadata = self.metadata()
            url, state = oauth_session().create_authorization_url(
                metadata["authorization_endpoint"], code_verifier=generate_token(48), state="st-1",
                login_hint="BOB@example.com",
            )
            with browser() as b:
                page = b.get(url, timeout=10).text
                refused = b.post(metadata["authorization_endpoint"], allow_redirects=False, timeout=10,
                                 data={"request": picker_request_id(page), "email": BOB.email})
                denied = b.post(metadata["authorization_endpoint"], allow_redirects=False, timeout=10,
                                data={"request": picker_request_id(page), "action": "deny"})
                again = b.post(metadata["authorization_endpoint"], allow_redirects=False, timeout=10,
                               data={"request": picker_request_id(page), "email": ADA.email})
            return page, refused, denied, again

        page, refused, denied, again = await deferToThread(flow)
        self.assertIn('value="ada@example.com">', page)
        self.assertIn('value="bob@example.com" checked disabled>', page)
        self.assertEqual(refused.status_code, 403)
        self.assertIn("disabled", refused.text)
        self.assertEqual(denied.status_code, 302)
        query = parse_qs(urlsplit(denied.headers["location"]).query)
        self.assertEqual(query["error"], ["access_denied"])
        self.assertEqual(query["state"], ["st-1"])
        self.assertTrue(denied.headers["location"].startswith(CALLBACK + "?"))
        self.assertEqual(again.status_code, 400, "a page is used once")

    async def test_authorize_refusals(self) -> None:
        """An unknown client or an unregistered redirect_uri is a page, never a redirect; once those are good,
        a request without PKCE, without openid or not for a code is sent back with its error and state."""
        challenge = create_s256_code_challenge(generate_token(48))
        good = {"client_id": CLIENT.client_id, "redirect_uri": CALLBACK, "response_type": "code",
                "scope": "openid email", "state": "st-2", "code_challenge": challenge,
                "code_challenge_method": "S256"}
        cases = [
            ({"client_id": "nobody"}, 400, None),
            ({"redirect_uri": CALLBACK + "/evil"}, 400, None),
            ({"redirect_uri": "http://attacker.example/cb"}, 400, None),
            ({"code_challenge": None}, 302, "invalid_request"),
            ({"code_challenge_method": "plain"}, 302, "invalid_request"),
            ({"scope": "email"}, 302, "invalid_scope"),
            ({"response_type": "token"}, 302, "unsupported_response_type"),
            ({"prompt": "none"}, 302, "login_required"),
        ]

        def flow():
            found = []
            with browser() as b:
                for change, _, _ in cases:
                    params = {k: v for k, v in {**good, **change}.items() if v is not None}
                    found.append(b.get(self.issuer + "/authorize", params=params, allow_redirects=False, timeout=10))
            return found

        for (change, status, error), answer in zip(cases, await deferToThread(flow)):
            self.assertEqual(answer.status_code, status, change)
            if error is None:
                self.assertNotIn("location", answer.headers)
            else:
                location = answer.headers["location"]
                self.assertTrue(location.startswith(CALLBACK + "?"), location)
                query = parse_qs(urlsplit(location).query)
                self.assertEqual((query["error"], query["state"]), ([error], ["st-2"]), change)

    async def test_auto_sign_in(self) -> None:
        """With a user already signed in at the provider, ``/authorize`` sends the browser straight back with a code."""
        self.idp.auto_sign_in = BOB.email

        def flow():
            session = oauth_session()
            metadata = self.metadata()
            verifier = generate_token(48)
            url, state = session.create_authorization_url(metadata["authorization_endpoint"],
                                                          code_verifier=verifier, nonce="n-auto")
            with browser() as b:
                back = b.get(url, allow_redirects=False, timeout=10)
            answer = session.fetch_token(metadata["token_endpoint"], authorization_response=back.headers["location"],
                                         code_verifier=verifier, state=state)
            return self.verified(metadata, answer["id_token"])

        claims = await deferToThread(flow)
        self.assertEqual((claims["sub"], claims["nonce"]), (BOB.sub, "n-auto"))

    async def test_key_rotation(self) -> None:
        """After a rotation new tokens carry the new kid and the JWKS publishes old and new keys."""
        old = self.idp.kid
        new = self.idp.rotate_key()

        def flow():
            answer, metadata = self.sign_in(oauth_session())
            with browser() as b:
                kids = [key["kid"] for key in b.get(metadata["jwks_uri"], timeout=10).json()["keys"]]
            return self.verified(metadata, answer["id_token"]), kids

        claims, kids = await deferToThread(flow)
        self.assertEqual(kids, [new, old])
        self.assertEqual(claims["sub"], ADA.sub)

    async def test_token_errors_are_oauth_errors(self) -> None:
        """The token endpoint answers RFC 6749 error bodies: a missing grant type, an unknown one, a non-form body."""

        def flow():
            with browser() as b:
                auth = (CLIENT.client_id, CLIENT.secret)
                return [
                    b.post(self.issuer + "/token", data={}, auth=auth, timeout=10),
                    b.post(self.issuer + "/token", data={"grant_type": "password"}, auth=auth, timeout=10),
                    b.post(self.issuer + "/token", json={"grant_type": "refresh_token"}, auth=auth, timeout=10),
                    b.post(self.issuer + "/token", data={"grant_type": "refresh_token", "refresh_token": "x"},
                           auth=(CLIENT.client_id, "wrong"), timeout=10),
                ]

        answers = await deferToThread(flow)
        self.assertEqual(
            [(a.status_code, a.json()["error"]) for a in answers],
            [(400, "invalid_request"), (400, "unsupported_grant_type"), (400, "invalid_request"),
             (401, "invalid_client")],
        )
        self.assertEqual(answers[0].headers["cache-control"], "no-store")
        self.assertIn("Basic", answers[3].headers["www-authenticate"])


class ProviderRulesTests(SynchronousTestCase):
    """The provider object's rules, on a Clock."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_800_000_000)
        self.idp = SimulatedIdP(self.clock, [ADA], [CLIENT], issuer="https://idp.example/realms/corp/")

    def code_for(self, verifier: str) -> str:
        request_id, location = self.idp.start_authorization({
            "client_id": CLIENT.client_id, "redirect_uri": CALLBACK, "response_type": "code",
            "scope": "openid", "code_challenge": create_s256_code_challenge(verifier),
            "code_challenge_method": "S256", "nonce": "n",
        })
        self.assertIsNone(location)
        location = self.idp.finish_authorization({"request": request_id, "email": ADA.email})
        return parse_qs(urlsplit(location).query)["code"][0]

    def redeem(self, code: str, verifier: str) -> dict:
        form = {"grant_type": "authorization_code", "code": code, "redirect_uri": CALLBACK,
                "code_verifier": verifier, "client_id": CLIENT.client_id, "client_secret": CLIENT.secret}
        return self.idp.token(form, "", self.idp.issuer)

    def test_code_expires(self) -> None:
        """A code is good for its lifetime only."""
        verifier = generate_token(48)
        code = self.code_for(verifier)
        self.clock.advance(CODE_LIFETIME)
        with self.assertRaises(Exception) as caught:
            self.redeem(code, verifier)
        self.assertEqual(caught.exception.error, "invalid_grant")

    def test_times_and_issuer(self) -> None:
        """ID tokens carry the clock's times and the configured issuer (without its trailing slash)."""
        verifier = generate_token(48)
        answer = self.redeem(self.code_for(verifier), verifier)
        claims = jwt.decode(answer["id_token"], jwk.KeySet.import_key_set(self.idp.jwks())).claims
        self.assertEqual(claims["iss"], "https://idp.example/realms/corp")
        self.assertEqual(claims["iat"], 1_800_000_000)
        self.assertEqual(claims["exp"] - claims["iat"], 300)

    def test_id_token_edit(self) -> None:
        """A test can change what the next ID token says, or answer a token of its own."""
        self.idp.id_token_edit = lambda header, claims: claims.update(aud="someone-else")
        verifier = generate_token(48)
        answer = self.redeem(self.code_for(verifier), verifier)
        self.assertEqual(jwt.decode(answer["id_token"], jwk.KeySet.import_key_set(self.idp.jwks())).claims["aud"],
                         "someone-else")
        self.idp.id_token_edit = lambda header, claims: "not.a.token"
        verifier = generate_token(48)
        self.assertEqual(self.redeem(self.code_for(verifier), verifier)["id_token"], "not.a.token")

    def test_rotation_without_the_old_key(self) -> None:
        """``rotate_key(keep_old=False)`` publishes the new key only."""
        kid = self.idp.rotate_key(keep_old=False)
        self.assertEqual([key["kid"] for key in self.idp.jwks()["keys"]], [kid])
        self.assertNotIn("d", self.idp.jwks()["keys"][0], "no private part published")

    def test_refresh_token_rotation(self) -> None:
        """With ``rotate_refresh_tokens`` a refresh token works once."""
        self.idp.rotate_refresh_tokens = True
        verifier = generate_token(48)
        first = self.redeem(self.code_for(verifier), verifier)
        form = {"grant_type": "refresh_token", "refresh_token": first["refresh_token"],
                "client_id": CLIENT.client_id, "client_secret": CLIENT.secret}
        second = self.idp.token(form, "", self.idp.issuer)
        self.assertNotEqual(second["refresh_token"], first["refresh_token"])
        with self.assertRaises(Exception) as caught:
            self.idp.token(form, "", self.idp.issuer)
        self.assertEqual(caught.exception.error, "invalid_grant")
