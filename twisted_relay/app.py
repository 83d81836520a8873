# -*- test-case-name: tests.test_app -*-
"""
The relay's HTTP face: Klein routes, and what the relay holds between requests.

The relayed routes and the probes run their Klein endpoint directly
(:class:`_DirectDispatch`, through ``Klein.execute_endpoint``); every other
request goes through Klein's render, which leaves reference cycles per
request (docs/architecture.md, "Two dispatch paths, one set of routes").

:class:`RelayApp` routes each request; a relayed one (``/v1/messages``,
``count_tokens``, the model list) becomes a
:class:`~twisted_relay.relayed_request.RelayedRequest`, given the parts it
may use as a :class:`~twisted_relay.relayed_request.RequestContext`. The app
also takes a reload (:meth:`RelayApp.reconfigure`) and drains at shutdown
(:mod:`twisted_relay.drain`). Errors the relay raises itself are
Anthropic-shaped; errors the upstream raises pass through untouched.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import replace

from klein import Klein
from twisted.internet.defer import CancelledError, Deferred, maybeDeferred
from twisted.logger import Logger
from twisted.python import log as legacy_log
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from werkzeug.exceptions import MethodNotAllowed, NotFound

from twisted_relay._json import to_json
from twisted_relay._version import __version__
from twisted_relay.admin import usage_page
from twisted_relay.answer import (
    JSON_CONTENT_TYPE,
    error_answer,
    stamp_request_id,
)
from twisted_relay.batch import Batch
from twisted_relay.body_pool import BodyPool
from twisted_relay.config import RelayConfig
from twisted_relay.drain import InFlight
from twisted_relay.errors import RelayError
from twisted_relay.ledger_sql import LedgerError
from twisted_relay.message_threads.turns import ThreadKeeper, keeper_for
from twisted_relay.metrics import RelayMetrics
from twisted_relay.pacing import StartPacer
from twisted_relay.relay_keys import key_pairs, key_presented
from twisted_relay.relayed_request import (
    COUNT_TOKENS,
    MESSAGES,
    MODELS,
    RelayedRequest,
    RequestContext,
    RouteKind,
    method_and_path,
)
from twisted_relay.routing import RetryRule, Router
from twisted_relay.signin.managed_settings import ManagedSettings, managed_settings_route
from twisted_relay.signin.telemetry import TelemetryForwarder, logs_route, metrics_route, traces_route
from twisted_relay.signin.usage_api import usage_route
from twisted_relay.spend_guard import SpendGuard
from twisted_relay.spend_routes import delete_route, effective_route, list_route, retrieve_route, set_route
from twisted_relay.upstream import UpstreamClient, UpstreamClients

__all__ = ["RelayApp"]

class RelayApp:
    """
    The Messages relay as a Klein application.

    :param config: the relay's settings.
    :param clients: the upstream clients, one per upstream of ``config``
        (:class:`~twisted_relay.upstream.UpstreamClients`, or any mapping
        from upstream name to :class:`~twisted_relay.upstream.UpstreamClient`).
    :param reactor: the reactor, for timers.
    :param dumps: the diagnostic dump writer, or ``None`` for no dumps.
    :param metrics: the relay's metrics; a fresh set when ``None``.
    :param threads: the message threads the relay holds; made from
        ``config`` when ``None``.
    :param router: where each request goes (:mod:`twisted_relay.routing`);
        one made from ``config`` when ``None``.
    :param ledger: where each answer's usage is recorded
        (:class:`~twisted_relay.usage.UsageRecord`), or ``None``.
    :param bodies: where the work on large request bodies runs; a pool of
        one worker process (started when first needed) when ``None``.
    :param signin: sign-in (:class:`~twisted_relay.signin.session.SignIn`);
        made from ``config.signin`` (its store the ledger's database, if
        any) when ``None``.
    :param managed_settings: the settings ``GET /managed/settings`` serves
        (:class:`~twisted_relay.signin.managed_settings.ManagedSettings`), or ``None``.
    :param telemetry: where the OTLP exports taken at ``/v1/logs``,
        ``/v1/metrics`` and ``/v1/traces`` go; one with no collector (they
        are counted and dropped) when ``None``.
    :ivar requests: the requests in flight, and their draining
        (:class:`~twisted_relay.drain.InFlight`).
    :ivar starts: when each relayed request may start
        (:class:`~twisted_relay.pacing.StartPacer`).
    :ivar bodies: that pool (a service: stopping it stops the workers).
    :ivar spend: the spend limits (:class:`~twisted_relay.spend_guard.SpendGuard`,
        a service), or ``None`` without a ledger database.
    :ivar signin: sign-in (a service: it reads the revocations), or ``None``.
    """

    app = Klein()
    # Relay paths as they come: no redirect of "//" (werkzeug's default).
    app.url_map.merge_slashes = False
    log = Logger()

    def __init__(
        self,
        config: RelayConfig,
        clients: UpstreamClients,
        *,
        reactor,
        dumps=None,
        metrics: RelayMetrics | None = None,
        threads: ThreadKeeper | None = None,
        router: Router | None = None,
        ledger=None,
        bodies: BodyPool | None = None,
        signin=None,
        managed_settings: ManagedSettings | None = None,
        telemetry: TelemetryForwarder | None = None,
    ):
        self.requests = InFlight(reactor)
        # Request starts spread over reactor turns (docs/architecture.md, "Request starts, paced").
        self.starts = StartPacer(reactor)
        # Answers metered together, a batch at most every 50 ms (batch.py).
        self.batch = Batch(reactor)
        self.bodies = bodies if bodies is not None else BodyPool(reactor)
        self.metrics = metrics if metrics is not None else RelayMetrics(dumps)
        # Message threads held by the relay (docs/threads.md).
        self.threads = threads if threads is not None else keeper_for(config, reactor)
        # Spend limits live in the ledger's database (docs/usage.md); a
        # service (its timer), started and stopped with the ledger.
        self.spend = (
            SpendGuard(ledger, reactor=reactor, refresh_interval=config.spend_refresh_interval)
            if hasattr(ledger, "on_database")
            else None
        )
        self.signin = signin
        if signin is None and config.signin is not None:
            # Imported only when on: it needs the [signin] extra. Its state is
            # shared through the ledger's database when there is one.
            from twisted_relay.signin.session import signin_for

            self.signin = signin_for(config.signin, ledger, reactor)
        # What every request is handed; a reload makes a new one.
        self._context = RequestContext(
            config=config,
            reactor=reactor,
            log=self.log,
            metrics=self.metrics,
            dumps=dumps,
            threads=self.threads,
            secrets=config.secrets(),
            relay_keys=key_pairs(config.relay_keys),
            admin_keys=key_pairs(config.admin_keys),
            router=router if router is not None else Router(config, reactor),
            clients=clients,
            retry=RetryRule.from_config(config),
            in_flight=self.requests,
            ledger=ledger,
            starts=self.starts,
            batch=self.batch,
            bodies=self.bodies,
            spend=self.spend,
            signin=self.signin,
            managed_settings=managed_settings,
            telemetry=telemetry if telemetry is not None else TelemetryForwarder(None, reactor, metrics=self.metrics),
        )
        self.metrics.know_models(config.prices.models)
        # Read when scraped: no work per request.
        self.metrics.watch_active_requests(lambda: self.requests.count)
        self.metrics.watch_router(lambda: self._context.router)
        self.metrics.watch_thread_store(self.threads.store)
        if hasattr(ledger, "on_database"):
            self.metrics.watch_ledger(ledger)

    def resource(self, *, direct: bool = True):
        """
        The relay's web resource, to serve or to mount in another ``Site``.
        With ``direct`` false, even the relayed routes go through Klein's
        render (the dispatch contract test compares both).
        """
        return _RelayResource(self.requests, self.app, direct_routes(self.app) if direct else {})

    def reconfigure(self, router: Router, clients: UpstreamClients) -> None:
        """
        Route new requests with ``router`` over ``clients`` (a reload);
        requests in flight keep the ones they started with. The keys of the
        new configuration are redacted too (those of the old one still are).
        """
        context = self._context
        self.metrics.know_models(router.config.prices.models)
        self._context = replace(
            context,
            config=router.config,
            router=router,
            clients=clients,
            secrets=tuple(dict.fromkeys(context.secrets + router.config.secrets())),
        )

    @property
    def router(self) -> Router:
        """The router new requests are routed with."""
        return self._context.router

    def _first_client(self) -> UpstreamClient:
        """The client of the first upstream (whose URL the simulated upstream sets late)."""
        context = self._context
        return context.clients[context.router.config.upstreams[0].name]

    # -- routes -----------------------------------------------------------

    @app.route("/v1/messages", methods=["POST"])
    def messages(self, request):
        """Relay a Messages request, streaming or not."""
        return self._relay(request, MESSAGES)

    @app.route("/v1/messages/count_tokens", methods=["POST"])
    def count_tokens(self, request):
        """Relay a token count; the upstream counts the history it would see."""
        return self._relay(request, COUNT_TOKENS)

    @app.route("/v1/models", methods=["GET"])
    def models(self, request):
        """Relay the model list (to the first target of the route for any model)."""
        return self._relay(request, MODELS)

    @app.route("/v1/models/<model_id>", methods=["GET"])
    def model(self, request, model_id):
        """Relay one model's description, routed as a request for it; a model id is one path segment."""
        return self._relay(request, MODELS, model_id)

    @app.route("/", methods=["HEAD"])
    @app.route("/api/hello", methods=["HEAD", "GET"])
    def hello(self, request):
        """Answer clients' connection-warming probes at once."""
        stamp_request_id(request)
        request.setHeader(b"content-type", JSON_CONTENT_TYPE)
        return b""

    @app.route("/health", methods=["GET"])
    def health(self, request):
        """Say that the relay process (which one: ``pid``) is up; it does not ask the upstream."""
        stamp_request_id(request)
        request.setHeader(b"content-type", JSON_CONTENT_TYPE)
        return to_json({"status": "ok", "version": __version__, "pid": os.getpid()})

    @app.route("/ready", methods=["GET"])
    def ready(self, request):
        """Say whether the relay takes new requests: not while it shuts down."""
        stamp_request_id(request)
        request.setHeader(b"content-type", JSON_CONTENT_TYPE)
        draining = self.requests.draining
        if draining or self._first_client().base_url is None:
            request.setResponseCode(503)
            return to_json({"status": "draining" if draining else "starting"})
        return to_json({"status": "ready", "active_requests": self.requests.count})

    @app.route("/metrics", methods=["GET"])
    def metrics_page(self, request):
        """Prometheus metrics, when enabled."""
        if not self._context.config.metrics:
            raise NotFound()
        stamp_request_id(request)
        # The answers metered a moment ago are counted first (and with
        # workers, this process's counts copied to the shared files).
        self.batch.run()
        self.metrics.sync()
        return self.metrics.resource()

    @app.route("/admin/usage", methods=["GET"])
    async def admin_usage(self, request):
        """The usage page: spend per relay key and per day against its cap (admin key)."""
        stamp_request_id(request)
        self.batch.run()
        try:
            return await usage_page(self._context, request)
        except RelayError as e:
            return error_answer(request, e)

    @app.route("/v1/organizations/spend_limits", methods=["POST"])
    def spend_limit_set(self, request):
        """Set a spend limit (admin key; Anthropic's Admin API shape)."""
        return self._admin(request, set_route)

    @app.route("/v1/organizations/spend_limits", methods=["GET"])
    def spend_limit_list(self, request):
        """List the spend limits (admin key)."""
        return self._admin(request, list_route)

    @app.route("/v1/organizations/spend_limits/effective", methods=["GET"])
    def spend_limit_effective(self, request):
        """The cap that binds each relay key, per period, and its spend (admin key)."""
        return self._admin(request, effective_route)

    @app.route("/v1/organizations/spend_limits/<limit_id>", methods=["GET"])
    def spend_limit_retrieve(self, request, limit_id):
        """One spend limit (admin key)."""
        return self._admin(request, retrieve_route, limit_id)

    @app.route("/v1/organizations/spend_limits/<limit_id>", methods=["DELETE"])
    def spend_limit_delete(self, request, limit_id):
        """Delete a spend limit (admin key)."""
        return self._admin(request, delete_route, limit_id)

    async def _admin(self, request, route, *args):
        stamp_request_id(request)
        # Spend read here includes the answers metered a moment ago.
        self.batch.run()
        try:
            return await route(self._context, request, *args)
        except RelayError as e:
            return error_answer(request, e)
        except LedgerError as e:
            return error_answer(
                request, RelayError(503, "The spend limits' database cannot be used now: %s" % (e,), error_type="api_error")
            )

    # -- sign-in (docs/signin.md): each route is its module's ---------------

    @app.route("/.well-known/oauth-authorization-server", methods=["GET"])
    def signin_metadata(self, request):
        return self._signin(request, "authorization", "metadata_route")

    @app.route("/oauth/device_authorization", methods=["POST"])
    def signin_device_authorization(self, request):
        return self._signin(request, "authorization", "device_authorization_route")

    @app.route("/oauth/token", methods=["POST"])
    def signin_token(self, request):
        return self._signin(request, "authorization", "token_route")

    @app.route("/oauth/revoke", methods=["POST"])
    def signin_revoke(self, request):
        return self._signin(request, "authorization", "revoke_route")

    @app.route("/device", methods=["GET"])
    def signin_device_page(self, request):
        return self._signin(request, "browser", "device_page_route")

    @app.route("/device", methods=["POST"])
    def signin_device_submit(self, request):
        return self._signin(request, "browser", "device_submit_route")

    @app.route("/oauth/callback", methods=["GET"])
    def signin_callback(self, request):
        return self._signin(request, "browser", "callback_route")

    async def _signin(self, request, module: str, route: str):
        stamp_request_id(request)
        signin = self._context.signin
        if signin is None:
            raise NotFound()
        routes = importlib.import_module("twisted_relay.signin." + module)
        return await getattr(routes, route)(signin, request)
    # -- what a signed-in Claude Code asks beside the Messages API (signin/) --

    @app.route("/managed/settings", methods=["GET"])
    def managed_settings(self, request):
        """The managed settings Claude Code applies (``ETag``/``If-None-Match``)."""
        return self._caller_route(request, managed_settings_route)

    @app.route("/v1/logs", methods=["POST"])
    def otlp_logs(self, request):
        """An OTLP log export, stamped with the caller and queued for the collector."""
        return self._caller_route(request, logs_route)

    @app.route("/v1/metrics", methods=["POST"])
    def otlp_metrics(self, request):
        """An OTLP metrics export, stamped with the caller and queued for the collector."""
        return self._caller_route(request, metrics_route)

    @app.route("/v1/traces", methods=["POST"])
    def otlp_traces(self, request):
        """An OTLP trace export, stamped with the caller and queued for the collector."""
        return self._caller_route(request, traces_route)

    @app.route("/api/oauth/usage", methods=["GET"])
    def oauth_usage(self, request):
        """The caller's spend and caps, for Claude Code's ``/usage``."""
        return self._caller_route(request, usage_route)

    async def _caller_route(self, request, route):
        # Who asks: a signed-in person or a relay key; these routes speak of
        # a caller, so an open relay answers them 401 too.
        stamp_request_id(request)
        context = self._context
        try:
            # A session token (refused with a 401 when it is not good now), else a relay key.
            who = context.signin.person_presented(request.requestHeaders) if context.signin is not None else None
            if who is None and context.relay_keys:
                who = key_presented(context.relay_keys, request.requestHeaders)
            if who is None:
                raise RelayError(401, "This route takes a relay key in x-api-key or Authorization: Bearer, or "
                                      "signing in (claude auth login).", should_retry=False)
            return await route(context, request, who)
        except RelayError as e:
            return error_answer(request, e)
        except LedgerError as e:
            return error_answer(request, RelayError(503, "The usage ledger cannot be read now: %s" % (e,), error_type="api_error"))

    @app.handle_errors(NotFound)
    def not_found(self, request, failure):
        """Unknown paths get an Anthropic-shaped 404."""
        return error_answer(
            request,
            RelayError(404, "The relay has no route for %s %s." % method_and_path(request)),
        )

    @app.handle_errors(MethodNotAllowed)
    def method_not_allowed(self, request, failure):
        """Known paths asked with the wrong method get an Anthropic-shaped 405."""
        return error_answer(request, RelayError(405, "%s is not allowed on %s." % method_and_path(request)))

    def _relay(self, request, route: RouteKind, model_id: str | None = None):
        return RelayedRequest(self._context, request, route, model_id).run()

    # -- draining ---------------------------------------------------------

    def begin_draining(self) -> None:
        """
        From now on ``/ready`` answers 503; requests are still served. The
        connections of requests in flight close when their answers end.
        """
        self.requests.begin_draining()

    @property
    def in_flight(self) -> int:
        """Requests being relayed now."""
        return self.requests.count

    def drain(self, grace: float) -> Deferred:
        """
        Say 503 at ``/ready``; fire when the requests in flight are done, or
        after ``grace`` seconds, when the connections of the rest are closed.
        """
        d = self.requests.drain(grace)

        def metered(result):
            # The last answers' usage, before the ledger is stopped; an
            # answer cut at the grace's end is metered as it ends.
            self.batch.close()
            # With workers, this process's last counts reach the shared files.
            self.metrics.sync()
            return result

        return d.addBoth(metered)


