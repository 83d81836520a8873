"""
Tests for the simulated OpenAI Responses API
(:mod:`twisted_relay.simulated.openai_responses`).

First the official ``openai`` SDK over real sockets on 127.0.0.1: its types
and its stream parsers accept what the simulator sends.  Then the rules, the
answers, the quirks and the reasoning tally, in memory on a Clock.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.python.failure import Failure
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase
from twisted.web.client import ResponseFailed
from twisted.web.server import Site
from treq.testing import StubTreq

from tests.test_simulated import parse_sse
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.openai_responses import SimulatedOpenAIResponses

try:
    import openai
except ImportError:  # pragma: no cover - the test extra installs it
    openai = None

KEYS = {"sk-a": "org-a", "sk-a2": "org-a", "sk-b": "org-b"}
MODEL = "gpt-5.5"
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather at a place.", "strict": False,
     "parameters": {"type": "object", "properties": {"location": {"type": "string"},
                                                     "days": {"type": "integer"}},
                    "required": ["location"]}},
    {"type": "function", "name": "Bash", "strict": False,
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
]
INCLUDE = ["reasoning.encrypted_content"]
NOT_PERSISTED = ("Item with id '%s' not found. Items are not persisted when `store` is set to false. Try again "
                 "with `store` set to true, or remove this item from your input.")


def request(**overrides: Any) -> dict:
    """A stateless request as a relay sends it, with ``overrides`` laid over."""
    body = {"model": MODEL, "input": [{"role": "user", "content": "Check the weather, one city at a time."}],
            "tools": TOOLS, "store": False, "include": INCLUDE,
            "reasoning": {"effort": "medium", "summary": "auto"}}
    body.update(overrides)
    return {key: value for key, value in body.items() if value is not None}


def follow_up(history: list, response: dict, seen: Counter, *, keep_reasoning: bool = True) -> list[str]:
    """
    Append ``response``'s output to ``history`` as a stateless client sends
    it back (no item ids; a repeated ``call_id`` renamed ``X-k``, the next
    free ``k``, as a relay does), then an output for each call (or a user message); the call ids
    the model gave.
    """
    given, calls = [], []
    used = {item["call_id"] for item in history if item.get("type") == "function_call"}
    for item in response["output"]:
        kind = item["type"]
        if kind == "reasoning" and keep_reasoning:
            history.append({"type": "reasoning", "summary": item["summary"],
                            "encrypted_content": item["encrypted_content"]})
        elif kind == "message":
            history.append({"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": part["text"]} for part in item["content"]]})
        elif kind == "function_call":
            given.append(item["call_id"])
            seen[item["call_id"]] += 1
            call_id, k = item["call_id"], max(2, seen[item["call_id"]])
            while call_id in used:
                call_id, k = "%s-%d" % (item["call_id"], k), k + 1
            used.add(call_id)
            history.append({"type": "function_call", "call_id": call_id, "name": item["name"],
                            "arguments": item["arguments"]})
            calls.append(call_id)
    history.extend({"type": "function_call_output", "call_id": call_id, "output": "sunny, 21 C"}
                   for call_id in calls)
    if not calls:
        history.append({"role": "user", "content": "Go on."})
    return given


# -- the official SDK over sockets --------------------------------------------------


class SDKTests(TestCase):
    """The official SDK parses what the simulator sends, streamed and not."""

    def setUp(self) -> None:
        if openai is None:
            raise SkipTest("the openai SDK is not installed (pip install '.[test]')")
        self.sim = SimulatedOpenAIResponses(SimulatedUpstream(mode="lenient", reactor=reactor, seed=3), keys=KEYS)
        port = reactor.listenTCP(0, Site(self.sim.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.base = "http://127.0.0.1:%d/v1" % port.getHost().port

    def client(self, key: str = "sk-a"):
        return openai.OpenAI(base_url=self.base, api_key=key, max_retries=0, timeout=30)

    def in_thread(self, work) -> Deferred:
        def run():
            client = self.client()
            try:
                return work(client)
            finally:
                client.close()
        return deferToThread(run)

    async def test_create(self) -> None:
        """
        ``responses.create`` parses a tool turn: reasoning with its summary
        and encrypted content, a message, a function call; completed, with
        the usage's details.
        """
        response = await self.in_thread(lambda client: client.responses.create(**request()))
        kinds = [item.type for item in response.output]
        self.assertEqual(kinds[0], "reasoning")
        self.assertEqual([kind for kind in kinds if kind != "reasoning"], ["message", "function_call"])
        self.assertEqual(response.status, "completed")
        reasoning = response.output[0]
        self.assertTrue(reasoning.id.startswith("rs_"))
        self.assertTrue(reasoning.encrypted_content.startswith("gAAAAA"))
        self.assertTrue(reasoning.summary and reasoning.summary[0].text)
        call = response.output[-1]
        self.assertRegex(call.call_id, r"^call_[A-Za-z0-9]{24}$")
        self.assertTrue(call.id.startswith("fc_"))
        self.assertIsInstance(json.loads(call.arguments), dict)
        usage = response.usage
        self.assertEqual(usage.total_tokens, usage.input_tokens + usage.output_tokens)
        self.assertGreater(usage.output_tokens_details.reasoning_tokens, 0)
        self.assertLessEqual(usage.input_tokens_details.cached_tokens, usage.input_tokens)

    async def test_create_stream(self) -> None:
        """
        ``responses.create(stream=True)`` yields typed events numbered from 0,
        from ``response.created`` to ``response.completed``; the encrypted
        content of ``output_item.done`` is the final one.
        """
        def work(client):
            return list(client.responses.create(stream=True, **request()))

        events = await self.in_thread(work)
        self.assertEqual([event.sequence_number for event in events], list(range(len(events))))
        self.assertEqual([event.type for event in events[:2]], ["response.created", "response.in_progress"])
        self.assertEqual(events[-1].type, "response.completed")
        added = [event.item for event in events if event.type == "response.output_item.added"]
        done = [event.item for event in events if event.type == "response.output_item.done"]
        self.assertEqual([item.type for item in added], [item.type for item in done])
        for before, after in zip(added, done):
            if after.type == "reasoning":
                self.assertNotEqual(before.encrypted_content, after.encrypted_content)
        self.assertEqual([item.id for item in events[-1].response.output], [item.id for item in done])

    async def test_stream_helper(self) -> None:
        """``responses.stream`` accumulates the events into the final response."""
        def work(client):
            with client.responses.stream(**request()) as stream:
                texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
                return texts, stream.get_final_response()

        texts, final = await self.in_thread(work)
        self.assertEqual(final.output_text, "".join(texts))
        self.assertEqual(final.output[-1].type, "function_call")
        self.assertIsNotNone(final.usage)

    async def test_tool_loop(self) -> None:
        """
        A stateless tool loop through the SDK, streamed and not, every
        earlier item sent back without its id: each turn is answered, the
        model reuses call ids (sent back renamed), and every turn replayed
        its own reasoning.
        """
        def work(client):
            history = list(request()["input"])
            seen: Counter = Counter()
            given = []
            counts = []
            for turn in range(10):
                body = request(input=history)
                if turn % 2:
                    with client.responses.stream(**body) as stream:
                        response = stream.get_final_response()
                else:
                    response = client.responses.create(**body)
                counts.append(client.responses.input_tokens.count(
                    model=MODEL, input=history, tools=TOOLS).input_tokens)
                counts.append(response.usage.input_tokens)
                given += follow_up(history, response.model_dump(exclude_none=True), seen)
            return given, counts

        given, counts = await self.in_thread(work)
        self.assertEqual(len(given), 10)
        self.assertLess(len(set(given)), len(given), "the model reuses call ids now and then")
        self.assertEqual(counts[0::2], counts[1::2], "input_tokens counts what the same request is billed")
        report = self.sim.reasoning_report()
        self.assertTrue(report.ok, report.problems())
        [conversation] = report.conversations.values()
        self.assertEqual(conversation.turns, 10)
        self.assertEqual(conversation.last_replayed, conversation.last_expected)
        self.assertGreater(conversation.last_expected, 8)

    async def test_errors(self) -> None:
        """The SDK raises its typed errors with OpenAI's fields."""
        first = await self.in_thread(lambda client: client.responses.create(**request()))
        history = list(request()["input"])
        follow_up(history, first.model_dump(exclude_none=True), Counter())

        def work(client):
            raised = {}
            other, stranger = self.client("sk-b"), self.client("sk-nope")
            for name, call in (
                ("auth", lambda: stranger.responses.create(**request())),
                ("stop", lambda: client.responses.create(**request(), extra_body={"stop": ["\n\n"]})),
                ("foreign", lambda: other.responses.create(**request(input=history))),
                ("stored", lambda: client.responses.create(**request(input=[
                    *history[:1], {"type": "reasoning", "id": "rs_123", "summary": []}]))),
            ):
                try:
                    call()
                except openai.APIStatusError as error:
                    raised[name] = error
            other.close()
            stranger.close()
            return raised

        raised = await self.in_thread(work)
        self.assertIsInstance(raised["auth"], openai.AuthenticationError)
        self.assertIsInstance(raised["stop"], openai.BadRequestError)
        self.assertEqual((raised["stop"].param, raised["stop"].code), ("stop", "unknown_parameter"))
        self.assertEqual(raised["foreign"].code, "invalid_encrypted_content")
        self.assertIsInstance(raised["stored"], openai.NotFoundError)
        self.assertEqual(raised["stored"].body["message"], NOT_PERSISTED % "rs_123")


