"""
The work on a request body, in the relay's process and in its worker
processes (:mod:`twisted_relay.body_work`, :mod:`twisted_relay.body_pool`):
both give the same bytes to send and the same translation; the translation
comes back from a worker in parts and works as the original; a worker that
dies or fails costs its request a 500, not the relay; and the relay's own
end-to-end tests, run again with every body sent to a worker, pass.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading

import ujson
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase

from tests import test_binding_recovery as binding_recovery
from tests import test_sdk as sdk
from tests import test_sdk_message_threads as sdk_threads
from tests.helpers import encode, messages_body
from twisted_relay._json import to_json
from twisted_relay import body_pool
from twisted_relay.body_pool import DIGESTED_ON_THREAD, BodyPool, BodyWorkError, RequestBody
from twisted_relay.body_work import (
    PROJECTED_FROM,
    BodyFacts,
    BodyShape,
    facts_of,
    prepare,
    prepare_in_worker,
    read_in_worker,
)
from twisted_relay.errors import RelayError
from twisted_relay.message_threads.model import Conversation, conversation_after, conversation_prefix
from twisted_relay.translation import RequestTranslation, UpstreamRules, translate_request


def colliding_body(turns: int = 30, **extra) -> dict:
    """A history whose upstream reused one id every turn: the relay repairs each repeat."""
    messages = [{"role": "user", "content": "go"}]
    for n in range(turns):
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": "step %d é" % (n,)},
            {"type": "tool_use", "id": "toolu_same", "name": "get_weather", "input": {"city": "Paris"}},
        ]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_same", "content": "sunny"},
        ]})
    return messages_body(messages, **extra)


class StepsTests(SynchronousTestCase):
    """The pure steps give what the request path gave before them."""

    def test_prepare_is_the_translation_serialised(self):
        """The bytes to send are the translated body's; the repairs are the translation's, counted."""
        body = colliding_body()
        raw = encode(body)
        prepared = prepare(ujson.loads(raw), raw, None, UpstreamRules(), None, False, repairs_shown=5)
        translation = translate_request(body, UpstreamRules())
        self.assertEqual(prepared.body, to_json(translation.upstream_body))
        self.assertEqual(prepared.repair_count, len(translation.repairs))
        self.assertEqual([e.upstream_id for e in prepared.repairs], [e.upstream_id for e in translation.repairs[:5]])
        self.assertTrue(prepared.droppable)
        self.assertIsNone(prepared.translation.upstream_body)

    def test_unchanged_body_sent_as_it_came(self):
        """A body the translation leaves alone is sent as the very bytes the client sent."""
        raw = encode(messages_body())
        self.assertIs(prepare(ujson.loads(raw), raw, None, UpstreamRules(), None, False).body, raw)

    def test_drop_block_applied_when_asked(self):
        """``drop_block`` asked for a body that may take it: sent with it, and not droppable again."""
        raw = encode(colliding_body(thinking={"type": "adaptive"}))
        prepared = prepare(ujson.loads(raw), raw, "other-model", UpstreamRules(), None, True)
        sent = ujson.loads(prepared.body)
        self.assertEqual(sent["thinking"]["block_binding"], {"prefix_mismatch_behavior": "drop_block"})
        self.assertEqual(sent["model"], "other-model")
        self.assertTrue(prepared.dropping)
        self.assertFalse(prepared.droppable)

    def test_translation_in_parts(self):
        """
        A translation taken apart (as a worker sends it) and put together
        again translates an answer as the original does, and has its table.
        """
        body = colliding_body()
        rules = UpstreamRules()
        original = translate_request(body, rules)
        head, parts = original.parts(size=7)
        self.assertGreater(len(parts), 10)
        again = RequestTranslation.assembled(rules, head)
        for part in parts:
            again.add_part(part)
        self.assertEqual(again.table.to_dict(), original.table.to_dict())
        answer = {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_same", "name": "get_weather", "input": {}},
            {"type": "tool_use", "id": "", "name": "get_weather", "input": {}},
        ]}
        mine, theirs = ujson.loads(ujson.dumps(answer)), ujson.loads(ujson.dumps(answer))
        original.response().translate_message(theirs)
        again.response().translate_message(mine)
        self.assertEqual(mine, theirs)
        self.assertNotEqual(mine["content"][0]["id"], "toolu_same")

    def test_worker_side(self):
        """What a worker sends back is the same as the steps give here."""
        body = colliding_body()
        raw = encode(body)
        facts = read_in_worker(raw)
        self.assertEqual(facts, facts_of(ujson.loads(raw)))
        self.assertEqual(read_in_worker(b"{nope")[0], 400)
        self.assertEqual(read_in_worker(b"[]"), (400, "Request body must be a JSON object."))
        sent, head, parts, repairs, count, can_drop, dropping, sha256 = prepare_in_worker(
            raw, None, tuple(UpstreamRules().to_dict().items()), None, False, 3, 50
        )
        here = prepare(ujson.loads(raw), raw, None, UpstreamRules(), None, False, 3)
        self.assertEqual(sent, here.body)
        self.assertEqual((len(repairs), count, can_drop, dropping), (3, here.repair_count, True, False))
        self.assertTrue(all(isinstance(part, bytes) for part in parts))
        self.assertIsNone(sha256)
        # Asked for (a SigV4 login), the SHA-256 of the bytes to send comes too.
        sent = prepare_in_worker(raw, None, tuple(UpstreamRules().to_dict().items()), None, False, 3, 50, None, True)
        self.assertEqual(sent[-1], hashlib.sha256(sent[0]).hexdigest())

    def test_digest_here_without_threads(self):
        """With a reactor that has no threads, a body made here is hashed here, large or not."""
        raw = encode(messages_body([{"role": "user", "content": "x" * (2 * DIGESTED_ON_THREAD)}]))
        request = RequestBody(BodyPool(Clock()), raw)
        self.successResultOf(request.read())
        prepared = self.successResultOf(request.prepare(None, UpstreamRules(), None, False, False, digest=True))
        self.assertEqual(prepared.body_sha256, hashlib.sha256(prepared.body).hexdigest())

    def test_conversation_bytes(self):
        """The prefix a turn keeps, and the answer after it, are the bytes the whole conversation encodes to."""
        answer = {"id": "msg_1", "content": [{"type": "text", "text": "fine, ☃ \U0001f600"}]}
        for request in (
            {"model": "m", "system": "be brief", "tools": [{"name": "t"}], "messages": [{"role": "user", "content": "hé"}]},
            {"model": "m", "messages": []},
            {"model": "m"},
        ):
            self.assertEqual(
                conversation_after(conversation_prefix(request), answer), Conversation.after(request, answer).encode()
            )

    def test_shape_counted_in_pieces(self):
        """A body's cost counted piece by piece is its cost counted whole; projected, before and as it comes."""
        raw = encode(colliding_body(3000))
        whole = BodyShape.of(raw)
        shape = BodyShape()
        self.assertEqual(shape.projected(len(raw)), 0)
        self.assertGreater(len(raw), 2 * PROJECTED_FROM)
        for at in range(0, len(raw), 1000):
            shape.add(raw[at:at + 1000])
            if shape.size >= PROJECTED_FROM:
                # The whole body's cost, projected from what came.
                self.assertGreater(shape.projected(len(raw)), 10 * len(raw))
            else:
                self.assertEqual(shape.projected(len(raw)), shape.cost())
        self.assertEqual(shape.cost(), whole.cost())
        self.assertEqual(shape.projected(len(raw)), whole.cost())
        # Tiny messages cost more than fourteen times their bytes; a long string about twice.
        self.assertGreater(whole.cost(), 10 * len(raw))
        text = encode(messages_body([{"role": "user", "content": "x" * 100_000}]))
        self.assertLess(BodyShape.of(text).cost(), 3 * len(text))


