# -*- test-case-name: tests.test_simulated_openai_chat -*-
"""
A simulated OpenAI Chat Completions upstream, in the dialect of one vendor
(``openai``, ``deepseek``, ``kimi``, ``gemini``, ``groq``, ``mistral``,
``openrouter``), on top of a :class:`SimulatedUpstream` (the same fake
model: its tool calls, its id reuse, its usage and prompt cache).

``POST .../chat/completions`` (any prefix: ``/v1``, Gemini's
``/v1beta/openai``, Groq's ``/openai/v1``, OpenRouter's ``/api/v1``) with
``Authorization: Bearer <key>``; streamed as OpenAI streams (``data:``
lines, no event names, ``data: [DONE]``), usage in a stream only when
``stream_options.include_usage`` asks (Mistral and OpenRouter always).
What each dialect refuses, in its words: :mod:`.openai_chat_dialects`; the
reasoning each emits and requires back, and the tally of what came back:
:mod:`.openai_chat_reasoning`; the converters: :mod:`.openai_chat_convert`.
"""

from __future__ import annotations

import hmac
import secrets
from collections import deque
from dataclasses import dataclass
from typing import Any

import ujson
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET

from twisted_relay._json import to_json
from twisted_relay.logs import bounded
from twisted_relay.simulated.base import Rejection, seeded_rng
from twisted_relay.simulated.model import plan_chunks
from twisted_relay.simulated.openai_chat_convert import (
    TOOL_INDEX_MODES,
    calls_of,
    chat_usage,
    completion_id,
    completion_of,
    encode_stream,
    history_ids,
    metered,
    one_call,
    stream_chunks,
    text_of,
    to_anthropic,
)
from twisted_relay.simulated.openai_chat_dialects import DIALECTS, ChatRefusal, check_request, refusal, thinking_on
from twisted_relay.simulated.openai_chat_reasoning import (
    DEFAULT_CHAT_SECRET,
    Reasoner,
    ReasoningTally,
    chat_conversation_key,
    check_reasoning,
)
from twisted_relay.simulated.resource import MAX_BODY, PacedWriter, ReceivedRequest, SimulatedUpstream

__all__ = ["ChatAnswer", "SimulatedOpenAIChat"]

# GPT models that reason unless told ``reasoning_effort: "none"``.
_REASONING_MODELS = ("gpt-5", "gpt-6", "o3", "o4")


@dataclass
class ChatAnswer:
    """
    One answer of the simulated Chat upstream.

    :ivar completion: the chat completion (the non-streaming body).
    :ivar message: the fake model's Anthropic answer it was made from.
    :ivar usage: the usage reported (``completion["usage"]``).
    :ivar metered: the same in Anthropic's terms (what a relay should meter).
    :ivar conversation: the conversation it belongs to.
    """

    completion: dict
    message: dict
    usage: dict
    metered: dict
    conversation: str