# The routes served by :class:`_DirectDispatch` (docs/architecture.md, "Two
# dispatch paths, one set of routes"), by Klein endpoint name: the relayed
# ones, and the probes a load balancer asks often.
DIRECT_ENDPOINTS = frozenset({"messages", "count_tokens", "models", "health", "ready", "hello"})


def direct_routes(klein: Klein, endpoints=DIRECT_ENDPOINTS) -> dict[tuple[bytes, bytes], tuple[str, int]]:
    """
    ``(method, path)`` to ``(endpoint, segments)`` for the routes of
    ``klein`` named in ``endpoints`` whose paths take no argument, read from
    its URL map (werkzeug's public ``Rule``): a route changed there changes
    here. ``HEAD`` is left to Klein. ``segments`` is how many path segments
    Klein moves to ``prepath`` for the route.
    """
    table = {}
    for rule in klein.url_map.iter_rules():
        if rule.endpoint in endpoints and rule.methods and not rule.arguments:
            segments = rule.rule.count("/") - rule.rule.endswith("/")
            for method in rule.methods - {"HEAD"}:
                table[(method.encode("ascii"), rule.rule.encode("utf-8"))] = (rule.endpoint, segments)
    return table


class _RelayResource(Resource):
    """
    The relay's resource: answers a path that is not UTF-8 with an
    Anthropic-shaped 400 (Klein's own answer is an HTML page), runs the
    relayed routes' Klein endpoints itself (:class:`_DirectDispatch`), and
    leaves every other request to Klein's render.
    """

    isLeaf = True

    def __init__(self, requests: InFlight, klein: Klein, direct: dict):
        super().__init__()
        self._requests = requests
        self._app = klein
        self._klein = klein.resource()
        self._direct = direct

    def render(self, request):
        # Klein makes a URL of both: bytes that are not UTF-8 would get its
        # HTML page and a logged traceback.
        for what, value in (("path", b"/".join(request.prepath + request.postpath)),
                            ("Host header", request.getRequestHostname())):
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                return error_answer(request, RelayError(400, "The request's %s is not valid UTF-8." % (what,)))
        # While draining, its connection closes once it is answered.
        self._requests.arrived(request)
        # Where the relay is mounted, for the upstream path.
        request.relay_mount = b"/".join(request.prepath)
        # The path Klein matches (its ``PATH_INFO``).
        path = b"/".join(request.postpath)
        if path and not path.startswith(b"/"):
            path = b"/" + path
        direct = self._direct.get((request.method, path))
        if direct is None:
            return self._klein.render(request)
        endpoint, segments = direct
        request.prepath.extend(request.postpath[:segments])
        request.postpath = request.postpath[segments:]
        _DirectDispatch(request).run(self._app, endpoint)
        return NOT_DONE_YET


