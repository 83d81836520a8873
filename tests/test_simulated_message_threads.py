"""
Tests for message threads in the simulated upstream
(:mod:`twisted_relay.simulated.message_threads`): an upstream that knows threads,
one that rejects the field, one that ignores it; and the official SDK's
tool runner (threads on by default) against each, on 127.0.0.1.
"""

from __future__ import annotations

import json

from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Site

from tests.test_simulated import TOOLS, _answer_results, _body, _result, _Upstream
from twisted_relay.message_threads.model import THREADS_BETA
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.cli import parse_args, upstream_from
from twisted_relay.tap import Options

FIRST = {"role": "user", "content": "Bonjour, fais le tour des outils."}


def create(messages, **extra):
    return _body(messages, thread={"type": "create"}, **extra)


def cont(previous, messages, **extra):
    body = _body(messages, thread={"type": "continue", "previous_message_id": previous}, **extra)
    if "tools" not in extra:
        del body["tools"]
    return body


def assistant(answer):
    return {"role": "assistant", "content": answer["content"]}


class KnowsTests(SynchronousTestCase):
    def setUp(self):
        self.up = _Upstream(mode="strict", seed=3, reuse_every=0, threads="knows")

    def test_continue_is_answered_as_the_whole_conversation(self):
        """Create then two continues are answered exactly as the whole history sent each time
        to an upstream without threads (same ids, same content)."""
        plain = _Upstream(mode="strict", seed=3, reuse_every=0, api="2025")
        self.up = _Upstream(mode="strict", seed=3, reuse_every=0, threads="knows", api="2025")
        history = [FIRST]
        response, answer = self.up.post(create(history))
        self.assertEqual(response.code, 200)
        for _ in range(2):
            _, expected = plain.post(_body(history))
            self.assertEqual(answer, expected)
            new = _answer_results(answer)
            history = history + [assistant(answer), new]
            response, answer = self.up.post(cont(answer["id"], [new]))
            self.assertEqual(response.code, 200, answer)
        self.assertEqual(answer, plain.post(_body(history))[1])

    def assert_thread_error(self, response, body, status, error_type, code):
        self.assertEqual(response.code, status)
        self.assertEqual(body["error"]["type"], error_type)
        self.assertEqual(body["error"]["details"], {"error_code": code})
        self.assertEqual(body["request_id"], response.headers.getRawHeaders("request-id")[0])

    def test_unknown_answer(self):
        """A continue from an answer the upstream never gave is 404 thread_not_found."""
        response, body = self.up.post(cont("msg_01nothing", [FIRST]))
        self.assert_thread_error(response, body, 404, "not_found_error", "thread_not_found")

    def test_second_continue(self):
        """A second continue from the same answer is 400 thread_already_continued."""
        _, first = self.up.post(create([FIRST]))
        new = _answer_results(first)
        self.assertEqual(self.up.post(cont(first["id"], [new]))[0].code, 200)
        response, body = self.up.post(cont(first["id"], [new]))
        self.assert_thread_error(response, body, 400, "invalid_request_error", "thread_already_continued")

    def test_continue_in_flight_until_the_stream_ends(self):
        """While a streamed continue is being written, another from the same answer is
        thread_continue_in_flight; once it ended, its own answer continues."""
        up = _Upstream(mode="strict", seed=3, reuse_every=0, threads="knows", event_delay=1.0)
        _, first = up.post(create([FIRST]))
        new = _answer_results(first)
        streaming = up.stub.request("POST", "http://upstream.example/v1/messages",
                                    data=json.dumps(cont(first["id"], [new], stream=True)).encode())
        up.stub.flush()
        second = up.stub.request("POST", "http://upstream.example/v1/messages",
                                 data=json.dumps(cont(first["id"], [new])).encode())
        up.stub.flush()
        response = _result(second)
        body = json.loads(_result(up.stub.content(response)))
        self.assert_thread_error(response, body, 400, "invalid_request_error", "thread_continue_in_flight")
        up.settle()
        self.assertEqual(_result(streaming).code, 200)
        self.assertEqual(up.post(cont(first["id"], [new]))[1]["error"]["details"]["error_code"],
                         "thread_already_continued")

    def test_refused_continue_does_not_advance(self):
        """A continue the upstream refuses (a tool_result for no call) leaves the thread where it was."""
        _, first = self.up.post(create([FIRST]))
        bad = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}
        response, body = self.up.post(cont(first["id"], [bad]))
        self.assertEqual(response.code, 400)
        self.assertIn("unexpected `tool_use_id`", body["error"]["message"])
        self.assertEqual(self.up.post(cont(first["id"], [_answer_results(first)]))[0].code, 200)

    def test_changed_tools(self):
        """A continue that changes the thread's tools is thread_fingerprint_mismatch."""
        _, first = self.up.post(create([FIRST]))
        body = cont(first["id"], [_answer_results(first)], tools=TOOLS[:1])
        response, error = self.up.post(body)
        self.assert_thread_error(response, error, 400, "invalid_request_error", "thread_fingerprint_mismatch")

    def test_plain_requests_unchanged(self):
        """Requests without a thread are answered as before (the year-old API,
        whose msg_ id follows from the request)."""
        plain = _Upstream(mode="strict", seed=3, reuse_every=0, api="2025")
        up = _Upstream(mode="strict", seed=3, reuse_every=0, threads="knows", api="2025")
        self.assertEqual(up.post(_body([FIRST]))[1], plain.post(_body([FIRST]))[1])


