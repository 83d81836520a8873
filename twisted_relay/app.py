# -*- test-case-name: tests.test_app -*-
"""
The relay's HTTP face: Klein routes that wire one request through the parts.

A route parses and checks the client's body, builds the id translation for
it, sends the upstream-bound request, and either streams the answer through
the SSE gate or rewrites a whole JSON answer. Errors the relay raises itself
are Anthropic-shaped; errors the upstream raises pass through untouched.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import treq
import ujson
from klein import Klein
from klein.interfaces import IKleinRequest
from twisted.internet.defer import CancelledError
from twisted.logger import Logger
from twisted.web.http_headers import Headers
from werkzeug.exceptions import MethodNotAllowed, NotFound

from twisted_relay._version import __version__
from twisted_relay.config import RelayConfig
from twisted_relay.errors import RelayError, error_body
from twisted_relay.sse import SSEGate
from twisted_relay.translation import translate_request
from twisted_relay.upstream import (
    UpstreamClient,
    client_response_headers,
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


def _new_request_id() -> str:
    return "rly_" + os.urandom(12).hex()


def _dumps(value) -> bytes:
    return ujson.dumps(value, ensure_ascii=False, escape_forward_slashes=False).encode(
        "utf-8"
    )


class RelayApp:
    """
    The Messages relay as a Klein application.

    :param config: the relay's settings.
    :param client: the upstream client (owns the connection pool).
    :param reactor: the reactor, for timers.
    :param dumps: the diagnostic dump writer, or ``None`` for no dumps.
    """

    app = Klein()
    log = Logger()

    def __init__(self, config: RelayConfig, client: UpstreamClient, *, reactor, dumps=None):
        self._config = config
        self._client = client
        self._reactor = reactor
        self._dumps = dumps

    def resource(self):
        """The relay's web resource, to serve or to mount in another ``Site``."""
        return self.app.resource()

    # -- routes -----------------------------------------------------------

    @app.route("/v1/messages", methods=["POST"])
    def messages(self, request):
        """Relay a Messages request, streaming or not."""
        return self._relay_json(request, streaming_allowed=True, translate_answer=True)

    @app.route("/v1/messages/count_tokens", methods=["POST"])
    def count_tokens(self, request):
        """Relay a token count; the upstream counts the history it would see."""
        return self._relay_json(request, streaming_allowed=False, translate_answer=False)

    @app.route("/v1/models", methods=["GET"])
    def models(self, request):
        """Relay the model list."""
        return self._relay_get(request)

    @app.route("/v1/models/<path:model_id>", methods=["GET"])
    def model(self, request, model_id):
        """Relay one model's description."""
        return self._relay_get(request)

    @app.route("/", methods=["HEAD"])
    @app.route("/api/hello", methods=["HEAD", "GET"])
    def hello(self, request):
        """Answer clients' connection-warming probes at once."""
        request.setHeader(b"content-type", _JSON)
        return b""

    @app.route("/health", methods=["GET"])
    def health(self, request):
        """Say that the relay is up (it does not ask the upstream)."""
        request.setHeader(b"content-type", _JSON)
        return _dumps({"status": "ok", "version": __version__})

    @app.handle_errors(NotFound)
    def not_found(self, request, failure):
        """Unknown paths get an Anthropic-shaped 404."""
        return self._error(
            request,
            RelayError(
                404,
                "The relay has no route for %s %s."
                % (request.method.decode("ascii", "replace"), request.path.decode("utf-8", "replace")),
            ),
        )

    @app.handle_errors(MethodNotAllowed)
    def method_not_allowed(self, request, failure):
        """Known paths asked with the wrong method get an Anthropic-shaped 405."""
        return self._error(
            request,
            RelayError(
                405,
                "%s is not allowed on %s."
                % (request.method.decode("ascii", "replace"), request.path.decode("utf-8", "replace")),
            ),
        )

    # -- the work ---------------------------------------------------------

    def _error(self, request, error: RelayError, request_id: str | None = None) -> bytes:
        request.setResponseCode(error.status)
        request.setHeader(b"content-type", _JSON)
        if request_id is None:
            request_id = _new_request_id()
            request.setHeader(RELAY_REQUEST_ID_HEADER, request_id.encode("ascii"))
        return error.body(request_id)

    def _read_body(self, request) -> bytes:
        content = request.content
        content.seek(0, os.SEEK_END)
        size = content.tell()
        if size > self._config.max_body:
            raise RelayError(
                413,
                "Request body is %d bytes; the relay accepts at most %d."
                % (size, self._config.max_body),
            )
        content.seek(0)
        return content.read()

    def _parse_messages_body(self, raw: bytes) -> dict:
        try:
            body = ujson.loads(raw)
        except ValueError as e:
            raise RelayError(400, "Request body is not valid JSON: %s." % (e,))
        if not isinstance(body, dict):
            raise RelayError(400, "Request body must be a JSON object.")
        if not isinstance(body.get("messages"), list):
            raise RelayError(400, "messages: Field required and must be a list.")
        return body

    async def _relay_json(self, request, *, streaming_allowed: bool, translate_answer: bool):
        request_id = _new_request_id()
        request.setHeader(RELAY_REQUEST_ID_HEADER, request_id.encode("ascii"))
        started = self._reactor.seconds()
        received_at = time.time()
        try:
            raw = self._read_body(request)
            body = self._parse_messages_body(raw)
            translation = translate_request(body, self._config.upstream_ids)
            self._log_repairs(request_id, translation)
            upstream_body = _dumps(translation.upstream_body) if translation.changed else raw
            headers = upstream_request_headers(request.requestHeaders, self._config.upstream_key)
            path = _upstream_path(request)
            response = await self._client.request(b"POST", path, headers, upstream_body)
        except RelayError as e:
            self._log_request(request, request_id, e.status, started, error=e.message)
            return self._error(request, e, request_id)
        except CancelledError:
            raise
        except Exception:
            self.log.failure("Unexpected failure relaying {relay_request_id}", relay_request_id=request_id)
            return self._error(request, RelayError(500, "Internal relay error."), request_id)

        exchange = _Exchange(
            request_id,
            received_at,
            self._client.url_for(path),
            request.requestHeaders,
            raw,
            headers,
            upstream_body,
            translation,
        )
        request.setResponseCode(response.code)
        _set_headers(request, client_response_headers(response.headers))
        content_type = (response.headers.getRawHeaders(b"content-type") or [b""])[0]
        try:
            if (
                streaming_allowed
                and body.get("stream") is True
                and response.code < 300
                and content_type.startswith(b"text/event-stream")
            ):
                await self._stream(request, response, exchange)
                self._log_request(request, request_id, response.code, started, stream=True)
                return None
            answer = await self._read_upstream_body(response)
        except CancelledError:
            raise
        except RelayError as e:
            # Headers have been set but nothing written: a plain error still fits.
            if not request.startedWriting:
                _clear_headers(request)
                self._log_request(request, request_id, e.status, started, error=e.message)
                return self._error(request, e, request_id)
            raise
        if response.code >= 400:
            if response.code < 500:
                self._dump(exchange, response, answer)
            self._log_request(request, request_id, response.code, started)
            return _whole(request, answer)
        if translate_answer:
            answer = self._translate_answer(answer, translation, request_id)
        self._log_request(request, request_id, response.code, started)
        return _whole(request, answer)

    async def _read_upstream_body(self, response) -> bytes:
        try:
            return await treq.content(response)
        except CancelledError:
            raise
        except Exception as e:
            raise RelayError(502, "The upstream's answer was cut off: %s." % (e.__class__.__name__,))

    def _translate_answer(self, answer: bytes, translation, request_id: str) -> bytes:
        try:
            message = ujson.loads(answer)
        except ValueError:
            return answer
        if not isinstance(message, dict) or not isinstance(message.get("content"), list):
            return answer
        responder = translation.response()
        if not responder.translate_message(message):
            return answer
        for rewrite in responder.rewrites:
            self._log_rewrite(request_id, rewrite)
        return _dumps(message)

    async def _stream(self, request, response, exchange: "_Exchange") -> None:
        config = self._config

        def on_error_event(payload: dict) -> None:
            error = payload.get("error") if isinstance(payload, dict) else None
            if isinstance(error, dict) and error.get("type") in _CLIENT_ERROR_TYPES:
                self._dump(exchange, response, None, stream_error=payload)

        gate = SSEGate(
            request.write,
            exchange.translation.response(),
            clock=self._reactor,
            idle_timeout=config.idle_timeout or None,
            ping_interval=config.ping_interval or None,
            on_rewrite=lambda rewrite: self._log_rewrite(exchange.request_id, rewrite),
            on_error_event=on_error_event,
        )
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")
        # Send the status line and headers now: the client knows at once
        # that the stream has begun.
        request.write(b"")
        request.registerProducer(gate, True)
        response.deliverBody(gate)
        try:
            await gate.done
        except RelayError as e:
            self.log.warn(
                "Stream {relay_request_id} ended with an error: {message}",
                relay_request_id=exchange.request_id,
                message=e.message,
            )
            request.write(e.sse_event())
        finally:
            request.unregisterProducer()

    async def _relay_get(self, request):
        request_id = _new_request_id()
        request.setHeader(RELAY_REQUEST_ID_HEADER, request_id.encode("ascii"))
        started = self._reactor.seconds()
        headers = upstream_request_headers(request.requestHeaders, self._config.upstream_key)
        try:
            response = await self._client.request(
                request.method, _upstream_path(request), headers, None
            )
            answer = await self._read_upstream_body(response)
        except RelayError as e:
            self._log_request(request, request_id, e.status, started, error=e.message)
            return self._error(request, e, request_id)
        request.setResponseCode(response.code)
        _set_headers(request, client_response_headers(response.headers))
        self._log_request(request, request_id, response.code, started)
        return _whole(request, answer)

    # -- side effects -----------------------------------------------------

    def _dump(self, exchange: "_Exchange", response, answer: bytes | None, stream_error=None) -> None:
        if self._dumps is None:
            return
        self._dumps.submit(
            relay_request_id=exchange.request_id,
            upstream_request_id=(response.headers.getRawHeaders(b"request-id") or [b""])[0].decode(
                "latin-1"
            )
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

    def _log_repairs(self, request_id: str, translation) -> None:
        for entry in translation.repairs:
            self.log.info(
                "Repaired duplicate id {client_id} as {upstream_id} at messages.{message_index}"
                ".content.{block_index} ({relay_request_id})",
                relay_request_id=request_id,
                client_id=entry.client_id,
                upstream_id=entry.upstream_id,
                message_index=entry.message_index,
                block_index=entry.block_index,
            )

    def _log_rewrite(self, request_id: str, rewrite) -> None:
        self.log.info(
            "Rewrote upstream id {upstream_id} to {client_id} ({relay_request_id})",
            relay_request_id=request_id,
            upstream_id=rewrite.upstream_id,
            client_id=rewrite.client_id,
            block_type=rewrite.block_type,
            suspected_double_emission=rewrite.suspected_double_emission,
        )

    def _log_request(self, request, request_id, status, started, stream=False, error=None) -> None:
        self.log.info(
            "{method} {path} {status} {duration_ms:.1f}ms ({relay_request_id})",
            method=request.method.decode("ascii", "replace"),
            path=request.path.decode("utf-8", "replace"),
            status=status,
            duration_ms=(self._reactor.seconds() - started) * 1000.0,
            relay_request_id=request_id,
            stream=stream,
            error=error,
        )


@dataclass(slots=True)
class _Exchange:
    """What one relayed request keeps, in case its answer must be dumped."""

    request_id: str
    received_at: float
    url: str
    client_headers: Headers
    client_body: bytes
    upstream_headers: Headers
    upstream_body: bytes
    translation: object


def _upstream_path(request) -> str:
    """
    The client's path and query string, relative to where the relay is
    mounted: ``/relay/v1/messages?beta=true`` under ``/relay`` is
    ``/v1/messages?beta=true`` upstream.
    """
    uri = request.uri.decode("latin-1")
    mount = IKleinRequest(request).mapper.script_name.rstrip("/")
    if mount and uri.startswith(mount):
        uri = uri[len(mount):]
    return uri


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
