# -*- test-case-name: tests.test_service -*-
"""
Build the relay as Twisted services, to run under twistd or inside another
application.

``make_service(config)`` gives a ``MultiService`` that listens on
``config.listen``; ``Relay(config)`` gives the parts, for an application that
mounts ``relay.resource()`` in its own ``Site`` and parents ``relay.service``
so the connection pool and the dump writer live and stop with it.
``Relay.reload()`` reads the ``--config`` file again (SIGHUP calls it under
``twistd relay``; an embedding application calls it itself).
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from typing import Mapping, Sequence

from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import MultiService, Service
from twisted.internet import endpoints
from twisted.internet.defer import DeferredList, maybeDeferred, succeed
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IStreamServerEndpoint
from twisted.internet.task import deferLater
from twisted.logger import Logger
from zope.interface import implementer

from twisted_relay import _twisted
from twisted_relay._version import __version__
from twisted_relay.app import RelayApp
from twisted_relay.config import DEFAULT_UPSTREAM_NAME, RelayConfig
from twisted_relay.dumps import DumpWriter
from twisted_relay.gctuning import GarbageCollectorTuning
from twisted_relay.ledger import Ledger
from twisted_relay.ledger_sql import LedgerError, open_ledger
from twisted_relay.logins import LoginError
from twisted_relay.metrics import RelayMetrics, SharedMetricsFolder
from twisted_relay.routing import Router
from twisted_relay.settings import SIMULATED_CLOUDS, ListenCheck, ReloadResult, SettingsError, reload_config
from twisted_relay.signin.managed_settings import ManagedSettings, SettingsFileError
from twisted_relay.signin.telemetry import TelemetryForwarder
from twisted_relay.site import RelaySite
from twisted_relay.start_checks import (
    ENDPOINT_ERRORS,
    StartCheck,
    StartupError,
    one_line_reason,
    run_start_checks,
    start_checks_for,
)
from twisted_relay.upstream import UpstreamClient, UpstreamClients, display_url
from twisted_relay.workers import ReusePortListener, WorkerProcesses, shareable

# The services that accept connections: stopped before anything else.
_LISTENERS = (StreamServerEndpointService, ReusePortListener)

__all__ = ["Relay", "RelaySite", "StartupError", "listen_checker", "make_service"]


_log = Logger()


class _UpstreamPoolService(Service):
    """
    Starts the upstreams' logins (their credentials kept fresh from then
    on) and closes the upstream connection pools when the relay stops
    (those of the running configuration).
    """

    log = Logger()

    def __init__(self, relay: "Relay"):
        self._relay = relay

    def startService(self):
        Service.startService(self)
        # A login that cannot get its credentials now fails its requests
        # (502, the next target tried) and tries again on its own.
        self._relay.clients.start_logins().addErrback(
            lambda failure: self.log.error("Upstream login failed: {reason}", reason=str(failure.value)))

    def stopService(self):
        Service.stopService(self)
        return self._relay.clients.close()


class _ThreadStoreService(Service):
    """Lets go of the thread store's connections when the relay stops."""

    def __init__(self, store):
        self._store = store

    def stopService(self):
        Service.stopService(self)
        return self._store.close()


class _SimulatedUpstreamService(Service):
    """
    Serves the embedded simulated upstream on an ephemeral loopback port and
    points the relay's upstream client at it.
    """

    log = Logger()

    def __init__(self, reactor, client: UpstreamClient, mode: str, options: dict, cloud=None):
        from twisted_relay.simulated import SimulatedUpstream

        self._reactor = reactor
        self._client = client
        # A simulated cloud (--simulate bedrock...), or the Anthropic API in ``mode``.
        self._cloud = cloud
        simulator = cloud if cloud is not None else SimulatedUpstream(mode=mode, reactor=reactor, **options)
        self._site = RelaySite(simulator.resource())
        self._site.noisy = False
        self._port = None
        self.mode = mode

    def startService(self):
        Service.startService(self)
        endpoint = endpoints.TCP4ServerEndpoint(self._reactor, 0, interface="127.0.0.1")
        d = endpoint.listen(self._site)

        def listening(port):
            self._port = port
            url = "http://127.0.0.1:%d" % (port.getHost().port,)
            self._client.base_url = url if self._cloud is None else self._cloud.listening(url)
            self.log.info(
                "Simulated upstream ({mode}) listening at {url}", mode=self.mode, url=url
            )

        d.addCallback(listening)
        return d

    def stopService(self):
        Service.stopService(self)
        if self._cloud is not None:
            self._cloud.close()
        if self._port is not None:
            return self._port.stopListening()


