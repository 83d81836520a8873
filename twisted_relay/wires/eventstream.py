# -*- test-case-name: tests.test_eventstream -*-
"""
Amazon's event stream (``application/vnd.amazon.eventstream``), the framing
of Bedrock's InvokeModelWithResponseStream answer, read as Anthropic's
server-sent events for the SSE gate. Bottom to top:

- :class:`FrameDecoder` (pure): frames from reads split anywhere, both
  CRC32s checked, lengths bounded (smithy's ``amazon-eventstream.rst``).
- :class:`BedrockToSSE` (pure): ``chunk`` frames as Anthropic's events,
  invocation metrics into the usage, exception frames as ``error`` events;
  :func:`bedrock_error` maps Bedrock's error names, streamed or not.
- :class:`EventStreamToSSE`: the Protocol that ``deliverBody`` feeds, in
  front of the gate (:class:`~twisted_relay.sse.SSEGate`), which it hands
  the events whole (``eventsReceived``): nothing is framed again.
"""

from __future__ import annotations

import re
import struct
from binascii import Error as BinasciiError
from binascii import a2b_base64
from functools import lru_cache
from typing import Any, NamedTuple
from zlib import crc32

import ujson
from twisted.internet.interfaces import IProtocol, ITransport
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from twisted_relay._json import to_json
from twisted_relay.errors import ERROR_TYPES, sse_error_event

__all__ = [
    "CONTENT_TYPE", "MAX_HEADERS_BYTES", "MAX_HEADER_VALUE_BYTES", "MAX_PAYLOAD_BYTES", "PROMPT_TOO_LONG",
    "USAGE_OF_METRIC", "BedrockError", "BedrockToSSE", "EventStreamError", "EventStreamToSSE", "Frame",
    "FrameDecoder", "bedrock_error",
]

#: The media type of an event-stream body.
CONTENT_TYPE = b"application/vnd.amazon.eventstream"
#: The largest payload of one frame (botocore's limit: 24 MiB).
MAX_PAYLOAD_BYTES = 24 * 1024 * 1024
#: The largest headers section of one frame (128 KiB).
MAX_HEADERS_BYTES = 128 * 1024
#: The largest value of one ``bytes`` or ``string`` header.
MAX_HEADER_VALUE_BYTES = 32767

#: Bedrock's invocation metric -> the Anthropic ``usage`` count it reports.
USAGE_OF_METRIC = {
    "inputTokenCount": "input_tokens", "outputTokenCount": "output_tokens",
    "cacheReadInputTokenCount": "cache_read_input_tokens", "cacheWriteInputTokenCount": "cache_creation_input_tokens",
}

_PRELUDE = struct.Struct("!III")
_PRELUDE_BYTES = 12
# The prelude and the message CRC: a frame with no headers and no payload.
_FRAME_OVERHEAD = 16
_UINT32 = struct.Struct("!I")
_UINT16 = struct.Struct("!H")
# Fixed-size header values by type; 8 is a timestamp in ms.
_FIXED = {kind: struct.Struct(code) for kind, code in ((2, "!b"), (3, "!h"), (4, "!i"), (5, "!q"), (8, "!q"))}
_UUID_BYTES = 16
# Headers sections up to this size are kept once read, for every stream.
_KEPT_HEADERS_BYTES = 1024
# Frames up to this size have their CRC computed on a copy (cheaper than a view).
_COPIED_BYTES = 65536


# -- frames ----------------------------------------------------------------------


class EventStreamError(ValueError):
    """
    Bytes that are no event stream: a checksum that does not match, a length
    past its limit, a header that runs past its section. The message is one
    line and never holds the payload.

    :ivar frames: the frames decoded whole before the fault in the same
        :meth:`FrameDecoder.feed` call, so that none is lost.
    """

    def __init__(self, message: str, frames: list[Frame] | None = None):
        super().__init__(message)
        self.frames = frames or []


class Frame(NamedTuple):
    """
    One event-stream message: its headers (name -> ``bool``, ``int``
    (integers and timestamps in milliseconds), ``bytes`` (byte arrays and
    UUIDs) or ``str``) and its payload. The headers dict may be shared with
    other frames whose headers are the same bytes: read it, never change it.
    """

    headers: dict[str, Any]
    payload: bytes


