# -*- test-case-name: tests.test_body_work -*-
"""
Where the work on a request body runs, so that no body holds the reactor.

A body estimated small (:data:`~twisted_relay.body_work.INLINE_COST`) is
worked on in the relay's process, at once, as before; a larger one in a
worker process of a small pool (:class:`BodyPool`: ``python -m
twisted_relay.body_worker`` processes, started with the reactor's
``spawnProcess`` when first needed): the relay sends its bytes, and gets
back the few facts it reads of it, then for each attempt the bytes to send
and the translation, read back a part at a time (:class:`RequestBody`).
``ujson`` parses and serialises in one C call each that holds the
interpreter's lock throughout (0.25 s for 32 MB of tiny messages), so a
thread would not do: ``docs/architecture.md``, "Big bodies", has the
measurements behind the choice.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections import deque

import ujson
from twisted.application.service import Service
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import IReactorProcess, IReactorThreads
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

import twisted_relay
from twisted_relay._json import to_json
from twisted_relay.body_work import (
    ASSUMED_COST_PER_BYTE,
    HEAD_FIELDS,
    INLINE_COST,
    REFUSED,
    BodyFacts,
    BodyShape,
    Prepared,
    ThreadForm,
    body_sha256,
    collector_paused,
    dropping_in_worker,
    parse_messages_body,
    prepare,
)
from twisted_relay.body_worker import HEADER, frame
from twisted_relay.errors import RelayError
from twisted_relay.message_threads.model import ThreadError, thread_request
from twisted_relay.routing import RequestFacts
from twisted_relay.translation import RequestTranslation, UpstreamRules

__all__ = ["DIGESTED_ON_THREAD", "BodyPool", "BodyWorkError", "RequestBody"]

#: Bodies made in this process whose SHA-256 is made on a thread from this
#: size on: it costs the reactor about 0.5 us a KB here, and the hand-over
#: to a thread about 30 us (``bench/bench_sigv4.py``).
DIGESTED_ON_THREAD = 64 * 1024

#: Values per part of a translation sent back by a worker: a part is read
#: back in about a millisecond.
PART_SIZE = 20_000

#: How long the reactor reads parts of a translation back before it takes a turn.
_SLICE = 0.01

#: How many repaired duplicates of a request are logged one by one.
REPAIRS_SHOWN = 20

#: Seconds a stopping worker has to end before it is killed.
_STOP_GRACE = 5.0

# The folder twisted_relay is imported from: the workers import the same.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(twisted_relay.__file__)))


# The environment variables a body worker keeps (and every PYTHON* and LC_*).
_KEPT_ENVIRONMENT = frozenset({"PATH", "HOME", "TMPDIR", "LANG", "LD_LIBRARY_PATH", "VIRTUAL_ENV"})


class BodyPool(Service):
    """
    The worker processes whole-body work runs in, for bodies estimated over
    ``inline_cost``; none is started until one is needed, and stopping the
    service stops them. Each worker runs one call at a time; calls wait
    their turn in order.

    :param reactor: the reactor (``spawnProcess``).
    :param workers: worker processes at most (0, or a reactor that cannot
        spawn processes: every body in this process).
    :param inline_cost: the largest estimated cost worked on in this process.
    """

    log = Logger()

    def __init__(self, reactor, workers: int = 1, inline_cost: int = INLINE_COST):
        self.reactor = reactor
        # A reactor that cannot start processes (a test's memory reactor):
        # every body in this process.
        self.workers = workers if IReactorProcess.providedBy(reactor) else 0
        self.inline_cost = inline_cost
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []
        self._waiting: deque = deque()
        self._closed = False
        self._ended: Deferred | None = None

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the workers running now."""
        return [worker.transport.pid for worker in self._all if worker.transport is not None and worker.transport.pid]

    def inline(self, cost: int) -> bool:
        """Whether a body of this estimated cost is worked on in this process."""
        return cost <= self.inline_cost or not self.workers or self._closed

    def digest(self, data: bytes) -> Deferred:
        """
        :func:`~twisted_relay.body_work.body_sha256` of a body made in this
        process: a Deferred of the hex. From :data:`DIGESTED_ON_THREAD` bytes
        on, on the reactor's thread pool (hashlib lets go of the interpreter
        lock while it hashes: the reactor pays only the hand-over); a smaller
        body, or with a reactor that has no threads (a test's memory
        reactor), here.
        """
        if len(data) >= DIGESTED_ON_THREAD and IReactorThreads.providedBy(self.reactor):
            return deferToThreadPool(self.reactor, self.reactor.getThreadPool(), body_sha256, data)
        return succeed(body_sha256(data))

    def run(self, name: str, *args) -> Deferred:
        """
        Call ``name`` (one of :data:`~twisted_relay.body_worker.CALLS`) with
        ``args`` in a worker process: a Deferred of its value. Cancelling it
        drops the value (a call not yet sent is not made). A worker that
        dies (killed for its memory) fails its call with a 500
        ``api_error``; the next call starts another.
        """
        if self._closed:
            return fail(_worker_lost())
        call = _Call(name, args)
        call.deferred = Deferred(lambda _: self._cancelled(call))
        self._waiting.append(call)
        self._dispatch()
        return call.deferred

    def _cancelled(self, call: _Call) -> None:
        if call in self._waiting:
            self._waiting.remove(call)

    def _dispatch(self) -> None:
        while self._waiting:
            if self._idle:
                worker = self._idle.pop()
            elif len(self._all) < self.workers:
                worker = self._start()
            else:
                return
            worker.send(self._waiting.popleft())

    def _start(self) -> _Worker:
        worker = _Worker(self)
        # Only what Python needs: the relay's environment holds its keys
        # (the upstream key, a worker's whole configuration), which a body
        # worker never uses.
        env = {
            name: value
            for name, value in os.environ.items()
            if name in _KEPT_ENVIRONMENT or name.startswith(("PYTHON", "LC_"))
        }
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        self.reactor.spawnProcess(
            worker,
            sys.executable,
            [sys.executable, "-m", "twisted_relay.body_worker"],
            env=env,
            path=os.getcwd(),
            childFDs={0: "w", 1: "r", 2: "r"},
        )
        self._all.append(worker)
        return worker

    def answered(self, worker: _Worker, call: _Call, answer: tuple) -> None:
        """A worker's answer to ``call``; the worker takes the next call."""
        if not self._closed:
            self._idle.append(worker)
        kind, value = answer
        if not call.deferred.called:
            if kind == "ok":
                call.deferred.callback(value)
            else:
                call.deferred.errback(BodyWorkError(value))
        self._dispatch()

    def ended(self, worker: _Worker, call: _Call | None, reason) -> None:
        """A worker ended: its call, if any, fails; another starts for the calls waiting."""
        self._all.remove(worker)
        if worker in self._idle:
            self._idle.remove(worker)
        if call is not None and not call.deferred.called:
            self.log.error("A body worker process ended with a call in progress: {why}", why=reason.getErrorMessage())
            call.deferred.errback(_worker_lost())
        if self._closed:
            if not self._all and self._ended is not None:
                ended, self._ended = self._ended, None
                ended.callback(None)
            return
        self._dispatch()

    def stopService(self):
        Service.stopService(self)
        return self.close()

    def close(self) -> Deferred:
        """
        Stop the workers (calls waiting fail; bodies from now on are worked on
        in this process); fires once they have ended.
        """
        self._closed = True
        while self._waiting:
            call = self._waiting.popleft()
            if not call.deferred.called:
                call.deferred.errback(_worker_lost())
        if not self._all:
            return succeed(None)
        self._ended = Deferred()
        for worker in list(self._all):
            worker.stop(self.reactor, _STOP_GRACE)
        return self._ended


