# -*- test-case-name: tests.test_app -*-
"""
The relay's HTTP face: Klein routes that wire one request through the parts.

A route admits the request (relay keys, load, shutdown), parses and checks
the client's body, builds the id translation for it, sends the
upstream-bound request (again, on failures before any byte reached the
client, if retries are on), and either streams the answer through the SSE
gate or rewrites a whole JSON answer. Errors the relay raises itself are
Anthropic-shaped; errors the upstream raises pass through untouched.
"""

from __future__ import annotations

import hmac
import itertools
import os
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import ujson
from klein import Klein
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred, succeed
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from werkzeug.exceptions import MethodNotAllowed, NotFound

from twisted_relay._json import dumps
from twisted_relay._version import __version__
from twisted_relay.config import RelayConfig
from twisted_relay.drain import close_after_answer
from twisted_relay.errors import RelayError
from twisted_relay.logs import bounded
from twisted_relay.metrics import RelayMetrics
from twisted_relay.sse import SSEGate
from twisted_relay.translation import translate_request
from twisted_relay.upstream import (
    UpstreamClient,
    client_response_headers,
    read_body,
    upstream_request_headers,
)

__all__ = ["RelayApp", "RELAY_REQUEST_ID_HEADER"]

#: The header that carries the relay's own id for a request; dumps are named by it.
RELAY_REQUEST_ID_HEADER = b"x-relay-request-id"

_JSON = b"application/json"
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
# Failures that happen before the upstream saw the request, or that it
# dropped before answering: safe to send again.
_RETRYABLE_KINDS = frozenset({"connect", "dropped"})
# What the log and the metrics call a request whose client went away.
_CLIENT_GONE = 499


# A request id is a random per-process prefix and a counter: unique across
# processes and restarts, without a system call per request.
_REQUEST_ID_PREFIX = "rly_" + os.urandom(6).hex()
_request_numbers = itertools.count(1)


def _new_request_id() -> str:
    return "%s%012x" % (_REQUEST_ID_PREFIX, next(_request_numbers))


_dumps = dumps


