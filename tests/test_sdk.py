"""
End-to-end tests with the official ``anthropic`` Python SDK as the client,
on real sockets on 127.0.0.1: the relay in front of the simulated upstream.

The SDK is blocking, so each session runs in a thread while the reactor
serves the relay and the upstream.
"""

from __future__ import annotations

from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.server import Site

from twisted_relay.config import RelayConfig, one_upstream
from twisted_relay.simulated import SimulatedUpstream

from tests.helpers import TOOLS, serve_relay

try:
    import anthropic
except ImportError:  # pragma: no cover - the test extra installs it
    anthropic = None

MODEL = "claude-sonnet-4-5"


def sdk_client(base_url: str):
    """An SDK client that neither retries nor waits long: failures show."""
    return anthropic.Anthropic(base_url=base_url, api_key="sk-test-sdk", max_retries=0, timeout=30)


def run_session(base_url: str, turns: int, stream: bool) -> dict:
    """
    Drive a tool-use session as Claude Code would: send the whole history,
    append the answer, answer every ``tool_use`` with a ``tool_result``.

    Runs in a thread. Returns what the client saw.
    """
    client = sdk_client(base_url)
    messages = [{"role": "user", "content": "Check the weather in many cities, one call at a time."}]
    seen_ids: list[str] = []
    failures: list[str] = []
    completed = 0
    try:
        for turn in range(turns):
            try:
                if stream:
                    with client.messages.stream(
                        model=MODEL, max_tokens=256, messages=messages, tools=TOOLS
                    ) as events:
                        message = events.get_final_message()
                else:
                    message = client.messages.create(
                        model=MODEL, max_tokens=256, messages=messages, tools=TOOLS
                    )
            except anthropic.APIStatusError as e:
                failures.append("turn %d: %d %s" % (turn, e.status_code, e.response.text))
                break
            seen_ids.extend(feed_back(messages, message))
            completed += 1
    finally:
        client.close()
    return {"completed": completed, "ids": seen_ids, "failures": failures}


def feed_back(messages: list, message) -> list[str]:
    """
    Append an answer and the next user turn to ``messages``, as a client
    does (a result for every tool call, else "Go on."); the tool-use ids.
    """
    content = [block.model_dump(exclude_none=True) for block in message.content]
    uses = [block for block in content if block["type"] == "tool_use"]
    messages.append({"role": "assistant", "content": content})
    results = [{"type": "tool_result", "tool_use_id": block["id"], "content": "sunny, 21 C"} for block in uses]
    messages.append({"role": "user", "content": results or "Go on."})
    return [block["id"] for block in uses]


class SDKTestMixin:
    def setUp(self):
        if anthropic is None:
            raise SkipTest("the anthropic SDK is not installed (pip install '.[test]')")

    def serve_upstream(self, **options) -> tuple[SimulatedUpstream, str]:
        sim = SimulatedUpstream(reactor=reactor, **options)
        port = reactor.listenTCP(0, Site(sim.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return sim, "http://127.0.0.1:%d" % (port.getHost().port,)

    def serve_relay(self, upstream_url: str, **settings) -> str:
        config = RelayConfig(listen=(), upstreams=one_upstream(upstream_url), dump_dir=None).with_changes(**settings)
        return serve_relay(self, config, reactor).url


class SDKInteropTests(SDKTestMixin, TestCase):
    """
    The SDK gets what it expects through the relay, streaming and not.
    """

    async def test_non_streaming(self):
        """
        ``messages.create`` through the relay returns a well-formed message
        with a tool call, usage and stop reason.
        """
        _, upstream = self.serve_upstream(mode="strict", seed=5)
        base = self.serve_relay(upstream)

        def call():
            client = sdk_client(base)
            try:
                return client.messages.create(
                    model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "hi"}], tools=TOOLS
                )
            finally:
                client.close()

        message = await deferToThread(call)
        self.assertEqual(message.role, "assistant")
        self.assertEqual(message.stop_reason, "tool_use")
        self.assertEqual([b.type for b in message.content][-1], "tool_use")
        self.assertEqual(message.content[-1].name, "get_weather")
        self.assertGreater(message.usage.output_tokens, 0)

    async def test_streaming(self):
        """
        ``messages.stream`` through the relay yields the events the SDK needs
        to assemble the same kind of message, including a tool call's input.
        """
        _, upstream = self.serve_upstream(mode="strict", seed=5)
        base = self.serve_relay(upstream)

        def call():
            client = sdk_client(base)
            try:
                with client.messages.stream(
                    model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "hi"}], tools=TOOLS
                ) as stream:
                    kinds = [event.type for event in stream]
                    return kinds, stream.get_final_message()
            finally:
                client.close()

        kinds, message = await deferToThread(call)
        self.assertEqual(kinds[0], "message_start")
        self.assertIn("content_block_delta", kinds)
        self.assertEqual(kinds[-1], "message_stop")
        self.assertEqual(message.stop_reason, "tool_use")
        self.assertIsInstance(message.content[-1].input, dict)

    async def test_relay_error_reaches_sdk(self):
        """
        A relay error (an unreachable upstream) reaches the SDK as an
        ``APIStatusError`` with Anthropic's error shape.
        """
        base = self.serve_relay("http://127.0.0.1:9")

        def call():
            client = sdk_client(base)
            try:
                client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}])
            except anthropic.APIStatusError as e:
                return e
            finally:
                client.close()

        error = await deferToThread(call)
        self.assertEqual(error.status_code, 502)
        self.assertEqual(error.body["error"]["type"], "api_error")


