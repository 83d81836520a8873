"""
Tests for :mod:`twisted_relay.wires.eventstream`: Bedrock's event stream
read as Anthropic's server-sent events.

The decoder is checked on botocore's own golden vectors
(``tests/fixtures/eventstream``), on frames made by the small encoder below
(which botocore decodes alike, checked here too) cut at every point, and on
broken frames. The events are checked against the Anthropic SDK's own
Bedrock decoder; the Protocol runs in front of the real SSE gate, with a
real id translation, on a ``StringTransport``.
"""

from __future__ import annotations

import base64
import json
import os
import random
import struct
import zlib

import ujson
from anthropic._streaming import SSEDecoder
from anthropic.lib.bedrock._stream_decoder import AWSEventStreamDecoder
from botocore.eventstream import EventStreamBuffer
from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.internet.error import ConnectionLost
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

import tests.test_sse as gate_tests
import twisted_relay.sse as sse_module
from tests.test_openai_wires import _Bytes, _Events
from tests.test_sse import (
    ERROR_STREAM, FRESH, STREAMS, TOOL_HISTORY, _done, _reference_frame, _reporting_gate,
)
from twisted_relay.errors import RelayError
from twisted_relay.metering import AnswerMeter
from twisted_relay.prices import DEFAULT_PRICES
from twisted_relay.sse import PING_EVENT, SSEGate
from twisted_relay.sse_events import event_name_at, parse_event
from twisted_relay.translation import ORIGINAL, UNIQUE, UpstreamRules, translate_request
from twisted_relay.wires.eventstream import (
    MAX_HEADER_VALUE_BYTES,
    BedrockError,
    BedrockToSSE,
    EventStreamError,
    EventStreamToSSE,
    FrameDecoder,
    bedrock_error,
)

VECTORS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "eventstream", "botocore-vectors.json")

# -- a small encoder (the clouds brief, section 8, with every header type) -----------------

STRING, BYTES = 7, 6


def _header(name: str, value) -> bytes:
    """One header: a ``str`` is a string, else ``(type, value)``."""
    kind, value = (STRING, value) if isinstance(value, str) else value
    head = bytes([len(name.encode())]) + name.encode() + bytes([kind])
    if kind in (0, 1):
        return head
    if kind in (2, 3, 4, 5, 8):
        return head + struct.pack({2: "!b", 3: "!h", 4: "!i", 5: "!q", 8: "!q"}[kind], value)
    if kind == 9:
        return head + value
    data = value.encode() if kind == STRING else value
    return head + struct.pack("!H", len(data)) + data


def frame(headers: dict, payload: bytes = b"", header_bytes: bytes | None = None) -> bytes:
    """An event-stream message, both CRCs right."""
    hb = b"".join(_header(k, v) for k, v in headers.items()) if header_bytes is None else header_bytes
    prelude = struct.pack("!II", 16 + len(hb) + len(payload), len(hb))
    message = prelude + struct.pack("!I", zlib.crc32(prelude)) + hb + payload
    return message + struct.pack("!I", zlib.crc32(message))


CHUNK_HEADERS = {":event-type": "chunk", ":content-type": "application/json", ":message-type": "event"}


def event_bytes(event) -> bytes:
    return event if isinstance(event, bytes) else json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()


def chunk(event, pad: str = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0") -> bytes:
    """Bedrock's ``chunk`` frame carrying one Anthropic event (a dict, or its JSON bytes)."""
    body = json.dumps({"bytes": base64.b64encode(event_bytes(event)).decode(), "p": pad}).encode()
    return frame(CHUNK_HEADERS, body)


def exception(kind: str, body) -> bytes:
    headers = {":exception-type": kind, ":content-type": "application/json", ":message-type": "exception"}
    return frame(headers, body if isinstance(body, bytes) else json.dumps(body).encode())


def botocore_frames(data: bytes) -> list[tuple[dict, bytes]]:
    buffer = EventStreamBuffer()
    buffer.add_data(data)
    return [(m.headers, m.payload) for m in buffer]


def sdk_events(stream: bytes) -> list[tuple[str | None, str]]:
    """The events as the Anthropic SDK reads first-party SSE."""
    return [(e.event, e.data) for e in SSEDecoder().iter_bytes(iter([stream]))]


def sdk_bedrock_events(data: bytes) -> list[tuple[str | None, str]]:
    """The events as the Anthropic SDK reads a Bedrock event stream (``AnthropicBedrock``)."""
    return [(e.event, e.data) for e in AWSEventStreamDecoder().iter_bytes(iter([data]))]


def sse(event) -> bytes:
    """The event as Anthropic's own wire carries it."""
    raw = event_bytes(event)
    return b"event: " + json.loads(raw)["type"].encode() + b"\ndata: " + raw + b"\n\n"


TOOLU = "toolu_bdrk_01T1x1fJ34qAmk2tNTrN7Up6"
START = {
    "type": "message_start",
    "message": {
        "id": "msg_bdrk_014p7gG3wDgGV9EUtLvnow3U", "type": "message", "role": "assistant",
        "model": "claude-opus-4-6", "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 472, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 2048, "output_tokens": 2},
    },
}
TOOL_EVENTS = [
    START,
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Okay, été 😀 \"quoted\"\n"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": TOOLU, "name": "get_weather", "input": {}}},
    {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"location\": \"Paris\"}"}},
    {"type": "content_block_stop", "index": 1},
    {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": {"output_tokens": 89}},
    {"type": "message_stop"},
]
METRICS = {
    "inputTokenCount": 472, "outputTokenCount": 89, "invocationLatency": 1530, "firstByteLatency": 402,
    "cacheReadInputTokenCount": 2048, "cacheWriteInputTokenCount": 0,
}


def bedrock_stream(events, metrics=None) -> bytes:
    """The events as Bedrock frames them, the metrics on ``message_stop``; paddings vary."""
    out = []
    for i, event in enumerate(events):
        if metrics is not None and event.get("type") == "message_stop":
            event = dict(event, **{"amazon-bedrock-invocationMetrics": metrics})
        out.append(chunk(event, pad="abcdefghijklmnopqrstuvwxyz"[: (i * 7) % 26]))
    return b"".join(out)


def _history(tool_id: str) -> dict:
    return {
        "model": "claude-opus-4-6", "max_tokens": 100, "stream": True,
        "messages": [
            {"role": "user", "content": "What is the weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": tool_id, "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": "15 C"}]},
            {"role": "assistant", "content": "15 C."},
            {"role": "user", "content": "And now?"},
        ],
    }


