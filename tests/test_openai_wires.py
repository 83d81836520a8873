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

import treq
import ujson
from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from twisted.web.server import Site

from tests.helpers import serve_relay
from twisted_relay.config import RelayConfig, Upstream
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.openai_chat import SimulatedOpenAIChat
from twisted_relay.simulated.openai_responses import SimulatedOpenAIResponses

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
