"""
Issue 34's refusals as the real Claude Code CLI (2.1.332, ``.ci/run``'s,
named by ``$TWISTED_RELAY_CLAUDE_CODE``; skipped without it) meets them:

- a person outside the allowed groups is refused at the browser step, and
  ``claude auth login --gateway-json`` stops with Claude Code's own "denied"
  screen, signed in as nobody;
- a signed-in person whose group reaches its spend limit: the next
  ``claude -p`` is refused with one request (429 ``billing_error``,
  ``x-should-retry: false``) and the CLI shows the relay's message.

The sign-in is played as in :mod:`tests.test_claude_code_signin` (the same
driver and world); nothing reaches outside 127.0.0.1.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from bench.claude_code import installed_cli, run_cli
from tests.signin_helpers import claude_code_folders, cli_environment, gateway_login, trap
from tests.test_signin_flow import ADMIN, _World

CLAUDE, NOT_INSTALLED = installed_cli()


class _SignedInCLI:
    """A fresh ``HOME`` whose settings name the relay as the gateway, a project folder, a proxy trap."""

    def __init__(self, testcase: TestCase, world: _World, relay: str):
        self.testcase, self.world, self.relay = testcase, world, relay
        folder = tempfile.mkdtemp(prefix="claude-code-signin-")
        testcase.addCleanup(shutil.rmtree, folder, True)
        self.home, self.project = claude_code_folders(folder, relay)
        self.trap, trap_url = trap(testcase)
        self.environment = cli_environment(self.home, trap_url)

    async def login(self, email: str) -> tuple[int, list[dict], object]:
        """``claude auth login --gateway-json`` with ``email`` at the browser: exit code, screens, the callback's page."""
        code, login, pages = await gateway_login(CLAUDE, self.world, self.relay, self.environment, self.project, email)
        return code, login.states, pages[0] if pages else None

    async def prompt(self, text: str):
        return await run_cli(reactor, [CLAUDE, "-p", text, "--output-format", "json", "--tools", "",
                                       "--max-turns", "1"], self.environment, self.project, 90)


def _messages_answered(world: _World) -> list[str]:
    """The statuses of the relay's ``/v1/messages`` answers, from its log lines, in order."""
    return re.findall(r"'path': '/v1/messages', 'status': (\d+)", "\n".join(world.logged))


class ClaudeCodeSignInRefusalTests(TestCase):
    skip = NOT_INSTALLED
    timeout = 180

    async def test_outside_the_allowed_groups(self):
        """Carol (IdP group ``sales``; the relay admits ``engineering``): a clear page, the CLI's denied screen."""
        world = _World(self)
        cli = _SignedInCLI(self, world, world.relay())
        code, screens, page = await cli.login("carol@example.com")
        self.assertEqual(page.status_code, 403, page.text)
        self.assertIn("engineering", page.text)
        self.assertNotEqual(code, 0)
        self.assertEqual(screens[-1].get("state"), "error", screens)
        self.assertIn("denied", screens[-1].get("message", "").lower(), screens)
        self.assertNotIn("confirm_account", [screen.get("state") for screen in screens])
        self.assertFalse(os.path.exists(os.path.join(cli.home, ".claude", ".credentials.json"))
                         and "enterpriseGateway" in open(os.path.join(cli.home, ".claude", ".credentials.json")).read())
        status = await run_cli(reactor, [CLAUDE, "auth", "status", "--json"], cli.environment, cli.project, 60)
        self.assertNotEqual(status.code, 0, status.stdout)
        self.assertEqual(cli.trap.caught, [])

    async def test_group_cap_refuses_the_next_prompt(self):
        """
        Alice (group ``platform``) is answered and metered; her group's cap
        is then set to $0: the next ``claude -p`` gets one 429 and shows the
        relay's message, ``x-should-retry: false`` kept it from retrying.
        """
        world = _World(self)
        relay = world.relay()
        cli = _SignedInCLI(self, world, relay)
        code, screens, _ = await cli.login("alice@example.com")
        self.assertEqual((code, screens[-1].get("state")), (0, "done"), screens)
        answered = await cli.prompt("Reply with pong")
        self.assertFalse(answered.result.get("is_error"), answered.stdout[-2000:])
        rows = await world.ledger_rows(1)
        self.assertEqual(set(rows), {("alice@example.com", "platform")})

        limit = await world.call("POST", relay + "/v1/organizations/spend_limits", headers={"x-api-key": ADMIN.key},
                                 json={"scope": {"type": "workspace", "workspace_id": "platform"},
                                       "period": "monthly", "amount": "0"})
        self.assertEqual(limit.status_code, 200, limit.text)
        before = len(_messages_answered(world))
        refused = await cli.prompt("Reply with pong again")
        self.assertTrue(refused.result.get("is_error"), refused.stdout[-2000:])
        self.assertEqual(refused.result.get("api_error_status"), 429, refused.stdout[-2000:])
        self.assertIn("spend limit reached", refused.result.get("result", ""))
        self.assertIn("group's monthly spend limit is $0", refused.result.get("result", ""))
        # One request, refused: the CLI did not retry it.
        self.assertEqual(_messages_answered(world)[before:], ["429"])
        self.assertEqual(cli.trap.caught, [])
