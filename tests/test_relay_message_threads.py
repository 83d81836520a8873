"""
Message threads held by the relay, on the request path: a ``create`` is
kept under the answer's id, a ``continue`` is rebuilt and sent plain, and
every refusal is the API's own. The relay and a strict simulated upstream
that ignores the ``thread`` field run in memory, time on a clock.
"""

from __future__ import annotations

import json

from prometheus_client import generate_latest
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from tests.helpers import UPSTREAM_URL, InMemoryRelay, messages_body
from twisted_relay.config import RelayConfig, one_upstream
from twisted_relay.message_threads.model import THREADS_BETA, assemble_stream
from twisted_relay.simulated import SimulatedUpstream

CREATE = {"type": "create"}


def continuing(previous: str) -> dict:
    return {"type": "continue", "previous_message_id": previous}


def results_for(answer: dict) -> list:
    """The user turn answering every tool call of ``answer``."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": block["id"], "content": "sunny"}
                for block in answer["content"]
                if block["type"] == "tool_use"
            ],
        }
    ]


class _ThreadedRelay(SynchronousTestCase):
    def relay(self, threads: str = "ignore", **settings) -> InMemoryRelay:
        self.clock = MemoryReactorClock()
        self.upstream = SimulatedUpstream(mode="strict", seed=3, threads=threads, reactor=self.clock)
        config = RelayConfig(listen=(), upstreams=one_upstream(UPSTREAM_URL), dump_dir=None).with_changes(**settings)
        return InMemoryRelay(self.upstream.resource(), config, clock=self.clock)

    def call(self, relay: InMemoryRelay, body: dict, key: str = "sk-test-client") -> tuple[int, dict]:
        """POST ``body`` with the threads beta; the status and the answer (a stream assembled)."""
        d = relay.post(
            "/v1/messages?beta=true", body, {"anthropic-beta": [THREADS_BETA], "x-api-key": [key]}
        )
        relay.flush()
        response = self.successResultOf(d)
        content = response.content()
        relay.flush()
        data = self.successResultOf(content)
        if body.get("stream") and response.code == 200:
            return response.code, assemble_stream(data)
        return response.code, json.loads(data)

    def assertThreadError(self, result: tuple[int, dict], status: int, error_type: str, code: str) -> None:
        self.assertEqual(result[0], status, result)
        self.assertEqual(result[1]["type"], "error")
        self.assertEqual(result[1]["error"]["type"], error_type)
        self.assertEqual(result[1]["error"]["details"], {"error_code": code})
        self.assertTrue(result[1]["request_id"].startswith("rly_"))


class RelayHeldThreadTests(_ThreadedRelay):
    """The relay holds threads itself in front of an upstream that does not know them."""

    def session(self, relay: InMemoryRelay, turns: int, stream: bool = False, ask: str = "Hello") -> list[dict]:
        """A tool-use session of ``turns`` turns in one thread; the answers."""
        first = [{"role": "user", "content": ask}]
        code, answer = self.call(relay, messages_body(first, stream=stream, thread=CREATE))
        self.assertEqual(code, 200, answer)
        answers = [answer]
        for _ in range(turns - 1):
            self.assertEqual(answer["stop_reason"], "tool_use")
            body = messages_body(results_for(answer), stream=stream, tools=False, thread=continuing(answer["id"]))
            code, answer = self.call(relay, body)
            self.assertEqual(code, 200, answer)
            answers.append(answer)
        return answers

    def test_continue_rebuilt_json(self):
        """
        Continues carrying only tool results reach a strict upstream whole: it
        would refuse a ``tool_result`` without its ``tool_use`` in the history.
        """
        relay = self.relay()
        answers = self.session(relay, 6)
        self.assertEqual(len(answers), 6)
        self.assertEqual(relay.app.threads.store.hits, 5)
        self.assertEqual(relay.app.threads.store.misses, 0)

    def test_continue_rebuilt_stream(self):
        """A streamed session: each answer is recorded as the client received it and continued from."""
        relay = self.relay()
        answers = self.session(relay, 5, stream=True)
        self.assertEqual(len({a["id"] for a in answers}), 5)
        self.assertEqual(relay.app.threads.store.hits, 4)

    def test_upstream_that_rejects_the_field(self):
        """An upstream that refuses the ``thread`` field gets plain requests (no field): the session goes on."""
        relay = self.relay(threads="rejects")
        self.session(relay, 4)

    def test_unknown_thread(self):
        """A continue from an answer the relay never kept is the API's 404 ``thread_not_found``."""
        relay = self.relay()
        result = self.call(relay, messages_body(tools=False, thread=continuing("msg_unknown")))
        self.assertThreadError(result, 404, "not_found_error", "thread_not_found")
        self.assertEqual(relay.app.threads.store.misses, 1)

    def test_second_continue(self):
        """A second continue from one answer is ``thread_already_continued``; the latest goes on."""
        relay = self.relay()
        first = self.session(relay, 2)
        body = messages_body(results_for(first[0]), tools=False, thread=continuing(first[0]["id"]))
        self.assertThreadError(self.call(relay, body), 400, "invalid_request_error", "thread_already_continued")
        body = messages_body(results_for(first[1]), tools=False, thread=continuing(first[1]["id"]))
        self.assertEqual(self.call(relay, body)[0], 200)

    def test_changed_tools(self):
        """A continue that changes ``tools`` is ``thread_fingerprint_mismatch``."""
        relay = self.relay()
        [answer] = self.session(relay, 1)
        body = messages_body(results_for(answer), tools=True, thread=continuing(answer["id"]))
        body["tools"] = body["tools"] + [dict(body["tools"][0], name="other")]
        self.assertThreadError(
            self.call(relay, body), 400, "invalid_request_error", "thread_fingerprint_mismatch"
        )

    def test_malformed_field(self):
        """A malformed ``thread`` field is a plain 400 naming it; nothing is sent upstream."""
        relay = self.relay()
        code, answer = self.call(relay, messages_body(thread={"type": "fork"}))
        self.assertEqual(code, 400)
        self.assertIn("thread.type", answer["error"]["message"])

    def test_failed_answer_does_not_advance(self):
        """
        A continue the upstream refuses (a ``tool_result`` for an unknown id)
        leaves the thread where it was: the same answer can be continued again.
        """
        relay = self.relay()
        [answer] = self.session(relay, 1)
        bad = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]
        code, refused = self.call(relay, messages_body(bad, tools=False, thread=continuing(answer["id"])))
        self.assertEqual(code, 400, refused)
        self.assertNotIn("details", refused["error"])
        body = messages_body(results_for(answer), tools=False, thread=continuing(answer["id"]))
        self.assertEqual(self.call(relay, body)[0], 200)

    def test_other_client(self):
        """Only the client that created a thread can continue it: another key gets ``thread_not_found``."""
        relay = self.relay()
        [answer] = self.session(relay, 1)
        body = messages_body(results_for(answer), tools=False, thread=continuing(answer["id"]))
        self.assertThreadError(self.call(relay, body, key="sk-other"), 404, "not_found_error", "thread_not_found")
        self.assertEqual(self.call(relay, body)[0], 200)

    def test_expiry(self):
        """A thread unused for ``thread_ttl`` seconds is gone: ``thread_not_found``, counted as expired."""
        relay = self.relay(thread_ttl=60.0)
        [answer] = self.session(relay, 1)
        self.clock.advance(61)
        body = messages_body(results_for(answer), tools=False, thread=continuing(answer["id"]))
        self.assertThreadError(self.call(relay, body), 404, "not_found_error", "thread_not_found")
        self.assertEqual(relay.app.threads.store.expirations, 1)

    def test_eviction_by_count(self):
        """Past ``thread_max_count`` the least recently used thread is evicted."""
        relay = self.relay(thread_max_count=2)
        first = self.session(relay, 1, ask="one")[0]
        second = self.session(relay, 1, ask="two")[0]
        self.session(relay, 1, ask="three")
        self.assertThreadError(
            self.call(relay, messages_body(results_for(first), tools=False, thread=continuing(first["id"]))),
            404, "not_found_error", "thread_not_found",
        )
        body = messages_body(results_for(second), tools=False, thread=continuing(second["id"]))
        self.assertEqual(self.call(relay, body)[0], 200)
        self.assertEqual(relay.app.threads.store.evictions, 1)

    def test_metrics(self):
        """``/metrics`` counts lookups by outcome and shows what the store holds."""
        relay = self.relay()
        self.session(relay, 3)
        self.call(relay, messages_body(tools=False, thread=continuing("msg_unknown")))
        exposition = generate_latest(relay.app.metrics.registry).decode()
        self.assertIn('relay_thread_lookups_total{outcome="hit"} 2.0', exposition)
        self.assertIn('relay_thread_lookups_total{outcome="miss"} 1.0', exposition)
        self.assertIn("relay_threads_held 1.0", exposition)
        self.assertIn('relay_thread_evictions_total{reason="bound"} 0.0', exposition)

    def test_plain_requests_untouched(self):
        """A request without a thread is relayed as before and keeps nothing."""
        relay = self.relay()
        code, _ = self.call(relay, messages_body())
        self.assertEqual(code, 200)
        self.assertEqual(relay.app.threads.store.size(), (0, 0))

    def test_concurrent_continue(self):
        """A continue while another from the same answer is in flight is ``thread_continue_in_flight``."""
        relay = self.relay()
        [answer] = self.session(relay, 1)
        body = messages_body(results_for(answer), tools=False, thread=continuing(answer["id"]))
        headers = {"anthropic-beta": [THREADS_BETA]}
        first, second = relay.post("/v1/messages", body, headers), relay.post("/v1/messages", body, headers)
        relay.flush()
        responses = sorted([self.successResultOf(first), self.successResultOf(second)], key=lambda r: r.code)
        self.assertEqual([r.code for r in responses], [200, 400])
        content = responses[1].content()
        relay.flush()
        error = json.loads(self.successResultOf(content))["error"]
        self.assertEqual(error["details"], {"error_code": "thread_continue_in_flight"})