class RelayApp:
    """
    The Messages relay as a Klein application.

    :param config: the relay's settings.
    :param client: the upstream client (owns the connection pool).
    :param reactor: the reactor, for timers.
    :param dumps: the diagnostic dump writer, or ``None`` for no dumps.
    :param metrics: the relay's metrics; a fresh set when ``None``.
    """

    app = Klein()
    # Relay paths as they come: no redirect of "//" (werkzeug's default).
    app.url_map.merge_slashes = False
    log = Logger()

    def __init__(
        self,
        config: RelayConfig,
        client: UpstreamClient,
        *,
        reactor,
        dumps=None,
        metrics: RelayMetrics | None = None,
    ):
        self._config = config
        self._client = client
        self._reactor = reactor
        self._dumps = dumps
        self.metrics = metrics if metrics is not None else RelayMetrics(dumps)
        # Read when scraped: no work per request.
        self.metrics.watch_active_requests(lambda: len(self._active))
        self._relay_keys = tuple(key.encode("utf-8") for key in config.relay_keys)
        self._active: set = set()
        self._draining = False
        self._idle_waiters: list[Deferred] = []

    def resource(self):
        """The relay's web resource, to serve or to mount in another ``Site``."""
        return _RelayResource(self, self.app.resource())

    # -- routes -----------------------------------------------------------

    @app.route("/v1/messages", methods=["POST"])
    def messages(self, request):
        """Relay a Messages request, streaming or not."""
        return self._relay(request, "messages", has_body=True, stream_ok=True, translate_answer=True)

    def render_messages(self, request):
        """
        ``POST /v1/messages`` without Klein's URL matching, per-request map
        binding and Deferred wrappers (an eighth of a small request's CPU):
        the relay's own hot path. It answers as Klein does for the route:
        the returned body is written and the request finished; a client that
        leaves cancels the work; a failure nobody handled is Twisted's 500.
        """
        finished = []
        request.notifyFinish().addBoth(finished.append)
        d = ensureDeferred(self.messages(request))
        request.notifyFinish().addErrback(lambda _: d.cancel())

        def answer(body):
            if body is not None:
                request.write(body)
            if not finished:
                request.finish()

        def failed(failure):
            if finished:
                if not failure.check(CancelledError):
                    self.log.failure("Unhandled error relaying a request", failure)
                return
            request.processingFailed(failure)

        d.addCallbacks(answer, failed)
        d.addErrback(lambda failure: self.log.failure("Unhandled error writing an answer", failure))
        return NOT_DONE_YET

    @app.route("/v1/messages/count_tokens", methods=["POST"])
    def count_tokens(self, request):
        """Relay a token count; the upstream counts the history it would see."""
        return self._relay(request, "count_tokens", has_body=True, stream_ok=False, translate_answer=False)

    @app.route("/v1/models", methods=["GET"])
    def models(self, request):
        """Relay the model list."""
        return self._relay(request, "models", has_body=False, stream_ok=False, translate_answer=False)

    @app.route("/v1/models/<path:model_id>", methods=["GET"])
    def model(self, request, model_id):
        """Relay one model's description."""
        return self._relay(request, "models", has_body=False, stream_ok=False, translate_answer=False)

    @app.route("/", methods=["HEAD"])
    @app.route("/api/hello", methods=["HEAD", "GET"])
    def hello(self, request):
        """Answer clients' connection-warming probes at once."""
        request.setHeader(b"content-type", _JSON)
        return b""

    @app.route("/health", methods=["GET"])
    def health(self, request):
        """Say that the relay process (which one: ``pid``) is up; it does not ask the upstream."""
        request.setHeader(b"content-type", _JSON)
        return _dumps({"status": "ok", "version": __version__, "pid": os.getpid()})

    @app.route("/ready", methods=["GET"])
    def ready(self, request):
        """Say whether the relay takes new requests: not while it shuts down."""
        request.setHeader(b"content-type", _JSON)
        if self._draining or self._client.base_url is None:
            request.setResponseCode(503)
            return _dumps({"status": "draining" if self._draining else "starting"})
        return _dumps({"status": "ready", "active_requests": len(self._active)})

    @app.route("/metrics", methods=["GET"])
    def metrics_page(self, request):
        """Prometheus metrics, when enabled."""
        if not self._config.metrics:
            raise NotFound()
        return self.metrics.resource()

    @app.handle_errors(NotFound)
    def not_found(self, request, failure):
        """Unknown paths get an Anthropic-shaped 404."""
        return self._error(
            request,
            RelayError(404, "The relay has no route for %s %s." % _method_and_path(request)),
        )

    @app.handle_errors(MethodNotAllowed)
    def method_not_allowed(self, request, failure):
        """Known paths asked with the wrong method get an Anthropic-shaped 405."""
        return self._error(request, RelayError(405, "%s is not allowed on %s." % _method_and_path(request)))

    # -- draining ---------------------------------------------------------

    def begin_draining(self) -> None:
        """
        From now on ``/ready`` answers 503; requests are still served. The
        connections of requests in flight close when their answers end.
        """
        self._draining = True
        for request in self._active:
            close_after_answer(request)

    @property
    def in_flight(self) -> int:
        """Requests being relayed now."""
        return len(self._active)

    def drain(self, grace: float) -> Deferred:
        """
        Say 503 at ``/ready``; fire when the requests in flight are done, or
        after ``grace`` seconds, when the connections of the rest are closed.
        """
        self._draining = True
        if not self._active:
            return succeed(None)
        waiter = Deferred()
        self._idle_waiters.append(waiter)

        def deadline():
            if waiter.called:
                return
            self.log.warn(
                "Shutdown grace of {grace}s over; closing {count} requests still in flight",
                grace=grace,
                count=len(self._active),
            )
            for request in list(self._active):
                request.channel.transport.loseConnection()
            self._idle_waiters.remove(waiter)
            waiter.callback(None)

        timer = self._reactor.callLater(grace, deadline)
        waiter.addBoth(lambda result: (timer.cancel() if timer.active() else None, result)[1])
        return waiter

    def _begin(self, request) -> None:
        self._active.add(request)

    def _end(self, request) -> None:
        self._active.discard(request)
        if not self._active and self._idle_waiters:
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                waiter.callback(None)

    # -- the work ---------------------------------------------------------

    def _error(self, request, error: RelayError, request_id: str | None = None) -> bytes:
        request.setResponseCode(error.status)
        request.setHeader(b"content-type", _JSON)
        if request_id is None:
            request_id = _new_request_id()
            request.setHeader(RELAY_REQUEST_ID_HEADER, request_id.encode("ascii"))
        return _whole(request, error.body(request_id))

    def _admit(self, request) -> None:
        """Refuse a request the relay must not take now, and say why."""
        # While draining, requests on connections still open are served (a
        # load balancer does not resend a refused POST); each such
        # connection closes as its answer ends (drain.py).
        if self._relay_keys and not self._key_allowed(request):
            raise RelayError(
                401,
                "The relay requires a relay key in x-api-key or Authorization: Bearer.",
            )
        limit = self._config.max_concurrent
        if limit and len(self._active) > limit:
            raise RelayError(
                529,
                "The relay is handling %d requests, its limit; try again shortly." % (limit,),
                kind="overloaded",
            )

    def _key_allowed(self, request) -> bool:
        presented = []
        presented.extend(request.requestHeaders.getRawHeaders(b"x-api-key", []))
        for value in request.requestHeaders.getRawHeaders(b"authorization", []):
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                presented.append(token.strip())
        allowed = False
        # Compare every presented key with every relay key, in constant time
        # per comparison, and never stop early.
        for candidate in presented:
            for key in self._relay_keys:
                allowed |= hmac.compare_digest(candidate, key)
        return allowed

    def _read_body(self, request) -> bytes:
        if getattr(request, "body_too_large", False):
            raise RelayError(
                413,
                "Request body is over %d bytes, the most the relay accepts." % (self._config.max_body,),
            )
        content = request.content
        content.seek(0, os.SEEK_END)
        size = content.tell()
        if size > self._config.max_body:
            raise RelayError(
                413,
                "Request body is %d bytes; the relay accepts at most %d." % (size, self._config.max_body),
            )
        content.seek(0)
        return content.read()

    def _parse_messages_body(self, raw: bytes) -> dict:
        try:
            body = ujson.loads(raw)
        except (ValueError, OverflowError) as e:
            raise RelayError(400, "Request body is not valid JSON: %s." % (e,))
        if not isinstance(body, dict):
            raise RelayError(400, "Request body must be a JSON object.")
        if not isinstance(body.get("messages"), list):
            raise RelayError(400, "messages: Field required and must be a list.")
        return body

    async def _relay(self, request, route: str, *, has_body: bool, stream_ok: bool, translate_answer: bool):
        request_id = _new_request_id()
        request.setHeader(RELAY_REQUEST_ID_HEADER, request_id.encode("ascii"))
        started = self._reactor.seconds()
        outcome = _Outcome()
        # Fires (with None, whatever happened) once the request is finished
        # or its connection lost.
        settled = request.notifyFinish()
        settled.addErrback(lambda _: None)
        self._begin(request)
        try:
            return await self._relay_admitted(
                request, route, request_id, started, outcome, has_body, stream_ok, translate_answer
            )
        except CancelledError:
            outcome.status = _CLIENT_GONE
            # The client's transport stops the stream before the request
            # hears of the lost connection; wait until it has, so Klein knows
            # the request is gone and does not treat the cancellation as a
            # failure to render.
            if not settled.called:
                await settled
            raise
        except Exception:
            self.log.failure("Unexpected failure relaying {relay_request_id}", relay_request_id=request_id)
            outcome.status, outcome.error = 500, "internal relay error"
            if request.startedWriting:
                raise
            _clear_headers(request)
            return self._error(request, RelayError(500, "Internal relay error."), request_id)
        finally:
            self._end(request)
            status = outcome.status or request.code
            self.metrics.labelled(self.metrics.requests, route, str(status)).inc()
            self.log.info(
                "{method} {path} {status} {duration_ms}ms ({relay_request_id})",
                method=request.method.decode("ascii", "replace"),
                path=request.path.decode("utf-8", "replace"),
                status=status,
                duration_ms=round((self._reactor.seconds() - started) * 1000.0, 1),
                relay_request_id=request_id,
                stream=outcome.stream,
                error=None if outcome.error is None else bounded(outcome.error, 1000),
            )

    async def _relay_admitted(
        self, request, route, request_id, started, outcome, has_body, stream_ok, translate_answer
    ):
        config = self._config
        received_at = time.time()
        raw = upstream_body = translation = body = None
        try:
            self._admit(request)
            if has_body:
                raw = self._read_body(request)
                body = self._parse_messages_body(raw)
                translation = translate_request(body, config.upstream_ids)
                self._note_repairs(request_id, translation)
                upstream_body = _dumps(translation.upstream_body) if translation.changed else raw
            headers = upstream_request_headers(
                request.requestHeaders, config.upstream_key, strip_credentials=bool(self._relay_keys)
            )
            path = _upstream_path(request)
            response = await self._send(route, request.method, path, headers, upstream_body, started)
        except RelayError as e:
            outcome.error = e.message
            return self._error(request, e, request_id)

        exchange = _Exchange(
            request_id, received_at, self._client.display_url + path, request.requestHeaders,
            raw, headers, upstream_body, translation,
        )
        request.setResponseCode(response.code)
        _set_headers(request, client_response_headers(response.headers))
        content_type = (response.headers.getRawHeaders(b"content-type") or [b""])[0]
        if (
            stream_ok
            and body.get("stream") is True
            and response.code < 300
            and content_type.startswith(b"text/event-stream")
        ):
            outcome.stream = True
            await self._stream(request, response, exchange, route, started, outcome)
            return None
        try:
            deadline = started + config.total_timeout if config.total_timeout else None
            answer = await self._read_upstream_body(response, deadline)
        except RelayError as e:
            # Headers have been set but nothing written: a plain error still fits.
            _clear_headers(request)
            outcome.error = e.message
            return self._error(request, e, request_id)
        if 400 <= response.code < 500 and translation is not None:
            self._dump(exchange, response, answer)
        elif response.code < 300 and translate_answer:
            answer = self._translate_answer(answer, translation, request_id)
        self.metrics.labelled(self.metrics.time_to_first_byte, route, "false").observe(self._reactor.seconds() - started)
        return _whole(request, answer)

    async def _send(self, route, method, path, headers, body, started):
        """
        Send upstream; send again after a failure that reached no client
        byte, as ``retries`` and ``retry_statuses`` allow.
        """
        config = self._config
        attempt = 0
        while True:
            sent = self._reactor.seconds()
            timeout = None
            if config.total_timeout:
                timeout = max(0.001, config.total_timeout - (sent - started))
            try:
                response = await self._client.request(method, path, headers, body, timeout=timeout)
            except RelayError as e:
                if e.kind in _RETRYABLE_KINDS and attempt < config.retries:
                    attempt += 1
                    await self._retry_pause(attempt, None, e.message)
                    continue
                self.metrics.upstream_errors.labels(e.kind or "other").inc()
                raise
            self.metrics.labelled(self.metrics.upstream_latency, route).observe(self._reactor.seconds() - sent)
            if (
                response.code in config.retry_statuses
                and (response.code == 429 or response.code >= 500)
                and attempt < config.retries
            ):
                delay = _retry_after(response.headers)
                if delay is None or delay <= config.max_retry_wait:
                    attempt += 1
                    # Read the refused answer, so its connection goes back to the pool.
                    try:
                        await read_body(response, self._reactor, config.idle_timeout or None)
                    except RelayError:
                        pass
                    await self._retry_pause(attempt, delay, "status %d" % (response.code,))
                    continue
            return response

    def _retry_pause(self, attempt: int, delay: float | None, why: str) -> Deferred:
        if delay is None:
            delay = min(8.0, 0.5 * 2 ** (attempt - 1))
        self.metrics.retries.inc()
        self.log.info("Retrying upstream request ({why}), attempt {attempt} in {delay}s", why=why, attempt=attempt + 1, delay=delay)
        return deferLater(self._reactor, delay, lambda: None)

    async def _read_upstream_body(self, response, deadline: float | None = None) -> bytes:
        try:
            return await read_body(response, self._reactor, self._config.idle_timeout or None, deadline)
        except RelayError as e:
            self.metrics.upstream_errors.labels(e.kind).inc()
            raise

    def _translate_answer(self, answer: bytes, translation, request_id: str) -> bytes:
        try:
            message = ujson.loads(answer)
        except (ValueError, OverflowError):
            return answer
        if not isinstance(message, dict) or not isinstance(message.get("content"), list):
            return answer
        responder = translation.response()
        if not responder.translate_message(message):
            return answer
        for rewrite in responder.rewrites:
            self._note_rewrite(request_id, rewrite)
        return _dumps(message)

    async def _stream(self, request, response, exchange: "_Exchange", route, started, outcome) -> None:
        config = self._config
        metrics = self.metrics
        first_byte = [True]

        def write(data: bytes) -> None:
            if first_byte[0] and data:
                first_byte[0] = False
                metrics.labelled(metrics.time_to_first_byte, route, "true").observe(self._reactor.seconds() - started)
            request.write(data)

        def on_error_event(payload: dict) -> None:
            error = payload.get("error") if isinstance(payload, dict) else None
            if isinstance(error, dict) and error.get("type") in _CLIENT_ERROR_TYPES:
                self._dump(exchange, response, None, stream_error=payload)

        gate = SSEGate(
            write,
            exchange.translation.response(),
            clock=self._reactor,
            idle_timeout=config.idle_timeout or None,
            ping_interval=config.ping_interval or None,
            on_rewrite=lambda rewrite: self._note_rewrite(exchange.request_id, rewrite),
            on_error_event=on_error_event,
        )
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")
        # Send the status line and headers now: the client knows at once
        # that the stream has begun.
        request.write(b"")
        request.registerProducer(gate, True)
        response.deliverBody(gate)
        over_time = []
        timer = None
        if config.total_timeout:
            def too_long():
                over_time.append(True)
                gate.stopProducing()

            timer = self._reactor.callLater(max(0.0, config.total_timeout - (self._reactor.seconds() - started)), too_long)
        metrics.active_streams.inc()
        try:
            await gate.done
        except RelayError as e:
            outcome.error = e.message
            metrics.upstream_errors.labels(e.kind or "stream").inc()
            self.log.warn(
                "Stream {relay_request_id} ended with an error: {message}",
                relay_request_id=exchange.request_id,
                message=e.message,
            )
            request.write(e.sse_event())
        except CancelledError:
            if not over_time:
                raise
            error = RelayError(
                504, "The request took longer than %g seconds, the relay's limit." % (config.total_timeout,),
                kind="total_timeout",
            )
            outcome.error = error.message
            metrics.upstream_errors.labels(error.kind).inc()
            request.write(error.sse_event())
        finally:
            metrics.active_streams.dec()
            if timer is not None and timer.active():
                timer.cancel()
            request.unregisterProducer()

    # -- side effects -----------------------------------------------------

    def _dump(self, exchange: "_Exchange", response, answer: bytes | None, stream_error=None) -> None:
        if self._dumps is None:
            return
        self._dumps.submit(
            relay_request_id=exchange.request_id,
            upstream_request_id=(response.headers.getRawHeaders(b"request-id") or [b""])[0].decode("latin-1")
            or None,
            received_at=exchange.received_at,
            upstream_url=exchange.url,
            status=response.code,
            response_headers=list(response.headers.getAllRawHeaders()),
            response_body=answer if answer is not None else b"",
            client_headers=list(exchange.client_headers.getAllRawHeaders()),
            client_body=exchange.client_body,
            upstream_headers=list(exchange.upstream_headers.getAllRawHeaders()),
            upstream_body=exchange.upstream_body,
            table=exchange.translation.table.to_dict(),
            policy=self._config.upstream_ids,
            stream_error=stream_error,
            session_id=_session_id(exchange.client_headers),
        )

    def _note_repairs(self, request_id: str, translation) -> None:
        for entry in translation.repairs:
            self.metrics.repairs.inc()
            self.log.info(
                "Repaired duplicate id {client_id} as {upstream_id} at messages.{message_index}"
                ".content.{block_index} ({relay_request_id})",
                relay_request_id=request_id,
                client_id=bounded(entry.client_id),
                upstream_id=bounded(entry.upstream_id),
                message_index=entry.message_index,
                block_index=entry.block_index,
            )

    def _note_rewrite(self, request_id: str, rewrite) -> None:
        self.metrics.ids_rewritten.labels(rewrite.block_type).inc()
        ids = dict(
            relay_request_id=request_id,
            upstream_id=bounded(rewrite.upstream_id),
            client_id=bounded(rewrite.client_id),
        )
        if rewrite.suspected_double_emission:
            self.metrics.suspected_double_emissions.inc()
            self.log.warn(
                "Suspected double emission: upstream repeated block {upstream_id} in one answer; "
                "sent to the client as {client_id} ({relay_request_id})",
                **ids,
            )
        self.log.info(
            "Rewrote upstream id {upstream_id} to {client_id} ({relay_request_id})",
            block_type=rewrite.block_type,
            suspected_double_emission=rewrite.suspected_double_emission,
            **ids,
        )


