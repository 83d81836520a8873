"""
Metering, read from what the upstream reports (:mod:`twisted_relay.metering`):
the rules on hand-written usage objects, then the real bytes of recorded
answers, streamed through the SSE gate at every split or read whole.
"""

from __future__ import annotations

import json
import os
from decimal import Decimal

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone

from twisted_relay.config import RelayKey
from twisted_relay.metering import AnswerMeter, counted, parts_of, tokens_of
from twisted_relay.prices import DEFAULT_PRICES
from twisted_relay.sse import SSEGate
from twisted_relay.usage import TOKEN_KINDS

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def _tokens(**counts: int) -> dict[str, int]:
    return dict(dict.fromkeys(TOKEN_KINDS, 0), **counts)


class CountingRuleTests(SynchronousTestCase):
    """What one usage object counts."""

    def test_cache_writes_split_by_lifetime(self) -> None:
        """1-hour writes are the split's; the rest of ``cache_creation_input_tokens`` are
        5-minute ones, a write without a split included."""
        usage = {"input_tokens": 10, "output_tokens": 5, "cache_creation_input_tokens": 700,
                 "cache_read_input_tokens": 40,
                 "cache_creation": {"ephemeral_5m_input_tokens": 200, "ephemeral_1h_input_tokens": 500}}
        self.assertEqual(counted(usage), {"input_tokens": 10, "output_tokens": 5, "cache_creation_5m_tokens": 200,
                                          "cache_creation_1h_tokens": 500, "cache_read_tokens": 40})
        unsplit = dict(usage)
        del unsplit["cache_creation"]
        self.assertEqual(counted(unsplit)["cache_creation_5m_tokens"], 700)
        # A total reported later (a message_delta) with the split of message_start.
        self.assertEqual(counted(dict(usage, cache_creation_input_tokens=900))["cache_creation_5m_tokens"], 400)
        # The split alone.
        only_split = {"cache_creation": usage["cache_creation"]}
        self.assertEqual(counted(only_split)["cache_creation_5m_tokens"], 200)

    def test_odd_values_count_nothing(self) -> None:
        """Counts that are not whole numbers zero or more (null, text, negative, true) are 0."""
        usage = {"input_tokens": None, "output_tokens": "12", "cache_read_input_tokens": -3,
                 "cache_creation_input_tokens": True, "cache_creation": "x"}
        self.assertEqual(counted(usage), dict.fromkeys(counted({}), 0))

    def test_a_count_past_any_answer_is_bounded(self) -> None:
        """A count no answer can reach is taken as 2**32: costs and the ledger's 64-bit columns stay in range."""
        self.assertEqual(counted({"input_tokens": 2**70, "output_tokens": 7})["input_tokens"], 2**32)
        self.assertEqual(counted({"output_tokens": 2**32 - 1})["output_tokens"], 2**32 - 1)

    def test_iterations_are_the_bill(self) -> None:
        """With ``iterations``, the tokens are theirs (a compaction's, outside the top level,
        included), each at its own model; server tools come from the top level."""
        usage = {
            "input_tokens": 100, "output_tokens": 50,
            "server_tool_use": {"web_search_requests": 2, "web_fetch_requests": 1},
            "iterations": [
                {"type": "compaction", "input_tokens": 900, "output_tokens": 30},
                {"type": "message", "model": "claude-fable-5-2", "input_tokens": 40, "output_tokens": 1},
                {"type": "fallback_message", "model": "claude-sonnet-5", "input_tokens": 60, "output_tokens": 49},
            ],
        }
        parts = parts_of(usage, "claude-sonnet-5")
        self.assertEqual([model for model, _ in parts], ["claude-sonnet-5", "claude-fable-5-2", "claude-sonnet-5"])
        self.assertEqual(tokens_of(usage, parts), _tokens(input_tokens=1000, output_tokens=80,
                                                          web_search_requests=2, web_fetch_requests=1))
        # Without them, the top level.
        del usage["iterations"]
        self.assertEqual(tokens_of(usage, parts_of(usage, "m")), _tokens(input_tokens=100, output_tokens=50,
                                                                        web_search_requests=2, web_fetch_requests=1))


