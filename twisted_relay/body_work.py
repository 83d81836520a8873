# -*- test-case-name: tests.test_body_work -*-
"""
The work one request body takes, as pure functions of plain values: reading
it (parsed, checked, and the few facts the request path needs of it), and
preparing what one attempt sends upstream (the target's model, the
translation for its upstream, the message thread's form, ``drop_block``),
serialised. The request path runs them in its own process for a small body
and in a worker process for a large one (:mod:`twisted_relay.body_pool`);
the ``*_in_worker`` functions are the worker's side: bytes in, plain values
out.

And what a body costs in memory once parsed, estimated from its bytes as
they arrive (:class:`BodyShape`): what the in-flight budget counts
(``docs/architecture.md``, "Big bodies").

Pure: no Twisted, no I/O.
"""

from __future__ import annotations

import gc
import hashlib
import pickle
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import ujson

from twisted_relay._json import to_json
from twisted_relay.affinity import conversation_of
from twisted_relay.bodies import droppable, dropping_blocks, holds_image
from twisted_relay.body_form import BodyForm
from twisted_relay.errors import RelayError, capability_rejected
from twisted_relay.openai import CapabilityRejected, to_upstream_protocol
from twisted_relay.message_threads.model import ThreadError, conversation_prefix, thread_request, upstream_thread_request
from twisted_relay.translation import RequestTranslation, UpstreamRules, translate_request

__all__ = [
    "ASSUMED_COST_PER_BYTE",
    "PROJECTED_FROM",
    "HEAD_FIELDS",
    "INLINE_COST",
    "BodyFacts",
    "BodyShape",
    "Prepared",
    "ThreadForm",
    "body_sha256",
    "collector_paused",
    "dropping_in_worker",
    "facts_of",
    "kept_cost",
    "parse_messages_body",
    "prepare",
    "prepare_in_worker",
    "read_in_worker",
    "thread_in_worker",
]

# -- what a body costs -------------------------------------------------------------

#: Bytes a parsed body costs per ``{`` (a dict of a few keys), per ``[`` (a
#: list), per ``"`` (half a string: each costs about 50 bytes besides its
#: characters) and per ``,`` (a slot in a container, or a number), beside
#: twice its own bytes (the bytes themselves, and ujson's and the
#: serialiser's buffers). Fitted on bodies of tiny messages, of tool uses and
#: results, of numbers, strings, empty objects and lists
#: (``docs/architecture.md``, "What a body costs"); never below what was
#: measured but for shapes of almost nothing but numbers.
OBJECT_COST = 200
ARRAY_COST = 70
QUOTE_COST = 26
COMMA_COST = 32

#: What a stored conversation's byte is assumed to cost, unread: about what
#: tiny messages cost (15 bytes a byte).
ASSUMED_COST_PER_BYTE = 16

#: The bytes of a body from which its whole cost is projected.
PROJECTED_FROM = 64 * 1024

#: Bodies estimated to cost at most this are worked on in the relay's own
#: process (5 to 45 ms of work at this cost, by shape: floats and nested
#: lists the slowest); larger ones in a worker process.
INLINE_COST = 8 * 1024 * 1024

#: What a request keeps per translation table row once its body is sent:
#: the row's values, its ids and its place in the history's maps.
_KEPT_PER_ROW = 400


class BodyShape:
    """
    What makes a body's parsed form large, counted as its bytes arrive: its
    size, and how many ``{``, ``[``, ``"`` and ``,`` it holds (in strings or
    not: an estimate that errs on the large side). Each count is one C-speed
    pass over each piece as it comes.

    :ivar size: bytes counted.
    """

    __slots__ = ("size", "_objects", "_arrays", "_quotes", "_commas")

    def __init__(self) -> None:
        self.size = 0
        self._objects = self._arrays = self._quotes = self._commas = 0

    def add(self, data: bytes) -> None:
        """Count one more piece of the body."""
        self.size += len(data)
        self._objects += data.count(b"{")
        self._arrays += data.count(b"[")
        self._quotes += data.count(b'"')
        self._commas += data.count(b",")

    def cost(self) -> int:
        """The body's estimated cost in memory, in bytes, while it is parsed and worked on."""
        return (
            2 * self.size
            + OBJECT_COST * self._objects
            + ARRAY_COST * self._arrays
            + QUOTE_COST * self._quotes
            + COMMA_COST * self._commas
        )

    def projected(self, length: int | None) -> int:
        """
        The cost of a whole body of ``length`` bytes (``None``: what has
        arrived), projected from the part counted so far once that is
        :data:`PROJECTED_FROM` bytes or more; before, what arrived costs.
        """
        if length is None or self.size >= length or self.size < PROJECTED_FROM:
            return self.cost()
        return self.cost() * length // self.size

    @classmethod
    def of(cls, data: bytes) -> BodyShape:
        """The shape of a whole body."""
        shape = cls()
        shape.add(data)
        return shape