# -- in memory ----------------------------------------------------------------------------------


def _result(d: Deferred) -> Any:
    results: list = []
    d.addBoth(results.append)
    if not results:
        raise AssertionError("the Deferred has not fired")
    if isinstance(results[0], Failure):
        results[0].raiseException()
    return results[0]


class _Sim:
    """A simulated Responses API behind StubTreq, on a Clock."""

    def __init__(self, upstream: dict | None = None, **options: Any):
        self.clock = Clock()
        self.clock.advance(1_796_000_000)
        self.upstream = SimulatedUpstream(**{"mode": "lenient", "reactor": self.clock, **(upstream or {})})
        self.api = SimulatedOpenAIResponses(self.upstream, **{"keys": KEYS, **options})
        self.stub = StubTreq(self.api.resource())

    def settle(self) -> None:
        for _ in range(10_000):
            self.stub.flush()
            if not self.clock.getDelayedCalls():
                break
            self.clock.advance(0.01)
        self.stub.flush()

    def post(self, body: Any, path: str = "/v1/responses", key: str | None = "sk-a") -> tuple[int, Any]:
        """POST ``body``; the status and the JSON answer, or the stream's events."""
        headers = {"content-type": "application/json"}
        if key is not None:
            headers["authorization"] = "Bearer " + key
        data = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
        d = self.stub.request("POST", "http://api.example" + path, data=data, headers=headers)
        self.settle()
        response = _result(d)
        content = self.stub.content(response)
        self.settle()
        raw = _result(content)
        kind = response.headers.getRawHeaders("content-type", [""])[0]
        if kind.startswith("text/event-stream"):
            return response.code, parse_sse(raw)
        return response.code, json.loads(raw)

    def ok(self, body: dict, key: str = "sk-a") -> Any:
        status, value = self.post(body, key=key)
        if status != 200:
            raise AssertionError("%d %r" % (status, value))
        return value

    def loop(self, turns: int, key: str = "sk-a", keep_reasoning=lambda turn: True, **overrides: Any):
        """A stateless tool loop of ``turns`` turns (every other one streamed): the history and the responses."""
        history = list(request()["input"])
        seen: Counter = Counter()
        responses = []
        for turn in range(turns):
            body = request(input=list(history), stream=bool(turn % 2) or None, **overrides)
            value = self.ok(body, key)
            response = value[-1][1]["response"] if body.get("stream") else value
            responses.append(response)
            follow_up(history, response, seen, keep_reasoning=keep_reasoning(turn))
        return history, responses


