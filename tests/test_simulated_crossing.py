"""
The simulated upstream's rules for conversations that cross upstreams: its
own id pattern, ids left out, and signed thinking it verifies, each refused
in Anthropic's words; and the relay's translation meeting them.
"""

from __future__ import annotations

import json

from twisted.trial.unittest import SynchronousTestCase

from tests.test_simulated import (
    _assistant,
    _body,
    _ErrorAssertions,
    _results,
    _Upstream,
    parse_sse,
)
from twisted_relay.simulated.cli import parse_args, upstream_from
from twisted_relay.simulated.model import ModelOptions, compose_answer, sign_thinking
from twisted_relay.translation import (
    ORIGINAL,
    UNIQUE,
    UpstreamRules,
    read_mark,
    translate_request,
)

THINKING = {"type": "enabled", "budget_tokens": 1024}
KIMI = r"^functions\.[A-Za-z_]+:[0-9]+$"


def unmarked(body: dict) -> dict:
    """``body`` with every thinking mark removed, all else kept."""
    body = json.loads(json.dumps(body))
    for message in body["messages"]:
        for block in message["content"] if isinstance(message["content"], list) else ():
            if block["type"] == "thinking" and read_mark(block["signature"]):
                block["signature"] = read_mark(block["signature"])[1]
    return body


def assemble(events: list) -> list:
    """The content blocks a client rebuilds from a stream, thinking included."""
    blocks: list = []
    partial: dict = {}
    for name, data in events:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
            partial[data["index"]] = []
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                partial[data["index"]].append(delta["partial_json"])
        elif name == "content_block_stop" and partial[data["index"]]:
            blocks[data["index"]]["input"] = json.loads("".join(partial[data["index"]]))
    return blocks


class IdPatternTests(_ErrorAssertions, SynchronousTestCase):
    """``id_pattern`` refuses ids outside it with Anthropic's error, in any checking mode."""

    def test_refused_with_the_pattern(self) -> None:
        """A declaration or a result outside the pattern is refused with the pattern in the message."""
        for mode in ("strict", "stateful"):
            upstream = _Upstream(mode=mode, id_pattern=r"^[A-Za-z0-9_]+$")
            messages = [{"role": "user", "content": "hi"}, _assistant("toolu_a-2"), _results("toolu_a-2")]
            response, body = upstream.post(_body(messages))
            self.assert_error(response, body, 400, "invalid_request_error",
                              "messages.1.content.1.tool_use.id: String should match pattern '^[A-Za-z0-9_]+$'")
        upstream = _Upstream(mode="strict", id_pattern=KIMI)
        messages = [{"role": "user", "content": "hi"}, _assistant("functions.Bash:0"), _results("toolu_x")]
        response, body = upstream.post(_body(messages))
        self.assert_error(response, body, 400, "invalid_request_error",
                          f"messages.2.content.0.tool_result.tool_use_id: String should match pattern '{KIMI}'")

    def test_own_pattern_replaces_anthropics(self) -> None:
        """A strict upstream with Kimi's pattern accepts Kimi's ids."""
        upstream = _Upstream(mode="strict", id_pattern=KIMI)
        messages = [{"role": "user", "content": "hi"}, _assistant("functions.Bash:0"), _results("functions.Bash:0")]
        response, _ = upstream.post(_body(messages))
        self.assertEqual(response.code, 200)

    def test_relay_encoding_passes(self) -> None:
        """The same Kimi history translated for a strict upstream's pattern is accepted."""
        upstream = _Upstream(mode="strict", id_pattern=r"^[A-Za-z0-9_]+$")
        messages = [{"role": "user", "content": "hi"}, _assistant("functions.Bash:0"), _results("functions.Bash:0"),
                    _assistant("toolu_b-2"), _results("toolu_b-2")]
        rules = UpstreamRules(policy=UNIQUE, id_pattern=r"^[A-Za-z0-9_]+$")
        response, _ = upstream.post(translate_request(_body(messages), rules).upstream_body)
        self.assertEqual(response.code, 200)
        response, _ = upstream.post(_body(messages))
        self.assertEqual(response.code, 400)

    def test_cli(self) -> None:
        """``--id-pattern``, ``--left-out-ids`` and ``--thinking-secret`` reach the upstream; a bad pattern exits."""
        sim = upstream_from(parse_args(["--id-pattern", KIMI, "--left-out-ids", "empty", "--thinking-secret", "s"]))
        self.assertEqual(sim.id_pattern, KIMI)
        self.assertEqual(sim.options.left_out_ids, "empty")
        self.assertEqual(sim.options.thinking_secret, "s")
        self.assertRaises(SystemExit, parse_args, ["--id-pattern", "("])
        self.assertRaises(ValueError, ModelOptions, left_out_ids="sometimes")


