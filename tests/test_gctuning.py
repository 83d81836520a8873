"""
Tests for the relay's garbage collector tuning.
"""

import gc

from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.config import RelayConfig
from twisted_relay.gctuning import GarbageCollectorTuning
from twisted_relay.service import Relay
from twisted_relay.tap import Options, makeService


class GarbageCollectorTuningTests(SynchronousTestCase):
    """
    While the relay runs, what existed at its start is frozen; when it
    stops, the process is as it was.
    """

    def setUp(self):
        self.before = gc.get_threshold()
        self.addCleanup(gc.set_threshold, *self.before)
        self.addCleanup(gc.unfreeze)

    def test_start_and_stop(self):
        tuning = GarbageCollectorTuning()
        tuning.startService()
        try:
            # How often the collector runs is Python's to say.
            self.assertEqual(gc.get_threshold(), self.before)
            # This test's own objects existed at the start: frozen.
            self.assertGreater(gc.get_freeze_count(), 1000)
        finally:
            tuning.stopService()
        self.assertEqual(gc.get_threshold(), self.before)
        self.assertEqual(gc.get_freeze_count(), 0)

    def test_stop_without_start(self):
        """
        Stopping a tuning that never started changes nothing.
        """
        GarbageCollectorTuning().stopService()
        self.assertEqual(gc.get_threshold(), self.before)

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
