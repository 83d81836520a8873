"""
The OpenAI wires end to end (issue 33): the relay on 127.0.0.1 in front of
the simulated Responses and Chat upstreams, a client speaking Anthropic's
API to it: what cannot be carried is a ``capability_rejected`` 400 (from a
body worker too), ``count_tokens`` on each wire, an upstream's failure
inside a stream an ``error`` event (never a normal end), OpenAI's errors in
Anthropic's envelope.
"""

from __future__ import annotations

import base64
import json

import random

import treq
import ujson
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import ResponseDone
from twisted.web.server import Site

from tests.helpers import serve_relay
from tests.test_openai_answers import CTX, Responses
from twisted_relay.config import RelayConfig, Upstream
from twisted_relay.openai.responses_answer import ResponsesStream
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.openai_chat import SimulatedOpenAIChat
from twisted_relay.simulated.openai_responses import SimulatedOpenAIResponses
from twisted_relay.sse import SSEGate
from twisted_relay.sse_events import parse_event, sse_event
from twisted_relay.translation import UNIQUE, UpstreamRules, translate_request
from twisted_relay.wires.openai_stream import OpenAIStreamToSSE, gate_events, sse_of

KEY = "sk-test-openai-wires"
MODEL = "claude-opus-4-6"
TOOLS = [{"name": "get_weather", "description": "Weather for a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
# A 1x1 PNG.
PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c4890000000d4944415478da63f8cf"
    "c0f01f0005000201a8fa2a0a0000000049454e44ae426082")).decode("ascii")