def cuts(data: bytes, seed: int, pieces: int) -> list[bytes]:
    rnd = random.Random(seed)
    points = sorted(rnd.sample(range(1, len(data)), min(pieces, len(data) - 1)))
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


def _value(v):
    return bytes.fromhex(v["bytes_hex"]) if isinstance(v, dict) else v


# -- the decoder -------------------------------------------------------------------------


class GoldenVectorTests(SynchronousTestCase):
    """botocore's own test vectors decode to what botocore's tests say."""

    def setUp(self):
        with open(VECTORS, encoding="utf-8") as f:
            self.vectors = json.load(f)

    def _expected(self, case):
        return {k: _value(v) for k, v in case["headers"].items()}, bytes.fromhex(case["payload_hex"])

    def test_each_whole_and_cut_everywhere(self):
        """Each message decodes alike whole, cut in two at every point, and byte by byte."""
        for case in self.vectors["positive"]:
            data = bytes.fromhex(case["encoded_hex"])
            expected = [self._expected(case)]
            self.assertEqual([tuple(f) for f in FrameDecoder().feed(data)], expected, case["name"])
            for at in range(len(data) + 1):
                decoder = FrameDecoder()
                frames = decoder.feed(data[:at]) + decoder.feed(data[at:])
                self.assertEqual([tuple(f) for f in frames], expected, (case["name"], at))
            decoder = FrameDecoder()
            frames = [f for i in range(len(data)) for f in decoder.feed(data[i : i + 1])]
            self.assertEqual([tuple(f) for f in frames], expected, case["name"])
            self.assertEqual(decoder.pending, 0)

    def test_checksums_are_the_vectors(self):
        """The prelude and message CRCs the vectors name are those of their bytes."""
        for case in self.vectors["positive"]:
            data = bytes.fromhex(case["encoded_hex"])
            self.assertEqual(struct.unpack("!I", data[8:12])[0], case["prelude_crc"])
            self.assertEqual(struct.unpack("!I", data[-4:])[0], case["message_crc"])

    def test_all_in_one_buffer(self):
        """All the messages in one read, then in one byte at a time, decode in order."""
        data = b"".join(bytes.fromhex(c["encoded_hex"]) for c in self.vectors["positive"])
        expected = [self._expected(c) for c in self.vectors["positive"]]
        self.assertEqual([tuple(f) for f in FrameDecoder().feed(data)], expected)
        decoder = FrameDecoder()
        self.assertEqual([tuple(f) for i in range(len(data)) for f in decoder.feed(data[i : i + 1])], expected)

    def test_split_as_botocore_splits_them(self):
        for case in self.vectors["split"]:
            decoder = FrameDecoder()
            frames = [f for read in case["reads_hex"] for f in decoder.feed(bytes.fromhex(read))]
            self.assertEqual([tuple(f) for f in frames], [self._expected(case)], case["name"])

    def test_corrupted(self):
        """Each corrupted message is refused, in one line naming what is wrong."""
        why = {
            "CORRUPTED_LENGTH": "prelude's checksum",
            "CORRUPTED_HEADER_LENGTH": "prelude's checksum",
            "CORRUPTED_PAYLOAD": "message's checksum",
            "CORRUPTED_HEADERS": "message's checksum",
            "DUPLICATE_HEADER": "comes twice",
        }
        for case in self.vectors["negative"]:
            with self.assertRaises(EventStreamError) as caught:
                FrameDecoder().feed(bytes.fromhex(case["encoded_hex"]))
            self.assertIn(why[case["name"]], str(caught.exception))
            self.assertNotIn("\n", str(caught.exception))
            self.assertNotIn("foo", str(caught.exception))


class EncoderTests(SynchronousTestCase):
    """The tests' encoder writes what botocore reads (else the tests below prove nothing)."""

    def test_empty_frame_is_botocores_vector(self):
        self.assertEqual(frame({}), bytes.fromhex("000000100000000005c248eb7d98c8ff"))

    def test_every_header_type(self):
        headers = {
            "t": (0, True), "f": (1, False), "i8": (2, -7), "i16": (3, -300), "i32": (4, 70000),
            "i64": (5, -(2**40)), "b": (BYTES, b"\x00\xff"), "s": "caf\u00e9", "ts": (8, 1733356800123),
            "u": (9, bytes(range(16))),
        }
        data = frame(headers, b"payload")
        plain = {k: v[1] if isinstance(v, tuple) else v for k, v in headers.items()}
        self.assertEqual(botocore_frames(data), [(plain, b"payload")])
        self.assertEqual([tuple(f) for f in FrameDecoder().feed(data)], [(plain, b"payload")])

    def test_bedrock_frames(self):
        data = chunk(START) + exception("throttlingException", {"message": "slow down"})
        decoded = botocore_frames(data)
        self.assertEqual(decoded[0][0][":event-type"], "chunk")
        self.assertEqual(decoded[1][0][":exception-type"], "throttlingException")
        self.assertEqual([tuple(f) for f in FrameDecoder().feed(data)], decoded)


