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

import twisted_relay.sse as sse
from twisted_relay.errors import RelayError
from twisted_relay.sse import PING_EVENT, SSEGate
from twisted_relay.sse_events import (
    EventFramer,
    EventTooLarge,
    event_data_at,
    event_name,
    event_name_at,
    parse_event,
)
from twisted_relay.translation import ORIGINAL, UNIQUE, UpstreamRules, translate_request

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
                {
                    "type": "server_tool_use",
                    "id": SRVTOOLU,
                    "name": "web_search",
                    "input": {"query": "météo Paris"},
                },
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
    "commented": (COMMENTED_STREAM, TOOL_HISTORY, {4: {TOOLU: TOOLU + "-2"}}),
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
        out, previous = [], b""
        for line in lines[:-1]:
            # "\r" then an empty line ended by "\n" would be one "\r\n".
            choices = (b"\r\n", b"\r") if previous == b"\r" and not line else (b"\n", b"\r\n", b"\r")
            previous = rnd.choice(choices)
            out.append(line + previous)
        return b"".join(out)
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



#: Generated lines of one SSE event: a field (or a comment, or junk), a
#: separator, a value, an ending (:func:`_generated_event` joins them).
_EVENT_LINES = st.lists(
    st.tuples(
        st.sampled_from(["event", "data", ":", "id", "x", "data", "event"]),
        st.sampled_from(["", ":", ": ", ":  "]),
        st.text(alphabet="ab \u00e9:{}\u2028", max_size=6),
        st.sampled_from(["\n", "\r\n", "\r"]),
    ),
    min_size=1,
    max_size=6,
)


def _generated_event(lines) -> bytes:
    """One event of :data:`_EVENT_LINES`' lines (empty ones left out), ended by a blank line."""
    lines = [line for line in lines if "".join(line[:3])]
    # The blank line takes the last line's ending, so that it stays blank.
    return ("".join("".join(line) for line in lines) + (lines[-1][3] if lines else "\n")).encode("utf-8")

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


class FramerSkipTests(SynchronousTestCase):
    """
    ``EventFramer.next_marked``, the gate's way through a read: the events
    it skips hold none of the markers, the events it returns are exactly the
    framer's events, and together they are the input, over every split.
    """

    def _walk(self, chunks, markers, max_event_bytes=None):
        """
        Feed ``chunks`` as the gate does (append, take with next_marked,
        compact); return the pieces taken in order, as ("event", bytes) and
        ("skipped", bytes), and what is left pending.
        """
        framer = EventFramer() if max_event_bytes is None else EventFramer(max_event_bytes)
        pieces = []

        def take():
            buf = framer.buffer
            while True:
                before = framer.position
                start, end = framer.next_marked(markers)
                if start != before:
                    pieces.append(("skipped", bytes(buf[before:start])))
                if end < 0:
                    self.assertEqual(start, framer.position)
                    break
                self.assertEqual(end, framer.position)
                pieces.append(("event", bytes(buf[start:end])))
            framer.compact()
            self.assertEqual(framer.position, 0)

        for chunk in chunks:
            framer.append(chunk)
            take()
        framer.end()
        take()
        return pieces, framer.pending

    def _check(self, data, chunks, markers, where):
        expected, tail = _reference_frame(data)
        pieces, pending = self._walk(chunks, markers)
        self.assertEqual(pending, tail, where)
        self.assertEqual(b"".join(piece for _, piece in pieces) + pending, data, where)
        # Cut the skipped runs at the oracle's event ends: each must be whole
        # events, none holding a marker; every event returned is the oracle's.
        framed = []
        for kind, piece in pieces:
            if kind == "event":
                framed.append(piece)
                continue
            while piece:
                event = expected[len(framed)]
                self.assertTrue(piece.startswith(event), where)
                self.assertFalse(any(marker in event for marker in markers), (where, event))
                framed.append(event)
                piece = piece[len(event) :]
        self.assertEqual(framed, expected, where)
        return pieces

    def test_recorded_streams_every_split(self):
        """
        Over every split and line ending of the recorded streams, with the
        gate's markers and with others, skipping keeps exactly the framing,
        and every event holding a marker is returned on its own.
        """
        gated = (b"_start\n", b"error\n", b"message_stop\n")
        for name, (stream, _, _) in STREAMS.items():
            for ending in ENDINGS:
                data = _with_endings(stream, ending, seed=len(name))
                for markers in (gated, (b"_delta\n",), (b"never here\n",)):
                    for label, chunks in _splits(data, randoms=2):
                        self._check(data, chunks, markers, "%s, %r, %r, %s" % (name, ending, markers, label))

    def test_whole_read_skipped_at_once(self):
        """
        A read of unmarked events and one marked event in the middle gives
        three pieces: the events before it in one, the marked event, and the
        events after it in one.
        """
        delta = b"event: content_block_delta\ndata: {}\n\n"
        start = b"event: content_block_start\ndata: {}\n\n"
        data = delta * 20 + start + delta * 30
        pieces, pending = self._walk([data], (b"_start\n", b"error\n"))
        self.assertEqual(pieces, [("skipped", delta * 20), ("event", start), ("skipped", delta * 30)])
        self.assertEqual(pending, b"")

    def test_no_skipping_once_a_carriage_return_came(self):
        """After a ``\\r``, a ``\\n\\n`` may not end an event: every event is returned."""
        data = b"data: a\r\n\r\ndata: b\n\ndata: c\n\n"
        pieces, _ = self._walk([data], (b"nothing\n",))
        self.assertEqual(
            pieces, [("event", b"data: a\r\n\r\n"), ("event", b"data: b\n\n"), ("event", b"data: c\n\n")]
        )

    def test_limit_still_applies(self):
        """
        Events are skipped in bulk only while all of them together are
        within the size limit of one; beyond it each is framed and an
        oversized one raises, with the events before it taken.
        """
        small = b"data: 123456789\n\n"  # 17 bytes
        pieces, _ = self._walk([small * 3], (b"x\n",), max_event_bytes=40)
        self.assertEqual(pieces, [("event", small)] * 3)
        pieces, _ = self._walk([small * 2], (b"x\n",), max_event_bytes=40)
        self.assertEqual(pieces, [("skipped", small * 2)])
        framer = EventFramer(max_event_bytes=40)
        framer.append(small + b"data: " + b"9" * 40 + b"\n\n")
        self.assertEqual(framer.next_marked((b"x\n",)), (0, len(small)))
        self.assertRaises(EventTooLarge, framer.next_marked, (b"x\n",))
        self.assertEqual(framer.position, len(small))


