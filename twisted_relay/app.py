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
import io
import itertools
import os
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from urllib.parse import quote

import ujson
from klein import Klein
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from werkzeug.exceptions import MethodNotAllowed, NotFound

from twisted_relay._json import to_json
from twisted_relay._version import __version__
from twisted_relay.config import RelayConfig
from twisted_relay.drain import close_after_answer
from twisted_relay.errors import RelayError
from twisted_relay.logs import bounded
from twisted_relay.message_threads.turns import ThreadKeeper, credential_of, keeper_for, owner_of
from twisted_relay.metrics import RelayMetrics
from twisted_relay.redact import redact_text
from twisted_relay.routing import FAILOVER_KINDS, NoRoute, RequestFacts, Router
from twisted_relay.sse import SSEGate
from twisted_relay.translation import translate_request
from twisted_relay.upstream import (
    UpstreamClient,
    UpstreamClients,
    client_response_headers,
    connection_tokens,
    path_escapes,
    read_body,
    upstream_request_headers,
)

__all__ = ["RelayApp", "RELAY_REQUEST_ID_HEADER", "RELAY_UPSTREAM_HEADER"]

#: The header that carries the relay's own id for a request; dumps are named by it.
RELAY_REQUEST_ID_HEADER = b"x-relay-request-id"
#: The header that names the upstream that served an answer.
RELAY_UPSTREAM_HEADER = b"x-relay-upstream"

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


