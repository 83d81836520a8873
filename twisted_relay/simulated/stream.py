# -*- test-case-name: tests.test_simulated -*-
"""
The SSE byte stream of the simulated upstream: the events of a message, their
bytes, and where a stream is cut.  Pure: no Twisted.
"""

from __future__ import annotations

import random
from bisect import bisect_right
from typing import Any, Iterator, Sequence

import ujson

from twisted_relay.simulated.base import declares_tool_use

__all__ = ["LINE_ENDINGS", "encode_events", "message_events", "plan_chunks"]

#: Line endings an SSE stream may use.
LINE_ENDINGS = ("\n", "\r\n", "\r")


def _to_json(value: Any) -> str:
    text = ujson.dumps(value, ensure_ascii=False, escape_forward_slashes=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate echoed from the request has no UTF-8 form.
        text = ujson.dumps(value, ensure_ascii=True, escape_forward_slashes=False)
    return text


def _pieces(text: str, rng: random.Random, leading_empty: bool) -> list[str]:
    """``text`` cut at 1 to 3 places (whole characters: deltas are JSON)."""
    count = max(0, min(len(text) - 1, rng.randint(1, 3)))
    cuts = sorted(rng.sample(range(1, len(text)), count))
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    return [""] + pieces if leading_empty else pieces


def _block_events(index: int, block: dict, rng: random.Random) -> Iterator[tuple[str, dict]]:
    kind = block["type"]
    if kind == "text":
        start: dict = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": piece} for piece in _pieces(block["text"], rng, False)]
    elif kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        # An omitted-display block (empty text) carries only its signature.
        deltas = [
            {"type": "thinking_delta", "thinking": piece}
            for piece in (_pieces(block["thinking"], rng, False) if block["thinking"] else [])
        ]
        deltas.append({"type": "signature_delta", "signature": block["signature"]})
    elif declares_tool_use(block):
        start = {"type": kind, "name": block["name"], "input": {}}
        if "id" in block:
            start = {"type": kind, "id": block["id"], "name": block["name"], "input": {}}
        deltas = [
            {"type": "input_json_delta", "partial_json": piece}
            for piece in _pieces(_to_json(block["input"]), rng, rng.random() < 0.5)
        ]
    else:
        # Server-tool results arrive whole in content_block_start.
        start, deltas = block, []
    yield "content_block_start", {"type": "content_block_start", "index": index, "content_block": start}
    if index == 0:
        yield "ping", {"type": "ping"}
    for delta in deltas:
        yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    yield "content_block_stop", {"type": "content_block_stop", "index": index}


def message_events(
    message: dict, rng: random.Random, usage: tuple[dict, dict] | None = None
) -> list[tuple[str, dict]]:
    """
    The Anthropic SSE events that stream ``message``, in order: message_start,
    per block start/deltas/stop (a ping after the first start), message_delta,
    message_stop.  Text and tool input are cut into several deltas.

    :param usage: the usage ``message_start`` and ``message_delta`` report;
        by default the answer's with one output token, then its output tokens.
    """
    if usage is None:
        usage = (dict(message["usage"], output_tokens=1), {"output_tokens": message["usage"]["output_tokens"]})
    started = dict(message, content=[], stop_reason=None, stop_sequence=None)
    started["usage"] = usage[0]
    events: list[tuple[str, dict]] = [("message_start", {"type": "message_start", "message": started})]
    for index, block in enumerate(message["content"]):
        events.extend(_block_events(index, block, rng))
    events.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                "usage": usage[1],
            },
        )
    )
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def encode_events(events: Sequence[tuple[str, dict]], line_ending: str = "\n") -> tuple[bytes, list[int]]:
    """
    Serialise SSE events.

    :return: the bytes, and the offset where each event starts.
    """
    if line_ending not in LINE_ENDINGS:
        raise ValueError("line_ending must be one of \\n, \\r\\n, \\r")
    chunks, starts, offset = [], [], 0
    for name, data in events:
        encoded = f"event: {name}{line_ending}data: {_to_json(data)}{line_ending}{line_ending}".encode("utf-8")
        starts.append(offset)
        chunks.append(encoded)
        offset += len(encoded)
    return b"".join(chunks), starts


def plan_chunks(
    data: bytes, event_starts: Sequence[int], rng: random.Random | None
) -> list[tuple[int, bytes]]:
    """
    Cut an encoded stream into the pieces to write.

    Without ``rng``, one piece per event.  With it, cuts fall at odd places:
    inside each event, across some event boundaries (a piece may end one
    event and begin the next), inside a multi-byte UTF-8 character when
    there is one, and between the two bytes of a ``\\r\\n`` when there is one.

    :return: ``(event index, bytes)`` pairs, the index being the last event
        the piece touches, so a paced writer can send it once that event is
        due.
    """
    bounds = list(event_starts[1:])
    if rng is not None:
        cuts = set(bound for bound in bounds if rng.random() < 0.5)
        ends = [*event_starts[1:], len(data)]
        for start, end in zip(event_starts, ends):
            if end - start > 1:
                cuts.update(rng.sample(range(start + 1, end), min(end - start - 1, rng.randint(1, 2))))
        inside_character = [i for i, byte in enumerate(data) if byte & 0xC0 == 0x80]
        if inside_character:
            cuts.add(rng.choice(inside_character))
        inside_crlf = [i + 1 for i in range(len(data) - 1) if data[i : i + 2] == b"\r\n"]
        if inside_crlf:
            cuts.add(rng.choice(inside_crlf))
        bounds = sorted(cuts)
    edges = [0, *bounds, len(data)]
    return [
        (bisect_right(event_starts, end - 1) - 1, data[start:end]) for start, end in zip(edges, edges[1:])
    ]
