# -*- test-case-name: tests.test_simulated_usage -*-
"""
The usage the simulated upstream reports, and its tally of what it reported.

- :class:`PromptCache`: prompt caching as today's API does it, per account
  (workspace) and model: a prefix up to a ``cache_control`` breakpoint
  (``tools``, then ``system``, then the messages' blocks) is written with
  the breakpoint's lifetime (``5m``, or ``"ttl": "1h"``) when it holds at
  least :data:`MIN_CACHEABLE_TOKENS`, and read back (its lifetime renewed)
  by a later request that starts with it, the breakpoint having moved up to
  :data:`LOOKBACK` blocks further on.
- :func:`sampling`, :func:`today_usage`: one sampling's counts (a
  ``usage.iterations`` entry) and an answer's whole ``usage``, every field
  today's API reports; the top-level counts are the sum of the samplings
  but the ``compaction`` ones, as the API documents.
- :func:`start_usage`, :func:`delta_usage`: what a stream reports in
  ``message_start`` (the input side) and in its ``message_delta``
  (cumulative counts), as the recorded streams of today's API do.
- :class:`UsageTally`: what the upstream reported, answer by answer, and
  its totals per user (``metadata.user_id``) and model, by the rule of its
  bill (:func:`billed`): so that a test can compare a relay's metering with
  the truth.

Pure: no Twisted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import ujson

from twisted_relay.simulated.base import canonical, messages_of
from twisted_relay.simulated.system_messages import prompt_tools
from twisted_relay.usage import TOKEN_KINDS

__all__ = [
    "KINDS",
    "LOOKBACK",
    "MAX_TALLIED",
    "MIN_CACHEABLE_TOKENS",
    "OTHER_USERS",
    "Prompt",
    "PromptCache",
    "ReportedAnswer",
    "UsageTally",
    "billed",
    "delta_usage",
    "sampling",
    "start_usage",
    "today_usage",
]

#: The kinds the tally counts: the relay's (:data:`twisted_relay.usage.TOKEN_KINDS`).
KINDS = TOKEN_KINDS
#: The shortest prefix the cache keeps, in tokens (the API's figure for
#: Sonnet 5.5 and Haiku 5.5; the simulator uses it for every model).
MIN_CACHEABLE_TOKENS = 512
#: How many blocks before a breakpoint a cache read is looked for.
LOOKBACK = 20
_TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
# The fields a stream's message_start leaves out (they come with message_delta).
_DELTA_ONLY = ("iterations", "output_tokens_details", "server_tool_use")
# The fields a message_delta repeats (cumulative), as the recorded streams show.
_DELTA_FIELDS = (
    "input_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "output_tokens",
    "output_tokens_details",
    "server_tool_use",
    "iterations",
    "fallback_credit",
)


def _tokens(length: int) -> int:
    # The simulator's tokenizer: four characters of JSON a token.
    return length // 4


@dataclass(frozen=True)
class Prompt:
    """
    How one sampling read its prompt: tokens read from the cache, written
    to it (by lifetime), and the rest (``input_tokens``).
    """

    input_tokens: int
    cache_read: int = 0
    cache_write_5m: int = 0
    cache_write_1h: int = 0

    @classmethod
    def uncached(cls, tokens: int) -> "Prompt":
        """A prompt read without the cache."""
        return cls(tokens)


def _ttl(part: Any) -> str | None:
    control = part.get("cache_control") if isinstance(part, dict) else None
    if isinstance(control, dict) and control.get("type") == "ephemeral":
        return "1h" if control.get("ttl") == "1h" else "5m"
    return None


def _without_marker(part: Any) -> Any:
    if isinstance(part, dict) and "cache_control" in part:
        return {key: value for key, value in part.items() if key != "cache_control"}
    return part


def _segments(body: dict) -> list[tuple[tuple[str | None, Any], str | None]]:
    """
    The prompt in the cache's order, block by block (each with where it
    is: ``tools``, ``system`` or its message's role), each with its
    breakpoint's lifetime (or ``None``).
    """
    parts: list[tuple[tuple[str | None, Any], str | None]] = []
    tools = prompt_tools(body)
    for tool in tools if isinstance(tools, list) else ():
        parts.append((("tools", tool), _ttl(tool)))
    system = body.get("system")
    if isinstance(system, list):
        parts.extend((("system", block), _ttl(block)) for block in system)
    elif system is not None:
        parts.append((("system", system), None))
    for message in messages_of(body):
        content = message.get("content") if isinstance(message, dict) else None
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts.extend(((role, block), _ttl(block)) for block in content)
        else:
            parts.append(((role, content), None))
    return parts


class PromptCache:
    """
    The prompt cache of the simulated upstream: prefixes by account, model
    and content, each alive until its lifetime runs out (renewed when read).

    :param capacity: prefixes kept at most (the least recently used go).
    """

    def __init__(self, capacity: int = 10_000):
        self._capacity = capacity
        self._alive: OrderedDict[tuple, tuple[float, str]] = OrderedDict()

    def read(self, body: dict, *, account: str, model: str, total: int, now: float) -> Prompt:
        """
        Read ``body``'s prompt (``total`` tokens in all) through the cache:
        the longest cached prefix is read, every breakpoint after it written.
        """
        segments = _segments(body)
        breakpoints = [i for i, (_, ttl) in enumerate(segments) if ttl is not None]
        if not breakpoints:
            return Prompt.uncached(total)
        # Digest and tokens of each prefix (markers left out: moving a
        # breakpoint does not change what is cached).
        digest = hashlib.sha256()
        digests, lengths, length = [], [], 0
        for (role, part), _ in segments[: breakpoints[-1] + 1]:
            part = _without_marker(part)
            digest.update(canonical([role, part]))
            digests.append(digest.hexdigest())
            # Tokens counted as count_tokens counts the whole prompt's.
            length += len(ujson.dumps(part, ensure_ascii=False))
            lengths.append(min(total, _tokens(length)))
        alive = self._alive
        read_at = -1
        candidates = sorted(
            {i for point in breakpoints for i in range(max(0, point - LOOKBACK), point + 1)}, reverse=True
        )
        for i in candidates:
            entry = alive.get((account, model, digests[i]))
            if entry is not None and entry[0] > now:
                read_at = i
                ttl = entry[1]
                alive[(account, model, digests[i])] = (now + _TTL_SECONDS[ttl], ttl)
                alive.move_to_end((account, model, digests[i]))
                break
        read = lengths[read_at] if read_at >= 0 else 0
        written = {"5m": 0, "1h": 0}
        done = read
        for point in breakpoints:
            if point <= read_at or lengths[point] < MIN_CACHEABLE_TOKENS:
                continue
            ttl = segments[point][1]
            written[ttl] += lengths[point] - done
            done = lengths[point]
            alive[(account, model, digests[point])] = (now + _TTL_SECONDS[ttl], ttl)
            alive.move_to_end((account, model, digests[point]))
        while len(alive) > self._capacity:
            alive.popitem(last=False)
        return Prompt(max(0, total - done), read, written["5m"], written["1h"])


# -- an answer's usage ----------------------------------------------------------------


def sampling(prompt: Prompt, output_tokens: int, kind: str | None = None, model: str | None = None) -> dict:
    """
    One sampling's counts: a ``usage.iterations`` entry when ``kind`` is
    given (``message``, ``compaction``, ``advisor_message``,
    ``fallback_message``; with its ``model`` when given).
    """
    entry: dict = {}
    if kind is not None:
        entry["type"] = kind
    if model is not None:
        entry["model"] = model
    entry.update(
        input_tokens=prompt.input_tokens,
        output_tokens=output_tokens,
        cache_read_input_tokens=prompt.cache_read,
        cache_creation_input_tokens=prompt.cache_write_5m + prompt.cache_write_1h,
        cache_creation={
            "ephemeral_5m_input_tokens": prompt.cache_write_5m,
            "ephemeral_1h_input_tokens": prompt.cache_write_1h,
        },
    )
    return entry


def today_usage(
    iterations: list[dict],
    *,
    thinking_tokens: int = 0,
    web_search_requests: int = 0,
    web_fetch_requests: int = 0,
    inference_geo: str = "global",
    speed: str | None = None,
) -> dict:
    """
    An answer's ``usage`` as today's API reports it: the counts of its
    samplings (``iterations``) summed, but those of ``compaction`` ones,
    which the API leaves out of the top level; the cache writes split by
    lifetime; the thinking tokens (part of ``output_tokens``); the server
    tool requests; the tier, the geography and (when the request chose
    one) the speed.
    """
    counted = [entry for entry in iterations if entry.get("type") != "compaction"]

    def total(name: str) -> int:
        return sum(entry[name] for entry in counted)

    usage = {
        "input_tokens": total("input_tokens"),
        "cache_creation_input_tokens": total("cache_creation_input_tokens"),
        "cache_read_input_tokens": total("cache_read_input_tokens"),
        "cache_creation": {
            name: sum(entry["cache_creation"][name] for entry in counted)
            for name in ("ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens")
        },
        "output_tokens": total("output_tokens"),
        "output_tokens_details": {"thinking_tokens": thinking_tokens},
        "server_tool_use": {"web_search_requests": web_search_requests, "web_fetch_requests": web_fetch_requests},
        "service_tier": "standard",
        "inference_geo": inference_geo,
        "iterations": iterations,
    }
    if speed is not None:
        usage["speed"] = speed
    return usage


def start_usage(usage: dict, today: bool = True) -> dict:
    """What a stream's ``message_start`` reports: the input side (and one output token)."""
    if not today:
        return dict(usage, output_tokens=1)
    return {key: value for key, value in usage.items() if key not in _DELTA_ONLY} | {"output_tokens": 1}


