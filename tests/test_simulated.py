"""
Tests for :mod:`twisted_relay.simulated`, the fake Anthropic upstream.
"""

from __future__ import annotations

import io
import json
import re
import sys
from typing import Any

import treq
from twisted.internet import reactor as global_reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Site
from treq.testing import StubTreq

from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.cli import parse_args, serve, upstream_from
from twisted_relay.simulated.model import (
    MODELS,
    ModelOptions,
    compose_answer,
    encode_events,
    message_events,
    plan_chunks,
    seeded_rng,
)

BASE = "http://upstream.example"

TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather at a place.",
        "input_schema": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["location"],
        },
    },
    {
        "name": "Bash",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
            "required": ["command"],
        },
    },
]

CANONICAL_TOOLU = re.compile(r"toolu_01[0-9A-Za-z]{22}")
CANONICAL_SRVTOOLU = re.compile(r"srvtoolu_01[0-9A-Za-z]{22}")


# -- helpers ------------------------------------------------------------------


def _assistant(*ids: str, kind: str = "tool_use") -> dict:
    return {
        "role": "assistant",
        "content": [{"type": "text", "text": "Je regarde."}]
        + [{"type": kind, "id": i, "name": "get_weather", "input": {"location": "Zürich"}} for i in ids],
    }


def _results(*ids: str) -> dict:
    return {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": i, "content": "22°C"} for i in ids],
    }


def _body(messages: list, **extra: Any) -> dict:
    body = {"model": "claude-sonnet-4-5-20250929", "max_tokens": 512, "messages": messages, "tools": TOOLS}
    body.update(extra)
    return body


def _answer_results(answer: dict) -> dict:
    ids = [block["id"] for block in answer["content"] if block["type"] == "tool_use"]
    return _results(*ids) if ids else {"role": "user", "content": "Continue."}


def _session(options: ModelOptions, turns: int, tools: list = TOOLS) -> list[tuple[list, dict]]:
    """Drive the pure model like a client: ``(history sent, answer)`` per turn."""
    messages: list = [{"role": "user", "content": "Bonjour, fais le tour des outils."}]
    turns_seen = []
    for _ in range(turns):
        answer = compose_answer(_body(messages, tools=tools), options)
        turns_seen.append((messages, answer))
        messages = messages + [
            {"role": "assistant", "content": answer["content"]},
            _answer_results(answer),
        ]
    return turns_seen


def _declared(messages: list, kind: str = "tool_use") -> list[str]:
    return [
        block["id"]
        for message in messages
        if isinstance(message["content"], list)
        for block in message["content"]
        if block["type"] == kind
    ]


def parse_sse(data: bytes) -> list[tuple[str, dict]]:
    """A reference SSE reader: all three line endings, one ``data`` line."""
    events, name, lines = [], None, []
    for line in re.split(r"\r\n|\r|\n", data.decode("utf-8")):
        if line == "":
            if name is not None or lines:
                events.append((name, json.loads("\n".join(lines))))
            name, lines = None, []
        elif line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            lines.append(line[len("data: ") :])
    return events


def assemble(test: SynchronousTestCase, events: list[tuple[str, dict]]) -> dict:
    """
    Check that ``events`` is a well-formed Anthropic stream and rebuild the
    message it carries, as an SDK would.
    """
    for name, data in events:
        test.assertEqual(name, data["type"])
    names = [name for name, _ in events if name != "ping"]
    test.assertEqual(names[0], "message_start")
    test.assertEqual(names[-2:], ["message_delta", "message_stop"])
    test.assertIn("ping", [name for name, _ in events])
    message = events[0][1]["message"]
    test.assertEqual(message["content"], [])
    test.assertIsNone(message["stop_reason"])
    open_index, partial = None, {}
    for name, data in events[1:]:
        if name == "content_block_start":
            test.assertIsNone(open_index, "a block started before the previous one stopped")
            test.assertEqual(data["index"], len(message["content"]))
            open_index = data["index"]
            message["content"].append(dict(data["content_block"]))
            partial[open_index] = []
        elif name == "content_block_delta":
            test.assertEqual(data["index"], open_index)
            block, delta = message["content"][open_index], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                test.assertEqual(delta["type"], "input_json_delta")
                partial[open_index].append(delta["partial_json"])
        elif name == "content_block_stop":
            test.assertEqual(data["index"], open_index)
            block = message["content"][open_index]
            if block["type"].endswith("tool_use"):
                block["input"] = json.loads("".join(partial[open_index]))
            open_index = None
        elif name == "message_delta":
            test.assertIsNone(open_index)
            message["stop_reason"] = data["delta"]["stop_reason"]
            # Cumulative counts: laid over those of message_start.
            message["usage"].update(data["usage"])
    return message


def _sans_id(answer: dict) -> dict:
    """An answer without its ``msg_`` id, which today's API draws afresh every time."""
    return {key: value for key, value in answer.items() if key != "id"}


