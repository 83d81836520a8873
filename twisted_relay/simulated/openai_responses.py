# -*- test-case-name: tests.test_simulated_openai_responses -*-
"""
A simulated OpenAI Responses API (GPT models), on the fake model of a
:class:`~twisted_relay.simulated.resource.SimulatedUpstream` (its tool
calls, its reuse of ids, its prompt cache), as a twisted.web resource.

Routes: ``POST /v1/responses`` (JSON or a stream of events) and ``POST
/v1/responses/input_tokens`` (``{"object": "response.input_tokens",
"input_tokens": N}``, exactly the ``input_tokens`` the same request is billed).
``Authorization: Bearer <key>``; the key's organisation binds the reasoning's
``encrypted_content`` and the prompt cache.

What it checks, in OpenAI's words (:mod:`.openai_responses_rules`), and the
stateless rules: with ``store: false`` an item id is a 404 (``Item with id
'rs_...' not found. Items are not persisted when `store` is set to
false...``); a reasoning item's ``encrypted_content`` opens only here and
only for its organisation (400 ``invalid_encrypted_content``, or withheld
with ``input_transformations`` by the newest models); a reasoning item must
be followed by the item it preceded, and carry ``summary``.

What it answers (:mod:`.openai_responses_answer`), and the tally of the
reasoning each conversation was given and sent back
(:mod:`.openai_reasoning`, :meth:`SimulatedOpenAIResponses.reasoning_report`).
Switches make it fail as the API and its look-alikes do.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Mapping

import ujson
from twisted.logger import Logger
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET

from twisted_relay._json import to_json
from twisted_relay.logs import bounded
from twisted_relay.simulated.base import Rejection, seeded_rng
from twisted_relay.simulated.model import encode_events, plan_chunks
from twisted_relay.simulated.openai_reasoning import (
    DEFAULT_SECRET,
    ReasoningLedger,
    ReasoningReport,
    ReasoningSeal,
    assistant_side,
    fingerprint,
)
from twisted_relay.simulated.openai_responses_answer import (
    FAILURE_MESSAGE,
    Produced,
    StreamFault,
    anthropic_usage,
    cut_to,
    new_id,
    output_items,
    response_object,
    stream_events,
    usage_of,
)
from twisted_relay.simulated.openai_responses_rules import (
    GPT_MODELS,
    GptModel,
    OpenAIError,
    Settings,
    check_calls,
    check_item,
    input_items,
    model_view,
    read_settings,
)
from twisted_relay.simulated.resource import MAX_BODY, PacedWriter, ReceivedRequest, SimulatedUpstream, StreamPlan

__all__ = ["INCOMPLETE_REASONS", "STREAM_FAULTS", "Answer", "SimulatedOpenAIResponses"]

#: What :meth:`SimulatedOpenAIResponses.break_next_stream` breaks a stream with.
STREAM_FAULTS = ("failed", "error")
#: What :meth:`SimulatedOpenAIResponses.end_next_incomplete` ends an answer with.
INCOMPLETE_REASONS = ("max_output_tokens", "content_filter")

_NO_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header using "
           "Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or as the password field (with blank username) if "
           "you're accessing the API from your browser and are prompted for a username and password. You can "
           "obtain an API key from https://platform.openai.com/account/api-keys.")
_BAD_KEY = "Incorrect API key provided. You can find your API key at https://platform.openai.com/account/api-keys."
_NOT_PERSISTED = ("Item with id '{id}' not found. Items are not persisted when `store` is set to false. Try again "
                  "with `store` set to true, or remove this item from your input.")


@dataclass
class Answer:
    """
    One answer composed, before it is sent.

    :ivar response: the response object (its final form).
    :ivar produced: its output items with their token costs.
    :ivar settings: the request's parameters.
    :ivar organisation: whose request it was.
    :ivar conversation: the conversation it continues (the tally's name).
    :ivar message: the fake model's answer it was made from.
    :ivar items: the request's input, resolved (what a stored response keeps).
    """

    response: dict
    produced: list[Produced]
    settings: Settings
    organisation: str
    conversation: str
    message: dict
    items: list[dict]


class SimulatedOpenAIResponses:
    """
    The Responses API, simulated.

    :param upstream: the fake model; by default a lenient
        :class:`SimulatedUpstream` (this API's checks are its own).  Its
        ``seed``, ``reuse_every`` (``call_id`` s copied from the history:
        the client must send repeats back renamed, as a relay does),
        ``parallel``, ``event_delay``, ``split``, ``line_ending``,
        ``reactor``, ``stream_errors`` (``response.failed`` after the first
        item), ``stream_cuts`` (the connection drops) and its prompt cache
        and usage tally (``reported``, in the Messages API's terms) serve
        here.  Its ``thinking_secret`` must be unset.
    :param keys: API key -> organisation (another key: 401); ``None``: any
        key, each an organisation of its own.
    :param models: model name -> :class:`GptModel` (:data:`GPT_MODELS` by
        default); a dated name (``gpt-5.5-2026-04-23``) is its model.
    :param secret: what reasoning is sealed with: instances with one secret
        read each other's.
    :param reasoning_splits: the share of answers with a second reasoning
        item (before a later item), drawn from the answer.
    :param argument_deltas: stream function arguments in deltas (``False``:
        only ``response.function_call_arguments.done``).
    :param announce_items: send ``response.output_item.added`` for messages
        and function calls (``False``: not, as some look-alikes do).
    :param cache_writes: report ``cache_write_tokens`` (``False``: counted as
        plain input, as OpenAI's usage did before it reported them).

    :ivar requests: the last requests received (``ReceivedRequest``).
    :ivar responses: the last responses sent whole (their objects).
    """

    log = Logger()

    def __init__(
        self,
        upstream: SimulatedUpstream | None = None,
        *,
        keys: Mapping[str, str] | None = None,
        models: Mapping[str, GptModel] | None = None,
        secret: str = DEFAULT_SECRET,
        reasoning_splits: float = 0.3,
        argument_deltas: bool = True,
        announce_items: bool = True,
        cache_writes: bool = True,
        keep_requests: int = 100,
        keep_stored: int = 1000,
    ):
        if not 0.0 <= reasoning_splits <= 1.0:
            raise ValueError("reasoning_splits must be between 0 and 1")
        self.upstream = upstream if upstream is not None else SimulatedUpstream(mode="lenient")
        self.keys = None if keys is None else dict(keys)
        self.models = dict(GPT_MODELS if models is None else models)
        self.reasoning_splits = reasoning_splits
        self.argument_deltas = argument_deltas
        self.announce_items = announce_items
        self.cache_writes = cache_writes
        self.requests: deque[ReceivedRequest] = deque(maxlen=keep_requests)
        self.responses: deque[dict] = deque(maxlen=keep_requests)
        self._seal = ReasoningSeal(secret)
        self._ledger = ReasoningLedger()
        self._keep_stored = keep_stored
        self._stored: OrderedDict[str, tuple[str, list[dict]]] = OrderedDict()
        self._stored_items: dict[str, tuple[str, dict, dict | None]] = {}
        self._http_faults: deque[OpenAIError] = deque()
        self._stream_faults: deque[StreamFault] = deque()
        self._incomplete: deque[str] = deque()

    def resource(self) -> IResource:
        """The root resource: ``/v1/responses`` and ``/v1/responses/input_tokens``."""
        return _ResponsesResource(self)

    def reasoning_report(self) -> ReasoningReport:
        """
        What reasoning each conversation was given and sent back (a
        snapshot): ``report.ok``, ``report.problems()``,
        ``report.conversations[name]`` or ``report.by_label(prompt_cache_key)``.
        """
        return self._ledger.report()

    # -- switches -----------------------------------------------------------------

    def fail_next(self, status: int = 429, code: str | None = "rate_limit_exceeded", message: str | None = None,
                  times: int = 1) -> None:
        """Answer the next ``times`` authenticated requests with the HTTP error
        ``status`` (``{"error": {"message", "type", "param", "code"}}``)."""
        text = message or ("Rate limit reached for requests" if status == 429 else
                           FAILURE_MESSAGE.format(request_id="req_" + secrets.token_hex(16)))
        for _ in range(times):
            self._http_faults.append(OpenAIError(status, text, None, code, _error_type(status)))

    def break_next_stream(self, kind: str = "failed", after_events: int = 4, code: str = "server_error",
                          message: str | None = None) -> None:
        """
        End the next stream after ``after_events`` events with a
        ``response.failed`` (``kind="failed"``: ``response.error`` carries
        ``code`` and ``message``) or a top-level ``error`` event
        (``kind="error"``), and nothing after it.
        """
        if kind not in STREAM_FAULTS:
            raise ValueError("kind must be one of " + ", ".join(STREAM_FAULTS))
        text = message or FAILURE_MESSAGE.format(request_id="req_" + secrets.token_hex(16))
        self._stream_faults.append(StreamFault(kind, after_events, code, text))

    def end_next_incomplete(self, reason: str = "content_filter") -> None:
        """End the next answer (streamed or not) ``incomplete`` with
        ``incomplete_details.reason`` ``reason``, its output cut halfway.
        (``max_output_tokens`` also comes by itself, when the output does not fit.)"""
        if reason not in INCOMPLETE_REASONS:
            raise ValueError("reason must be one of " + ", ".join(INCOMPLETE_REASONS))
        self._incomplete.append(reason)

    # -- the endpoints, on parsed requests ------------------------------------------

    def organisation_of(self, headers: dict[str, str]) -> str:
        """
        The organisation of the request's key.

        :raises OpenAIError: 401 without a key, or with one not in ``keys``.
        """
        authorization = headers.get("authorization", "")
        key = authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
        if not key:
            raise OpenAIError(401, _NO_KEY)
        if self.keys is None:
            return "org-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:24]
        organisation = self.keys.get(key)
        if organisation is None:
            raise OpenAIError(401, _BAD_KEY, None, "invalid_api_key")
        return organisation

    def count(self, body: Any, organisation: str) -> dict:
        """``POST /v1/responses/input_tokens``: what ``body`` would be billed as input."""
        settings = read_settings(body, self.models, counting=True)
        items = self._resolve(body, organisation, store=True)
        checked, _, _ = self._check_input(items, organisation, settings.spec)
        view = model_view(checked, settings)
        tokens = self._call_model(lambda: self.upstream.count(view, self._model_headers(organisation, None)))
        return {"object": "response.input_tokens", "input_tokens": tokens["input_tokens"]}

    def respond(self, body: Any, organisation: str) -> Answer:
        """
        Check a ``POST /v1/responses`` body and compose its answer (not yet
        sent: :meth:`delivered` once it was).

        :raises OpenAIError: what the API refuses.
        """
        if self._http_faults:
            raise self._http_faults.popleft()
        settings = read_settings(body, self.models)
        items = self._resolve(body, organisation, store=settings.store)
        checked, transformations, reasoning_ids = self._check_input(items, organisation, settings.spec)
        view = model_view(checked, settings)
        headers = self._model_headers(organisation, settings.prompt_cache_key)
        message = self._call_model(lambda: self.upstream.answer(view, headers))
        conversation = self._ledger.follow(checked, reasoning_ids, organisation, settings.prompt_cache_key)
        rng = seeded_rng(self.upstream.options.seed, "openai reasoning", message["content"])
        history = frozenset(block.get("id") for entry in view["messages"] for block in entry["content"]
                            if block.get("type") == "tool_use")
        produced = output_items(message, settings, rng, self.reasoning_splits, history)
        produced, cut = cut_to(produced, settings.max_output_tokens)
        reason = "max_output_tokens" if cut else None
        if self._incomplete:
            reason = self._incomplete.popleft()
            if not cut:
                produced, _ = cut_to(produced, max(1, sum(item.tokens for item in produced) // 2))
        response_id = new_id("resp_")
        self._seal_reasoning(produced, organisation, conversation, response_id, settings)
        response = response_object(
            response_id, settings, int(self.upstream.reactor.seconds()),
            status="incomplete" if reason else "completed", output=[item.item for item in produced],
            usage=usage_of(message["usage"], produced, self.cache_writes), incomplete=reason,
            previous=body.get("previous_response_id"), transformations=transformations,
        )
        return Answer(response, produced, settings, organisation, conversation, message, checked)

    def delivered(self, answer: Answer, *, stream: bool, usage_sent: bool = True, whole: bool = True) -> None:
        """
        Record an answer once sent: in the reasoning tally and the store
        when it was sent whole, its usage in the upstream's tally when that
        was sent.
        """
        response = answer.response
        settings = answer.settings
        if whole:
            self.responses.append(response)
            self._ledger.issue(answer.conversation, response["id"], response["output"], answer.organisation,
                               replayable=settings.encrypted or settings.store)
            if settings.store:
                self._store(answer)
        if usage_sent:
            user = (settings.echo.get("metadata") or {}).get("user_id") or settings.echo.get(
                "safety_identifier") or settings.echo.get("user")
            self.upstream.reported.add({"metadata": {"user_id": user}}, {"model": settings.model},
                                       anthropic_usage(response["usage"]), stream=stream, whole=whole)

    def next_stream_fault(self, answer: Answer) -> StreamFault | None:
        """How the stream of ``answer`` breaks, if it does: a switch, or the
        upstream's ``stream_errors`` (``response.failed`` after the first item)."""
        if self._stream_faults:
            return self._stream_faults.popleft()
        if self.upstream.cuts_stream(answer.message):
            return StreamFault("failed", None, "server_error",
                               FAILURE_MESSAGE.format(request_id="req_" + secrets.token_hex(16)))
        return None

    # -- inside ---------------------------------------------------------------------

    def _model_headers(self, organisation: str, cache_key: str | None) -> dict[str, str]:
        # The prompt cache is the organisation's, split by prompt_cache_key.
        return {"x-api-key": f"openai:{organisation}:{cache_key or ''}"}

    def _call_model(self, call: Any) -> Any:
        try:
            return call()
        except Rejection as rejection:
            raise OpenAIError(400, rejection.message, "input")

    def _resolve(self, body: Any, organisation: str, store: bool) -> list:
        """The input with the previous response's items before it and stored items in place of their ids."""
        items = input_items(body)
        previous = body.get("previous_response_id")
        if previous is not None:
            stored = self._stored.get(previous)
            if stored is None or stored[0] != organisation:
                raise OpenAIError(404, f"Previous response with id '{previous}' not found.", "previous_response_id",
                                  "previous_response_not_found")
            items = [*stored[1], *items]
        resolved = []
        for item in items:
            item_id = item.get("id") if isinstance(item, dict) else None
            if item_id is None:
                resolved.append(item)
                continue
            if not store:
                self._ledger.refused("item_not_persisted")
                raise OpenAIError(404, _NOT_PERSISTED.format(id=item_id), "input")
            stored_item = self._stored_items.get(item_id) if isinstance(item_id, str) else None
            if stored_item is None or stored_item[0] != organisation:
                raise OpenAIError(404, f"Item with id '{item_id}' not found.", "input")
            resolved.append(stored_item[1] if item.get("type") == "item_reference" else item)
        return resolved

    def _check_input(self, items: list, organisation: str, spec: GptModel):
        """
        Check the input: each item's shape, the reasoning's seal and
        organisation, the reasoning grammar, the function calls' pairing.

        :return: the items kept (another organisation's reasoning withheld),
            the ``input_transformations``, and the ``rs_`` id of each kept
            reasoning item (``None``: neither sealed nor stored).
        """
        for index, item in enumerate(items):
            if isinstance(item, dict) and item.get("type") == "reasoning" and "summary" not in item:
                self._ledger.refused("missing_summary")
            check_item(index, item)
        kept: list[dict] = []
        follows: dict[int, str | None] = {}
        reasoning_ids: dict[int, str | None] = {}
        transformations: list[dict] = []
        for item in items:
            if item.get("type") != "reasoning":
                kept.append(item)
                continue
            payload = self._payload_of(item, organisation)
            if payload is not None and payload.get("org") != organisation:
                if spec.foreign_reasoning == "withhold":
                    transformations.append({"id": payload.get("id"), "action": "removed",
                                            "reason": "organization_mismatch", "type": "reasoning"})
                    self._ledger.withheld(1)
                    continue
                self._ledger.refused("organization_mismatch")
                raise _unverified(item["encrypted_content"])
            reasoning_ids[len(kept)] = payload.get("id") if payload else None
            follows[len(kept)] = payload.get("follows") if payload else None
            kept.append(item)
        for index, item in enumerate(kept):
            if item.get("type") != "reasoning":
                continue
            following = kept[index + 1] if index + 1 < len(kept) else None
            fits = following is not None and assistant_side(following) and following.get("type") != "reasoning"
            if fits and follows[index] is not None:
                fits = fingerprint(following) == follows[index]
            if not fits and (follows[index] is not None or reasoning_ids[index] is None):
                self._ledger.refused("missing_following_item")
                name = reasoning_ids[index] or item.get("id") or f"input[{index}]"
                raise OpenAIError(400, f"Item '{name}' of type 'reasoning' was provided without its required "
                                  "following item.", "input")
        check_calls(kept)
        return kept, transformations, reasoning_ids

    def _payload_of(self, item: dict, organisation: str) -> dict | None:
        """What a reasoning item was: from its encrypted content, or the store."""
        sealed = item.get("encrypted_content")
        if sealed is not None:
            payload = self._seal.open(sealed)
            if payload is None or "id" not in payload:
                self._ledger.refused("invalid_encrypted_content")
                raise _unverified(sealed, parsed=False)
            return payload
        stored = self._stored_items.get(item.get("id")) if isinstance(item.get("id"), str) else None
        return stored[2] if stored is not None else None

    def _seal_reasoning(self, produced: list[Produced], organisation: str, conversation: str, response_id: str,
                        settings: Settings) -> None:
        for index, item in enumerate(produced):
            if not item.reasoning:
                continue
            following = produced[index + 1].item if index + 1 < len(produced) else None
            payload = {"id": item.item["id"], "org": organisation, "conversation": conversation,
                       "response": response_id, "model": settings.model, "tokens": item.tokens,
                       "follows": fingerprint(following) if following is not None else None}
            item.payload = payload
            if settings.encrypted:
                item.item["encrypted_content"] = self._seal.seal(payload)

    def _store(self, answer: Answer) -> None:
        output = answer.response["output"]
        self._stored[answer.response["id"]] = (answer.organisation, [*answer.items, *output])
        for produced in answer.produced:
            self._stored_items[produced.item["id"]] = (answer.organisation, produced.item, produced.payload)
        while len(self._stored) > self._keep_stored:
            _, (_, dropped) = self._stored.popitem(last=False)
            for item in dropped:
                if isinstance(item.get("id"), str):
                    self._stored_items.pop(item["id"], None)


def _error_type(status: int) -> str:
    """The ``error.type`` of an HTTP status, as OpenAI words it."""
    if status == 429:
        return "requests"
    return "server_error" if status >= 500 else "invalid_request_error"


def _unverified(sealed: str, parsed: bool = True) -> OpenAIError:
    shown = f"{sealed[:4]}...{sealed[-4:]}" if len(sealed) > 12 else sealed
    reason = "" if parsed else " Reason: Encrypted content could not be decrypted or parsed."
    return OpenAIError(400, f"The encrypted content {shown} could not be verified.{reason}", None,
                       "invalid_encrypted_content")


def _headers_of(request: IRequest) -> dict[str, str]:
    return {
        name.decode("latin-1").lower(): ", ".join(value.decode("latin-1") for value in values)
        for name, values in request.requestHeaders.getAllRawHeaders()
    }


def _parse(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return ujson.loads(raw)
    except ValueError:
        return None


class _ResponsesResource(Resource):
    """Routes every path; state lives on the :class:`SimulatedOpenAIResponses`."""

    isLeaf = True
    log = Logger()

    def __init__(self, simulator: SimulatedOpenAIResponses):
        super().__init__()
        self._simulator = simulator

    def render(self, request: IRequest) -> bytes | int:
        simulator = self._simulator
        method = request.method.decode("latin-1")
        path = request.path.decode("utf-8", "replace")
        headers = _headers_of(request)
        raw = request.content.read() if request.content is not None else b""
        body = _parse(raw) if len(raw) <= MAX_BODY else None
        simulator.requests.append(ReceivedRequest(method, request.uri.decode("utf-8", "replace"), headers, body))
        request_id = "req_" + secrets.token_hex(16)
        request.setHeader(b"x-request-id", request_id.encode("ascii"))
        request.setHeader(b"openai-version", b"2020-10-01")
        try:
            return self._serve(request, method, path, headers, raw, body, request_id)
        except OpenAIError as error:
            self.log.debug("{method} {path} refused: {status} {message}", method=method, path=path,
                           status=error.status, message=bounded(error.message))
            request.setResponseCode(error.status)
            request.setHeader(b"content-type", b"application/json")
            return to_json(error.body())

    def _serve(self, request: IRequest, method: str, path: str, headers: dict, raw: bytes, body: Any,
               request_id: str) -> bytes | int:
        simulator = self._simulator
        if path not in ("/v1/responses", "/v1/responses/input_tokens") or method != "POST":
            raise OpenAIError(404, f"Invalid URL ({method} {path})")
        organisation = simulator.organisation_of(headers)
        request.setHeader(b"openai-organization", organisation.encode("utf-8"))
        if len(raw) > MAX_BODY:
            raise OpenAIError(413, "The request body is too large.")
        request.setHeader(b"content-type", b"application/json")
        if path == "/v1/responses/input_tokens":
            return to_json(simulator.count(body, organisation))
        answer = simulator.respond(body, organisation)
        request.setHeader(b"openai-processing-ms", str(200 + answer.response["usage"]["output_tokens"]).encode())
        if answer.settings.stream:
            return self._stream(request, answer)
        simulator.delivered(answer, stream=False)
        return to_json(answer.response)

    def _stream(self, request: IRequest, answer: Answer) -> int:
        simulator = self._simulator
        upstream = simulator.upstream
        fault = simulator.next_stream_fault(answer)
        drop = fault is None and upstream.drops_stream(answer.message)
        rng = seeded_rng(upstream.options.seed, "openai stream", answer.message["content"])
        events = stream_events(answer.response, answer.produced, rng, argument_deltas=simulator.argument_deltas,
                               announce_items=simulator.announce_items,
                               obfuscation=answer.settings.obfuscation, fault=fault)
        data, starts = encode_events(events, upstream.line_ending)
        usage_end = len(data) if fault is None else None
        if drop:
            data = data[: seeded_rng(upstream.options.seed, "openai cut at", answer.message["content"]).randrange(
                starts[1], len(data))]
            starts = [start for start in starts if start < len(data)]
        chunks = plan_chunks(data, starts, rng if upstream.split else None)
        pieces = [(index * upstream.event_delay, piece) for index, piece in chunks]
        reported = [] if usage_end is None else [(usage_end, answer.response["usage"])]
        plan = StreamPlan(pieces, drop, fault is None and not drop, reported)
        request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
        request.setHeader(b"cache-control", b"no-cache")
        writer = PacedWriter(request, plan.pieces, upstream.reactor, drop=plan.drop)

        def ended(whole: bool) -> None:
            simulator.delivered(answer, stream=True, usage_sent=plan.usage_sent(writer.written) is not None,
                                whole=whole and plan.whole)

        writer.on_end = ended
        writer.start()
        return NOT_DONE_YET