class LeftOutIdsTests(SynchronousTestCase):
    """The model can emit tool_use blocks with an empty or no id."""

    def test_empty_and_absent(self) -> None:
        """``empty`` gives ``""``, ``absent`` no id field, ``some`` a mix; streams carry the same."""
        body = _body([{"role": "user", "content": "hi"}])
        for left_out, check in (("empty", lambda b: b["id"] == ""), ("absent", lambda b: "id" not in b)):
            answer = compose_answer(body, ModelOptions(left_out_ids=left_out, parallel=2))
            calls = [b for b in answer["content"] if b["type"] == "tool_use"]
            self.assertEqual(len(calls), 2)
            self.assertTrue(all(check(b) for b in calls))
            upstream = _Upstream(mode="lenient", left_out_ids=left_out, parallel=2)
            _, data = upstream.post(dict(body, stream=True))
            streamed = [b for b in assemble(parse_sse(data)) if b["type"] == "tool_use"]
            self.assertTrue(all(check(b) for b in streamed))
        answer = compose_answer(body, ModelOptions(left_out_ids="some", parallel=4))
        shapes = {b.get("id", None) == "" or "id" not in b for b in answer["content"] if b["type"] == "tool_use"}
        self.assertEqual(shapes, {True, False})

    def test_session_lives_through_the_relay(self) -> None:
        """
        A strict upstream that leaves ids out refuses its own history at the
        next request; through the translation (minted ids) a 20-turn session
        has no failed turn, streaming and not.
        """
        for stream in (False, True):
            upstream = _Upstream(mode="strict", left_out_ids="some", parallel=2)
            messages: list = [{"role": "user", "content": "go"}]
            seen: set = set()
            for turn in range(20):
                body = _body(messages, stream=stream)
                t = translate_request(body, UNIQUE)
                response, answer = upstream.post(t.upstream_body)
                self.assertEqual(response.code, 200, answer)
                r = t.response()
                if stream:
                    events = parse_sse(answer)
                    for name, data in events:
                        if name == "content_block_start":
                            r.translate_block(data["content_block"])
                    content = assemble(events)
                else:
                    r.translate_message(answer)
                    content = answer["content"]
                ids = [b["id"] for b in content if b["type"] == "tool_use"]
                self.assertTrue(all(ids))
                self.assertFalse(seen & set(ids))
                seen.update(ids)
                messages = messages + [{"role": "assistant", "content": content}, _results(*ids)]
        # without the relay, the upstream's first answer sent back is refused
        first = [{"role": "user", "content": "go"}]
        _, answer = upstream.post(_body(first))
        self.assertIn(None, [b.get("id") or None for b in answer["content"] if b["type"] == "tool_use"])
        history = first + [{"role": "assistant", "content": answer["content"]},
                           _results(*[b.get("id", "") for b in answer["content"] if b["type"] == "tool_use"])]
        response, _ = upstream.post(_body(history))
        self.assertEqual(response.code, 400)


