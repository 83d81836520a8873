"""
End to end with the official Python SDK's default tool runner (threads on):
200 turns through the relay, on real 127.0.0.1 sockets, in front of a
strict simulated upstream that reuses ids and ignores or rejects the
``thread`` field, and in front of a stateful one that knows threads and
reuses ids. Zero failed turns, no tool-use id seen twice, every continue
found its thread; the same sessions straight to those upstreams fail.
"""

from __future__ import annotations

from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase
from twisted.web.server import Site

from bench.threads_today import UPSTREAM_IDS, tool_runner_session
from twisted_relay.config import RelayConfig, one_upstream
from twisted_relay.service import Relay
from twisted_relay.simulated import SimulatedUpstream

from tests import redis_server
from tests.helpers import serve_relay

TURNS = 200


class ToolRunnerThreadTests(TestCase):
    """The SDK's tool runner keeps one thread for 200 turns through the relay."""

    timeout = 120

    def relay(self, upstream: str, mode: str, relay_threads: str) -> tuple[str, Relay]:
        config = RelayConfig(
            listen=(), upstreams=one_upstream(upstream, ids=UPSTREAM_IDS[mode]), dump_dir=None, threads=relay_threads
        )
        served = serve_relay(self, config, reactor)
        return served.url, served.relay

    async def through_relay(self, mode: str, threads: str, relay_threads: str = "relay") -> None:
        simulated = SimulatedUpstream(mode=mode, threads=threads, seed=1, reactor=reactor)
        port = reactor.listenTCP(0, Site(simulated.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        base, relay = self.relay("http://127.0.0.1:%d" % (port.getHost().port,), mode, relay_threads)
        result = await deferToThread(tool_runner_session, base, TURNS)
        self.assertEqual(result, {"completed": TURNS, "error": None, "duplicates": 0})
        store = relay.app.threads.store
        # Every turn after the first was a continue the relay found: no replay.
        self.assertEqual((store.hits, store.misses), (TURNS - 1, 0))
        if relay_threads == "upstream":
            # Every continue was passed on, and found its thread upstream.
            self.assertEqual(simulated.threads.store.hits, TURNS - 1)

    async def test_strict_ignoring_threads(self):
        """A strict upstream that ignores ``thread`` gets whole requests: 200 turns, no duplicate id."""
        await self.through_relay("strict", "ignore")

    async def test_strict_rejecting_threads(self):
        """A strict upstream that refuses ``thread`` never sees it: 200 turns, no duplicate id."""
        await self.through_relay("strict", "rejects")

    async def test_stateful_knowing_threads(self):
        """A stateful upstream that knows threads and reuses ids: 200 turns, no duplicate id."""
        await self.through_relay("stateful", "knows")

    async def test_stateful_threads_passed_through(self):
        """``--threads upstream``: the same upstream keeps the thread itself; 200 turns, no duplicate id."""
        await self.through_relay("stateful", "knows", "upstream")


class DirectFailureTests(TestCase):
    """Without the relay the same sessions fail: what the relay's threads are for."""

    timeout = 60

    async def direct(self, mode: str, threads: str, turns: int) -> dict:
        simulated = SimulatedUpstream(mode=mode, threads=threads, seed=1, reactor=reactor)
        port = reactor.listenTCP(0, Site(simulated.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return await deferToThread(tool_runner_session, "http://127.0.0.1:%d" % (port.getHost().port,), turns)

    async def test_strict_ignoring(self):
        """The continue reaches the upstream without its history: refused at turn 2."""
        result = await self.direct("strict", "ignore", 10)
        self.assertEqual(result["completed"], 1)
        self.assertIn("unexpected `tool_use_id`", result["error"])

    async def test_strict_rejecting(self):
        """The ``thread`` field itself is refused at turn 1."""
        result = await self.direct("strict", "rejects", 10)
        self.assertEqual(result["completed"], 0)
        self.assertIn("thread: Extra inputs are not permitted", result["error"])

    async def test_stateful_knowing(self):
        """The session goes on but the client sees reused ids."""
        result = await self.direct("stateful", "knows", 30)
        self.assertEqual(result["completed"], 30)
        self.assertGreater(result["duplicates"], 0)


class StoreDownTests(TestCase):
    """A Redis thread store that stops answering: continues are not found, nothing else stops."""

    timeout = 30

    if redis_server.SKIP_REASON is not None:
        skip = redis_server.SKIP_REASON

    async def test_nothing_listens(self):
        """
        With nothing listening any more at the store's address (Redis
        answered when the relay started, as its start check asks, then
        stopped), a continue answers 404 ``thread_not_found`` (the client
        replays), while a create and a plain request are answered as usual.
        """
        import json

        import treq

        from tests.helpers import messages_body

        simulated = SimulatedUpstream(mode="strict", seed=1, reactor=reactor)
        port = reactor.listenTCP(0, Site(simulated.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        redis = redis_server.RedisServer()
        redis.start()
        self.addCleanup(redis.stop)
        config = RelayConfig(
            listen=(), upstreams=one_upstream("http://127.0.0.1:%d" % (port.getHost().port,)), dump_dir=None,
            thread_store=redis.url,
        )
        served = serve_relay(self, config, reactor)
        relay = served.relay
        redis.stop()
        url = served.url + "/v1/messages"

        async def post(body):
            response = await treq.post(
                url, json=body, headers={"x-api-key": ["sk-test"]}, persistent=False
            )
            return response.code, json.loads(await response.content())

        code, created = await post(messages_body(thread={"type": "create"}))
        self.assertEqual(code, 200, created)
        code, plain = await post(messages_body())
        self.assertEqual(code, 200, plain)
        code, error = await post(
            messages_body(tools=False, thread={"type": "continue", "previous_message_id": created["id"]})
        )
        self.assertEqual(code, 404, error)
        self.assertEqual(error["error"]["details"], {"error_code": "thread_not_found"})
        self.assertGreater(relay.app.threads.store.failures, 0)
