# -*- test-case-name: tests.test_faults -*-
"""
A fake upstream that fails on purpose, and a raw client that does too.

The simulated upstream (:mod:`twisted_relay.simulated`) is a faithful
Anthropic backend. :class:`FaultyUpstream` is not: it serves on a real
socket on 127.0.0.1 and answers each request with the next :class:`Fault`
of a script the test chose. It resets connections before answering, sends
headers and then nothing, cuts streams after some events or in the middle
of one, sends garbage, oversized events, error statuses with and without
``retry-after``, goes silent mid-stream or trickles its bytes. It records
every request it received, whether and when its connection was lost, and
how many connections are open, so that a test can assert that a retry
happened (or did not) and that nothing was left open.

:class:`RawClient` is the client-side counterpart: an HTTP/1.1 client on a
bare ``Protocol`` that can trickle its request, stop half-way or hang up
after some bytes of the answer; :func:`parse_response` reads what it got.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import ujson
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.protocol import Protocol
from twisted.web.http import HTTPChannel
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

__all__ = [
    "Answer",
    "FaultyUpstream",
    "Fault",
    "Hang",
    "RawBytes",
    "RawClient",
    "RawResponse",
    "Received",
    "Reset",
    "Stream",
    "closed_port_url",
    "complete_stream",
    "cut_after",
    "error_answer",
    "garbage_stream",
    "message_json",
    "oversized_event",
    "parse_response",
    "silent_mid_stream",
    "sse_events",
    "trickle",
    "truncated_mid_event",
]

_SSE = b"text/event-stream; charset=utf-8"
_JSON = b"application/json"


def _to_json(value) -> bytes:
    return ujson.dumps(value, ensure_ascii=False, escape_forward_slashes=False).encode("utf-8")


def _event(name: str, payload: dict) -> bytes:
    return b"event: " + name.encode("ascii") + b"\ndata: " + _to_json(payload) + b"\n\n"


def message_json(text: str = "Hello", message_id: str = "msg_faulty_1") -> dict:
    """A whole non-streaming Messages answer with one text block."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 2},
    }


def sse_events(deltas: int = 3, message_id: str = "msg_faulty_1", tool_id: str = "toolu_faulty_1") -> list[bytes]:
    """
    The events of a complete streamed answer: a text block of ``deltas``
    deltas, then a ``tool_use`` block (so the relay decides one id), then
    ``message_delta`` and ``message_stop``. Each item is one whole event.
    """
    start = message_json("", message_id)
    start["content"], start["stop_reason"] = [], None
    events = [
        _event("message_start", {"type": "message_start", "message": start}),
        _event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
    ]
    for n in range(deltas):
        events.append(
            _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "part %d " % n}},
            )
        )
    events += [
        _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 1,
                "content_block": {"type": "tool_use", "id": tool_id, "name": "get_weather", "input": {}},
            },
        ),
        _event(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'},
            },
        ),
        _event("content_block_stop", {"type": "content_block_stop", "index": 1}),
        _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {"output_tokens": 9},
            },
        ),
        _event("message_stop", {"type": "message_stop"}),
    ]
    return events


@dataclass
class Received:
    """
    One request as the faulty upstream received it, and how it ended.

    :ivar method: e.g. ``b"POST"``.
    :ivar path: the request target, query string included.
    :ivar headers: ``(lower-case name, value)`` pairs as received.
    :ivar body: the request body.
    :ivar at: the reactor's time when the request arrived.
    :ivar connection: which connection it came on (1 for the first one accepted, ...).
    :ivar outcome: ``"finished"`` when the upstream completed its answer,
        ``"lost"`` when the connection went away first, ``None`` meanwhile.
    :ivar ended_at: the reactor's time of the outcome.
    :ivar ended: fires with the outcome.
    """

    method: bytes
    path: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    at: float
    connection: int = 0
    outcome: str | None = None
    ended_at: float | None = None
    ended: Deferred = field(default_factory=Deferred)

    def header(self, name: bytes) -> list[bytes]:
        """Every value the request carried for header ``name``."""
        return [value for key, value in self.headers if key == name.lower()]