def error_of(test: SynchronousTestCase, answer: tuple[int, Any], status: int, message: str,
             param: Any = "absent", code: Any = "absent") -> dict:
    """Assert ``answer`` is OpenAI's error ``status`` with ``message`` (and ``param``, ``code`` when given)."""
    got_status, body = answer
    test.assertEqual(got_status, status, body)
    error = body["error"]
    test.assertEqual(error["message"], message)
    test.assertEqual(set(error), {"message", "type", "param", "code"})
    if param != "absent":
        test.assertEqual(error["param"], param)
    if code != "absent":
        test.assertEqual(error["code"], code)
    return error


class StatelessRulesTests(SynchronousTestCase):
    """What the API refuses of a stateless (``store: false``) conversation."""

    def first(self, sim: _Sim, **overrides: Any) -> tuple[list, dict]:
        response = sim.ok(request(**overrides))
        history = list(request()["input"])
        follow_up(history, response, Counter())
        return history, response

    def test_item_ids_not_persisted(self) -> None:
        """
        With ``store: false`` an earlier item sent with its id (``rs_``,
        ``fc_``, ``msg_``) is a 404 naming it, and the tally counts it.
        """
        sim = _Sim()
        history, response = self.first(sim)
        for item in response["output"]:
            with_id = [dict(entry) for entry in history]
            position = [entry.get("type") for entry in with_id].index(item["type"])
            with_id[position]["id"] = item["id"]
            error_of(self, sim.post(request(input=with_id)), 404, NOT_PERSISTED % item["id"], "input", None)
        self.assertEqual(sim.api.reasoning_report().refused, {"item_not_persisted": len(response["output"])})

    def test_stored_items_by_id(self) -> None:
        """With ``store`` (the default), items go back by id or by reference, and ``previous_response_id`` works."""
        sim = _Sim()
        response = sim.ok(request(store=None))
        outputs = [{"type": "function_call_output", "call_id": item["call_id"], "output": "ok"}
                   for item in response["output"] if item["type"] == "function_call"]
        by_reference = [*request()["input"], *({"type": "item_reference", "id": item["id"]}
                                               for item in response["output"]), *outputs]
        self.assertEqual(sim.ok(request(store=None, input=by_reference))["status"], "completed")
        chained = sim.ok(request(store=None, input=outputs, previous_response_id=response["id"]))
        self.assertEqual(chained["previous_response_id"], response["id"])
        error_of(self, sim.post(request(store=None, input=outputs, previous_response_id="resp_nope")), 404,
                 "Previous response with id 'resp_nope' not found.", "previous_response_id")
        error_of(self, sim.post(request(store=None, previous_response_id=response["id"], input=outputs),
                                key="sk-b"), 404, "Previous response with id '%s' not found." % response["id"])

    def test_encrypted_content_bound_to_organisation(self) -> None:
        """
        Reasoning replayed under another organisation's key is a 400
        ``invalid_encrypted_content``; another key of the same organisation
        reads it.
        """
        sim = _Sim()
        history, response = self.first(sim)
        sealed = response["output"][0]["encrypted_content"]
        error_of(self, sim.post(request(input=history), key="sk-b"), 400,
                 "The encrypted content %s...%s could not be verified." % (sealed[:4], sealed[-4:]), None,
                 "invalid_encrypted_content")
        sim.ok(request(input=history), key="sk-a2")
        self.assertEqual(sim.api.reasoning_report().refused, {"organization_mismatch": 1})

    def test_encrypted_content_of_another_maker(self) -> None:
        """
        Encrypted content this API did not make (another secret, an edit, an
        Anthropic signature) could not be decrypted: a 400 saying so.
        """
        sim = _Sim()
        history, response = self.first(sim)
        sealed = response["output"][0]["encrypted_content"]
        elsewhere = _Sim(secret="another")
        other_history, _ = self.first(elsewhere)
        for content in (sealed[:-6] + "AAAAAA", "EqQBCkgIARABGAIiQL0xsignature", other_history[1]["encrypted_content"]):
            replay = [dict(item) for item in history]
            replay[1]["encrypted_content"] = content
            error_of(self, sim.post(request(input=replay)), 400,
                     "The encrypted content %s...%s could not be verified. Reason: Encrypted content could not be "
                     "decrypted or parsed." % (content[:4], content[-4:]), None, "invalid_encrypted_content")

    def test_snapshot_is_not_the_encrypted_content(self) -> None:
        """The encrypted content of ``output_item.added`` is a snapshot: sent back, it is refused."""
        sim = _Sim()
        events = sim.ok(request(stream=True))
        added = next(data["item"] for name, data in events
                     if name == "response.output_item.added" and data["item"]["type"] == "reasoning")
        history = list(request()["input"])
        follow_up(history, events[-1][1]["response"], Counter())
        history[1]["encrypted_content"] = added["encrypted_content"]
        status, body = sim.post(request(input=history))
        self.assertEqual((status, body["error"]["code"]), (400, "invalid_encrypted_content"))

    def test_newest_models_withhold_foreign_reasoning(self) -> None:
        """A 5.6 model leaves another organisation's reasoning out and says so in ``input_transformations``."""
        sim = _Sim()
        history, response = self.first(sim, model="gpt-5.6-sol")
        answer = sim.ok(request(model="gpt-5.6-sol", input=history), key="sk-b")
        self.assertEqual(answer["input_transformations"], [
            {"id": response["output"][0]["id"], "action": "removed", "reason": "organization_mismatch",
             "type": "reasoning"}])
        own = sim.ok(request(model="gpt-5.6-sol", input=history))
        self.assertNotIn("input_transformations", own)
        self.assertEqual(sim.api.reasoning_report().withheld, 1)

    def test_reasoning_needs_its_following_item(self) -> None:
        """
        A reasoning item must be followed by the item it preceded: at the end,
        before another item, or moved after its call, it is a 400 naming it.
        """
        sim = _Sim()
        history, response = self.first(sim)
        rs = response["output"][0]["id"]
        message = "Item '%s' of type 'reasoning' was provided without its required following item." % rs
        reasoning = history[1]
        last = [item for item in history if item.get("type") != "reasoning"] + [reasoning]
        moved = [item for item in history if item.get("type") != "reasoning"]
        moved.insert(len(moved) - 1, reasoning)
        swapped = [history[0], reasoning, {"type": "message", "role": "assistant", "content": "Another text."},
                   *history[2:]]
        for replay in (last, moved, swapped):
            error_of(self, sim.post(request(input=replay)), 400, message, "input")
        self.assertEqual(sim.api.reasoning_report().refused, {"missing_following_item": 3})

    def test_summary_required(self) -> None:
        """A replayed reasoning item without ``summary`` is refused (``[]`` is fine)."""
        sim = _Sim()
        history, _ = self.first(sim)
        del history[1]["summary"]
        error_of(self, sim.post(request(input=history)), 400, "Missing required parameter: 'input[1].summary'.",
                 "input[1].summary", "missing_required_parameter")
        history[1]["summary"] = []
        sim.ok(request(input=history))

    def test_sampling_refused_while_reasoning(self) -> None:
        """
        A reasoning model refuses ``temperature`` and ``top_p`` unless
        ``reasoning.effort`` is ``none``; a model that does not reason takes
        them and refuses ``reasoning``.
        """
        sim = _Sim()
        for field in ("temperature", "top_p"):
            error_of(self, sim.post(request(**{field: 0.5})), 400,
                     "Unsupported parameter: '%s' is not supported with this model." % field, field, None)
            sim.ok(request(reasoning={"effort": "none"}, **{field: 0.5}))
            sim.ok(request(model="gpt-4.1", reasoning=None, **{field: 0.5}))
        error_of(self, sim.post(request(model="gpt-4.1", reasoning={"effort": "low"})), 400,
                 "Unsupported parameter: 'reasoning.effort' is not supported with this model.", "reasoning.effort",
                 "unsupported_parameter")

    def test_unknown_parameters(self) -> None:
        """``stop`` (and any Anthropic field left over) is an unknown parameter."""
        sim = _Sim()
        for name, value in (("stop", ["\n"]), ("max_tokens", 100), ("system", "Be brief."), ("thinking", {})):
            error_of(self, sim.post(request(**{name: value})), 400, "Unknown parameter: '%s'." % name, name,
                     "unknown_parameter")

    def test_call_id_at_most_64(self) -> None:
        """A ``call_id`` of 65 characters is refused; 64 go."""
        sim = _Sim()
        history, _ = self.first(sim)
        for length, status in ((64, 200), (65, 400)):
            replay = [dict(item) for item in history]
            call_id = "call_" + "a" * (length - 5)
            for item in replay:
                if "call_id" in item:
                    item["call_id"] = call_id
            position = next(n for n, item in enumerate(replay) if item.get("type") == "function_call")
            answer = sim.post(request(input=replay))
            if status == 400:
                where = "input[%d].call_id" % position
                error_of(self, answer, 400, "Invalid '%s': string too long. Expected a string with maximum length "
                         "64, but got a string with length 65 instead." % where, where, "string_above_max_length")
            else:
                self.assertEqual(answer[0], 200, answer[1])

    def test_efforts(self) -> None:
        """Each model's efforts: ``max`` where it has it, ``none`` not on codex, summaries not on spark."""
        sim = _Sim()
        sim.ok(request(model="gpt-5.6-sol", reasoning={"effort": "max"}))
        error_of(self, sim.post(request(reasoning={"effort": "max"})), 400,
                 "Unsupported value: 'max' is not supported with the 'gpt-5.5' model. Supported values are: "
                 "'none', 'low', 'medium', 'high', and 'xhigh'.", "reasoning.effort", "unsupported_value")
        error_of(self, sim.post(request(model="gpt-5.1-codex", reasoning={"effort": "none"})), 400,
                 "Unsupported value: 'none' is not supported with the 'gpt-5.1-codex' model. Supported values are: "
                 "'low', 'medium', and 'high'.", "reasoning.effort")
        error_of(self, sim.post(request(reasoning={"effort": "ultra"})), 400,
                 "Invalid value: 'ultra'. Supported values are: 'none', 'minimal', 'low', 'medium', 'high', "
                 "'xhigh', and 'max'.", "reasoning.effort", "invalid_value")
        error_of(self, sim.post(request(model="gpt-5.3-codex-spark")), 400,
                 "Unsupported parameter: 'reasoning.summary' is not supported with the 'gpt-5.3-codex-spark' model.",
                 "reasoning.summary")
        self.assertEqual(sim.ok(request(model="gpt-5.5-2026-04-23"))["status"], "completed")

    def test_function_call_pairing(self) -> None:
        """Every call answered once, every output answering a call before it, no call id on two calls."""
        sim = _Sim()
        history, _ = self.first(sim)
        call = next(item for item in history if item.get("type") == "function_call")
        output = history[-1]
        error_of(self, sim.post(request(input=history[:-1])), 400,
                 "No tool output found for function call %s." % call["call_id"], "input")
        error_of(self, sim.post(request(input=[history[0], output])), 400,
                 "No tool call found for function call output with call_id %s." % call["call_id"], "input")
        twice = [*history, {"role": "user", "content": "again"}, dict(call), dict(output)]
        status, body = sim.post(request(input=twice))
        self.assertEqual((status, body["error"]["param"]), (400, "input"))
        self.assertIn(call["call_id"], body["error"]["message"])

    def test_strict_function_tools(self) -> None:
        """A function tool is ``strict`` by default, and its schema must say so; names are at most 64."""
        sim = _Sim()
        lax = dict(TOOLS[0])
        del lax["strict"]
        error_of(self, sim.post(request(tools=[lax])), 400,
                 "Invalid schema for function 'get_weather': In context=(), 'additionalProperties' is required to be "
                 "supplied and to be false.", "tools[0].parameters", "invalid_function_parameters")
        closed = dict(lax, parameters=dict(lax["parameters"], additionalProperties=False))
        error_of(self, sim.post(request(tools=[closed])), 400,
                 "Invalid schema for function 'get_weather': In context=(), 'required' is required to be supplied "
                 "and to be an array including every key in properties. Missing 'days'.", "tools[0].parameters")
        long_name = "mcp__" + "x" * 60
        error_of(self, sim.post(request(tools=[dict(TOOLS[0], name=long_name)])), 400,
                 "Invalid 'tools[0].name': string too long. Expected a string with maximum length 64, but got a "
                 "string with length 65 instead.", "tools[0].name")

    def test_keys(self) -> None:
        """No key, or a key not in the table: 401, the key never echoed."""
        sim = _Sim()
        status, body = sim.post(request(), key=None)
        self.assertEqual((status, body["error"]["code"]), (401, None))
        self.assertIn("You didn't provide an API key", body["error"]["message"])
        status, body = sim.post(request(), key="sk-secret-nope")
        self.assertEqual((status, body["error"]["code"]), (401, "invalid_api_key"))
        self.assertNotIn("nope", json.dumps(body))

    def test_unknown_route(self) -> None:
        """Another path is OpenAI's 404."""
        error_of(self, _Sim().post({}, path="/v1/messages"), 404, "Invalid URL (POST /v1/messages)")


