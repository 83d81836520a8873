"""
Tests for :mod:`twisted_relay.simulated.foundry`: the simulated Microsoft
Foundry endpoint and Azure's managed-identity endpoint.

In memory (StubTreq on a Clock) for the rules; on 127.0.0.1 for what the
official clients parse: Anthropic's ``AnthropicFoundry`` with a key and
with a token from azure-identity's ``ManagedIdentityCredential``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Site
from treq.testing import StubTreq

from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.foundry import (
    ANTHROPIC_HOSTED,
    DEFAULT_DEPLOYMENTS,
    Deployment,
    SimulatedFoundry,
    SimulatedIdentity,
)

try:
    import anthropic
    from azure.identity import ManagedIdentityCredential
except ImportError:  # pragma: no cover - the test extra installs both
    anthropic = None

BASE = "http://res.example"
KEY = "foundry-key-1"
VERSION = {"anthropic-version": "2023-06-01"}
MODEL = "claude-sonnet-4-5"


def set_environment(testcase, values: dict[str, str]) -> None:
    """Set environment variables for one test (azure-identity reads ``os.environ``)."""
    for name, value in values.items():
        old = os.environ.get(name)
        os.environ[name] = value
        testcase.addCleanup(_restore, name, old)


def _restore(name: str, old: str | None) -> None:
    if old is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = old


def body(**extra: Any) -> dict:
    return {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **extra}


class _Foundry:
    """A simulated Foundry (and identity endpoint) behind StubTreq, on a Clock."""

    def __init__(self, **options: Any):
        self.clock = Clock()
        self.clock.advance(1_800_000_000)
        self.identity = SimulatedIdentity(lifetime=60, reactor=self.clock)
        self.upstream = SimulatedUpstream(mode="lenient", reactor=self.clock)
        self.foundry = SimulatedFoundry(self.upstream, identity=self.identity, **options)
        self.stub = StubTreq(self.foundry.resource())

    def settle(self) -> None:
        for _ in range(1000):
            self.stub.flush()
            if not self.clock.getDelayedCalls():
                break
            self.clock.advance(0.01)
        self.stub.flush()

    def request(self, method: str, path: str, payload: Any = None, headers: dict | None = None):
        data = None if payload is None else json.dumps(payload).encode()
        d = self.stub.request(method, BASE + path, data=data, headers=headers or {})
        self.settle()
        response = self.stub_result(d)
        content = self.stub.content(response)
        self.settle()
        return response, self.stub_result(content)

    def stub_result(self, d):
        results: list = []
        d.addBoth(results.append)
        assert results, "the Deferred has not fired"
        if hasattr(results[0], "raiseException"):
            results[0].raiseException()
        return results[0]

    def post(self, payload: Any, headers: dict, path: str = "/anthropic/v1/messages"):
        response, content = self.request("POST", path, payload, headers)
        if response.headers.getRawHeaders("content-type", [""])[0].startswith("application/json"):
            return response, json.loads(content)
        return response, content

    def token(self, resource: str = "https://ai.azure.com") -> str:
        response, content = self.request(
            "GET",
            "/msi/token?api-version=2019-08-01&resource=" + resource,
            headers={"X-IDENTITY-HEADER": self.identity.header},
        )
        assert response.code == 200, content
        return json.loads(content)["access_token"]


class FoundryKeyTests(SynchronousTestCase):
    """Keys, deployments and the headers of the answers."""

    def setUp(self) -> None:
        self.sim = _Foundry(
            deployments={**DEFAULT_DEPLOYMENTS, "team-sonnet": Deployment(MODEL)},
        )

    def test_key_in_either_header(self) -> None:
        """A resource key is taken in api-key or in x-api-key."""
        for name in ("api-key", "x-api-key"):
            response, answer = self.sim.post(body(), {name: KEY, **VERSION})
            self.assertEqual((response.code, answer["type"]), (200, "message"), name)

    def test_answer_headers(self) -> None:
        """Every answer has apim-request-id and request-id, and no Anthropic rate-limit header."""
        response, _ = self.sim.post(body(), {"api-key": KEY, **VERSION})
        names = [name.decode().lower() for name, _ in response.headers.getAllRawHeaders()]
        self.assertIn("apim-request-id", names)
        self.assertIn("request-id", names)
        self.assertEqual([name for name in names if name.startswith("anthropic-ratelimit-")], [])

    def test_deployment_maps_to_its_model(self) -> None:
        """The model field is a deployment name: the fake model answers as the deployment's model."""
        response, answer = self.sim.post(body(model="team-sonnet"), {"api-key": KEY, **VERSION})
        self.assertEqual(response.code, 200)
        self.assertEqual(answer["model"], MODEL)
        seen = self.sim.upstream.requests[-1]
        self.assertEqual((seen.path, seen.body["model"]), ("/v1/messages", MODEL))

    def test_unknown_deployment(self) -> None:
        """An unknown deployment is Azure's 404 DeploymentNotFound, in Azure's shape."""
        response, answer = self.sim.post(body(model="claude-opus-9"), {"api-key": KEY, **VERSION})
        self.assertEqual(response.code, 404)
        self.assertEqual(answer["error"]["code"], "DeploymentNotFound")
        self.assertIn("The API deployment for this resource does not exist.", answer["error"]["message"])

    def test_wrong_or_missing_key(self) -> None:
        """A wrong key and no key are Azure's 401s, not Anthropic's envelope."""
        response, answer = self.sim.post(body(), {"api-key": "not-the-key", **VERSION})
        self.assertEqual(response.code, 401)
        self.assertIn("invalid subscription key", answer["error"]["message"])
        response, answer = self.sim.post(body(), dict(VERSION))
        self.assertEqual(response.code, 401)
        self.assertIn("missing subscription key", answer["error"]["message"])

    def test_version_required(self) -> None:
        """Without anthropic-version: Anthropic's 400."""
        response, answer = self.sim.post(body(), {"api-key": KEY})
        self.assertEqual(response.code, 400)
        self.assertEqual(answer["error"]["message"], "anthropic-version: header is required")
        self.assertEqual(answer["request_id"], response.headers.getRawHeaders("request-id")[0])

    def test_count_tokens(self) -> None:
        """count_tokens goes through the deployment map too."""
        payload = {"model": "team-sonnet", "messages": [{"role": "user", "content": "hi"}]}
        response, answer = self.sim.post(payload, {"api-key": KEY, **VERSION}, "/anthropic/v1/messages/count_tokens")
        self.assertEqual(response.code, 200)
        self.assertGreater(answer["input_tokens"], 0)

    def test_other_paths(self) -> None:
        """Anything but the two Messages routes is Azure's 404 (no models list, no batches)."""
        response, answer = self.sim.post({}, {"api-key": KEY, **VERSION}, "/anthropic/v1/messages/batches")
        self.assertEqual((response.code, answer["error"]["code"]), (404, "404"))

    def test_stream(self) -> None:
        """A streamed answer is Anthropic's SSE, through to message_stop."""
        response, content = self.sim.post(body(stream=True), {"x-api-key": KEY, **VERSION})
        self.assertEqual(response.code, 200)
        self.assertIn(b"event: message_start", content)
        self.assertTrue(content.rstrip().endswith(b'data: {"type":"message_stop"}'))


