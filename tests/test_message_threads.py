"""
Tests for :mod:`twisted_relay.message_threads.model`: the ``thread`` field, the error
bodies (read back by the official SDK's own error classes), conversations
kept and rebuilt, and the message rebuilt from a stream.
"""

from __future__ import annotations

import itertools

import httpx2
import ujson
from anthropic._error_classes import make_status_error
from anthropic.lib.streaming._beta_messages import accumulate_event
from anthropic.types import (
    ThreadAlreadyContinuedError,
    ThreadContinueInFlightError,
    ThreadNotFoundError,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.message_threads.model import (
    CONTINUE,
    CREATE,
    THREADS_BETA,
    AnswerRecorder,
    Conversation,
    ThreadError,
    ThreadRequest,
    already_continued,
    assemble_stream,
    continue_in_flight,
    plain_request,
    rebuild_request,
    thread_not_found,
    thread_of,
    without_threads_beta,
)
from twisted_relay.simulated.model import (
    ModelOptions,
    compose_answer,
    encode_events,
    message_events,
    seeded_rng,
)

TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def sdk_error(error: ThreadError):
    """The exception the official SDK raises for ``error``'s answer."""
    request = httpx2.Request("POST", "http://relay.test/v1/messages")
    response = httpx2.Response(error.status, request=request, content=error.body("req_1"))
    return make_status_error("Error", body=ujson.loads(error.body("req_1")), response=response)


class ThreadFieldTests(SynchronousTestCase):
    def test_absent(self):
        """A request without ``thread`` (or with ``null``) is a plain request."""
        self.assertIsNone(thread_of({"messages": []}))
        self.assertIsNone(thread_of({"thread": None}))

    def test_create_and_continue(self):
        """Both shapes the SDK sends are read."""
        self.assertEqual(thread_of({"thread": {"type": "create"}}), ThreadRequest(CREATE))
        self.assertEqual(
            thread_of({"thread": {"type": "continue", "previous_message_id": "msg_1"}}),
            ThreadRequest(CONTINUE, "msg_1"),
        )

    def test_malformed(self):
        """A malformed ``thread`` is a 400 invalid_request_error naming the field, without a code."""
        for thread, where in [
            ("create", "thread:"),
            ({"type": "fork"}, "thread.type"),
            ({"type": "continue"}, "thread.previous_message_id: Field required"),
            ({"type": "continue", "previous_message_id": 7}, "thread.previous_message_id"),
            ({"type": "continue", "previous_message_id": ""}, "thread.previous_message_id"),
            ({"type": "create", "previous_message_id": "msg_1"}, "thread.previous_message_id"),
        ]:
            with self.assertRaises(ThreadError) as caught:
                thread_of({"thread": thread})
            self.assertEqual((caught.exception.status, caught.exception.error_type), (400, "invalid_request_error"))
            self.assertIsNone(caught.exception.error_code)
            self.assertIn(where, caught.exception.message)

    def test_plain_request(self):
        """The plain request drops ``thread`` and leaves the caller's body alone."""
        body = {"model": "m", "thread": {"type": "create"}, "messages": []}
        self.assertEqual(plain_request(body), {"model": "m", "messages": []})
        self.assertIn("thread", body)

    def test_without_threads_beta(self):
        """The threads beta is taken out of ``anthropic-beta``; the others stay."""
        self.assertIsNone(without_threads_beta(THREADS_BETA))
        self.assertIsNone(without_threads_beta(None))
        self.assertEqual(
            without_threads_beta(f"a-1, {THREADS_BETA},b-2"),
            "a-1, b-2",
        )
        self.assertEqual(without_threads_beta("a-1"), "a-1")


class ErrorBodyTests(SynchronousTestCase):
    def test_not_found_shape(self):
        """thread_not_found is a 404 not_found_error with ``details.error_code``, as the API answers."""
        body = ujson.loads(thread_not_found().body("req_9"))
        self.assertEqual(body["type"], "error")
        self.assertEqual(body["request_id"], "req_9")
        self.assertEqual(body["error"]["type"], "not_found_error")
        self.assertEqual(body["error"]["details"], {"error_code": "thread_not_found"})
        self.assertEqual(thread_not_found().status, 404)

    def test_sdk_reads_each_code(self):
        """The official SDK maps each answer to its own thread error class (what it replays on)."""
        self.assertIsInstance(sdk_error(thread_not_found()), ThreadNotFoundError)
        self.assertIsInstance(sdk_error(already_continued()), ThreadAlreadyContinuedError)
        self.assertIsInstance(sdk_error(continue_in_flight()), ThreadContinueInFlightError)
        for error in (thread_not_found(), already_continued(), continue_in_flight()):
            self.assertEqual(sdk_error(error).error_code, error.error_code)


def user(text):
    return {"role": "user", "content": text}


def answer(msg_id, *content):
    return {"id": msg_id, "type": "message", "role": "assistant", "content": list(content),
            "stop_reason": "end_turn", "usage": {"input_tokens": 1, "output_tokens": 1}}


class ConversationTests(SynchronousTestCase):
    def test_rebuild_equals_the_unthreaded_request(self):
        """Three turns by create/continue rebuild, turn by turn, the request a client without threads sends."""
        create = {"model": "m", "max_tokens": 9, "system": "be brief", "tools": TOOLS,
                  "messages": [user("one")], "thread": {"type": "create"}}
        first = answer("msg_1", {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}})
        stored = Conversation.decode(Conversation.after(plain_request(create), first).encode())
        result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}
        cont = {"model": "m", "max_tokens": 9, "messages": [result],
                "thread": {"type": "continue", "previous_message_id": "msg_1"}}
        rebuilt = rebuild_request(cont, stored)
        unthreaded = {"model": "m", "max_tokens": 9, "system": "be brief", "tools": TOOLS,
                      "messages": [user("one"), {"role": "assistant", "content": first["content"]}, result]}
        self.assertEqual(rebuilt, unthreaded)
        second = answer("msg_2", {"type": "text", "text": "sunny"})
        stored = Conversation.after(rebuilt, second)
        cont2 = {"model": "m", "max_tokens": 9, "messages": [user("thanks")],
                 "thread": {"type": "continue", "previous_message_id": "msg_2"}}
        self.assertEqual(
            rebuild_request(cont2, stored)["messages"],
            unthreaded["messages"] + [{"role": "assistant", "content": second["content"]}, user("thanks")],
        )

    def test_thread_without_system_or_tools(self):
        """A thread created without ``system``/``tools`` rebuilds none."""
        stored = Conversation.after({"model": "m", "messages": [user("a")]}, answer("msg_1"))
        rebuilt = rebuild_request({"model": "m", "messages": [], "thread": {"type": "continue"}}, stored)
        self.assertNotIn("system", rebuilt)
        self.assertNotIn("tools", rebuilt)
        self.assertNotIn("thread", rebuilt)

    def test_pause_turn_continue_with_no_messages(self):
        """A continue with no new messages (after ``pause_turn``) ends with the stored answer."""
        stored = Conversation.after({"messages": [user("a")]}, answer("msg_1", {"type": "text", "text": "x"}))
        rebuilt = rebuild_request({"model": "m", "messages": []}, stored)
        self.assertEqual(rebuilt["messages"][-1]["role"], "assistant")

    def test_rebuild_does_not_change_the_stored_conversation(self):
        """Rebuilding leaves the stored messages list as it was (a retry rebuilds the same)."""
        stored = Conversation.after({"messages": [user("a")]}, answer("msg_1"))
        rebuild_request({"model": "m", "messages": [user("b")]}, stored)
        self.assertEqual(len(stored.messages), 2)

    def test_fingerprint_mismatch(self):
        """A continue that changes ``system`` or ``tools`` is refused with thread_fingerprint_mismatch."""
        stored = Conversation.after({"system": "s", "tools": TOOLS, "messages": [user("a")]}, answer("msg_1"))
        with self.assertRaises(ThreadError) as caught:
            rebuild_request({"system": "other", "messages": []}, stored)
        self.assertEqual(caught.exception.error_code, "thread_fingerprint_mismatch")
        self.assertIn("`system`", caught.exception.message)
        self.assertEqual(rebuild_request({"tools": TOOLS, "messages": []}, stored)["tools"], TOOLS)

    def test_decode_refuses_other_bytes(self):
        """Bytes that are not a stored conversation raise ValueError (the relay answers not found)."""
        for data in (b"{}", b"[1]", b'{"v": 2, "fields": {}, "messages": []}', b"not json"):
            self.assertRaises(ValueError, Conversation.decode, data)