class Fault:
    """What the upstream does with one request; subclasses say what."""

    def respond(self, request, exchange: "_Exchange"):
        """Answer ``request``: return bytes, or ``NOT_DONE_YET``."""
        raise NotImplementedError


@dataclass
class Answer(Fault):
    """A whole answer: ``status``, ``headers`` and ``body`` (a Messages message by default)."""

    status: int = 200
    body: bytes | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()

    def respond(self, request, exchange):
        request.setResponseCode(self.status)
        request.setHeader(b"content-type", _JSON)
        request.setHeader(b"request-id", b"req_faulty_%d" % (exchange.number,))
        for name, value in self.headers:
            request.setHeader(name, value)
        return self.body if self.body is not None else _to_json(message_json())


def error_answer(
    status: int,
    error_type: str,
    message: str = "Faulty upstream says no.",
    *,
    retry_after: str | None = None,
    retry_after_ms: str | None = None,
) -> Answer:
    """An Anthropic-shaped error answer, with ``retry-after`` headers if given."""
    headers = []
    if retry_after is not None:
        headers.append((b"retry-after", retry_after.encode("ascii")))
    if retry_after_ms is not None:
        headers.append((b"retry-after-ms", retry_after_ms.encode("ascii")))
    body = _to_json({"type": "error", "error": {"type": error_type, "message": message}})
    return Answer(status, body, tuple(headers))


class Reset(Fault):
    """Accept the request, then reset the connection before any header."""

    def respond(self, request, exchange):
        request.channel.transport.abortConnection()
        return NOT_DONE_YET


@dataclass
class Hang(Fault):
    """
    Never answer; with ``headers``, send the status line and headers of
    ``content_type`` first. The connection stays open until the client
    closes it or the upstream stops.
    """

    headers: bool = False
    content_type: bytes = _SSE

    def respond(self, request, exchange):
        if self.headers:
            request.setHeader(b"content-type", self.content_type)
            request.write(b"")
        return NOT_DONE_YET


@dataclass
class RawBytes(Fault):
    """Write ``data`` straight on the connection, no HTTP framing, then close it."""

    data: bytes

    def respond(self, request, exchange):
        transport = request.channel.transport
        transport.write(self.data)
        transport.loseConnection()
        return NOT_DONE_YET


@dataclass
class Stream(Fault):
    """
    An SSE answer written piece by piece on the reactor's clock.

    :ivar pieces: ``(seconds to wait first, bytes)`` in order.
    :ivar end: after the last piece, ``"finish"`` the response properly,
        ``"close"`` the connection (no final chunk), ``"abort"`` it (reset),
        or ``"hang"`` with it open.
    :ivar status: the response status.
    :ivar end_after: seconds between the last piece and the end (a reset
        discards what the kernel has not sent yet, so give it time).
    """

    pieces: list[tuple[float, bytes]]
    end: str = "finish"
    status: int = 200
    end_after: float = 0.0

    def respond(self, request, exchange):
        request.setResponseCode(self.status)
        request.setHeader(b"content-type", _SSE)
        request.setHeader(b"request-id", b"req_faulty_%d" % (exchange.number,))
        request.write(b"")
        exchange.play(self.pieces, self.end, self.end_after)
        return NOT_DONE_YET


def complete_stream(deltas: int = 3, delay: float = 0.0) -> Stream:
    """A whole, well-formed stream, its events ``delay`` seconds apart."""
    return Stream([(delay, event) for event in sse_events(deltas)])


def cut_after(events: int, how: str = "close") -> Stream:
    """The first ``events`` events of a stream, then the connection closes (or resets)."""
    return Stream([(0.0, event) for event in sse_events()[:events]], end=how, end_after=0.05)


