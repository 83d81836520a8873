# -*- test-case-name: tests.test_app -*-
"""
One client request on its way through the relay.

A :class:`RelayedRequest` owns a request's lifecycle: admission (relay
keys, load, body size), its path and body, its deadline, the turn of its
message thread, and, when it ends, its log line and request metrics. It
hands the sending to :class:`~twisted_relay.attempts.Attempts` and the
answer to :class:`~twisted_relay.answer.Answer`.

It knows the application only through a :class:`RequestContext`: the
parts the app hands to each request, as they were when the request came
(a reload makes a new context; requests in flight keep theirs).
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass, replace
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.logger import Logger

from twisted_relay.answer import (
    CLIENT_GONE_STATUS,
    JSON_CONTENT_TYPE,
    RELAY_REQUEST_ID_HEADER,
    Answer,
    Exchange,
    clear_headers,
    error_answer,
    new_request_id,
    whole,
)
from twisted_relay.attempts import Attempts
from twisted_relay.body_pool import BodyPool, RequestBody
from twisted_relay.body_work import kept_cost
from twisted_relay.config import RelayConfig, RelayKey
from twisted_relay.relay_keys import key_presented
from twisted_relay.drain import InFlight
from twisted_relay.errors import RelayError, capability_rejected
from twisted_relay.logs import bounded
from twisted_relay.message_threads.turns import ThreadKeeper, credential_of, owner_of
from twisted_relay.metrics import RelayMetrics
from twisted_relay.model_list import model_body, model_list_body, routed_model_ids, wire_model_ids
from twisted_relay.spend_limits import refusal, standing_headers
from twisted_relay.routing import NoRoute, RequestFacts, RetryRule, Router, route_matches
from twisted_relay.upstream import UpstreamClients, path_escapes
from twisted_relay.upstream_headers import attribution_of

__all__ = [
    "COUNT_TOKENS",
    "MESSAGES",
    "MODELS",
    "RelayedRequest",
    "RequestContext",
    "RouteKind",
    "method_and_path",
    "upstream_path",
]


@dataclass(frozen=True, slots=True)
class RequestContext:
    """
    What the application hands each request it relays: everything a
    request may use of the relay, and nothing else.

    :ivar config: the relay's settings.
    :ivar reactor: the reactor (timers, the clock).
    :ivar log: where a request's log lines go.
    :ivar metrics: the relay's metrics.
    :ivar dumps: the dump writer (:class:`~twisted_relay.dumps.DumpWriter`),
        or ``None`` for no dumps.
    :ivar threads: the message threads the relay holds.
    :ivar secrets: every key to remove from what upstreams send back.
    :ivar relay_keys: the keys a client must present, as bytes, each with
        its :class:`~twisted_relay.config.RelayKey` (none: open).
    :ivar router: where requests go.
    :ivar clients: the upstream clients, by upstream name.
    :ivar retry: when an attempt is sent again to the same target.
    :ivar in_flight: the requests in flight (``begin``/``end``, ``count``).
    :ivar admin_keys: the admin keys, as (bytes, :class:`RelayKey`) pairs:
        refused on every relayed route.
    :ivar ledger: where each answer's usage goes (an object with
        ``record(UsageRecord)`` that never blocks nor raises), or ``None``.
    :ivar starts: when a request may start (its ``turn()``,
        :class:`~twisted_relay.pacing.StartPacer`), or ``None``: at once.
    :ivar bodies: where the work on large request bodies runs
        (:class:`~twisted_relay.body_pool.BodyPool`); ``None``: every body in
        this process.
    :ivar spend: the spend limits (:class:`~twisted_relay.spend_guard.SpendGuard`),
        or ``None`` (no ledger).
    :ivar batch: where an answer's metering waits a moment for others
        (:class:`~twisted_relay.batch.Batch`; run it before reading usage),
        or ``None``: done at once.
    :ivar signin: sign-in (:class:`~twisted_relay.signin.session.SignIn`):
        a session token stands for a person as a relay key does; ``None``: off.
    :ivar managed_settings: the managed settings file
        (:class:`~twisted_relay.signin.managed_settings.ManagedSettings`)
        ``GET /managed/settings`` serves, or ``None``.
    :ivar telemetry: where OTLP exports go
        (:class:`~twisted_relay.signin.telemetry.TelemetryForwarder`), or ``None``.
    """

    config: RelayConfig
    reactor: Any
    log: Logger
    metrics: RelayMetrics
    dumps: Any
    threads: ThreadKeeper
    secrets: tuple[str, ...]
    relay_keys: tuple[tuple[bytes, RelayKey], ...]
    router: Router
    clients: UpstreamClients
    retry: RetryRule
    in_flight: InFlight
    ledger: Any = None
    starts: Any = None
    admin_keys: tuple = ()
    bodies: Any = None
    spend: Any = None
    batch: Any = None
    signin: Any = None
    managed_settings: Any = None
    telemetry: Any = None


@dataclass(frozen=True, slots=True)
class RouteKind:
    """
    What a relayed route does: its name in logs and metrics, whether it
    reads a Messages body, how it answers, and whether its answers are
    metered (:mod:`twisted_relay.metering`).
    """

    name: str
    has_body: bool
    stream_ok: bool
    translate_answer: bool
    threads: bool = False
    metered: bool = False


MESSAGES = RouteKind("messages", has_body=True, stream_ok=True, translate_answer=True, threads=True, metered=True)
COUNT_TOKENS = RouteKind("count_tokens", has_body=True, stream_ok=False, translate_answer=False)
MODELS = RouteKind("models", has_body=False, stream_ok=False, translate_answer=False)


class RelayedRequest:
    """
    One client request on its way through the relay, from admission to the
    last byte of its answer: what became of it (for the request's log line
    and metrics) and its deadline.

    The deadline (``total_timeout``) is one timer for the whole request: it
    cancels whatever the request waits on when it fires (the upstream's
    headers, a retry's pause, a whole body or a stream), and that wait
    fails with a 504 ``total_timeout`` error.

    :ivar request: the Twisted request.
    :ivar route: what kind of route it came by.
    :ivar model_id: the model a ``GET /v1/models/{id}`` names.
    :ivar id: the relay's id for it (``x-relay-request-id``).
    :ivar started: when it started, on the reactor's clock.
    :ivar turn: the message thread's turn it takes, if any.
    :ivar stream: its answer is streamed (for the log line).
    :ivar error: what went wrong, for the log line.
    :ivar attribution: Claude Code's attribution headers the client sent
        (``x-claude-code-session-id`` ...), bounded, for the log line,
        dumps and its usage record
        (:func:`~twisted_relay.upstream_headers.attribution_of`).
    :ivar relay_key: the relay key it presented
        (:class:`~twisted_relay.config.RelayKey`: its name for the log
        line, dumps and usage), or the signed-in person whose session token
        it presented (a :class:`~twisted_relay.signin.person.Person`, with
        the same ``name`` and ``group``); ``None`` when the relay takes
        every client.
    :ivar requested_model: the ``model`` of its body, if it named one.
    """

    def __init__(self, context: RequestContext, request, route: RouteKind, model_id: str | None = None):
        self.context = context
        self.request = request
        self.route = route
        self.model_id = model_id
        self.id = new_request_id()
        self.started = context.reactor.seconds()
        #: When the request came (wall clock), for its dumps; set as it is relayed.
        self.received_at: float | None = None
        self.turn = None
        # What the log line and the metrics say.
        self.status: int | None = None
        self.stream = False
        self.error: str | None = None
        self.attribution = attribution_of(request.requestHeaders, context.secrets)
        self.relay_key: RelayKey | None = None
        self.requested_model: str | None = None
        #: The ``anthropic-ratelimit-unified-*`` headers its answer carries
        #: (a key with a spend cap), or ``None``.
        self.spend_headers: list[tuple[bytes, bytes]] | None = None
        self._attempts: Attempts | None = None
        self._waiting: Deferred | None = None
        self._over_time = False
        self._deadline_call = None

    async def run(self):
        """Relay the request; return the answer's body, or ``None`` once it has been streamed."""
        context, request = self.context, self.request
        request.setHeader(RELAY_REQUEST_ID_HEADER, self.id.encode("ascii"))
        # Fires (with None, whatever happened) once the request is finished
        # or its connection lost.
        settled = request.notifyFinish()
        settled.addErrback(lambda _: None)
        context.in_flight.begin(request)
        if context.config.total_timeout:
            self._deadline_call = context.reactor.callLater(context.config.total_timeout, self._too_long)
        try:
            return await self._relay()
        except CancelledError:
            self.status = CLIENT_GONE_STATUS
            # The client's transport stops the stream before the request
            # hears of the lost connection; wait until it has, so Klein knows
            # the request is gone and does not treat the cancellation as a
            # failure to render.
            if not settled.called:
                await settled
            raise
        except Exception:
            context.log.failure("Unexpected failure relaying {relay_request_id}", relay_request_id=self.id)
            self.status, self.error = 500, "internal relay error"
            if request.startedWriting:
                raise
            clear_headers(request)
            return error_answer(request, RelayError(500, "Internal relay error."), self.id)
        finally:
            if self.turn is not None:
                # Not settled by a whole answer: the thread stays where it was.
                self.turn.failed()
            if self._deadline_call is not None and self._deadline_call.active():
                self._deadline_call.cancel()
            context.in_flight.end(request)
            self._log()
            # The attempts refer back to this request: dropped, both are
            # freed when the request is, not by a full garbage collection.
            self._attempts = None

    # -- the deadline ---------------------------------------------------------

    def _too_long(self) -> None:
        self._deadline_call = None
        self._over_time = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def wait(self, d: Deferred):
        """
        Wait for ``d``, within the request's deadline. When the deadline
        cancels it, fail with the 504 ``total_timeout`` error instead of
        ``CancelledError``.
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
                    % (self.context.config.total_timeout,),
                    kind="total_timeout",
                ) from None
            raise
        finally:
            self._waiting = None

    # -- the work ---------------------------------------------------------------

    async def _relay(self):
        context, request, route = self.context, self.request, self.route
        received_at = self.received_at = time.time()
        body = None
        stream_asked = False
        try:
            self.relay_key = _admit(context, request)
            if route.metered and context.spend is not None:
                await self._check_spend()
            if context.starts is not None:
                # Admitted and in flight (the drain waits for it), it waits for
                # its turn, within its deadline, when many requests start at once.
                await self.wait(context.starts.turn())
            # Checked before anything is read or sent: a path that could
            # leave the upstream's base path is never sent.
            path = upstream_path(request)
            facts = None
            if route.has_body:
                pool = context.bodies if context.bodies is not None else BodyPool(context.reactor, workers=0)
                body = RequestBody(pool, _read_body(context.config, request), getattr(request, "body_cost", None))
                await self.wait(body.read())
                if route.threads and "thread" in body.head:
                    body = await self._open_thread(body)
                stream_asked = body.head.get("stream") is True
                facts = body.facts
                plan = context.router.plan_for(facts)
                self.requested_model = facts.model
            else:
                listed = routed_model_ids(context.router.config)
                if self.model_id is not None:
                    plan = context.router.plan_for(RequestFacts.for_model(self.model_id))
                else:
                    plan = context.router.plan_for_listing()
                if listed is None and not isinstance(plan, NoRoute):
                    # A cloud's wire has no Models API: the relay lists its model map.
                    listed = wire_model_ids(context.router.config, plan.route)
                if listed is not None:
                    return self._model_list(listed)
            if isinstance(plan, NoRoute):
                raise _no_route_error(context.router, plan, facts, None if body is None else body.head)
            if self.spend_headers is not None and facts is not None:
                # What each target would send upstream: its own model, else the request's.
                self._check_priced([target.model or facts.model for target in plan.route.targets])
            # The facts may hold the parsed body, which a request waiting on
            # the upstream must not keep.
            facts = None
            # The body is handed over, not kept in this frame: the first
            # attempt drops its parsed form once serialised.
            attempts = self._attempts = Attempts(context, self, plan, path, body)
            raw = None if body is None else body.raw
            body = None
            response, sent = await attempts.make()
        except RelayError as e:
            self.error = e.message
            return error_answer(request, e, self.id)

        attempt = attempts.attempt
        exchange = Exchange(
            self.id, received_at, context.clients[attempt.upstream.name].display_url + (sent.path or ""),
            request.requestHeaders, raw, sent.headers, sent.body, sent.translation, attempt, attempts.labels(),
            self.attribution, self.relay_key,
        )
        answer = Answer(context, self, attempts, response, exchange)
        answer.set_headers()
        if answer.streams(stream_asked):
            await answer.stream()
            return None
        return await answer.whole_body()

    async def _check_spend(self) -> None:
        """
        Refuse a request whose key, group or relay is at its spend cap (429
        ``billing_error``, before anything is sent upstream); otherwise keep
        the headers its answer carries (:attr:`spend_headers`).
        """
        if self.context.spend.uncapped():
            return
        if self.context.batch is not None:
            # The answers metered a moment ago count against the cap.
            self.context.batch.run()
        key = self.relay_key
        standing = await self.wait(
            ensureDeferred(self.context.spend.admit(key.name if key else None, key.group if key else None))
        )
        if standing is None:
            return
        if standing.exceeded:
            error, headers = refusal(standing, time.time())
            for name, value in headers:
                self.request.setHeader(name, value)
            raise error
        self.spend_headers = standing_headers(standing)

    def _check_priced(self, models: list[str | None]) -> None:
        """
        Refuse a request a spend cap applies to when a model its route may ask
        for has no price (400): its answer would cost nothing against the cap.
        """
        prices = self.context.config.prices
        unpriced = [model for model in models if model and prices.price_of(model) is None]
        if unpriced:
            raise RelayError(
                400,
                "This relay has no price for the model %s, so a request under a spend limit cannot use it "
                "(the relay's price table needs it first)." % (bounded(unpriced[0]),),
                should_retry=False,
            )

    def prepared(self, raw: bytes, sent) -> None:
        """
        The first attempt's body is ready to send: from now on the request
        holds its bytes, those sent and its translation only, and its room in
        the in-flight budget shrinks to that (``docs/architecture.md``, "Big bodies").
        """
        keep = getattr(self.request, "keep_body_cost", None)
        if keep is not None:
            held = 0 if self.turn is None else self.turn.held_bytes
            keep(kept_cost(raw, sent.body, sent.translation) + held)

    def _model_list(self, listed: tuple[str, ...]) -> bytes:
        """
        The relay's own answer to ``GET /v1/models`` or ``/v1/models/{id}``
        when its routes name their models (:mod:`twisted_relay.model_list`):
        the listed ids, and any model a route serves; 404 for the rest.
        """
        request, model_id = self.request, self.model_id
        if model_id is None:
            body = model_list_body(listed, request.args)
        elif model_id in listed or self.context.router.route_for(RequestFacts.for_model(model_id)) is not None:
            body = model_body(model_id)
        else:
            error = RelayError(404, "model: %s" % (bounded(model_id),))
            self.error = error.message
            return error_answer(request, error, self.id)
        request.setHeader(b"content-type", JSON_CONTENT_TYPE)
        return whole(request, body)

    async def _open_thread(self, body: RequestBody) -> RequestBody:
        """
        A request in a message thread becomes the plain request it stands
        for (a ``continue`` rebuilt from the thread the relay holds), which
        is then translated and sent like any other, and dumped as such. The
        rebuilding runs where the body's work does (a worker process when
        the body or the thread is large).

        :raises ThreadError: the API's own answer (not found, already
            continued, in flight, changed ``system``/``tools``, malformed).
        """
        # A signed-in person's threads are theirs whatever session token they present.
        sub = getattr(self.relay_key, "sub", None)
        credential = "person:" + sub if sub else credential_of(self.request.requestHeaders)
        opened = await self.wait(
            self.context.threads.open_with(body.head, owner_of(credential), body.thread_request)
        )
        if opened is None:
            return body
        self.turn, plain = opened
        return plain

    async def settle_thread(self, settling: Deferred) -> None:
        """
        Wait until the thread is kept (before the answer's end reaches the
        client, so its next ``continue`` finds it; bounded by the store's
        own timeout). A store that failed was logged and counted.
        """
        self.turn = None
        try:
            await settling
        except Exception:
            self.context.log.failure("Keeping a thread failed ({relay_request_id})", relay_request_id=self.id)

    def _log(self) -> None:
        context, request = self.context, self.request
        metrics = context.metrics
        status = self.status or request.code
        metrics.labelled(metrics.requests, self.route.name, str(status)).inc()
        attempts = self._attempts
        attempt = None if attempts is None else attempts.attempt
        context.log.info(
            "{method} {path} {status} {duration_ms}ms ({relay_request_id})",
            method=request.method.decode("ascii", "replace"),
            path=request.path.decode("utf-8", "replace"),
            status=status,
            duration_ms=round((context.reactor.seconds() - self.started) * 1000.0, 1),
            relay_request_id=self.id,
            stream=self.stream,
            error=None if self.error is None else bounded(self.error, 1000),
            upstream=None if attempt is None else attempt.upstream.name,
            upstream_model=None if attempt is None or attempt.model is None else bounded(attempt.model),
            attempts=None if attempts is None else attempts.labels(),
            attribution=self.attribution or None,
            relay_key=None if self.relay_key is None else self.relay_key.name,
        )


def _no_route_error(router: Router, no_route: NoRoute, facts: RequestFacts | None, body: dict | None) -> RelayError:
    """
    The error for a request no route takes. When a route would take it but
    for a capability the route keeps off its upstreams (``thinking = false``
    for a request that thinks, ``images = false`` for one holding an image),
    the relay refuses that capability, with Claude Code's convention
    (:func:`~twisted_relay.errors.capability_rejected`), so that the client
    can send it again without; otherwise the 404 of
    :class:`~twisted_relay.routing.NoRoute`.
    """
    if facts is not None:
        for route in router.config.routes:
            if not route_matches(replace(route, thinking=None, images=None), facts):
                continue
            if route.thinking is False and facts.thinking:
                return capability_rejected("thinking_type:%s" % (_thinking_type(body),))
            if route.images is False and facts.images:
                return capability_rejected("image_block")
    return no_route.error()


def _thinking_type(body: dict | None) -> str:
    thinking = (body or {}).get("thinking")
    kind = thinking.get("type", "enabled") if isinstance(thinking, dict) else "enabled"
    return bounded(kind, 40) if isinstance(kind, str) else "enabled"


def method_and_path(request) -> tuple[str, str]:
    """The request's method and path, as text, for error messages."""
    return request.method.decode("ascii", "replace"), request.path.decode("utf-8", "replace")


