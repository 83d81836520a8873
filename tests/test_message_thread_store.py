"""
Tests for :mod:`twisted_relay.message_threads.store`: the continue rules on both
stores, the memory store's time to live and bounds on a ``Clock``, and the
Redis store on a real ``redis-server`` (started here on 127.0.0.1), stopped
in the middle of use.
"""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer, reactor, task
from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase

from tests.redis_server import SKIP_REASON, RedisServer
from twisted_relay.message_threads.model import ThreadError
from twisted_relay.message_threads.store import (
    MemoryThreadStore,
    RedisThreadStore,
    thread_store_for,
)
from twisted_relay.metrics import RelayMetrics


def code_of(failure_or_error) -> str:
    error = getattr(failure_or_error, "value", failure_or_error)
    assert isinstance(error, ThreadError), error
    return error.error_code


def begin_now(store, key):
    """A memory store's begin, whose Deferred has fired: the bytes, or the error code."""
    result = []
    store.begin(key).addBoth(result.append)
    value = result[0]
    return value if isinstance(value, bytes) else code_of(value)


class RulesMixin:
    """The continue rules, the same on every store. ``self.store`` is fresh."""

    @defer.inlineCallbacks
    def outcome(self, d):
        try:
            value = yield d
        except ThreadError as error:
            return error.error_code
        return value

    @defer.inlineCallbacks
    def test_create_then_continue(self):
        """A created thread is found by its answer id; its continue's answer is found next."""
        yield self.store.commit("msg_1", b"conversation one")
        self.assertEqual((yield self.outcome(self.store.begin("msg_1"))), b"conversation one")
        yield self.store.commit("msg_2", b"conversation two", "msg_1")
        self.assertEqual((yield self.outcome(self.store.begin("msg_2"))), b"conversation two")
        self.assertEqual(self.store.hits, 2)

    @defer.inlineCallbacks
    def test_unknown(self):
        """An answer never stored is thread_not_found, counted as a miss."""
        self.assertEqual((yield self.outcome(self.store.begin("msg_unknown"))), "thread_not_found")
        self.assertEqual(self.store.misses, 1)

    @defer.inlineCallbacks
    def test_second_continue(self):
        """Continuing again from an answer already continued is thread_already_continued."""
        yield self.store.commit("msg_1", b"one")
        yield self.store.begin("msg_1")
        yield self.store.commit("msg_2", b"two", "msg_1")
        self.assertEqual((yield self.outcome(self.store.begin("msg_1"))), "thread_already_continued")

    @defer.inlineCallbacks
    def test_concurrent_continue(self):
        """A continue while another from the same answer is in flight is thread_continue_in_flight."""
        yield self.store.commit("msg_1", b"one")
        yield self.store.begin("msg_1")
        self.assertEqual((yield self.outcome(self.store.begin("msg_1"))), "thread_continue_in_flight")

    @defer.inlineCallbacks
    def test_failed_answer_does_not_advance(self):
        """A continue whose answer failed (abort) leaves the thread where it was: it can be continued."""
        yield self.store.commit("msg_1", b"one")
        yield self.store.begin("msg_1")
        yield self.store.abort("msg_1")
        self.assertEqual((yield self.outcome(self.store.begin("msg_1"))), b"one")

    @defer.inlineCallbacks
    def test_recreate_under_same_id(self):
        """A create whose answer has an id already held replaces what was held."""
        yield self.store.commit("msg_1", b"old")
        yield self.store.commit("msg_1", b"new")
        self.assertEqual((yield self.outcome(self.store.begin("msg_1"))), b"new")

    @defer.inlineCallbacks
    def test_recreate_after_continued(self):
        """A create whose answer has the id of an answer continued before can be continued again."""
        yield self.store.commit("msg_1", b"one")
        yield self.store.begin("msg_1")
        yield self.store.commit("msg_2", b"two", "msg_1")
        yield self.store.commit("msg_1", b"again")
        self.assertEqual((yield self.outcome(self.store.begin("msg_1"))), b"again")

    @defer.inlineCallbacks
    def test_answer_under_its_previous_id(self):
        """An answer that has the id of the answer it continued is kept and free to continue."""
        yield self.store.commit("msg_1", b"one")
        yield self.store.begin("msg_1")
        yield self.store.commit("msg_1", b"two", "msg_1")
        self.assertEqual((yield self.outcome(self.store.begin("msg_1"))), b"two")

    @defer.inlineCallbacks
    def test_binary_and_unicode(self):
        """Any bytes are kept as they are, under any id."""
        data = "é 東京 \U0001f527".encode() + bytes(range(256))
        yield self.store.commit("msg_é\u6771", data)
        self.assertEqual((yield self.outcome(self.store.begin("msg_é\u6771"))), data)


