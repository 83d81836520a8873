"""TurnBatch: calls left to the end of the reactor turn."""

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.turn_batch import TurnBatch


class TurnBatchTests(SynchronousTestCase):
    def test_runs_at_the_turns_end_in_order(self):
        """What is added in a turn runs together at the next, in the order added, once."""
        clock, done = Clock(), []
        batch = TurnBatch(clock)
        batch.add(lambda: done.append(1))
        batch.add(lambda: done.append(2))
        self.assertEqual((done, batch.pending, len(clock.getDelayedCalls())), ([], 2, 1))
        clock.advance(0)
        self.assertEqual((done, batch.pending, clock.getDelayedCalls()), ([1, 2], 0, []))
        batch.add(lambda: done.append(3))
        clock.advance(0)
        self.assertEqual(done, [1, 2, 3])

    def test_run_now(self):
        """run() does what waits at once and leaves no call behind."""
        clock, done = Clock(), []
        batch = TurnBatch(clock)
        batch.add(lambda: done.append(1))
        batch.run()
        self.assertEqual((done, clock.getDelayedCalls()), ([1], []))
        clock.advance(0)
        self.assertEqual(done, [1])

    def test_one_failing_call_does_not_stop_the_others(self):
        """A call that raises is logged; the calls after it still run."""
        clock, done = Clock(), []
        batch = TurnBatch(clock)
        batch.add(lambda: 1 / 0)
        batch.add(lambda: done.append(2))
        clock.advance(0)
        self.assertEqual(done, [2])
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
