"""
Tests for the simulated Vertex AI (:mod:`twisted_relay.simulated.vertex`)
and the simulated Google token endpoint
(:mod:`twisted_relay.simulated.google_tokens`).

First the official SDK's ``AnthropicVertex`` over real sockets on 127.0.0.1,
with google-auth service-account credentials minted by the simulated token
endpoint: the simulator speaks what real clients parse. Then the rules, in
memory on a Clock.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlencode

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.python.failure import Failure
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase
from twisted.web.server import Site
from treq.testing import StubTreq

from tests.test_simulated import TOOLS, parse_sse
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.google_tokens import (
    CLOUD_PLATFORM,
    GOOGLE_TOKEN_URI,
    JWT_BEARER,
    SimulatedGoogleTokens,
    make_service_account,
)
from twisted_relay.simulated.thinking import BINDING_BETA
from twisted_relay.simulated.vertex import SimulatedVertex, from_vertex_ids, to_vertex_ids

try:
    import anthropic
    from google.auth import crypt, jwt
    from google.oauth2 import service_account
except ImportError:  # pragma: no cover - the test extra installs them
    anthropic = None

PROJECT = "relay-test-1"
EMAIL = "relay@relay-test-1.iam.gserviceaccount.com"
MODEL = "claude-sonnet-4-5"
BASE = "http://vertex.example"
UNEXPECTED = (
    "Unexpected value(s) `%s` for the `anthropic-beta` header. Please consult our documentation at "
    "docs.anthropic.com or try again without the header."
)

_accounts: dict[str, Any] = {}


def test_account(token_uri: str = BASE + "/token"):
    """The test service account (one RSA key for the whole module: making one takes a while)."""
    if "key" not in _accounts:
        _accounts["key"] = make_service_account(EMAIL, PROJECT, token_uri)
    account = _accounts["key"]
    return account._replace(info={**account.info, "token_uri": token_uri})


def vertex_path(model: str = MODEL, method: str = "rawPredict", location: str = "us-east5",
                project: str = PROJECT, version: str = "/v1") -> str:
    return f"{version}/projects/{project}/locations/{location}/publishers/anthropic/models/{model}:{method}"


def vertex_body(messages: list | None = None, **extra: Any) -> dict:
    body = {
        "anthropic_version": "vertex-2023-10-16",
        "max_tokens": 256,
        "messages": messages or [{"role": "user", "content": "Quel temps fait-il ?"}],
        "tools": TOOLS,
    }
    body.update(extra)
    return body


def _result(d: Deferred) -> Any:
    results: list = []
    d.addBoth(results.append)
    if not results:
        raise AssertionError("the Deferred has not fired")
    if isinstance(results[0], Failure):
        results[0].raiseException()
    return results[0]


class _Vertex:
    """A simulated Vertex behind StubTreq, on a Clock at today's time."""

    def __init__(self, upstream: dict | None = None, lifetime: int = 3599, **options: Any):
        self.clock = Clock()
        self.clock.advance(time.time())
        self.upstream = SimulatedUpstream(reactor=self.clock, **(upstream or {}))
        account = test_account()
        self.tokens = SimulatedGoogleTokens(self.clock, {EMAIL: account.public_key}, lifetime=lifetime,
                                            metadata_account=EMAIL, project_id=PROJECT)
        self.vertex = SimulatedVertex(self.upstream, PROJECT, self.tokens, **options)
        self.stub = StubTreq(self.vertex.resource())
        self.token = self.tokens.issue(EMAIL, [CLOUD_PLATFORM])[0]

    def settle(self) -> None:
        for _ in range(10_000):
            self.stub.flush()
            if not self.clock.getDelayedCalls():
                break
            self.clock.advance(0.01)
        self.stub.flush()

    def request(self, method: str, path: str, data: bytes | None, headers: dict) -> tuple[Any, bytes]:
        d = self.stub.request(method, BASE + path, data=data, headers=headers)
        self.settle()
        response = _result(d)
        content = self.stub.content(response)
        self.settle()
        return response, _result(content)

    def post(self, body: Any, path: str | None = None, headers: dict | None = None,
             token: str | None = "default") -> tuple[Any, Any]:
        sent = {"content-type": "application/json", **(headers or {})}
        if token is not None:
            sent["authorization"] = "Bearer " + (self.token if token == "default" else token)
        data = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
        response, content = self.request("POST", path or vertex_path(), data, sent)
        kind = response.headers.getRawHeaders("content-type", [""])[0]
        if kind.startswith("application/json"):
            return response, json.loads(content)
        return response, content

    def grant(self, form: dict) -> tuple[Any, dict]:
        data = urlencode(form).encode("ascii")
        response, content = self.request(
            "POST", "/token", data, {"content-type": "application/x-www-form-urlencoded"}
        )
        return response, json.loads(content)


