# -*- test-case-name: tests.test_simulated -*-
"""
The pure part of the simulated upstream: request checks, the fake model and
the SSE byte stream.

Nothing here imports Twisted, so the subtle parts (what a strict backend
rejects, when the model reuses an id, where a stream is cut) can be tested
and read on their own.  Every random choice comes from a
:class:`random.Random` seeded with the upstream's seed and the request's
content, never from global state: a restarted upstream answers the same
request the same way.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import random
import re
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import ujson

from twisted_relay.simulated.base import (
    Rejection,
    blocks_of,
    invalid,
    declares_tool_use,
    is_reference,
    messages_of,
    conversation_key,
    declaration_ids,
    seeded_rng,
)
from twisted_relay.simulated.stream import LINE_ENDINGS, encode_events, message_events, plan_chunks
from twisted_relay.simulated.system_messages import callable_tools, prompt_tools

__all__ = [
    "ID_STYLES",
    "LEFT_OUT_IDS",
    "LINE_ENDINGS",
    "MODELS",
    "MODES",
    "ConversationLedger",
    "ModelOptions",
    "Rejection",
    "check_id_pattern",
    "check_shape",
    "check_strict_ids",
    "check_thinking",
    "compose_answer",
    "conversation_key",
    "count_tokens",
    "declaration_ids",
    "encode_events",
    "message_events",
    "plan_chunks",
    "request_rng",
    "seeded_rng",
    "sign_thinking",
]

#: The validation modes of the simulated upstream.
MODES = ("strict", "stateful", "lenient")

#: ``toolu``: canonical Anthropic ids; ``kimi``: ``functions.<name>:<idx>``.
ID_STYLES = ("toolu", "kimi")

#: How the model emits tool_use ids: ``never`` left out; ``empty``: ``""``;
#: ``absent``: no ``id`` field; ``some``: one call in two of each, in turn.
LEFT_OUT_IDS = ("never", "empty", "absent", "some")

#: The models listed by ``GET /v1/models``, newest first as Anthropic lists them.
MODELS = (
    {
        "type": "model",
        "id": "claude-opus-4-1-20250805",
        "display_name": "Claude Opus 4.1",
        "created_at": "2025-08-05T00:00:00Z",
    },
    {
        "type": "model",
        "id": "claude-sonnet-4-5-20250929",
        "display_name": "Claude Sonnet 4.5",
        "created_at": "2025-09-29T00:00:00Z",
    },
    {
        "type": "model",
        "id": "claude-haiku-4-5-20251001",
        "display_name": "Claude Haiku 4.5",
        "created_at": "2025-10-01T00:00:00Z",
    },
    {
        "type": "model",
        "id": "claude-3-5-haiku-20241022",
        "display_name": "Claude Haiku 3.5",
        "created_at": "2024-10-22T00:00:00Z",
    },
)

_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_TOOL_USE_PATTERN = "^[a-zA-Z0-9_-]+$"
_SERVER_TOOL_USE_PATTERN = "^srvtoolu_[a-zA-Z0-9_]+$"
_TOOL_USE_RE = re.compile(r"[a-zA-Z0-9_-]+")
_SERVER_TOOL_USE_RE = re.compile(r"srvtoolu_[a-zA-Z0-9_]+")

# Text the fake model says.  Several phrases are not ASCII on purpose, so
# that split streams cut through multi-byte UTF-8 characters.
_TOOL_PHRASES = (
    "Je vérifie ça tout de suite.",
    "Let me look that up — one moment.",
    "東京の状況を確認します。",
    "Prüfe die Datei in Zürich …",
    "Running the next step 🔧",
    "Voy a comprobarlo, señor.",
)
_FINAL_PHRASES = (
    "Voilà — c'est terminé. ✅",
    "All done: everything checks out.",
    "完了しました。ありがとうございます。",
    "Fertig, die Prüfung ist abgeschlossen.",
)
_WORDS = ("Zürich", "東京", "naïve café", "São Paulo", "Kraków", "report.txt", "ls -la", "🌧️ forecast")
_SEARCHES = ("météo à Genève", "tool use ids", "Twisted SSE", "東京 天気")


@dataclass(frozen=True)
class ModelOptions:
    """
    How the fake model behaves.

    :ivar seed: the seed every random choice starts from.
    :ivar reuse_every: every ``reuse_every``-th tool call of a conversation
        copies an id from the context (0: never).
    :ivar id_style: ``toolu`` or ``kimi``.
    :ivar parallel: tool_use blocks per answer.
    :ivar server_tools: add a ``server_tool_use`` and its
        ``web_search_tool_result`` to every answer.
    :ivar lookalikes: sometimes emit ``X-2`` natively, ``X`` from the history.
    :ivar left_out_ids: one of :data:`LEFT_OUT_IDS`.
    :ivar thinking_secret: when set and the request turns thinking on, the
        answer starts with a thinking block signed with it
        (:func:`sign_thinking`).
    """

    seed: int = 0
    reuse_every: int = 3
    id_style: str = "toolu"
    parallel: int = 1
    server_tools: bool = False
    lookalikes: bool = False
    left_out_ids: str = "never"
    thinking_secret: str | None = None

    def __post_init__(self) -> None:
        if self.reuse_every < 0:
            raise ValueError("reuse_every must be 0 or more")
        if self.id_style not in ID_STYLES:
            raise ValueError(f"id_style must be one of {', '.join(ID_STYLES)}")
        if self.parallel < 1:
            raise ValueError("parallel must be 1 or more")
        if self.left_out_ids not in LEFT_OUT_IDS:
            raise ValueError(f"left_out_ids must be one of {', '.join(LEFT_OUT_IDS)}")


# -- walking a conversation ---------------------------------------------------



def request_rng(seed: int, body: Any) -> random.Random:
    """
    The random generator of the answer to ``body``, derived from the seed
    and what the model reads (messages, system, tools, tool_choice).

    Fields that do not change the answer (``stream``, ``max_tokens``,
    ``metadata``) are left out, so a streamed and a non-streamed request
    get the same answer; keys are sorted, so re-serialising the body does
    not change it either.
    """
    if isinstance(body, dict):
        read = {key: body.get(key) for key in ("messages", "system", "tools", "tool_choice")}
    else:
        read = None
    return seeded_rng(seed, "answer", read)


# -- strict and stateful checks -----------------------------------------------


def check_shape(body: Any, *, for_count: bool = False, system_role: bool = False) -> None:
    """
    Reject a request whose top-level shape a real backend would refuse.

    :param for_count: the body is for ``count_tokens``, which has no
        ``max_tokens``.
    :param system_role: ``role: "system"`` messages are taken (today's models).
    :raises Rejection: with pydantic-style locations, as Anthropic words them.
    """
    if not isinstance(body, dict):
        raise invalid("Input should be a valid dictionary")
    if "model" not in body:
        raise invalid("model: Field required")
    if not isinstance(body["model"], str):
        raise invalid("model: Input should be a valid string")
    if not for_count:
        if "max_tokens" not in body:
            raise invalid("max_tokens: Field required")
        max_tokens = body["max_tokens"]
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise invalid("max_tokens: Input should be a valid integer")
        if max_tokens < 1:
            raise invalid("max_tokens: Input should be greater than or equal to 1")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise invalid("stream: Input should be a valid boolean")
    if "tools" in body and not isinstance(body["tools"], list):
        raise invalid("tools: Input should be a valid list")
    if "messages" not in body:
        raise invalid("messages: Field required")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise invalid("messages: Input should be a valid list")
    if not messages:
        raise invalid("messages: at least one message is required")
    for n, message in enumerate(messages):
        _check_message_shape(n, message, system_role)


def _check_message_shape(n: int, message: Any, system_role: bool) -> None:
    if not isinstance(message, dict):
        raise invalid(f"messages.{n}: Input should be a valid dictionary")
    if message.get("role") not in ("user", "assistant", "system" if system_role else "user"):
        expected = "'user', 'assistant' or 'system'" if system_role else "'user' or 'assistant'"
        raise invalid(f"messages.{n}.role: Input should be {expected}")
    if "content" not in message:
        raise invalid(f"messages.{n}.content: Field required")
    content = message["content"]
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise invalid(f"messages.{n}.content: Input should be a valid list")
    for m, block in enumerate(content):
        if not isinstance(block, dict):
            raise invalid(f"messages.{n}.content.{m}: Input should be a valid dictionary")
        if not isinstance(block.get("type"), str):
            raise invalid(f"messages.{n}.content.{m}.type: Field required")


def _check_declaration_pattern(n: int, m: int, block: dict) -> None:
    kind = block["type"]
    value = block.get("id")
    if kind == "server_tool_use":
        regex, pattern = _SERVER_TOOL_USE_RE, _SERVER_TOOL_USE_PATTERN
    else:
        regex, pattern = _TOOL_USE_RE, _TOOL_USE_PATTERN
    if not isinstance(value, str) or regex.fullmatch(value) is None:
        raise invalid(f"messages.{n}.content.{m}.{kind}.id: String should match pattern '{pattern}'")


def check_id_pattern(messages: Sequence[dict], pattern: str) -> None:
    """
    Reject a ``tool_use`` id or a ``tool_result.tool_use_id`` that does not
    match ``pattern`` (whole), with Anthropic's wording.

    :raises Rejection: for the first fault in walk order.
    """
    regex = re.compile(pattern)
    for n, message in enumerate(messages):
        for m, block in enumerate(blocks_of(message)):
            kind = block.get("type")
            if kind == "tool_use":
                field, value = "id", block.get("id")
            elif kind == "tool_result":
                field, value = "tool_use_id", block.get("tool_use_id")
            else:
                continue
            if not isinstance(value, str) or regex.fullmatch(value) is None:
                raise invalid(
                    f"messages.{n}.content.{m}.{kind}.{field}: String should match pattern '{pattern}'"
                )


def sign_thinking(secret: str, thinking: str) -> str:
    """The signature of a thinking text: base64 of its HMAC-SHA256 under ``secret``."""
    digest = hmac.new(secret.encode("utf-8"), thinking.encode("utf-8"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def _thinking_on(body: Any) -> bool:
    thinking = body.get("thinking") if isinstance(body, dict) else None
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def check_thinking(body: dict, secret: str, manual_only: bool = False) -> None:
    """
    Reject what Anthropic rejects about thinking: a thinking block whose
    signature this upstream did not make (any ``redacted_thinking`` block:
    this model never redacts), and, with thinking on, a tool loop whose final
    assistant message does not start with a thinking block (today's API:
    ``manual_only``, with manual ``enabled`` thinking only).

    :raises Rejection: for the first fault.
    """
    messages = body["messages"]
    for n, message in enumerate(messages):
        for m, block in enumerate(blocks_of(message)):
            kind = block.get("type")
            if kind == "thinking":
                text, signature = block.get("thinking"), block.get("signature")
                if not (isinstance(text, str) and isinstance(signature, str)
                        and hmac.compare_digest(signature, sign_thinking(secret, text))):
                    raise invalid(f"messages.{n}.content.{m}: Invalid `signature` in `thinking` block")
            elif kind == "redacted_thinking":
                raise invalid(f"messages.{n}.content.{m}: Invalid `data` in `redacted_thinking` block")
    thinking = body.get("thinking")
    if not _thinking_on(body) or manual_only and not (isinstance(thinking, dict) and thinking["type"] == "enabled"):
        return
    last = next((n for n in range(len(messages) - 1, -1, -1) if messages[n].get("role") == "assistant"), None)
    if last is None or not any(
        block.get("type") == "tool_result" for message in messages[last + 1:] for block in blocks_of(message)
    ):
        return
    content = messages[last].get("content")
    first = content[0].get("type") if isinstance(content, list) and content and isinstance(content[0], dict) \
        else "text"
    if first not in ("thinking", "redacted_thinking"):
        raise invalid(
            f"messages.{last}.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
            f"`{first}`. When `thinking` is enabled, a final `assistant` message must start with a thinking "
            "block (preceeding the lastmost set of `tool_use` and `tool_result` blocks). We recommend you "
            "include thinking blocks from previous turns. To avoid this requirement, disable `thinking`. "
            "Please consult our documentation at "
            "https://docs.claude.com/en/docs/build-with-claude/extended-thinking"
        )


def _unexpected_result(n: int, m: int, block: dict) -> Rejection:
    if block["type"] == "tool_result":
        return invalid(
            f"messages.{n}.content.{m}: unexpected `tool_use_id` found in `tool_result` "
            f"blocks: {block.get('tool_use_id')}. Each `tool_result` block must have a "
            "corresponding `tool_use` block in the previous message."
        )
    # Anthropic's wording for a server-tool result without its call is not
    # known; this follows the tool_result sentence.
    return invalid(
        f"messages.{n}.content.{m}: unexpected `tool_use_id` found in `{block['type']}` "
        f"blocks: {block.get('tool_use_id')}. Each `{block['type']}` block must have a "
        "corresponding `server_tool_use` block before it in the same message."
    )


def check_strict_ids(messages: Sequence[dict], *, check_pattern: bool = True) -> None:
    """
    Reject tool ids the way a stateless, strict backend does.

    Declarations must match their type's pattern and be unique across the
    whole history; a ``tool_result`` must answer a ``tool_use`` of the
    previous message; every ``tool_use`` of an assistant message must be
    answered in the next message; a server-tool result must follow its
    ``server_tool_use`` in the same message.  ``messages`` must already have
    passed :func:`check_shape`.

    :param check_pattern: check ``tool_use`` ids against Anthropic's pattern
        (off when the upstream has a pattern of its own,
        :func:`check_id_pattern`).
    :raises Rejection: for the first fault in walk order.
    """
    seen: set[str] = set()
    previous_calls: list[str] = []
    for n, message in enumerate(messages):
        calls: list[str] = []
        answered: set[str] = set()
        for m, block in enumerate(blocks_of(message)):
            if declares_tool_use(block):
                if check_pattern or block["type"] != "tool_use":
                    _check_declaration_pattern(n, m, block)
                if block["id"] in seen:
                    raise invalid(f"messages.{n}.content.{m}: `tool_use` ids must be unique")
                seen.add(block["id"])
                calls.append(block["id"])
            elif is_reference(block):
                target = block["tool_use_id"]
                if block["type"] == "tool_result":
                    if not isinstance(target, str) or (check_pattern and _TOOL_USE_RE.fullmatch(target) is None):
                        raise invalid(
                            f"messages.{n}.content.{m}.tool_result.tool_use_id: "
                            f"String should match pattern '{_TOOL_USE_PATTERN}'"
                        )
                    if target not in previous_calls:
                        raise _unexpected_result(n, m, block)
                    answered.add(target)
                elif target not in calls:
                    raise _unexpected_result(n, m, block)
        missing = [call for call in previous_calls if call not in answered]
        if missing:
            raise invalid(
                f"messages.{n - 1}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {', '.join(missing)}. Each `tool_use` block must have "
                "a corresponding `tool_result` block in the next message."
            )
        previous_calls = [
            block["id"]
            for block in blocks_of(message)
            if block.get("type") == "tool_use" and message.get("role") == "assistant"
        ]


class ConversationLedger:
    """
    What a stateful backend remembers: per conversation, the declaration ids
    it issued, in walk order.

    Such a backend accepts duplicate ids (it matches results to calls by
    occurrence order), but it notices any id it did not issue for a block:
    a relay that mangles ids towards it is caught.

    :param capacity: conversations kept; the least recently used go first.
    """

    def __init__(self, capacity: int = 1024):
        self._capacity = capacity
        self._issued: OrderedDict[str, list[str]] = OrderedDict()

    def issued(self, key: str) -> list[str] | None:
        """The ids issued in conversation ``key``, or ``None`` if unknown."""
        ids = self._issued.get(key)
        return None if ids is None else list(ids)

    def check(self, key: str, messages: Sequence[dict]) -> None:
        """
        Reject a history that does not carry exactly the issued ids.

        :raises Rejection: for the first fault in walk order.
        """
        issued = self._issued.get(key)
        known = set(issued or ())
        position = 0
        previous_calls: Counter[str] = Counter()
        for n, message in enumerate(messages):
            calls: Counter[str] = Counter()
            for m, block in enumerate(blocks_of(message)):
                where = f"messages.{n}.content.{m}"
                if declares_tool_use(block):
                    value = block.get("id")
                    if issued is None:
                        raise invalid(
                            f"{where}: `{block['type']}` id {value} belongs to no "
                            "conversation this server knows"
                        )
                    if not isinstance(value, str) or value not in known:
                        raise invalid(f"{where}: `{block['type']}` id {value} was never issued")
                    expected = issued[position] if position < len(issued) else None
                    if value != expected:
                        raise invalid(
                            f"{where}: `{block['type']}` id {value} is not the id issued "
                            f"for this block (expected {expected})"
                        )
                    position += 1
                    calls[value] += 1
                elif is_reference(block):
                    target = block["tool_use_id"]
                    if not isinstance(target, str) or target not in known:
                        raise invalid(f"{where}: `tool_use_id` {target} was never issued")
                    # Results are matched to calls by occurrence order: each
                    # consumes one open call with its id.
                    open_calls = previous_calls if block["type"] == "tool_result" else calls
                    if open_calls[target] < 1:
                        raise _unexpected_result(n, m, block)
                    open_calls[target] -= 1
            previous_calls = calls if message.get("role") == "assistant" else Counter()

    def record(self, key: str, ids: Sequence[str]) -> None:
        """
        Remember ``ids`` (the history's declarations then the answer's) as
        conversation ``key``.  A retried or edited turn overwrites what
        followed it.
        """
        self._issued[key] = list(ids)
        self._issued.move_to_end(key)
        while len(self._issued) > self._capacity:
            self._issued.popitem(last=False)


# -- the fake model -----------------------------------------------------------


def _random_id(prefix: str, rng: random.Random) -> str:
    return prefix + "".join(rng.choice(_BASE62) for _ in range(22))


def _client_tools(body: dict) -> list[dict]:
    return callable_tools(body)


def _value_for(schema: Any, rng: random.Random, depth: int) -> Any:
    schema = schema if isinstance(schema, dict) else {}
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = kind[0] if kind else None
    if kind == "integer":
        return rng.randint(1, 500)
    if kind == "number":
        return round(rng.uniform(0, 100), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array" and depth < 3:
        return [_value_for(schema.get("items"), rng, depth + 1) for _ in range(rng.randint(1, 2))]
    if kind == "object" and depth < 3:
        return _input_for(schema, rng, depth + 1)
    return rng.choice(_WORDS)


def _input_for(schema: Any, rng: random.Random, depth: int = 0) -> dict:
    schema = schema if isinstance(schema, dict) else {}
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return {}
    required = schema.get("required")
    required = set(required) if isinstance(required, list) else set()
    return {
        name: _value_for(prop, rng, depth)
        for name, prop in properties.items()
        if name in required or rng.random() < 0.5
    }


class _IdSource:
    """
    Chooses the ids of one answer, as a model that copies from its context.

    :ivar answer_ids: ids this answer has declared so far, by block type.
    """

    def __init__(self, options: ModelOptions, messages: list, rng: random.Random):
        self._options = options
        self._rng = rng
        self._history = {
            kind: [value for value in declaration_ids(messages, kind) if isinstance(value, str)]
            for kind in ("tool_use", "server_tool_use")
        }
        self._calls = {kind: len(ids) for kind, ids in self._history.items()}
        self.answer_ids: dict[str, list[str]] = {"tool_use": [], "server_tool_use": []}

    def next_id(self, kind: str, name: str) -> str:
        self._calls[kind] += 1
        if kind == "tool_use" and self._options.id_style == "kimi":
            # Kimi-family models number calls within the turn, so the same
            # ids come back every turn; no copying is needed to collide.
            chosen = f"functions.{name}:{len(self.answer_ids[kind])}"
        else:
            chosen = self._copied(kind) or self._lookalike(kind) or self._fresh(kind)
        self.answer_ids[kind].append(chosen)
        return chosen

    def _copied(self, kind: str) -> str | None:
        every = self._options.reuse_every
        if not every or self._calls[kind] % every:
            return None
        history, answer = self._history[kind], self.answer_ids[kind]
        if answer and (not history or self._rng.random() < 0.5):
            return self._rng.choice(answer)
        return self._rng.choice(history) if history else None

    def _lookalike(self, kind: str) -> str | None:
        history = self._history[kind]
        if not self._options.lookalikes or not history or self._rng.random() >= 1 / 3:
            return None
        separator = "-" if kind == "tool_use" else "_"
        candidate = self._rng.choice(history) + separator + "2"
        if candidate in history or candidate in self.answer_ids[kind]:
            return None
        return candidate

    def _fresh(self, kind: str) -> str:
        prefix = "toolu_01" if kind == "tool_use" else "srvtoolu_01"
        return _random_id(prefix, self._rng)


def _estimate_tokens(value: Any) -> int:
    # The length of JSON does not depend on key order: no sorting needed.
    return max(1, len(ujson.dumps(value, ensure_ascii=False)) // 4)


def count_tokens(body: Any) -> int:
    """The input-token count the fake model reports for ``body``."""
    if not isinstance(body, dict):
        return 1
    return _estimate_tokens([body.get("system"), prompt_tools(body), body.get("messages")])


def _tool_choice_allows_tools(body: dict) -> bool:
    choice = body.get("tool_choice")
    return not (isinstance(choice, dict) and choice.get("type") == "none")


def _chosen_tool(body: dict, tools: list[dict], rng: random.Random) -> dict:
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "tool":
        for tool in tools:
            if tool["name"] == choice.get("name"):
                return tool
    return rng.choice(tools)


def _server_tool_blocks(ids: _IdSource, rng: random.Random) -> list[dict]:
    query = rng.choice(_SEARCHES)
    call_id = ids.next_id("server_tool_use", "web_search")
    page = rng.randint(1, 999)
    return [
        {"type": "server_tool_use", "id": call_id, "name": "web_search", "input": {"query": query}},
        {
            "type": "web_search_tool_result",
            "tool_use_id": call_id,
            "content": [
                {
                    "type": "web_search_result",
                    "url": f"https://example.com/results/{page}",
                    "title": f"Résultat {page}: {query}",
                    "encrypted_content": _random_id("Eu", rng),
                    "page_age": None,
                }
            ],
        },
    ]


def _offers_web_fetch(body: dict) -> bool:
    """The request offers the web fetch server tool (a ``web_fetch_*`` tool)."""
    tools = body.get("tools")
    return isinstance(tools, list) and any(
        isinstance(tool, dict) and str(tool.get("type", "")).startswith("web_fetch") for tool in tools
    )


def _web_fetch_blocks(ids: _IdSource, rng: random.Random) -> list[dict]:
    page = rng.randint(1, 999)
    call_id = ids.next_id("server_tool_use", "web_fetch")
    url = f"https://example.com/pages/{page}"
    return [
        {"type": "server_tool_use", "id": call_id, "name": "web_fetch", "input": {"url": url}},
        {
            "type": "web_fetch_tool_result",
            "tool_use_id": call_id,
            "content": {
                "type": "web_fetch_result",
                "url": url,
                "content": {
                    "type": "document",
                    "source": {"type": "text", "media_type": "text/plain", "data": f"Page {page}: {rng.choice(_WORDS)}"},
                },
                "retrieved_at": "2026-12-01T12:00:00Z",
            },
        },
    ]


def compose_answer(body: Any, options: ModelOptions) -> dict:
    """
    The assistant message the fake model answers ``body`` with.

    With client tools in the request: a short text block then
    ``options.parallel`` ``tool_use`` blocks (``stop_reason`` ``tool_use``);
    without: a text answer (``end_turn``).  ``options.server_tools`` adds a
    web search and its result, and a web fetch with its result when the
    request offers the ``web_fetch`` tool.  Deterministic in
    ``options.seed`` and the request's content.
    """
    body = body if isinstance(body, dict) else {}
    messages = messages_of(body)
    rng = request_rng(options.seed, body)
    ids = _IdSource(options, messages, rng)
    tools = _client_tools(body) if _tool_choice_allows_tools(body) else []
    step = len(messages) // 2 + 1
    content: list[dict] = []
    if options.thinking_secret is not None and _thinking_on(body):
        thought = f"Step {step}: {rng.choice(_WORDS)} — what next?"
        content.append({"type": "thinking", "thinking": thought,
                        "signature": sign_thinking(options.thinking_secret, thought)})
    if options.server_tools:
        content.extend(_server_tool_blocks(ids, rng))
        if _offers_web_fetch(body):
            content.extend(_web_fetch_blocks(ids, rng))
    if tools:
        content.append({"type": "text", "text": f"{rng.choice(_TOOL_PHRASES)} (step {step})"})
        for call in range(options.parallel):
            tool = _chosen_tool(body, tools, rng)
            block = {
                "type": "tool_use",
                "id": ids.next_id("tool_use", tool["name"]),
                "name": tool["name"],
                "input": _input_for(tool.get("input_schema"), rng),
            }
            left_out = options.left_out_ids
            if left_out == "some":
                left_out = ("empty", "absent", "never", "never")[(step + call) % 4]
            if left_out == "empty":
                block["id"] = ""
            elif left_out == "absent":
                del block["id"]
            content.append(block)
        stop_reason = "tool_use"
    else:
        content.append({"type": "text", "text": f"{rng.choice(_FINAL_PHRASES)} (step {step})"})
        stop_reason = "end_turn"
    model = body.get("model")
    return {
        "id": _random_id("msg_01", rng),
        "type": "message",
        "role": "assistant",
        "model": model if isinstance(model, str) else MODELS[0]["id"],
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": count_tokens(body), "output_tokens": _estimate_tokens(content)},
    }
