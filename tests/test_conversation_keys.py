"""
One account per conversation, end to end on 127.0.0.1: the relay in front
of a scripted upstream (:class:`tests.faulty_upstream.FaultyUpstream`) with
a pool of four keys in two accounts. 30 turns of one conversation keep one
key; two conversations spread over keys; after a 429 the conversation goes
to the other key of its account, and the move is logged and counted.
"""

from __future__ import annotations

import glob
import json
import os

import treq
import ujson
from twisted.trial.unittest import TestCase

from twisted_relay.affinity import conversation_of, key_digest, key_order
from twisted_relay.config import Upstream

from tests.faulty_upstream import error_answer
from tests.helpers import messages_body
from tests.test_failover import RelayOverUpstreams, sleep

KEYS = tuple("sk-ant-conversation-key-%d" % (i,) for i in range(4))
ACCOUNTS = ("team-a", "team-b", "team-a", "team-b")


def turn(first: str, turns: int) -> dict:
    """The request of a conversation begun with ``first``, ``turns`` tool turns in."""
    messages = [{"role": "user", "content": first}]
    for n in range(turns):
        messages.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_%02d" % (n,), "name": "get_weather", "input": {"city": "Paris"}},
        ]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_%02d" % (n,), "content": "sunny"},
        ]})
    return messages_body(messages)


def home_of(first: str) -> int:
    return key_order(conversation_of(turn(first, 0)), [key_digest(k) for k in KEYS], ACCOUNTS)[0]


class ConversationKeyTests(RelayOverUpstreams, TestCase):

    def setUp(self):
        self.upstream_, url = self.upstream()
        self.start_relay([Upstream("pool", url, keys=KEYS, accounts=ACCOUNTS)])

    def keys_sent(self) -> list[int]:
        return [KEYS.index(r.header(b"x-api-key")[0].decode()) for r in self.upstream_.received]

    async def test_thirty_turns_one_key(self):
        """30 turns of one conversation over a 4-key pool go to one key (today: 26 key switches)."""
        for n in range(30):
            response, _ = await self.post(turn("plan the migration", n))
            self.assertEqual(response.code, 200)
        self.assertEqual(self.keys_sent(), [home_of("plan the migration")] * 30)

    async def test_two_conversations_spread(self):
        """Two conversations with different homes, interleaved: each keeps its own key."""
        first = "conversation one"
        second = next(t for t in ("conversation %d" % (n,) for n in range(2, 50)) if home_of(t) != home_of(first))
        for n in range(5):
            await self.post(turn(first, n))
            await self.post(turn(second, n))
        self.assertEqual(self.keys_sent(), [home_of(first), home_of(second)] * 5)

    async def test_429_prefers_same_account(self):
        """A 429 on the conversation's key: the other key of its account answers; the move is counted."""
        first = "rate limited conversation"
        home = home_of(first)
        await self.post(turn(first, 0))
        self.upstream_.script(error_answer(429, "rate_limit_error", retry_after="20"))
        response, _ = await self.post(turn(first, 1))
        self.assertEqual(response.code, 200)
        sent = self.keys_sent()
        self.assertEqual(sent[:2], [home, home])
        self.assertNotEqual(sent[2], home)
        self.assertEqual(ACCOUNTS[sent[2]], ACCOUNTS[home])
        metrics = await (await treq.get(self.base + "/metrics", persistent=False)).text()
        self.assertIn('relay_conversation_moves_total{across="key",upstream="pool"} 1.0', metrics)
        for key in KEYS:
            self.assertNotIn(key, metrics)


class MovedDumpTests(RelayOverUpstreams, TestCase):
    async def test_dump_names_the_move(self):
        """A moved conversation's refused answer is dumped with the move among its attempts."""
        upstream, url = self.upstream()
        dumps = self.mktemp()
        self.start_relay([Upstream("pool", url, keys=KEYS, accounts=ACCOUNTS)], dump_dir=dumps)
        upstream.script(
            error_answer(429, "rate_limit_error", retry_after="20"),
            error_answer(400, "invalid_request_error", "messages.0: something else"),
        )
        response, _ = await self.post(turn("a moved conversation", 1))
        self.assertEqual(response.code, 400)
        for _ in range(100):
            found = glob.glob(os.path.join(dumps, "*", "*.json"))
            if found:
                break
            await sleep(0.05)
        with open(found[0]) as f:
            attempts = json.load(f)["attempts"]
        home = home_of("a moved conversation")
        self.assertEqual(attempts[0], "pool key #%d (429)" % (home + 1,))
        self.assertTrue(attempts[-1].startswith("conversation moved from pool key #%d to pool key #" % (home + 1,)))
        self.assertTrue(attempts[-1].endswith("(same account)"), attempts)


class UpstreamThreadKeyTests(RelayOverUpstreams, TestCase):
    """``--threads upstream``: a ``continue`` goes to the key that made the ``create``, and only to it."""

    async def test_continue_on_the_create_key(self):
        upstream, url = self.upstream()
        self.start_relay([Upstream("pool", url, keys=KEYS, accounts=ACCOUNTS)], threads="upstream")
        create = dict(turn("a threaded conversation", 0), thread={"type": "create"})
        response, answer = await self.post(create)
        self.assertEqual(response.code, 200, answer)
        previous = ujson.loads(answer)["id"]
        follow = {
            "model": "claude-sonnet-4-5", "max_tokens": 256,
            "thread": {"type": "continue", "previous_message_id": previous},
            "messages": [{"role": "user", "content": "and then?"}],
        }
        # A 429 on the thread's key goes to the client: another key's account holds no such thread.
        upstream.script(error_answer(429, "rate_limit_error", retry_after="20"))
        response, _ = await self.post(follow)
        self.assertEqual(response.code, 429)
        # The key rests; the continue still goes to it.
        response, answer = await self.post(follow)
        self.assertEqual(response.code, 200, answer)
        sent = [r.header(b"x-api-key")[0].decode() for r in upstream.received]
        self.assertEqual(len(sent), 3)
        self.assertEqual(set(sent), {KEYS[home_of("a threaded conversation")]})
        self.assertEqual(ujson.loads(upstream.received[2].body)["thread"]["type"], "continue")