class BodyWorkError(Exception):
    """A body worker's call failed (its text says how): answered as the relay's own 500."""


class _Call:
    """One call to a worker: its name, arguments, and the Deferred of its value."""

    __slots__ = ("name", "args", "deferred")

    def __init__(self, name: str, args: tuple):
        self.name = name
        self.args = args
        self.deferred: Deferred | None = None


class _Worker(ProcessProtocol):
    """One worker process's pipes: calls written to its standard input, answers read from its standard output."""

    log = Logger()

    def __init__(self, pool: BodyPool):
        self._pool = pool
        self._call: _Call | None = None
        self._pieces: list[bytes] = []
        self._have = 0
        self._size: int | None = None
        self._kill = None

    def send(self, call: _Call) -> None:
        """Make ``call`` (this worker is idle)."""
        self._call = call
        self.transport.writeSequence(frame((call.name, call.args)))
        # The arguments (a body's bytes) are the pipe's now.
        call.args = None

    def outReceived(self, data: bytes) -> None:
        self._pieces.append(data)
        self._have += len(data)
        while True:
            if self._size is None:
                if self._have < HEADER.size:
                    return
                joined = b"".join(self._pieces)
                (self._size,) = HEADER.unpack_from(joined)
                self._take(joined, HEADER.size)
            if self._have < self._size:
                return
            joined = b"".join(self._pieces)
            answer = pickle.loads(memoryview(joined)[: self._size])
            self._take(joined, self._size)
            self._size = None
            call, self._call = self._call, None
            if call is not None:
                self._pool.answered(self, call, answer)

    def _take(self, joined: bytes, used: int) -> None:
        rest = joined[used:]
        self._pieces = [rest] if rest else []
        self._have = len(rest)

    def errReceived(self, data: bytes) -> None:
        self.log.warn("A body worker process said: {text}", text=data.decode("utf-8", "replace")[:2000])

    def processEnded(self, reason) -> None:
        if self._kill is not None and self._kill.active():
            self._kill.cancel()
        call, self._call = self._call, None
        self._pool.ended(self, call, reason)

    def stop(self, clock, grace: float) -> None:
        """End it: its standard input closes (it ends once its call is answered), then it is killed after ``grace`` seconds."""
        self.transport.closeStdin()
        self._kill = clock.callLater(grace, self._killed)

    def _killed(self) -> None:
        try:
            self.transport.signalProcess("KILL")
        except ProcessExitedAlready:
            pass


