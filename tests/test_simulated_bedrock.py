"""
The simulated Bedrock runtime (``twisted_relay.simulated.bedrock``): first
with the official clients over 127.0.0.1 (the SDK's ``AnthropicBedrock``,
signed and with an API key, and boto3's ``bedrock-runtime``), then each
check and switch in memory (StubTreq, a Clock), requests signed by botocore.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.eventstream import EventStreamBuffer
from botocore.loaders import Loader
from botocore.model import ServiceModel
from botocore.parsers import EventStreamJSONParser
from treq.testing import StubTreq
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Site

from tests.test_simulated import TOOLS, _answer_results, _result
from twisted_relay.simulated.bedrock import SimulatedBedrock
from twisted_relay.simulated.bedrock_auth import SIGNATURE_MISMATCH, AwsCredential
from twisted_relay.simulated.bedrock_rules import HTTP_ERRORS, STREAM_EXCEPTIONS
from twisted_relay.simulated.eventstream_frames import chunk_frame, exception_frame, frame
from twisted_relay.simulated.resource import SimulatedUpstream

REGION = "us-east-1"
KEY, SECRET = "AKIDSIMULATED", "simulated-secret-key"
TEMP_KEY, TEMP_SECRET, TOKEN = "ASIASIMULATED", "temporary-secret", "session-token-1"
API_KEY = "bedrock-api-key-simulated"
OPUS = "global.anthropic.claude-opus-4-6-v1"
HAIKU = "us.anthropic.claude-haiku-4-5-20251001-v1:0"
BASE = "http://bedrock.test"
ARN = f"arn:aws:bedrock:{REGION}:123456789012:application-inference-profile/abc123"

_STREAM_SHAPE = ServiceModel(Loader().load_service_model("bedrock-runtime", "service-2")).shape_for("ResponseStream")


def decode_stream(data: bytes, piece: int = 7) -> list[dict]:
    """The event stream as botocore parses it, fed ``piece`` bytes at a time."""
    buffer, parser, parsed = EventStreamBuffer(), EventStreamJSONParser(), []
    for start in range(0, len(data), piece):
        buffer.add_data(data[start:start + piece])
        for message in buffer:
            parsed.append(parser.parse(message.to_response_dict(), _STREAM_SHAPE))
    return parsed


def chunk_events(parsed: list[dict]) -> list[dict]:
    return [json.loads(item["chunk"]["bytes"]) for item in parsed if "chunk" in item]


def bedrock_body(messages: list | None = None, **extra: Any) -> dict:
    body = {"anthropic_version": "bedrock-2023-05-31", "max_tokens": 512,
            "messages": messages or [{"role": "user", "content": "Quel temps fait-il ?"}]}
    body.update(extra)
    return body


def sign(url: str, body: bytes, headers: dict | None = None, *, key: str = KEY, secret: str = SECRET,
         token: str | None = None, region: str = REGION, service: str = "bedrock") -> dict[str, str]:
    """The headers botocore signs ``POST url`` with."""
    request = AWSRequest("POST", url, data=body, headers={"content-type": "application/json", **(headers or {})})
    SigV4Auth(Credentials(key, secret, token), service, region).add_auth(request)
    return dict(request.headers.items())


class _Bedrock:
    """A simulated Bedrock behind StubTreq, paced by a Clock."""

    def __init__(self, upstream_options: dict | None = None, **options: Any):
        self.clock = Clock()
        upstream_options = dict(upstream_options or {})
        upstream_options.setdefault("reactor", self.clock)
        upstream_options.setdefault("thinking_secret", "bedrock-test")
        self.sim = SimulatedBedrock(
            SimulatedUpstream(**upstream_options),
            access_keys={KEY: SECRET, TEMP_KEY: AwsCredential(TEMP_SECRET, TOKEN, time.time() + 3600)},
            api_keys={API_KEY: "123456789012"},
            application_profiles={ARN: HAIKU},
            **options,
        )
        self.stub = StubTreq(self.sim.resource())

    def settle(self) -> None:
        for _ in range(10_000):
            self.stub.flush()
            if not self.clock.getDelayedCalls():
                break
            self.clock.advance(1)
        self.stub.flush()

    def send(self, path: str, data: bytes, headers: dict[str, str]) -> tuple[Any, bytes]:
        d = self.stub.request("POST", BASE + path, data=data, headers=headers)
        self.settle()
        response = _result(d)
        content = self.stub.content(response)
        self.settle()
        return response, _result(content)

    def invoke(self, model: str, body: Any, *, stream: bool = False, signed: bool = False,
               headers: dict | None = None) -> tuple[Any, Any]:
        """POST a body (with an API key, or signed); the response and its
        JSON, or the stream parsed by botocore."""
        path = f"/model/{_quote(model)}/{'invoke-with-response-stream' if stream else 'invoke'}"
        data = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
        headers = dict(headers or {})
        if signed:
            headers = sign(BASE + path, data, headers)
        else:
            headers.setdefault("authorization", f"Bearer {API_KEY}")
            headers.setdefault("content-type", "application/json")
        response, content = self.send(path, data, headers)
        if response.code == 200 and stream:
            return response, decode_stream(content)
        return response, json.loads(content) if content else None


def _quote(model: str) -> str:
    from urllib.parse import quote

    return quote(model, safe=":")


def _error_type(response: Any) -> str:
    return response.headers.getRawHeaders("x-amzn-errortype")[0].partition(":")[0]


class SDKTests(TestCase):
    """The official clients against the simulated Bedrock on 127.0.0.1."""

    def setUp(self) -> None:
        # Lenient: the fake model's copied ids stay in the history (the relay's
        # job is to make a strict upstream take them).
        upstream = SimulatedUpstream(mode="lenient", thinking_secret="bedrock-test")
        self.sim = SimulatedBedrock(upstream, access_keys={KEY: SECRET}, api_keys={API_KEY: "123456789012"})
        self.port = reactor.listenTCP(0, Site(self.sim.resource()), interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)
        self.url = f"http://127.0.0.1:{self.port.getHost().port}"

    async def test_sdk_tool_loop(self) -> None:
        """``AnthropicBedrock`` signed with SigV4 runs a tool loop on Opus 4.6,
        streamed and not, with adaptive thinking: ``msg_bdrk_``/``toolu_bdrk_``
        ids, a copied id among them, and the thinking replayed each turn accepted."""
        import anthropic

        def session() -> list:
            client = anthropic.AnthropicBedrock(base_url=self.url, aws_access_key=KEY, aws_secret_key=SECRET,
                                                aws_region=REGION, max_retries=0, timeout=30)
            self.addCleanup(client.close)
            messages: list = [{"role": "user", "content": "Fais le tour des outils."}]
            answers = []
            for turn in range(6):
                kwargs = dict(model=OPUS, max_tokens=1024, messages=messages, tools=TOOLS,
                              thinking={"type": "adaptive"}, extra_body={"anthropic_version": "bedrock-2023-05-31"})
                if turn % 2:
                    with client.messages.stream(**kwargs) as stream:
                        answer = stream.get_final_message().model_dump()
                else:
                    answer = client.messages.create(**kwargs).model_dump()
                answers.append(answer)
                messages = messages + [{"role": "assistant", "content": answer["content"]}, _answer_results(answer)]
            return answers

        answers = await deferToThread(session)
        tool_ids = [block["id"] for answer in answers for block in answer["content"] if block["type"] == "tool_use"]
        self.assertTrue(all(answer["id"].startswith("msg_bdrk_") for answer in answers))
        self.assertTrue(all(tool_id.startswith("toolu_bdrk_") for tool_id in tool_ids))
        self.assertLess(len(set(tool_ids)), len(tool_ids), "the fake model copies ids from the history")
        self.assertTrue(all(answer["content"][0]["type"] == "thinking" for answer in answers))
        self.assertEqual(answers[0]["model"], "claude-opus-4-6")
        received = self.sim.requests[-1]
        self.assertEqual(received.model_id, OPUS)
        self.assertTrue(received.headers["authorization"].startswith(f"AWS4-HMAC-SHA256 Credential={KEY}/"))
        self.assertNotIn("model", received.body)
        self.assertEqual(len(self.sim.reported.answers), 6)

    async def test_sdk_api_key(self) -> None:
        """``AnthropicBedrock(api_key=...)`` sends a Bearer key; an unknown one is a 403."""
        import anthropic

        def call(key: str) -> Any:
            client = anthropic.AnthropicBedrock(base_url=self.url, api_key=key, aws_region=REGION, max_retries=0)
            self.addCleanup(client.close)
            try:
                return client.messages.create(model=OPUS, max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"anthropic_version": "bedrock-2023-05-31"})
            except anthropic.APIStatusError as error:
                return error

        message = await deferToThread(call, API_KEY)
        self.assertTrue(message.id.startswith("msg_bdrk_"))
        error = await deferToThread(call, "bedrock-api-key-unknown")
        self.assertEqual(error.status_code, 403)
        self.assertIn("Authentication failed: Please make sure your API Key is valid.", str(error))

    async def test_boto3(self) -> None:
        """boto3's ``bedrock-runtime`` client: InvokeModel with Bedrock's
        headers, the stream with the invocation metrics in its last chunk and
        no ping, CountTokens, a refusal in Bedrock's words, and one body byte
        changed after signing refused as ``InvalidSignatureException``."""
        import boto3
        from botocore.exceptions import ClientError

        body = json.dumps(bedrock_body()).encode()

        def calls() -> dict:
            client = boto3.client("bedrock-runtime", endpoint_url=self.url, region_name=REGION,
                                  aws_access_key_id=KEY, aws_secret_access_key=SECRET)
            self.addCleanup(client.close)
            out: dict = {}
            answer = client.invoke_model(modelId=HAIKU, body=body)
            out["headers"] = answer["ResponseMetadata"]["HTTPHeaders"]
            out["message"] = json.loads(answer["body"].read())
            stream = client.invoke_model_with_response_stream(modelId=HAIKU, body=body)
            out["events"] = [json.loads(event["chunk"]["bytes"]) for event in stream["body"]]
            out["count"] = client.count_tokens(modelId=HAIKU, input={"invokeModel": {"body": body}})
            try:
                client.invoke_model(modelId="anthropic.claude-haiku-4-5-20251001-v1:0", body=body)
            except ClientError as error:
                out["on_demand"] = error.response["Error"]
            client.meta.events.register("before-send.bedrock-runtime.InvokeModel", _change_one_byte)
            try:
                client.invoke_model(modelId=HAIKU, body=body)
            except ClientError as error:
                out["tampered"] = error.response["Error"]
            return out

        out = await deferToThread(calls)
        message, headers = out["message"], out["headers"]
        self.assertTrue(message["id"].startswith("msg_bdrk_"))
        self.assertEqual(headers["x-amzn-bedrock-output-token-count"], str(message["usage"]["output_tokens"]))
        self.assertEqual(headers["x-amzn-bedrock-input-token-count"], str(message["usage"]["input_tokens"]))
        self.assertIn("x-amzn-requestid", headers)
        kinds = [event["type"] for event in out["events"]]
        self.assertEqual((kinds[0], kinds[-1]), ("message_start", "message_stop"))
        self.assertNotIn("ping", kinds)
        metrics = out["events"][-1]["amazon-bedrock-invocationMetrics"]
        self.assertEqual(metrics["outputTokenCount"], out["events"][-2]["usage"]["output_tokens"])
        self.assertEqual(out["count"]["inputTokens"], message["usage"]["input_tokens"])
        self.assertEqual(out["on_demand"]["Code"], "ValidationException")
        self.assertIn("with on-demand throughput isn't supported", out["on_demand"]["Message"])
        self.assertEqual(out["tampered"], {"Code": "InvalidSignatureException", "Message": SIGNATURE_MISMATCH})


def _change_one_byte(request: Any, **_: Any) -> None:
    """A proxy on the way that changes one byte of the signed body."""
    body = bytearray(request.body)
    body[body.index(b"Quel")] = ord("q")
    request.body = bytes(body)


class FrameTests(SynchronousTestCase):
    """The event-stream encoder, checked with botocore's decoder."""

    def test_empty_message_vector(self) -> None:
        """An empty message is botocore's ``EMPTY_MESSAGE`` test vector."""
        self.assertEqual(frame({}, b"").hex(), "000000100000000005c248eb7d98c8ff")

    def test_botocore_decodes(self) -> None:
        """botocore reads a chunk (its Anthropic event) and an exception frame,
        across 7-byte pieces."""
        data = chunk_frame({"type": "message_stop"}, "abcdef") + exception_frame(
            "modelStreamErrorException", {"message": "Overloaded", "originalStatusCode": 529})
        parsed = decode_stream(data)
        self.assertEqual(chunk_events(parsed), [{"type": "message_stop"}])
        self.assertEqual(parsed[1], {"Error": {"Code": "modelStreamErrorException", "Message": "Overloaded"}})