def assertion(**claims: Any) -> str:
    """An assertion as google-auth's service account signs it, with ``claims`` laid over."""
    now = int(time.time())
    payload = {"iss": EMAIL, "aud": GOOGLE_TOKEN_URI, "scope": CLOUD_PLATFORM, "iat": now, "exp": now + 3600}
    payload.update(claims)
    payload = {key: value for key, value in payload.items() if value is not None}
    signer = crypt.RSASigner.from_service_account_info(test_account().info)
    return jwt.encode(signer, payload).decode("ascii")


class _NeedsGoogle:
    def setUp(self) -> None:
        if anthropic is None:
            raise SkipTest("the anthropic SDK and google-auth are not installed (pip install '.[test]')")


# -- the SDK over sockets -----------------------------------------------------


class SDKTests(_NeedsGoogle, TestCase):
    """``anthropic.AnthropicVertex`` gets what it expects, its token minted by google-auth."""

    def serve(self, lifetime: int = 3599) -> tuple[SimulatedVertex, str]:
        upstream = SimulatedUpstream(reactor=reactor, seed=3)
        tokens = SimulatedGoogleTokens(reactor, lifetime=lifetime)
        vertex = SimulatedVertex(upstream, PROJECT, tokens)
        port = reactor.listenTCP(0, Site(vertex.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        base = "http://127.0.0.1:%d" % (port.getHost().port,)
        tokens.add_service_account(EMAIL, test_account().public_key)
        return vertex, base

    def client(self, base: str, **options: Any):
        if "access_token" not in options:
            account = test_account(base + "/token")
            options["credentials"] = service_account.Credentials.from_service_account_info(
                account.info, scopes=[CLOUD_PLATFORM]
            )
        return anthropic.AnthropicVertex(region="us-east5", project_id=PROJECT, base_url=base + "/v1",
                                         max_retries=0, timeout=30, **options)

    async def test_messages_and_count(self) -> None:
        """
        With service-account credentials whose token endpoint is the
        simulator: ``messages.create``, a stream and ``count_tokens`` answer as
        Claude on Vertex (``msg_vrtx_``, ``toolu_vrtx_``, ``req_vrtx_``); a
        tool-use id the client sends back is the fake model's own.
        """
        vertex, base = self.serve()

        def session():
            client = self.client(base)
            try:
                messages = [{"role": "user", "content": "Weather in Lyon?"}]
                first = client.messages.with_raw_response.create(
                    model="claude-sonnet-4-5@20250929", max_tokens=200, messages=messages, tools=TOOLS
                )
                message = first.parse()
                content = [block.model_dump(exclude_none=True) for block in message.content]
                messages += [{"role": "assistant", "content": content},
                             {"role": "user", "content": [
                                 {"type": "tool_result", "tool_use_id": block["id"], "content": "sunny"}
                                 for block in content if block["type"] == "tool_use"] or "Go on."}]
                with client.messages.stream(model=MODEL, max_tokens=200, messages=messages, tools=TOOLS) as events:
                    streamed = events.get_final_message()
                counted = client.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS)
                return first.headers.get("request-id"), message, streamed, counted
            finally:
                client.close()

        request_id, message, streamed, counted = await deferToThread(session)
        self.assertTrue(request_id.startswith("req_vrtx_01"), request_id)
        self.assertTrue(message.id.startswith("msg_vrtx_01"), message.id)
        self.assertEqual(message.model, "claude-sonnet-4-5-20250929")
        uses = [block.id for block in message.content if block.type == "tool_use"]
        self.assertTrue(uses and all(use.startswith("toolu_vrtx_01") for use in uses), uses)
        self.assertTrue(streamed.id.startswith("msg_vrtx_01"))
        self.assertEqual(streamed.stop_reason, message.stop_reason)
        self.assertGreater(counted.input_tokens, 0)
        # The path and body the SDK sent: model in the path, version in the body.
        sent = list(vertex.upstream.requests)
        self.assertEqual(sent[0].path, "/v1" + vertex_path(model="claude-sonnet-4-5@20250929", version=""))
        self.assertEqual(sent[1].path, "/v1" + vertex_path(method="streamRawPredict", version=""))
        self.assertNotIn("model", sent[0].body)
        self.assertIs(sent[1].body["stream"], True)
        self.assertEqual(sent[2].path, "/v1" + vertex_path(model="count-tokens", version=""))
        self.assertEqual(sent[2].body["model"], MODEL)
        self.assertEqual(vertex.tokens.minted, 1)

    async def test_refusals(self) -> None:
        """
        What the SDK sees of Vertex's refusals: an unknown beta (400, Anthropic's
        envelope, the exact wording), the SDK's own count-tokens beta on
        count-tokens, and a token nobody minted (401 ``google.rpc``).
        """
        _, base = self.serve()

        def refusals():
            client = self.client(base)
            stranger = self.client(base, access_token="ya29.made-up")
            found = []
            hello = [{"role": "user", "content": "x"}]
            calls = [
                lambda: client.messages.create(model=MODEL, max_tokens=10, messages=hello,
                                               extra_headers={"anthropic-beta": "prompt-caching-scope-2026-01-05"}),
                lambda: client.beta.messages.count_tokens(model=MODEL, messages=hello),
                lambda: stranger.messages.create(model=MODEL, max_tokens=10, messages=hello),
            ]
            try:
                for call in calls:
                    try:
                        call()
                    except anthropic.APIStatusError as error:
                        found.append((error.status_code, error.body))
                    else:
                        found.append(None)
            finally:
                client.close()
                stranger.close()
            return found

        beta, count_beta, unknown = await deferToThread(refusals)
        self.assertEqual(beta[0], 400)
        self.assertEqual(beta[1]["error"], {"type": "invalid_request_error",
                                            "message": UNEXPECTED % "prompt-caching-scope-2026-01-05"})
        self.assertTrue(beta[1]["request_id"].startswith("req_vrtx_"))
        self.assertEqual(count_beta[0], 400)
        self.assertEqual(count_beta[1]["error"]["message"], UNEXPECTED % "token-counting-2024-11-01")
        self.assertEqual(unknown[0], 401)
        self.assertEqual(unknown[1]["error"]["status"], "UNAUTHENTICATED")


# -- routes and Google's layer ------------------------------------------------


class RouteTests(_NeedsGoogle, SynchronousTestCase):
    """The paths Vertex serves, and what Google's layer refuses before the model reads a request."""

    def test_with_and_without_version(self) -> None:
        """``/v1/projects/...`` and ``/projects/...`` are both served; with
        ``require_version`` the versionless path is a 404, as on Vertex."""
        sim = _Vertex()
        for version in ("/v1", ""):
            response, answer = sim.post(vertex_body(), vertex_path(version=version))
            self.assertEqual(response.code, 200, answer)
            self.assertEqual(answer["type"], "message")
        strict = _Vertex(require_version=True)
        response, answer = strict.post(vertex_body(), vertex_path(version=""))
        self.assertEqual(response.code, 404)
        self.assertEqual(answer["error"]["status"], "NOT_FOUND")
        self.assertEqual(strict.post(vertex_body(), vertex_path())[0].code, 200)

    def test_tokens(self) -> None:
        """No token, a token nobody minted, an expired one: 401 ``UNAUTHENTICATED``
        with the reason; a token without the cloud-platform scope: 403."""
        sim = _Vertex(lifetime=100)
        cases = {
            None: "CREDENTIALS_MISSING",
            "ya29.nobody-minted-this": "ACCESS_TOKEN_TYPE_UNSUPPORTED",
        }
        for token, reason in cases.items():
            response, answer = sim.post(vertex_body(), token=token)
            self.assertEqual(response.code, 401)
            self.assertEqual(answer["error"]["status"], "UNAUTHENTICATED")
            self.assertEqual(answer["error"]["details"][0]["reason"], reason)
            self.assertEqual(response.headers.getRawHeaders("www-authenticate"),
                             ['Bearer realm="https://accounts.google.com/"'])
        self.assertEqual(sim.post(vertex_body())[0].code, 200)
        sim.clock.advance(100)
        response, answer = sim.post(vertex_body())
        self.assertEqual(response.code, 401)
        self.assertEqual(answer["error"]["message"], (
            "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or "
            "other valid authentication credential. See https://developers.google.com/identity/sign-in/web/"
            "devconsole-project."))
        self.assertEqual(answer["error"]["details"][0]["reason"], "ACCESS_TOKEN_EXPIRED")
        narrow = sim.tokens.issue(EMAIL, ["https://www.googleapis.com/auth/userinfo.email"])[0]
        response, answer = sim.post(vertex_body(), token=narrow)
        self.assertEqual((response.code, answer["error"]["status"]), (403, "PERMISSION_DENIED"))

    def test_project_location_model(self) -> None:
        """Another project is a 403; a location, publisher or model Vertex does not
        serve a 404 ``Publisher Model ... was not found``; today's models only at
        the global and multi-region endpoints."""
        sim = _Vertex()
        response, answer = sim.post(vertex_body(), vertex_path(project="someone-else"))
        self.assertEqual((response.code, answer["error"]["status"]), (403, "PERMISSION_DENIED"))
        self.assertIn("'aiplatform.endpoints.predict' denied", answer["error"]["message"])
        for path in (vertex_path(location="mars-north1"), vertex_path(model="claude-nonexistent-9"),
                     vertex_path().replace("/anthropic/", "/google/"), vertex_path(model="claude-opus-5-5")):
            response, answer = sim.post(vertex_body(), path)
            self.assertEqual(response.code, 404, path)
            self.assertEqual(answer["error"]["status"], "NOT_FOUND")
            self.assertRegex(answer["error"]["message"], r"^Publisher Model `projects/relay-test-1/locations/.*"
                                                         r"` was not found or your project does not have access")
        for location in ("global", "us", "eu"):
            path = vertex_path(model="claude-opus-5-5", location=location)
            self.assertEqual(sim.post(vertex_body(), path)[0].code, 200, location)
        self.assertEqual(sim.post(vertex_body(), vertex_path(model="claude-haiku-4-5@20251001"))[0].code, 200)

    def test_quota(self) -> None:
        """``quota_errors``: 429 ``RESOURCE_EXHAUSTED`` naming the base model, an
        object on rawPredict and a JSON array on streamRawPredict (as
        Google's streaming methods answer); ``error_arrays`` says otherwise."""
        sim = _Vertex(quota_errors=1.0)
        response, answer = sim.post(vertex_body(), vertex_path(model="claude-sonnet-4-5@20250929"))
        self.assertEqual(response.code, 429)
        self.assertEqual(answer["error"]["status"], "RESOURCE_EXHAUSTED")
        self.assertEqual(answer["error"]["code"], 429)
        self.assertTrue(answer["error"]["message"].startswith(
            "Quota exceeded for aiplatform.googleapis.com/online_prediction_requests_per_base_model with base "
            "model: anthropic-claude-sonnet-4-5. Please submit a quota increase request."))
        response, answer = sim.post(vertex_body(stream=True), vertex_path(method="streamRawPredict"))
        self.assertEqual(response.code, 429)
        self.assertEqual([entry["error"]["status"] for entry in answer], ["RESOURCE_EXHAUSTED"])
        sim.vertex.quota_errors = 0.0
        self.assertEqual(sim.post(vertex_body())[0].code, 200)
        always = _Vertex(quota_errors=1.0, error_arrays="always")
        self.assertIsInstance(always.post(vertex_body())[1], list)
        never = _Vertex(quota_errors=1.0, error_arrays="never")
        self.assertIsInstance(never.post(vertex_body(stream=True), vertex_path(method="streamRawPredict"))[1], dict)

    def test_quota_share(self) -> None:
        """A share of requests, drawn in order from the seed: the same on every run."""
        codes = []
        for _ in range(2):
            sim = _Vertex(quota_errors=0.5)
            codes.append([sim.post(vertex_body())[0].code for _ in range(20)])
        self.assertEqual(codes[0], codes[1])
        self.assertEqual(set(codes[0]), {200, 429})


# -- the body -----------------------------------------------------------------


class BodyTests(_NeedsGoogle, SynchronousTestCase):
    """What Claude on Vertex requires of the body, and refuses in Anthropic's envelope."""

    def assert_refused(self, response: Any, answer: dict, message: str) -> None:
        self.assertEqual(response.code, 400)
        self.assertEqual(answer["type"], "error")
        self.assertEqual(answer["error"], {"type": "invalid_request_error", "message": message})
        self.assertTrue(answer["request_id"].startswith("req_vrtx_01"))
        self.assertEqual(response.headers.getRawHeaders("request-id"), [answer["request_id"]])

    def test_anthropic_version(self) -> None:
        """``anthropic_version`` is required in the body (count-tokens too);
        ``vertex-2023-10-16`` and ``2026-10-21`` are taken, and ``2026-10-21``
        is today's API version (sampling parameters refused)."""
        sim = _Vertex()
        body = vertex_body()
        del body["anthropic_version"]
        self.assert_refused(*sim.post(body), "anthropic_version: Field required")
        self.assert_refused(*sim.post({**body, "model": MODEL}, vertex_path(model="count-tokens")),
                            "anthropic_version: Field required")
        self.assert_refused(*sim.post(vertex_body(anthropic_version="2023-06-01")),
                            "anthropic_version: Input should be 'vertex-2023-10-16' or '2026-10-21'")
        self.assertEqual(sim.post(vertex_body(temperature=0.5))[0].code, 200)
        self.assert_refused(*sim.post(vertex_body(anthropic_version="2026-10-21", temperature=0.5)),
                            "temperature: Extra inputs are not permitted")

    def test_model_in_body(self) -> None:
        """rawPredict's model is the path's: one in the body is a 400; count-tokens
        keeps it in the body."""
        sim = _Vertex()
        self.assert_refused(*sim.post(vertex_body(model=MODEL)), "model: Extra inputs are not permitted")
        response, answer = sim.post(vertex_body(model=MODEL), vertex_path(model="count-tokens"))
        self.assertEqual(response.code, 200, answer)
        self.assertGreater(answer["input_tokens"], 0)
        response, answer = sim.post(vertex_body(model="claude-nonexistent-9"), vertex_path(model="count-tokens"))
        self.assertEqual(response.code, 404)

    def test_stream_is_read(self) -> None:
        """``stream`` stays in the body: a streamed answer is Anthropic's SSE with
        Vertex's ids, and the model read ``stream: true``."""
        sim = _Vertex()
        response, data = sim.post(vertex_body(stream=True), vertex_path(method="streamRawPredict"))
        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["text/event-stream; charset=utf-8"])
        events = parse_sse(data)
        self.assertEqual([name for name, _ in events][0], "message_start")
        self.assertEqual(events[-1][0], "message_stop")
        self.assertTrue(events[0][1]["message"]["id"].startswith("msg_vrtx_01"))
        uses = [data["content_block"]["id"] for name, data in events
                if name == "content_block_start" and data["content_block"]["type"] == "tool_use"]
        self.assertTrue(uses and all(use.startswith("toolu_vrtx_01") for use in uses))
        self.assertIs(sim.upstream.requests[-1].body["stream"], True)

    def test_betas(self) -> None:
        """An ``anthropic-beta`` value the simulated Vertex does not take is a 400
        with Anthropic's exact words (every one named); known ones pass;
        count-tokens takes none."""
        sim = _Vertex()
        headers = {"anthropic-beta": "interleaved-thinking-2025-05-14, effort-2025-11-24,adaptive-thinking-2026-01-28"}
        self.assert_refused(*sim.post(vertex_body(), headers=headers),
                            UNEXPECTED % "effort-2025-11-24`, `adaptive-thinking-2026-01-28")
        known = {"anthropic-beta": "interleaved-thinking-2025-05-14,context-1m-2025-08-07"}
        self.assertEqual(sim.post(vertex_body(), headers=known)[0].code, 200)
        count = vertex_path(model="count-tokens")
        self.assert_refused(*sim.post(vertex_body(model=MODEL), count, headers=known),
                            UNEXPECTED % "interleaved-thinking-2025-05-14`, `context-1m-2025-08-07")
        self.assert_refused(*sim.post(vertex_body(model=MODEL), count,
                                      headers={"anthropic-beta": "token-counting-2024-11-01"}),
                            UNEXPECTED % "token-counting-2024-11-01")
        narrow = _Vertex(betas={"effort-2025-11-24"})
        self.assertEqual(narrow.post(vertex_body(), headers={"anthropic-beta": "effort-2025-11-24"})[0].code, 200)

    def test_mid_stream_error(self) -> None:
        """The upstream's ``stream_errors`` cut a stream with an ``overloaded_error``
        event carrying the ``req_vrtx_`` request id."""
        sim = _Vertex(upstream={"stream_errors": 1.0})
        response, data = sim.post(vertex_body(stream=True), vertex_path(method="streamRawPredict"))
        self.assertEqual(response.code, 200)
        name, error = parse_sse(data)[-1]
        self.assertEqual(name, "error")
        self.assertEqual(error["error"]["type"], "overloaded_error")
        self.assertEqual(error["request_id"], response.headers.getRawHeaders("request-id")[0])
        self.assertTrue(error["request_id"].startswith("req_vrtx_01"))

    def test_model_errors_in_anthropic_envelope(self) -> None:
        """The fake model's own 400s come in Anthropic's envelope with a ``req_vrtx_`` id."""
        sim = _Vertex()
        response, answer = sim.post(vertex_body(messages=[{"role": "robot", "content": "x"}]))
        self.assertEqual(response.code, 400)
        self.assertEqual(answer["error"]["type"], "invalid_request_error")
        self.assertTrue(answer["request_id"].startswith("req_vrtx_01"))


