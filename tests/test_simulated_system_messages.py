# -*- test-case-name: tests.test_simulated_system_messages -*-
"""
Tests for mid-conversation ``role: "system"`` messages and deferred tools on
the simulated upstream (:mod:`twisted_relay.simulated.system_messages`, and
the prefix rules of :mod:`twisted_relay.simulated.thinking`), as Claude Code
2.1.328 sends them: system messages with its
``mid-conversation-tool-changes-2026-07-01`` beta, and a ``defer_loading``
tool that a later message loads.
"""

from __future__ import annotations

import copy

from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase
from twisted.web.server import Site

from tests.test_simulated import TOOLS, _answer_results
from tests.test_simulated_today import BETA, SONNET, _assistant, _body, _Upstream
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.system_messages import TOOL_CHANGES_BETA, callable_tools

try:
    import anthropic
except ImportError:  # pragma: no cover - the test extra installs it
    anthropic = None

DEFERRED = {"name": "lookup_city", "description": "Find a city.", "defer_loading": True,
            "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}
REMINDER = {"role": "system", "content": "Answer in French from now on."}


def _tool_names(answer: dict) -> set:
    return {block["name"] for block in answer["content"] if block["type"] == "tool_use"}


class SystemMessageTests(SynchronousTestCase):
    """``role: "system"`` messages on today's and year-old models."""

    def test_text_system_message_taken_without_beta(self) -> None:
        """A text system message is taken by today's models with no beta (the docs:
        "Mid-conversation system messages don't require a beta header")."""
        up = _Upstream()
        response, answer = up.post(_body([{"role": "user", "content": "Salut."}, REMINDER]))
        self.assertEqual(response.code, 200, answer)

    def test_year_old_model_refuses_system_role(self) -> None:
        """A year-old model keeps refusing the role, as before."""
        up = _Upstream()
        body = _body([{"role": "user", "content": "Hi."}, REMINDER], model="claude-sonnet-4-5")
        response, answer = up.post(body)
        self.assertEqual(response.code, 400)
        self.assertEqual(answer["error"]["message"], "messages.1.role: Input should be 'user' or 'assistant'")

    def test_tool_change_needs_its_beta(self) -> None:
        """``tool_addition`` without the tool-changes beta is a 400; with it, a 200."""
        up = _Upstream()
        change = {"role": "system", "content": [
            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_weather"}}]}
        body = _body([{"role": "user", "content": "Hi."}, change])
        response, answer = up.post(body)
        self.assertEqual(response.code, 400)
        self.assertTrue(answer["error"]["message"].startswith("messages.1.content.0: `tool_removal`"))
        response, answer = up.post(body, headers={"anthropic-beta": TOOL_CHANGES_BETA})
        self.assertEqual(response.code, 200, answer)

    def test_unknown_block_in_system_message(self) -> None:
        """A system message takes text and tool changes only."""
        up = _Upstream()
        bad = {"role": "system", "content": [{"type": "image", "source": {}}]}
        response, answer = up.post(_body([{"role": "user", "content": "Hi."}, bad]))
        self.assertEqual(response.code, 400)
        self.assertTrue(answer["error"]["message"].startswith("messages.1.content.0: Input tag 'image'"))

    def test_system_message_is_part_of_the_prefix(self) -> None:
        """A system message before a thinking block is in its prefix by value:
        kept, the next turn is a 200; edited, the API's prefix 400."""
        up = _Upstream()
        messages = [{"role": "user", "content": "Salut."}, REMINDER]
        response, answer = up.post(_body(messages))
        self.assertEqual(response.code, 200, answer)
        messages = messages + [_assistant(answer), _answer_results(answer)]
        response, again = up.post(_body(messages))
        self.assertEqual(response.code, 200, again)
        edited = copy.deepcopy(messages)
        edited[1]["content"] = "Answer in German from now on."
        response, refused = up.post(_body(edited))
        self.assertEqual(response.code, 400)
        self.assertIn("messages.2.content.0", refused["error"]["message"])
        self.assertIn("bound to a different conversation", refused["error"]["message"])

    def test_tool_removal_and_addition_steer_the_model(self) -> None:
        """The fake model calls only the tools offered at the end of the messages."""
        remove = {"role": "system", "content": [
            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_weather"}}]}
        body = _body([{"role": "user", "content": "Hi."}, remove], tools=TOOLS[:1])
        self.assertEqual(callable_tools(body), [])
        add = {"role": "system", "content": [
            {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "get_weather"}}]}
        body["messages"].append(add)
        self.assertEqual([tool["name"] for tool in callable_tools(body)], ["get_weather"])


class DeferredToolTests(SynchronousTestCase):
    """A ``defer_loading`` tool, as Claude Code declares its deferred ones."""

    def test_model_never_calls_an_unloaded_deferred_tool(self) -> None:
        """A deferred tool is not offered until a message loads it."""
        up = _Upstream()
        body = _body([{"role": "user", "content": "Hi."}], tools=[DEFERRED])
        for seed in range(5):
            body["messages"][0]["content"] = f"Hi {seed}."
            response, answer = up.post(body)
            self.assertEqual(response.code, 200, answer)
            self.assertEqual(_tool_names(answer), set())
        loaded = {"role": "system", "content": [
            {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "lookup_city"}}]}
        body["messages"].append(loaded)
        response, answer = up.post(body, headers={"anthropic-beta": TOOL_CHANGES_BETA})
        self.assertEqual(_tool_names(answer), {"lookup_city"})

    def test_later_use_of_a_deferred_tool_is_not_an_edit(self) -> None:
        """The tools array stays the same and a later message uses a deferred tool:
        the thinking blocks before that message stay valid (Claude Code's
        ``DeferredToolPlaceholder`` refused as "bound to a different
        conversation" before)."""
        up = _Upstream()
        tools = TOOLS + [DEFERRED]
        messages = [{"role": "user", "content": "Salut."}]
        response, answer = up.post(_body(messages, tools=tools), headers=BETA)
        self.assertEqual(response.code, 200, answer)
        messages = messages + [_assistant(answer), _answer_results(answer)]
        use = {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_01A2b3C4d5E6f7G8h9I0j1K2", "name": "lookup_city", "input": {}}]}
        result = {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01A2b3C4d5E6f7G8h9I0j1K2", "content": "Lyon"}]}
        response, again = up.post(_body(messages + [use, result], tools=tools), headers=BETA)
        self.assertEqual(response.code, 200, again)
        self.assertEqual(again["input_transformations"], [])

    def test_changed_loaded_deferred_tool_is_an_edit(self) -> None:
        """Once loaded, a deferred tool's definition is in the prefix of the blocks after it."""
        up = _Upstream()
        tools = TOOLS + [DEFERRED]
        use = {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_01A2b3C4d5E6f7G8h9I0j1K2", "name": "lookup_city", "input": {}}]}
        result = {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01A2b3C4d5E6f7G8h9I0j1K2", "content": "Lyon"}]}
        messages = [{"role": "user", "content": "Salut."}, use, result]
        response, answer = up.post(_body(messages, tools=tools))
        self.assertEqual(response.code, 200, answer)
        messages = messages + [_assistant(answer), _answer_results(answer)]
        changed = copy.deepcopy(tools)
        changed[-1]["description"] = "Find a town."
        response, refused = up.post(_body(messages, tools=changed))
        self.assertEqual(response.code, 400)
        self.assertIn("messages.3.content.0", refused["error"]["message"])


class SystemMessageSDKTests(TestCase):
    """The official SDK's ``client.beta.messages.create(betas=[...])`` with a system message."""

    def setUp(self) -> None:
        if anthropic is None:  # pragma: no cover
            raise SkipTest("the anthropic SDK is not installed")
        upstream = SimulatedUpstream(reuse_every=0)
        self.port = reactor.listenTCP(0, Site(upstream.resource()), interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)
        self.base_url = "http://127.0.0.1:%d" % self.port.getHost().port

    async def test_beta_create_with_tool_change(self) -> None:
        """Two turns through the SDK: a system message with a tool removal and
        then an addition; the model calls the added tool, thinking kept."""
        def run() -> list:
            client = anthropic.Anthropic(base_url=self.base_url, api_key="sk-test-system", max_retries=0,
                                         timeout=30)
            try:
                messages: list = [
                    {"role": "user", "content": "Quel temps fait-il ?"},
                    {"role": "system", "content": [
                        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "get_weather"}}]},
                ]
                first = client.beta.messages.create(model=SONNET, max_tokens=512, messages=messages,
                                                    tools=TOOLS[:1], betas=[TOOL_CHANGES_BETA])
                messages = messages + [
                    {"role": "assistant", "content": [block.model_dump(exclude_none=True)
                                                      for block in first.content]},
                    {"role": "user", "content": "Et maintenant ?"},
                    {"role": "system", "content": [
                        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "get_weather"}}]},
                ]
                second = client.beta.messages.create(model=SONNET, max_tokens=512, messages=messages,
                                                     tools=TOOLS[:1], betas=[TOOL_CHANGES_BETA])
                return [first, second]
            finally:
                client.close()

        first, second = await deferToThread(run)
        self.assertEqual(first.stop_reason, "end_turn")
        self.assertEqual(first.content[0].type, "thinking")
        self.assertEqual(second.stop_reason, "tool_use")
        self.assertEqual({block.name for block in second.content if block.type == "tool_use"}, {"get_weather"})