def upstream_path(request) -> str:
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
        raise RelayError(404, "The relay has no route for %s %s." % method_and_path(request))
    return uri.decode("latin-1")


# -- admission ------------------------------------------------------------------


def _admit(context: RequestContext, request) -> RelayKey | None:
    """
    Refuse a request the relay must not take now, and say why; return the
    relay key it presented, or the signed-in person (a
    :class:`~twisted_relay.signin.person.Person`, who stands where a relay
    key does); ``None`` when the relay takes every client.
    """
    # While draining, requests on connections still open are served (a
    # load balancer does not resend a refused POST); each such
    # connection closes as its answer ends (drain.py).
    relay_key = None
    if context.admin_keys and key_presented(context.admin_keys, request.requestHeaders, basic=True) is not None:
        # Not even on a relay open to every client, where it would go upstream.
        raise RelayError(401, "An admin key is not accepted here; present a relay key.", should_retry=False)
    if context.signin is not None:
        # A session token that is not good (now) is refused here: 401.
        relay_key = context.signin.person_presented(request.requestHeaders)
    if relay_key is None and (context.relay_keys or context.signin is not None):
        relay_key = key_presented(context.relay_keys, request.requestHeaders)
        if relay_key is None:
            raise RelayError(
                401,
                "The relay requires a relay key in x-api-key or Authorization: Bearer"
                + (", or signing in (claude auth login)." if context.signin is not None else "."),
            )
    limit = context.config.max_concurrent
    if limit and context.in_flight.count > limit:
        raise RelayError(
            529,
            "The relay is handling %d requests, its limit; try again shortly." % (limit,),
            kind="overloaded",
        )
    return relay_key


def _read_body(config: RelayConfig, request) -> bytes:
    if getattr(request, "body_too_large", False):
        raise RelayError(
            413,
            "Request body is over %d bytes, the most the relay accepts." % (config.max_body,),
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
    if size > config.max_body:
        raise RelayError(
            413,
            "Request body is %d bytes; the relay accepts at most %d." % (size, config.max_body),
        )
    if isinstance(content, io.BytesIO):
        # The buffer itself, not a copy of it.
        return content.getvalue()
    content.seek(0)
    return content.read()


