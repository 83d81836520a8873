"""
Sign-in across relays as users run them (``docs/signin.md``, "Several
relays"): two ``twistd -n relay --config FILE`` processes with the same
``[signin]`` table, one PostgreSQL ledger (``--usage-db``) between them, nginx
in front (:class:`bench.cluster.Cluster`), the simulated identity provider
served by this process on its own 127.0.0.1 port, the simulated upstream.

Claude Code's side is HTTP calls as ``tests/test_signin_flow.py`` makes them;
the person's browser is a ``requests.Session`` (the identity provider has the
person already signed in: ``auto_sign_in``).
"""

from __future__ import annotations

import os
import time

import requests
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.server import Site

from twisted_relay.simulated.idp import IdPClient, IdPUser, SimulatedIdP

from tests import postgres_server

SESSION_SECRET = "cluster-session-secret-of-forty-chars-x"
CLIENT_SECRET = "cluster-client-secret-at-the-idp-0042"
ADMIN_KEY = "sk-admin-cluster-0123456789abcdef"
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
ALICE = IdPUser("alice@example.com", "sub-alice", ("engineering", "eng-platform"), "Alice")
CLAUDE_CODE = {"User-Agent": "claude-code/2.1.332", "Connection": "close"}
#: Seconds between two reads of the revocations by each relay: the stated bound.
REVOCATION_POLL = 1.0
#: What a busy machine may add to the bound (a read's own time, a request's).
MARGIN = 1.0

_CONFIG = """\
[relay]
usage-db = "{usage_db}"
usage-flush-interval = 0.05
admin-keys = "{admin_keys}"

[signin]
public_url = "{public_url}"
issuer = "{issuer}"
client_id = "twisted-relay"
client_secret = "file:client.secret"
session_secret = "env:RELAY_SESSION_SECRET"
allowed_email_domains = ["example.com"]
allowed_groups = ["engineering"]
poll_interval = 1
revocation_poll = {revocation_poll}

[signin.groups]
"eng-platform" = "platform"
"""


def nginx_skip_reason() -> str | None:
    from bench.cluster import find_nginx

    return None if find_nginx() else "nginx is not installed (apt-get install nginx-light; .ci/run installs it)"


