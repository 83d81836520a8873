# -*- test-case-name: tests.test_message_threads -*-
"""
Message threads (the ``message-threads-2026-08-12`` beta): the pure model.

A client may send a conversation once (``"thread": {"type": "create"}``) and
afterwards only the new messages (``"thread": {"type": "continue",
"previous_message_id": <id of the answer it received>}``). When the relay
holds threads itself it keeps, under the id of each answer it returned, the
whole conversation up to and including that answer (:class:`Conversation`),
and turns each ``continue`` back into the plain, thread-less request the
client would have sent without threads (:func:`rebuild_request`); that
request is then translated like any other. ``docs/threads.md`` has the wire
shapes this follows, as the official SDK reads them.

Nothing here does I/O or imports Twisted; the stores are in
:mod:`twisted_relay.message_threads.store`. :class:`AnswerRecorder` rebuilds the
answer a client received from the SSE bytes written to it, so the relay can
store the answer exactly as the client saw it (ids already translated).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import ujson

from twisted_relay.errors import RelayError

__all__ = [
    "CONTINUE",
    "CREATE",
    "CREATE_ONLY_FIELDS",
    "THREAD_MODES",
    "THREADS_BETA",
    "AnswerRecorder",
    "Conversation",
    "MessageAssembler",
    "ThreadError",
    "ThreadRequest",
    "already_continued",
    "assemble_stream",
    "continue_in_flight",
    "conversation_after",
    "conversation_prefix",
    "fingerprint_mismatch",
    "plain_request",
    "rebuild_request",
    "thread_not_found",
    "thread_of",
    "thread_request",
    "upstream_thread_request",
    "without_threads_beta",
]

#: The ``anthropic-beta`` value of message threads.
THREADS_BETA = "message-threads-2026-08-12"

#: ``thread.type`` values.
CREATE = "create"
CONTINUE = "continue"

#: How the relay treats threads towards an upstream (``--threads``): ``relay``
#: holds them itself and sends plain requests; ``upstream`` passes them to an
#: upstream that knows threads (sending only the new messages, translated).
THREAD_MODES = ("relay", "upstream")

#: Fields a ``continue`` takes from the thread: the SDK leaves them out of a
#: ``continue`` and the API refuses one that changes them.
CREATE_ONLY_FIELDS = ("system", "tools")

_CONVERSATION_VERSION = 1


# -- errors, as the API gives them ---------------------------------------------


class ThreadError(RelayError):
    """
    A thread request the relay refuses, with the API's status, ``error.type``
    and ``error.details.error_code``; the SDKs decide on the code alone.

    :ivar error_code: the ``error.details.error_code``, or ``None`` for a
        malformed ``thread`` field (a plain ``invalid_request_error``).
    """

    def __init__(self, status: int, error_type: str, message: str, error_code: str | None = None):
        super().__init__(status, message, error_type, error_code=error_code)

    def __repr__(self) -> str:
        return f"ThreadError({self.status}, {self.error_type!r}, {self.error_code!r})"


def thread_not_found() -> ThreadError:
    """No thread is held for the answer a ``continue`` names (unknown,
    expired, evicted, or the store is unreachable): 404, replayed by the SDKs."""
    return ThreadError(
        404,
        "not_found_error",
        "No usable thread state was found for `thread.previous_message_id`. "
        'Replay the full conversation with `thread: {"type": "create"}`.',
        "thread_not_found",
    )


def already_continued() -> ThreadError:
    """The answer a ``continue`` names was continued already: 400, replayed."""
    return ThreadError(
        400,
        "invalid_request_error",
        "The response that `thread.previous_message_id` names has already been continued; "
        "continue from the thread's most recent response `id`.",
        "thread_already_continued",
    )


def continue_in_flight() -> ThreadError:
    """Another ``continue`` from the same answer has not finished: 400, replayed."""
    return ThreadError(
        400,
        "invalid_request_error",
        "Another request is still continuing from the same `thread.previous_message_id`.",
        "thread_continue_in_flight",
    )


def fingerprint_mismatch(fields: list[str]) -> ThreadError:
    """A ``continue`` sends a create-only field that differs from the thread's."""
    named = " and ".join(f"`{field}`" for field in fields)
    return ThreadError(
        400,
        "invalid_request_error",
        "{} differ{} from the value the thread was created with.".format(named, "" if len(fields) > 1 else "s"),
        "thread_fingerprint_mismatch",
    )


def _malformed(message: str) -> ThreadError:
    return ThreadError(400, "invalid_request_error", message)


# -- requests -------------------------------------------------------------------