class AnswerTests(SynchronousTestCase):
    """What the simulated API answers."""

    def test_output_items(self) -> None:
        """
        Reasoning, a message, a function call; the ids OpenAI gives; JSON
        arguments for the tool's schema; ``completed`` on a tool turn.
        """
        response = _Sim().ok(request())
        self.assertEqual(response["status"], "completed")
        self.assertRegex(response["id"], r"^resp_[0-9a-f]{50}$")
        prefixes = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}
        for item in response["output"]:
            self.assertRegex(item["id"], "^%s[0-9a-f]{50}$" % prefixes[item["type"]])
        call = response["output"][-1]
        self.assertEqual(call["type"], "function_call")
        self.assertIn(call["name"], ("get_weather", "Bash"))
        self.assertIsInstance(json.loads(call["arguments"]), dict)

    def test_several_reasoning_items(self) -> None:
        """Now and then a turn reasons twice: reason, message, reason, call, each with its own item."""
        response = _Sim(reasoning_splits=1.0).ok(request())
        self.assertEqual([item["type"] for item in response["output"]],
                         ["reasoning", "message", "reasoning", "function_call"])
        self.assertNotEqual(response["output"][0]["id"], response["output"][2]["id"])

    def test_what_is_asked(self) -> None:
        """A summary only when asked; encrypted content only when included; no reasoning at ``none``."""
        sim = _Sim()
        quiet = sim.ok(request(reasoning={"effort": "low"}, include=None))
        self.assertEqual(quiet["output"][0]["summary"], [])
        self.assertNotIn("encrypted_content", quiet["output"][0])
        none = sim.ok(request(reasoning={"effort": "none"}))
        self.assertNotIn("reasoning", [item["type"] for item in none["output"]])
        self.assertEqual(none["usage"]["output_tokens_details"]["reasoning_tokens"], 0)
        self.assertNotIn("reasoning", [item["type"] for item in sim.ok(request(model="gpt-4.1", reasoning=None))[
            "output"]])

    def test_stream_events(self) -> None:
        """
        OpenAI's events in its order, numbered; deltas that add up to the
        ``.done`` values, keyed by item id; the final encrypted content only
        on ``output_item.done``; the completed response as returned whole.
        """
        sim = _Sim(reasoning_splits=1.0)
        events = sim.ok(request(stream=True))
        names = [name for name, _ in events]
        self.assertEqual([data["sequence_number"] for _, data in events], list(range(len(events))))
        self.assertEqual([name for name, data in events], [data["type"] for _, data in events])
        self.assertEqual(names[:3], ["response.created", "response.in_progress", "response.output_item.added"])
        self.assertEqual(names[-1], "response.completed")
        self.assertIsNone(events[0][1]["response"]["usage"])
        final = events[-1][1]["response"]
        texts: dict = {}
        for name, data in events:
            if name.endswith(".delta"):
                texts[(data["item_id"], name)] = texts.get((data["item_id"], name), "") + data["delta"]
        for name, data in events:
            if name == "response.function_call_arguments.done":
                self.assertEqual(texts[(data["item_id"], "response.function_call_arguments.delta")],
                                 data["arguments"])
            elif name == "response.output_text.done":
                self.assertEqual(texts[(data["item_id"], "response.output_text.delta")], data["text"])
        sealed = [data["item"].get("encrypted_content") for name, data in events
                  if name.startswith("response.output_item") and data["item"]["type"] == "reasoning"]
        self.assertEqual(len(sealed), 4)
        self.assertNotEqual(sealed[0], sealed[1])
        self.assertEqual(sealed[1], final["output"][0]["encrypted_content"])
        self.assertEqual(names.count("response.reasoning_summary_part.added"),
                         sum(len(item["summary"]) for item in final["output"] if item["type"] == "reasoning"))
        self.assertEqual(final["status"], "completed")
        self.assertEqual(set(final), set(sim.ok(request())))

    def test_usage_and_prompt_cache(self) -> None:
        """
        A stable prefix is read from the cache on the next turn:
        ``input_tokens`` include the cached and the written tokens, output
        the reasoning; the upstream's tally holds it in the Messages API's
        terms.
        """
        sim = _Sim()
        instructions = "You are a careful assistant. " * 120
        _, responses = sim.loop(4, instructions=instructions, prompt_cache_key="session-1")
        usages = [response["usage"] for response in responses]
        self.assertEqual(usages[0]["input_tokens_details"]["cached_tokens"], 0)
        self.assertGreater(usages[0]["input_tokens_details"]["cache_write_tokens"], 0)
        for usage in usages[1:]:
            details = usage["input_tokens_details"]
            self.assertGreater(details["cached_tokens"], 500)
            self.assertLessEqual(details["cached_tokens"] + details["cache_write_tokens"], usage["input_tokens"])
        for usage in usages:
            self.assertGreater(usage["output_tokens"], usage["output_tokens_details"]["reasoning_tokens"])
        reported = [answer.usage for answer in sim.upstream.reported.answers]
        self.assertEqual([report["cache_read_input_tokens"] + report["input_tokens"]
                          + report["cache_creation_input_tokens"] for report in reported],
                         [usage["input_tokens"] for usage in usages])
        # Without cache writes: none reported, and the tally still adds up to OpenAI's input_tokens. (Not
        # compared with the run above: each run's call ids are random, the next turn's input holds them, and
        # their token count varies by a few tokens from run to run: 1355 against 1372 seen in CI.)
        quiet = _Sim(cache_writes=False)
        _, responses = quiet.loop(2, instructions=instructions)
        quiet_usages = [response["usage"] for response in responses]
        self.assertEqual([usage["input_tokens_details"]["cache_write_tokens"] for usage in quiet_usages], [0, 0])
        self.assertGreater(quiet_usages[1]["input_tokens_details"]["cached_tokens"], 500)
        reported = [answer.usage for answer in quiet.upstream.reported.answers]
        self.assertEqual([report["cache_creation_input_tokens"] for report in reported], [0, 0])
        self.assertEqual([report["cache_read_input_tokens"] + report["input_tokens"] for report in reported],
                         [usage["input_tokens"] for usage in quiet_usages])

    def test_changing_prefix_never_hits(self) -> None:
        """
        A first instruction line that changes each request, or a random
        ``prompt_cache_key``, reads nothing from the cache.
        """
        sim = _Sim()
        history = list(request()["input"])
        seen: Counter = Counter()
        for turn in range(4):
            for instructions, key in (("cch=%d\n" % turn + "Be careful. " * 300, "session-2"),
                                      ("Be careful. " * 300, "random-%d" % turn)):
                response = sim.ok(request(input=history, instructions=instructions, prompt_cache_key=key))
                self.assertEqual(response["usage"]["input_tokens_details"]["cached_tokens"], 0)
            follow_up(history, response, seen)

    def test_input_tokens(self) -> None:
        """
        ``/v1/responses/input_tokens`` counts exactly what the same request is
        billed as input, takes its own parameters only, and checks the
        reasoning like the answer does.
        """
        sim = _Sim()
        history, responses = sim.loop(3, instructions="Be brief.")
        count = {"model": MODEL, "input": history, "tools": TOOLS, "instructions": "Be brief."}
        status, counted = sim.post(count, path="/v1/responses/input_tokens")
        self.assertEqual(status, 200)
        for retention in (None, "24h"):
            billed = sim.ok(request(input=history, instructions="Be brief.", prompt_cache_retention=retention,
                                    prompt_cache_key="session-3"))["usage"]["input_tokens"]
            self.assertEqual(counted, {"object": "response.input_tokens", "input_tokens": billed})
        for name in ("store", "include", "max_output_tokens", "stream"):
            error_of(self, sim.post(dict(count, **{name: None}), path="/v1/responses/input_tokens"), 400,
                     "Unknown parameter: '%s'." % name, name)
        status, body = sim.post(count, path="/v1/responses/input_tokens", key="sk-b")
        self.assertEqual((status, body["error"]["code"]), (400, "invalid_encrypted_content"))


