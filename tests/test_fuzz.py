"""
Hostile-input fuzzing: thousands of malformed requests, and the relay must
answer each one well.

Every answer is either a well-formed Anthropic error (4xx/5xx, JSON with
``type: error`` and string ``error.type`` and ``error.message``; never a
traceback, never HTML, never the relay's own 500) or a correct relay of the
simulated upstream's answer (a whole message or a whole SSE stream, whose
tool-use ids repeat none of the client's). Nothing may be logged as an
error, and the relay still serves a normal request afterwards.

The bulk runs in memory (:class:`tests.helpers.InMemoryRelay`, fast); a
smaller run sends raw bytes over a real socket, where HTTP framing itself
can be hostile.
"""

from __future__ import annotations

import socket

import treq
import ujson
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.testing import MemoryReactorClock
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.http_headers import Headers
from twisted.web.server import Site

from twisted_relay.config import RelayConfig, one_upstream
from twisted_relay.errors import ERROR_TYPES
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.upstream_agent import BytesProducer

from tests.faulty_upstream import parse_response
from tests.helpers import InMemoryRelay, encode, messages_body, serve_relay

RELAY_KEY = "rk-fuzz-key"
_FUZZ = dict(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
# A Twisted HTTP channel refuses a request it cannot frame (a header line
# it cannot parse, too many or too large headers, a bad content-length or
# chunk) with these very bytes, before any resource sees it.
_FRAMING_REFUSAL = b"HTTP/1.1 400 Bad Request\r\n\r\n"

# -- strategies ----------------------------------------------------------------

#: Ids from a small pool collide often; the rest are odd in every way.
_ID_POOL = ["toolu_1", "toolu_1-2", "toolu_1-3", "toolu_2", "srvtoolu_1", "srvtoolu_1_2", "functions.get_weather:0"]
_ODD_IDS = [
    "", "-2", "-", "--2", "toolu_1-2-2", "toolu_1-0", "toolu_1-02", "toolu_1-99999999999999999999",
    "toolu_1\n", "toolu 1", "\x00", "é", "ü🎉", "\u202etoolu", "x" * 300, "toolu_1-2_2",
]
ids = st.one_of(
    st.sampled_from(_ID_POOL),
    st.sampled_from(_ODD_IDS),
    st.text(max_size=12),
    st.builds(lambda c, n: c * n, st.characters(), st.integers(1000, 70000)),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.lists(st.sampled_from(_ID_POOL), max_size=2),
    st.fixed_dictionaries({"id": st.sampled_from(_ID_POOL)}),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
block_types = st.one_of(
    st.sampled_from(
        [
            "text", "image", "document", "thinking", "redacted_thinking", "container_upload", "compaction",
            "tool_use", "server_tool_use", "mcp_tool_use", "future_tool_use", "_tool_use", "tool_use ",
            "TOOL_USE", "tool_result", "mcp_tool_result", "web_search_tool_result",
            "code_execution_tool_result", "future_tool_result", "", "search_result",
        ]
    ),
    st.text(max_size=8),
    json_values,
)


def _block(content):
    return st.fixed_dictionaries(
        {"type": block_types},
        optional={
            "id": ids,
            "tool_use_id": ids,
            "name": st.one_of(st.sampled_from(["get_weather", ""]), json_values),
            "input": json_values,
            "text": st.one_of(st.text(max_size=20), json_values),
            "caller": st.one_of(
                st.fixed_dictionaries({"type": st.just("code_execution_20250825"), "tool_id": ids}), json_values
            ),
            "content": content,
            "is_error": json_values,
        },
    )


# Block content nests: a tool_result's content holds blocks, which hold content...
contents = st.recursive(
    st.one_of(st.text(max_size=20), json_values),
    lambda inner: st.one_of(st.lists(_block(inner), max_size=4), _block(inner)),
    max_leaves=8,
)
roles = st.one_of(st.sampled_from(["user", "assistant", "system", "", "tool", "USER"]), json_values)
messages = st.one_of(
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"role": roles, "content": contents}),
            st.fixed_dictionaries({}, optional={"role": roles, "content": contents, "extra": json_values}),
            json_values,
        ),
        max_size=8,
    ),
    json_values,
)
streams = st.one_of(st.just(True), st.just(True), st.booleans(), json_values)


