# -*- test-case-name: tests.test_openai_counting -*-
"""
``count_tokens`` for a Chat Completions upstream, which cannot count
(issue 33, item 6): an estimate of the request's input tokens that does
not undercount. Claude Code compacts its context from these counts: an
undercount lets a conversation grow past the model's window (a "prompt is
too long" 400 mid-session), an overcount compacts it early.

The estimate is taken of what would be sent: the request translated for
the dialect (:func:`~twisted_relay.openai.chat_request.to_chat`), each text
priced by :func:`text_tokens`, each image by its size
(:func:`image_tokens`), plus an allowance for each message, tool call and
tool (the chat template's own tokens); tool-call ids count as text (the
templates of Mistral and Kimi write them).

:func:`text_tokens` reads a text as a byte-pair tokenizer cuts it before
merging (the pre-tokenizer of OpenAI's ``o200k_base``: words with their
leading space or mark, numbers of up to three digits, runs of marks, of
white space) and prices each piece: a word one token for each five letters,
and one more for each pair of its letters that English seldom joins (a
random identifier, base64, hex); a run of marks one token and 0.9 for each
mark after the first; other characters by script (:data:`CYRILLIC`,
:data:`TWO_BYTE`, :data:`THREE_BYTE`, :data:`FOUR_BYTE`).

Measured with ``bench/openai_counting.py`` (docs/openai.md, "Counting")
against OpenAI's ``o200k_base`` and ``cl100k_base`` through tiktoken; the
ratio is this estimate over the larger of the two counts, for texts of up
to 4,000 characters:

- the relay's own code (60 texts), docs (60), ``git log -p`` (60) and
  JSON (40): least 1.06, medians 1.45, 1.35, 1.40, 1.39, most 1.67;
- prose in 64 files of 30 languages (Latin, Cyrillic, Greek, Hebrew,
  Arabic, Devanagari, Thai, Chinese, Japanese, Korean scripts): least 1.01,
  median 1.40, most 1.87 (Russian, which both cut in long pieces);
- random data as tool results hold it (base64, hex, UUIDs, sha256sum
  lines, lock-file hashes, printable ASCII, letters, digits, white space):
  least 1.00, most 1.20 (7.9 for 3,000 blanks in a row);
- random code points outside ASCII (no text anyone sends): 0.54, the one
  kind of input it undercounts.

Other models' tokenizers (Gemini, DeepSeek, Mistral, Llama, Kimi, GLM) have
vocabularies of 128k to 256k entries, more than cl100k's 100k, and cut
text in fewer pieces than the larger of the two counts; the bound is kept
against both for that reason. The estimate runs at about 2 MB of code a
second (one core of the machine it was measured on).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import struct
from typing import Any

from twisted_relay.openai.chat_request import to_chat
from twisted_relay.openai.context import TranslateContext

__all__ = [
    "IMAGE_MOST",
    "IMAGE_LEAST",
    "MESSAGE_ALLOWANCE",
    "TOOL_ALLOWANCE",
    "estimate_input_tokens",
    "image_tokens",
    "text_tokens",
]

#: Tokens of a chat template around one message (role, separators): four to
#: six in the templates read, twelve so that a short message is not undercounted.
MESSAGE_ALLOWANCE = 12
#: Tokens around one tool's definition or one tool call.
TOOL_ALLOWANCE = 12
#: The reply's start.
REPLY_ALLOWANCE = 4
#: An image's tokens: at least (OpenAI's 512-pixel tile, Gemini's small image) ...
IMAGE_LEAST = 300
#: ... and at most (a 1,024 by 1,024 image in 16-pixel patches, Mistral's:
#: 4,096 and a break per row). An image whose size cannot be read costs this.
IMAGE_MOST = 4200

# English letter pairs that make up 97% of those in the relay's own code and
# docs: a word of them is read as a word; each other pair costs a token.
_COMMON_PAIRS = frozenset(
    "ab ac ad ag ai ak al am an ap ar as at au aw ay ba be bl bo bu by ca ce ch ci ck cl co cr cs ct da dd de "
    "dg di do dr ds du dy ea ec ed ee ef eg ei el em en ep eq er es et ev ew ex ey fa fe ff fi fl fo fr ft fu ga "
    "ge gh gi gl gr gu ha he hi ho hr ht ia ic id ie if ig il im in io ip ir is it iv js ke ki ks la ld le lf li "
    "ll lo ls lt lu ly ma md me mi mo mp ms mu na nc nd ne nf ng ni nk nl nn no ns nt nv oa ob oc od of og oi ok "
    "ol om on oo op or os ot ou ov ow pa pe pi pl po pp pr ps pt pu py ql qu ra rd re rg ri rk rl rm rn ro rr rs "
    "rt ru rv ry sa sc se sh si so sp ss st su sw ta tc te tf th ti to tp tr ts tt tu tw ty ua ud ue ul um un up "
    "ur us ut va ve vi wa we wh wi wn wo wr ws xt ye ys yt".split())
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
#: Pairs of letters outside :data:`_COMMON_PAIRS`, found overlapping.
_RARE_PAIR = re.compile("(?=%s)" % "|".join(
    "%s[%s]" % (a, "".join(b for b in _LETTERS if a + b not in _COMMON_PAIRS)) for a in _LETTERS))
_MARK = "[^\\r\\nA-Za-z0-9\\x80-\\U0010ffff]"
#: The pieces a byte-pair tokenizer's pre-tokenizer makes (o200k's, for ASCII).
_PIECE = re.compile(
    _MARK + "?[A-Z]*[a-z]+|" + _MARK + "?[A-Z]+[a-z]*|[0-9]{1,3}| ?[^\\sA-Za-z0-9\\x80-\\U0010ffff]+[\\r\\n/]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+|[\\x80-\\u07ff]+|[\\u0800-\\uffff]+|[\\U00010000-\\U0010ffff]+")
_LEADING_MARKS = "\"'([{<.,:;!?-_=+*&^%$#@~`|\\/ \t"


#: The letters of a word priced as one token (each further run of them: one
#: more). Five, not eight: cl100k cuts the words of Italian or Finnish prose
#: of six to ten letters in two or three.
WORD_LETTERS = 5
#: A mark after the first of a run of marks (``")),``).
MARK = 0.9
#: A Cyrillic letter after the first of a run; any other two-byte character
#: (Greek, Hebrew, Arabic, accented Latin) after the first.
CYRILLIC = 0.6
TWO_BYTE = 1.0
#: A three-byte character (Chinese, Japanese, Korean, Indic, Thai); a four-byte one.
THREE_BYTE = 1.4
FOUR_BYTE = 4.0


def text_tokens(text: str) -> int:
    """An estimate, not below the count of ``o200k_base`` or ``cl100k_base`` on text, of ``text``'s tokens."""
    total = 1.0
    for piece in _PIECE.findall(text):
        last = piece[-1]
        if last < "\x80":
            if last.isalpha():
                word = piece.lstrip(_LEADING_MARKS).lower()
                total += 1 + (len(word) - 1) // WORD_LETTERS
                if len(word) > 1:
                    total += len(_RARE_PAIR.findall(word))
            elif last.isdigit():
                total += 1
            elif piece.isspace():
                total += 1 + len(piece) // 16
            else:
                total += 1 + (len(piece) - 1) * MARK
        elif last < "\u0800":
            total += 1 + (len(piece) - 1) * (CYRILLIC if "\u0400" <= last < "\u0530" else TWO_BYTE)
        elif last < "\U00010000":
            total += 0.5 + len(piece) * THREE_BYTE
        else:
            total += FOUR_BYTE * len(piece)
    return int(total)


