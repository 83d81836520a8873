# -*- test-case-name: tests.test_simulated_openai_chat -*-
"""
The reasoning the simulated Chat Completions upstream emits, its check that
each turn sent its own back, and the tally of those checks.  Pure: no Twisted.

An answer's reasoning is a function of the simulator's secret, the answer's
tool calls (ids, names, arguments as values: a client may re-serialise them)
and its text, and for a signature (Gemini, OpenRouter) the account of the
key.  So it is checked without state: the reasoning an
assistant message carries back is recomputed from that message.  A message
whose reasoning is another turn's, another account's, edited or made up is
``foreign``; one without is ``missing``; Gemini's documented
``skip_thought_signature_validator`` is ``skipped``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ujson

from twisted_relay.simulated.base import canonical
from twisted_relay.simulated.openai_chat_dialects import (
    GEMINI_CORRUPTED,
    GEMINI_MISSING,
    SKIP_SIGNATURE,
    ChatRefusal,
    Dialect,
    refusal,
    thinking_on,
)

__all__ = [
    "DEEPSEEK_MISSING",
    "DEFAULT_CHAT_SECRET",
    "DETAILS_FORMAT",
    "ConversationReasoning",
    "Reasoner",
    "Reasoning",
    "ReasoningProblem",
    "ReasoningTally",
    "check_reasoning",
    "chat_conversation_key",
]

#: The secret reasoning is derived from unless the simulator is given one:
#: every instance, restarted or not, accepts the others'.
DEFAULT_CHAT_SECRET = "twisted-relay simulated chat completions"
#: DeepSeek's words for an assistant tool-call message without its reasoning.
DEEPSEEK_MISSING = "The `reasoning_content` in the thinking mode must be passed back to the API."
#: The ``format`` of OpenRouter's reasoning details for a Gemini model.
DETAILS_FORMAT = "google-gemini-v1"

# Non-ASCII on purpose: streams cut reasoning through multi-byte characters.
_THOUGHTS = (
    "Je pèse l'étape suivante",
    "Checking what the tools said — carefully",
    "次の手順を考えています",
    "Prüfe die Ergebnisse …",
    "Weighing the next call 🤔",
)


class Reasoning(NamedTuple):
    """
    The reasoning of one answer.

    :ivar digest: hex; names the turn in the tally.
    :ivar text: the visible reasoning (``""`` where the dialect shows none).
    :ivar signature: Gemini's thought signature, OpenRouter's encrypted data.
    :ivar tokens: the reasoning tokens it costs.
    """

    digest: str
    text: str
    signature: str
    tokens: int

    def details(self, first_call_id: str | None) -> list[dict]:
        """OpenRouter's ``reasoning_details``: the text, and on a tool turn the
        encrypted entry keyed by the first call's id."""
        entries = [{"type": "reasoning.text", "text": self.text, "format": DETAILS_FORMAT, "index": 0}]
        if first_call_id is not None:
            entries.append({"type": "reasoning.encrypted", "data": self.signature, "id": first_call_id,
                            "format": DETAILS_FORMAT, "index": 1})
        return entries


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return ujson.loads(value)
        except ValueError:
            return value
    return value


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
    return content if isinstance(content, str) else ""


def _turn(tool_calls: Any, content: Any) -> list:
    """What names a turn: its tool calls (names, arguments as values) and
    its text (a string, or text parts: the same). Not the calls' ids: a
    gateway may rename them (a repeat made unique, an id another backend
    cannot take), and the vendors' checks bind reasoning to what the model
    said, not to the ids it was given."""
    calls = [call for call in tool_calls if isinstance(call, dict)] if isinstance(tool_calls, list) else []
    return [[[(call.get("function") or {}).get("name"),
              _arguments((call.get("function") or {}).get("arguments"))] for call in calls], _text(content)]


