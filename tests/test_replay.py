"""
Tests for :mod:`twisted_relay.replay`, the ``twisted-relay-replay`` command,
on dumps the real :class:`~twisted_relay.dumps.DumpWriter` wrote.
"""

from __future__ import annotations

import io
import json
import os

from twisted.internet import reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site

from twisted_relay.dumps import DumpRequest, DumpWriter, load_dump
from twisted_relay.redact import REDACTED
from twisted_relay.replay import differences, main
from twisted_relay.translation import TranslationTable

from tests.test_dumps import SETTINGS, UPSTREAM_KEY, conversation, exchange


def run(argv: list[str]) -> tuple[int, str, str]:
    """Run the command; its exit status, output and error output."""
    out, err = io.StringIO(), io.StringIO()
    status = main(argv, stdout=out, stderr=err)
    return status, out.getvalue(), err.getvalue()


class _DumpMixin:
    """Dumps written by a real writer, and edited copies of them."""

    @inlineCallbacks
    def write_dump(self, **kwargs):
        writer = DumpWriter(self.mktemp(), reactor=reactor, secrets=(UPSTREAM_KEY,), settings=SETTINGS)
        writer.startService()
        try:
            path = yield writer.submit(DumpRequest(**exchange(**kwargs)))
        finally:
            yield writer.stopService()
        return path

    def edited(self, path: str, edit) -> str:
        dump = load_dump(path)
        edit(dump)
        copy = self.mktemp() + ".json"
        with open(copy, "w", encoding="utf-8") as f:
            json.dump(dump, f, indent=2)
        return copy


class ReplayTests(_DumpMixin, TestCase):
    """Reading and checking a dump from cold."""

    @inlineCallbacks
    def test_prints_summary_timeline_and_table(self):
        """
        Without options the command prints the refusal, every timeline line
        and the translation table as readable text.
        """
        path = yield self.write_dump()
        dump = load_dump(path)
        status, out, _ = run([path])
        self.assertEqual(status, 0)
        self.assertIn("400 invalid_request_error: duplicate tool_call id toolu_001", out)
        self.assertIn(dump["relay_request_id"], out)
        self.assertIn("sess-42", out)
        for line in dump["timeline"]:
            self.assertIn(f"  {line}\n", out)
        for line in TranslationTable.from_dict(dump["translation_table"]).format().splitlines():
            self.assertIn(f"  {line}".rstrip(), out)

    @inlineCallbacks
    def test_check_fresh_dump(self):
        """
        ``--check`` on a dump the current code wrote finds the same upstream
        body and table, under either policy, and exits 0.
        """
        for policy, repeat_id in (("unique", "toolu_001"), ("original", "toolu_001-2")):
            path = yield self.write_dump(body=conversation(repeat_id=repeat_id), policy=policy)
            status, out, err = run([path, "--check"])
            self.assertEqual((status, err), (0, ""), out)
            self.assertIn("identical", out)

    @inlineCallbacks
    def test_check_upstream_body_difference(self):
        """
        A dumped upstream body the current code would not produce makes
        ``--check`` exit 1 and name the place that differs.
        """
        path = yield self.write_dump()

        def edit(dump):
            dump["upstream_request"]["body"]["messages"][47]["content"][1]["id"] = "toolu_001"

        status, out, _ = run([self.edited(path, edit), "--check"])
        self.assertEqual(status, 1)
        self.assertIn(
            'upstream_request.body.messages[47].content[1].id: dumped "toolu_001", now "toolu_001-2"', out
        )
        self.assertIn("1 difference(s)", out)

    @inlineCallbacks
    def test_check_table_difference(self):
        """A dumped table that differs makes ``--check`` exit 1 and name the entry."""
        path = yield self.write_dump()

        def edit(dump):
            entries = dump["translation_table"]["entries"]
            entries[-1]["repaired"] = False
            del entries[0]

        status, out, _ = run([self.edited(path, edit), "--check"])
        self.assertEqual(status, 1)
        self.assertIn("translation_table.entries: dumped", out)
        self.assertIn("translation_table.entries[0].message_index: dumped 2, now 1", out)

    @inlineCallbacks
    def test_check_truncated(self):
        """A truncated dump cannot be checked: exit 2, saying why."""
        path = yield self.write_dump()

        def edit(dump):
            dump["truncated"] = True
            dump["client_request"]["body"] = {"truncated": True, "original_bytes": 10}

        status, _, err = run([self.edited(path, edit), "--check"])
        self.assertEqual(status, 2)
        self.assertIn("truncated", err)

    def test_unreadable_dump(self):
        """A missing or broken file is exit 2 with a message."""
        broken = self.mktemp()
        with open(broken, "w") as f:
            f.write("{not json")
        for path in (broken, self.mktemp()):
            status, _, err = run([path])
            self.assertEqual(status, 2)
            self.assertIn("cannot read", err)


