# -*- test-case-name: tests.test_simulated_openai_responses -*-
"""
The reasoning of the simulated OpenAI Responses API: its ``encrypted_content``
bound to the organisation, and the tally that checks every conversation
replays its own reasoning.

- :class:`ReasoningSeal`: a reasoning item's ``encrypted_content`` is a Fernet
  token (``gAAAAA...``, as OpenAI's are) of what the item was: its ``rs_`` id,
  the organisation, the conversation, the response, the item it preceded.
  Only a seal with the same secret opens it; the organisation inside binds
  it.
- :class:`ReasoningLedger`: what reasoning each conversation was given, and
  whether each later request sent it back: none dropped, none foreign, none
  rebuilt without its encrypted content.  A conversation is found from the
  request itself (stateless, as the API is): the earlier answers whose
  function calls (by ``call_id``, a relay's ``-k`` suffix left out, name and
  arguments) it holds, else whose reasoning it sends back; within it, the
  answers whose text it holds too.

Pure: no Twisted.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

import ujson
from cryptography.fernet import Fernet, InvalidToken

from twisted_relay.simulated.base import canonical

__all__ = [
    "DEFAULT_SECRET",
    "ConversationReasoning",
    "ReasoningLedger",
    "ReasoningReport",
    "ReasoningSeal",
    "assistant_side",
    "fingerprint",
]

#: The secret every simulated Responses API seals with unless told otherwise:
#: two instances (or a restarted one) read each other's reasoning.
DEFAULT_SECRET = "simulated-openai-responses"

_SUFFIXES = re.compile(r"(-\d+)+$")


class ReasoningSeal:
    """
    Seals and opens reasoning items' ``encrypted_content``.

    :param secret: what the key is derived from.
    """

    def __init__(self, secret: str = DEFAULT_SECRET):
        key = hashlib.sha256(b"simulated-openai-responses:" + secret.encode("utf-8")).digest()
        self._fernet = Fernet(base64.urlsafe_b64encode(key))

    def seal(self, payload: dict) -> str:
        """The ``encrypted_content`` carrying ``payload``."""
        return self._fernet.encrypt(canonical(payload)).decode("ascii")

    def open(self, token: Any) -> dict | None:
        """The payload sealed in ``token``, or ``None`` when this seal did
        not make it (another secret, another API's signature, an edit)."""
        if not isinstance(token, str):
            return None
        try:
            payload = ujson.loads(self._fernet.decrypt(token.encode("ascii")))
        except (InvalidToken, UnicodeEncodeError, ValueError):
            return None
        return payload if isinstance(payload, dict) else None


def assistant_side(item: dict) -> bool:
    """Whether an input item is the model's (a reasoning item, a function
    call, an assistant message) rather than the client's."""
    kind = item.get("type", "message")
    return kind in ("reasoning", "function_call") or (kind == "message" and item.get("role") == "assistant")


def _text_of(item: dict) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or () if isinstance(part, dict)
                   and isinstance(part.get("text"), str))


def fingerprint(item: dict) -> str | None:
    """
    What identifies a function call or an assistant message across turns,
    whatever a relay did to it on the way: a function call by its
    ``call_id`` (without ``-k`` suffixes, a relay's renaming of repeats),
    name and arguments (their value, not their spelling); a message by its
    text.  ``None`` for other items.
    """
    kind = item.get("type", "message")
    if kind == "function_call":
        arguments = item.get("arguments")
        try:
            arguments = ujson.loads(arguments)
        except (TypeError, ValueError):
            pass
        call_id = item.get("call_id")
        base = _SUFFIXES.sub("", call_id) if isinstance(call_id, str) else None
        key = ["function_call", base, item.get("name"), arguments]
    elif kind == "message" and item.get("role") == "assistant":
        key = ["message", _text_of(item)]
    else:
        return None
    return hashlib.sha256(canonical(key)).hexdigest()[:32]


@dataclass
class ConversationReasoning:
    """
    What one conversation was given and sent back.

    :ivar conversation: the simulator's name for it (``conversation-1``...).
    :ivar label: the ``prompt_cache_key`` of its latest request, if any.
    :ivar organisation: whose it is.
    :ivar turns: its requests that were checked and answered (a retried
        turn counts twice; an answer whose stream then failed counts).
    :ivar issued: the ``rs_`` ids of the reasoning items given to it, in order.
    :ivar replayed: those that came back in place at least once.
    :ivar dropped: ``rs_`` id -> the turn that first left it out although
        it held the function calls or text the item was given with.
    :ivar foreign: ``rs_`` id -> the turn that first sent it where it does
        not belong (another turn's or another conversation's reasoning).
    :ivar rebuilt: ``(turn, input index)`` of reasoning items sent without
        ``encrypted_content`` or id (rebuilt from a summary: the model
        cannot read them).
    :ivar last_expected: the reasoning items the latest request had to
        send back; ``last_replayed``: those it did.
    """

    conversation: str
    label: str | None
    organisation: str
    turns: int = 0
    issued: list[str] = field(default_factory=list)
    replayed: set[str] = field(default_factory=set)
    dropped: dict[str, int] = field(default_factory=dict)
    foreign: dict[str, int] = field(default_factory=dict)
    rebuilt: list[tuple[int, int]] = field(default_factory=list)
    last_expected: int = 0
    last_replayed: int = 0

    @property
    def ok(self) -> bool:
        """Nothing dropped, nothing foreign, nothing rebuilt."""
        return not (self.dropped or self.foreign or self.rebuilt)

    def copy(self) -> "ConversationReasoning":
        return ConversationReasoning(
            self.conversation, self.label, self.organisation, self.turns, list(self.issued), set(self.replayed),
            dict(self.dropped), dict(self.foreign), list(self.rebuilt), self.last_expected, self.last_replayed,
        )


