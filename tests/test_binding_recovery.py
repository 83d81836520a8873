"""
Recovery from the "bound to a different conversation" 400 (issue 25, item
5), on 127.0.0.1 in front of a scripted upstream
(:class:`tests.faulty_upstream.FaultyUpstream`): the request is sent once
more to the same key with ``prefix_mismatch_behavior: "drop_block"`` and the
beta, the client gets the 200, the original 400 is dumped with a note and
counted; with ``--thinking-binding-recovery off``, for ``between_tools``,
for other 400s and for a second such 400, the client gets the 400 as the
upstream said it; never a failover to another key.
"""

from __future__ import annotations

import glob
import json
import os

import treq
import ujson
from twisted.trial.unittest import SynchronousTestCase, TestCase

from twisted_relay.bodies import BINDING_BETA, bound_elsewhere, droppable, dropping_blocks, with_beta
from twisted_relay.config import Upstream

from tests.faulty_upstream import error_answer
from tests.helpers import messages_body
from tests.test_failover import RelayOverUpstreams, sleep

KEYS = ("sk-ant-binding-key-one", "sk-ant-binding-key-two")
BOUND = (
    "messages.1.content.0: Invalid `signature` in `thinking` block. The block is bound to a different "
    "conversation. Remove the block, or set `thinking.block_binding.prefix_mismatch_behavior` to "
    '"drop_block". That setting requires the `thinking-binding-controls-2026-08-01` value in the '
    "`anthropic-beta` header. The system prompt changed."
)
BAD_SIGNATURE = "messages.1.content.0: Invalid `signature` in `thinking` block"


def edited(thinking=None) -> dict:
    """A conversation whose client edited an old turn (its thinking block's prefix changed)."""
    body = messages_body([
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "", "signature": "EuYBCkQYAiJA"},
            {"type": "text", "text": "Let me look."},
        ]},
        {"role": "user", "content": "And in Rome?"},
    ])
    if thinking is not None:
        body["thinking"] = thinking
    return body


class BodyTests(SynchronousTestCase):
    """The pure parts (:mod:`twisted_relay.bodies`)."""

    def test_match_the_fixed_text_only(self):
        answer = lambda message, kind="invalid_request_error": json.dumps(  # noqa: E731
            {"type": "error", "error": {"type": kind, "message": message}}
        ).encode()
        self.assertTrue(bound_elsewhere(answer(BOUND)))
        self.assertTrue(bound_elsewhere(answer(BOUND.split(" Remove")[0])))
        self.assertTrue(bound_elsewhere(answer(BOUND.replace("`thinking` block", "`redacted_thinking` block"))))
        self.assertFalse(bound_elsewhere(answer(BAD_SIGNATURE)))
        self.assertFalse(bound_elsewhere(answer(BOUND, "api_error")))
        for junk in (None, b"", b"not json", b"[]", b'{"error": "x"}'):
            self.assertFalse(bound_elsewhere(junk))

    def test_droppable(self):
        self.assertTrue(droppable({"messages": []}))
        self.assertTrue(droppable({"thinking": {"type": "adaptive", "display": "summarized"}}))
        self.assertTrue(droppable({"thinking": {"type": "enabled", "budget_tokens": 2000}}))
        self.assertFalse(droppable({"thinking": {"type": "between_tools"}}))
        self.assertFalse(droppable({"thinking": {"type": "disabled"}}))
        self.assertFalse(droppable({"thinking": {"type": "adaptive", "block_binding": {"prefix_mismatch_behavior": "error"}}}))
        self.assertFalse(droppable(dropping_blocks({"messages": []})))

    def test_dropping_blocks_keeps_the_rest(self):
        body = {"model": "m", "thinking": {"type": "adaptive", "display": "summarized"}, "messages": [1]}
        self.assertEqual(dropping_blocks(body), {"model": "m", "messages": [1], "thinking": {
            "type": "adaptive", "display": "summarized", "block_binding": {"prefix_mismatch_behavior": "drop_block"}}})
        self.assertEqual(dropping_blocks({})["thinking"]["type"], "adaptive")
        self.assertEqual(body["thinking"], {"type": "adaptive", "display": "summarized"})

    def test_with_beta(self):
        self.assertEqual(with_beta(None), BINDING_BETA.encode())
        self.assertEqual(with_beta([b"a-1, b-2"]), b"a-1,b-2," + BINDING_BETA.encode())
        self.assertEqual(with_beta([BINDING_BETA.encode()]), BINDING_BETA.encode())


