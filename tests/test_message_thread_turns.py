"""
Tests for :mod:`twisted_relay.message_threads.turns`: a thread request opened as the
plain request to send, and settled once its answer is known, on the memory
store with a ``Clock``.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.message_threads.model import ThreadError, upstream_thread_request
from twisted_relay.message_threads.store import MemoryThreadStore
from twisted_relay.message_threads.turns import ThreadKeeper, owner_of
from twisted_relay.simulated.model import encode_events, message_events, seeded_rng

TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}


def now(d):
    results = []
    d.addBoth(results.append)
    if isinstance(results[0], Failure):
        if results[0].check(ThreadError):
            return results[0].value.error_code or "malformed"
        results[0].raiseException()
    return results[0]


def message(msg_id, *content):
    return {"id": msg_id, "type": "message", "role": "assistant", "content": list(content),
            "stop_reason": "tool_use", "usage": {"input_tokens": 1, "output_tokens": 1}}


def create(*messages):
    return {"model": "m", "max_tokens": 9, "system": "s", "tools": TOOLS, "messages": list(messages),
            "thread": {"type": "create"}}


def cont(previous, *messages):
    return {"model": "m", "max_tokens": 9, "messages": list(messages),
            "thread": {"type": "continue", "previous_message_id": previous}}


class ThreadKeeperTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.store = MemoryThreadStore(self.clock)
        self.keeper = ThreadKeeper(self.store)

    def test_not_a_thread(self):
        """A request without a thread is left to the relay as it is."""
        self.assertIsNone(now(self.keeper.open({"model": "m", "messages": []})))

    def test_malformed(self):
        """A malformed thread field fails with the 400 to answer."""
        self.assertEqual(now(self.keeper.open({"thread": {"type": "fork"}})), "malformed")

    def test_create_then_continue(self):
        """A create is sent without its field; its continue is sent as the whole conversation."""
        turn = now(self.keeper.open(create({"role": "user", "content": "go"})))
        self.assertNotIn("thread", turn.request)
        self.assertIsNone(turn.previous_message_id)
        now(turn.answered(message("msg_1", CALL)))
        turn = now(self.keeper.open(cont("msg_1", RESULT)))
        self.assertEqual(turn.request, {
            "model": "m", "max_tokens": 9, "system": "s", "tools": TOOLS,
            "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": [CALL]}, RESULT],
        })
        self.assertEqual(turn.previous_message_id, "msg_1")

    def test_rules(self):
        """While a continue is open another is in flight; once answered, a second is already continued."""
        now(now(self.keeper.open(create())).answered(message("msg_1")))
        turn = now(self.keeper.open(cont("msg_1", RESULT)))
        self.assertEqual(now(self.keeper.open(cont("msg_1", RESULT))), "thread_continue_in_flight")
        now(turn.answered(message("msg_2")))
        self.assertEqual(now(self.keeper.open(cont("msg_1", RESULT))), "thread_already_continued")
        self.assertEqual(now(self.keeper.open(cont("msg_x", RESULT))), "thread_not_found")

    def test_failed_answer_does_not_advance(self):
        """A continue whose answer failed (or came without an id) can be sent again."""
        now(now(self.keeper.open(create())).answered(message("msg_1")))
        now(now(self.keeper.open(cont("msg_1", RESULT))).failed())
        now(now(self.keeper.open(cont("msg_1", RESULT))).answered({"type": "message"}))
        self.assertNotIsInstance(now(self.keeper.open(cont("msg_1", RESULT))), str)

    def test_settled_once(self):
        """A turn answered and then reported failed stays answered."""
        now(now(self.keeper.open(create())).answered(message("msg_1")))
        turn = now(self.keeper.open(cont("msg_1", RESULT)))
        now(turn.answered(message("msg_2")))
        now(turn.failed())
        self.assertNotIsInstance(now(self.keeper.open(cont("msg_2", RESULT))), str)

    def test_owners(self):
        """A thread is continued only by its owner; the owner is a digest, not the credential."""
        alice, bob = owner_of("sk-alice"), owner_of("sk-bob")
        self.assertEqual(alice, owner_of("sk-alice"))
        self.assertNotIn("alice", alice)
        self.assertEqual(owner_of(None), "")
        now(now(self.keeper.open(create(), alice)).answered(message("msg_1")))
        self.assertEqual(now(self.keeper.open(cont("msg_1", RESULT), bob)), "thread_not_found")
        self.assertEqual(now(self.keeper.open(cont("msg_1", RESULT))), "thread_not_found")
        self.assertNotIsInstance(now(self.keeper.open(cont("msg_1", RESULT), alice)), str)

    def test_corrupt_entry(self):
        """Bytes that are not a conversation are thread_not_found, and hold nothing."""
        now(self.store.commit("msg_1", b"garbage"))
        self.assertEqual(now(self.keeper.open(cont("msg_1"))), "thread_not_found")
        self.assertEqual(now(self.keeper.open(cont("msg_1"))), "thread_not_found")

    def test_changed_system_releases_the_thread(self):
        """A continue refused for a changed system leaves the thread free for a correct one."""
        now(now(self.keeper.open(create())).answered(message("msg_1")))
        self.assertEqual(now(self.keeper.open(dict(cont("msg_1"), system="other"))),
                         "thread_fingerprint_mismatch")
        self.assertNotIsInstance(now(self.keeper.open(cont("msg_1", RESULT))), str)

    def test_streamed_answer(self):
        """A stream recorded on its way to the client is kept once whole; a cut one is not."""
        answer = message("msg_s", {"type": "text", "text": "Zürich 東京"}, CALL)
        data, starts = encode_events(message_events(answer, seeded_rng(1)))
        now(now(self.keeper.open(create())).answered(message("msg_1")))
        turn = now(self.keeper.open(cont("msg_1", RESULT)))
        written = []
        write = turn.recording(written.append)
        write(data[: starts[-1]])
        now(turn.stream_ended(False))
        self.assertEqual(b"".join(written), data[: starts[-1]])
        turn = now(self.keeper.open(cont("msg_1", RESULT)))
        write = turn.recording(lambda _: None)
        for start in range(0, len(data), 50):
            write(data[start:start + 50])
        now(turn.stream_ended(True))
        again = now(self.keeper.open(cont("msg_s", {"role": "user", "content": "more"})))
        self.assertEqual(again.request["messages"][-2], {"role": "assistant", "content": answer["content"]})

    def test_stream_too_large(self):
        """A streamed answer past the keeper's limit is not kept (its continue is not found)."""
        keeper = ThreadKeeper(self.store, max_answer_bytes=100)
        data, _ = encode_events(message_events(message("msg_big", CALL), seeded_rng(2)))
        turn = now(keeper.open(create()))
        turn.recording(lambda _: None)(data)
        now(turn.stream_ended(True))
        self.assertEqual(now(keeper.open(cont("msg_big"))), "thread_not_found")