class FrameDecoderTests(SynchronousTestCase):
    """Frames reassembled from any split; every fault refused in one line."""

    def setUp(self):
        self.stream = bedrock_stream(TOOL_EVENTS, METRICS) + frame({"n": (4, 1)}) + exception("x", {"message": "m"})
        self.expected = botocore_frames(self.stream)

    def test_every_split_point(self):
        """The stream cut once at every point, and cut into pieces of every size up to 40, decodes alike."""
        for at in range(len(self.stream) + 1):
            decoder = FrameDecoder()
            frames = decoder.feed(self.stream[:at]) + decoder.feed(self.stream[at:])
            self.assertEqual([tuple(f) for f in frames], self.expected, at)
        for size in range(1, 41):
            decoder = FrameDecoder()
            reads = [self.stream[i : i + size] for i in range(0, len(self.stream), size)]
            self.assertEqual([tuple(f) for r in reads for f in decoder.feed(r)], self.expected, size)
            self.assertEqual(decoder.pending, 0)

    def test_random_splits(self):
        for seed in range(200):
            decoder = FrameDecoder()
            frames = [f for r in cuts(self.stream, seed, 1 + seed % 30) for f in decoder.feed(r)]
            self.assertEqual([tuple(f) for f in frames], self.expected, seed)

    def test_holds_only_the_open_frame(self):
        """After a read, what is held is the frame begun: the rest was dropped."""
        one = chunk(START)
        decoder = FrameDecoder()
        self.assertEqual(len(decoder.feed(one * 3 + one[:20])), 3)
        self.assertEqual(decoder.pending, 20)
        self.assertEqual(len(decoder.feed(one[20:] + one[:5])), 1)
        self.assertEqual(decoder.pending, 5)

    def test_big_frame_in_small_reads(self):
        """A frame of 1 MiB, in reads of 1 KiB, comes out whole once, at its last read."""
        big = frame(CHUNK_HEADERS, b"x" * (1 << 20))
        decoder = FrameDecoder()
        out = []
        for i in range(0, len(big), 1024):
            out.append(decoder.feed(big[i : i + 1024]))
        self.assertEqual([len(o) for o in out].count(1), 1)
        self.assertEqual(out[-1][0].payload, b"x" * (1 << 20))

    def test_prelude_crc(self):
        """A changed byte of the prelude (lengths or CRC) is refused as soon as the prelude has come."""
        data = chunk(START)
        for i in range(12):
            bad = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]
            with self.assertRaises(EventStreamError) as caught:
                FrameDecoder().feed(bad[:12])
            self.assertIn("prelude's checksum does not match", str(caught.exception))

    def test_message_crc(self):
        """A changed byte of the headers, payload or message CRC is refused."""
        data = chunk(START)
        for i in range(12, len(data)):
            bad = data[:i] + bytes([data[i] ^ 0x20]) + data[i + 1 :]
            with self.assertRaises(EventStreamError) as caught:
                FrameDecoder().feed(bad)
            self.assertIn("message's checksum does not match", str(caught.exception))
            self.assertNotIn("msg_bdrk", str(caught.exception))

    def test_fault_keeps_the_frames_before_and_sticks(self):
        good = chunk(START)
        bad = good[:-1] + bytes([good[-1] ^ 1])
        decoder = FrameDecoder()
        with self.assertRaises(EventStreamError) as caught:
            decoder.feed(good + good + bad)
        self.assertEqual(len(caught.exception.frames), 2)
        self.assertRaises(EventStreamError, decoder.feed, good)

    def _prelude(self, total: int, headers: int) -> bytes:
        prelude = struct.pack("!II", total, headers)
        return prelude + struct.pack("!I", zlib.crc32(prelude))

    def test_length_limits(self):
        """Lengths past the limits are refused from the prelude alone: nothing is buffered for them."""
        decoder = FrameDecoder()
        with self.assertRaises(EventStreamError) as caught:
            decoder.feed(self._prelude(16 + 24 * 1024 * 1024 + 1, 0))
        self.assertIn("payload is 25165825 bytes, past the limit of 25165824", str(caught.exception))
        with self.assertRaises(EventStreamError) as caught:
            FrameDecoder().feed(self._prelude(16 + 131073, 131073))
        self.assertIn("headers are 131073 bytes, past the limit of 131072", str(caught.exception))
        with self.assertRaises(EventStreamError) as caught:
            FrameDecoder().feed(self._prelude(15, 0))
        self.assertIn("less than the 16", str(caught.exception))
        with self.assertRaises(EventStreamError) as caught:
            FrameDecoder().feed(self._prelude(20, 5))
        self.assertIn("do not fit", str(caught.exception))
        with self.assertRaises(EventStreamError) as caught:
            FrameDecoder(max_payload_bytes=100).feed(frame({}, b"x" * 101))
        self.assertIn("past the limit of 100", str(caught.exception))
        self.assertEqual(len(FrameDecoder(max_payload_bytes=100).feed(frame({}, b"x" * 100))), 1)

    def test_header_value_limit(self):
        FrameDecoder().feed(frame({"b": (BYTES, b"v" * MAX_HEADER_VALUE_BYTES)}))
        with self.assertRaises(EventStreamError) as caught:
            FrameDecoder().feed(frame({"b": (BYTES, b"v" * (MAX_HEADER_VALUE_BYTES + 1))}))
        self.assertIn("the value of header 'b' is 32768 bytes, past the limit of 32767", str(caught.exception))

    def test_headers_kept_across_streams_keep_each_limit(self):
        """
        A small headers section is read once for every stream (Bedrock's
        chunk frames all carry the same): a decoder with a lower limit still
        refuses what another took, and a frame after a fault is refused too.
        """
        data = frame({"b": (BYTES, b"v" * 100)}, b"payload")
        self.assertEqual([tuple(f) for f in FrameDecoder().feed(data)], [({"b": b"v" * 100}, b"payload")])
        self.assertEqual([tuple(f) for f in FrameDecoder().feed(data)], [({"b": b"v" * 100}, b"payload")])
        with self.assertRaises(EventStreamError) as caught:
            FrameDecoder(max_header_value_bytes=50).feed(data)
        self.assertIn("past the limit of 50", str(caught.exception))

    def test_bad_headers(self):
        """Headers that run past their section, of an unknown type, or not UTF-8 are refused."""
        for header_bytes, why in [
            (b"\x04name\x07\x00\x09short", "runs past"),
            (b"\x04name\x04\x00\x00", "runs past"),
            (b"\x09name", "runs past"),
            (b"\x00\x00", "runs past"),
            (b"\x04name\x0a", "unknown type 10"),
            (b"\x02\xff\xfe\x00", "not UTF-8"),
            (b"\x01s\x07\x00\x02\xff\xfe", "not UTF-8"),
        ]:
            with self.assertRaises(EventStreamError) as caught:
                FrameDecoder().feed(frame({}, b"", header_bytes=header_bytes))
            self.assertIn(why, str(caught.exception), header_bytes)