class _DirectDispatch:
    """
    One request run through a Klein endpoint (``Klein.execute_endpoint``,
    Klein's public API) the way ``KleinResource.render`` runs a matched
    route, for endpoints that answer with bytes, text or ``None``: the
    endpoint's Deferred is cancelled if the connection is lost; its bytes
    are written and the request finished unless it is finished already; a
    failure goes to ``request.processingFailed`` (an error after the
    request is finished is logged, a cancellation not even that). Unlike
    Klein's render it makes no reference cycle: Klein's keeps a closure that
    refers to itself and to the request until a full garbage collection
    (Klein issue #101), and werkzeug's matcher another; this object's only
    cycle, through its Deferred's callbacks, is gone once the Deferred has
    fired.
    """

    def __init__(self, request):
        self.request = request
        self.finished = False
        self.running: Deferred | None = None

    def run(self, klein: Klein, endpoint: str) -> None:
        """Run ``endpoint`` of ``klein`` for the request, and write what it answers."""
        request = self.request
        request.notifyFinish().addBoth(self._finished)
        running = self.running = maybeDeferred(klein.execute_endpoint, endpoint, request)
        request.notifyFinish().addErrback(self._cancel)
        running.addCallbacks(self._write, self._failed)
        running.addErrback(legacy_log.err, _why="Unhandled Error writing response")

    def _finished(self, result) -> None:
        self.finished = True

    def _cancel(self, reason) -> None:
        self.running.cancel()

    def _failed(self, failure) -> None:
        if self.finished:
            if not failure.check(CancelledError):
                legacy_log.err(failure, "Unhandled Error Processing Request.")
                return
            # A cancellation's traceback holds the frames that raised it
            # (Twisted's, of the cancel), whose locals hold this failure:
            # a cycle. Nobody reads it: let it go.
            failure.cleanFailure()
            return
        self.request.processingFailed(failure)

    def _write(self, answer) -> None:
        request = self.request
        if isinstance(answer, str):
            answer = answer.encode("utf-8")
        if isinstance(answer, bytes):
            request.write(answer)
        elif answer is not None:
            # Only Klein's render knows what else an endpoint may answer (a
            # resource, an element): such a route is not one to run directly.
            self._failed(Failure(TypeError("%r answered directly: not bytes, text or None" % (type(answer),))))
            return
        if not self.finished:
            request.finish()
