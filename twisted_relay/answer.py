# -*- test-case-name: tests.test_app -*-
"""
What the client gets back.

:class:`Answer` relays the upstream's answer to one request: a stream
through the SSE gate (:class:`~twisted_relay.sse.SSEGate`), or a whole
body, its ids translated back; upstream errors and headers with every key
removed; a dump of a refused request (:mod:`twisted_relay.dumps`); a log
line and a count for each id rewritten or repaired; the usage record of a
Messages answer (:mod:`twisted_relay.metering`), handed to the ledger and
counted. The answers the relay makes itself (its own errors, its request
ids) are written here too.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import ujson
from twisted.internet.defer import CancelledError
from twisted.web.http_headers import Headers

from twisted_relay._json import to_json
from twisted_relay.dumps import DumpRequest
from twisted_relay.errors import RelayError
from twisted_relay.logs import bounded
from twisted_relay.metering import AnswerMeter
from twisted_relay.platforms import BEDROCK_TIER_HEADER, platform_of, platform_tier
from twisted_relay.redact import redact_text
from twisted_relay.sse import SSEGate
from twisted_relay.upstream import read_body
from twisted_relay.upstream_headers import client_response_headers, connection_tokens

__all__ = [
    "CLIENT_GONE_STATUS",
    "RELAY_REQUEST_ID_HEADER",
    "RELAY_UPSTREAM_HEADER",
    "SHOULD_RETRY_HEADER",
    "Answer",
    "Exchange",
    "JSON_CONTENT_TYPE",
    "clear_headers",
    "error_answer",
    "new_request_id",
    "note_repairs",
    "note_rewrite",
    "stamp_request_id",
    "whole",
    "without_keys",
]

#: The header that carries the relay's own id for a request; dumps are named by it.
RELAY_REQUEST_ID_HEADER = b"x-relay-request-id"
#: The header that names the upstream that served an answer.
RELAY_UPSTREAM_HEADER = b"x-relay-upstream"
#: The header that tells a client whether to retry an error (the SDKs obey it).
SHOULD_RETRY_HEADER = b"x-should-retry"

#: What the log, the metrics and usage records call the status of a request
#: whose client went away.
CLIENT_GONE_STATUS = 499

#: The content type of the JSON answers the relay makes itself.
JSON_CONTENT_TYPE = b"application/json"
# Error types an upstream puts in a mid-stream ``error`` event that mean the
# request itself was refused, as a 4xx would: those are dumped too.
_CLIENT_ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "billing_error",
    }
)
# Response headers the relay set itself, kept when an error answer replaces
# the upstream's headers: the request's id, and the drain's ``Connection: close``.
_KEPT_ON_ERROR = (RELAY_REQUEST_ID_HEADER, b"connection")

# A request id is a random per-process prefix and a counter: unique across
# processes and restarts, without a system call per request.
_REQUEST_ID_PREFIX = "rly_" + os.urandom(6).hex()
_request_numbers = itertools.count(1)


def new_request_id() -> str:
    """A new relay request id (``rly_`` and hex digits)."""
    return "%s%012x" % (_REQUEST_ID_PREFIX, next(_request_numbers))


def stamp_request_id(request) -> None:
    """Give an answer the relay makes itself its ``x-relay-request-id``, as every answer has."""
    request.setHeader(RELAY_REQUEST_ID_HEADER, new_request_id().encode("ascii"))


def whole(request, body: bytes) -> bytes:
    """Answer with a whole body, its length known (no chunked encoding)."""
    request.setHeader(b"content-length", b"%d" % (len(body),))
    return body


def error_answer(request, error: RelayError, request_id: str | None = None) -> bytes:
    """
    Answer ``request`` with the relay's own Anthropic-shaped ``error`` and
    its ``x-should-retry`` (:attr:`~twisted_relay.errors.RelayError.should_retry`);
    a request without an id yet (``request_id`` ``None``) is given one.
    """
    request.setResponseCode(error.status)
    request.setHeader(b"content-type", JSON_CONTENT_TYPE)
    request.setHeader(SHOULD_RETRY_HEADER, error.retry_header())
    if request_id is None:
        request_id = new_request_id()
        request.setHeader(RELAY_REQUEST_ID_HEADER, request_id.encode("ascii"))
    return whole(request, error.body(request_id))


def clear_headers(request) -> None:
    """Drop the upstream's headers before an error answer; keep the relay's own (:data:`_KEPT_ON_ERROR`)."""
    old, request.responseHeaders = request.responseHeaders, Headers()
    for name in _KEPT_ON_ERROR:
        keep = old.getRawHeaders(name)
        if keep:
            request.responseHeaders.setRawHeaders(name, keep)


def without_keys(answer: bytes, secrets: tuple[str, ...]) -> bytes:
    """
    An upstream's error body with every configured key (and anything
    shaped like an Anthropic key) replaced, as the dumps do: some backends
    repeat the key they were sent in a 401. Bytes that are not UTF-8 are
    kept as they are.
    """
    text = answer.decode("utf-8", "surrogateescape")
    redacted = redact_text(text, secrets)
    if redacted == text:
        return answer
    return redacted.encode("utf-8", "surrogateescape")


def _header_without_keys(value: bytes, secrets: tuple[str, ...]) -> bytes:
    """A header value with every configured key replaced, as :func:`without_keys` does for bodies."""
    text = value.decode("latin-1")
    redacted = redact_text(text, secrets)
    return value if redacted == text else redacted.encode("latin-1")


def _set_headers(request, headers: Headers, secrets: tuple[str, ...] = ()) -> None:
    """Give the client the upstream's headers, every configured key (and Anthropic-shaped key) removed."""
    for name, values in headers.getAllRawHeaders():
        request.responseHeaders.setRawHeaders(name, [_header_without_keys(value, secrets) for value in values])


