# -*- test-case-name: tests.test_sse -*-
"""
Server-sent events as bytes: an incremental framer that cuts a stream into
raw events, and the readers of one event's name and data.

The framer never changes a byte: the events it returns, and the tail it
still holds, are always the input, whatever the split. The SSE gate
(:mod:`twisted_relay.sse`) streams an upstream answer through it; the demo
client reads the relay's answers with it.
"""

from __future__ import annotations

import re

from twisted_relay._json import to_json

__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "EventFramer",
    "EventTooLarge",
    "copy_range",
    "event_name",
    "event_name_at",
    "event_data_at",
    "parse_event",
    "sse_event",
]

#: The largest event accepted by default (8 MiB).
DEFAULT_MAX_EVENT_BYTES = 8 * 1024 * 1024

# The longest match first, so that a complete "\r\n" is one line ending.
_LINE_END = re.compile(rb"\r\n|\r|\n")
_CR = 13


class EventTooLarge(ValueError):
    """
    An event grew past the framer's maximum size.

    :ivar events: the complete events that preceded the oversized one in the
        same :meth:`EventFramer.feed` call, so that no byte is lost.
    """

    def __init__(self, size: int, limit: int, events: list[bytes] | None = None):
        super().__init__(
            "An event of at least %d bytes exceeds the limit of %d bytes." % (size, limit)
        )
        self.size = size
        self.limit = limit
        self.events = events or []


