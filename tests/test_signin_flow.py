"""
Claude Code's gateway sign-in through the relay, end to end over sockets on
127.0.0.1 (``docs/signin.md``): the relay with a ``[signin]`` table and a
usage ledger, the simulated identity provider
(:mod:`twisted_relay.simulated.idp`) and the simulated Anthropic upstream,
each served on its own port.

Claude Code's side is HTTP calls exactly as ``claude-code-signin.md``
(section 1.3) says the CLI 2.1.332 makes them: the metadata, the device
authorization with the body ``surface=claude_code``, the token polls, the
refresh, the two revocations of ``claude auth logout``, the bearer on
``/v1/messages?beta=true``. The person's side is a browser with a cookie
jar (``requests.Session``, in a thread): the verification page, the code
posted, the identity provider's user picker, the way back to the callback.
"""

from __future__ import annotations

import os
import re
import sqlite3
import time

import requests
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import TestCase
from twisted.web.server import Site

from twisted_relay.config import RelayConfig, RelayKey, one_upstream
from twisted_relay.service import Relay
from twisted_relay.signin.config import SignInConfig
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.idp import IdPClient, IdPUser, SimulatedIdP

from tests import postgres_server
from tests.helpers import free_port

SECRET = "a-session-secret-of-forty-characters-xx"
CLIENT_SECRET = "the-relay-client-secret-at-the-idp"
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
ALICE = IdPUser("Alice@Example.com", "sub-alice", ("engineering", "eng-platform"), "Alice")
BOB = IdPUser("bob@other.org", "sub-bob", ("engineering",), "Bob")
CAROL = IdPUser("carol@example.com", "sub-carol", ("sales",), "Carol")
CI_KEY = RelayKey("sk-relay-ci-0123456789", "ci-job", "automation")
ADMIN = RelayKey("sk-admin-0123456789abcdef", "ops")
CLAUDE_CODE = {"User-Agent": "claude-code/2.1.332", "Connection": "close"}


def session() -> requests.Session:
    s = requests.Session()
    s.headers["Connection"] = "close"  # no connection outlives a test
    return s


class _RecordingSite(Site):
    """A site that keeps the credentials of every request it gets (what the upstream was sent)."""

    def __init__(self, resource):
        super().__init__(resource)
        self.credentials: list[bytes] = []

    def getResourceFor(self, request):
        for name in (b"authorization", b"x-api-key"):
            self.credentials.extend(request.requestHeaders.getRawHeaders(name, []))
        return super().getResourceFor(request)