class AuthTests(SynchronousTestCase):
    """SigV4 checked by signing again, Bedrock API keys, and AWS's 403s."""

    def setUp(self) -> None:
        self.bedrock = _Bedrock()
        self.data = json.dumps(bedrock_body()).encode()
        self.path = f"/model/{HAIKU}/invoke"

    def refused(self, headers: dict, data: bytes | None = None, path: str | None = None) -> tuple[str, str]:
        response, content = self.bedrock.send(path or self.path, self.data if data is None else data, headers)
        self.assertEqual(response.code, 403)
        body = json.loads(content)
        return _error_type(response), body.get("message", body.get("Message"))

    def test_signed_request_passes(self) -> None:
        """A botocore-signed request passes, temporary credentials with their token too."""
        for headers in (sign(BASE + self.path, self.data),
                        sign(BASE + self.path, self.data, key=TEMP_KEY, secret=TEMP_SECRET, token=TOKEN)):
            response, _ = self.bedrock.send(self.path, self.data, headers)
            self.assertEqual(response.code, 200)

    def test_changed_bytes(self) -> None:
        """One changed body byte, a signed header changed or repeated on the way
        (LiteLLM #13738), or a wrong secret: ``InvalidSignatureException``."""
        headers = sign(BASE + self.path, self.data)
        mismatch = ("InvalidSignatureException", SIGNATURE_MISMATCH)
        self.assertEqual(self.refused(headers, self.data.replace(b"Quel", b"quel")), mismatch)
        self.assertEqual(self.refused(dict(headers, **{"content-type": "application/json; charset=utf-8"})), mismatch)
        doubled = dict(headers, **{"content-type": ["application/json", "application/json"]})
        self.assertEqual(self.refused(doubled), mismatch)
        self.assertEqual(self.refused(sign(BASE + self.path, self.data, secret="not-the-secret")), mismatch)

    def test_arn_path(self) -> None:
        """An ARN's ``/`` goes out as ``%2F`` and is signed as ``%252F``: the
        simulator accepts that signature, and refuses one over a path encoded
        otherwise (vercel/ai #17410)."""
        path = f"/model/{_quote(ARN)}/invoke"
        self.assertIn("%2F", path)
        response, _ = self.bedrock.send(path, self.data, sign(BASE + path, self.data))
        self.assertEqual(response.code, 200)
        self.assertEqual(self.bedrock.sim.requests[-1].model_id, ARN)
        wrong = sign(BASE + path.replace("%2F", "/"), self.data)
        self.assertEqual(self.refused(wrong, path=path)[0], "InvalidSignatureException")

    def test_scope_and_clock(self) -> None:
        """A credential scoped to another service or region, and a date more than
        five minutes off either way, are refused in AWS's words."""
        self.assertEqual(self.refused(sign(BASE + self.path, self.data, service="bedrock-mantle")),
                         ("InvalidSignatureException", "Credential should be scoped to correct service: 'bedrock'. "))
        self.assertEqual(self.refused(sign(BASE + self.path, self.data, region="us-west-2")),
                         ("InvalidSignatureException", "Credential should be scoped to a valid region, not "
                                                       "'us-west-2'. "))
        headers = sign(BASE + self.path, self.data)
        for offset, words in ((400, "Signature expired: "), (-400, "Signature not yet current: ")):
            self.bedrock.sim.auth.wall_clock = lambda offset=offset: time.time() + offset
            kind, message = self.refused(headers)
            self.assertEqual(kind, "InvalidSignatureException")
            self.assertTrue(message.startswith(words + headers["X-Amz-Date"]), message)
        self.bedrock.sim.auth.wall_clock = lambda: time.time() + 240
        self.assertEqual(self.bedrock.send(self.path, self.data, headers)[0].code, 200)

    def test_credentials(self) -> None:
        """No authorization, an unknown key, a temporary key without its token,
        an expired session, an unknown API key: each its own 403."""
        self.assertEqual(self.refused({"content-type": "application/json"}),
                         ("MissingAuthenticationTokenException", "Authorization header is missing"))
        self.assertEqual(self.refused(sign(BASE + self.path, self.data, key="AKIDUNKNOWN")),
                         ("UnrecognizedClientException", "The security token included in the request is invalid."))
        self.assertEqual(self.refused(sign(BASE + self.path, self.data, key=TEMP_KEY, secret=TEMP_SECRET))[0],
                         "UnrecognizedClientException")
        self.bedrock.sim.auth.access_keys[TEMP_KEY].expires_at = time.time() - 1
        self.assertEqual(self.refused(sign(BASE + self.path, self.data, key=TEMP_KEY, secret=TEMP_SECRET, token=TOKEN)),
                         ("ExpiredTokenException", "The security token included in the request is expired"))
        self.assertEqual(self.refused({"authorization": "Bearer bedrock-api-key-unknown"}),
                         ("AccessDeniedException", "Authentication failed: Please make sure your API Key is valid."))
        self.assertNotIn(SECRET, repr(self.bedrock.sim.auth.access_keys))


