"""
Tests for :mod:`twisted_relay.dumps` and :mod:`twisted_relay.redact`.

The writer runs on the real reactor with its real thread pool: what these
tests are about is files on disk written off the reactor thread.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import tracemalloc
from datetime import datetime, timezone

from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.task import Clock, LoopingCall, deferLater
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase, TestCase

from twisted_relay._version import __version__
from twisted_relay.dumps import (
    FORMAT_VERSION,
    DumpRequest,
    DumpWriter,
    apply_retention,
    build_timeline,
    load_dump,
    write_once,
)
from twisted_relay.redact import (
    REDACTED,
    header_secrets,
    redact_headers,
    redact_text,
    redact_url,
)
from twisted_relay.translation import translate_request

MiB = 1024 * 1024
DAY = 86400.0

CLIENT_KEY = "sk-ant-api03-clientKEY0123456789abcdef"
UPSTREAM_KEY = "upstream-secret-7f3a9c2e11"
BEARER = "oauth-bearer-token-5d8e2b7a"
SETTINGS = {"version": __version__, "upstream": "https://upstream.example", "upstream_ids": "unique"}
ERROR = {
    "type": "error",
    "error": {"type": "invalid_request_error", "message": "duplicate tool_call id toolu_001"},
    "request_id": "req_011CTest",
}


def conversation(turns: int = 49, repeat_at: int = 47, repeat_id: str = "toolu_001") -> dict:
    """
    A Claude-Code-like request body: a tool call in every assistant turn, its
    result in the next user turn, and at ``repeat_at`` a tool call whose id
    ``repeat_id`` an earlier one had already.
    """
    messages: list = [{"role": "user", "content": "start"}]
    for i in range(1, turns):
        if i % 2:
            tool_id = repeat_id if i == repeat_at else f"toolu_{i:03d}"
            messages.append(
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": f"turn {i}"},
                        {"type": "tool_use", "id": tool_id, "name": "Bash", "input": {"command": "ls"}},
                    ],
                }
            )
        else:
            previous = messages[-1]["content"][1]["id"]
            messages.append(
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": previous, "content": "ok"}]}
            )
    return {"model": "claude-test", "max_tokens": 1024, "messages": messages}


def exchange(body: dict | None = None, policy: str = "unique", **overrides) -> dict:
    """The keyword arguments the relay passes to ``DumpWriter.submit``."""
    body = conversation() if body is None else body
    translation = translate_request(body, policy)
    kwargs = dict(
        relay_request_id="rly_" + os.urandom(6).hex(),
        upstream_request_id="req_011CTest",
        received_at=time.time(),
        upstream_url="https://upstream.example/v1/messages?beta=true",
        status=400,
        response_headers=[(b"Content-Type", b"application/json"), (b"request-id", b"req_011CTest")],
        response_body=json.dumps(ERROR).encode(),
        client_headers=[
            (b"X-Api-Key", CLIENT_KEY.encode()),
            (b"Anthropic-Version", b"2023-06-01"),
            (b"X-Claude-Code-Session-Id", b"sess-42"),
        ],
        client_body=json.dumps(body).encode(),
        upstream_headers=[(b"x-api-key", UPSTREAM_KEY.encode()), (b"anthropic-version", b"2023-06-01")],
        upstream_body=json.dumps(translation.upstream_body).encode(),
        table=translation.table.to_dict(),
        policy=policy,
        stream_error=None,
        session_id="sess-42",
    )
    kwargs.update(overrides)
    return kwargs


def dump_files(root: str) -> list[str]:
    """Every dump file under ``root``."""
    return sorted(
        os.path.join(folder, name)
        for folder, _, names in os.walk(root)
        for name in names
        if name.endswith(".json")
    )


def every_file(root: str) -> list[str]:
    """Every file under ``root``, hidden ones included."""
    return sorted(os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names)


class GatedDumpWriter(DumpWriter):
    """A writer whose writes wait until the test opens ``gate``: a slow disk."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def _write_dump(self, request):
        self.gate.wait(30)
        return super()._write_dump(request)


