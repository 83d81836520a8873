"""
The wires' mappings (:mod:`twisted_relay.wires`): what each sends for an
attempt (path, headers, the body's edits) and how each reads an error back,
pure; the body's edits made where the body is serialised, in the relay's
process and in a body worker alike.
"""

from __future__ import annotations

import base64
import os

import ujson
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.http_headers import Headers

from tests.helpers import encode, messages_body
from twisted_relay.body_form import BodyForm
from twisted_relay.body_pool import BodyPool, RequestBody
from twisted_relay.body_work import prepare
from twisted_relay.config import Upstream, cloud_base_url
from twisted_relay.errors import RelayError
from twisted_relay.translation import UpstreamRules
from twisted_relay.wires import wire_for
from twisted_relay.wires.base import check_model_id
from twisted_relay.wires.vertex import UNWANTED_FOR


def headers(**values: str) -> Headers:
    found = Headers()
    for name, value in values.items():
        found.setRawHeaders(name.replace("_", "-").encode("ascii"), [value.encode("latin-1")])
    return found


BEDROCK = Upstream("bedrock", "https://bedrock-runtime.us-east-1.amazonaws.com", wire="bedrock", region="us-east-1")
VERTEX = Upstream("vertex", "https://aiplatform.googleapis.com", wire="vertex", project="proj-1", region="global")


def sent_body(form: BodyForm, body: dict) -> dict:
    """What ``prepare`` sends for ``body`` under ``form``, parsed again."""
    prepared = prepare(body, encode(body), None, UpstreamRules(), None, False, 0, form)
    return ujson.loads(prepared.body)


class BedrockOutgoingTests(SynchronousTestCase):
    """What an attempt sends to Bedrock's InvokeModel."""

    def test_stream_path_body_and_betas(self):
        """A stream goes to invoke-with-response-stream; model and stream leave the body; betas go into it."""
        wire = wire_for(BEDROCK)
        client = headers(anthropic_beta="context-1m-2025-08-07, fine-grained-tool-streaming-2025-05-14",
                         anthropic_version="2023-06-01", user_agent="claude-cli/2.1.332")
        out = wire.outgoing("messages", "/v1/messages?beta=true", client, "us.anthropic.claude-opus-4-6-v1", True)
        self.assertEqual(out.path, "/model/us.anthropic.claude-opus-4-6-v1/invoke-with-response-stream")
        self.assertEqual(out.headers.getRawHeaders(b"accept"), [b"application/vnd.amazon.eventstream"])
        self.assertIsNone(out.headers.getRawHeaders(b"anthropic-beta"))
        self.assertIsNone(out.headers.getRawHeaders(b"anthropic-version"))
        body = sent_body(out.form, messages_body([{"role": "user", "content": "hi"}], stream=True,
                                                service_tier="auto"))
        self.assertNotIn("model", body)
        self.assertNotIn("stream", body)
        self.assertNotIn("service_tier", body)
        self.assertEqual(body["anthropic_version"], "bedrock-2023-05-31")
        self.assertEqual(body["anthropic_beta"], ["context-1m-2025-08-07", "fine-grained-tool-streaming-2025-05-14"])

    def test_version_is_the_platforms_not_the_clients(self):
        """A client's own ``anthropic_version`` in the body is replaced by Bedrock's."""
        out = wire_for(BEDROCK).outgoing("messages", "/v1/messages", Headers(), "anthropic.claude-x-v1:0", False)
        body = sent_body(out.form, messages_body([{"role": "user", "content": "hi"}], anthropic_version="2026-10-21"))
        self.assertEqual(body["anthropic_version"], "bedrock-2023-05-31")
        self.assertEqual(out.path, "/model/anthropic.claude-x-v1:0/invoke")

    def test_fields_pass_untouched(self):
        """No allowlist: a field Bedrock came to accept (tool search's defer_loading) is never stripped (litellm #26113)."""
        tools = [{"name": "t", "description": "d", "input_schema": {"type": "object"}, "defer_loading": True}]
        body = dict(messages_body([{"role": "user", "content": "hi"}], tools=False), tools=tools,
                    context_management={"edits": []})
        out = wire_for(BEDROCK).outgoing("messages", "/v1/messages", Headers(), "anthropic.claude-x-v1:0", False)
        sent = sent_body(out.form, body)
        self.assertEqual(sent["tools"], tools)
        self.assertEqual(sent["context_management"], {"edits": []})

    def test_arn_in_path(self):
        """An application inference profile's ARN goes with its ``/`` as ``%2F``, its ``:`` as they are."""
        arn = "arn:aws:bedrock:us-east-1:123456789012:application-inference-profile/abc123"
        out = wire_for(BEDROCK).outgoing("messages", "/v1/messages", Headers(), arn, False)
        self.assertEqual(
            out.path, "/model/arn:aws:bedrock:us-east-1:123456789012:application-inference-profile%2Fabc123/invoke"
        )

    def test_inference_profile_prefix_kept(self):
        """A ``global.``/``us.`` profile prefix is the model id, kept whole (litellm #32683)."""
        for model in ("global.anthropic.claude-sonnet-4-5-20250929-v1:0", "us.anthropic.claude-opus-4-6-v1"):
            for kind in ("messages", "count_tokens"):
                out = wire_for(BEDROCK).outgoing(kind, "/v1/messages", Headers(), model, False)
                self.assertTrue(out.path.startswith("/model/%s/" % (model,)), out.path)

    def test_service_tier_header(self):
        """The upstream's service tier goes in Bedrock's header."""
        upstream = Upstream("b", BEDROCK.url, wire="bedrock", region="us-east-1", service_tier="priority")
        out = wire_for(upstream).outgoing("messages", "/v1/messages", Headers(), "m", False)
        self.assertEqual(out.headers.getRawHeaders(b"x-amzn-bedrock-service-tier"), [b"priority"])

    def test_count_tokens_envelope(self):
        """count_tokens goes to CountTokens, the InvokeModel body base64 inside, max_tokens given when missing."""
        out = wire_for(BEDROCK).outgoing("count_tokens", "/v1/messages/count_tokens",
                                         headers(anthropic_beta="b1"), "us.anthropic.claude-opus-4-6-v1", False)
        self.assertEqual(out.path, "/model/us.anthropic.claude-opus-4-6-v1/count-tokens")
        body = {"model": "claude-opus-4-6", "messages": [{"role": "user", "content": "hi"}]}
        prepared = prepare(body, encode(body), None, UpstreamRules(), None, False, 0, out.form)
        outer = ujson.loads(prepared.body)
        inner = ujson.loads(base64.b64decode(outer["input"]["invokeModel"]["body"]))
        self.assertEqual(inner["max_tokens"], 1)
        self.assertEqual(inner["anthropic_version"], "bedrock-2023-05-31")
        self.assertEqual(inner["anthropic_beta"], ["b1"])
        self.assertNotIn("model", inner)
        self.assertEqual(wire_for(BEDROCK).counted(b'{"inputTokens": 42}'), b'{"input_tokens":42}')