# -- parsing -------------------------------------------------------------------

_ODD_EVENTS = [
    b"event: a\ndata: 1\n\n",
    b"event:a\ndata:1\n\n",
    b"event:  a\ndata:  1\n\n",
    b": comment\nevent: a\n: another\ndata: x\ndata: y\n\n",
    b"data: x\nevent: late\n\n",
    b"event: first\nevent: second\ndata: z\n\n",
    b"event: a\r\ndata: 1\r\ndata:\r\n\r\n",
    b"event: a\rdata: {\"k\": 1}\r\r",
    b"data\nevent\n\n",
    b"eventual: no\ndata: q\n\n",
    b"id: 7\nretry: 10\nevent: a\ndata: 1\n\n",
    "event: a\ndata: é\u2028x\n\n".encode("utf-8"),
]


class ParseEventTests(SynchronousTestCase):
    """:func:`parse_event` reads an event exactly as the Anthropic SDK does."""

    def test_like_the_sdk(self):
        """Name and data agree with the SDK's decoder on odd but valid events."""
        for raw in _ODD_EVENTS:
            (expected,) = _sdk_events(raw)
            self.assertEqual(parse_event(raw), expected, raw)

    def test_rules(self):
        """Comments are skipped, one space is stripped, data lines join with ``\\n``."""
        self.assertEqual(
            parse_event(b": hi\nevent: x\ndata: a\ndata:  b\ndata:c\n\n"), ("x", "a\n b\nc")
        )
        self.assertEqual(parse_event(b": only a comment\n\n"), (None, ""))

    @settings(max_examples=200, deadline=None)
    @given(_EVENT_LINES)
    def test_generated_like_the_sdk(self, lines):
        """For generated events (no blank line inside), parse_event agrees with the SDK."""
        raw = _generated_event(lines)
        sdk = _sdk_events(raw)
        name, data = parse_event(raw)
        self.assertEqual((name, data), sdk[0] if sdk else (None, ""))
        self.assertEqual(event_name(raw), None if name is None else name.encode("utf-8"))


class EventNameTests(SynchronousTestCase):
    """:func:`event_name` finds the name the SDK would dispatch on."""

    def test_names(self):
        """The common shape, spacing variants, a late or repeated field, and no name at all."""
        self.assertEqual(event_name(b"event: content_block_delta\ndata: {}\n\n"), b"content_block_delta")
        self.assertEqual(event_name(b"event:x\r\ndata: {}\r\n\r\n"), b"x")
        self.assertEqual(event_name(b"event: x\rdata: {}\r\r"), b"x")
        self.assertEqual(event_name(b"data: {}\nevent: late\n\n"), b"late")
        self.assertEqual(event_name(b"event: a\nevent: b\n\n"), b"b")
        self.assertEqual(event_name(b": c\nevent: a\n\n"), b"a")
        self.assertEqual(event_name(b"eventual: a\ndata: 1\n\n"), None)
        self.assertEqual(event_name(b"data: 1\n\n"), None)
        self.assertEqual(event_name(b"\n"), None)

    def test_like_the_sdk(self):
        """On every odd event, the name is the SDK's."""
        for raw in _ODD_EVENTS:
            ((name, _),) = _sdk_events(raw)
            self.assertEqual(event_name(raw), None if name is None else name.encode(), raw)


class EventDataTests(SynchronousTestCase):
    """:func:`event_data_at` gives an event's data as :func:`parse_event` does, in UTF-8 bytes."""

    def _check(self, raw: bytes) -> None:
        expected = parse_event(raw)[1].encode("utf-8")
        others = b'event: x\ndata: {"before": 1}\n\n', b'data: {"after": 2}\n\n'
        for cr in (True,) if b"\r" in raw else (True, False):
            for buf in (raw, others[0] + raw + others[1], bytearray(others[0] + raw)):
                start = 0 if buf is raw else len(others[0])
                data = event_data_at(buf, start, start + len(raw), cr)
                self.assertEqual((type(data), data), (bytes, expected), (raw, cr, type(buf)))

    def test_shapes(self):
        """The common shape and every other one: a space or none, comments, several data lines, no data."""
        for raw in (
            b'event: response.output_text.delta\ndata: {"delta": "data: x"}\n\n',
            b'data: {"choices": []}\n\n',
            b"data:[DONE]\n\n",
            b"data:  two spaces, one kept\n\n",
            b": a comment\ndata: 1\n\n",
            b"data: 1\ndata: 2\n\n",
            b"event: data\ndata: 1\n\n",
            b"data: 1\nevent: late\n\n",
            b"data\n\n",
            b"event: ping\n\n",
            b"\n",
            b"data: 1\r\n\r\n",
            "data: caf\u00e9 \u2028\n\n".encode("utf-8"),
        ):
            self._check(raw)

    @settings(max_examples=200, deadline=None)
    @given(_EVENT_LINES)
    def test_generated_like_parse_event(self, lines):
        """For generated events, in a buffer of others or alone, the data is parse_event's."""
        self._check(_generated_event(lines))


# -- the gate: recorded streams over every split ---------------------------


