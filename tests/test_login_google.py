"""
Tests for the relay's Google login (:mod:`twisted_relay.logins.google`),
against the simulated Google token endpoint and Vertex AI on real sockets
on 127.0.0.1: google-auth does real HTTP on the logins' threads.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.utils import getProcessOutputAndValue
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase
from twisted.web.http_headers import Headers
from twisted.web.server import Site

from tests.test_simulated_vertex import EMAIL, PROJECT, test_account, vertex_body, vertex_path
from twisted_relay.logins.base import LoginError, LoginThreads
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.google_tokens import SimulatedGoogleTokens, make_service_account
from twisted_relay.simulated.vertex import SimulatedVertex

try:
    import google.auth  # noqa: F401

    from twisted_relay.logins.google import GoogleLogin, require_google_auth
except ImportError:  # pragma: no cover - the test extra installs google-auth
    GoogleLogin = None  # type: ignore[assignment,misc]

VM_ACCOUNT = "vm-default@relay-test-1.iam.gserviceaccount.com"


class _Google:
    """The simulated token endpoint, metadata server and Vertex, served on 127.0.0.1."""

    def __init__(self, testcase: TestCase, lifetime: int = 3599):
        self.tokens = SimulatedGoogleTokens(reactor, {EMAIL: test_account().public_key}, lifetime=lifetime,
                                            metadata_account=VM_ACCOUNT, project_id=PROJECT)
        self.vertex = SimulatedVertex(SimulatedUpstream(reactor=reactor), PROJECT, self.tokens)
        self.port = reactor.listenTCP(0, Site(self.vertex.resource()), interface="127.0.0.1")
        testcase.addCleanup(self.port.stopListening)
        self.base = "http://127.0.0.1:%d" % (self.port.getHost().port,)
        self.key_file = os.path.join(testcase.mktemp())
        with open(self.key_file, "w") as f:
            json.dump(test_account(self.base + "/token").info, f)

    async def count(self, headers: Headers) -> int:
        """POST a count-tokens request to the simulated Vertex; its status."""
        headers = headers.copy()
        headers.setRawHeaders(b"content-type", [b"application/json"])
        body = json.dumps(vertex_body(model="claude-sonnet-4-5")).encode("utf-8")
        response = await treq.post(self.base + vertex_path(model="count-tokens"), data=body, headers=headers,
                                   persistent=False)
        await treq.content(response)
        return response.code


class GoogleLoginTests(TestCase):
    """A token from google-auth on every request, fetched and refreshed off the reactor."""

    def setUp(self) -> None:
        if GoogleLogin is None:
            raise SkipTest("google-auth is not installed (pip install '.[test]')")
        self.threads = LoginThreads(reactor)
        self.addCleanup(self.threads.stop)

    def login(self, **options: Any) -> GoogleLogin:
        login = GoogleLogin(reactor, self.threads, **options)

        def quiesce():
            # No timed refresh after this, and none in flight when the
            # threads stop (a fetch waits on a simulator this reactor serves).
            login.stop()
            return login.refresh().addErrback(lambda failure: None)

        self.addCleanup(quiesce)
        return login

    def authorized(self, login: GoogleLogin) -> Headers:
        headers = Headers()
        login.authorize(b"POST", "http://vertex.example/v1/projects/p", headers, b"{}")
        return headers

    async def test_service_account_file(self) -> None:
        """A service account's key file: the token google-auth gets from the
        token endpoint goes on the request as a Bearer token that Vertex takes;
        the project is the key file's."""
        google = _Google(self)
        login = self.login(credentials_file=google.key_file)
        with self.assertRaises(LoginError):
            self.authorized(login)
        await login.start()
        headers = self.authorized(login)
        [authorization] = headers.getRawHeaders(b"authorization")
        self.assertTrue(authorization.startswith(b"Bearer ya29."))
        self.assertEqual(google.tokens.check(authorization[7:].decode()).account, EMAIL)
        self.assertEqual(login.project, PROJECT)
        self.assertEqual(await google.count(headers), 200)
        self.assertIsNone(headers.getRawHeaders(b"x-goog-user-project"))

    async def test_refreshed_ahead_of_expiry(self) -> None:
        """Tokens that live 2 seconds: over 3 seconds of requests none is refused,
        each carries a token Vertex takes, and new ones were fetched on the
        way (without the refresh the first expires under the requests)."""
        google = _Google(self, lifetime=2)
        login = self.login(credentials_file=google.key_file)
        await login.start()
        seen = set()
        codes = []
        end = time.monotonic() + 3.0
        for _ in range(40):
            if time.monotonic() >= end:
                break
            headers = self.authorized(login)
            seen.add(headers.getRawHeaders(b"authorization")[0])
            codes.append(await google.count(headers))
            await deferLater(reactor, 0.1, lambda: None)
        self.assertEqual(set(codes), {200})
        self.assertGreaterEqual(len(codes), 10)
        self.assertGreaterEqual(len(seen), 3)
        self.assertGreaterEqual(google.tokens.minted, 3)

    async def test_application_default_credentials(self) -> None:
        """Without a file, Application Default Credentials: here
        ``GOOGLE_APPLICATION_CREDENTIALS`` names the key file."""
        google = _Google(self)
        previous = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
        os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = google.key_file

        def restore() -> None:
            if previous is None:
                os.environ.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
            else:
                os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = previous

        self.addCleanup(restore)
        login = self.login()
        self.assertIn("Application Default Credentials", repr(login))
        await login.start()
        self.assertEqual(await google.count(self.authorized(login)), 200)
        self.assertEqual(login.project, PROJECT)

    async def test_fetch_failure_is_one_line(self) -> None:
        """A refused grant, an unreachable endpoint, a broken key file: a
        one-line :class:`LoginError` naming the source, without the key or
        the assertion."""
        google = _Google(self)
        stranger = make_service_account(EMAIL, PROJECT, google.base + "/token")
        other_key = os.path.join(self.mktemp())
        with open(other_key, "w") as f:
            json.dump(stranger.info, f)
        broken = os.path.join(self.mktemp())
        with open(broken, "w") as f:
            key = stranger.info["private_key"]
            json.dump({**stranger.info, "private_key": key[:200] + "AAAA" + key[204:]}, f)
        closed = _Google(self)
        await closed.port.stopListening()
        cases = [
            (other_key, "invalid_grant: Invalid JWT Signature."),
            (broken, ""),
            (closed.key_file, ""),
        ]
        for path, words in cases:
            login = self.login(credentials_file=path, timeout=5)
            error = await self.assertFailure(login.start(), LoginError)
            message = str(error)
            self.assertTrue(message.startswith("Google credentials from the file %s: " % (path,)), message)
            self.assertIn(words, message)
            self.assertNotIn("\n", message)
            self.assertNotIn("PRIVATE KEY", message)
            for piece in stranger.info["private_key"].splitlines()[1:-1]:
                self.assertNotIn(piece, message)
            self.assertNotIn("eyJ", message, "an assertion (a JWT) in the message")

    async def test_token_never_shown(self) -> None:
        """The token is in no repr and no log line, whether refreshes succeed or fail."""
        google = _Google(self, lifetime=2)
        events: list = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        login = self.login(credentials_file=google.key_file)
        await login.start()
        tokens = {self.authorized(login).getRawHeaders(b"authorization")[0][7:].decode()}
        # The next timed refresh fails: the account is gone.
        google.tokens.add_service_account(EMAIL, make_service_account(EMAIL, PROJECT, "x").public_key)
        await deferLater(reactor, 1.3, lambda: None)
        tokens.add(self.authorized(login).getRawHeaders(b"authorization")[0][7:].decode())
        self.assertEqual(len(tokens), 1, "the failed refresh kept the token in force")
        self.flushLoggedErrors()
        shown = [repr(login), repr(login.source.current), repr(login.source.current.value)]
        from twisted.logger import formatEvent

        shown += [formatEvent(event) + repr(event) for event in events]
        self.assertTrue(any("Refreshing" in text and "Invalid JWT Signature" in text for text in shown),
                        "the failed refresh was logged")
        for token in tokens:
            for text in shown:
                self.assertNotIn(token, text)

    async def test_metadata_server(self) -> None:
        """On a VM (here: the simulated metadata server, in a process of its own
        since google-auth reads ``GCE_METADATA_HOST`` when imported),
        Application Default Credentials are the VM's account's."""
        google = _Google(self)
        host = "127.0.0.1:%d" % (google.port.getHost().port,)
        home = os.path.abspath(self.mktemp())
        os.makedirs(home)
        env = {key: value for key, value in os.environ.items() if not key.startswith(("GOOGLE_", "GCE_", "CLOUDSDK"))}
        env.update(GCE_METADATA_HOST=host, GCE_METADATA_IP=host, HOME=home, CLOUDSDK_CONFIG=home)
        out, err, code = await getProcessOutputAndValue(sys.executable, ["-c", _METADATA_CHILD], env=env)
        self.assertEqual(code, 0, err.decode("utf-8", "replace")[-2000:])
        project, token = out.decode().split()
        self.assertEqual(project, PROJECT)
        self.assertEqual(google.tokens.check(token).account, VM_ACCOUNT)