class RecoveryTests(RelayOverUpstreams, TestCase):

    def start(self, **settings):
        self.upstream_, url = self.upstream()
        self.dumps = self.mktemp()
        self.start_relay([Upstream("pool", url, keys=KEYS)], dump_dir=self.dumps, **settings)

    async def post(self, body, beta="inline-tools-2026-09-15"):
        headers = {"content-type": ["application/json"], "x-api-key": ["sk-ant-client"], "anthropic-beta": [beta]}
        response = await treq.post(self.base + "/v1/messages", data=ujson.dumps(body).encode(), headers=headers, persistent=False)
        return response, await response.content()

    def sent(self):
        return [(ujson.loads(r.body), r.header(b"anthropic-beta"), r.header(b"x-api-key")) for r in self.upstream_.received]

    async def dump_files(self, count=1):
        for _ in range(100):
            found = sorted(glob.glob(os.path.join(self.dumps, "*", "*.json")))
            if len(found) >= count:
                return found
            await sleep(0.05)
        return found

    async def test_recovered(self):
        """The 400, then the same key again with drop_block and the beta: the client gets the 200."""
        self.start()
        self.upstream_.script(error_answer(400, "invalid_request_error", BOUND))
        response, answer = await self.post(edited({"type": "adaptive", "display": "summarized"}))
        self.assertEqual(response.code, 200, answer)
        (first, first_beta, first_key), (second, second_beta, second_key) = self.sent()
        self.assertNotIn("block_binding", first["thinking"])
        self.assertEqual(second["thinking"], {
            "type": "adaptive", "display": "summarized", "block_binding": {"prefix_mismatch_behavior": "drop_block"},
        })
        self.assertEqual(first_beta, [b"inline-tools-2026-09-15"])
        self.assertEqual(second_beta, [b"inline-tools-2026-09-15," + BINDING_BETA.encode()])
        self.assertEqual(second_key, first_key)
        self.assertEqual({k: v for k, v in second.items() if k != "thinking"}, {k: v for k, v in first.items() if k != "thinking"})
        [path] = await self.dump_files()
        with open(path) as f:
            dump = json.load(f)
        self.assertEqual(dump["status"], 400)
        with open(path) as f:
            text = f.read()
        for key in KEYS + ("sk-ant-client",):
            self.assertNotIn(key, text)
        self.assertIn("drop_block", dump["note"])
        self.assertIn("bound to a different conversation", json.dumps(dump["response"]))
        metrics = await (await treq.get(self.base + "/metrics", persistent=False)).text()
        self.assertIn('relay_binding_recoveries_total{upstream="pool"} 1.0', metrics)
        self.assertNotIn("relay_upstream_failovers_total{", metrics)

    async def test_no_thinking_field_gets_adaptive(self):
        """A request without ``thinking`` (adaptive by default) is sent again with ``{"type": "adaptive", ...}``."""
        self.start()
        self.upstream_.script(error_answer(400, "invalid_request_error", BOUND))
        response, _ = await self.post(edited())
        self.assertEqual(response.code, 200)
        self.assertEqual(self.sent()[1][0]["thinking"]["type"], "adaptive")

    async def test_off(self):
        """``--thinking-binding-recovery off``: the client gets the upstream's 400, as it said it."""
        self.start(thinking_binding_recovery="off")
        self.upstream_.script(error_answer(400, "invalid_request_error", BOUND))
        response, answer = await self.post(edited())
        self.assertEqual(response.code, 400)
        self.assertEqual(ujson.loads(answer)["error"]["message"], BOUND)
        self.assertEqual(len(self.sent()), 1)

    async def test_not_retried(self):
        """
        between_tools, a 400 that is not this one (a bad signature), and a
        second such 400 after the recovery go to the client; the body read
        to judge it arrives whole; no other key is tried.
        """
        self.start()
        self.upstream_.script(error_answer(400, "invalid_request_error", BOUND))
        response, answer = await self.post(edited({"type": "between_tools"}))
        self.assertEqual((response.code, ujson.loads(answer)["error"]["message"]), (400, BOUND))
        self.upstream_.script(error_answer(400, "invalid_request_error", BAD_SIGNATURE))
        response, answer = await self.post(edited())
        self.assertEqual((response.code, ujson.loads(answer)["error"]["message"]), (400, BAD_SIGNATURE))
        self.upstream_.script(*[error_answer(400, "invalid_request_error", BOUND)] * 2)
        response, answer = await self.post(edited())
        self.assertEqual((response.code, ujson.loads(answer)["error"]["message"]), (400, BOUND))
        sent = self.sent()
        self.assertEqual(len(sent), 4)
        self.assertEqual(len({tuple(s[2]) for s in sent}), 1)
        self.assertIn("block_binding", sent[3][0]["thinking"])

    async def test_later_turns_carry_it(self):
        """
        After a recovery, the conversation's later requests carry
        ``drop_block`` from the start (the edit stays in its history): no
        second 400, no second dump. Another conversation is sent as it came.
        """
        self.start()
        self.upstream_.script(error_answer(400, "invalid_request_error", BOUND))
        await self.post(edited())
        later = edited()
        later["messages"] += [
            {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
            {"role": "user", "content": "Thanks."},
        ]
        response, _ = await self.post(later)
        self.assertEqual(response.code, 200)
        other = messages_body([{"role": "user", "content": "Another conversation"}])
        await self.post(other)
        sent = self.sent()
        self.assertEqual(len(sent), 4)
        self.assertIn("block_binding", sent[2][0]["thinking"])
        self.assertEqual(sent[2][1], [b"inline-tools-2026-09-15," + BINDING_BETA.encode()])
        self.assertNotIn("thinking", sent[3][0])
        self.assertEqual(sent[3][1], [b"inline-tools-2026-09-15"])
        await self.dump_files(1)
        await sleep(0.3)
        self.assertEqual(len(glob.glob(os.path.join(self.dumps, "*", "*.json"))), 1)

    async def test_streamed(self):
        """A streaming request recovered: the client gets the stream of the second answer, whole."""
        self.start()
        self.upstream_.script(error_answer(400, "invalid_request_error", BOUND))
        response, answer = await self.post(dict(edited(), stream=True))
        self.assertEqual(response.code, 200, answer)
        self.assertEqual(response.headers.getRawHeaders(b"content-type")[0].split(b";")[0], b"text/event-stream")
        self.assertIn(b"event: message_stop", answer)
        self.assertIn("block_binding", self.sent()[-1][0]["thinking"])
