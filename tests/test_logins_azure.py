"""
Tests for :mod:`twisted_relay.logins.azure`: Entra ID tokens from
azure-identity, fetched off the reactor and refreshed before they expire.

The token tests run the real azure-identity (``ManagedIdentityCredential``,
App Service's flow) against the simulated identity endpoint, and send the
requests to the simulated Foundry, on 127.0.0.1.
"""

from __future__ import annotations

import json
import sys
import time

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.task import Clock, deferLater
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python.threadable import isInIOThread
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.http_headers import Headers
from twisted.web.server import Site

from twisted_relay.logins.azure import AzureLogin, require_azure_identity
from twisted_relay.logins.base import LoginError, LoginThreads
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.foundry import SimulatedFoundry, SimulatedIdentity

from tests.test_simulated_foundry import set_environment

try:
    from azure.identity import ManagedIdentityCredential
except ImportError:  # pragma: no cover - the test extra installs it
    ManagedIdentityCredential = None

BODY = {"model": "claude-haiku-4-5", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


class AzureLoginSetupTests(SynchronousTestCase):
    """What is checked when the login is made, at the relay's start."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.threads = LoginThreads(self.clock)

    def test_missing_library(self) -> None:
        """Without azure-identity: one line saying how to install it."""
        saved = sys.modules.get("azure.identity")
        sys.modules["azure.identity"] = None  # type: ignore[assignment]  # import fails
        self.addCleanup(sys.modules.__setitem__, "azure.identity", saved)
        for attempt in (require_azure_identity, lambda: AzureLogin(self.clock, self.threads)):
            with self.assertRaises(LoginError) as caught:
                attempt()
            message = str(caught.exception)
            self.assertIn("pip install 'twisted-relay[azure]'", message)
            self.assertNotIn("\n", message)

    def test_client_secret_variables(self) -> None:
        """A client secret whose variable is not set is refused, the variable named."""
        environ = {"AZURE_TENANT_ID": "tenant", "AZURE_CLIENT_ID": "client"}
        with self.assertRaises(LoginError) as caught:
            AzureLogin(self.clock, self.threads, identity="client-secret", environ=environ)
        self.assertIn("$AZURE_CLIENT_SECRET not set", str(caught.exception))
        environ = {"T": "tenant", "C": "client", "S": "the-secret-value"}
        login = AzureLogin(
            self.clock, self.threads, identity="client-secret", environ=environ,
            tenant_id_env="T", client_id_env="C", client_secret_env="S",
        )
        self.assertNotIn("the-secret-value", repr(login))

    def test_unknown_identity(self) -> None:
        """An identity kind that does not exist is a ValueError naming the kinds."""
        with self.assertRaises(ValueError) as caught:
            AzureLogin(self.clock, self.threads, identity="browser")
        self.assertIn("default, managed, client-secret", str(caught.exception))

    def test_no_token_before_start(self) -> None:
        """authorize before the first token is a LoginError, not a request without credentials."""
        login = AzureLogin(self.clock, self.threads, identity="managed")
        self.assertRaises(LoginError, login.authorize, b"POST", "https://x/anthropic/v1/messages", Headers(), None)


class _ThreadNoting:
    """An azure-identity credential, noting the thread each get_token runs on."""

    def __init__(self, credential):
        self.credential = credential
        self.on_reactor: list[bool] = []

    def get_token(self, *scopes, **options):
        self.on_reactor.append(isInIOThread())
        return self.credential.get_token(*scopes, **options)


class AzureLoginTokenTests(TestCase):
    """Tokens from the real azure-identity, against the simulated identity endpoint."""

    timeout = 30

    def setUp(self) -> None:
        if ManagedIdentityCredential is None:
            self.skipTest("azure-identity is not installed")
        self.threads = LoginThreads(reactor)
        self.addCleanup(self.threads.stop)
        pool = HTTPConnectionPool(reactor)
        self.addCleanup(pool.closeCachedConnections)
        self.http = HTTPClient(Agent(reactor, pool=pool))

    def serve(self, lifetime: int) -> None:
        self.identity = SimulatedIdentity(lifetime=lifetime)
        self.foundry = SimulatedFoundry(SimulatedUpstream(mode="lenient"), identity=self.identity)
        port = reactor.listenTCP(0, Site(self.foundry.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        base = "http://127.0.0.1:%d" % (port.getHost().port,)
        self.url = base + "/anthropic/v1/messages"
        set_environment(self, self.identity.environ(base))

    def login(self, **options) -> AzureLogin:
        login = AzureLogin(reactor, self.threads, identity="managed", **options)
        self.addCleanup(login.stop)
        return login

    async def send(self, login: AzureLogin) -> tuple[int, str]:
        """One request as the relay sends it: the client's headers, then the login's."""
        headers = Headers({
            b"content-type": [b"application/json"],
            b"anthropic-version": [b"2023-06-01"],
            b"x-api-key": [b"the-client-own-key"],
        })
        data = json.dumps(BODY).encode()
        login.authorize(b"POST", self.url, headers, data)
        response = await self.http.post(self.url, data=data, headers=headers)
        await response.content()
        return response.code, headers.getRawHeaders(b"authorization")[0].decode()

    async def test_bearer_token(self) -> None:
        """
        The token is fetched on a login thread, never the reactor's; each
        request carries it as a bearer, the client's key removed.
        """
        self.serve(lifetime=600)
        credential = _ThreadNoting(ManagedIdentityCredential())
        self.addCleanup(credential.credential.close)
        login = self.login(credential=credential)
        before = time.time()
        await login.start()
        self.assertEqual(credential.on_reactor, [False])
        self.assertTrue(before + 599 <= login.expires_at <= time.time() + 601)
        code, authorization = await self.send(login)
        self.assertEqual(code, 200)
        self.assertTrue(self.identity.check(authorization[len("Bearer "):]))
        sent = self.foundry.requests[-1].headers
        self.assertNotIn("x-api-key", sent)
        self.assertNotIn("api-key", sent)

    async def test_refreshed_before_expiry(self) -> None:
        """
        Tokens that live 3 seconds, requests for 5 seconds: fetched again
        ahead of expiry, every request is taken.
        """
        self.serve(lifetime=3)
        login = self.login()
        await login.start()
        codes, tokens = [], []
        for _ in range(20):
            code, authorization = await self.send(login)
            codes.append(code)
            tokens.append(authorization)
            await deferLater(reactor, 0.25)
        self.assertEqual(codes, [200] * 20)
        self.assertGreaterEqual(len(set(tokens)), 3)
        self.assertGreaterEqual(self.identity.minted, 3)

    async def test_failure_in_one_line(self) -> None:
        """A refused token request fails the start with one line, naming the login, no secret."""
        self.serve(lifetime=600)
        set_environment(self, {"IDENTITY_HEADER": "wrong-identity-secret"})
        login = self.login()
        with self.assertRaises(LoginError) as caught:
            await login.start()
        message = str(caught.exception)
        self.assertTrue(message.startswith("Entra ID token for https://ai.azure.com/.default (managed): "), message)
        self.assertNotIn("\n", message)
        self.assertNotIn("wrong-identity-secret", message)
        self.assertNotIn(self.identity.header, message)

    async def test_failed_refresh(self) -> None:
        """
        A refresh that fails keeps the token in force and logs one line
        without the token or the identity secret.
        """
        # Under 5 minutes: azure-identity asks the endpoint, not its cache.
        self.serve(lifetime=120)
        login = self.login()
        await login.start()
        events: list = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        set_environment(self, {"IDENTITY_HEADER": "wrong-identity-secret"})
        with self.assertRaises(LoginError) as caught:
            await login.refresh()
        code, authorization = await self.send(login)
        self.assertEqual(code, 200)
        token = authorization[len("Bearer "):]
        logged = "\n".join(formatEvent(event) for event in events)
        self.assertIn("Refreshing Entra ID token", logged)
        for secret in (token, self.identity.header, "wrong-identity-secret"):
            self.assertNotIn(secret, logged)
            self.assertNotIn(secret, str(caught.exception))
            self.assertNotIn(secret, repr(login))