class PoolTests(TestCase):
    """Worker processes on the real reactor."""

    def pool(self, **options) -> BodyPool:
        pool = BodyPool(reactor, **options)
        self.addCleanup(pool.close)
        return pool

    async def test_read_and_prepare_in_a_worker(self):
        """A large body read and prepared in a worker gives what the steps give here."""
        pool = self.pool(inline_cost=0)
        body = colliding_body(200)
        raw = encode(body)
        request = RequestBody(pool, raw)
        self.assertFalse(request.inline)
        await request.read()
        self.assertEqual(request.head["model"], body["model"])
        self.assertEqual(request.facts.conversation, facts_of(body).conversation)
        rules = UpstreamRules()
        prepared = await request.prepare(None, rules, None, False, True)
        here = prepare(body, raw, None, rules, None, False, 20)
        self.assertEqual(prepared.body, here.body)
        self.assertEqual(prepared.translation.table.to_dict(), here.translation.table.to_dict())
        self.assertEqual(prepared.repair_count, here.repair_count)

    async def test_prepare_with_digest_in_a_worker(self):
        """A large body prepared in a worker comes back with the SHA-256 of its bytes when asked."""
        request = RequestBody(self.pool(inline_cost=0), encode(colliding_body(50)))
        await request.read()
        prepared = await request.prepare(None, UpstreamRules(), None, False, False, digest=True)
        self.assertEqual(prepared.body_sha256, hashlib.sha256(prepared.body).hexdigest())
        again = await request.prepare(None, UpstreamRules(), None, False, False)
        self.assertIsNone(again.body_sha256)

    async def test_digest_of_a_large_body_off_the_reactor(self):
        """
        A body made here (small in cost, large in bytes) from
        DIGESTED_ON_THREAD bytes on has its SHA-256 made on a thread, not on
        the reactor's; a smaller one here, at once.
        """
        hashed_on = []

        def noted(data):
            hashed_on.append(threading.current_thread() is threading.main_thread())
            return hashlib.sha256(data).hexdigest()

        self.patch(body_pool, "body_sha256", noted)
        pool = self.pool()
        for size, on_reactor in ((1000, True), (2 * DIGESTED_ON_THREAD, False)):
            request = RequestBody(pool, encode(messages_body([{"role": "user", "content": "x" * size}])))
            self.assertTrue(request.inline)
            await request.read()
            prepared = await request.prepare(None, UpstreamRules(), None, False, False, digest=True)
            self.assertEqual(prepared.body_sha256, hashlib.sha256(prepared.body).hexdigest())
            self.assertEqual(hashed_on, [on_reactor])
            del hashed_on[:]

    async def test_bad_body_is_a_400(self):
        """A body that is not JSON, read in a worker, is the relay's 400."""
        request = RequestBody(self.pool(inline_cost=0), b"{not json")
        error = await self.assertFailure(request.read(), RelayError)
        self.assertEqual(error.status, 400)

    async def test_failed_call_is_an_error(self):
        """A call that raises in the worker fails with its words; the worker takes the next call."""
        pool = self.pool()
        error = await self.assertFailure(pool.run("dropping", b"{not json"), BodyWorkError)
        self.assertIn("Unexpected character", str(error))
        self.assertIsInstance(await pool.run("read", encode(messages_body())), BodyFacts)

    async def test_worker_killed(self):
        """
        A worker killed in the middle of a call (as for its memory) fails
        that call with a 500; the next call starts another worker.
        """
        pool = self.pool()
        raw = encode(colliding_body(30_000))
        call = pool.run("prepare", raw, None, tuple(UpstreamRules().to_dict().items()), None, False, 0, 1000)
        for _ in range(200):
            if pool.worker_pids:
                break
            await deferLater(reactor, 0.01, lambda: None)
        os.kill(pool.worker_pids[0], signal.SIGKILL)
        error = await self.assertFailure(call, RelayError)
        self.assertEqual(error.status, 500)
        self.flushLoggedErrors()
        self.assertIsInstance(await pool.run("read", encode(messages_body())), BodyFacts)

    async def test_close(self):
        """Closing ends the workers; bodies are then worked on in this process, calls waiting fail."""
        pool = self.pool()
        await pool.run("read", encode(messages_body()))
        waiting = Deferred()
        pool.run("read", encode(messages_body())).addBoth(waiting.callback)
        await pool.close()
        self.assertEqual(pool.worker_pids, [])
        self.assertTrue(pool.inline(10**12))
        await waiting


