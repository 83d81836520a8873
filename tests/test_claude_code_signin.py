"""
Issue 34 with the real Claude Code CLI (2.1.332, ``.ci/run``'s, named by
``$TWISTED_RELAY_CLAUDE_CODE``; skipped without it): ``claude auth login
--gateway-json`` signs in through the relay and the simulated identity
provider (the test plays the person at the browser when the CLI says it is
polling), ``claude auth status`` says so, ``claude -p`` is answered through
the relay with the session bearer, after a refresh the short session lifetime
asks for, and metered under the person; ``claude auth logout`` revokes, and
the token is refused afterwards. Nothing reaches outside 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from bench.claude_code import installed_cli, run_cli
from tests.signin_helpers import claude_code_folders, claude_code_signs_in, cli_environment, trap
from tests.test_signin_flow import _World

CLAUDE, NOT_INSTALLED = installed_cli()


class ClaudeCodeSignInTests(TestCase):
    skip = NOT_INSTALLED
    timeout = 180

    async def test_login_prompt_logout(self):
        world = _World(self)
        # Under 5 minutes: the CLI refreshes before its first request.
        relay = world.relay(session_ttl=120)
        folder = tempfile.mkdtemp(prefix="claude-code-signin-")
        self.addCleanup(shutil.rmtree, folder, True)
        home, project = claude_code_folders(folder, relay)
        caught, trap_url = trap(self)
        environment = cli_environment(home, trap_url)
        login = await claude_code_signs_in(self, CLAUDE, world, relay, environment, project, "alice@example.com")
        names = [state.get("state") for state in login.states]
        self.assertIn("polling", names)
        self.assertIn("confirm_account", names)
        with open(os.path.join(home, ".claude", ".credentials.json")) as f:
            gateway = json.load(f)["enterpriseGateway"]
        self.assertEqual((gateway["email"], gateway["revocationEndpoint"]), ("alice@example.com", relay + "/oauth/revoke"))
        self.assertTrue(gateway["idpRefreshToken"])

        redeemed = world.idp.requests["token"]
        status = await run_cli(reactor, [CLAUDE, "auth", "status", "--json"], environment, project, 60)
        self.assertTrue(json.loads(status.stdout)["loggedIn"], status.stdout)

        debug = os.path.join(folder, "debug.log")
        # The simulated model calls a tool whenever it has one: one tool, two turns, then the CLI stops.
        answered = await run_cli(reactor, [CLAUDE, "-p", "Reply with pong", "--output-format", "json", "--tools", "Read",
                                           "--allowedTools", "Read", "--max-turns", "2", "--debug-file", debug],
                                 environment, project, 90)
        if answered.timed_out or answered.result.get("api_error_status") is not None or not answered.result:
            with open(debug, encoding="utf-8", errors="replace") as f:
                shown = f.read()[-6000:]
            self.fail((answered.stdout[-2000:], answered.stderr[-2000:], shown,
                       [line for line in world.logged if "relay_request" in line or "method" in line][-10:]))
        # The short session was refreshed (the provider asked again), and no request failed for it.
        self.assertGreater(world.idp.requests["token"], redeemed)
        statuses = re.findall(r"'path': '/v1/messages', 'status': (\d+)", "\n".join(world.logged))
        self.assertTrue(statuses)
        self.assertEqual(set(statuses), {"200"})
        rows = await world.ledger_rows(1)
        self.assertTrue(rows and set(rows) == {("alice@example.com", "platform")}, rows)

        with open(os.path.join(home, ".claude", ".credentials.json")) as f:
            session_token = json.load(f)["enterpriseGateway"]["jwt"]
        logout = await run_cli(reactor, [CLAUDE, "auth", "logout"], environment, project, 60)
        self.assertEqual(logout.code, 0, logout.stderr[-2000:])
        refused = await world.message(relay, session_token)
        self.assertEqual((refused.status_code, refused.headers["x-should-retry"]), (401, "false"))
        after = await run_cli(reactor, [CLAUDE, "auth", "status", "--json"], environment, project, 60)
        self.assertNotEqual(after.code, 0)
        self.assertEqual(caught.caught, [])
        logged = "\n".join(world.logged)
        for secret in (session_token, gateway["idpRefreshToken"]):
            self.assertNotIn(secret, logged)