class MemoryRulesTests(RulesMixin, TestCase):
    def setUp(self):
        self.clock = Clock()
        self.store = MemoryThreadStore(self.clock)


class MemoryStoreTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()

    def begin(self, store, key):
        return begin_now(store, key)

    def test_ttl_after_last_use(self):
        """A thread lives ttl seconds after its last use: a continue renews it; then it expires."""
        store = MemoryThreadStore(self.clock, ttl=300)
        store.commit("msg_1", b"one")
        self.clock.advance(299)
        self.assertEqual(self.begin(store, "msg_1"), b"one")
        store.abort("msg_1")
        self.clock.advance(299)
        self.assertEqual(self.begin(store, "msg_1"), b"one")
        store.abort("msg_1")
        self.clock.advance(300)
        self.assertEqual(self.begin(store, "msg_1"), "thread_not_found")
        self.assertEqual(store.expirations, 1)
        self.assertEqual(store.size(), (0, 0))

    def test_no_ttl(self):
        """Without a time to live a thread stays until evicted."""
        store = MemoryThreadStore(self.clock, ttl=None)
        store.commit("msg_1", b"one")
        self.clock.advance(10**7)
        self.assertEqual(self.begin(store, "msg_1"), b"one")

    def test_count_bound_evicts_least_recently_used(self):
        """Past max_threads, the least recently used thread goes first (a continue counts as use)."""
        store = MemoryThreadStore(self.clock, max_threads=2)
        store.commit("msg_a", b"a")
        self.clock.advance(1)
        store.commit("msg_b", b"b")
        self.clock.advance(1)
        self.assertEqual(self.begin(store, "msg_a"), b"a")
        store.abort("msg_a")
        store.commit("msg_c", b"c")
        self.assertEqual(self.begin(store, "msg_b"), "thread_not_found")
        self.assertEqual(self.begin(store, "msg_a"), b"a")
        self.assertEqual(store.evictions, 1)
        self.assertEqual(store.size()[0], 2)

    def test_byte_bound(self):
        """Past max_bytes, threads are evicted oldest first; one larger than the bound is not kept."""
        store = MemoryThreadStore(self.clock, max_bytes=100)
        store.commit("msg_a", b"x" * 40)
        store.commit("msg_b", b"y" * 40)
        self.assertEqual(store.size(), (2, 90))
        store.commit("msg_c", b"z" * 40)
        self.assertEqual(store.size(), (2, 90))
        self.assertEqual(self.begin(store, "msg_a"), "thread_not_found")
        store.commit("msg_huge", b"h" * 200)
        self.assertEqual(self.begin(store, "msg_huge"), "thread_not_found")
        self.assertEqual(store.evictions, 2)

    def test_continued_answer_is_dropped(self):
        """Once continued, an answer's conversation is dropped: a long thread holds one conversation."""
        store = MemoryThreadStore(self.clock)
        store.commit("msg_0", b"c" * 10)
        for turn in range(1, 50):
            previous = f"msg_{turn - 1}"
            self.assertEqual(self.begin(store, previous), b"c" * (10 * turn))
            store.commit(f"msg_{turn}", b"c" * (10 * (turn + 1)), previous)
        self.assertEqual(store.size(), (1, 500 + len("msg_49")))

    def test_continued_markers_expire(self):
        """The mark of a continued answer lives as long as a thread; after it, the answer is not found."""
        store = MemoryThreadStore(self.clock, ttl=300)
        store.commit("msg_1", b"one")
        store.begin("msg_1")
        store.commit("msg_2", b"two", "msg_1")
        self.clock.advance(200)
        self.assertEqual(self.begin(store, "msg_1"), "thread_already_continued")
        self.clock.advance(200)
        self.assertEqual(self.begin(store, "msg_1"), "thread_not_found")

    def test_lease_expires(self):
        """A continue that never ended (a lost request) stops blocking the thread after the lease."""
        store = MemoryThreadStore(self.clock, ttl=None, lease=60)
        store.commit("msg_1", b"one")
        store.begin("msg_1")
        self.clock.advance(59)
        self.assertEqual(self.begin(store, "msg_1"), "thread_continue_in_flight")
        self.clock.advance(2)
        self.assertEqual(self.begin(store, "msg_1"), b"one")

    def test_metrics(self):
        """The relay's metrics export the store's hits, misses, evictions and size."""
        store = MemoryThreadStore(self.clock, max_threads=1)
        metrics = RelayMetrics()
        metrics.watch_thread_store(store)
        store.commit("msg_a", b"aaaa")
        store.commit("msg_b", b"bbbb")
        self.begin(store, "msg_b")
        self.begin(store, "msg_a")
        sample = metrics.registry.get_sample_value
        self.assertEqual(sample("relay_thread_lookups_total", {"outcome": "hit"}), 1)
        self.assertEqual(sample("relay_thread_lookups_total", {"outcome": "miss"}), 1)
        self.assertEqual(sample("relay_thread_evictions_total", {"reason": "bound"}), 1)
        self.assertEqual(sample("relay_threads_held", {}), 1)
        self.assertEqual(sample("relay_thread_bytes_held", {}), 4 + len("msg_b"))

    def test_thread_store_for(self):
        """--thread-store takes memory or a redis:// URL, and nothing else."""
        self.assertIsInstance(thread_store_for("memory", self.clock), MemoryThreadStore)
        for bad in ("redis:", "http://x", "redis:///0", "redis://h/db"):
            self.assertRaises(ValueError, thread_store_for, bad, self.clock)


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["create", "begin", "continue", "abort", "advance"]),
        st.integers(0, 7),
        st.integers(0, 7),
        st.integers(0, 60),
    ),
    max_size=60,
)