def sdk_accumulate(events):
    snapshot, bufs = None, {}
    for _, payload in events:
        if payload["type"] == "ping":
            continue
        snapshot = accumulate_event(event=payload, current_snapshot=snapshot, json_bufs=bufs,
                                    request_headers=httpx2.Headers())
    return snapshot.to_dict()


def simulated_stream(seed, parallel, server_tools):
    body = {"model": "m", "tools": TOOLS, "messages": [user(f"seed {seed}")]}
    message = compose_answer(body, ModelOptions(seed=seed, parallel=parallel, server_tools=server_tools))
    return message, message_events(message, seeded_rng(seed, "deltas"))


class AssembleTests(SynchronousTestCase):
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(seed=st.integers(0, 10**6), parallel=st.integers(1, 3), server_tools=st.booleans(),
           ending=st.sampled_from(["\n", "\r\n", "\r"]), cuts=st.lists(st.integers(0, 10**6), max_size=8))
    def test_same_message_as_the_sdk(self, seed, parallel, server_tools, ending, cuts):
        """The message rebuilt from a stream cut anywhere, any line ending, is the one the SDK
        accumulates, and the one the simulated model composed."""
        message, events = simulated_stream(seed, parallel, server_tools)
        data, _ = encode_events(events, ending)
        recorder = AnswerRecorder(limit=10**7)
        written = []
        write = recorder.tee(written.append)
        bounds = sorted({0, len(data), *(cut % (len(data) + 1) for cut in cuts)})
        for start, end in itertools.pairwise(bounds):
            write(data[start:end])
        self.assertEqual(b"".join(written), data)
        rebuilt = recorder.message()
        self.assertEqual(rebuilt, message)
        sdk = sdk_accumulate(events)
        self.assertEqual(rebuilt["content"], sdk["content"])
        self.assertEqual(rebuilt["stop_reason"], sdk["stop_reason"])

    def test_thinking_citations_compaction(self):
        """Thinking with its signature, citations and compaction blocks rebuild as the SDK's do."""
        citation = {"type": "char_location", "cited_text": "x", "document_index": 0, "document_title": None,
                    "start_char_index": 0, "end_char_index": 1}
        start = {"type": "message_start", "message": answer("msg_t")}
        start["message"]["stop_reason"] = None
        events = [
            ("message_start", start),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "thinking_delta", "thinking": "hmm "}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "thinking_delta", "thinking": "yes"}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "signature_delta", "signature": "sig"}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("content_block_start", {"type": "content_block_start", "index": 1,
                                     "content_block": {"type": "text", "text": "", "citations": None}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                     "delta": {"type": "citations_delta", "citation": citation}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                     "delta": {"type": "text_delta", "text": "cited"}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 1}),
            ("content_block_start", {"type": "content_block_start", "index": 2,
                                     "content_block": {"type": "compaction", "content": None}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 2,
                                     "delta": {"type": "compaction_delta", "content": "summary",
                                               "encrypted_content": "enc"}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 2}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                               "usage": {"output_tokens": 7}}),
            ("message_stop", {"type": "message_stop"}),
        ]
        data, _ = encode_events(events)
        rebuilt = assemble_stream(data)
        self.assertEqual(rebuilt["content"][0], {"type": "thinking", "thinking": "hmm yes", "signature": "sig"})
        self.assertEqual(rebuilt["content"][1]["citations"], [citation])
        self.assertEqual(rebuilt["content"][1]["text"], "cited")
        self.assertEqual(rebuilt["content"][2]["content"], "summary")
        self.assertEqual(rebuilt["usage"]["output_tokens"], 7)
        sdk = sdk_accumulate(events)
        self.assertEqual(rebuilt["content"][0], sdk["content"][0])
        self.assertEqual(rebuilt["content"][1]["text"], sdk["content"][1]["text"])

    def test_incomplete_streams_give_nothing(self):
        """A stream cut before message_stop, one with an error event, or with a broken event gives no message."""
        message, events = simulated_stream(1, 1, False)
        data, starts = encode_events(events)
        self.assertIsNone(assemble_stream(data[: starts[-1]]))
        error = b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"x"}}\n\n'
        self.assertIsNone(assemble_stream(data[: starts[3]] + error + data[starts[3]:]))
        self.assertIsNone(assemble_stream(data[: starts[2]] + b"event: content_block_delta\ndata: {\n\n"))
        self.assertEqual(assemble_stream(data), message)

    def test_relay_pings_and_comments_are_ignored(self):
        """Pings the relay adds between events, and SSE comments, do not change the message."""
        message, events = simulated_stream(2, 2, False)
        data, starts = encode_events(events)
        ping = b'event: ping\ndata: {"type": "ping"}\n\n: keep-alive\n\n'
        self.assertEqual(assemble_stream(data[: starts[4]] + ping + data[starts[4]:]), message)

    def test_stream_without_final_blank_line(self):
        """A stream whose last event lacks its blank line (as some recorded ones) still completes."""
        message, events = simulated_stream(3, 1, False)
        data, _ = encode_events(events)
        self.assertEqual(assemble_stream(data.rstrip(b"\n")), message)

    def test_recorder_limit(self):
        """Past its limit the recorder keeps nothing and gives no message."""
        _, events = simulated_stream(4, 1, False)
        data, _ = encode_events(events)
        recorder = AnswerRecorder(limit=len(data) - 1)
        recorder.write(data[:10])
        recorder.write(data[10:])
        self.assertTrue(recorder.overflowed)
        self.assertIsNone(recorder.message())
        exact = AnswerRecorder(limit=len(data))
        exact.write(data)
        self.assertIsNotNone(exact.message())