class SignedInCluster:
    """
    The identity provider (in this process), and a :class:`bench.cluster.Cluster`
    of relays whose config file has a ``[signin]`` table, their public URL
    nginx's (or the first relay's, without nginx).
    """

    def __init__(self, testcase: TestCase, usage_db: str, relays: int, nginx: bool = True,
                 relay_options: tuple[str, ...] = (), idp_site=Site):
        from bench.cluster import Cluster

        self.testcase = testcase
        self.idp = SimulatedIdP(reactor, users=(ALICE,))
        self.idp.auto_sign_in = ALICE.email
        self.idp_site = idp_site(self.idp.resource())
        idp_port = reactor.listenTCP(0, self.idp_site, interface="127.0.0.1")
        testcase.addCleanup(idp_port.stopListening)
        self.issuer = "http://127.0.0.1:%d" % (idp_port.getHost().port,)
        self.idp.issuer = self.issuer
        self.folder = os.path.abspath(testcase.mktemp())
        os.makedirs(self.folder)
        self.config = os.path.join(self.folder, "relay.toml")
        self.cluster = Cluster(self.folder, relays=relays, nginx=nginx, drain_delay=0,
                               relay_options=("--config", self.config) + tuple(relay_options),
                               environ={"RELAY_SESSION_SECRET": SESSION_SECRET})
        self.public_url = "http://127.0.0.1:%d" % (self.cluster.nginx_port if nginx else self.cluster.relay_ports[0],)
        self.usage_db = usage_db
        self._write_config()

    def _write_config(self) -> None:
        self.idp.add_client(IdPClient("twisted-relay", CLIENT_SECRET, (self.public_url + "/oauth/callback",)))
        with open(os.path.join(self.folder, "client.secret"), "w") as f:
            f.write(CLIENT_SECRET + "\n")
        with open(os.path.join(self.folder, "admin-keys"), "w") as f:
            f.write("ops = %s\n" % (ADMIN_KEY,))
        with open(self.config, "w") as f:
            f.write(_CONFIG.format(usage_db=self.usage_db, admin_keys=os.path.join(self.folder, "admin-keys"),
                                   public_url=self.public_url, issuer=self.issuer, revocation_poll=REVOCATION_POLL))

    async def start(self) -> None:
        """Start the processes (in a thread: the identity provider answers on this reactor meanwhile)."""
        self.testcase.addCleanup(deferToThread, self.cluster.stop)
        await deferToThread(self.cluster.start)

    def relay(self, number: int) -> str:
        return self.cluster.relay_url(number)

    def log(self, number: int) -> str:
        with open(os.path.join(self.folder, self.cluster.relays[number][2]), encoding="utf-8", errors="replace") as f:
            return f.read()

    async def call(self, method: str, url: str, **kwargs) -> requests.Response:
        """One HTTP call as Claude Code makes it, in a thread."""
        headers = {**CLAUDE_CODE, **kwargs.pop("headers", {})}
        return await deferToThread(requests.request, method, url, headers=headers, timeout=10, **kwargs)

    async def device_authorization(self, url: str) -> dict:
        answer = await self.call("POST", url + "/oauth/device_authorization", data="surface=claude_code",
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
        self.testcase.assertEqual(answer.status_code, 200, answer.text)
        return answer.json()

    async def browser_signs_in(self, grant: dict) -> requests.Response:
        """The person at the browser: the code posted at the verification page, the IdP, back to the callback."""
        browser = requests.Session()
        browser.headers["Connection"] = "close"
        page = await deferToThread(browser.get, grant["verification_uri_complete"], timeout=10)
        self.testcase.assertEqual(page.status_code, 200, page.text)
        done = await deferToThread(browser.post, grant["verification_uri"], data={"user_code": grant["user_code"]},
                                   timeout=10)
        self.testcase.assertEqual(done.status_code, 200, done.text)
        self.testcase.assertTrue(done.url.startswith(self.public_url + "/oauth/callback?"), done.url)
        return done

    async def poll(self, url: str, device_code: str) -> requests.Response:
        return await self.call("POST", url + "/oauth/token", data={"grant_type": DEVICE_GRANT, "device_code": device_code})

    async def signed_in(self, started_on: str, polled_on: str) -> dict:
        """A whole sign-in, the device code asked for at ``started_on`` and polled at ``polled_on``."""
        grant = await self.device_authorization(started_on)
        self.testcase.assertEqual(grant["verification_uri"], self.public_url + "/device")
        await self.browser_signs_in(grant)
        await deferLater(reactor, grant["interval"], lambda: None)
        answer = await self.poll(polled_on, grant["device_code"])
        self.testcase.assertEqual(answer.status_code, 200, answer.text)
        return {**answer.json(), "device_code": grant["device_code"]}

    async def message(self, url: str, bearer: str, **body) -> requests.Response:
        body = {"model": "claude-sonnet-4-5", "max_tokens": 32, "messages": [{"role": "user", "content": "Say pong"}],
                **body}
        return await self.call("POST", url + "/v1/messages?beta=true", json=body, headers={
            "Authorization": "Bearer " + bearer, "anthropic-version": "2023-06-01"})


class TwoRelaysBehindNginxTests(TestCase):
    """
    Two relay processes behind nginx sharing a PostgreSQL ledger: a token
    minted on one works on the other; a revocation on one is refused on both
    within ``revocation_poll`` (1 s here) and a margin.
    """

    timeout = 60

    def setUp(self):
        for reason in (nginx_skip_reason(), postgres_server.SKIP_REASON):
            if reason:
                raise SkipTest(reason)

    async def ledger_rows(self, url: str, want: int) -> list[tuple]:
        """The shared ledger's (key_name, key_group) rows, once it holds ``want`` (within 5 s)."""
        import psycopg

        for _ in range(100):
            with psycopg.connect(url) as connection:
                rows = connection.execute("SELECT key_name, key_group FROM relay_usage ORDER BY at").fetchall()
            if len(rows) >= want:
                return [tuple(row) for row in rows]
            await deferLater(reactor, 0.05, lambda: None)
        return rows

    async def test_minted_on_one_revoked_on_both(self):
        usage_db = postgres_server.shared_server().new_database()
        world = SignedInCluster(self, usage_db, relays=2)
        await world.start()
        a, b = world.relay(0), world.relay(1)
        # Signed in through nginx (the device code asked for and polled wherever nginx sends them).
        tokens = await world.signed_in(world.public_url, world.public_url)
        self.assertEqual(tokens["email"], ALICE.email)
        # The token on relay B directly, on relay A directly, and through nginx: answered,
        # each metered under the person (and her mapped group) in the shared ledger.
        for url in (b, a, world.public_url):
            reply = await world.message(url, tokens["access_token"])
            self.assertEqual(reply.status_code, 200, reply.text)
        self.assertEqual(await self.ledger_rows(usage_db, 3), [(ALICE.email, "platform")] * 3)
        # Its refresh token, minted through nginx, refreshed on B.
        refreshed = await world.call("POST", b + "/oauth/token",
                                     data={"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"]})
        self.assertEqual(refreshed.status_code, 200, refreshed.text)
        access = refreshed.json()["access_token"]
        self.assertEqual((await world.message(a, access)).status_code, 200)
        self.assertEqual((await world.message(b, access)).status_code, 200)
        # Revoked through A: refused on A at once, on B within revocation_poll.
        revoked = await world.call("POST", a + "/oauth/revoke", data={"token": access, "token_type_hint": "access_token"})
        self.assertEqual(revoked.status_code, 200, revoked.text)
        at = time.monotonic()
        on_a = await world.message(a, access)
        self.assertEqual((on_a.status_code, on_a.headers.get("x-should-retry")), (401, "false"), on_a.text)
        refused = None
        while time.monotonic() - at < REVOCATION_POLL + MARGIN + 3:
            refused = await world.message(b, access)
            if refused.status_code != 200:
                break
            await deferLater(reactor, 0.05, lambda: None)
        took = time.monotonic() - at
        self.assertEqual((refused.status_code, refused.headers.get("x-should-retry")), (401, "false"), refused.text)
        self.assertIn("revoked", refused.json()["error"]["message"])
        self.assertLess(took, REVOCATION_POLL + MARGIN, "relay B refused the revoked token %.2f s after" % (took,))
        print("\nrevoked on relay A, refused on relay B %.2f s after (revocation_poll %g s)" % (took, REVOCATION_POLL))
        # Through nginx too, whichever relay answers, every time.
        for _ in range(4):
            through = await world.message(world.public_url, access)
            self.assertEqual((through.status_code, through.headers.get("x-should-retry")), (401, "false"))
        # The first session token was not revoked: still good on both.
        self.assertEqual((await world.message(b, tokens["access_token"])).status_code, 200)
        # The ledger's password (in the config file, not on the command line) in neither relay's log.
        for number in (0, 1):
            self.assertNotIn(postgres_server.PASSWORD, world.log(number))

    async def test_device_code_started_on_one_polled_on_the_other(self):
        """nginx may send the poll anywhere: a device code asked for on A, signed in, polled on B."""
        world = SignedInCluster(self, postgres_server.shared_server().new_database(), relays=2)
        await world.start()
        a, b = world.relay(0), world.relay(1)
        grant = await world.device_authorization(a)
        pending = await world.poll(b, grant["device_code"])
        self.assertEqual((pending.status_code, pending.json()["error"]), (400, "authorization_pending"))
        await world.browser_signs_in(grant)
        await deferLater(reactor, grant["interval"], lambda: None)
        answer = await world.poll(b, grant["device_code"])
        self.assertEqual(answer.status_code, 200, answer.text)
        # Spent on both.
        again = await world.poll(a, grant["device_code"])
        self.assertEqual((again.status_code, again.json()["error"]), (400, "invalid_grant"))
        self.assertEqual((await world.message(a, answer.json()["access_token"])).status_code, 200)
