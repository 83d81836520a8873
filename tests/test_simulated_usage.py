"""
The usage the simulated upstream reports (:mod:`twisted_relay.simulated.usage`):
every field of today's API, in whole answers and streams, consistent with
each other; its prompt cache; streams it cuts; and the tally of what it
reported, which tests compare a relay's metering with.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.test_simulated import TOOLS, _Upstream, parse_sse
from twisted_relay.simulated.cli import parse_args, upstream_from
from twisted_relay.simulated.usage import MIN_CACHEABLE_TOKENS, Prompt, PromptCache, billed

FABLE = "claude-fable-5-2"
LONG = "Read the forecast with care. " * 120  # over 512 tokens
FALLBACK_BETA = {"anthropic-beta": "server-side-fallback-2026-07-01"}


def _body(model: str = FABLE, ttl: str | None = "1h", **extra: Any) -> dict:
    system: dict = {"type": "text", "text": LONG}
    if ttl is not None:
        system["cache_control"] = {"type": "ephemeral", "ttl": ttl} if ttl == "1h" else {"type": "ephemeral"}
    body = {"model": model, "max_tokens": 256, "system": [system], "tools": TOOLS,
            "messages": [{"role": "user", "content": "Weather, please."}]}
    body.update(extra)
    return body


def _streamed_usage(events: list) -> dict:
    """A stream's usage as the SDKs gather it: message_start's, message_delta's laid over."""
    usage = dict(events[0][1]["message"]["usage"])
    for name, payload in events:
        if name == "message_delta":
            usage.update(payload["usage"])
    return usage


def _top(usage: dict, name: str) -> int:
    return sum(entry[name] for entry in usage["iterations"] if entry["type"] != "compaction")


class PromptCacheTests(SynchronousTestCase):
    """The prompt cache, on its own."""

    def read(self, cache: PromptCache, body: dict, now: float = 0.0, **where: str) -> Prompt:
        where = {"account": "acme", "model": FABLE, **where}
        return cache.read(body, total=5000, now=now, **where)

    def test_write_then_read(self) -> None:
        """A breakpoint's prefix is written with its lifetime, then read by the next request;
        what follows the last breakpoint is plain input."""
        cache = PromptCache()
        first = self.read(cache, _body())
        self.assertGreater(first.cache_write_1h, MIN_CACHEABLE_TOKENS)
        self.assertEqual((first.cache_read, first.cache_write_5m), (0, 0))
        self.assertEqual(first.input_tokens + first.cache_write_1h, 5000)
        second = self.read(cache, _body(), now=10)
        self.assertEqual((second.cache_read, second.cache_write_1h, second.input_tokens),
                         (first.cache_write_1h, 0, first.input_tokens))

    def test_moving_breakpoint(self) -> None:
        """A longer conversation with its breakpoint further on reads what was cached and
        writes the rest up to its breakpoint (5-minute)."""
        cache = PromptCache()
        body = _body(messages=[{"role": "user", "content": [
            {"type": "text", "text": LONG, "cache_control": {"type": "ephemeral"}}]}])
        first = self.read(cache, body)
        self.assertGreater(first.cache_write_5m, 0)
        later = dict(body, messages=[
            {"role": "user", "content": [{"type": "text", "text": LONG}]},
            {"role": "assistant", "content": [{"type": "text", "text": LONG}]},
            {"role": "user", "content": [{"type": "text", "text": LONG, "cache_control": {"type": "ephemeral"}}]},
        ])
        second = self.read(cache, later, now=1)
        self.assertEqual(second.cache_read, first.cache_write_1h + first.cache_write_5m)
        self.assertGreater(second.cache_write_5m, 0)

    def test_isolation_lifetime_and_minimum(self) -> None:
        """Each account and model has its own cache; a 5-minute entry is gone after 300 s
        (renewed by a read); a prefix under the minimum is not cached."""
        cache = PromptCache()
        self.read(cache, _body(ttl="5m"))
        self.assertEqual(self.read(cache, _body(ttl="5m"), account="other").cache_read, 0)
        self.assertEqual(self.read(cache, _body(ttl="5m"), model="claude-opus-5-5").cache_read, 0)
        self.assertGreater(self.read(cache, _body(ttl="5m"), now=299).cache_read, 0)
        self.assertGreater(self.read(cache, _body(ttl="5m"), now=598).cache_read, 0)
        self.assertEqual(self.read(cache, _body(ttl="5m"), now=899).cache_read, 0)
        short = dict(_body(), system=[{"type": "text", "text": "Short.", "cache_control": {"type": "ephemeral"}}])
        self.assertEqual(self.read(cache, short), Prompt(5000))
        self.assertEqual(self.read(cache, _body(ttl=None)), Prompt(5000))


