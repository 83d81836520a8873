"""
Issue 33's long sessions (``bench/openai_session.py``): through the relay,
with the official Anthropic SDK, 300 turns of a tool loop (whole and
streamed turns, adaptive thinking, ids reused by the upstream) against the
simulated Responses upstream and each Chat Completions dialect: no failed
turn, no id the client sees twice, and every turn sends back the reasoning
the upstream made (the simulators' own tally: none dropped, none foreign).
"""

from __future__ import annotations

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from bench.openai_session import run_session

TURNS = 300


class OpenAISessionTests(TestCase):
    timeout = 300

    async def session(self, upstream: str, thinks: bool = True) -> dict:
        figures = await run_session(reactor, upstream=upstream, turns=TURNS, time_limit=240.0)
        self.assertEqual(figures["errors"], [])
        self.assertEqual((figures["turns"], figures["failed_turns"]), (TURNS, 0))
        self.assertEqual(figures["duplicate_ids"], 0)
        self.assertGreater(figures["ids_renamed"], 0)
        self.assertEqual(figures["dumps"], 0)
        self.assertTrue(figures["reasoning_ok"], figures.get("reasoning_problems") or figures.get("reasoning_totals"))
        if thinks:
            # Claude Code sees the upstream's thinking on every turn.
            self.assertEqual(figures["answers_with_thinking"], TURNS)
        return figures

    async def test_responses(self):
        await self.session("responses")

    async def test_deepseek(self):
        totals = (await self.session("deepseek"))["reasoning_totals"]
        self.assertGreater(totals["own"], 0)

    async def test_kimi(self):
        await self.session("kimi")

    async def test_gemini(self):
        await self.session("gemini")

    async def test_openrouter(self):
        await self.session("openrouter")

    async def test_groq(self):
        await self.session("groq", thinks=False)

    async def test_mistral(self):
        await self.session("mistral", thinks=False)

    async def test_openai_chat(self):
        await self.session("openai", thinks=False)

    async def test_alternating_with_anthropic(self):
        """
        The same session alternating every three turns between an Anthropic
        upstream and the Responses upstream: each one's reasoning goes back to
        it (the Responses upstream's tally; the Anthropic one refuses a tool
        loop whose thinking it did not sign), none to the other.
        """
        figures = await self.session("alternate")
        self.assertEqual(figures["served"], {"gpt": TURNS // 2, "anthropic": TURNS // 2})