class _World:
    """The identity provider, the upstream, and relays sharing one ledger file, all on 127.0.0.1."""

    def __init__(self, testcase: TestCase, database: str | None = None):
        self.testcase = testcase
        self.idp = SimulatedIdP(reactor, users=(ALICE, BOB, CAROL))
        idp_port = reactor.listenTCP(0, Site(self.idp.resource()), interface="127.0.0.1")
        testcase.addCleanup(idp_port.stopListening)
        self.issuer = "http://127.0.0.1:%d" % (idp_port.getHost().port,)
        self.idp.issuer = self.issuer
        self.upstream = _RecordingSite(SimulatedUpstream(mode="lenient").resource())
        upstream = reactor.listenTCP(0, self.upstream, interface="127.0.0.1")
        testcase.addCleanup(upstream.stopListening)
        self.upstream_url = "http://127.0.0.1:%d" % (upstream.getHost().port,)
        folder = testcase.mktemp()
        os.makedirs(folder)
        self.ledger_path = os.path.join(folder, "usage.sqlite")
        self.database = database or self.ledger_path
        self.public_url = None
        self.logged: list[str] = []
        observer = lambda event: self.logged.append(repr(event))  # noqa: E731
        globalLogPublisher.addObserver(observer)
        testcase.addCleanup(globalLogPublisher.removeObserver, observer)

    def relay(self, relay_keys=(CI_KEY,), upstream_key: str | None = "sk-upstream", **signin) -> str:
        """A relay on the shared ledger, all of them behind one public URL (the first's); its own URL."""
        port = free_port()
        url = "http://127.0.0.1:%d" % (port,)
        if self.public_url is None:
            self.public_url = url
            self.idp.add_client(IdPClient("twisted-relay", CLIENT_SECRET, (url + "/oauth/callback",)))
        settings = dict(
            public_url=self.public_url, issuer=self.issuer, client_id="twisted-relay", client_secret=CLIENT_SECRET,
            session_secret=SECRET, allowed_email_domains=("example.com",), allowed_groups=("engineering",),
            groups=(("eng-platform", "platform"),), login_notice="Sign in with your Example account.",
            poll_interval=1, revocation_poll=0.5,
        )
        settings.update(signin)
        config = RelayConfig(
            listen=("tcp:%d:interface=127.0.0.1" % (port,),), upstreams=one_upstream(self.upstream_url, upstream_key),
            dump_dir=None, usage_db=self.database, usage_flush_interval=0.05, relay_keys=relay_keys, admin_keys=(ADMIN,),
            signin=SignInConfig(**settings),
        )
        relay = Relay(config, reactor)
        relay.service.privilegedStartService()
        relay.service.startService()
        self.testcase.addCleanup(lambda: relay.service.stopService() if relay.service.running else None)
        self.last = relay
        return url

    async def call(self, method: str, url: str, **kwargs) -> requests.Response:
        """One HTTP call as Claude Code makes it, in a thread."""
        headers = {**CLAUDE_CODE, **kwargs.pop("headers", {})}
        return await deferToThread(requests.request, method, url, headers=headers, timeout=10, **kwargs)

    async def device_authorization(self, relay_url: str) -> dict:
        answer = await self.call("POST", relay_url + "/oauth/device_authorization", data="surface=claude_code",
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
        self.testcase.assertEqual(answer.status_code, 200, answer.text)
        return answer.json()

    async def poll(self, relay_url: str, device_code: str) -> requests.Response:
        return await self.call("POST", relay_url + "/oauth/token", data={"grant_type": DEVICE_GRANT, "device_code": device_code})

    async def browser_signs_in(self, grant: dict, email: str, browser: requests.Session | None = None) -> requests.Response:
        """
        The person at the browser: the verification page of the link
        Claude Code opens, the code posted, the identity provider's picker,
        the way back to the relay's callback. The callback's page.
        """
        browser = browser or session()
        page = await deferToThread(browser.get, grant["verification_uri_complete"], timeout=10)
        self.testcase.assertEqual(page.status_code, 200)
        self.testcase.assertIn('value="%s"' % (grant["user_code"],), page.text)
        self.testcase.assertNotIn("<script", page.text)
        self.testcase.assertIn("Sign in with your Example account.", page.text)
        # A browser sends a form post with its page's origin (the page's referrer policy must allow it:
        # under no-referrer a browser sends "Origin: null").
        self.testcase.assertEqual(page.headers["referrer-policy"], "same-origin")
        sent = await deferToThread(browser.post, grant["verification_uri"], data={"user_code": grant["user_code"]},
                                   headers={"Origin": self.public_url}, allow_redirects=False, timeout=10)
        self.testcase.assertEqual(sent.status_code, 303, sent.text)
        cookie = sent.headers["Set-Cookie"]
        for attribute in ("HttpOnly", "SameSite=lax", "Path=/oauth/callback"):
            self.testcase.assertIn(attribute.lower(), cookie.lower())
        picker = await deferToThread(browser.get, sent.headers["Location"], timeout=10)
        self.testcase.assertEqual(picker.status_code, 200, picker.text)
        request_id = re.search(r'name="request" value="([^"]+)"', picker.text).group(1)
        back = await deferToThread(browser.post, picker.url, data={"request": request_id, "email": email, "action": "sign_in"},
                                   allow_redirects=False, timeout=10)
        self.testcase.assertTrue(back.headers["Location"].startswith(self.public_url + "/oauth/callback?"))
        return await deferToThread(browser.get, back.headers["Location"], timeout=10)

    async def signed_in(self, relay_url: str, email: str) -> dict:
        """A whole sign-in on ``relay_url``: the token endpoint's answer."""
        grant = await self.device_authorization(relay_url)
        done = await self.browser_signs_in(grant, email)
        self.testcase.assertEqual(done.status_code, 200, done.text)
        await deferLater(reactor, grant["interval"], lambda: None)
        answer = await self.poll(relay_url, grant["device_code"])
        self.testcase.assertEqual(answer.status_code, 200, answer.text)
        return answer.json()

    async def message(self, relay_url: str, bearer: str) -> requests.Response:
        body = {"model": "claude-sonnet-4-5", "max_tokens": 32, "messages": [{"role": "user", "content": "Say pong"}]}
        return await self.call("POST", relay_url + "/v1/messages?beta=true", json=body, headers={
            "Authorization": "Bearer " + bearer, "anthropic-version": "2023-06-01"})

    async def ledger_rows(self, want: int) -> list[tuple]:
        """The usage ledger's (key_name, key_group) rows, once it holds ``want`` (within 5 s)."""
        for _ in range(100):
            with sqlite3.connect(self.ledger_path) as connection:
                rows = connection.execute("SELECT key_name, key_group FROM relay_usage ORDER BY at").fetchall()
            if len(rows) >= want:
                return rows
            await deferLater(reactor, 0.05, lambda: None)
        return rows


class SignInFlowTests(TestCase):
    """The whole sign-in, a session on the Messages API, refresh, logout; who is refused."""

    timeout = 60

    async def test_sign_in_use_refresh_logout(self):
        world = _World(self)
        relay = world.relay()
        # 1. The metadata: same-origin absolute endpoints.
        metadata = (await world.call("GET", relay + "/.well-known/oauth-authorization-server")).json()
        self.assertEqual(
            (metadata["device_authorization_endpoint"], metadata["token_endpoint"], metadata["revocation_endpoint"],
             metadata["gateway_protocol_version"]),
            (relay + "/oauth/device_authorization", relay + "/oauth/token", relay + "/oauth/revoke", 1),
        )
        # 2. The device authorization.
        grant = await world.device_authorization(relay)
        self.assertRegex(grant["user_code"], r"^[BCDFGHJKMNPQRSTVWXYZ]{4}-[BCDFGHJKMNPQRSTVWXYZ]{4}$")
        self.assertGreaterEqual(len(grant["device_code"]), 43)
        self.assertEqual((grant["verification_uri"], grant["expires_in"], grant["interval"], grant["login_notice"]),
                         (relay + "/device", 600, 1, "Sign in with your Example account."))
        # 3. Polled before the person signed in: pending.
        pending = await world.poll(relay, grant["device_code"])
        self.assertEqual((pending.status_code, pending.json()["error"]), (400, "authorization_pending"))
        # 4. The browser step.
        done = await world.browser_signs_in(grant, "alice@example.com")
        self.assertEqual(done.status_code, 200, done.text)
        self.assertIn("alice@example.com", done.text)
        await deferLater(reactor, 1, lambda: None)
        answer = await world.poll(relay, grant["device_code"])
        self.assertEqual(answer.status_code, 200, answer.text)
        tokens = answer.json()
        self.assertEqual((tokens["token_type"], tokens["expires_in"], tokens["email"]), ("Bearer", 3600, "alice@example.com"))
        self.assertIn("refresh_token", tokens)
        # The device code is spent.
        again = await world.poll(relay, grant["device_code"])
        self.assertEqual((again.status_code, again.json()["error"]), (400, "invalid_grant"))
        # 5. The session on the Messages API, metered under the person and their mapped group.
        reply = await world.message(relay, tokens["access_token"])
        self.assertEqual(reply.status_code, 200, reply.text)
        self.assertEqual(await world.ledger_rows(1), [("alice@example.com", "platform")])
        # The session token stays with the relay: the upstream gets the relay's own key.
        self.assertEqual(world.upstream.credentials, [b"sk-upstream"])
        # A relay key still works beside sign-in; nothing at all does not.
        keyed = await world.message(relay, CI_KEY.key)
        self.assertEqual(keyed.status_code, 200, keyed.text)
        self.assertEqual((await world.ledger_rows(2))[1], ("ci-job", "automation"))
        bare = await world.call("POST", relay + "/v1/messages", json={})
        self.assertEqual((bare.status_code, bare.headers["x-should-retry"]), (401, "false"))
        # 6. The refresh: a new pair; the old refresh token is spent.
        refreshed = await world.call("POST", relay + "/oauth/token",
                                     data={"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"]})
        self.assertEqual(refreshed.status_code, 200, refreshed.text)
        fresh = refreshed.json()
        self.assertNotEqual(fresh["refresh_token"], tokens["refresh_token"])
        self.assertEqual((await world.message(relay, fresh["access_token"])).status_code, 200)
        usage = await world.call("GET", relay + "/api/oauth/usage", headers={"Authorization": "Bearer " + fresh["access_token"]})
        self.assertEqual(usage.status_code, 200, usage.text)
        reused = await world.call("POST", relay + "/oauth/token",
                                  data={"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"]})
        self.assertEqual((reused.status_code, reused.json()["error"]), (401, "invalid_grant"))
        # 7. Logout: the access token, then the refresh token; both refused afterwards.
        for token, hint in ((fresh["access_token"], "access_token"), (fresh["refresh_token"], "refresh_token")):
            revoked = await world.call("POST", relay + "/oauth/revoke", data={"token": token, "token_type_hint": hint})
            self.assertEqual(revoked.status_code, 200)
        refused = await world.message(relay, fresh["access_token"])
        self.assertEqual((refused.status_code, refused.headers["x-should-retry"], refused.json()["error"]["type"]),
                         (401, "false", "authentication_error"))
        # Refused on the other routes a signed-in Claude Code calls, which took it before.
        usage = await world.call("GET", relay + "/api/oauth/usage", headers={"Authorization": "Bearer " + fresh["access_token"]})
        self.assertEqual((usage.status_code, usage.headers["x-should-retry"]), (401, "false"))
        self.assertIn("revoked", refused.json()["error"]["message"])
        gone = await world.call("POST", relay + "/oauth/token",
                                data={"grant_type": "refresh_token", "refresh_token": fresh["refresh_token"]})
        self.assertEqual((gone.status_code, gone.json()["error"]), (401, "invalid_grant"))
        # No secret of the sign-in in any log line.
        logged = "\n".join(world.logged)
        for secret in (tokens["access_token"], tokens["refresh_token"], fresh["access_token"], fresh["refresh_token"],
                       grant["device_code"], SECRET, CLIENT_SECRET):
            self.assertNotIn(secret, logged)

    async def test_session_token_never_goes_upstream(self):
        """Not even from a relay without relay keys whose upstream takes the clients' own credentials."""
        world = _World(self)
        relay = world.relay(relay_keys=(), upstream_key=None)
        tokens = await world.signed_in(relay, "alice@example.com")
        self.assertEqual((await world.message(relay, tokens["access_token"])).status_code, 200)
        self.assertEqual(world.upstream.credentials, [])
        # Sign-in on: a relay without relay keys is no longer open to anyone.
        bare = await world.message(relay, "sk-ant-someone-elses-key")
        self.assertEqual((bare.status_code, bare.headers["x-should-retry"]), (401, "false"))

    async def test_thread_outlives_the_session_token(self):
        """A message thread is the person's: continued with the token a refresh gave."""
        world = _World(self)
        relay = world.relay()
        tokens = await world.signed_in(relay, "alice@example.com")
        beta = {"anthropic-beta": "message-threads-2026-08-12", "anthropic-version": "2023-06-01"}
        body = {"model": "claude-sonnet-4-5", "max_tokens": 32, "messages": [{"role": "user", "content": "Say pong"}],
                "thread": {"type": "create"}}
        created = await world.call("POST", relay + "/v1/messages?beta=true", json=body,
                                   headers={"Authorization": "Bearer " + tokens["access_token"], **beta})
        self.assertEqual(created.status_code, 200, created.text)
        refreshed = (await world.call("POST", relay + "/oauth/token",
                                      data={"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"]})).json()
        body = {"model": "claude-sonnet-4-5", "max_tokens": 32, "messages": [{"role": "user", "content": "Again"}],
                "thread": {"type": "continue", "previous_message_id": created.json()["id"]}}
        continued = await world.call("POST", relay + "/v1/messages?beta=true", json=body,
                                     headers={"Authorization": "Bearer " + refreshed["access_token"], **beta})
        self.assertEqual(continued.status_code, 200, continued.text)

    async def test_leaver_refused_at_refresh(self):
        """A person the identity provider disabled cannot refresh: 401 ``invalid_grant`` (sign in again)."""
        world = _World(self)
        relay = world.relay()
        tokens = await world.signed_in(relay, "alice@example.com")
        world.idp.disable_user("alice@example.com")
        refreshed = await world.call("POST", relay + "/oauth/token",
                                     data={"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"]})
        self.assertEqual((refreshed.status_code, refreshed.json()["error"]), (401, "invalid_grant"))

    async def test_groups_followed_at_refresh(self):
        """A refresh reads the person's groups again: a new relay group for metering; out of the allowed groups, signed out."""
        world = _World(self)
        relay = world.relay()
        tokens = await world.signed_in(relay, "alice@example.com")
        world.idp.update_user("alice@example.com", groups=("engineering",))
        refreshed = await world.call("POST", relay + "/oauth/token",
                                     data={"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"]})
        self.assertEqual(refreshed.status_code, 200, refreshed.text)
        self.assertEqual((await world.message(relay, refreshed.json()["access_token"])).status_code, 200)
        self.assertEqual(await world.ledger_rows(1), [("alice@example.com", None)])
        world.idp.update_user("alice@example.com", groups=("sales",))
        refused = await world.call("POST", relay + "/oauth/token",
                                   data={"grant_type": "refresh_token", "refresh_token": refreshed.json()["refresh_token"]})
        self.assertEqual((refused.status_code, refused.json()["error"]), (401, "invalid_grant"))
        self.assertIn("engineering", refused.json()["error_description"])

    async def test_cap_on_the_persons_group(self):
        """A spend limit on the relay group a person's IdP group maps to refuses their next request (429, no retry)."""
        world = _World(self)
        relay = world.relay()
        tokens = await world.signed_in(relay, "alice@example.com")
        limit = await world.call("POST", relay + "/v1/organizations/spend_limits", headers={"x-api-key": ADMIN.key},
                                 json={"scope": {"type": "workspace", "workspace_id": "platform"}, "period": "monthly",
                                       "amount": "0"})
        self.assertEqual(limit.status_code, 200, limit.text)
        refused = await world.message(relay, tokens["access_token"])
        self.assertEqual((refused.status_code, refused.headers["x-should-retry"], refused.json()["error"]["type"]),
                         (429, "false", "billing_error"))
        # Another group's relay key is not under it.
        self.assertEqual((await world.message(relay, CI_KEY.key)).status_code, 200)

    async def test_refused_domain_and_group(self):
        """Outside the allowed domains or groups: a clear page, and Claude Code's poll gets ``access_denied``."""
        world = _World(self)
        relay = world.relay()
        for email, reason in (("bob@other.org", "example.com"), ("carol@example.com", "engineering")):
            grant = await world.device_authorization(relay)
            page = await world.browser_signs_in(grant, email)
            self.assertEqual(page.status_code, 403, page.text)
            self.assertIn(reason, page.text)
            denied = await world.poll(relay, grant["device_code"])
            self.assertEqual((denied.status_code, denied.json()["error"]), (400, "access_denied"))

    async def test_polled_too_fast(self):
        """Two polls closer than the interval: ``slow_down`` (Claude Code then waits 5 s longer)."""
        world = _World(self)
        relay = world.relay()
        grant = await world.device_authorization(relay)
        first = await world.poll(relay, grant["device_code"])
        second = await world.poll(relay, grant["device_code"])
        self.assertEqual((first.json()["error"], second.json()["error"]), ("authorization_pending", "slow_down"))

    async def test_callback_needs_the_browser_that_started(self):
        """The identity provider's way back, opened in another browser (no cookie): refused, the grant still pending."""
        world = _World(self)
        relay = world.relay()
        grant = await world.device_authorization(relay)
        browser = session()
        sent = await deferToThread(browser.post, grant["verification_uri"], data={"user_code": grant["user_code"]},
                                   allow_redirects=False, timeout=10)
        picker = await deferToThread(browser.get, sent.headers["Location"], timeout=10)
        request_id = re.search(r'name="request" value="([^"]+)"', picker.text).group(1)
        back = await deferToThread(browser.post, picker.url, data={"request": request_id, "email": "alice@example.com"},
                                   allow_redirects=False, timeout=10)
        elsewhere = await deferToThread(session().get, back.headers["Location"], timeout=10)
        self.assertEqual(elsewhere.status_code, 400)
        self.assertIn("another browser", elsewhere.text)
        pending = await world.poll(relay, grant["device_code"])
        self.assertEqual(pending.json()["error"], "authorization_pending")

    async def test_verification_page_guarded(self):
        """A code form posted from another site is refused; ten codes tried from one address, then 429."""
        world = _World(self)
        relay = world.relay()
        grant = await world.device_authorization(relay)
        for origin in ("https://attacker.example", "null"):
            forged = await world.call("POST", relay + "/device", data={"user_code": grant["user_code"]},
                                      headers={"Origin": origin}, allow_redirects=False)
            self.assertEqual(forged.status_code, 403, origin)
        statuses = []
        for _ in range(11):
            tried = await world.call("POST", relay + "/device", data={"user_code": "BBBB-BBBB"}, allow_redirects=False)
            statuses.append(tried.status_code)
        self.assertEqual(statuses, [400] * 10 + [429])

    async def test_device_authorization_body(self):
        """
        Unknown parameters (a client_id, another surface, a later client's)
        are ignored, as RFC 8628 and the gateway protocol ask; a body that
        is not a form is refused with OAuth's error shape.
        """
        world = _World(self)
        relay = world.relay()
        for body in ("surface=claude_code&client_id=x&scope=openid", "surface=desktop", "", "surface=claude_code&new=1"):
            answer = await world.call("POST", relay + "/oauth/device_authorization", data=body,
                                      headers={"Content-Type": "application/x-www-form-urlencoded"})
            self.assertEqual(answer.status_code, 200, (body, answer.text))
            self.assertEqual(len(answer.json()["user_code"]), 9)
        for body in (b"surface=claude_code&surface=claude_code", b"surface=claude_code&&x=1", b"surface=\xff"):
            answer = await world.call("POST", relay + "/oauth/device_authorization", data=body,
                                      headers={"Content-Type": "application/x-www-form-urlencoded"})
            self.assertEqual((answer.status_code, answer.json()["error"]), (400, "invalid_request"), body)
            self.assertIn("error_description", answer.json())


