# -*- test-case-name: tests.test_simulated_message_threads -*-
"""
Message threads in the simulated upstream, in one of three ways
(:data:`THREAD_MODES`):

- ``ignore``: the ``thread`` field is accepted and ignored, as by a backend
  that ignores unknown fields: a ``continue`` is answered from its new
  messages alone (a strict upstream then refuses its ``tool_result``);
- ``rejects``: a request with ``thread`` is refused, 400
  ``invalid_request_error`` naming the extra field, as by a backend that
  validates its input and does not know threads;
- ``knows``: the upstream keeps each conversation under its answer's id and
  honours ``create``/``continue`` with the API's three error codes, using the
  relay's own model (:mod:`twisted_relay.message_threads.model`) and memory store.

A ``continue`` is in flight from its request until its answer has been
written whole (a stream: its last byte); an answer that was not (the client
went away, the request was refused) does not advance the thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from twisted_relay.message_threads.store import MemoryThreadStore
from twisted_relay.message_threads.turns import ThreadKeeper, ThreadTurn
from twisted_relay.simulated.model import Rejection

__all__ = ["THREAD_MODES", "SimulatedThreads", "ThreadTurn"]

#: How the simulated upstream treats the ``thread`` field.
THREAD_MODES = ("ignore", "rejects", "knows")


def _now(d) -> Any:
    """The result of a Deferred that has fired (the memory store's do at once)."""
    results: list = []
    d.addBoth(results.append)
    result = results[0]
    if isinstance(result, Failure):
        result.raiseException()
    return result


class SimulatedThreads:
    """
    The simulated upstream's threads.

    :param mode: one of :data:`THREAD_MODES`.
    :param clock: called for the clock of the threads' time to live.
    :param ttl: seconds a thread lives after its last use.
    """

    def __init__(self, mode: str, clock: Callable[[], IReactorTime], ttl: float = 300.0):
        if mode not in THREAD_MODES:
            raise ValueError(f"threads must be one of {', '.join(THREAD_MODES)}")
        self.mode = mode
        self._clock = clock
        self._ttl = ttl
        self._keeper: ThreadKeeper | None = None

    @property
    def store(self) -> MemoryThreadStore:
        """The threads kept (``knows``)."""
        return self._thread_keeper().store

    def _thread_keeper(self) -> ThreadKeeper:
        if self._keeper is None:
            self._keeper = ThreadKeeper(MemoryThreadStore(self._clock(), ttl=self._ttl, max_threads=1024))
        return self._keeper

    def open(self, body: Any) -> tuple[Any, ThreadTurn | None]:
        """
        The request to answer for ``body``, and the turn to settle once the
        answer is written (``None`` for a request that is not a thread).

        :raises Rejection: ``rejects`` and a ``thread`` field.
        :raises ThreadError: ``knows`` and a malformed ``thread``, an unknown,
            continued or busy answer, or a changed ``system``/``tools``.
        """
        if self.mode == "ignore" or not isinstance(body, dict) or "thread" not in body:
            return body, None
        if self.mode == "rejects":
            raise Rejection(400, "invalid_request_error", "thread: Extra inputs are not permitted")
        turn = _now(self._thread_keeper().open(body))
        if turn is None:
            body = dict(body)
            del body["thread"]
            return body, None
        return turn.request, turn