class BodyTests(SynchronousTestCase):
    """What InvokeModel refuses, in Bedrock's words, and what it takes."""

    def setUp(self) -> None:
        self.bedrock = _Bedrock()

    def refusal(self, model: str, body: Any, headers: dict | None = None) -> str:
        response, error = self.bedrock.invoke(model, body, headers=headers)
        self.assertEqual((response.code, _error_type(response)), (400, "ValidationException"), error)
        return error["message"]

    def test_version_and_extra_fields(self) -> None:
        """``anthropic_version`` is required (``bedrock-2023-05-31``; ``2026-10-21``
        only from Claude 4.7); ``model``, ``stream`` and ``service_tier`` in the
        body are extra inputs; the tier goes in its header."""
        body = bedrock_body()
        del body["anthropic_version"]
        self.assertEqual(self.refusal(OPUS, body), "anthropic_version: Field required")
        self.assertEqual(self.refusal(OPUS, bedrock_body(anthropic_version="2026-10-21")), "Invalid API version")
        self.assertEqual(self.bedrock.invoke("global.anthropic.claude-opus-4-7",
                                             bedrock_body(anthropic_version="2026-10-21"))[0].code, 200)
        for name, value in (("model", OPUS), ("stream", True), ("service_tier", "priority")):
            self.assertEqual(self.refusal(OPUS, bedrock_body(**{name: value})),
                             f"{name}: Extra inputs are not permitted")
        response, _ = self.bedrock.invoke(OPUS, bedrock_body(), headers={"X-Amzn-Bedrock-Service-Tier": "priority"})
        self.assertEqual(response.code, 200)
        # The answer says which tier served it, as Bedrock's do (botocore's InvokeModel output).
        self.assertEqual(response.headers.getRawHeaders("x-amzn-bedrock-service-tier"), ["priority"])
        self.assertIsNone(self.bedrock.invoke(OPUS, bedrock_body())[0].headers.getRawHeaders(
            "x-amzn-bedrock-service-tier"))
        self.assertIn("serviceTier", self.refusal(OPUS, bedrock_body(), {"X-Amzn-Bedrock-Service-Tier": "fast"}))
        self.assertEqual(self.refusal(OPUS, b"not json"),
                         "Malformed input request, please reformat your input and try again.")

    def test_betas(self) -> None:
        """Betas are read from the body only: an unknown one is a 400 ``invalid beta
        flag``; a header beta, known or not, is ignored."""
        self.assertEqual(self.refusal(OPUS, bedrock_body(anthropic_beta=["prompt-caching-scope-2026-01-05"])),
                         "invalid beta flag")
        self.assertEqual(self.bedrock.invoke(OPUS, bedrock_body(), headers={
            "anthropic-beta": "prompt-caching-scope-2026-01-05"})[0].code, 200)
        sonnet = "global.anthropic.claude-sonnet-5-5"
        body = bedrock_body(anthropic_version="2026-10-21")
        binding = "thinking-binding-controls-2026-08-01"
        _, by_header = self.bedrock.invoke(sonnet, body, headers={"anthropic-beta": binding})
        self.assertNotIn("input_transformations", by_header)
        _, by_body = self.bedrock.invoke(sonnet, dict(body, anthropic_beta=[binding]))
        self.assertEqual(by_body["input_transformations"], [])

    def test_tool_fields(self) -> None:
        """``eager_input_streaming`` is taken by Opus 4.6 and refused by Haiku 4.5
        (LiteLLM #23825); ``defer_loading`` needs the tool-search beta, and with
        it the deferred tools are not read (fewer input tokens: LiteLLM #26113);
        ``cache_control.scope`` is refused."""
        eager = [dict(TOOLS[0], eager_input_streaming=True)]
        self.assertEqual(self.bedrock.invoke(OPUS, bedrock_body(tools=eager))[0].code, 200)
        self.assertEqual(self.refusal(HAIKU, bedrock_body(tools=eager)),
                         "tools.0.custom.eager_input_streaming: Extra inputs are not permitted")
        many = [dict(TOOLS[0], name=f"tool_{n}", description="x" * 400) for n in range(10)]
        deferred = [dict(tool, defer_loading=True) for tool in many]
        self.assertEqual(self.refusal(OPUS, bedrock_body(tools=TOOLS + deferred)),
                         f"tools.{len(TOOLS)}.custom.defer_loading: Extra inputs are not permitted")
        search = ["tool-search-tool-2025-10-19"]
        _, eager_answer = self.bedrock.invoke(OPUS, bedrock_body(tools=TOOLS + many, anthropic_beta=search))
        _, lazy_answer = self.bedrock.invoke(OPUS, bedrock_body(tools=TOOLS + deferred, anthropic_beta=search))
        self.assertLess(lazy_answer["usage"]["input_tokens"] + 800, eager_answer["usage"]["input_tokens"])
        scoped = bedrock_body(system=[{"type": "text", "text": "Be brief.",
                                       "cache_control": {"type": "ephemeral", "scope": "global"}}])
        self.assertEqual(self.refusal(OPUS, scoped), "system.0.cache_control.ephemeral.scope: Extra inputs are "
                                                     "not permitted")

    def test_model_ids(self) -> None:
        """Profiles, base ids, ARNs: a profile-only model called by its base id is
        refused (LiteLLM #32683), a profile of another geography or an unknown id
        is invalid, an application profile ARN routes to its model."""
        self.assertEqual(self.refusal("anthropic.claude-opus-4-6-v1", bedrock_body()),
                         "Invocation of model ID anthropic.claude-opus-4-6-v1 with on-demand throughput isn't "
                         "supported. Retry your request with the ID or ARN of an inference profile that contains "
                         "this model.")
        for model in ("eu.anthropic.claude-opus-4-6-v1", "anthropic.claude-unknown", "us.anthropic.claude-unknown"):
            self.assertEqual(self.refusal(model, bedrock_body()), "The provided model identifier is invalid.")
        for model, name in (("us.anthropic.claude-opus-4-6-v1", "claude-opus-4-6"),
                            ("anthropic.claude-3-5-haiku-20241022-v1:0", "claude-3-5-haiku-20241022"),
                            (ARN, "claude-haiku-4-5-20251001"),
                            (f"arn:aws:bedrock:{REGION}::foundation-model/anthropic.claude-3-5-haiku-20241022-v1:0",
                             "claude-3-5-haiku-20241022")):
            response, answer = self.bedrock.invoke(model, bedrock_body())
            self.assertEqual((response.code, answer["model"]), (200, name))

    def test_input_too_long(self) -> None:
        """Past the limit set, "Input is too long for requested model."."""
        bedrock = _Bedrock(max_input_tokens=50)
        self.assertEqual(bedrock.invoke(OPUS, bedrock_body())[0].code, 200)
        response, error = bedrock.invoke(OPUS, bedrock_body([{"role": "user", "content": "long " * 100}]))
        self.assertEqual((response.code, error), (400, {"message": "Input is too long for requested model."}))

    def test_count_tokens(self) -> None:
        """CountTokens reads the base64 InvokeModel body (``max_tokens`` required)
        and counts as the answer does."""
        body = bedrock_body()
        data = json.dumps({"input": {"invokeModel": {"body": base64.b64encode(json.dumps(body).encode()).decode()}}})
        path = f"/model/{OPUS}/count-tokens"
        response, content = self.bedrock.send(path, data.encode(), sign(BASE + path, data.encode()))
        _, answer = self.bedrock.invoke(OPUS, body)
        self.assertEqual((response.code, json.loads(content)), (200, {"inputTokens": answer["usage"]["input_tokens"]}))
        del body["max_tokens"]
        data = json.dumps({"input": {"invokeModel": {"body": base64.b64encode(json.dumps(body).encode()).decode()}}})
        response, content = self.bedrock.send(path, data.encode(), sign(BASE + path, data.encode()))
        self.assertEqual((response.code, json.loads(content)["message"]), (400, "max_tokens: Field required"))


