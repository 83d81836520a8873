# -*- test-case-name: bench.test_harness -*-
"""
A fast fake Anthropic upstream for the benchmarks.

One asyncio process, raw HTTP/1.1 (keep-alive, and HTTP/1.0 for proxies that
speak it), every response pre-serialised. What it answers is chosen by the
request's ``model`` (found with ``bytes.find``, so that a 32 MiB body costs
one scan, not a parse):

``bench:paced:N:MS``
    A text stream of ``N`` 60-byte deltas, ``MS`` milliseconds apart. Each
    delta's text begins with ``~T`` and the send time in microseconds of
    ``time.monotonic_ns`` (16 digits): a load generator on the same machine
    computes each event's latency from it.
``bench:burst:N``
    The same stream unpaced: the whole body in one write, as fast as TCP
    takes it (one HTTP chunk per event, as a server that flushes each event
    sends it).
``bench:idle:S``
    ``message_start`` and a ``ping``, then nothing for ``S`` seconds (or
    until the client goes), then the end of the stream.
``bench:json`` (and anything else)
    A small non-streaming Messages answer.

Paced streams share one timer: a wheel of 1 ms slots, so that the cost per
event is one ``%`` format and one ``write``. Run it as::

    python bench/fake_upstream.py --port 0 --port-file PATH

It prints (or writes to ``--port-file``) the port it listens on.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

__all__ = [
    "DELTA_TEXT_BYTES",
    "STAMP_MARKER",
    "FakeUpstream",
    "delta_event",
    "main",
    "stream_events",
]

#: What precedes every send-time stamp in a delta's text.
STAMP_MARKER = b"~T"
#: The length of each delta's text, stamp included.
DELTA_TEXT_BYTES = 60

_STAMP_DIGITS = 16
_FILLER = b" " + b"lorem ipsum dolor sit amet consectetur adipisci"[: DELTA_TEXT_BYTES - 3 - _STAMP_DIGITS]
_DELTA_TEMPLATE = (
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"'
    + STAMP_MARKER.replace(b"%", b"%%")
    + b"%016d"
    + _FILLER
    + b'"}}\n\n'
)

# The same, framed as one HTTP chunk: every delta has the same length.
_DELTA_CHUNK_TEMPLATE = b"%x\r\n" % (len(_DELTA_TEMPLATE % (0,)),) + _DELTA_TEMPLATE + b"\r\n"

_MESSAGE_START = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"msg_01XFDUDYJgAACzvnptvVoYEL",'
    b'"type":"message","role":"assistant","model":"claude-bench","content":[],'
    b'"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":25,'
    b'"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":1}}}\n\n'
)
_PING = b'event: ping\ndata: {"type": "ping"}\n\n'
_BLOCK_START = (
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n\n'
)
_TAIL = (
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n',
    b"event: message_delta\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
    b'"usage":{"output_tokens":15}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
)
_HEAD = (_MESSAGE_START, _PING, _BLOCK_START)

_JSON_ANSWER = (
    b'{"id":"msg_01XFDUDYJgAACzvnptvVoYEL","type":"message","role":"assistant",'
    b'"model":"claude-bench","content":[{"type":"text","text":"Hello! How can I help you today?"}],'
    b'"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":12,"output_tokens":10}}'
)

_STREAM_HEADERS = (
    b"content-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\n"
    b"request-id: req_bench\r\n"
)
_MAX_HEAD = 64 * 1024


def delta_event(stamp_us: int) -> bytes:
    """One stamped ``content_block_delta`` event."""
    return _DELTA_TEMPLATE % (stamp_us,)


def stream_events(deltas: int) -> list[bytes]:
    """Every event of a text stream of ``deltas`` deltas (stamped 0)."""
    return list(_HEAD) + [delta_event(0)] * deltas + list(_TAIL)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _now_us() -> int:
    return time.monotonic_ns() // 1000


class _Stream:
    """One paced response in flight."""

    __slots__ = ("transport", "left", "interval_ms", "chunked", "protocol")

    def __init__(self, protocol, left: int, interval_ms: int):
        self.protocol = protocol
        self.transport = protocol.transport
        self.left = left
        self.interval_ms = interval_ms
        self.chunked = protocol.chunked


class FakeUpstream:
    """
    The server's shared state: the paced-stream wheel and counters.

    :param loop: the event loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.requests = 0
        self.connections = 0
        self._wheel: dict[int, list[_Stream]] = {}
        self._next_ms = 0
        self._timer: asyncio.TimerHandle | None = None
        self._burst_bodies: dict[tuple[int, bool], bytes] = {}

    # -- paced streams ------------------------------------------------------

    def add_paced(self, stream: _Stream) -> None:
        """Send the stream's first delta one interval from now, and so on."""
        due = int(time.monotonic() * 1000) + stream.interval_ms
        self._wheel.setdefault(due, []).append(stream)
        if self._timer is None:
            self._next_ms = due
            self._schedule()

    def _schedule(self) -> None:
        # loop.time() is time.monotonic() in asyncio's default loop.
        self._timer = self.loop.call_at(self._next_ms / 1000.0, self._tick)

    def _tick(self) -> None:
        now_ms = int(time.monotonic() * 1000)
        wheel = self._wheel
        template = _DELTA_CHUNK_TEMPLATE
        plain = _DELTA_TEMPLATE
        for ms in range(self._next_ms, now_ms + 1):
            due = wheel.pop(ms, None)
            if not due:
                continue
            for stream in due:
                if stream.transport.is_closing():
                    continue
                stamp = time.monotonic_ns() // 1000
                data = (template if stream.chunked else plain) % (stamp,)
                stream.left -= 1
                if stream.left == 0:
                    data += stream.protocol.tail()
                    stream.transport.write(data)
                    stream.protocol.response_done()
                else:
                    stream.transport.write(data)
                    wheel.setdefault(ms + stream.interval_ms, []).append(stream)
        self._next_ms = now_ms + 1
        if wheel:
            # Skip empty slots: the next due time is the smallest key.
            self._next_ms = max(self._next_ms, min(wheel))
            self._schedule()
        else:
            self._timer = None

    def burst_body(self, deltas: int, chunked: bool) -> bytes:
        """The whole body of an unpaced stream, built once per shape."""
        key = (deltas, chunked)
        body = self._burst_bodies.get(key)
        if body is None:
            events = stream_events(deltas)[len(_HEAD) :]
            frame = _chunk if chunked else (lambda e: e)
            body = b"".join(frame(e) for e in events)
            if chunked:
                body += b"0\r\n\r\n"
            self._burst_bodies[key] = body
        return body


