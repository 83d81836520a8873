"""
Measure what the chunked decoder costs per HTTP chunk, beside Twisted's.

Run from the work tree's root: ``python bench/bench_chunked.py`` (well under
a minute). Figures are per chunk, in microseconds, best of several rounds,
for an upstream that flushes every SSE event as a chunk of its own (a
``content_block_delta`` of about 170 bytes per chunk):

- paced: one chunk per read (what many paced streams send: S1);
- a few chunks per read (16, about 3 KiB);
- unpaced: 64 KiB reads of whole chunks (S2), 2,000 chunks in all;
- one chunk split across two reads (the tail is carried over).

Twisted's own decoder is measured on the same reads with a no-op callback.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from twisted_relay._twisted import TwistedChunkedDecoder  # noqa: E402

from twisted_relay.chunked import CoalescingChunkedDecoder  # noqa: E402

#: A text delta as Anthropic frames it, as one HTTP chunk.
DELTA = (
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    b'"text":"Okay, let me look at the weather in San Francisco for you. "}}\n\n'
)
CHUNK = b"%x\r\n%s\r\n" % (len(DELTA), DELTA)
ROUNDS = 7


def discard(data: bytes) -> None:
    """A callback that keeps nothing."""


def reads_of(total_chunks: int, read_size: int) -> list[bytes]:
    """``total_chunks`` chunks cut into reads of ``read_size`` bytes (no end marker)."""
    wire = CHUNK * total_chunks
    return [wire[i : i + read_size] for i in range(0, len(wire), read_size)]


def best(decoder_class, reads: list[bytes], chunks: int, repeat: int) -> float:
    """Best-of-ROUNDS seconds per chunk, feeding ``reads`` ``repeat`` times to one decoder."""
    times = []
    for _ in range(ROUNDS):
        decoder = decoder_class(discard, discard)
        receive = decoder.dataReceived
        t0 = time.perf_counter()
        for _ in range(repeat):
            for read in reads:
                receive(read)
        times.append((time.perf_counter() - t0) / (chunks * repeat))
    return min(times)


def cases() -> list[tuple[str, list[bytes], int, int]]:
    """(label, reads, chunks in the reads, times the reads are fed)."""
    half = len(CHUNK) // 2
    return [
        ("paced, 1 chunk per read", [CHUNK], 1, 100_000),
        ("16 chunks per read", [CHUNK * 16], 16, 10_000),
        ("unpaced, 64 KiB reads", reads_of(2000, 65536), 2000, 100),
        ("1 chunk split in 2 reads", [CHUNK[:half], CHUNK[half:]], 1, 50_000),
    ]


def main() -> None:
    print("Chunked decoding; one %d-byte event per chunk; best of %d rounds" % (len(DELTA), ROUNDS))
    print("  %-28s %10s %10s" % ("", "relay", "Twisted"))
    for label, reads, chunks, repeat in cases():
        ours = best(CoalescingChunkedDecoder, reads, chunks, repeat)
        theirs = best(TwistedChunkedDecoder, reads, chunks, max(1, repeat // 4))
        print("  %-28s %7.3f us %7.3f us" % (label, ours * 1e6, theirs * 1e6))


if __name__ == "__main__":
    main()
