"""
Tests for :mod:`twisted_relay.sse`: the event framer, the SDK-style event
parser, and the gate that streams an upstream answer to the client.

Recorded streams are fed over every split (every packet size, a cut at every
position, seeded random splits) and every line ending, with the real id
translator; the output is checked per chunk, byte for byte, and parsed with
the Anthropic Python SDK's own decoder.
"""

from __future__ import annotations

import json
import random
import re

import ujson
from anthropic._streaming import SSEDecoder
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss

from twisted_relay.errors import RelayError
from twisted_relay.sse import (
    PING_EVENT,
    EventFramer,
    EventTooLarge,
    SSEGate,
    event_name,
    parse_event,
)
from twisted_relay.translation import ORIGINAL, UNIQUE, translate_request

# -- recorded streams ----------------------------------------------------------

TOOLU = "toolu_01T1x1fJ34qAmk2tNTrN7Up6"
SRVTOOLU = "srvtoolu_014hJH82Qum7Td6UV8gDXThB"
THINK_TOOLU = "toolu_01JtDzFxkgMxEPjnJrhU3ACs"
FR_TOOLU = "toolu_01Ff9h8zB6HL1KtUzKJmPZrE"

#: The tool-use stream of docs/protocol.md, verbatim.
TOOL_USE_STREAM = rb"""event: message_start
data: {"type":"message_start","message":{"id":"msg_014p7gG3wDgGV9EUtLvnow3U","type":"message","role":"assistant","model":"claude-opus-4-1-20250805","stop_sequence":null,"usage":{"input_tokens":472,"output_tokens":2},"content":[],"stop_reason":null}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}

event: ping
data: {"type": "ping"}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Okay"}}

event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: content_block_start
data: {"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_01T1x1fJ34qAmk2tNTrN7Up6","name":"get_weather","input":{}}}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"location\":"}}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":" \"San Francisco, CA\"}"}}

event: content_block_stop
data: {"type":"content_block_stop","index":1}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":89}}

event: message_stop
data: {"type":"message_stop"}

"""

SERVER_TOOL_STREAM = r"""event: message_start
data: {"type":"message_start","message":{"id":"msg_01Cn1b4wHjyZ4Mdp7kCFSZ5u","type":"message","role":"assistant","model":"claude-opus-4-1-20250805","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":2679,"output_tokens":3}}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"server_tool_use","id":"srvtoolu_014hJH82Qum7Td6UV8gDXThB","name":"web_search","input":{}}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":""}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":"{\"query\": \"météo Paris demain\"}"}}

event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: content_block_start
data: {"type":"content_block_start","index":1,"content_block":{"type":"web_search_tool_result","tool_use_id":"srvtoolu_014hJH82Qum7Td6UV8gDXThB","content":[{"type":"web_search_result","title":"Météo Paris – Prévisions à 15 jours","url":"https://meteo.example/fr/paris/","encrypted_content":"EqgfCioIARgBIiQ3YTAw/+==","page_age":"2 days ago"}]}}

event: content_block_stop
data: {"type":"content_block_stop","index":1}

event: content_block_start
data: {"type":"content_block_start","index":2,"content_block":{"type":"text","text":"","citations":[]}}

event: content_block_delta
data: {"type":"content_block_delta","index":2,"delta":{"type":"citations_delta","citation":{"type":"web_search_result_location","cited_text":"Ciel dégagé, 21 °C","url":"https://meteo.example/fr/paris/","title":"Météo Paris – Prévisions à 15 jours","encrypted_index":"Eo8BCioIAhgBIiQ5"}}}

event: content_block_delta
data: {"type":"content_block_delta","index":2,"delta":{"type":"text_delta","text":"Demain il fera beau à Paris : 21 °C."}}

event: content_block_stop
data: {"type":"content_block_stop","index":2}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":412,"server_tool_use":{"web_search_requests":1}}}

event: message_stop
data: {"type":"message_stop"}

""".encode("utf-8")

THINKING_STREAM = rb"""event: message_start
data: {"type":"message_start","message":{"id":"msg_01Vd9xU2QJ2FhJbLnn4NpL1c","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":610,"output_tokens":1}}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"The user wants the weather again; I should call get_weather."}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":" Location: San Francisco, CA."}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds+MbbCYB1Y4e+/nm4Ik1T5oH/V2xqRo="}}

event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: content_block_start
data: {"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_01JtDzFxkgMxEPjnJrhU3ACs","name":"get_weather","input":{}}}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"location\": \"San Francisco, CA\"}"}}

event: content_block_stop
data: {"type":"content_block_stop","index":1}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":96}}

event: message_stop
data: {"type":"message_stop"}

"""

