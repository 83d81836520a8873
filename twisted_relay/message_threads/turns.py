# -*- test-case-name: tests.test_message_thread_turns -*-
"""
Threads held by the relay, one request at a time: the small piece the
request path calls (``docs/threads.md``, "Wiring it into the relay").

:meth:`ThreadKeeper.open` turns a request that carries a ``thread`` field
into the plain request to translate and send (a ``create`` without its
field, a ``continue`` rebuilt from the kept conversation), or fails with the
:class:`~twisted_relay.message_threads.model.ThreadError` to answer. The
:class:`ThreadTurn` it gives is settled once the answer is known: kept under
the answer's id when the client received it whole, and otherwise left where
it was, so a failed answer never advances a thread.

The simulated upstream's ``--threads knows`` runs on this same piece.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import ujson
from twisted.internet import defer
from twisted.logger import Logger
from twisted.web.http_headers import Headers

from twisted_relay.message_threads.model import (
    CONTINUE,
    THREAD_MODES,
    AnswerRecorder,
    Conversation,
    ThreadError,
    conversation_after,
    thread_not_found,
    thread_of,
    thread_request,
    without_threads_beta,
)
from twisted_relay.message_threads.store import IThreadStore, thread_store_for

__all__ = ["THREAD_MODES", "ThreadKeeper", "ThreadTurn", "credential_of", "keeper_for", "owner_of"]

_log = Logger()


def owner_of(credential: str | None) -> str:
    """
    The owner of the threads a client creates: a digest of its credential
    (its relay key, or the ``x-api-key`` / ``Authorization`` it sends), so that
    only the client that created a thread can continue it. ``""`` without one.
    The credential itself is never kept.
    """
    if not credential:
        return ""
    return hashlib.sha256(credential.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def credential_of(headers: Headers) -> str | None:
    """
    The credential a client presents (its relay key when relay keys are on,
    else the key it sends on): ``x-api-key``, else ``Authorization``.
    """
    for name in (b"x-api-key", b"authorization"):
        values = headers.getRawHeaders(name)
        if values:
            return values[0].decode("latin-1")
    return None


def keeper_for(config, clock) -> ThreadKeeper:
    """The :class:`ThreadKeeper` of a :class:`~twisted_relay.config.RelayConfig`."""
    return ThreadKeeper(
        thread_store_for(
            config.thread_store,
            clock,
            ttl=config.thread_ttl or None,
            max_threads=config.thread_max_count,
            max_bytes=config.thread_max_bytes,
        ),
        upstream_knows=config.threads == "upstream",
    )


class ThreadTurn:
    """
    One thread request on its way: the plain request to send, and how to
    settle the thread once the answer is known (exactly once).

    :ivar request: the plain, thread-less request, to translate and send
        (``None`` when it was made elsewhere: a worker process).
    :ivar previous_message_id: the answer a ``continue`` resumes from
        (``None`` for a ``create``).
    :ivar new_messages: how many messages the client sent in this request
        (the tail of :attr:`request`).
    :param prefix: the conversation's bytes but for their end
        (:func:`~twisted_relay.message_threads.model.conversation_prefix`),
        when made elsewhere; then kept instead of :attr:`request`.
    """

    def __init__(
        self, keeper: ThreadKeeper, owner: str, request: dict | None, previous_message_id: str | None,
        new_messages: int = 0, *, prefix: bytes | None = None,
    ):
        self._keeper = keeper
        self._owner = owner
        self.request = request
        self.previous_message_id = previous_message_id
        self.new_messages = new_messages
        self._prefix = prefix
        self._recorder: AnswerRecorder | None = None
        self._settled = False

    @property
    def held_bytes(self) -> int:
        """The bytes of the conversation this turn holds (those made elsewhere)."""
        return 0 if self._prefix is None else len(self._prefix)

    def answered(self, message: dict | None) -> defer.Deferred:
        """The client received ``message`` whole: keep the thread under its id.
        ``None`` (or a message without an id) is a failed answer."""
        if self._settled:
            return defer.succeed(None)
        if not isinstance(message, dict) or not isinstance(message.get("id"), str) or not message["id"]:
            return self.failed()
        self._settled = True
        keeper = self._keeper
        previous = self.previous_message_id
        if self._prefix is not None:
            data = conversation_after(self._prefix, message)
        else:
            data = Conversation.after(self.request, message).encode()
        return keeper.store.commit(
            keeper.key(self._owner, message["id"]),
            data,
            None if previous is None else keeper.key(self._owner, previous),
        )

    def failed(self) -> defer.Deferred:
        """The answer did not reach the client whole: the thread stays where it was."""
        if self._settled:
            return defer.succeed(None)
        self._settled = True
        if self.previous_message_id is None:
            return defer.succeed(None)
        return self._keeper.store.abort(self._keeper.key(self._owner, self.previous_message_id))

    def answered_json(self, answer: bytes) -> defer.Deferred:
        """A whole JSON answer (as the client receives it) was given."""
        try:
            message = ujson.loads(answer)
        except (ValueError, OverflowError):
            message = None
        return self.answered(message)

    def upstream_headers(self, headers: Headers) -> Headers:
        """``headers`` as sent: without the threads beta when the request sent is plain."""
        if self._keeper.upstream_knows:
            return headers
        values = headers.getRawHeaders(b"anthropic-beta")
        if values:
            kept = without_threads_beta(", ".join(v.decode("latin-1") for v in values))
            if kept is None:
                headers.removeHeader(b"anthropic-beta")
            else:
                headers.setRawHeaders(b"anthropic-beta", [kept.encode("latin-1")])
        return headers

    @property
    def settled(self) -> bool:
        """Whether the turn was settled (answered or failed)."""
        return self._settled

    def recording(self, write: Callable[[bytes], None]) -> Callable[[bytes], None]:
        """A ``write`` for the stream's gate: writes to the client and records
        the answer, for :meth:`stream_ended`."""
        self._recorder = AnswerRecorder(self._keeper.max_answer_bytes)
        return self._recorder.tee(write)

    def stream_ended(self, whole: bool) -> defer.Deferred:
        """The recorded stream is over: ``whole`` when the gate judged it
        complete (``done`` fired ``None``)."""
        message = self._recorder.message() if whole and self._recorder is not None else None
        self._recorder = None
        return self.answered(message)


class ThreadKeeper:
    """
    Threads held by the relay, in ``store``.

    :param store: where threads are kept.
    :param max_answer_bytes: the largest streamed answer recorded (a larger
        one is not kept: its continue will be ``thread_not_found``).
    :param upstream_knows: the upstream knows threads (``--threads
        upstream``): the thread is passed on, the relay keeping its copy to
        translate the new messages; a ``continue`` the relay has no copy of
        is ``thread_not_found`` (nothing is sent under an answer id the
        relay did not see the upstream give).
    """

    def __init__(self, store: IThreadStore, max_answer_bytes: int = 32 * 1024 * 1024, upstream_knows: bool = False):
        self.store = store
        self.max_answer_bytes = max_answer_bytes
        self.upstream_knows = upstream_knows

    @staticmethod
    def key(owner: str, answer_id: str) -> str:
        """The store key of an answer of ``owner``'s."""
        return f"{owner}:{answer_id}" if owner else answer_id

    def open(self, body: dict, owner: str = "") -> defer.Deferred:
        """
        Read ``body``'s ``thread`` field.

        :param owner: from :func:`owner_of`.
        :return: a Deferred firing ``None`` for a request without a thread,
            or the :class:`ThreadTurn`; failing with the
            :class:`~twisted_relay.message_threads.model.ThreadError` to answer.
        """

        def rebuild(stored: bytes | None) -> defer.Deferred:
            request, new = thread_request(body, stored)
            return defer.succeed((request, None, new, None))

        return self.open_with(body, owner, rebuild).addCallback(lambda opened: None if opened is None else opened[0])

    def open_with(self, head: dict, owner: str, rebuild: Callable[[bytes | None], defer.Deferred]) -> defer.Deferred:
        """
        :meth:`open`, the plain request made by ``rebuild`` (in a worker
        process, for a large body or conversation). ``head`` holds the body's
        ``thread`` field; ``rebuild(stored)`` makes the plain request from
        the stored conversation (``None`` for a ``create``) and gives a
        Deferred of ``(request, prefix, new_messages, value)``, ``request``
        or ``prefix`` ``None`` (:class:`ThreadTurn`), or fails with the
        :class:`~twisted_relay.message_threads.model.ThreadError` to answer
        (``ValueError``: a stored conversation it cannot read, not found).

        :return: a Deferred firing ``None`` for a request without a thread,
            or ``(turn, value)``.
        """
        try:
            thread = thread_of(head)
        except ThreadError:
            return defer.fail()
        if thread is None:
            return defer.succeed(None)

        def opened(made: tuple, previous: str | None) -> tuple:
            request, prefix, new, value = made
            return ThreadTurn(self, owner, request, previous, new, prefix=prefix), value

        if thread.kind != CONTINUE:
            return defer.maybeDeferred(rebuild, None).addCallback(opened, None)
        previous = thread.previous_message_id
        key = self.key(owner, previous)

        def refused(failure):
            self.store.abort(key)
            if failure.check(ValueError) and not failure.check(ThreadError):
                raise thread_not_found()
            return failure

        def found(data: bytes) -> defer.Deferred:
            return defer.maybeDeferred(rebuild, data).addCallbacks(opened, refused, callbackArgs=(previous,))

        return self.store.begin(key).addCallback(found)