class BedrockErrorTests(SynchronousTestCase):
    """Bedrock's errors, as the client gets them."""

    def refusal(self, kind: str, status: int, message: str):
        answer = headers(x_amzn_ErrorType=kind + ":http://internal.amazon.com/coral/com.amazon.bedrock/",
                         x_amzn_RequestId="req-1")
        refusal = wire_for(BEDROCK).refusal("messages", status, answer, ujson.dumps({"message": message}).encode(), "m")
        return refusal, ujson.loads(refusal.body)

    def test_throttling(self):
        refusal, body = self.refusal("ThrottlingException", 429, "Too many requests, please wait before trying again.")
        self.assertEqual((refusal.status, body["error"]["type"]), (429, "rate_limit_error"))
        self.assertIn("Too many requests", body["error"]["message"])
        self.assertEqual(body["request_id"], "req-1")

    def test_unavailable_is_overloaded(self):
        refusal, body = self.refusal("ServiceUnavailableException", 503, "Service unavailable")
        self.assertEqual((refusal.status, body["error"]["type"]), (529, "overloaded_error"))

    def test_input_too_long_is_prompt_too_long(self):
        """Claude Code compacts on Anthropic's wording: the relay's 400 carries it, Bedrock's text kept."""
        refusal, body = self.refusal("ValidationException", 400, "Input is too long for requested model.")
        self.assertEqual((refusal.status, body["error"]["type"]), (400, "invalid_request_error"))
        self.assertIn("prompt is too long", body["error"]["message"])
        self.assertIn("Input is too long for requested model.", body["error"]["message"])

    def test_validation_wording_kept(self):
        """Claude Code's capability retry matches the platform's words: kept verbatim."""
        text = "The model returned the following errors: tools.0.custom.eager_input_streaming: Extra inputs are not permitted"
        refusal, body = self.refusal("ValidationException", 400, text)
        self.assertEqual(refusal.status, 400)
        self.assertIn(text, body["error"]["message"])

    def test_expired_credentials(self):
        """Expired credentials are fetched again and the request sent once more, never the client's 401."""
        refusal, body = self.refusal("ExpiredTokenException", 403, "The security token included in the request is expired")
        self.assertTrue(refusal.expired)
        self.assertEqual(refusal.status, 502)
        self.assertNotEqual(body["error"]["type"], "authentication_error")