class AnswerUsageTests(SynchronousTestCase):
    """Every field today's API reports, consistent."""

    def test_whole_answer(self) -> None:
        """The top level is the sum of the samplings; the cache writes split; thinking tokens
        part of the output; server tool requests as the answer used them (a web fetch only
        when the request offers it); tier and geography."""
        up = _Upstream(mode="lenient", server_tools=True)
        _, first = up.post(_body())
        _, again = up.post(_body())
        _, fetching = _Upstream(mode="lenient", server_tools=True).post(
            _body(tools=TOOLS + [{"type": "web_fetch_20250910", "name": "web_fetch"}]))
        usage = first["usage"]
        (entry,) = usage["iterations"]
        self.assertEqual(entry["type"], "message")
        for name in ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
            self.assertEqual(usage[name], entry[name], name)
        self.assertEqual(usage["cache_creation"]["ephemeral_1h_input_tokens"], usage["cache_creation_input_tokens"])
        self.assertGreater(usage["cache_creation_input_tokens"], 0)
        self.assertLess(usage["output_tokens_details"]["thinking_tokens"], usage["output_tokens"])
        self.assertEqual(usage["server_tool_use"], {"web_search_requests": 1, "web_fetch_requests": 0})
        self.assertEqual((usage["service_tier"], usage["inference_geo"]), ("standard", "global"))
        self.assertNotIn("speed", usage)
        self.assertEqual(fetching["usage"]["server_tool_use"], {"web_search_requests": 1, "web_fetch_requests": 1})
        self.assertEqual(again["usage"]["cache_read_input_tokens"], usage["cache_creation_input_tokens"])

    def test_speed_and_geography(self) -> None:
        """``speed: fast`` runs fast where the model has fast mode, at standard speed elsewhere;
        ``inference_geo`` is where it ran; other values are refused."""
        up = _Upstream(mode="lenient")
        _, fast = up.post(_body(speed="fast", inference_geo="us"))
        self.assertEqual((fast["usage"]["speed"], fast["usage"]["inference_geo"]), ("fast", "us"))
        _, standard = up.post(_body("claude-sonnet-5-5", speed="fast"))
        self.assertEqual(standard["usage"]["speed"], "standard")
        for extra, message in (({"speed": "ludicrous"}, "speed: Input should be"),
                               ({"inference_geo": "mars"}, "inference_geo: Input should be")):
            response, error = up.post(_body(**extra))
            self.assertEqual(response.code, 400)
            self.assertIn(message, error["error"]["message"])

    def test_fallback_and_compaction(self) -> None:
        """A refusal served by a fallback: the declined attempt (its model, one output token)
        and the fallback's answer, summed at the top; a compaction: its sampling outside
        the top level."""
        up = _Upstream(mode="lenient", refusals=1.0)
        _, answer = up.post(_body("claude-sonnet-5-5", fallbacks="default"), headers=FALLBACK_BETA)
        usage = answer["usage"]
        declined, served = usage["iterations"]
        self.assertEqual((declined["type"], declined["model"], declined["output_tokens"]),
                         ("message", "claude-sonnet-5-5", 1))
        self.assertEqual((served["type"], served["model"]), ("fallback_message", answer["model"]))
        for name in ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
            self.assertEqual(usage[name], declined[name] + served[name], name)
        up = _Upstream(mode="lenient", compactions=1.0)
        _, answer = up.post(_body())
        usage = answer["usage"]
        self.assertEqual([entry["type"] for entry in usage["iterations"]], ["compaction", "message"])
        self.assertEqual(usage["input_tokens"], _top(usage, "input_tokens"))
        self.assertGreater(usage["iterations"][0]["input_tokens"], usage["input_tokens"])

    def test_stream_reports_as_the_api(self) -> None:
        """message_start reports the input side (the cache split, tier, geography, one output
        token); the message_delta the cumulative counts and iterations; laid over each other,
        the whole answer's usage."""
        up = _Upstream(mode="lenient", server_tools=True)
        _, data = up.post(_body(stream=True))
        events = parse_sse(data)
        start = events[0][1]["message"]["usage"]
        (delta,) = [payload["usage"] for name, payload in events if name == "message_delta"]
        self.assertEqual(start["output_tokens"], 1)
        self.assertIn("cache_creation", start)
        self.assertNotIn("iterations", start)
        self.assertNotIn("cache_creation", delta)
        self.assertIn("iterations", delta)
        _, whole = up.post(_body())
        # The second request reads the prefix the first wrote: compare with a fresh upstream.
        _, fresh = _Upstream(mode="lenient", server_tools=True).post(_body())
        self.assertEqual(_streamed_usage(events), fresh["usage"])
        self.assertNotEqual(whole["usage"], fresh["usage"])