class ThreadRequest(NamedTuple):
    """
    The ``thread`` field of a request.

    :ivar kind: :data:`CREATE` or :data:`CONTINUE`.
    :ivar previous_message_id: the answer a ``continue`` resumes from.
    """

    kind: str
    previous_message_id: str | None = None


def thread_of(body: Any) -> ThreadRequest | None:
    """
    Read the ``thread`` field of a Messages request body.

    :return: ``None`` when the body has no ``thread`` field (or ``null``).
    :raises ThreadError: 400 for a malformed one.
    """
    if not isinstance(body, dict):
        return None
    thread = body.get("thread")
    if thread is None:
        return None
    if not isinstance(thread, dict):
        raise _malformed("thread: Input should be a valid dictionary")
    kind = thread.get("type")
    if kind == CREATE:
        if "previous_message_id" in thread:
            raise _malformed("thread.previous_message_id: Extra inputs are not permitted")
        return ThreadRequest(CREATE)
    if kind == CONTINUE:
        previous = thread.get("previous_message_id")
        if previous is None:
            raise _malformed("thread.previous_message_id: Field required")
        if not isinstance(previous, str) or not previous:
            raise _malformed("thread.previous_message_id: Input should be a non-empty string")
        return ThreadRequest(CONTINUE, previous)
    raise _malformed("thread.type: Input should be 'create' or 'continue'")


def plain_request(body: dict) -> dict:
    """``body`` without its ``thread`` field (a shallow copy)."""
    plain = dict(body)
    plain.pop("thread", None)
    return plain


def upstream_thread_request(translated: dict, previous_message_id: str | None, new_messages: int) -> dict:
    """
    What an upstream that knows threads is sent for a thread's turn, once
    the whole (plain) request is translated (``translated``): the thread
    field again, and for a ``continue`` (``previous_message_id``) only the
    ``new_messages`` translated new messages, without ``system``/``tools``
    (which the upstream holds). A whole request translates every message
    exactly as the upstream's thread already holds it (a block's upstream id
    never changes on later turns), so the new messages fit the upstream's
    thread.
    """
    sent = dict(translated)
    if previous_message_id is None:
        sent["thread"] = {"type": CREATE}
    else:
        sent["thread"] = {"type": CONTINUE, "previous_message_id": previous_message_id}
        for name in CREATE_ONLY_FIELDS:
            sent.pop(name, None)
        messages = translated.get("messages") or []
        sent["messages"] = messages[len(messages) - new_messages:] if new_messages else []
    return sent


def without_threads_beta(header: str | None) -> str | None:
    """
    An ``anthropic-beta`` header value without :data:`THREADS_BETA`, for the
    plain request sent to an upstream that does not know threads.

    :return: ``None`` when nothing else is left.
    """
    if header is None:
        return None
    kept = [beta.strip() for beta in header.split(",") if beta.strip() and beta.strip() != THREADS_BETA]
    return ", ".join(kept) if kept else None


# -- the conversation kept under an answer's id ----------------------------------


class Conversation:
    """
    A thread as the relay holds it: the create-only fields of the ``create``
    (only those it sent) and every message up to and including the last
    answer, all as the client sent and received them.

    :ivar fields: ``system`` and/or ``tools``, when the ``create`` had them.
    :ivar messages: the whole history, ending with the answer.
    """

    __slots__ = ("fields", "messages")

    def __init__(self, fields: dict, messages: list):
        self.fields = fields
        self.messages = messages

    @classmethod
    def after(cls, request: dict, answer: dict) -> Conversation:
        """
        The conversation once ``answer`` was given to ``request``: the plain
        (create or rebuilt) request's create-only fields and messages, then
        the answer as an assistant message.

        :param request: a plain Messages request (:func:`plain_request`,
            :func:`rebuild_request`).
        :param answer: the whole answer message the client received.
        """
        fields = {name: request[name] for name in CREATE_ONLY_FIELDS if name in request}
        messages = list(request.get("messages") or ())
        messages.append({"role": "assistant", "content": answer.get("content", [])})
        return cls(fields, messages)

    def encode(self) -> bytes:
        """
        The bytes a store keeps: JSON in ASCII (other characters escaped),
        built through an ASCII string. A conversation with one character
        outside the BMP would otherwise be built through a string of four
        bytes a character, and these large temporaries, freed between the
        conversations kept, leave the heap fragmented (RSS measured at 1.8
        times the bytes kept, against 1.0 this way: bench/thread_memory.py).
        """
        value = {"v": _CONVERSATION_VERSION, "fields": self.fields, "messages": self.messages}
        return ujson.dumps(value, ensure_ascii=True, escape_forward_slashes=False).encode("ascii")

    @classmethod
    def decode(cls, data: bytes) -> Conversation:
        """
        Read :meth:`encode`'s bytes.

        :raises ValueError: for bytes that are not a conversation of this
            version (treated as "not found" by the relay).
        """
        value = ujson.loads(data)
        if (
            not isinstance(value, dict)
            or value.get("v") != _CONVERSATION_VERSION
            or not isinstance(value.get("fields"), dict)
            or not isinstance(value.get("messages"), list)
        ):
            raise ValueError("not a stored conversation")
        return cls(value["fields"], value["messages"])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Conversation):
            return NotImplemented
        return self.fields == other.fields and self.messages == other.messages

    def __repr__(self) -> str:
        return f"<Conversation {sorted(self.fields)}, {len(self.messages)} messages>"


