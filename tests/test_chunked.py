"""
Tests for the coalescing chunked decoder: it decodes what Twisted's own
decoder decodes, refuses what it refuses, and calls back once per read.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase
from twisted_relay._twisted import DataLoss, MalformedChunkedData, TwistedChunkedDecoder

from twisted_relay.chunked import CoalescingChunkedDecoder

_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def _run(decoder_class, reads):
    """
    Feed ``reads`` to a decoder; return (calls, finished rest or None,
    error class or None, whether noMoreData passes).
    """
    calls = []
    finished = []
    decoder = decoder_class(calls.append, finished.append)
    error = None
    for read in reads:
        if finished:
            break
        try:
            decoder.dataReceived(read)
        except (MalformedChunkedData, RuntimeError) as e:
            error = type(e)
            break
    try:
        decoder.noMoreData()
        complete = True
    except DataLoss:
        complete = False
    return calls, (finished[0] if finished else None), error, complete


def _encode(pieces, trailers=(), extension=b""):
    wire = b"".join(b"%x%s\r\n%s\r\n" % (len(p), extension, p) for p in pieces if p)
    return wire + b"0\r\n" + b"".join(t + b"\r\n" for t in trailers) + b"\r\n"


def _split(wire: bytes, cuts) -> list[bytes]:
    points = sorted({c % (len(wire) + 1) for c in cuts})
    reads, last = [], 0
    for p in points:
        reads.append(wire[last:p])
        last = p
    reads.append(wire[last:])
    return [r for r in reads if r]


class NamedCases(SynchronousTestCase):
    """Hand-picked bodies, including every error Twisted's decoder raises."""

    def test_one_callback_per_read(self):
        """A read holding many chunks reaches the callback as one string."""
        wire = _encode([b"event: a\n\n", b"event: b\n\n", b"event: c\n\n"])
        calls, rest, error, complete = _run(CoalescingChunkedDecoder, [wire + b"NEXT"])
        self.assertEqual(calls, [b"event: a\n\nevent: b\n\nevent: c\n\n"])
        self.assertEqual(rest, b"NEXT")
        self.assertIsNone(error)
        self.assertTrue(complete)

    def test_chunk_across_reads(self):
        """A chunk split over reads is passed on as it arrives, byte for byte."""
        wire = _encode([b"0123456789"])
        calls, rest, _, complete = _run(CoalescingChunkedDecoder, [wire[:6], wire[6:9], wire[9:]])
        self.assertEqual(b"".join(calls), b"0123456789")
        self.assertEqual(calls, [b"012", b"345", b"6789"])
        self.assertEqual(rest, b"")
        self.assertTrue(complete)

    def test_extensions_and_trailers(self):
        """Chunk extensions and trailer fields are read and dropped."""
        wire = _encode([b"abc", b"de"], trailers=[b"x-checksum: 1"], extension=b";name=value")
        calls, rest, error, complete = _run(CoalescingChunkedDecoder, [wire])
        self.assertEqual((b"".join(calls), rest, error, complete), (b"abcde", b"", None, True))

    def test_truncated_is_data_loss(self):
        """A body cut anywhere before its last chunk is not complete."""
        wire = _encode([b"abc", b"defgh"])
        for cut in range(len(wire) - 1):
            calls, rest, error, complete = _run(CoalescingChunkedDecoder, [wire[:cut]])
            self.assertIsNone(rest)
            self.assertFalse(complete, cut)

    def test_malformed(self):
        """Each malformation Twisted refuses is refused."""
        cases = [
            b"0x3\r\nabc\r\n0\r\n\r\n",  # a prefix
            b"+3\r\nabc\r\n0\r\n\r\n",  # a sign
            b" 3\r\nabc\r\n0\r\n\r\n",  # white space
            b"\r\nabc\r\n0\r\n\r\n",  # no size
            b"3\r\nabcXY0\r\n\r\n",  # no CRLF after the data
            b"3\r\nabc\rX",  # half a CRLF
            b"3;\x00\r\nabc\r\n0\r\n\r\n",  # a control character in an extension
            b"1" * 1100,  # an endless size line
            b"0\r\n" + b"x: " + b"y" * 70000,  # endless trailers
        ]
        for wire in cases:
            for decoder_class in (CoalescingChunkedDecoder, TwistedChunkedDecoder):
                _, rest, error, _ = _run(decoder_class, [wire])
                self.assertIs(error, MalformedChunkedData, (decoder_class, wire))
                self.assertIsNone(rest)

    def test_trailer_limit_as_twisted(self):
        """Trailers of exactly the limit pass, one byte more fails, wherever the read is cut."""
        for extra, error in ((0, None), (1, MalformedChunkedData)):
            line = b"x: " + b"y" * (2**16 - 2 - 3 + extra)
            wire = b"0\r\n" + line + b"\r\n\r\n"
            cut = 3 + len(line) + 1  # just after the trailer's CR
            for decoder_class in (CoalescingChunkedDecoder, TwistedChunkedDecoder):
                _, rest, got, complete = _run(decoder_class, [wire[:cut], wire[cut:]])
                self.assertIs(got, error, (decoder_class, extra))
                self.assertEqual(complete, error is None)

    def test_bulk_read(self):
        """
        A large read of many whole chunks (decoded in bulk) gives the same
        data and end as Twisted, also when a chunk's data holds a CRLF, a
        size not seen before, or damage.
        """
        import twisted_relay.chunked as chunked

        # A cache of sizes of this test's own, whatever ran before it.
        self.patch(chunked, "_SIZES", {})
        events = [b"event: content_block_delta\ndata: {\"n\": %d}\n\n" % (i,) for i in range(300)]
        variants = {
            "plain": events,
            "crlf in data": events[:100] + [b"data: a\r\nb\r\n\r\n"] + events[100:],
            "new size": events[:150] + [b"x" * 3001] + events[150:],
        }
        for label, pieces in variants.items():
            wire = _encode(pieces) + b"NEXT"
            for reads in ([wire], [wire[:5000], wire[5000:]], [wire[:7], wire[7:]]):
                ours = _run(CoalescingChunkedDecoder, reads)
                theirs = _run(TwistedChunkedDecoder, reads)
                self.assertEqual(b"".join(ours[0]), b"".join(pieces), label)
                self.assertEqual(ours[1:], theirs[1:], label)
                self.assertEqual(ours[1], b"NEXT", label)
                self.assertLessEqual(len(ours[0]), len(reads), label)
        # The sizes are known now: the bulk reading takes all the whole chunks at once.
        from twisted_relay.chunked import _whole_chunks

        wire = _encode(events)
        taken, body = _whole_chunks(wire, 0)
        self.assertEqual((taken, body), (len(wire) - 5, b"".join(events)))
        damaged = bytearray(_encode(events))
        at = damaged.index(b"\r\n", 2000)
        damaged[at] = ord("X")
        ours = _run(CoalescingChunkedDecoder, [bytes(damaged)])
        theirs = _run(TwistedChunkedDecoder, [bytes(damaged)])
        self.assertIs(ours[2], MalformedChunkedData)
        self.assertEqual(ours[1:], theirs[1:])
        self.assertEqual(b"".join(ours[0]), b"".join(theirs[0]))

    def test_bulk_takes_the_agreeing_chunks(self):
        """
        The bulk reading takes the whole chunks before the first it cannot
        vouch for (a new size, data holding a CRLF, the last chunk), and
        leaves that one and the rest to the strict loop.
        """
        import twisted_relay.chunked as chunked
        from twisted_relay.chunked import _whole_chunks

        self.patch(chunked, "_SIZES", {b"5": 5, b"0": 0})
        known = _encode([b"abcde", b"fghij"])[:-5]  # two chunks, no last chunk
        for stop, label in ((b"7\r\nabcdefg\r\n", "new size"), (b"5\r\na\r\nbc\r\n", "CRLF in data"),
                            (b"0\r\n\r\n", "last chunk"), (b"5\r\nab", "incomplete")):
            taken, body = _whole_chunks(b"xx" + known + stop + known, 2)
            self.assertEqual((taken, body), (len(known), b"abcdefghij"), label)
        self.assertEqual(_whole_chunks(b"7\r\nabcdefg\r\n" + known, 0), (0, b""))

    def test_size_cache_starts_over_when_full(self):
        """When the cache of sizes is full it starts over: new sizes are still cached."""
        import twisted_relay.chunked as chunked

        self.patch(chunked, "_SIZES", {})
        self.patch(chunked, "_MAX_SIZES_KEPT", 3)
        for size in (1, 2, 3, 4, 5):
            _run(CoalescingChunkedDecoder, [_encode([b"x" * size])])
        self.assertIn(b"5", chunked._SIZES)
        self.assertLessEqual(len(chunked._SIZES), 3)

    def test_half_a_crlf_waits(self):
        """The first byte of a chunk's CRLF alone is judged only with the second, as in Twisted."""
        for decoder_class in (CoalescingChunkedDecoder, TwistedChunkedDecoder):
            self.assertEqual(_run(decoder_class, [b"1\r\n\r\n"])[1:], (None, None, False), decoder_class)

    def test_data_after_finish(self):
        """Bytes given after the body finished are a caller's bug, as in Twisted."""
        decoder = CoalescingChunkedDecoder(lambda data: None, lambda rest: None)
        decoder.dataReceived(b"0\r\n\r\n")
        self.assertRaises(RuntimeError, decoder.dataReceived, b"1")