class AnswerTests(SynchronousTestCase):
    """What the simulated Bedrock answers: ids, headers, the event stream."""

    def test_ids_and_reuse(self) -> None:
        """Bedrock's id prefixes, with the fake model's copies kept copies, in a
        stateful tool loop (the ids it issued, demanded back exactly)."""
        bedrock = _Bedrock({"mode": "stateful", "reuse_every": 1})
        messages: list = [{"role": "user", "content": "Go."}]
        ids = []
        for turn in range(4):
            response, answer = bedrock.invoke(HAIKU, bedrock_body(messages, tools=TOOLS), stream=bool(turn % 2))
            self.assertEqual(response.code, 200, answer)
            if turn % 2:
                answer = _rebuild(chunk_events(answer))
            self.assertTrue(answer["id"].startswith("msg_bdrk_"))
            ids += [block["id"] for block in answer["content"] if block["type"] == "tool_use"]
            messages += [{"role": "assistant", "content": answer["content"]}, _answer_results(answer)]
        self.assertTrue(all(tool_id.startswith("toolu_bdrk_") for tool_id in ids))
        self.assertLess(len(set(ids)), len(ids))

    def test_headers_and_cache(self) -> None:
        """The token-count headers follow the usage, cache reads and writes
        included, and the stream's metrics say the same."""
        bedrock = _Bedrock()
        system = [{"type": "text", "text": "Règle. " * 600, "cache_control": {"type": "ephemeral"}}]
        body = bedrock_body(system=system)
        first, written = bedrock.invoke(OPUS, body)
        second, read = bedrock.invoke(OPUS, body)
        self.assertGreater(written["usage"]["cache_creation_input_tokens"], 0)
        self.assertEqual(read["usage"]["cache_read_input_tokens"], written["usage"]["cache_creation_input_tokens"])
        for response, answer in ((first, written), (second, read)):
            usage = answer["usage"]
            for name, value in (("input", usage["input_tokens"]), ("output", usage["output_tokens"]),
                                ("cache-read-input", usage["cache_read_input_tokens"]),
                                ("cache-write-input", usage["cache_creation_input_tokens"])):
                self.assertEqual(response.headers.getRawHeaders(f"x-amzn-bedrock-{name}-token-count"), [str(value)])
            self.assertTrue(response.headers.getRawHeaders("x-amzn-bedrock-invocation-latency"))
        response, parsed = bedrock.invoke(OPUS, body, stream=True)
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["application/vnd.amazon.eventstream"])
        self.assertEqual(response.headers.getRawHeaders("x-amzn-bedrock-content-type"), ["application/json"])
        metrics = chunk_events(parsed)[-1]["amazon-bedrock-invocationMetrics"]
        self.assertEqual(metrics["cacheReadInputTokenCount"], read["usage"]["cache_read_input_tokens"])
        self.assertEqual(metrics["cacheWriteInputTokenCount"], 0)
        self.assertEqual([answer.stream for answer in bedrock.sim.reported.answers], [False, False, True])

    def test_stream_frames(self) -> None:
        """One chunk per Anthropic event, no ping, padding of random lengths,
        the bytes written in pieces that cut through frames, paced by the
        event delay."""
        bedrock = _Bedrock({"event_delay": 0.5})
        path = f"/model/{OPUS}/invoke-with-response-stream"
        data = json.dumps(bedrock_body(tools=TOOLS)).encode()
        d = bedrock.stub.request("POST", BASE + path, data=data, headers=sign(BASE + path, data))
        bedrock.stub.flush()
        bedrock.clock.advance(0)
        bedrock.stub.flush()
        pieces: list[bytes] = []
        done = bedrock.stub.collect(_result(d), pieces.append)
        bedrock.stub.flush()
        first = len(pieces)
        self.assertTrue(pieces)
        bedrock.clock.advance(0.5)
        bedrock.stub.flush()
        self.assertGreater(len(pieces), first, "the next event's pieces half a second later")
        bedrock.settle()
        _result(done)
        data = b"".join(pieces)
        frames = _frame_lengths(data)
        self.assertGreater(len(pieces), len(frames), "pieces cut through frames")
        events = chunk_events(decode_stream(data))
        self.assertEqual(len(events), len(frames))
        self.assertNotIn("ping", [event["type"] for event in events])
        paddings = {len(json.loads(_payload(data, start))["p"]) for start in frames}
        self.assertGreater(len(paddings), 1)