class EventFramer:
    """
    Cut a stream of bytes into raw SSE events, incrementally.

    An event is any run of lines ended by an empty line (a blank line with no
    event before it is an event of its own). Lines end in ``\\n``, ``\\r\\n``
    or ``\\r``. A raw event is returned exactly as received, its blank line
    included, so the concatenation of all events (and the tail still held)
    is always the input, whatever the split.

    One ambiguity is settled by waiting: a bare ``\\r`` at the end of the
    buffer that would end an event may be the first half of ``\\r\\n``, so
    that event is held until the next byte arrives (or :meth:`close`). The
    framing therefore never depends on where the stream was split; the cost
    is that, in a stream using bare ``\\r`` line endings, each event waits
    for the first byte of the next one.

    :param max_event_bytes: the largest event accepted; a larger one raises
        :class:`EventTooLarge`.

    :ivar buffer: the bytes held (read only): the events not yet dropped by
        :meth:`compact`, then the incomplete tail. It is the received chunk
        itself while nothing is held over, and a bytearray that grows in
        place once an event spans chunks.
    :ivar position: the offset in ``buffer`` of the first event not yet
        taken (read only).
    """

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES):
        self.max_event_bytes = max_event_bytes
        self.buffer: bytes | bytearray = b""
        self.position = 0
        self._line = 0  # the first byte of the current event's open line
        self._seen = 0  # bytes of the buffer already examined
        # Until a "\r" has been seen, events end exactly at "\n\n": the fast
        # path. Anthropic's streams never contain a raw "\r".
        self._cr = False
        # Set by close() or end(): no byte will come, so a final "\r" is a
        # whole line end.
        self._final = False
        # For next_marked, while the buffer stays as it is: the end of its
        # last complete event, 0 when events are to be taken one by one, -1
        # when not yet known.
        self._marked_last = -1

    @property
    def pending(self) -> bytes:
        """The bytes received but not yet returned as an event."""
        return bytes(self.buffer[self.position :])

    def feed(self, data: bytes) -> list[bytes]:
        """
        Add received bytes and return every event they complete.

        :raises EventTooLarge: when the event being read exceeds the limit;
            its ``events`` holds the complete events before it.
        """
        self.append(data)
        events = []
        buf = self.buffer
        try:
            while True:
                start = self.position
                end = self.next_end()
                if end < 0:
                    break
                events.append(copy_range(buf, start, end))
        except EventTooLarge as e:
            e.events = events
            raise
        self.compact()
        return events

    def close(self) -> list[bytes]:
        """
        Declare the end of the stream: return the events that only waited for
        the next byte (an event ended by a bare ``\\r``).

        Whatever remains in :attr:`pending` afterwards is an incomplete event.
        """
        self.end()
        return self.feed(b"")

    # -- without a copy per event: what the gate uses ------------------------
    #
    # The gate reads events in place: it appends a read, takes events as
    # offsets into ``buffer`` (next_end, next_marked), copies what it
    # writes, and drops what it has taken (compact).

    @property
    def line_ends_vary(self) -> bool:
        """Whether a ``\\r`` has been received: lines may end in more than ``\\n``."""
        return self._cr

    def append(self, data: bytes) -> None:
        """Add received bytes without taking events (see :meth:`next_end`)."""
        # (An int's membership is a plain byte search; a bytes' first fails
        # as an index, at the cost of an exception made and cleared.)
        if not self._cr and _CR in data:
            self._cr = True
        self._marked_last = -1
        if self.position == len(self.buffer):
            self.buffer = data
            self.position = self._line = self._seen = 0
        elif isinstance(self.buffer, bytearray):
            self.buffer += data
        else:
            self.buffer = bytearray(self.buffer)
            self.buffer += data

    def end(self) -> None:
        """No byte will come: an event ended by a bare ``\\r`` at the end is complete."""
        self._final = True

    def compact(self) -> None:
        """Drop the events taken so far, keeping the incomplete tail; offsets start over."""
        start = self.position
        if not start:
            return
        self._marked_last = -1
        if start == len(self.buffer):
            self.buffer = b""
            self.position = self._line = self._seen = 0
        else:
            if isinstance(self.buffer, bytearray):
                del self.buffer[:start]
            else:
                self.buffer = bytearray(self.buffer[start:])
            self.position = 0
            self._line -= start
            self._seen -= start

    def next_marked(self, markers: tuple[bytes, ...]) -> tuple[int, int]:
        """
        Take the complete events that surely hold none of ``markers`` and the
        next one after them, in one step: return where that next event starts
        and ends in ``buffer``, or ``(position, -1)`` when no event is
        complete. The events skipped lie between ``position`` before the
        call and the returned start.

        Events are skipped without being framed one by one (a ``find`` per
        marker) while no ``\\r`` has come, so that every ``\\n\\n`` ends
        an event, and while all the complete events held are together within
        the size limit of one; otherwise this is :meth:`next_end`. A marker
        should end in ``\\n``, so that it cannot straddle two events. The
        markers are searched in order, each search stopping at the nearest
        place found so far, and the next call starts after it; a marker
        absent from the rest of the buffer is searched to its end on every
        call that reaches it, so the marker that recurs in a buffer should
        come first.

        :raises EventTooLarge: as :meth:`next_end`.
        """
        start = self.position
        last = self._marked_last
        if last < 0:
            # The first call since the buffer changed: where the complete
            # events end, if they may be skipped.
            last = 0
            if not self._cr:
                end = self.buffer.rfind(b"\n\n", start) + 2
                # Skipped events are not checked one by one: only while all
                # of them together are within the size limit for one.
                if end > 1 and end - start <= self.max_event_bytes:
                    last = end
            self._marked_last = last
        if start < last:
            buf = self.buffer
            hit = last
            for marker in markers:
                at = buf.find(marker, start, hit)
                if at >= 0:
                    hit = at
            if hit == last:
                skip_to = last
            else:
                # The event holding the hit starts after the "\n\n" before it.
                skip_to = buf.rfind(b"\n\n", start, hit) + 2
                if skip_to < start + 2:
                    skip_to = start
            if skip_to != start:
                self.position = self._line = self._seen = start = skip_to
                if start == len(buf):
                    return start, -1
        return start, self.next_end()

    def next_end(self) -> int:
        """
        Take the next complete event: return its end offset in ``buffer``
        (it starts at ``position`` before the call), or -1 when none is
        complete.

        :raises EventTooLarge: when the event being read exceeds the limit.
        """
        buf = self.buffer
        start = self.position
        n = len(buf)
        if start == n:
            return -1
        if self._cr:
            end = self._next_end_slow(buf, start, n)
        elif buf[start] == 10:
            end = start + 1
        else:
            seen = self._seen
            p = buf.find(b"\n\n", start if seen <= start else seen - 1)
            if p < 0:
                # Only the new bytes can hold the open line's start.
                at = buf.rfind(b"\n", start if seen <= start else seen, n)
                if at >= 0:
                    self._line = at + 1
                self._seen = n
                end = -1
            else:
                end = p + 2
        if end < 0:
            if n - start > self.max_event_bytes:
                raise EventTooLarge(n - start, self.max_event_bytes)
            return -1
        if end - start > self.max_event_bytes:
            raise EventTooLarge(end - start, self.max_event_bytes)
        self.position = self._line = self._seen = end
        return end

    def _next_end_slow(self, buf: bytes | bytearray, start: int, n: int) -> int:
        line = self._line
        # Bytes before _seen - 1 hold no line ending of the open line; the
        # last one examined may be a "\r" that waited for its partner.
        i = max(line, self._seen - 1)
        search = _LINE_END.search
        while True:
            m = search(buf, i)
            if m is None:
                break
            at = m.start()
            if at == n - 1 and buf[at] == _CR and not self._final:
                break
            if at == line:
                return m.end()
            line = i = m.end()
        self._line = line
        self._seen = n
        return -1