class QuirkTests(SynchronousTestCase):
    """The switches that make the simulated API fail as the API and its look-alikes do."""

    def test_failed_mid_stream(self) -> None:
        """``break_next_stream("failed")``: a ``response.failed`` with its error, then nothing; no usage tallied."""
        sim = _Sim()
        sim.api.break_next_stream("failed", after_events=6, code="server_error")
        events = sim.ok(request(stream=True))
        self.assertEqual(len(events), 7)
        name, data = events[-1]
        self.assertEqual(name, "response.failed")
        self.assertEqual(data["response"]["status"], "failed")
        self.assertEqual(data["response"]["error"]["code"], "server_error")
        self.assertEqual(list(sim.upstream.reported.answers), [])
        self.assertEqual(sim.ok(request(stream=True))[-1][0], "response.completed")

    def test_error_event_mid_stream(self) -> None:
        """``break_next_stream("error")``: a top-level ``error`` event, numbered like the others."""
        sim = _Sim()
        sim.api.break_next_stream("error", after_events=3, code="rate_limit_exceeded", message="Slow down.")
        events = sim.ok(request(stream=True))
        self.assertEqual(events[-1], ("error", {"type": "error", "code": "rate_limit_exceeded",
                                                "message": "Slow down.", "param": None, "sequence_number": 3}))

    def test_upstream_stream_errors_and_cuts(self) -> None:
        """The upstream's ``stream_errors`` fail a stream after its first item; ``stream_cuts`` drop it."""
        events = _Sim({"stream_errors": 1.0}).ok(request(stream=True))
        self.assertEqual([name for name, _ in events][-2:], ["response.output_item.done", "response.failed"])
        sim = _Sim({"stream_cuts": 1.0})
        d = sim.stub.request("POST", "http://api.example/v1/responses", data=json.dumps(request(stream=True)).encode(),
                             headers={"authorization": "Bearer sk-a", "content-type": "application/json"})
        sim.settle()
        content = sim.stub.content(_result(d))
        sim.settle()
        self.assertRaises(ResponseFailed, _result, content)
        self.assertEqual(list(sim.api.responses), [], "a dropped answer is not given")

    def test_incomplete(self) -> None:
        """
        Output that does not fit ``max_output_tokens`` ends ``incomplete``
        for that reason; ``end_next_incomplete("content_filter")`` for its.
        """
        sim = _Sim()
        events = sim.ok(request(stream=True, max_output_tokens=16))
        self.assertEqual(events[-1][0], "response.incomplete")
        response = events[-1][1]["response"]
        self.assertEqual((response["status"], response["incomplete_details"]),
                         ("incomplete", {"reason": "max_output_tokens"}))
        self.assertLessEqual(response["usage"]["output_tokens"], 16)
        sim.api.end_next_incomplete("content_filter")
        response = sim.ok(request())
        self.assertEqual(response["incomplete_details"], {"reason": "content_filter"})
        self.assertNotEqual(response["output"][-1]["type"], "function_call")

    def test_arguments_only_done(self) -> None:
        """``argument_deltas=False``: function arguments come whole on ``.done``."""
        names = [name for name, _ in _Sim(argument_deltas=False).ok(request(stream=True))]
        self.assertNotIn("response.function_call_arguments.delta", names)
        self.assertIn("response.function_call_arguments.done", names)

    def test_items_not_announced(self) -> None:
        """``announce_items=False``: no ``output_item.added`` for messages and function calls."""
        events = _Sim(announce_items=False).ok(request(stream=True))
        added = [data["item"]["type"] for name, data in events if name == "response.output_item.added"]
        self.assertEqual(added, ["reasoning"])

    def test_http_fault(self) -> None:
        """``fail_next``: the next request gets OpenAI's error."""
        sim = _Sim()
        sim.api.fail_next(429, "rate_limit_exceeded", "Rate limit reached.")
        error = error_of(self, sim.post(request()), 429, "Rate limit reached.", None, "rate_limit_exceeded")
        self.assertEqual(error["type"], "requests")
        sim.ok(request())