class StreamCutTests(SynchronousTestCase):
    """``stream_cuts``: the connection drops midway."""

    def test_cut(self) -> None:
        """Every stream cut: the body stops after message_start, before message_stop, at a
        byte drawn from the answer's content (the same each time)."""
        cuts = []
        for _ in range(2):
            up = _Upstream(mode="lenient", stream_cuts=1.0, reuse_every=0)
            plan = up.sim.stream_plan(up.sim.answer(_body(), {}), drop=True)
            data = b"".join(piece for _, piece in plan.pieces)
            self.assertTrue(plan.drop)
            self.assertFalse(plan.whole)
            self.assertTrue(data.startswith(b"event: message_start"))
            self.assertIn(b"\n\n", data)
            self.assertNotIn(b"message_stop", data)
            cuts.append(len(data))
        self.assertEqual(cuts[0], cuts[1])

    def test_share(self) -> None:
        """With a share of 0.5, some streams are cut and some are not; the cut ones never reach
        message_stop over the wire, and the tally counts only what was sent."""
        up = _Upstream(mode="lenient", stream_cuts=0.5, reuse_every=0)
        outcomes = set()
        for n in range(12):
            body = _body(messages=[{"role": "user", "content": "City %d." % (n,)}], stream=True)
            try:
                _, data = up.post(body)
            except Exception:
                outcomes.add("dropped")
                continue
            outcomes.add("whole" if b"message_stop" in data else "short")
        self.assertEqual(outcomes, {"dropped", "whole"})
        answers = list(up.sim.reported.answers)
        self.assertEqual(len(answers), 12)
        self.assertTrue(any(not answer.whole for answer in answers))
        for answer in answers:
            if not answer.whole and "iterations" not in answer.usage:
                self.assertEqual(answer.usage["output_tokens"], 1)

    def test_command_line(self) -> None:
        """``--stream-cuts SHARE``."""
        upstream = upstream_from(parse_args(["--stream-cuts", "0.25"]))
        self.assertEqual(upstream.stream_cuts, 0.25)


class TallyTests(SynchronousTestCase):
    """What the upstream reported, in total by user and model."""

    def test_totals(self) -> None:
        """Whole answers and streams, by ``metadata.user_id`` and model, by the rule of the bill."""
        up = _Upstream(mode="lenient", server_tools=True)
        _, one = up.post(_body(metadata={"user_id": "alice"}))
        _, two = up.post(_body(metadata={"user_id": "alice"}, stream=True))
        _, three = up.post(_body("claude-opus-5-5"))
        totals = up.sim.reported.totals()
        self.assertEqual(set(totals), {("alice", FABLE), (None, "claude-opus-5-5")})
        streamed = _streamed_usage(parse_sse(two))
        self.assertEqual(totals[("alice", FABLE)], {
            kind: billed(one["usage"])[kind] + billed(streamed)[kind] for kind in billed(one["usage"])})
        self.assertEqual(totals[(None, "claude-opus-5-5")], billed(three["usage"]))
        self.assertEqual(totals[("alice", FABLE)]["web_search_requests"], 2)

    def test_billed(self) -> None:
        """Iterations when reported (a compaction's counts included), else the top level; the
        1-hour writes as split, the rest 5-minute."""
        usage = {"input_tokens": 5, "output_tokens": 1, "cache_creation_input_tokens": 10,
                 "cache_creation": {"ephemeral_1h_input_tokens": 4}}
        self.assertEqual(billed(usage), {
            "input_tokens": 5, "output_tokens": 1, "cache_creation_5m_tokens": 6, "cache_creation_1h_tokens": 4,
            "cache_read_tokens": 0, "web_search_requests": 0, "web_fetch_requests": 0})
        usage["iterations"] = [{"type": "compaction", "input_tokens": 100, "output_tokens": 7}, dict(usage)]
        self.assertEqual(billed(usage)["input_tokens"], 105)