def estimate_input_tokens(body: dict, ctx: TranslateContext) -> int:
    """
    An estimate of the input tokens of the Messages request ``body`` at the
    Chat Completions upstream of ``ctx`` (module docstring: how, and its
    measured error).

    :raises CapabilityRejected: as :func:`~twisted_relay.openai.chat_request.to_chat`
        for a request the upstream could not take.
    """
    request = to_chat(body, ctx)
    total = REPLY_ALLOWANCE
    for message in request["messages"]:
        total += MESSAGE_ALLOWANCE + _content_tokens(message.get("content"))
        if "tool_call_id" in message:
            total += text_tokens(str(message["tool_call_id"]))
        for name in ("reasoning_content", "reasoning_details"):
            if name in message:
                total += _value_tokens(message[name])
        for call in message.get("tool_calls") or ():
            function = call["function"]
            total += (TOOL_ALLOWANCE + text_tokens(str(call.get("id"))) + text_tokens(str(function.get("name")))
                      + text_tokens(function["arguments"]))
            if "extra_content" in call:
                total += _value_tokens(call["extra_content"])
    for tool in request.get("tools") or ():
        total += TOOL_ALLOWANCE + _value_tokens(tool["function"])
    if "response_format" in request:
        total += _value_tokens(request["response_format"])
    return total


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return text_tokens(content)
    total = 0
    for part in content if isinstance(content, list) else ():
        if part.get("type") == "image_url":
            total += image_tokens(part["image_url"]["url"])
        else:
            total += text_tokens(part.get("text") or "")
    return total