# Raw U+2028 and U+0085 are line breaks for str.splitlines, not for SSE.
NON_ASCII_STREAM = (
    r"""event: message_start
data: {"type":"message_start","message":{"id":"msg_01GrVfWb3mZ1S7o2Gk8Tq9Lx","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":88,"output_tokens":1}}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Grüße aus Zürich! "}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"東京は晴れです。🌸✨ “quotes” SEP NEL"}}

event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: content_block_start
data: {"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_01Ff9h8zB6HL1KtUzKJmPZrE","name":"traduire","input":{}}}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"texte\": \"Ça va très bien, merci — 谢谢\"}"}}

event: content_block_stop
data: {"type":"content_block_stop","index":1}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":57}}

event: message_stop
data: {"type":"message_stop"}

""".replace("SEP", "\u2028")
    .replace("NEL", "\u0085")
    .encode("utf-8")
)

#: ``message_start`` may, in principle, carry whole blocks.
MESSAGE_START_STREAM = rb"""event: message_start
data: {"type":"message_start","message":{"id":"msg_01Pq","type":"message","role":"assistant","model":"m","content":[{"type":"text","text":"Again."},{"type":"tool_use","id":"toolu_01T1x1fJ34qAmk2tNTrN7Up6","name":"get_weather","input":{"location":"Paris"}}],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":9,"output_tokens":1}}}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":20}}

event: message_stop
data: {"type":"message_stop"}

"""

#: Comments, multi-line data, a field order other than event-first, no space.
COMMENTED_STREAM = rb"""
: relay warm-up

event: message_start
data: {"type":"message_start","message":{"id":"msg_01Zz","type":"message","role":"assistant","model":"m","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":5,"output_tokens":1}}}

: keep-alive

: a comment before the name
data: {"type":"content_block_start","index":0,
data: "content_block":{"type":"tool_use","id":"toolu_01T1x1fJ34qAmk2tNTrN7Up6",
data: "name":"get_weather","input":{}}}
event: content_block_start

data:{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":"{}"}}
event:content_block_delta

event: ping
data: {"type": "ping"}

event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":12}}

event: message_stop
data: {"type":"message_stop"}

"""

ERROR_STREAM = rb"""event: message_start
data: {"type":"message_start","message":{"id":"msg_01Er","type":"message","role":"assistant","model":"m","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":5,"output_tokens":1}}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hel"}}

event: error
data: {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}

"""


def _body(messages: list) -> dict:
    return {"model": "claude-sonnet-4-5", "max_tokens": 1024, "stream": True, "messages": messages}


FRESH = _body([{"role": "user", "content": "What is the weather in San Francisco?"}])


