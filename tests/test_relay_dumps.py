"""
The relay writes a dump of every upstream 4xx, with every field, no key,
and without making anyone wait for it: on real sockets on 127.0.0.1. The
grep docs/dumps.md gives finds what it says.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading

import treq
import ujson
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from twisted_relay import dumps
from twisted_relay.dumps import DumpRequest, build_dump, render_dump, write_once
from twisted_relay.config import RelayConfig, RelayKey, one_upstream
from twisted_relay.simulated import SimulatedUpstream

from tests.helpers import encode, messages_body, serve_relay
from tests.test_dumps import SETTINGS, every_file, exchange

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT_KEY = "sk-ant-api03-client-key-that-must-never-be-written-0123456789"
UPSTREAM_KEY = "sk-upstream-secret-0123456789abcdef"

# A history as the relay gave it to the client: the upstream emitted
# toolu_01SAME twice, the client saw toolu_01SAME and toolu_01SAME-2.
HISTORY = [
    {"role": "user", "content": "Check two cities. My key is " + CLIENT_KEY},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01SAME", "name": "get_weather", "input": {"city": "Oslo"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01SAME", "content": "cold"}]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01SAME-2", "name": "get_weather", "input": {"city": "Rome"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01SAME-2", "content": "warm"}]},
]


class StreamedError(Resource):
    """An upstream that refuses a request inside an already started stream."""

    isLeaf = True

    def render(self, request):
        request.setHeader(b"content-type", b"text/event-stream")
        request.write(
            b'event: error\ndata: {"type":"error","error":{"type":"invalid_request_error",'
            b'"message":"messages.3.content.0: `tool_use` ids must be unique"}}\n\n'
        )
        request.finish()
        return NOT_DONE_YET


class RelayDumpTests(TestCase):
    """
    Every 4xx the upstream returns leaves exactly one complete dump.
    """

    def start(self, upstream_resource, ids="unique", **settings):
        port = reactor.listenTCP(0, Site(upstream_resource), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        upstream_url = "http://127.0.0.1:%d" % (port.getHost().port,)
        self.dump_dir = self.mktemp()
        config = RelayConfig(listen=(), upstreams=one_upstream(upstream_url, ids=ids), dump_dir=self.dump_dir).with_changes(**settings)
        served = serve_relay(self, config, reactor)
        self.writer = served.relay.dumps
        return served.url

    def slow_disk(self) -> threading.Event:
        """
        Make every dump's write wait until the returned gate is set: a slow
        disk (the gate opens at the test's cleanup at the latest).
        """
        gate = threading.Event()
        write_once = dumps.write_once

        def slow_write_once(*args, **kwargs):
            gate.wait(30)
            return write_once(*args, **kwargs)

        self.patch(dumps, "write_once", slow_write_once)
        self.addCleanup(gate.set)
        return gate

    async def post(self, base, body, **headers):
        all_headers = {
            "content-type": ["application/json"],
            "x-api-key": [CLIENT_KEY],
            "x-claude-code-session-id": ["session-47"],
        }
        all_headers.update(headers)
        response = await treq.post(base + "/v1/messages", data=encode(body), headers=all_headers, persistent=False)
        return response.code, await response.content()

    async def test_rejected_request_dumped_once_with_every_field(self):
        """
        Behind ``--upstream-ids original`` a strict upstream refuses the
        duplicates it is sent: the client gets the upstream's 400 untouched,
        and one dump holds every field, with no key anywhere in its bytes.
        """
        base = self.start(SimulatedUpstream(mode="strict", seed=1).resource(), ids="original")
        code, answer = await self.post(base, messages_body(HISTORY))
        self.assertEqual(code, 400)
        self.assertIn(b"ids must be unique", answer)
        await self.writer.drain()

        files = every_file(self.dump_dir)
        self.assertEqual(len(files), 1, files)
        raw = open(files[0], "rb").read()
        self.assertNotIn(CLIENT_KEY.encode(), raw)
        self.assertEqual(os.stat(files[0]).st_mode & 0o777, 0o600)
        dump = json.loads(raw)
        for field in (
            "relay_request_id", "upstream_request_id", "time", "upstream_url", "status", "response",
            "client_request", "upstream_request", "timeline", "translation_table", "session_id",
            "relay_version", "settings", "policy",
        ):
            self.assertIn(field, dump)
        self.assertEqual(dump["status"], 400)
        self.assertTrue(dump["upstream_request_id"].startswith("req_"))
        self.assertTrue(dump["upstream_url"].endswith("/v1/messages"))
        self.assertEqual(dump["settings"]["upstream_ids"], "original")
        self.assertEqual(dump["session_id"], "session-47")
        self.assertTrue(dump["relay_request_id"].startswith("rly_"))
        # The client's request as received and the upstream-bound request as
        # sent: the relay translated toolu_01SAME-2 back to toolu_01SAME.
        self.assertIn("toolu_01SAME-2", json.dumps(dump["client_request"]))
        sent = json.dumps(dump["upstream_request"])
        self.assertNotIn("toolu_01SAME-2", sent)
        self.assertEqual(
            dump["timeline"][3], "3 assistant: tool_use id=toolu_01SAME-2 (upstream toolu_01SAME)"
        )
        entries = dump["translation_table"]["entries"]
        self.assertEqual([e["kind"] for e in entries], ["declaration", "reference"] * 2)
        self.assertEqual(entries[2]["occurrence"], 2)
        self.assertIn("ids must be unique", json.dumps(dump["response"]))

    async def test_dump_names_the_relay_key(self):
        """
        Behind named relay keys, the dump says whose key made the request,
        by its name and group (``relay_key``), and holds no key.
        """
        relay_key = RelayKey("sk-relay-dana-0123456789", "dana", "research")
        base = self.start(SimulatedUpstream(mode="strict", seed=1).resource(), ids="original",
                          relay_keys=(relay_key,))
        code, _ = await self.post(base, messages_body(HISTORY), **{"x-api-key": [relay_key.key]})
        self.assertEqual(code, 400)
        await self.writer.drain()
        (path,) = every_file(self.dump_dir)
        raw = open(path, "rb").read()
        self.assertNotIn(relay_key.key.encode(), raw)
        self.assertEqual(json.loads(raw)["relay_key"], {"name": "dana", "group": "research"})

    async def test_streamed_client_error_dumped(self):
        """
        An ``invalid_request_error`` inside a stream is dumped like a 4xx.
        """
        base = self.start(StreamedError())
        code, answer = await self.post(base, messages_body(HISTORY, stream=True))
        self.assertEqual(code, 200)
        self.assertIn(b"event: error", answer)
        await self.writer.drain()
        files = every_file(self.dump_dir)
        self.assertEqual(len(files), 1, files)
        self.assertIn(b"ids must be unique", open(files[0], "rb").read())

    async def test_success_not_dumped(self):
        """
        Answers below 400 leave no dump.
        """
        base = self.start(SimulatedUpstream(mode="strict", seed=1).resource())
        code, _ = await self.post(base, messages_body(HISTORY))
        self.assertEqual(code, 200)
        await self.writer.drain()
        self.assertEqual(every_file(self.dump_dir), [])

    async def test_slow_disk_never_holds_requests(self):
        """
        While a dump waits on a slow disk, the refused client already has
        its answer and other clients are answered as usual.
        """
        base = self.start(SimulatedUpstream(mode="strict", seed=1).resource(), ids="original")
        gate = self.slow_disk()
        code, _ = await self.post(base, messages_body(HISTORY))
        self.assertEqual(code, 400)
        for _ in range(5):
            code, answer = await self.post(base, messages_body())
            self.assertEqual(code, 200)
            self.assertEqual(ujson.loads(answer)["type"], "message")
        self.assertEqual(self.writer.written, 0)
        gate.set()
        await self.writer.drain()
        self.assertEqual(self.writer.written, 1)
        await deferLater(reactor, 0, lambda: None)


class ThreadDumpTests(TestCase):
    """A 4xx answering a thread's continue is dumped with the request the relay rebuilt."""

    start = RelayDumpTests.start
    post = RelayDumpTests.post

    async def test_continue_dumped_rebuilt(self):
        """
        The dump's client request is the whole conversation the ``continue``
        stands for (its first message, the answer kept, the new turn), without
        the ``thread`` field: what was translated and sent.
        """
        base = self.start(SimulatedUpstream(mode="strict", seed=1).resource())
        first = [{"role": "user", "content": "The first question of the thread."}]
        code, answer = await self.post(base, messages_body(first, thread={"type": "create"}))
        self.assertEqual(code, 200)
        answer_id = json.loads(answer)["id"]
        bad = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]
        body = messages_body(bad, tools=False, thread={"type": "continue", "previous_message_id": answer_id})
        code, refused = await self.post(base, body)
        self.assertEqual(code, 400, refused)
        await self.writer.drain()
        files = every_file(self.dump_dir)
        self.assertEqual(len(files), 1, files)
        dump = json.loads(open(files[0], "rb").read())
        client = json.dumps(dump["client_request"])
        self.assertIn("The first question of the thread.", client)
        self.assertIn("toolu_nope", client)
        self.assertIn("get_weather", client)
        self.assertNotIn('"thread"', client)


