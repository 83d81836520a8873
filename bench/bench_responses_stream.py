"""
Measure what reading OpenAI's Responses stream costs on the streaming hot
path, stage by stage, beside the SSE gate alone fed the same text as
Anthropic's own wire carries it (issue 33): where the Responses wire's CPU
per paced event goes.

Run from the work tree's root: ``python bench/bench_responses_stream.py``
(well under a minute). Figures are CPU time (``time.process_time``), best
of several rounds, per text delta event of the fake upstream's paced
stream (``bench/fake_upstream.py``: the same 60-byte stamped text), one
event per read, as a paced stream arrives:

- ``gate``: the Anthropic wire, the event into the gate;
- ``responses``: the Responses wire, the event through
  ``OpenAIStreamToSSE`` (framing, ``event_data_at``, ``ujson.loads``, the
  translator, ``gate_events``) into the gate's ``eventsReceived``;
- then each stage alone on the same event: framing, ``event_data_at``,
  ``ujson.loads``, ``ResponsesStream.feed``, ``gate_events`` (the text
  delta written from its template), the gate's ``eventsReceived``;
- per stream, a whole one-second stream of 50 deltas, one event per read,
  from the first event to the last (its head and tail included: Responses'
  ``.done`` events and ``response.completed`` repeat the whole text).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ujson  # noqa: E402
from twisted.internet.task import Clock  # noqa: E402
from twisted.internet.testing import StringTransport  # noqa: E402

from bench.fake_upstream import (  # noqa: E402
    _RESPONSES_DELTA_TEMPLATE,
    _responses_tail_of,
    delta_event,
    responses_events,
    stream_events,
)
from twisted_relay.openai.context import TranslateContext  # noqa: E402
from twisted_relay.openai.responses_answer import ResponsesStream  # noqa: E402
from twisted_relay.sse import SSEGate  # noqa: E402
from twisted_relay.sse_events import EventFramer, event_data_at, parse_event  # noqa: E402
from twisted_relay.translation import translate_request  # noqa: E402
from twisted_relay.wires.openai_stream import OpenAIStreamToSSE, gate_events  # noqa: E402

ROUNDS = 5
EVENTS = 100_000
STAMP = 1_764_892_800_000_000


def discard(data: bytes) -> None:
    """A client sink that keeps nothing."""


def gate() -> SSEGate:
    history = {"model": "m", "max_tokens": 100, "stream": True, "messages": [{"role": "user", "content": "Hi."}]}
    g = SSEGate(discard, translate_request(history).response(), clock=Clock(), idle_timeout=300, ping_interval=15)
    g.makeConnection(StringTransport())
    return g


def translator() -> ResponsesStream:
    """A translator past the stream's head: its text block open, as in a stream's middle."""
    stream = ResponsesStream(TranslateContext("gpt", "account", "gpt-5.5", requested_model="claude-bench"))
    for raw in responses_events(1)[:4]:
        stream.feed(ujson.loads(parse_event(raw)[1]))
    return stream


def responses_wire():
    """The Responses wire in front of a gate, past the stream's head."""
    g = gate()
    wire = OpenAIStreamToSSE(g, translator())
    wire.makeConnection(StringTransport())
    return wire


def best(step, argument) -> float:
    """Best-of-ROUNDS CPU microseconds of ``step(argument)``, per call."""
    times = []
    for _ in range(ROUNDS):
        t0 = time.process_time()
        for _ in range(EVENTS):
            step(argument)
        times.append(time.process_time() - t0)
    return min(times) / EVENTS * 1e6


def whole_stream(make, reads: list[bytes], streams: int = 2_000) -> float:
    """Best-of-ROUNDS CPU microseconds per stream of ``reads`` fed one by one to a fresh protocol."""
    times = []
    for _ in range(ROUNDS):
        protocols = [make() for _ in range(streams)]
        t0 = time.process_time()
        for protocol in protocols:
            receive = protocol.dataReceived
            for read in reads:
                receive(read)
        times.append(time.process_time() - t0)
    return min(times) / streams * 1e6


def fresh_gate() -> SSEGate:
    return gate()


def fresh_responses_wire() -> OpenAIStreamToSSE:
    wire = OpenAIStreamToSSE(gate(), ResponsesStream(TranslateContext("gpt", "account", "gpt-5.5",
                                                                      requested_model="claude-bench")))
    wire.makeConnection(StringTransport())
    return wire


def main() -> None:
    anthropic = delta_event(STAMP)
    responses = _RESPONSES_DELTA_TEMPLATE % (STAMP,)
    text = parse_event(responses)[1].encode("utf-8")
    parsed = ujson.loads(text)
    stream = translator()
    translated = stream.feed(parsed)
    print("One paced text delta (%d bytes as Anthropic's SSE, %d as a Responses event); CPU, best of %d rounds"
          % (len(anthropic), len(responses), ROUNDS))
    framer = EventFramer()

    def framing(raw: bytes) -> None:
        # As the wire frames a read: its events taken in place, then dropped.
        framer.append(raw)
        while framer.next_end() >= 0:
            pass
        framer.compact()

    events = gate_events(translated)
    figures = [
        ("gate (the Anthropic wire)", gate().dataReceived, anthropic),
        ("responses wire, gate included", responses_wire().dataReceived, responses),
        ("  framing (EventFramer)", framing, responses),
        ("  event_data_at", lambda raw: event_data_at(raw, 0, len(raw), False), responses),
        ("  ujson.loads", ujson.loads, text),
        ("  ResponsesStream.feed", stream.feed, parsed),
        ("  gate_events", gate_events, translated),
        ("  the gate's eventsReceived", gate().eventsReceived, events),
    ]
    base = None
    for label, step, argument in figures:
        us = best(step, argument)
        base = base or us
        print("  %-32s %6.2f us/event  x%.2f of the gate" % (label, us, us / base))




def per_stream(deltas: int = 50) -> None:
    stamps = [STAMP + 20_000 * i for i in range(deltas)]
    anthropic = stream_events(0)
    anthropic = anthropic[:3] + [delta_event(s) for s in stamps] + anthropic[3:]
    responses = responses_events(0)[:3] + [_RESPONSES_DELTA_TEMPLATE % (s,) for s in stamps]
    responses += list(_responses_tail_of(stamps))
    mine = whole_stream(fresh_responses_wire, responses)
    theirs = whole_stream(fresh_gate, anthropic)
    deltas_only = whole_stream(fresh_responses_wire, responses[:3 + deltas]) - whole_stream(fresh_gate, anthropic[:3 + deltas])
    print("A whole stream of %d deltas, one event per read (%d Anthropic events, %d Responses events):"
          % (deltas, len(anthropic), len(responses)))
    print("  gate %.0f us, responses wire %.0f us a stream: x%.2f; of the %.0f us more, %.0f us in the head and deltas,"
          " %.0f us in the tail (the .done events and response.completed)"
          % (theirs, mine, mine / theirs, mine - theirs, deltas_only, mine - theirs - deltas_only))


if __name__ == "__main__":
    main()
    per_stream()