class IdTests(_NeedsGoogle, SynchronousTestCase):
    """Vertex's ids on the wire, the fake model's ids in its world."""

    def test_round_trip(self) -> None:
        """``to_vertex_ids`` prefixes the message id and the tool-use ids (nested
        too), ``from_vertex_ids`` takes the prefix off again; other ids stay."""
        message = {"id": "msg_01A", "content": [
            {"type": "tool_use", "id": "toolu_01B", "name": "x", "input": {"id": "toolu_in_input"}},
            {"type": "server_tool_use", "id": "srvtoolu_01C", "name": "web_search", "input": {}},
        ]}
        vertex = to_vertex_ids(message)
        self.assertEqual(vertex["id"], "msg_vrtx_01A")
        self.assertEqual(vertex["content"][0]["id"], "toolu_vrtx_01B")
        self.assertEqual(vertex["content"][1]["id"], "srvtoolu_01C")
        self.assertEqual(message["content"][0]["id"], "toolu_01B", "the answer itself is not changed")
        history = [{"role": "assistant", "content": vertex["content"]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_vrtx_01B"}]}]
        plain = from_vertex_ids(history)
        self.assertEqual(plain[0]["content"][0]["id"], "toolu_01B")
        self.assertEqual(plain[1]["content"][0]["tool_use_id"], "toolu_01B")

    def test_reuse_and_stateful_mode(self) -> None:
        """A stateful fake model that reuses ids on every call: over several turns
        each reused id is one the client holds in its ``toolu_vrtx_`` form, and
        the model's ledger takes the client's history back exactly."""
        sim = _Vertex(upstream={"mode": "stateful", "reuse_every": 2})
        messages: list = [{"role": "user", "content": "Check every city, one call at a time."}]
        held: list[str] = []
        reused = 0
        for _ in range(6):
            response, answer = sim.post(vertex_body(messages))
            self.assertEqual(response.code, 200, answer)
            ids = [block["id"] for block in answer["content"] if block["type"] == "tool_use"]
            self.assertTrue(all(i.startswith("toolu_vrtx_") for i in ids), ids)
            reused += len([i for i in ids if i in held])
            held += ids
            messages += [{"role": "assistant", "content": answer["content"]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": "ok"}
                                                      for i in ids] or "Go on."}]
        self.assertGreater(reused, 0, "the fake model reused no id")

    def test_account_is_the_project(self) -> None:
        """Account-bound thinking (Sonnet 5.5) replayed with another token of the
        same project is read: a refreshed token is not another account."""
        sim = _Vertex()
        path = vertex_path(model="claude-sonnet-5-5", location="global")
        beta = {"anthropic-beta": BINDING_BETA}
        messages: list = [{"role": "user", "content": "Fais le tour des outils."}]
        for _ in range(2):
            response, answer = sim.post(vertex_body(messages), path, headers=beta)
            self.assertEqual(response.code, 200, answer)
            ids = [block["id"] for block in answer["content"] if block["type"] == "tool_use"]
            messages += [{"role": "assistant", "content": answer["content"]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": "ok"}
                                                      for i in ids] or "Go on."}]
        self.assertEqual(answer["input_transformations"], [])
        other = sim.tokens.issue(EMAIL, [CLOUD_PLATFORM])[0]
        response, answer = sim.post(vertex_body(messages), path, headers=beta, token=other)
        self.assertEqual(response.code, 200, answer)
        self.assertEqual(answer["input_transformations"], [])