class GateRecorderTests(SynchronousTestCase):
    """The recorder on the gate's output keeps the answer as the client got it (ids translated)."""

    def test_recorded_answer_has_the_client_ids(self):
        """An upstream answer reusing an id is recorded with the id the relay gave the client."""
        from twisted.internet.task import Clock
        from twisted.internet.testing import StringTransport
        from twisted.python.failure import Failure
        from twisted.web.client import ResponseDone

        from twisted_relay.sse import SSEGate
        from twisted_relay.translation import translate_request

        call = {"type": "tool_use", "id": "toolu_A", "name": "get_weather", "input": {"city": "Zürich"}}
        history = {"model": "m", "max_tokens": 9, "tools": TOOLS, "messages": [
            user("go"), {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_A", "content": "ok"}]},
        ]}
        upstream_answer = answer("msg_9", {"type": "text", "text": "again"}, dict(call, input={"city": "東京"}))
        upstream_answer["stop_reason"] = "tool_use"
        data, _ = encode_events(message_events(upstream_answer, seeded_rng(9)))
        recorder = AnswerRecorder(limit=10**6)
        sink = []
        gate = SSEGate(recorder.tee(sink.append), translate_request(history).response(), clock=Clock())
        gate.makeConnection(StringTransport())
        for start in range(0, len(data), 37):
            gate.dataReceived(data[start:start + 37])
        gate.connectionLost(Failure(ResponseDone()))
        self.assertTrue(gate.done.called)
        recorded = recorder.message()
        self.assertEqual(recorded, assemble_stream(b"".join(sink)))
        self.assertEqual(recorded["content"][1]["id"], "toolu_A-2")
        self.assertEqual(recorded["content"][1]["input"], {"city": "東京"})
        expected = dict(upstream_answer, content=[upstream_answer["content"][0], dict(call, id="toolu_A-2",
                                                                                   input={"city": "東京"})])
        self.assertEqual(recorded["content"], expected["content"])


class RebuildPropertyTests(SynchronousTestCase):
    @settings(max_examples=200, deadline=None)
    @given(
        turns=st.lists(st.lists(st.text(max_size=5), max_size=3), min_size=1, max_size=8),
        system=st.one_of(st.none(), st.text(max_size=5)),
        with_tools=st.booleans(),
    )
    def test_every_turn_rebuilds_the_unthreaded_request(self, turns, system, with_tools):
        """Whatever the conversation, each continue rebuilds exactly the request a client without
        threads sends at that turn, through conversations kept as bytes."""
        fields = {"model": "m", "max_tokens": 5}
        if system is not None:
            fields["system"] = system
        if with_tools:
            fields["tools"] = TOOLS
        history = []
        kept = None
        for n, texts in enumerate(turns):
            new = [user(text) for text in texts]
            unthreaded = dict(fields, messages=history + new)
            if kept is None:
                sent = plain_request(dict(unthreaded, thread={"type": "create"}))
            else:
                body = {"model": "m", "max_tokens": 5, "messages": new,
                        "thread": {"type": "continue", "previous_message_id": f"msg_{n - 1}"}}
                sent = rebuild_request(body, Conversation.decode(kept))
            self.assertEqual(sent, unthreaded)
            reply = answer(f"msg_{n}", {"type": "text", "text": f"turn {n} é 🔧"})
            kept = Conversation.after(sent, reply).encode()
            history = history + new + [{"role": "assistant", "content": reply["content"]}]
