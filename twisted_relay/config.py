# -*- test-case-name: tests.test_tap -*-
"""
The relay's settings, as one plain value.

:class:`RelayConfig` is what the twistd plugin builds from its command line
and what an application embedding the relay builds itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

__all__ = ["RelayConfig", "DEFAULT_LISTEN", "DEFAULT_UPSTREAM", "MiB"]

MiB = 1024 * 1024
DEFAULT_LISTEN = "tcp:8080:interface=127.0.0.1"
DEFAULT_UPSTREAM = "https://api.anthropic.com"


@dataclass(frozen=True)
class RelayConfig:
    """
    Everything the relay needs to know to run.

    :ivar listen: Twisted endpoint strings to serve on; empty when the relay
        is mounted in someone else's ``Site``.
    :ivar upstream: base URL of the Anthropic-compatible upstream.
    :ivar upstream_key: key sent upstream as ``x-api-key`` instead of the
        client's credentials; ``None`` passes the client's own through.
    :ivar upstream_ids: id policy towards the upstream, ``unique`` or
        ``original`` (see ``docs/id-translation.md``).
    :ivar connect_timeout: seconds to establish the upstream connection.
    :ivar response_timeout: seconds to wait for the upstream's response
        headers (a non-streaming answer sends them only when it is done).
    :ivar idle_timeout: seconds of upstream silence inside a stream before
        the relay gives up on it.
    :ivar ping_interval: seconds of upstream silence after which the relay
        sends its own ``ping`` event to the client; 0 disables.
    :ivar max_body: largest request body accepted, in bytes.
    :ivar max_upstream_connections: persistent connections kept per
        upstream host (concurrent streams each hold one).
    :ivar dump_dir: folder for diagnostic dumps of upstream 4xx answers;
        ``None`` disables dumps.
    :ivar dump_max_bytes: largest dump written whole; larger ones are
        truncated visibly.
    :ivar dump_retention_days: dumps older than this are deleted.
    :ivar dump_retention_bytes: the oldest dumps are deleted while the
        folder holds more than this.
    :ivar total_timeout: seconds a request may take end to end, stream
        included; 0 for no limit.
    :ivar request_read_timeout: seconds a client may take to send a whole
        request (headers and body); slower ones are cut (slowloris).
    :ivar relay_keys: keys clients must present (``x-api-key`` or
        ``Authorization: Bearer``); empty lets every client in. A relay key
        is never forwarded upstream.
    :ivar max_concurrent: requests relayed upstream at once; past it the
        relay answers ``529 overloaded_error`` at once. 0 for no limit.
    :ivar retries: times a request is sent again after a failure before any
        byte reached the client (connection failures, and the statuses in
        ``retry_statuses``); 0 never retries.
    :ivar retry_statuses: upstream statuses worth a retry.
    :ivar max_retry_wait: longest ``retry-after`` the relay waits out;
        longer ones are passed to the client.
    :ivar shutdown_grace: seconds streams in flight may go on after the
        relay is told to stop.
    :ivar drain_delay: seconds the relay goes on accepting connections
        after it is told to stop, while ``/ready`` already answers 503, so
        that a load balancer sees it and sends elsewhere; 0 stops accepting
        at once (``twistd relay`` waits 5 s by default).
    :ivar metrics: serve Prometheus metrics at ``/metrics``.
    :ivar simulate: run the embedded simulated upstream in this mode
        (``strict``, ``stateful`` or ``lenient``) and relay to it.
    :ivar simulate_options: keyword arguments for the simulated upstream.
    :ivar workers: relay processes serving the ``tcp:`` listen addresses
        together (``SO_REUSEPORT``), this one included; each has its own
        pool, limits and metrics. 1 runs the relay in this process only.
    :ivar gc_tuning: freeze what exists in the process when the relay
        starts, so full garbage collections no longer walk it
        (:mod:`twisted_relay.gctuning`); it changes the whole process, so
        only ``twistd relay`` turns it on.
    """

    listen: tuple[str, ...] = (DEFAULT_LISTEN,)
    upstream: str = DEFAULT_UPSTREAM
    upstream_key: str | None = None
    upstream_ids: str = "unique"
    connect_timeout: float = 10.0
    response_timeout: float = 600.0
    idle_timeout: float = 300.0
    ping_interval: float = 10.0
    max_body: int = 32 * MiB
    max_upstream_connections: int = 1024
    dump_dir: str | None = "relay-dumps"
    dump_max_bytes: int = 64 * MiB
    dump_retention_days: float = 30.0
    dump_retention_bytes: int = 1024 * MiB
    total_timeout: float = 0.0
    request_read_timeout: float = 120.0
    relay_keys: tuple[str, ...] = ()
    max_concurrent: int = 4096
    retries: int = 0
    retry_statuses: tuple[int, ...] = (429, 500, 502, 503, 504, 529)
    max_retry_wait: float = 60.0
    shutdown_grace: float = 30.0
    drain_delay: float = 0.0
    metrics: bool = True
    simulate: str | None = None
    simulate_options: dict = field(default_factory=dict)
    workers: int = 1
    gc_tuning: bool = False

    def with_changes(self, **changes) -> "RelayConfig":
        """A copy of this configuration with some settings changed."""
        return replace(self, **changes)

    def secrets(self) -> tuple[str, ...]:
        """Every key this configuration holds, for redaction."""
        return tuple(s for s in (self.upstream_key,) + tuple(self.relay_keys) if s)