class ThinkingTests(_ErrorAssertions, SynchronousTestCase):
    """Signed thinking: made, streamed, verified, and refused when not its own."""

    def test_signed_and_verified(self) -> None:
        """
        With thinking on the answer starts with a thinking block it signed; sent
        back, it is accepted; with another secret it is refused in Anthropic's
        words.
        """
        upstream = _Upstream(mode="strict", thinking_secret="alpha")
        first = [{"role": "user", "content": "hi"}]
        _, answer = upstream.post(_body(first, thinking=THINKING))
        block = answer["content"][0]
        self.assertEqual(block["type"], "thinking")
        self.assertEqual(block["signature"], sign_thinking("alpha", block["thinking"]))
        calls = [b["id"] for b in answer["content"] if b["type"] == "tool_use"]
        history = first + [{"role": "assistant", "content": answer["content"]}, _results(*calls)]
        response, _ = upstream.post(_body(history, thinking=THINKING))
        self.assertEqual(response.code, 200)
        other = _Upstream(mode="strict", thinking_secret="beta")
        response, body = other.post(_body(history, thinking=THINKING))
        self.assert_error(response, body, 400, "invalid_request_error",
                          "messages.1.content.0: Invalid `signature` in `thinking` block")
        # without thinking on, no thinking block is made
        _, answer = upstream.post(_body(first))
        self.assertNotIn("thinking", [b["type"] for b in answer["content"]])

    def test_streamed(self) -> None:
        """The stream carries the thinking text in deltas and the signature in a signature_delta."""
        upstream = _Upstream(mode="lenient", thinking_secret="alpha")
        body = _body([{"role": "user", "content": "hi"}], thinking=THINKING)
        _, data = upstream.post(dict(body, stream=True))
        events = parse_sse(data)
        self.assertIn("signature_delta", [d["delta"]["type"] for n, d in events if n == "content_block_delta"])
        self.assertEqual(assemble(events), upstream.post(body)[1]["content"])

    def test_tool_loop_rule(self) -> None:
        """With thinking on, a tool loop whose final assistant message lacks thinking is refused."""
        upstream = _Upstream(mode="strict", thinking_secret="alpha")
        messages = [{"role": "user", "content": "hi"}, _assistant("toolu_a"), _results("toolu_a")]
        response, body = upstream.post(_body(messages, thinking=THINKING))
        self.assertEqual(response.code, 400)
        self.assertTrue(body["error"]["message"].startswith(
            "messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found `text`."))
        response, _ = upstream.post(_body(messages))
        self.assertEqual(response.code, 200)

    def test_crossing_through_the_translation(self) -> None:
        """
        A tool-loop session that alternates between two upstreams with
        thinking on and different secrets, ids and policies: every request
        through the translation is accepted; sent as the client holds it, the
        first request after a move is refused.
        """
        strict = _Upstream(mode="strict", thinking_secret="alpha", reuse_every=2)
        # a Kimi-family backend takes any id, repeats included, and checks its thinking
        kimi = _Upstream(mode="lenient", thinking_secret="beta", id_style="kimi")
        homes = [(strict, UpstreamRules("strict", UNIQUE, mark_thinking=True)),
                 (kimi, UpstreamRules("kimi", ORIGINAL, own_ids=KIMI, mark_thinking=True))]
        messages: list = [{"role": "user", "content": "go"}]
        refused = 0
        for turn in range(24):
            upstream, rules = homes[turn // 3 % 2]
            body = _body(messages, thinking=THINKING)
            t = translate_request(body, rules)
            response, answer = upstream.post(t.upstream_body)
            self.assertEqual(response.code, 200, (turn, answer))
            if turn % 3 == 0 and turn:
                # what a relay without these rules would send: the client's
                # history, its thinking as the makers signed it
                response, _ = upstream.post(unmarked(body))
                refused += response.code == 400
            t.response().translate_message(answer)
            ids = [b["id"] for b in answer["content"] if b["type"] == "tool_use"]
            messages = messages + [{"role": "assistant", "content": answer["content"]}, _results(*ids)]
        self.assertEqual(refused, 7)