class RelayApp:
    """
    The Messages relay as a Klein application.

    :param config: the relay's settings.
    :param client: the upstream clients, one per upstream of ``config``
        (:class:`~twisted_relay.upstream.UpstreamClients`), or one
        :class:`~twisted_relay.upstream.UpstreamClient` for every upstream.
    :param reactor: the reactor, for timers.
    :param dumps: the diagnostic dump writer, or ``None`` for no dumps.
    :param metrics: the relay's metrics; a fresh set when ``None``.
    :param router: where each request goes (:mod:`twisted_relay.routing`);
        one made from ``config`` when ``None``.
    """

    app = Klein()
    # Relay paths as they come: no redirect of "//" (werkzeug's default).
    app.url_map.merge_slashes = False
    log = Logger()

    def __init__(
        self,
        config: RelayConfig,
        client: "UpstreamClients | UpstreamClient",
        *,
        reactor,
        dumps=None,
        metrics: RelayMetrics | None = None,
        threads: ThreadKeeper | None = None,
        router: Router | None = None,
    ):
        self._config = config
        self._reactor = reactor
        self._dumps = dumps
        self._router = router if router is not None else Router(config, reactor)
        self._clients = _OneForAll(client) if isinstance(client, UpstreamClient) else client
        self.metrics = metrics if metrics is not None else RelayMetrics(dumps)
        # Read when scraped: no work per request.
        self.metrics.watch_active_requests(lambda: len(self._active))
        self.metrics.watch_router(lambda: self._router)
        self._relay_keys = tuple(key.encode("utf-8") for key in config.relay_keys)
        self._secrets = config.secrets()
        self._active: set = set()
        self._draining = False
        self._idle_waiters: list[Deferred] = []
        # Message threads held by the relay (docs/threads.md).
        self.threads = threads if threads is not None else keeper_for(config, reactor)
        self.metrics.watch_thread_store(self.threads.store)

    def resource(self):
        """The relay's web resource, to serve or to mount in another ``Site``."""
        return _RelayResource(self, self.app.resource())

    @property
    def _client(self) -> UpstreamClient:
        """The client of the first upstream (whose URL the simulated upstream sets late)."""
        return self._clients[self._router.config.upstreams[0].name]

    def reconfigure(self, router: Router, clients: "UpstreamClients") -> None:
        """
        Route new requests with ``router`` over ``clients`` (a reload);
        requests in flight keep the ones they started with. The keys of the
        new configuration are redacted too (those of the old one still are).
        """
        self._router = router
        self._clients = clients
        self._secrets = tuple(dict.fromkeys(self._secrets + router.config.secrets()))

    # -- routes -----------------------------------------------------------

    @app.route("/v1/messages", methods=["POST"])
    def messages(self, request):
        """Relay a Messages request, streaming or not."""
        return self._relay(request, _MESSAGES)

    @app.route("/v1/messages/count_tokens", methods=["POST"])
    def count_tokens(self, request):
        """Relay a token count; the upstream counts the history it would see."""
        return self._relay(request, _COUNT_TOKENS)

    @app.route("/v1/models", methods=["GET"])
    def models(self, request):
        """Relay the model list (to the first target of the route for any model)."""
        return self._relay(request, _MODELS)

    @app.route("/v1/models/<model_id>", methods=["GET"])
    def model(self, request, model_id):
        """Relay one model's description, routed as a request for it; a model id is one path segment."""
        return self._relay(request, _MODELS, model_id)

    @app.route("/", methods=["HEAD"])
    @app.route("/api/hello", methods=["HEAD", "GET"])
    def hello(self, request):
        """Answer clients' connection-warming probes at once."""
        _stamp_request_id(request)
        request.setHeader(b"content-type", _JSON)
        return b""

    @app.route("/health", methods=["GET"])
    def health(self, request):
        """Say that the relay process (which one: ``pid``) is up; it does not ask the upstream."""
        _stamp_request_id(request)
        request.setHeader(b"content-type", _JSON)
        return to_json({"status": "ok", "version": __version__, "pid": os.getpid()})

    @app.route("/ready", methods=["GET"])
    def ready(self, request):
        """Say whether the relay takes new requests: not while it shuts down."""
        _stamp_request_id(request)
        request.setHeader(b"content-type", _JSON)
        if self._draining or self._client.base_url is None:
            request.setResponseCode(503)
            return to_json({"status": "draining" if self._draining else "starting"})
        return to_json({"status": "ready", "active_requests": len(self._active)})

    @app.route("/metrics", methods=["GET"])
    def metrics_page(self, request):
        """Prometheus metrics, when enabled."""
        if not self._config.metrics:
            raise NotFound()
        _stamp_request_id(request)
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
                _close_now(request.channel.transport)
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
        if getattr(request, "over_budget", False):
            raise RelayError(
                529,
                "The relay holds as many request bodies as its memory limit allows; try again shortly.",
                kind="overloaded",
            )
        content = request.content
        content.seek(0, os.SEEK_END)
        size = content.tell()
        if size > self._config.max_body:
            raise RelayError(
                413,
                "Request body is %d bytes; the relay accepts at most %d." % (size, self._config.max_body),
            )
        if isinstance(content, io.BytesIO):
            # The buffer itself, not a copy of it.
            return content.getvalue()
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

    def _relay(self, request, route: "_Route", model_id: str | None = None):
        return _RelayedRequest(self, request, route, model_id).run()

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
        return to_json(message)

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
            policy=exchange.attempt.upstream.ids,
            stream_error=stream_error,
            session_id=_session_id(exchange.client_headers),
            upstream=exchange.attempt.upstream.name,
            upstream_model=exchange.attempt.model,
            attempts=exchange.attempts,
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


