# -*- test-case-name: tests.test_body_work -*-
"""
Where the work on a request body runs, so that no body holds the reactor.

A body estimated small (:data:`~twisted_relay.body_work.INLINE_COST`) is
worked on in the relay's process, at once, as before; a larger one in a
worker process of a small pool (:class:`BodyPool`, the standard library's
``ProcessPoolExecutor``, started on first use): the relay sends its bytes,
and gets back the few facts it reads of it, then for each attempt the bytes
to send and the translation, read back a part at a time
(:class:`RequestBody`). ``ujson`` parses and serialises in one C call each
that holds the interpreter's lock throughout (0.25 s for 32 MB of tiny
messages), so a thread would not do: ``docs/architecture.md``, "Big bodies",
has the measurements behind the choice.
"""

from __future__ import annotations

import multiprocessing
import pickle
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import ujson
from twisted.internet.defer import Deferred, fail, succeed
from twisted.application.service import Service
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger

from twisted_relay.body_work import (
    HEAD_FIELDS,
    INLINE_COST,
    BodyFacts,
    BodyShape,
    Prepared,
    ThreadForm,
    collector_paused,
    dropping_in_worker,
    parse_messages_body,
    prepare,
    prepare_in_worker,
    read_in_worker,
)
from twisted_relay.errors import RelayError
from twisted_relay.routing import RequestFacts
from twisted_relay.translation import RequestTranslation, UpstreamRules

__all__ = ["BodyPool", "RequestBody"]

#: Values per part of a translation sent back by a worker: a part is read
#: back in about a millisecond.
PART_SIZE = 20_000

#: How long the reactor reads parts of a translation back before it takes a turn.
_SLICE = 0.01

#: How many repaired duplicates of a request are logged one by one.
REPAIRS_SHOWN = 20


class BodyPool(Service):
    """
    The worker processes whole-body work runs in, for bodies estimated over
    ``inline_cost``; none is started until one is needed, and stopping the
    service stops them.

    :param reactor: the reactor (results come back through ``callFromThread``).
    :param workers: worker processes at most (0: every body in this process).
    :param inline_cost: the largest estimated cost worked on in this process.
    """

    log = Logger()

    def __init__(self, reactor, workers: int = 1, inline_cost: int = INLINE_COST):
        self.reactor = reactor
        self.workers = workers
        self.inline_cost = inline_cost
        self._executor: ProcessPoolExecutor | None = None
        self._closed = False

    def inline(self, cost: int) -> bool:
        """Whether a body of this estimated cost is worked on in this process."""
        return cost <= self.inline_cost or not self.workers or self._closed

    def run(self, function, *args) -> Deferred:
        """
        ``function(*args)`` in a worker process: a Deferred of its result.
        Cancelling it drops the result (a call not yet started is not run).
        A worker that dies (killed for its memory) fails the calls it had
        with a 500 ``api_error``, and the next call starts a new pool.
        """
        executor = self._executor
        if executor is None:
            executor = self._executor = ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn")
            )
        try:
            future = executor.submit(function, *args)
        except (BrokenProcessPool, RuntimeError):
            self._executor = None
            return fail(_worker_lost())
        d = Deferred(lambda _: future.cancel())
        future.add_done_callback(lambda f: self.reactor.callFromThread(self._settle, d, f))
        return d

    def _settle(self, d: Deferred, future) -> None:
        if d.called:
            return
        if future.cancelled():
            d.cancel()
            return
        error = future.exception()
        if error is None:
            d.callback(future.result())
        elif isinstance(error, BrokenProcessPool):
            self._executor = None
            self.log.error("A body worker process stopped: {error}", error=str(error))
            d.errback(_worker_lost())
        else:
            d.errback(error)

    def stopService(self):
        Service.stopService(self)
        return self.close()

    def close(self) -> Deferred:
        """
        Stop the workers (calls not started are cancelled; later bodies are
        worked on in this process); fires once they have exited.
        """
        self._closed = True
        executor, self._executor = self._executor, None
        if executor is None:
            return succeed(None)
        executor.shutdown(wait=False, cancel_futures=True)
        return deferToThreadPool(self.reactor, self.reactor.getThreadPool(), executor.shutdown)


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

    def __init__(self, pool: BodyPool, raw: bytes, cost: int | None = None, *, parsed: dict | None = None):
        self.pool = pool
        self.raw = raw
        if cost is None:
            cost = BodyShape.of(raw).cost()
        self.cost = cost
        self.inline = parsed is not None or pool.inline(cost)
        self.head: dict = {} if parsed is None else parsed
        self.facts = None if parsed is None else RequestFacts(parsed, len(raw))
        self._body = parsed

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
        return self.pool.run(read_in_worker, self.raw).addCallback(self._read)

    def _read(self, result) -> None:
        if not isinstance(result, BodyFacts):
            status, message = result
            raise RelayError(status, message)
        self.head = result.head
        self.facts = RequestFacts.known(result.head, len(self.raw), result.images, result.conversation)

    def replaced(self, body: dict, raw: bytes) -> RequestBody:
        """The body a message thread's turn stands for (parsed here: a thread's request is read here)."""
        return RequestBody(self.pool, raw, self.cost, parsed=body)

    def parsed(self) -> dict | None:
        """The parsed body, when it was parsed here (the message thread's turn reads it)."""
        return self._body

    def prepare(self, model: str | None, rules: UpstreamRules, thread: ThreadForm | None, drop_blocks: bool,
                note_repairs: bool) -> Deferred:
        """
        What one attempt sends (:func:`~twisted_relay.body_work.prepare`): a
        Deferred of a :class:`~twisted_relay.body_work.Prepared`. The parsed
        body goes to the first attempt only, then is dropped.
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
                    return succeed(prepare(body, self.raw, model, rules, thread, drop_blocks, shown))
            except Exception:
                return fail()
        d = self.pool.run(
            prepare_in_worker, self.raw, model, tuple(rules.to_dict().items()), thread, drop_blocks, shown, PART_SIZE
        )
        return d.addCallback(lambda result: Deferred.fromCoroutine(self._assemble(result, rules)))

    async def _assemble(self, result: tuple, rules: UpstreamRules) -> Prepared:
        body, head, parts, repairs, count, can_drop, dropping = result
        translation = RequestTranslation.assembled(rules, head)
        clock = self.pool.reactor
        began = time.perf_counter()
        for part in parts:
            translation.add_part(pickle.loads(part))
            if time.perf_counter() - began > _SLICE:
                # Every other connection gets its turn.
                await deferLater(clock, 0, lambda: None)
                began = time.perf_counter()
        return Prepared(self.raw if body is None else body, translation, repairs, count, can_drop, dropping)

    def dropping_blocks(self, sent: bytes) -> Deferred:
        """``sent`` again with ``drop_block`` (:func:`~twisted_relay.body_work.dropping_in_worker`)."""
        if self.inline:
            try:
                return succeed(dropping_in_worker(sent))
            except Exception:
                return fail()
        return self.pool.run(dropping_in_worker, sent)