class GateStreamTests(SynchronousTestCase):
    """
    Over every split and line ending, the client receives the upstream's
    bytes unchanged except the events whose ids the translator rewrote, in
    order, each written as soon as it is complete and decided.
    """

    def _check(self, name: str, policy: str = UNIQUE) -> None:
        stream, history, rewrites = STREAMS[name]
        for ending in ENDINGS:
            data = _with_endings(stream, ending, seed=len(name))
            events, tail = _reference_frame(data)
            self.assertEqual(tail, b"")
            ends = []
            for raw in events:
                ends.append((ends[-1] if ends else 0) + len(raw))
            for body, expected_rewrites in ((FRESH, {}), (history, rewrites)):
                out_events = [
                    _rewritten(raw, expected_rewrites[i]) if i in expected_rewrites else raw
                    for i, raw in enumerate(events)
                ]
                expected = b"".join(out_events)
                # How many output bytes the client must hold once i events are through.
                written_after = [0]
                for raw in out_events:
                    written_after.append(written_after[-1] + len(raw))
                for label, chunks in _splits(data):
                    kind = "colliding" if expected_rewrites else "clean"
                    where = "%s, %r, %s, %s" % (name, ending, kind, label)
                    translator = translate_request(body, policy).response()
                    gate, sink, transport, _ = _gate(translator)
                    received = complete = 0
                    for chunk in chunks:
                        before = len(sink.writes)
                        gate.dataReceived(chunk)
                        received += len(chunk)
                        while complete < len(ends) and ends[complete] <= received:
                            complete += 1
                        through = complete
                        if through and ends[through - 1] == received and _held(data, received):
                            through -= 1
                        new = sink.writes[before:]
                        self.assertLessEqual(len(new), 1, where)
                        self.assertEqual(len(sink.value()), written_after[through], where)
                    gate.connectionLost(_done())
                    self.assertEqual(sink.value(), expected, where)
                    self.assertIsNone(self.successResultOf(gate.done), where)
                    ids = sum(len(m) for m in expected_rewrites.values())
                    self.assertEqual(len(translator.rewrites), ids, where)
                    self.assertEqual(gate.events_rewritten, len(expected_rewrites), where)
                    self.assertTrue(gate.message_stop_seen, where)
                    self.assertEqual(gate.bytes_received, len(data), where)
                    self.assertEqual(gate.bytes_written, len(expected), where)
                if not expected_rewrites:
                    self.assertEqual(expected, data)
                # The SDK reads the same events, the rewritten ids aside.
                sdk_in, sdk_out = _sdk_events(data), _sdk_events(expected)
                self.assertEqual(len(sdk_in), len(sdk_out))
                changed = 0
                for (in_name, in_data), (out_name, out_data) in zip(sdk_in, sdk_out):
                    self.assertEqual(in_name, out_name)
                    if in_data != out_data:
                        changed += 1
                        mapping = {}
                        for m in expected_rewrites.values():
                            mapping.update(m)
                        obj = json.loads(in_data)
                        _replace_ids(obj, mapping)
                        self.assertEqual(json.loads(out_data), obj)
                self.assertEqual(changed, len(expected_rewrites))

    def test_tool_use_stream(self):
        """
        The protocol.md stream passes byte for byte; when the upstream reuses
        an id of the history, only its ``content_block_start`` changes.
        """
        self._check("tool_use")

    def test_tool_use_stream_original_policy(self):
        """Under ``--upstream-ids original`` the reused id is rewritten the same way."""
        self._check("tool_use", ORIGINAL)

    def test_server_tool_stream(self):
        """
        A reused ``server_tool_use`` id is rewritten with ``_``, and so is the
        ``web_search_tool_result`` that points at it; non-ASCII text and URLs
        stay readable (no ``\\u`` or ``\\/`` escapes).
        """
        self._check("server_tool")
        _, history, rewrites = STREAMS["server_tool"]
        events, _ = _reference_frame(SERVER_TOOL_STREAM)
        rewritten = _rewritten(events[5], rewrites[5])
        self.assertIn("Météo Paris – Prévisions".encode("utf-8"), rewritten)
        self.assertIn(b"https://meteo.example/fr/paris/", rewritten)

    def test_thinking_stream(self):
        """Thinking and signature deltas pass byte for byte around a rewritten tool_use."""
        self._check("thinking")

    def test_non_ascii_stream(self):
        """
        UTF-8 text, including U+2028 and U+0085 (line breaks for Python's
        ``str.splitlines`` only), passes byte for byte.
        """
        self._check("non_ascii")

    def test_message_start_blocks(self):
        """Blocks inside ``message_start`` are translated too."""
        self._check("message_start")

    def test_comments_and_multiline_data(self):
        """
        Comments, an event whose name comes after its data and whose JSON
        spans three ``data:`` lines, and fields without a space: all pass,
        and the multi-line ``content_block_start`` is decided like any other.
        """
        self._check("commented")

    def test_decided_before_anything_later(self):
        """
        When the colliding ``content_block_start`` arrives with the next
        events in one chunk, a single write carries the rewritten event
        followed by the rest, and no byte of the original is ever written.
        """
        events, _ = _reference_frame(TOOL_USE_STREAM)
        gate, sink, _, _ = _gate(translate_request(TOOL_HISTORY).response())
        gate.dataReceived(b"".join(events[:5]))
        self.assertEqual(sink.writes, [b"".join(events[:5])])
        gate.dataReceived(events[5][:40])
        self.assertEqual(len(sink.writes), 1)
        gate.dataReceived(events[5][40:] + b"".join(events[6:8]))
        self.assertEqual(len(sink.writes), 2)
        rewritten = _rewritten(events[5], {TOOLU: TOOLU + "-2"})
        self.assertEqual(sink.writes[1], rewritten + b"".join(events[6:8]))
        self.assertNotIn(b'"id":"' + TOOLU.encode() + b'"', sink.value())

    def test_events_between_gated_ones_pass_in_bulk(self):
        """
        In one read holding several events the gate must read, with many
        deltas between them, only those events are read one by one: the
        deltas between them pass in bulk, and the output is the input with
        the colliding start rewritten.
        """
        import twisted_relay.sse as sse

        events, _ = _reference_frame(TOOL_USE_STREAM)
        read = []

        def counting(buf, start, end, cr=True):
            read.append(bytes(buf[start:end]))
            return real(buf, start, end, cr)

        real = sse.event_name_at
        self.patch(sse, "event_name_at", counting)
        delta = (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"some text"}}\n\n'
        )
        stop = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
        chunk = b"".join(events[:5]) + delta * 200 + events[5] + delta * 200 + stop
        gate, sink, _, _ = _gate(translate_request(TOOL_HISTORY).response())
        gate.dataReceived(chunk)
        expected = b"".join(events[:5]) + delta * 200 + _rewritten(events[5], {TOOLU: TOOLU + "-2"}) + delta * 200 + stop
        self.assertEqual(sink.writes, [expected])
        self.assertTrue(gate.message_stop_seen)
        self.assertNotIn(delta, read)
        self.assertIn(events[5], read)
        self.assertIn(stop, read)
        self.assertLess(len(read), 10)

    def test_gated_events_found_among_lookalike_text(self):
        """
        Text deltas that mention the gate's event names (as code does) pass
        through untouched, and the events that carry those names are still
        read in the same chunk, however their ``event`` line is spelt.
        """
        events, _ = _reference_frame(TOOL_USE_STREAM)
        lookalike = (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"on error call _start(); message_stop error\\n"}}\n\n'
        )
        no_space = events[5].replace(b"event: content_block_start", b"event:content_block_start")
        self.assertNotEqual(no_space, events[5])
        stop = b'event:message_stop\ndata: {"type":"message_stop"}\n\n'
        chunk = b"".join(events[:5]) + lookalike * 20 + no_space + lookalike * 20 + stop
        errors = []
        gate, sink, _, _ = _gate(translate_request(TOOL_HISTORY).response(), on_error_event=errors.append)
        gate.dataReceived(chunk)
        expected_start = _rewritten(no_space, {TOOLU: TOOLU + "-2"})
        self.assertEqual(
            sink.writes,
            [b"".join(events[:5]) + lookalike * 20 + expected_start + lookalike * 20 + stop],
        )
        self.assertTrue(gate.message_stop_seen)
        gate, sink, _, _ = _gate(None, on_error_event=errors.append)
        error = b'event:error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"x"}}\n\n'
        gate.dataReceived(lookalike * 20 + error)
        self.assertEqual(sink.value(), lookalike * 20 + error)
        self.assertTrue(gate.error_event_seen)
        self.assertEqual(errors, [{"type": "error", "error": {"type": "overloaded_error", "message": "x"}}])

    def test_clean_chunk_is_written_as_received(self):
        """
        When nothing is rewritten, a chunk of whole events is written as the
        very bytes object received: no copy, no re-encoding.
        """
        gate, sink, _, _ = _gate(translate_request(FRESH).response())
        gate.dataReceived(TOOL_USE_STREAM)
        self.assertIs(sink.writes[0], TOOL_USE_STREAM)

    def test_parallel_reuse_in_one_response(self):
        """
        Two ``tool_use`` blocks of one response with one id: the second one
        is renamed even with a clean history, and on_rewrite reports it.
        """
        events, _ = _reference_frame(TOOL_USE_STREAM)
        second, second_stop = (e.replace(b'"index":1', b'"index":2') for e in (events[5], events[8]))
        stream = b"".join(events[:9]) + second + second_stop + b"".join(events[9:])
        seen = []
        gate, sink, _, _ = _gate(translate_request(FRESH).response(), on_rewrite=seen.append)
        gate.dataReceived(stream)
        gate.connectionLost(_done())
        self.assertEqual([(r.upstream_id, r.client_id) for r in seen], [(TOOLU, TOOLU + "-2")])
        self.assertIn(_rewritten(second, {TOOLU: TOOLU + "-2"}), sink.value())
        self.assertEqual(sink.value().count(events[5]), 1)

    def test_without_translator(self):
        """With no translator the gate passes everything through, colliding ids included."""
        gate, sink, _, _ = _gate(None)
        for i in range(0, len(TOOL_USE_STREAM), 7):
            gate.dataReceived(TOOL_USE_STREAM[i : i + 7])
        gate.connectionLost(_done())
        self.assertEqual(sink.value(), TOOL_USE_STREAM)
        self.assertIsNone(self.successResultOf(gate.done))

    def test_unparseable_event_passes(self):
        """
        A ``content_block_start`` that is not JSON (or not the expected
        shape) is passed through as is: the relay never breaks a stream it
        cannot read.
        """
        stream = (
            b"event: content_block_start\ndata: {not json\n\n"
            b"event: content_block_start\ndata: [1, 2]\n\n"
            b"event: message_start\ndata: {\"message\": 3}\n\n"
            b"event: message_stop\ndata: {}\n\n"
        )
        gate, sink, _, _ = _gate(translate_request(TOOL_HISTORY).response())
        gate.dataReceived(stream)
        gate.connectionLost(_done())
        self.assertEqual(sink.value(), stream)
        self.assertIsNone(self.successResultOf(gate.done))