# A Frame made without NamedTuple's keyword handling: half the cost, per frame.
_new_frame = tuple.__new__


class FrameDecoder:
    """
    Decode an event stream incrementally: :meth:`feed` takes each read, cut
    anywhere, and returns the frames it completes.

    The bytes held are one buffer read at an offset: a read that completes
    no frame costs a look at the prelude, and the bytes taken are dropped
    at the next call (the tail kept is less than one frame), so a burst of
    many frames or a frame spread over many reads costs time in proportion
    to its bytes.

    :param max_payload_bytes: the largest payload of one frame.
    :param max_headers_bytes: the largest headers section of one frame.
    :param max_header_value_bytes: the largest ``bytes`` or ``string`` value.
    """

    def __init__(self, max_payload_bytes: int = MAX_PAYLOAD_BYTES, max_headers_bytes: int = MAX_HEADERS_BYTES,
                 max_header_value_bytes: int = MAX_HEADER_VALUE_BYTES):
        self.max_payload_bytes = max_payload_bytes
        self.max_headers_bytes = max_headers_bytes
        self.max_header_value_bytes = max_header_value_bytes
        self._buffer: bytes | bytearray = b""
        self._position = 0
        self._failure: EventStreamError | None = None
        self._last_header_bytes = b""
        self._last_headers: dict[str, Any] = {}

    @property
    def pending(self) -> int:
        """How many bytes are held: a frame begun and not yet complete."""
        return len(self._buffer) - self._position

    def feed(self, data: bytes) -> list[Frame]:
        """
        Add a read and return the frames it completes, in order.

        :raises EventStreamError: on bytes that are no event stream (its
            ``frames`` holds those decoded before them); every later call
            raises it again.
        """
        buf, spans, fault = self.read(data)
        frames = [_new_frame(Frame, (headers, bytes(buf[start:end]))) for headers, start, end in spans]
        if fault is not None:
            fault.frames = frames
            raise fault
        return frames

    def read(self, data: bytes) -> tuple[bytes | bytearray, list[tuple[dict[str, Any], int, int]], EventStreamError | None]:
        """
        Add a read and find the frames it completes, without copying them:
        the buffer, each frame as its headers and its payload's start and
        end in the buffer (read it before the next call, which may reuse
        the buffer), and the fault that ended the bytes read (``None``: no
        fault; once a fault is found, every later call gives it again).
        """
        if self._failure is not None:
            return b"", [], EventStreamError(str(self._failure))
        buf, position = self._buffer, self._position
        if position == len(buf):
            buf, position = data, 0
        elif data:
            # The bytes of the frames taken by the call before go now.
            if type(buf) is bytearray:
                del buf[:position]
            else:
                buf = bytearray(memoryview(buf)[position:])
            position = 0
            buf += data
        spans: list[tuple[dict[str, Any], int, int]] = []
        n = len(buf)
        view = None
        try:
            while n - position >= _PRELUDE_BYTES:
                total, headers_length, prelude_crc = _PRELUDE.unpack_from(buf, position)
                computed = crc32(buf[position : position + 8])
                if computed != prelude_crc:
                    raise EventStreamError(
                        "the prelude's checksum does not match (0x%08x sent, 0x%08x computed)"
                        % (prelude_crc, computed)
                    )
                payload_length = total - _FRAME_OVERHEAD - headers_length
                if not 0 <= payload_length <= self.max_payload_bytes or headers_length > self.max_headers_bytes:
                    self._refuse_lengths(total, headers_length)
                end = position + total
                if end > n:
                    break
                # botocore's reading: the CRC of what follows the prelude's
                # CRC, from it. A small frame is cheaper to copy than to view.
                if total <= _COPIED_BYTES:
                    computed = crc32(buf[position + 8 : end - 4], prelude_crc)
                else:
                    if view is None:
                        view = memoryview(buf)
                    computed = crc32(view[position + 8 : end - 4], prelude_crc)
                if computed != _UINT32.unpack_from(buf, end - 4)[0]:
                    raise EventStreamError(
                        "the message's checksum does not match (0x%08x sent, 0x%08x computed)"
                        % (_UINT32.unpack_from(buf, end - 4)[0], computed)
                    )
                headers_end = position + _PRELUDE_BYTES + headers_length
                header_bytes = buf[position + _PRELUDE_BYTES : headers_end]
                if header_bytes != self._last_header_bytes:
                    read = _kept_headers if headers_length <= _KEPT_HEADERS_BYTES else _parse_headers
                    self._last_header_bytes = bytes(header_bytes)
                    self._last_headers = read(self._last_header_bytes, self.max_header_value_bytes)
                spans.append((self._last_headers, headers_end, end - 4))
                position = end
        except EventStreamError as e:
            self._failure = e
            self._buffer, self._position = b"", 0
            return buf, spans, e
        finally:
            # A bytearray with a view on it cannot shrink.
            if view is not None:
                view.release()
        if position == n:
            # Nothing is pending: the next read starts a buffer of its own.
            self._buffer, self._position = b"", 0
        else:
            self._buffer, self._position = buf, position
        return buf, spans, None

    def _refuse_lengths(self, total: int, headers_length: int) -> None:
        payload_length = total - _FRAME_OVERHEAD - headers_length
        if total < _FRAME_OVERHEAD:
            why = "a frame says it is %d bytes long, less than the 16 of an empty one" % (total,)
        elif headers_length > self.max_headers_bytes:
            why = "a frame's headers are %d bytes, past the limit of %d" % (headers_length, self.max_headers_bytes)
        elif payload_length < 0:
            why = "a frame's headers (%d bytes) do not fit in its length (%d bytes)" % (headers_length, total)
        else:
            why = "a frame's payload is %d bytes, past the limit of %d" % (payload_length, self.max_payload_bytes)
        raise EventStreamError(why)