class VertexTests(SynchronousTestCase):
    """What an attempt sends to Vertex, and how its errors come back."""

    def test_hosts(self):
        """The hosts of Vertex's locations (``global-aiplatform`` does not exist)."""
        self.assertEqual(cloud_base_url("vertex", "global"), "https://aiplatform.googleapis.com")
        self.assertEqual(cloud_base_url("vertex", "us"), "https://aiplatform.us.rep.googleapis.com")
        self.assertEqual(cloud_base_url("vertex", "eu"), "https://aiplatform.eu.rep.googleapis.com")
        self.assertEqual(cloud_base_url("vertex", "us-east5"), "https://us-east5-aiplatform.googleapis.com")

    def test_paths_and_body(self):
        """rawPredict or streamRawPredict under /v1, model out of the body, stream kept, version in."""
        wire = wire_for(VERTEX)
        out = wire.outgoing("messages", "/v1/messages?beta=true", headers(anthropic_beta="b1"), "claude-sonnet-4-5@20250929", True)
        self.assertEqual(
            out.path,
            "/v1/projects/proj-1/locations/global/publishers/anthropic/models/claude-sonnet-4-5@20250929:streamRawPredict",
        )
        self.assertEqual(out.headers.getRawHeaders(b"anthropic-beta"), [b"b1"])
        body = sent_body(out.form, messages_body([{"role": "user", "content": "hi"}], stream=True))
        self.assertNotIn("model", body)
        self.assertIs(body["stream"], True)
        self.assertEqual(body["anthropic_version"], "vertex-2023-10-16")

    def test_count_tokens_without_betas(self):
        """count-tokens:rawPredict, the model kept in the body, no beta at all (litellm PR #39597)."""
        out = wire_for(VERTEX).outgoing("count_tokens", "/v1/messages/count_tokens",
                                        headers(anthropic_beta="token-counting-2024-11-01"), "claude-opus-4-6", False)
        self.assertTrue(out.path.endswith("/models/count-tokens:rawPredict"))
        self.assertIsNone(out.headers.getRawHeaders(b"anthropic-beta"))
        body = sent_body(out.form, {"model": "claude-opus-4-6", "messages": [{"role": "user", "content": "hi"}]})
        self.assertEqual(body["model"], "claude-opus-4-6")

    def test_refused_beta_learnt(self):
        """A beta Vertex refuses by name is left out for that model, for a while (litellm #19984)."""
        clock = Clock()
        wire = wire_for(VERTEX, clock)
        message = ("Unexpected value(s) `prompt-caching-scope-2026-01-05` for the `anthropic-beta` header. "
                   "Please consult our documentation at docs.anthropic.com or try again without the header.")
        answer = ujson.dumps({"type": "error", "error": {"type": "invalid_request_error", "message": message}}).encode()
        refusal = wire.refusal("messages", 400, Headers(), answer, "claude-opus-4-6")
        self.assertEqual(refusal.unwanted_betas, ("prompt-caching-scope-2026-01-05",))
        client = headers(anthropic_beta="prompt-caching-scope-2026-01-05,context-1m-2025-08-07")
        out = wire.outgoing("messages", "/v1/messages", client, "claude-opus-4-6", False)
        self.assertEqual(out.headers.getRawHeaders(b"anthropic-beta"), [b"context-1m-2025-08-07"])
        other = wire.outgoing("messages", "/v1/messages", client, "claude-haiku-4-5", False)
        self.assertEqual(other.headers.getRawHeaders(b"anthropic-beta"), client.getRawHeaders(b"anthropic-beta"))
        clock.advance(UNWANTED_FOR + 1)
        again = wire.outgoing("messages", "/v1/messages", client, "claude-opus-4-6", False)
        self.assertEqual(again.headers.getRawHeaders(b"anthropic-beta"), client.getRawHeaders(b"anthropic-beta"))

    def test_google_rpc_errors(self):
        """google.rpc errors, an object or an array of them, become Anthropic's envelope and status."""
        quota = {"error": {"code": 429, "message": "Quota exceeded for aiplatform.googleapis.com/"
                           "online_prediction_requests_per_base_model", "status": "RESOURCE_EXHAUSTED"}}
        for answer in (quota, [quota]):
            refusal = wire_for(VERTEX).refusal("messages", 429, Headers(), ujson.dumps(answer).encode(), "m")
            body = ujson.loads(refusal.body)
            self.assertEqual((refusal.status, body["error"]["type"]), (429, "rate_limit_error"))
            self.assertIn("Quota exceeded", body["error"]["message"])
        expired = {"error": {"code": 401, "message": "Request had invalid authentication credentials.",
                             "status": "UNAUTHENTICATED"}}
        self.assertTrue(wire_for(VERTEX).refusal("messages", 401, Headers(), ujson.dumps(expired).encode(), "m").expired)


