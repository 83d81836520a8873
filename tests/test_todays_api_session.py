# -*- test-case-name: tests.test_todays_api_session -*-
"""
Issue 25's "Done when", end to end and short: the official SDK through the
relay (built from a ``--config`` file as ``twistd relay`` builds it) on
127.0.0.1, thinking adaptive, alternating between a Kimi-style simulated
upstream and a strict, prefix-checking Sonnet-5.5-like one
(:mod:`bench.todays_api_session`, whose 300-turn runs are in
docs/benchmarks.md): no failed turn, no duplicate id, nothing dropped, each
upstream gets its own thinking back and the client's ``thinking`` reaches
both unchanged; the same with relay-held threads and with a failover between
two keys of one account; a failover to another account's key is reported
and counted; a client that edits an old turn is rescued by the recovery (or
gets the upstream's 400 with it off).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

from twisted.internet import reactor
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase

from bench.todays_api_session import Turn, own_thinking_back, run_session
from twisted_relay.simulated.thinking import prefix_mismatch_message

try:
    import anthropic
except ImportError:  # pragma: no cover - the test extra installs it
    anthropic = None


class TodaysAPISessionTests(TestCase):
    """Short sessions of :mod:`bench.todays_api_session`."""

    timeout = 120

    def setUp(self) -> None:
        if anthropic is None:  # pragma: no cover
            raise SkipTest("the anthropic SDK is not installed")

    async def session(self, turns: int = 12, **options) -> dict:
        folder = self.mktemp()
        return await run_session(reactor, turns=turns, every=3, time_limit=90, folder=folder, **options)

    def assertSessionWhole(self, figures: dict) -> None:
        """Every turn answered, no duplicate, each upstream got its own thinking back
        and the client's ``thinking`` with every request, and thought in every answer."""
        self.assertEqual(figures["turns"], figures["turns_asked"])
        self.assertEqual((figures["failed_turns"], figures["errors"]), (0, []))
        self.assertEqual(figures["duplicate_ids"], 0)
        for name in ("kimi", "strict"):
            upstream = figures[name]
            self.assertEqual(upstream["turns_served"], figures["turns"] // 2, name)
            self.assertEqual(upstream["turns_missing_own_thinking"], 0, name)
            self.assertEqual(upstream["own_blocks_made"], upstream["turns_served"], name)
            # Adaptive thinking is never touched (issue 25, item 3), so each model thinks every time.
            self.assertEqual(upstream["requests_with_thinking_field"], upstream["requests"], name)
            self.assertEqual(upstream["answers_with_thinking"], upstream["turns_served"], name)
        self.assertEqual(figures["kimi"]["thinking_dropped"], 0)

    async def test_session_thinking_omitted(self) -> None:
        """No ``thinking`` field (adaptive on Sonnet 5.5): the strict upstream thinks every time
        and gets all of it back; nothing is dropped, no field is added."""
        figures = await self.session(thinking="omitted")
        self.assertEqual((figures["turns"], figures["failed_turns"], figures["duplicate_ids"]), (12, 0, 0))
        strict = figures["strict"]
        self.assertEqual((strict["answers_with_thinking"], strict["own_blocks_made"]), (6, 6))
        self.assertEqual((strict["turns_missing_own_thinking"], strict["thinking_dropped"]), (0, 0))
        self.assertEqual(figures["kimi"]["requests_with_thinking_field"] + strict["requests_with_thinking_field"], 0)

    async def test_session(self) -> None:
        """24 turns, every other one streamed, a switch every 3: nothing dropped, nothing moved."""
        figures = await self.session(24)
        self.assertSessionWhole(figures)
        self.assertEqual(figures["strict"]["thinking_dropped"], 0)
        self.assertEqual(figures["streamed_turns"], 12)
        self.assertEqual((figures["moves_same_account"], figures["moves_other_account"]), (0, 0))
        self.assertEqual((figures["binding_recoveries"], figures["dumps"]), (0, 0))

    async def test_threads(self) -> None:
        """The SDK's tool runner with relay-held threads: the same, every continue found."""
        figures = await self.session(threads=True)
        self.assertSessionWhole(figures)
        self.assertEqual(figures["strict"]["thinking_dropped"], 0)
        self.assertEqual(figures["thread_continues_found"], 11)
        self.assertEqual(figures["thread_continues_lost"], 0)

    async def test_failover_same_account(self) -> None:
        """The conversation's key answers 429 from the middle on: the other key of its account
        takes over, nothing is dropped, the moves are counted as within the account."""
        figures = await self.session(failover="same-account")
        self.assertSessionWhole(figures)
        self.assertEqual(figures["strict"]["thinking_dropped"], 0)
        self.assertEqual(figures["rate_limited"], 1)
        self.assertEqual(dict(figures["strict_keys"]), {"acme-1": 3, "acme-2": 3})
        self.assertEqual((figures["moves_same_account"], figures["moves_other_account"]), (3, 0))

    async def test_failover_other_account(self) -> None:
        """The only other key is another account's: the session goes on, the upstream's drop of
        the first account's thinking is reported to the client and the moves are counted."""
        figures = await self.session(failover="other-account")
        self.assertSessionWhole(figures)
        self.assertEqual(dict(figures["strict_keys"]), {"acme-1": 3, "globex-1": 3})
        # The three blocks made under acme, dropped at each of the three turns under globex.
        self.assertEqual(figures["strict"]["thinking_dropped"], 9)
        self.assertEqual(figures["strict"]["dropped_reasons"], {"organization_binding_mismatch": 9})
        self.assertEqual((figures["moves_same_account"], figures["moves_other_account"]), (0, 3))

    async def test_bad_client_rescued(self) -> None:
        """A client edits an old tool result midway: the strict upstream's 400 is recovered with
        drop_block once (counted, dumped with its note), the session goes on, the drops are listed."""
        figures = await self.session(bad_client=True)
        self.assertSessionWhole(figures)
        self.assertEqual(figures["binding_recoveries"], 1)
        [note] = figures["dump_notes"]
        self.assertIn('"drop_block"', note)
        self.assertIn("thinking-binding-controls-2026-08-01", note)
        self.assertEqual(set(figures["strict"]["dropped_reasons"]), {"prefix_binding_mismatch"})
        # One extra request: the 400, then the same one again with drop_block.
        self.assertEqual(figures["strict"]["requests"], figures["strict"]["turns_served"] + 1)

    async def test_bad_client_without_recovery(self) -> None:
        """With --thinking-binding-recovery off the client gets the upstream's 400 at each strict
        turn after the edit; nothing is retried, every 400 is dumped without a note."""
        figures = await self.session(bad_client=True, recovery="off")
        self.assertEqual(figures["failed_turns"], 3)
        self.assertEqual(len(figures["errors"]), 3)
        for error in figures["errors"]:
            # The upstream's own words (the client sent the binding beta, so no sentence about it).
            n, m = map(int, re.search(r"\(strict\): 400 messages\.(\d+)\.content\.(\d+):", error).groups())
            self.assertEqual(error.split(": 400 ", 1)[1], prefix_mismatch_message(n, m, beta=True))
        self.assertEqual(figures["binding_recoveries"], 0)
        self.assertEqual(figures["dump_notes"], [None, None, None])
        self.assertEqual(figures["strict"]["requests"], 6)


class OwnThinkingBackTests(SynchronousTestCase):
    """The bench's check that an upstream got its own thinking back finds a block left out."""

    def test_block_left_out(self) -> None:
        def request(*signatures):
            content = [{"type": "thinking", "thinking": "", "signature": s} for s in signatures]
            return SimpleNamespace(path="/v1/messages", body={"messages": [{"role": "assistant", "content": content}]})

        upstream = SimpleNamespace(requests=[request(), request("s0"), request("s1"), request("s0", "s1", "s2")])
        done = [Turn(n, "strict", False, thinking=[("strict", "s%d" % (n,)), ("kimi", "k")], received={"strict": n + 1})
                for n in range(4)]
        self.assertEqual(own_thinking_back("strict", upstream, done), {
            "turns": 4, "turns_missing_own_thinking": 1, "own_blocks_missing": 1, "own_blocks_made": 4})