def _parse_headers(data: bytes, max_header_value_bytes: int) -> dict[str, Any]:
    """A frame's headers section, read (:class:`EventStreamError` for one not well formed)."""
    headers: dict[str, Any] = {}
    n = len(data)
    i = 0
    while i < n:
        name_length = data[i]
        i += 1
        if name_length == 0 or i + name_length + 1 > n:
            raise EventStreamError("a header's name runs past the headers' end")
        try:
            name = data[i : i + name_length].decode("utf-8")
        except UnicodeDecodeError:
            raise EventStreamError("a header's name is not UTF-8")
        i += name_length
        kind = data[i]
        i += 1
        fixed = _FIXED.get(kind)
        if kind == 0 or kind == 1:
            size = 0
        elif fixed is not None:
            size = fixed.size
        elif kind == 9:
            size = _UUID_BYTES
        elif kind == 6 or kind == 7:
            if i + 2 > n:
                raise EventStreamError("the value of header %r runs past the headers' end" % name)
            (size,) = _UINT16.unpack_from(data, i)
            i += 2
            if size > max_header_value_bytes:
                raise EventStreamError(
                    "the value of header %r is %d bytes, past the limit of %d"
                    % (name, size, max_header_value_bytes)
                )
        else:
            raise EventStreamError("header %r has the unknown type %d" % (name, kind))
        if i + size > n:
            raise EventStreamError("the value of header %r runs past the headers' end" % name)
        if size == 0 and kind < 2:
            value: Any = kind == 0
        elif fixed is not None:
            (value,) = fixed.unpack_from(data, i)
        elif kind == 7:
            try:
                value = data[i : i + size].decode("utf-8")
            except UnicodeDecodeError:
                raise EventStreamError("the string header %r is not UTF-8" % name)
        else:
            value = data[i : i + size]
        i += size
        if name in headers:
            raise EventStreamError("header %r comes twice" % name)
        headers[name] = value
    return headers


# Small headers sections, kept once read for every stream (Bedrock's chunk
# frames all carry the same headers): the dict is shared, never changed.
_kept_headers = lru_cache(maxsize=32)(_parse_headers)


# -- Bedrock's errors ------------------------------------------------------------------


class BedrockError(NamedTuple):
    """
    A Bedrock error as Anthropic would have answered it: the HTTP ``status``,
    the ``error.type`` and the ``message``.
    """

    status: int
    error_type: str
    message: str