def delta_usage(usage: dict, today: bool = True) -> dict:
    """What a stream's last ``message_delta`` reports: the cumulative counts."""
    if not today:
        return {"output_tokens": usage["output_tokens"]}
    return {key: usage[key] for key in _DELTA_FIELDS if key in usage}


# -- the tally -------------------------------------------------------------------------


def billed(usage: dict) -> dict[str, int]:
    """
    What the simulated upstream bills for ``usage`` as reported, by kind of
    :data:`KINDS`: its ``iterations`` when it has them (the ``compaction``
    ones included), else its top level; 1-hour cache writes as split, the
    rest of the writes 5-minute ones; server tool requests from the top level.
    """
    iterations = usage.get("iterations")
    entries = iterations if isinstance(iterations, list) and iterations else [usage]
    tokens = dict.fromkeys(KINDS, 0)
    for entry in entries:
        written = entry.get("cache_creation_input_tokens") or 0
        one_hour = (entry.get("cache_creation") or {}).get("ephemeral_1h_input_tokens", 0)
        tokens["input_tokens"] += entry.get("input_tokens") or 0
        tokens["output_tokens"] += entry.get("output_tokens") or 0
        tokens["cache_read_tokens"] += entry.get("cache_read_input_tokens") or 0
        tokens["cache_creation_1h_tokens"] += one_hour
        tokens["cache_creation_5m_tokens"] += written - one_hour
    tools = usage.get("server_tool_use") or {}
    tokens["web_search_requests"] = tools.get("web_search_requests", 0)
    tokens["web_fetch_requests"] = tools.get("web_fetch_requests", 0)
    return tokens


