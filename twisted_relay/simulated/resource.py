# -*- test-case-name: tests.test_simulated -*-
"""
The simulated upstream as a twisted.web resource.

:class:`SimulatedUpstream` holds the options and the little state a backend
has (the stateful ledger, the last requests received); its
:meth:`~SimulatedUpstream.resource` is the root resource to serve, in a
:class:`twisted.web.server.Site` of its own or mounted in another one.
"""

from __future__ import annotations

import dataclasses
import hmac
import re
import secrets
from collections import deque
from typing import Any, NamedTuple
from urllib.parse import parse_qs

import ujson
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET
from zope.interface import implementer

from twisted_relay._json import to_json
from twisted_relay.errors import error_body
from twisted_relay.logs import bounded
from twisted_relay.message_threads.model import ThreadError
from twisted_relay.simulated.message_threads import SimulatedThreads, ThreadTurn
from twisted_relay.simulated.model import (
    LINE_ENDINGS,
    MODELS,
    MODES,
    ConversationLedger,
    ModelOptions,
    Rejection,
    check_id_pattern,
    check_shape,
    check_strict_ids,
    check_thinking,
    compose_answer,
    conversation_key,
    count_tokens,
    declaration_ids,
    encode_events,
    message_events,
    plan_chunks,
    seeded_rng,
)
from twisted_relay.simulated.thinking import DEFAULT_SECRET
from twisted_relay.simulated.today import APIS, TodayRules, fallback_model_of, family_of, rare_answer
from twisted_relay.simulated.usage import PromptCache, UsageTally, delta_usage, start_usage

__all__ = ["MAX_BODY", "PacedWriter", "ReceivedRequest", "SimulatedUpstream", "StreamPlan", "get_model", "list_models"]

#: Anthropic's request body limit.
MAX_BODY = 32 * 1024 * 1024

_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


class ReceivedRequest(NamedTuple):
    """
    One request as the simulated upstream received it.

    :ivar method: e.g. ``"POST"``.
    :ivar path: the request target as sent, query string included
        (``/v1/messages?beta=true``).
    :ivar headers: lower-case names; repeated headers joined with ``", "``.
    :ivar body: the parsed JSON body, or ``None`` (empty or not JSON).
    """

    method: str
    path: str
    headers: dict[str, str]
    body: Any


def _json(value: Any) -> bytes:
    return to_json(value)