# -- notes: logs and counts of what the translation did -------------------------


def note_repairs(context, request_id: str, repairs: list, count: int) -> None:
    """
    Count the ``count`` duplicate ids of the client's request that the
    translation repaired, and log each of ``repairs`` (the first of them: a
    hostile body may hold hundreds of thousands).
    """
    if count:
        context.metrics.repairs.inc(count)
    if count > len(repairs):
        context.log.info(
            "Repaired {count} duplicate ids ({relay_request_id}); the first {shown} follow",
            relay_request_id=request_id, count=count, shown=len(repairs),
        )
    for entry in repairs:
        context.log.info(
            "Repaired duplicate id {client_id} as {upstream_id} at messages.{message_index}"
            ".content.{block_index} ({relay_request_id})",
            relay_request_id=request_id,
            client_id=bounded(entry.client_id),
            upstream_id=bounded(entry.upstream_id),
            message_index=entry.message_index,
            block_index=entry.block_index,
        )


def note_rewrite(context, request_id: str, rewrite) -> None:
    """Log and count one upstream id rewritten back to the client's."""
    metrics, log = context.metrics, context.log
    metrics.ids_rewritten.labels(rewrite.block_type).inc()
    ids = dict(
        relay_request_id=request_id,
        upstream_id=bounded(rewrite.upstream_id),
        client_id=bounded(rewrite.client_id),
    )
    if rewrite.suspected_double_emission:
        metrics.suspected_double_emissions.inc()
        log.warn(
            "Suspected double emission: upstream repeated block {upstream_id} in one answer; "
            "sent to the client as {client_id} ({relay_request_id})",
            **ids,
        )
    log.info(
        "Rewrote upstream id {upstream_id} to {client_id} ({relay_request_id})",
        block_type=rewrite.block_type,
        suspected_double_emission=rewrite.suspected_double_emission,
        **ids,
    )


def _parsed(answer: bytes):
    """A whole answer's JSON, or ``None`` when it is not JSON."""
    try:
        return ujson.loads(answer)
    except (ValueError, OverflowError):
        return None