# -- the token endpoint -------------------------------------------------------


class TokenEndpointTests(_NeedsGoogle, SynchronousTestCase):
    """The RFC 7523 grant, checked as Google checks it, answered in OAuth2's words."""

    def test_grant(self) -> None:
        """An assertion google-auth signs with the service account's key gets a
        bearer token of the configured lifetime, good on the Vertex routes."""
        sim = _Vertex(lifetime=42)
        response, answer = sim.grant({"grant_type": JWT_BEARER, "assertion": assertion()})
        self.assertEqual(response.code, 200, answer)
        self.assertEqual(answer["token_type"], "Bearer")
        self.assertEqual(answer["expires_in"], 42)
        self.assertEqual(sim.post(vertex_body(), token=answer["access_token"])[0].code, 200)
        sim.clock.advance(42)
        self.assertEqual(sim.post(vertex_body(), token=answer["access_token"])[0].code, 401)

    def test_refusals(self) -> None:
        """A bad signature, an unknown account, the wrong audience, a stale or
        too long-lived assertion, no scope, another grant type: 400 with
        Google's error and description."""
        sim = _Vertex()
        now = int(time.time())
        good = assertion()
        head, _, signature = good.split(".")
        tampered = ".".join((head, assertion(scope=CLOUD_PLATFORM + " x").split(".")[1], signature))
        cases = [
            ({"assertion": tampered}, "invalid_grant", "Invalid JWT Signature."),
            ({"assertion": "not-a-jwt"}, "invalid_grant", "Invalid JWT"),
            ({"assertion": assertion(iss="someone@else.iam.gserviceaccount.com")}, "invalid_grant",
             "Invalid grant: account not found"),
            ({"assertion": assertion(aud="https://example.com/token")}, "invalid_grant",
             "Invalid JWT: Failed audience check. The right audience is https://oauth2.googleapis.com/token"),
            ({"assertion": assertion(iat=now - 7200, exp=now - 3600)}, "invalid_grant", "short-lived token"),
            ({"assertion": assertion(exp=now + 7200)}, "invalid_grant", "short-lived token (60 minutes)"),
            ({"assertion": assertion(scope=None)}, "invalid_scope",
             "Invalid OAuth scope or ID token audience provided."),
            ({"grant_type": "client_credentials", "assertion": good}, "unsupported_grant_type",
             "Invalid grant_type: client_credentials"),
        ]
        for form, error, description in cases:
            response, answer = sim.grant({"grant_type": JWT_BEARER, **form})
            self.assertEqual(response.code, 400, form)
            self.assertEqual(answer["error"], error, form)
            self.assertIn(description, answer["error_description"], form)
        self.assertEqual(sim.tokens.minted, 1, "only the token the test issued itself")

    def test_metadata_server(self) -> None:
        """The metadata routes answer only with ``Metadata-Flavor: Google``, say
        who the default account is, and mint tokens good on Vertex."""
        sim = _Vertex()
        root = "/computeMetadata/v1/instance/service-accounts/default/"
        response, _ = sim.request("GET", root + "token", None, {})
        self.assertEqual(response.code, 403)
        flavor = {"metadata-flavor": "Google"}
        response, content = sim.request("GET", root + "?recursive=true", None, flavor)
        self.assertEqual(json.loads(content)["email"], EMAIL)
        response, content = sim.request("GET", root + "token?scopes=" + CLOUD_PLATFORM, None, flavor)
        self.assertEqual(response.headers.getRawHeaders("metadata-flavor"), ["Google"])
        token = json.loads(content)["access_token"]
        self.assertEqual(sim.post(vertex_body(), token=token)[0].code, 200)
        response, content = sim.request("GET", "/computeMetadata/v1/project/project-id", None, flavor)
        self.assertEqual(content, PROJECT.encode("ascii"))
