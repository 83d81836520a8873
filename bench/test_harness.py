# -*- test-case-name: bench.test_harness -*-
"""
Checks of the benchmark's own tools: the load generator must read every
response the way an HTTP client does, whatever the split, or its figures mean
nothing. Run with ``python -m twisted.trial bench.test_harness`` (not part
of CI: the benchmark is not a test).
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from bench.fake_upstream import DELTA_TEXT_BYTES, STAMP_MARKER, _model_of, delta_event, stream_events
from bench.loadgen import HTTPResponseReader, percentile


def _chunked(events: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


class _Collector:
    def __init__(self):
        self.body = []
        self.heads = []
        self.done = 0
        self.reader = HTTPResponseReader(self.body.append, lambda s, h: self.heads.append(s), self._done)

    def _done(self):
        self.done += 1


class HTTPResponseReaderTests(SynchronousTestCase):
    """The load generator's response parser."""

    def feed_split(self, wire: bytes, size: int) -> tuple[_Collector, bytes]:
        c = _Collector()
        extra = b""
        for i in range(0, len(wire), size):
            extra += c.reader.feed(wire[i : i + size])
        return c, extra

    def test_chunked_any_split(self):
        """A chunked stream decodes to the same body however the bytes are split."""
        events = stream_events(5)
        wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(events)
        for size in range(1, 40):
            c, extra = self.feed_split(wire, size)
            self.assertEqual(b"".join(c.body), b"".join(events), size)
            self.assertEqual((c.heads, c.done, extra), ([200], 1, b""))

    def test_content_length_and_leftover(self):
        """A length-delimited body ends at its length; bytes after it are handed back."""
        wire = b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nhelloNEXT"
        for size in range(1, 12):
            c, extra = self.feed_split(wire, size)
            self.assertEqual((b"".join(c.body), c.heads, c.done, extra), (b"hello", [404], 1, b"NEXT"))

    def test_close_delimited(self):
        """An HTTP/1.0 body without a length ends when the connection closes."""
        c, _ = self.feed_split(b"HTTP/1.0 200 OK\r\n\r\nabc", 2)
        self.assertEqual(c.done, 0)
        self.assertTrue(c.reader.close())
        self.assertEqual((b"".join(c.body), c.done, c.reader.keep_alive), (b"abc", 1, False))

    def test_chunk_trailers_ignored(self):
        """Trailer fields after the last chunk are skipped, not taken as body."""
        wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-T: 1\r\n\r\n"
        c, extra = self.feed_split(wire, 3)
        self.assertEqual((b"".join(c.body), c.done, extra), (b"abc", 1, b""))


class FakeUpstreamTests(SynchronousTestCase):
    """The fake upstream's events and request routing."""

    def test_delta_stamp(self):
        """Each delta carries its stamp after the marker, in a text of the stated length."""
        event = delta_event(1234567)
        at = event.index(STAMP_MARKER)
        self.assertEqual(int(event[at + 2 : at + 18]), 1234567)
        text = event.split(b'"text":"')[1].split(b'"')[0]
        self.assertEqual(len(text), DELTA_TEXT_BYTES)

    def test_model_found_without_parsing(self):
        """The answer is chosen by the model named in the body, wherever it is."""
        self.assertEqual(_model_of(b'{"stream":true, "model" : "bench:paced:5:20"}'), "paced:5:20")
        self.assertEqual(_model_of(b'{"model":"claude-x"}'), "")

    def test_percentile(self):
        """Nearest-rank percentiles as the tables report them."""
        values = list(range(101))
        self.assertEqual((percentile(values, 0.5), percentile(values, 0.99)), (50, 99))
        self.assertIsNone(percentile([], 0.5))