class AzureHostedTests(SynchronousTestCase):
    """A deployment hosted on Azure refuses what Azure does not run; one on Anthropic takes it."""

    def setUp(self) -> None:
        self.sim = _Foundry(
            deployments={
                "on-azure": Deployment(MODEL),
                "on-anthropic": Deployment(MODEL, ANTHROPIC_HOSTED),
            }
        )
        self.headers = {"api-key": KEY, **VERSION}

    def refused(self, **extra: Any) -> str:
        response, answer = self.sim.post(body(model="on-azure", **extra), self.headers)
        self.assertEqual((response.code, answer["error"]["type"]), (400, "invalid_request_error"))
        accepted, _ = self.sim.post(body(model="on-anthropic", **extra), self.headers)
        self.assertEqual(accepted.code, 200)
        return answer["error"]["message"]

    def test_server_tools(self) -> None:
        """Web search and code execution are refused, naming the tool."""
        message = self.refused(tools=[{"type": "web_search_20250305", "name": "web_search"}])
        self.assertTrue(message.startswith("tools.0: The web_search_20250305 tool is not supported"))
        message = self.refused(tools=[
            {"name": "Bash", "input_schema": {"type": "object"}},
            {"type": "code_execution_20250825", "name": "code_execution"},
        ])
        self.assertTrue(message.startswith("tools.1: The code_execution_20250825 tool"))

    def test_mcp_connector(self) -> None:
        """The MCP connector (mcp_servers) is refused."""
        servers = [{"type": "url", "url": "https://mcp.example/sse", "name": "x"}]
        self.assertTrue(self.refused(mcp_servers=servers).startswith("mcp_servers: The MCP connector"))

    def test_structured_outputs(self) -> None:
        """Structured outputs are refused (output_config.format and the beta's output_format)."""
        schema = {"type": "json_schema", "schema": {"type": "object"}}
        self.assertTrue(self.refused(output_config={"format": schema}).startswith("output_config.format:"))
        self.assertTrue(self.refused(output_format=schema).startswith("output_format:"))

    def test_client_tools_pass(self) -> None:
        """Client tools are fine on Azure."""
        tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
        response, _ = self.sim.post(body(model="on-azure", tools=tools), self.headers)
        self.assertEqual(response.code, 200)