#: Ids a strict upstream accepts, colliding often.
valid_ids = st.one_of(
    st.sampled_from(["toolu_1", "toolu_1-2", "toolu_1-3", "toolu_2", "toolu_1-2-2", "toolu_3-2"]),
    st.sampled_from(["toolu_1", "toolu_2"]),
    st.from_regex(r"\Atoolu_[a-zA-Z0-9_-]{1,8}\Z"),
)


@st.composite
def plausible_sessions(draw, odd_ids: bool = False):
    """
    Tool-use sessions that look right, with ids drawn so that they often
    collide; with ``odd_ids``, ids of any kind at all.
    """
    session_ids = st.one_of(valid_ids, ids) if odd_ids else valid_ids
    history = [{"role": "user", "content": draw(st.text(min_size=1, max_size=30))}]
    for _ in range(draw(st.integers(0, 5))):
        uses = [
            {
                "type": "tool_use",
                "id": draw(session_ids),
                "name": "get_weather",
                "input": {"city": draw(st.text(max_size=8))},
            }
            for _ in range(draw(st.integers(1, 3)))
        ]
        history.append({"role": "assistant", "content": [{"type": "text", "text": "Checking."}] + uses})
        results = [
            {
                "type": "tool_result",
                "tool_use_id": draw(st.one_of(st.just(use["id"]), session_ids)) if odd_ids else use["id"],
                "content": "sunny",
            }
            for use in uses
        ]
        history.append({"role": "user", "content": results})
    return messages_body(history, stream=draw(st.booleans()))


bodies = st.one_of(
    plausible_sessions(),
    plausible_sessions(odd_ids=True),
    st.fixed_dictionaries(
        {"model": st.one_of(st.just("claude-sonnet-4-5"), json_values), "messages": messages},
        optional={
            "max_tokens": st.one_of(st.integers(-5, 10**6), json_values),
            "stream": streams,
            "tools": st.one_of(st.just(messages_body()["tools"]), json_values),
            "system": st.one_of(st.text(max_size=20), contents),
            "tool_choice": json_values,
        },
    ),
    json_values,
)

#: Raw JSON that Python's JSON would never write, spliced in where a value goes.
_HOSTILE_LITERALS = [
    b'"\\ud800"', b'"\\udfff\\ud800"', b'"a\\ud83d"', b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999",
    b"123456789012345678901234567890123456789", b"-0", b'"\\u0000"', b"[" * 2000 + b"]" * 2000,
    b"[" * 100000, b'{"a":1,"a":2}', b"nul", b"tru", b'"unterminated', b"\xff\xfe", b'"\xc3\x28"',
    b'"\xed\xa0\x80"', b"{}" * 3, b'{"type":"tool_use","id":"toolu_1","id":"toolu_2"}', b"-", b"01",
]
raw_bodies = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(lambda text: text.encode("utf-8")),
    st.builds(
        lambda body, cut: encode(body)[:cut], plausible_sessions(), st.integers(0, 400)
    ),
    st.builds(lambda body, junk: encode(body) + junk, plausible_sessions(), st.binary(min_size=1, max_size=8)),
    st.sampled_from([b"", b"\xef\xbb\xbf{}", b"\x00" * 64, b"[]" * 1000, b'{"messages": []}' * 2]),
)


@st.composite
def spliced_bodies(draw):
    """A plausible session whose JSON has one hostile literal spliced in where a value was."""
    raw = encode(draw(plausible_sessions()))
    marker = draw(st.sampled_from([b'"Checking."', b'"sunny"', b'"get_weather"', b'"claude-sonnet-4-5"', b"256"]))
    if marker not in raw:
        marker = b"256"
    literal = draw(st.sampled_from(_HOSTILE_LITERALS))
    return raw.replace(marker, literal, draw(st.sampled_from([1, -1])))