class AnswerMeterTests(SynchronousTestCase):
    """One answer's record."""

    def record(self, meter: AnswerMeter, **changes):
        values = dict(at=1.5, request_id="rly_1", relay_key=RelayKey("sk-x", "alice", "platform"),
                      attribution={"x-claude-code-session-id": "s1", "x-claude-code-agent-id": "a1"},
                      upstream="default", status=200, stream=True, partial=False)
        values.update(changes)
        return meter.record(**values)

    def test_stream_counts_laid_over(self) -> None:
        """message_delta's cumulative counts replace message_start's, field by field; the last wins."""
        meter = AnswerMeter(DEFAULT_PRICES, "claude-opus-5-5")
        meter.message_start({"message": {"model": "claude-opus-5-5-20261101", "usage": {
            "input_tokens": 10, "output_tokens": 1, "cache_read_input_tokens": 1000,
            "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 2000},
            "cache_creation_input_tokens": 2000, "inference_geo": "us"}}})
        self.assertFalse(meter.final)
        meter.message_delta({"usage": {"output_tokens": 30}})
        meter.message_delta({"usage": {"output_tokens": 40, "input_tokens": 12}})
        self.assertTrue(meter.final)
        record = self.record(meter)
        self.assertEqual(record.model, "claude-opus-5-5-20261101")
        self.assertEqual(record.tokens, _tokens(input_tokens=12, output_tokens=40, cache_creation_1h_tokens=2000,
                                                cache_read_tokens=1000))
        # Opus 5.5 (the dated id takes its price), US-only inference: 1.1x.
        rates = 12 * Decimal(4) + 40 * Decimal(20) + 2000 * Decimal(8) + 1000 * Decimal("0.20")
        self.assertEqual(record.cost, Decimal("1.1") * rates / 1_000_000)
        self.assertEqual((record.key_name, record.key_group, record.session_id, record.agent_id,
                          record.parent_agent_id), ("alice", "platform", "s1", "a1", None))
        self.assertEqual(json.loads(record.usage)["output_tokens"], 40)

    def test_nulls_in_a_delta_leave_the_counts_before(self) -> None:
        """A message_delta's null fields (a proxy built on the SDK's types sends them all) are
        "not reported here", as the SDKs read them: message_start's counts stand."""
        meter = AnswerMeter(DEFAULT_PRICES, "claude-opus-5-5")
        meter.message_start({"message": {"model": "claude-opus-5-5", "usage": {
            "input_tokens": 1200, "output_tokens": 1, "cache_read_input_tokens": 50000,
            "cache_creation_input_tokens": 8000,
            "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 8000},
            "server_tool_use": {"web_search_requests": 2}}}})
        meter.message_delta({"usage": {
            "output_tokens": 900, "input_tokens": None, "cache_read_input_tokens": None,
            "cache_creation_input_tokens": None, "cache_creation": None, "server_tool_use": None}})
        record = self.record(meter)
        self.assertEqual(record.tokens, _tokens(input_tokens=1200, output_tokens=900, cache_creation_1h_tokens=8000,
                                                cache_read_tokens=50000, web_search_requests=2))
        # A null total beside a split: the split counts.
        split = {"cache_creation_input_tokens": None, "cache_creation": {"ephemeral_1h_input_tokens": 30}}
        self.assertEqual(counted(split)["cache_creation_1h_tokens"], 30)

    def test_unpriced_model_flagged(self) -> None:
        """A model the table does not know is metered in tokens, its cost None, never guessed."""
        meter = AnswerMeter(DEFAULT_PRICES, "claude-mythos-preview")
        meter.whole({"usage": {"input_tokens": 5, "output_tokens": 7}})
        record = self.record(meter, stream=False)
        self.assertEqual(record.model, "claude-mythos-preview")
        self.assertEqual(record.tokens, _tokens(input_tokens=5, output_tokens=7))
        self.assertIsNone(record.cost)
        self.assertFalse(record.priced)

    def test_platform(self) -> None:
        """The record names the platform that served it, which prices it: a regional Bedrock
        endpoint at 1.1x; by default, Anthropic's own at 1x."""
        usage = {"model": "claude-sonnet-4-5-20250929", "usage": {"input_tokens": 1000, "output_tokens": 100}}
        standard = (1000 * Decimal(3) + 100 * Decimal(15)) / 1_000_000
        for platform, cost in (("bedrock:us", Decimal("1.1") * standard), ("bedrock:global", standard)):
            meter = AnswerMeter(DEFAULT_PRICES, "claude-sonnet-4-5")
            meter.whole(usage)
            record = self.record(meter, platform=platform)
            self.assertEqual((record.platform, record.cost), (platform, cost))
        meter = AnswerMeter(DEFAULT_PRICES, "claude-sonnet-4-5")
        meter.whole(usage)
        record = self.record(meter)
        self.assertEqual((record.platform, record.cost), ("anthropic", standard))

    def test_platform_tier_over_the_usages(self) -> None:
        """The tier the platform set prices the answer in place of the usage's service_tier: a
        Bedrock tier with no price makes the answer unpriced, not standard."""
        meter = AnswerMeter(DEFAULT_PRICES, "claude-sonnet-4-5")
        meter.whole({"usage": {"input_tokens": 1000, "service_tier": "standard"}})
        self.assertEqual(self.record(meter, platform="bedrock:global").cost, Decimal("0.003"))
        meter = AnswerMeter(DEFAULT_PRICES, "claude-sonnet-4-5")
        meter.whole({"usage": {"input_tokens": 1000, "service_tier": "standard"}})
        self.assertIsNone(self.record(meter, platform="bedrock:global", platform_tier="bedrock:flex").cost)
        meter = AnswerMeter(DEFAULT_PRICES, "claude-sonnet-4-5")
        meter.whole({"usage": {"input_tokens": 1000, "service_tier": "priority"}})
        self.assertEqual(self.record(meter, platform="bedrock:global", platform_tier="bedrock:default").cost,
                         Decimal("0.003"))

    def test_nothing_reported(self) -> None:
        """An answer that reported nothing (a body that is not JSON, a stream cut before its
        first event) is a record of no tokens, at no cost, under the requested model."""
        meter = AnswerMeter(DEFAULT_PRICES, "claude-haiku-5-5")
        meter.whole(b"<html>not json</html>")
        record = self.record(meter, partial=True, relay_key=None)
        self.assertEqual((record.model, record.tokens, record.cost, record.usage, record.key_name),
                         ("claude-haiku-5-5", _tokens(), Decimal(0), "", None))