_METADATA_CHILD = """
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import react
from twisted.web.http_headers import Headers
from twisted_relay.logins.base import LoginThreads
from twisted_relay.logins.google import GoogleLogin

async def main(reactor):
    threads = LoginThreads(reactor)
    login = GoogleLogin(reactor, threads, timeout=5)
    try:
        await login.start()
        headers = Headers()
        login.authorize(b"POST", "http://vertex.example/", headers, b"")
        print(login.project, headers.getRawHeaders(b"authorization")[0].decode()[7:])
    finally:
        login.stop()
        threads.stop()

react(lambda reactor: ensureDeferred(main(reactor)))
"""


class RequireGoogleAuthTests(SynchronousTestCase):
    """Without google-auth the relay says, at start, which extra brings it."""

    def test_missing(self) -> None:
        """``require_google_auth`` and ``GoogleLogin`` raise a one-line
        :class:`LoginError` with the install command."""
        if GoogleLogin is None:
            raise SkipTest("google-auth is not installed (pip install '.[test]')")
        saved = {name: sys.modules.get(name) for name in ("google.auth", "google.auth.transport.requests")}
        sys.modules["google.auth"] = None  # type: ignore[assignment]

        def restore() -> None:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module

        self.addCleanup(restore)
        error = self.assertRaises(LoginError, require_google_auth)
        self.assertEqual(str(error), "The Google login needs google-auth and requests (google.auth is missing): "
                                     "pip install 'twisted-relay[gcp]'")
        threads = LoginThreads(reactor)
        self.assertRaises(LoginError, GoogleLogin, reactor, threads)
        restore()
        require_google_auth()
