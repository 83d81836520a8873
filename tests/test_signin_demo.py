"""
``twistd relay --simulate strict --simulate-idp``: the keyless demo of
sign-in (:mod:`twisted_relay.simulated.signin_demo`). A real ``twistd``
process serves the simulated identity provider under ``/_idp`` on its own
listener; a person signs in as Claude Code and a browser do (HTTP on
127.0.0.1), is answered on the Messages API, and a person outside the
allowed group is refused at the browser step; with the real Claude Code
CLI (``$TWISTED_RELAY_CLAUDE_CODE``), ``claude auth login`` and
``claude -p`` work against it with nothing else running.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile

import requests
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase

from twisted_relay.settings import SettingsError, config_from, read_settings, reload_config
from twisted_relay.simulated.signin_demo import SimulatedSignIn

from bench.claude_code import installed_cli, run_cli
from tests.helpers import free_port, start_twistd
from tests.signin_helpers import claude_code_folders, claude_code_signs_in, cli_environment, trap

CLAUDE, NOT_INSTALLED = installed_cli()
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _browser() -> requests.Session:
    browser = requests.Session()
    browser.headers["Connection"] = "close"
    return browser


class _DemoPerson:
    """The person at the browser, signing in at the demo's own identity provider."""

    def __init__(self, testcase: TestCase):
        self.testcase = testcase

    async def browser_signs_in(self, grant: dict, email: str, browser: requests.Session | None = None) -> requests.Response:
        """The verification page, the code, the provider's user picker, the callback: its page."""
        browser = browser or _browser()
        page = await deferToThread(browser.get, grant["verification_uri_complete"], timeout=10)
        self.testcase.assertIn("--simulate-idp", page.text)  # the login notice
        sent = await deferToThread(browser.post, grant["verification_uri"], data={"user_code": grant["user_code"]},
                                   allow_redirects=False, timeout=10)
        self.testcase.assertEqual(sent.status_code, 303, sent.text)
        picker = await deferToThread(browser.get, sent.headers["Location"], timeout=10)
        self.testcase.assertEqual(picker.status_code, 200, picker.text)
        self.testcase.assertIn("/_idp/authorize", picker.url)
        request_id = re.search(r'name="request" value="([^"]+)"', picker.text).group(1)
        back = await deferToThread(browser.post, picker.url, data={"request": request_id, "email": email, "action": "sign_in"},
                                   allow_redirects=False, timeout=10)
        return await deferToThread(browser.get, back.headers["Location"], timeout=10)


