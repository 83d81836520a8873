"""
Threads shared by ``twistd relay --workers 2`` through a real
``redis-server`` (started by the test on a free 127.0.0.1 port): the SDK's
default tool runner, one connection per request so that both workers take
turns, runs 200 turns with every continue found; with the store stopped
mid-session the client replays and no turn is lost.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from bench.threads_today import tool_runner_session
from tests.helpers import free_port, start_twistd
from tests.redis_server import SKIP_REASON, RedisServer

TURNS = 200


class WorkersRedisThreadTests(SynchronousTestCase):
    """Two relay processes, one Redis thread store."""

    def setUp(self):
        if SKIP_REASON is not None:
            raise SkipTest(SKIP_REASON)
        self.redis = RedisServer()
        self.redis.start()
        self.addCleanup(self.redis.stop)
        self.port = free_port()

    def start_relay(self, *options: str) -> None:
        start_twistd(
            self,
            "-n", "--pidfile=", "relay", "--workers", "2", "--no-dumps",
            "--thread-store", self.redis.url,
            "--listen", "tcp:%d:interface=127.0.0.1" % (self.port,),
            *options,
        )
        seen: set[int] = set()
        deadline = time.monotonic() + 30
        while len(seen) < 2 and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/health" % (self.port,), timeout=5) as r:
                    seen.add(json.loads(r.read())["pid"])
            except OSError:
                time.sleep(0.05)
        self.assertEqual(len(seen), 2, "both workers answer")

    def lookups(self) -> dict[str, float]:
        """The relay's thread lookups by outcome, summed over the workers (copied every second)."""
        time.sleep(1.5)
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % (self.port,), timeout=5) as r:
            text = r.read().decode()
        found = dict(re.findall(r'relay_thread_lookups_total\{outcome="(\w+)"\} ([0-9.e+]+)', text))
        failures = re.search(r"relay_thread_store_failures_total ([0-9.e+]+)", text)
        return {
            "hit": float(found.get("hit", 0)),
            "miss": float(found.get("miss", 0)),
            "failures": float(failures.group(1)) if failures else 0.0,
        }

    def session(self, **options) -> None:
        result = tool_runner_session(
            "http://127.0.0.1:%d" % (self.port,), TURNS, fresh_connections=True, **options
        )
        self.assertEqual(result, {"completed": TURNS, "error": None, "duplicates": 0})

    def test_strict_upstream(self):
        """A strict upstream ignoring threads: 200 turns over both workers, every continue found."""
        self.start_relay("--simulate", "strict", "--simulate-threads", "ignore")
        self.session()
        self.assertEqual(self.lookups(), {"hit": TURNS - 1, "miss": 0, "failures": 0})

    def test_stateful_upstream(self):
        """A stateful upstream knowing threads, reusing ids: 200 turns, no duplicate id."""
        self.start_relay(
            "--simulate", "stateful", "--simulate-threads", "knows", "--upstream-ids", "original"
        )
        self.session()
        self.assertEqual(self.lookups(), {"hit": TURNS - 1, "miss": 0, "failures": 0})

    def test_store_stopped_mid_session(self):
        """
        Redis stops at turn 100 and starts again (empty) two turns later:
        continues meanwhile answer ``thread_not_found``, the SDK replays the
        whole conversation, and every one of the 200 turns completes. (A
        thread lost twice in a row makes the SDK's tool runner go on without
        threads, whole history each turn, which the relay relays as any
        request.)
        """
        self.start_relay("--simulate", "strict", "--simulate-threads", "ignore")

        def on_turn(completed: int) -> None:
            if completed == 100:
                self.redis.stop()
            elif completed == 102:
                self.redis.start()

        self.session(on_turn=on_turn)
        lookups = self.lookups()
        self.assertGreater(lookups["miss"], 0)
        self.assertGreater(lookups["failures"], 0)
        # Every continue before the stop found its thread.
        self.assertGreaterEqual(lookups["hit"], 99)
