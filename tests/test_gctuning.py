"""
Tests for the relay's garbage collector tuning.
"""

import gc
import sys
import weakref

from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.config import RelayConfig
from twisted_relay.gctuning import GarbageCollectorTuning
from twisted_relay.service import Relay
from twisted_relay.tap import Options, makeService


class _Heap:
    """A heap size the test sets (memory blocks)."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self) -> int:
        return self.size


class _FullCollections:
    """Counts the collector's full collections while a test runs."""

    def __init__(self, case: SynchronousTestCase):
        self.count = 0
        gc.callbacks.append(self._callback)
        case.addCleanup(gc.callbacks.remove, self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            self.count += 1


class _Node:
    """An object that can be part of a reference cycle and be watched by a weak reference."""

    partner = None


class GarbageCollectorTuningTests(SynchronousTestCase):
    """
    While the relay runs, what existed at its start is frozen, and a full
    collection runs when the heap has grown, not when objects have merely
    lived long; when it stops, the process is as it was.
    """

    def setUp(self):
        self.before = gc.get_threshold()
        self.addCleanup(gc.set_threshold, *self.before)
        self.addCleanup(gc.unfreeze)
        self.clock = Clock()

    def start(self, heap) -> GarbageCollectorTuning:
        tuning = GarbageCollectorTuning(self.clock, heap=heap)
        tuning.startService()
        self.addCleanup(lambda: tuning.running and tuning.stopService())
        return tuning

    def test_start_and_stop(self):
        tuning = self.start(_Heap(1000))
        # This test's own objects existed at the start: frozen.
        self.assertGreater(gc.get_freeze_count(), 1000)
        # The young generations are collected as Python sets it.
        self.assertEqual(gc.get_threshold()[:2], self.before[:2])
        tuning.stopService()
        self.assertEqual(gc.get_threshold(), self.before)
        self.assertEqual(gc.get_freeze_count(), 0)
        # Nothing is measured any more.
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stop_without_start(self):
        """
        Stopping a tuning that never started changes nothing.
        """
        GarbageCollectorTuning(self.clock).stopService()
        self.assertEqual(gc.get_threshold(), self.before)

    def test_survivors_start_no_full_collection(self):
        """
        Objects that live long (a stream's, for as long as it lasts) do not
        by themselves start a full collection: with Python's own rule,
        promoting this many survivors into the oldest generation would start
        several.
        """
        self.start(_Heap(1000))
        full = _FullCollections(self)
        kept = []
        for _ in range(30):
            kept.append([[n] for n in range(5000)])
            # What the collector does on its own after every 7,000 or so
            # allocations: the young generations, survivors moved on.
            gc.collect(1)
            # The allocations themselves give Python its own occasions.
            kept.append([{} for _ in range(2000)])
        self.assertEqual(full.count, 0)

    def test_full_collection_when_the_heap_has_grown(self):
        """
        Once a second the heap is measured; past twice its size after the last
        full collection, and three times its size at start, a full
        collection runs, and the next one waits for the heap to double again.
        """
        heap = _Heap(1000)
        tuning = self.start(heap)
        full = _FullCollections(self)
        # Three times the start first.
        self.assertEqual(tuning.limit, 3000)
        heap.size = 3000
        self.clock.advance(tuning.interval)
        self.assertEqual((full.count, tuning.collections), (0, 0))
        heap.size = 3001
        self.clock.advance(tuning.interval / 2)
        self.assertEqual(full.count, 0)
        self.clock.advance(tuning.interval / 2)
        self.assertEqual((full.count, tuning.collections), (1, 1))
        # What was alive after it (here, as much as before) sets the next limit.
        self.assertEqual(tuning.limit, 6002)
        heap.size = 6000
        self.clock.advance(tuning.interval * 10)
        self.assertEqual(full.count, 1)
        heap.size = 7000
        self.clock.advance(tuning.interval)
        self.assertEqual(full.count, 2)
        # After a collection that freed much, the start's floor holds.
        heap.size = 1500
        self.clock.advance(tuning.interval)
        heap.size = 14001
        self.clock.advance(tuning.interval)
        self.assertEqual(full.count, 3)
        self.assertEqual(tuning.limit, 28002)
        heap.size = 1000
        tuning.check()
        self.assertEqual(full.count, 3)

    def test_old_garbage_does_not_pile_up(self):
        """
        Reference cycles that die after reaching the oldest generation, which
        young collections never free, are freed once the heap has grown
        enough: memory cannot pile up past the limit. (The real heap, the
        real collector.)
        """
        tuning = self.start(sys.getallocatedblocks)
        cycles = []
        for _ in range(1000):
            a, b = _Node(), _Node()
            a.partner, b.partner = b, a
            cycles.append(a)
        watched = weakref.ref(cycles[-1])
        # Survivors of young collections: in the oldest generation.
        gc.collect(1)
        gc.collect(1)
        del cycles, a, b
        gc.collect(1)
        self.assertIsNotNone(watched(), "a young collection freed old garbage")
        self.clock.advance(tuning.interval)
        self.assertIsNotNone(watched(), "a full collection ran before the heap had grown")
        # The heap grows past the limit (live objects, say).
        grown = [object() for _ in range(int(tuning.limit - sys.getallocatedblocks()) + 100_000)]
        self.clock.advance(tuning.interval)
        self.assertIsNone(watched())
        self.assertEqual(tuning.collections, 1)
        del grown

    def test_twistd_relay_tunes(self):
        """
        ``twistd relay`` runs the tuning as part of its service; with
        ``--no-gc-tuning`` it does not.
        """
        options = Options()
        options.parseOptions(["--listen", "tcp:0:interface=127.0.0.1", "--no-dumps"])
        service = makeService(options, MemoryReactorClock())
        self.assertEqual(sum(isinstance(s, GarbageCollectorTuning) for s in service), 1)

        options = Options()
        options.parseOptions(["--listen", "tcp:0:interface=127.0.0.1", "--no-dumps", "--no-gc-tuning"])
        service = makeService(options, MemoryReactorClock())
        self.assertFalse(any(isinstance(s, GarbageCollectorTuning) for s in service))

    def test_embedded_relay_leaves_the_process_alone(self):
        """
        An application that builds the relay from a plain ``RelayConfig``
        keeps its own garbage collector settings.
        """
        relay = Relay(RelayConfig(listen=(), dump_dir=None), MemoryReactorClock())
        self.assertFalse(any(isinstance(s, GarbageCollectorTuning) for s in relay.service))
