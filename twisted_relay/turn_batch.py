# -*- test-case-name: tests.test_turn_batch -*-
"""
Work that may wait for the end of the reactor turn, done there together.

Metering an answer (its usage record made, counted in the metrics and
handed to the ledger) costs about 9 us of CPU when answers are metered
many in a row, and four to five times that when each is metered on its
own between other requests' work: the processor's caches then hold the
rest of the relay, not metering's code and data (``docs/benchmarks.md``,
"Metering at the turn's end"). :class:`TurnBatch` runs what was added
during one reactor turn at the start of the next, before the reactor
reads its sockets again: a request read after an answer ended still sees
that answer's usage (the spend limits' totals), as when it was done at once.
"""

from __future__ import annotations

from typing import Callable

from twisted.logger import Logger

__all__ = ["TurnBatch"]


class TurnBatch:
    """
    Calls that wait for the end of the reactor turn, then run in the order
    they were added.

    :param reactor: the reactor (its ``callLater(0, ...)`` ends the turn).
    """

    log = Logger()

    def __init__(self, reactor):
        self._reactor = reactor
        self._pending: list[Callable[[], object]] = []
        self._call = None

    @property
    def pending(self) -> int:
        """How many calls wait."""
        return len(self._pending)

    def add(self, work: Callable[[], object]) -> None:
        """Call ``work()`` at the end of this reactor turn (or at :meth:`run`)."""
        self._pending.append(work)
        if self._call is None:
            self._call = self._reactor.callLater(0, self.run)

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
                self.log.failure("A call left to the end of the reactor turn failed")