@dataclass(frozen=True)
class ReportedAnswer:
    """
    One answer as the simulated upstream reported it.

    :ivar user: the request's ``metadata.user_id``, if it had one.
    :ivar model: the answer's ``model``.
    :ivar usage: the usage reported: a whole answer's, or a stream's
        ``message_start`` usage with its ``message_delta`` laid over when
        that event was sent.
    :ivar stream: it was streamed.
    :ivar whole: all of it was sent (a whole answer, or a stream up to its
        ``message_stop``).
    """

    user: str | None
    model: str
    usage: dict
    stream: bool
    whole: bool


#: The ``(user, model)`` pairs a tally counts apart; later pairs count
#: under the user :data:`OTHER_USERS`.
MAX_TALLIED = 10_000
#: The user of the pairs beyond :data:`MAX_TALLIED`.
OTHER_USERS = "(other users)"


class UsageTally:
    """
    What the simulated upstream reported: the last answers, and totals
    by user and model of what it billed (:func:`billed`), in this process
    (the first :data:`MAX_TALLIED` pairs of user and model apart).

    :param keep: answers kept in :attr:`answers`.
    :ivar answers: the last :class:`ReportedAnswer`, oldest first.
    """

    def __init__(self, keep: int = 100):
        self.answers: deque[ReportedAnswer] = deque(maxlen=keep)
        self._totals: dict[tuple[str | None, str], dict[str, int]] = {}

    def add(self, body: Any, message: dict, usage: dict, *, stream: bool, whole: bool) -> None:
        """Count ``usage``, reported for ``message`` answering ``body``."""
        metadata = body.get("metadata") if isinstance(body, dict) else None
        user = metadata.get("user_id") if isinstance(metadata, dict) else None
        user = user if isinstance(user, str) else None
        model = str(message.get("model"))
        usage = ujson.loads(ujson.dumps(usage))  # a copy of its own
        self.answers.append(ReportedAnswer(user, model, usage, stream, whole))
        key = (user, model)
        if key not in self._totals and len(self._totals) >= MAX_TALLIED:
            key = (OTHER_USERS, model)
        totals = self._totals.setdefault(key, dict.fromkeys(KINDS, 0))
        for kind, count in billed(usage).items():
            totals[kind] += count

    def totals(self) -> dict[tuple[str | None, str], dict[str, int]]:
        """The tokens billed so far, by ``(user, model)`` and kind."""
        return {key: dict(counts) for key, counts in self._totals.items()}
