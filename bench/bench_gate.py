"""
Measure what the SSE gate costs on the streaming hot path.

Run from the work tree's root: ``python bench/bench_gate.py`` (well under a
minute). Figures are per event, in microseconds, best of several rounds:

- a passed-through ``content_block_delta`` (about 60 bytes of text delta),
  delivered one event per chunk and sixteen events per chunk;
- a ``content_block_start`` of a ``tool_use`` that must be decided: clean (no
  collision, the original bytes go out) and colliding (the id is rewritten
  and the event re-serialised), against a history of realistic length;
- the same delta split across two chunks (the tail is carried over).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from twisted.internet.task import Clock  # noqa: E402
from twisted.internet.testing import StringTransport  # noqa: E402

from twisted_relay.sse import SSEGate  # noqa: E402
from twisted_relay.translation import translate_request  # noqa: E402

#: A text delta whose text is 60 bytes, as Anthropic frames it.
DELTA = (
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    b'"text":"Okay, let me look at the weather in San Francisco for you. "}}\n\n'
)
TOOL_ID = "toolu_01T1x1fJ34qAmk2tNTrN7Up6"
START = (
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":1,"content_block":'
    b'{"type":"tool_use","id":"' + TOOL_ID.encode() + b'","name":"get_weather","input":{}}}\n\n'
)
ROUNDS = 5


def history(turns: int, reuse: bool) -> dict:
    """A request with ``turns`` tool round trips; ``reuse`` puts ``TOOL_ID`` among them."""
    messages = [{"role": "user", "content": "Start."}]
    for i in range(turns):
        tool_id = TOOL_ID if reuse and i == turns // 2 else "toolu_%024d" % (i,)
        messages.append(
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": tool_id, "name": "get_weather", "input": {"n": i}}],
            }
        )
        messages.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": "ok"}]}
        )
    return {"model": "m", "max_tokens": 100, "stream": True, "messages": messages}


def discard(data: bytes) -> None:
    """A client sink that keeps nothing, so memory stays flat across iterations."""


def gate(translator=None, write=discard) -> SSEGate:
    g = SSEGate(write, translator, clock=Clock(), idle_timeout=300, ping_interval=15)
    g.makeConnection(StringTransport())
    return g


def best(fn, iterations: int) -> float:
    """Best-of-ROUNDS seconds per iteration."""
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        fn(iterations)
        times.append((time.perf_counter() - t0) / iterations)
    return min(times)


def pass_through(events_per_chunk: int) -> float:
    g = gate(translate_request(history(50, False)).response())
    chunk = DELTA * events_per_chunk
    receive = g.dataReceived

    def run(n):
        for _ in range(n):
            receive(chunk)

    return best(run, 200_000 // events_per_chunk) / events_per_chunk


def gated_then_deltas() -> float:
    """
    A read that opens with an event the gate reads (a text block's start)
    and goes on with 300 deltas, like a stream's first read.
    """
    g = gate(translate_request(history(50, False)).response())
    opening = (
        b"event: content_block_start\n"
        b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n\n'
    )
    chunk = opening + DELTA * 300
    receive = g.dataReceived

    def run(n):
        for _ in range(n):
            receive(chunk)

    return best(run, 1_000) / 301


def split_delta() -> float:
    g = gate(translate_request(history(50, False)).response())
    head, tail = DELTA[:37], DELTA[37:]
    receive = g.dataReceived

    def run(n):
        for _ in range(n):
            receive(head)
            receive(tail)

    return best(run, 100_000)


def decision(reuse: bool, turns: int) -> float:
    translation = translate_request(history(turns, reuse))
    count = 20_000
    # A fresh translator per event, made beforehand: a translator remembers
    # what it has seen, and every iteration must make the first decision.
    # It is swapped into one gate: building a gate per event would cost more
    # than the decision being measured.
    translators = iter([translation.response() for _ in range(count * ROUNDS)])
    g = gate()
    receive = g.dataReceived

    def run(n):
        for _ in range(n):
            g._translator = next(translators)
            receive(START)

    per_event = best(run, count)
    out = []
    gate(translation.response(), out.append).dataReceived(START)
    assert (out[0] != START) == reuse, out
    return per_event


def baseline() -> float:
    """A dataReceived that does nothing: the floor of any Protocol."""
    receive = StringTransport().write

    def run(n):
        for _ in range(n):
            receive(DELTA)

    return best(run, 200_000)


def main() -> None:
    print("SSE gate; text delta event of %d bytes; best of %d rounds" % (len(DELTA), ROUNDS))
    print("  call floor (a bare method call on bytes)   %6.2f us" % (baseline() * 1e6,))
    print("  pass-through, 1 event per chunk            %6.2f us/event" % (pass_through(1) * 1e6,))
    print("  pass-through, 16 events per chunk          %6.2f us/event" % (pass_through(16) * 1e6,))
    print("  pass-through, 1 event split in 2 chunks    %6.2f us/event" % (split_delta() * 1e6,))
    print("  a gated event, then 300 deltas, one chunk  %6.2f us/event" % (gated_then_deltas() * 1e6,))
    for turns in (10, 500):
        for label, reuse in (("clean,    ", False), ("colliding,", True)):
            figure = decision(reuse, turns) * 1e6
            print("  content_block_start, %s %3d-turn history %6.2f us" % (label, turns, figure))


if __name__ == "__main__":
    main()