@dataclass(frozen=True)
class ReasoningReport:
    """
    A snapshot of the tally.

    :ivar conversations: by the simulator's name, oldest first.
    :ivar refused: requests refused for their reasoning, by cause
        (``invalid_encrypted_content``, ``organization_mismatch``,
        ``missing_following_item``, ``missing_summary``, ``item_not_persisted``).
    :ivar withheld: reasoning items of another organisation a model left out
        (``input_transformations``), in all.
    """

    conversations: dict[str, ConversationReasoning]
    refused: dict[str, int]
    withheld: int = 0

    @property
    def ok(self) -> bool:
        """Every conversation replayed its own reasoning, and none was refused or withheld."""
        return not self.refused and not self.withheld and all(c.ok for c in self.conversations.values())

    def by_label(self, label: str) -> list[ConversationReasoning]:
        """The conversations whose latest ``prompt_cache_key`` is ``label``."""
        return [c for c in self.conversations.values() if c.label == label]

    def problems(self) -> list[str]:
        """What went wrong, one line each (empty when :attr:`ok`)."""
        lines = [f"{count} request(s) refused: {cause}" for cause, count in sorted(self.refused.items())]
        if self.withheld:
            lines.append(f"{self.withheld} reasoning item(s) of another organisation withheld")
        for c in self.conversations.values():
            lines += [f"{c.conversation}: {rs} dropped at turn {turn}" for rs, turn in c.dropped.items()]
            lines += [f"{c.conversation}: {rs} foreign at turn {turn}" for rs, turn in c.foreign.items()]
            lines += [f"{c.conversation}: input[{index}] rebuilt at turn {turn}" for turn, index in c.rebuilt]
        return lines


@dataclass
class _Answer:
    """One answer given: its conversation and reasoning."""

    conversation: str
    organisation: str
    reasoning: list[str]
    replayable: bool
    calls: list[str]
    texts: list[str]
    order: int


@dataclass
class _Run:
    """A run of the model's items in a request: its reasoning and what identifies it."""

    reasoning: list[tuple[int, str | None]] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


def _runs(items: list[dict], reasoning_ids: dict[int, str | None]) -> list[_Run]:
    runs: list[_Run] = []
    current: _Run | None = None
    for index, item in enumerate(items):
        if not assistant_side(item):
            current = None
            continue
        if current is None:
            current = _Run()
            runs.append(current)
        kind = item.get("type", "message")
        if kind == "reasoning":
            current.reasoning.append((index, reasoning_ids.get(index)))
        elif kind == "function_call":
            current.calls.append(fingerprint(item))
        else:
            current.texts.append(fingerprint(item))
    return runs


