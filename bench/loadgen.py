# -*- test-case-name: bench.test_harness -*-
"""
A load generator for the benchmarks: one asyncio process, raw sockets,
minimal HTTP/1.1.

``concurrency`` workers each hold one keep-alive connection and send
``requests`` requests between them (or as many as fit in ``duration``). For
each request it records the time to the first response byte, the time to
the first text delta, the total time, the body bytes, the events, and
whether it failed and why. With ``latency`` it reads the send-time stamp
that the fake upstream (``bench/fake_upstream.py``) puts in every delta and
records each event's latency, receive time minus send time, on the one
monotonic clock of this machine.

The result is one JSON object on stdout (see :func:`summarise`). Run it as::

    python bench/loadgen.py --port PORT --model bench:paced:50:20 \\
        --concurrency 200 --requests 400 --latency

With ``--hold``, streams stay open: once every stream has received its first
event it prints ``{"ready": ...}``, measures nothing more and waits for a
line on stdin (at most ``--hold-timeout`` seconds) before closing them all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from itertools import repeat

__all__ = [
    "HTTPResponseReader",
    "LoadResult",
    "RequestRecord",
    "percentile",
    "run_load",
    "summarise",
    "main",
]

_MARKER = b"~T"
_STAMP_DIGITS = 16
_STOP = b"message_stop"
# What a counting client keeps of a body's end: its last event, message_stop.
_TAIL_BYTES = 128


def _now_us() -> int:
    return time.monotonic_ns() // 1000


def percentile(values: list, fraction: float) -> float | None:
    """The ``fraction`` quantile (nearest rank) of ``values``; ``None`` if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, int(round(fraction * (len(ordered) - 1)))))
    return ordered[rank]


@dataclass(slots=True)
class RequestRecord:
    """What one request did. Times are microseconds from when it was sent."""

    status: int = 0
    ttfb_us: int | None = None
    ttfd_us: int | None = None
    total_us: int | None = None
    body_bytes: int = 0
    events: int = 0
    deltas: int = 0
    stream_complete: bool = False
    error: str | None = None


