# -*- test-case-name: tests.test_simulated_bedrock -*-
"""
A simulated Amazon Bedrock runtime (InvokeModel) on the simulated upstream's
fake model, as a twisted.web resource.

:class:`SimulatedBedrock` serves ``POST /model/{modelId}/invoke``,
``/invoke-with-response-stream`` and ``/count-tokens`` for Claude on top of
a :class:`~twisted_relay.simulated.resource.SimulatedUpstream` (its model,
id reuse, thinking signatures, usage, prompt cache and tally), checking what
Bedrock checks (:mod:`~twisted_relay.simulated.bedrock_auth`,
:mod:`~twisted_relay.simulated.bedrock_rules`) and answering as Bedrock
does: ``msg_bdrk_``/``toolu_bdrk_`` ids, ``X-Amzn-Bedrock-*`` headers, a
binary event stream (:mod:`~twisted_relay.simulated.eventstream_frames`)
with no pings and the invocation metrics in its last chunk.  Switches make
it fail as Bedrock fails: HTTP errors, exception frames mid-stream, long
silences.
"""

from __future__ import annotations

import base64
import binascii
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple
from urllib.parse import unquote

import ujson
from twisted.logger import Logger
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET

from twisted_relay._json import to_json
from twisted_relay.logs import bounded
from twisted_relay.message_threads.model import ThreadError
from twisted_relay.simulated.base import Rejection, seeded_rng
from twisted_relay.simulated.bedrock_auth import AwsCredential, BedrockAuth
from twisted_relay.simulated.bedrock_rules import (
    BEDROCK_MODELS,
    HTTP_ERRORS,
    NEW_VERSION,
    STREAM_EXCEPTIONS,
    BedrockError,
    BedrockModel,
    Resolved,
    check_body,
    foreign_ids,
    from_anthropic,
    resolve_model,
    to_anthropic,
    validation,
)
from twisted_relay.simulated.eventstream_frames import chunk_frame, exception_frame, padding
from twisted_relay.simulated.model import count_tokens, plan_chunks
from twisted_relay.simulated.resource import PacedWriter, SimulatedUpstream, StreamPlan

__all__ = ["BEDROCK_THINKING_SECRET", "MAX_BODY", "SERVICE_TIERS", "BedrockRequest", "SimulatedBedrock"]

#: The secret the simulated Bedrock's own fake model signs thinking with: a
#: block from the simulated Anthropic API (or another cloud) is not Bedrock's.
BEDROCK_THINKING_SECRET = "simulated-bedrock"
#: InvokeModel's body limit, in bytes.
MAX_BODY = 25_000_000
#: The values ``X-Amzn-Bedrock-Service-Tier`` takes.
SERVICE_TIERS = ("priority", "default", "flex", "reserved")

_OPERATIONS = ("invoke", "invoke-with-response-stream", "count-tokens")
_STATUS_TYPES = {401: "AccessDeniedException", 403: "AccessDeniedException", 404: "ResourceNotFoundException",
                 413: "ValidationException", 429: "ThrottlingException", 529: "ServiceUnavailableException"}


class BedrockRequest(NamedTuple):
    """
    One request as the simulated Bedrock received it.

    :ivar method: e.g. ``"POST"``.
    :ivar path: the request target as sent (an ARN's ``/`` as ``%2F``).
    :ivar headers: lower-case names; repeated headers joined with ``", "``.
    :ivar body: the parsed JSON body (for ``count-tokens`` the outer one),
        or ``None``.
    :ivar model_id: the model id decoded from the path (``None``: no model
        path).
    :ivar raw: the body's bytes as received.
    """

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    model_id: str | None
    raw: bytes


@dataclass
class _StreamFault:
    """What the next stream does: end in an exception frame after
    ``after_events`` events, or fall silent there for ``silence`` seconds."""

    after_events: int
    exception: str | None = None
    fields: dict | None = None
    silence: float = 0.0