class _WriterTestMixin:
    """Starting writers on the real reactor, and stopping them afterwards."""

    def start_writer(self, dump_dir=None, writer_class=DumpWriter, **kwargs) -> DumpWriter:
        kwargs.setdefault("reactor", reactor)
        kwargs.setdefault("secrets", (UPSTREAM_KEY,))
        kwargs.setdefault("settings", SETTINGS)
        writer = writer_class(dump_dir or self.mktemp(), **kwargs)
        writer.startService()
        self.addCleanup(self._stop, writer)
        return writer

    def _stop(self, writer):
        gate = getattr(writer, "gate", None)
        if gate is not None:
            gate.set()
        return writer.stopService() if writer.running else writer.drain()

    def capture_log(self, writer) -> list[dict]:
        events: list[dict] = []
        writer.log = Logger(namespace="twisted_relay.dumps", observer=events.append)
        return events


class DumpFileTests(_WriterTestMixin, TestCase):
    """One refused request becomes one complete, write-once file."""

    @inlineCallbacks
    def test_one_submit_one_file(self):
        """
        One submit writes exactly one file, at
        ``<dir>/YYYY-MM-DD/HHMMSS.ffffff-<relay id>.json`` (UTC), holding
        everything an operator needs to understand the refusal from cold.
        """
        writer = self.start_writer()
        body = conversation()
        kwargs = exchange(body)
        path = yield writer.submit(DumpRequest(**kwargs))

        self.assertEqual(every_file(writer.dump_dir), [path])
        when = datetime.fromtimestamp(kwargs["received_at"], timezone.utc)
        self.assertEqual(
            path,
            os.path.join(
                writer.dump_dir,
                when.strftime("%Y-%m-%d"),
                when.strftime("%H%M%S.%f") + "-" + kwargs["relay_request_id"] + ".json",
            ),
        )
        self.assertEqual((writer.written, writer.dropped, writer.failed), (1, 0, 0))

        dump = load_dump(path)
        translation = translate_request(body, "unique")
        self.assertEqual(dump["format"], FORMAT_VERSION)
        self.assertEqual(dump["relay_version"], __version__)
        self.assertEqual(dump["relay_request_id"], kwargs["relay_request_id"])
        self.assertEqual(dump["upstream_request_id"], "req_011CTest")
        self.assertEqual(dump["session_id"], "sess-42")
        self.assertEqual(dump["time"], when.strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
        self.assertEqual(dump["upstream_url"], kwargs["upstream_url"])
        self.assertEqual(dump["status"], 400)
        self.assertEqual(dump["policy"], "unique")
        self.assertEqual(dump["settings"], SETTINGS)
        self.assertIs(dump["truncated"], False)
        self.assertIsNone(dump["stream_error"])
        self.assertEqual(dump["error"], {"type": "invalid_request_error", "message": ERROR["error"]["message"]})
        self.assertEqual(dump["response"]["body"], ERROR)
        self.assertIn("request-id: req_011CTest", dump["response"]["headers"])
        self.assertEqual(dump["client_request"]["body"], body)
        self.assertIn("X-Claude-Code-Session-Id: sess-42", dump["client_request"]["headers"])
        self.assertEqual(dump["client_request"]["bytes"], len(kwargs["client_body"]))
        self.assertEqual(dump["upstream_request"]["body"], translation.upstream_body)
        self.assertEqual(dump["translation_table"], translation.table.to_dict())
        self.assertEqual(len(dump["timeline"]), len(body["messages"]))
        self.assertEqual(dump["timeline"][0], "0 user: (string)")
        self.assertEqual(
            dump["timeline"][47], "47 assistant: text | tool_use id=toolu_001 (upstream toolu_001-2)"
        )
        self.assertEqual(
            dump["timeline"][48], "48 user: tool_result tool_use_id=toolu_001 (upstream toolu_001-2)"
        )

    @inlineCallbacks
    def test_one_request_object(self):
        """
        The relay hands the writer one L{DumpRequest}, which it writes; the
        attempts are kept as a tuple, whatever sequence they came in.
        """
        writer = self.start_writer()
        kwargs = exchange()
        whole = yield writer.submit(DumpRequest(**kwargs))
        self.assertTrue(os.path.exists(whole))
        self.assertEqual(DumpRequest(**dict(kwargs, attempts=["a (529)"])).attempts, ("a (529)",))

    @inlineCallbacks
    def test_file_is_greppable(self):
        """
        The file has one field a line, so that a plain ``grep`` finds a
        turn's timeline line, the session id or the error message.
        """
        writer = self.start_writer()
        path = yield writer.submit(DumpRequest(**exchange()))
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        self.assertIn('    "47 assistant: text | tool_use id=toolu_001 (upstream toolu_001-2)",', lines)
        self.assertIn('  "session_id": "sess-42",', lines)
        self.assertTrue(any(re.search(r'"message": "duplicate tool_call id', line) for line in lines))

    @inlineCallbacks
    def test_stream_error(self):
        """
        A client-error ``error`` event in a stream (status 200, empty body) is
        dumped with the event, and the error summary comes from it.
        """
        writer = self.start_writer()
        event = {"type": "error", "error": {"type": "invalid_request_error", "message": "bad id"}}
        path = yield writer.submit(DumpRequest(**exchange(status=200, response_body=b"", stream_error=event)))
        dump = load_dump(path)
        self.assertEqual(dump["stream_error"], event)
        self.assertEqual(dump["error"], {"type": "invalid_request_error", "message": "bad id"})
        self.assertEqual(dump["response"]["body"], "")

    @inlineCallbacks
    def test_non_json_bodies_are_text(self):
        """A body that is not JSON is kept as text."""
        writer = self.start_writer()
        path = yield writer.submit(DumpRequest(**exchange(response_body=b"<html>Bad Gateway</html>")))
        self.assertEqual(load_dump(path)["response"]["body"], "<html>Bad Gateway</html>")

    @inlineCallbacks
    def test_same_second_two_files(self):
        """
        Dumps received in the same second, even at the same instant with the
        same relay request id, each get their own file.
        """
        writer = self.start_writer()
        now = time.time()
        paths = []
        for kwargs in (
            exchange(received_at=now, relay_request_id="rly_a"),
            exchange(received_at=now + 0.0001, relay_request_id="rly_b"),
            exchange(received_at=now, relay_request_id="rly_a"),
        ):
            paths.append((yield writer.submit(DumpRequest(**kwargs))))
        self.assertEqual(len(set(paths)), 3)
        self.assertEqual(dump_files(writer.dump_dir), sorted(paths))
        self.assertTrue(paths[2].endswith("-rly_a-2.json"), paths[2])
        self.assertEqual(writer.written, 3)

    @inlineCallbacks
    def test_never_overwrites(self):
        """
        A file already at the target name is left exactly as it was; the
        new dump takes the next free name.
        """
        kwargs = exchange()
        when = datetime.fromtimestamp(kwargs["received_at"], timezone.utc)
        dump_dir = self.mktemp()
        folder = os.path.join(dump_dir, when.strftime("%Y-%m-%d"))
        os.makedirs(folder)
        taken = os.path.join(folder, when.strftime("%H%M%S.%f") + "-" + kwargs["relay_request_id"] + ".json")
        with open(taken, "wb") as f:
            f.write(b"precious")
        # Made before the writer starts: its first retention pass (in its
        # thread) removes empty date folders, and would race an empty one.
        writer = self.start_writer(dump_dir)
        path = yield writer.submit(DumpRequest(**kwargs))
        with open(taken, "rb") as f:
            self.assertEqual(f.read(), b"precious")
        self.assertEqual(path, taken[: -len(".json")] + "-2.json")
        self.assertEqual(load_dump(path)["relay_request_id"], kwargs["relay_request_id"])

    @inlineCallbacks
    def test_permissions(self):
        """
        Dump files are 0600 and the folders the writer makes are 0700, and no
        temporary file is left behind.
        """
        writer = self.start_writer()
        path = yield writer.submit(DumpRequest(**exchange()))
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
        self.assertEqual(os.stat(os.path.dirname(path)).st_mode & 0o777, 0o700)
        self.assertEqual(os.stat(writer.dump_dir).st_mode & 0o777, 0o700)
        self.assertEqual(every_file(writer.dump_dir), [path])


class DumpRedactionTests(_WriterTestMixin, TestCase):
    """No secret ever reaches a dump file's bytes."""

    @inlineCallbacks
    def test_no_secret_in_the_file(self):
        """
        Keys in headers, in message text, in a tool result, in the URL's
        query, in the answer's headers, and the configured secrets (even in
        forms that JSON escapes) are all absent from the file's bytes, which
        still parse as JSON.
        """
        odd_secret = 'relay-key"with\\escapes'
        pasted_key = "sk-ant-admin01-pastedKeyNobodyConfigured99"
        body = conversation()
        body["messages"][0]["content"] = f"my key is {CLIENT_KEY}, the relay's is {UPSTREAM_KEY}"
        body["messages"][2]["content"][0]["content"] = [
            {"type": "text", "text": f"env: ANTHROPIC_API_KEY={pasted_key} TOKEN={BEARER} X={odd_secret}"}
        ]
        writer = self.start_writer(secrets=(UPSTREAM_KEY, odd_secret))
        kwargs = exchange(
            body,
            upstream_url=f"https://upstream.example/v1/messages?beta=true&key={UPSTREAM_KEY}&access_token=opaque-value",
            client_headers=[
                (b"X-Api-Key", CLIENT_KEY.encode()),
                (b"Authorization", b"Bearer " + BEARER.encode()),
                (b"Cookie", b"session=cookie-secret-value"),
                (b"X-Custom-Token", b"custom-token-value"),
                (b"Anthropic-Version", b"2023-06-01"),
            ],
            response_headers=[(b"Set-Cookie", b"track=set-cookie-secret"), (b"request-id", b"req_1")],
            response_body=json.dumps({"type": "error", "error": {"type": "x", "message": f"bad key {CLIENT_KEY}"}}).encode(),
        )
        path = yield writer.submit(DumpRequest(**kwargs))
        with open(path, "rb") as f:
            data = f.read()
        secrets = [
            CLIENT_KEY,
            UPSTREAM_KEY,
            BEARER,
            pasted_key,
            "cookie-secret-value",
            "custom-token-value",
            "set-cookie-secret",
            "opaque-value",
            odd_secret,
            json.dumps(odd_secret)[1:-1],
            "sk-ant-",
        ]
        for secret in secrets:
            self.assertNotIn(secret.encode(), data)
        dump = json.loads(data)
        self.assertIn(f"X-Api-Key: {REDACTED}", dump["client_request"]["headers"])
        self.assertIn(f"Authorization: {REDACTED}", dump["client_request"]["headers"])
        self.assertIn("Anthropic-Version: 2023-06-01", dump["client_request"]["headers"])
        self.assertIn(f"x-api-key: {REDACTED}", dump["upstream_request"]["headers"])
        self.assertEqual(
            dump["client_request"]["body"]["messages"][0]["content"],
            f"my key is {REDACTED}, the relay's is {REDACTED}",
        )
        self.assertTrue(dump["upstream_url"].startswith("https://upstream.example/v1/messages?beta=true&key="))


class RedactTests(SynchronousTestCase):
    """The redaction functions that dumps and logs share."""

    def test_headers_by_name(self):
        """
        Credential headers lose their whole value, whatever their case; other
        headers keep theirs, rate-limit token budgets included.
        """
        pairs = [
            (b"X-Api-Key", b"k1-abcdefgh"),
            (b"authorization", b"Bearer abc"),
            (b"Proxy-Authorization", b"Basic abc"),
            (b"x-goog-api-key", b"abc"),
            (b"X-Secret-Thing", b"abc"),
            (b"WWW-Authenticate", b"abc"),
            (b"anthropic-ratelimit-tokens-remaining", b"1000"),
            (b"content-type", b"application/json"),
        ]
        self.assertEqual(
            redact_headers(pairs),
            [
                ("X-Api-Key", REDACTED),
                ("authorization", REDACTED),
                ("Proxy-Authorization", REDACTED),
                ("x-goog-api-key", REDACTED),
                ("X-Secret-Thing", REDACTED),
                ("WWW-Authenticate", REDACTED),
                ("anthropic-ratelimit-tokens-remaining", "1000"),
                ("content-type", "application/json"),
            ],
        )

    def test_twisted_header_shape(self):
        """
        Headers as Twisted's ``getAllRawHeaders()`` gives them, a name with a
        list of values, are redacted value by value, and their credentials
        harvested.
        """
        pairs = [(b"X-Api-Key", [b"k1-abcdefgh"]), (b"Accept", [b"a", b"b"])]
        self.assertEqual(redact_headers(pairs), [("X-Api-Key", REDACTED), ("Accept", "a"), ("Accept", "b")])
        self.assertEqual(header_secrets(pairs), ["k1-abcdefgh"])

    def test_secret_in_other_header(self):
        """A configured secret inside a harmless header's value is removed."""
        self.assertEqual(
            redact_headers([("x-note", "key=" + UPSTREAM_KEY)], [UPSTREAM_KEY]), [("x-note", "key=" + REDACTED)]
        )

    def test_text(self):
        """
        Secrets go in every spelling a dump can hold (as is, JSON-escaped,
        URL-quoted), the longest first, and Anthropic-looking keys go even
        unconfigured.
        """
        secret = "a/b c+d\"e-123"
        text = " | ".join([secret, json.dumps(secret), "q=a%2Fb%20c%2Bd%22e-123", "p=a%2Fb+c%2Bd%22e-123"])
        self.assertNotIn("a/b", redact_text(text, [secret]))
        self.assertEqual(redact_text("x sk-ant-api03-AAAAAAAAAA_-zz y", []), f"x {REDACTED} y")
        self.assertEqual(redact_text("sk-ant-short", []), "sk-ant-short")
        self.assertEqual(redact_text("abcdef12345", ["abcdef", "abcdef12345"]), REDACTED)
        self.assertEqual(redact_text("keep", ["", "x" * 9]), "keep")

    def test_harvested_secrets(self):
        """
        The credentials in a request's headers are found, the bearer token
        alone too; a value too short to scrub from text is left out.
        """
        found = header_secrets([(b"Authorization", b"Bearer tok-123456789"), (b"x-api-key", b"short"), (b"accept", b"x" * 20)])
        self.assertEqual(sorted(found), ["Bearer tok-123456789", "tok-123456789"])

    def test_url(self):
        """Query parameters named like credentials are redacted; others kept."""
        self.assertEqual(
            redact_url("https://h/v1/messages?beta=true&api_key=abc&x=1"),
            f"https://h/v1/messages?beta=true&api_key={REDACTED}&x=1",
        )
        self.assertEqual(redact_url("https://h/v1/messages?beta=true"), "https://h/v1/messages?beta=true")


class TimelineTests(SynchronousTestCase):
    """The one-line-per-message timeline."""

    def test_block_ids(self):
        """
        Every id field shows: declarations, references, ``caller`` pointers
        and server-tool results, with the upstream's id where it differs.
        """
        client = {
            "messages": [
                {
                    "role": "assistant",
                    "content": [
                        {"type": "server_tool_use", "id": "srvtoolu_1"},
                        {"type": "tool_use", "id": "toolu_2", "caller": {"type": "code_execution_20250825", "tool_id": "srvtoolu_1"}},
                        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1"},
                    ],
                },
                {"role": "user", "content": []},
                "junk",
            ]
        }
        upstream = json.loads(json.dumps(client))
        upstream["messages"][0]["content"][1]["caller"]["tool_id"] = "srvtoolu_1_2"
        self.assertEqual(
            build_timeline(client, upstream),
            [
                "0 assistant: server_tool_use id=srvtoolu_1 | tool_use id=toolu_2 caller=srvtoolu_1 "
                "(upstream srvtoolu_1_2) | web_search_tool_result tool_use_id=srvtoolu_1",
                "1 user: (empty)",
                "2 ?: str",
            ],
        )

    def test_not_a_messages_body(self):
        """A body without ``messages`` has an empty timeline."""
        self.assertEqual(build_timeline("not json"), [])


class DumpFailureTests(_WriterTestMixin, TestCase):
    """A folder that cannot be written to costs dumps, not the relay."""

    @inlineCallbacks
    def test_unwritable_folder(self):
        """
        When the dump folder cannot be made, the dump is counted as failed
        and logged as an error (not an unhandled failure); once the folder
        is fixed, the next dump is written.
        """
        blocker = self.mktemp()
        with open(blocker, "w") as f:
            f.write("a file where the folder should be")
        writer = self.start_writer(os.path.join(blocker, "dumps"))
        events = self.capture_log(writer)
        result = yield writer.submit(DumpRequest(**exchange()))
        self.assertIsNone(result)
        self.assertEqual((writer.written, writer.failed), (0, 1))
        errors = [e for e in events if e["log_level"].name == "error"]
        self.assertEqual(len(errors), 1)
        self.assertIn("Could not write the dump", errors[0]["log_format"])

        os.remove(blocker)
        os.mkdir(blocker)
        path = yield writer.submit(DumpRequest(**exchange()))
        self.assertEqual(dump_files(writer.dump_dir), [path])
        self.assertEqual((writer.written, writer.failed), (1, 1))


class QueueTests(_WriterTestMixin, TestCase):
    """The writer holds a bounded number of dumps, and never the reactor."""

    @inlineCallbacks
    def test_queue_bound(self):
        """
        Past ``max_queue`` dumps waiting on a slow disk, further dumps are
        dropped, counted and logged, and their bodies are not kept in memory.
        """
        writer = self.start_writer(writer_class=GatedDumpWriter, max_queue=4)
        events = self.capture_log(writer)
        tracemalloc.start()
        self.addCleanup(tracemalloc.stop)
        before = tracemalloc.get_traced_memory()[0]
        results = []
        for i in range(50):
            body = b"%d" % i + b"x" * MiB
            results.append(writer.submit(DumpRequest(**exchange(client_body=body, upstream_body=body + b"!"))))
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        self.assertEqual((writer.pending, writer.dropped), (4, 46))
        # Four dumps of 2 MiB each are waiting; the 46 dropped would be 92 MiB.
        self.assertLess(held, 16 * MiB)
        self.assertEqual(sum(1 for e in events if e["log_format"].startswith("Dropped")), 46)

        writer.gate.set()
        yield writer.drain()
        self.assertEqual((writer.written, writer.pending), (4, 0))
        self.assertEqual(len(dump_files(writer.dump_dir)), 4)
        self.assertEqual(sum(1 for r in results if r.result is None), 46)

    @inlineCallbacks
    def test_queue_bytes_bound(self):
        """
        Queued dumps hold at most ``max_queue_bytes`` of bodies, but a lone
        dump is taken however large.
        """
        writer = self.start_writer(writer_class=GatedDumpWriter, max_queue_bytes=3 * MiB)
        body = b"y" * MiB
        for _ in range(3):
            writer.submit(DumpRequest(**exchange(client_body=body, upstream_body=body)))
        self.assertEqual((writer.pending, writer.dropped), (1, 2))
        writer.gate.set()
        yield writer.drain()
        self.assertEqual(writer.written, 1)

    @inlineCallbacks
    def test_reactor_keeps_running(self):
        """
        While dumps wait on a slow disk, ``submit`` returns at once and the
        reactor keeps running timed calls.
        """
        writer = self.start_writer(writer_class=GatedDumpWriter)
        ticks = []
        loop = LoopingCall(lambda: ticks.append(reactor.seconds()))
        loop.start(0.01)
        self.addCleanup(lambda: loop.running and loop.stop())
        started = time.monotonic()
        for _ in range(20):
            writer.submit(DumpRequest(**exchange()))
        submitting = time.monotonic() - started
        ticks.clear()
        yield deferLater(reactor, 0.3, lambda: None)
        self.assertEqual(writer.written, 0)
        self.assertGreaterEqual(len(ticks), 10)
        self.assertLess(submitting, 0.2)
        writer.gate.set()
        yield writer.drain()
        self.assertEqual(writer.written, 20)

    @inlineCallbacks
    def test_stop_drains(self):
        """
        ``stopService`` fires only once every queued dump is on disk; after
        it, new dumps are dropped.
        """
        writer = self.start_writer(writer_class=GatedDumpWriter)
        for _ in range(3):
            writer.submit(DumpRequest(**exchange()))
        stopped = writer.stopService()
        yield deferLater(reactor, 0.05, lambda: None)
        self.assertNoResult(stopped)
        writer.gate.set()
        yield stopped
        self.assertEqual(len(dump_files(writer.dump_dir)), 3)
        self.assertIsNone((yield writer.submit(DumpRequest(**exchange()))))
        self.assertEqual((writer.written, writer.dropped), (3, 1))


class TruncationTests(_WriterTestMixin, TestCase):
    """A dump over the size limit is cut visibly, never dropped."""

    @inlineCallbacks
    def test_request_bodies_cut(self):
        """
        Over ``max_dump_bytes``, the request bodies become
        ``{"truncated": true, "original_bytes": N}``; metadata, timeline,
        table and the (small) answer stay, and the dump says it was cut.
        """
        body = conversation()
        body["messages"][0]["content"] = "z" * 200_000
        writer = self.start_writer(max_dump_bytes=60_000)
        kwargs = exchange(body)
        path = yield writer.submit(DumpRequest(**kwargs))
        self.assertLessEqual(os.path.getsize(path), 60_000)
        dump = load_dump(path)
        self.assertIs(dump["truncated"], True)
        self.assertEqual(dump["client_request"]["body"], {"truncated": True, "original_bytes": len(kwargs["client_body"])})
        self.assertEqual(dump["upstream_request"]["body"], {"truncated": True, "original_bytes": len(kwargs["upstream_body"])})
        self.assertEqual(dump["response"]["body"], ERROR)
        self.assertEqual(len(dump["timeline"]), 49)
        self.assertEqual(dump["translation_table"], kwargs["table"])
        self.assertEqual(dump["relay_request_id"], kwargs["relay_request_id"])

    @inlineCallbacks
    def test_answer_cut_too(self):
        """When the answer alone is too large, it is cut as well."""
        writer = self.start_writer(max_dump_bytes=60_000)
        answer = json.dumps({"error": {"type": "x", "message": "w" * 100_000}}).encode()
        path = yield writer.submit(DumpRequest(**exchange(response_body=answer)))
        dump = load_dump(path)
        self.assertEqual(dump["response"]["body"], {"truncated": True, "original_bytes": len(answer)})
        self.assertLessEqual(os.path.getsize(path), 60_000)


class RetentionTests(_WriterTestMixin, TestCase):
    """Old dumps go, the folder stays bounded, foreign files stay."""

    def make_dump(self, root: str, received_at: float, size: int = 1000) -> str:
        return write_once(root, received_at, "rly_" + os.urandom(4).hex(), b"{" + b" " * (size - 2) + b"}")

    @inlineCallbacks
    def test_by_age_at_start(self):
        """
        On start, dumps older than ``retention_days`` are deleted and their
        emptied date folders removed; recent dumps and files the writer did
        not name are kept.
        """
        root = self.mktemp()
        now = time.time()
        old = self.make_dump(root, now - 40 * DAY)
        young = self.make_dump(root, now - 2 * DAY)
        foreign = os.path.join(os.path.dirname(young), "notes.txt")
        with open(foreign, "w") as f:
            f.write("mine")
        writer = self.start_writer(root, retention_days=30)
        yield writer.drain()
        self.assertFalse(os.path.exists(old))
        self.assertFalse(os.path.exists(os.path.dirname(old)))
        self.assertTrue(os.path.exists(young))
        self.assertTrue(os.path.exists(foreign))

    @inlineCallbacks
    def test_by_total_size(self):
        """
        While the dumps together are larger than ``retention_bytes``, the
        oldest are deleted.
        """
        root = self.mktemp()
        now = time.time()
        paths = [self.make_dump(root, now - 3600 * (5 - i)) for i in range(5)]
        writer = self.start_writer(root, retention_bytes=2500)
        yield writer.drain()
        self.assertEqual(dump_files(root), sorted(paths[3:]))

    @inlineCallbacks
    def test_at_most_once_a_minute(self):
        """
        After a write, retention runs again only once a minute has passed on
        the reactor's clock.
        """
        clock = Clock()
        clock.advance(time.time())
        root = self.mktemp()
        writer = self.start_writer(root, reactor=_ClockedReactor(clock), retention_days=30)
        yield writer.drain()
        old = self.make_dump(root, time.time() - 40 * DAY)
        yield writer.submit(DumpRequest(**exchange()))
        yield writer.drain()
        self.assertTrue(os.path.exists(old))
        clock.advance(61)
        yield writer.submit(DumpRequest(**exchange()))
        yield writer.drain()
        self.assertFalse(os.path.exists(old))


class _ClockedReactor:
    """The real reactor, but telling the time of a :class:`Clock`."""

    def __init__(self, clock: Clock):
        self._clock = clock

    def seconds(self) -> float:
        return self._clock.seconds()

    def __getattr__(self, name):
        return getattr(reactor, name)


class ApplyRetentionTests(SynchronousTestCase):
    """The retention pass itself, on files."""

    def test_stale_temporary_files(self):
        """
        A temporary file a crash left behind is removed once it is an hour
        old, not while a write might still own it.
        """
        root = self.mktemp()
        folder = os.path.join(root, "2030-01-01")
        os.makedirs(folder)
        stale = os.path.join(folder, ".120000.000000-rly_x.abc.tmp")
        fresh = os.path.join(folder, ".120000.000000-rly_y.def.tmp")
        for path in (stale, fresh):
            open(path, "w").close()
        now = time.time()
        os.utime(stale, (now - 7200, now - 7200))
        result = apply_retention(root, now, 30 * DAY, 10 * MiB)
        self.assertEqual((result.removed, os.path.exists(stale), os.path.exists(fresh)), (0, False, True))

    def test_missing_folder(self):
        """A dump folder that does not exist yet is nothing to do."""
        self.assertEqual(apply_retention(self.mktemp(), time.time(), DAY, MiB).kept, 0)