class LongSessionTests(SDKTestMixin, TestCase):
    """
    The reason the relay exists: a 200-turn tool session against a strict
    upstream that reuses an id every few calls survives, and the client
    never sees a duplicate id.
    """

    TURNS = 200

    def assertSurvived(self, outcome):
        self.assertEqual(outcome["failures"], [])
        self.assertEqual(outcome["completed"], self.TURNS)
        self.assertEqual(len(outcome["ids"]), len(set(outcome["ids"])), "the client saw a duplicate id")
        self.assertTrue(any(i.rsplit("-", 1)[-1].isdigit() for i in outcome["ids"]), "no id was ever rewritten")

    async def test_without_relay_the_session_dies(self):
        """
        Straight against the strict upstream, the session fails at the first
        reused id: the failure the relay prevents is real.
        """
        _, upstream = self.serve_upstream(mode="strict", seed=7, reuse_every=3)
        outcome = await deferToThread(run_session, upstream, self.TURNS, False)
        self.assertEqual(len(outcome["failures"]), 1)
        self.assertLess(outcome["completed"], 10)
        self.assertIn("400", outcome["failures"][0])

    async def test_strict_unique_non_streaming(self):
        """
        200 turns, non-streaming, strict upstream, ``--upstream-ids unique``.
        """
        _, upstream = self.serve_upstream(mode="strict", seed=7, reuse_every=3)
        base = self.serve_relay(upstream)
        self.assertSurvived(await deferToThread(run_session, base, self.TURNS, False))

    async def test_strict_unique_streaming(self):
        """
        200 turns, streaming, strict upstream, ``--upstream-ids unique``.
        """
        _, upstream = self.serve_upstream(mode="strict", seed=8, reuse_every=3)
        base = self.serve_relay(upstream)
        self.assertSurvived(await deferToThread(run_session, base, self.TURNS, True))

    async def test_stateful_original_streaming(self):
        """
        200 turns, streaming, against an upstream that remembers the ids it
        issued, with ``--upstream-ids original``: it gets its own ids back.
        """
        _, upstream = self.serve_upstream(mode="stateful", seed=9, reuse_every=3)
        base = self.serve_relay(upstream, upstreams=one_upstream(upstream, ids="original"))
        self.assertSurvived(await deferToThread(run_session, base, self.TURNS, True))

    async def test_stateful_original_non_streaming(self):
        """
        200 turns, non-streaming, stateful upstream, ``--upstream-ids original``.
        """
        _, upstream = self.serve_upstream(mode="stateful", seed=10, reuse_every=3)
        base = self.serve_relay(upstream, upstreams=one_upstream(upstream, ids="original"))
        self.assertSurvived(await deferToThread(run_session, base, self.TURNS, False))
