"""
The cloud wires end to end (issue 32): the relay on 127.0.0.1 in front of
the simulated Bedrock and Vertex, logged in to as the real ones are, a
client speaking Anthropic's API to it. Each bug a peer shipped (the issue's
list) has its test here: it fails had the relay made it.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import treq
import ujson
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase
from twisted.web.server import Site

from tests.helpers import RecordingLedger, serve_relay
from twisted_relay import body_pool
from twisted_relay.config import LoginSpec, RelayConfig, Upstream
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.bedrock import SimulatedBedrock
from twisted_relay.simulated.bedrock_auth import AwsCredential
from twisted_relay.simulated.google_tokens import SimulatedGoogleTokens, make_service_account
from twisted_relay.simulated.vertex import SimulatedVertex

try:
    import anthropic
except ImportError:  # pragma: no cover - the test extra installs it
    anthropic = None

KEY_ID, SECRET, TOKEN = "ASIATESTWIRESKEY0001", "test/wires/secret/0001", "test-wires-session-0001"
KEY_ID_2, SECRET_2, TOKEN_2 = "ASIATESTWIRESKEY0002", "test/wires/secret/0002", "test-wires-session-0002"
VARIABLES = ("TEST_WIRES_AWS_KEY_ID", "TEST_WIRES_AWS_SECRET", "TEST_WIRES_AWS_TOKEN")
ARN = "arn:aws:bedrock:us-east-1:123456789012:application-inference-profile/wires01"
MODELS = (
    ("claude-opus-4-6", "global.anthropic.claude-opus-4-6-v1"),
    ("claude-haiku-4-5", "us.anthropic.claude-haiku-4-5-20251001-v1:0"),
    ("claude-sonnet-4-5", ARN),
)
TOOLS = [{"name": "get_weather", "description": "Weather for a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def body(model: str = "claude-opus-4-6", **extra) -> dict:
    return dict({"model": model, "max_tokens": 256, "tools": TOOLS,
                 "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}, **extra)


def set_environment(testcase, values: dict) -> None:
    """Set environment variables for one test."""
    for name, value in values.items():
        former = os.environ.get(name)
        os.environ[name] = value
        testcase.addCleanup(lambda n=name, f=former: os.environ.pop(n, None) if f is None else os.environ.update({n: f}))


class BedrockWireTests(TestCase):
    """The relay in front of the simulated Bedrock, signing with SigV4."""

    def setUp(self):
        set_environment(self, dict(zip(VARIABLES, (KEY_ID, SECRET, TOKEN))))
        self.model = SimulatedUpstream(reactor=reactor, mode="strict", thinking_secret="wires-bedrock")
        self.bedrock = SimulatedBedrock(self.model, access_keys={
            KEY_ID: AwsCredential(SECRET, session_token=TOKEN),
            KEY_ID_2: AwsCredential(SECRET_2, session_token=TOKEN_2),
        }, application_profiles={ARN: "us.anthropic.claude-sonnet-4-5-20250929-v1:0"})
        port = reactor.listenTCP(0, Site(self.bedrock.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.dumps = self.mktemp()
        upstream = Upstream(
            "bedrock", "http://127.0.0.1:%d" % (port.getHost().port,), wire="bedrock", region="us-east-1",
            login=LoginSpec("aws", (("access-key-id", "env:" + VARIABLES[0]), ("secret-access-key", "env:" + VARIABLES[1]),
                                    ("session-token", "env:" + VARIABLES[2]))),
            models=MODELS,
        )
        self.ledger = RecordingLedger()
        self.served = serve_relay(self, RelayConfig(listen=(), upstreams=(upstream,), dump_dir=self.dumps,
                                                    ping_interval=1.0), reactor, ledger=self.ledger)

    async def post(self, payload: dict, path: str = "/v1/messages", headers: dict | None = None):
        response = await treq.post(self.served.url + path, data=json.dumps(payload).encode(),
                                   headers=dict({"content-type": "application/json",
                                                 "anthropic-version": "2023-06-01"}, **(headers or {})),
                                   persistent=False)
        content = await response.content()
        # The answers' usage records are made in batches: now.
        self.served.relay.app.batch.run()
        return response, content

    async def test_answer_and_what_bedrock_got(self):
        """InvokeModel, signed, the model in the path, no model or stream in the body, the betas in it."""
        response, content = await self.post(body(), headers={"anthropic-beta": "context-1m-2025-08-07"})
        self.assertEqual(response.code, 200, content)
        answer = ujson.loads(content)
        self.assertTrue(answer["id"].startswith("msg_bdrk_"))
        got = self.bedrock.requests[-1]
        self.assertEqual(got.path, "/model/global.anthropic.claude-opus-4-6-v1/invoke")
        self.assertTrue(got.headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=%s/" % (KEY_ID,)))
        self.assertNotIn("model", got.body)
        self.assertEqual(got.body["anthropic_beta"], ["context-1m-2025-08-07"])
        self.assertEqual(self.ledger.records[-1].upstream, "bedrock")

    async def test_large_body_signed_with_its_hash_made_off_the_reactor(self):
        """
        A body of 200 KB (its SHA-256 made on a thread, beside the body's
        work, not by the signature on the reactor) is signed right: the
        simulated Bedrock, re-signing with botocore, takes it, streamed or not.
        """
        hashed_on = []

        def noted(data):
            hashed_on.append(threading.current_thread() is threading.main_thread())
            return hashlib.sha256(data).hexdigest()

        self.patch(body_pool, "body_sha256", noted)
        large = body(messages=[{"role": "user", "content": "Summarise: " + "lorem ipsum " * 17_000}])
        for stream in (False, True):
            response, content = await self.post(dict(large, stream=stream))
            self.assertEqual(response.code, 200, content[:500])
            self.assertEqual(len(self.bedrock.requests[-1].body["messages"][0]["content"]), 11 + 12 * 17_000)
        self.assertEqual(hashed_on, [False, False])

    async def test_field_refused_by_one_model_keeps_bedrocks_words(self):
        """
        A field one model on the platform refuses (litellm #23825, #26240):
        the client gets Bedrock's own words in a 400, so Claude Code's
        capability retry can match them, and the refusal is dumped with
        Bedrock's request id.
        """
        tools = [dict(TOOLS[0], eager_input_streaming=True)]
        response, content = await self.post(body("claude-haiku-4-5", tools=tools))
        self.assertEqual(response.code, 400, content)
        refused = ujson.loads(content)
        error = refused["error"]
        self.assertEqual(error["type"], "invalid_request_error")
        self.assertIn("eager_input_streaming", error["message"])
        self.assertIn("Extra inputs are not permitted", error["message"])
        # The same field on a model that takes it passes.
        response, content = await self.post(body("claude-opus-4-6", tools=tools))
        self.assertEqual(response.code, 200, content)
        dumped = []
        for _ in range(100):
            dumped = [os.path.join(where, name) for where, _, names in os.walk(self.dumps) for name in names]
            if dumped:
                break
            await deferLater(reactor, 0.05, lambda: None)
        self.assertEqual(len(dumped), 1, "the 400 was not dumped")
        with open(dumped[0]) as f:
            dump = json.load(f)
        # Bedrock's own id of the refusal, to quote to AWS.
        self.assertEqual(dump["upstream_request_id"], refused["request_id"])

    async def test_tool_search_passes(self):
        """A field Bedrock accepts is never stripped: tool search's defer_loading (litellm #26113) saves tokens."""
        many = [dict(TOOLS[0], name="tool_%d" % (n,), description="A tool. " * 200) for n in range(20)]
        deferred = [dict(tool, defer_loading=True) for tool in many]
        beta = {"anthropic-beta": "tool-search-tool-2025-10-19"}
        response, plain = await self.post(body(tools=TOOLS + many), headers=beta)
        self.assertEqual(response.code, 200, plain)
        response, searched = await self.post(body(tools=TOOLS + deferred), headers=beta)
        self.assertEqual(response.code, 200, searched)
        sent = self.bedrock.requests[-1].body["tools"]
        self.assertTrue(all(tool.get("defer_loading") for tool in sent[1:]))
        self.assertLess(ujson.loads(searched)["usage"]["input_tokens"], ujson.loads(plain)["usage"]["input_tokens"])

    async def test_arn_and_profiles(self):
        """An application inference profile's ARN and a us. profile reach Bedrock whole, signed right (litellm #13738, #32683)."""
        for model, path in (("claude-sonnet-4-5", "/model/%s/invoke" % (ARN.replace("/", "%2F"),)),
                            ("claude-haiku-4-5", "/model/us.anthropic.claude-haiku-4-5-20251001-v1:0/invoke")):
            response, content = await self.post(body(model))
            self.assertEqual(response.code, 200, content)
            self.assertEqual(self.bedrock.requests[-1].path, path)

    async def test_count_tokens(self):
        """count_tokens through CountTokens, the profile kept (litellm #34272), the SDK's answer as Anthropic's."""
        def count():
            client = anthropic.Anthropic(base_url=self.served.url, api_key="sk-client", max_retries=0)
            try:
                return client.messages.count_tokens(model="claude-haiku-4-5", messages=body()["messages"],
                                                    tools=TOOLS)
            finally:
                client.close()

        counted = await deferToThread(count)
        self.assertGreater(counted.input_tokens, 0)
        self.assertEqual(self.bedrock.requests[-1].path, "/model/us.anthropic.claude-haiku-4-5-20251001-v1:0/count-tokens")

    async def test_stream_keeps_cache_usage(self):
        """
        A stream's cache reads and writes reach the client and the ledger
        (litellm #34373: cache usage lost in Bedrock streams).
        """
        system = [{"type": "text", "text": "You are careful. " * 600, "cache_control": {"type": "ephemeral"}}]
        usages = []
        for _ in range(2):
            response, content = await self.post(body(system=system, stream=True))
            self.assertEqual(response.code, 200)
            self.assertEqual(response.headers.getRawHeaders(b"content-type")[0][:17], b"text/event-stream")
            events = [json.loads(line[6:]) for line in content.decode().splitlines() if line.startswith("data: ")]
            start = next(e for e in events if e["type"] == "message_start")
            usages.append(start["message"]["usage"])
            self.assertNotIn("amazon-bedrock-invocationMetrics", content.decode())
        self.assertGreater(usages[0].get("cache_creation_input_tokens") or 0, 0)
        self.assertGreater(usages[1].get("cache_read_input_tokens") or 0, 0)
        records = self.ledger.records[-2:]
        self.assertGreater(records[0].tokens["cache_creation_5m_tokens"] + records[0].tokens["cache_creation_1h_tokens"], 0)
        self.assertEqual(records[1].tokens["cache_read_tokens"], usages[1]["cache_read_input_tokens"])

    async def test_replayed_thinking_untouched(self):
        """
        A tool loop's history goes to Bedrock as the client sent it: thinking
        blocks unchanged, a tool result without content kept, nothing
        reordered (bifrost #6342).
        """
        first = body(thinking={"type": "adaptive"})
        response, content = await self.post(first)
        self.assertEqual(response.code, 200, content)
        answer = ujson.loads(content)
        uses = [block for block in answer["content"] if block["type"] == "tool_use"]
        self.assertTrue(uses and any(block["type"] == "thinking" for block in answer["content"]))
        results = [{"type": "tool_result", "tool_use_id": block["id"]} for block in uses]
        second = dict(first, messages=first["messages"] + [
            {"role": "assistant", "content": answer["content"]}, {"role": "user", "content": results}])
        response, content = await self.post(second)
        self.assertEqual(response.code, 200, content)
        sent = self.bedrock.requests[-1].body["messages"]
        self.assertEqual([b["type"] for b in sent[1]["content"]], [b["type"] for b in answer["content"]])
        thinking = [b for b in sent[1]["content"] if b["type"] == "thinking"]
        self.assertEqual(thinking, [b for b in answer["content"] if b["type"] == "thinking"])
        self.assertEqual(sent[2]["content"], results)

    async def test_throttling_is_a_429(self):
        self.bedrock.fail_next("ThrottlingException", times=10)
        response, content = await self.post(body())
        self.assertEqual((response.code, ujson.loads(content)["error"]["type"]), (429, "rate_limit_error"))

    async def test_unavailable_is_overloaded(self):
        self.bedrock.fail_next("ServiceUnavailableException", times=10)
        response, content = await self.post(body())
        self.assertEqual((response.code, ujson.loads(content)["error"]["type"]), (529, "overloaded_error"))

    async def test_stream_exception_is_an_error_event(self):
        """An exception frame after the stream began: Anthropic's error event, never a normal end."""
        self.bedrock.break_next_stream("modelStreamErrorException", after_events=2, originalStatusCode=529)
        response, content = await self.post(body(stream=True))
        self.assertEqual(response.code, 200)
        self.assertIn(b"event: error", content)
        self.assertIn(b"overloaded_error", content)

    async def test_expired_credentials_refreshed_without_a_failed_request(self):
        """
        The relay's temporary credentials expire mid-run: Bedrock's
        ExpiredTokenException makes it fetch them again (here, the rotated
        keys in its environment) and send the request once more.
        """
        response, content = await self.post(body())
        self.assertEqual(response.code, 200, content)
        self.bedrock.auth.access_keys[KEY_ID].expires_at = time.time() - 1
        set_environment(self, dict(zip(VARIABLES, (KEY_ID_2, SECRET_2, TOKEN_2))))
        response, content = await self.post(body())
        self.assertEqual(response.code, 200, content)
        self.assertIn("Credential=%s/" % (KEY_ID_2,), self.bedrock.requests[-1].headers["authorization"])

    async def test_silence_pinged(self):
        """Bedrock sends no pings: the relay writes its own while the upstream is silent."""
        self.bedrock.silence_next_stream(2.5, after_events=2)
        response, content = await self.post(body(stream=True))
        self.assertEqual(response.code, 200)
        self.assertIn(b"event: ping", content)
        self.assertIn(b"message_stop", content)

    async def test_models_listed_from_the_map(self):
        """Bedrock has no Models API: /v1/models lists the model map."""
        response = await treq.get(self.served.url + "/v1/models", persistent=False)
        listed = ujson.loads(await response.content())
        self.assertEqual([model["id"] for model in listed["data"]], [asked for asked, _ in MODELS])

    async def test_model_id_that_would_leave_the_path(self):
        """A model id that would steer the signed path elsewhere never leaves the relay."""
        response, content = await self.post(body("../../guardrail"))
        self.assertEqual(response.code, 400, content)
        self.assertEqual(len(self.bedrock.requests), 0)


class VertexWireTests(TestCase):
    """The relay in front of the simulated Vertex, with a service account's tokens."""

    def setUp(self):
        self.model = SimulatedUpstream(reactor=reactor, mode="strict", thinking_secret="wires-vertex")
        self.tokens = SimulatedGoogleTokens(reactor=reactor, lifetime=3599)
        self.vertex = SimulatedVertex(self.model, "wires-project", self.tokens)
        port = reactor.listenTCP(0, Site(self.vertex.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        url = "http://127.0.0.1:%d" % (port.getHost().port,)
        account = make_service_account("relay@wires-project.iam.gserviceaccount.com", "wires-project",
                                       token_uri=url + "/token")
        self.tokens.add_service_account(account.email, account.public_key)
        key_file = self.mktemp()
        with open(key_file, "w") as f:
            json.dump(account.info, f)
        upstream = Upstream("vertex", url, wire="vertex", project="wires-project", region="global",
                            login=LoginSpec("google", (("credentials", key_file),)))
        self.served = serve_relay(self, RelayConfig(listen=(), upstreams=(upstream,), dump_dir=None), reactor)

    def client(self):
        return anthropic.Anthropic(base_url=self.served.url, api_key="sk-client", max_retries=0)

    def vertex_requests(self):
        return [r for r in self.model.requests if "Predict" in r.path]

    async def test_refused_beta_learnt(self):
        """A beta Vertex refuses by name is dropped and the request sent once more; later ones go without it (litellm #19984)."""
        def create():
            client = self.client()
            try:
                return [client.beta.messages.create(model="claude-opus-4-6", max_tokens=64, messages=body()["messages"],
                                                     betas=["prompt-caching-scope-2026-01-05"]) for _ in range(2)]
            finally:
                client.close()

        answers = await deferToThread(create)
        self.assertEqual(len(answers), 2)
        sent = [r.headers.get("anthropic-beta", "") for r in self.vertex_requests()]
        self.assertEqual(len(sent), 3)
        self.assertIn("prompt-caching-scope-2026-01-05", sent[0])
        self.assertNotIn("prompt-caching-scope-2026-01-05", sent[1] + sent[2])

    async def test_count_tokens_sends_no_beta(self):
        """count_tokens reaches Vertex without any beta, the SDK's own included (litellm PR #39597)."""
        def count():
            client = self.client()
            try:
                return client.beta.messages.count_tokens(model="claude-opus-4-6", messages=body()["messages"],
                                                         betas=["token-counting-2024-11-01"])
            finally:
                client.close()

        counted = await deferToThread(count)
        self.assertGreater(counted.input_tokens, 0)
        got = [r for r in self.model.requests if "count-tokens" in r.path][-1]
        self.assertNotIn("anthropic-beta", got.headers)
        self.assertTrue(got.path.endswith("/publishers/anthropic/models/count-tokens:rawPredict"))

    async def test_quota_is_a_429(self):
        """Vertex's google.rpc quota error, as Anthropic's rate limit."""
        self.vertex.quota_errors = 1.0
        response = await treq.post(self.served.url + "/v1/messages", data=json.dumps(body()).encode(),
                                   headers={"content-type": "application/json"}, persistent=False)
        content = await response.content()
        self.assertEqual(response.code, 429, content)
        self.assertEqual(ujson.loads(content)["error"]["type"], "rate_limit_error")