class SimulatedOpenAIChat:
    """
    A Chat Completions upstream of one dialect, simulated.

    :param dialect: one of ``openai``, ``deepseek``, ``kimi``, ``gemini``,
        ``groq``, ``mistral``, ``openrouter``.
    :param upstream: the fake model (lenient: the ids are the dialect's to
        check; Kimi's with ``id_style="kimi"``); its ``seed``, ``reuse_every``,
        ``parallel``, ``left_out_ids``, ``split``, ``event_delay``,
        ``line_ending``, ``stream_errors``, ``stream_cuts`` apply, and its
        ``reported`` tally counts what this upstream reported.  By default a
        lenient one of its own.
    :param keys: the API keys taken (``None``: any).
    :param accounts: key to account name (a key not listed is an account of
        its own): the prompt cache and Gemini's and OpenRouter's signatures
        are the account's.
    :param secret: what reasoning is derived from (instances with one secret
        accept each other's).
    :param tool_call_index: ``present``, ``missing`` or ``duplicated``: how
        streamed tool calls carry their ``index``.
    :param late_ids: a streamed tool call's id comes with its second delta,
        not its first.
    :param reactor: the clock of the default upstream.
    :param keep_requests: how many requests :attr:`requests` keeps.

    :ivar requests: the last requests received (:class:`ReceivedRequest`).
    :ivar reasoning: per conversation, whether every turn sent its own
        reasoning back (:class:`~.openai_chat_reasoning.ReasoningTally`).
    :ivar reported: the upstream's usage tally, fed in Anthropic's terms
        (:func:`~.openai_chat_convert.metered`).
    :ivar answers: the last :class:`ChatAnswer`.
    """

    log = Logger()

    def __init__(
        self,
        dialect: str = "openai",
        upstream: SimulatedUpstream | None = None,
        *,
        keys: Any = None,
        accounts: dict[str, str] | None = None,
        secret: str | None = None,
        tool_call_index: str = "present",
        late_ids: bool = False,
        reactor: IReactorTime | None = None,
        keep_requests: int = 100,
    ):
        if dialect not in DIALECTS:
            raise ValueError("dialect must be one of " + ", ".join(DIALECTS))
        if tool_call_index not in TOOL_INDEX_MODES:
            raise ValueError("tool_call_index must be one of " + ", ".join(TOOL_INDEX_MODES))
        if upstream is None:
            upstream = SimulatedUpstream(mode="lenient", id_style="kimi" if dialect == "kimi" else "toolu",
                                         reactor=reactor)
        if upstream.mode != "lenient":
            raise ValueError("the fake model must be lenient: the dialect checks the ids")
        if (dialect == "kimi") != (upstream.options.id_style == "kimi"):
            raise ValueError("the kimi dialect, and it alone, needs the fake model's id_style='kimi'")
        self.dialect = DIALECTS[dialect]
        self.upstream = upstream
        self.keys = None if keys is None else frozenset(keys)
        self.accounts = dict(accounts or {})
        self.reasoner = Reasoner(secret or DEFAULT_CHAT_SECRET)
        self.tool_call_index = tool_call_index
        self.late_ids = late_ids
        self.requests: deque[ReceivedRequest] = deque(maxlen=keep_requests)
        self.answers: deque[ChatAnswer] = deque(maxlen=keep_requests)
        self.reasoning = ReasoningTally()
        self.reported = upstream.reported

    def resource(self) -> IResource:
        """The root resource: ``POST .../chat/completions``; anything else is a 404."""
        return _ChatResource(self)

    # -- checks -----------------------------------------------------------------

    def authenticate(self, headers: dict[str, str]) -> str:
        """
        The key of ``Authorization: Bearer <key>``.

        :raises ChatRefusal: 401 without one, or with a key not taken (the
            key itself is never in the error).
        """
        authorization = headers.get("authorization", "")
        key = authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
        name = self.dialect.name
        if not key:
            raise refusal(name, "You didn't provide an API key. You need to provide your API key in an "
                          "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).", 401)
        if self.keys is not None and not any(hmac.compare_digest(key.encode(), known.encode()) for known in self.keys):
            raise refusal(name, "Incorrect API key provided.", 401, code="invalid_api_key")
        return key

    def account_of(self, key: str) -> str:
        """The account of ``key``."""
        return self.accounts.get(key, "key:" + key)

    def _reasoning_tokens(self, body: dict, reasoning: Any) -> int:
        if reasoning is not None:
            return reasoning.tokens
        model = body["model"]
        effort = body.get("reasoning_effort")
        if self.dialect.name == "openai" and model.startswith(_REASONING_MODELS) and effort != "none":
            # GPT reasons unseen: only its tokens are reported.
            return 16 + seeded_rng(self.upstream.options.seed, "hidden reasoning", body["messages"]).randrange(200)
        return 0

    # -- answering ----------------------------------------------------------------

    def answer(self, body: Any, headers: dict[str, str], raw: bytes = b"") -> ChatAnswer:
        """
        Check a Chat request as the dialect does, and answer it.

        :raises ChatRefusal: in the dialect's words and envelope.
        """
        dialect = self.dialect
        key = self.authenticate(headers)
        messages = check_request(dialect, body, raw)
        account = self.account_of(key)
        conversation = chat_conversation_key(headers, messages)
        verdicts, refused = check_reasoning(dialect, body, messages, self.reasoner, account)
        if dialect.required is not None and thinking_on(dialect, body):
            self.reasoning.checked(conversation, verdicts, refused is not None)
        if refused is not None:
            raise refused
        try:
            message, turn = self.upstream.answer_turn(to_anthropic(body, messages), {"x-api-key": account})
        except Rejection as rejection:
            raise refusal(dialect.name, rejection.message, rejection.status)
        if turn is not None:
            turn.answered(message)
        if body.get("parallel_tool_calls") is False:
            message = one_call(message)
        calls = calls_of(message, dialect, history_ids(messages))
        reasoning = None
        if thinking_on(dialect, body):
            reasoning = self.reasoner.of(dialect, account, calls, text_of(message))
            if calls and dialect.required is not None:
                self.reasoning.emitted(conversation, reasoning.digest)
        usage = chat_usage(dialect, message["usage"], self._reasoning_tokens(body, reasoning))
        completion = completion_of(
            dialect, message, calls, reasoning, usage, model=body["model"],
            created=int(self.upstream.reactor.seconds()), answer_id=completion_id(dialect),
            reasoning_format=body.get("reasoning_format"),
        )
        answer = ChatAnswer(completion, message, usage, metered(dialect, usage), conversation)
        self.answers.append(answer)
        return answer

    def tally(self, body: dict, answer: ChatAnswer, *, stream: bool, whole: bool) -> None:
        """Count ``answer``'s usage as reported (in Anthropic's terms) in :attr:`reported`."""
        user = body.get("safety_identifier") or body.get("user")
        self.reported.add({"metadata": {"user_id": user}}, {"model": body["model"]}, answer.metered,
                          stream=stream, whole=whole)