# -- the gate: events a wire made itself ---------------------------------------


def _as_events(raws) -> list[tuple[bytes, dict, bytes]]:
    """Events as a wire hands them to the gate: each one's name, its data parsed, its bytes."""
    events = []
    for raw in raws:
        name, data = parse_event(raw)
        events.append((name.encode("utf-8"), json.loads(data), raw))
    return events


def _reporting_gate(body: dict, rules):
    """
    A gate (not yet connected) for the answer to ``body`` under ``rules``,
    its sink, and what it reports: rewrites, usage, error events (an
    ``error`` event's "Overloaded" redacted).
    """
    seen = {"rewrites": [], "usage": [], "errors": []}
    sink = _Sink()
    gate = SSEGate(
        sink,
        translate_request(body, rules).response(),
        clock=Clock(),
        on_rewrite=seen["rewrites"].append,
        on_usage=lambda name, payload: seen["usage"].append((name, json.dumps(payload))),
        on_error_event=seen["errors"].append,
        redact_error=lambda raw: raw.replace(b"Overloaded", b"[REDACTED]"),
    )
    return gate, sink, seen


def _groups(events: list, seed: int) -> list[list]:
    """``events`` in runs of seeded random lengths (a read holds one or several)."""
    rnd, groups, i = random.Random(seed), [], 0
    while i < len(events):
        size = rnd.randint(1, 4)
        groups.append(events[i : i + size])
        i += size
    return groups