_MESSAGES_PATH = [b"v1", b"messages"]


class _RelayResource(Resource):
    """
    The relay's resource: answers a path that is not UTF-8 with an
    Anthropic-shaped 400 (Klein's own answer is an HTML page), takes
    ``POST /v1/messages`` straight to the relay, and leaves every other
    request to Klein.
    """

    isLeaf = True

    def __init__(self, relay: "RelayApp", klein_resource):
        super().__init__()
        self._relay = relay
        self._klein = klein_resource

    def render(self, request):
        try:
            b"/".join(request.prepath + request.postpath).decode("utf-8")
        except UnicodeDecodeError:
            error = RelayError(400, "The request path is not valid UTF-8.")
            request.setResponseCode(400)
            request.setHeader(b"content-type", _JSON)
            request_id = _new_request_id()
            request.setHeader(RELAY_REQUEST_ID_HEADER, request_id.encode("ascii"))
            return _whole(request, error.body(request_id))
        if self._relay._draining:
            close_after_answer(request)
        # Where the relay is mounted, for the upstream path.
        request.relay_mount = b"/".join(request.prepath)
        if request.method == b"POST" and request.postpath == _MESSAGES_PATH:
            return self._relay.render_messages(request)
        return self._klein.render(request)


@dataclass(slots=True)
class _Exchange:
    """What one relayed request keeps, in case its answer must be dumped."""

    request_id: str
    received_at: float
    url: str
    client_headers: Headers
    client_body: bytes | None
    upstream_headers: Headers
    upstream_body: bytes | None
    translation: object