# -- Bedrock's frames as Anthropic's events ------------------------------------------------


def _data(events: list[tuple[str | None, str]]) -> list[tuple[str | None, dict]]:
    return [(name, json.loads(data)) for name, data in events]


class BedrockToSSETests(SynchronousTestCase):
    """Chunks become Anthropic's events; metrics, usage and exceptions as Anthropic's."""

    def test_chunks_are_the_events_as_sent(self):
        """
        Each chunk's event leaves with its JSON as Bedrock encoded it, padding
        dropped: what the SDK reads from the SSE equals what it reads from
        Bedrock's frames (``AnthropicBedrock``), and the SSE is byte for byte
        what Anthropic's own wire would carry.
        """
        data = bedrock_stream(TOOL_EVENTS)
        out = BedrockToSSE().feed(data)
        self.assertEqual(out, b"".join(sse(e) for e in TOOL_EVENTS))
        self.assertEqual(sdk_events(out), sdk_bedrock_events(data))
        self.assertNotIn(b'"p"', out)

    def test_line_ends_in_the_json_are_written_again(self):
        """An event whose JSON holds a raw line end (or names its type later) still makes one SSE event."""
        raw = b'{\n  "index": 0,\r\n  "type": "content_block_stop"\n}'
        out = BedrockToSSE().feed(chunk(raw) + chunk(b'{"index":0,"type":"content_block_stop"}'))
        self.assertEqual(out, sse(b'{"index":0,"type":"content_block_stop"}') * 2)

    def test_line_ends_after_the_type_are_written_again(self):
        """
        An event that names its type first (the way read without parsing)
        and holds a raw line end further on, LF or CR alone, still makes one
        SSE event: a line end in ``data:`` would end the event early.
        """
        for raw in (b'{"type":"content_block_stop",\n"index":0}', b'{"type":"content_block_stop",\r"index":0}'):
            out = BedrockToSSE().feed(chunk(raw))
            self.assertEqual(out, sse(b'{"type":"content_block_stop","index":0}'), raw)

    def test_other_event_types_are_skipped(self):
        other = frame({":event-type": "initial-response", ":message-type": "event"}, b"{}")
        self.assertEqual(BedrockToSSE().feed(other + chunk(START)), sse(START))

    def test_metrics_leave_message_stop(self):
        stream = BedrockToSSE()
        out = stream.feed(bedrock_stream(TOOL_EVENTS, METRICS))
        self.assertNotIn(b"amazon-bedrock", out)
        self.assertEqual(stream.invocation_metrics, METRICS)
        self.assertTrue(out.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n'))

    def test_message_delta_waits_for_the_next_frame(self):
        """A ``message_delta`` is held until the next frame, and given up when the stream ends."""
        stream = BedrockToSSE()
        delta, stop = TOOL_EVENTS[-2], TOOL_EVENTS[-1]
        self.assertEqual(stream.feed(chunk(START) + chunk(delta)), sse(START))
        self.assertEqual(stream.feed(chunk(stop)), sse(delta) + sse(stop))
        stream = BedrockToSSE()
        self.assertEqual(stream.feed(chunk(delta)), b"")
        ((name, payload, raw),) = stream.end()
        self.assertEqual((name, payload, raw), (b"message_delta", delta, sse(delta)))
        self.assertEqual(stream.end(), [])

    def _usage(self, start_usage: dict, delta_usage: dict | None, metrics: dict) -> dict:
        """The usage a meter reads through the gate, and the client's events, for one stream."""
        start = json.loads(json.dumps(START))
        start["message"]["usage"] = start_usage
        delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}}
        if delta_usage is not None:
            delta["usage"] = delta_usage
        events = [start, {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}, delta, {"type": "message_stop"}]
        meter = AnswerMeter(DEFAULT_PRICES, "claude-opus-4-6")
        gate = SSEGate(lambda data: None, clock=Clock(), on_usage=lambda name, p: (meter.message_start(p) if name == b"message_start" else meter.message_delta(p)))
        wire = EventStreamToSSE(gate)
        wire.makeConnection(StringTransport())
        for read in cuts(bedrock_stream(events, metrics), 3, 9):
            wire.dataReceived(read)
        wire.connectionLost(Failure(ResponseDone()))
        self.successResultOf(gate.done)
        return meter.usage

    def test_cache_counts_kept(self):
        """
        Events that report no cache counts (LiteLLM #34373: cache usage lost
        in Bedrock streams): the metrics' counts reach the stream's usage,
        so the answer is metered with its cache reads and writes.
        """
        metrics = dict(METRICS, cacheReadInputTokenCount=2048, cacheWriteInputTokenCount=512)
        usage = self._usage({"input_tokens": 472, "output_tokens": 1}, {"output_tokens": 89}, metrics)
        self.assertEqual(
            usage,
            {"input_tokens": 472, "output_tokens": 89, "cache_read_input_tokens": 2048, "cache_creation_input_tokens": 512},
        )

    def test_reported_counts_never_overwritten(self):
        """Counts the events reported stand, whatever the metrics say; a ``null`` is no report."""
        metrics = dict(METRICS, inputTokenCount=1, outputTokenCount=2, cacheReadInputTokenCount=3, cacheWriteInputTokenCount=4)
        usage = self._usage(
            {"input_tokens": 472, "cache_read_input_tokens": 2048, "output_tokens": 1},
            {"output_tokens": 89, "cache_creation_input_tokens": None},
            metrics,
        )
        self.assertEqual(
            usage,
            {"input_tokens": 472, "cache_read_input_tokens": 2048, "output_tokens": 89, "cache_creation_input_tokens": 4},
        )

    def test_delta_without_usage_gets_one(self):
        stream = BedrockToSSE()
        delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}
        out = stream.feed(chunk({"type": "message_start", "message": {"usage": {}}}) + chunk(delta) + chunk({"type": "message_stop", "amazon-bedrock-invocationMetrics": METRICS}))
        events = _data(sdk_events(out))
        self.assertEqual(events[1][1]["usage"], {"input_tokens": 472, "output_tokens": 89, "cache_read_input_tokens": 2048, "cache_creation_input_tokens": 0})

    def test_exceptions(self):
        """Each exception frame becomes Anthropic's ``error`` event with the mapped type, text kept."""
        cases = [
            (exception("throttlingException", {"message": "Too many requests, please wait before trying again."}), "rate_limit_error", "Too many requests, please wait before trying again."),
            (exception("serviceUnavailableException", {"message": "Service unavailable"}), "overloaded_error", "Service unavailable"),
            (exception("modelTimeoutException", {"message": "Model has timed out"}), "timeout_error", "Model has timed out"),
            (exception("internalServerException", {"message": "Internal error"}), "api_error", "Internal error"),
            (exception("validationException", {"message": "messages.1: Extra inputs are not permitted"}), "invalid_request_error", "messages.1: Extra inputs are not permitted"),
            (exception("validationException", {"message": "Input is too long for requested model."}), "invalid_request_error", "prompt is too long: Input is too long for requested model."),
            (exception("modelStreamErrorException", {"message": "Overloaded", "originalStatusCode": 529, "originalMessage": "{}"}), "overloaded_error", "Overloaded"),
            (exception("modelStreamErrorException", {"message": "Slow down", "originalStatusCode": 429}), "rate_limit_error", "Slow down"),
            (exception("modelStreamErrorException", {"message": "Bad gateway", "originalStatusCode": 502}), "api_error", "Bad gateway"),
            (exception("modelStreamErrorException", {"message": "Odd", "originalStatusCode": 400}), "api_error", "Odd"),
            (exception("throttlingException", b"not json\n  at all"), "rate_limit_error", "not json at all"),
            (exception("somethingNewException", {}), "api_error", "somethingNewException"),
        ]
        for data, error_type, message in cases:
            stream = BedrockToSSE()
            out = stream.feed(chunk(START) + data + chunk(TOOL_EVENTS[1]))
            self.assertEqual(
                _data(sdk_events(out)),
                [("message_start", START), ("error", {"type": "error", "error": {"type": error_type, "message": message}})],
            )
            self.assertTrue(stream.ended)
            self.assertEqual(stream.feed(chunk(START)), b"")

    def test_unmodeled_error_frame(self):
        """botocore's ``error`` vector (``:error-code``, ``:error-message``) becomes an ``api_error``."""
        with open(VECTORS, encoding="utf-8") as f:
            vector = next(c for c in json.load(f)["positive"] if c["name"] == "ERROR_EVENT_MESSAGE")
        out = BedrockToSSE().feed(bytes.fromhex(vector["encoded_hex"]))
        self.assertEqual(_data(sdk_events(out)), [("error", {"type": "error", "error": {"type": "api_error", "message": "message"}})])

    def test_held_delta_goes_before_the_error(self):
        out = BedrockToSSE().feed(chunk(TOOL_EVENTS[-2]) + exception("internalServerException", {"message": "x"}))
        self.assertEqual([name for name, _ in sdk_events(out)], ["message_delta", "error"])

    def test_malformed(self):
        """A chunk that cannot be read ends the stream with an ``api_error`` naming why, no payload in it."""
        cases = [
            (frame(CHUNK_HEADERS, b"SECRET not json"), "a chunk's payload is not JSON"),
            (frame(CHUNK_HEADERS, b'{"p":"SECRET"}'), "has no \"bytes\" text"),
            (frame(CHUNK_HEADERS, b'{"bytes":"QUJDRA="}'), "is not base64"),
            (chunk(b'SECRET {"type":"ping"}'), "a chunk's event is not JSON"),
            (chunk(b'{"index":0,"text":"SECRET"}'), "not an object with a \"type\""),
            (chunk(b'{"index":0,"type":"a b"}'), "not a name"),
            (chunk(START)[:-1] + b"\x00", "message's checksum does not match"),
        ]
        for data, why in cases:
            stream = BedrockToSSE()
            out = stream.feed(chunk(START) + data + chunk(START))
            events = _data(sdk_events(out))
            self.assertEqual(events[0], ("message_start", START))
            self.assertEqual(events[1][1]["error"]["type"], "api_error")
            message = events[1][1]["error"]["message"]
            self.assertTrue(message.startswith("The upstream's event stream was malformed: "), message)
            self.assertIn(why, message)
            self.assertNotIn("SECRET", message)
            self.assertEqual(len(events), 2)
            self.assertEqual(stream.malformed, message.partition(": ")[2])


