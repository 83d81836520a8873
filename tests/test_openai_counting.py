"""
The input-token estimate for Chat Completions upstreams
(twisted_relay.openai.counting): never below OpenAI's tokenizers' counts
on the recorded sample, not far above them, images priced by their size.

tests/fixtures/openai-counting/sample.json holds texts with their counts by
``o200k_base`` and ``cl100k_base``, as bench/openai_counting.py wrote them
(tiktoken, with the ranks checked against OpenAI's files).
"""

from __future__ import annotations

import base64
import json
import os
import statistics
import struct

from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.openai.capabilities import CapabilityRejected
from twisted_relay.openai.context import TranslateContext
from twisted_relay.openai.counting import (
    IMAGE_LEAST,
    IMAGE_MOST,
    estimate_input_tokens,
    image_size,
    image_tokens,
    text_tokens,
)
from twisted_relay.openai.envelope import account_of, seal
from twisted_relay.simulated.model import count_tokens as simulated_count

SAMPLE = os.path.join(os.path.dirname(__file__), "fixtures", "openai-counting", "sample.json")
ACCOUNT = account_of("sk-count")


def sample() -> list[dict]:
    with open(SAMPLE, encoding="utf-8") as f:
        return json.load(f)


def counted(entry: dict) -> int:
    return max(entry["o200k_base"], entry["cl100k_base"])


def data_url(media_type: str, data: bytes) -> str:
    return "data:%s;base64,%s" % (media_type, base64.b64encode(data).decode("ascii"))


def png(width: int, height: int, padding: int = 0) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I4sII", 13, b"IHDR", width, height) + b"\x08\x06\0\0\0" + b"\0" * padding


def jpeg(width: int, height: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0"
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + b"\0" * 9
    return b"\xff\xd8" + app0 + sof + b"\xff\xd9"


class TextTokensTests(SynchronousTestCase):
    """The text estimate against the recorded counts."""

    def test_never_below_either_tokenizer(self):
        entries = sample()
        self.assertGreater(len(entries), 50)
        for entry in entries:
            self.assertGreaterEqual(text_tokens(entry["text"]), counted(entry), entry["kind"])

    def test_not_far_above(self):
        ratios = [text_tokens(e["text"]) / counted(e) for e in sample()
                  if e["kind"] in ("code", "docs", "git log -p", "json")]
        self.assertGreater(len(ratios), 30)
        self.assertLess(statistics.median(ratios), 1.5)
        self.assertLess(max(ratios), 1.8)

    def test_every_kind_is_sampled(self):
        kinds = {entry["kind"].split()[0] for entry in sample()}
        self.assertTrue({"code", "docs", "json", "prose", "base64", "hex", "printable"} <= kinds, kinds)
        languages = {entry["kind"] for entry in sample() if entry["kind"].startswith("prose ")}
        self.assertGreaterEqual(len(languages), 20)

    def test_small_texts(self):
        self.assertEqual(text_tokens(""), 1)
        self.assertGreaterEqual(text_tokens("hi"), 1)
        self.assertGreater(text_tokens("a" * 1000), text_tokens("a" * 100))


class ImageTokensTests(SynchronousTestCase):
    """An image costs what its size says, never what its bytes say."""

    def test_sizes_read(self):
        self.assertEqual(image_size(data_url("image/png", png(640, 480))), (640, 480))
        self.assertEqual(image_size(data_url("image/jpeg", jpeg(1024, 768))), (1024, 768))
        self.assertEqual(image_size(data_url("image/gif", b"GIF89a" + struct.pack("<HH", 33, 44) + b"\0" * 8)), (33, 44))
        webp = b"RIFF\0\0\0\0WEBPVP8X" + b"\0" * 8 + (99).to_bytes(3, "little") + (49).to_bytes(3, "little")
        self.assertEqual(image_size(data_url("image/webp", webp)), (100, 50))
        self.assertIsNone(image_size("https://example.com/a.png"))
        self.assertIsNone(image_size("data:image/png;base64,%%%"))

    def test_tokens_of_sizes(self):
        self.assertEqual(image_tokens(data_url("image/png", png(1, 1))), IMAGE_LEAST)
        self.assertEqual(image_tokens(data_url("image/png", png(512, 512))), 32 * 32 + 32)
        self.assertEqual(image_tokens(data_url("image/png", png(3000, 2000))), IMAGE_MOST)
        self.assertEqual(image_tokens("https://example.com/a.png"), IMAGE_MOST)

    def test_bytes_do_not_count(self):
        # A megabyte of base64 priced as text would fill a context window by itself.
        big = data_url("image/png", png(800, 600, padding=1_000_000))
        self.assertEqual(image_tokens(big), 50 * 38 + 38)


def session(turns: int) -> dict:
    """A Claude Code session of the sample's texts: system, tools, a tool loop."""
    entries = sample()
    code = [e for e in entries if e["kind"] == "code"]
    docs = [e for e in entries if e["kind"] == "docs"]
    messages = [{"role": "user", "content": [{"type": "text", "text": docs[0]["text"]},
                                             {"type": "text", "text": "Fix the bug."}]}]
    for turn in range(turns):
        call_id = "toolu_01%022d" % turn
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": "Reading file %d." % turn},
            {"type": "tool_use", "id": call_id, "name": "Read", "input": {"file_path": "src/mod_%d.py" % turn}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call_id, "content": code[turn % len(code)]["text"]}]})
    return {
        "model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cch=0a1b2;"},
                   {"type": "text", "text": docs[1]["text"], "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "Read", "description": docs[2]["text"],
                   "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                                    "required": ["file_path"]}}],
        "messages": messages,
    }


