# -*- test-case-name: tests.test_hardening -*-
"""
Prometheus metrics of one relay, on a registry of its own.

Each :class:`RelayMetrics` has its own ``CollectorRegistry``, so two relays in
one process (or in one test run) never mix their figures. The exposition
resource is ``prometheus_client``'s own Twisted resource.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["RelayMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _DumpCollector:
    """Reads the dump writer's own counters when metrics are scraped."""

    def __init__(self, dumps):
        self._dumps = dumps

    def collect(self):
        family = CounterMetricFamily(
            "relay_dumps", "Diagnostic dumps of upstream 4xx answers, by outcome.", labels=["outcome"]
        )
        for outcome in ("written", "dropped", "failed"):
            family.add_metric([outcome], getattr(self._dumps, outcome, 0))
        yield family


class _ThreadStoreCollector:
    """Reads a thread store's own counters and size when metrics are scraped."""

    def __init__(self, store):
        self._store = store

    def collect(self):
        store = self._store
        lookups = CounterMetricFamily(
            "relay_thread_lookups", "Thread continues looked up, by outcome.", labels=["outcome"]
        )
        lookups.add_metric(["hit"], store.hits)
        lookups.add_metric(["miss"], store.misses)
        yield lookups
        evictions = CounterMetricFamily(
            "relay_thread_evictions", "Threads dropped before a continue, by reason.", labels=["reason"]
        )
        evictions.add_metric(["bound"], store.evictions)
        evictions.add_metric(["expired"], store.expirations)
        yield evictions
        yield CounterMetricFamily(
            "relay_thread_store_failures", "Thread store operations that failed.", value=store.failures
        )
        size = store.size()
        if size is not None:
            yield GaugeMetricFamily("relay_threads_held", "Threads the relay holds.", value=size[0])
            yield GaugeMetricFamily(
                "relay_thread_bytes_held", "Bytes of the threads the relay holds.", value=size[1]
            )


class RelayMetrics:
    """
    The relay's counters, gauges and histograms.

    :ivar registry: the registry to expose (``prometheus_client``'s
        ``MetricsResource(registry)``).
    """

    def __init__(self, dumps=None):
        self._children: dict = {}
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "relay_requests",
            "Requests answered, by route and status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.upstream_latency = Histogram(
            "relay_upstream_response_seconds",
            "Time from sending a request upstream to its response headers.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_to_first_byte = Histogram(
            "relay_time_to_first_byte_seconds",
            "Time from receiving a request to writing the first byte of its answer body.",
            ["route", "stream"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.active_streams = Gauge(
            "relay_active_streams", "Streams being relayed now.", registry=self.registry
        )
        self.active_requests = Gauge(
            "relay_active_requests", "Requests being relayed upstream now.", registry=self.registry
        )
        self.ids_rewritten = Counter(
            "relay_ids_rewritten",
            "Upstream ids rewritten for the client, by block type.",
            ["block_type"],
            registry=self.registry,
        )
        self.suspected_double_emissions = Counter(
            "relay_suspected_double_emissions",
            "Rewritten ids whose block repeats an earlier one of the same answer (same name and input).",
            registry=self.registry,
        )
        self.repairs = Counter(
            "relay_repairs",
            "Raw duplicate ids in a client's history sent upstream under a fresh id.",
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            "relay_upstream_failures",
            "Upstream failures the relay reported itself, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.retries = Counter(
            "relay_upstream_retries", "Upstream requests sent again.", registry=self.registry
        )
        if dumps is not None:
            self.registry.register(_DumpCollector(dumps))

    def watch_thread_store(self, store):
        """Export ``store``'s hits, misses, evictions, failures and size
        (an :class:`~twisted_relay.thread_store.IThreadStore`)."""
        self.registry.register(_ThreadStoreCollector(store))

    def labelled(self, metric, *values):
        """``metric.labels(*values)``, looked up once per label set (there are few)."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def resource(self):
        """The ``/metrics`` resource, in Prometheus' text format."""
        from prometheus_client.twisted import MetricsResource

        return MetricsResource(registry=self.registry)
