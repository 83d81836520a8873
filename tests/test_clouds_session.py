"""
Issue 32's long sessions (``bench/clouds_session.py``): through the relay,
with the official SDK, 300 turns of a tool loop (whole and streamed turns,
adaptive thinking on Opus 4.6, ids reused by the upstream) against each
simulated cloud, logged in to as the real one is: no failed turn, no id the
client sees twice, each upstream's own thinking back at every turn it
serves; and one session that moves from Anthropic to Bedrock to Vertex by
failover only, before the first byte of an answer.
"""

from __future__ import annotations

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from bench.clouds_session import run_session

TURNS = 300


class CloudSessionTests(TestCase):
    timeout = 300

    async def session(self, cloud: str) -> dict:
        figures = await run_session(reactor, cloud=cloud, turns=TURNS, time_limit=240.0)
        self.assertEqual(figures["errors"], [])
        self.assertEqual((figures["turns"], figures["failed_turns"]), (TURNS, 0))
        self.assertEqual(figures["duplicate_ids"], 0)
        # The upstream did reuse ids: the relay renamed them for the client.
        self.assertGreater(figures["ids_renamed"], 0)
        for name, served in figures["upstreams"].items():
            self.assertGreater(served["turns_served"], 0, name)
            self.assertEqual(served["answers_with_thinking"], served["turns_served"], name)
            self.assertEqual(served["turns_missing_own_thinking"], 0, name)
        return figures

    async def test_bedrock(self):
        figures = await self.session("bedrock")
        self.assertEqual(figures["order"], ["bedrock"])

    async def test_vertex(self):
        figures = await self.session("vertex")
        self.assertEqual(figures["order"], ["vertex"])

    async def test_foundry(self):
        figures = await self.session("foundry")
        self.assertEqual(figures["order"], ["foundry"])

    async def test_switch_by_failover_only(self):
        """Anthropic, then Bedrock, then Vertex: each move is a failover before the first byte."""
        figures = await self.session("switch")
        self.assertEqual(figures["order"], ["anthropic", "bedrock", "vertex"])
        self.assertGreater(figures["refusals"]["anthropic"], 0)
        self.assertGreater(figures["refusals"]["bedrock"], 0)
