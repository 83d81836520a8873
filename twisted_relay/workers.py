# -*- test-case-name: tests.test_workers -*-
"""
Worker processes: one relay process per core, on the same listening ports.

One Twisted process uses one core. With ``workers`` above 1 the relay
listens with ``SO_REUSEPORT`` and starts ``workers - 1`` more processes
(``python -m twisted_relay.worker_process``) that listen on the same TCP ports;
the kernel spreads new connections over all of them. Each worker is a whole
relay with its own connection pool, limits and metrics, relaying to the
same upstream and writing dumps to the same folder.

The first process supervises the others: a worker that dies is started
again (after a growing delay if it keeps dying), every worker's log events
reach the first process's log with a ``relay_worker`` field, and stopping
the first process stops them all, each draining its requests in flight.
A worker whose first process dies stops too.

This module knows nothing of the relay it runs: :mod:`twisted_relay.service`
uses it, and :mod:`twisted_relay.worker_process` (a worker's ``main``) uses
both.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import replace
from typing import Mapping

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint, serverFromString
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger, eventFromJSON

from twisted_relay.config import RelayConfig
from twisted_relay.metrics import forget_process

__all__ = [
    "ReusePortListener",
    "WorkerProcesses",
    "config_from_json",
    "config_to_json",
    "listen_reuseport",
    "shareable",
    "worker_settings",
]

# The environment variables that carry a worker's configuration, and the
# command-line options it was built from (read again with the file on reload).
_CONFIG_VARIABLE = "TWISTED_RELAY_WORKER_CONFIG"
_COMMAND_LINE_VARIABLE = "TWISTED_RELAY_WORKER_COMMAND_LINE"
# A worker that dies sooner than this after its start waits longer each time.
_STABLE_SECONDS = 10.0
_FIRST_RESTART_DELAY = 1.0
_MAX_RESTART_DELAY = 60.0


def shareable(reactor, description: str) -> bool:
    """Whether a ``--listen`` endpoint can be shared by workers (``tcp:`` or ``tcp6:``)."""
    return isinstance(serverFromString(reactor, description), (TCP4ServerEndpoint, TCP6ServerEndpoint))


def listen_reuseport(reactor, description: str, factory):
    """
    Listen on a ``tcp:`` or ``tcp6:`` endpoint with ``SO_REUSEPORT``, so that
    other processes may listen on the same port; return the listening port.

    :raises ValueError: for any other kind of endpoint.
    :raises OSError: when the address cannot be bound.
    """
    family, port, interface, backlog = tcp_listen_parts(description)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((interface or ("::" if family == socket.AF_INET6 else ""), port))
        sock.listen(backlog)
        sock.setblocking(False)
        return reactor.adoptStreamPort(sock.fileno(), family, factory)
    finally:
        # The reactor holds its own copy of the descriptor.
        sock.close()


_TCP_PARAMETERS = ("port", "interface", "backlog")


def tcp_listen_parts(description: str) -> tuple[int, int, str, int]:
    """
    The address family, port, interface and backlog of a ``tcp:`` or
    ``tcp6:`` server endpoint string, read as Twisted reads it: parts split
    at ``:``, ``\\`` escapes the next character, ``name=value`` or positional
    in the order port, interface, backlog (default 50).

    :raises ValueError: for any other kind of endpoint, or a malformed one.
    """
    parts: list[list[str]] = [[""]]
    chars = iter(description)
    for char in chars:
        if char == "\\":
            parts[-1][-1] += next(chars, "")
        elif char == ":":
            parts.append([""])
        elif char == "=" and len(parts[-1]) == 1:
            parts[-1].append("")
        else:
            parts[-1][-1] += char
    kind = parts[0][0]
    if len(parts[0]) != 1 or kind not in ("tcp", "tcp6"):
        raise ValueError("Workers share tcp: and tcp6: endpoints only, not %r." % (description,))
    values: dict[str, str] = {}
    positional = 0
    for part in parts[1:]:
        if len(part) == 2:
            name, value = part
        elif positional < len(_TCP_PARAMETERS):
            name, value = _TCP_PARAMETERS[positional], part[0]
            positional += 1
        else:
            raise ValueError("Too many parts in the endpoint %r." % (description,))
        if name not in _TCP_PARAMETERS or name in values:
            raise ValueError("Unknown or repeated %r in the endpoint %r." % (name, description))
        values[name] = value
    if "port" not in values:
        raise ValueError("No port in the endpoint %r." % (description,))
    family = socket.AF_INET6 if kind == "tcp6" else socket.AF_INET
    return family, int(values["port"]), values.get("interface", ""), int(values.get("backlog", 50))


def _description(listener: "ReusePortListener") -> str:
    """A ``tcp:``/``tcp6:`` endpoint string for the address a listener is bound to."""
    address = listener.port.getHost()
    backlog = tcp_listen_parts(listener.description)[3]
    if address.type == "TCP6":
        return "tcp6:%d:interface=%s:backlog=%d" % (address.port, address.host.replace(":", "\\:"), backlog)
    return "tcp:%d:interface=%s:backlog=%d" % (address.port, address.host, backlog)


class ReusePortListener(Service):
    """
    Serves a site on a ``tcp:``/``tcp6:`` endpoint that other worker
    processes share; binds when started, and fails the start at once when
    the address is taken.
    """

    def __init__(self, reactor, description: str, factory):
        self._reactor = reactor
        self.description = description
        self._factory = factory
        self.port = None

    def startService(self):
        # Bound here, after twistd has dropped privileges (--uid), not in
        # privilegedStartService: Linux shares a port among SO_REUSEPORT
        # sockets of one user only, and the workers run as that user.
        Service.startService(self)
        self.port = listen_reuseport(self._reactor, self.description, self._factory)

    def stopService(self):
        Service.stopService(self)
        if self.port is not None:
            port, self.port = self.port, None
            return port.stopListening()
        return None


def config_to_json(config: RelayConfig) -> str:
    """A configuration as JSON, for a worker's environment."""
    return json.dumps(config.to_dict())