class ModelIdTests(SynchronousTestCase):
    """A model id a cloud wire puts in its signed URL path."""

    def test_ids_taken(self):
        for model in ("anthropic.claude-opus-4-6-v1", "global.anthropic.claude-sonnet-4-5-20250929-v1:0",
                      "arn:aws:bedrock:us-east-1:123:application-inference-profile/abc", "claude-sonnet-4-5@20250929"):
            check_model_id(model)

    def test_ids_refused(self):
        for model in (None, "", "../../guardrail", "a/../b", "m?x=1", "m#f", "m b", "m\x00"):
            with self.assertRaises(RelayError) as caught:
                check_model_id(model)
            self.assertEqual(caught.exception.status, 400)


class WorkerFormTests(TestCase):
    """A large body's edits are made in its body worker, as they are here."""

    async def test_form_in_a_worker(self):
        pool = BodyPool(reactor, inline_cost=0)
        self.addCleanup(pool.close)
        body = messages_body([{"role": "user", "content": "x" * 1000}], stream=True)
        raw = encode(body)
        request = RequestBody(pool, raw)
        self.assertFalse(request.inline)
        await request.read()
        form = wire_for(BEDROCK).outgoing("messages", "/v1/messages", headers(anthropic_beta="b1"), "m", True).form
        prepared = await request.prepare(None, UpstreamRules(), None, False, False, form)
        here = prepare(body, raw, None, UpstreamRules(), None, False, 0, form)
        self.assertEqual(prepared.body, here.body)
        self.assertNotIn(b'"model"', prepared.body)


class ConfigTests(SynchronousTestCase):
    """A cloud upstream's settings, as a worker process gets them (JSON) and as the file gives them."""

    def test_round_trip(self):
        """``to_dict``/``from_dict`` (how ``--workers`` hands the configuration over) keep every cloud setting."""
        import json

        from twisted_relay.config import LoginSpec, RelayConfig

        upstream = Upstream("b", BEDROCK.url, wire="bedrock", region="us-east-1", service_tier="priority",
                            login=LoginSpec("aws", (("profile", "prod"),)), models=(("claude-opus-4-6", "global.x"),),
                            headers=(("anthropic-workspace-id", "wrkspc_1"),), anthropic_version="bedrock-2023-05-31")
        config = RelayConfig(upstreams=(upstream,))
        again = RelayConfig.from_dict(json.loads(json.dumps(config.to_dict())))
        self.assertEqual(again.upstreams, (upstream,))
        hash(again.upstreams[0])
        self.assertNotIn("prod", repr(again.upstreams[0].login))

    def test_file(self):
        """An ``[upstreams.NAME]`` table of each cloud, and the mistakes refused in one line."""
        from twisted_relay.configfile import ConfigFileError, load

        folder = self.mktemp()
        os.makedirs(folder)
        path = os.path.join(folder, "relay.toml")

        def read(text: str):
            with open(path, "w") as f:
                f.write(text)
            return load(path, {}, environ={"FOUNDRY_KEY": "foundry-secret"})

        settings = read('''
[upstreams.bedrock]
wire = "bedrock"
region = "eu-west-1"
login = { kind = "aws", profile = "prod" }
models = { "claude-opus-4-6" = "eu.anthropic.claude-opus-4-6-v1" }
service-tier = "flex"

[upstreams.vertex]
wire = "vertex"
project = "p1"
region = "us"
login = { kind = "google" }

[upstreams.foundry]
url = "https://res.services.ai.azure.com/anthropic"
login = { kind = "key", key = "env:FOUNDRY_KEY", headers = "x-api-key,api-key" }
''')
        bedrock, vertex, foundry = settings.upstreams
        self.assertEqual(bedrock.url, "https://bedrock-runtime.eu-west-1.amazonaws.com")
        self.assertEqual(bedrock.platform_model("claude-opus-4-6"), "eu.anthropic.claude-opus-4-6-v1")
        self.assertEqual(bedrock.platform_model("claude-haiku-4-5"), "claude-haiku-4-5")
        self.assertEqual(bedrock.service_tier, "flex")
        self.assertEqual(vertex.url, "https://aiplatform.us.rep.googleapis.com")
        self.assertEqual(foundry.login.option("key"), "foundry-secret")
        self.assertNotIn("foundry-secret", repr(settings))
        for table, words in (
            ('wire = "bedrock"', "region"),
            ('wire = "vertex"\nregion = "global"', "project"),
            ('wire = "smoke-signals"\nurl = "https://x"', "wire"),
            ('url = "https://x"\nlogin = { kind = "magic" }', "login"),
            ('url = "https://x"\nservice-tier = "gold"', "service-tier"),
            ('url = "https://x"\nheaders = { "bad header" = "v" }', "headers"),
        ):
            with self.assertRaises(ConfigFileError) as caught:
                read("[upstreams.u]\n" + table + "\n")
            self.assertIn(words, str(caught.exception))
            self.assertEqual(len(str(caught.exception).splitlines()), 1)


