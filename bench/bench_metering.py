"""
Measure what metering costs per event of a paced stream, in process.

Run from the work tree's root: ``python bench/bench_metering.py`` (under a
minute) prints, per event of a one-second stream (``message_start``, a
ping, a text block of 50 deltas, ``message_delta``, ``message_stop``; one
event per read, as a paced stream arrives), the SSE gate's cost without
metering and with it: the gate reading ``message_delta`` too, the answer's
meter fed, and at the end its usage record made and counted in the
metrics, as ``Answer`` does. Best of several rounds, microseconds.

For an instruction count free of the machine's noise, run one side alone
under callgrind, twice, and take the difference per stream::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python bench/bench_metering.py --streams 0 --metering on
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python bench/bench_metering.py --streams 400 --metering on

(the same with ``--metering off``); valgrind prints the instructions (``Collected``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from twisted.internet.task import Clock  # noqa: E402
from twisted.internet.testing import StringTransport  # noqa: E402

from twisted_relay.config import RelayKey  # noqa: E402
from twisted_relay.metering import AnswerMeter  # noqa: E402
from twisted_relay.metrics import RelayMetrics  # noqa: E402
from twisted_relay.prices import DEFAULT_PRICES  # noqa: E402
from twisted_relay.sse import SSEGate  # noqa: E402
from twisted_relay.translation import translate_request  # noqa: E402

DELTAS = 50
ROUNDS = 5
KEY = RelayKey("sk-relay-bench", "alice", "platform")


def _event(name: str, data: str) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + data.encode() + b"\n\n"


#: One stream's reads, an event each, as today's API sends them.
EVENTS = [
    _event("message_start", '{"type":"message_start","message":{"model":"claude-opus-5-5","id":"msg_01bench",'
           '"type":"message","role":"assistant","content":[],"stop_reason":null,"stop_sequence":null,'
           '"usage":{"input_tokens":2100,"cache_creation_input_tokens":3000,"cache_read_input_tokens":40000,'
           '"cache_creation":{"ephemeral_5m_input_tokens":0,"ephemeral_1h_input_tokens":3000},'
           '"output_tokens":1,"service_tier":"standard","inference_geo":"global"}}}'),
    _event("ping", '{"type": "ping"}'),
    _event("content_block_start", '{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}'),
    *[_event("content_block_delta", '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
             '"text":"Okay, let me look at the weather in San Francisco for you. "}}')] * DELTAS,
    _event("content_block_stop", '{"type":"content_block_stop","index":0}'),
    _event("message_delta", '{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
           '"usage":{"input_tokens":2100,"cache_creation_input_tokens":3000,"cache_read_input_tokens":40000,'
           '"output_tokens":612,"output_tokens_details":{"thinking_tokens":200},'
           '"iterations":[{"type":"message","input_tokens":2100,"output_tokens":612,'
           '"cache_read_input_tokens":40000,"cache_creation_input_tokens":3000,'
           '"cache_creation":{"ephemeral_5m_input_tokens":0,"ephemeral_1h_input_tokens":3000}}]}}'),
    _event("message_stop", '{"type":"message_stop"}'),
]
HISTORY = {"model": "claude-opus-5-5", "max_tokens": 100, "stream": True,
           "messages": [{"role": "user", "content": "The weather, please."}]}


def discard(data: bytes) -> None:
    """A client sink that keeps nothing."""


def one_stream(translation, metrics: RelayMetrics | None) -> None:
    """One stream through a gate, metered as the relay meters it when ``metrics`` is given."""
    meter = None
    on_usage = None
    if metrics is not None:
        meter = AnswerMeter(DEFAULT_PRICES, "claude-opus-5-5")

        def on_usage(name: bytes, payload: dict) -> None:
            if name == b"message_delta":
                meter.message_delta(payload)
            else:
                meter.message_start(payload)

    gate = SSEGate(discard, translation.response(), clock=Clock(), idle_timeout=300, ping_interval=15,
                   on_usage=on_usage)
    gate.makeConnection(StringTransport())
    receive = gate.dataReceived
    for event in EVENTS:
        receive(event)
    if meter is not None:
        record = meter.record(at=0.0, request_id="rly_bench", relay_key=KEY, attribution={}, upstream="default",
                              status=200, stream=True, partial=False)
        metrics.count_usage(record)


def streams(count: int, metering: bool) -> None:
    translation = translate_request(HISTORY)
    metrics = RelayMetrics() if metering else None
    if metrics is not None:
        metrics.know_models(DEFAULT_PRICES.models)
    for _ in range(count):
        one_stream(translation, metrics)


def per_event(metering: bool, count: int = 400) -> float:
    """Best-of-ROUNDS microseconds per event."""
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        streams(count, metering)
        times.append((time.perf_counter() - started) / (count * len(EVENTS)))
    return min(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, help="run this many streams and exit (for callgrind)")
    parser.add_argument("--metering", choices=("on", "off"), default="on")
    options = parser.parse_args()
    if options.streams is not None:
        streams(options.streams, options.metering == "on")
        return
    print("A paced stream of %d events, one a read; best of %d rounds" % (len(EVENTS), ROUNDS))
    off, on = per_event(False), per_event(True)
    print("  gate, metering off   %6.2f us/event" % (off,))
    print("  gate, metering on    %6.2f us/event  (%+.2f us, %+.1f %%)" % (on, on - off, (on - off) / off * 100))


if __name__ == "__main__":
    main()
