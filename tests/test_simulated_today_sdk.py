# -*- test-case-name: tests.test_simulated_today_sdk -*-
"""
The simulated upstream's today's API seen by the official ``anthropic`` SDK,
on a real socket on 127.0.0.1: an append-only session on Sonnet 5.5 keeps its
thinking, an edited prefix gets the API's exact 400, and ``drop_block`` with
the beta answers with ``input_transformations``.
"""

from __future__ import annotations

from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.server import Site

from tests.helpers import TOOLS
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.thinking import BINDING_BETA, prefix_mismatch_message

try:
    import anthropic
except ImportError:  # pragma: no cover - the test extra installs it
    anthropic = None

MODEL = "claude-sonnet-5-5"
SYSTEM = "You are a careful agent."


def _client(base_url: str):
    return anthropic.Anthropic(base_url=base_url, api_key="sk-test-today", max_retries=0, timeout=30)


def _session(base_url: str, turns: int) -> list:
    """An append-only client, streaming: the history after ``turns`` turns."""
    client = _client(base_url)
    messages: list = [{"role": "user", "content": "Check the weather in many cities."}]
    try:
        for _ in range(turns):
            with client.messages.stream(model=MODEL, max_tokens=512, system=SYSTEM, messages=messages,
                                        tools=TOOLS) as events:
                message = events.get_final_message()
            content = [block.model_dump(exclude_none=True) for block in message.content]
            messages.append({"role": "assistant", "content": content})
            results = [{"type": "tool_result", "tool_use_id": block["id"], "content": "sunny"}
                       for block in content if block["type"] == "tool_use"]
            messages.append({"role": "user", "content": results or "Go on."})
    finally:
        client.close()
    return messages


class TodaySDKTests(TestCase):
    """The official SDK against today's simulated upstream."""

    def setUp(self) -> None:
        if anthropic is None:  # pragma: no cover
            raise SkipTest("the anthropic SDK is not installed")
        upstream = SimulatedUpstream(reuse_every=0, split=True)
        self.port = reactor.listenTCP(0, Site(upstream.resource()), interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)
        self.base_url = "http://127.0.0.1:%d" % self.port.getHost().port

    async def test_append_only_session_keeps_thinking(self) -> None:
        """Eight streamed turns: every answer starts with a signed thinking block and every
        later request is accepted with all of them sent back."""
        messages = await deferToThread(_session, self.base_url, 8)
        thinking = [message["content"][0] for message in messages if message["role"] == "assistant"]
        self.assertEqual([block["type"] for block in thinking], ["thinking"] * 8)
        self.assertTrue(all(block["signature"] for block in thinking))

    async def test_edited_prefix_and_drop_block(self) -> None:
        """An edited first message: the exact 400 (with the beta sentence); then, through
        the beta API, ``drop_block`` drops the bound blocks and lists them."""
        messages = await deferToThread(_session, self.base_url, 3)
        messages[0] = {"role": "user", "content": "Check the weather in a few cities."}

        def plain():
            client = _client(self.base_url)
            try:
                client.messages.create(model=MODEL, max_tokens=512, system=SYSTEM, messages=messages, tools=TOOLS)
            except anthropic.BadRequestError as error:
                return error
            finally:
                client.close()

        error = await deferToThread(plain)
        self.assertIsNotNone(error)
        self.assertEqual(error.status_code, 400)
        self.assertEqual(error.body["error"]["message"], prefix_mismatch_message(1, 0, beta=False))

        def dropping():
            client = _client(self.base_url)
            try:
                return client.beta.messages.create(
                    model=MODEL, max_tokens=512, system=SYSTEM, messages=messages, tools=TOOLS,
                    betas=[BINDING_BETA],
                    thinking={"type": "adaptive", "block_binding": {"prefix_mismatch_behavior": "drop_block"}},
                )
            finally:
                client.close()

        message = await deferToThread(dropping)
        self.assertEqual(
            [(entry.type, entry.path, entry.reason) for entry in message.input_transformations],
            [("thinking_dropped", f"messages.{n}.content.0", "prefix_binding_mismatch") for n in (1, 3, 5)],
        )
        self.assertEqual(message.content[0].type, "thinking")