def _headers_of(request: IRequest) -> dict[str, str]:
    return {
        name.decode("latin-1").lower(): ", ".join(value.decode("latin-1") for value in values)
        for name, values in request.requestHeaders.getAllRawHeaders()
    }


def _parse(raw: bytes) -> Any:
    try:
        return ujson.loads(raw) if raw else None
    except ValueError:
        return None


class _ChatResource(Resource):
    """Routes every path; state lives on the :class:`SimulatedOpenAIChat`."""

    isLeaf = True
    log = Logger()

    def __init__(self, chat: SimulatedOpenAIChat):
        super().__init__()
        self._chat = chat

    def render(self, request: IRequest) -> bytes | int:
        chat = self._chat
        method = request.method.decode("latin-1")
        path = request.path.decode("utf-8", "replace")
        headers = _headers_of(request)
        raw = request.content.read() if request.content is not None else b""
        body = _parse(raw) if len(raw) <= MAX_BODY else None
        chat.requests.append(ReceivedRequest(method, request.uri.decode("utf-8", "replace"), headers, body))
        request.setHeader(b"x-request-id", ("req_" + secrets.token_hex(16)).encode("ascii"))
        name = chat.dialect.name
        try:
            if method != "POST" or not path.endswith("/chat/completions"):
                raise refusal(name, f"Invalid URL ({method} {path})", 404)
            if len(raw) > MAX_BODY:
                raise refusal(name, "Request too large.", 413)
            answer = chat.answer(body, headers, raw)
        except ChatRefusal as refused:
            self.log.debug("{path} refused: {status} {message}", path=path, status=refused.status,
                           message=bounded(refused.message))
            request.setResponseCode(refused.status)
            request.setHeader(b"content-type", b"application/json")
            return refused.body
        if body.get("stream") is True:
            return self._stream(request, body, answer)
        chat.tally(body, answer, stream=False, whole=True)
        request.setHeader(b"content-type", b"application/json")
        return to_json(answer.completion)

    def _stream(self, request: IRequest, body: dict, answer: ChatAnswer) -> int:
        chat = self._chat
        upstream = chat.upstream
        message = answer.message
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        cut = upstream.cuts_stream(message)
        drop = not cut and upstream.drops_stream(message)
        seed = upstream.options.seed
        key = answer.completion["choices"][0]["message"]
        chunks = stream_chunks(chat.dialect, answer.completion, seeded_rng(seed, "chat deltas", key),
                               include_usage=include_usage, index_mode=chat.tool_call_index,
                               late_ids=chat.late_ids, cut=cut)
        data, starts = encode_stream(chunks, upstream.line_ending, done=not cut)
        ends = [*starts[1:], len(data)]
        # The bytes up to the end of the chunk that carries the usage report it.
        usage_at = next((ends[i] for i, item in enumerate(chunks)
                         if isinstance(item, dict) and item.get("usage")), None)
        whole_length = len(data)
        if drop:
            data = data[: seeded_rng(seed, "chat cut at", key).randrange(ends[0], len(data))]
            starts = [start for start in starts if start < len(data)]
        rng = seeded_rng(seed, "chat chunks", key) if upstream.split else None
        pieces = [(index * upstream.event_delay, piece) for index, piece in plan_chunks(data, starts, rng)]
        request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
        request.setHeader(b"cache-control", b"no-cache")
        writer = PacedWriter(request, pieces, upstream.reactor, drop=drop)

        def ended(whole: bool) -> None:
            if usage_at is not None and writer.written >= usage_at:
                chat.tally(body, answer, stream=True, whole=whole and not cut and writer.written == whole_length)

        writer.on_end = ended
        writer.start()
        return NOT_DONE_YET
