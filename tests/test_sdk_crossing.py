"""
End to end with the official ``anthropic`` SDK on real sockets: the relay, as
it runs today (one upstream, default rules), in front of a strict simulated
upstream that emits Kimi-style ids and leaves ids out, both of which it then
refuses in its own history.
"""

from __future__ import annotations

from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from tests.test_sdk import SDKTestMixin, run_session

TURNS = 40


class CrossingSDKTests(SDKTestMixin, TestCase):
    """Encoded and minted ids keep an SDK session alive, streaming and not."""

    def serve_strict(self, seed: int, left_out_ids: str = "some") -> str:
        _, upstream = self.serve_upstream(mode="strict", seed=seed, id_style="kimi", left_out_ids=left_out_ids,
                                          reuse_every=0)
        return upstream

    def assertSurvived(self, outcome: dict) -> None:
        self.assertEqual(outcome["failures"], [])
        self.assertEqual(outcome["completed"], TURNS)
        ids = outcome["ids"]
        self.assertEqual(len(ids), len(set(ids)), "the client saw a duplicate id")
        self.assertTrue(all(ids), "the client saw an empty id")
        self.assertTrue(any(i.startswith("toolu_relay") for i in ids), "no id was minted")
        self.assertTrue(any(i.startswith("functions.") for i in ids), "no Kimi-style id reached the client")

    async def test_without_relay_the_session_dies(self):
        """Straight against the upstream, the session fails at once: its own Kimi-style ids are refused."""
        upstream = self.serve_strict(seed=3, left_out_ids="never")
        outcome = await deferToThread(run_session, upstream, TURNS, False)
        self.assertEqual(len(outcome["failures"]), 1)
        self.assertIn("400", outcome["failures"][0])
        self.assertLess(outcome["completed"], 3)

    async def test_streaming(self):
        """Through the relay, streaming: every turn succeeds, ids minted at content_block_start."""
        base = self.serve_relay(self.serve_strict(seed=4))
        self.assertSurvived(await deferToThread(run_session, base, TURNS, True))

    async def test_non_streaming(self):
        """Through the relay, not streaming: every turn succeeds."""
        base = self.serve_relay(self.serve_strict(seed=5))
        self.assertSurvived(await deferToThread(run_session, base, TURNS, False))


