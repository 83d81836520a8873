# -*- test-case-name: tests.test_simulated_bedrock -*-
"""
Amazon's event-stream framing, the encoding side, for the simulated Bedrock.

A message is a 12-byte prelude (total length, headers length, CRC32 of
those 8 bytes), typed headers, the payload and a CRC32 of everything before
it; all big-endian (smithy's ``amazon-eventstream`` spec, botocore's
``eventstream.py``).  The simulator writes only string headers (type 7),
which is all Bedrock sends.

- :func:`frame`: one message.
- :func:`chunk_frame`: one ``chunk`` event carrying one Anthropic event, as
  ``{"bytes": "<base64 of the event JSON>", "p": "<padding>"}``.
- :func:`exception_frame`: an ``exception`` message (``throttlingException``,
  ``modelStreamErrorException``...), as Bedrock ends a stream that fails.

Pure: no Twisted.
"""

from __future__ import annotations

import base64
import random
import struct
import zlib
from typing import Any

from twisted_relay._json import to_json

__all__ = ["PADDING_ALPHABET", "chunk_frame", "exception_frame", "frame", "padding"]

#: The characters of a chunk's ``p`` padding (Bedrock pads with a run of
#: the alphabet, upper and lower case, and digits).
PADDING_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"

_STRING = 7


def _header(name: str, value: str) -> bytes:
    raw_name, raw_value = name.encode("utf-8"), value.encode("utf-8")
    return bytes([len(raw_name)]) + raw_name + bytes([_STRING]) + struct.pack("!H", len(raw_value)) + raw_value


def frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One event-stream message with string ``headers`` and ``payload``."""
    encoded = b"".join(_header(name, value) for name, value in headers.items())
    prelude = struct.pack("!II", 16 + len(encoded) + len(payload), len(encoded))
    message = prelude + struct.pack("!I", zlib.crc32(prelude)) + encoded + payload
    return message + struct.pack("!I", zlib.crc32(message))


def padding(rng: random.Random) -> str:
    """A ``p`` value of random length, as Bedrock pads its chunks."""
    return PADDING_ALPHABET[: rng.randint(1, len(PADDING_ALPHABET))]


def chunk_frame(event: dict, pad: str) -> bytes:
    """A ``chunk`` event carrying the Anthropic ``event``."""
    encoded = base64.b64encode(to_json(event)).decode("ascii")
    payload = to_json({"bytes": encoded, "p": pad})
    return frame({":event-type": "chunk", ":content-type": "application/json", ":message-type": "event"}, payload)


def exception_frame(kind: str, fields: dict[str, Any]) -> bytes:
    """An ``exception`` message of ``kind`` (e.g. ``throttlingException``)
    whose JSON payload is ``fields`` (``message``, and for
    ``modelStreamErrorException`` ``originalStatusCode``, ``originalMessage``)."""
    headers = {":exception-type": kind, ":content-type": "application/json", ":message-type": "exception"}
    return frame(headers, to_json(fields))