class _Upstream(Resource):
    """A local stand-in for the upstream that records what it receives."""

    isLeaf = True

    def __init__(self, code: int, answer: dict):
        super().__init__()
        self.code = code
        self.answer = answer
        self.received: list[tuple[bytes, dict, bytes]] = []

    def render_POST(self, request):
        headers = {k.lower(): v for k, v in request.requestHeaders.getAllRawHeaders()}
        self.received.append((request.uri, headers, request.content.read()))
        request.setResponseCode(self.code)
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"request-id", b"req_local")
        return json.dumps(self.answer).encode()


class SendTests(_DumpMixin, TestCase):
    """``--send`` replays the upstream-bound request against a server."""

    def serve(self, upstream: _Upstream) -> str:
        site = Site(upstream)
        site.timeOut = None
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return f"http://127.0.0.1:{port.getHost().port}"

    @inlineCallbacks
    def test_send_shows_the_answer(self):
        """
        The dumped upstream body goes to the dumped path and query under the
        given URL, with the dumped headers minus redacted ones, and the given
        key; the status and answer are shown, and a 4xx exits 1.
        """
        path = yield self.write_dump()
        dump = load_dump(path)
        upstream = _Upstream(400, {"type": "error", "error": {"type": "invalid_request_error", "message": "still bad"}})
        url = self.serve(upstream)
        status, out, err = yield deferToThread(
            run, [path, "--send", url, "--api-key", "local-key-123", "--timeout", "10"]
        )
        self.assertEqual((status, err), (1, ""))
        self.assertIn("status: 400 Bad Request", out)
        self.assertIn("request-id: req_local", out)
        self.assertIn('"message": "still bad"', out)
        [(uri, headers, body)] = upstream.received
        self.assertEqual(uri, b"/v1/messages?beta=true")
        self.assertEqual(json.loads(body), dump["upstream_request"]["body"])
        self.assertEqual(headers[b"x-api-key"], [b"local-key-123"])
        self.assertEqual(headers[b"anthropic-version"], [b"2023-06-01"])
        self.assertNotIn(REDACTED.encode(), b"".join(v for vs in headers.values() for v in vs))

    @inlineCallbacks
    def test_send_key_from_environment(self):
        """Without ``--api-key`` the key comes from ``ANTHROPIC_API_KEY``; 200 exits 0."""
        path = yield self.write_dump()
        upstream = _Upstream(200, {"type": "message", "content": []})
        url = self.serve(upstream)
        self.patch(os, "environ", dict(os.environ, ANTHROPIC_API_KEY="env-key-456"))
        status, out, _ = yield deferToThread(run, [path, "--send", url + "/prefix/"])
        self.assertEqual(status, 0)
        self.assertIn("status: 200 OK", out)
        [(uri, headers, _)] = upstream.received
        self.assertEqual(uri, b"/prefix/v1/messages?beta=true")
        self.assertEqual(headers[b"x-api-key"], [b"env-key-456"])

    @inlineCallbacks
    def test_send_nowhere(self):
        """A server that is not there is exit 2 with the reason."""
        path = yield self.write_dump()
        port = reactor.listenTCP(0, Site(Resource()), interface="127.0.0.1")
        number = port.getHost().port
        yield port.stopListening()
        status, _, err = yield deferToThread(run, [path, "--send", f"http://127.0.0.1:{number}", "--timeout", "5"])
        self.assertEqual(status, 2)
        self.assertIn("cannot send", err)


class DifferencesTests(SynchronousTestCase):
    """The JSON comparison behind ``--check``."""

    def test_paths(self):
        """Each difference is named by its path, missing keys and lengths too."""
        self.assertEqual(
            list(differences("b", {"a": [1, {"x": "y"}], "gone": 1}, {"a": [1, {"x": "z"}, 3], "new": True})),
            [
                "b.a: dumped 2 items, now 3",
                'b.a[1].x: dumped "y", now "z"',
                "b.gone: only in the dump (1)",
                "b.new: only now (true)",
            ],
        )

    def test_types_matter(self):
        """``1`` and ``true`` (equal in Python) are a difference in JSON."""
        self.assertEqual(list(differences("v", 1, True)), ["v: dumped 1, now true"])
        self.assertEqual(list(differences("v", {"a": [1]}, {"a": [1]})), [])