def _with_digest(sha256: str, prepared: Prepared) -> Prepared:
    prepared.body_sha256 = sha256
    return prepared


def _worker_lost() -> RelayError:
    return RelayError(500, "The relay's worker process for large request bodies stopped; try again.")


class RequestBody:
    """
    One request's body, held as its bytes, and the work on it: read
    (:meth:`read`), then prepared for each attempt (:meth:`prepare`). A small
    body is parsed once in this process and its parsed form handed to the
    first attempt; a large one is never parsed here.

    :param pool: where the work runs.
    :param raw: the body's bytes.
    :param cost: its estimated cost (:meth:`~twisted_relay.body_work.BodyShape.cost`),
        ``None``: estimated now.
    :param parsed: the body already parsed here (then it is worked on here).
    :ivar head: the body's top-level ``model``, ``stream``, ``thinking`` and
        ``thread`` (the parsed body itself, when parsed here).
    :ivar facts: what routes match on (:class:`~twisted_relay.routing.RequestFacts`).
    """

    def __init__(
        self,
        pool: BodyPool,
        raw: bytes,
        cost: int | None = None,
        *,
        parsed: dict | None = None,
        read: BodyFacts | None = None,
    ):
        self.pool = pool
        self.raw = raw
        if cost is None:
            cost = BodyShape.of(raw).cost()
        self.cost = cost
        self.inline = parsed is not None or (read is None and pool.inline(cost))
        self.head: dict = {} if parsed is None else parsed
        self.facts = None if parsed is None else RequestFacts(parsed, len(raw))
        self._body = parsed
        if read is not None:
            self._read(read)

    def read(self) -> Deferred:
        """
        Parse and check the body, and learn its facts: fires with ``None``,
        or fails with the 400 :class:`~twisted_relay.errors.RelayError` to answer.
        """
        if self.inline:
            try:
                with collector_paused():
                    body = parse_messages_body(self.raw)
            except RelayError:
                return fail()
            self.head = self._body = body
            self.facts = RequestFacts(body, len(self.raw))
            return succeed(None)
        return self.pool.run("read", self.raw).addCallback(self._read)

    def _read(self, result) -> None:
        if not isinstance(result, BodyFacts):
            status, message = result
            raise RelayError(status, message)
        self.head = result.head
        self.facts = RequestFacts.known(result.head, len(self.raw), result.images, result.conversation)

    def thread_request(self, stored: bytes | None) -> Deferred:
        """
        The plain request this thread request stands for
        (:func:`~twisted_relay.message_threads.model.thread_request`), made
        here when it is small, in a worker when the body or the stored
        conversation is large: for
        :meth:`~twisted_relay.message_threads.turns.ThreadKeeper.open_with`,
        a Deferred of ``(request, prefix, new messages, the plain request's
        RequestBody)``.
        """
        size = 0 if stored is None else ASSUMED_COST_PER_BYTE * len(stored)
        if self.inline and self.pool.inline(self.cost + size):
            try:
                with collector_paused():
                    request, new = thread_request(self._body, stored)
                    replacement = RequestBody(self.pool, to_json(request), self.cost + size, parsed=request)
            except Exception:
                return fail()
            return succeed((request, None, new, replacement))
        return self.pool.run("thread", self.raw, stored).addCallback(self._rebuilt)

    def _rebuilt(self, result: tuple) -> tuple:
        if result[0] == "refused":
            raise ThreadError(*result[1:])
        if result[0] == "unreadable":
            raise ValueError("not a stored conversation")
        _, plain, cost, facts, prefix, new = result
        return None, prefix, new, RequestBody(self.pool, plain, cost, read=facts)

    def parsed(self) -> dict | None:
        """The parsed body, when it was parsed here."""
        return self._body

    def prepare(
        self, model: str | None, rules: UpstreamRules, thread: ThreadForm | None, drop_blocks: bool, note_repairs: bool,
        form=None, digest: bool = False,
    ) -> Deferred:
        """
        What one attempt sends (:func:`~twisted_relay.body_work.prepare`): a
        Deferred of a :class:`~twisted_relay.body_work.Prepared`. The parsed
        body goes to the first attempt only, then is dropped.

        :param form: the wire's edits of the body (a
            :class:`~twisted_relay.wires.BodyForm`), if any.
        :param digest: also give the SHA-256 of the bytes to send
            (``Prepared.body_sha256``), made off the reactor for a large
            body: in the worker, or on a thread (:meth:`BodyPool.digest`).
        """
        shown = REPAIRS_SHOWN if note_repairs else 0
        if self.inline:
            body, self._body = self._body, None
            # Nothing here keeps the parsed body once this attempt has it.
            self.head = {name: self.head[name] for name in HEAD_FIELDS if name in self.head}
            self.facts = None
            try:
                with collector_paused():
                    if body is None:
                        body = ujson.loads(self.raw)
                    prepared = prepare(body, self.raw, model, rules, thread, drop_blocks, shown, form)
            except Exception:
                return fail()
            if not digest:
                return succeed(prepared)
            return self.pool.digest(prepared.body).addCallback(_with_digest, prepared)
        d = self.pool.run(
            "prepare", self.raw, model, tuple(rules.to_dict().items()), thread, drop_blocks, shown, PART_SIZE,
            tuple(form) if form else None, digest,
        )
        return d.addCallback(lambda result: Deferred.fromCoroutine(self._assemble(result, rules)))

    async def _assemble(self, result: tuple, rules: UpstreamRules) -> Prepared:
        if result[0] == REFUSED:
            raise RelayError(result[1], result[2], kind="capability", should_retry=False)
        body, head, parts, repairs, count, can_drop, dropping, sha256 = result
        translation = RequestTranslation.assembled(rules, head)
        clock = self.pool.reactor
        began = time.perf_counter()
        for part in parts:
            translation.add_part(pickle.loads(part))
            if time.perf_counter() - began > _SLICE:
                # Every other connection gets its turn.
                await deferLater(clock, 0, lambda: None)
                began = time.perf_counter()
        return Prepared(self.raw if body is None else body, translation, repairs, count, can_drop, dropping, sha256)

    def dropping_blocks(self, sent: bytes) -> Deferred:
        """``sent`` again with ``drop_block`` (:func:`~twisted_relay.body_work.dropping_in_worker`)."""
        if self.inline:
            try:
                return succeed(dropping_in_worker(sent))
            except Exception:
                return fail()
        return self.pool.run("dropping", sent)