class LoginSecretTests(SynchronousTestCase):
    """A login's secret written in the configuration is never taken for a name, nor shown."""

    def test_literal_secrets_never_shown(self):
        from twisted.internet.task import Clock

        from twisted_relay.config import LoginSpec
        from twisted_relay.logins import LoginError, LoginThreads, login_for

        secret = "ABSKQmVkcm9ja0FQSUtleS1zZWNyZXQtdmFsdWU="
        upstream = Upstream("b", BEDROCK.url, wire="bedrock", region="us-east-1",
                            login=LoginSpec("bedrock-api-key", (("key", secret),)))
        login = login_for(upstream, Clock(), LoginThreads(Clock()))
        self.assertNotIn(secret, repr(login))
        unset = Upstream("b", BEDROCK.url, wire="bedrock", region="us-east-1",
                         login=LoginSpec("bedrock-api-key", (("key", "env:TEST_WIRES_UNSET_VARIABLE"),)))
        with self.assertRaises(LoginError) as caught:
            login_for(unset, Clock(), LoginThreads(Clock()))
        self.assertIn("TEST_WIRES_UNSET_VARIABLE", str(caught.exception))

    def test_aws_keys_one_way(self):
        """An AWS login's keys all from the environment, or all written out (a mix signed with "env:X" as the secret)."""
        from twisted_relay.configfile import ConfigFileError, load

        folder = self.mktemp()
        os.makedirs(folder)
        path = os.path.join(folder, "relay.toml")
        with open(path, "w") as f:
            f.write('[upstreams.b]\nwire = "bedrock"\nregion = "us-east-1"\n'
                    'login = { kind = "aws", access-key-id = "AKIAWRITTENOUT", secret-access-key = "env:S" }\n')
        with self.assertRaises(ConfigFileError) as caught:
            load(path, {}, environ={"S": "wJalrXUtnFEMI"})
        self.assertNotIn("AKIAWRITTENOUT", str(caught.exception))
        self.assertNotIn("wJalrXUtnFEMI", str(caught.exception))

    def test_credential_refusals_hide_the_message(self):
        """Bedrock's refusal of the relay's credentials may hold its canonical request (the session token): never echoed."""
        token = "IQoJb3JpZ2luX2VjEXAMPLESESSIONTOKEN"
        message = ("The request signature we calculated does not match the signature you provided.\\n\\n"
                   "The Canonical String for this request should have been\\n'POST\\n/model/x/invoke\\n\\n"
                   "x-amz-security-token:%s'" % (token,))
        for kind in ("InvalidSignatureException", "AccessDeniedException", "UnrecognizedClientException"):
            refusal = wire_for(BEDROCK).refusal("messages", 403, headers(x_amzn_ErrorType=kind),
                                                ujson.dumps({"message": message}).encode(), "m")
            self.assertNotIn(token.encode(), refusal.body)
            self.assertEqual(refusal.status, 502)