_body_pieces = st.lists(st.binary(min_size=0, max_size=300), max_size=12)
_cuts = st.lists(st.integers(min_value=0, max_value=10_000), max_size=12)


class AgreesWithTwisted(SynchronousTestCase):
    """Generated bodies, split anywhere: the same result as Twisted's decoder."""

    @settings(max_examples=400, **_SETTINGS)
    @given(
        pieces=_body_pieces,
        trailers=st.lists(st.sampled_from([b"a: b", b"x-y: 1 2", b"k:"]), max_size=3),
        extension=st.sampled_from([b"", b";a=b", b';q="x y"']),
        tail=st.binary(max_size=20),
        cuts=_cuts,
    )
    def test_valid_bodies(self, pieces, trailers, extension, tail, cuts):
        reads = _split(_encode(pieces, trailers, extension) + tail, cuts)
        ours = _run(CoalescingChunkedDecoder, reads)
        theirs = _run(TwistedChunkedDecoder, reads)
        self.assertEqual(b"".join(ours[0]), b"".join(pieces))
        self.assertEqual(b"".join(ours[0]), b"".join(theirs[0]))
        self.assertEqual(ours[1:], theirs[1:])
        # The bytes after the body that came in the read that finished it.
        self.assertTrue(tail.startswith(ours[1]))
        # Never more callbacks than reads.
        self.assertLessEqual(len(ours[0]), len(reads))

    @settings(max_examples=200, **_SETTINGS)
    @given(
        sizes=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=4),
        picks=st.lists(st.integers(min_value=0, max_value=3), min_size=60, max_size=200),
        crlf_at=st.lists(st.integers(min_value=0, max_value=199), max_size=3),
        cuts=_cuts,
    )
    def test_bulk_reads(self, sizes, picks, crlf_at, cuts):
        """
        Reads of 2 KiB and more of chunks whose sizes the decoder has seen
        (the bulk reading's case), some holding a CRLF in their data: the
        same result as Twisted's decoder.
        """
        pieces = [b"e" * sizes[p % len(sizes)] for p in picks]
        for i in crlf_at:
            if i < len(pieces) and len(pieces[i]) >= 2:
                pieces[i] = b"\r\n" + pieces[i][2:]
        wire = _encode(pieces) + b"NEXT"
        _run(CoalescingChunkedDecoder, [_encode(pieces[:8])])  # the sizes are seen
        reads = _split(wire, [c * 4 for c in cuts])
        ours = _run(CoalescingChunkedDecoder, reads)
        theirs = _run(TwistedChunkedDecoder, reads)
        self.assertEqual(b"".join(ours[0]), b"".join(pieces))
        self.assertEqual(ours[1:], theirs[1:])
        self.assertLessEqual(len(ours[0]), len(reads))

    @settings(max_examples=600, **_SETTINGS)
    @given(
        pieces=_body_pieces,
        position=st.integers(min_value=0, max_value=5000),
        junk=st.binary(min_size=1, max_size=4),
        cuts=_cuts,
    )
    def test_damaged_bodies(self, pieces, position, junk, cuts):
        """A body with bytes replaced anywhere: the same data, end and error as Twisted."""
        wire = bytearray(_encode(pieces))
        at = position % len(wire)
        wire[at : at + len(junk)] = junk
        reads = _split(bytes(wire), cuts)
        ours = _run(CoalescingChunkedDecoder, reads)
        theirs = _run(TwistedChunkedDecoder, reads)
        self.assertEqual(ours[1:], theirs[1:])
        self.assertEqual(b"".join(ours[0]), b"".join(theirs[0]))
