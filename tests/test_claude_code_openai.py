"""
Issue 33, "Done when" (``bench/claude_code_openai.py``): the real Claude Code
CLI completes a tool session through the relay against the simulated
Responses upstream and the Gemini dialect of the simulated Chat Completions
upstream. Two ``claude -p`` rounds (the second with ``--continue``), three
agentic turns each, ``Read`` and ``Glob`` only, ``--model claude-opus-4-6``
(the CLI's adaptive thinking, effort, betas, context management and
attribution line as it sends them), which the relay's model map sends to
``gpt-5.5`` or ``gemini-3-pro``: no API error; every request the upstream
received in its own protocol with the relay's key (stateless Responses
input items with encrypted reasoning asked for; Chat messages whose tool
calls carry Gemini's thought signatures), never the CLI's key; tool calls
and their results in the CLI's transcript and in what went back, no id seen
twice though the upstream reused some; the simulator's own tally of its
reasoning clean (every turn sent back what it made: none dropped, none
foreign, nothing refused); Claude Code's attribution line never sent; no
4xx dumped; nothing reached outside 127.0.0.1.

The CLI is ``.ci/run``'s, named by ``$TWISTED_RELAY_CLAUDE_CODE``; without it
these tests are skipped.
"""

from __future__ import annotations

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from bench.claude_code import installed_cli
from bench.claude_code_openai import run_cli_session
from tests.helpers import check_cli_rounds

CLAUDE, NOT_INSTALLED = installed_cli()
ROUNDS = 2
MAX_TURNS = 3


class ClaudeCodeOpenAITests(TestCase):
    skip = NOT_INSTALLED
    # Each round takes about a second here; a hung CLI is killed after 60.
    timeout = 2 * ROUNDS * 60 + 30

    async def session(self, upstream: str) -> dict:
        figures = await run_cli_session(reactor, claude=CLAUDE, upstream=upstream, rounds=ROUNDS,
                                        max_turns=MAX_TURNS, timeout=60.0)
        check_cli_rounds(self, figures, ROUNDS, MAX_TURNS)
        self.assertEqual(figures["off_the_protocol"], [])
        self.assertGreaterEqual(figures["requests"], ROUNDS * MAX_TURNS)
        self.assertTrue(figures["reasoning_ok"], figures.get("reasoning_problems") or figures.get("reasoning_totals"))
        # Its per-request line would change the prompt's prefix at every request.
        self.assertEqual(figures["attribution_sent"], 0)
        self.assertEqual(figures["dumps"], [])
        return figures

    async def test_responses(self):
        """GPT on the Responses API: function calls, their outputs and the encrypted reasoning sent back."""
        figures = await self.session("responses")
        self.assertEqual(figures["paths"], ["/v1/responses"])
        carried = figures["carried"]
        self.assertGreater(carried["function_calls"], 0)
        self.assertEqual(carried["function_call_outputs"], carried["function_calls"])
        # Which items are this upstream's to get back is the simulator's tally (reasoning_ok) to check.
        self.assertGreater(carried["reasoning_items"], 0)

    async def test_gemini(self):
        """Gemini's Chat Completions: every tool call sent back with its thought signature, checked as Gemini does."""
        figures = await self.session("gemini")
        self.assertEqual(figures["paths"], ["/v1/chat/completions"])
        carried = figures["carried"]
        self.assertGreater(carried["tool_calls"], 0)
        self.assertEqual(carried["tool_messages"], carried["tool_calls"])
        self.assertEqual(carried["thought_signatures"], carried["tool_calls"])
        self.assertGreater(figures["reasoning_totals"]["own"], 0)