# Bedrock's error names, first letter lowered (the stream's exception frames
# write them so, its HTTP errors' ``x-amzn-ErrorType`` with a capital) ->
# (status, error.type). The model's errors go by the model's own status.
_ERRORS = {
    "validationException": (400, "invalid_request_error"),
    "throttlingException": (429, "rate_limit_error"),
    "serviceQuotaExceededException": (429, "rate_limit_error"),
    "serviceUnavailableException": (529, "overloaded_error"),
    "modelNotReadyException": (529, "overloaded_error"),
    "modelTimeoutException": (504, "timeout_error"),
    "internalServerException": (500, "api_error"),
    "accessDeniedException": (403, "permission_error"),
    "unrecognizedClientException": (403, "permission_error"),
    "invalidSignatureException": (403, "permission_error"),
    "expiredTokenException": (403, "permission_error"),
    "resourceNotFoundException": (404, "not_found_error"),
}
_MODEL_ERRORS = frozenset({"modelErrorException", "modelStreamErrorException"})
_INPUT_TOO_LONG = re.compile(r"input is too long", re.IGNORECASE)
#: Anthropic's wording for a prompt past the model's context (Claude Code compacts on it).
PROMPT_TOO_LONG = "prompt is too long"


def bedrock_error(
    error_name: str | None, message: str | None, original_status: Any = None, status: int | None = None
) -> BedrockError:
    """
    Map a Bedrock error to Anthropic's status, type and message.

    :param error_name: the error's name, as an exception frame's
        ``:exception-type`` (``throttlingException``) or an HTTP answer's
        ``x-amzn-ErrorType`` (``ThrottlingException``, anything from a ``:``
        on is cut) writes it.
    :param message: Bedrock's message, kept verbatim; a validation error
        saying "Input is too long" is put in Anthropic's words first
        (``prompt is too long: <Bedrock's message>``), so that Claude Code
        compacts.
    :param original_status: the model's own status, which a model error
        (``ModelErrorException``, ``modelStreamErrorException``) carries as
        ``originalStatusCode``: 529 is ``overloaded_error``, 429
        ``rate_limit_error``, anything else ``api_error`` (500).
    :param status: the HTTP status Bedrock answered with, for a name not
        known here (the type follows it); ``None``: 500.
    """
    name = (error_name or "").partition(":")[0].strip()
    key = name[:1].lower() + name[1:]
    text = message if isinstance(message, str) and message else (name or "Bedrock reported an error.")
    if key in _MODEL_ERRORS:
        if original_status == 529:
            return BedrockError(529, "overloaded_error", text)
        if original_status == 429:
            return BedrockError(429, "rate_limit_error", text)
        return BedrockError(500, "api_error", text)
    known = _ERRORS.get(key)
    if known is None:
        if status in ERROR_TYPES:
            return BedrockError(status, ERROR_TYPES[status], text)
        if status is not None and 400 <= status < 500:
            return BedrockError(400, "invalid_request_error", text)
        return BedrockError(500, "api_error", text)
    status, error_type = known
    if key == "validationException" and _INPUT_TOO_LONG.search(text) and PROMPT_TOO_LONG not in text:
        text = "%s: %s" % (PROMPT_TOO_LONG, text)
    return BedrockError(status, error_type, text)


# -- Bedrock's frames as Anthropic's events -------------------------------------------

_METRICS_KEY = "amazon-bedrock-invocationMetrics"
_MESSAGE_START = b"message_start"
_MESSAGE_DELTA = b"message_delta"
_MESSAGE_STOP = b"message_stop"
_CONTENT_BLOCK_DELTA = b"content_block_delta"
_DELTA_FIRST = b'{"type":"content_block_delta"'
_DELTA_FIRST_BYTES = len(_DELTA_FIRST)
# The events read for the usage and the invocation metrics: parsed.
_USAGE_EVENTS = frozenset((_MESSAGE_START, _MESSAGE_DELTA, _MESSAGE_STOP))
# An Anthropic event's JSON names its type first, as Bedrock sends it: the
# name is read without parsing the rest. Anything else is parsed.
_TYPE_FIRST = re.compile(rb'\{"type":"([A-Za-z0-9_]+)"')
_EVENT_NAME = re.compile(r"[A-Za-z0-9_]+")
# How Bedrock begins a chunk's payload: its base64 read without parsing.
_CHUNK_FIRST = b'{"bytes":"'
_CHUNK_FIRST_BYTES = len(_CHUNK_FIRST)
# A malformed stream's error, and the longest text of an exception's payload
# that is not JSON kept in the message.
_MALFORMED = "The upstream's event stream was malformed: %s"
_NOT_BASE64 = "a chunk's \"bytes\" is not base64"
_MAX_TEXT = 1000
_RELAY_FAILED = "The relay failed while reading the upstream's event stream."