class SimulatedUpstream:
    """
    A fake Anthropic Messages backend whose model reuses tool-use ids.

    :param mode: ``strict`` (reject what a stateless backend rejects),
        ``stateful`` (remember issued ids, demand them back exactly) or
        ``lenient`` (accept anything).
    :param seed: every answer is a function of the seed and the request.
    :param reuse_every: every ``reuse_every``-th tool call of a conversation
        copies an id from its history (0: never).
    :param id_style: ``toolu`` or ``kimi`` (``functions.<name>:<idx>``).
    :param event_delay: seconds between two SSE events.
    :param split: write streams in pieces cut at odd places.
    :param reactor: the clock that paces streams; the global reactor when
        ``None``.  Streams are always written from timers, so with an
        in-memory client pass a ``Clock`` and advance it.
    :param parallel: ``tool_use`` blocks per answer.
    :param server_tools: add a web search and its result to every answer.
    :param lookalikes: sometimes emit ``X-2`` natively, ``X`` from the history.
    :param line_ending: ``"\\n"``, ``"\\r\\n"`` or ``"\\r"`` in streams.
    :param require_key: if set, requests must carry it in ``x-api-key`` or
        ``Authorization: Bearer``.
    :param keep_requests: how many requests :attr:`requests` keeps.
    :param threads: how message threads are treated: ``ignore`` (the
        ``thread`` field is ignored), ``rejects`` (400 naming the field) or
        ``knows`` (kept and honoured); see
        :mod:`twisted_relay.simulated.message_threads`.
    :param id_pattern: a regular expression every ``tool_use`` id and
        ``tool_result.tool_use_id`` must match (in every mode; strict mode
        otherwise checks Anthropic's ``^[a-zA-Z0-9_-]+$``).
    :param left_out_ids: ``never``, ``empty``, ``absent`` or ``some``: emit
        ``tool_use`` blocks with an empty or no id.
    :param thinking_secret: sign thinking blocks with it (the answer to a
        request with thinking on starts with one) and refuse, in every mode,
        thinking it did not sign and a tool loop whose final assistant
        message does not start with thinking, as Anthropic does.  Today's
        models sign with it too (with a fixed default when it is ``None``).
    :param api: ``"2026-12"`` (today's API: model families, bound thinking,
        both API versions, a fresh ``msg_`` id and today's usage fields; see
        :mod:`twisted_relay.simulated.today`) or ``"2025"`` (the year-old
        behaviour, whole).
    :param accounts: API key to account name, for account-bound thinking
        (two keys of one account read each other's thinking); a key not
        listed is an account of its own.
    :param binding_default: ``"error"`` (an account created since
        2026-08-31: a changed prefix is a 400 unless the request asks to drop
        the block) or ``"allow"`` (an older account).
    :param stream_errors: the share of streamed answers (seeded by their
        content) cut after their first block by an ``error`` event
        (``overloaded_error``); 0 never, 1 always.
    :param refusals: the share of today's models' answers (seeded by the
        request) that are a ``refusal`` with ``stop_details``; 0 never.
    :param compactions: likewise, answers that are a ``compaction`` block
        (``stop_reason`` ``compaction``).
    :param stream_cuts: the share of streamed answers (seeded by their
        content) whose connection drops midway, at a seeded byte after the
        ``message_start`` event and before the end: no ``message_stop``, no
        end of the body; 0 never, 1 always.
    :param keep_reports: how many answers :attr:`reported` keeps.

    :ivar requests: the last requests received, oldest first, as
        :class:`ReceivedRequest`.
    :ivar reported: what the upstream reported as usage, answer by answer
        (the last ``keep_reports``) and in total by user and model
        (:class:`~twisted_relay.simulated.usage.UsageTally`): a stream
        counts what it sent before it ended, was cut or lost its client.
    :ivar prompt_cache: today's prompt cache
        (:class:`~twisted_relay.simulated.usage.PromptCache`).
    """

    def __init__(
        self,
        mode: str = "strict",
        seed: int = 0,
        reuse_every: int = 3,
        id_style: str = "toolu",
        event_delay: float = 0.0,
        split: bool = True,
        reactor: IReactorTime | None = None,
        *,
        parallel: int = 1,
        server_tools: bool = False,
        lookalikes: bool = False,
        line_ending: str = "\n",
        require_key: str | None = None,
        keep_requests: int = 100,
        threads: str = "ignore",
        id_pattern: str | None = None,
        left_out_ids: str = "never",
        thinking_secret: str | None = None,
        api: str = "2026-12",
        accounts: dict[str, str] | None = None,
        binding_default: str = "error",
        stream_errors: float = 0.0,
        refusals: float = 0.0,
        compactions: float = 0.0,
        stream_cuts: float = 0.0,
        keep_reports: int = 100,
    ):
        if api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}")
        shares = (("stream_errors", stream_errors), ("refusals", refusals), ("compactions", compactions),
                  ("stream_cuts", stream_cuts))
        for name, share in shares:
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        if event_delay < 0:
            raise ValueError("event_delay must be 0 or more")
        if line_ending not in LINE_ENDINGS:
            raise ValueError("line_ending must be one of \\n, \\r\\n, \\r")
        self.mode = mode
        self.options = ModelOptions(
            seed=seed,
            reuse_every=reuse_every,
            id_style=id_style,
            parallel=parallel,
            server_tools=server_tools,
            lookalikes=lookalikes,
            left_out_ids=left_out_ids,
            thinking_secret=thinking_secret,
        )
        if id_pattern is not None:
            re.compile(id_pattern)
        self.id_pattern = id_pattern
        self.event_delay = event_delay
        self.split = split
        self.line_ending = line_ending
        self.requests: deque[ReceivedRequest] = deque(maxlen=keep_requests)
        self._reactor = reactor
        self._require_key = require_key
        self._ledger = ConversationLedger()
        self.threads = SimulatedThreads(threads, lambda: self.reactor)
        self.api = api
        self.stream_errors = stream_errors
        self.stream_cuts = stream_cuts
        self.reported = UsageTally(keep_reports)
        self.prompt_cache = PromptCache()
        self.rare = (("refusal", refusals), ("compaction", compactions))
        self.today: TodayRules | None = None
        if api == "2026-12":
            self.today = TodayRules(
                thinking_secret or DEFAULT_SECRET, thinking_secret, accounts, binding_default
            )
        # Today's models think by today's rules, not by the year-old option.
        self._today_options = dataclasses.replace(self.options, thinking_secret=None)

    def resource(self) -> IResource:
        """The root resource: ``/v1/messages``, ``/v1/messages/count_tokens``,
        ``/v1/models`` and ``/v1/models/{id}``; everything else is a 404."""
        return _SimulatedResource(self)

    @property
    def reactor(self) -> IReactorTime:
        """The clock streams are paced with."""
        if self._reactor is None:
            from twisted.internet import reactor

            self._reactor = reactor  # type: ignore[assignment]
        return self._reactor  # type: ignore[return-value]

    # -- the endpoints, on parsed requests ------------------------------------

    def check_key(self, headers: dict[str, str]) -> None:
        """
        Refuse a request without the required key, as Anthropic does.

        :raises Rejection: 401 when a key is required and not presented.
        """
        if self._require_key is None:
            return
        presented = [headers.get("x-api-key")]
        authorization = headers.get("authorization", "")
        if authorization[:7].lower() == "bearer ":
            presented.append(authorization[7:].strip())
        if not any(
            value is not None and hmac.compare_digest(value.encode(), self._require_key.encode())
            for value in presented
        ):
            if presented == [None]:
                raise Rejection(401, "authentication_error", "x-api-key header is required")
            raise Rejection(401, "authentication_error", "invalid x-api-key")

    def _check(self, body: Any, headers: dict[str, str], for_count: bool) -> str | None:
        """
        Validate as the mode demands, and the id pattern and thinking
        signatures when asked for (in every mode); return the stateful
        conversation key.
        """
        if self.id_pattern is not None or (self.options.thinking_secret is not None and not for_count):
            check_shape(body, for_count=for_count, system_role=self._is_today(body))
            if self.id_pattern is not None:
                check_id_pattern(body["messages"], self.id_pattern)
            if self.options.thinking_secret is not None and not for_count and not self._is_today(body):
                check_thinking(body, self.options.thinking_secret, manual_only=self.api == "2026-12")
        if self.mode == "lenient":
            return None
        check_shape(body, for_count=for_count, system_role=self._is_today(body))
        if self.mode == "strict":
            check_strict_ids(body["messages"], check_pattern=self.id_pattern is None)
            return None
        key = conversation_key(headers.get("x-claude-code-session-id"), body)
        self._ledger.check(key, body["messages"])
        return key

    def _is_today(self, body: Any) -> bool:
        """The request is for a model of today's API, and this upstream speaks it."""
        return self.today is not None and isinstance(body, dict) and family_of(body.get("model")) is not None

    def _prepare(self, body: Any, headers: dict[str, str], for_count: bool) -> Any:
        """Today's checks (``None`` under the year-old API)."""
        if self.today is None or not isinstance(body, dict):
            return None
        if self._is_today(body):
            check_shape(body, for_count=for_count, system_role=self._is_today(body))
        return self.today.prepare(body, headers)

    def _maybe_rare(self, message: dict, body: dict, account: str) -> dict:
        """A refusal or a compaction instead, when the seeded draw says so."""
        draw = seeded_rng(self.options.seed, "rare", body.get("messages")).random()
        for kind, share in self.rare:
            if draw < share:
                fallback = fallback_model_of(body) if kind == "refusal" else None
                # Caches are per model: the fallback model reads its own.
                prompt = None if fallback is None else self._read_prompt(body, account, fallback)
                return rare_answer(message, kind, body, prompt)
            draw -= share
        return message

    def _read_prompt(self, body: dict, account: str, model: str):
        """How ``model`` reads ``body``'s prompt through the prompt cache."""
        return self.prompt_cache.read(
            body, account=account, model=model, total=count_tokens(body), now=self.reactor.seconds()
        )

    def answer(self, body: Any, headers: dict[str, str]) -> dict:
        """
        Validate a Messages request and compose the model's answer; in
        stateful mode, remember the ids it issues.

        :raises Rejection: when the mode rejects the request.
        """
        message, turn = self.answer_turn(body, headers)
        if turn is not None:
            turn.answered(message)
        return message

    def answer_turn(self, body: Any, headers: dict[str, str]) -> tuple[dict, ThreadTurn | None]:
        """
        Like :meth:`answer`, for a request that may be a thread's: the
        answer, and the :class:`ThreadTurn` to settle once it was written
        (``None`` when the request is not a thread).

        :raises Rejection: when the mode rejects the request.
        :raises ThreadError: when the threads refuse it.
        """
        body, turn = self.threads.open(body)
        try:
            key = self._check(body, headers, for_count=False)
            prepared = self._prepare(body, headers, for_count=False)
        except BaseException:
            if turn is not None:
                turn.failed()
            raise
        if prepared is None:
            message = compose_answer(body, self.options)
        else:
            options = self.options if prepared.family is None else self._today_options
            prompt = self._read_prompt(prepared.body, prepared.account, str(prepared.body.get("model")))
            message = self.today.finish(compose_answer(prepared.body, options), prepared, body, prompt)
            if prepared.family is not None:
                message = self._maybe_rare(message, prepared.body, prepared.account)
        if key is not None:
            self._ledger.record(key, declaration_ids(body["messages"]) + declaration_ids([message]))
        return message, turn

    def count(self, body: Any, headers: dict[str, str]) -> dict:
        """Validate a count_tokens request and count it.

        :raises Rejection: when the mode rejects the request.
        """
        self._check(body, headers, for_count=True)
        prepared = self._prepare(body, headers, for_count=True)
        return {"input_tokens": count_tokens(body if prepared is None else prepared.body)}

    def cuts_stream(self, message: dict) -> bool:
        """Whether the stream of ``message`` ends in an ``error`` event
        (``stream_errors``, seeded by the answer's content)."""
        if not self.stream_errors:
            return False
        return seeded_rng(self.options.seed, "stream error", message["content"]).random() < self.stream_errors

    def drops_stream(self, message: dict) -> bool:
        """Whether the connection of ``message``'s stream drops midway
        (``stream_cuts``, seeded by the answer's content)."""
        if not self.stream_cuts:
            return False
        return seeded_rng(self.options.seed, "stream cut", message["content"]).random() < self.stream_cuts

    def stream_pieces(
        self, message: dict, *, cut: bool = False, request_id: str | None = None
    ) -> list[tuple[float, bytes]]:
        """
        The bytes that stream ``message``, as ``(seconds after the start,
        bytes)`` pieces.  The message id (year-old API: drawn from the
        answer's seeded generator) or its content (today's API: the id is
        fresh) seeds where deltas and pieces are cut.

        :param cut: end the stream after its first block with an ``error``
            event (``overloaded_error``) carrying ``request_id``.
        """
        return self.stream_plan(message, cut=cut, request_id=request_id).pieces

    def _reports(self, message: dict) -> tuple[dict, dict]:
        """The usage a stream of ``message`` reports in ``message_start``, then in ``message_delta``."""
        today = self.api != "2025"
        return start_usage(message["usage"], today), delta_usage(message["usage"], today)

    def stream_events(
        self, message: dict, *, cut: bool = False, request_id: str | None = None
    ) -> list[tuple[str, dict]]:
        """
        The Anthropic events that stream ``message``, as ``(name, data)``:
        its usage reported as the API reports it in a stream, its deltas cut
        where the answer's content (year-old API: its id) says.

        :param cut: end after the first block with an ``error`` event
            (``overloaded_error``) carrying ``request_id``.
        """
        key = message["id"] if self.api == "2025" else message["content"]
        events = message_events(message, seeded_rng(self.options.seed, "deltas", key), self._reports(message))
        if cut:
            first_stop = next(i for i, (name, _) in enumerate(events) if name == "content_block_stop")
            error = error_body("overloaded_error", "Overloaded", request_id or _request_id())
            events = [*events[: first_stop + 1], ("error", ujson.loads(error))]
        return events

    def stream_plan(
        self, message: dict, *, cut: bool = False, drop: bool = False, request_id: str | None = None
    ) -> "StreamPlan":
        """
        How ``message`` streams: its pieces (see :meth:`stream_pieces`),
        where the connection drops (``drop``: at a byte drawn from the
        answer's content, after ``message_start`` and before the end) and
        what usage each prefix of the bytes reports.
        """
        seed = self.options.seed
        key = message["id"] if self.api == "2025" else message["content"]
        reports = self._reports(message)
        events = self.stream_events(message, cut=cut, request_id=request_id)
        data, starts = encode_events(events, self.line_ending)
        ends = [*starts[1:], len(data)]
        # What the bytes up to the end of each usage event report.
        reported = [(ends[0], reports[0])]
        for index, (name, _) in enumerate(events):
            if name == "message_delta":
                reported.append((ends[index], {**reports[0], **reports[1]}))
        if drop:
            data = data[: seeded_rng(seed, "cut at", key).randrange(ends[0], len(data))]
            starts = [start for start in starts if start < len(data)]
        rng = seeded_rng(seed, "chunks", key) if self.split else None
        pieces = [(index * self.event_delay, piece) for index, piece in plan_chunks(data, starts, rng)]
        return StreamPlan(pieces, drop, len(data) == ends[-1], reported)