class PassedThroughThreadTests(_ThreadedRelay):
    """``threads = upstream``: the thread is passed to an upstream that knows threads."""

    def relay(self, **settings) -> InMemoryRelay:
        self.clock = MemoryReactorClock()
        self.upstream = SimulatedUpstream(mode="stateful", seed=3, threads="knows", reactor=self.clock)
        config = RelayConfig(
            listen=(), upstreams=one_upstream(UPSTREAM_URL, ids="original"), dump_dir=None, threads="upstream"
        ).with_changes(**settings)
        return InMemoryRelay(self.upstream.resource(), config, clock=self.clock)

    def test_continues_reach_the_upstreams_thread(self):
        """
        Each continue is a continue upstream too (the upstream found its own
        thread every time) and carries only the new, translated messages:
        a stateful upstream that reuses ids accepts every turn, and the
        client never sees an id twice.
        """
        relay = self.relay()
        code, answer = self.call(relay, messages_body(thread=CREATE))
        self.assertEqual(code, 200, answer)
        seen = [b["id"] for b in answer["content"] if b["type"] == "tool_use"]
        for _ in range(12):
            body = messages_body(results_for(answer), tools=False, thread=continuing(answer["id"]))
            code, answer = self.call(relay, body)
            self.assertEqual(code, 200, answer)
            seen += [b["id"] for b in answer["content"] if b["type"] == "tool_use"]
        self.assertEqual(len(seen), len(set(seen)))
        self.assertEqual(self.upstream.threads.store.hits, 12)
        self.assertEqual(relay.app.threads.store.hits, 12)

    def test_unknown_to_the_relay(self):
        """A continue from an answer the relay did not see is ``thread_not_found``; nothing goes upstream."""
        relay = self.relay()
        result = self.call(relay, messages_body(tools=False, thread=continuing("msg_unknown")))
        self.assertThreadError(result, 404, "not_found_error", "thread_not_found")
        self.assertEqual((self.upstream.threads.store.hits, self.upstream.threads.store.misses), (0, 0))