def config_from_json(text: str) -> RelayConfig:
    """The configuration :func:`config_to_json` wrote."""
    return RelayConfig.from_dict(json.loads(text))


class _WorkerProtocol(ProcessProtocol):
    """One worker's pipes: JSON log events on its stdout, plain text on its stderr."""

    def __init__(self, monitor: "WorkerProcesses", name: str):
        self._monitor = monitor
        self.name = name
        self._pending = {1: b"", 2: b""}

    def childDataReceived(self, fd: int, data: bytes) -> None:
        if fd not in self._pending:
            return
        lines = (self._pending[fd] + data).split(b"\n")
        self._pending[fd] = lines.pop()
        for line in lines:
            self._monitor.worker_said(self.name, fd, line)

    def processEnded(self, reason) -> None:
        for fd, rest in self._pending.items():
            if rest:
                self._monitor.worker_said(self.name, fd, rest)
        self._monitor.worker_ended(self.name, reason)


class WorkerProcesses(Service):
    """
    Starts, watches and stops the relay's other worker processes.

    :param reactor: the reactor, for processes and timers.
    :param config: the relay's configuration; each worker gets a copy that
        listens on the addresses the first process bound (``listeners``).
    :param listeners: the first process's :class:`ReusePortListener` services,
        started before this one.
    :param upstream: a callable giving the embedded simulated upstream's
        base URL once this service starts (its port is known late), which
        the workers relay to under ``simulate``.
    :param command_line: the options given on the relay's command line,
        which each worker reads its file again with on reload.
    """

    log = Logger()

    def __init__(self, reactor, config: RelayConfig, listeners, upstream, *,
                 command_line: Mapping[str, object] | None = None):
        self._reactor = reactor
        self._config = config
        self._listeners = listeners
        self._upstream = upstream
        self._command_line = dict(command_line or {})
        self._processes: dict[str, object] = {}
        self._started_at: dict[str, float] = {}
        self._delays: dict[str, float] = {}
        self._restarts: dict[str, object] = {}
        self._kills: dict[str, object] = {}
        self._pids: dict[str, int] = {}
        self._all_ended: Deferred | None = None
        self._env: dict[str, str] = {}

    @property
    def names(self) -> list[str]:
        """The workers this service runs."""
        return ["worker-%d" % (i,) for i in range(1, self._config.workers)]

    def startService(self):
        Service.startService(self)
        self._set_environment()
        for name in self.names:
            self._delays[name] = _FIRST_RESTART_DELAY
            self._start(name)

    def _set_environment(self) -> None:
        """The environment workers start with: this process's, with their configuration."""
        config = self._config.with_changes(
            listen=tuple(_description(listener) for listener in self._listeners), simulate=None, workers=1
        )
        if self._config.simulate:
            # The workers relay to this process's simulated upstream.
            first = replace(config.upstreams[0], url=self._upstream())
            config = config.with_changes(upstreams=(first,) + config.upstreams[1:])
        env = dict(os.environ)
        env[_CONFIG_VARIABLE] = config_to_json(config)
        env[_COMMAND_LINE_VARIABLE] = json.dumps(self._command_line)
        self._env = env

    def reload(self, config: RelayConfig) -> None:
        """
        This process took a new configuration: workers started from now on
        get it, and the running ones are told to read the file again (SIGHUP).
        """
        self._config = config
        if not self.running:
            return
        self._set_environment()
        for process in list(self._processes.values()):
            try:
                process.signalProcess("HUP")
            except ProcessExitedAlready:
                pass

    def _start(self, name: str) -> None:
        self._restarts.pop(name, None)
        if not self.running:
            return
        protocol = _WorkerProtocol(self, name)
        self._started_at[name] = self._reactor.seconds()
        self._processes[name] = self._reactor.spawnProcess(
            protocol,
            sys.executable,
            [sys.executable, "-m", "twisted_relay.worker_process", name],
            env=self._env,
            path=os.getcwd(),
            childFDs={0: "w", 1: "r", 2: "r"},
        )
        self._pids[name] = self._processes[name].pid
        self.log.info("Started relay {relay_worker} (pid {pid})", relay_worker=name, pid=self._pids[name])

    def worker_said(self, name: str, fd: int, line: bytes) -> None:
        """A line worker ``name`` wrote on ``fd`` (1: its log, 2: anything else): logged here."""
        line = line.strip(b"\r")
        if not line.strip():
            return
        if fd == 1:
            try:
                event = eventFromJSON(line.decode("utf-8"))
            except ValueError:
                event = None
            if isinstance(event, dict):
                event["relay_worker"] = name
                event["log_system"] = name
                self.log.observer(event)
                return
        self.log.warn(
            "{relay_worker}: {line}", relay_worker=name, line=line.decode("utf-8", "replace")
        )

    def worker_ended(self, name: str, reason) -> None:
        """Worker ``name`` exited: start it again after a pause, unless the relay is stopping."""
        self._processes.pop(name, None)
        forget_process(self._pids.pop(name, None))
        kill = self._kills.pop(name, None)
        if kill is not None and kill.active():
            kill.cancel()
        if not self.running:
            if not self._processes and self._all_ended is not None and not self._all_ended.called:
                self._all_ended.callback(None)
            return
        lived = self._reactor.seconds() - self._started_at.get(name, 0.0)
        if lived >= _STABLE_SECONDS:
            self._delays[name] = _FIRST_RESTART_DELAY
        delay = self._delays[name]
        self._delays[name] = min(delay * 2, _MAX_RESTART_DELAY)
        self.log.warn(
            "Relay {relay_worker} ended ({why}) after {lived:.1f}s; starting it again in {delay:g}s",
            relay_worker=name,
            why=reason.getErrorMessage(),
            lived=lived,
            delay=delay,
        )
        self._restarts[name] = self._reactor.callLater(delay, self._start, name)

    def stopService(self):
        """Stop every worker (each drains its requests); fire when all have ended."""
        Service.stopService(self)
        for call in self._restarts.values():
            if call.active():
                call.cancel()
        self._restarts.clear()
        if not self._processes:
            return succeed(None)
        self._all_ended = Deferred()
        # A worker gets the same grace for its requests as this process, and
        # a little more to close; then it is killed.
        kill_after = self._config.shutdown_grace + 5.0
        for name, process in list(self._processes.items()):
            try:
                process.signalProcess("TERM")
            except ProcessExitedAlready:
                continue
            self._kills[name] = self._reactor.callLater(kill_after, _kill, process)
        return self._all_ended


def _kill(process) -> None:
    try:
        process.signalProcess("KILL")
    except ProcessExitedAlready:
        pass


def worker_settings(environ: dict) -> tuple[RelayConfig, dict] | None:
    """
    The configuration and command-line options the first process gave a
    worker in its environment (removed from ``environ``), or ``None`` when
    the process was not started as a worker.
    """
    text = environ.pop(_CONFIG_VARIABLE, None)
    if text is None:
        return None
    return config_from_json(text), json.loads(environ.pop(_COMMAND_LINE_VARIABLE, "{}"))
