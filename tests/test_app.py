"""
Tests for the relay's routes, in memory: validation, forwarding, header
rules, error paths, streaming and non-streaming answers.
"""

from __future__ import annotations

import ujson
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from twisted_relay.config import RelayConfig, one_upstream
from twisted_relay.simulated import SimulatedUpstream

from tests.helpers import UPSTREAM_URL, InMemoryRelay, encode, messages_body


class FixedAnswer(Resource):
    """An upstream that answers every request with one fixed response."""

    isLeaf = True

    def __init__(self, code: int, body: bytes, headers=()):
        super().__init__()
        self.code, self.body, self.headers = code, body, headers
        self.received = []

    def render(self, request):
        self.received.append((request.method, request.uri, request.requestHeaders, request.content.read()))
        request.setResponseCode(self.code)
        for name, value in self.headers:
            request.setHeader(name, value)
        return self.body


class NeverAnswers(Resource):
    """An upstream that accepts a request and never answers it."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.pending = []

    def render(self, request):
        self.pending.append(request)
        return NOT_DONE_YET


class CutStream(Resource):
    """An upstream that starts a stream, sends some events, then hangs up."""

    isLeaf = True

    def __init__(self, events: bytes):
        super().__init__()
        self.events = events

    def render(self, request):
        request.setHeader(b"content-type", b"text/event-stream")
        request.write(self.events)
        request.channel.transport.loseConnection()
        return NOT_DONE_YET


def result(testcase, relay, d):
    """Flush the in-memory relay and return what ``d`` fired with."""
    relay.flush()
    return testcase.successResultOf(d)


def body_of(testcase, relay, response) -> bytes:
    d = response.content()
    relay.flush()
    return testcase.successResultOf(d)


def json_of(testcase, relay, response):
    return ujson.loads(body_of(testcase, relay, response))


class RelayTestMixin:
    def relay(self, upstream=None, **config):
        clock = MemoryReactorClock()
        self.sim = upstream
        if upstream is None:
            self.sim = SimulatedUpstream(mode="lenient", seed=3, reuse_every=0, reactor=clock)
        resource = self.sim.resource() if isinstance(self.sim, SimulatedUpstream) else self.sim
        settings = dict(listen=(), upstreams=one_upstream(UPSTREAM_URL), dump_dir=None)
        settings.update(config)
        return InMemoryRelay(resource, RelayConfig(**settings), clock=clock)

    def assertAnthropicError(self, relay, response, status, error_type, words=()):
        self.assertEqual(response.code, status)
        self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])
        body = json_of(self, relay, response)
        self.assertEqual(body["type"], "error")
        self.assertEqual(body["error"]["type"], error_type)
        for word in words:
            self.assertIn(word, body["error"]["message"])
        relay_id = response.headers.getRawHeaders(b"x-relay-request-id")[0].decode()
        self.assertEqual(body["request_id"], relay_id)
        self.assertTrue(relay_id.startswith("rly_"))
        return body


class ValidationTests(RelayTestMixin, SynchronousTestCase):
    """
    The relay checks only what it needs, and says clearly what is wrong.
    """

    def test_invalid_json(self):
        """
        A body that is not JSON gets a 400 ``invalid_request_error`` that says
        so, and the upstream is never asked.
        """
        relay = self.relay()
        response = result(self, relay, relay.post("/v1/messages", b'{"model": '))
        self.assertAnthropicError(relay, response, 400, "invalid_request_error", ["not valid JSON"])
        self.assertEqual(list(self.sim.requests), [])

    def test_invalid_utf8(self):
        """
        Bytes that are not UTF-8 get a 400 as well, not a traceback.
        """
        relay = self.relay()
        response = result(self, relay, relay.post("/v1/messages", b'{"messages": ["\xff\xfe"]}'))
        self.assertAnthropicError(relay, response, 400, "invalid_request_error")

    def test_not_an_object(self):
        """
        A JSON value other than an object is refused.
        """
        relay = self.relay()
        response = result(self, relay, relay.post("/v1/messages", b"[1, 2]"))
        self.assertAnthropicError(relay, response, 400, "invalid_request_error", ["JSON object"])

    def test_messages_required(self):
        """
        ``messages`` must be present and be a list.
        """
        relay = self.relay()
        for body in ({"model": "m", "max_tokens": 1}, {"model": "m", "messages": "hi"}):
            response = result(self, relay, relay.post("/v1/messages", body))
            self.assertAnthropicError(relay, response, 400, "invalid_request_error", ["messages"])

    def test_too_large(self):
        """
        A body over ``max_body`` gets a 413 ``request_too_large`` naming both sizes.
        """
        relay = self.relay(max_body=200)
        body = messages_body([{"role": "user", "content": "x" * 500}])
        response = result(self, relay, relay.post("/v1/messages", body))
        self.assertAnthropicError(relay, response, 413, "request_too_large", ["200"])
        self.assertEqual(list(self.sim.requests), [])

    def test_unknown_fields_roles_and_blocks_pass(self):
        """
        Fields, roles and block types the relay does not know reach the
        upstream intact: Claude Code sends ``role: "system"`` messages and new
        block types appear all the time.
        """
        relay = self.relay()
        body = messages_body(
            [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "brand_new_block", "payload": {"x": [1, 2.5, None]}}]},
            ],
            context_management={"edits": [{"type": "clear"}]},
            some_future_field=True,
        )
        response = result(self, relay, relay.post("/v1/messages", body))
        self.assertEqual(response.code, 200)
        self.assertEqual(self.sim.requests[-1].body, body)

    def test_unknown_path(self):
        """
        A path the relay does not serve gets an Anthropic-shaped 404.
        """
        relay = self.relay()
        response = result(self, relay, relay.post("/v1/complete", b"{}"))
        self.assertAnthropicError(relay, response, 404, "not_found_error", ["/v1/complete"])

    def test_wrong_method(self):
        """
        A known path asked with the wrong method gets an Anthropic-shaped 405.
        """
        relay = self.relay()
        response = result(self, relay, relay.get("/v1/messages"))
        self.assertAnthropicError(relay, response, 405, "invalid_request_error", ["GET"])


class ProbeTests(RelayTestMixin, SynchronousTestCase):
    """
    Probes are answered by the relay at once, without the upstream.
    """

    def test_head_probes(self):
        """
        ``HEAD /`` and ``HEAD /api/hello`` (Claude Code's connection warm-up)
        answer 200.
        """
        relay = self.relay()
        for path in ("/", "/api/hello"):
            d = relay.stub.request("HEAD", "http://relay.test" + path)
            self.assertEqual(result(self, relay, d).code, 200)
        self.assertEqual(list(self.sim.requests), [])

    def test_health(self):
        """
        ``GET /health`` says the relay is up.
        """
        relay = self.relay()
        response = result(self, relay, relay.get("/health"))
        self.assertEqual(response.code, 200)
        self.assertEqual(json_of(self, relay, response)["status"], "ok")


class ForwardingTests(RelayTestMixin, SynchronousTestCase):
    """
    Requests reach the upstream as the client sent them, and answers come
    back as the upstream sent them.
    """

    def test_non_streaming_answer(self):
        """
        A non-streaming request gets the upstream's message, its
        ``request-id``, and the relay's own request id.
        """
        relay = self.relay()
        response = result(self, relay, relay.post("/v1/messages", messages_body()))
        self.assertEqual(response.code, 200)
        message = json_of(self, relay, response)
        self.assertEqual(message["type"], "message")
        self.assertEqual(message["role"], "assistant")
        self.assertTrue(response.headers.getRawHeaders(b"request-id")[0].startswith(b"req_"))
        self.assertTrue(response.headers.getRawHeaders(b"x-relay-request-id")[0].startswith(b"rly_"))

    def test_clean_answer_is_byte_for_byte(self):
        """
        When no id needs rewriting, the client gets the upstream's bytes.
        """
        raw = b'{"id":"msg_1",  "type":"message","role":"assistant","content":[{"type":"text","text":"hi"}]}'
        upstream = FixedAnswer(200, raw, [(b"content-type", b"application/json")])
        relay = self.relay(upstream)
        response = result(self, relay, relay.post("/v1/messages", messages_body()))
        self.assertEqual(body_of(self, relay, response), raw)

    def test_query_string_and_headers_forwarded(self):
        """
        ``?beta=true`` and ``anthropic-*`` headers reach the upstream;
        hop-by-hop headers do not, nor Claude Code's attribution headers
        (``x-claude-code-*``: consumed, see tests.test_gateway_contract).
        """
        upstream = FixedAnswer(200, b"{}", [(b"content-type", b"application/json")])
        relay = self.relay(upstream)
        d = relay.post(
            "/v1/messages?beta=true",
            messages_body(),
            headers={
                "anthropic-version": ["2023-06-01"],
                "anthropic-beta": ["fine-grained-tool-streaming-2025-05-14"],
                "x-claude-code-session-id": ["sess-42"],
                "keep-alive": ["timeout=5"],
            },
        )
        self.assertEqual(result(self, relay, d).code, 200)
        method, uri, headers, _ = upstream.received[-1]
        self.assertEqual(uri, b"/v1/messages?beta=true")
        self.assertEqual(headers.getRawHeaders(b"anthropic-version"), [b"2023-06-01"])
        self.assertEqual(
            headers.getRawHeaders(b"anthropic-beta"), [b"fine-grained-tool-streaming-2025-05-14"]
        )
        self.assertIsNone(headers.getRawHeaders(b"x-claude-code-session-id"))
        self.assertIsNone(headers.getRawHeaders(b"keep-alive"))
        self.assertEqual(headers.getRawHeaders(b"x-api-key"), [b"sk-test-client"])

    def test_no_cookie_shared_between_clients(self):
        """
        A cookie the upstream sets for one client is passed back to that
        client but never sent upstream with anyone's later request: the relay
        keeps no cookie jar.
        """
        upstream = FixedAnswer(
            200, b"{}", [(b"content-type", b"application/json"), (b"set-cookie", b"session=alice")]
        )
        relay = self.relay(upstream)
        first = result(self, relay, relay.raw_post("/v1/messages", messages_body()))
        self.assertEqual(first.headers.getRawHeaders(b"set-cookie"), [b"session=alice"])
        result(self, relay, relay.raw_post("/v1/messages", messages_body()))
        self.assertIsNone(upstream.received[-1][2].getRawHeaders(b"cookie"))

    def test_no_empty_content_encoding(self):
        """
        An answer the upstream sent without ``content-encoding`` reaches the
        client without one (not with an empty one).
        """
        upstream = FixedAnswer(200, b"{}", [(b"content-type", b"application/json")])
        relay = self.relay(upstream)
        response = result(self, relay, relay.raw_post("/v1/messages", messages_body()))
        self.assertIsNone(response.headers.getRawHeaders(b"content-encoding"))

    def test_body_forwarded_unchanged_when_clean(self):
        """
        A request with no id to translate reaches the upstream as the very
        bytes the client sent.
        """
        upstream = FixedAnswer(200, b"{}", [(b"content-type", b"application/json")])
        relay = self.relay(upstream)
        raw = b'{"model":"m", "max_tokens":5,"messages":[{"role":"user","content":"caf\xc3\xa9"}]}'
        result(self, relay, relay.post("/v1/messages", raw))
        self.assertEqual(upstream.received[-1][3], raw)

    def test_client_key_passes_through(self):
        """
        Without ``--upstream-key`` the upstream authenticates the client's key.
        """
        relay = self.relay(SimulatedUpstream(mode="lenient", require_key="sk-test-client"))
        response = result(self, relay, relay.post("/v1/messages", messages_body()))
        self.assertEqual(response.code, 200)
        wrong = relay.post("/v1/messages", messages_body(), headers={"x-api-key": ["sk-wrong"]})
        self.assertEqual(result(self, relay, wrong).code, 401)

    def test_upstream_key_replaces_client_key(self):
        """
        With ``--upstream-key`` the upstream sees the relay's key, whatever
        the client sends.
        """
        relay = self.relay(
            SimulatedUpstream(mode="lenient", require_key="sk-upstream-secret"),
            upstreams=one_upstream(UPSTREAM_URL, key="sk-upstream-secret"),
        )
        d = relay.post("/v1/messages", messages_body(), headers={"x-api-key": ["sk-wrong"]})
        self.assertEqual(result(self, relay, d).code, 200)

    def test_upstream_error_passes_byte_for_byte(self):
        """
        An upstream error reaches the client with its status, its headers and
        its exact bytes: Claude Code matches Anthropic's wording.
        """
        raw = b'{"type":"error","error":{"type":"rate_limit_error","message":"Slow  down."},"request_id":"req_9"}'
        upstream = FixedAnswer(
            429,
            raw,
            [
                (b"content-type", b"application/json"),
                (b"retry-after", b"7"),
                (b"x-should-retry", b"true"),
                (b"request-id", b"req_9"),
                (b"anthropic-ratelimit-requests-remaining", b"0"),
            ],
        )
        relay = self.relay(upstream)
        response = result(self, relay, relay.post("/v1/messages", messages_body(stream=True)))
        self.assertEqual(response.code, 429)
        self.assertEqual(body_of(self, relay, response), raw)
        for name, value in upstream.headers:
            self.assertEqual(response.headers.getRawHeaders(name), [value], name)

    def test_strict_upstream_error_passes_through(self):
        """
        The simulated strict upstream's 400 for an orphan ``tool_result``
        reaches the client as the upstream wrote it (the same answer the
        upstream gives when asked directly, but for its own request id).
        """
        from treq.testing import StubTreq

        sim = SimulatedUpstream(mode="strict", seed=1)
        relay = self.relay(sim)
        history = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nowhere", "content": "x"}]},
        ]
        raw = encode(messages_body(history))
        response = result(self, relay, relay.post("/v1/messages", raw))
        self.assertEqual(response.code, 400)
        through_relay = ujson.loads(body_of(self, relay, response))

        direct = StubTreq(sim.resource())
        d = direct.post(UPSTREAM_URL + "/v1/messages", data=raw, headers={"content-type": ["application/json"]})
        direct.flush()
        answer = self.successResultOf(d)
        self.assertEqual(answer.code, 400)
        d = answer.content()
        direct.flush()
        expected = ujson.loads(self.successResultOf(d))
        through_relay.pop("request_id", None)
        expected.pop("request_id", None)
        self.assertEqual(through_relay, expected)
        self.assertIn("toolu_nowhere", expected["error"]["message"])

    def test_upstream_timeout(self):
        """
        An upstream that sends no headers within ``response_timeout`` gets
        the client a 504 ``timeout_error`` that says so.
        """
        relay = self.relay(NeverAnswers(), response_timeout=30)
        d = relay.post("/v1/messages", messages_body())
        relay.flush()
        self.assertNoResult(d)
        relay.clock.advance(31)
        response = result(self, relay, d)
        self.assertAnthropicError(relay, response, 504, "timeout_error", ["30 seconds"])

    def test_count_tokens(self):
        """
        ``count_tokens`` is relayed, with the same inbound translation: a
        history holding a raw duplicate id is repaired, so a strict upstream
        counts it instead of refusing it.
        """
        relay = self.relay(SimulatedUpstream(mode="strict", seed=1))
        tool_use = {"type": "tool_use", "id": "toolu_dup", "name": "get_weather", "input": {}}
        history = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [tool_use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_dup", "content": "1"}]},
            {"role": "assistant", "content": [dict(tool_use)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_dup", "content": "2"}]},
        ]
        response = result(self, relay, relay.post("/v1/messages/count_tokens", messages_body(history)))
        self.assertEqual(response.code, 200)
        self.assertIsInstance(json_of(self, relay, response)["input_tokens"], int)
        sent = self.sim.requests[-1].body["messages"]
        self.assertEqual(sent[3]["content"][0]["id"], "toolu_dup-2")
        self.assertEqual(sent[4]["content"][0]["tool_use_id"], "toolu_dup-2")

    def test_huge_ids_are_bounded_in_logs(self):
        """
        Ids come from clients and models and may be huge: the log event of a
        repair names them by a bounded prefix and their length.
        """
        from twisted.logger import globalLogPublisher

        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        relay = self.relay(SimulatedUpstream(mode="strict", seed=1))
        huge = "toolu_" + "x" * 100_000
        tool_use = {"type": "tool_use", "id": huge, "name": "get_weather", "input": {}}
        history = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [tool_use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": huge, "content": "1"}]},
            {"role": "assistant", "content": [dict(tool_use)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": huge, "content": "2"}]},
        ]
        response = result(self, relay, relay.post("/v1/messages/count_tokens", messages_body(history)))
        self.assertEqual(response.code, 200)
        repairs = [e for e in events if "Repaired" in e.get("log_format", "")]
        self.assertEqual(len(repairs), 1)
        self.assertLess(len(repairs[0]["client_id"]), 300)
        self.assertIn("(100006 chars)", repairs[0]["client_id"])
        self.assertTrue(huge.startswith(repairs[0]["client_id"][:200]))

    def test_every_log_event_is_bounded(self):
        """
        A request whose huge id the upstream refuses (an orphan tool result)
        leaves no log event, the relay's or the simulated upstream's, that
        holds the id whole: each field is a bounded prefix.
        """
        from twisted.logger import globalLogPublisher

        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        relay = self.relay(SimulatedUpstream(mode="strict", seed=1))
        huge = "0" * 65_000
        history = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": huge, "content": "1"}]},
        ]
        response = result(self, relay, relay.post("/v1/messages", messages_body(history)))
        self.assertEqual(response.code, 400)
        self.assertTrue(events)
        for event in events:
            for name, value in event.items():
                if isinstance(value, str):
                    self.assertLess(len(value), 2000, (event.get("log_format"), name))

    def test_models(self):
        """
        ``GET /v1/models`` and ``GET /v1/models/{id}`` are relayed with their
        query strings.
        """
        relay = self.relay()
        response = result(self, relay, relay.get("/v1/models?limit=1"))
        self.assertEqual(response.code, 200)
        listing = json_of(self, relay, response)
        self.assertEqual(len(listing["data"]), 1)
        model_id = listing["data"][0]["id"]
        response = result(self, relay, relay.get("/v1/models/" + model_id))
        self.assertEqual(json_of(self, relay, response)["id"], model_id)


class StreamingTests(RelayTestMixin, SynchronousTestCase):
    """
    Streamed answers, in memory.
    """

    def test_stream(self):
        """
        A streaming request gets an SSE answer with the headers that keep
        proxies from buffering it, ending in ``message_stop``.
        """
        relay = self.relay()
        d = relay.post("/v1/messages", messages_body(stream=True))
        relay.flush()
        response = self.successResultOf(d)
        self.assertEqual(response.code, 200)
        self.assertTrue(response.headers.getRawHeaders(b"content-type")[0].startswith(b"text/event-stream"))
        self.assertEqual(response.headers.getRawHeaders(b"x-accel-buffering"), [b"no"])
        text = body_of(self, relay, response).decode("utf-8")
        names = [line[len("event: "):] for line in text.splitlines() if line.startswith("event: ")]
        self.assertEqual(names[0], "message_start")
        self.assertEqual(names[-1], "message_stop")

    def test_stream_requires_stream_true(self):
        """
        Streaming is decided by ``"stream": true`` in the body only; a
        ``stream`` field that is not ``true`` gets a JSON answer.
        """
        relay = self.relay()
        response = result(self, relay, relay.post("/v1/messages", messages_body(stream=False)))
        self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])

    def test_stream_cut_becomes_error_event(self):
        """
        An upstream that hangs up mid-stream gets the client an SSE ``error``
        event and a clean end, not a dropped connection.
        """
        events = (
            b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
            b'"role":"assistant","content":[],"model":"m","stop_reason":null,"usage":{"input_tokens":1,'
            b'"output_tokens":1}}}\n\n'
            b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
            b'"content_block":{"type":"text","text":""}}\n\n'
        )
        relay = self.relay(CutStream(events))
        d = relay.post("/v1/messages", messages_body(stream=True))
        response = result(self, relay, d)
        text = body_of(self, relay, response)
        self.assertTrue(text.startswith(events))
        tail = text[len(events):].decode()
        self.assertTrue(tail.startswith("event: error\ndata: "), tail)
        payload = ujson.loads(tail.split("data: ", 1)[1])
        self.assertEqual(payload["type"], "error")
        self.assertEqual(payload["error"]["type"], "api_error")


class DeadlineTests(RelayTestMixin, SynchronousTestCase):
    """
    ``total_timeout`` is one deadline for the whole request: whatever the
    request waits on when it comes ends with a 504.
    """

    def test_deadline_during_a_retry_pause(self):
        """
        An upstream that keeps answering 529: the relay waits between
        retries, but never past the deadline; the client gets a 504
        ``timeout_error`` when it comes, not the 529 after a longer wait.
        """
        upstream = FixedAnswer(
            529,
            b'{"type":"error","error":{"type":"overloaded_error","message":"busy"}}',
            [(b"content-type", b"application/json")],
        )
        relay = self.relay(upstream, retries=3, total_timeout=1.0)
        d = relay.post("/v1/messages", messages_body())
        relay.flush()
        # Sent at 0, again after 0.5 s; the next pause (1 s) outlasts the deadline.
        for _ in range(3):
            relay.clock.advance(0.25)
            relay.flush()
        self.assertNoResult(d)
        relay.clock.advance(0.25)
        relay.flush()
        response = self.successResultOf(d)
        body = self.assertAnthropicError(relay, response, 504, "timeout_error", ["longer than 1 seconds"])
        self.assertTrue(body)
        self.assertEqual(len(upstream.received), 2)