class _ReloadOnHangup(Service):
    """
    Reads the configuration file again on SIGHUP (in the reactor's thread),
    while the relay runs; the signal's former handler is put back on stop.
    """

    def __init__(self, reactor, relay: "Relay"):
        self._reactor = reactor
        self._relay = relay
        self._former = None

    def startService(self):
        Service.startService(self)
        self._former = signal.signal(signal.SIGHUP, self._hangup)

    def stopService(self):
        Service.stopService(self)
        if self._former is not None:
            signal.signal(signal.SIGHUP, self._former)
            self._former = None

    def _hangup(self, signum, frame):
        self._reactor.callFromThread(self._relay.reload)


@implementer(IStreamServerEndpoint)
class _EndpointOfDescription:
    """
    A ``--listen`` endpoint, made from its description when it listens:
    what is wrong with it (an ``ssl:`` endpoint's TLS files) is then found
    by the start checks, before any port listens, not when the relay is built.
    """

    def __init__(self, reactor, description: str):
        self._reactor = reactor
        self.description = description

    def listen(self, factory):
        return endpoints.serverFromString(self._reactor, self.description).listen(factory)


def _start_order(service) -> int:
    """Listeners start first, then the usage ledger, then the rest (in the order they were added)."""
    if isinstance(service, _LISTENERS):
        return 0
    return 1 if isinstance(service, Ledger) else 2


class _RelayService(MultiService):
    """
    The relay's services, stopped in order for a graceful shutdown: stop
    accepting connections, let requests in flight finish (up to the grace
    period), then drain the dump writer and close the connection pool.
    """

    log = Logger()

    def __init__(self, app: RelayApp, grace: float, *, reactor=None, drain_delay: float = 0.0):
        super().__init__()
        self._app = app
        self._grace = grace
        self._reactor = reactor
        self._drain_delay = drain_delay
        # Each listener's --listen description, for start-up errors.
        self.descriptions: dict = {}
        # Fields of the start-up line (a callable), or None for no line.
        self.describe = None
        # What is opened or checked before any child starts (once).
        self.start_checks: tuple[StartCheck, ...] = ()

    @contextmanager
    def _one_line_errors(self, service):
        """Turn what a user can cause at start (a port in use...) into a :class:`StartupError`."""
        try:
            yield
        except LedgerError as e:
            raise StartupError("cannot open the usage ledger: %s" % (e,)) from e
        except SettingsFileError as e:
            raise StartupError("cannot serve the managed settings: %s" % (e,)) from e
        except (CannotListenError, OSError) as e:
            description = self.descriptions.get(service)
            if description is not None:
                raise StartupError("cannot listen on %s: %s" % (description, one_line_reason(e))) from e
            raise StartupError("cannot start: %s" % (one_line_reason(e),)) from e

    def _check_before_listening(self) -> None:
        """
        Run the start checks, before any child starts: when one fails,
        nothing has listened and nothing runs (the error ends the start).
        """
        if not self.start_checks:
            return
        try:
            run_start_checks(self.start_checks)
        except StartupError:
            self._remove_shared_metrics(started=())
            raise
        self.start_checks = ()

    def _remove_shared_metrics(self, started) -> None:
        for service in self:
            if isinstance(service, SharedMetricsFolder) and service not in started:
                # Made when the relay was built: removed even if never started.
                service.stopService()

    def privilegedStartService(self):
        self._check_before_listening()
        Service.privilegedStartService(self)
        for service in self:
            with self._one_line_errors(service):
                service.privilegedStartService()

    def startService(self):
        # (Already done when privilegedStartService was called.)
        self._check_before_listening()
        Service.startService(self)
        # Twisted's internals the relay relies on are checked now, once
        # (twisted_relay/_twisted.py); a part built earlier may have already.
        _twisted.activate()
        started = []
        # Listeners first: a port in use fails the start before anything
        # else runs (nothing is served before the whole start is done);
        # then the ledger, which opens its database again, before the
        # services that start threads (which a failed start could not stop:
        # the reactor never runs).
        services = sorted(self, key=_start_order)
        try:
            for service in services:
                with self._one_line_errors(service):
                    service.startService()
                started.append(service)
        except StartupError:
            # Stop what did start (the dump writer's threads would keep the
            # process alive), then let the error end the process.
            for service in reversed(started):
                try:
                    service.stopService()
                except Exception:
                    self.log.failure("Stopping {service} after a failed start", service=service)
            self._remove_shared_metrics(started)
            raise
        if self.describe is not None:
            self.log.info(
                "twisted-relay {version} listening on {listen}; upstream {upstream} (ids: {upstream_ids}); "
                "upstream key: {upstream_key}; relay keys: {relay_keys}; sign-in: {signin}; dumps: {dump_dir}; "
                "usage ledger: {usage_db}; workers: {workers}",
                **self.describe(),
            )

    def stopService(self):
        Service.stopService(self)
        children = list(self)
        listeners = [s for s in children if isinstance(s, _LISTENERS)]
        workers = [s for s in children if isinstance(s, WorkerProcesses)]
        rest = [s for s in reversed(children) if s not in listeners and s not in workers]

        def stop_all(services):
            return DeferredList(
                [maybeDeferred(s.stopService) for s in services if s.running], consumeErrors=True
            )

        def stop_rest(_):
            d = succeed(None)
            for service in rest:
                if service.running:
                    d.addCallback(lambda _, service=service: service.stopService())
                    if isinstance(service, Ledger):
                        # Its last writes reach the shared files (with workers).
                        d.addCallback(lambda _: self._app.metrics.sync())
            return d

        # Say 503 at /ready, and go on accepting for the drain delay, so that
        # a load balancer sees it and moves on; then stop accepting; tell
        # the other workers to stop (they drain the same way), and let them
        # drain their requests while this process drains its own; then wait
        # for them before closing what they may still use (the simulated
        # upstream).
        self._app.begin_draining()
        self.log.info(
            "Draining: /ready answers 503; accepting for {drain_delay:g}s more, "
            "then finishing {in_flight} requests in flight (within {grace:g}s)",
            drain_delay=self._drain_delay,
            in_flight=self._app.in_flight,
            grace=self._grace,
        )
        workers_ended = stop_all(workers)
        if self._drain_delay > 0 and listeners:
            d = deferLater(self._reactor, self._drain_delay, lambda: None)
        else:
            d = succeed(None)
        d.addCallback(lambda _: stop_all(listeners))
        d.addCallback(lambda _: self._app.drain(self._grace))
        d.addCallback(lambda _: workers_ended)
        d.addCallback(stop_rest)
        return d