class _Malformed(Exception):
    """A chunk whose event cannot be read (the stream ends with an error)."""


class BedrockToSSE:
    """
    Turn Bedrock's event stream into Anthropic's events, read by read: as
    SSE bytes (:meth:`feed`), or as the gate takes them (:meth:`events`).

    Each ``chunk`` event frame becomes ``event: <type>`` and ``data:`` with
    the event's JSON as Bedrock encoded it (the padding ``p`` dropped; a
    JSON that holds a raw line end is written again, compact). As on the
    Anthropic wire, an event's JSON is not parsed, but for ``message_start``,
    ``message_delta`` and a ``message_stop`` with metrics. Frames of other
    event types are skipped, as the SDKs skip union members they do not know.

    Usage: ``message_stop`` comes with Bedrock's invocation metrics, which
    leave the event; each of their counts (:data:`USAGE_OF_METRIC`) that no
    event reported (``message_start``'s usage, ``message_delta``'s, a
    ``null`` being no report) is laid into the ``message_delta`` usage,
    never over a count an event reported. Since ``message_delta`` comes
    before ``message_stop``, a ``message_delta`` is held until the next
    frame arrives (at most that one event; :meth:`end` gives it up when the
    stream ends first).

    An exception frame (``:message-type`` ``exception``, or the unmodeled
    ``error`` with ``:error-code`` and ``:error-message``) becomes an
    Anthropic ``error`` event (:func:`bedrock_error`) and ends the stream;
    so do bytes that are no event stream, as an ``api_error`` ("The
    upstream's event stream was malformed: ..."). Nothing is read after.

    :ivar ended: whether an error event has ended the stream.
    :ivar error: the :class:`BedrockError` an exception frame reported.
    :ivar malformed: why the stream was malformed, or ``None``.
    :ivar invocation_metrics: the metrics Bedrock sent, as sent.
    """

    def __init__(self, max_payload_bytes: int = MAX_PAYLOAD_BYTES):
        self._decoder = FrameDecoder(max_payload_bytes)
        self._chunk_headers: dict | None = None
        self._held: dict | None = None
        self._held_bytes = b""
        self._reported: set[str] = set()
        self.ended = False
        self.error: BedrockError | None = None
        self.malformed: str | None = None
        self.invocation_metrics: dict | None = None

    @property
    def pending(self) -> int:
        """Bytes of a frame begun and not complete."""
        return self._decoder.pending

    def feed(self, data: bytes) -> bytes:
        """The SSE bytes of every event the read completes (``b""`` for none)."""
        return b"".join([raw for _, _, raw in self.events(data)])

    def events(self, data: bytes) -> list[tuple[bytes, dict | None, bytes]]:
        """The events the read completes, as ``SSEGate.eventsReceived`` takes them (payload ``None``: not parsed)."""
        if self.ended:
            return []
        buf, frames, error = self._decoder.read(data)
        fault = None if error is None else str(error)
        out: list[tuple[bytes, dict | None, bytes]] = []
        for headers, start, end in frames:
            try:
                # The decoder gives frames with the same headers the same dict.
                if headers is not self._chunk_headers:
                    if headers.get(":event-type") != "chunk" or headers.get(":message-type") != "event":
                        self._other(headers, bytes(buf[start:end]), out)
                        if self.ended:
                            return out
                        continue
                    self._chunk_headers = headers
                # Bedrock writes "bytes" first, its base64 holding no quote
                # nor backslash: read in place; anything else is parsed.
                first = start + _CHUNK_FIRST_BYTES
                close = buf.find(b'"', first, end) if buf[start:first] == _CHUNK_FIRST else -1
                if close > 0 and buf.find(b"\\", first, close) < 0:
                    raw = a2b_base64(buf[first:close])
                else:
                    raw = _event_json(bytes(buf[start:end]))
                if raw[:_DELTA_FIRST_BYTES] == _DELTA_FIRST:  # the commonest, named without the pattern
                    name = _CONTENT_BLOCK_DELTA
                else:
                    typed = _TYPE_FIRST.match(raw)
                    name = None if typed is None else typed[1]
                # Parsed: the events read for the usage, and any whose JSON
                # holds a line end (allowed between JSON's tokens, it would
                # end the SSE event early; find, not `in`: on Python 3.11 a
                # bytes `in` costs an exception). The rest pass on unparsed.
                if name is None or name in _USAGE_EVENTS or raw.find(b"\n") >= 0 or raw.find(b"\r") >= 0:
                    self._parsed_chunk(raw, out)
                    continue
                if self._held is not None:
                    self._release(out)
                out.append((name, None, b"".join((b"event: ", name, b"\ndata: ", raw, b"\n\n"))))
            except _Malformed as e:
                fault = str(e)
                break
            except BinasciiError:
                fault = _NOT_BASE64
                break
        if fault is not None:
            self.malformed = fault
            self._end(out, "api_error", _MALFORMED % (fault,))
        return out

    def end(self) -> list[tuple[bytes, dict | None, bytes]]:
        """The stream has ended: the ``message_delta`` still held, if any, as :meth:`events` gives it."""
        out: list[tuple[bytes, dict | None, bytes]] = []
        self._release(out)
        return out

    # -- one frame -------------------------------------------------------------

    def _other(self, headers: dict[str, Any], payload: bytes, out: list) -> None:
        kind = headers.get(":message-type")
        if kind == "exception":
            self._exception(headers.get(":exception-type"), payload, out)
        elif kind == "error":
            code, text = headers.get(":error-code"), headers.get(":error-message")
            error = bedrock_error(code if isinstance(code, str) else None, text if isinstance(text, str) else None)
            self.error = error
            self._end(out, error.error_type, error.message)

    def _parsed_chunk(self, raw: bytes, out: list) -> None:
        """A chunk's event that is parsed: one with usage or metrics, or one whose JSON is written again."""
        event = _parse_event(raw)
        name = event["type"].encode("utf-8")
        if raw.find(b"\n") >= 0 or raw.find(b"\r") >= 0:
            raw = to_json(event)
        if name == _MESSAGE_STOP and _METRICS_KEY in event:
            metrics = event.pop(_METRICS_KEY, None)
            if isinstance(metrics, dict):
                self.invocation_metrics = metrics
            raw = to_json(event)
        if self._held is not None:
            self._release(out)
        if name == _MESSAGE_DELTA:
            self._note_reported(event.get("usage"))
            self._held, self._held_bytes = event, raw
            return
        if name == _MESSAGE_START:
            message = event.get("message")
            if isinstance(message, dict):
                self._note_reported(message.get("usage"))
        out.append((name, event, b"".join((b"event: ", name, b"\ndata: ", raw, b"\n\n"))))

    def _note_reported(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self._reported.update(name for name, value in usage.items() if value is not None)

    def _release(self, out: list) -> None:
        """Write the held ``message_delta``, with the metrics' counts no event reported."""
        event = self._held
        if event is None:
            return
        self._held = None
        raw = self._held_bytes
        metrics = self.invocation_metrics
        usage = event.get("usage")
        if isinstance(metrics, dict) and (usage is None or isinstance(usage, dict)):
            reported = self._reported
            unreported = {USAGE_OF_METRIC[metric]: count for metric, count in metrics.items()
                          if metric in USAGE_OF_METRIC and USAGE_OF_METRIC[metric] not in reported
                          and type(count) is int and count >= 0}
            if unreported:
                if usage is None:
                    usage = event["usage"] = {}
                usage.update(unreported)
                self._reported.update(unreported)
                raw = to_json(event)
        out.append((_MESSAGE_DELTA, event, b"event: " + _MESSAGE_DELTA + b"\ndata: " + raw + b"\n\n"))

    def _exception(self, exception_type: Any, payload: bytes, out: list) -> None:
        message, original_status = None, None
        try:
            body = ujson.loads(payload)
        except ValueError:
            body = None
            text = payload[:_MAX_TEXT].decode("utf-8", "replace").strip()
            message = " ".join(text.split()) or None
        if isinstance(body, dict):
            message = body.get("message", body.get("Message"))
            if not isinstance(message, str) or not message:
                message = body.get("originalMessage")
            original_status = body.get("originalStatusCode")
        error = bedrock_error(exception_type if isinstance(exception_type, str) else None,
                              message if isinstance(message, str) else None, original_status)
        self.error = error
        self._end(out, error.error_type, error.message)

    def _end(self, out: list, error_type: str, message: str) -> None:
        self._release(out)
        self.ended = True
        out.append((b"error", None, sse_error_event(error_type, message)))


def _event_json(payload: bytes) -> bytes:
    """The Anthropic event a chunk's payload carries, as its JSON bytes, the payload parsed."""
    try:
        chunk = ujson.loads(payload)
    except ValueError:
        raise _Malformed("a chunk's payload is not JSON")
    encoded = chunk.get("bytes") if isinstance(chunk, dict) else None
    if not isinstance(encoded, str):
        raise _Malformed("a chunk's payload has no \"bytes\" text")
    try:
        return a2b_base64(encoded)
    except (BinasciiError, ValueError):
        raise _Malformed(_NOT_BASE64)


def _parse_event(raw: bytes) -> dict:
    try:
        event = ujson.loads(raw)
    except ValueError:
        raise _Malformed("a chunk's event is not JSON")
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise _Malformed("a chunk's event is not an object with a \"type\"")
    if not _EVENT_NAME.fullmatch(event["type"]):
        raise _Malformed("a chunk's event type is not a name")
    return event


# -- the Protocol ----------------------------------------------------------------------


class EventStreamToSSE(Protocol):
    """
    Read a Bedrock event-stream body and feed its events to ``inner`` (the
    SSE gate): give this to ``response.deliverBody``.

    Each read's complete events reach the gate in one call, whole
    (:meth:`BedrockToSSE.events` to ``eventsReceived``: it frames and
    searches nothing again); a protocol without it gets their SSE bytes. A
    read that completes none still reaches it (its idle timer hears the
    upstream is alive). The transport is the inner protocol's too, so a
    slow or departed client's pause or stop reaches the upstream. A
    malformed stream ends with an ``api_error`` event and the upstream
    stopped; the gate ends the client's stream as one that reported its
    own error. See :class:`BedrockToSSE` for the rest.

    :param inner: the protocol that reads the events, e.g. an ``SSEGate``.
    :param max_payload_bytes: the largest frame payload accepted.

    :ivar stream: the :class:`BedrockToSSE` (its ``error``,
        ``invocation_metrics``, ``malformed``).
    """

    log = Logger()

    def __init__(self, inner: IProtocol, max_payload_bytes: int = MAX_PAYLOAD_BYTES):
        self._inner = inner
        self._events_received = getattr(inner, "eventsReceived", None)
        self.stream = BedrockToSSE(max_payload_bytes)
        self._failed = False

    def makeConnection(self, transport: ITransport) -> None:
        """Connect, and connect the inner protocol to the same transport."""
        Protocol.makeConnection(self, transport)
        self._inner.makeConnection(transport)

    def dataReceived(self, data: bytes) -> None:
        """Decode a read and pass on its events in one call."""
        stream = self.stream
        if stream.ended or self._failed:
            return
        try:
            events = stream.events(data)
        except Exception:
            # A bug of ours: the client hears of it as of a malformed stream.
            self.log.failure("Reading an upstream's event stream failed")
            self._failed = True
            events = [(b"error", None, sse_error_event("api_error", _RELAY_FAILED))]
        self._hand_on(events)
        if stream.malformed is not None or self._failed:
            # Nothing more is read (the stream has ended): stop the upstream.
            self.transport.stopProducing()

    def _hand_on(self, events: list[tuple[bytes, dict | None, bytes]]) -> None:
        if self._events_received is not None:
            self._events_received(events)
        else:
            self._inner.dataReceived(b"".join([raw for _, _, raw in events]))

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Pass on the ``message_delta`` still held, then the end."""
        tail = [] if self._failed else self.stream.end()
        if tail:
            self._hand_on(tail)
        self._inner.connectionLost(reason)