class HTTPResponseReader:
    """
    Reads one HTTP/1.1 response at a time from a byte stream: head, then a
    chunked, length-delimited or close-delimited body, handing body bytes to
    ``on_body`` as soon as they arrive.

    :param on_body: called with each piece of decoded body bytes.
    :param on_head: called with ``(status, lowercased head bytes)``.
    :param on_done: called once the response is complete.
    :param pieces: call ``on_body`` with a list of the pieces of body bytes
        a read holds, never joined (for a client that only counts them).
    """

    def __init__(self, on_body, on_head, on_done, pieces: bool = False):
        self._on_body = on_body if pieces else _joined(on_body)
        self._on_head = on_head
        self._on_done = on_done
        self.reset()

    def reset(self) -> None:
        """Expect the next response."""
        self._buf = b""
        self._state = "head"
        self._left = 0
        self.keep_alive = True

    def feed(self, data: bytes) -> bytes:
        """
        Take bytes; return those past the end of the response (normally none).
        """
        if self._state == "done":
            return data
        if self._state == "length":
            return self._feed_length(data)
        if self._state == "close":
            self._on_body([data])
            return b""
        if self._state == "head":
            self._buf += data
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return b""
            head = self._buf[:end].lower()
            data = self._buf[end + 4 :]
            self._buf = b""
            self._start_body(head)
            if self._state == "length":
                return self._feed_length(data)
            if self._state == "close":
                if data:
                    self._on_body([data])
                return b""
        return self._feed_chunked(data)

    def close(self) -> bool:
        """The connection ended: whether that completed the response."""
        if self._state == "close":
            self._state = "done"
            self._on_done()
            return True
        return False

    def _start_body(self, head: bytes) -> None:
        first, _, rest = head.partition(b"\r\n")
        parts = first.split(b" ", 2)
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        headers = {}
        for line in rest.split(b"\r\n"):
            name, _, value = line.partition(b":")
            headers[name.strip()] = value.strip()
        self.keep_alive = parts[0] == b"http/1.1" and headers.get(b"connection") != b"close"
        self._on_head(status, head)
        if b"chunked" in headers.get(b"transfer-encoding", b""):
            self._state = "size"
        elif b"content-length" in headers:
            self._left = int(headers[b"content-length"])
            self._state = "length"
            if self._left == 0:
                self._finish()
        else:
            self._state = "close"
            self.keep_alive = False

    def _feed_length(self, data: bytes) -> bytes:
        take = min(self._left, len(data))
        if take:
            self._on_body([data[:take] if take < len(data) else data])
            self._left -= take
        if self._left == 0:
            self._finish()
            return data[take:]
        return b""

    def _feed_chunked(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        pos = 0
        n = len(buf)
        pieces = []
        append = pieces.append
        state = self._state
        bulk = n >= _BULK_MIN
        try:
            while pos < n:
                if state == "size":
                    if bulk:
                        # A large read of many small chunks (an upstream that
                        # flushes every event) costs C-level work only, not a
                        # step per chunk; tried once per read.
                        bulk = False
                        taken = _whole_chunks(buf[pos:] if pos else buf, pieces)
                        if taken:
                            pos += taken
                            continue
                    # The common case, a whole chunk in the buffer, costs one
                    # find, one int and one slice.
                    eol = buf.find(b"\r\n", pos)
                    if eol < 0:
                        break
                    try:
                        size = int(buf[pos:eol], 16)
                    except ValueError:
                        size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
                    if size == 0:
                        pos = eol + 2
                        state = "trailer"
                        continue
                    start = eol + 2
                    end = start + size
                    if end + 2 <= n:
                        append(buf[start:end])
                        pos = end + 2
                        continue
                    self._left = size
                    pos = start
                    state = "data"
                elif state == "data":
                    take = min(self._left, n - pos)
                    append(buf[pos : pos + take])
                    pos += take
                    self._left -= take
                    if self._left == 0:
                        state = "crlf"
                elif state == "crlf":
                    if n - pos < 2:
                        break
                    pos += 2
                    state = "size"
                elif state == "trailer":
                    eol = buf.find(b"\r\n", pos)
                    if eol < 0:
                        break
                    if eol > pos:
                        pos = eol + 2  # a trailer field: ignored
                        continue
                    self._buf = b""
                    if pieces:
                        self._on_body(pieces)
                    self._finish()
                    return bytes(buf[eol + 2 :])
        finally:
            if self._state != "done":
                self._state = state
        if pieces:
            self._on_body(pieces)
        self._buf = buf[pos:] if pos < n else b""
        return b""

    def _finish(self) -> None:
        self._state = "done"
        self._on_done()


def _joined(on_body):
    """``on_body`` called with the pieces joined."""

    def call(pieces: list) -> None:
        on_body(pieces[0] if len(pieces) == 1 else b"".join(pieces))

    return call


#: Reads from which whole chunks are first taken in bulk.
_BULK_MIN = 4096


def _whole_chunks(buf: bytes, pieces: list) -> int:
    """
    The whole chunks at the start of ``buf`` (a size line), in bulk: append
    their data to ``pieces`` and return the bytes they take, or 0 when they
    cannot be taken so. Splitting at every CRLF gives size, data, size,
    data ...; where every size (hex) equals the length of the part after it,
    those are the chunks, up to the last chunk (size 0). Anything else (data
    holding a CRLF, extensions, an odd size line) leaves the read to the loop.
    """
    parts = buf.split(b"\r\n")
    pairs = (len(parts) - 1) // 2
    if pairs < 2:
        return 0
    sizes = parts[0 : 2 * pairs : 2]
    bodies = parts[1 : 2 * pairs : 2]
    try:
        numbers = list(map(int, sizes, repeat(16)))
    except ValueError:
        return 0
    lengths = list(map(len, bodies))
    if numbers != lengths:
        return 0
    if 0 in lengths:
        pairs = lengths.index(0)
        del sizes[pairs:], bodies[pairs:], lengths[pairs:]
    pieces.extend(bodies)
    return sum(map(len, sizes)) + sum(lengths) + 4 * pairs


class _Connection(asyncio.Protocol):
    """One client connection: one request at a time."""

    def __init__(self, load: "_Load"):
        self._load = load
        self.transport = None
        self.closed = asyncio.get_running_loop().create_future()
        self._future: asyncio.Future | None = None
        self._record: RequestRecord | None = None
        self._sent_us = 0
        self._pending = bytearray()
        self._latencies = load.latencies if load.collect_latency else None
        if load.count_only:
            self._reader = HTTPResponseReader(self._count_body, self._on_head, self._on_done, pieces=True)
        else:
            self._reader = HTTPResponseReader(self._on_body, self._on_head, self._on_done)
        self._tail = b""
        self.on_first_event = None

    # -- asyncio.Protocol -----------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        record = self._record
        if record is None:
            return
        self._now = now = _now_us()
        if record.ttfb_us is None:
            record.ttfb_us = now - self._sent_us
        extra = self._reader.feed(data)
        if extra and self._record is not None:
            self._fail("extra_bytes")

    def connection_lost(self, exc) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        if self._record is not None:
            self._now = _now_us()
            if not self._reader.close():
                self._fail("reset" if self._record.ttfb_us is not None else "closed_before_answer")

    # -- one exchange -------------------------------------------------------

    def send(self, request: bytes) -> asyncio.Future:
        """Send a request; the future fires with its :class:`RequestRecord`."""
        self._future = asyncio.get_running_loop().create_future()
        self._record = RequestRecord()
        self._pending = bytearray()
        self._tail = b""
        self._reader.reset()
        self._sent_us = _now_us()
        self.transport.write(request)
        return self._future

    def abort(self, why: str) -> None:
        """Give up on the request in flight and drop the connection."""
        self._fail(why)
        self.transport.abort()

    def _on_head(self, status: int, head: bytes) -> None:
        self._record.status = status

    def _on_body(self, data: bytes) -> None:
        record = self._record
        record.body_bytes += len(data)
        pending = self._pending
        if pending:
            pending += data
            data = pending
        last = data.rfind(b"\n\n")
        if last < 0:
            if data is not pending:
                self._pending = bytearray(data)
            return
        region = data[: last + 2]
        self._pending = bytearray(data[last + 2 :]) if last + 2 < len(data) else bytearray()
        first = record.events == 0
        record.events += region.count(b"\n\n")
        deltas = region.count(_MARKER)
        if deltas:
            if record.deltas == 0:
                record.ttfd_us = self._now - self._sent_us
            record.deltas += deltas
            latencies = self._latencies
            if latencies is not None:
                now = self._now
                at = region.find(_MARKER)
                while at >= 0:
                    latencies.append(now - int(region[at + 2 : at + 2 + _STAMP_DIGITS]))
                    at = region.find(_MARKER, at + 2 + _STAMP_DIGITS)
        if _STOP in region:
            record.stream_complete = True
        if first and self.on_first_event is not None:
            self.on_first_event()

    def _count_body(self, pieces: list) -> None:
        """Count the body bytes without reading them; keep the end to find ``message_stop``."""
        record = self._record
        record.body_bytes += sum(map(len, pieces))
        last = pieces[-1]
        self._tail = last[-_TAIL_BYTES:] if len(last) >= _TAIL_BYTES else (self._tail + last)[-_TAIL_BYTES:]
        if record.ttfd_us is None:
            record.ttfd_us = self._now - self._sent_us

    def _on_done(self) -> None:
        record = self._record
        if self._tail:
            record.stream_complete = _STOP in self._tail
        record.total_us = self._now - self._sent_us
        if record.status != 200:
            record.error = "http_%d" % (record.status,)
        self._resolve()

    def _fail(self, why: str) -> None:
        if self._record is None:
            return
        if self._record.error is None:
            self._record.error = why
        self._resolve()

    def _resolve(self) -> None:
        record, self._record = self._record, None
        future, self._future = self._future, None
        if future is not None and not future.done():
            future.set_result(record)


@dataclass
class LoadResult:
    """Everything a run measured, before it is summarised."""

    records: list = field(default_factory=list)
    latencies: list = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    connect_errors: int = 0


class _Load:
    def __init__(self, collect_latency: bool, count_only: bool = False):
        self.collect_latency = collect_latency
        self.count_only = count_only
        self.latencies: list[int] = []


def _request_bytes(host: str, port: int, path: str, body: bytes, headers: list[str]) -> bytes:
    head = [
        "POST %s HTTP/1.1" % (path,),
        "Host: %s:%d" % (host, port),
        "Content-Type: application/json",
        "Content-Length: %d" % (len(body),),
        "Anthropic-Version: 2023-06-01",
        "X-Api-Key: sk-bench",
    ] + headers
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def request_body(model: str, stream: bool, padding: bytes = b"") -> bytes:
    """A small Messages request naming the fake upstream's ``model``."""
    body = b'{"model":"%s","max_tokens":1024,"stream":%s,"messages":[{"role":"user","content":"Hello"}]' % (
        model.encode("ascii"),
        b"true" if stream else b"false",
    )
    return body + padding + b"}"


async def run_load(
    *,
    host: str,
    port: int,
    path: str,
    body: bytes,
    concurrency: int,
    requests: int | None = None,
    duration: float | None = None,
    ramp: float = 0.0,
    timeout: float = 120.0,
    latency: bool = False,
    headers: list[str] | None = None,
    hold: bool = False,
    hold_timeout: float = 300.0,
    count_only: bool = False,
) -> LoadResult:
    """
    Run the load; return the records. Bounded: ``requests`` in all, or
    ``duration`` seconds, and ``timeout`` seconds per request.

    ``count_only``: count body bytes without reading events (a stream is
    complete when it ends with ``message_stop``; :func:`summarise` checks
    the byte count), so that the load generator is not the bottleneck of a
    throughput test.
    """
    if requests is None and duration is None:
        requests = concurrency
    loop = asyncio.get_running_loop()
    load = _Load(latency, count_only)
    result = LoadResult(latencies=load.latencies)
    request = _request_bytes(host, port, path, body, headers or [])
    issued = [0]
    started = time.monotonic()
    deadline = started + duration if duration is not None else None
    ready = [0]
    all_ready = asyncio.Event()
    release = asyncio.Event()
    connections: list[_Connection] = []

    def next_request() -> bool:
        if requests is not None and issued[0] >= requests:
            return False
        if deadline is not None and time.monotonic() >= deadline:
            return False
        issued[0] += 1
        return True

    def first_event() -> None:
        ready[0] += 1
        if ready[0] >= concurrency:
            all_ready.set()

    async def worker(index: int) -> None:
        if ramp:
            await asyncio.sleep(ramp * index / concurrency)
        conn = None
        while next_request():
            if conn is None or conn.closed.done():
                try:
                    _, conn = await asyncio.wait_for(
                        loop.create_connection(lambda: _Connection(load), host, port), timeout
                    )
                except (OSError, asyncio.TimeoutError) as e:
                    result.connect_errors += 1
                    result.records.append(RequestRecord(error="connect_" + type(e).__name__))
                    conn = None
                    await asyncio.sleep(0.05)
                    continue
                connections.append(conn)
                if hold:
                    conn.on_first_event = first_event
            future = conn.send(request)
            try:
                record = await asyncio.wait_for(asyncio.shield(future), timeout)
            except asyncio.TimeoutError:
                conn.abort("timeout")
                record = await future
            if record.error is None and (record.events or count_only) and not record.stream_complete:
                record.error = "incomplete_stream"
            result.records.append(record)
            if not conn._reader.keep_alive:
                conn.transport.close()
                conn = None

    cpu_started = time.process_time()
    tasks = [asyncio.ensure_future(worker(i)) for i in range(concurrency)]
    if hold:
        try:
            await asyncio.wait_for(all_ready.wait(), hold_timeout)
        except asyncio.TimeoutError:
            pass
        print(json.dumps({"ready": ready[0], "wanted": concurrency}), flush=True)
        loop.add_reader(sys.stdin.fileno(), release.set)
        try:
            await asyncio.wait_for(release.wait(), hold_timeout)
        except asyncio.TimeoutError:
            pass
        loop.remove_reader(sys.stdin.fileno())
        for conn in connections:
            if conn._record is not None:
                conn.abort("held")
    await asyncio.gather(*tasks)
    result.wall_s = time.monotonic() - started
    result.cpu_s = time.process_time() - cpu_started
    for conn in connections:
        if conn.transport is not None:
            conn.transport.close()
    return result


def _stats_ms(values: list) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50": percentile(values, 0.5) / 1000.0,
        "p99": percentile(values, 0.99) / 1000.0,
        "max": max(values) / 1000.0,
    }


