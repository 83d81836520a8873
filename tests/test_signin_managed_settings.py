"""
Managed settings (``GET /managed/settings``): the checksum is the one
Claude Code computes (checked against fixed texts, and against Node running
the very functions of Claude Code 2.1.332's bundle where Node is installed),
the document, ``ETag`` and 304 over HTTP on 127.0.0.1, a changed file read
again, a bad file refused at start and ignored after a change.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase

from twisted_relay.signin.managed_settings import (
    ManagedSettings,
    SettingsFileError,
    canonical_json,
    read_settings_document,
    settings_checksum,
)

from tests.signin_helpers import serve_app

# Claude Code 2.1.332's own functions (its bundle's ``uU`` and ``s1``, names
# kept, ``rn`` spelt out), run by Node on each JSON line of standard input.
_CLAUDE_CODE_CHECKSUM = r"""
const crypto = require("crypto");
function uU(e){if(Array.isArray(e))return e.map(uU);if(e!==null&&typeof e==="object"){let n={};for(let o of Object.keys(e).sort())n[o]=uU(Object.hasOwn(e,o)?e[o]:void 0);return n}return e}
function s1(e){let n=uU(e),o=JSON.stringify(n);return`sha256:${crypto.createHash("sha256").update(o).digest("hex")}`}
for (const line of require("fs").readFileSync(0, "utf8").split("\n")) {
  if (line) console.log(s1(JSON.parse(line)));
}
"""


def _sha(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


class ChecksumTests(SynchronousTestCase):
    """The checksum recipe, against texts written out by hand from JavaScript's rules."""

    def test_keys_sorted_at_every_level_no_whitespace(self):
        settings = {"permissions": {"deny": ["Bash(rm:*)"], "allow": []}, "env": {"Z": "1", "A": "2"}, "model": "opus"}
        text = '{"env":{"A":"2","Z":"1"},"model":"opus","permissions":{"allow":[],"deny":["Bash(rm:*)"]}}'
        self.assertEqual(canonical_json(settings), text)
        self.assertEqual(settings_checksum(settings), _sha(text))

    def test_unicode_as_javascript_writes_and_sorts_it(self):
        """
        Non-ASCII as UTF-8, control characters and lone surrogates escaped
        in lower case, U+2028 and DEL as they are; keys by UTF-16 code unit
        (an emoji's surrogates before U+E000), array indices first in
        numeric order.
        """
        settings = {"\ue000": 1, "\U0001f600": 2, "b": "caf\u00e9\u2028\x7f\x01\n\"\\/", "a": "\ud800", "10": 3, "9": 4, "01": 5}
        text = '{"9":4,"10":3,"01":5,"a":"\\ud800","b":"caf\u00e9\u2028\x7f\\u0001\\n\\"\\\\/","\U0001f600":2,"\ue000":1}'
        self.assertEqual(canonical_json(settings), text)
        self.assertEqual(settings_checksum(settings), "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest())

    def test_numbers_as_javascript_prints_doubles(self):
        values = [0, -0.0, 1.0, 100.0, 0.1, 1e21, 1e16, 1e-7, 1e-6, 12345.678, 2**53, 2**53 + 1, 2**64, -2.5e-300, 1.5e300]
        text = "[0,0,1,100,0.1,1e+21,10000000000000000,1e-7,0.000001,12345.678,9007199254740992,9007199254740992,18446744073709552000,-2.5e-300,1.5e+300]"
        self.assertEqual(canonical_json(values), text)

    def test_document_served_is_the_canonical_text(self):
        document = read_settings_document(b'{ "b": [1.0, {"y": 2, "x": 1}],\n "a": true }', "f.json")
        self.assertEqual(document.checksum, _sha('{"a":true,"b":[1,{"x":1,"y":2}]}'))
        self.assertEqual(
            json.loads(document.body),
            {"uuid": document.checksum, "checksum": document.checksum, "settings": {"a": True, "b": [1, {"x": 1, "y": 2}]}},
        )
        self.assertEqual(document.etag, b'"' + document.checksum.encode() + b'"')

    def test_files_claude_code_cannot_take_are_refused(self):
        for data, why in (
            (b"[1, 2]", "must hold a JSON object"),
            (b"null", "must hold a JSON object"),
            (b'{"a": ', "not valid JSON"),
            (b'{"a": NaN}', "not valid JSON"),
            (b'{"a": 1e400}', "too large"),
            (b'{"a": {"__proto__": {}}}', "__proto__ (at a)"),
            (b'{"a": "\xff"}', "not UTF-8"),
        ):
            with self.assertRaises(SettingsFileError) as caught:
                read_settings_document(data, "managed.json")
            message = str(caught.exception)
            self.assertIn(why, message)
            self.assertTrue(message.startswith("managed settings file managed.json: "), message)
            self.assertNotIn("\n", message)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=5),
    max_leaves=20,
)