class GateEventsTests(SynchronousTestCase):
    """
    Events a wire made itself reach the gate parsed (``eventsReceived``:
    name, data, bytes) and are decided and written exactly as their bytes
    would be through ``dataReceived``: the same writes, ids, signatures,
    usage, errors and ending; without being framed or parsed again.
    """

    #: Streams a wire can make: one ``event`` and one ``data`` line each.
    NAMES = ("tool_use", "server_tool", "thinking", "non_ascii", "message_start")

    def _gate(self, body: dict, rules):
        gate, sink, seen = _reporting_gate(body, rules)
        gate.makeConnection(StringTransport())
        return gate, sink, seen

    def test_as_their_bytes(self):
        """
        Every stream, fresh and colliding, under each upstream's rules
        (one that marks thinking too), in reads of one event, of all, and
        of random runs: what the client gets and what the gate reports
        are those of the same bytes; none is framed or parsed again.
        """
        read = []
        self.patch(sse, "parse_event", lambda raw: read.append(raw) or parse_event(raw))
        self.patch(sse, "event_name_at", lambda *args: read.append(args) or event_name_at(*args))
        marking = UpstreamRules(name="anthropic", policy=UNIQUE, mark_thinking=True)
        streams = [STREAMS[name][:2] for name in self.NAMES] + [(ERROR_STREAM, TOOL_HISTORY)]
        for stream, history in streams:
            events, tail = _reference_frame(stream)
            self.assertEqual(tail, b"")
            for rules in (UNIQUE, ORIGINAL, marking):
                for body in (FRESH, history):
                    for label, groups in [("one a read", [[e] for e in events]), ("all in one", [events])] + [
                        ("seed %d" % (seed,), _groups(events, seed)) for seed in range(5)
                    ]:
                        where = "%s, %s, %s" % (event_name(events[1]), rules, label)
                        by_bytes, bytes_sink, bytes_seen = self._gate(body, rules)
                        for group in groups:
                            by_bytes.dataReceived(b"".join(group))
                        del read[:]
                        by_events, events_sink, events_seen = self._gate(body, rules)
                        for group in groups:
                            by_events.eventsReceived(_as_events(group))
                        self.assertEqual(read, [], where)
                        for gate in (by_bytes, by_events):
                            gate.connectionLost(_done())
                            self.assertIsNone(self.successResultOf(gate.done), where)
                        self.assertEqual(events_sink.writes, bytes_sink.writes, where)
                        self.assertEqual(events_seen, bytes_seen, where)
                        for counter in ("events_rewritten", "message_stop_seen", "error_event_seen",
                                        "bytes_received", "bytes_written"):
                            self.assertEqual(getattr(by_events, counter), getattr(by_bytes, counter),
                                             (counter, where))
        # The colliding thinking stream under the marking rules: its id and signature both changed.
        by_events, sink, _ = self._gate(THINK_HISTORY, marking)
        by_events.eventsReceived(_as_events(_reference_frame(THINKING_STREAM)[0]))
        self.assertEqual(by_events.events_rewritten, 2)
        self.assertNotIn(b'"id":"' + THINK_TOOLU.encode() + b'"', sink.value())

    def test_payload_is_not_read_again(self):
        """The gate reads the payload it is given, not the bytes: a rewrite is made of the payload."""
        events = _as_events(_reference_frame(TOOL_USE_STREAM)[0])
        name, payload, raw = events[5]
        payload["content_block"]["name"] = "from_the_payload"
        gate, sink, _ = self._gate(TOOL_HISTORY, UNIQUE)
        gate.eventsReceived(events)
        self.assertIn(b'"name":"from_the_payload"', sink.value())
        self.assertIn(b'"id":"' + TOOLU.encode() + b'-2"', sink.value())

    def test_wait_behind_a_pause(self):
        """Events that come while paused are held, and written in one go, in order and decided, on resume."""
        events, _ = _reference_frame(TOOL_USE_STREAM)
        gate, sink, transport, _ = _gate(translate_request(TOOL_HISTORY).response())
        gate.eventsReceived(_as_events(events[:2]))
        gate.pauseProducing()
        gate.eventsReceived(_as_events(events[2:6]))
        gate.eventsReceived(_as_events(events[6:]))
        self.assertEqual(sink.writes, [b"".join(events[:2])])
        self.assertEqual(transport.producerState, "paused")
        gate.resumeProducing()
        rewritten = _rewritten(events[5], {TOOLU: TOOLU + "-2"})
        self.assertEqual(sink.writes[1:], [b"".join(events[2:5]) + rewritten + b"".join(events[6:])])
        gate.connectionLost(_done())
        self.assertIsNone(self.successResultOf(gate.done))

    def test_client_write_pauses(self):
        """A write that pauses the gate (a full client buffer): the next events wait for the resumption."""
        events, _ = _reference_frame(TOOL_USE_STREAM)
        writes = []

        def write(data):
            writes.append(data)
            gate.pauseProducing()

        gate = SSEGate(write, None, clock=Clock())
        gate.makeConnection(StringTransport())
        gate.eventsReceived(_as_events(events[:1]))
        gate.eventsReceived(_as_events(events[1:2]))
        gate.eventsReceived(_as_events(events[2:3]))
        self.assertEqual(writes, [events[0]])
        gate.resumeProducing()
        self.assertEqual(writes, [events[0], events[1] + events[2]])

    def test_nothing_after_the_end(self):
        """After the client went away, events are dropped: nothing written."""
        events, _ = _reference_frame(TOOL_USE_STREAM)
        gate, sink, _, _ = _gate()
        gate.stopProducing()
        gate.eventsReceived(_as_events(events))
        self.assertEqual(sink.writes, [])
        self.failureResultOf(gate.done, CancelledError)

    def test_no_events_is_news_of_the_upstream(self):
        """A read that made no event still tells the idle timer that the upstream is alive."""
        gate, _, _, clock = _gate(idle_timeout=30)
        for _ in range(3):
            clock.advance(20)
            gate.eventsReceived([])
        self.assertNoResult(gate.done)
        clock.advance(31)
        self.assertEqual(self.failureResultOf(gate.done, RelayError).value.status, 504)

    def test_translator_bug(self):
        """A translator that raises fails the stream with a 500 and writes nothing of the read."""

        class Broken:
            rewrites = []

            def translate_block(self, block):
                raise ZeroDivisionError()

            translate_message = translate_block

        events, _ = _reference_frame(TOOL_USE_STREAM)
        gate, sink, transport, _ = _gate(Broken())
        gate.eventsReceived(_as_events(events[:2]))
        self.assertEqual(self.failureResultOf(gate.done, RelayError).value.status, 500)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.assertEqual(transport.producerState, "stopped")
        self.assertEqual(sink.value(), b"")