def summarise(
    result: LoadResult, expected_deltas: int | None = None, expected_bytes: int | None = None
) -> dict:
    """
    The figures of a run: request and error counts (by kind), wall and CPU
    seconds, body bytes, MB/s, requests/s, and medians/p99s (ms) of time to
    first byte, time to first delta, total time and per-event latency.
    """
    errors: dict[str, int] = {}
    ok = 0
    for record in result.records:
        if record.error is None and expected_deltas is not None and record.deltas != expected_deltas:
            record.error = "wrong_delta_count"
        if record.error is None and expected_bytes is not None and record.body_bytes != expected_bytes:
            record.error = "wrong_body_bytes"
        if record.error is None:
            ok += 1
        else:
            errors[record.error] = errors.get(record.error, 0) + 1
    body_bytes = sum(r.body_bytes for r in result.records)
    wall = result.wall_s or 1e-9
    return {
        "requests": len(result.records),
        "ok": ok,
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "wall_s": result.wall_s,
        "cpu_s": result.cpu_s,
        "body_bytes": body_bytes,
        "events": sum(r.events for r in result.records),
        "mb_per_s": body_bytes / wall / 1e6,
        "requests_per_s": ok / wall,
        "ttfb_ms": _stats_ms([r.ttfb_us for r in result.records if r.error is None]),
        "ttfd_ms": _stats_ms([r.ttfd_us for r in result.records if r.error is None]),
        "total_ms": _stats_ms([r.total_us for r in result.records if r.error is None]),
        "event_latency_ms": _stats_ms(result.latencies),
    }


