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

Bedrock's InvokeModel routes answer too, the model taken from the path
(``POST /model/bench:paced:50:20/invoke-with-response-stream``; the body
has no ``model`` on that wire): the same streams as Amazon's event stream
(``application/vnd.amazon.eventstream``), one ``chunk`` frame per Anthropic
event, its JSON ``{"bytes": base64 of the event, "p": padding}``, no
``ping`` (Bedrock sends none), the invocation metrics on ``message_stop``;
``/model/{id}/invoke`` (and any other operation) answers the small JSON
message. Signatures are not checked: the relay still signs every request.

OpenAI's Responses route answers too (``POST /v1/responses``, the model
from the body as above; the relay's ``openai-responses`` wire sends the
client's model when its upstream maps none): the same streams as Responses
stream events (``event: <type>`` and its JSON: ``response.created``, the
message item and its text part added, one ``response.output_text.delta``
per delta, the same stamped 60-byte text, then the text, part and item
done and ``response.completed`` with the usage); a request that is not a
stream (``bench:json``) answers the small message as a Responses object.
Keys are not checked.

Paced streams share one timer: a wheel of 1 ms slots, so that the cost per
event is one ``%`` format and one ``write`` (and on Bedrock's route, one
frame: a base64 and two CRC32s; on the Responses route, the same as SSE). Run it as::

    python bench/fake_upstream.py --port 0 --port-file PATH

It prints (or writes to ``--port-file``) the port it listens on.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import struct
import sys
import time
from binascii import b2a_base64
from urllib.parse import unquote
from zlib import crc32