def _tool_turns(tool_id: str, name: str) -> list:
    return [
        {"role": "user", "content": "What is the weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": tool_id, "name": name, "input": {"location": "Paris"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": "15 °C"}]},
        {"role": "assistant", "content": "15 °C in Paris."},
        {"role": "user", "content": "And now?"},
    ]


TOOL_HISTORY = _body(_tool_turns(TOOLU, "get_weather"))
THINK_HISTORY = _body(_tool_turns(THINK_TOOLU, "get_weather"))
FR_HISTORY = _body(_tool_turns(FR_TOOLU, "traduire"))
SERVER_HISTORY = _body(
    [
        {"role": "user", "content": "Météo à Paris ?"},
        {
            "role": "assistant",
            "content": [
                {"type": "server_tool_use", "id": SRVTOOLU, "name": "web_search", "input": {"query": "météo Paris"}},
                {"type": "web_search_tool_result", "tool_use_id": SRVTOOLU, "content": []},
                {"type": "text", "text": "Il fait 18 °C."},
            ],
        },
        {"role": "user", "content": "Et demain ?"},
    ]
)

#: name -> (stream, colliding history, {event index: {upstream id: client id}}).
STREAMS = {
    "tool_use": (TOOL_USE_STREAM, TOOL_HISTORY, {5: {TOOLU: TOOLU + "-2"}}),
    "server_tool": (
        SERVER_TOOL_STREAM,
        SERVER_HISTORY,
        {1: {SRVTOOLU: SRVTOOLU + "_2"}, 5: {SRVTOOLU: SRVTOOLU + "_2"}},
    ),
    "thinking": (THINKING_STREAM, THINK_HISTORY, {6: {THINK_TOOLU: THINK_TOOLU + "-2"}}),
    "non_ascii": (NON_ASCII_STREAM, FR_HISTORY, {5: {FR_TOOLU: FR_TOOLU + "-2"}}),
    "message_start": (MESSAGE_START_STREAM, TOOL_HISTORY, {0: {TOOLU: TOOLU + "-2"}}),
    "commented": (COMMENTED_STREAM, TOOL_HISTORY, {5: {TOOLU: TOOLU + "-2"}}),
}

ENDINGS = ("\n", "\r\n", "\r", "mixed")

# -- helpers -----------------------------------------------------------------

_LINE_END = re.compile(rb"\r\n|\r|\n")


def _with_endings(stream: bytes, ending: str, seed: int = 0) -> bytes:
    """The stream with every line ending replaced (``mixed``: a seeded choice per line)."""
    lines = stream.split(b"\n")
    assert lines[-1] == b""
    if ending == "mixed":
        rnd = random.Random(seed)
        return b"".join(line + rnd.choice((b"\n", b"\r\n", b"\r")) for line in lines[:-1])
    return b"".join(line + ending.encode("ascii") for line in lines[:-1])


def _reference_frame(data: bytes) -> tuple[list[bytes], bytes]:
    """
    An independent oracle: frame a whole stream line by line (an empty line
    ends an event); returns the events and the incomplete tail.
    """
    events = []
    start = line_start = 0
    for m in _LINE_END.finditer(data):
        if m.start() == line_start:
            events.append(data[start : m.end()])
            start = m.end()
        line_start = m.end()
    return events, data[start:]


def _splits(data: bytes, randoms: int = 20):
    """Every packet size, a cut at every position, and seeded random splits."""
    n = len(data)
    for size in range(1, n + 1):
        yield "packet size %d" % (size,), [data[i : i + size] for i in range(0, n, size)]
    for cut in range(1, n):
        yield "cut at %d" % (cut,), [data[:cut], data[cut:]]
    for seed in range(randoms):
        rnd = random.Random(seed)
        chunks, i = [], 0
        while i < n:
            size = rnd.choice((rnd.randint(1, 8), rnd.randint(1, 64), rnd.randint(1, 600)))
            chunks.append(data[i : i + size])
            i += size
        yield "random seed %d" % (seed,), chunks


def _replace_ids(obj, mapping: dict) -> None:
    """Replace, in place, every id field whose value is in ``mapping``."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ("id", "tool_use_id", "tool_id") and value in mapping:
                obj[key] = mapping[value]
            else:
                _replace_ids(value, mapping)
    elif isinstance(obj, list):
        for value in obj:
            _replace_ids(value, mapping)


def _rewritten(raw: bytes, mapping: dict) -> bytes:
    """The bytes a rewritten event must have: one ``event:`` and one ``data:`` line."""
    name, data = parse_event(raw)
    obj = json.loads(data)
    before = json.dumps(obj)
    for key in ("content_block", "message"):
        if key in obj:
            _replace_ids(obj[key], mapping)
    assert json.dumps(obj) != before, "the mapping must change this event"
    body = ujson.dumps(obj, ensure_ascii=False, escape_forward_slashes=False)
    return b"event: " + name.encode() + b"\ndata: " + body.encode("utf-8") + b"\n\n"


def _sdk_events(stream: bytes) -> list[tuple[str | None, str]]:
    """The events as the Anthropic Python SDK decodes them."""
    return [(e.event, e.data) for e in SSEDecoder().iter_bytes(iter([stream]))]


def _held(data: bytes, end: int) -> bool:
    # An event that ends in a bare "\r" waits for the next byte.
    return data[end - 1] == 13


class _Sink:
    """The client side: records every write."""

    def __init__(self):
        self.writes: list[bytes] = []

    def __call__(self, data: bytes) -> None:
        assert isinstance(data, bytes), type(data)
        self.writes.append(data)

    def value(self) -> bytes:
        return b"".join(self.writes)


def _gate(translator=None, **kwargs):
    """A gate connected to a ``StringTransport``, with its sink, transport and clock."""
    sink = _Sink()
    clock = kwargs.pop("clock", None) or Clock()
    gate = SSEGate(sink, translator, clock=clock, **kwargs)
    transport = StringTransport()
    gate.makeConnection(transport)
    return gate, sink, transport, clock


def _done() -> Failure:
    return Failure(ResponseDone("Response body fully received"))


# -- the framer ----------------------------------------------------------------


class EventFramerTests(SynchronousTestCase):
    """
    :class:`EventFramer` returns each event exactly as received, whatever the
    split and the line endings.
    """

    def test_events_keep_their_bytes(self):
        """
        Each event comes back with its lines and blank line as received, and
        the incomplete tail stays pending.
        """
        framer = EventFramer()
        events = framer.feed(b"event: a\ndata: 1\n\nevent: b\r\ndata: 2\r\n\r\nevent: c\rdata")
        self.assertEqual(events, [b"event: a\ndata: 1\n\n", b"event: b\r\ndata: 2\r\n\r\n"])
        self.assertEqual(framer.pending, b"event: c\rdata")
        self.assertEqual(framer.feed(b": 3\r\r"), [])
        self.assertEqual(framer.feed(b"e"), [b"event: c\rdata: 3\r\r"])
        self.assertEqual(framer.pending, b"e")

    def test_crlf_split_between_chunks(self):
        """
        A ``\\r\\n`` whose halves arrive in two chunks is one line ending: the
        ``\\n`` stays with its event.
        """
        framer = EventFramer()
        self.assertEqual(framer.feed(b"data: x\r\n\r"), [])
        self.assertEqual(framer.feed(b"\ndata: y\r\n\r\n"), [b"data: x\r\n\r\n", b"data: y\r\n\r\n"])

    def test_bare_cr_at_end_waits_for_the_next_byte(self):
        """
        An event ended by a ``\\r`` at the end of a chunk is held until the
        next byte says it was not a ``\\r\\n``; ``close`` releases it.
        """
        framer = EventFramer()
        self.assertEqual(framer.feed(b"data: x\r\r"), [])
        self.assertEqual(framer.close(), [b"data: x\r\r"])
        self.assertEqual(framer.pending, b"")

    def test_close_leaves_an_incomplete_event(self):
        """An event with no blank line is still pending after ``close``."""
        framer = EventFramer()
        framer.feed(b"event: a\ndata: 1\r")
        self.assertEqual(framer.close(), [])
        self.assertEqual(framer.pending, b"event: a\ndata: 1\r")

    def test_blank_line_alone_is_an_event(self):
        """A blank line between events is an (empty) event of its own, not glued to the next."""
        framer = EventFramer()
        self.assertEqual(framer.feed(b"data: 1\n\n\ndata: 2\n\n"), [b"data: 1\n\n", b"\n", b"data: 2\n\n"])
        self.assertEqual(framer.feed(b"\r\n\r"), [b"\r\n"])
        self.assertEqual(framer.close(), [b"\r"])

    def test_whole_chunk_is_not_copied(self):
        """A chunk that ends on an event boundary comes back as its own bytes object."""
        chunk = b"data: 1\n\n"
        self.assertIs(EventFramer().feed(chunk)[0], chunk)

    def test_too_large(self):
        """
        An event over the limit raises ``EventTooLarge``, which still carries
        the complete events before it; an event of exactly the limit passes.
        """
        framer = EventFramer(max_event_bytes=10)
        self.assertEqual(framer.feed(b"data: 12\n\n"), [b"data: 12\n\n"])
        with self.assertRaises(EventTooLarge) as caught:
            framer.feed(b"data: 1\n\ndata: 12345")
        self.assertEqual(caught.exception.events, [b"data: 1\n\n"])
        self.assertEqual(caught.exception.limit, 10)

    def test_too_large_complete_event(self):
        """A complete event over the limit, received in one chunk, is refused too."""
        with self.assertRaises(EventTooLarge):
            EventFramer(max_event_bytes=10).feed(b"data: 12345\n\n")

    def test_recorded_streams_every_split(self):
        """
        Every recorded stream, with every line ending, frames into the same
        events over every split as the line-by-line oracle does on the whole.
        """
        for name, (stream, _, _) in STREAMS.items():
            for ending in ENDINGS:
                data = _with_endings(stream, ending)
                expected, tail = _reference_frame(data)
                self.assertEqual(tail, b"")
                for label, chunks in _splits(data, randoms=5):
                    framer = EventFramer()
                    events = []
                    for chunk in chunks:
                        events.extend(framer.feed(chunk))
                    events.extend(framer.close())
                    self.assertEqual(events, expected, "%s, %r, %s" % (name, ending, label))

    @settings(max_examples=300, deadline=None)
    @given(
        data=st.lists(
            st.sampled_from([b"\r", b"\n", b"\r\n", b"a", b":", b" ", b"data: x", "é".encode()]),
            max_size=60,
        ).map(b"".join),
        cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
    )
    def test_concatenation_is_the_input(self, data, cuts):
        """
        For any bytes and any split, the events and the pending tail
        concatenate to the input, and match the oracle's framing.
        """
        points = sorted({c % (len(data) + 1) for c in cuts})
        chunks = [data[a:b] for a, b in zip([0] + points, points + [len(data)])]
        framer = EventFramer()
        events = []
        received = b""
        for chunk in chunks:
            received += chunk
            events.extend(framer.feed(chunk))
            self.assertEqual(b"".join(events) + framer.pending, received)
        events.extend(framer.close())
        self.assertEqual(b"".join(events) + framer.pending, data)
        self.assertEqual((events, framer.pending), _reference_frame(data))