class BedrockErrorTests(SynchronousTestCase):
    """The HTTP errors' names (``x-amzn-ErrorType``) as Anthropic's status and type."""

    def test_table(self):
        cases = [
            ("ThrottlingException:http://internal.amazon.com/coral/com.amazon.bedrock/", "Too many requests", (429, "rate_limit_error", "Too many requests")),
            ("ServiceQuotaExceededException", "quota", (429, "rate_limit_error", "quota")),
            ("ValidationException", "The model returned the following errors: Extra inputs are not permitted", (400, "invalid_request_error", "The model returned the following errors: Extra inputs are not permitted")),
            ("ValidationException", "Input is too long for requested model.", (400, "invalid_request_error", "prompt is too long: Input is too long for requested model.")),
            ("ServiceUnavailableException", "unavailable", (529, "overloaded_error", "unavailable")),
            ("ModelNotReadyException", "not ready", (529, "overloaded_error", "not ready")),
            ("ModelTimeoutException", "timed out", (504, "timeout_error", "timed out")),
            ("InternalServerException", "oops", (500, "api_error", "oops")),
            ("AccessDeniedException", "denied", (403, "permission_error", "denied")),
            ("ResourceNotFoundException", "no model", (404, "not_found_error", "no model")),
            ("InvalidSignatureException", "sig", (403, "permission_error", "sig")),
            ("ExpiredTokenException", "expired", (403, "permission_error", "expired")),
        ]
        for name, message, expected in cases:
            self.assertEqual(bedrock_error(name, message), BedrockError(*expected), name)

    def test_model_error_by_original_status(self):
        self.assertEqual(bedrock_error("ModelErrorException", "m", 529).status, 529)
        self.assertEqual(bedrock_error("ModelErrorException", "m", 429).error_type, "rate_limit_error")
        self.assertEqual(bedrock_error("ModelErrorException", "m", 503), BedrockError(500, "api_error", "m"))
        self.assertEqual(bedrock_error("ModelErrorException", "m"), BedrockError(500, "api_error", "m"))

    def test_unknown_names_follow_the_status(self):
        self.assertEqual(bedrock_error("NewException", "m", status=413), BedrockError(413, "request_too_large", "m"))
        self.assertEqual(bedrock_error("NewException", "m", status=424), BedrockError(400, "invalid_request_error", "m"))
        self.assertEqual(bedrock_error(None, None), BedrockError(500, "api_error", "Bedrock reported an error."))