class ReasoningLedger:
    """
    The answers given, by what identifies them, and per conversation what
    came back.

    :param capacity: answers kept (the oldest go first); conversations kept
        likewise.
    """

    def __init__(self, capacity: int = 50_000):
        self._capacity = capacity
        self._answers: OrderedDict[str, _Answer] = OrderedDict()
        self._by_call: dict[str, list[str]] = {}
        self._by_text: dict[str, list[str]] = {}
        self._by_reasoning: dict[str, str] = {}
        self._conversations: OrderedDict[str, ConversationReasoning] = OrderedDict()
        self._refused: dict[str, int] = {}
        self._withheld = 0
        self._named = 0
        self._given = 0

    # -- what the requests did ---------------------------------------------------

    def refused(self, cause: str) -> None:
        """Count a request refused for its reasoning."""
        self._refused[cause] = self._refused.get(cause, 0) + 1

    def withheld(self, count: int) -> None:
        """Count reasoning items of another organisation a model left out."""
        self._withheld += count

    def follow(self, items: list[dict], reasoning_ids: dict[int, str | None], organisation: str,
               label: str | None) -> str:
        """
        Check a request that was answered: find its conversation (a new one
        when it continues none), and tally, for each run of the model's
        items it holds, the reasoning it had to send back and what it sent.

        :param items: the request's input, every item resolved.
        :param reasoning_ids: input index of each reasoning item -> the
            ``rs_`` id it was sealed or stored with (``None``: neither).
        :return: the conversation's name.
        """
        runs = _runs(items, reasoning_ids)
        sources = [self._source(run, organisation, None) for run in runs]
        known = [self._answers[answer].conversation for answer in sources if answer is not None]
        if not known:
            # No function call of ours: the reasoning sent back may say whose it is.
            owners = [self._by_reasoning.get(rs) for run in runs for _, rs in run.reasoning]
            known = [self._answers[owner].conversation for owner in owners
                     if owner in self._answers and self._answers[owner].organisation == organisation]
        conversation = known[-1] if known else self._new_conversation()
        if known:
            # Answers known only by their text are looked for in this conversation.
            sources = [answer if answer is not None else self._source(run, organisation, conversation)
                       for run, answer in zip(runs, sources)]
        tally = self._conversations.get(conversation)
        if tally is None:
            tally = self._conversations[conversation] = ConversationReasoning(conversation, label, organisation)
        self._conversations.move_to_end(conversation)
        tally.turns += 1
        if label is not None:
            tally.label = label
        turn = tally.turns
        tally.last_expected = tally.last_replayed = 0
        # Judged over the whole request: a run matched to the wrong answer
        # (alike texts and calls of two models in one conversation) must not
        # make an item sent back look dropped, nor its own look foreign.
        sent = {rs for run in runs for _, rs in run.reasoning if rs is not None}
        expected_all: set[str] = set()
        for run, source in zip(runs, sources):
            answer = self._answers.get(source) if source is not None else None
            tally.rebuilt += [(turn, index) for index, rs in run.reasoning if rs is None]
            if answer is not None and answer.conversation == conversation and answer.replayable:
                expected_all.update(answer.reasoning)
        ours = set(tally.issued)
        for rs in expected_all:
            if rs in sent:
                tally.replayed.add(rs)
            else:
                tally.dropped.setdefault(rs, turn)
        for rs in sent:
            if rs not in ours and rs not in expected_all:
                tally.foreign.setdefault(rs, turn)
        tally.last_expected = len(expected_all)
        tally.last_replayed = len(expected_all & sent)
        return conversation

    def issue(self, conversation: str, response_id: str, output: list[dict], organisation: str, *,
              replayable: bool) -> None:
        """
        Remember an answer given whole to ``conversation``.

        :param output: its output items (reasoning items with their ids).
        :param replayable: the client can send its reasoning back (it was
            sealed, or the response stored).
        """
        reasoning = [item["id"] for item in output if item.get("type") == "reasoning"]
        # Its calls are known by the ids it made (call_...): a copy of another
        # model's id (the fake model reuses ids of the history) names that model's turn too.
        calls = [fingerprint(item) for item in output
                 if item.get("type") == "function_call" and str(item.get("call_id", "")).startswith("call_")]
        texts = [fingerprint(item) for item in output if item.get("type") == "message"]
        self._given += 1
        self._answers[response_id] = _Answer(conversation, organisation, reasoning, replayable, calls, texts,
                                            self._given)
        for key in calls:
            self._by_call.setdefault(key, []).append(response_id)
        for key in texts:
            self._by_text.setdefault(key, []).append(response_id)
        for rs in reasoning:
            self._by_reasoning[rs] = response_id
        tally = self._conversations.get(conversation)
        if tally is not None:
            tally.issued += reasoning
        while len(self._answers) > self._capacity:
            self._forget(*self._answers.popitem(last=False))
        while len(self._conversations) > self._capacity:
            self._conversations.popitem(last=False)

    def report(self) -> ReasoningReport:
        """A snapshot of the tally."""
        return ReasoningReport(
            {name: tally.copy() for name, tally in self._conversations.items()}, dict(self._refused), self._withheld
        )

    # -- inside ---------------------------------------------------------------------

    def _new_conversation(self) -> str:
        self._named += 1
        return f"conversation-{self._named}"

    def _source(self, run: _Run, organisation: str, conversation: str | None) -> str | None:
        """
        The answer a run of a request came from: of the organisation's, the
        one most of its function calls point to (and its texts, within
        ``conversation`` only), the one whose reasoning it holds among
        equals, the latest among those; ``None`` when none.
        """
        votes: dict[str, int] = {}
        keys: Iterable[tuple[dict[str, list[str]], str]] = [(self._by_call, key) for key in run.calls]
        if conversation is not None and not run.calls:
            # Texts only for a run without calls: a run whose calls are
            # another model's (a conversation that moved between upstreams)
            # is not ours, however alike the texts.
            keys = [*keys, *((self._by_text, key) for key in run.texts)]
        for index, key in keys:
            for answer in index.get(key, ()):
                given = self._answers[answer]
                if given.organisation == organisation and conversation in (None, given.conversation):
                    votes[answer] = votes.get(answer, 0) + 1
        if not votes:
            return None
        present = {rs for _, rs in run.reasoning}
        return max(votes, key=lambda answer: (
            votes[answer], len(present.intersection(self._answers[answer].reasoning)), self._answers[answer].order))

    def _forget(self, response_id: str, answer: _Answer) -> None:
        for rs in answer.reasoning:
            self._by_reasoning.pop(rs, None)
        for index, keys in ((self._by_call, answer.calls), (self._by_text, answer.texts)):
            for key in keys:
                holders = index.get(key, [])
                if response_id in holders:
                    holders.remove(response_id)
                if not holders:
                    index.pop(key, None)