class MemoryStorePropertyTests(SynchronousTestCase):
    @settings(max_examples=300, deadline=None)
    @given(operations=OPERATIONS, max_threads=st.integers(1, 5), max_bytes=st.integers(8, 120))
    def test_bounds_and_contents(self, operations, max_threads, max_bytes):
        """Whatever happens, the store stays within its bounds, hands out only the bytes last
        committed under an id, never hands out an answer that was continued since, and a commit
        is found right after (when it fits)."""
        clock = Clock()
        store = MemoryThreadStore(clock, ttl=100, max_threads=max_threads, max_bytes=max_bytes)
        latest, continued, serial = {}, set(), 0
        for op, a, b, amount in operations:
            key, other = f"m{a}", f"m{b}"
            if op == "create":
                serial += 1
                data = b"d%d" % serial * (amount // 8 + 1)
                store.commit(key, data)
                latest[key] = data
                continued.discard(key)
                if len(data) + len(key) <= max_bytes:
                    self.assertEqual(begin_now(store, key), data)
                    store.abort(key)
            elif op in ("begin", "continue"):
                got = begin_now(store, key)
                if isinstance(got, bytes):
                    self.assertEqual(got, latest[key])
                    self.assertNotIn(key, continued)
                    if op == "continue" and other != key:
                        serial += 1
                        data = b"c%d" % serial
                        store.commit(other, data, key)
                        latest[other] = data
                        continued.discard(other)
                        continued.add(key)
                    else:
                        store.abort(key)
                else:
                    self.assertIn(got, ("thread_not_found", "thread_already_continued"))
            elif op == "abort":
                store.abort(key)
            else:
                clock.advance(amount)
            threads, held = store.size()
            self.assertLessEqual(threads, max_threads)
            self.assertLessEqual(held, max_bytes)


class RedisRulesTests(RulesMixin, TestCase):
    skip = SKIP_REASON

    def setUp(self):
        self.server = RedisServer()
        self.server.start()
        self.addCleanup(self.server.stop)
        self.store = thread_store_for(self.server.url, reactor, ttl=300)
        self.addCleanup(self.store.close)


class RedisStoreTests(TestCase):
    skip = SKIP_REASON

    def setUp(self):
        self.server = RedisServer()
        self.server.start()
        self.addCleanup(self.server.stop)
        self.events = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def store(self, **options):
        store = RedisThreadStore.from_url(self.server.url, reactor, **options)
        self.addCleanup(store.close)
        return store

    @defer.inlineCallbacks
    def outcome(self, d):
        try:
            return (yield d)
        except ThreadError as error:
            return error.error_code

    @defer.inlineCallbacks
    def test_shared_between_stores(self):
        """Two relays (two connections) on one Redis share threads and the continue rules."""
        one, two = self.store(), self.store()
        yield one.commit("msg_1", b"one")
        self.assertEqual((yield self.outcome(two.begin("msg_1"))), b"one")
        self.assertEqual((yield self.outcome(one.begin("msg_1"))), "thread_continue_in_flight")
        yield two.commit("msg_2", b"two", "msg_1")
        self.assertEqual((yield self.outcome(one.begin("msg_1"))), "thread_already_continued")
        self.assertEqual((yield self.outcome(one.begin("msg_2"))), b"two")

    @defer.inlineCallbacks
    def test_entries_expire(self):
        """Threads have a time to live in Redis itself."""
        store = self.store(ttl=0.2)
        yield store.commit("msg_1", b"one")
        yield task.deferLater(reactor, 0.5, lambda: None)
        self.assertEqual((yield self.outcome(store.begin("msg_1"))), "thread_not_found")

    @defer.inlineCallbacks
    def test_stopped_mid_use(self):
        """A Redis that stops makes continues answer thread_not_found quickly, commits fail quietly,
        the failures are counted and logged without any key; when it is back, the store works again."""
        store = self.store(command_timeout=1.0)
        secret_id = "msg_SECRET_ID_never_logged"
        yield store.commit(secret_id, b"one")
        self.server.stop()
        started = time.monotonic()
        self.assertEqual((yield self.outcome(store.begin(secret_id))), "thread_not_found")
        yield store.commit("msg_SECRET_2", b"two", secret_id)
        yield store.abort(secret_id)
        self.assertLess(time.monotonic() - started, 5)
        self.assertGreaterEqual(store.failures, 3)
        self.assertEqual(store.misses, 1)
        logged = repr(self.events)
        self.assertIn("The thread store failed", logged)
        self.assertNotIn("SECRET", logged)
        # Back, empty (no persistence): the store reconnects by itself.
        self.server.start()
        deadline = time.monotonic() + 20
        while True:
            yield store.commit("msg_3", b"three")
            if (yield self.outcome(store.begin("msg_3"))) == b"three":
                break
            self.assertLess(time.monotonic(), deadline, "the store did not reconnect")
            yield task.deferLater(reactor, 0.2, lambda: None)

    @defer.inlineCallbacks
    def test_down_from_the_start(self):
        """A relay whose Redis is not there answers not found and keeps going."""
        self.server.stop()
        store = self.store(command_timeout=0.5)
        self.assertEqual((yield self.outcome(store.begin("msg_1"))), "thread_not_found")
        yield store.commit("msg_1", b"one")
        self.assertIsNone(store.size())
