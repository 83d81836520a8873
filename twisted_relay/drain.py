# -*- test-case-name: tests.test_drain -*-
"""
The requests in flight, and draining them so that a load balancer can see it.

When the relay is told to stop, ``/ready`` answers 503 at once while the
relay goes on accepting for ``drain_delay`` seconds (a load balancer that
checks ``/ready`` moves on meanwhile; the service paces this); then it
stops accepting and lets the requests in flight finish within
``shutdown_grace`` (:meth:`InFlight.drain`), after which their connections
are closed. Requests that still arrive on connections a load balancer
keeps alive are served, not refused (a balancer does not resend a refused
POST), and each such connection closes as its answer ends
(``Connection: close``), so the balancer opens its next one elsewhere.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

__all__ = ["InFlight", "close_after_answer"]


class InFlight:
    """
    The requests being relayed now, and whether the relay drains them.

    :param reactor: the reactor, for the shutdown grace's timer.
    :ivar active: the Twisted requests in flight (read it, do not change it).
    :ivar draining: the relay is shutting down: ``/ready`` says 503.
    """

    log = Logger()

    def __init__(self, reactor):
        self._reactor = reactor
        self.active: set = set()
        self.draining = False
        self._idle_waiters: list[Deferred] = []

    @property
    def count(self) -> int:
        """How many requests are in flight."""
        return len(self.active)

    def begin(self, request) -> None:
        """``request`` is being relayed from now on."""
        self.active.add(request)

    def end(self, request) -> None:
        """``request`` is done (answered, failed, or its client gone)."""
        self.active.discard(request)
        if not self.active and self._idle_waiters:
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                waiter.callback(None)

    def arrived(self, request) -> None:
        """A request arrived: while draining, its connection closes once it is answered."""
        if self.draining:
            close_after_answer(request)

    def begin_draining(self) -> None:
        """
        From now on the relay drains (``/ready`` answers 503); requests are
        still served. The connections of requests in flight close when their
        answers end.
        """
        self.draining = True
        for request in self.active:
            close_after_answer(request)

    def drain(self, grace: float) -> Deferred:
        """
        Drain; fire when the requests in flight are done, or after ``grace``
        seconds, when the connections of the rest are closed.
        """
        self.draining = True
        if not self.active:
            return succeed(None)
        waiter = Deferred()
        self._idle_waiters.append(waiter)

        def deadline():
            if waiter.called:
                return
            self.log.warn(
                "Shutdown grace of {grace}s over; closing {count} requests still in flight",
                grace=grace,
                count=len(self.active),
            )
            for request in list(self.active):
                channel = request.channel
                if channel is not None:  # None once its connection is lost
                    close_now(channel.transport)
            self._idle_waiters.remove(waiter)
            waiter.callback(None)

        timer = self._reactor.callLater(grace, deadline)
        waiter.addBoth(lambda result: (timer.cancel() if timer.active() else None, result)[1])
        return waiter


def close_after_answer(request) -> None:
    """
    Close ``request``'s connection once its answer ends; say so in the
    answer's headers when they are not sent yet.
    """
    if not request.startedWriting:
        request.responseHeaders.setRawHeaders(b"connection", [b"close"])
    channel = getattr(request, "channel", None)
    if channel is not None:
        # Read by Twisted's HTTPChannel when the request is done.
        channel.persistent = False


def close_now(transport) -> None:
    """
    Close a connection at once, its unsent bytes dropped: a client that
    stopped reading must not keep its socket past the shutdown grace.
    """
    abort = getattr(transport, "abortConnection", None)
    if abort is not None:
        abort()
    else:
        transport.loseConnection()