# -- the gate: flow control ------------------------------------------------


class GateRedactionTests(SynchronousTestCase):
    """``redact_error`` sees upstream ``error`` events only, and its result is what the client gets."""

    def test_only_error_events_redacted(self):
        """
        Every event but ``error`` reaches the client as received (the
        redactor never sees it, even when it holds the secret); an
        ``error`` event, JSON or not, reaches it redacted.
        """
        seen = []

        def redact(raw: bytes) -> bytes:
            seen.append(raw)
            return raw.replace(b"SECRET", b"[REDACTED]")

        start = b'event: message_start\ndata: {"type":"message_start","message":{"id":"SECRET","content":[]}}\n\n'
        delta = (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"SECRET"}}\n\n'
        )
        error = b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"SECRET"}}\n\n'
        broken = b"event: error\ndata: not json SECRET\n\n"
        gate, sink, _, _ = _gate(redact_error=redact)
        gate.dataReceived(start + delta + error + broken)
        gate.connectionLost(_done())
        self.successResultOf(gate.done)
        self.assertEqual(seen, [error, broken])
        self.assertEqual(
            sink.value(),
            start + delta + error.replace(b"SECRET", b"[REDACTED]") + broken.replace(b"SECRET", b"[REDACTED]"),
        )


class GateFlowControlTests(SynchronousTestCase):
    """
    The gate is the push producer registered on the client request: a slow
    client pauses the upstream, and nothing is written while paused.
    """

    def test_pause_and_resume_reach_the_upstream(self):
        """Pausing the gate pauses the upstream transport; resuming resumes it."""
        gate, _, transport, _ = _gate()
        gate.pauseProducing()
        self.assertEqual(transport.producerState, "paused")
        gate.resumeProducing()
        self.assertEqual(transport.producerState, "producing")

    def test_nothing_written_while_paused(self):
        """
        Events that arrive while paused are held, and written in one go, in
        order, on resume.
        """
        events, _ = _reference_frame(TOOL_USE_STREAM)
        gate, sink, _, _ = _gate(translate_request(TOOL_HISTORY).response())
        gate.dataReceived(b"".join(events[:2]))
        gate.pauseProducing()
        gate.dataReceived(b"".join(events[2:6]))
        gate.dataReceived(b"".join(events[6:]))
        self.assertEqual(sink.writes, [b"".join(events[:2])])
        gate.resumeProducing()
        rewritten = _rewritten(events[5], {TOOLU: TOOLU + "-2"})
        self.assertEqual(
            sink.writes[1:], [b"".join(events[2:5]) + rewritten + b"".join(events[6:])]
        )
        gate.connectionLost(_done())
        self.assertIsNone(self.successResultOf(gate.done))

    def test_client_write_pauses(self):
        """
        When the client's write fills its buffer and pauses the gate from
        inside ``write`` (as a Twisted transport does), later chunks wait.
        """
        events, _ = _reference_frame(TOOL_USE_STREAM)
        writes = []
        transport = StringTransport()

        def write(data):
            writes.append(data)
            gate.pauseProducing()

        gate = SSEGate(write, None, clock=Clock())
        gate.makeConnection(transport)
        gate.dataReceived(events[0])
        self.assertEqual(transport.producerState, "paused")
        gate.dataReceived(events[1])
        gate.dataReceived(events[2])
        self.assertEqual(writes, [events[0]])
        gate.resumeProducing()
        self.assertEqual(writes, [events[0], events[1] + events[2]])

    def test_pause_before_connection(self):
        """
        A pause that comes before treq connects the body (the request was
        already paused at ``registerProducer``) is applied on connection.
        """
        gate = SSEGate(_Sink(), None, clock=Clock())
        gate.pauseProducing()
        transport = StringTransport()
        gate.makeConnection(transport)
        self.assertEqual(transport.producerState, "paused")

    def test_stop_producing(self):
        """
        The client went away: the upstream is stopped, ``done`` fails with
        ``CancelledError``, no timer is left, and nothing more is written.
        """
        gate, sink, transport, clock = _gate(idle_timeout=30, ping_interval=10)
        gate.dataReceived(TOOL_USE_STREAM[:100])
        gate.stopProducing()
        self.assertEqual(transport.producerState, "stopped")
        self.failureResultOf(gate.done, CancelledError)
        self.assertEqual(clock.getDelayedCalls(), [])
        gate.dataReceived(TOOL_USE_STREAM[100:])
        gate.connectionLost(Failure(ResponseFailed([Failure(ConnectionLost())])))
        gate.stopProducing()
        clock.advance(100)
        self.assertEqual(sink.writes, [])

    def test_cancel_done(self):
        """Cancelling ``done`` (Klein does, when the client disconnects) stops the upstream."""
        gate, _, transport, clock = _gate(idle_timeout=30)
        gate.done.cancel()
        self.failureResultOf(gate.done, CancelledError)
        self.assertEqual(transport.producerState, "stopped")
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_stop_before_connection(self):
        """A stop that comes before the body is connected stops the upstream on connection."""
        gate = SSEGate(_Sink(), None, clock=Clock(), idle_timeout=5)
        gate.stopProducing()
        transport = StringTransport()
        gate.makeConnection(transport)
        self.assertEqual(transport.producerState, "stopped")
        self.failureResultOf(gate.done, CancelledError)