class DemoTests(TestCase):
    """A ``twistd relay --simulate strict --simulate-idp`` process, signed in to over 127.0.0.1."""

    timeout = 180

    async def start(self) -> tuple[str, str]:
        """The demo relay on a free port (within 30 s): its URL and its log's path."""
        port = free_port()
        _, log_path = start_twistd(self, "-n", "--pidfile=", "relay", "--simulate", "strict", "--simulate-idp",
                                   "--listen", "tcp:%d:interface=127.0.0.1" % (port,), "--no-dumps", "--drain-delay", "0")
        for _ in range(300):
            if _accepts(port):
                break
            await deferLater(reactor, 0.1, lambda: None)
        self.assertTrue(_accepts(port), open(log_path).read())
        return "http://127.0.0.1:%d" % (port,), log_path

    async def call(self, method: str, url: str, **kwargs) -> requests.Response:
        headers = {"User-Agent": "claude-code/2.1.332", "Connection": "close", **kwargs.pop("headers", {})}
        return await deferToThread(requests.request, method, url, headers=headers, timeout=10, **kwargs)

    async def test_sign_in_and_be_answered(self):
        relay, log_path = await self.start()
        metadata = (await self.call("GET", relay + "/.well-known/oauth-authorization-server")).json()
        self.assertEqual(metadata["token_endpoint"], relay + "/oauth/token")
        discovery = (await self.call("GET", relay + "/_idp/.well-known/openid-configuration")).json()
        self.assertEqual(discovery["issuer"], relay + "/_idp")

        person = _DemoPerson(self)
        answers = {}
        for email in ("alice@example.com", "carol@example.com"):
            grant = (await self.call("POST", metadata["device_authorization_endpoint"], data="surface=claude_code",
                                     headers={"Content-Type": "application/x-www-form-urlencoded"})).json()
            done = await person.browser_signs_in(grant, email)
            answers[email] = done
            await deferLater(reactor, grant["interval"], lambda: None)
            polled = await self.call("POST", metadata["token_endpoint"],
                                     data={"grant_type": DEVICE_GRANT, "device_code": grant["device_code"]})
            if email == "alice@example.com":
                self.assertEqual(done.status_code, 200, done.text)
                self.assertEqual(polled.status_code, 200, polled.text)
                token = polled.json()["access_token"]
            else:
                self.assertEqual(done.status_code, 403, done.text)
                self.assertIn("engineering", done.text)
                self.assertEqual(polled.json()["error"], "access_denied")

        body = {"model": "claude-sonnet-4-5", "max_tokens": 32, "messages": [{"role": "user", "content": "Say pong"}]}
        answered = await self.call("POST", relay + "/v1/messages?beta=true", json=body,
                                   headers={"Authorization": "Bearer " + token, "anthropic-version": "2023-06-01"})
        self.assertEqual(answered.status_code, 200, answered.text)
        self.assertEqual(answered.json()["type"], "message")
        refused = await self.call("POST", relay + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
        self.assertEqual(refused.status_code, 401)
        with open(log_path) as f:
            logged = f.read()
        self.assertIn("Simulated identity provider at %s/_idp" % (relay,), logged)
        self.assertIn("sign-in: %s (issuer %s/_idp)" % (relay, relay), logged)
        self.assertNotIn(token, logged)

    async def test_claude_code(self):
        if NOT_INSTALLED:
            self.skipTest(NOT_INSTALLED)
        relay, _ = await self.start()
        folder = tempfile.mkdtemp(prefix="claude-code-signin-demo-")
        self.addCleanup(shutil.rmtree, folder, True)
        home, project = claude_code_folders(folder, relay)
        caught, trap_url = trap(self)
        environment = cli_environment(home, trap_url)
        await claude_code_signs_in(self, CLAUDE, _DemoPerson(self), relay, environment, project, "bob@example.com")
        status = await run_cli(reactor, [CLAUDE, "auth", "status", "--json"], environment, project, 60)
        self.assertEqual(json.loads(status.stdout)["email"], "bob@example.com")
        answered = await run_cli(reactor, [CLAUDE, "-p", "Reply with pong", "--output-format", "json", "--tools", "",
                                           "--max-turns", "1"], environment, project, 90)
        self.assertFalse(answered.timed_out)
        self.assertIsNone(answered.result.get("api_error_status"), answered.stdout[-2000:])
        self.assertTrue(answered.result.get("result"), answered.stdout[-2000:])
        self.assertEqual(caught.caught, [])


class DemoSettingsTests(SynchronousTestCase):
    """What ``--simulate-idp`` needs, refused in one line at start."""

    def test_refused(self):
        for options, says in (
            ({"simulate-idp": True, "listen": ["unix:relay.sock"]}, "--simulate-idp serves Claude Code at http://127.0.0.1:PORT"),
            ({"simulate-idp": True, "listen": ["tcp:0:interface=127.0.0.1"]}, "with a fixed port"),
            ({"simulate-idp": True, "listen": ["tcp:8080:interface=10.1.2.3"]}, "interface=127.0.0.1"),
            # Its user picker asks no password: never on an interface others reach.
            ({"simulate-idp": True, "listen": ["tcp:8080:interface=0.0.0.0"]}, "interface=127.0.0.1"),
            ({"simulate-idp": True, "listen": ["tcp:8080"]}, "interface=127.0.0.1"),
            ({"simulate-idp": True, "workers": "2"}, "--simulate-idp runs in one process"),
        ):
            error = self.assertRaises(SettingsError, config_from, options)
            self.assertIn(says, str(error))
        self.assertTrue(config_from({"simulate-idp": True}).simulate_idp)
        folder = self.mktemp()
        os.makedirs(folder)
        path = os.path.join(folder, "relay.toml")
        with open(path, "w") as f:
            f.write('[signin]\npublic_url = "http://127.0.0.1:8080"\nissuer = "http://127.0.0.1:9"\nclient_id = "x"\n'
                    'session_secret = "a-session-secret-of-forty-characters-xx"\n')
        error = self.assertRaises(SettingsError, read_settings, {"simulate-idp": True}, path)
        self.assertIn("[signin] with --simulate-idp", str(error))

    def test_reload(self):
        """A reload keeps the sign-in the relay made, and does not call it a change that needs a restart."""
        folder = self.mktemp()
        os.makedirs(folder)
        path = os.path.join(folder, "relay.toml")
        with open(path, "w") as f:
            f.write("[relay]\nsimulate-idp = true\nsimulate = \"strict\"\n")
        config = read_settings(None, path)
        running = config.with_changes(signin=SimulatedSignIn(config.listen[0], reactor).signin)
        result = reload_config(running, {})  # as twistd relay --config relay.toml reloads
        self.assertEqual((result.error, result.needs_restart), (None, ()))
        self.assertEqual(result.config.signin, running.signin)