class _UpstreamProtocol(asyncio.Protocol):
    """One connection: requests in sequence, each answered by the model it names."""

    def __init__(self, server: FakeUpstream):
        self.server = server
        self.transport = None
        self._buf = bytearray()
        self._need = -1  # body bytes still to read, -1 while reading a head
        self._head = b""
        self._body_parts: list[bytes] = []
        self.chunked = True
        self.closing = False
        self._busy = False
        self._idle_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections += 1

    def connection_lost(self, exc) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def data_received(self, data: bytes) -> None:
        if self._need > 0:
            if len(data) < self._need:
                self._body_parts.append(data)
                self._need -= len(data)
                return
            self._body_parts.append(data[: self._need])
            data = data[self._need :]
            self._need = 0
            self._request_complete()
        if data:
            self._buf += data
        while self._need < 0 and self._buf and not self._busy:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > _MAX_HEAD:
                    self.transport.close()
                return
            head = bytes(self._buf[:end])
            rest = bytes(self._buf[end + 4 :])
            self._buf = bytearray()
            self._start_request(head)
            if self._need > len(rest):
                self._body_parts = [rest]
                self._need -= len(rest)
                return
            self._body_parts = [rest[: self._need]]
            self._buf = bytearray(rest[self._need :])
            self._need = 0
            self._request_complete()

    def _start_request(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        request_line = lines[0].split(b" ")
        version = request_line[2] if len(request_line) > 2 else b"HTTP/1.0"
        length = 0
        connection = b""
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value.strip())
            elif name == b"connection":
                connection = value.strip().lower()
        self.chunked = version == b"HTTP/1.1"
        self.closing = not self.chunked or connection == b"close"
        self._head = head
        self._need = length

    def _request_complete(self) -> None:
        self._need = -1
        self.server.requests += 1
        body = b"".join(self._body_parts)
        self._body_parts = []
        self._busy = True
        model = _model_of(body)
        kind, _, args = model.partition(":")
        try:
            if kind == "paced":
                deltas, interval = (int(x) for x in args.split(":"))
                self._stream_start()
                self.server.add_paced(_Stream(self, deltas, interval))
            elif kind == "burst":
                self._stream_start()
                self.transport.write(self.server.burst_body(int(args), self.chunked))
                self.response_done()
            elif kind == "idle":
                self._stream_start()
                self._idle_timer = self.server.loop.call_later(float(args), self._idle_end)
            else:
                self._json()
        except ValueError:
            self._json()

    def _stream_start(self) -> None:
        head = b"HTTP/1.1 200 OK\r\n" + _STREAM_HEADERS
        if self.chunked:
            head += b"transfer-encoding: chunked\r\n"
            first = b"".join(_chunk(e) for e in _HEAD)
        else:
            first = b"".join(_HEAD)
        if self.closing:
            head += b"connection: close\r\n"
        self.transport.write(head + b"\r\n" + first)

    def _idle_end(self) -> None:
        self._idle_timer = None
        if not self.transport.is_closing():
            self.transport.write(self.tail())
            self.response_done()

    def tail(self) -> bytes:
        """The events after the last delta, with the chunked terminator."""
        if self.chunked:
            return b"".join(_chunk(e) for e in _TAIL) + b"0\r\n\r\n"
        return b"".join(_TAIL)

    def _json(self) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nrequest-id: req_bench\r\n"
        if self.closing:
            head += b"connection: close\r\n"
        head += b"content-length: %d\r\n\r\n" % (len(_JSON_ANSWER),)
        self.transport.write(head + _JSON_ANSWER)
        self.response_done()

    def response_done(self) -> None:
        """The answer is written: close, or read the next request."""
        self._busy = False
        if self.closing:
            self.transport.close()
        elif self._buf:
            self.data_received(b"")


def _model_of(body: bytes) -> str:
    """The ``model`` value of a JSON body, found without parsing it."""
    at = body.find(b'"model"')
    if at < 0:
        return ""
    start = body.find(b'"', body.find(b":", at + 7) + 1)
    end = body.find(b'"', start + 1)
    if start < 0 or end < 0:
        return ""
    value = body[start + 1 : end].decode("ascii", "replace")
    return value[len("bench:") :] if value.startswith("bench:") else ""


async def _serve(port: int, port_file: str | None, backlog: int) -> None:
    loop = asyncio.get_running_loop()
    server_state = FakeUpstream(loop)
    server = await loop.create_server(
        lambda: _UpstreamProtocol(server_state), "127.0.0.1", port, backlog=backlog
    )
    bound = server.sockets[0].getsockname()[1]
    if port_file:
        with open(port_file + ".tmp", "w") as f:
            f.write("%d\n" % (bound,))
        os.replace(port_file + ".tmp", port_file)
    else:
        print(bound, flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def main(argv: list[str] | None = None) -> None:
    """Run the fake upstream until SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", default=None)
    parser.add_argument("--backlog", type=int, default=4096)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.port, args.port_file, args.backlog))


if __name__ == "__main__":
    main(sys.argv[1:])