# -- the gate: timers --------------------------------------------------------


class GateTimerTests(SynchronousTestCase):
    """The relay pings a silent stream, and gives up on one that stays silent."""

    def test_ping_after_silence(self):
        """
        After ``ping_interval`` seconds without an upstream byte the client
        gets a relay ping, then one per interval; upstream bytes postpone it.
        """
        events, _ = _reference_frame(TOOL_USE_STREAM)
        gate, sink, _, clock = _gate(ping_interval=10)
        gate.dataReceived(events[0])
        clock.advance(9.9)
        self.assertEqual(sink.value(), events[0])
        clock.advance(0.1)
        self.assertEqual(sink.writes, [events[0], PING_EVENT])
        clock.advance(10)
        self.assertEqual(sink.writes[2:], [PING_EVENT])
        gate.dataReceived(events[1])
        clock.advance(9)
        self.assertEqual(sink.writes[3:], [events[1]])
        clock.advance(1)
        self.assertEqual(sink.writes[4:], [PING_EVENT])
        self.assertEqual(gate.pings_sent, 3)

    def test_ping_falls_between_events(self):
        """
        A ping during a half-received event goes out before it: the client's
        stream still parses into the upstream's events, plus the ping.
        """
        events, _ = _reference_frame(TOOL_USE_STREAM)
        gate, sink, _, clock = _gate(ping_interval=10)
        gate.dataReceived(events[0] + events[1][:30])
        clock.advance(10)
        gate.dataReceived(events[1][30:] + b"".join(events[2:]))
        gate.connectionLost(_done())
        self.assertEqual(sink.value(), events[0] + PING_EVENT + b"".join(events[1:]))
        sdk = _sdk_events(sink.value())
        self.assertEqual(sdk[1], ("ping", '{"type": "ping"}'))
        self.assertEqual(sdk[:1] + sdk[2:], _sdk_events(TOOL_USE_STREAM))

    def test_idle_timeout(self):
        """
        ``idle_timeout`` seconds without an upstream byte fail ``done`` with
        a 504 ``timeout_error`` and stop the upstream; a later byte or end is
        ignored.
        """
        gate, sink, transport, clock = _gate(idle_timeout=30, ping_interval=10)
        gate.dataReceived(TOOL_USE_STREAM[:200])
        clock.advance(20)
        gate.dataReceived(TOOL_USE_STREAM[200:300])
        clock.advance(29)
        self.assertNoResult(gate.done)
        clock.advance(1)
        error = self.failureResultOf(gate.done, RelayError).value
        self.assertEqual((error.status, error.error_type), (504, "timeout_error"))
        self.assertIn("30 seconds", error.message)
        self.assertEqual(transport.producerState, "stopped")
        self.assertEqual(clock.getDelayedCalls(), [])
        written = sink.value()
        gate.dataReceived(TOOL_USE_STREAM[300:])
        gate.connectionLost(_done())
        self.assertEqual(sink.value(), written)

    def test_pause_is_not_upstream_silence(self):
        """
        While the client holds the stream paused, no ping and no idle
        timeout: the silence is ours. The clock restarts on resume.
        """
        gate, sink, _, clock = _gate(idle_timeout=30, ping_interval=10)
        gate.dataReceived(TOOL_USE_STREAM[:200])
        gate.pauseProducing()
        clock.advance(1000)
        self.assertNoResult(gate.done)
        self.assertEqual(gate.pings_sent, 0)
        gate.resumeProducing()
        clock.pump([1] * 29)
        self.assertNoResult(gate.done)
        self.assertEqual(gate.pings_sent, 2)
        clock.advance(1)
        self.assertEqual(self.failureResultOf(gate.done, RelayError).value.status, 504)

    def test_timers_cancelled_on_clean_end(self):
        """A finished stream leaves no timer behind."""
        gate, _, _, clock = _gate(idle_timeout=30, ping_interval=10)
        gate.dataReceived(TOOL_USE_STREAM)
        gate.connectionLost(_done())
        self.assertIsNone(self.successResultOf(gate.done))
        self.assertEqual(clock.getDelayedCalls(), [])


# -- the gate: how a stream ends -------------------------------------------