# -- the Protocol in front of the gate -----------------------------------------------------


class _Sink:
    def __init__(self):
        self.writes: list[bytes] = []

    def __call__(self, data: bytes) -> None:
        self.writes.append(data)

    def value(self) -> bytes:
        return b"".join(self.writes)


def _wired(translator=None, **kwargs):
    sink = _Sink()
    clock = kwargs.pop("clock", None) or Clock()
    gate = SSEGate(sink, translator, clock=clock, **kwargs)
    wire = EventStreamToSSE(gate)
    transport = StringTransport()
    wire.makeConnection(transport)
    return wire, gate, sink, transport


class EventStreamToSSETests(SynchronousTestCase):
    """The Protocol in front of the real SSE gate."""

    def test_same_as_the_anthropic_wire(self):
        """
        Bedrock's frames, cut anywhere, reach the client as the same stream
        fed to the gate as Anthropic's SSE would: the reused tool id
        translated, the metrics gone.
        """
        sink = _Sink()
        first_party = SSEGate(sink, translate_request(_history(TOOLU)).response(), clock=Clock())
        first_party.makeConnection(StringTransport())
        first_party.dataReceived(b"".join(sse(e) for e in TOOL_EVENTS))
        first_party.connectionLost(Failure(ResponseDone()))
        expected = sink.value()
        self.assertIn(b'"id":"' + TOOLU.encode() + b'-2"', expected)
        data = bedrock_stream(TOOL_EVENTS, METRICS)
        splits = [[data[:at], data[at:]] for at in range(0, len(data) + 1, 7)]
        splits += [cuts(data, seed, 2 + seed) for seed in range(40)]
        for reads in splits:
            wire, gate, sink, _ = _wired(translate_request(_history(TOOLU)).response())
            for read in reads:
                wire.dataReceived(read)
            wire.connectionLost(Failure(ResponseDone()))
            self.assertEqual(sink.value(), expected)
            self.successResultOf(gate.done)
            self.assertTrue(gate.message_stop_seen)

    def test_one_write_per_read(self):
        """The complete events of one read reach the client in one write."""
        wire, gate, sink, _ = _wired(translate_request(_history(TOOLU)).response())
        frames = [chunk(e) for e in TOOL_EVENTS]
        wire.dataReceived(b"".join(frames[:6]) + frames[6][:10])
        self.assertEqual(len(sink.writes), 1)
        self.assertEqual(sdk_events(sink.writes[0])[-1][0], "content_block_delta")
        wire.dataReceived(frames[6][10:] + frames[7])
        self.assertEqual(len(sink.writes), 2)
        wire.dataReceived(frames[8])
        self.assertEqual([name for name, _ in sdk_events(sink.writes[2])], ["message_delta", "message_stop"])

    def test_pause_resume_stop_reach_the_upstream(self):
        wire, gate, sink, transport = _wired()
        self.assertIs(gate.transport, transport)
        gate.pauseProducing()
        self.assertEqual(transport.producerState, "paused")
        wire.dataReceived(chunk(START))
        self.assertEqual(sink.writes, [])
        gate.resumeProducing()
        self.assertEqual(transport.producerState, "producing")
        self.assertEqual(sink.value(), sse(START))
        gate.stopProducing()
        self.assertEqual(transport.producerState, "stopped")
        self.failureResultOf(gate.done)

    def test_malformed_stream_ends_cleanly(self):
        """
        A broken frame: the client gets the events before it and an
        ``api_error`` event, the upstream is stopped, and the gate ends the
        stream as one that reported its own error (no 502 after it).
        """
        errors = []
        wire, gate, sink, transport = _wired(on_error_event=errors.append)
        bad = chunk(TOOL_EVENTS[1])
        wire.dataReceived(chunk(START) + bad[:-1] + bytes([bad[-1] ^ 1]) + chunk(TOOL_EVENTS[2]))
        self.assertEqual(transport.producerState, "stopped")
        wire.dataReceived(chunk(TOOL_EVENTS[2]))
        wire.connectionLost(Failure(ResponseFailed([Failure(ConnectionLost())])))
        self.successResultOf(gate.done)
        self.assertTrue(gate.error_event_seen)
        events = _data(sdk_events(sink.value()))
        self.assertEqual([name for name, _ in events], ["message_start", "error"])
        self.assertEqual(errors, [events[1][1]])
        self.assertIn("message's checksum does not match", events[1][1]["error"]["message"])

    def test_exception_frame_ends_cleanly(self):
        wire, gate, sink, transport = _wired()
        wire.dataReceived(chunk(START) + exception("throttlingException", {"message": "Too many tokens"}))
        wire.connectionLost(Failure(ResponseDone()))
        self.successResultOf(gate.done)
        self.assertEqual(transport.producerState, "producing")
        self.assertEqual(wire.stream.error, BedrockError(429, "rate_limit_error", "Too many tokens"))
        self.assertEqual(_data(sdk_events(sink.value()))[-1], ("error", {"type": "error", "error": {"type": "rate_limit_error", "message": "Too many tokens"}}))

    def test_cut_after_message_delta(self):
        """The held ``message_delta`` reaches the client before the gate says the stream was cut."""
        wire, gate, sink, _ = _wired()
        wire.dataReceived(bedrock_stream(TOOL_EVENTS[:-1]))
        wire.connectionLost(Failure(ResponseDone()))
        self.assertEqual(sdk_events(sink.value())[-1][0], "message_delta")
        error = self.failureResultOf(gate.done, RelayError).value
        self.assertIn("cut before message_stop", error.message)

    def test_cut_in_a_frame(self):
        wire, gate, sink, _ = _wired()
        data = bedrock_stream(TOOL_EVENTS)
        wire.dataReceived(data[:-30])
        wire.connectionLost(Failure(ResponseFailed([Failure(ConnectionLost())])))
        self.assertEqual(wire.stream.pending, len(data) - len(bedrock_stream(TOOL_EVENTS[:-1])) - 30)
        self.failureResultOf(gate.done, RelayError)

    def test_ping_after_silence(self):
        """Bedrock sends no pings: after 15 s of silence the gate writes one, and not while frames come."""
        clock = Clock()
        wire, gate, sink, _ = _wired(clock=clock, ping_interval=15)
        wire.dataReceived(chunk(START))
        clock.advance(14)
        frame_bytes = chunk(TOOL_EVENTS[1])
        wire.dataReceived(frame_bytes[:30])
        clock.advance(14)
        self.assertNotIn(PING_EVENT, sink.value())
        wire.dataReceived(frame_bytes[30:])
        clock.advance(15)
        self.assertEqual(sink.writes[-1], PING_EVENT)
        self.assertEqual(gate.pings_sent, 1)