class EntraTokenTests(SynchronousTestCase):
    """The Foundry routes take only tokens the identity endpoint minted, for Foundry, unexpired."""

    def setUp(self) -> None:
        self.sim = _Foundry()

    def post_with(self, token: str) -> tuple[Any, Any]:
        return self.sim.post(body(), {"authorization": "Bearer " + token, **VERSION})

    def assert_refused(self, token: str) -> None:
        response, answer = self.post_with(token)
        self.assertEqual(response.code, 401)
        self.assertEqual(answer["statusCode"], 401)
        self.assertIn("Access token is missing, invalid, audience is incorrect", answer["message"])

    def test_minted_token_taken(self) -> None:
        """A minted token for https://ai.azure.com (or cognitiveservices) is taken."""
        for resource in ("https://ai.azure.com", "https://cognitiveservices.azure.com"):
            response, _ = self.post_with(self.sim.token(resource))
            self.assertEqual(response.code, 200, resource)

    def test_expired_token_refused(self) -> None:
        """A token is good for its lifetime, refused after."""
        token = self.sim.token()
        self.sim.clock.advance(59)
        self.assertEqual(self.post_with(token)[0].code, 200)
        self.sim.clock.advance(1.5)
        self.assert_refused(token)

    def test_other_tokens_refused(self) -> None:
        """Another audience, an edited token, another endpoint's token and junk are refused."""
        self.assert_refused(self.sim.token("https://management.azure.com"))
        token = self.sim.token()
        header, claims, signature = token.split(".")
        self.assert_refused(header + "." + claims[:-2] + "AA." + signature)
        other, _ = SimulatedIdentity(reactor=self.sim.clock).mint("https://ai.azure.com")
        self.assert_refused(other)
        self.assert_refused("not-a-token")

    def test_thinking_bound_to_the_resource(self) -> None:
        """
        Thinking written under a key is read back under a token (and the other
        key): the account is the resource, not the credential.
        """
        first = body(model="claude-sonnet-5-5")
        response, answer = self.sim.post(first, {"api-key": KEY, **VERSION})
        self.assertEqual(answer["content"][0]["type"], "thinking")
        follow = body(
            model="claude-sonnet-5-5",
            messages=[*first["messages"], {"role": "assistant", "content": answer["content"]},
                      {"role": "user", "content": "more"}],
        )
        beta = {"anthropic-beta": "thinking-binding-controls-2026-08-01", **VERSION}
        for credential in ({"authorization": "Bearer " + self.sim.token()}, {"x-api-key": "foundry-key-2"}):
            response, again = self.sim.post(follow, {**credential, **beta})
            self.assertEqual((response.code, again["input_transformations"]), (200, []))