class _RelayResource(Resource):
    """
    The relay's resource: answers a path that is not UTF-8 with an
    Anthropic-shaped 400 (Klein's own answer is an HTML page), and leaves
    every other request to Klein's routes.
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
            return self._relay._error(request, RelayError(400, "The request path is not valid UTF-8."))
        if self._relay._draining:
            close_after_answer(request)
        # Where the relay is mounted, for the upstream path.
        request.relay_mount = b"/".join(request.prepath)
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
    attempt: object
    attempts: list


@dataclass(frozen=True, slots=True)
class _Sent:
    """What one attempt sends upstream."""

    path: str
    headers: Headers
    body: bytes | None
    translation: object


class _OneForAll:
    """One client for every upstream (a relay embedded with a single client)."""

    def __init__(self, client: UpstreamClient):
        self._client = client

    def __getitem__(self, name: str) -> UpstreamClient:
        return self._client


@dataclass(frozen=True, slots=True)
class _Route:
    """What a relayed route does: its name in logs and metrics, whether it reads a Messages body, and how it answers."""

    name: str
    has_body: bool
    stream_ok: bool
    translate_answer: bool
    threads: bool = False


_MESSAGES = _Route("messages", has_body=True, stream_ok=True, translate_answer=True, threads=True)
_COUNT_TOKENS = _Route("count_tokens", has_body=True, stream_ok=False, translate_answer=False)
_MODELS = _Route("models", has_body=False, stream_ok=False, translate_answer=False)


class _RelayedRequest:
    """
    One client request on its way through the relay, from admission to the
    last byte of its answer: what it sent upstream, what became of it (for
    the request's log line and metrics) and its deadline.

    The deadline (``total_timeout``) is one timer for the whole request: it
    cancels whatever the request waits on when it fires (the upstream's
    headers, a retry's pause, a whole body or a stream), and that wait
    fails with a 504 ``total_timeout`` error.
    """

    def __init__(self, relay: RelayApp, request, route: _Route, model_id: str | None = None):
        self.relay = relay
        self.request = request
        self.route = route
        self.model_id = model_id
        # The plan of attempts, the attempt made last, and whether that
        # attempt's 2xx answer is yet to be reported to the plan.
        self.plan = None
        self.attempt = None
        self._unsettled = False
        self._body = None
        self.id = _new_request_id()
        self.started = relay._reactor.seconds()
        # What the log line and the metrics say.
        self.status: int | None = None
        self.stream = False
        self.error: str | None = None
        self._waiting: Deferred | None = None
        self._over_time = False
        self._deadline_call = None
        # The message thread this request continues or creates, if any.
        self._turn = None

    async def run(self):
        """Relay the request; return the answer's body, or ``None`` once it has been streamed."""
        relay, request = self.relay, self.request
        request.setHeader(RELAY_REQUEST_ID_HEADER, self.id.encode("ascii"))
        # Fires (with None, whatever happened) once the request is finished
        # or its connection lost.
        settled = request.notifyFinish()
        settled.addErrback(lambda _: None)
        relay._begin(request)
        if relay._config.total_timeout:
            self._deadline_call = relay._reactor.callLater(relay._config.total_timeout, self._too_long)
        try:
            return await self._relay()
        except CancelledError:
            self.status = _CLIENT_GONE
            # The client's transport stops the stream before the request
            # hears of the lost connection; wait until it has, so Klein knows
            # the request is gone and does not treat the cancellation as a
            # failure to render.
            if not settled.called:
                await settled
            raise
        except Exception:
            relay.log.failure("Unexpected failure relaying {relay_request_id}", relay_request_id=self.id)
            self.status, self.error = 500, "internal relay error"
            if request.startedWriting:
                raise
            _clear_headers(request)
            return relay._error(request, RelayError(500, "Internal relay error."), self.id)
        finally:
            if self._turn is not None:
                # Not settled by a whole answer: the thread stays where it was.
                self._turn.failed()
            if self._deadline_call is not None and self._deadline_call.active():
                self._deadline_call.cancel()
            relay._end(request)
            self._log()

    # -- the deadline ---------------------------------------------------------

    def _too_long(self) -> None:
        self._deadline_call = None
        self._over_time = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def _wait(self, d: Deferred):
        """
        Wait for ``d``. When the deadline cancels it, fail with the 504
        ``total_timeout`` error instead of ``CancelledError``.
        """
        if self._over_time:
            d.cancel()
        self._waiting = d
        try:
            return await d
        except CancelledError:
            if self._over_time:
                raise RelayError(
                    504,
                    "The request took longer than %g seconds, the relay's limit."
                    % (self.relay._config.total_timeout,),
                    kind="total_timeout",
                ) from None
            raise
        finally:
            self._waiting = None

    # -- the work ---------------------------------------------------------------

    async def _relay(self):
        relay, request, route = self.relay, self.request, self.route
        # This request's routes and clients, whatever a reload does meanwhile.
        router, clients = relay._router, relay._clients
        received_at = time.time()
        raw = body = None
        stream_asked = False
        try:
            relay._admit(request)
            # Checked before anything is read or sent: a path that could
            # leave the upstream's base path is never sent.
            path = _upstream_path(request)
            if route.has_body:
                raw = relay._read_body(request)
                body = relay._parse_messages_body(raw)
                if route.threads and "thread" in body:
                    body, raw = await self._open_thread(body, raw)
                stream_asked = body.get("stream") is True
                plan = router.plan(body, len(raw))
            elif self.model_id is not None:
                plan = router.plan_for(RequestFacts.for_model(self.model_id))
            else:
                plan = router.plan_for_listing()
            if isinstance(plan, NoRoute):
                raise plan.error()
            self.plan = plan
            # Handed over, not kept in this frame: the first attempt drops it
            # once serialised.
            self._body, body = body, None
            response, sent = await self._attempts(plan, clients, router, path, raw)
        except RelayError as e:
            self.error = e.message
            return relay._error(request, e, self.id)

        attempt = self.attempt
        idle_timeout = attempt.upstream.idle_timeout or None
        exchange = _Exchange(
            self.id, received_at, clients[attempt.upstream.name].display_url + sent.path, request.requestHeaders,
            raw, sent.headers, sent.body, sent.translation, attempt, self._attempt_labels(),
        )
        request.setResponseCode(response.code)
        _set_headers(request, client_response_headers(response.headers, connection_tokens(response)), relay._secrets)
        request.setHeader(RELAY_UPSTREAM_HEADER, attempt.upstream.name.encode("ascii"))
        content_type = (response.headers.getRawHeaders(b"content-type") or [b""])[0]
        if (
            route.stream_ok
            and stream_asked
            and response.code < 300
            and content_type.startswith(b"text/event-stream")
        ):
            self.stream = True
            await self._stream(response, exchange, idle_timeout)
            return None
        try:
            answer = await self._read_whole(response, idle_timeout)
        except RelayError as e:
            # Headers have been set but nothing written: a plain error still fits.
            _clear_headers(request)
            self.error = e.message
            return relay._error(request, e, self.id)
        finally:
            self._settle()
        if 400 <= response.code < 500 and sent.translation is not None:
            relay._dump(exchange, response, answer)
        if response.code >= 400:
            answer = _without_keys(answer, relay._secrets)
        elif response.code < 300 and route.translate_answer:
            answer = relay._translate_answer(answer, sent.translation, self.id)
        if self._turn is not None and response.code < 300:
            await self._settle_thread(self._turn.answered_json(answer))
        metrics = relay.metrics
        metrics.labelled(metrics.time_to_first_byte, route.name, "false").observe(
            relay._reactor.seconds() - self.started
        )
        return _whole(request, answer)

    async def _open_thread(self, body: dict, raw: bytes) -> tuple[dict, bytes]:
        """
        A request in a message thread becomes the plain request it stands
        for (a ``continue`` rebuilt from the thread the relay holds), which
        is then translated and sent like any other, and dumped as such.

        :raises ThreadError: the API's own answer (not found, already
            continued, in flight, changed ``system``/``tools``, malformed).
        """
        credential = credential_of(self.request.requestHeaders)
        turn = await self._wait(self.relay.threads.open(body, owner_of(credential)))
        if turn is None:
            return body, raw
        self._turn = turn
        return turn.request, to_json(turn.request)

    async def _settle_thread(self, settling: Deferred) -> None:
        """
        Wait until the thread is kept (before the answer's end reaches the
        client, so its next ``continue`` finds it; bounded by the store's
        own timeout). A store that failed was logged and counted.
        """
        self._turn = None
        try:
            await settling
        except Exception:
            self.relay.log.failure("Keeping a thread failed ({relay_request_id})", relay_request_id=self.id)

    async def _attempts(self, plan, clients, router, path: str, raw: bytes | None):
        """
        Make the plan's attempts, one at a time, until one's outcome goes to
        the client (:func:`twisted_relay.routing.judge`): an answer, or a
        failure with no answer (raised). A 2xx answer is reported to the plan
        once its body has been relayed (:meth:`_settle`).
        """
        metrics = self.relay.metrics
        attempt = plan.first()
        while True:
            self.attempt = attempt
            sent = self._prepare(attempt, router, path, raw)
            name = attempt.upstream.name
            metrics.labelled(metrics.upstream_requests, name).inc()
            try:
                response = await self._send(clients[name], sent, attempt)
            except RelayError as e:
                following = plan.report(attempt, error_kind=e.kind)
                self._note_attempt(attempt, e.kind or "failed", following)
                if following is None:
                    if len(plan.tried) > 1 and e.kind in FAILOVER_KINDS:
                        raise plan.error() from None
                    raise
                attempt = following
                continue
            if response.code < 300:
                self._unsettled = True
                return response, sent
            retry_after = _retry_after(response.headers) if response.code == 429 else None
            following = plan.report(attempt, response.code, retry_after=retry_after)
            self._note_attempt(attempt, str(response.code), following)
            if following is None:
                return response, sent
            # Read the refused answer, so its connection goes back to the pool.
            await self._discard(response, attempt)
            attempt = following

    def _prepare(self, attempt, router, path: str, raw: bytes | None) -> "_Sent":
        """The path, headers and body to send for one attempt: its model, its key, its upstream's id rules."""
        relay, request = self.relay, self.request
        headers = upstream_request_headers(
            request.requestHeaders, attempt.key, strip_credentials=bool(relay._relay_keys)
        )
        if raw is None:
            if self.model_id is not None and attempt.model is not None and attempt.model != self.model_id:
                path = _renamed_model_path(path, attempt.model)
            return _Sent(path, headers, None, None)
        # The parsed body for the first attempt; made again from the bytes
        # should another upstream be tried.
        body, self._body = self._body, None
        if body is None:
            body = ujson.loads(raw)
        renamed = attempt.model is not None and body.get("model") != attempt.model
        if renamed:
            body = dict(body)
            body["model"] = attempt.model
        translation = translate_request(body, router.rules(attempt.upstream))
        if not self.plan.tried:
            relay._note_repairs(self.id, translation)
        upstream_body = to_json(translation.upstream_body) if translation.changed or renamed else raw
        if self._turn is not None:
            upstream_body = self._turn.upstream_bytes(translation.upstream_body, upstream_body)
            headers = self._turn.upstream_headers(headers)
        # The parsed body (often ten times the size of its bytes) is not
        # needed once serialised: a request that waits on the upstream holds
        # its bytes only.
        translation.forget_body()
        return _Sent(path, headers, upstream_body, translation)

    def _note_attempt(self, attempt, outcome: str, following) -> None:
        """Log and count an attempt whose outcome did not end the request well, or moved it on."""
        relay, metrics = self.relay, self.relay.metrics
        name = attempt.upstream.name
        if outcome.isdigit() and int(outcome) < 500 and outcome not in ("401", "403", "429"):
            return  # an answer the client must see, not a failure of the upstream
        metrics.labelled(metrics.upstream_attempt_failures, name, outcome).inc()
        if following is None:
            return
        metrics.labelled(metrics.failovers, name).inc()
        relay.log.warn(
            "Upstream {attempt} answered {outcome} for {relay_request_id}; trying {following}",
            attempt=attempt.label,
            outcome=outcome,
            following=following.label,
            relay_request_id=self.id,
            upstream=name,
            upstream_model=attempt.model,
        )

    def _settle(self, error_kind: str | None = None) -> None:
        """Report the delivered 2xx attempt's outcome, once its body has gone (or broken off)."""
        if not self._unsettled:
            return
        self._unsettled = False
        attempt = self.attempt
        if error_kind is None:
            self.plan.report(attempt, 200)
        else:
            self.plan.report(attempt, error_kind=error_kind, first_byte_sent=True)
            metrics = self.relay.metrics
            metrics.labelled(metrics.upstream_attempt_failures, attempt.upstream.name, error_kind).inc()

    def _attempt_labels(self) -> list[str]:
        """Every attempt made, with its outcome: ``local (connect)``, ``anthropic key #2 (200)``."""
        labels = ["%s (%s)" % (t.attempt.label, t.outcome) for t in self.plan.tried]
        if self._unsettled:
            labels.append("%s (answered)" % (self.attempt.label,))
        return labels

    async def _discard(self, response, attempt) -> None:
        relay = self.relay
        try:
            await self._wait(read_body(response, relay._reactor, attempt.upstream.idle_timeout or None))
        except RelayError as e:
            if e.kind == "total_timeout":
                raise

    async def _send(self, client: UpstreamClient, sent: "_Sent", attempt):
        """
        Send one attempt upstream; send again after a failure that reached
        no client byte, as ``retries`` and ``retry_statuses`` allow.
        """
        relay = self.relay
        config, clock, metrics = relay._config, relay._reactor, relay.metrics
        retried = 0
        while True:
            started = clock.seconds()
            try:
                response = await self._wait(client.request(self.request.method, sent.path, sent.headers, sent.body))
            except RelayError as e:
                if e.kind in _RETRYABLE_KINDS and retried < config.retries:
                    retried += 1
                    await self._retry_pause(retried, None, e.message)
                    continue
                metrics.upstream_errors.labels(e.kind or "other").inc()
                raise
            metrics.labelled(metrics.upstream_latency, self.route.name).observe(clock.seconds() - started)
            if (
                response.code in config.retry_statuses
                and (response.code == 429 or response.code >= 500)
                and retried < config.retries
            ):
                delay = _retry_after(response.headers)
                if delay is None or delay <= config.max_retry_wait:
                    retried += 1
                    await self._discard(response, attempt)
                    await self._retry_pause(retried, delay, "status %d" % (response.code,))
                    continue
            return response

    async def _retry_pause(self, attempt: int, delay: float | None, why: str) -> None:
        if delay is None:
            delay = min(8.0, 0.5 * 2 ** (attempt - 1))
        relay = self.relay
        relay.metrics.retries.inc()
        relay.log.info(
            "Retrying upstream request ({why}), attempt {attempt} in {delay}s", why=why, attempt=attempt + 1, delay=delay
        )
        await self._wait(deferLater(relay._reactor, delay, lambda: None))

    async def _read_whole(self, response, idle_timeout: float | None) -> bytes:
        relay = self.relay
        try:
            return await self._wait(read_body(response, relay._reactor, idle_timeout))
        except RelayError as e:
            relay.metrics.upstream_errors.labels(e.kind).inc()
            if self._unsettled:
                self._settle(e.kind)
            raise

    async def _stream(self, response, exchange: "_Exchange", idle_timeout: float | None) -> None:
        relay, request, route = self.relay, self.request, self.route
        config, clock, metrics = relay._config, relay._reactor, relay.metrics
        first_byte = [True]
        # An upstream error event (overloaded, api_error) inside the stream:
        # the upstream's breaker hears of it when the stream ends.
        failed_inside = [None]

        def write(data: bytes) -> None:
            if first_byte[0] and data:
                first_byte[0] = False
                metrics.labelled(metrics.time_to_first_byte, route.name, "true").observe(clock.seconds() - self.started)
            request.write(data)

        turn = self._turn
        if turn is not None:
            write = turn.recording(write)

        def on_error_event(payload: dict) -> None:
            error = payload.get("error") if isinstance(payload, dict) else None
            if isinstance(error, dict) and error.get("type") in _CLIENT_ERROR_TYPES:
                relay._dump(exchange, response, None, stream_error=payload)
            else:
                failed_inside[0] = "stream_error"

        gate = SSEGate(
            write,
            exchange.translation.response(),
            clock=clock,
            idle_timeout=idle_timeout,
            ping_interval=config.ping_interval or None,
            on_rewrite=lambda rewrite: relay._note_rewrite(exchange.request_id, rewrite),
            on_error_event=on_error_event,
            redact_error=lambda raw: _without_keys(raw, relay._secrets),
        )
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")
        # Send the status line and headers now: the client knows at once
        # that the stream has begun.
        request.write(b"")
        request.registerProducer(gate, True)
        response.deliverBody(gate)
        metrics.active_streams.inc()
        try:
            await self._wait(gate.done)
            if turn is not None:
                await self._settle_thread(turn.stream_ended(True))
        except RelayError as e:
            self.error = e.message
            metrics.upstream_errors.labels(e.kind or "stream").inc()
            # Nothing is taken back once the stream has begun: the
            # upstream's breaker hears of it, the client gets the error.
            self._settle(e.kind or "stream")
            relay.log.warn(
                "Stream {relay_request_id} from {upstream} ended with an error: {message}",
                relay_request_id=exchange.request_id,
                upstream=exchange.attempt.upstream.name,
                message=e.message,
            )
            request.write(e.sse_event())
        else:
            self._settle(failed_inside[0])
        finally:
            metrics.active_streams.dec()
            request.unregisterProducer()

    def _log(self) -> None:
        relay, request = self.relay, self.request
        status = self.status or request.code
        relay.metrics.labelled(relay.metrics.requests, self.route.name, str(status)).inc()
        attempt = self.attempt
        relay.log.info(
            "{method} {path} {status} {duration_ms}ms ({relay_request_id})",
            method=request.method.decode("ascii", "replace"),
            path=request.path.decode("utf-8", "replace"),
            status=status,
            duration_ms=round((relay._reactor.seconds() - self.started) * 1000.0, 1),
            relay_request_id=self.id,
            stream=self.stream,
            error=None if self.error is None else bounded(self.error, 1000),
            upstream=None if attempt is None else attempt.upstream.name,
            upstream_model=None if attempt is None or attempt.model is None else bounded(attempt.model),
            attempts=None if self.plan is None else self._attempt_labels(),
        )


def _renamed_model_path(path: str, model: str) -> str:
    """``/v1/models/{id}?query`` with the model id replaced (a target's rename)."""
    target, mark, query = path.partition("?")
    head = target.rpartition("/")[0]
    return "%s/%s%s%s" % (head, quote(model, safe=""), mark, query)


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

    :raises RelayError: 404 for a path that a server or proxy on the way
        could read as one outside the upstream's base path
        (:func:`twisted_relay.upstream.path_escapes`); nothing is sent for it.
    """
    uri = request.uri
    mount = getattr(request, "relay_mount", b"").strip(b"/")
    if mount and uri.startswith(b"/" + mount + b"/"):
        uri = uri[len(mount) + 1 :]
    if path_escapes(uri):
        raise RelayError(404, "The relay has no route for %s %s." % _method_and_path(request))
    return uri.decode("latin-1")


def _without_keys(answer: bytes, secrets: tuple[str, ...]) -> bytes:
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


def _close_now(transport) -> None:
    """
    Close a connection at once, its unsent bytes dropped: a client that
    stopped reading must not keep its socket past the shutdown grace.
    """
    abort = getattr(transport, "abortConnection", None)
    if abort is not None:
        abort()
    else:
        transport.loseConnection()


def _stamp_request_id(request) -> None:
    """Give an answer the relay makes itself its ``x-relay-request-id``, as every answer has."""
    request.setHeader(RELAY_REQUEST_ID_HEADER, _new_request_id().encode("ascii"))


def _whole(request, body: bytes) -> bytes:
    """Answer with a whole body, its length known (no chunked encoding)."""
    request.setHeader(b"content-length", b"%d" % (len(body),))
    return body


def _set_headers(request, headers: Headers, secrets: tuple[str, ...] = ()) -> None:
    """Give the client the upstream's headers, every configured key (and Anthropic-shaped key) removed."""
    for name, values in headers.getAllRawHeaders():
        request.responseHeaders.setRawHeaders(name, [_header_without_keys(value, secrets) for value in values])


def _header_without_keys(value: bytes, secrets: tuple[str, ...]) -> bytes:
    """A header value with every configured key replaced, as :func:`_without_keys` does for bodies."""
    text = value.decode("latin-1")
    redacted = redact_text(text, secrets)
    return value if redacted == text else redacted.encode("latin-1")


# Response headers the relay set itself, kept when an error answer replaces
# the upstream's headers: the request's id, and the drain's ``Connection: close``.
_KEPT_ON_ERROR = (RELAY_REQUEST_ID_HEADER, b"connection")


def _clear_headers(request) -> None:
    """Drop the upstream's headers before an error answer; keep the relay's own (:data:`_KEPT_ON_ERROR`)."""
    old, request.responseHeaders = request.responseHeaders, Headers()
    for name in _KEPT_ON_ERROR:
        keep = old.getRawHeaders(name)
        if keep:
            request.responseHeaders.setRawHeaders(name, keep)


def _session_id(headers: Headers) -> str | None:
    values = headers.getRawHeaders(b"x-claude-code-session-id")
    return values[0].decode("latin-1") if values else None