def _as_bedrock(stream: bytes, metrics: dict) -> list[bytes]:
    """A recorded Anthropic SSE stream as Bedrock sends it: a chunk frame per event, the metrics on ``message_stop``."""
    frames = []
    for raw in _reference_frame(stream)[0]:
        name, data = parse_event(raw)
        if name == "message_stop":
            data = json.dumps(dict(json.loads(data), **{"amazon-bedrock-invocationMetrics": metrics}))
        frames.append(chunk(data.encode()))
    return frames


class GateHandOffTests(SynchronousTestCase):
    """
    The wire hands the gate each read's events whole (``eventsReceived``):
    nothing is framed or searched again, only the events the gate decides
    and the wire did not parse are parsed; the client gets what the same
    events' SSE bytes would have given it.
    """

    def test_the_gate_is_handed_events(self):
        """
        One call a read, a read of no whole frame included: each event's
        name, its SSE bytes as the bytes path has them, and the payload the
        wire parsed (the usage events, the metrics merged) or ``None``; a
        protocol that reads bytes only gets those bytes.
        """
        data = bedrock_stream(TOOL_EVENTS, METRICS)
        reads = cuts(data, 3, 12)
        events, as_bytes = _Events(), _Bytes()
        for inner in (events, as_bytes):
            wire = EventStreamToSSE(inner)
            wire.makeConnection(StringTransport())
            for read in reads:
                wire.dataReceived(read)
            wire.connectionLost(Failure(ResponseDone()))
        self.assertEqual(len(events.received), len(reads))
        handed = [event for read in events.received for event in read]
        self.assertEqual(b"".join(raw for _, _, raw in handed), BedrockToSSE().feed(data))
        self.assertEqual(b"".join(as_bytes.received), BedrockToSSE().feed(data))
        for name, payload, raw in handed:
            said, text = parse_event(raw)
            self.assertEqual(said.encode(), name)
            if name in (b"message_start", b"message_delta", b"message_stop"):  # read for the usage and metrics
                self.assertEqual(payload, json.loads(text))
            else:
                self.assertIsNone(payload, name)

    def test_through_the_gate_as_bytes(self):
        """
        The recorded streams (ids fresh and reused, server tools, thinking
        with a marked signature, non-ASCII text, ids in ``message_start``,
        an upstream error event), as Bedrock frames with metrics, in reads
        of one frame, all at once and cut anywhere, under each upstream's
        rules: the same writes, rewrites, usage, error reports and ending as
        the gate gives the same events' bytes; the gate frames nothing and
        parses only the events it decides that the wire did not parse.
        """
        framed, parsed = [], []
        self.patch(sse_module, "event_name_at", lambda *args: framed.append(args) or event_name_at(*args))
        self.patch(sse_module, "parse_event", lambda raw: parsed.append(raw) or parse_event(raw))
        marking = UpstreamRules(name="anthropic", policy=UNIQUE, mark_thinking=True)
        streams = [STREAMS[name][:2] for name in gate_tests.GateEventsTests.NAMES] + [(ERROR_STREAM, TOOL_HISTORY)]
        rewritten = 0
        for stream, history in streams:
            frames = _as_bedrock(stream, METRICS)
            data = b"".join(frames)
            splits = [("one a read", frames), ("all in one", [data])]
            splits += [("cut, seed %d" % (seed,), cuts(data, seed, 4 + 3 * seed)) for seed in range(4)]
            for rules in (UNIQUE, ORIGINAL, marking):
                for body in (FRESH, history):
                    for label, reads in splits:
                        where = "%s, %s, %s" % (parse_event(_reference_frame(stream)[0][1])[0], rules, label)
                        by_bytes, bytes_sink, bytes_seen = _reporting_gate(body, rules)
                        by_bytes.makeConnection(StringTransport())
                        stream_reader = BedrockToSSE()
                        for read in reads:
                            by_bytes.dataReceived(stream_reader.feed(read))
                        by_bytes.dataReceived(b"".join(raw for _, _, raw in stream_reader.end()))
                        by_bytes.connectionLost(_done())
                        del framed[:], parsed[:]
                        by_events, events_sink, events_seen = _reporting_gate(body, rules)
                        wire = EventStreamToSSE(by_events)
                        wire.makeConnection(StringTransport())
                        for read in reads:
                            wire.dataReceived(read)
                        wire.connectionLost(_done())
                        self.assertEqual(framed, [], where)
                        decided = [raw for name, payload, raw in BedrockToSSE().events(data) if payload is None
                                   and (name in (b"content_block_start", b"error")
                                        or (rules is marking and b'"signature_delta"' in raw))]
                        self.assertEqual(parsed, decided, where)
                        for gate in (by_bytes, by_events):
                            self.assertIsNone(self.successResultOf(gate.done), where)
                        self.assertEqual(events_sink.writes, bytes_sink.writes, where)
                        self.assertEqual(events_seen, bytes_seen, where)
                        for counter in ("events_rewritten", "message_stop_seen", "error_event_seen",
                                        "bytes_received", "bytes_written"):
                            self.assertEqual(getattr(by_events, counter), getattr(by_bytes, counter),
                                             (counter, where))
                        rewritten += by_events.events_rewritten
        self.assertGreater(rewritten, 0)