class Reasoner:
    """Makes and recognises the reasoning of answers, under ``secret``."""

    def __init__(self, secret: str = DEFAULT_CHAT_SECRET):
        self._secret = secret.encode("utf-8")

    def of(self, dialect: Dialect, account: str, tool_calls: Any, content: Any) -> Reasoning:
        """The reasoning of an answer with these tool calls (as sent) or this text."""
        bound = account if dialect.bound else ""
        mac = hmac.new(self._secret, canonical([dialect.name, bound, _turn(tool_calls, content)]),
                       hashlib.sha256).digest()
        digest = mac.hex()[:24]
        text = ""
        if dialect.reasoning in ("reasoning_content", "reasoning", "details"):
            text = f"{_THOUGHTS[mac[0] % len(_THOUGHTS)]} (#{digest[:12]})."
        signature = base64.b64encode(b"\x12\x20sim" + mac).decode("ascii")
        tokens = max(1, len(text) // 4) if text else 16 + mac[1] % 200
        return Reasoning(digest, text, signature, tokens)

    def verdict(self, dialect: Dialect, account: str, message: dict) -> tuple[str, Reasoning]:
        """
        Whether an assistant tool-call message carries its own reasoning back:
        ``own``, ``missing``, ``foreign`` or ``skipped``; and the reasoning it
        should carry.
        """
        calls = message.get("tool_calls")
        expected = self.of(dialect, account, calls, message.get("content"))
        if dialect.reasoning == "reasoning_content":
            sent = message.get("reasoning_content")
            if sent is None:
                return "missing", expected
            return ("own" if sent == expected.text else "foreign"), expected
        if dialect.reasoning == "signature":
            first = calls[0] if isinstance(calls, list) and calls and isinstance(calls[0], dict) else {}
            extra = first.get("extra_content")
            google = extra.get("google") if isinstance(extra, dict) else None
            sent = google.get("thought_signature") if isinstance(google, dict) else None
            if sent is None:
                return "missing", expected
            if sent == SKIP_SIGNATURE:
                return "skipped", expected
            return ("own" if sent == expected.signature else "foreign"), expected
        details = message.get("reasoning_details")
        if not isinstance(details, list) or not details:
            return "missing", expected
        if any(isinstance(entry, dict) and entry.get("type") == "reasoning.encrypted"
               and entry.get("data") == SKIP_SIGNATURE for entry in details):
            return "skipped", expected
        first_id = calls[0].get("id") if isinstance(calls, list) and calls and isinstance(calls[0], dict) else None
        own = _without_nulls(details) == expected.details(first_id)
        return ("own" if own else "foreign"), expected


def _without_nulls(value: Any) -> Any:
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    return value


def _required(dialect: Dialect, messages: list) -> list[int]:
    """The assistant tool-call messages whose reasoning must come back."""
    start = 0
    if dialect.required == "turn":
        users = [i for i, message in enumerate(messages) if message.get("role") == "user"]
        start = users[-1] + 1 if users else 0
    return [i for i in range(start, len(messages))
            if messages[i].get("role") == "assistant" and messages[i].get("tool_calls")]


def _gemini_error(message: str) -> str:
    # As OpenRouter quotes its provider's answer: the JSON text, indented.
    return json.dumps({"error": {"code": 400, "message": message, "status": "INVALID_ARGUMENT"}}, indent=2) + "\n"


def _refusal_for(dialect: Dialect, index: int, message: dict, verdict: str):
    name = dialect.name
    if name == "deepseek":
        return refusal(name, DEEPSEEK_MISSING)
    if name == "kimi":
        return refusal(name, f"thinking is enabled but reasoning_content is missing in assistant tool call "
                             f"message at index {index}")
    calls = message.get("tool_calls") or [{}]
    function_name = (calls[0].get("function") or {}).get("name") if isinstance(calls[0], dict) else None
    text = GEMINI_MISSING.format(name=function_name, position=index) if verdict == "missing" else GEMINI_CORRUPTED
    if name == "gemini":
        return refusal(name, text)
    return refusal(name, "Provider returned error", metadata={"raw": _gemini_error(text),
                                                              "provider_name": "Google AI Studio"})


class ReasoningProblem(NamedTuple):
    """A message that did not carry its own reasoning back."""

    conversation: str
    index: int
    verdict: str


def check_reasoning(dialect: Dialect, body: dict, messages: list, reasoner: Reasoner,
                    account: str) -> tuple[list[tuple[int, str, str]], ChatRefusal | None]:
    """
    The verdict on every message whose reasoning ``dialect`` requires back,
    as ``(message index, verdict, turn digest)``, and the refusal of the
    first message the dialect refuses (``None``: none): DeepSeek and Kimi
    refuse a ``missing`` one, Gemini and OpenRouter a ``missing`` or
    ``foreign`` one.
    """
    if dialect.required is None or not thinking_on(dialect, body):
        return [], None
    verdicts = []
    refused = None
    for index in _required(dialect, messages):
        verdict, expected = reasoner.verdict(dialect, account, messages[index])
        verdicts.append((index, verdict, expected.digest))
        refuses = verdict == "missing" or (verdict == "foreign" and dialect.required == "turn")
        if refuses and refused is None:
            refused = _refusal_for(dialect, index, messages[index], verdict)
    return verdicts, refused


def chat_conversation_key(headers: dict[str, str], messages: list) -> str:
    """The conversation a request belongs to: Claude Code's session header,
    else its first user message."""
    session = headers.get("x-claude-code-session-id")
    if session:
        return "session:" + session
    first = next((message.get("content") for message in messages if message.get("role") == "user"), None)
    return "first:" + hashlib.sha256(canonical(first)).hexdigest()[:32]


_COUNTS = ("requests", "checked", "own", "missing", "foreign", "skipped", "refused")


@dataclass
class ConversationReasoning:
    """
    What one conversation sent back.

    :ivar requests: its requests checked (a dialect that requires reasoning
        back, with reasoning on).
    :ivar checked: the messages whose reasoning was required, summed over
        its requests (a message counts in every request that carries it).
    :ivar own, missing, foreign, skipped: their verdicts.
    :ivar refused: its requests refused for their reasoning.
    :ivar emitted: the turns (digests) whose reasoning the dialect will
        require back, as answered.
    :ivar returned: of those, the ones seen back as their own.
    """

    requests: int = 0
    checked: int = 0
    own: int = 0
    missing: int = 0
    foreign: int = 0
    skipped: int = 0
    refused: int = 0
    emitted: set = field(default_factory=set)
    returned: set = field(default_factory=set)

    def unreturned(self) -> int:
        """Answered turns never seen back with their own reasoning."""
        return len(self.emitted - self.returned)

    def counts(self) -> dict[str, int]:
        """The counts, with ``emitted`` and ``unreturned`` as numbers."""
        counts = {name: getattr(self, name) for name in _COUNTS}
        counts.update(emitted=len(self.emitted), unreturned=self.unreturned())
        return counts


class ReasoningTally:
    """
    Per conversation (:func:`chat_conversation_key`), whether every turn sent
    its own reasoning back; the last problems.

    :param keep: conversations kept (the least recently used go).
    :ivar problems: the last :class:`ReasoningProblem`, oldest first.
    """

    def __init__(self, keep: int = 1000, keep_problems: int = 100):
        self._keep = keep
        self._conversations: OrderedDict[str, ConversationReasoning] = OrderedDict()
        self.problems: deque[ReasoningProblem] = deque(maxlen=keep_problems)

    def conversation(self, key: str) -> ConversationReasoning:
        """The record of conversation ``key`` (a new one if unknown)."""
        record = self._conversations.get(key)
        if record is None:
            record = self._conversations[key] = ConversationReasoning()
            while len(self._conversations) > self._keep:
                self._conversations.popitem(last=False)
        self._conversations.move_to_end(key)
        return record

    def conversations(self) -> dict[str, dict[str, int]]:
        """Every kept conversation's counts."""
        return {key: record.counts() for key, record in self._conversations.items()}

    def totals(self) -> dict[str, int]:
        """The counts of every kept conversation summed."""
        totals = dict.fromkeys((*_COUNTS, "emitted", "unreturned"), 0)
        for record in self._conversations.values():
            for name, count in record.counts().items():
                totals[name] += count
        return totals

    def checked(self, key: str, verdicts: list[tuple[int, str, str]], refused: bool) -> None:
        """Record a request's verdicts (:func:`check_reasoning`)."""
        record = self.conversation(key)
        record.requests += 1
        record.refused += int(refused)
        for index, verdict, digest in verdicts:
            record.checked += 1
            setattr(record, verdict, getattr(record, verdict) + 1)
            if verdict == "own":
                record.returned.add(digest)
            else:
                self.problems.append(ReasoningProblem(key, index, verdict))

    def emitted(self, key: str, digest: str) -> None:
        """Record an answered turn whose reasoning must come back."""
        self.conversation(key).emitted.add(digest)
