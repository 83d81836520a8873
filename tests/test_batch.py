"""Batch: calls that wait a moment, then run together."""

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.batch import Batch


class BatchTests(SynchronousTestCase):
    def test_runs_together_after_the_delay_in_order(self):
        """What is added within the delay runs together when it ends, in the order added, once."""
        clock, done = Clock(), []
        batch = Batch(clock, delay=0.05)
        batch.add(lambda: done.append(1))
        clock.advance(0.03)
        batch.add(lambda: done.append(2))
        self.assertEqual((done, batch.pending, len(clock.getDelayedCalls())), ([], 2, 1))
        clock.advance(0.02)
        self.assertEqual((done, batch.pending, clock.getDelayedCalls()), ([1, 2], 0, []))
        batch.add(lambda: done.append(3))
        clock.advance(0.05)
        self.assertEqual(done, [1, 2, 3])

    def test_run_now(self):
        """run() does what waits at once and leaves no call behind."""
        clock, done = Clock(), []
        batch = Batch(clock)
        batch.add(lambda: done.append(1))
        batch.run()
        self.assertEqual((done, clock.getDelayedCalls()), ([1], []))
        clock.advance(1)
        self.assertEqual(done, [1])

    def test_one_failing_call_does_not_stop_the_others(self):
        """A call that raises is logged; the calls after it still run."""
        clock, done = Clock(), []
        batch = Batch(clock)
        batch.add(lambda: 1 / 0)
        batch.add(lambda: done.append(2))
        clock.advance(1)
        self.assertEqual(done, [2])
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)

    def test_closed_runs_each_call_at_once(self):
        """After close() (the relay stopping), what waits has run and each new call runs as it is added."""
        clock, done = Clock(), []
        batch = Batch(clock)
        batch.add(lambda: done.append(1))
        batch.close()
        self.assertEqual(done, [1])
        batch.add(lambda: done.append(2))
        self.assertEqual((done, clock.getDelayedCalls()), ([1, 2], []))