class IdentityEndpointTests(SynchronousTestCase):
    """The managed-identity endpoint answers as App Service's does."""

    def setUp(self) -> None:
        self.sim = _Foundry()

    def get(self, query: str, header: str | None) -> tuple[int, dict]:
        headers = {} if header is None else {"X-IDENTITY-HEADER": header}
        response, content = self.sim.request("GET", "/msi/token?" + query, headers=headers)
        return response.code, json.loads(content)

    def test_token(self) -> None:
        """A token with its expiry (Unix seconds, as a string), resource and type."""
        code, answer = self.get("api-version=2019-08-01&resource=https://ai.azure.com", self.sim.identity.header)
        self.assertEqual(code, 200)
        self.assertEqual(answer["expires_on"], str(1_800_000_000 + 60))
        self.assertEqual((answer["resource"], answer["token_type"]), ("https://ai.azure.com", "Bearer"))
        self.assertEqual(self.sim.identity.minted, 1)

    def test_refusals(self) -> None:
        """Without the identity header, or with another api-version or no resource: refused."""
        query = "api-version=2019-08-01&resource=https://ai.azure.com"
        self.assertEqual(self.get(query, None)[0], 401)
        self.assertEqual(self.get(query, "guess")[0], 401)
        self.assertEqual(self.get("api-version=2017-09-01&resource=https://ai.azure.com", self.sim.identity.header)[0], 400)
        self.assertEqual(self.get("api-version=2019-08-01", self.sim.identity.header)[0], 400)
        self.assertEqual(self.sim.identity.minted, 0)


class OfficialClientTests(TestCase):
    """
    The official clients against the simulators, on 127.0.0.1: Anthropic's
    AnthropicFoundry with a key, and with azure-identity's
    ManagedIdentityCredential reading the simulated identity endpoint.
    """

    def setUp(self) -> None:
        if anthropic is None:
            self.skipTest("anthropic and azure-identity are not installed")
        self.identity = SimulatedIdentity(lifetime=600)
        self.foundry = SimulatedFoundry(SimulatedUpstream(mode="lenient"), identity=self.identity)
        port = reactor.listenTCP(0, Site(self.foundry.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.base = "http://127.0.0.1:%d" % (port.getHost().port,)
        set_environment(self, self.identity.environ(self.base))

    def client(self, **auth: Any):
        return anthropic.AnthropicFoundry(base_url=self.base + "/anthropic/", max_retries=0, timeout=30, **auth)

    def exchange(self, client) -> dict:
        """One answer whole, one streamed, and the errors the client raises (in a thread)."""
        try:
            whole = client.messages.create(**body())
            with client.messages.stream(**body(model="claude-opus-5-5")) as events:
                streamed = events.get_final_message()
            try:
                client.messages.create(**body(model="no-such-deployment"))
            except anthropic.NotFoundError as error:
                missing = error.status_code
            return {"whole": whole, "streamed": streamed, "missing": missing}
        finally:
            client.close()

    async def test_api_key(self) -> None:
        """With a key: both answers parse, sent in both key headers; an unknown deployment is a NotFoundError."""
        seen = await deferToThread(self.exchange, self.client(api_key=KEY))
        self.assertEqual((seen["whole"].model, seen["whole"].stop_reason), (MODEL, "end_turn"))
        self.assertEqual([block.type for block in seen["streamed"].content], ["thinking", "text"])
        self.assertEqual(seen["missing"], 404)
        sent = self.foundry.requests[0].headers
        self.assertEqual((sent["x-api-key"], sent["api-key"]), (KEY, KEY))

    async def test_managed_identity(self) -> None:
        """With azure-identity's ManagedIdentityCredential on the simulated endpoint: bearer tokens taken."""
        credential = ManagedIdentityCredential()

        def exchange() -> dict:
            provider = lambda: credential.get_token("https://ai.azure.com/.default").token  # noqa: E731
            try:
                return self.exchange(self.client(azure_ad_token_provider=provider))
            finally:
                credential.close()

        seen = await deferToThread(exchange)
        self.assertEqual(seen["whole"].model, MODEL)
        self.assertEqual(seen["streamed"].stop_reason, "end_turn")
        self.assertEqual(seen["missing"], 404)
        self.assertTrue(self.foundry.requests[0].headers["authorization"].startswith("Bearer eyJ"))
        self.assertNotIn("x-api-key", self.foundry.requests[0].headers)
        self.assertGreaterEqual(self.identity.minted, 1)

    async def test_wrong_key(self) -> None:
        """A wrong key is an AuthenticationError for the client."""

        def attempt() -> int:
            client = self.client(api_key="wrong")
            try:
                client.messages.create(**body())
            except anthropic.AuthenticationError as error:
                return error.status_code
            finally:
                client.close()

        self.assertEqual(await deferToThread(attempt), 401)