class WhatIsSentTests(SynchronousTestCase):
    """What a turn sends upstream: plain for an upstream without threads, the thread's tail for one with."""

    def turn(self, upstream_knows: bool):
        keeper = ThreadKeeper(MemoryThreadStore(Clock()), upstream_knows=upstream_knows)
        first = now(keeper.open(create({"role": "user", "content": "go"})))
        now(first.answered(message("msg_1", CALL)))
        return now(keeper.open(cont("msg_1", RESULT)))

    def test_plain(self):
        """Without threads upstream: no threads beta (other betas kept)."""
        from twisted.web.http_headers import Headers

        turn = self.turn(False)
        headers = turn.upstream_headers(Headers({b"anthropic-beta": [b"message-threads-2026-08-12,other-beta"]}))
        self.assertEqual(headers.getRawHeaders(b"anthropic-beta"), [b"other-beta"])
        alone = turn.upstream_headers(Headers({b"anthropic-beta": [b"message-threads-2026-08-12"]}))
        self.assertFalse(alone.hasHeader(b"anthropic-beta"))

    def test_passed_through(self):
        """
        To an upstream that knows threads: the continue's field and only its
        new messages (as translated: here, whatever the given body holds),
        without ``system`` and ``tools``; the beta kept.
        """
        import json

        from twisted.web.http_headers import Headers

        turn = self.turn(True)
        self.assertEqual(len(turn.request["messages"]), 3)
        translated = dict(turn.request, messages=turn.request["messages"][:2] + [{"role": "user", "content": "T"}])
        sent = json.loads(json.dumps(upstream_thread_request(translated, turn.previous_message_id, turn.new_messages)))
        self.assertEqual(sent["thread"], {"type": "continue", "previous_message_id": "msg_1"})
        self.assertEqual(sent["messages"], [{"role": "user", "content": "T"}])
        self.assertNotIn("tools", sent)
        self.assertNotIn("system", sent)
        headers = turn.upstream_headers(Headers({b"anthropic-beta": [b"message-threads-2026-08-12"]}))
        self.assertEqual(headers.getRawHeaders(b"anthropic-beta"), [b"message-threads-2026-08-12"])