class StreamPlan(NamedTuple):
    """
    How one answer streams.

    :ivar pieces: ``(seconds after the start, bytes)`` to write.
    :ivar drop: the connection drops after the last piece (no end of body).
    :ivar whole: the pieces hold every event, up to ``message_stop``.
    :ivar reported: ``(offset, usage)``: the bytes up to ``offset`` report
        ``usage`` (``message_start``'s, then with ``message_delta``'s laid over).
    """

    pieces: list[tuple[float, bytes]]
    drop: bool
    whole: bool
    reported: list[tuple[int, dict]]

    def usage_sent(self, sent: int) -> dict | None:
        """The usage reported by the first ``sent`` bytes (``None``: none yet)."""
        usage = None
        for offset, reported in self.reported:
            if sent >= offset:
                usage = reported
        return usage


def list_models(query: dict[str, list[str]]) -> dict:
    """
    ``GET /v1/models``: a page of :data:`MODELS`.

    :param query: the parsed query string (``limit``, ``after_id``,
        ``before_id``).
    :raises Rejection: for a bad ``limit`` or an unknown cursor.
    """
    raw_limit = query.get("limit", ["20"])[-1]
    try:
        limit = int(raw_limit)
    except ValueError:
        raise Rejection(400, "invalid_request_error", "limit: Input should be a valid integer")
    if not 1 <= limit <= 1000:
        raise Rejection(400, "invalid_request_error", "limit: Input should be between 1 and 1000")
    ids = [model["id"] for model in MODELS]
    start, end = 0, len(MODELS)
    for name in ("after_id", "before_id"):
        cursor = query.get(name, [None])[-1]
        if cursor is None:
            continue
        if cursor not in ids:
            raise Rejection(404, "not_found_error", f"model: {cursor}")
        if name == "after_id":
            start = ids.index(cursor) + 1
        else:
            end = ids.index(cursor)
    window = list(MODELS[start:end])
    # Paging backwards (before_id alone) keeps the models nearest the cursor.
    page = window[-limit:] if "before_id" in query and "after_id" not in query else window[:limit]
    has_more = len(window) > limit
    return {
        "data": page,
        "has_more": has_more,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }


def get_model(model_id: str) -> dict:
    """``GET /v1/models/{id}``.

    :raises Rejection: 404 for an unknown model.
    """
    for model in MODELS:
        if model["id"] == model_id:
            return model
    raise Rejection(404, "not_found_error", f"model: {model_id}")


def _request_id() -> str:
    # Request ids identify one exchange, so they are unique rather than
    # seeded: a restarted upstream must not reuse them.
    return "req_01" + "".join(secrets.choice(_BASE62) for _ in range(22))


def _headers_of(request: IRequest) -> dict[str, str]:
    return {
        name.decode("latin-1").lower(): ", ".join(value.decode("latin-1") for value in values)
        for name, values in request.requestHeaders.getAllRawHeaders()
    }


class _SimulatedResource(Resource):
    """Routes every path of the simulated API; state lives on the upstream."""

    isLeaf = True
    log = Logger()

    def __init__(self, upstream: SimulatedUpstream):
        super().__init__()
        self._upstream = upstream

    def render(self, request: IRequest) -> bytes | int:
        method = request.method.decode("latin-1")
        path = request.path.decode("utf-8", "replace")
        headers = _headers_of(request)
        raw = request.content.read() if request.content is not None else b""
        # An oversized body is refused below without being parsed.
        body = _parse(raw) if len(raw) <= MAX_BODY else None
        self._upstream.requests.append(
            ReceivedRequest(method, request.uri.decode("utf-8", "replace"), headers, body)
        )
        request.setHeader(b"request-id", _request_id().encode("ascii"))
        try:
            return self._route(request, method, path, headers, raw, body)
        except Rejection as rejection:
            self.log.debug(
                "{method} {path} rejected: {status} {message}",
                method=method,
                path=path,
                status=rejection.status,
                message=bounded(rejection.message),
            )
            return self._error(request, rejection)
        except ThreadError as error:
            request.setResponseCode(error.status)
            request.setHeader(b"content-type", b"application/json")
            request_id = request.responseHeaders.getRawHeaders(b"request-id")[0].decode("ascii")
            return _body_for(request, error.body(request_id))

    def _route(
        self, request: IRequest, method: str, path: str, headers: dict[str, str], raw: bytes, body: Any
    ) -> bytes | int:
        if path in ("/v1/messages", "/v1/messages/count_tokens"):
            allowed = ("POST",)
        elif path == "/v1/models" or path.startswith("/v1/models/") and path.count("/") == 3:
            allowed = ("GET", "HEAD")
        else:
            raise Rejection(404, "not_found_error", "Not Found")
        if method not in allowed:
            raise Rejection(405, "invalid_request_error", f"Method {method} not allowed on {path}")
        self._upstream.check_key(headers)
        if method == "POST":
            if len(raw) > MAX_BODY:
                raise Rejection(
                    413, "request_too_large", "Request exceeds the maximum allowed number of bytes."
                )
            if body is None:
                raise Rejection(
                    400,
                    "invalid_request_error",
                    "There was an error parsing the body of your request: expected JSON",
                )
        if path == "/v1/messages":
            upstream = self._upstream
            message, turn = upstream.answer_turn(body, headers)
            if isinstance(body, dict) and body.get("stream") is True:
                cut = upstream.cuts_stream(message)
                drop = not cut and upstream.drops_stream(message)
                request_id = request.responseHeaders.getRawHeaders(b"request-id")[0].decode("ascii")
                plan = upstream.stream_plan(message, cut=cut, drop=drop, request_id=request_id)
                return self._stream(request, plan, message, body, turn, cut)
            if turn is not None:
                turn.answered(message)
            upstream.reported.add(body, message, message["usage"], stream=False, whole=True)
            return self._ok(request, message)
        if path == "/v1/messages/count_tokens":
            return self._ok(request, self._upstream.count(body, headers))
        if path == "/v1/models":
            query = parse_qs(request.uri.decode("utf-8", "replace").partition("?")[2])
            return self._ok(request, list_models(query))
        return self._ok(request, get_model(path.rsplit("/", 1)[1]))

    def _ok(self, request: IRequest, value: Any) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        return _body_for(request, _json(value))

    def _error(self, request: IRequest, rejection: Rejection) -> bytes:
        request.setResponseCode(rejection.status)
        request.setHeader(b"content-type", b"application/json")
        request_id = request.responseHeaders.getRawHeaders(b"request-id")[0].decode("ascii")
        return _body_for(request, error_body(rejection.error_type, rejection.message, request_id))

    def _stream(
        self,
        request: IRequest,
        plan: StreamPlan,
        message: dict,
        body: Any,
        turn: ThreadTurn | None,
        cut: bool = False,
    ) -> int:
        request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
        request.setHeader(b"cache-control", b"no-cache")
        writer = PacedWriter(request, plan.pieces, self._upstream.reactor, drop=plan.drop)
        tally = self._upstream.reported

        def ended(whole: bool) -> None:
            complete = whole and plan.whole
            if turn is not None:
                if complete and not cut:
                    turn.answered(message)
                else:
                    turn.failed()
            usage = plan.usage_sent(writer.written)
            if usage is not None:
                tally.add(body, message, usage, stream=True, whole=complete)

        writer.on_end = ended
        writer.start()
        return NOT_DONE_YET