class RequestEstimateTests(SynchronousTestCase):
    """A whole request's estimate."""

    def ctx(self, dialect: str) -> TranslateContext:
        return TranslateContext(dialect, ACCOUNT, "model-x", dialect=dialect)

    def test_not_below_its_texts(self):
        entries = sample()
        code = [e for e in entries if e["kind"] == "code"]
        docs = [e for e in entries if e["kind"] == "docs"]
        body = session(30)
        texts = counted(docs[0]) + counted(docs[1]) + counted(docs[2]) + sum(counted(code[t % len(code)])
                                                                           for t in range(30))
        for dialect in ("deepseek", "gemini", "mistral", "openai"):
            estimate = estimate_input_tokens(body, self.ctx(dialect))
            self.assertGreaterEqual(estimate, texts, dialect)
            self.assertLess(estimate, 2 * texts, dialect)

    def test_not_below_the_simulated_upstreams_count(self):
        # The fake model counts a quarter of the body's JSON characters.
        for turns in (0, 1, 5, 40):
            body = session(turns)
            self.assertGreaterEqual(estimate_input_tokens(body, self.ctx("deepseek")), simulated_count(body), turns)
        short = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
        self.assertGreaterEqual(estimate_input_tokens(short, self.ctx("groq")), simulated_count(short))

    def test_reasoning_sent_back_counts(self):
        body = session(1)
        reasoning = sample()[0]["text"]
        body["messages"][1]["content"].insert(0, {"type": "thinking", "thinking": reasoning, "signature": seal(
            "deepseek", ACCOUNT, {"kind": "chat", "reasoning_content": reasoning})})
        with_reasoning = estimate_input_tokens(body, self.ctx("deepseek"))
        self.assertGreaterEqual(with_reasoning - estimate_input_tokens(session(1), self.ctx("deepseek")),
                                counted(sample()[0]))
        # Groq gets no reasoning back: none is counted.
        body_groq = session(1)
        self.assertEqual(estimate_input_tokens(body, self.ctx("groq")), estimate_input_tokens(body_groq, self.ctx("groq")))

    def test_images_by_size(self):
        body = session(0)
        body["messages"][0]["content"].append({"type": "image", "source": {
            "type": "base64", "media_type": "image/png",
            "data": base64.b64encode(png(800, 600, padding=500_000)).decode("ascii")}})
        grown = estimate_input_tokens(body, self.ctx("gemini")) - estimate_input_tokens(session(0), self.ctx("gemini"))
        self.assertEqual(grown, 50 * 38 + 38)

    def test_what_cannot_be_sent_cannot_be_counted(self):
        body = session(0)
        body["messages"][0]["content"].append({"type": "document", "source": {
            "type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}})
        error = self.assertRaises(CapabilityRejected, estimate_input_tokens, body, self.ctx("deepseek"))
        self.assertEqual(error.capability, "document_block")