class ClaudeCodeChecksumTests(SynchronousTestCase):
    """The checksum against Claude Code's own functions, run by Node on the same documents."""

    def setUp(self):
        self.node = shutil.which("node")
        if self.node is None:
            raise self.skipTest("node is not installed: Claude Code's checksum functions cannot be run")

    def claude_code_checksums(self, documents: list[str]) -> list[str]:
        done = subprocess.run(
            [self.node, "-e", _CLAUDE_CODE_CHECKSUM], input="\n".join(documents) + "\n",
            capture_output=True, text=True, timeout=60, check=True,
        )
        return done.stdout.split("\n")[: len(documents)]

    def test_generated_documents(self):
        """Two hundred generated documents (nested keys, any text, integers and doubles of every size)."""
        documents = []

        @settings(max_examples=200, deadline=None, database=None)
        @given(st.dictionaries(st.text(max_size=8), _json_values, max_size=6))
        def collect(settings_value):
            documents.append(settings_value)

        collect()
        lines = [json.dumps(document) for document in documents]
        expected = self.claude_code_checksums(lines)
        # What the relay serves is what it read from the file: the same JSON text.
        mine = [read_settings_document(line.encode("utf-8"), "generated").checksum for line in lines]
        self.assertEqual(mine, expected)


class ManagedSettingsRouteTests(TestCase):
    """The route over HTTP on 127.0.0.1, and the file read again when it changes."""

    def setUp(self):
        self.path = os.path.join(self.mktemp() + "-settings.json")
        self.write({"env": {"CLAUDE_CODE_ENABLE_TELEMETRY": "1"}, "model": "opus"})
        self.logged = []
        observer = lambda event: self.logged.append(formatEvent(event))  # noqa: E731
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)

    def write(self, settings) -> None:
        data = settings if isinstance(settings, bytes) else json.dumps(settings).encode()
        with open(self.path + ".new", "wb") as f:
            f.write(data)
        os.replace(self.path + ".new", self.path)

    async def test_document_etag_and_304(self):
        served = serve_app(self, managed_settings=ManagedSettings(self.path))
        response = await served.get("/managed/settings")
        self.assertEqual(response.code, 200)
        document = json.loads(await response.content())
        checksum = settings_checksum({"env": {"CLAUDE_CODE_ENABLE_TELEMETRY": "1"}, "model": "opus"})
        self.assertEqual(document, {"uuid": checksum, "checksum": checksum, "settings": {"env": {"CLAUDE_CODE_ENABLE_TELEMETRY": "1"}, "model": "opus"}})
        etag = response.headers.getRawHeaders("etag")[0]
        self.assertEqual(etag, '"%s"' % (checksum,))
        self.assertIn("no-cache", response.headers.getRawHeaders("cache-control")[0])

        again = await served.get("/managed/settings", if_none_match=etag)
        self.assertEqual((again.code, await again.content()), (304, b""))
        self.assertEqual(again.headers.getRawHeaders("etag"), [etag])
        for other in ('"sha256:0000"', "*"):
            stale = await served.get("/managed/settings", if_none_match=other)
            self.assertEqual(stale.code, 200, other)
            await stale.content()

    async def test_a_changed_file_is_served_and_a_bad_one_is_not(self):
        served = serve_app(self, managed_settings=ManagedSettings(self.path))
        first = json.loads(await (await served.get("/managed/settings")).content())["checksum"]
        self.write({"model": "sonnet"})
        response = await served.get("/managed/settings", if_none_match='"%s"' % (first,))
        self.assertEqual(response.code, 200)
        changed = json.loads(await response.content())
        self.assertEqual((changed["settings"], changed["checksum"]), ({"model": "sonnet"}, settings_checksum({"model": "sonnet"})))

        self.write(b'["not", "an object"]')
        kept = json.loads(await (await served.get("/managed/settings")).content())
        self.assertEqual(kept["settings"], {"model": "sonnet"})
        self.assertTrue([line for line in self.logged if "must hold a JSON object" in line and "still serving" in line], self.logged)

    def test_a_bad_file_is_refused_at_start(self):
        self.write(b'"just text"')
        with self.assertRaises(SettingsFileError) as caught:
            ManagedSettings(self.path)
        self.assertIn("must hold a JSON object", str(caught.exception))
        with self.assertRaises(SettingsFileError) as caught:
            ManagedSettings(self.path + ".missing")
        self.assertIn("No such file", str(caught.exception))

    async def test_no_file_no_key(self):
        """No settings file: 404 with no-store (Claude Code: no policy). No relay key: 401, not retried."""
        served = serve_app(self)
        response = await served.get("/managed/settings")
        self.assertEqual(response.code, 404)
        self.assertEqual(response.headers.getRawHeaders("cache-control"), ["no-store"])
        self.assertEqual(json.loads(await response.content())["error"]["type"], "not_found_error")
        served = serve_app(self, managed_settings=ManagedSettings(self.path))
        refused = await served.get("/managed/settings", key=None)
        self.assertEqual((refused.code, refused.headers.getRawHeaders("x-should-retry")), (401, ["false"]))
        self.assertEqual(json.loads(await refused.content())["error"]["type"], "authentication_error")