@dataclass(slots=True)
class _Outcome:
    """What the request log line and the metrics say of one request."""

    status: int | None = None
    stream: bool = False
    error: str | None = None


def _method_and_path(request) -> tuple[str, str]:
    return request.method.decode("ascii", "replace"), request.path.decode("utf-8", "replace")


def _retry_after(headers: Headers) -> float | None:
    """The wait an upstream asks for: ``retry-after-ms``, or ``retry-after`` (seconds or a date)."""
    for value in headers.getRawHeaders(b"retry-after-ms", []):
        try:
            return max(0.0, float(value) / 1000.0)
        except ValueError:
            pass
    for value in headers.getRawHeaders(b"retry-after", []):
        try:
            return max(0.0, float(value))
        except ValueError:
            try:
                return max(0.0, parsedate_to_datetime(value.decode("latin-1")).timestamp() - time.time())
            except (TypeError, ValueError):
                pass
    return None


def _upstream_path(request) -> str:
    """
    The client's path and query string, relative to where the relay is
    mounted: ``/relay/v1/messages?beta=true`` under ``/relay`` is
    ``/v1/messages?beta=true`` upstream.
    """
    uri = request.uri
    mount = getattr(request, "relay_mount", b"").strip(b"/")
    if mount and uri.startswith(b"/" + mount + b"/"):
        uri = uri[len(mount) + 1 :]
    return uri.decode("latin-1")


def _whole(request, body: bytes) -> bytes:
    """Answer with a whole body, its length known (no chunked encoding)."""
    request.setHeader(b"content-length", b"%d" % (len(body),))
    return body


def _set_headers(request, headers: Headers) -> None:
    for name, values in headers.getAllRawHeaders():
        request.responseHeaders.setRawHeaders(name, values)


def _clear_headers(request) -> None:
    keep = request.responseHeaders.getRawHeaders(RELAY_REQUEST_ID_HEADER)
    request.responseHeaders = Headers()
    if keep:
        request.responseHeaders.setRawHeaders(RELAY_REQUEST_ID_HEADER, keep)


def _session_id(headers: Headers) -> str | None:
    values = headers.getRawHeaders(b"x-claude-code-session-id")
    return values[0].decode("latin-1") if values else None