def _body_for(request: IRequest, body: bytes) -> bytes:
    # A HEAD answer has the headers of the GET answer and no body.
    if request.method == b"HEAD":
        request.setHeader(b"content-length", str(len(body)).encode("ascii"))
        return b""
    return body


def _parse(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return ujson.loads(raw)
    except ValueError:
        return None


@implementer(IPushProducer)
class PacedWriter:
    """
    Writes a stream's pieces on the clock, each once it is due, pausing when
    the connection pushes back and stopping when the client goes away.
    """

    def __init__(self, request: IRequest, pieces: list[tuple[float, bytes]], clock: IReactorTime,
                 drop: bool = False):
        self._request = request
        self._pieces = pieces
        self._clock = clock
        self._drop = drop
        self._next = 0
        #: The bytes written so far.
        self.written = 0
        self._call: Any = None
        self._paused = False
        self._done = False
        self._started_at = 0.0
        #: Called once with whether the whole stream was written.
        self.on_end: Any = None

    def _ended(self, whole: bool) -> None:
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end(whole)

    def start(self) -> None:
        """Begin writing; the first piece goes out on the next clock tick."""
        self._started_at = self._clock.seconds()
        self._request.registerProducer(self, True)
        self._request.notifyFinish().addErrback(self._lost)
        self._schedule()

    def _schedule(self) -> None:
        if self._paused or self._done or self._call is not None:
            return
        due = self._started_at + self._pieces[self._next][0]
        self._call = self._clock.callLater(max(0.0, due - self._clock.seconds()), self._write_next)

    def _write_next(self) -> None:
        self._call = None
        piece = self._pieces[self._next][1]
        self._next += 1
        self._request.write(piece)
        self.written += len(piece)
        if self._next == len(self._pieces):
            self._done = True
            self._request.unregisterProducer()
            if self._drop:
                # The connection drops: what was written goes, then nothing.
                self._ended(False)
                self._request.loseConnection()
                return
            self._request.finish()
            self._ended(True)
        else:
            self._schedule()

    def _cancel(self) -> None:
        self._done = True
        self._ended(False)
        if self._call is not None:
            self._call.cancel()
            self._call = None

    def _lost(self, reason: Failure) -> None:
        # The client went away: nothing more may be written, and the
        # failure is expected, so it is consumed here.
        self._cancel()

    def pauseProducing(self) -> None:
        """Stop writing until :meth:`resumeProducing`."""
        self._paused = True
        if self._call is not None:
            self._call.cancel()
            self._call = None

    def resumeProducing(self) -> None:
        """Write again, catching up with pieces that fell due meanwhile."""
        self._paused = False
        self._schedule()

    def stopProducing(self) -> None:
        """Write nothing more."""
        self._cancel()