class Relay:
    """
    The relay's parts, built from one :class:`RelayConfig`.

    :ivar client: the upstream client (and its connection pool).
    :ivar dumps: the dump writer service, or ``None``.
    :ivar ledger: the usage ledger service (``config.usage_db``), or ``None``.
    :ivar app: the Klein application.
    :ivar managed_settings: the ``[signin]`` table's managed settings file
        (:class:`~twisted_relay.signin.managed_settings.ManagedSettings`, a
        service that reads it as it starts), or ``None``.
    :ivar telemetry: the forwarder of the OTLP exports the relay takes to
        the ``[signin]`` table's ``telemetry_endpoint``
        (:class:`~twisted_relay.signin.telemetry.TelemetryForwarder`, a
        service); with none, exports are counted and dropped.
    :ivar router: the routes and the health of the upstreams and keys
        (:mod:`twisted_relay.routing`); replaced on reload, keeping the
        health of upstreams that did not change.
    :ivar service: a ``MultiService`` owning every part's life; it also
        listens on ``config.listen`` when that is not empty, and runs the
        other worker processes when ``config.workers`` is above 1.
    :param worker: build one of those other workers (it shares the listening
        ports and starts no workers itself).
    :param command_line: the options given on the command line ``config``
        was built from (see :func:`twisted_relay.settings.config_from`);
        :meth:`reload` reads ``config.config_file`` again with them. ``None``
        (an application that embeds the relay): none.
    :param ledger: where each answer's usage record goes (an object with
        ``record(UsageRecord)`` that never blocks nor raises) in place of the
        ledger ``config.usage_db`` names; ``None``: that one, if any.
    :param start_checks: what :attr:`service` opens or checks when it
        starts, before anything listens
        (:class:`~twisted_relay.start_checks.StartCheck`; the first that
        fails makes its start raise a :class:`StartupError`). ``None``: the
        resources ``config`` names but the upstreams' logins
        (:func:`~twisted_relay.start_checks.start_checks_for`); ``()`` when
        they were checked already (``twistd relay`` does, logins included,
        before it daemonizes).
    """

    def __init__(
        self,
        config: RelayConfig,
        reactor=None,
        *,
        worker: bool = False,
        command_line: Mapping[str, object] | None = None,
        ledger=None,
        start_checks: Sequence[StartCheck] | None = None,
    ):
        if reactor is None:
            from twisted.internet import reactor
        self._cloud = None
        if config.simulate in SIMULATED_CLOUDS and not worker:
            # The one upstream is a simulated cloud's: its wire, login and model map.
            from twisted_relay.simulated.clouds import SimulatedCloud

            self._cloud = SimulatedCloud(config.simulate, reactor, dict(config.simulate_options))
            config = config.with_changes(upstreams=(self._cloud.upstream(config.upstreams[0]),))
        # --simulate-idp: the demo identity provider, on the relay's own listener, and sign-in with it.
        self._simulated_signin = None
        if config.simulate_idp and not worker:
            from twisted_relay.simulated.signin_demo import SimulatedSignIn

            self._simulated_signin = SimulatedSignIn(config.listen[0], reactor)
            config = config.with_changes(signin=self._simulated_signin.signin)
        self.config = config
        self._reactor = reactor
        self._worker = worker
        # None for an application that embeds the relay (no command line).
        self._command_line = None if command_line is None else dict(command_line)
        self.router = Router(config, reactor)
        # Under --simulate, the one upstream (``default``) is the simulated
        # one, whose URL is known once it listens.
        self.clients = UpstreamClients(
            reactor, config, simulated=config.upstreams[0].name if config.simulate else None
        )
        self.dumps = None
        if config.dump_dir:
            self.dumps = DumpWriter(
                config.dump_dir,
                reactor=reactor,
                secrets=config.secrets(),
                max_dump_bytes=config.dump_max_bytes,
                retention_days=config.dump_retention_days,
                retention_bytes=config.dump_retention_bytes,
                settings={
                    "version": __version__,
                    "upstream": (
                        display_url(config.upstreams[0].url) if not config.simulate else "simulated:" + config.simulate
                    ),
                    "upstream_ids": config.upstreams[0].ids,
                },
            )
        shared_metrics = None
        if config.metrics and config.workers > 1 and not worker:
            # Before any metric exists: they write to the workers' shared folder.
            shared_metrics = SharedMetricsFolder()
        self.metrics = RelayMetrics(self.dumps)
        self.ledger = None
        if config.usage_db is not None:
            # Each worker process writes its own rows to the same database.
            self.ledger = Ledger(
                open_ledger(config.usage_db),
                reactor=reactor,
                flush_interval=config.usage_flush_interval,
                max_queue=config.usage_max_queue,
                retention_days=config.usage_retention_days,
            )
        signin = config.signin
        # The managed settings file, read when the service starts (after
        # the start checks tried it), then again whenever it changes.
        self.managed_settings = (
            ManagedSettings(signin.managed_settings, read=False)
            if signin is not None and signin.managed_settings is not None
            else None
        )
        # Where the OTLP exports taken at /v1/logs, /v1/metrics and
        # /v1/traces go; with no collector, counted and dropped.
        self.telemetry = TelemetryForwarder(
            signin.telemetry_endpoint if signin is not None else None, reactor, metrics=self.metrics
        )
        self.app = RelayApp(
            config, self.clients, reactor=reactor, dumps=self.dumps, metrics=self.metrics, router=self.router,
            ledger=ledger if ledger is not None else self.ledger, managed_settings=self.managed_settings,
            telemetry=self.telemetry,
        )

        self.service = _RelayService(
            self.app, config.shutdown_grace, reactor=reactor, drain_delay=config.drain_delay
        )
        if start_checks is None:
            # Not the logins': they fetch off the reactor as the service starts.
            start_checks = start_checks_for(config, reactor, logins=False)
        self.service.start_checks = tuple(start_checks)
        if shared_metrics is not None:
            # Stopped last: removed once every worker has ended.
            shared_metrics.setServiceParent(self.service)
        sync = self.metrics.sync_service()
        if sync is not None:
            sync.setServiceParent(self.service)
        _UpstreamPoolService(self).setServiceParent(self.service)
        _ThreadStoreService(self.app.threads.store).setServiceParent(self.service)
        self.app.bodies.setServiceParent(self.service)
        if config.gc_tuning:
            GarbageCollectorTuning(reactor).setServiceParent(self.service)
        if self.dumps is not None:
            self.dumps.setServiceParent(self.service)
        if self.ledger is not None:
            # Stopped after the requests in flight have ended (and recorded their usage).
            self.ledger.setServiceParent(self.service)
        if self.app.spend is not None:
            # Reads the spend limits every refresh interval; started after the ledger, stopped before it.
            self.app.spend.setServiceParent(self.service)
        if self.app.signin is not None:
            # Reads the revocations every revocation_poll seconds; started after the ledger, stopped before it.
            self.app.signin.setServiceParent(self.service)
        if self.managed_settings is not None:
            self.managed_settings.setServiceParent(self.service)
        if self._simulated_signin is not None:
            self._simulated_signin.setServiceParent(self.service)
        # Stopped once the requests in flight have ended: what is still queued then is dropped (and counted).
        self.telemetry.setServiceParent(self.service)
        if config.simulate:
            _SimulatedUpstreamService(
                reactor, self.client, config.simulate, dict(config.simulate_options), self._cloud
            ).setServiceParent(self.service)
        site = RelaySite.for_config(self.resource(), config)
        shared = []
        for description in config.listen:
            if worker or config.workers > 1:
                listener = ReusePortListener(reactor, description, site)
                shared.append(listener)
            else:
                listener = StreamServerEndpointService(_EndpointOfDescription(reactor, description), site)
                # A port already in use stops twistd with a clear error at start.
                _twisted.raise_listen_errors(listener)
            self.service.descriptions[listener] = description
            listener.setServiceParent(self.service)
        self._workers = None
        if not worker:
            self.service.describe = self._startup_fields
        if config.workers > 1 and not worker and shared:
            self._workers = WorkerProcesses(
                reactor, config, shared, lambda: self.client.base_url, command_line=self._command_line
            )
            self._workers.setServiceParent(self.service)
        if config.config_file is not None and not worker:
            _ReloadOnHangup(reactor, self).setServiceParent(self.service)

    def _startup_fields(self) -> dict:
        """What the start-up line says: never a key, only whether there is one."""
        config = self.config
        first = config.upstreams[0]
        if config.simulate:
            upstream = "simulated:%s at %s" % (config.simulate, self.client.base_url)
        elif len(config.upstreams) == 1 and first.name == DEFAULT_UPSTREAM_NAME:
            upstream = display_url(first.url)
        else:
            upstream = ", ".join("%s=%s" % (u.name, display_url(u.url)) for u in config.upstreams)
        return {
            "version": __version__,
            "listen": ", ".join(config.listen) or "(mounted in another site)",
            "upstream": upstream,
            "upstream_ids": first.ids,
            "upstream_key": "set" if first.keys else "none (clients' own credentials pass through)",
            "upstream_key_set": bool(first.keys),
            "relay_keys": ("%d" % len(config.relay_keys)) if config.relay_keys
            else "none" if config.signin is not None else "none (every client is let in)",
            "signin": _signin_field(config.signin),
            "relay_key_count": len(config.relay_keys),
            "dump_dir": os.path.abspath(config.dump_dir) if config.dump_dir else "off",
            "usage_db": self.ledger.database.description if self.ledger is not None else "off",
            "workers": config.workers,
        }

    @property
    def client(self) -> UpstreamClient:
        """The client of the first upstream (the simulated one under ``--simulate``)."""
        return self.clients[self.config.upstreams[0].name]

    def resource(self):
        """The relay's web resource, for mounting in another ``Site`` (with ``/_idp`` under ``--simulate-idp``)."""
        if self._simulated_signin is not None:
            return self._simulated_signin.mount(self.app.resource())
        return self.app.resource()

    def reload(self) -> ReloadResult:
        """
        Read the configuration file (``config.config_file``) again, with the
        command line the relay was given if any (which still wins). A valid
        one replaces the upstreams, routes and breaker settings of
        :attr:`config`, and :attr:`router` and the upstream clients, for new
        requests; an invalid one is refused with one log line and the
        running configuration stays. The ``[signin]`` table takes effect
        at restart only (a change is named in the warning line): the
        managed settings and the telemetry forwarder stay as they are,
        and the settings file is read again whenever it changes anyway.

        SIGHUP calls this under ``twistd relay``; an application that embeds
        the relay calls it when it likes (in the reactor's thread).

        :return: what the file gave (:class:`twisted_relay.settings.ReloadResult`).
        """
        result = reload_config(
            self.config, self._command_line, worker=self._worker, check_listen=listen_checker(self._reactor)
        )
        if result.error is not None:
            _log.error("Configuration not reloaded; the running one stays: {error}", error=result.error)
            return result
        try:
            # Made first: an upstream whose login cannot be made leaves the running configuration whole.
            clients, unused = self.clients.reconfigured(result.config)
        except LoginError as e:
            _log.error("Configuration not reloaded; the running one stays: {error}", error=str(e))
            return ReloadResult(self.config, str(e))
        self.config = result.config
        self.router = self.router.reloaded(result.config)
        self.clients = clients
        self.app.reconfigure(self.router, self.clients)
        # The logins of upstreams made anew fetch their credentials now, off the reactor.
        self.clients.start_logins().addErrback(
            lambda failure: _log.error("Upstream login failed: {reason}", reason=str(failure.value)))
        if self.dumps is not None:
            self.dumps.add_secrets(result.config.secrets())
        for client in unused:
            # Requests in flight on it finish where they are.
            client.retire()
        if self._workers is not None:
            self._workers.reload(result.config)
        _log.info(
            "Configuration reloaded from {config_file}: upstreams {upstreams}, {routes} routes",
            config_file=result.config.config_file,
            upstreams=", ".join(u.name for u in result.config.upstreams),
            routes=len(result.config.routes),
        )
        if result.needs_restart:
            _log.warn(
                "Changed settings that take effect only at restart kept their running values: {settings}",
                settings=", ".join(result.needs_restart),
            )
        return result