def copy_range(buf: bytes | bytearray, start: int, end: int) -> bytes:
    """``bytes(buf[start:end])`` with one copy at most (none for a whole ``bytes``)."""
    if type(buf) is bytes:
        return buf[start:end]
    return bytes(memoryview(buf)[start:end])


def event_name_at(
    buf: bytes | bytearray, start: int, end: int, cr: bool = True
) -> bytes | None:
    """
    The ``event`` field of the raw event in ``buf[start:end]``.

    The common shape (``event:`` on the first line, no other ``event`` line)
    costs three ``find`` calls, five when ``cr`` says the buffer may hold a
    ``\\r``; anything else falls back to a line parse.
    """
    if buf.startswith(b"event:", start):
        eol = buf.find(b"\n", start, end)
        if eol < 0:
            eol = end
        if cr:
            at = buf.find(b"\r", start, eol)
            if at >= 0:
                eol = at
        if buf.find(b"\nevent", eol, end) < 0 and not (cr and buf.find(b"\revent", eol, end) >= 0):
            value_start = start + 6
            if value_start < eol and buf[value_start] == 32:
                value_start += 1
            name = buf[value_start:eol]
            if type(name) is not bytes:
                name = bytes(name)
            return name or None
    name = None
    for line in bytes(buf[start:end]).splitlines():
        if line.startswith(b":"):
            continue
        field, _, value = line.partition(b":")
        if field == b"event":
            name = value[1:] if value.startswith(b" ") else value
    return name or None


def event_name(raw: bytes) -> bytes | None:
    """
    The ``event`` field of a raw event, or ``None`` when it has none (or an
    empty one, which the SDKs treat alike).

    Reads the ``event:`` line only, not the data: cheap enough to call on
    every event. When several ``event`` lines occur the last one wins, as in
    the SDKs.
    """
    return event_name_at(raw, 0, len(raw))


def event_data_at(buf: bytes | bytearray, start: int, end: int, cr: bool = True) -> bytes:
    """
    The data of the raw event in ``buf[start:end]``, as :func:`parse_event`
    gives it, in UTF-8 bytes (``json`` and ``ujson`` read them as they are).

    The common shape (one ``data`` line, the event's last, after an
    ``event`` line or alone, no ``\\r`` in the buffer) is a slice found with
    three ``find`` calls; anything else is :func:`parse_event`'s.

    :raises UnicodeDecodeError: as :func:`parse_event` does, when the event
        takes its path and is not UTF-8.
    """
    if not cr and end - start > 2 and buf[end - 2] == 10:
        at = buf.rfind(b"\n", start, end - 2)
        line = start if at < 0 else at + 1
        # No other line that may be a data line ("data" anywhere before the last line).
        if buf.startswith(b"data:", line) and buf.find(b"data", start, line) < 0:
            value = line + 5
            if value < end - 2 and buf[value] == 32:
                value += 1
            data = buf[value : end - 2]
            return data if type(data) is bytes else bytes(data)
    return parse_event(copy_range(buf, start, end))[1].encode("utf-8")


def sse_event(name: bytes, payload) -> bytes:
    """An event named ``name`` whose data is ``payload`` as JSON (:func:`~twisted_relay._json.to_json`)."""
    return b"event: " + name + b"\ndata: " + to_json(payload) + b"\n\n"


def parse_event(raw: bytes) -> tuple[str | None, str]:
    """
    Parse a raw event the way the Anthropic SDKs do.

    Lines starting with ``:`` are comments; a field is split at its first
    ``:`` and one leading space is stripped from the value; the last
    ``event`` wins; ``data`` lines are joined with ``\\n``.

    :return: ``(event name or None, data)``.
    """
    name = None
    data = []
    for line in raw.splitlines():
        text = line.decode("utf-8")
        if text.startswith(":"):
            continue
        field, _, value = text.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "event":
            name = value
        elif field == "data":
            data.append(value)
    return name or None, "\n".join(data)