class DocumentedGrepTests(SynchronousTestCase):
    """The grep docs/dumps.md gives finds the dumps it says it finds."""

    def mktemp_dir(self) -> str:
        path = self.mktemp()
        os.makedirs(path)
        return path

    def test_documented_duplicate_grep(self):
        """
        The grep that docs/dumps.md gives for refusals about duplicate ids
        finds a dump of Anthropic's own wording and of the other backends'.
        """
        with open(os.path.join(ROOT, "docs", "dumps.md"), encoding="utf-8") as f:
            lines = f.read().splitlines()
        at = next(n for n, line in enumerate(lines) if line.startswith("# Every refusal that complained about a duplicate"))
        command = next(line for line in lines[at:] if line.startswith("grep"))
        folder = self.mktemp_dir()
        for message in ("messages.3.content.0: `tool_use` ids must be unique", "duplicate tool_call id toolu_001",
                        "max_tokens: Field required"):
            error = {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
            request = DumpRequest(**exchange(response_body=ujson.dumps(error).encode()))
            data = render_dump(build_dump(request, SETTINGS), [], 64 * 1024 * 1024)
            write_once(os.path.join(folder, "relay-dumps"), request.received_at, request.relay_request_id, data)
        done = subprocess.run(["sh", "-c", command], cwd=folder, capture_output=True, timeout=30, check=False)
        self.assertIn(b"must be unique", done.stdout)
        self.assertIn(b"duplicate tool_call id", done.stdout)
        self.assertNotIn(b"Field required", done.stdout)