class _Upstream:
    """A simulated upstream behind StubTreq, paced by a Clock."""

    def __init__(self, **options: Any):
        self.clock = Clock()
        options.setdefault("reactor", self.clock)
        self.sim = SimulatedUpstream(**options)
        self.stub = StubTreq(self.sim.resource())

    def settle(self) -> None:
        for _ in range(10_000):
            self.stub.flush()
            if not self.clock.getDelayedCalls():
                break
            self.clock.advance(1)
        self.stub.flush()

    def request(
        self, method: str, path: str, body: Any = None, headers: dict | None = None
    ) -> tuple[Any, bytes]:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode("utf-8")
        d = self.stub.request(method, BASE + path, data=data, headers=headers or {})
        self.settle()
        response = _result(d)
        content = self.stub.content(response)
        self.settle()
        return response, _result(content)

    def post(self, body: Any, path: str = "/v1/messages", headers: dict | None = None) -> tuple[Any, Any]:
        response, content = self.request("POST", path, body, headers)
        if response.headers.getRawHeaders("content-type", [""])[0].startswith("application/json"):
            return response, json.loads(content)
        return response, content


def _result(d: Deferred) -> Any:
    results: list = []
    d.addBoth(results.append)
    if not results:
        raise AssertionError("the Deferred has not fired")
    if isinstance(results[0], Failure):
        results[0].raiseException()
    return results[0]


class _ErrorAssertions:
    """Checks shared by the test cases that look at Anthropic errors."""

    def assert_error(
        self, response: Any, body: Any, status: int, error_type: str, message: str | None = None
    ) -> None:
        self.assertEqual(response.code, status)
        self.assertEqual(body["type"], "error")
        self.assertEqual(body["error"]["type"], error_type)
        if message is not None:
            self.assertEqual(body["error"]["message"], message)
        self.assertEqual(body["request_id"], response.headers.getRawHeaders("request-id")[0])


# -- modes --------------------------------------------------------------------