__all__ = [
    "BEDROCK_PADDING",
    "DELTA_TEXT_BYTES",
    "STAMP_MARKER",
    "FakeUpstream",
    "RESPONSES_TEXT",
    "chunk_frame",
    "delta_event",
    "main",
    "responses_events",
    "start_server",
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

# The delta's JSON alone, as a Bedrock chunk carries it.
_DELTA_JSON_TEMPLATE = _DELTA_TEMPLATE.split(b"\ndata: ", 1)[1].rstrip(b"\n")

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


# -- Bedrock's event stream: the same events, framed --------------------------------

#: The ``p`` padding of every chunk: Bedrock pads each chunk with a run of
#: the alphabet of random length; this is about the mean seen.
BEDROCK_PADDING = b"abcdefghijklmnopqrstuvwxyzABCD"

_BEDROCK_HEADERS = (
    b"content-type: application/vnd.amazon.eventstream\r\n"
    b"x-amzn-requestid: 5e1b7f3c-bench-4d7a-9c1e-000000000000\r\n"
    b"x-amzn-bedrock-content-type: application/json\r\n"
)
_METRICS = (
    b'"amazon-bedrock-invocationMetrics":{"inputTokenCount":25,"outputTokenCount":15,'
    b'"invocationLatency":1250,"firstByteLatency":310}'
)
_PRELUDE = struct.Struct("!II")
_UINT32 = struct.Struct("!I")


def _string_header(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + b"\x07" + struct.pack("!H", len(value)) + value


_CHUNK_HEADERS = (
    _string_header(b":event-type", b"chunk")
    + _string_header(b":content-type", b"application/json")
    + _string_header(b":message-type", b"event")
)


def chunk_frame(event_json: bytes) -> bytes:
    """One event-stream ``chunk`` message carrying one Anthropic event's JSON, as Bedrock frames it."""
    payload = b'{"bytes":"%s","p":"%s"}' % (b2a_base64(event_json, newline=False), BEDROCK_PADDING)
    prelude = _PRELUDE.pack(16 + len(_CHUNK_HEADERS) + len(payload), len(_CHUNK_HEADERS))
    message = prelude + _UINT32.pack(crc32(prelude)) + _CHUNK_HEADERS + payload
    return message + _UINT32.pack(crc32(message))


def _bedrock_event(sse_event: bytes) -> bytes:
    """An SSE event's JSON as Bedrock sends it: ``message_stop`` with the invocation metrics."""
    data = sse_event.split(b"\ndata: ", 1)[1].rstrip(b"\n")
    if data == b'{"type":"message_stop"}':
        data = data[:-1] + b"," + _METRICS + b"}"
    return data


def _bedrock_delta(stamp_us: int) -> bytes:
    return chunk_frame(_DELTA_JSON_TEMPLATE % (stamp_us,))


def _bedrock_delta_chunk(stamp_us: int) -> bytes:
    return _chunk(_bedrock_delta(stamp_us))


def delta_event(stamp_us: int) -> bytes:
    """One stamped ``content_block_delta`` event."""
    return _DELTA_TEMPLATE % (stamp_us,)


def stream_events(deltas: int, ping: bool = True) -> list[bytes]:
    """
    Every event of a text stream of ``deltas`` deltas (stamped 0); without
    the ``ping`` with ``ping=False``, as Bedrock streams (and the relay reads
    a Bedrock stream back as Anthropic's SSE).
    """
    head = _HEAD if ping else tuple(e for e in _HEAD if e != _PING)
    return list(head) + [delta_event(0)] * deltas + list(_TAIL)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _now_us() -> int:
    return time.monotonic_ns() // 1000


class _Wire:
    """
    How one upstream wire writes a stream: its response headers, the events
    before the deltas and after them (each one piece to write; after them,
    made from the deltas' stamps where the wire repeats the whole text, as
    Responses' ``.done`` events do), and a stamped delta (alone, or framed as
    one HTTP chunk).
    """

    __slots__ = ("name", "headers", "head", "tail_of", "delta", "delta_chunk")

    def __init__(self, name: str, headers: bytes, head: tuple, tail, delta, delta_chunk):
        self.name = name
        self.headers = headers
        self.head = head
        self.tail_of = tail if callable(tail) else (lambda stamps: tail)
        self.delta = delta
        self.delta_chunk = delta_chunk


_ANTHROPIC = _Wire(
    "anthropic", _STREAM_HEADERS, _HEAD, _TAIL, _DELTA_TEMPLATE.__mod__, _DELTA_CHUNK_TEMPLATE.__mod__
)
_BEDROCK = _Wire(
    "bedrock",
    _BEDROCK_HEADERS,
    tuple(chunk_frame(_bedrock_event(e)) for e in _HEAD if e != _PING),
    tuple(chunk_frame(_bedrock_event(e)) for e in _TAIL),
    _bedrock_delta,
    _bedrock_delta_chunk,
)


# -- OpenAI's Responses stream: the same text, as Responses events -----------------

_RESPONSES_HEADERS = (
    b"content-type: text/event-stream; charset=utf-8\r\n"
    b"x-request-id: req_bench\r\n"
    b"openai-processing-ms: 120\r\n"
)
_RESPONSE_ID = b"resp_0bench68d1f0a2c4e8b0aa0000000000000000"
_ITEM_ID = b"msg_0bench68d1f0a2c4e8b0aa0000000000000001"
_TEXT_PART = b'{"type":"output_text","annotations":[],"logprobs":[],"text":"%s"}'
_USAGE = (
    b'"usage":{"input_tokens":25,"input_tokens_details":{"cached_tokens":0},"output_tokens":15,'
    b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":40}'
)


def _responses_event(sequence: int, kind: bytes, fields: bytes) -> bytes:
    return b'event: %s\ndata: {"type":"%s","sequence_number":%d,%s}\n\n' % (kind, kind, sequence, fields)


def _response(status: bytes, output: bytes, usage: bytes) -> bytes:
    return (b'"response":{"id":"%s","object":"response","created_at":1764892800,"status":"%s",'
            b'"model":"gpt-5.5","output":[%s],"parallel_tool_calls":true,"store":false,%s}'
            % (_RESPONSE_ID, status, output, usage))


def _message_item(status: bytes, content: bytes) -> bytes:
    return b'{"id":"%s","type":"message","status":"%s","role":"assistant","content":[%s]}' % (
        _ITEM_ID, status, content)


#: The text of the whole answer a ``bench:json`` request gets on the Responses route.
RESPONSES_TEXT = b"Hello! How can I help you today?"

_RESPONSES_HEAD = (
    _responses_event(0, b"response.created", _response(b"in_progress", b"", b'"usage":null')),
    _responses_event(1, b"response.output_item.added",
                     b'"output_index":0,"item":%s' % (_message_item(b"in_progress", b""),)),
    _responses_event(2, b"response.content_part.added",
                     b'"item_id":"%s","output_index":0,"content_index":0,"part":%s'
                     % (_ITEM_ID, _TEXT_PART % (b"",))),
)
_DELTA_TEXT_TEMPLATE = _DELTA_JSON_TEMPLATE.split(b'"text":"', 1)[1].split(b'"', 1)[0]
# Each delta's sequence number is its own in a real stream; one number serves
# here (the relay does not read it), so that a delta is one ``%`` format.
_RESPONSES_DELTA_TEMPLATE = _responses_event(
    3, b"response.output_text.delta",
    b'"item_id":"%s","output_index":0,"content_index":0,"delta":"' % (_ITEM_ID,)
    + _DELTA_TEXT_TEMPLATE
    + b'","logprobs":[]',
)
_RESPONSES_DELTA_CHUNK_TEMPLATE = (
    b"%x\r\n" % (len(_RESPONSES_DELTA_TEMPLATE % (0,)),) + _RESPONSES_DELTA_TEMPLATE + b"\r\n"
)


def _responses_tail(text: bytes) -> tuple:
    """The events after the deltas; ``text`` the whole text, which ``.done`` events repeat."""
    part = _TEXT_PART % (text,)
    item = _message_item(b"completed", part)
    return (
        _responses_event(4, b"response.output_text.done",
                         b'"item_id":"%s","output_index":0,"content_index":0,"text":"%s","logprobs":[]'
                         % (_ITEM_ID, text)),
        _responses_event(5, b"response.content_part.done",
                         b'"item_id":"%s","output_index":0,"content_index":0,"part":%s' % (_ITEM_ID, part)),
        _responses_event(6, b"response.output_item.done", b'"output_index":0,"item":%s' % (item,)),
        _responses_event(7, b"response.completed", _response(b"completed", item, _USAGE)),
    )


def _responses_tail_of(stamps: list[int]) -> tuple:
    """The events after the deltas stamped ``stamps``: the ``.done`` events repeat their whole text."""
    return _responses_tail(b"".join(_DELTA_TEXT_TEMPLATE % (stamp,) for stamp in stamps))


_RESPONSES_JSON_ANSWER = _response(b"completed", _message_item(b"completed", _TEXT_PART % (RESPONSES_TEXT,)),
                                   _USAGE)[len(b'"response":'):]


def responses_events(deltas: int) -> list[bytes]:
    """Every event of the Responses stream of ``deltas`` deltas (stamped 0)."""
    return list(_RESPONSES_HEAD) + [_RESPONSES_DELTA_TEMPLATE % (0,)] * deltas + list(_responses_tail_of([0] * deltas))


_RESPONSES = _Wire(
    "responses",
    _RESPONSES_HEADERS,
    _RESPONSES_HEAD,
    _responses_tail_of,
    _RESPONSES_DELTA_TEMPLATE.__mod__,
    _RESPONSES_DELTA_CHUNK_TEMPLATE.__mod__,
)


class _Stream:
    """One paced response in flight."""

    __slots__ = ("transport", "left", "interval_ms", "delta", "protocol", "stamps")

    def __init__(self, protocol, left: int, interval_ms: int):
        self.protocol = protocol
        self.transport = protocol.transport
        self.left = left
        self.interval_ms = interval_ms
        self.stamps: list[int] = []
        wire = protocol.wire
        self.delta = wire.delta_chunk if protocol.chunked else wire.delta


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
        self._burst_bodies: dict[tuple[int, bool, str], bytes] = {}

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
        for ms in range(self._next_ms, now_ms + 1):
            due = wheel.pop(ms, None)
            if not due:
                continue
            for stream in due:
                if stream.transport.is_closing():
                    continue
                stamp = time.monotonic_ns() // 1000
                data = stream.delta(stamp)
                stream.stamps.append(stamp)
                stream.left -= 1
                if stream.left == 0:
                    data += stream.protocol.tail(stream.stamps)
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

    def burst_body(self, deltas: int, chunked: bool, wire: _Wire = _ANTHROPIC) -> bytes:
        """The whole body of an unpaced stream after its head, built once per shape."""
        key = (deltas, chunked, wire.name)
        body = self._burst_bodies.get(key)
        if body is None:
            events = [wire.delta(0)] * deltas + list(wire.tail_of([0] * deltas))
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
        self._path = b""
        self.chunked = True
        self.closing = False
        self.wire = _ANTHROPIC
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
        self._path = request_line[1] if len(request_line) > 1 else b""
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
        bedrock = _bedrock_route(self._path)
        if bedrock is None:
            self.wire = _RESPONSES if self._path.endswith(_RESPONSES_PATH) else _ANTHROPIC
            model = _model_of(body)
        else:
            self.wire = _BEDROCK
            model, streamed = bedrock
            if not streamed:
                model = ""
        kind, _, args = model.partition(":")
        try:
            if kind == "paced":
                deltas, interval = (int(x) for x in args.split(":"))
                self._stream_start()
                self.server.add_paced(_Stream(self, deltas, interval))
            elif kind == "burst":
                self._stream_start()
                self.transport.write(self.server.burst_body(int(args), self.chunked, self.wire))
                self.response_done()
            elif kind == "idle":
                self._stream_start()
                self._idle_timer = self.server.loop.call_later(float(args), self._idle_end)
            else:
                self._json()
        except ValueError:
            self._json()

    def _stream_start(self) -> None:
        head = b"HTTP/1.1 200 OK\r\n" + self.wire.headers
        if self.chunked:
            head += b"transfer-encoding: chunked\r\n"
            first = b"".join(_chunk(e) for e in self.wire.head)
        else:
            first = b"".join(self.wire.head)
        if self.closing:
            head += b"connection: close\r\n"
        self.transport.write(head + b"\r\n" + first)

    def _idle_end(self) -> None:
        self._idle_timer = None
        if not self.transport.is_closing():
            self.transport.write(self.tail([]))
            self.response_done()

    def tail(self, stamps: list[int]) -> bytes:
        """The events after the last delta (the deltas stamped ``stamps``), with the chunked terminator."""
        events = self.wire.tail_of(stamps)
        if self.chunked:
            return b"".join(_chunk(e) for e in events) + b"0\r\n\r\n"
        return b"".join(events)

    def _json(self) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nrequest-id: req_bench\r\n"
        if self.closing:
            head += b"connection: close\r\n"
        answer = _RESPONSES_JSON_ANSWER if self.wire is _RESPONSES else _JSON_ANSWER
        head += b"content-length: %d\r\n\r\n" % (len(answer),)
        self.transport.write(head + answer)
        self.response_done()

    def response_done(self) -> None:
        """The answer is written: close, or read the next request."""
        self._busy = False
        if self.closing:
            self.transport.close()
        elif self._buf:
            self.data_received(b"")


_RESPONSES_PATH = b"/responses"
_BEDROCK_PREFIX = b"/model/"
_BEDROCK_STREAM = b"invoke-with-response-stream"


def _bedrock_route(path: bytes) -> tuple[str, bool] | None:
    """
    For Bedrock's ``/model/{modelId}/{operation}``: the model (``bench:``
    taken off, as :func:`_model_of` does) and whether the operation streams;
    ``None`` for any other path.
    """
    if not path.startswith(_BEDROCK_PREFIX):
        return None
    model_id, _, operation = path[len(_BEDROCK_PREFIX) :].rpartition(b"/")
    value = unquote(model_id.decode("ascii", "replace"))
    model = value[len("bench:") :] if value.startswith("bench:") else ""
    return model, operation == _BEDROCK_STREAM


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


async def start_server(port: int = 0, backlog: int = 4096) -> asyncio.AbstractServer:
    """The fake upstream listening on 127.0.0.1 (``port`` 0: any free port) in the running loop."""
    loop = asyncio.get_running_loop()
    server_state = FakeUpstream(loop)
    return await loop.create_server(lambda: _UpstreamProtocol(server_state), "127.0.0.1", port, backlog=backlog)


async def _serve(port: int, port_file: str | None, backlog: int) -> None:
    server = await start_server(port, backlog)
    loop = asyncio.get_running_loop()
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
