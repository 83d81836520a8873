# -*- test-case-name: tests.test_batch -*-
"""
Work that may wait a moment, done together.

Metering an answer (its usage record made, counted in the metrics and
handed to the ledger) costs about 9 us of CPU when answers are metered
many in a row, and four to five times that when each is metered on its
own between other requests' work: the processor's caches then hold the
rest of the relay, not metering's code and data. Done at once, each
answer also cost the reactor a turn of its own at 200 paced streams
(``docs/benchmarks.md``, "Metering and its price, side by side").
:class:`Batch` runs what was added within :data:`DELAY` together; whoever
reads what the work produces (the spend limits' totals, ``/metrics``, the
usage page, the drain before the ledger stops) calls :meth:`Batch.run`
first, so that nothing is read stale.
"""

from __future__ import annotations

from typing import Callable

from twisted.logger import Logger

__all__ = ["DELAY", "Batch"]

#: Seconds the first call of a batch may wait for others.
DELAY = 0.05


class Batch:
    """
    Calls that wait up to ``delay`` seconds, then run together in the
    order they were added (or at once, at :meth:`run`).

    :param reactor: the reactor (its ``callLater`` runs the batch).
    :param delay: seconds the first call of a batch may wait.
    """

    log = Logger()

    def __init__(self, reactor, delay: float = DELAY):
        self._reactor = reactor
        self._delay = delay
        self._pending: list[Callable[[], object]] = []
        self._call = None
        self._closed = False

    @property
    def pending(self) -> int:
        """How many calls wait."""
        return len(self._pending)

    def add(self, work: Callable[[], object]) -> None:
        """Call ``work()`` within the delay (or at :meth:`run`; at once after :meth:`close`)."""
        self._pending.append(work)
        if self._closed:
            self.run()
        elif self._call is None:
            self._call = self._reactor.callLater(self._delay, self.run)

    def close(self) -> None:
        """Run what waits, and from now on every call at once (the relay is stopping)."""
        self._closed = True
        self.run()

    def run(self) -> None:
        """Run every call that waits, now; one that raises is logged and the rest still run."""
        call, self._call = self._call, None
        if call is not None and call.active():
            call.cancel()
        pending, self._pending = self._pending, []
        for work in pending:
            try:
                work()
            except Exception:
                self.log.failure("A batched call failed")
