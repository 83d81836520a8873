"""
Issue 32's last line (``bench/claude_code_clouds.py``): the real Claude Code
CLI completes a tool session through the relay against each simulated cloud.
Two ``claude -p`` rounds (the second with ``--continue``), three agentic
turns each, ``Read`` and ``Glob`` only, Opus 4.6 with the adaptive thinking
the CLI turns on for it: no API error; every request the cloud received on
its own wire with the relay's login (Bedrock: InvokeModel, SigV4 with the
session's credentials; Vertex: rawPredict with a token from the simulated
token endpoint; Foundry: the deployment and the resource key), never the
CLI's key; tool calls and their results in the CLI's own transcript, no id
seen twice though the cloud reused some; thinking back to the cloud; no 4xx
dumped but the one Bedrock answers the CLI's newest beta with; and nothing
reached outside 127.0.0.1.

The CLI is ``.ci/run``'s (``npm install --prefix DIR
@anthropic-ai/claude-code@2.1.332``), named by ``$TWISTED_RELAY_CLAUDE_CODE``;
without it these tests are skipped.
"""

from __future__ import annotations

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from bench.claude_code import installed_cli
from bench.claude_code_clouds import BEDROCK_BETA_REFUSAL, run_cli_session
from tests.helpers import check_cli_rounds

CLAUDE, NOT_INSTALLED = installed_cli()
ROUNDS = 2
MAX_TURNS = 3


class ClaudeCodeCloudTests(TestCase):
    skip = NOT_INSTALLED
    # Each round takes about a second here; a hung CLI is killed after 60.
    timeout = 2 * ROUNDS * 60 + 30

    async def session(self, cloud: str) -> dict:
        figures = await run_cli_session(reactor, claude=CLAUDE, cloud=cloud, rounds=ROUNDS, max_turns=MAX_TURNS,
                                        timeout=60.0)
        check_cli_rounds(self, figures, ROUNDS, MAX_TURNS)
        self.assertEqual(figures["off_the_wire"], [])
        self.assertGreaterEqual(figures["requests"], ROUNDS * MAX_TURNS)
        # Every answer went back to the cloud with its thinking.
        self.assertGreater(figures["requests_with_thinking_back"], 0)
        self.assertEqual(figures["answers_sent_back_without_thinking"], 0)
        return figures

    async def test_bedrock(self):
        """InvokeModel signed with SigV4; the CLI's betas in the body."""
        figures = await self.session("bedrock")
        # The CLI's newest beta (thinking-token-count-2026-05-13) is not one Bedrock takes: its 400 "invalid
        # beta flag" names none, the relay passes it on with its words, and the CLI sends the request again
        # without that beta: once per CLI process, dumped each time.
        self.assertLessEqual(figures["refused_betas_sent"], ROUNDS)
        self.assertEqual([(d["status"], d["message"], d["upstream"]) for d in figures["dumps"]],
                         [(400, BEDROCK_BETA_REFUSAL, "bedrock")] * figures["refused_betas_sent"])

    async def test_vertex(self):
        """rawPredict with a service account's token; the betas Vertex refuses by name learned once and dropped."""
        figures = await self.session("vertex")
        self.assertLessEqual(figures["refused_betas_sent"], 1)
        self.assertEqual(figures["dumps"], [])

    async def test_foundry(self):
        """The Anthropic wire, the model a deployment, the resource's key."""
        figures = await self.session("foundry")
        self.assertEqual(figures["dumps"], [])
