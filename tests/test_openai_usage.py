"""
Issue 33, "Done when": usage in the ledger equals the upstream's reported
usage under the mapping, for every answer.

Sessions through the relay (the official Anthropic SDK, whole and streamed
turns alternating, :func:`bench.openai_session.session`) against the
simulated Responses upstream and Chat Completions dialects that report
cache reads (OpenAI's own, which reports cache writes too; DeepSeek's, with
its ``prompt_cache_hit_tokens``; Kimi's, with its ``cached_tokens`` beside
the counts), the relay's usage records kept by a :class:`RecordingLedger`.
Each record is joined, through the answer's ``x-relay-request-id`` and its
message id, to the answer the simulator sent, and its token counts are
compared with that answer's raw OpenAI usage under the documented rule
(docs/openai.md, "Usage"):

- Anthropic input = OpenAI input - cached - cache writes;
- cache read = cached; cache write = cache writes (where reported);
- output = OpenAI output, reasoning included.

The rule is written here from OpenAI's fields, not taken from the relay's
translation nor from the simulators' own conversion: a relay that left the
cached tokens in the input (litellm #28354), reported reads as 0, or added
the reasoning to the output a second time fails here.
"""

from __future__ import annotations

import os
import time

from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from bench.openai_session import OpenAIUpstreams, session
from tests.helpers import RecordingLedger, serve_relay
from twisted_relay.settings import read_settings

TURNS = 40


def expected_usage(usage: dict) -> dict:
    """OpenAI's usage (Responses' or Chat's) under the documented rule, in the ledger's kinds."""
    if "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details") or {}
        input_total, output = usage["prompt_tokens"], usage["completion_tokens"]
    else:
        details = usage["input_tokens_details"]
        input_total, output = usage["input_tokens"], usage["output_tokens"]
    cached = details.get("cached_tokens") or usage.get("prompt_cache_hit_tokens") or usage.get("cached_tokens") or 0
    written = details.get("cache_write_tokens") or 0
    return {"input_tokens": input_total - cached - written, "output_tokens": output,
            "cache_read_tokens": cached, "cache_write_tokens": written}


def reasoning_tokens(usage: dict) -> int:
    """The reasoning tokens OpenAI's usage reports (inside its output count)."""
    details = usage.get("output_tokens_details") or usage.get("completion_tokens_details") or {}
    return details.get("reasoning_tokens") or 0


def _message_id(upstream_id: str) -> str:
    """The message id the client sees for the upstream's answer ``upstream_id`` (its prefix swapped)."""
    for prefix in ("resp_", "chatcmpl-"):
        if upstream_id.startswith(prefix):
            return "msg_" + upstream_id[len(prefix):]
    return "msg_" + upstream_id


class UsageInTheLedgerTests(TestCase):
    timeout = 60

    async def session(self, upstream: str) -> list[tuple[dict, dict, bool]]:
        """
        Run :data:`TURNS` turns against ``upstream``; every answer as
        ``(what the ledger holds, the rule applied to what the upstream
        reported, streamed)``, after checking that each answer has one record
        and that the upstream reasoned (its tokens are in the output).
        """
        upstreams = OpenAIUpstreams(reactor, upstream, keep=TURNS * 2)
        self.addCleanup(upstreams.stop)
        folder = self.mktemp()
        os.makedirs(folder)
        ledger = RecordingLedger()
        served = serve_relay(self, read_settings({}, upstreams.config(folder)).with_changes(drain_delay=0.0), reactor, ledger=ledger)
        done = await deferToThread(session, served.url, TURNS, time.monotonic() + 45, upstreams.models)
        self.assertEqual([turn.error for turn in done if turn.error], [])
        self.assertEqual(len(done), TURNS)
        # The answers' usage records are made in batches: now.
        served.relay.app.batch.run()
        if upstream == "responses":
            reported = {response["id"]: response["usage"] for response in upstreams.simulators["responses"].responses}
        else:
            reported = {answer.completion["id"]: answer.usage for answer in upstreams.simulators["chat"].answers}
        by_message = {_message_id(answer_id): usage for answer_id, usage in reported.items()}
        by_request = {turn.request_id: turn for turn in done}
        self.assertEqual(len(reported), TURNS)
        self.assertGreater(sum(1 for usage in reported.values() if reasoning_tokens(usage)), TURNS // 2)
        self.assertEqual(sorted(record.request_id for record in ledger.records), sorted(by_request))
        compared = []
        for record in ledger.records:
            turn = by_request[record.request_id]
            self.assertEqual((record.status, record.partial, record.stream), (200, False, turn.streamed))
            tokens = record.tokens
            metered = {"input_tokens": tokens["input_tokens"], "output_tokens": tokens["output_tokens"],
                       "cache_read_tokens": tokens["cache_read_tokens"],
                       "cache_write_tokens": tokens["cache_creation_5m_tokens"] + tokens["cache_creation_1h_tokens"]}
            compared.append((metered, expected_usage(by_message[turn.message_id]), turn.streamed))
        return compared

    def assertUsageMapped(self, compared: list, writes: bool) -> None:
        """Every answer's record equals the rule; the session read the cache (else the check proves nothing)."""
        for number, (metered, expected, streamed) in enumerate(compared):
            self.assertEqual(metered, expected, "answer %d (%s)" % (number, "streamed" if streamed else "whole"))
        self.assertEqual({streamed for _, _, streamed in compared}, {True, False})
        self.assertGreater(sum(1 for _, expected, _ in compared if expected["cache_read_tokens"]), TURNS // 2)
        self.assertEqual(any(expected["cache_write_tokens"] for _, expected, _ in compared), writes)

    async def test_responses(self):
        """GPT on the Responses API: cached and written tokens out of the input, reasoning in the output."""
        compared = await self.session("responses")
        self.assertUsageMapped(compared, writes=True)

    async def test_openai_chat(self):
        """OpenAI's Chat Completions: ``prompt_tokens_details`` with cache reads and writes."""
        self.assertUsageMapped(await self.session("openai"), writes=True)

    async def test_deepseek(self):
        """DeepSeek: cache hits reported (``prompt_cache_hit_tokens``), writes not (plain input)."""
        self.assertUsageMapped(await self.session("deepseek"), writes=False)

    async def test_kimi(self):
        """Kimi: ``cached_tokens`` beside the counts."""
        self.assertUsageMapped(await self.session("kimi"), writes=False)