# -- recorded answers -----------------------------------------------------------------

#: Each recorded stream: the model, the tokens it reported, what they cost
#: (None: the model has no price; those models are retired).
RECORDED_STREAMS = {
    "recorded-sse/py_basic_response.txt": ("claude-3-opus-latest", _tokens(input_tokens=11, output_tokens=6), None),
    "recorded-sse/py_compaction_response.txt": (
        "claude-opus-4-7", _tokens(input_tokens=30, output_tokens=8), Decimal("0.00035")),
    "recorded-sse/py_fallback_credit_response.txt": (
        "claude-sonnet-4-5", _tokens(input_tokens=25, output_tokens=8), Decimal("0.000195")),
    "recorded-sse/py_fallback_response.txt": (
        "claude-opus-4-7", _tokens(input_tokens=25, output_tokens=8), Decimal("0.000325")),
    "recorded-sse/py_incomplete_partial_json_response.txt": (
        "claude-3-7-sonnet-20250219", _tokens(input_tokens=450, output_tokens=124), None),
    "recorded-sse/py_refusal_response.txt": ("claude-opus-4-7", _tokens(input_tokens=20), Decimal("0.0001")),
    "recorded-sse/py_tool_use_response.txt": (
        "claude-sonnet-4-20250514", _tokens(input_tokens=377, output_tokens=65), Decimal("0.002106")),
    "recorded-usage/py_stream-a-refusal.sse": (
        "claude-fable-5", _tokens(input_tokens=28, output_tokens=106), Decimal("0.00558")),
    # Its message_start says 612 input tokens, its message_delta 28: the last word counts.
    "recorded-usage/py_stream-a-toolrefusal.sse": (
        "claude-fable-5", _tokens(input_tokens=28, output_tokens=106), Decimal("0.00558")),
    "recorded-usage/py_stream-b-fallback.sse": (
        "claude-opus-4-8", _tokens(input_tokens=31, output_tokens=547), Decimal("0.01383")),
}


def _through_gate(data: bytes, size: int, seen: list | None = None):
    """Stream ``data`` through an SSE gate in pieces of ``size`` bytes; the meter, the bytes out, the gate.
    The names of the events read for usage go to ``seen``."""
    meter = AnswerMeter(DEFAULT_PRICES, "requested-model")
    written = []

    def usage(name: bytes, payload: dict) -> None:
        if seen is not None:
            seen.append(name)
        if name == b"message_delta":
            meter.message_delta(payload)
        else:
            meter.message_start(payload)

    gate = SSEGate(written.append, None, clock=Clock(), on_usage=usage)
    gate.makeConnection(StringTransport())
    for at in range(0, len(data), size):
        gate.dataReceived(data[at:at + size])
    gate.connectionLost(Failure(ResponseDone()))
    return meter, b"".join(written), gate