def body(**extra) -> dict:
    return dict({"model": MODEL, "max_tokens": 256, "tools": TOOLS,
                 "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}, **extra)


class WireTestCase(TestCase):
    def serve(self, simulator, wire: str, model: str, dialect: str | None = None, **settings):
        port = reactor.listenTCP(0, Site(simulator.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        upstream = Upstream("up", "http://127.0.0.1:%d/v1" % (port.getHost().port,), keys=(KEY,), wire=wire,
                            dialect=dialect, models=((MODEL, model),))
        self.served = serve_relay(self, RelayConfig(listen=(), upstreams=(upstream,), dump_dir=None, **settings),
                                  reactor)

    async def post(self, payload: dict, path: str = "/v1/messages"):
        response = await treq.post(self.served.url + path, data=json.dumps(payload).encode(),
                                   headers={"content-type": "application/json", "anthropic-version": "2023-06-01"},
                                   persistent=False)
        return response, await response.content()


class ResponsesWireTests(WireTestCase):
    def setUp(self):
        self.gpt = SimulatedOpenAIResponses(SimulatedUpstream(mode="lenient", reactor=reactor), keys={KEY: "org-a"})
        self.serve(self.gpt, "openai-responses", "gpt-5.5")

    async def test_stop_sequences_refused(self):
        """Responses has no stop parameter: refused as capability_rejected, never dropped in silence."""
        response, content = await self.post(body(stop_sequences=["END"]))
        self.assertEqual(response.code, 400, content)
        self.assertEqual(ujson.loads(content)["error"]["message"], "capability_rejected: stop_sequences")
        self.assertEqual(len(self.gpt.requests), 0)

    async def test_count_tokens_exact(self):
        """count_tokens is the upstream's own count (POST /v1/responses/input_tokens)."""
        response, content = await self.post(body(), "/v1/messages/count_tokens")
        self.assertEqual(response.code, 200, content)
        counted = ujson.loads(content)["input_tokens"]
        self.assertGreater(counted, 0)
        self.assertTrue(self.gpt.requests[-1].path.endswith("/responses/input_tokens"))

    async def test_failed_stream_is_an_error_event(self):
        """A response.failed midway is Anthropic's error event, never a normal end (sub2api PR #6923)."""
        self.gpt.break_next_stream("failed", after_events=4)
        response, content = await self.post(body(stream=True))
        self.assertEqual(response.code, 200)
        self.assertIn(b"event: error", content)
        self.assertNotIn(b"message_stop", content)

    async def test_errors_in_anthropics_envelope(self):
        self.gpt.fail_next(429, times=10)
        response, content = await self.post(body())
        self.assertEqual((response.code, ujson.loads(content)["error"]["type"]), (429, "rate_limit_error"))


class ChatWireTests(WireTestCase):
    def setUp(self):
        self.chat = SimulatedOpenAIChat("deepseek", SimulatedUpstream(mode="lenient", reactor=reactor),
                                        keys={KEY}, reactor=reactor)
        self.serve(self.chat, "openai-chat", "deepseek-v4-pro", "deepseek")

    async def test_image_to_a_backend_without_vision(self):
        """DeepSeek's Chat API takes no images: capability_rejected: image_block, before anything is sent."""
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
        payload = body(messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}])
        response, content = await self.post(payload)
        self.assertEqual(response.code, 400, content)
        self.assertEqual(ujson.loads(content)["error"]["message"], "capability_rejected: image_block")
        self.assertEqual(len(self.chat.requests), 0)

    async def test_count_tokens_estimated_never_under(self):
        """No Chat upstream counts: the relay's estimate, at least what the upstream bills as input."""
        payload = body()
        response, content = await self.post(payload, "/v1/messages/count_tokens")
        self.assertEqual(response.code, 200, content)
        estimate = ujson.loads(content)["input_tokens"]
        self.assertEqual(len(self.chat.requests), 0)
        response, content = await self.post(payload)
        self.assertEqual(response.code, 200, content)
        usage = ujson.loads(content)["usage"]
        billed = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) + usage.get(
            "cache_creation_input_tokens", 0)
        self.assertGreaterEqual(estimate, billed)


class WorkerRefusalTests(WireTestCase):
    """A large body is translated in a body worker: what it cannot carry is still the client's 400."""

    def setUp(self):
        self.chat = SimulatedOpenAIChat("deepseek", SimulatedUpstream(mode="lenient", reactor=reactor),
                                        keys={KEY}, reactor=reactor)
        self.serve(self.chat, "openai-chat", "deepseek-v4-pro", "deepseek")
        # Every body worked on in a body worker process (as tests.test_body_work does).
        self.served.relay.app.bodies.inline_cost = -1

    async def test_refused_in_a_worker(self):
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
        payload = body(messages=[{"role": "user", "content": [image, {"type": "text", "text": "x" * 2000}]}])
        response, content = await self.post(payload)
        self.assertEqual(response.code, 400, content)
        self.assertEqual(ujson.loads(content)["error"]["message"], "capability_rejected: image_block")


# -- the stream's hand-off to the gate, in memory -------------------------------------------------

_CALL_ID = "call_Weather01"
_TEXT = 'Checking "Paris" \u2014 caf\u00e9 \\ \u2028 again.'
# The history a client sends back: the upstream's call id is in it already, so the gate renames a reuse.
_REUSED = {"model": MODEL, "max_tokens": 256, "stream": True, "messages": [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": _CALL_ID, "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": _CALL_ID, "content": "18 C"}]},
]}


def _responses_stream() -> list[bytes]:
    """A Responses stream, one event a read: reasoning with a summary, text, a call whose id was used before."""
    up = Responses()
    reasoning, thought = up.reasoning(0, "rs_1", summaries=["Look it up again."])
    message, said = up.message(1, "msg_1", _TEXT, pieces=5)
    call, called = up.call(2, "fc_1", _CALL_ID, "get_weather", '{"city": "Paris"}')
    events = [up.created(), *reasoning, *message, *call, up.completed([thought, said, called])]
    return [b"event: %s\ndata: %s\n\n" % (event["type"].encode(), json.dumps(event).encode()) for event in events]


class _Events(Protocol):
    """A gate's stand-in: records what it is handed."""

    def __init__(self):
        self.received = []

    def eventsReceived(self, events):
        self.received.append(events)


class _Bytes(Protocol):
    """A protocol that reads bytes only (a whole body's reader)."""

    def __init__(self):
        self.received = []

    def dataReceived(self, data):
        self.received.append(data)


def _wire(inner):
    wire = OpenAIStreamToSSE(inner, ResponsesStream(CTX))
    wire.makeConnection(StringTransport())
    return wire


class StreamHandOffTests(SynchronousTestCase):
    """
    The wire hands the gate each read's events already parsed and
    serialised, so that it neither frames nor parses them again; the
    client gets what the same events' bytes would have given it.
    """

    def test_the_gate_is_handed_events(self):
        """
        One call a read: each event's name, its payload and its bytes
        (the payload, serialised); a protocol that reads bytes only gets
        those bytes.
        """
        reads = _responses_stream()
        events, as_bytes = _Events(), _Bytes()
        for inner in (events, as_bytes):
            wire = _wire(inner)
            for read in reads:
                wire.dataReceived(read)
        self.assertEqual(len(events.received), len(reads))
        self.assertEqual(b"".join(as_bytes.received),
                         b"".join(raw for read in events.received for _, _, raw in read))
        names = []
        for name, payload, raw in (event for read in events.received for event in read):
            self.assertEqual((name.decode(), ujson.loads(parse_event(raw)[1])), parse_event(raw)[:1] + (payload,))
            self.assertEqual(raw, sse_event(name, payload))
            names.append(name)
        self.assertEqual(names.count(b"content_block_delta"), 11)

    def test_through_the_gate_as_bytes(self):
        """
        Through the gate, in reads of one event, all at once and cut
        anywhere: the client gets what the gate makes of the same events
        as bytes, the reused call id renamed, the upstream's mark on the
        reasoning's signature; the text's quotes, backslash, U+2028 and
        non-ASCII letters as JSON writes them.
        """
        reads = _responses_stream()
        whole = b"".join(reads)
        rules = UpstreamRules(name="gpt", policy=UNIQUE, mark_thinking=True)
        expected = []
        gate = SSEGate(expected.append, translate_request(_REUSED, rules).response(), clock=Clock())
        gate.makeConnection(StringTransport())
        translator = ResponsesStream(CTX)
        gate.dataReceived(sse_of([event for read in reads for event in translator.feed(
            ujson.loads(parse_event(read)[1]))]))
        gate.connectionLost(Failure(ResponseDone()))
        expected = b"".join(expected)
        self.assertIn(b'"id":"%s-2"' % (_CALL_ID.encode(),), expected)
        said = [ujson.loads(parse_event(event + b"\n\n")[1]) for event in expected.split(b"\n\n")[:-1]]
        self.assertEqual("".join(event["delta"]["text"] for event in said
                                 if event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta"),
                         _TEXT)
        rnd = random.Random(7)
        splits = [("one event a read", reads), ("all at once", [whole])]
        for seed in range(5):
            cuts = sorted(rnd.sample(range(1, len(whole)), 12))
            splits.append(("cut, seed %d" % (seed,), [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)])]))
        for label, chunks in splits:
            written = []
            gate = SSEGate(written.append, translate_request(_REUSED, rules).response(), clock=Clock())
            wire = OpenAIStreamToSSE(gate, ResponsesStream(CTX))
            wire.makeConnection(StringTransport())
            for chunk in chunks:
                wire.dataReceived(chunk)
            wire.connectionLost(Failure(ResponseDone()))
            self.assertEqual(b"".join(written), expected, label)
            self.assertIsNone(self.successResultOf(gate.done), label)
            self.assertEqual(gate.events_rewritten, 2, label)

    @settings(max_examples=300, deadline=None)
    @given(st.text(), st.integers(min_value=0, max_value=10**6))
    def test_text_delta_as_json_writes_it(self, text, index):
        """A text delta, written from its template, is the bytes of its event serialised whole, for any text."""
        payload = {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}}
        ((name, given, raw),) = gate_events([("content_block_delta", payload)])
        self.assertEqual((name, raw), (b"content_block_delta", sse_event(b"content_block_delta", payload)))
        self.assertIs(given, payload)
        self.assertEqual(ujson.loads(parse_event(raw)[1]), payload)