def _expected_bytes(model: str, wire: str = "anthropic") -> int | None:
    """
    The body length of an unpaced stream (``bench:burst:N``), else ``None``;
    through the ``bedrock`` wire, without the ``ping`` Bedrock does not send;
    through the ``responses`` wire, ``None`` (the relay makes the events
    itself: not the fake upstream's bytes).
    """
    parts = model.split(":")
    if len(parts) < 3 or parts[1] != "burst" or wire == "responses":
        return None
    try:
        from fake_upstream import stream_events
    except ImportError:
        from bench.fake_upstream import stream_events
    return sum(map(len, stream_events(int(parts[2]), ping=wire != "bedrock")))


def _expected_deltas(model: str) -> int | None:
    parts = model.split(":")
    if len(parts) >= 3 and parts[1] in ("paced", "burst"):
        return int(parts[2])
    return None


def main(argv: list[str] | None = None) -> None:
    """Run one load from the command line and print its summary as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", default="/v1/messages")
    parser.add_argument("--model", default="bench:json")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--duration", type=float, default=None)
    parser.add_argument("--ramp", type=float, default=0.0, help="seconds over which workers start")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--latency", action="store_true")
    parser.add_argument("--body-file", default=None, help="send this file's bytes as the body")
    parser.add_argument("--header", action="append", default=[])
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--hold-timeout", type=float, default=300.0)
    parser.add_argument("--count-only", action="store_true",
                        help="count body bytes without reading events (throughput: see run_load)")
    parser.add_argument("--wire", default="anthropic", choices=("anthropic", "bedrock", "responses"),
                        help="the target's wire to the fake upstream: bedrock streams have no ping (--count-only)")
    args = parser.parse_args(argv)
    stream = args.model.split(":")[1:2] in (["paced"], ["burst"], ["idle"])
    if args.body_file:
        with open(args.body_file, "rb") as f:
            body = f.read()
    else:
        body = request_body(args.model, stream)
    result = asyncio.run(
        run_load(
            host=args.host,
            port=args.port,
            path=args.path,
            body=body,
            concurrency=args.concurrency,
            requests=args.requests,
            duration=args.duration,
            ramp=args.ramp,
            timeout=args.timeout,
            latency=args.latency,
            headers=args.header,
            hold=args.hold,
            hold_timeout=args.hold_timeout,
            count_only=args.count_only,
        )
    )
    if args.hold:
        summary = summarise(result)
    elif args.count_only:
        summary = summarise(result, expected_bytes=_expected_bytes(args.model, args.wire))
    else:
        summary = summarise(result, _expected_deltas(args.model))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
