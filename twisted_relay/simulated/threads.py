# -*- test-case-name: tests.test_simulated_threads -*-
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
  relay's own model (:mod:`twisted_relay.threads`) and memory store.

A ``continue`` is in flight from its request until its answer has been
written whole (a stream: its last byte); an answer that was not (the client
went away, the request was refused) does not advance the thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from twisted_relay.simulated.model import Rejection
from twisted_relay.thread_store import MemoryThreadStore
from twisted_relay.threads import (
    CONTINUE,
    Conversation,
    plain_request,
    rebuild_request,
    thread_of,
)

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


class ThreadTurn:
    """What a thread request leaves to settle once its answer is written (or not)."""

    def __init__(self, store: MemoryThreadStore, request: dict, previous_message_id: str | None):
        self._store = store
        self._request = request
        self._previous = previous_message_id
        self._settled = False

    def answered(self, message: dict) -> None:
        """The answer went out whole: keep the thread under its id."""
        if self._settled:
            return
        self._settled = True
        data = Conversation.after(self._request, message).encode()
        self._store.commit(message["id"], data, self._previous)

    def failed(self) -> None:
        """The answer did not go out: the thread stays where it was."""
        if self._settled:
            return
        self._settled = True
        if self._previous is not None:
            self._store.abort(self._previous)


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
        self._store: MemoryThreadStore | None = None

    @property
    def store(self) -> MemoryThreadStore:
        """The threads kept (``knows``)."""
        if self._store is None:
            self._store = MemoryThreadStore(self._clock(), ttl=self._ttl, max_threads=1024)
        return self._store

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
        thread = thread_of(body)
        if thread is None:
            return plain_request(body), None
        if thread.kind != CONTINUE:
            plain = plain_request(body)
            return plain, ThreadTurn(self.store, plain, None)
        previous = thread.previous_message_id
        data = _now(self.store.begin(previous))
        try:
            plain = rebuild_request(body, Conversation.decode(data))
        except BaseException:
            self.store.abort(previous)
            raise
        return plain, ThreadTurn(self.store, plain, previous)