def conversation_prefix(request: dict) -> bytes:
    """
    The bytes a store keeps for the conversation of the plain ``request``,
    but for their end: ``Conversation.after(request, answer).encode()`` is
    :func:`conversation_after` of them and the answer. Made once the request
    is, so that a turn holds these bytes rather than the parsed request
    (ten times larger), and keeping the answer costs a copy, not a
    serialisation of the whole conversation.
    """
    fields = {name: request[name] for name in CREATE_ONLY_FIELDS if name in request}
    data = Conversation(fields, list(request.get("messages") or ())).encode()
    # Without the messages list's "]" and the object's "}": the messages come last.
    return data[:-2]


def conversation_after(prefix: bytes, answer: dict) -> bytes:
    """The bytes :meth:`Conversation.encode` gives for the conversation of :func:`conversation_prefix` once ``answer`` was given."""
    message = {"role": "assistant", "content": answer.get("content", [])}
    data = ujson.dumps(message, ensure_ascii=True, escape_forward_slashes=False).encode("ascii")
    return b"".join((prefix, b"" if prefix.endswith(b"[") else b",", data, b"]}"))


def thread_request(body: dict, stored: bytes | None) -> tuple[dict, int]:
    """
    The plain request a thread request ``body`` stands for, and how many
    messages of it the client sent: for a ``create`` (``stored`` is
    ``None``) the body without its ``thread``; for a ``continue``, rebuilt
    from the ``stored`` conversation (:func:`rebuild_request`).

    :raises ThreadError: as :func:`rebuild_request`.
    :raises ValueError: for ``stored`` bytes that are not a conversation.
    """
    if stored is None:
        return plain_request(body), 0
    new = body.get("messages")
    return rebuild_request(body, Conversation.decode(stored)), len(new) if isinstance(new, list) else 0


def rebuild_request(body: dict, conversation: Conversation) -> dict:
    """
    The plain request a ``continue`` stands for: its own fields without
    ``thread``, the thread's create-only fields, and the thread's messages
    followed by the new ones (none after a ``pause_turn`` answer: the
    upstream then resumes the unfinished turn).

    :raises ThreadError: ``thread_fingerprint_mismatch`` when the
        ``continue`` sends a create-only field that differs from the
        thread's (the same value again is accepted); 400 when its
        ``messages`` is not a list.
    """
    changed = [
        name
        for name in CREATE_ONLY_FIELDS
        if name in body and body[name] != conversation.fields.get(name)
    ]
    if changed:
        raise fingerprint_mismatch(changed)
    new = body.get("messages", [])
    if not isinstance(new, list):
        raise _malformed("messages: Input should be a valid list")
    rebuilt = plain_request(body)
    for name in CREATE_ONLY_FIELDS:
        rebuilt.pop(name, None)
    rebuilt.update(conversation.fields)
    rebuilt["messages"] = conversation.messages + new
    return rebuilt


# -- the answer the client received ---------------------------------------------