header_values = st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
    st.text(max_size=40).map(lambda t: t.encode("utf-8")),
    st.sampled_from([b"", b" ", b"application/json; charset=latin-1", b"text/plain", b"2023-06-01,2023-06-01",
                     b"Bearer", b"Bearer ", b"bearer " + RELAY_KEY.encode(), b"Bearer  " + RELAY_KEY.encode(),
                     RELAY_KEY.encode() + b"\x00", RELAY_KEY.encode().upper(), b"\xff" * 40, b"x" * 8000]),
)
odd_headers = st.dictionaries(
    st.sampled_from(
        [b"anthropic-version", b"anthropic-beta", b"x-api-key", b"authorization",
         b"x-claude-code-session-id", b"accept", b"accept-encoding", b"connection", b"cookie", b"expect",
         b"x-relay-request-id", b"content-encoding", b"user-agent", b"x-stainless-retry-count"]
    ),
    st.lists(header_values, min_size=1, max_size=3),
    max_size=6,
)
paths = st.one_of(
    st.sampled_from(
        ["/v1/messages", "/v1/messages/count_tokens", "/v1/models", "/v1/models/x", "/v1/messages?beta=true"]
    ),
    st.builds(
        lambda base, tail: base + tail,
        st.sampled_from(["/v1/messages", "/v1/models/", "/", "/v1/", "/ready", "/health"]),
        st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="#"), max_size=20),
    ),
)
methods = st.sampled_from([b"POST", b"GET", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"HEAD", b"TRACE", b"FOO"])

# -- judging an answer -----------------------------------------------------------


