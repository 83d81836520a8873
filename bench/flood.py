# -*- test-case-name: tests.test_stalls -*-
"""
The flood (issue 22): paced streams through a relay while large bodies of
tiny messages arrive; does one big body stop everyone else?

``--streams`` clients each run paced streams back to back (the fake
upstream's ``bench:paced:EVENTS:PACE``: its events ``PACE`` ms apart) for
the whole run. After ``--warmup`` seconds, ``--bodies`` requests at once
send ``--body-bytes`` each of tiny messages (assistant ``tool_use`` and user
``tool_result`` in turn, each id its own: about 340,000 messages in 32 MB),
to ``bench:json`` (which the fake upstream answers at once, finding the
model without parsing). The run ends ``--tail`` seconds after the last body
is answered. One process, measured from outside the relay: the streams on
an asyncio loop, the large bodies each sent from a thread of its own on a
blocking socket (so that sending them does not hold the streams' loop)::

    python bench/flood.py --port RELAY_PORT                    # 100 streams, 10 x 32 MB
    python bench/flood.py --port PORT --streams 20 --bodies 3 --body-bytes 4000000

It prints one JSON object: for the paced streams, the worst gap between two
events of one stream and the worst wait for a stream's first event (ms; a
healthy relay: about the pace, and a few ms), their 99th percentiles,
streams and errors; for the bodies, their statuses (with the error type
for the others) and the seconds to each answer. ``bench/run.py --scenarios
flood`` runs it against each target and adds the target's peak memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

__all__ = ["hostile_body", "main", "run_flood"]

_EVENT_END = b"\n\n"
_STOP = b"event: message_stop"


def hostile_body(size: int, model: str = "bench:json") -> bytes:
    """
    A Messages body of about ``size`` bytes (never more) of tiny messages:
    an assistant ``tool_use`` and the user's ``tool_result`` in turn, each
    id its own, ending on the user's turn.
    """
    head = b'{"model":"%s","max_tokens":16,"messages":[' % (model.encode("ascii"),)
    tail = b"]}"
    pieces = []
    used = len(head) + len(tail)
    n = 0
    while True:
        if n % 2 == 0:
            piece = b'{"role":"assistant","content":[{"type":"tool_use","id":"toolu_%d","name":"t","input":{}}]}' % (n,)
        else:
            piece = (b'{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_%d","content":"r"}]}'
                     % (n - 1,))
        if used + len(piece) + 1 > size:
            break
        pieces.append(piece)
        used += len(piece) + 1
        n += 1
    if n % 2:
        pieces.pop()
    return head + b",".join(pieces) + tail


def _request(host: str, port: int, path: str, body: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
        b"Anthropic-Version: 2023-06-01\r\nX-Api-Key: sk-bench\r\n\r\n" % (path.encode(), host.encode(), port, len(body))
    ) + body


class _Response:
    """Reads one HTTP/1.1 response: status, then a chunked or length-delimited body, events timed as they come."""

    def __init__(self) -> None:
        self.status = 0
        self.head_done = False
        self.chunked = False
        self.left = 0
        self.body = b""
        self.buf = b""
        self.done = False
        self.event_times: list[float] = []
        self._pending = b""

    def feed(self, data: bytes, now: float) -> None:
        self.buf += data
        if not self.head_done:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            self.buf = self.buf[end + 4:]
            self.head_done = True
            self.status = int(head.split(b" ", 2)[1])
            self.chunked = b"transfer-encoding: chunked" in head
            if not self.chunked:
                at = head.find(b"content-length:")
                self.left = int(head[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
        if self.chunked:
            self._chunks(now)
        else:
            take = self.buf[:self.left]
            self.buf = self.buf[self.left:]
            self.left -= len(take)
            self._body(take, now)
            self.done = self.left == 0

    def _chunks(self, now: float) -> None:
        while True:
            eol = self.buf.find(b"\r\n")
            if eol < 0:
                return
            size = int(self.buf[:eol].split(b";", 1)[0], 16)
            if size == 0:
                # The last chunk, then the empty trailer line.
                self.done = len(self.buf) >= eol + 4
                return
            if len(self.buf) < eol + 2 + size + 2:
                return
            self._body(self.buf[eol + 2:eol + 2 + size], now)
            self.buf = self.buf[eol + 4 + size:]

    def _body(self, data: bytes, now: float) -> None:
        self.body += data
        events = (self._pending + data).count(_EVENT_END)
        self._pending = (self._pending + data)[-1:]
        if events:
            self.event_times.append(now)


class _Client(asyncio.Protocol):
    """One keep-alive connection, one request at a time."""

    def __init__(self) -> None:
        self.transport = None
        self.response: _Response | None = None
        self.finished: asyncio.Future | None = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, request: bytes) -> asyncio.Future:
        self.response = _Response()
        self.finished = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.finished

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:
            return
        response.feed(data, time.monotonic())
        if response.done and not self.finished.done():
            self.finished.set_result(response)

    def connection_lost(self, exc) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        if self.finished is not None and not self.finished.done():
            self.finished.set_exception(ConnectionError("closed"))


async def _paced_worker(host, port, request, stop: asyncio.Event, timeout: float, records: list, ramp: float) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(ramp)
    client = None
    while not stop.is_set():
        if client is None or client.lost.done():
            try:
                _, client = await asyncio.wait_for(loop.create_connection(_Client, host, port), timeout)
            except (OSError, asyncio.TimeoutError) as e:
                records.append({"error": "connect_" + type(e).__name__})
                client = None
                await asyncio.sleep(0.05)
                continue
        sent = time.monotonic()
        try:
            response = await asyncio.wait_for(client.send(request), timeout)
        except (ConnectionError, asyncio.TimeoutError) as e:
            records.append({"error": type(e).__name__, "sent": sent})
            client.transport.abort()
            client = None
            continue
        times = response.event_times
        record = {"sent": sent, "status": response.status}
        if response.status != 200 or _STOP not in response.body:
            record["error"] = "http_%d" % (response.status,) if response.status != 200 else "incomplete"
        elif times:
            record["first_event_ms"] = (times[0] - sent) * 1000
            record["worst_gap_ms"] = max((b - a for a, b in zip(times, times[1:])), default=0) * 1000
            record["end"] = times[-1]
        records.append(record)
    if client is not None:
        client.transport.close()


def _send_body(host: str, port: int, request: bytes, timeout: float) -> dict:
    """
    Send one large request and read its answer, on a blocking socket (run
    in a thread: the kernel's copy of the bytes holds no lock the paced
    streams' loop needs).
    """
    sent = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(request)
            answer = b""
            while b"\r\n\r\n" not in answer:
                data = s.recv(65536)
                if not data:
                    raise ConnectionError("closed before the answer")
                answer += data
            head, _, body = answer.partition(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            at = head.lower().find(b"content-length:")
            length = int(head[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
            while len(body) < length:
                data = s.recv(65536)
                if not data:
                    break
                body += data
        kind = None
        if status != 200:
            try:
                kind = json.loads(body)["error"]["type"]
            except (ValueError, KeyError, TypeError):
                kind = "?"
        return {"status": status, "error_type": kind, "seconds": time.monotonic() - sent}
    except (OSError, ConnectionError) as e:
        return {"status": 0, "error_type": type(e).__name__, "seconds": time.monotonic() - sent}


def _percentile(values: list, fraction: float):
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


async def run_flood(*, host: str = "127.0.0.1", port: int, path: str = "/v1/messages", streams: int = 100,
                    pace_ms: int = 50, events: int = 20, bodies: int = 10, body_bytes: int = 32_000_000,
                    warmup: float = 2.0, tail: float = 1.0, timeout: float = 300.0) -> dict:
    """Run the flood; return its figures (see the module's docstring)."""
    paced = _request(host, port, path, b'{"model":"bench:paced:%d:%d","max_tokens":1024,"stream":true,'
                     b'"messages":[{"role":"user","content":"Hello"}]}' % (events, pace_ms))
    big = _request(host, port, path, hostile_body(body_bytes))
    stop = asyncio.Event()
    records: list = []
    started = time.monotonic()
    workers = [asyncio.ensure_future(_paced_worker(host, port, paced, stop, timeout, records, warmup * i / streams / 2))
               for i in range(streams)]
    await asyncio.sleep(warmup)
    flood_began = time.monotonic()
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max(1, bodies)) as senders:
        results = await asyncio.gather(
            *(loop.run_in_executor(senders, _send_body, host, port, big, timeout) for _ in range(bodies))
        )
    flood_ended = time.monotonic()
    await asyncio.sleep(tail)
    stop.set()
    await asyncio.gather(*workers)
    ok = [r for r in records if "error" not in r]
    errors: dict = {}
    for r in records:
        if "error" in r:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    during = [r for r in ok if r["sent"] < flood_ended and r.get("end", 0) > flood_began]
    statuses: dict = {}
    kinds: dict = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
        if r["error_type"]:
            kinds[r["error_type"]] = kinds.get(r["error_type"], 0) + 1

    def figures(rs):
        gaps = [r["worst_gap_ms"] for r in rs]
        firsts = [r["first_event_ms"] for r in rs]
        return {
            "streams": len(rs),
            "worst_gap_ms": max(gaps, default=None),
            "p99_gap_ms": _percentile(gaps, 0.99),
            "worst_first_event_ms": max(firsts, default=None),
            "p99_first_event_ms": _percentile(firsts, 0.99),
            "median_first_event_ms": _percentile(firsts, 0.5),
        }

    summary = figures(ok)
    summary.update({"pace_ms": pace_ms, "events": events, "errors": sum(errors.values()), "error_kinds": errors,
                    "during_bodies": figures(during)})
    return {
        "paced": summary,
        "bodies": {
            "count": bodies,
            "bytes": len(big),
            "statuses": statuses,
            "error_types": kinds,
            "seconds": sorted(round(r["seconds"], 2) for r in results),
            "window_s": flood_ended - flood_began,
        },
        "wall_s": time.monotonic() - started,
    }


def main(argv: list[str] | None = None) -> None:
    """Run the flood from the command line; print its figures as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", default="/v1/messages")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--pace-ms", type=int, default=50)
    parser.add_argument("--events", type=int, default=20)
    parser.add_argument("--bodies", type=int, default=10)
    parser.add_argument("--body-bytes", type=int, default=32_000_000)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--tail", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    figures = asyncio.run(run_flood(
        host=args.host, port=args.port, path=args.path, streams=args.streams, pace_ms=args.pace_ms,
        events=args.events, bodies=args.bodies, body_bytes=args.body_bytes, warmup=args.warmup, tail=args.tail,
        timeout=args.timeout,
    ))
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