def _translate_answer(context, answer: bytes, message, translation, request_id: str) -> bytes:
    """A whole 2xx Messages answer (``message``, its parsed JSON) with the upstream's ids turned back into the client's."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return answer
    responder = translation.response()
    if not responder.translate_message(message):
        return answer
    for rewrite in responder.rewrites:
        note_rewrite(context, request_id, rewrite)
    return to_json(message)


# -- the answer to one request -----------------------------------------------------


@dataclass(slots=True)
class Exchange:
    """
    What one relayed request sent, in case its answer must be dumped: the
    client's request, and what the attempt that answered sent upstream.
    """

    request_id: str
    received_at: float
    url: str
    client_headers: Headers
    client_body: bytes | None
    upstream_headers: Headers
    upstream_body: bytes | None
    translation: object
    attempt: object
    attempts: list
    attribution: dict | None = None
    relay_key: object = None

    def dump(self, response, answer: bytes | None, stream_error: dict | None = None) -> DumpRequest:
        """The dump of this exchange refused with ``response`` (its body ``answer``)."""
        return DumpRequest(
            relay_request_id=self.request_id,
            upstream_request_id=_upstream_request_id(response.headers),
            received_at=self.received_at,
            upstream_url=self.url,
            status=response.code,
            response_headers=list(response.headers.getAllRawHeaders()),
            response_body=answer if answer is not None else b"",
            client_headers=list(self.client_headers.getAllRawHeaders()),
            client_body=self.client_body,
            upstream_headers=list(self.upstream_headers.getAllRawHeaders()),
            upstream_body=self.upstream_body,
            table=self.translation.table.to_dict(),
            policy=self.attempt.upstream.ids,
            stream_error=stream_error,
            session_id=_session_id(self.client_headers),
            upstream=self.attempt.upstream.name,
            upstream_model=self.attempt.model,
            attempts=tuple(self.attempts),
            attribution=self.attribution or None,
            relay_key=None if self.relay_key is None else {"name": self.relay_key.name, "group": self.relay_key.group},
        )


class Answer:
    """
    The upstream's answer to one relayed request, on its way to the client.

    :param context: the relay's parts for this request
        (:class:`~twisted_relay.relayed_request.RequestContext`).
    :param relayed: the request
        (:class:`~twisted_relay.relayed_request.RelayedRequest`): its
        deadline (``wait``), message thread (``turn``) and what its log
        line says (``stream``, ``error``).
    :param attempts: the attempts made
        (:class:`~twisted_relay.attempts.Attempts`), whose answering one
        hears how its answer ended (``settle``).
    :param response: the upstream's response to deliver.
    :param exchange: what was sent, for a dump.
    """

    def __init__(self, context, relayed, attempts, response, exchange: Exchange):
        self._context = context
        self._relayed = relayed
        self._attempts = attempts
        self._response = response
        self._exchange = exchange
        # A 2xx Messages answer is metered: one usage record when it ends.
        self._meter = (
            AnswerMeter(context.config.prices, relayed.requested_model)
            if relayed.route.metered and response.code < 300
            else None
        )

    def set_headers(self) -> None:
        """Give the client the upstream's status and headers, keys removed, and the upstream's name."""
        request, response = self._relayed.request, self._response
        request.setResponseCode(response.code)
        _set_headers(request, client_response_headers(response.headers, connection_tokens(response)), self._context.secrets)
        spend_headers = getattr(self._relayed, "spend_headers", None)
        if spend_headers is not None:
            # The key's own standing, not the upstream's account-wide limits.
            for name, _ in list(request.responseHeaders.getAllRawHeaders()):
                if name.lower().startswith(b"anthropic-ratelimit-"):
                    request.responseHeaders.removeHeader(name)
            for name, value in spend_headers:
                request.setHeader(name, value)
        request.setHeader(RELAY_UPSTREAM_HEADER, self._exchange.attempt.upstream.name.encode("ascii"))

    def streams(self, stream_asked: bool) -> bool:
        """The answer is to be streamed: the route streams, the client asked, and a 2xx event stream came."""
        response = self._response
        content_type = (response.headers.getRawHeaders(b"content-type") or [b""])[0]
        return (
            self._relayed.route.stream_ok
            and stream_asked
            and response.code < 300
            and content_type.startswith(b"text/event-stream")
        )

    async def whole_body(self) -> bytes:
        """
        Read the whole answer and give it as the client's body: a refusal
        dumped, an error's keys removed, a 2xx Messages answer's ids
        translated back, a message thread kept.
        """
        context, relayed, response, exchange = self._context, self._relayed, self._response, self._exchange
        request = relayed.request
        idle_timeout = exchange.attempt.upstream.idle_timeout or None
        try:
            answer = await self._read_whole(idle_timeout)
        except RelayError as e:
            # Headers have been set but nothing written: a plain error still fits.
            self._meter_end(partial=True, status=e.status)
            clear_headers(request)
            relayed.error = e.message
            return error_answer(request, e, relayed.id)
        except CancelledError:
            self._meter_end(partial=True, status=CLIENT_GONE_STATUS)
            raise
        finally:
            self._attempts.settle()
        if 400 <= response.code < 500 and exchange.translation is not None:
            self._dump(answer)
        if response.code >= 400:
            answer = without_keys(answer, context.secrets)
        elif response.code < 300 and relayed.route.translate_answer:
            message = _parsed(answer)
            if self._meter is not None:
                self._meter.whole(message)
                self._meter_end(partial=not self._meter.final)
            answer = _translate_answer(context, answer, message, exchange.translation, relayed.id)
        if relayed.turn is not None and response.code < 300:
            await relayed.settle_thread(relayed.turn.answered_json(answer))
        metrics = context.metrics
        metrics.labelled(metrics.time_to_first_byte, relayed.route.name, "false").observe(
            context.reactor.seconds() - relayed.started
        )
        return whole(request, answer)

    async def _read_whole(self, idle_timeout: float | None) -> bytes:
        context = self._context
        try:
            return await self._relayed.wait(read_body(self._response, context.reactor, idle_timeout))
        except RelayError as e:
            context.metrics.upstream_errors.labels(e.kind).inc()
            self._attempts.settle(e.kind)
            raise

    async def stream(self) -> None:
        """Stream the answer's events through the SSE gate, ids translated back, as they come."""
        context, relayed, response, exchange = self._context, self._relayed, self._response, self._exchange
        request, route = relayed.request, relayed.route
        config, clock, metrics = context.config, context.reactor, context.metrics
        relayed.stream = True
        first_byte = [True]
        # An upstream error event (overloaded, api_error) inside the stream:
        # the upstream's breaker hears of it when the stream ends.
        failed_inside = [None]

        def write(data: bytes) -> None:
            if first_byte[0] and data:
                first_byte[0] = False
                metrics.labelled(metrics.time_to_first_byte, route.name, "true").observe(
                    clock.seconds() - relayed.started
                )
            request.write(data)

        turn = relayed.turn
        if turn is not None:
            write = turn.recording(write)

        def on_error_event(payload: dict) -> None:
            error = payload.get("error") if isinstance(payload, dict) else None
            if isinstance(error, dict) and error.get("type") in _CLIENT_ERROR_TYPES:
                self._dump(None, stream_error=payload)
            else:
                failed_inside[0] = "stream_error"

        gate = SSEGate(
            write,
            exchange.translation.response(),
            clock=clock,
            idle_timeout=exchange.attempt.upstream.idle_timeout or None,
            ping_interval=config.ping_interval or None,
            on_rewrite=lambda rewrite: note_rewrite(context, exchange.request_id, rewrite),
            on_error_event=on_error_event,
            redact_error=lambda raw: without_keys(raw, context.secrets),
            on_usage=None if self._meter is None else self._read_usage,
        )
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")
        # Send the status line and headers now: the client knows at once
        # that the stream has begun.
        request.write(b"")
        request.registerProducer(gate, True)
        response.deliverBody(gate)
        metrics.active_streams.inc()
        starts = context.starts
        if starts is not None:
            # Request starts are paced while a stream runs (pacing.py).
            starts.stream_began()
        # How the stream ended, for its usage record: cut short, and the
        # status the client got (the client leaving: CLIENT_GONE_STATUS).
        partial, status = True, response.code
        try:
            await relayed.wait(gate.done)
            partial = not gate.message_stop_seen or gate.error_event_seen
            if turn is not None:
                await relayed.settle_thread(turn.stream_ended(True))
        except CancelledError:
            status = CLIENT_GONE_STATUS
            raise
        except RelayError as e:
            relayed.error = e.message
            metrics.upstream_errors.labels(e.kind or "stream").inc()
            # Nothing is taken back once the stream has begun: the
            # upstream's breaker hears of it, the client gets the error.
            self._attempts.settle(e.kind or "stream")
            context.log.warn(
                "Stream {relay_request_id} from {upstream} ended with an error: {message}",
                relay_request_id=exchange.request_id,
                upstream=exchange.attempt.upstream.name,
                message=e.message,
            )
            request.write(e.sse_event())
        else:
            self._attempts.settle(failed_inside[0])
        finally:
            metrics.active_streams.dec()
            if starts is not None:
                starts.stream_ended()
            self._meter_end(partial=partial, status=status)
            # A request whose connection is gone has no channel left to
            # unregister from (it let go of its producer then).
            if request.channel is not None:
                request.unregisterProducer()

    # -- metering ---------------------------------------------------------------

    def _read_usage(self, name: bytes, payload: dict) -> None:
        """The gate's reader of ``message_start`` and ``message_delta``: never raises into the gate."""
        meter = self._meter
        if meter is None:
            return
        try:
            if name == b"message_delta":
                meter.message_delta(payload)
            else:
                meter.message_start(payload)
        except Exception:
            self._meter = None
            self._context.log.failure("Metering {relay_request_id} failed", relay_request_id=self._relayed.id)

    def _meter_end(self, partial: bool, status: int | None = None) -> None:
        """
        The answer has ended: make its one usage record, count it and hand
        it to the ledger (nothing when it is not metered, or already was).
        """
        meter, self._meter = self._meter, None
        if meter is None:
            return
        status = self._response.code if status is None else status
        batch = self._context.batch
        if batch is None:
            self._record(meter, partial, status)
        else:
            batch.add(lambda: self._record(meter, partial, status))

    def _record(self, meter: AnswerMeter, partial: bool, status: int) -> None:
        """Make the answer's usage record, count it and hand it to the ledger."""
        context, relayed = self._context, self._relayed
        attempt = self._exchange.attempt
        upstream = attempt.upstream
        try:
            tier = self._response.headers.getRawHeaders(BEDROCK_TIER_HEADER)
            record = meter.record(
                at=self._exchange.received_at,
                request_id=relayed.id,
                relay_key=relayed.relay_key,
                attribution=relayed.attribution,
                upstream=upstream.name,
                status=status,
                stream=relayed.stream,
                partial=partial,
                platform=platform_of(upstream.wire, upstream.region, attempt.model, upstream.login),
                platform_tier=platform_tier(
                    upstream.wire, upstream.service_tier, tier[0].decode("latin-1") if tier else None
                ),
            )
            if context.metrics.count_usage(record):
                context.log.warn(
                    "Model {model} has no price in the price table (or not for this answer's speed, "
                    "geography, tier or platform): its answers are metered in tokens only",
                    model=bounded(record.model),
                )
            if context.ledger is not None:
                # It never blocks nor raises, by its contract; a bug there
                # must not end the answer either.
                context.ledger.record(record)
        except Exception:
            context.log.failure("Metering {relay_request_id} failed", relay_request_id=relayed.id)

    def _dump(self, answer: bytes | None, stream_error: dict | None = None) -> None:
        dumps = self._context.dumps
        if dumps is not None:
            dumps.submit(self._exchange.dump(self._response, answer, stream_error))


# Where an upstream names its request: Anthropic's API (and Vertex), Bedrock, Azure's gateway.
_REQUEST_ID_HEADERS = (b"request-id", b"x-amzn-requestid", b"apim-request-id")


def _upstream_request_id(headers: Headers) -> str | None:
    """The upstream's id of its answer, under the name its platform gives it."""
    for name in _REQUEST_ID_HEADERS:
        values = headers.getRawHeaders(name)
        if values and values[0]:
            return values[0].decode("latin-1")
    return None


def _session_id(headers: Headers) -> str | None:
    values = headers.getRawHeaders(b"x-claude-code-session-id")
    return values[0].decode("latin-1") if values else None
