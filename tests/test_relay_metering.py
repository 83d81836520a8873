"""
The relay's metering, in memory on the production path: one usage record
per 2xx Messages answer (whole, streamed, cut by the upstream, left by the
client), handed to the ledger and counted in the metrics; none for other
routes and refusals; relay keys known by name (logs, records, metrics),
never by value.
"""

from __future__ import annotations

import ujson
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.config import RelayConfig, RelayKey, one_upstream
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.usage import billed

from tests.helpers import UPSTREAM_URL, InMemoryRelay, RecordingLedger, messages_body
from tests.test_app import FixedAnswer, body_of, result

ALICE = RelayKey("sk-relay-alice-0001", "alice", "platform")
BOB = RelayKey("sk-relay-bob-0002", "bob")
MODEL = "claude-opus-5-5"
SYSTEM = [{"type": "text", "text": "Be brief. " * 300, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]


def _body(**extra) -> dict:
    return messages_body(model=MODEL, system=SYSTEM, metadata={"user_id": "alice"}, **extra)


class _Reader(Protocol):
    """Reads a response body as it comes."""

    def __init__(self):
        self.data = b""

    def dataReceived(self, data: bytes) -> None:
        self.data += data


class MeteringTests(SynchronousTestCase):
    """What the relay records of each answer."""

    def relay(self, upstream=None, **options) -> InMemoryRelay:
        self.clock = MemoryReactorClock()
        if upstream is None:
            upstream = SimulatedUpstream(mode="lenient", reactor=self.clock, **options)
        self.sim = upstream
        self.ledger = RecordingLedger()
        config = RelayConfig(listen=(), upstreams=one_upstream(UPSTREAM_URL, key="sk-ant-upstream"), dump_dir=None,
                             relay_keys=(ALICE, BOB))
        resource = upstream.resource() if isinstance(upstream, SimulatedUpstream) else upstream
        return InMemoryRelay(resource, config, clock=self.clock, ledger=self.ledger)

    def post(self, relay, body, key=ALICE.key, headers=None):
        all_headers = {"x-api-key": [key]}
        all_headers.update(headers or {})
        response = result(self, relay, relay.post("/v1/messages", body, headers=all_headers))
        return response, body_of(self, relay, response)

    def sample(self, relay, name: str, **labels) -> float:
        return relay.app.metrics.registry.get_sample_value(name, labels) or 0.0

    def test_whole_answer(self) -> None:
        """A whole answer: one record, its tokens those the upstream reported (the 1-hour
        cache write of the system prompt, then its read), priced, named by the key's name
        and group, with Claude Code's attribution; the same in /metrics."""
        relay = self.relay()
        headers = {"x-claude-code-session-id": ["sess-1"], "x-claude-code-parent-agent-id": ["agent-0"]}
        for _ in range(2):
            response, data = self.post(relay, _body(), headers=headers)
            self.assertEqual(response.code, 200)
        first, second = self.ledger.records
        answer = ujson.loads(data)
        self.assertEqual(second.tokens, billed(answer["usage"]))
        self.assertGreater(first.tokens["cache_creation_1h_tokens"], 500)
        self.assertEqual(second.tokens["cache_read_tokens"], first.tokens["cache_creation_1h_tokens"])
        self.assertEqual((second.key_name, second.key_group, second.model, second.upstream, second.status),
                         ("alice", "platform", MODEL, "default", 200))
        self.assertEqual((second.session_id, second.parent_agent_id, second.agent_id), ("sess-1", "agent-0", None))
        self.assertFalse(second.stream or second.partial)
        self.assertGreater(second.cost, 0)
        self.assertEqual(ujson.loads(second.usage), answer["usage"])
        labels = dict(key="alice", group="platform", model=MODEL)
        self.assertEqual(self.sample(relay, "relay_usage_tokens_total", kind="cache_read", **labels),
                         second.tokens["cache_read_tokens"])
        self.assertEqual(self.sample(relay, "relay_usage_tokens_total", kind="output", **labels),
                         first.tokens["output_tokens"] + second.tokens["output_tokens"])
        self.assertAlmostEqual(self.sample(relay, "relay_usage_cost_usd_total", **labels),
                               float(first.cost + second.cost))
        self.assertEqual(self.sample(relay, "relay_usage_answers_total", complete="true", priced="true", **labels), 2)

    def test_stream(self) -> None:
        """A streamed answer: one record, from message_start and message_delta, equal to what
        the upstream reported; the stream reaches the client unchanged."""
        relay = self.relay(server_tools=True)
        response, data = self.post(relay, _body(stream=True))
        self.assertIn(b"event: message_stop", data)
        (record,) = self.ledger.records
        (reported,) = self.sim.reported.answers
        self.assertEqual(record.tokens, billed(reported.usage))
        self.assertEqual(record.tokens["web_search_requests"], 1)
        self.assertTrue(record.stream and not record.partial)

    def test_stream_ending_in_an_error(self) -> None:
        """An upstream error event: a partial record of what message_start reported."""
        relay = self.relay(stream_errors=1.0)
        self.post(relay, _body(stream=True))
        (record,) = self.ledger.records
        (reported,) = self.sim.reported.answers
        self.assertTrue(record.partial)
        self.assertEqual(record.status, 200)
        self.assertEqual(record.tokens, billed(reported.usage))
        self.assertEqual(record.tokens["output_tokens"], 1)

    def test_stream_cut_by_the_upstream(self) -> None:
        """A dropped upstream connection: a partial record of what was reported before it."""
        relay = self.relay(stream_cuts=1.0)
        response, data = self.post(relay, _body(stream=True))
        self.assertIn(b"event: error", data)
        (record,) = self.ledger.records
        (reported,) = self.sim.reported.answers
        self.assertFalse(reported.whole)
        self.assertTrue(record.partial)
        self.assertEqual(record.tokens, billed(reported.usage))
        self.assertGreater(record.tokens["input_tokens"], 0)

    def test_client_leaves(self) -> None:
        """The client leaving mid-stream: a partial record, status 499, of what was reported."""
        relay = self.relay(event_delay=0.01)
        response = result(self, relay, relay.raw_post(
            "/v1/messages", _body(stream=True), headers={b"x-api-key": [ALICE.key.encode()]}))
        reader = _Reader()
        response.deliverBody(reader)
        for _ in range(30):
            self.clock.advance(0.01)
            relay.flush()
            if b"content_block_delta" in reader.data:
                break
        self.assertNotIn(b"message_delta", reader.data)
        reader.transport.stopProducing()
        relay.flush()
        for _ in range(10):
            self.clock.advance(0.05)
            relay.flush()
        (record,) = self.ledger.records
        (reported,) = self.sim.reported.answers
        self.assertEqual((record.status, record.partial, record.stream), (499, True, True))
        self.assertEqual(record.tokens, billed(reported.usage))

    def test_no_record_without_a_2xx_answer(self) -> None:
        """A refused key, an upstream's 4xx, count_tokens and the model list make no record."""
        relay = self.relay(upstream=SimulatedUpstream(mode="strict", reactor=MemoryReactorClock()))
        response, _ = self.post(relay, _body(), key="sk-wrong")
        self.assertEqual(response.code, 401)
        response, _ = self.post(relay, dict(_body(), max_tokens=0))
        self.assertEqual(response.code, 400)
        count = result(self, relay, relay.post("/v1/messages/count_tokens", _body(),
                                               headers={"x-api-key": [BOB.key]}))
        self.assertEqual(count.code, 200)
        models = result(self, relay, relay.get("/v1/models", headers={"x-api-key": [BOB.key]}))
        self.assertEqual(models.code, 200)
        self.assertEqual(self.ledger.records, [])

    def test_answer_without_usage(self) -> None:
        """A 2xx answer that is not JSON: one partial record of no tokens, under the model asked."""
        relay = self.relay(upstream=FixedAnswer(200, b"not json", [(b"content-type", b"text/plain")]))
        self.post(relay, _body(), key=BOB.key)
        (record,) = self.ledger.records
        self.assertEqual((record.key_name, record.key_group, record.model, record.partial), ("bob", None, MODEL, True))
        self.assertEqual(sum(record.tokens.values()), 0)

    def test_odd_model_names(self) -> None:
        """A model name no UTF-8 text can hold (a lone surrogate), one PostgreSQL refuses
        (a NUL) or of a megabyte: the record, its label and its log line hold it escaped
        and bounded; no error is logged."""
        relay = self.relay()
        for model in (b"claude-\\ud800", b"claude-\\u0000", b"m" * 1_000_000):
            raw = b'{"model": "%s", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}' % (model,)
            response = result(self, relay, relay.post("/v1/messages", raw, headers={"x-api-key": [ALICE.key]}))
            self.assertEqual(response.code, 200)
            body_of(self, relay, response)
        odd, nul, long = self.ledger.records
        self.assertEqual(odd.model, "claude-\\ud800")
        self.assertEqual(nul.model, "claude-\\x00")
        self.assertLess(len(long.model), 250)
        for record in (odd, nul, long):
            record.model.encode("utf-8")
            record.usage.encode("ascii")

    def test_names_never_keys(self) -> None:
        """The request's log line names the key by its name; no key is in the log, the
        record or the metrics."""
        relay = self.relay()
        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        self.post(relay, _body())
        # A key in an attribution header, across the point where its value is cut.
        self.post(relay, _body(), headers={"x-claude-code-session-id": ["s" * 190 + ALICE.key]})
        lines = [event for event in events if event.get("relay_request_id") and "duration_ms" in event]
        self.assertEqual([line["relay_key"] for line in lines], ["alice", "alice"])
        self.assertTrue(self.ledger.records[1].session_id.startswith("s" * 190))
        from prometheus_client import generate_latest

        exposed = generate_latest(relay.app.metrics.registry).decode()
        self.assertIn('key="alice"', exposed)
        for text in (repr(events), exposed, repr(self.ledger.records), ALICE.__repr__()):
            self.assertNotIn(ALICE.key[:10], text)