class SimulatedBedrock:
    """
    A fake Bedrock runtime for Claude, on the fake model of ``upstream``.

    :param upstream: the fake model; by default a strict
        :class:`SimulatedUpstream` signing thinking with
        :data:`BEDROCK_THINKING_SECRET`.  Its ``event_delay``, ``split``,
        ``reactor``, ``stream_errors`` (an exception frame
        ``modelStreamErrorException`` after the first block) and
        ``stream_cuts`` (the connection drops) shape the streams.
    :param region: the region served (signatures and profiles must match).
    :param access_keys: access key id -> secret key or
        :class:`~twisted_relay.simulated.bedrock_auth.AwsCredential`
        (temporary credentials with their session token and expiry).
    :param api_keys: Bedrock API keys (``Authorization: Bearer``) -> AWS account.
    :param models: base model id -> :class:`BedrockModel`
        (:data:`~twisted_relay.simulated.bedrock_rules.BEDROCK_MODELS` by default).
    :param application_profiles: application inference profile ARN -> the
        model id (base or system profile) it routes to.
    :param max_input_tokens: a longer prompt is a 400 "Input is too long for
        requested model." (``None``: no limit).
    :param wall_clock: the time signatures and credential expiries are judged by.

    :ivar requests: the last requests received, as :class:`BedrockRequest`.
    :ivar reported: the usage reported (the upstream's
        :class:`~twisted_relay.simulated.usage.UsageTally`).
    :ivar auth: the credential tables (:class:`BedrockAuth`), live.
    """

    log = Logger()

    def __init__(
        self,
        upstream: SimulatedUpstream | None = None,
        *,
        region: str = "us-east-1",
        access_keys: dict[str, str | AwsCredential] | None = None,
        api_keys: dict[str, str] | None = None,
        models: dict[str, BedrockModel] | None = None,
        application_profiles: dict[str, str] | None = None,
        max_input_tokens: int | None = None,
        keep_requests: int = 100,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.upstream = upstream if upstream is not None else SimulatedUpstream(
            thinking_secret=BEDROCK_THINKING_SECRET)
        self.region = region
        self.auth = BedrockAuth(region, access_keys, api_keys, wall_clock)
        self.models = dict(BEDROCK_MODELS if models is None else models)
        self.application_profiles = dict(application_profiles or {})
        self.max_input_tokens = max_input_tokens
        self.requests: deque[BedrockRequest] = deque(maxlen=keep_requests)
        self._http_faults: deque[tuple[str, dict]] = deque()
        self._stream_faults: deque[_StreamFault] = deque()

    @property
    def reported(self):
        """The usage the fake model reported (``upstream.reported``)."""
        return self.upstream.reported

    def resource(self) -> IResource:
        """The root resource: ``/model/{modelId}/{operation}``."""
        return _BedrockResource(self)

    # -- switches -----------------------------------------------------------------

    def fail_next(self, error_type: str, times: int = 1, **fields: Any) -> None:
        """
        Answer the next ``times`` authenticated requests with the HTTP error
        ``error_type`` (a key of :data:`~twisted_relay.simulated.bedrock_rules.HTTP_ERRORS`,
        e.g. ``ThrottlingException`` 429); ``fields`` go into the body
        (``originalStatusCode=529`` for ``ModelErrorException``).
        """
        if error_type not in HTTP_ERRORS:
            raise ValueError(f"error_type must be one of {', '.join(HTTP_ERRORS)}")
        for _ in range(times):
            self._http_faults.append((error_type, fields))

    def break_next_stream(self, exception: str, after_events: int = 2, **fields: Any) -> None:
        """
        End the next stream with an exception frame of type ``exception``
        (a key of :data:`~twisted_relay.simulated.bedrock_rules.STREAM_EXCEPTIONS`)
        after ``after_events`` events; ``fields`` go into its payload
        (``originalStatusCode=529``, ``originalMessage=...`` for
        ``modelStreamErrorException``; ``message`` overrides the default).
        """
        if exception not in STREAM_EXCEPTIONS:
            raise ValueError(f"exception must be one of {', '.join(STREAM_EXCEPTIONS)}")
        self._stream_faults.append(_StreamFault(after_events, exception, fields))

    def silence_next_stream(self, seconds: float, after_events: int = 2) -> None:
        """Hold the next stream ``seconds`` after its first ``after_events``
        events (Bedrock sends no pings meanwhile)."""
        self._stream_faults.append(_StreamFault(after_events, silence=seconds))

    # -- the operations, on checked requests -------------------------------------------

    def _anthropic_request(self, body: dict, resolved: Resolved, betas: list[str], account: str,
                           headers: dict[str, str]) -> tuple[dict, dict[str, str]]:
        """The Messages request the fake model reads for a Bedrock body, and its headers."""
        anthropic = to_anthropic({key: value for key, value in body.items()
                                  if key not in ("anthropic_version", "anthropic_beta")})
        anthropic["model"] = resolved.model.name
        inner = {
            "anthropic-version": NEW_VERSION if body["anthropic_version"] == NEW_VERSION else "2023-06-01",
            "x-api-key": "aws-account:" + account,
        }
        if betas:
            inner["anthropic-beta"] = ",".join(betas)
        if "x-claude-code-session-id" in headers:
            inner["x-claude-code-session-id"] = headers["x-claude-code-session-id"]
        return anthropic, inner

    def count(self, body: Any, resolved: Resolved, account: str, headers: dict[str, str]) -> dict:
        """CountTokens: ``{"input": {"invokeModel": {"body": <base64>}}}`` -> ``{"inputTokens": N}``."""
        inner = _count_input(body)
        betas = check_body(inner, resolved)
        anthropic, inner_headers = self._anthropic_request(inner, resolved, betas, account, headers)
        anthropic.pop("max_tokens", None)
        return {"inputTokens": _call_model(lambda: self.upstream.count(anthropic, inner_headers))["input_tokens"]}

    def answer(self, body: Any, resolved: Resolved, account: str, headers: dict[str, str]):
        """Check an InvokeModel body and compose the answer: ``(message as
        Bedrock sends it, the Messages request, the thread turn)``."""
        betas = check_body(body, resolved)
        anthropic, inner_headers = self._anthropic_request(body, resolved, betas, account, headers)
        if self.max_input_tokens is not None and count_tokens(anthropic) > self.max_input_tokens:
            raise validation("Input is too long for requested model.")
        message, turn = _call_model(lambda: self.upstream.answer_turn(anthropic, inner_headers))
        return from_anthropic(message, foreign_ids(body.get("messages"))), anthropic, turn

    def next_http_fault(self) -> BedrockError | None:
        """The HTTP error the next request gets, if one was asked for."""
        if not self._http_faults:
            return None
        error_type, fields = self._http_faults.popleft()
        status, message = HTTP_ERRORS[error_type]
        fields = dict(fields)
        return BedrockError(status, error_type, fields.pop("message", message), fields)

    def next_stream_fault(self) -> _StreamFault | None:
        return self._stream_faults.popleft() if self._stream_faults else None


def _call_model(call: Callable[[], Any]) -> Any:
    """Run the fake model; its refusals become Bedrock's (400 ``ValidationException``
    with the model's words)."""
    try:
        return call()
    except Rejection as rejection:
        error_type = "ValidationException" if rejection.status == 400 else _STATUS_TYPES.get(
            rejection.status, "InternalServerException")
        raise BedrockError(rejection.status if rejection.status != 529 else 503, error_type, rejection.message)
    except ThreadError as error:
        raise BedrockError(error.status, "ValidationException", str(error))


def _count_input(body: Any) -> Any:
    """The InvokeModel body inside a CountTokens request."""
    invoke = body.get("input") if isinstance(body, dict) else None
    invoke = invoke.get("invokeModel") if isinstance(invoke, dict) else None
    encoded = invoke.get("body") if isinstance(invoke, dict) else None
    if not isinstance(encoded, str):
        raise validation("1 validation error detected: Value null at 'input' failed to satisfy constraint: "
                         "Member must not be null")
    try:
        return ujson.loads(base64.b64decode(encoded, validate=True))
    except (binascii.Error, ValueError):
        raise validation("Malformed input request, please reformat your input and try again.")


def _invocation_metrics(usage: dict, latency: int) -> dict:
    return {
        "inputTokenCount": usage.get("input_tokens", 0),
        "outputTokenCount": usage.get("output_tokens", 0),
        "invocationLatency": latency,
        "firstByteLatency": max(1, latency // 4),
        "cacheReadInputTokenCount": usage.get("cache_read_input_tokens") or 0,
        "cacheWriteInputTokenCount": usage.get("cache_creation_input_tokens") or 0,
    }


def _latency(message: dict) -> int:
    """A plausible latency in milliseconds, a function of the answer."""
    return 300 + 12 * message["usage"]["output_tokens"] + seeded_rng("latency", message["content"]).randrange(200)


class _BedrockResource(Resource):
    """Routes ``/model/{modelId}/{operation}``; state lives on the :class:`SimulatedBedrock`."""

    isLeaf = True
    log = Logger()

    def __init__(self, bedrock: SimulatedBedrock):
        super().__init__()
        self._bedrock = bedrock

    def render(self, request: IRequest) -> bytes | int:
        method = request.method.decode("latin-1")
        raw_path = request.path.decode("latin-1")
        uri = request.uri.decode("latin-1")
        pairs = [(name.decode("latin-1"), value.decode("latin-1"))
                 for name, values in request.requestHeaders.getAllRawHeaders() for value in values]
        headers: dict[str, str] = {}
        for name, value in pairs:
            name = name.lower()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        raw = request.content.read() if request.content is not None else b""
        segments = raw_path.split("/")
        model_id = unquote(segments[2]) if len(segments) == 4 and segments[1] == "model" else None
        body = _parse(raw) if len(raw) <= MAX_BODY else None
        self._bedrock.requests.append(BedrockRequest(method, uri, headers, body, model_id, raw))
        request.setHeader(b"x-amzn-RequestId", str(uuid.uuid4()).encode("ascii"))
        try:
            account = self._bedrock.auth.check(method, f"http://{headers.get('host', 'localhost')}{uri}", pairs, raw)
            if model_id is None or segments[3] not in _OPERATIONS or method != "POST":
                raise BedrockError(404, "UnknownOperationException", "The requested operation is not recognized "
                                                                     "by the service.")
            return self._operate(request, segments[3], model_id, headers, raw, body, account)
        except BedrockError as error:
            self.log.debug("{method} {path} refused: {status} {kind} {message}", method=method, path=raw_path,
                           status=error.status, kind=error.error_type, message=bounded(error.message))
            return _error(request, error)

    def _operate(self, request: IRequest, operation: str, model_id: str, headers: dict[str, str], raw: bytes,
                 body: Any, account: str) -> bytes | int:
        bedrock = self._bedrock
        fault = bedrock.next_http_fault()
        if fault is not None:
            raise fault
        resolved = resolve_model(model_id, bedrock.region, bedrock.models, bedrock.application_profiles)
        if len(raw) > MAX_BODY:
            raise BedrockError(413, "ValidationException", "Input is too long for requested model.")
        tier = headers.get("x-amzn-bedrock-service-tier")
        if tier is not None and tier not in SERVICE_TIERS:
            raise validation(f"1 validation error detected: Value '{tier}' at 'serviceTier' failed to satisfy "
                             f"constraint: Member must satisfy enum value set: [{', '.join(SERVICE_TIERS)}]")
        if tier is not None:
            # The tier that served the request, as Bedrock's answers say it.
            request.setHeader(b"X-Amzn-Bedrock-Service-Tier", tier.encode("ascii"))
        if operation == "count-tokens":
            return _json_answer(request, bedrock.count(body, resolved, account, headers))
        message, anthropic, turn = bedrock.answer(body, resolved, account, headers)
        if operation == "invoke":
            if turn is not None:
                turn.answered(message)
            bedrock.reported.add(anthropic, message, message["usage"], stream=False, whole=True)
            usage = message["usage"]
            for name, value in (("Input", usage["input_tokens"]), ("Output", usage["output_tokens"]),
                                ("Cache-Read-Input", usage.get("cache_read_input_tokens") or 0),
                                ("Cache-Write-Input", usage.get("cache_creation_input_tokens") or 0)):
                request.setHeader(f"X-Amzn-Bedrock-{name}-Token-Count".encode("ascii"), str(value).encode("ascii"))
            request.setHeader(b"X-Amzn-Bedrock-Invocation-Latency", str(_latency(message)).encode("ascii"))
            return _json_answer(request, message)
        return self._stream(request, message, anthropic, turn)

    def _stream(self, request: IRequest, message: dict, anthropic: dict, turn: Any) -> int:
        bedrock = self._bedrock
        upstream = bedrock.upstream
        fault = bedrock.next_stream_fault()
        cut = upstream.cuts_stream(message)
        drop = fault is None and not cut and upstream.drops_stream(message)
        plan = _frames(upstream, message, cut=cut, drop=drop, fault=fault)
        request.setHeader(b"content-type", b"application/vnd.amazon.eventstream")
        request.setHeader(b"X-Amzn-Bedrock-Content-Type", b"application/json")
        writer = PacedWriter(request, plan.pieces, upstream.reactor, drop=plan.drop)

        def ended(whole: bool) -> None:
            complete = whole and plan.whole
            if turn is not None:
                if complete:
                    turn.answered(message)
                else:
                    turn.failed()
            usage = plan.usage_sent(writer.written)
            if usage is not None:
                bedrock.reported.add(anthropic, message, usage, stream=True, whole=complete)

        writer.on_end = ended
        writer.start()
        return NOT_DONE_YET


def _frames(upstream: SimulatedUpstream, message: dict, *, cut: bool, drop: bool,
            fault: _StreamFault | None) -> StreamPlan:
    """
    How ``message`` streams as Bedrock streams it: one ``chunk`` frame per
    Anthropic event (no pings), padded at random, the invocation metrics on
    ``message_stop``; an exception frame instead of the rest where the
    upstream cuts the stream or ``fault`` says so; the frames' bytes split
    at seeded points and paced by the upstream's ``event_delay``.
    """
    seed = upstream.options.seed
    events = [(name, data) for name, data in upstream.stream_events(message, cut=cut) if name != "ping"]
    usage = message["usage"]
    exception: tuple[str, dict] | None = None
    if cut:
        # The upstream's overloaded error, as Bedrock relays a model's error.
        events = events[:-1]
        exception = ("modelStreamErrorException", {"message": STREAM_EXCEPTIONS["modelStreamErrorException"],
                                                   "originalStatusCode": 529, "originalMessage": "Overloaded"})
    if fault is not None and fault.exception is not None and fault.after_events < len(events):
        events = events[: fault.after_events]
        fields = dict(fault.fields or {})
        exception = (fault.exception, {"message": fields.pop("message", STREAM_EXCEPTIONS[fault.exception]),
                                       **fields})
    rng = seeded_rng(seed, "bedrock frames", message["content"])
    frames, reported, reports = [], [], {}
    offset = 0
    for name, data in events:
        if name == "message_stop":
            data = dict(data, **{"amazon-bedrock-invocationMetrics": _invocation_metrics(usage, _latency(message))})
        encoded = chunk_frame(data, padding(rng))
        frames.append(encoded)
        offset += len(encoded)
        if name == "message_start":
            reports = dict(data["message"]["usage"])
            reported.append((offset, dict(reports)))
        elif name == "message_delta":
            reported.append((offset, {**reports, **data["usage"]}))
    if exception is not None:
        frames.append(exception_frame(*exception))
    starts, offset = [], 0
    for encoded in frames:
        starts.append(offset)
        offset += len(encoded)
    data = b"".join(frames)
    whole = exception is None and events[-1][0] == "message_stop"
    if drop:
        data = data[: seeded_rng(seed, "bedrock cut at", message["content"]).randrange(len(frames[0]), len(data))]
        starts = [start for start in starts if start < len(data)]
        whole = False
    chunks = plan_chunks(data, starts, rng if upstream.split else None)
    pieces = []
    for index, piece in chunks:
        held = fault.silence if fault is not None and index >= fault.after_events else 0.0
        pieces.append((index * upstream.event_delay + held, piece))
    return StreamPlan(pieces, drop, whole, reported)


def _json_answer(request: IRequest, value: Any) -> bytes:
    request.setHeader(b"content-type", b"application/json")
    return to_json(value)


def _error(request: IRequest, error: BedrockError) -> bytes:
    request.setResponseCode(error.status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"x-amzn-ErrorType", f"{error.error_type}:http://internal.amazon.com/coral/com.amazon.bedrock/"
                      .encode("ascii"))
    return to_json(error.body())


def _parse(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return ujson.loads(raw)
    except ValueError:
        return None
