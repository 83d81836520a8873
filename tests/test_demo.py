"""
Tests for :mod:`twisted_relay.demo`, the long-session demo client, against
the simulated upstream (and once the relay) on real 127.0.0.1 sockets.
"""

from __future__ import annotations

import io
import os
import re
import sys
from typing import Any

import ujson
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.error import ConnectionDone
from twisted.internet.task import deferLater
from twisted.internet.testing import StringTransport
from twisted.protocols.policies import WrappingFactory
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import ResponseDone
from twisted.web.server import Site

from twisted_relay.demo import _Failed, _StreamReader, parse_args, run, run_session
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.model import (
    ModelOptions,
    compose_answer,
    encode_events,
    message_events,
    seeded_rng,
)


class _Terminal(io.StringIO):
    """Output that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class _SessionCase(TestCase):
    """Serves upstreams on ephemeral loopback ports for the demo to talk to."""

    def listen(self, site: Site) -> str:
        """
        Serve ``site`` on 127.0.0.1; on cleanup, wait (boundedly) for its
        connections to close, so no server-side timer outlives the test.
        """
        factory = WrappingFactory(site)
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")

        async def close() -> None:
            for _ in range(200):
                if not factory.protocols:
                    break
                await deferLater(reactor, 0.01)
            for protocol in list(factory.protocols):
                protocol.transport.abortConnection()
            await port.stopListening()

        self.addCleanup(lambda: ensureDeferred(close()))
        return f"http://127.0.0.1:{port.getHost().port}"

    def serve(self, **options: Any) -> tuple[SimulatedUpstream, str]:
        sim = SimulatedUpstream(reactor=reactor, **options)
        return sim, self.listen(Site(sim.resource()))

    def options(self, base_url: str, *argv: str) -> Any:
        return parse_args(["--base-url", base_url, "--api-key", "sk-ant-test-key", *argv])


class SessionTests(_SessionCase):
    """The demo drives whole sessions and reports them truthfully."""

    async def test_lenient_session_completes(self) -> None:
        """
        Against a lenient upstream a 30-turn streamed session completes, exits
        0, and counts the ids the model reused (every third call) as
        duplicates the client saw.
        """
        sim, url = self.serve(mode="lenient", reuse_every=3)
        out = io.StringIO()
        code = await run(reactor, self.options(url, "--turns", "30"), out)
        self.assertEqual(code, 0)
        text = out.getvalue()
        self.assertRegex(text, r"turns completed:\s+30/30")
        self.assertRegex(text, r"tool calls:\s+30")
        self.assertRegex(text, rf"duplicate ids seen:\s+{30 // 3}\n")
        self.assertRegex(text, r"failed turns:\s+0")
        self.assertIn("OK: the session survived every turn.", text)
        self.assertEqual(len(sim.requests), 30)
        self.assertTrue(all(r.body["stream"] is True for r in sim.requests))

    async def test_upstream_of_each_turn(self) -> None:
        """
        When answers name their upstream (``x-relay-upstream``, as a relay
        with several upstreams sends), the summary says which served which
        turns, and progress lines name the last one; without the header,
        nothing is said.
        """
        sim = SimulatedUpstream(reactor=reactor, mode="lenient")
        names = ["local"] * 4 + ["anthropic"] * 3 + ["local"] * 3

        class NamingSite(Site):
            def getResourceFor(self, request):
                if request.path.endswith(b"/v1/messages"):
                    request.responseHeaders.setRawHeaders(b"x-relay-upstream", [names.pop(0)])
                return super().getResourceFor(request)

        url = self.listen(NamingSite(sim.resource()))
        for stream in ("--stream", "--no-stream"):
            names[:] = ["local"] * 4 + ["anthropic"] * 3 + ["local"] * 3
            out = io.StringIO()
            code = await run(reactor, self.options(url, "--turns", "10", "--progress-every", "5", stream), out)
            self.assertEqual(code, 0)
            text = out.getvalue()
            self.assertIn("served by (turns):       local 1-4, 8-10; anthropic 5-7", text)
            self.assertIn("turn 5/10", text)
            self.assertRegex(text, r"turn 5/10 .* upstream anthropic\n")
        _, plain = self.serve(mode="lenient")
        out = io.StringIO()
        await run(reactor, self.options(plain, "--turns", "2"), out)
        self.assertNotIn("served by", out.getvalue())
        self.assertNotIn("upstream ", out.getvalue().split("\n", 1)[1])

    async def test_not_streaming(self) -> None:
        """--no-stream runs the same session over plain JSON answers."""
        sim, url = self.serve(mode="lenient", reuse_every=3)
        report = await run_session(reactor, self.options(url, "--turns", "12", "--no-stream"), io.StringIO())
        self.assertTrue(report.ok)
        self.assertEqual((report.completed, report.tool_calls, len(report.duplicates)), (12, 12, 4))
        self.assertNotIn("stream", sim.requests[-1].body)

    async def test_history_like_claude_code(self) -> None:
        """Each turn resends the history with tools, and answers every tool_use with a tool_result."""
        sim, url = self.serve(mode="strict", reuse_every=0, parallel=2)
        report = await run_session(reactor, self.options(url, "--turns", "5"), io.StringIO())
        self.assertTrue(report.ok, report.failures)
        last = sim.requests[-1].body
        self.assertEqual(len(last["messages"]), 1 + 2 * 4)
        self.assertEqual([tool["name"] for tool in last["tools"]], ["Bash", "Read", "get_weather"])
        for call, answer in zip(last["messages"][1::2], last["messages"][2::2]):
            calls = [block["id"] for block in call["content"] if block["type"] == "tool_use"]
            self.assertEqual([block["tool_use_id"] for block in answer["content"]], calls)
        headers = sim.requests[-1].headers
        self.assertEqual(headers["x-api-key"], "sk-ant-test-key")
        self.assertEqual(headers["anthropic-version"], "2023-06-01")
        self.assertEqual(len({r.headers["x-claude-code-session-id"] for r in sim.requests}), 1)

    async def test_strict_dies_at_first_reuse(self) -> None:
        """
        Straight against a strict upstream (no relay), the session dies on the
        request after the first reused id, and the summary shows the
        upstream's 400 body: the proof that the relay is needed.
        """
        _, url = self.serve(mode="strict", reuse_every=3)
        out = io.StringIO()
        code = await run(reactor, self.options(url, "--turns", "30"), out)
        self.assertEqual(code, 1)
        text = out.getvalue()
        self.assertRegex(text, r"turns completed:\s+3/30")
        self.assertRegex(text, r"first failure:\s+turn 4, HTTP 400")
        body = ujson.loads(re.search(r"first error body:\s+(.*)\n", text).group(1))
        self.assertEqual(body["error"]["type"], "invalid_request_error")
        self.assertTrue(body["error"]["message"].endswith("`tool_use` ids must be unique"))
        self.assertIn("FAILED: the session died at turn 4.", text)

    async def test_through_the_relay(self) -> None:
        """
        Behind the relay the same strict session survives: no duplicate
        reaches the client, and each reused id arrives renamed X-2.
        """
        from twisted_relay.config import RelayConfig, one_upstream

        from tests.helpers import serve_relay

        _, upstream = self.serve(mode="strict", reuse_every=3)
        base_url = serve_relay(self, RelayConfig(listen=(), upstreams=one_upstream(upstream), dump_dir=None), reactor).url
        report = await run_session(reactor, self.options(base_url, "--turns", "30"), io.StringIO())
        self.assertTrue(report.ok, report.failures)
        self.assertEqual(report.duplicates, [])
        self.assertEqual(len(report.rewritten), 30 // 3)

    async def test_through_the_relay_on_todays_model(self) -> None:
        """
        The strict simulated upstream speaks today's API by default: a session
        on Sonnet 5.5 (adaptive thinking, each block bound to its prefix and
        account) survives behind the relay, every thinking block goes back to
        the upstream at every turn, and replaying the last request with the
        binding beta shows none was dropped.
        """
        from twisted_relay.config import RelayConfig, one_upstream
        from twisted_relay.simulated.thinking import BINDING_BETA

        from tests.helpers import serve_relay

        sim, upstream = self.serve(mode="strict", reuse_every=3)
        base_url = serve_relay(self, RelayConfig(listen=(), upstreams=one_upstream(upstream), dump_dir=None), reactor).url
        options = self.options(base_url, "--turns", "20", "--model", "claude-sonnet-5-5")
        report = await run_session(reactor, options, io.StringIO())
        self.assertTrue(report.ok, report.failures)
        self.assertEqual(report.duplicates, [])
        sent = [request.body for request in sim.requests]
        thinking = [
            sum(1 for message in body["messages"] if isinstance(message["content"], list)
                for block in message["content"] if block["type"] == "thinking")
            for body in sent
        ]
        self.assertEqual(thinking, list(range(20)))
        last = sim.requests[-1]
        answer = sim.answer(last.body, dict(last.headers, **{"anthropic-beta": BINDING_BETA}))
        self.assertEqual(answer["input_transformations"], [])

    async def test_key_passed(self) -> None:
        """The key reaches the upstream; a refused key fails turn 1 and is never printed."""
        _, url = self.serve(mode="lenient", require_key="sk-ant-test-key")
        self.assertTrue((await run_session(reactor, self.options(url, "--turns", "2"), io.StringIO())).ok)
        out = io.StringIO()
        options = parse_args(["--base-url", url, "--api-key", "sk-ant-wrong-key", "--turns", "2"])
        self.assertEqual(await run(reactor, options, out), 1)
        self.assertRegex(out.getvalue(), r"turn 1, HTTP 401")
        self.assertIn("authentication_error", out.getvalue())
        self.assertNotIn("sk-ant-wrong-key", out.getvalue())

    async def test_unreachable(self) -> None:
        """Nobody listening is a failed turn with a readable reason, not a traceback."""
        port = reactor.listenTCP(0, Site(SimulatedUpstream().resource()), interface="127.0.0.1")
        url = f"http://127.0.0.1:{port.getHost().port}"
        await port.stopListening()
        out = io.StringIO()
        self.assertEqual(await run(reactor, self.options(url, "--turns", "3"), out), 1)
        self.assertIn(f"cannot reach {url}", out.getvalue())
        self.assertRegex(out.getvalue(), r"turn 1, no response")

    async def test_turn_timeout(self) -> None:
        """A turn slower than --timeout fails, and its connection is dropped."""
        sim, url = self.serve(mode="lenient", event_delay=0.2)
        report = await run_session(
            reactor, self.options(url, "--turns", "2", "--timeout", "0.3"), io.StringIO()
        )
        self.assertEqual([(f.turn, f.status) for f in report.failures], [(1, None)])
        self.assertIn("no complete answer within 0.3 s", report.failures[0].body)

    async def test_progress_lines(self) -> None:
        """Off a terminal, progress is a line every --progress-every turns."""
        _, url = self.serve(mode="lenient")
        out = io.StringIO()
        await run_session(reactor, self.options(url, "--turns", "30", "--progress-every", "10"), out)
        lines = out.getvalue().splitlines()
        self.assertEqual([line.split()[1] for line in lines], ["10/30", "20/30", "30/30"])
        self.assertIn(f"client duplicates {10 // 3}", lines[0])

    async def test_progress_on_terminal(self) -> None:
        """On a terminal, progress is one line rewritten in place each turn."""
        _, url = self.serve(mode="lenient")
        out = _Terminal()
        await run_session(reactor, self.options(url, "--turns", "4"), out)
        text = out.getvalue()
        self.assertEqual(text.count("\r"), 4)
        self.assertEqual(text.count("\n"), 1)
        self.assertTrue(text.endswith("\n"))


def _stream(**options: Any) -> tuple[dict, bytes]:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "Bash", "input_schema": {}}]}
    message = compose_answer(body, ModelOptions(**options))
    data, _ = encode_events(message_events(message, seeded_rng(1)))
    return message, data


class StreamReaderTests(SynchronousTestCase):
    """The demo rebuilds streamed answers wherever the bytes are cut."""

    def read(self, chunks: list[bytes], reason: Failure | None = None) -> Any:
        reader = _StreamReader()
        reader.makeConnection(StringTransport())
        for chunk in chunks:
            reader.dataReceived(chunk)
        reader.connectionLost(reason or Failure(ResponseDone()))
        return reader.done

    def test_every_split(self) -> None:
        """Cut into pieces of every size from 1 to 9 bytes, the stream gives the JSON answer."""
        message, data = _stream(server_tools=True, parallel=2)
        for size in range(1, 10):
            chunks = [data[i : i + size] for i in range(0, len(data), size)]
            self.assertEqual(self.successResultOf(self.read(chunks)), message)

    def test_error_event(self) -> None:
        """An error event mid-stream fails the turn with the event's data as the body."""
        _, data = _stream()
        error = (
            b'event: error\ndata: {"type":"error",'
            b'"error":{"type":"overloaded_error","message":"Overloaded"}}\n\n'
        )
        failure = self.failureResultOf(
            self.read([data[: data.index(b"event: content_block_stop")], error]), _Failed
        )
        self.assertIn("overloaded_error", failure.value.body)

    def test_truncated(self) -> None:
        """A stream that stops before message_stop is a failure, not a half answer."""
        _, data = _stream()
        failure = self.failureResultOf(self.read([data[: data.index(b"event: message_delta")]]), _Failed)
        self.assertIn("before message_stop", failure.value.body)

    def test_broken_connection(self) -> None:
        """A connection lost mid-stream is a failure naming the cause."""
        _, data = _stream()
        failure = self.failureResultOf(self.read([data[:100]], Failure(ConnectionDone())), _Failed)
        self.assertIn("the stream broke", failure.value.body)

    def test_malformed_event(self) -> None:
        """An event whose JSON is broken fails the turn instead of crashing the demo."""
        failure = self.failureResultOf(self.read([b"event: message_start\ndata: {nope\n\n"]), _Failed)
        self.assertIn("malformed message_start", failure.value.body)

    def test_cancel_drops_the_connection(self) -> None:
        """Cancelling the read (a turn timeout) stops the transport."""
        reader = _StreamReader()
        transport = StringTransport()
        reader.makeConnection(transport)
        reader.done.cancel()
        self.assertEqual(transport.producerState, "stopped")
        self.failureResultOf(reader.done)


class CommandLineTests(SynchronousTestCase):
    """twisted-relay-demo's options."""

    def test_defaults(self) -> None:
        """Defaults: the relay's default address, 50 streamed turns, the key from the environment."""
        self.patch(os, "environ", {"ANTHROPIC_API_KEY": "sk-ant-from-env"})
        options = parse_args([])
        self.assertEqual(
            (options.base_url, options.turns, options.stream, options.api_key),
            ("http://127.0.0.1:8080", 50, True, "sk-ant-from-env"),
        )
        self.patch(os, "environ", {})
        self.assertTrue(parse_args([]).api_key)
        self.assertFalse(parse_args(["--no-stream"]).stream)

    def test_bad_values(self) -> None:
        """A bad value exits with status 2 and says what is wrong."""
        for argv, message in (
            (["--turns", "0"], "must be 1 or more"),
            (["--base-url", "localhost:8080"], "not an http"),
        ):
            stderr = io.StringIO()
            self.patch(sys, "stderr", stderr)
            self.assertEqual(self.assertRaises(SystemExit, parse_args, argv).code, 2)
            self.assertIn(message, stderr.getvalue())