class StrictModeTests(_ErrorAssertions, SynchronousTestCase):
    """A strict upstream rejects what Anthropic's stateless API rejects, in its words."""

    def setUp(self) -> None:
        self.upstream = _Upstream(mode="strict")

    def test_clean_history_accepted(self) -> None:
        """A history with unique, answered ids gets a 200 with a tool_use answer."""
        messages = [{"role": "user", "content": "hi"}, _assistant("toolu_a"), _results("toolu_a")]
        response, body = self.upstream.post(_body(messages))
        self.assertEqual(response.code, 200)
        self.assertEqual(body["type"], "message")
        self.assertEqual(body["stop_reason"], "tool_use")
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["application/json"])

    def test_duplicate_declaration(self) -> None:
        """A tool_use id declared twice anywhere in the history is a 400 at the repeat."""
        messages = [
            {"role": "user", "content": "hi"},
            _assistant("toolu_a"),
            _results("toolu_a"),
            _assistant("toolu_a"),
            _results("toolu_a"),
        ]
        response, body = self.upstream.post(_body(messages))
        self.assert_error(
            response,
            body,
            400,
            "invalid_request_error",
            "messages.3.content.1: `tool_use` ids must be unique",
        )

    def test_duplicate_inside_one_message(self) -> None:
        """Two parallel calls with one id are a duplicate too."""
        messages = [{"role": "user", "content": "hi"}, _assistant("toolu_a", "toolu_a"), _results("toolu_a")]
        response, body = self.upstream.post(_body(messages))
        self.assert_error(
            response,
            body,
            400,
            "invalid_request_error",
            "messages.1.content.2: `tool_use` ids must be unique",
        )

    def test_server_tool_duplicate(self) -> None:
        """A server_tool_use id repeating across turns is rejected like a tool_use one."""
        messages = [
            {"role": "user", "content": "hi"},
            _assistant("srvtoolu_01a", kind="server_tool_use"),
            {"role": "user", "content": "encore"},
            _assistant("srvtoolu_01a", kind="server_tool_use"),
            {"role": "user", "content": "encore"},
        ]
        response, body = self.upstream.post(_body(messages))
        self.assert_error(
            response,
            body,
            400,
            "invalid_request_error",
            "messages.3.content.1: `tool_use` ids must be unique",
        )

    def test_unexpected_tool_result(self) -> None:
        """A tool_result that answers no tool_use of the previous message is a 400 naming the id."""
        messages = [{"role": "user", "content": "hi"}, _assistant("toolu_a"), _results("toolu_a", "toolu_zz")]
        response, body = self.upstream.post(_body(messages))
        self.assert_error(
            response,
            body,
            400,
            "invalid_request_error",
            "messages.2.content.1: unexpected `tool_use_id` found in `tool_result` blocks: toolu_zz. "
            "Each `tool_result` block must have a corresponding `tool_use` block in the previous message.",
        )

    def test_result_for_an_older_call(self) -> None:
        """A result must answer the previous message, not an older one."""
        messages = [
            {"role": "user", "content": "hi"},
            _assistant("toolu_a"),
            _results("toolu_a"),
            _assistant("toolu_b"),
            _results("toolu_a"),
        ]
        response, body = self.upstream.post(_body(messages))
        self.assertEqual(response.code, 400)
        self.assertIn(
            "unexpected `tool_use_id` found in `tool_result` blocks: toolu_a.", body["error"]["message"]
        )
        self.assertTrue(body["error"]["message"].startswith("messages.4.content.0: "))

    def test_missing_tool_result(self) -> None:
        """A tool_use left unanswered by the next message is a 400 on the assistant message."""
        messages = [{"role": "user", "content": "hi"}, _assistant("toolu_a", "toolu_b"), _results("toolu_a")]
        response, body = self.upstream.post(_body(messages))
        self.assert_error(
            response,
            body,
            400,
            "invalid_request_error",
            "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_b. "
            "Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
        )

    def test_tool_use_id_pattern(self) -> None:
        """A tool_use id outside ^[a-zA-Z0-9_-]+$ (a Kimi id) is rejected with the pattern."""
        messages = [
            {"role": "user", "content": "hi"},
            _assistant("functions.Bash:0"),
            _results("functions.Bash:0"),
        ]
        response, body = self.upstream.post(_body(messages))
        self.assert_error(
            response,
            body,
            400,
            "invalid_request_error",
            "messages.1.content.1.tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$'",
        )

    def test_server_tool_use_id_pattern(self) -> None:
        """A server_tool_use id with a hyphen breaks ^srvtoolu_[a-zA-Z0-9_]+$."""
        messages = [
            {"role": "user", "content": "hi"},
            _assistant("srvtoolu_01a-2", kind="server_tool_use"),
            {"role": "user", "content": "encore"},
        ]
        response, body = self.upstream.post(_body(messages))
        self.assert_error(
            response,
            body,
            400,
            "invalid_request_error",
            "messages.1.content.1.server_tool_use.id: String should match pattern '^srvtoolu_[a-zA-Z0-9_]+$'",
        )

    def test_rewritten_ids_accepted(self) -> None:
        """The relay's rewrites (X-2 for tool_use, X_2 for server_tool_use) pass strict checks."""
        messages = [
            {"role": "user", "content": "hi"},
            _assistant("toolu_a"),
            _results("toolu_a"),
            _assistant("toolu_a-2"),
            _results("toolu_a-2"),
        ]
        response, _ = self.upstream.post(_body(messages))
        self.assertEqual(response.code, 200)

    def test_server_result_needs_its_call(self) -> None:
        """A web_search_tool_result must point at a server_tool_use of its own message."""
        message = _assistant("srvtoolu_01a", kind="server_tool_use")
        message["content"].append(
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_01b", "content": []}
        )
        response, body = self.upstream.post(
            _body([{"role": "user", "content": "hi"}, message, {"role": "user", "content": "ok"}])
        )
        self.assertEqual(response.code, 400)
        self.assertIn("srvtoolu_01b", body["error"]["message"])

    def test_shape_errors(self) -> None:
        """Missing required fields are 400s with pydantic-style locations."""
        cases = [
            ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens: Field required"),
            ({"max_tokens": 5, "messages": []}, "model: Field required"),
            ({"model": "m", "max_tokens": 5}, "messages: Field required"),
            (
                {"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]},
                "messages.0.role: Input should be 'user' or 'assistant'",
            ),
        ]
        for body, message in cases:
            response, answer = self.upstream.post(body)
            self.assert_error(response, answer, 400, "invalid_request_error", message)

    def test_body_not_json(self) -> None:
        """A body that is not JSON is an invalid_request_error, not a crash."""
        response, body = self.upstream.post(b"{not json")
        self.assert_error(response, body, 400, "invalid_request_error")

    def test_session_fails_after_first_reuse(self) -> None:
        """
        Fed its own answers back, the model's first reused id (the third call)
        makes the fourth request fail: the failure the relay exists to prevent.
        """
        messages: list = [{"role": "user", "content": "hi"}]
        codes = []
        for _ in range(5):
            response, body = self.upstream.post(_body(messages))
            codes.append(response.code)
            if response.code != 200:
                break
            messages = messages + [{"role": "assistant", "content": body["content"]}, _answer_results(body)]
        self.assertEqual(codes, [200, 200, 200, 400])
        self.assertIn("`tool_use` ids must be unique", body["error"]["message"])


class StatefulModeTests(_ErrorAssertions, SynchronousTestCase):
    """A stateful upstream accepts its own duplicates but catches any id it did not issue."""

    def setUp(self) -> None:
        self.upstream = _Upstream(mode="stateful", reuse_every=2)

    def _converse(self, turns: int, headers: dict | None = None, first: str = "hi") -> list:
        messages: list = [{"role": "user", "content": first}]
        for _ in range(turns):
            response, body = self.upstream.post(_body(messages), headers=headers)
            self.assertEqual(response.code, 200, body)
            messages = messages + [{"role": "assistant", "content": body["content"]}, _answer_results(body)]
        return messages

    def test_own_duplicates_accepted(self) -> None:
        """A 12-turn session full of reused ids is accepted when the ids come back exactly."""
        messages = self._converse(12)
        declared = _declared(messages)
        self.assertLess(len(set(declared)), len(declared))

    def test_mangled_id_rejected(self) -> None:
        """A declaration carrying any other id than the issued one (a relay's X-2) is a 400."""
        messages = self._converse(3)
        victim = messages[3]["content"][1]
        victim["id"] += "-2"
        messages[4]["content"][0]["tool_use_id"] = victim["id"]
        response, body = self.upstream.post(_body(messages))
        self.assert_error(response, body, 400, "invalid_request_error")
        self.assertTrue(body["error"]["message"].startswith("messages.3.content.1: "))
        self.assertIn(victim["id"], body["error"]["message"])

    def test_swapped_ids_rejected(self) -> None:
        """Issued ids in the wrong blocks are caught even though each was issued."""
        self.upstream = _Upstream(mode="stateful", reuse_every=0)
        messages = self._converse(2)
        first, second = messages[1]["content"][1], messages[3]["content"][1]
        first["id"], second["id"] = second["id"], first["id"]
        messages[2]["content"][0]["tool_use_id"] = first["id"]
        messages[4]["content"][0]["tool_use_id"] = second["id"]
        response, body = self.upstream.post(_body(messages))
        self.assert_error(response, body, 400, "invalid_request_error")
        self.assertIn("is not the id issued for this block", body["error"]["message"])

    def test_result_for_unissued_id(self) -> None:
        """A tool_result for an id the upstream never issued is a 400."""
        messages = self._converse(1)
        messages[2]["content"][0]["tool_use_id"] = "toolu_never"
        response, body = self.upstream.post(_body(messages))
        self.assert_error(
            response,
            body,
            400,
            "invalid_request_error",
            "messages.2.content.0: `tool_use_id` toolu_never was never issued",
        )

    def test_unknown_conversation(self) -> None:
        """A history with declarations from a conversation the upstream never had is a 400."""
        messages = [{"role": "user", "content": "hi"}, _assistant("toolu_a"), _results("toolu_a")]
        response, body = self.upstream.post(_body(messages))
        self.assert_error(response, body, 400, "invalid_request_error")
        self.assertIn("no conversation", body["error"]["message"])

    def test_restart_forgets(self) -> None:
        """A restarted stateful upstream no longer knows the conversation."""
        messages = self._converse(2)
        restarted = _Upstream(mode="stateful", reuse_every=2)
        response, _ = restarted.post(_body(messages))
        self.assertEqual(response.code, 400)

    def test_session_header_is_the_key(self) -> None:
        """Conversations are told apart by x-claude-code-session-id when it is sent."""
        one = self._converse(2, headers={"x-claude-code-session-id": "one"})
        response, body = self.upstream.post(_body(one), headers={"x-claude-code-session-id": "two"})
        self.assertEqual(response.code, 400, body)
        response, _ = self.upstream.post(_body(one), headers={"x-claude-code-session-id": "one"})
        self.assertEqual(response.code, 200)

    def test_retry_accepted(self) -> None:
        """Sending the same turn twice (a retry) is accepted and answered the same way."""
        messages = self._converse(3)
        first = self.upstream.post(_body(messages))[1]
        second = self.upstream.post(_body(messages))[1]
        self.assertEqual(_sans_id(first), _sans_id(second))
        self.assertNotEqual(first["id"], second["id"])
        messages = messages + [{"role": "assistant", "content": second["content"]}, _answer_results(second)]
        self.assertEqual(self.upstream.post(_body(messages))[0].code, 200)

    def test_results_matched_by_occurrence(self) -> None:
        """Two results for an id called once in the previous message are one too many."""
        messages = self._converse(1)
        call = messages[1]["content"][1]["id"]
        messages[2] = _results(call, call)
        response, body = self.upstream.post(_body(messages))
        self.assertEqual(response.code, 400)
        self.assertIn("unexpected `tool_use_id`", body["error"]["message"])


class LenientModeTests(SynchronousTestCase):
    """A lenient upstream accepts whatever it is sent."""

    def test_accepts_anything(self) -> None:
        """Duplicates, bad patterns, orphan results and missing fields all get a 200."""
        upstream = _Upstream(mode="lenient")
        histories = [
            [{"role": "user", "content": "hi"}, _assistant("a b", "a b"), _results("nobody")],
            [{"role": "robot", "content": 3}],
        ]
        for messages in histories:
            response, body = upstream.post({"messages": messages, "tools": TOOLS})
            self.assertEqual(response.code, 200, body)
            self.assertEqual(body["type"], "message")

    def test_rejects_bad_options(self) -> None:
        """Unknown modes and id styles are refused when the upstream is built."""
        self.assertRaises(ValueError, SimulatedUpstream, mode="chaotic")
        self.assertRaises(ValueError, SimulatedUpstream, id_style="uuid")
        self.assertRaises(ValueError, SimulatedUpstream, reuse_every=-1)
        self.assertRaises(ValueError, SimulatedUpstream, line_ending="\n\n")


# -- the model ----------------------------------------------------------------


class ModelTests(SynchronousTestCase):
    """The fake model calls tools and reuses ids like the models in the incident report."""

    def test_deterministic(self) -> None:
        """Same seed and request give the same answer, across instances (a restart)."""
        body = _body([{"role": "user", "content": "hi"}])
        one = _Upstream(mode="lenient", seed=4).post(body)[1]
        two = _Upstream(mode="lenient", seed=4).post(body)[1]
        self.assertEqual(_sans_id(one), _sans_id(two))
        self.assertNotEqual(one["id"], two["id"], "today's API gives every answer a fresh msg_ id")
        old = [_Upstream(mode="lenient", seed=4, api="2025").post(body)[1] for _ in range(2)]
        self.assertEqual(old[0], old[1], "the year-old API drew the id from the request")
        other = _Upstream(mode="lenient", seed=5).post(body)[1]
        self.assertNotEqual(one["content"][1]["id"], other["content"][1]["id"])

    def test_answer_shape(self) -> None:
        """With tools: text then a tool_use of a given tool whose input fits its schema."""
        for history, answer in _session(ModelOptions(seed=2), 10):
            text, call = answer["content"]
            self.assertEqual(text["type"], "text")
            self.assertEqual(answer["stop_reason"], "tool_use")
            self.assertIn(call["name"], [tool["name"] for tool in TOOLS])
            required = next(t for t in TOOLS if t["name"] == call["name"])["input_schema"]["required"]
            self.assertLessEqual(set(required), set(call["input"]))
            self.assertTrue(answer["id"].startswith("msg_01"))
            self.assertGreater(answer["usage"]["input_tokens"], 0)

    def test_no_tools_ends_turn(self) -> None:
        """Without tools (or with tool_choice none) the answer is text with end_turn."""
        for body in (
            {"messages": [{"role": "user", "content": "hi"}]},
            _body([{"role": "user", "content": "hi"}], tool_choice={"type": "none"}),
        ):
            answer = compose_answer(body, ModelOptions())
            self.assertEqual([block["type"] for block in answer["content"]], ["text"])
            self.assertEqual(answer["stop_reason"], "end_turn")

    def test_reuse_every(self) -> None:
        """Every third call copies an id from the history; every other call is fresh and canonical."""
        seen: list[str] = []
        for call, (history, answer) in enumerate(_session(ModelOptions(seed=7, reuse_every=3), 30), start=1):
            self.assertEqual(_declared(history), seen)
            tool_id = answer["content"][1]["id"]
            if call % 3 == 0:
                self.assertIn(tool_id, seen)
            else:
                self.assertNotIn(tool_id, seen)
                self.assertRegex(tool_id, CANONICAL_TOOLU)
            seen.append(tool_id)

    def test_never_reuse(self) -> None:
        """reuse_every=0 gives 50 turns of distinct ids."""
        turns = _session(ModelOptions(seed=1, reuse_every=0), 50)
        ids = [answer["content"][1]["id"] for _, answer in turns]
        self.assertEqual(len(set(ids)), 50)

    def test_kimi_ids(self) -> None:
        """Kimi style numbers calls within the turn, so ids repeat every turn."""
        for _, answer in _session(ModelOptions(id_style="kimi", parallel=3), 4):
            calls = [block for block in answer["content"] if block["type"] == "tool_use"]
            self.assertEqual(
                [c["id"] for c in calls], [f"functions.{c['name']}:{i}" for i, c in enumerate(calls)]
            )

    def test_parallel(self) -> None:
        """parallel=N gives N tool_use blocks, and reuse sometimes repeats an id inside one answer."""
        turns = _session(ModelOptions(seed=3, parallel=3, reuse_every=2), 30)
        repeated_inside = 0
        for _, answer in turns:
            ids = [block["id"] for block in answer["content"] if block["type"] == "tool_use"]
            self.assertEqual(len(ids), 3)
            repeated_inside += len(set(ids)) < 3
        self.assertGreater(repeated_inside, 0)

    def test_server_tools(self) -> None:
        """A server_tool_use comes with a web_search_tool_result pointing at it, and is reused too."""
        seen: list[str] = []
        for call, (history, answer) in enumerate(
            _session(ModelOptions(seed=5, server_tools=True), 9), start=1
        ):
            kinds = [block["type"] for block in answer["content"]]
            self.assertEqual(kinds, ["server_tool_use", "web_search_tool_result", "text", "tool_use"])
            server, result = answer["content"][:2]
            self.assertEqual(result["tool_use_id"], server["id"])
            if call % 3 == 0:
                self.assertIn(server["id"], seen)
            else:
                self.assertRegex(server["id"], CANONICAL_SRVTOOLU)
            seen.append(server["id"])

    def test_lookalikes(self) -> None:
        """lookalikes=True sometimes emits X-2 natively, X being an id of the history."""
        found = 0
        for history, answer in _session(ModelOptions(seed=9, reuse_every=0, lookalikes=True), 30):
            tool_id = answer["content"][1]["id"]
            if tool_id.endswith("-2"):
                self.assertIn(tool_id[:-2], _declared(history))
                found += 1
        self.assertGreater(found, 0)


# -- streaming ----------------------------------------------------------------


class StreamTests(SynchronousTestCase):
    """Streamed answers are correct Anthropic SSE, cut and paced like a real network."""

    def _stream(self, **options: Any) -> tuple[Any, bytes]:
        # The year-old API: its msg_ id, and so its bytes, follow from the request.
        upstream = _Upstream(mode="lenient", api="2025", **options)
        messages = [{"role": "user", "content": "hi"}, _assistant("toolu_a"), _results("toolu_a")]
        return upstream.post(_body(messages, stream=True))

    def test_well_formed(self) -> None:
        """The stream parses into the Anthropic event order and rebuilds the JSON answer."""
        upstream = _Upstream(mode="lenient", server_tools=True, parallel=2)
        body = _body([{"role": "user", "content": "hi"}])
        response, data = upstream.post(dict(body, stream=True))
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["text/event-stream; charset=utf-8"])
        self.assertTrue(response.headers.getRawHeaders("request-id")[0].startswith("req_"))
        streamed = assemble(self, parse_sse(data))
        self.assertEqual(_sans_id(streamed), _sans_id(upstream.post(body)[1]))

    def test_deltas_are_split(self) -> None:
        """Text and tool input arrive in several deltas, as from a real model."""
        _, data = self._stream()
        deltas = [d["delta"] for name, d in parse_sse(data) if name == "content_block_delta"]
        self.assertGreater(len([d for d in deltas if d["type"] == "text_delta"]), 1)
        self.assertGreater(len([d for d in deltas if d["type"] == "input_json_delta"]), 1)

    def test_split_reassembles(self) -> None:
        """split=True writes the same bytes as split=False."""
        self.assertEqual(self._stream(split=True)[1], self._stream(split=False)[1])

    def test_cuts_at_odd_places(self) -> None:
        """Split pieces cut a UTF-8 character, a CRLF pair and event boundaries."""
        message = compose_answer(_body([{"role": "user", "content": "hi"}]), ModelOptions(server_tools=True))
        self.assertNotEqual(
            message["content"][2]["text"].encode("utf-8").decode("ascii", "replace"),
            message["content"][2]["text"],
        )
        data, starts = encode_events(message_events(message, seeded_rng(0, "d")), "\r\n")
        pieces = plan_chunks(data, starts, seeded_rng(0, "c"))
        self.assertEqual(b"".join(piece for _, piece in pieces), data)
        offsets = [0]
        for _, piece in pieces:
            offsets.append(offsets[-1] + len(piece))
        self.assertTrue(any(data[o] & 0xC0 == 0x80 for o in offsets[1:-1]))
        self.assertTrue(any(data[o - 1 : o + 1] == b"\r\n" for o in offsets[1:-1]))
        self.assertTrue(set(offsets[1:-1]) - set(starts))
        unsplit = plan_chunks(data, starts, None)
        self.assertEqual([index for index, _ in unsplit], list(range(len(starts))))

    def test_piece_event_index(self) -> None:
        """Each piece is tagged with the last event it touches, so it is never sent early."""
        message = compose_answer(_body([{"role": "user", "content": "hi"}]), ModelOptions())
        data, starts = encode_events(message_events(message, seeded_rng(0, "d")))
        offset = 0
        for index, piece in plan_chunks(data, starts, seeded_rng(1, "c")):
            offset += len(piece)
            self.assertLess(starts[index], offset)
            self.assertTrue(index == len(starts) - 1 or starts[index + 1] >= offset)

    def test_line_endings(self) -> None:
        """CRLF and CR streams carry the same events as LF streams."""
        events = parse_sse(self._stream()[1])
        for ending in ("\r\n", "\r"):
            data = self._stream(line_ending=ending)[1]
            self.assertNotIn(b"\n" if ending == "\r" else b"\n\n", data)
            self.assertEqual(parse_sse(data), events)

    def test_paced_by_clock(self) -> None:
        """Nothing is sent until the clock moves; then one event per event_delay."""
        upstream = _Upstream(mode="lenient", event_delay=1.0, split=False)
        d = upstream.stub.post(
            BASE + "/v1/messages",
            data=json.dumps(_body([{"role": "user", "content": "hi"}], stream=True)),
            unbuffered=True,
        )
        upstream.stub.flush()
        self.assertNoResult(d)
        upstream.clock.advance(0)
        upstream.stub.flush()
        received: list[bytes] = []
        done = upstream.stub.collect(self.successResultOf(d), received.append)
        upstream.stub.flush()
        self.assertEqual([name for name, _ in parse_sse(b"".join(received))], ["message_start"])
        upstream.clock.advance(1)
        upstream.stub.flush()
        self.assertEqual(len(parse_sse(b"".join(received))), 2)
        self.assertNoResult(done)
        upstream.settle()
        self.successResultOf(done)
        assemble(self, parse_sse(b"".join(received)))


