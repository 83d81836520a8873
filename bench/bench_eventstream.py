"""
Measure what reading Bedrock's event stream costs on the streaming hot path:
the frame decoder and the event mapping in front of the SSE gate
(``twisted_relay.wires.eventstream.EventStreamToSSE``), beside the gate alone
fed the same events as Anthropic's own wire carries them.

Run from the work tree's root: ``python bench/bench_eventstream.py`` (well
under a minute). Figures are CPU time (``time.process_time``), best of
several rounds:

- per event, a text delta of about 60 bytes of text: one event per read
  (a paced stream: each event arrives alone) and sixteen per read;
- per MB of client SSE, text deltas of 4 KiB of text, sixteen per read;
- the same with a read cut in the middle of a frame (the tail carried over);
- the frame decoder alone on bursts of 1,000 and 20,000 frames in one read,
  beside botocore's ``EventStreamBuffer`` (which re-slices its buffer per
  frame): per frame, flat for the relay's decoder.

Bedrock's chunks carry a random padding ``p``; here every frame has the
mean of the lengths seen in Bedrock's answers, about 30 characters.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import sys
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from twisted.internet.task import Clock  # noqa: E402
from twisted.internet.testing import StringTransport  # noqa: E402

from twisted_relay.sse import SSEGate  # noqa: E402
from twisted_relay.translation import translate_request  # noqa: E402
from twisted_relay.wires.eventstream import BedrockToSSE, EventStreamToSSE  # noqa: E402

ROUNDS = 5
PAD = "abcdefghijklmnopqrstuvwxyzABCD"
TEXT = "Okay, let me look at the weather in San Francisco for you. "


def delta(text: str) -> bytes:
    event = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
    return json.dumps(event, separators=(",", ":")).encode()


def anthropic_sse(event: bytes) -> bytes:
    return b"event: content_block_delta\ndata: " + event + b"\n\n"


def _string_header(name: str, value: str) -> bytes:
    return bytes([len(name)]) + name.encode() + b"\x07" + struct.pack("!H", len(value)) + value.encode()


HEADERS = b"".join(
    _string_header(k, v)
    for k, v in ((":event-type", "chunk"), (":content-type", "application/json"), (":message-type", "event"))
)


def bedrock_frame(event: bytes) -> bytes:
    payload = json.dumps({"bytes": base64.b64encode(event).decode(), "p": PAD}).encode()
    prelude = struct.pack("!II", 16 + len(HEADERS) + len(payload), len(HEADERS))
    message = prelude + struct.pack("!I", zlib.crc32(prelude)) + HEADERS + payload
    return message + struct.pack("!I", zlib.crc32(message))


def discard(data: bytes) -> None:
    """A client sink that keeps nothing."""


def gate() -> SSEGate:
    history = {
        "model": "m",
        "max_tokens": 100,
        "stream": True,
        "messages": [{"role": "user", "content": "Hi."}],
    }
    g = SSEGate(discard, translate_request(history).response(), clock=Clock(), idle_timeout=300, ping_interval=15)
    return g


def anthropic_wire():
    g = gate()
    g.makeConnection(StringTransport())
    return g


def bedrock_wire():
    wire = EventStreamToSSE(gate())
    wire.makeConnection(StringTransport())
    return wire


def best(reads: list[bytes], make, iterations: int) -> float:
    """Best-of-ROUNDS CPU seconds for feeding ``reads`` ``iterations`` times to a fresh protocol."""
    times = []
    for _ in range(ROUNDS):
        receive = make().dataReceived
        t0 = time.process_time()
        for _ in range(iterations):
            for read in reads:
                receive(read)
        times.append(time.process_time() - t0)
    return min(times)


def compare(label: str, event: bytes, per_read: int, iterations: int, split: bool = False) -> None:
    first_party = anthropic_sse(event) * per_read
    bedrock = bedrock_frame(event) * per_read
    if split:
        first_party = [first_party[: len(first_party) // 2 + 7], first_party[len(first_party) // 2 + 7 :]]
        bedrock = [bedrock[: len(bedrock) // 2 + 7], bedrock[len(bedrock) // 2 + 7 :]]
    else:
        first_party, bedrock = [first_party], [bedrock]
    # The mapping alone, without the gate, says where the difference goes.
    decoder_only = best(bedrock, lambda: type("P", (), {"dataReceived": BedrockToSSE().feed}), iterations)
    anthropic = best(first_party, anthropic_wire, iterations)
    through_bedrock = best(bedrock, bedrock_wire, iterations)
    events = per_read * iterations
    megabytes = len(anthropic_sse(event)) * events / 1e6
    print(
        "  %-34s %7.2f %7.2f %7.2f us/event  %6.3f %6.3f s/MB  x%.2f"
        % (
            label,
            anthropic / events * 1e6,
            through_bedrock / events * 1e6,
            decoder_only / events * 1e6,
            anthropic / megabytes,
            through_bedrock / megabytes,
            through_bedrock / anthropic,
        )
    )


def bursts() -> None:
    from botocore.eventstream import EventStreamBuffer

    from twisted_relay.wires.eventstream import FrameDecoder

    frame_bytes = bedrock_frame(delta(TEXT))
    for count in (1_000, 20_000):
        burst = frame_bytes * count

        def ours(burst=burst):
            return FrameDecoder().feed(burst)

        def botocores(burst=burst):
            buffer = EventStreamBuffer()
            buffer.add_data(burst)
            return list(buffer)

        figures = []
        for decode in (ours, botocores):
            times = []
            # botocore's big burst takes seconds: once is enough.
            for _ in range(ROUNDS if decode is ours or count <= 1_000 else 1):
                t0 = time.process_time()
                assert len(decode()) == count
                times.append(time.process_time() - t0)
            figures.append(min(times) / count * 1e6)
        print("  burst of %6d frames in one read: decoder %6.2f us/frame, botocore %7.2f us/frame" % (count, *figures))


def main() -> None:
    small, large = delta(TEXT), delta("x" * 4096)
    print(
        "Bedrock's event stream before the SSE gate; CPU, best of %d rounds; frames padded with %d characters"
        % (ROUNDS, len(PAD))
    )
    print("  (per MB: of the client's SSE; x: Bedrock wire over Anthropic wire, gate included)")
    print("  %-34s %7s %7s %7s           %6s %6s" % ("", "gate", "bedrock", "mapping", "gate", "bedrk"))
    compare("%d-byte delta, 1 event per read" % len(anthropic_sse(small)), small, 1, 100_000)
    compare("%d-byte delta, 16 events per read" % len(anthropic_sse(small)), small, 16, 10_000)
    compare("%d-byte delta, 1 event in 2 reads" % len(anthropic_sse(small)), small, 1, 50_000, split=True)
    compare("%d-byte delta, 16 events per read" % len(anthropic_sse(large)), large, 16, 1_000)
    bursts()


if __name__ == "__main__":
    main()