def kept_cost(raw: bytes, sent: bytes | None, translation: RequestTranslation | None) -> int:
    """What a request keeps of its body while it waits on the upstream: its bytes, those sent, its translation."""
    cost = len(raw)
    if sent is not None and sent is not raw:
        cost += len(sent)
    if translation is not None:
        cost += _KEPT_PER_ROW * translation.entries
    return cost


@contextmanager
def collector_paused():
    """
    The garbage collector off for one body's work. Parsing a large body
    makes millions of containers, and the collections they set off (which
    free nothing: a parsed body holds no reference cycle) took three
    quarters of the parse: 32 MB of tiny messages parsed in 0.9-1.1 s with
    the collector, 0.23-0.26 s without.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# -- reading a body -------------------------------------------------------------------


def parse_messages_body(raw: bytes) -> dict:
    """
    A Messages request body, parsed and checked.

    :raises RelayError: 400, for a body that is not JSON, not an object, or
        has no ``messages`` list.
    """
    try:
        body = ujson.loads(raw)
    except (ValueError, OverflowError) as e:
        raise RelayError(400, "Request body is not valid JSON: %s." % (e,))
    if not isinstance(body, dict):
        raise RelayError(400, "Request body must be a JSON object.")
    if not isinstance(body.get("messages"), list):
        raise RelayError(400, "messages: Field required and must be a list.")
    return body


@dataclass(frozen=True, slots=True)
class BodyFacts:
    """
    What the request path reads of a Messages body held as bytes only (read
    in a worker process): what routes match on, and the top-level fields it
    looks at.

    :ivar head: the body's ``model``, ``stream``, ``thinking`` and
        ``thread`` fields, those it has.
    :ivar images: it holds an image.
    :ivar conversation: :func:`~twisted_relay.affinity.conversation_of` it.
    """

    head: dict
    images: bool
    conversation: str | None


#: The top-level fields :attr:`BodyFacts.head` keeps.
HEAD_FIELDS = ("model", "stream", "thinking", "thread")


def facts_of(body: dict) -> BodyFacts:
    """The :class:`BodyFacts` of a parsed body."""
    return BodyFacts(
        {name: body[name] for name in HEAD_FIELDS if name in body},
        holds_image(body.get("messages")),
        conversation_of(body),
    )


# -- preparing an attempt ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ThreadForm:
    """
    What an upstream that knows message threads is sent for a thread's turn
    instead of the whole request (:func:`~twisted_relay.message_threads.model.upstream_thread_request`).

    :ivar previous_message_id: the answer a ``continue`` resumes from
        (``None`` for a ``create``).
    :ivar new_messages: how many messages the client sent in this request.
    """

    previous_message_id: str | None
    new_messages: int


@dataclass(slots=True)
class Prepared:
    """
    What one attempt sends, prepared.

    :ivar body: the bytes to send (the client's own when nothing changed).
    :ivar translation: the request's translation (its body forgotten).
    :ivar repairs: the duplicate ids the translation repaired, when asked
        for (at most ``repairs_shown`` of them).
    :ivar repair_count: how many there are in all.
    :ivar droppable: the body sent may be sent again with ``drop_block``
        (:func:`~twisted_relay.bodies.droppable`).
    :ivar dropping: it is sent with ``drop_block`` (asked, and it may).
    :ivar body_sha256: the SHA-256 of :attr:`body` in hex, when asked for
        (a login that signs the body: SigV4), else ``None``.
    """

    body: bytes
    translation: Any
    repairs: list
    repair_count: int
    droppable: bool
    dropping: bool = False
    body_sha256: str | None = None


def prepare(body: dict, raw: bytes, model: str | None, rules: UpstreamRules, thread: ThreadForm | None,
            drop_blocks: bool, repairs_shown: int = 0, form: BodyForm | None = None) -> Prepared:
    """
    What one attempt sends for ``body`` (parsed from ``raw``): ``model`` in
    place of the body's own (``None``: the body's), its ids translated for
    ``rules``, in the form ``thread`` says (``None``: the whole request), with
    ``drop_block`` when ``drop_blocks`` and the body may take it, with the
    wire's edits (``form``, :class:`~twisted_relay.wires.BodyForm`);
    serialised. ``body`` is never changed.

    :param repairs_shown: how many repaired duplicates to give (0: none
        counted either).
    """
    renamed = model is not None and body.get("model") != model
    if renamed:
        body = dict(body)
        body["model"] = model
    translation = translate_request(body, rules)
    sent = translation.upstream_body
    data = to_json(sent) if translation.changed or renamed else raw
    if thread is not None:
        sent = upstream_thread_request(sent, thread.previous_message_id, thread.new_messages)
        data = None
    can_drop = droppable(sent)
    dropping = drop_blocks and can_drop
    if dropping:
        # Its history still holds what broke a block's prefix: the setting
        # goes with every later request, as the API asks.
        sent, data, can_drop = dropping_blocks(sent), None, False
    if form:
        # The wire's edits come last: what the upstream's platform takes.
        edited = form.apply(sent)
        if form.translate:
            try:
                edited = to_upstream_protocol(form.translate, form.context, edited)
            except CapabilityRejected as refused:
                raise capability_rejected(refused.capability) from None
        data = form.wrap(to_json(edited))
    elif data is None:
        data = to_json(sent)
    repairs, count = [], 0
    if repairs_shown:
        found = translation.repairs
        repairs, count = found[:repairs_shown], len(found)
    # The parsed body (often ten times the size of its bytes) is not
    # needed once serialised.
    translation.forget_body()
    return Prepared(data, translation, repairs, count, can_drop, dropping)


# -- the worker's side: bytes in, plain values out --------------------------------------


def read_in_worker(raw: bytes) -> BodyFacts | tuple[int, str]:
    """:func:`parse_messages_body` and :func:`facts_of` in a worker: the facts, or the error to answer (status, message)."""
    with collector_paused():
        try:
            body = parse_messages_body(raw)
        except RelayError as e:
            return (e.status, e.message)
        return facts_of(body)


#: The first item of what :func:`prepare_in_worker` gives for a body the attempt refuses.
REFUSED = "refused"


def prepare_in_worker(raw: bytes, model: str | None, rules: tuple, thread: ThreadForm | None, drop_blocks: bool,
                      repairs_shown: int, part_size: int, form: tuple | None = None, digest: bool = False) -> tuple:
    """
    :func:`prepare` in a worker, on a body :func:`read_in_worker` read.
    ``rules`` is :meth:`~twisted_relay.translation.UpstreamRules.to_dict`'s
    items. Gives the bytes to send (``None``: ``raw`` itself), the
    translation's head and its parts, each pickled on its own (read back a
    part at a time), the repairs, their count, whether the body sent may
    take ``drop_block``, whether it has it, and with ``digest`` the SHA-256
    of the bytes to send (:func:`body_sha256`; else ``None``).
    """
    with collector_paused():
        try:
            prepared = prepare(ujson.loads(raw), raw, model, _rules(rules), thread, drop_blocks, repairs_shown,
                               None if form is None else BodyForm(*form))
        except RelayError as e:
            # What the upstream cannot take (capability_rejected): the client's 400, not a worker's failure.
            return (REFUSED, e.status, e.message)
        head, parts = prepared.translation.parts(part_size)
        pickled = [pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL) for part in parts]
        body = None if prepared.body is raw else prepared.body
        sha256 = body_sha256(prepared.body) if digest else None
        return (body, head, pickled, prepared.repairs, prepared.repair_count, prepared.droppable, prepared.dropping,
                sha256)


def body_sha256(data: bytes) -> str:
    """
    The SHA-256 of a body to send, in hex: what a SigV4 signature covers,
    made where the body is made (in a worker for a large body), so that the
    signature on the reactor does not hash it.
    """
    return hashlib.sha256(data).hexdigest()


def dropping_in_worker(sent: bytes) -> bytes:
    """A body already sent, again with ``drop_block`` (:func:`~twisted_relay.bodies.dropping_blocks`)."""
    with collector_paused():
        return to_json(dropping_blocks(ujson.loads(sent)))


def thread_in_worker(raw: bytes, stored: bytes | None) -> tuple:
    """
    :func:`~twisted_relay.message_threads.model.thread_request` in a worker,
    on a body :func:`read_in_worker` read and the stored conversation
    (``None`` for a ``create``). Gives ``("ok", plain request's bytes, their
    estimated cost, their facts, the conversation's prefix, new messages)``,
    ``("refused", status, error type, message, error code)`` for the
    :class:`~twisted_relay.message_threads.model.ThreadError` to answer, or
    ``("unreadable",)`` for stored bytes that are not a conversation.
    """
    with collector_paused():
        body = ujson.loads(raw)
        try:
            request, new = thread_request(body, stored)
        except ThreadError as e:
            return ("refused", e.status, e.error_type, e.message, e.error_code)
        except ValueError:
            return ("unreadable",)
        del body
        plain = to_json(request)
        return ("ok", plain, BodyShape.of(plain).cost(), facts_of(request), conversation_prefix(request), new)


@lru_cache(maxsize=64)
def _rules(items: tuple) -> UpstreamRules:
    return UpstreamRules.from_dict(dict(items))