def _to_workers(served):
    """Every body of this relay worked on in a worker process."""
    served.relay.app.bodies.inline_cost = -1
    return served


class WorkersLongSessionTests(sdk.LongSessionTests):
    """The long tool sessions of ``tests.test_sdk``, every body in a worker."""

    TURNS = 60

    def serve_relay(self, upstream_url: str, **settings) -> str:
        from tests.helpers import serve_relay
        from twisted_relay.config import RelayConfig, one_upstream

        config = RelayConfig(listen=(), upstreams=one_upstream(upstream_url), dump_dir=None).with_changes(**settings)
        return _to_workers(serve_relay(self, config, reactor)).url


class WorkersThreadTests(sdk_threads.ToolRunnerThreadTests):
    """The tool runner's threads of ``tests.test_sdk_message_threads``, every body and rebuild in a worker."""

    def relay(self, upstream: str, mode: str, relay_threads: str):
        base, relay = super().relay(upstream, mode, relay_threads)
        relay.app.bodies.inline_cost = -1
        return base, relay


class WorkersRecoveryTests(binding_recovery.RecoveryTests):
    """The ``drop_block`` recovery of ``tests.test_binding_recovery``, every body in a worker."""

    def start_relay(self, upstreams, routes=(), **settings) -> str:
        base = super().start_relay(upstreams, routes, **settings)
        self.relay.app.bodies.inline_cost = -1
        return base