class RecordedStreamTests(SynchronousTestCase):
    """The recorded streams of the official SDKs, through the gate."""

    def test_every_recorded_stream(self) -> None:
        """Each stream, cut in pieces of every size from 1 to 64 bytes and whole: the usage
        the upstream reported, priced by the table; the bytes pass unchanged."""
        for name, (model, tokens, cost) in RECORDED_STREAMS.items():
            with open(os.path.join(FIXTURES, name), "rb") as f:
                data = f.read()
            for size in (*range(1, 65), len(data)):
                meter, written, gate = _through_gate(data, size)
                self.assertTrue(gate.done.called and gate.message_stop_seen, name)
                self.assertTrue(written.startswith(data.rstrip(b"\n")), name)
                self.assertTrue(meter.final, name)
                self.assertEqual(meter.served_model, model, name)
                self.assertEqual(meter.cost(), (tokens, cost), (name, size))

    def test_every_line_ending(self) -> None:
        """The same streams with CRLF or CR line endings: the same usage."""
        for name in ("recorded-usage/py_stream-b-fallback.sse", "recorded-sse/py_tool_use_response.txt"):
            with open(os.path.join(FIXTURES, name), "rb") as f:
                data = f.read()
            model, tokens, cost = RECORDED_STREAMS[name]
            for ending in (b"\r\n", b"\r"):
                meter, _, gate = _through_gate(data.replace(b"\n", ending) + ending * 2, 61)
                self.assertTrue(gate.message_stop_seen, (name, ending))
                self.assertEqual(meter.cost(), (tokens, cost), (name, ending))

    def test_text_that_names_the_events(self) -> None:
        """Text deltas that write out the events' names (as a model explaining SSE
        does) pass unchanged at every split, and the usage is read once."""
        with open(os.path.join(FIXTURES, "recorded-usage/py_stream-b-fallback.sse"), "rb") as f:
            data = f.read()
        model, tokens, cost = RECORDED_STREAMS["recorded-usage/py_stream-b-fallback.sse"]
        text = ('event: message_delta\\ndata: {\\"usage\\": {\\"output_tokens\\": 9}} '
                "then message_stop, message_start and an error")
        delta = ('event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                 '"delta":{"type":"text_delta","text":"%s"}}\n\n' % (text,)).encode()
        at = data.index(b"event: content_block_delta")
        data = data[:at] + delta * 3 + data[at:]
        for size in (*range(1, 40), 97, len(data)):
            seen = []
            meter, written, gate = _through_gate(data, size, seen)
            self.assertTrue(written.startswith(data.rstrip(b"\n")), size)
            self.assertEqual(seen, [b"message_start", b"message_delta"], size)
            self.assertEqual(meter.cost(), (tokens, cost), size)

    def test_today_usage_kept_whole(self) -> None:
        """Every field the upstream reported stays in the record's usage: the cache split and
        geography from message_start, thinking tokens and iterations from message_delta."""
        with open(os.path.join(FIXTURES, "recorded-usage/py_stream-a-refusal.sse"), "rb") as f:
            meter, _, _ = _through_gate(f.read(), 100)
        usage = meter.usage
        self.assertEqual(usage["cache_creation"], {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0})
        self.assertEqual((usage["service_tier"], usage["inference_geo"]), ("standard", "global"))
        self.assertEqual(usage["output_tokens_details"], {"thinking_tokens": 67})
        self.assertEqual([entry["type"] for entry in usage["iterations"]], ["message"])

    def test_cut_stream_keeps_what_was_reported(self) -> None:
        """A stream cut after message_start is metered with message_start's usage."""
        with open(os.path.join(FIXTURES, "recorded-usage/py_stream-b-fallback.sse"), "rb") as f:
            data = f.read()
        cut = data.index(b"event: message_delta")
        meter, _, gate = _through_gate(data[:cut], 50)
        self.failureResultOf(gate.done)
        self.assertFalse(meter.final)
        self.assertEqual(meter.cost()[0], _tokens(input_tokens=31, output_tokens=7))

    def test_whole_answers(self) -> None:
        """The ten whole answers of a recorded tool runner session: each one's usage, priced
        (a dated model id at its undated price)."""
        with open(os.path.join(FIXTURES, "recorded-usage/ts_ToolRunner.json"), "rb") as f:
            exchanges = json.load(f)
        rates = {"claude-opus-4-8": (Decimal(5), Decimal(25)), "claude-sonnet-4-5-20250929": (Decimal(3), Decimal(15))}
        for exchange in exchanges:
            answer = exchange["response"]
            meter = AnswerMeter(DEFAULT_PRICES, exchange["body"]["model"])
            meter.whole(json.dumps(answer).encode("utf-8"))
            tokens, cost = meter.cost()
            reported = answer["usage"]
            self.assertEqual(tokens, _tokens(input_tokens=reported["input_tokens"],
                                             output_tokens=reported["output_tokens"]))
            rate_in, rate_out = rates[answer["model"]]
            self.assertEqual(cost, (reported["input_tokens"] * rate_in + reported["output_tokens"] * rate_out)
                             / 1_000_000)