def _value_tokens(value: Any) -> int:
    """A JSON value's tokens: its compact JSON as text (opaque signatures priced as any text)."""
    return text_tokens(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def image_tokens(url: str) -> int:
    """
    An image's tokens, from its size when it is a ``data:`` URL whose
    header can be read (PNG, GIF, JPEG, WebP): one for each 16 by 16 pixels
    and one for each row of them (Mistral's patches, the most of the
    upstreams'), at least :data:`IMAGE_LEAST`, at most :data:`IMAGE_MOST`
    (the upstreams shrink larger images); :data:`IMAGE_MOST` otherwise.
    """
    size = image_size(url)
    if size is None:
        return IMAGE_MOST
    width, height = size
    patches = math.ceil(width / 16) * math.ceil(height / 16) + math.ceil(height / 16)
    return max(IMAGE_LEAST, min(IMAGE_MOST, patches))


def image_size(url: str) -> tuple[int, int] | None:
    """The width and height of a base64 ``data:`` URL's image, when its header can be read."""
    if not url.startswith("data:"):
        return None
    _, comma, data = url.partition(",")
    if not comma:
        return None
    try:
        head = base64.b64decode(data[:65536 - 65536 % 4] if len(data) > 65536 else data)
    except (binascii.Error, ValueError):
        return None
    return _size_of(head)


def _size_of(head: bytes) -> tuple[int, int] | None:
    if head[:8] == b"\x89PNG\r\n\x1a\n" and len(head) >= 24:
        return struct.unpack(">II", head[16:24])
    if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        return struct.unpack("<HH", head[6:10])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP" and len(head) >= 30:
        chunk = head[12:16]
        if chunk == b"VP8X":
            return 1 + int.from_bytes(head[24:27], "little"), 1 + int.from_bytes(head[27:30], "little")
        if chunk == b"VP8 ":
            width, height = struct.unpack("<HH", head[26:30])
            return width & 0x3FFF, height & 0x3FFF
        if chunk == b"VP8L":
            bits = int.from_bytes(head[21:25], "little")
            return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
        return None
    if head[:2] == b"\xff\xd8":
        return _jpeg_size(head)
    return None


def _jpeg_size(head: bytes) -> tuple[int, int] | None:
    at = 2
    while at + 9 < len(head):
        if head[at] != 0xFF:
            return None
        marker = head[at + 1]
        if marker == 0xFF:
            at += 1
            continue
        length = struct.unpack(">H", head[at + 2:at + 4])[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width = struct.unpack(">HH", head[at + 5:at + 9])
            return width, height
        at += 2 + length
    return None