class ChunkJsonTests(SynchronousTestCase):
    """The padding and the order of a chunk's fields do not matter."""

    def test_fields_in_any_order_and_escaped(self):
        raw = event_bytes(START)
        b64 = base64.b64encode(raw).decode()
        payloads = [
            json.dumps({"p": "abc", "bytes": b64}).encode(),
            json.dumps({"bytes": b64}).replace("/", "\\/").encode(),
            ujson.dumps({"bytes": b64, "p": ""}).encode(),
        ]
        for payload in payloads:
            self.assertEqual(BedrockToSSE().feed(frame(CHUNK_HEADERS, payload)), sse(START), payload)


class _BedrockResource(Resource):
    """An upstream that answers with an event stream and writes what the test says, when it says."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.requests = []

    def render_POST(self, request):
        request.setHeader(b"content-type", b"application/vnd.amazon.eventstream")
        self.requests.append(request)
        request.write(b"")  # the status line and headers, now
        return NOT_DONE_YET


class OverTwistedWebTests(SynchronousTestCase):
    """The Protocol on twisted.web's own HTTP client (``treq``'s ``deliverBody``), over an in-memory connection."""

    def _stream(self):
        upstream = _BedrockResource()
        stub = StubTreq(upstream)
        answered = stub.request("POST", "http://bedrock.test/model/m/invoke-with-response-stream", unbuffered=True)
        stub.flush()
        response = self.successResultOf(answered)
        self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/vnd.amazon.eventstream"])
        sink = _Sink()
        gate = SSEGate(sink, translate_request(_history(TOOLU)).response(), clock=Clock())
        response.deliverBody(EventStreamToSSE(gate))
        return stub, upstream.requests[0], gate, sink

    def test_whole_stream(self):
        stub, request, gate, sink = self._stream()
        for piece in cuts(bedrock_stream(TOOL_EVENTS, METRICS), 7, 25):
            request.write(piece)
            stub.flush()
        request.finish()
        stub.flush()
        self.assertIsNone(self.successResultOf(gate.done))
        events = _data(sdk_events(sink.value()))
        self.assertEqual([name for name, _ in events], [e["type"] for e in TOOL_EVENTS])
        self.assertEqual(events[4][1]["content_block"]["id"], TOOLU + "-2")
        self.assertEqual(events[-1][1], {"type": "message_stop"})

    def test_malformed_stream_drops_the_upstream(self):
        """A broken frame: the upstream connection is closed, the client's stream ends with the error, cleanly."""
        stub, request, gate, sink = self._stream()
        gone = []
        request.notifyFinish().addErrback(gone.append)
        request.write(chunk(START))
        stub.flush()
        bad = chunk(TOOL_EVENTS[1])
        request.write(bad[:-1] + bytes([bad[-1] ^ 1]) + chunk(TOOL_EVENTS[2]))
        stub.flush()
        self.assertEqual(len(gone), 1)
        self.assertIsNone(self.successResultOf(gate.done))
        self.assertEqual([name for name, _ in sdk_events(sink.value())], ["message_start", "error"])


class FailureTests(SynchronousTestCase):
    """A bug in the mapping is logged, and the client's stream still ends with an error event."""

    def test_bug_ends_the_stream_cleanly(self):
        wire, gate, sink, transport = _wired()
        wire.dataReceived(chunk(START))

        def broken(data):
            raise TypeError("a bug")

        wire.stream.events = broken
        wire.dataReceived(chunk(TOOL_EVENTS[1]))
        self.assertEqual(len(self.flushLoggedErrors(TypeError)), 1)
        self.assertEqual(transport.producerState, "stopped")
        wire.dataReceived(chunk(TOOL_EVENTS[2]))
        wire.connectionLost(Failure(ResponseFailed([Failure(ConnectionLost())])))
        self.successResultOf(gate.done)
        events = _data(sdk_events(sink.value()))
        self.assertEqual(events[-1][1]["error"], {"type": "api_error", "message": "The relay failed while reading the upstream's event stream."})
        self.assertEqual(len(events), 2)