class MessageAssembler:
    """
    Rebuild a whole message from its stream events, as the SDKs' accumulators
    do (text, tool input JSON, thinking and signature, citations, compaction
    content; ``message_delta`` stop reason, container and usage).

    :ivar message: the message so far (``None`` before ``message_start``).
    :ivar stopped: whether ``message_stop`` was seen.
    :ivar failed: whether an ``error`` event was seen, or an event that does
        not fit (then the message is not used).
    """

    def __init__(self) -> None:
        self.message: dict | None = None
        self.stopped = False
        self.failed = False
        self._json: dict[int, list[str]] = {}

    def event(self, name: str | None, payload: Any) -> None:
        """Take one parsed event (``name`` from its ``event:`` line, or its ``type``)."""
        if self.failed:
            return
        if isinstance(payload, dict):
            name = name or payload.get("type")
        try:
            self._take(name, payload)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            self.failed = True

    def result(self) -> dict | None:
        """The whole message, or ``None`` unless it ended with ``message_stop``
        and nothing failed."""
        if self.failed or not self.stopped or self.message is None:
            return None
        return self.message

    def _take(self, name: str | None, payload: Any) -> None:
        if name == "error":
            self.failed = True
            return
        if name == "message_start":
            self.message = dict(payload["message"])
            self.message["content"] = list(self.message.get("content") or ())
            self.message["usage"] = dict(self.message.get("usage") or {})
            return
        if name not in _STREAM_EVENTS:
            return  # ping, and event types added later
        message = self.message
        if message is None:
            raise ValueError("event before message_start")
        content = message["content"]
        if name == "content_block_start":
            index = payload["index"]
            if index != len(content):
                raise ValueError("content block out of order")
            content.append(dict(payload["content_block"]))
        elif name == "content_block_delta":
            index = payload["index"]
            self._delta(content[index], index, payload["delta"])
        elif name == "content_block_stop":
            index = payload["index"]
            parts = self._json.pop(index, None)
            if parts:
                content[index]["input"] = ujson.loads("".join(parts))
        elif name == "message_delta":
            delta = payload.get("delta") or {}
            for key in ("stop_reason", "stop_sequence", "stop_details", "container"):
                if key in delta and (key != "container" or delta[key] is not None):
                    message[key] = delta[key]
            for key in ("context_management", "input_transformations"):
                if payload.get(key) is not None:
                    message[key] = payload[key]
            usage = payload.get("usage") or {}
            message["usage"].update((key, value) for key, value in usage.items() if value is not None)
        else:
            self.stopped = True

    def _delta(self, block: dict, index: int, delta: dict) -> None:
        kind = delta["type"]
        if kind == "text_delta":
            block["text"] = block.get("text", "") + delta["text"]
        elif kind == "input_json_delta":
            self._json.setdefault(index, []).append(delta["partial_json"])
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + delta["thinking"]
        elif kind == "signature_delta":
            block["signature"] = delta["signature"]
        elif kind == "citations_delta":
            block["citations"] = list(block.get("citations") or ()) + [delta["citation"]]
        elif kind == "compaction_delta":
            block["content"] = delta.get("content")
            block["encrypted_content"] = delta.get("encrypted_content")


_STREAM_EVENTS = frozenset(
    ("content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop")
)


def _events(data: bytes):
    """``(name, data)`` of each complete SSE event in ``data``, any line ending."""
    text = data.decode("utf-8", "replace")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    blocks = text.split("\n\n")
    # What follows the last blank line is an event only if the stream ended
    # without one (a few recorded streams do) and it is whole.
    for block in blocks:
        name = None
        lines = []
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                lines.append(value)
        if lines:
            yield name, "\n".join(lines)


def assemble_stream(data: bytes) -> dict | None:
    """
    The whole message an SSE body streams, or ``None`` when the stream is
    not a complete message (cut before ``message_stop``, an ``error``
    event, an event that is not JSON or does not fit).
    """
    assembler = MessageAssembler()
    for name, text in _events(data):
        if name == "ping":
            continue
        try:
            payload = ujson.loads(text)
        except ValueError:
            return None
        assembler.event(name, payload)
        if assembler.failed:
            return None
    return assembler.result()


class AnswerRecorder:
    """
    Keeps the bytes of a streamed answer as they are written to the client,
    to rebuild the answer once the stream is over (:meth:`message`).

    Writing costs one list append per write (no parsing while the stream
    runs); past ``limit`` bytes the recorder gives up and keeps nothing, so
    an answer too large for the thread store costs no memory.

    :param limit: the most bytes kept.
    :ivar overflowed: whether the answer went past ``limit``.
    """

    def __init__(self, limit: int):
        self._limit = limit
        self._chunks: list[bytes] = []
        self._size = 0
        self.overflowed = False

    def write(self, data: bytes) -> None:
        """Record ``data``, the next bytes the client receives."""
        if self.overflowed:
            return
        self._size += len(data)
        if self._size > self._limit:
            self.overflowed = True
            self._chunks = []
            return
        self._chunks.append(data)

    def tee(self, write: Callable[[bytes], None]) -> Callable[[bytes], None]:
        """A ``write`` that passes ``data`` on to ``write`` and records it."""
        record = self.write

        def both(data: bytes) -> None:
            write(data)
            record(data)

        return both

    def message(self) -> dict | None:
        """The answer the recorded stream holds, or ``None`` (incomplete,
        failed, or over the limit)."""
        if self.overflowed:
            return None
        return assemble_stream(b"".join(self._chunks))