def truncated_mid_event(events: int = 3) -> Stream:
    """``events`` whole events and half of the next one, then the connection closes."""
    all_events = sse_events()
    half = all_events[events][: len(all_events[events]) // 2]
    return Stream([(0.0, event) for event in all_events[:events]] + [(0.0, half)], end="close")


def silent_mid_stream(silence: float, after: int = 3) -> Stream:
    """A whole stream that says nothing for ``silence`` seconds after ``after`` events."""
    events = sse_events()
    pieces = [(0.0, e) for e in events[:after]] + [(silence, events[after])]
    return Stream(pieces + [(0.0, e) for e in events[after + 1:]])


def trickle(chunk: int, interval: float, deltas: int = 3) -> Stream:
    """A whole stream sent ``chunk`` bytes at a time, ``interval`` seconds apart."""
    data = b"".join(sse_events(deltas))
    return Stream([(interval, data[i:i + chunk]) for i in range(0, len(data), chunk)])


def oversized_event(size: int, before: int = 2, pause: float = 0.0) -> Stream:
    """
    ``before`` whole events, then a ``content_block_delta`` of about
    ``size`` bytes, then (``pause`` seconds later) the rest of the stream.
    """
    events = sse_events()
    huge = _event(
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x" * size}},
    )
    pieces = [(0.0, e) for e in events[:before]]
    # Written in pieces, as a network delivers it.
    step = 256 * 1024
    pieces += [(0.0, huge[i:i + step]) for i in range(0, len(huge), step)]
    rest = events[before:]
    return Stream(pieces + [(pause, rest[0])] + [(0.0, e) for e in rest[1:]])


def garbage_stream(data: bytes, end: str = "finish") -> Stream:
    """An SSE response whose body is ``data``, whatever it holds."""
    return Stream([(0.0, data)], end=end)


class _Exchange:
    """One request being answered: its record and the timers writing it."""

    def __init__(self, upstream: "FaultyUpstream", request, record: Received, number: int):
        self.upstream = upstream
        self.request = request
        self.record = record
        self.number = number
        self._calls = []
        self._end_after = 0.0
        request.notifyFinish().addBoth(self._ended)

    def play(self, pieces: list[tuple[float, bytes]], end: str, end_after: float = 0.0) -> None:
        """Write ``pieces`` on the clock, then end as ``end`` says, ``end_after`` seconds later."""
        self._end_after = end_after
        self._play(pieces, 0, end)

    def _play(self, pieces: list[tuple[float, bytes]], index: int, end: str) -> None:
        while index < len(pieces):
            if self.record.outcome is not None:
                return
            delay, data = pieces[index]
            if delay > 0:
                self._later(delay, self._write_then_play, pieces, index, end)
                return
            self.request.write(data)
            index += 1
        if self.record.outcome is not None:
            return
        if self._end_after > 0:
            self._later(self._end_after, self._end, end)
        else:
            self._end(end)

    def _write_then_play(self, pieces: list[tuple[float, bytes]], index: int, end: str) -> None:
        if self.record.outcome is not None:
            return
        self.request.write(pieces[index][1])
        self._play(pieces, index + 1, end)

    def _later(self, delay: float, f, *args) -> None:
        self._calls = [call for call in self._calls if call.active()]
        self._calls.append(self.upstream.reactor.callLater(delay, f, *args))

    def _end(self, end: str) -> None:
        if self.record.outcome is not None:
            return
        transport = self.request.channel.transport
        if end == "finish":
            self.request.finish()
        elif end == "close":
            transport.loseConnection()
        elif end == "abort":
            transport.abortConnection()
        elif end != "hang":
            raise ValueError("end must be finish, close, abort or hang, not %r" % (end,))

    def _ended(self, result) -> None:
        self.record.outcome = "finished" if result is None else "lost"
        self.record.ended_at = self.upstream.reactor.seconds()
        for call in self._calls:
            if call.active():
                call.cancel()
        self._calls = []
        self.upstream._exchanges.discard(self)
        self.record.ended.callback(self.record.outcome)


class _FaultResource(Resource):
    isLeaf = True

    def __init__(self, upstream: "FaultyUpstream"):
        super().__init__()
        self._upstream = upstream

    def render(self, request):
        return self._upstream._respond(request)


class _CountingChannel(HTTPChannel):
    """An HTTP channel that tells its upstream when it opens and closes."""

    def connectionMade(self):
        super().connectionMade()
        self.site.upstream._opened(self)

    def connectionLost(self, reason):
        super().connectionLost(reason)
        self.site.upstream._closed(self)


class _FaultSite(Site):
    protocol = _CountingChannel
    noisy = False

    def __init__(self, upstream: "FaultyUpstream"):
        super().__init__(_FaultResource(upstream))
        self.upstream = upstream

    def log(self, request) -> None:
        pass


class FaultyUpstream:
    """
    An upstream on 127.0.0.1 whose answers a test scripts.

    :param reactor: the reactor to listen and keep time with.
    :param default: the fault for requests beyond the script; a complete
        stream for streaming requests and a whole answer otherwise when
        ``None``.

    :ivar received: every request received, oldest first.
    :ivar open_connections: connections open now.
    :ivar connections_made: connections accepted so far.
    """

    def __init__(self, reactor, default: Fault | None = None):
        self.reactor = reactor
        self.default = default
        self.received: list[Received] = []
        self.open_connections = 0
        self.connections_made = 0
        self._script: deque[Fault] = deque()
        self._channels: set = set()
        self._exchanges: set[_Exchange] = set()
        self._numbers = itertools.count(1)
        self._count = 0
        self._port = None
        self._closed_waiters: list[Deferred] = []

    def script(self, *faults: Fault) -> None:
        """Answer the next requests with these faults, in order."""
        self._script.extend(faults)

    def listen(self) -> str:
        """Listen on an ephemeral port of 127.0.0.1; return the base URL."""
        self._port = self.reactor.listenTCP(0, _FaultSite(self), interface="127.0.0.1")
        return "http://127.0.0.1:%d" % (self._port.getHost().port,)

    @property
    def request_count(self) -> int:
        """Requests received so far (forgotten ones included)."""
        return self._count

    def forget_finished(self) -> None:
        """Drop the records of requests that have ended, so that a long run keeps few."""
        self.received = [record for record in self.received if record.outcome is None]

    @property
    def in_flight(self) -> list[Received]:
        """Requests whose answer has neither finished nor lost its connection."""
        return [record for record in self.received if record.outcome is None]

    def stop(self) -> Deferred:
        """
        Stop listening and drop every open connection; fire when every
        connection is closed.
        """
        port, self._port = self._port, None
        d = maybeDeferred(port.stopListening) if port is not None else succeed(None)
        for channel in list(self._channels):
            channel.transport.abortConnection()
        d.addCallback(lambda _: self.wait_closed())
        return d

    def wait_closed(self) -> Deferred:
        """Fire once no connection is open."""
        d = Deferred()
        if not self._channels:
            d.callback(None)
        else:
            self._closed_waiters.append(d)
        return d

    # -- the site's side ----------------------------------------------------

    def _respond(self, request):
        number = next(self._numbers)
        content = request.content.read() if request.content is not None else b""
        record = Received(
            request.method,
            request.uri,
            [(name.lower(), value) for name, values in request.requestHeaders.getAllRawHeaders() for value in values],
            content,
            self.reactor.seconds(),
            request.channel.number,
        )
        self.received.append(record)
        self._count += 1
        exchange = _Exchange(self, request, record, number)
        self._exchanges.add(exchange)
        fault = self._script.popleft() if self._script else self._default_for(content)
        return fault.respond(request, exchange)

    def _default_for(self, content: bytes) -> Fault:
        if self.default is not None:
            return self.default
        try:
            streaming = ujson.loads(content).get("stream") is True
        except (ValueError, AttributeError):
            streaming = False
        return complete_stream() if streaming else Answer()

    def _opened(self, channel) -> None:
        self._channels.add(channel)
        self.open_connections += 1
        self.connections_made += 1
        channel.number = self.connections_made

    def _closed(self, channel) -> None:
        self._channels.discard(channel)
        self.open_connections -= 1
        if not self._channels:
            waiters, self._closed_waiters = self._closed_waiters, []
            for waiter in waiters:
                waiter.callback(None)


def closed_port_url(reactor) -> Deferred:
    """Fire with the URL of a port of 127.0.0.1 that was just closed: connecting is refused."""
    site = Site(Resource())
    site.noisy = False
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    url = "http://127.0.0.1:%d" % (port.getHost().port,)
    return port.stopListening().addCallback(lambda _: url)


# -- the client side ---------------------------------------------------------


class RawClient(Protocol):
    """
    An HTTP/1.1 client that sends bytes as given and reads whatever comes.

    :param request: the whole request, as bytes.
    :param reactor: for trickling.
    :param trickle: ``(bytes per write, seconds between writes)``; the
        request is sent at once when ``None``.
    :param send_only: send only the first this many bytes of ``request``.
    :param abort_after: hang up (reset) once this many response bytes
        have arrived.

    :ivar received: the response bytes so far.
    :ivar done: fires with :attr:`received` when the connection closes.
    :ivar closed_at: the reactor's time when it closed.
    """

    def __init__(self, request: bytes, reactor=None, *, trickle=None, send_only=None, abort_after=None):
        self.request = request if send_only is None else request[:send_only]
        self.reactor = reactor
        self.trickle = trickle
        self.abort_after = abort_after
        self.received = bytearray()
        self.done = Deferred()
        self.closed_at = None
        self._call = None

    def connectionMade(self):
        if self.trickle is None:
            self.transport.write(self.request)
        else:
            self._send_some(0)

    def _send_some(self, offset: int) -> None:
        self._call = None
        size, interval = self.trickle
        self.transport.write(self.request[offset:offset + size])
        if offset + size < len(self.request):
            self._call = self.reactor.callLater(interval, self._send_some, offset + size)

    def dataReceived(self, data):
        self.received += data
        if self.abort_after is not None and len(self.received) >= self.abort_after:
            self.abort_after = None
            self.transport.abortConnection()

    def abort(self) -> None:
        """Hang up now, with a reset."""
        self.transport.abortConnection()

    def connectionLost(self, reason):
        if self._call is not None and self._call.active():
            self._call.cancel()
        if self.reactor is not None:
            self.closed_at = self.reactor.seconds()
        self.done.callback(bytes(self.received))


@dataclass
class RawResponse:
    """
    An HTTP response read from raw bytes.

    :ivar status: the status code, or 0 when there was no status line.
    :ivar headers: ``(lower-case name, value)`` pairs.
    :ivar body: the body, de-chunked.
    :ivar complete: whether the body ended as its framing says it must
        (final chunk, or ``content-length`` bytes).
    """

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    complete: bool

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name``, or ``None``."""
        for key, value in self.headers:
            if key == name.lower():
                return value
        return None


def parse_response(raw: bytes) -> RawResponse:
    """Read the first HTTP response out of ``raw``, however it ended."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return RawResponse(0, [], b"", False)
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    try:
        status = int(parts[1])
    except (IndexError, ValueError):
        return RawResponse(0, [], b"", False)
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.strip().lower(), value.strip()))
    response = RawResponse(status, headers, b"", False)
    if (response.header(b"transfer-encoding") or b"").lower() == b"chunked":
        response.body, response.complete = _dechunk(rest)
    elif response.header(b"content-length") is not None:
        length = int(response.header(b"content-length"))
        response.body, response.complete = rest[:length], len(rest) >= length
    else:
        response.body, response.complete = rest, True
    return response


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    body = bytearray()
    offset = 0
    while True:
        eol = data.find(b"\r\n", offset)
        if eol < 0:
            return bytes(body), False
        try:
            size = int(data[offset:eol].split(b";")[0], 16)
        except ValueError:
            return bytes(body), False
        start = eol + 2
        if size == 0:
            return bytes(body), True
        if len(data) < start + size:
            body += data[start:]
            return bytes(body), False
        body += data[start:start + size]
        offset = start + size + 2