def _frame_lengths(data: bytes) -> list[int]:
    starts, offset = [], 0
    while offset < len(data):
        starts.append(offset)
        offset += int.from_bytes(data[offset:offset + 4], "big")
    return starts


def _payload(data: bytes, start: int) -> bytes:
    total = int.from_bytes(data[start:start + 4], "big")
    headers = int.from_bytes(data[start + 4:start + 8], "big")
    return data[start + 12 + headers:start + total - 4]


def _rebuild(events: list[dict]) -> dict:
    """The message a stream of Anthropic events carries."""
    message = dict(events[0]["message"])
    message["content"] = []
    partial: dict = {}
    for event in events[1:]:
        if event["type"] == "content_block_start":
            message["content"].append(dict(event["content_block"]))
            partial[event["index"]] = ""
        elif event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
            partial[event["index"]] += event["delta"]["partial_json"]
        elif event["type"] == "content_block_stop" and message["content"][event["index"]]["type"] == "tool_use":
            message["content"][event["index"]]["input"] = json.loads(partial[event["index"]] or "{}")
    return message


class FaultTests(SynchronousTestCase):
    """The switches that make the simulated Bedrock fail as Bedrock fails."""

    def test_http_errors(self) -> None:
        """Each HTTP error with its status and ``x-amzn-ErrorType``, once each."""
        bedrock = _Bedrock()
        for error_type, (status, message) in HTTP_ERRORS.items():
            bedrock.sim.fail_next(error_type)
            response, body = bedrock.invoke(OPUS, bedrock_body(), signed=True)
            self.assertEqual((response.code, _error_type(response), body["message"]), (status, error_type, message))
        bedrock.sim.fail_next("ModelErrorException", originalStatusCode=529)
        self.assertEqual(bedrock.invoke(OPUS, bedrock_body())[1]["originalStatusCode"], 529)
        self.assertEqual(bedrock.invoke(OPUS, bedrock_body())[0].code, 200)

    def test_exception_frames(self) -> None:
        """Each exception frame, after the events asked for, ends the stream;
        botocore reads its type."""
        bedrock = _Bedrock()
        for kind in STREAM_EXCEPTIONS:
            bedrock.sim.break_next_stream(kind, after_events=3, **(
                {"originalStatusCode": 529} if kind == "modelStreamErrorException" else {}))
            response, parsed = bedrock.invoke(OPUS, bedrock_body(), stream=True)
            self.assertEqual(response.code, 200)
            self.assertEqual(len(chunk_events(parsed)), 3)
            self.assertEqual(parsed[-1]["Error"], {"Code": kind, "Message": STREAM_EXCEPTIONS[kind]})
        self.assertFalse(bedrock.sim.reported.answers[-1].whole)

    def test_upstream_stream_errors(self) -> None:
        """The upstream's ``stream_errors`` become a ``modelStreamErrorException``
        whose original status is the overload's 529."""
        bedrock = _Bedrock({"stream_errors": 1.0})
        path = f"/model/{OPUS}/invoke-with-response-stream"
        data = json.dumps(bedrock_body()).encode()
        response, content = bedrock.send(path, data, sign(BASE + path, data))
        last = len(_frame_lengths(content)) - 1
        self.assertEqual(json.loads(_payload(content, _frame_lengths(content)[last])),
                         {"message": STREAM_EXCEPTIONS["modelStreamErrorException"], "originalStatusCode": 529,
                          "originalMessage": "Overloaded"})

    def test_silence(self) -> None:
        """A stream falls silent for the time asked (longer than the 15 seconds
        after which a gateway pings), with nothing written meanwhile."""
        bedrock = _Bedrock()
        bedrock.sim.silence_next_stream(20.0, after_events=2)
        path = f"/model/{OPUS}/invoke-with-response-stream"
        data = json.dumps(bedrock_body()).encode()
        d = bedrock.stub.request("POST", BASE + path, data=data, headers=sign(BASE + path, data))
        bedrock.stub.flush()
        bedrock.clock.advance(0)
        bedrock.stub.flush()
        pieces: list[bytes] = []
        done = bedrock.stub.collect(_result(d), pieces.append)
        bedrock.stub.flush()
        before = b"".join(pieces)
        self.assertEqual(len(chunk_events(decode_stream(before))), 2)
        bedrock.clock.advance(19.5)
        bedrock.stub.flush()
        self.assertEqual(b"".join(pieces), before)
        bedrock.clock.advance(0.5)
        bedrock.stub.flush()
        _result(done)
        self.assertEqual(chunk_events(decode_stream(b"".join(pieces)))[-1]["type"], "message_stop")