class _Connection:
    """The simulated upstream's Site on an in-memory transport."""

    def __init__(self, test: SynchronousTestCase, **options: Any):
        self.clock = Clock()
        sim = SimulatedUpstream(mode="lenient", reactor=self.clock, event_delay=0.5, **options)
        self.channel = Site(sim.resource(), reactor=self.clock).buildProtocol(None)
        self.transport = StringTransport()
        self.channel.makeConnection(self.transport)
        body = json.dumps(_body([{"role": "user", "content": "hi"}], stream=True)).encode()
        self.channel.dataReceived(
            b"POST /v1/messages HTTP/1.1\r\nHost: upstream\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )


def _dechunk(response: bytes) -> bytes:
    """The body of a complete chunked HTTP/1.1 response."""
    rest = response.partition(b"\r\n\r\n")[2]
    body = b""
    while True:
        size, _, rest = rest.partition(b"\r\n")
        if int(size, 16) == 0:
            return body
        body, rest = body + rest[: int(size, 16)], rest[int(size, 16) + 2 :]


class StreamConnectionTests(SynchronousTestCase):
    """A stream respects the connection: back-pressure and the client going away."""

    def test_pauses_under_back_pressure(self) -> None:
        """While the channel is paused no more bytes are written; resuming catches up."""
        connection = _Connection(self)
        connection.clock.advance(1)
        written = len(connection.transport.value())
        self.assertGreater(written, 0)
        # What a real transport does when its send buffer fills, and empties.
        connection.transport.producer.pauseProducing()
        connection.clock.advance(10)
        self.assertEqual(len(connection.transport.value()), written)
        connection.transport.producer.resumeProducing()
        for _ in range(200):
            connection.clock.advance(0.5)
        assemble(self, parse_sse(_dechunk(connection.transport.value())))

    def test_client_gone_stops_timers(self) -> None:
        """When the client disconnects mid-stream, no timer is left and nothing more is written."""
        connection = _Connection(self)
        connection.clock.advance(1)
        self.assertTrue(connection.clock.getDelayedCalls())
        connection.channel.connectionLost(Failure(ConnectionDone()))
        written = connection.transport.value()
        self.assertEqual(connection.clock.getDelayedCalls(), [])
        connection.clock.advance(100)
        self.assertEqual(connection.transport.value(), written)


# -- the other endpoints ------------------------------------------------------


class EndpointTests(_ErrorAssertions, SynchronousTestCase):
    """count_tokens, models, unknown paths and the request log."""

    def setUp(self) -> None:
        self.upstream = _Upstream(mode="strict")

    def test_count_tokens(self) -> None:
        """count_tokens answers input_tokens, which grows with the conversation."""
        short = [{"role": "user", "content": "hi"}]
        long = short + [_assistant("toolu_a"), _results("toolu_a")]
        counts = []
        for messages in (short, long):
            response, body = self.upstream.post(
                {"model": "m", "messages": messages}, path="/v1/messages/count_tokens"
            )
            self.assertEqual(response.code, 200)
            self.assertEqual(list(body), ["input_tokens"])
            counts.append(body["input_tokens"])
        self.assertLess(counts[0], counts[1])

    def test_count_tokens_validated(self) -> None:
        """count_tokens rejects the histories messages rejects, in strict mode."""
        messages = [{"role": "user", "content": "hi"}, _assistant("toolu_a", "toolu_a"), _results("toolu_a")]
        response, body = self.upstream.post(
            {"model": "m", "messages": messages}, path="/v1/messages/count_tokens"
        )
        self.assert_error(
            response,
            body,
            400,
            "invalid_request_error",
            "messages.1.content.2: `tool_use` ids must be unique",
        )

    def test_models_pages(self) -> None:
        """GET /v1/models pages with limit, has_more, first_id, last_id and after_id."""
        response, content = self.upstream.request("GET", "/v1/models?limit=2")
        page = json.loads(content)
        self.assertEqual(response.code, 200)
        self.assertEqual([m["id"] for m in page["data"]], [m["id"] for m in MODELS[:2]])
        self.assertEqual(
            (page["has_more"], page["first_id"], page["last_id"]), (True, MODELS[0]["id"], MODELS[1]["id"])
        )
        rest = json.loads(
            self.upstream.request("GET", f"/v1/models?limit=1000&after_id={page['last_id']}")[1]
        )
        self.assertEqual([m["id"] for m in rest["data"]], [m["id"] for m in MODELS[2:]])
        self.assertFalse(rest["has_more"])

    def test_models_bad_limit(self) -> None:
        """A limit outside 1..1000 is a 400."""
        response, content = self.upstream.request("GET", "/v1/models?limit=0")
        self.assert_error(response, json.loads(content), 400, "invalid_request_error")

    def test_one_model(self) -> None:
        """GET /v1/models/{id} returns the model, or a 404 naming it."""
        model_id = MODELS[1]["id"]
        response, content = self.upstream.request("GET", f"/v1/models/{model_id}")
        self.assertEqual(json.loads(content), MODELS[1])
        response, content = self.upstream.request("GET", "/v1/models/gpt-nope")
        self.assert_error(response, json.loads(content), 404, "not_found_error", "model: gpt-nope")

    def test_unknown_paths(self) -> None:
        """Unknown paths and HEAD / are Anthropic-shaped 404s with a request-id."""
        response, content = self.upstream.request("GET", "/v2/whatever")
        self.assert_error(response, json.loads(content), 404, "not_found_error", "Not Found")
        response, content = self.upstream.request("HEAD", "/")
        self.assertEqual((response.code, content), (404, b""))
        self.assertRegex(response.headers.getRawHeaders("request-id")[0], r"req_01[0-9A-Za-z]{22}")

    def test_wrong_method(self) -> None:
        """GET on the messages endpoint is refused with an Anthropic error."""
        response, content = self.upstream.request("GET", "/v1/messages")
        self.assert_error(response, json.loads(content), 405, "invalid_request_error")

    def test_requests_recorded(self) -> None:
        """requests keeps method, target with query, lower-case headers and parsed body."""
        body = _body([{"role": "user", "content": "hi"}])
        self.upstream.post(body, path="/v1/messages?beta=true", headers={"X-Claude-Code-Session-Id": "s1"})
        method, path, headers, received = self.upstream.sim.requests[-1]
        self.assertEqual((method, path, received), ("POST", "/v1/messages?beta=true", body))
        self.assertEqual(headers["x-claude-code-session-id"], "s1")

    def test_requests_bounded(self) -> None:
        """Only the last keep_requests requests are kept."""
        upstream = _Upstream(keep_requests=3)
        for n in range(5):
            upstream.request("GET", f"/v1/models/{n}")
        self.assertEqual(
            [r.path for r in upstream.sim.requests], ["/v1/models/2", "/v1/models/3", "/v1/models/4"]
        )


class KeyTests(_ErrorAssertions, SynchronousTestCase):
    """With require_key, only requests carrying the key are served."""

    def setUp(self) -> None:
        self.upstream = _Upstream(mode="lenient", require_key="sk-ant-sim-123")
        self.body = _body([{"role": "user", "content": "hi"}])

    def test_missing_key(self) -> None:
        """No key at all is a 401 authentication_error."""
        response, body = self.upstream.post(self.body)
        self.assert_error(response, body, 401, "authentication_error", "x-api-key header is required")

    def test_wrong_key(self) -> None:
        """A wrong key, in either header, is a 401 that does not echo it."""
        for headers in ({"x-api-key": "sk-ant-other"}, {"authorization": "Bearer sk-ant-other"}):
            response, body = self.upstream.post(self.body, headers=headers)
            self.assert_error(response, body, 401, "authentication_error", "invalid x-api-key")
            self.assertNotIn("sk-ant-other", json.dumps(body))

    def test_right_key(self) -> None:
        """The key in x-api-key or as a Bearer token is accepted, on every endpoint."""
        for headers in ({"x-api-key": "sk-ant-sim-123"}, {"Authorization": "Bearer sk-ant-sim-123"}):
            self.assertEqual(self.upstream.post(self.body, headers=headers)[0].code, 200)
            self.assertEqual(self.upstream.request("GET", "/v1/models", headers=headers)[0].code, 200)
        self.assertEqual(self.upstream.request("GET", "/v1/models")[0].code, 401)


# -- the command line ---------------------------------------------------------


class CommandLineTests(SynchronousTestCase):
    """twisted-relay-simulated's options."""

    def test_defaults(self) -> None:
        """Without arguments: strict, seed 0, reuse every 3, on 127.0.0.1:8081."""
        options = parse_args([])
        self.assertEqual(
            (options.listen, options.mode, options.seed, options.reuse_every),
            ("tcp:8081:interface=127.0.0.1", "strict", 0, 3),
        )

    def test_options_reach_the_upstream(self) -> None:
        """Every option is passed on to the SimulatedUpstream."""
        options = parse_args(
            [
                "--mode",
                "stateful",
                "--seed",
                "4",
                "--reuse-every",
                "0",
                "--event-delay",
                "0.02",
                "--id-style",
                "kimi",
                "--parallel",
                "2",
                "--server-tools",
                "--lookalikes",
                "--no-split",
                "--line-ending",
                "crlf",
            ]
        )
        sim = upstream_from(options, Clock())
        self.assertEqual(
            (sim.mode, sim.event_delay, sim.split, sim.line_ending), ("stateful", 0.02, False, "\r\n")
        )
        self.assertEqual(
            sim.options,
            ModelOptions(
                seed=4, reuse_every=0, id_style="kimi", parallel=2, server_tools=True, lookalikes=True
            ),
        )

    def test_bad_values(self) -> None:
        """A bad value exits with status 2 and a message saying what is wrong, not a traceback."""
        cases = [
            (["--reuse-every", "-1"], "must be 0 or more"),
            (["--event-delay", "soon"], "is not a number of seconds"),
            (["--mode", "chaotic"], "invalid choice"),
            (["--listen", "tcp:notaport"], "is not a valid endpoint"),
            (["--parallel", "0"], "must be 1 or more"),
        ]
        for argv, message in cases:
            stderr = io.StringIO()
            self.patch(sys, "stderr", stderr)
            error = self.assertRaises(SystemExit, parse_args, argv)
            self.assertEqual(error.code, 2)
            self.assertIn(message, stderr.getvalue())
            self.assertNotIn("Traceback", stderr.getvalue())


class ServeTests(TestCase):
    """serve() listens with the real reactor on 127.0.0.1."""

    def test_serves(self) -> None:
        """The listening upstream answers /v1/models over a real socket."""

        async def go() -> None:
            port = await serve(global_reactor, parse_args(["--listen", "tcp:0:interface=127.0.0.1"]))
            self.addCleanup(port.stopListening)
            response = await treq.get(f"http://127.0.0.1:{port.getHost().port}/v1/models", persistent=False)
            self.assertEqual(response.code, 200)
            self.assertEqual(len((await response.json())["data"]), len(MODELS))

        return ensureDeferred(go())

    def test_port_taken(self) -> None:
        """A port already in use exits with status 1 after logging why."""

        async def go() -> None:
            first = await serve(global_reactor, parse_args(["--listen", "tcp:0:interface=127.0.0.1"]))
            self.addCleanup(first.stopListening)
            taken = f"tcp:{first.getHost().port}:interface=127.0.0.1"
            with self.assertRaises(SystemExit) as raised:
                await serve(global_reactor, parse_args(["--listen", taken]))
            self.assertEqual(raised.exception.code, 1)

        return ensureDeferred(go())

    def test_side_by_side(self) -> None:
        """
        Two simulated upstreams of different kinds run side by side on two
        ports, each with its own state: the one a config's routes send
        cheap requests to can differ from the fallback.
        """

        async def go() -> None:
            strict = await serve(global_reactor, parse_args(["--listen", "tcp:0:interface=127.0.0.1"]))
            self.addCleanup(strict.stopListening)
            kimi = await serve(
                global_reactor,
                parse_args(["--listen", "tcp:0:interface=127.0.0.1", "--mode", "stateful", "--id-style", "kimi"]),
            )
            self.addCleanup(kimi.stopListening)
            self.assertNotEqual(strict.getHost().port, kimi.getHost().port)
            ids = {}
            for name, port in (("strict", strict), ("kimi", kimi)):
                response = await treq.post(
                    f"http://127.0.0.1:{port.getHost().port}/v1/messages",
                    data=json.dumps(
                        {
                            "model": "claude-sonnet-4-5",
                            "max_tokens": 64,
                            "messages": [{"role": "user", "content": "go"}],
                            "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
                        }
                    ).encode(),
                    headers={"content-type": ["application/json"], "x-claude-code-session-id": ["s1"]},
                    persistent=False,
                )
                self.assertEqual(response.code, 200, name)
                answer = await response.json()
                ids[name] = [b["id"] for b in answer["content"] if b["type"] == "tool_use"]
            self.assertRegex(ids["strict"][0], r"^toolu_")
            self.assertRegex(ids["kimi"][0], r"^functions\.Bash:\d+$")

        return ensureDeferred(go())
