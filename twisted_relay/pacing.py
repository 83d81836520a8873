# -*- test-case-name: tests.test_pacing -*-
"""
Request starts spread over reactor turns, so that a burst of new requests
does not hold up the streams already running.

Starting a relayed request (Twisted's request handling, Klein's endpoint,
the body's parse and translation, the route, the upstream request) costs
about 0.3 ms of CPU; an event of a running stream costs tens of
microseconds. When many requests come at once (a client's connections
all starting their next request as their streams end together), a reactor
turn that starts them all lasts tens of milliseconds, and every event of
every running stream that arrived meanwhile waits for it: at 200 paced
streams the relay's p99 added latency per event was six times aiohttp's
(``docs/benchmarks.md``).

:class:`StartPacer` lets requests start in a turn until the turn has run for
``budget`` seconds (half a millisecond) since its first start; later ones
wait, in order, for the next turns (at least one starts in each), and the
reactor reads the sockets of running streams in between. A request that
has waited longer than ``patience`` (0.1 s, far less than a model takes to
answer) lets turns run longer, by a quarter of its extra wait: an overload
that lasts then costs both sides (events wait about a quarter of what
starts wait), instead of the reactor reading one event per read and
spending its time in system calls. A request that waits is in flight
already (the drain waits for it), and its client's leaving cancels it
like any other.

Only while a stream is being relayed: with none running there is nothing
a burst of starts would hold up, and spreading them would only cost the
reactor more turns (each a ``epoll`` call and a round of timers): on small
non-streaming requests alone (S3), pacing them cost 3 to 4 % of the
requests a second (``docs/benchmarks.md``, "Metering and its price, side by side").
"""

from __future__ import annotations

from collections import deque

from twisted.internet.defer import Deferred, succeed

__all__ = ["StartPacer"]


class StartPacer:
    """
    Spreads request starts over reactor turns. The first request of a turn
    starts at once; others start while the turn has run, since its first
    start, less than ``budget`` seconds (more under a sustained overload,
    see ``patience``); the rest wait for the next turns, first come first
    started.

    :param reactor: the reactor (its ``callLater(0, ...)`` ends a turn).
    :param budget: seconds a turn may spend starting requests.
    :param patience: seconds a request may wait for its turn before turns
        may run longer: by ``ratio`` of every second it has waited beyond
        that. A burst is spread thin; an overload that lasts (more to start
        than the reactor's spare time) lets turns grow, so that the reactor
        reads more per turn (fewer system calls per event) rather than new
        requests waiting without end.
    :param clock: the time now, in seconds (the reactor's by default).
    """

    def __init__(self, reactor, budget: float = 0.0005, patience: float = 0.1, ratio: float = 0.25, clock=None):
        #: Whose ``callLater(0, ...)`` ends a turn.
        self.reactor = reactor
        self.budget = budget
        self.patience = patience
        self.ratio = ratio
        #: The time now, in seconds.
        self.clock = clock if clock is not None else reactor.seconds
        self._waiting: deque[tuple[float, Deferred]] = deque()
        # When this turn's first request started; None: none has yet.
        self._turn_began: float | None = None
        # How long this turn may start requests for, after its first.
        self._allowed = budget
        #: How many streams are being relayed (:meth:`stream_began`, :meth:`stream_ended`).
        self.streams = 0

    @property
    def waiting(self) -> int:
        """How many requests wait for their turn."""
        return sum(1 for _, d in self._waiting if not d.called)

    def turn(self) -> Deferred:
        """
        Fire (with ``None``) when the caller may start its request: at once
        if no stream is being relayed, or this turn has time left and nobody
        waits; else in a later turn. Cancelling it gives up the place.
        """
        if not self._waiting and (not self.streams or self._may_start()):
            return succeed(None)
        waiting: Deferred = Deferred()
        self._waiting.append((self.clock(), waiting))
        return waiting

    def stream_began(self) -> None:
        """A stream is being relayed: starts are paced while one is."""
        self.streams += 1

    def stream_ended(self) -> None:
        """A stream :meth:`stream_began` counted has ended."""
        self.streams -= 1

    def _may_start(self) -> bool:
        now = self.clock()
        if self._turn_began is None:
            self._turn_began = now
            self.reactor.callLater(0, self._next_turn)
            return True
        return now - self._turn_began < self._allowed

    def _next_turn(self) -> None:
        self._turn_began = None
        waiting = self._waiting
        while waiting and waiting[0][1].called:
            # Cancelled: its client left.
            waiting.popleft()
        self._allowed = self.budget
        if waiting:
            overdue = self.clock() - waiting[0][0] - self.patience
            if overdue > 0:
                self._allowed += self.ratio * overdue
        while waiting:
            first = waiting[0][1]
            if not first.called:
                if not self._may_start():
                    break
                first.callback(None)
            waiting.popleft()
