"""
Claude Code's gateway contract (its "gateway protocol" page; docs/gateway.md),
one test class per item: everything forwarded unchanged, Anthropic-shaped
relay errors with ``x-should-retry``, upstream errors untouched,
``capability_rejected`` refusals, attribution headers recorded and not
forwarded, and ``/v1/models`` answered from the routes.

The official ``anthropic`` SDK is the client where the contract is about
what a client sees; real sockets on 127.0.0.1 for those, the in-memory
relay (:class:`tests.helpers.InMemoryRelay`) for the rest.
"""

from __future__ import annotations

import json

import anthropic
import treq
import ujson
from twisted.internet import reactor
from twisted.internet.testing import MemoryReactorClock
from twisted.internet.threads import deferToThread
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Site

from twisted_relay.config import RelayConfig, Route, Target, one_upstream
from twisted_relay.errors import RelayError, capability_rejected
from twisted_relay.model_list import model_list_body, routed_model_ids
from twisted_relay.tap import Options

from tests.helpers import UPSTREAM_URL, InMemoryRelay, encode, messages_body, serve_relay
from tests.test_app import FixedAnswer, NeverAnswers, json_of, result
from tests.test_dumps import every_file

MODEL = "claude-sonnet-4-5"
MESSAGE = ujson.dumps(
    {
        "id": "msg_01gateway",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [{"type": "text", "text": "ok"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 1},
    }
).encode()
# Claude Code's first system block: its attribution, which must reach the
# upstream untouched (prompt caching matches exact prefixes).
BILLING_BLOCK = {
    "type": "text",
    "text": "x-anthropic-billing-header: cc_version=2.1.301.a1b; cc_entrypoint=cli; cch=00000;",
}
ATTRIBUTION = {
    "x-app": "cli",
    "x-claude-code-session-id": "0b5d7a52-5b1e-4a43-9d4c-3a1a3e1b2c01",
    "x-claude-code-agent-id": "agent-7",
    "x-claude-code-parent-agent-id": "agent-1",
    "x-claude-code-prompt-id": "prompt-42",
    "x-claude-code-managed-settings-checksum": "sha256:abc123",
}
CLIENT_KEY = "sk-ant-api03-client-key-never-to-be-written-0123456789"


def Recorder(code: int = 200, body: bytes = MESSAGE, headers=((b"content-type", b"application/json"),)):
    """An upstream that records every request as it came, bytes and all, and gives one answer."""
    return FixedAnswer(code, body, headers)


def serve_upstream(testcase, resource) -> str:
    """``resource`` served on 127.0.0.1 until the test's cleanup; its base URL."""
    port = reactor.listenTCP(0, Site(resource), interface="127.0.0.1")
    testcase.addCleanup(port.stopListening)
    return "http://127.0.0.1:%d" % (port.getHost().port,)


def sdk_client(base_url: str, sent: list | None = None, **options):
    """
    An SDK client that does not retry (unless told to); each request it
    sends (the SDK's HTTP request) is appended to ``sent``.
    """
    hooks = {"request": [sent.append]} if sent is not None else {}
    settings = dict(base_url=base_url, api_key="sk-test-sdk", max_retries=0, timeout=30)
    settings.update(options)
    return anthropic.Anthropic(http_client=anthropic.DefaultHttpxClient(event_hooks=hooks), **settings)


def in_memory(upstream, **config) -> InMemoryRelay:
    """The relay in memory in front of ``upstream``, with ``config`` changed."""
    settings = dict(listen=(), upstreams=one_upstream(UPSTREAM_URL), dump_dir=None)
    settings.update(config)
    return InMemoryRelay(upstream, RelayConfig(**settings), clock=MemoryReactorClock())


def only(route_models=(), **conditions) -> tuple[Route, ...]:
    """One route to the one upstream, with these conditions."""
    return (Route(targets=(Target("default"),), models=tuple(route_models), **conditions),)


class ForwardedUnchangedTests(TestCase):
    """
    Item 1: every body field (unknown ones included), ``anthropic-beta`` and
    ``anthropic-version``, the query string and the first system block reach
    the upstream unchanged.
    """

    def setUp(self):
        self.upstream = Recorder()
        config = RelayConfig(listen=(), upstreams=one_upstream(serve_upstream(self, self.upstream)), dump_dir=None)
        self.relay = serve_relay(self, config, reactor)

    def create(self, sent: list, **request):
        client = sdk_client(self.relay.url, sent)
        try:
            return client.messages.create(**request)
        finally:
            client.close()

    async def test_bytes_forwarded_as_sent(self):
        """
        Claude Code's request (``?beta=true``, the 2026-10-21 version, three
        beta values, its attribution block first in ``system``, fields the
        relay has never heard of) reaches the upstream as the very bytes the
        SDK sent, with both headers unchanged.
        """
        sent = []
        message = await deferToThread(
            self.create,
            sent,
            model=MODEL,
            max_tokens=64,
            system=[BILLING_BLOCK, {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={
                "anthropic-version": "2026-10-21",
                "anthropic-beta": "interleaved-thinking-2025-05-14,inline-tools-2026-09-15,context-1m-2025-08-07",
            },
            extra_query={"beta": "true"},
            extra_body={
                "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                "a_field_from_next_year": {"nested": [1, 2.5, None, "\u00e9"]},
                "diagnostics": {"previous_message_id": None},
            },
        )
        self.assertEqual(message.id, "msg_01gateway")
        (request,) = sent
        (method, uri, headers, body) = self.upstream.received[-1]
        self.assertEqual(uri, b"/v1/messages?beta=true")
        self.assertEqual(body, request.content)
        self.assertEqual(headers.getRawHeaders(b"anthropic-version"), [b"2026-10-21"])
        self.assertEqual(
            headers.getRawHeaders(b"anthropic-beta"),
            [b"interleaved-thinking-2025-05-14,inline-tools-2026-09-15,context-1m-2025-08-07"],
        )
        self.assertEqual(json.loads(body)["system"][0], BILLING_BLOCK)

    async def test_first_system_block_kept_when_the_body_is_rewritten(self):
        """
        A request whose ids the relay must rewrite (a duplicate tool-use id)
        is serialised again: its first system block and its unknown fields
        still reach the upstream with the same values, and in the same place.
        """
        use = {"type": "tool_use", "id": "toolu_01DUP", "name": "get_weather", "input": {"city": "Oslo"}}
        history = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01DUP", "content": "1"}]},
            {"role": "assistant", "content": [dict(use)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01DUP", "content": "2"}]},
        ]
        body = messages_body(history, system=[BILLING_BLOCK, {"type": "text", "text": "Be brief."}], unknown_field={"x": 1})
        response = await treq.post(
            self.relay.url + "/v1/messages",
            data=encode(body),
            headers={"content-type": ["application/json"], "x-api-key": ["sk-test"]},
            persistent=False,
        )
        self.assertEqual(response.code, 200)
        await response.content()
        upstream_body = json.loads(self.upstream.received[-1][3])
        self.assertNotEqual(upstream_body["messages"], history)
        self.assertEqual(upstream_body["system"], body["system"])
        self.assertEqual(list(upstream_body)[: len(body)], list(body))
        self.assertEqual(upstream_body["unknown_field"], {"x": 1})


class RelayErrorTests(SynchronousTestCase):
    """
    Item 2: each error the relay makes is in Anthropic's envelope, with the
    ``error.type`` its status implies and an ``x-should-retry`` that says
    whether the same request can succeed later.
    """

    def assertRelayError(self, relay, response, status, error_type, should_retry):
        self.assertEqual(response.code, status)
        body = json_of(self, relay, response)
        self.assertEqual((body["type"], body["error"]["type"]), ("error", error_type))
        self.assertTrue(body["request_id"].startswith("rly_"))
        self.assertEqual(response.headers.getRawHeaders(b"x-should-retry"), [should_retry])
        return body

    def test_not_worth_retrying(self):
        """Bad JSON 400, no relay key 401, unknown path 404, wrong method 405, too large 413: ``false``."""
        upstream = FixedAnswer(200, MESSAGE)
        relay = in_memory(upstream)
        response = result(self, relay, relay.post("/v1/messages", b'{"model": '))
        self.assertRelayError(relay, response, 400, "invalid_request_error", b"false")
        response = result(self, relay, relay.get("/v1/nothing-here"))
        self.assertRelayError(relay, response, 404, "not_found_error", b"false")
        response = result(self, relay, relay.get("/v1/messages"))
        self.assertRelayError(relay, response, 405, "invalid_request_error", b"false")

        keyed = in_memory(upstream, relay_keys=("rk-only",))
        response = result(self, keyed, keyed.post("/v1/messages", messages_body()))
        self.assertRelayError(keyed, response, 401, "authentication_error", b"false")

        small = in_memory(upstream, max_body=200)
        response = result(self, small, small.post("/v1/messages", messages_body(system="x" * 500)))
        self.assertRelayError(small, response, 413, "request_too_large", b"false")

        routed = in_memory(upstream, routes=only(["claude-haiku-*"]))
        response = result(self, routed, routed.post("/v1/messages", messages_body()))
        self.assertRelayError(routed, response, 404, "not_found_error", b"false")
        self.assertEqual(upstream.received, [])

    def test_worth_retrying(self):
        """
        The relay at its limit (529), an upstream that cannot be reached
        (502) or does not answer in time (504): ``true``.
        """
        busy = in_memory(NeverAnswers(), max_concurrent=1)
        busy.post("/v1/messages", messages_body())
        busy.flush()
        response = result(self, busy, busy.post("/v1/messages", messages_body()))
        self.assertRelayError(busy, response, 529, "overloaded_error", b"true")

        nowhere = in_memory(FixedAnswer(200, MESSAGE), upstreams=one_upstream("http://nowhere.test"))
        response = result(self, nowhere, nowhere.post("/v1/messages", messages_body()))
        self.assertRelayError(nowhere, response, 502, "api_error", b"true")

        slow = in_memory(NeverAnswers(), response_timeout=5.0)
        d = slow.post("/v1/messages", messages_body())
        slow.flush()
        slow.clock.advance(6)
        response = result(self, slow, d)
        self.assertRelayError(slow, response, 504, "timeout_error", b"true")

    def test_decided_in_one_place(self):
        """
        ``RelayError`` decides: by status, except a TLS failure (the same
        certificate fails again); a 408 carries Anthropic's
        ``request_body_timeout`` code; an explicit choice wins.
        """
        self.assertTrue(RelayError(502, "x", kind="connect").should_retry)
        self.assertFalse(RelayError(502, "x", kind="tls").should_retry)
        self.assertFalse(RelayError(400, "x").should_retry)
        self.assertEqual(RelayError(408, "x").error_code, "request_body_timeout")
        self.assertEqual(json.loads(RelayError(408, "x").body())["error"]["details"], {"error_code": "request_body_timeout"})
        self.assertIsNone(RelayError(400, "x").error_code)
        self.assertFalse(RelayError(503, "x", should_retry=False).should_retry)


class UpstreamErrorTests(TestCase):
    """Item 2: an upstream's errors reach the client as they came: status, body and retry headers."""

    async def relayed(self, code: int, body: bytes, headers) -> tuple:
        upstream = Recorder(code, body, headers)
        config = RelayConfig(listen=(), upstreams=one_upstream(serve_upstream(self, upstream)), dump_dir=None)
        relay = serve_relay(self, config, reactor)
        response = await treq.post(
            relay.url + "/v1/messages",
            data=encode(messages_body()),
            headers={"content-type": ["application/json"], "x-api-key": ["sk-test"]},
            persistent=False,
        )
        return response, await response.content()

    async def test_spend_cap_429_untouched(self):
        """
        The spend-cap 429 (``billing_error``, ``x-should-retry: false``, the
        unified rate-limit headers, no ``retry-after``) and a plain 429
        (``retry-after``) arrive with their bodies byte for byte.
        """
        body = (
            b'{"type":"error","error":{"type":"billing_error","message":"Spend limit reached.",'
            b'"details":{"error_code":"enforced_spend_limit_reached"}},"request_id":"req_011"}'
        )
        headers = (
            (b"content-type", b"application/json"),
            (b"x-should-retry", b"false"),
            (b"request-id", b"req_011"),
            (b"anthropic-ratelimit-unified-status", b"rejected"),
            (b"anthropic-ratelimit-unified-overage-utilization", b"1"),
        )
        response, answer = await self.relayed(429, body, headers)
        self.assertEqual((response.code, answer), (429, body))
        for name, value in headers:
            self.assertEqual(response.headers.getRawHeaders(name), [value], name)
        self.assertIsNone(response.headers.getRawHeaders(b"retry-after"))

        body = b'{"type":"error","error":{"type":"rate_limit_error","message":"Slow down."}}'
        response, answer = await self.relayed(
            429, body, ((b"content-type", b"application/json"), (b"retry-after", b"17"))
        )
        self.assertEqual((response.code, answer), (429, body))
        self.assertEqual(response.headers.getRawHeaders(b"retry-after"), [b"17"])
        # The relay adds no retry advice of its own to the upstream's answer.
        self.assertIsNone(response.headers.getRawHeaders(b"x-should-retry"))

    async def test_overloaded_529_untouched(self):
        """A 529 ``overloaded_error`` with ``x-should-retry: true`` is not turned into a 502."""
        body = b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}'
        headers = ((b"content-type", b"application/json"), (b"x-should-retry", b"true"))
        response, answer = await self.relayed(529, body, headers)
        self.assertEqual((response.code, answer), (529, body))
        self.assertEqual(response.headers.getRawHeaders(b"x-should-retry"), [b"true"])


class CapabilityRejectedTests(SynchronousTestCase):
    """
    Item 3: a request that a route would take but for a capability the
    route keeps off its upstreams is refused with
    ``capability_rejected: <class>``, so that Claude Code sends it again
    without it.
    """

    def refused(self, routes, body) -> tuple:
        upstream = FixedAnswer(200, MESSAGE)
        relay = in_memory(upstream, routes=routes)
        response = result(self, relay, relay.post("/v1/messages", body))
        answer = json_of(self, relay, response)
        self.assertEqual(upstream.received, [])
        return response, answer

    def test_thinking_refused(self):
        """
        Behind a route with ``thinking = false`` a thinking request gets 400
        ``capability_rejected: thinking_type:<its type>``, not worth a retry
        as it is.
        """
        for kind in ("enabled", "adaptive"):
            thinking = {"type": kind, "budget_tokens": 1024} if kind == "enabled" else {"type": kind}
            response, answer = self.refused(only(["claude-*"], thinking=False), messages_body(thinking=thinking))
            self.assertEqual(response.code, 400)
            self.assertEqual(answer["error"]["type"], "invalid_request_error")
            self.assertEqual(answer["error"]["message"], "capability_rejected: thinking_type:%s" % (kind,))
            self.assertEqual(response.headers.getRawHeaders(b"x-should-retry"), [b"false"])

    def test_images_refused(self):
        """Behind a route with ``images = false`` a pasted screenshot gets ``capability_rejected: image_block``."""
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
        body = messages_body([{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}])
        response, answer = self.refused(only(images=False), body)
        self.assertEqual((response.code, answer["error"]["message"]), (400, "capability_rejected: image_block"))

    def test_other_misses_stay_404(self):
        """A model no route serves is a 404 ``not_found_error`` as before, not a capability."""
        response, answer = self.refused(only(["claude-haiku-*"], thinking=False), messages_body(thinking={"type": "adaptive"}))
        self.assertEqual((response.code, answer["error"]["type"]), (404, "not_found_error"))
        self.assertEqual(capability_rejected("image_block").message, "capability_rejected: image_block")


class AttributionTests(TestCase):
    """
    Item 4: Claude Code's attribution headers are recorded (the request's
    log line, dumps) and not forwarded upstream unless configured.
    """

    def start(self, upstream, **settings):
        self.dump_dir = self.mktemp()
        config = RelayConfig(
            listen=(), upstreams=one_upstream(serve_upstream(self, upstream)), dump_dir=self.dump_dir
        ).with_changes(**settings)
        return serve_relay(self, config, reactor)

    async def post(self, relay, headers):
        all_headers = {"content-type": ["application/json"], "x-api-key": [CLIENT_KEY]}
        all_headers.update({name: [value] for name, value in headers.items()})
        response = await treq.post(
            relay.url + "/v1/messages", data=encode(messages_body()), headers=all_headers, persistent=False
        )
        return response.code, await response.content()

    async def test_recorded_not_forwarded(self):
        """
        The upstream never sees them; the log line names each, bounded
        (a 10,000-character one is cut), and so does the dump of a refused
        request; a key sent in one is never written.
        """
        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        upstream = Recorder(400, b'{"type":"error","error":{"type":"invalid_request_error","message":"no"}}')
        relay = self.start(upstream)
        headers = dict(ATTRIBUTION, **{"x-claude-code-prompt-id": "p" * 10_000, "x-app": "cli " + CLIENT_KEY})
        code, _ = await self.post(relay, headers)
        self.assertEqual(code, 400)
        sent = upstream.received[-1][2]
        for name in ATTRIBUTION:
            self.assertIsNone(sent.getRawHeaders(name.encode()), name)

        (line,) = [e for e in events if e.get("attribution") is not None]
        recorded = line["attribution"]
        self.assertEqual(set(recorded), set(ATTRIBUTION))
        self.assertEqual(recorded["x-claude-code-session-id"], ATTRIBUTION["x-claude-code-session-id"])
        self.assertLess(len(recorded["x-claude-code-prompt-id"]), 300)
        self.assertNotIn(CLIENT_KEY, recorded["x-app"])

        await relay.relay.dumps.drain()
        (path,) = every_file(self.dump_dir)
        raw = open(path, "rb").read()
        self.assertNotIn(CLIENT_KEY.encode(), raw)
        dump = json.loads(raw)
        self.assertEqual(dump["attribution"]["x-claude-code-agent-id"], "agent-7")
        self.assertEqual(dump["session_id"], ATTRIBUTION["x-claude-code-session-id"])

    async def test_forwarded_when_configured(self):
        """``--forward-attribution`` (off by default) sends them upstream as they came."""
        self.assertFalse(RelayConfig().forward_attribution)
        options = Options()
        options.parseOptions(["--forward-attribution", "--no-dumps"])
        self.assertTrue(options.config.forward_attribution)
        upstream = Recorder()
        relay = self.start(upstream, forward_attribution=True)
        code, _ = await self.post(relay, ATTRIBUTION)
        self.assertEqual(code, 200)
        sent = upstream.received[-1][2]
        for name, value in ATTRIBUTION.items():
            self.assertEqual(sent.getRawHeaders(name.encode()), [value.encode()], name)


ROUTED = (
    Route(targets=(Target("default", model="kimi-k2"),), models=("claude-haiku-4-5", "claude-haiku-*")),
    Route(targets=(Target("default"),), models=("claude-sonnet-4-5", "claude-opus-4-1", "claude-haiku-4-5")),
)


class ModelListTests(TestCase):
    """
    Item 5: ``GET /v1/models`` lists the models the routes name, in the API's
    shape (the SDK's ``models.list()`` reads it), and ``/v1/models/{id}``
    agrees; without model-naming routes the upstream answers, as before.
    """

    def serve(self, upstream, routes=()):
        config = RelayConfig(listen=(), upstreams=one_upstream(serve_upstream(self, upstream)), dump_dir=None, routes=routes)
        return serve_relay(self, config, reactor)

    async def test_routes_listed_with_the_sdk(self):
        """
        The concrete ids, each once, in file order (no glob); one at a time
        the SDK pages through the same list; an id a route serves is found,
        another is a 404; the upstream is never asked.
        """
        upstream = Recorder()
        relay = self.serve(upstream, ROUTED)

        def discover():
            client = sdk_client(relay.url)
            try:
                listed = client.models.list(limit=1000)
                paged = [model.id for model in client.models.list(limit=1)]
                one = client.models.retrieve("claude-opus-4-1")
                globbed = client.models.retrieve("claude-haiku-3-0")
                try:
                    client.models.retrieve("gpt-5")
                except anthropic.NotFoundError as e:
                    missing = e
                return listed, paged, one, globbed, missing
            finally:
                client.close()

        listed, paged, one, globbed, missing = await deferToThread(discover)
        ids = ["claude-haiku-4-5", "claude-sonnet-4-5", "claude-opus-4-1"]
        self.assertEqual([model.id for model in listed.data], ids)
        self.assertEqual((listed.has_more, listed.first_id, listed.last_id), (False, ids[0], ids[-1]))
        self.assertEqual({model.type for model in listed.data}, {"model"})
        self.assertTrue(all(model.display_name for model in listed.data))
        self.assertEqual(paged, ids)
        self.assertEqual((one.id, one.type), ("claude-opus-4-1", "model"))
        self.assertEqual(globbed.id, "claude-haiku-3-0")
        self.assertEqual(missing.status_code, 404)
        self.assertEqual(missing.response.headers["x-should-retry"], "false")
        self.assertEqual(upstream.received, [])

    async def test_upstream_answers_without_named_models(self):
        """One upstream and no routes: the list is the upstream's, as it sent it."""
        answer = b'{"data":[{"type":"model","id":"claude-x","display_name":"X","created_at":"2026-01-01T00:00:00Z"}],"has_more":false,"first_id":"claude-x","last_id":"claude-x"}'
        upstream = Recorder(200, answer)
        relay = self.serve(upstream)
        response = await treq.get(relay.url + "/v1/models?limit=1000", persistent=False)
        self.assertEqual(await response.content(), answer)
        self.assertEqual(upstream.received[-1][1], b"/v1/models?limit=1000")

    def test_which_ids(self):
        """A route that takes any model, or only globs, leave the list to the upstream."""
        self.assertIsNone(routed_model_ids(RelayConfig()))
        self.assertIsNone(routed_model_ids(RelayConfig(routes=ROUTED + (Route(targets=(Target("default"),)),))))
        self.assertIsNone(routed_model_ids(RelayConfig(routes=only(["claude-*"]))))
        self.assertEqual(routed_model_ids(RelayConfig(routes=ROUTED)), ("claude-haiku-4-5", "claude-sonnet-4-5", "claude-opus-4-1"))
        page = json.loads(model_list_body(("a", "b", "c"), {b"limit": [b"2"], b"before_id": [b"c"]}))
        self.assertEqual(([m["id"] for m in page["data"]], page["has_more"]), (["a", "b"], False))
