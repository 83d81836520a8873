# -*- test-case-name: tests.test_chunked -*-
"""
A chunked transfer decoder that hands on everything one read completes in
one callback.

Twisted's own decoder calls its data callback once per HTTP chunk. An
upstream that flushes every SSE event as a chunk of its own (most do) then
turns one 64 KiB read into hundreds of callbacks, and the relay into
hundreds of writes. This decoder parses the same grammar (RFC 9112 7.1) just
as strictly, but joins the data of every chunk a read holds into a single
callback, so the SSE gate sees a read, not an event, at a time.
"""

from __future__ import annotations

from typing import Callable

from twisted.web.http import maxChunkSizeLineLength

from twisted_relay._twisted import DataLoss, MalformedChunkedData

__all__ = ["CoalescingChunkedDecoder"]

_HEX_DIGITS = b"0123456789abcdefABCDEF"
# Characters allowed in a chunk extension (RFC 9112 7.1.1), as Twisted's
# decoder allows them: copied, not imported (tests.test_twisted compares them).
CHUNK_EXTENSION_CHARS = (
    b"\t !\"#$%&'()*+,-./0123456789:;<=>?@"
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZ[]^_`"
    b"abcdefghijklmnopqrstuvwxyz{|}~" + bytes(range(0x80, 0x100))
)
_MAX_TRAILER_BYTES = 2**16
# Short size lines already read and checked, and their sizes: a stream's
# events come in few distinct lengths. Shared by every decoder, and bounded.
_SIZES: dict[bytes, int] = {}
_MAX_SIZES_KEPT = 4096
# Bytes from which a read's whole chunks are first taken in bulk (_whole_chunks).
_BULK_MIN = 2048

_SIZE, _DATA, _CRLF, _TRAILER, _FINISHED = "CHUNK_LENGTH", "BODY", "CRLF", "TRAILER", "FINISHED"


class CoalescingChunkedDecoder:
    """
    Decode a ``chunked`` body; a drop-in for Twisted's ``_ChunkedTransferDecoder``.

    :param dataCallback: called with the body bytes that one
        :meth:`dataReceived` completes, once per call at most.
    :param finishCallback: called once, after the last chunk and the
        trailers, with the bytes that followed the body.

    Malformed input raises Twisted's own error for it; a body that ends
    before its last chunk makes :meth:`noMoreData` raise Twisted's data-loss
    error, as Twisted's decoder does (both by way of ``twisted_relay._twisted``).
    """

    def __init__(
        self,
        dataCallback: Callable[[bytes], None],
        finishCallback: Callable[[bytes], None],
    ) -> None:
        self.dataCallback = dataCallback
        self.finishCallback = finishCallback
        self.state = _SIZE
        self._left = 0  # bytes of the current chunk still to come
        self._held = b""  # an incomplete size line, CRLF or trailer line
        self._trailer_bytes = 0

    def dataReceived(self, data: bytes) -> None:
        """Decode received bytes; pass on their body data in one call."""
        if self.state is _FINISHED:
            raise RuntimeError("CoalescingChunkedDecoder.dataReceived called after the last chunk")
        if self._held:
            data = self._held + data
            self._held = b""
        out: list = []
        try:
            rest = self._decode(data, out)
        finally:
            # Data before a malformation is passed on before the error, as in Twisted.
            self._deliver(out)
        if rest is not None:
            # The callbacks are bound to the parser and the response, which
            # hold this decoder: dropped, the parser, its response and this
            # decoder are freed when the connection lets go of them, not at
            # the garbage collector's next full collection.
            finish = self.finishCallback
            self.dataCallback = self.finishCallback = None
            finish(rest)

    def _decode(self, data: bytes, out: list) -> bytes | None:
        """
        Append the body data of ``data`` to ``out``; return the bytes after
        the body once it is finished, else ``None``.

        One fast path: where a size line starts, the read's whole chunks are
        first taken in bulk (:func:`_whole_chunks`), once per read. Whatever
        it leaves (a size not seen before, data holding a CRLF, the end of
        the body, an incomplete chunk, damage) goes through the strict loop
        below, a state at a time.
        """
        view = None
        pos = 0
        n = len(data)
        state = self.state
        bulk = True
        while pos < n:
            if state is _SIZE:
                if bulk and n - pos >= _BULK_MIN:
                    bulk = False
                    taken, body = _whole_chunks(data, pos)
                    if taken:
                        out.append(body)
                        pos += taken
                        continue
                eol = data.find(b"\r\n", pos, pos + maxChunkSizeLineLength + 2)
                if eol < 0 or eol - pos >= maxChunkSizeLineLength:
                    if eol >= 0 or n - pos > maxChunkSizeLineLength:
                        raise MalformedChunkedData(
                            "Chunk size line exceeds maximum of %d bytes." % (maxChunkSizeLineLength,)
                        )
                    self._held = data[pos:]
                    break
                line = data[pos:eol]
                size = _SIZES.get(line)
                if size is None:
                    size = _chunk_size(line)
                    if len(line) <= 8:
                        if len(_SIZES) >= _MAX_SIZES_KEPT:
                            # Sizes in use change (an upstream that re-chunks): start over.
                            _SIZES.clear()
                        _SIZES[line] = size
                pos = eol + 2
                if not size:
                    state = _TRAILER
                    continue
                end = pos + size
                if end + 2 > n:
                    self._left = size
                    state = _DATA
                    continue
                # The whole chunk and its CRLF are here: one step. (Its data
                # is passed on even when the CRLF is wrong, as in Twisted.)
                if view is None:
                    view = memoryview(data)
                out.append(view[pos:end])
                if data[end] != 13 or data[end + 1] != 10:
                    raise MalformedChunkedData("Chunk did not end with CRLF")
                pos = end + 2
            elif state is _DATA:
                end = pos + self._left
                if end > n:
                    end = n
                if pos == 0 and end == n:
                    out.append(data)
                else:
                    if view is None:
                        view = memoryview(data)
                    out.append(view[pos:end])
                self._left -= end - pos
                pos = end
                if self._left:
                    break
                state = _CRLF
            elif state is _CRLF:
                if pos + 1 == n:
                    # Judged once both bytes are here, as Twisted does.
                    self._held = data[pos:]
                    break
                if data[pos] != 13 or data[pos + 1] != 10:
                    raise MalformedChunkedData("Chunk did not end with CRLF")
                pos += 2
                state = _SIZE
            else:  # _TRAILER
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    # What the trailers will hold at least, their CRLF included.
                    least = self._trailer_bytes + (n - pos) + (1 if data.endswith(b"\r") else 2)
                    if least > _MAX_TRAILER_BYTES:
                        raise MalformedChunkedData("Trailer headers data is too long.")
                    self._held = data[pos:]
                    break
                if eol == pos:
                    self.state = _FINISHED
                    return data[eol + 2 :]
                # A trailer field: read and dropped, as Twisted's client does.
                self._trailer_bytes += eol + 2 - pos
                if self._trailer_bytes > _MAX_TRAILER_BYTES:
                    raise MalformedChunkedData("Trailer headers data is too long.")
                pos = eol + 2
        self.state = state
        return None

    def _deliver(self, out: list) -> None:
        if not out:
            return
        if len(out) == 1:
            chunk = out[0]
            self.dataCallback(chunk if type(chunk) is bytes else chunk.tobytes())
        else:
            self.dataCallback(b"".join(out))

    def noMoreData(self) -> None:
        """Raise ``DataLoss`` unless the last chunk has been read."""
        # The connection is gone: the callbacks (bound to the parser, which
        # holds this decoder) are dropped, as after the last chunk, so the
        # parser is freed without the garbage collector.
        self.dataCallback = self.finishCallback = None
        if self.state is not _FINISHED:
            raise DataLoss(
                "Chunked decoder in %r state, still expecting more data to get to "
                "'FINISHED' state." % (self.state,)
            )


def _whole_chunks(data: bytes, pos: int) -> tuple[int, bytes]:
    """
    The whole chunks from ``pos`` (a size line) in bulk: how many bytes they
    take and their data, or ``(0, b"")`` when none can be taken so.

    Splitting at every CRLF gives size, data, size, data ...; as long as each
    size is one the strict parser has already read (``_SIZES``) and each data
    part is exactly that long, the chunk-by-chunk parse would find the very
    same chunks, and all the checks ran in C. The chunks up to the first pair
    that does not agree (data holding a CRLF, a new size, the last chunk,
    damage, the read's incomplete end) are taken; the rest is left to the
    strict loop.
    """
    parts = (data[pos:] if pos else data).split(b"\r\n")
    # The last part is never followed by a CRLF: a pair ending there is not whole.
    pairs = (len(parts) - 1) // 2
    if not pairs:
        return 0, b""
    sizes = list(map(_SIZES.get, parts[0 : 2 * pairs : 2]))
    lengths = list(map(len, parts[1 : 2 * pairs : 2]))
    if sizes != lengths or 0 in sizes:
        # Take the pairs before the first that disagrees, or before the
        # last chunk (size 0: its "data" is the empty line that ends a body
        # without trailers), which the loop reads with its trailers.
        agree = 0
        for size, length in zip(sizes, lengths):
            if size != length or not size:
                break
            agree += 1
        if not agree:
            return 0, b""
        pairs = agree
        del lengths[pairs:]
    taken = sum(map(len, parts[0 : 2 * pairs : 2])) + sum(lengths) + 4 * pairs
    return taken, b"".join(parts[1 : 2 * pairs : 2])


def _chunk_size(line: bytes) -> int:
    """The size on a chunk size line: strict hex digits, extensions checked and ignored."""
    size, semicolon, extension = line.partition(b";")
    if not size or size.translate(None, _HEX_DIGITS):
        raise MalformedChunkedData("Chunk-size must be an integer.")
    if semicolon and extension.translate(None, CHUNK_EXTENSION_CHARS):
        raise MalformedChunkedData("Invalid characters in chunk extensions: %r." % (extension,))
    return int(size, 16)