class ReasoningTallyTests(SynchronousTestCase):
    """The simulator checks that each conversation sends its own reasoning back."""

    def test_all_replayed(self) -> None:
        """A loop that sends every item back: each turn replays all earlier reasoning, nothing else."""
        sim = _Sim(reasoning_splits=0.5)
        _, responses = sim.loop(20, prompt_cache_key="session-ok")
        report = sim.api.reasoning_report()
        self.assertTrue(report.ok, report.problems())
        [conversation] = report.by_label("session-ok")
        issued = [item["id"] for response in responses for item in response["output"] if item["type"] == "reasoning"]
        self.assertEqual(conversation.issued, issued)
        self.assertEqual(conversation.turns, 20)
        last = sum(1 for item in responses[-1]["output"] if item["type"] == "reasoning")
        self.assertEqual(conversation.last_expected, len(issued) - last)
        self.assertEqual(conversation.last_replayed, conversation.last_expected)
        self.assertEqual(conversation.replayed, set(issued[:-last]))

    def test_dropped(self) -> None:
        """A client that stops sending reasoning back from turn 5 on is caught, turn by turn."""
        sim = _Sim()
        _, responses = sim.loop(8, keep_reasoning=lambda turn: turn < 5)
        report = sim.api.reasoning_report()
        self.assertFalse(report.ok)
        [conversation] = report.conversations.values()
        dropped = {item["id"]: turn for response, turn in zip(responses[5:7], (7, 8))
                   for item in response["output"] if item["type"] == "reasoning"}
        self.assertEqual(conversation.dropped, dropped)
        self.assertEqual(conversation.last_expected - conversation.last_replayed, len(dropped))

    def test_foreign(self) -> None:
        """Another conversation's turn, reasoning and all, put into this one is foreign."""
        sim = _Sim()
        theirs, _ = sim.loop(2, prompt_cache_key="a")
        ours, _ = sim.loop(1, prompt_cache_key="b")
        ours[1:1] = theirs[1:5]
        sim.ok(request(input=ours, prompt_cache_key="b"))
        report = sim.api.reasoning_report()
        [b] = report.by_label("b")
        [a] = report.by_label("a")
        self.assertEqual(set(b.foreign), {a.issued[0]})
        self.assertTrue(a.ok)

    def test_rebuilt(self) -> None:
        """Reasoning sent back without its encrypted content (rebuilt from the summary) is counted."""
        sim = _Sim()
        history, _ = sim.loop(1)
        del history[1]["encrypted_content"]
        sim.ok(request(input=history))
        [conversation] = sim.api.reasoning_report().conversations.values()
        self.assertEqual(conversation.rebuilt, [(2, 1)])
        self.assertEqual(list(conversation.dropped), conversation.issued[:1])

    def test_conversations_apart(self) -> None:
        """Two conversations that start alike, taken in turns, are told apart."""
        sim = _Sim()
        histories = [list(request()["input"]), list(request()["input"])]
        seen = [Counter(), Counter()]
        for _ in range(5):
            for n in (0, 1):
                follow_up(histories[n], sim.ok(request(input=histories[n])), seen[n])
        report = sim.api.reasoning_report()
        self.assertEqual([c.turns for c in report.conversations.values()], [5, 5])
        self.assertTrue(report.ok, report.problems())

    def test_repeated_call_ids(self) -> None:
        """
        The model reuses call ids; a history that holds one twice is refused,
        renamed (``X-2``, as a relay renames) it is taken and still matched.
        """
        sim = _Sim({"reuse_every": 2})
        history = list(request()["input"])
        seen: Counter = Counter()
        given = []
        for _ in range(6):
            given += follow_up(history, sim.ok(request(input=history)), seen)
        repeated = [call_id for call_id, count in Counter(given).items() if count > 1]
        self.assertTrue(repeated)
        raw = [dict(item, call_id=re.sub(r"-\d+$", "", item["call_id"])) if "call_id" in item else item
               for item in history]
        status, body = sim.post(request(input=raw))
        self.assertEqual(status, 400)
        self.assertTrue(any(call_id in body["error"]["message"] for call_id in repeated), body)
        self.assertTrue(sim.api.reasoning_report().ok)