class TwoRelaysTests(TestCase):
    """Two relays behind one name, sharing the ledger's database: one sign-in, one revocation, for both."""

    timeout = 60

    def world(self) -> _World:
        return _World(self)

    async def test_minted_on_one_revoked_on_both(self):
        world = self.world()
        first = world.relay()
        second = world.relay()
        # Asked for on the second, signed in at the browser on the first (the public URL's), polled on the second.
        tokens = await world.signed_in(second, "alice@example.com")
        self.assertEqual((await world.message(first, tokens["access_token"])).status_code, 200)
        self.assertEqual((await world.message(second, tokens["access_token"])).status_code, 200)
        # The refresh token too: used on the second.
        refreshed = await world.call("POST", second + "/oauth/token",
                                     data={"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"]})
        self.assertEqual(refreshed.status_code, 200, refreshed.text)
        access = refreshed.json()["access_token"]
        revoked = await world.call("POST", first + "/oauth/revoke", data={"token": access})
        self.assertEqual(revoked.status_code, 200)
        at = time.monotonic()
        # Refused on the first at once, on the second within revocation_poll (0.5 s; 3 s allowed for a busy machine).
        self.assertEqual((await world.message(first, access)).status_code, 401)
        while time.monotonic() - at < 3:
            refused = await world.message(second, access)
            if refused.status_code == 401:
                break
            await deferLater(reactor, 0.1, lambda: None)
        self.assertEqual((refused.status_code, refused.headers["x-should-retry"]), (401, "false"))
        self.assertLess(time.monotonic() - at, 1.5)


class TwoRelaysOnPostgresTests(TwoRelaysTests):
    """The same two relays on a real PostgreSQL ledger."""

    skip = postgres_server.SKIP_REASON

    def world(self) -> _World:
        return _World(self, postgres_server.shared_server().new_database())