class GateEndingTests(SynchronousTestCase):
    """
    ``done`` says whether the client got a whole stream, whatever way the
    upstream body ended, and it fires exactly once.
    """

    def _end(self, data: bytes, reason: Failure, **kwargs):
        gate, sink, _, clock = _gate(idle_timeout=30, ping_interval=10, **kwargs)
        gate.dataReceived(data)
        gate.connectionLost(reason)
        self.assertEqual(clock.getDelayedCalls(), [])
        return gate, sink

    def test_complete(self):
        """After ``message_stop``, ``ResponseDone`` and ``PotentialDataLoss`` both succeed."""
        for reason in (_done(), Failure(PotentialDataLoss())):
            gate, sink = self._end(TOOL_USE_STREAM, reason)
            self.assertIsNone(self.successResultOf(gate.done))
            self.assertEqual(sink.value(), TOOL_USE_STREAM)

    def test_cut_before_message_stop(self):
        """
        A body that ends between events but before ``message_stop`` fails
        with a 502 ``api_error`` saying the stream was cut, for every reason.
        """
        events, _ = _reference_frame(TOOL_USE_STREAM)
        cut = b"".join(events[:-1])
        for reason in (
            _done(),
            Failure(PotentialDataLoss()),
            Failure(ResponseFailed([Failure(ConnectionLost())])),
            Failure(ConnectionDone()),
        ):
            gate, sink = self._end(cut, reason)
            error = self.failureResultOf(gate.done, RelayError).value
            self.assertEqual((error.status, error.error_type), (502, "api_error"))
            self.assertIn("cut before message_stop", error.message)
            self.assertEqual(sink.value(), cut)

    def test_cut_mid_event(self):
        """
        A body that ends inside an event fails with a 502 saying so; the
        partial event is never written.
        """
        events, _ = _reference_frame(TOOL_USE_STREAM)
        cut = b"".join(events[:6]) + events[6][:20]
        for reason in (
            _done(),
            Failure(PotentialDataLoss()),
            Failure(ResponseFailed([Failure(ConnectionLost())])),
            Failure(ConnectionLost()),
            Failure(ConnectionDone()),
        ):
            gate, sink = self._end(cut, reason)
            error = self.failureResultOf(gate.done, RelayError).value
            self.assertEqual(error.status, 502)
            self.assertIn("cut in the middle of an event", error.message)
            self.assertEqual(sink.value(), b"".join(events[:6]))

    def test_upstream_error_event(self):
        """
        An upstream ``error`` event reaches the client as sent and
        ``on_error_event`` with its payload; the stream then ends cleanly
        without ``message_stop`` (the upstream reported its own end).
        """
        payloads = []
        gate, sink = self._end(ERROR_STREAM, _done(), on_error_event=payloads.append)
        self.assertIsNone(self.successResultOf(gate.done))
        self.assertEqual(sink.value(), ERROR_STREAM)
        self.assertEqual(
            payloads, [{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}]
        )

    def test_unreadable_error_event(self):
        """
        An ``error`` event whose data is not JSON still ends the stream as
        the upstream's own report: passed through, no callback, no 502.
        """
        payloads = []
        stream = ERROR_STREAM.replace(b'{"type": "error", "error"', b"{oops")
        gate, sink = self._end(stream, _done(), on_error_event=payloads.append)
        self.assertIsNone(self.successResultOf(gate.done))
        self.assertEqual((sink.value(), payloads), (stream, []))

    def test_held_cr_event_released_at_end(self):
        """
        A stream with bare ``\\r`` line endings: its last event, held for the
        byte that never comes, is written when the body ends.
        """
        data = _with_endings(TOOL_USE_STREAM, "\r")
        gate, sink, _, _ = _gate()
        gate.dataReceived(data)
        self.assertEqual(len(sink.value()), len(data) - len(_reference_frame(data)[0][-1]))
        gate.connectionLost(_done())
        self.assertEqual(sink.value(), data)
        self.assertIsNone(self.successResultOf(gate.done))

    def test_end_while_paused(self):
        """Events held by a pause are written when the body ends, before ``done`` fires."""
        results = []
        gate, sink, _, _ = _gate()
        gate.done.addCallback(lambda _: results.append(sink.value()))
        gate.pauseProducing()
        gate.dataReceived(TOOL_USE_STREAM)
        self.assertEqual(sink.writes, [])
        gate.connectionLost(_done())
        self.assertEqual(results, [TOOL_USE_STREAM])

    def test_fires_once(self):
        """A second ``connectionLost``, or a stop after the end, changes nothing."""
        gate, _ = self._end(TOOL_USE_STREAM, _done())
        gate.connectionLost(Failure(ConnectionLost()))
        gate.stopProducing()
        gate.pauseProducing()
        gate.resumeProducing()
        self.assertIsNone(self.successResultOf(gate.done))

    def test_translator_bug(self):
        """
        A translator that raises fails the stream with a 500 (logged), stops
        the upstream, and writes nothing of the undecided event.
        """

        class Broken:
            rewrites = []

            def translate_block(self, block):
                raise ZeroDivisionError()

            translate_message = translate_block

        events, _ = _reference_frame(TOOL_USE_STREAM)
        gate, sink, transport, _ = _gate(Broken())
        gate.dataReceived(events[0] + events[1])
        self.assertEqual(self.failureResultOf(gate.done, RelayError).value.status, 500)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.assertEqual(transport.producerState, "stopped")
        self.assertEqual(sink.value(), b"")


# -- the gate: oversized events ----------------------------------------------


class GateMaxEventTests(SynchronousTestCase):
    """An upstream event over ``max_event_bytes`` ends the stream with a 502."""

    def test_oversized_event(self):
        """
        The events before the oversized one are written, the upstream is
        stopped, and ``done`` fails with a 502 ``api_error``.
        """
        events, _ = _reference_frame(TOOL_USE_STREAM)
        limit = max(map(len, events[:3]))
        big = b"event: content_block_delta\ndata: " + b"x" * limit + b"\n\n"
        gate, sink, transport, _ = _gate(max_event_bytes=limit)
        gate.dataReceived(b"".join(events[:3]) + big[:10])
        gate.dataReceived(big[10:limit])
        self.assertNoResult(gate.done)
        gate.dataReceived(big[limit : limit + 1])
        error = self.failureResultOf(gate.done, RelayError).value
        self.assertEqual((error.status, error.error_type), (502, "api_error"))
        self.assertIn(str(limit), error.message)
        self.assertEqual(transport.producerState, "stopped")
        self.assertEqual(sink.value(), b"".join(events[:3]))

    def test_oversized_in_one_chunk(self):
        """A complete oversized event in one chunk with others: those before it still go out."""
        events, _ = _reference_frame(TOOL_USE_STREAM)
        gate, sink, _, _ = _gate(max_event_bytes=len(events[0]))
        gate.dataReceived(events[0] + events[0] + b":" + events[0])
        self.assertEqual(self.failureResultOf(gate.done, RelayError).value.status, 502)
        self.assertEqual(sink.value(), events[0] + events[0])