class RejectsAndIgnoresTests(SynchronousTestCase):
    def test_rejects(self):
        """An upstream that does not know threads and validates its input refuses the field by name."""
        up = _Upstream(mode="strict", threads="rejects")
        response, body = up.post(create([FIRST]))
        self.assertEqual(response.code, 400)
        self.assertEqual(body["error"], {"type": "invalid_request_error",
                                         "message": "thread: Extra inputs are not permitted"})
        self.assertEqual(up.post(_body([FIRST]))[0].code, 200)

    def test_ignores(self):
        """An upstream that ignores the field answers a continue from its new messages alone:
        a strict one refuses the tool_result (the failure of issue 15)."""
        up = _Upstream(mode="strict", threads="ignore")
        _, first = up.post(create([FIRST]))
        response, body = up.post(cont(first["id"], [_answer_results(first)]))
        self.assertEqual(response.code, 400)
        self.assertIn("messages.0.content.0: unexpected `tool_use_id`", body["error"]["message"])

    def test_bad_mode(self):
        """An unknown threads mode is refused."""
        self.assertRaises(ValueError, SimulatedUpstream, threads="sometimes")


class OptionTests(SynchronousTestCase):
    def test_cli(self):
        """twisted-relay-simulated --threads selects the mode (default ignore)."""
        self.assertEqual(upstream_from(parse_args([])).threads.mode, "ignore")
        self.assertEqual(upstream_from(parse_args(["--threads", "knows"])).threads.mode, "knows")

    def test_tap(self):
        """twistd relay --simulate-threads reaches the embedded simulated upstream's options."""
        options = Options()
        options.parseOptions(["--simulate", "stateful", "--simulate-threads", "knows"])
        self.assertEqual(options.config.simulate_options["threads"], "knows")
        bad = Options()
        from twisted.python.usage import UsageError

        self.assertRaises(UsageError, bad.parseOptions, ["--simulate", "strict", "--simulate-threads", "x"])


def tool_runner_session(base_url: str, iterations: int) -> dict:
    """The official SDK's default tool runner (threads on), run in a thread."""
    import anthropic
    from anthropic import beta_tool

    @beta_tool
    def get_weather(location: str) -> str:
        """Weather at a place.

        Args:
            location: the city.
        """
        return f"sunny in {location}"

    client = anthropic.Anthropic(base_url=base_url, api_key="sk-test", max_retries=0, timeout=30)
    done, error = 0, None
    try:
        runner = client.beta.messages.tool_runner(
            model="claude-sonnet-4-5", max_tokens=256, tools=[get_weather],
            messages=[{"role": "user", "content": "Weather everywhere, one call at a time."}],
            max_iterations=iterations,
        )
        for _message in runner:
            done += 1
    except anthropic.APIStatusError as caught:
        error = f"{caught.status_code} {caught.body}"
    finally:
        client.close()
    return {"turns": done, "error": error}


class ToolRunnerTests(TestCase):
    """The SDK's tool runner, which threads by default, against each simulated upstream."""

    def serve(self, **options):
        sim = SimulatedUpstream(reactor=reactor, **options)
        port = reactor.listenTCP(0, Site(sim.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return sim, f"http://127.0.0.1:{port.getHost().port}"

    async def test_knows(self):
        """Against an upstream that knows threads the runner goes on, sending continues with
        only the new messages and the threads beta."""
        sim, url = self.serve(mode="stateful", seed=2, threads="knows")
        result = await deferToThread(tool_runner_session, url, 12)
        self.assertEqual(result, {"turns": 12, "error": None})
        bodies = [request.body for request in sim.requests]
        self.assertEqual(bodies[0]["thread"], {"type": "create"})
        self.assertTrue(all(body["thread"]["type"] == "continue" for body in bodies[1:]))
        self.assertTrue(all(len(body["messages"]) == 1 for body in bodies[1:]))
        self.assertIn(THREADS_BETA, sim.requests[1].headers["anthropic-beta"])

    async def test_ignores(self):
        """Against a strict upstream that ignores the field, the session dies at turn 2."""
        _, url = self.serve(mode="strict", seed=2, threads="ignore")
        result = await deferToThread(tool_runner_session, url, 12)
        self.assertEqual(result["turns"], 1)
        self.assertIn("unexpected `tool_use_id`", result["error"])

    async def test_rejects(self):
        """Against an upstream that rejects the field, the session dies at turn 1."""
        _, url = self.serve(mode="strict", seed=2, threads="rejects")
        result = await deferToThread(tool_runner_session, url, 12)
        self.assertEqual(result["turns"], 0)
        self.assertIn("thread: Extra inputs are not permitted", result["error"])