def _declared_ids(value) -> set[str]:
    """Every string id declared anywhere in a client's request body."""
    found = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            kind = item.get("type")
            if isinstance(kind, str) and kind.endswith("tool_use") and isinstance(item.get("id"), str):
                found.add(item["id"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _explained(error: BaseException) -> str:
    """An error with the notes Hypothesis attaches (the falsifying example), which trial does not print."""
    parts = []
    for one in getattr(error, "exceptions", None) or [error]:
        parts.append("%s: %s" % (one.__class__.__name__, str(one)[:2000]))
        parts.extend(note[:4000] for note in getattr(one, "__notes__", []))
    return "\n".join(parts)


class AnswerJudge:
    """Assertions on one answer of the relay, shared by both runs."""

    def check_property(self, property) -> None:
        """Run a Hypothesis property; on failure, say which examples failed and how."""
        try:
            property()
        except Exception as e:
            raise self.failureException(_explained(e)) from e

    def assert_anthropic_error(self, status: int, raw: bytes) -> dict:
        """A well-formed Anthropic error body, never the relay's own 500."""
        self.assertNotIn(b"Traceback", raw)
        self.assertNotIn(b"<html", raw.lower())
        body = ujson.loads(raw)
        self.assertIsInstance(body, dict)
        self.assertEqual(body.get("type"), "error", raw)
        self.assertIsInstance(body["error"]["type"], str)
        self.assertIsInstance(body["error"]["message"], str)
        self.assertNotEqual(status, 500, raw)
        if status in ERROR_TYPES and status != 405:
            self.assertEqual(body["error"]["type"], ERROR_TYPES[status], raw)
        return body

    def assert_answer(self, method: bytes, path: str, sent, status: int, content_type: bytes, raw: bytes) -> str:
        """
        Judge one answer; return what it was (``error``, ``message``,
        ``stream`` or ``other``) for the tallies.
        """
        if method == b"HEAD":
            # A HEAD answer, error or not, has headers only.
            self.assertEqual(raw, b"")
            self.assertNotEqual(status, 500)
            return "other"
        if status >= 400:
            self.assertTrue(content_type.startswith(b"application/json"), (status, content_type, raw[:200]))
            self.assert_anthropic_error(status, raw)
            return "error"
        self.assertEqual(status, 200, raw[:300])
        route = path.split("?")[0]
        history = _declared_ids(sent)
        if route == "/v1/messages" and content_type.startswith(b"text/event-stream"):
            self.assertTrue(isinstance(sent, dict) and sent.get("stream") is True)
            self.assert_stream(raw, history)
            return "stream"
        self.assertTrue(content_type.startswith(b"application/json"), content_type)
        answer = ujson.loads(raw)
        if route == "/v1/messages":
            self.assertEqual(answer["type"], "message")
            self.assert_fresh_ids([b["id"] for b in answer["content"] if b["type"].endswith("tool_use")], history)
            return "message"
        return "other"

    def assert_stream(self, raw: bytes, history: set[str]) -> None:
        """A whole stream: ``message_start`` first, ``message_stop`` last, every event named and JSON."""
        events = [event for event in raw.split(b"\n\n") if event]
        names, declared = [], []
        for event in events:
            lines = event.split(b"\n")
            self.assertTrue(lines[0].startswith(b"event: "), event[:100])
            name = lines[0][len(b"event: "):].decode()
            data = ujson.loads(b"\n".join(line[len(b"data: "):] for line in lines[1:]))
            self.assertEqual(data["type"], name)
            names.append(name)
            if name == "content_block_start" and data["content_block"]["type"].endswith("tool_use"):
                declared.append(data["content_block"]["id"])
        self.assertEqual(names[0], "message_start")
        self.assertEqual(names[-1], "message_stop")
        self.assert_fresh_ids(declared, history)

    def assert_fresh_ids(self, answer_ids: list[str], history: set[str]) -> None:
        """The answer's tool-use ids repeat neither each other nor the client's history."""
        self.assertEqual(len(set(answer_ids)), len(answer_ids), answer_ids)
        self.assertEqual(set(answer_ids) & history, set(), (answer_ids, sorted(history)[:20]))


class InMemoryFuzzTests(AnswerJudge, SynchronousTestCase):
    """
    The bulk: hostile bodies, literals, headers, paths and methods against
    the relay in front of the strict simulated upstream, all in memory.
    """

    def setUp(self):
        self.clock = MemoryReactorClock()
        self.upstream = SimulatedUpstream(mode="strict", reactor=self.clock)
        self.relay = InMemoryRelay(self.upstream.resource(), clock=self.clock)
        self.tally: dict[str, int] = {}

    def send(self, method: bytes, path: str, body: bytes | None, headers: dict | None = None):
        """Send one request through the bare agent; return ``(status, content-type, body)``."""
        all_headers = Headers({b"content-type": [b"application/json"], b"x-api-key": [b"sk-test-client"]})
        for name, values in (headers or {}).items():
            all_headers.setRawHeaders(name, values)
        d = self.relay.agent.request(
            method, b"http://relay.test" + path.encode("utf-8"), all_headers,
            None if body is None else BytesProducer(body),
        )
        answers = []
        d.addCallback(lambda response: treq.content(response).addCallback(
            lambda raw: answers.append((response.code, response.headers, raw))))
        for _ in range(200):
            self.relay.flush(rounds=4)
            if answers or d.called and not answers:
                break
            self.clock.advance(0.1)
        if not answers:
            self.successResultOf(d)
        self.assertEqual(answers and len(answers), 1, "no answer")
        status, response_headers, raw = answers[0]
        content_type = (response_headers.getRawHeaders(b"content-type") or [b""])[0]
        return status, content_type, raw

    def check(self, method: bytes, path: str, raw_body: bytes | None, sent=None, headers=None) -> None:
        """Send, judge the answer, and fail on anything logged as an error."""
        status, content_type, raw = self.send(method, path, raw_body, headers)
        kind = self.assert_answer(method, path, sent, status, content_type, raw)
        self.tally[kind] = self.tally.get(kind, 0) + 1
        self.assertEqual(self.flushLoggedErrors(), [])

    def assert_still_serves(self) -> None:
        """After all that, a normal streaming request is relayed whole."""
        body = messages_body(stream=True)
        status, content_type, raw = self.send(b"POST", "/v1/messages", encode(body))
        self.assertEqual(status, 200)
        self.assertEqual(self.assert_answer(b"POST", "/v1/messages", body, status, content_type, raw), "stream")

    def test_hostile_bodies(self):
        """
        Bodies of every shape (messages not a list, messages not objects,
        content and blocks of every type, odd and colliding ids, nesting):
        each gets a well-formed error or a correct relay.
        """

        @settings(max_examples=1400, **_FUZZ)
        @given(bodies)
        def property(body):
            self.check(b"POST", "/v1/messages", encode(body), body)

        self.check_property(property)
        # Hypothesis must have reached the upstream, and seen it answer, often.
        self.assertGreater(self.tally.get("stream", 0) + self.tally.get("message", 0), 100, self.tally)
        self.assertGreater(self.tally.get("error", 0), 100, self.tally)
        self.assert_still_serves()

    def test_hostile_count_tokens(self):
        """The same bodies to ``count_tokens``: an error or a count, nothing else."""

        @settings(max_examples=300, **_FUZZ)
        @given(bodies)
        def property(body):
            self.check(b"POST", "/v1/messages/count_tokens", encode(body), body)

        self.check_property(property)
        self.assert_still_serves()

    def test_hostile_raw_bytes(self):
        """
        Bytes that are not JSON, invalid UTF-8, truncated JSON, JSON with
        junk after it, and JSON holding what no JSON writer writes (lone
        surrogates, NaN, 1e999, huge integers, deep nesting, duplicate
        keys): each gets a well-formed error or a correct relay.
        """

        @settings(max_examples=1200, **_FUZZ)
        @given(st.one_of(raw_bodies, spliced_bodies()))
        @example(
            b'{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"\\ud800"},'
            b'{"role":"assistant","content":[{"type":"tool_use","id":"toolu_1","name":"n","input":{}},'
            b'{"type":"tool_use","id":"toolu_1","name":"n","input":{}}]},'
            b'{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"x"}]}]}'
        )
        def property(raw):
            try:
                sent = ujson.loads(raw)
            except (ValueError, OverflowError):
                sent = None
            self.check(b"POST", "/v1/messages", raw, sent)

        self.check_property(property)
        self.assert_still_serves()

    def test_odd_headers_with_relay_keys(self):
        """
        Odd values of the headers the relay reads or forwards (keys,
        versions, session ids, encodings), with relay keys on: a 401 unless
        the right key is presented exactly, else a relay. (A value with a
        NUL byte is refused by Twisted's HTTP channel with a bare 400, as
        RFC 9110 allows. ``content-type`` is fuzzed on a real socket, where
        the relay's own ``Site`` parses it.)
        """
        config = RelayConfig(listen=(), upstreams=one_upstream("http://upstream.test"), dump_dir=None, relay_keys=(RELAY_KEY,))
        self.relay = InMemoryRelay(self.upstream.resource(), config, clock=self.clock)

        @settings(max_examples=400, **_FUZZ)
        @given(odd_headers, plausible_sessions())
        def property(headers, body):
            self.upstream.requests.clear()
            status, content_type, raw = self.send(b"POST", "/v1/messages", encode(body), headers)
            if (status, content_type, raw) == (400, b"", b""):
                values = [value for values in headers.values() for value in values]
                self.assertTrue(
                    any(b"\x00" in value for value in values) or sum(map(len, values)) > 16000,
                    "a request with sound headers was refused as bad HTTP",
                )
                return
            self.assert_answer(b"POST", "/v1/messages", body, status, content_type, raw)
            keys = headers.get(b"x-api-key", []) + [
                value[7:].strip() for value in headers.get(b"authorization", []) if value[:7].lower() == b"bearer "
            ]
            if RELAY_KEY.encode() not in keys:
                self.assertEqual(status, 401, raw)
            self.assertEqual(self.flushLoggedErrors(), [])
            # The relay key never travels as a credential (a client may put
            # it in any other header, which is forwarded like any other).
            for received in self.upstream.requests:
                for name in ("x-api-key", "authorization"):
                    self.assertNotIn(RELAY_KEY, received.headers.get(name, ""))

        self.check_property(property)
        status, _, _ = self.send(b"POST", "/v1/messages", encode(messages_body()), {b"x-api-key": [RELAY_KEY.encode()]})
        self.assertEqual(status, 200)

    def test_odd_paths_and_methods(self):
        """
        Any method on any path: a route's answer or an Anthropic-shaped
        404/405. (Not ``/metrics``: its resource renders in a thread, which
        a memory reactor never runs.)
        """

        @settings(max_examples=500, **_FUZZ)
        @given(methods, paths, st.one_of(st.none(), bodies.map(encode)))
        @example(b"POST", "/v1/messages%80", encode(messages_body()))
        def property(method, path, body):
            sent = ujson.loads(body) if body is not None else None
            self.check(method, path, body, sent)

        self.check_property(property)
        self.assert_still_serves()


class RealSocketFuzzTests(AnswerJudge, TestCase):
    """
    A smaller run of raw bytes over a real socket, where the HTTP framing
    itself can be hostile: header bytes, lengths, chunking.
    """

    def setUp(self):
        # Like Anthropic's API, the upstream does not parse form bodies: a
        # body the relay forwards with a multipart content type reaches it.
        upstream_site = Site(SimulatedUpstream(mode="strict").resource(), parsePOSTFormSubmission=False)
        upstream_site.noisy = False
        upstream_port = reactor.listenTCP(0, upstream_site, interface="127.0.0.1")
        self.addCleanup(upstream_port.stopListening)
        config = RelayConfig(
            listen=(), upstreams=one_upstream("http://127.0.0.1:%d" % (upstream_port.getHost().port,)), dump_dir=None,
            request_read_timeout=0.5, max_body=64 * 1024,
        )
        self.port = serve_relay(self, config, reactor).port
        self.framing_refusals = 0

    def exchange(self, request: bytes) -> bytes:
        """Send raw bytes, read until the relay closes (in a thread)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            try:
                sock.sendall(request)
            except OSError:
                pass  # the relay may hang up on a request it refused early
            chunks = []
            while True:
                try:
                    data = sock.recv(65536)
                except OSError:
                    break
                if not data:
                    break
                chunks.append(data)
        return b"".join(chunks)

    def judge_raw(self, sent, hostile_framing: bool, raw: bytes) -> None:
        if raw == _FRAMING_REFUSAL:
            self.assertTrue(hostile_framing, "a well-framed request was refused as bad HTTP")
            self.framing_refusals += 1
            return
        response = parse_response(raw)
        self.assertNotEqual(response.status, 0, raw[:200])
        self.assertTrue(response.complete, raw[-200:])
        self.assert_answer(
            b"POST", "/v1/messages", sent, response.status, response.header(b"content-type") or b"", response.body
        )

    def fuzz_raw(self) -> None:
        @settings(max_examples=400, **_FUZZ)
        @given(
            st.one_of(bodies.map(encode), raw_bodies, spliced_bodies()),
            st.lists(
                st.tuples(
                    st.binary(min_size=1, max_size=20).filter(lambda name: b":" not in name and b"\r" not in name
                                                              and b"\n" not in name),
                    st.binary(max_size=60).map(lambda value: value.replace(b"\r\n", b"")),
                ),
                max_size=4,
            ),
            st.sampled_from(["exact", "exact", "exact", "short", "long", "chunked", "bad-chunked", "none"]),
            st.sampled_from([0, 0, 0, 600, 20000]),
            st.one_of(
                st.just(b"application/json"),
                st.sampled_from(
                    [b"application/json; charset=utf-8", b"text/plain", b"", b"\x85", b"a/b\x85c",
                     b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=zz",
                     b"multipart/form-data", b"application/json; boundary=\xff"]
                ),
                header_values,
            ),
        )
        @example(encode(messages_body()), [], "exact", 0, b"application/json; a\x85b")
        @example(encode(messages_body()), [], "exact", 0, b"multipart/form-data; boundary=zz")
        def property(body, extra_headers, framing, many_headers, content_type):
            head = [b"POST /v1/messages HTTP/1.1", b"Host: relay", b"Content-Type: " + content_type,
                    b"Connection: close"]
            head += [name + b": " + value for name, value in extra_headers]
            head += [b"X-Pad-%d: p" % (n,) for n in range(many_headers)]
            if framing == "exact":
                head.append(b"Content-Length: %d" % (len(body),))
                payload = body
            elif framing == "short":
                head.append(b"Content-Length: %d" % (max(0, len(body) - 3),))
                payload = body
            elif framing == "long":
                head.append(b"Content-Length: %d" % (len(body) + 3,))
                payload = body
            elif framing == "chunked":
                head.append(b"Transfer-Encoding: chunked")
                payload = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
            elif framing == "bad-chunked":
                head.append(b"Transfer-Encoding: chunked")
                payload = b"zz\r\n" + body
            else:
                payload = b""
            raw = self.exchange(b"\r\n".join(head) + b"\r\n\r\n" + payload)
            hostile = (
                bool(extra_headers) or framing not in ("exact", "chunked") or many_headers > 500
                or b"\x00" in content_type or len(content_type) > 4000
                # A bare CR or LF in a header value breaks the header line itself.
                or b"\n" in content_type or b"\r" in content_type
            )
            try:
                sent = ujson.loads(body) if framing in ("exact", "chunked") else None
            except (ValueError, OverflowError):
                sent = None
            self.judge_raw(sent, hostile, raw)

        self.check_property(property)
        # A normal request, afterwards.
        body = messages_body(stream=True)
        raw = self.exchange(
            b"POST /v1/messages HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(encode(body)), encode(body))
        )
        response = parse_response(raw)
        self.assertEqual(response.status, 200)
        self.assert_stream(response.body, set())

    async def test_raw_hostile_requests(self):
        """
        Raw requests with odd header bytes, lengths that lie, chunking
        good and bad, and too many headers: an Anthropic error or a relay,
        except that requests which break HTTP framing itself may get
        Twisted's bare ``400 Bad Request``; never a 500, a traceback or
        HTML, and the relay serves a normal request afterwards.
        """
        await deferToThread(self.fuzz_raw)