def _signin_field(signin) -> str:
    """The start-up line's ``sign-in`` field: where people sign in, and the settings and telemetry it serves."""
    if signin is None:
        return "off"
    parts = ["issuer " + signin.issuer]
    if signin.managed_settings is not None:
        parts.append("managed settings " + signin.managed_settings)
    if signin.telemetry_endpoint is not None:
        parts.append("telemetry to " + display_url(signin.telemetry_endpoint))
    return "%s (%s)" % (signin.public_url, "; ".join(parts))


def make_service(
    config: RelayConfig,
    reactor=None,
    *,
    command_line: Mapping[str, object] | None = None,
    start_checks: Sequence[StartCheck] | None = None,
) -> MultiService:
    """
    The relay as one service that listens on ``config.listen``; its start
    raises :class:`StartupError` (and nothing listens) when a resource of
    ``config`` cannot be opened.

    :param command_line: the options given on the command line ``config``
        was built from, read again with the file on reload (see :class:`Relay`).
    :param start_checks: what its start tries first (see :class:`Relay`).
    """
    return Relay(config, reactor, command_line=command_line, start_checks=start_checks).service


def listen_checker(reactor=None) -> ListenCheck:
    """
    A check of ``--listen`` endpoints against the reactor, for
    :func:`twisted_relay.settings.config_from`: each must parse as a Twisted
    server endpoint, and be ``tcp:``/``tcp6:`` when worker processes share it.
    """
    if reactor is None:
        from twisted.internet import reactor

    def check(description: str, shared: bool) -> None:
        try:
            endpoints.serverFromString(reactor, description)
        except IndexError:
            if description.startswith("systemd:"):
                raise SettingsError(
                    "--listen %r: systemd passed no socket at that index (run the relay from a "
                    "systemd .socket unit, or under systemd-socket-activate)." % (description,)
                )
            raise SettingsError("--listen %r is not a valid endpoint." % (description,))
        except OSError as e:
            raise SettingsError("--listen %r: %s: %s" % (description, e.strerror or e, e.filename or ""))
        except (ValueError, TypeError, KeyError) as e:
            raise SettingsError("--listen %r is not a valid endpoint: %s" % (description, e))
        except ENDPOINT_ERRORS as e:
            # A TLS key or certificate that does not load, or a pair that does not match.
            raise SettingsError("--listen %r: %s" % (description, one_line_reason(e)))
        if shared and not shareable(reactor, description):
            raise SettingsError("--workers shares tcp: and tcp6: endpoints only, not --listen %r." % (description,))

    return check
