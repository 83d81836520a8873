# -*- test-case-name: tests.test_metrics -*-
"""
Prometheus metrics of one relay, on a registry of its own.

Each :class:`RelayMetrics` has its own ``CollectorRegistry``, so two relays in
one process (or in one test run) never mix their figures. The exposition
resource is ``prometheus_client``'s own Twisted resource.

With several worker processes (``--workers``) the metrics use
``prometheus_client``'s multiprocess mode: every process writes its values
to files in one folder (``$PROMETHEUS_MULTIPROC_DIR``), which the first
process creates (or empties) at start and removes when it stops, and any
process answers ``/metrics`` with the totals of all of them. The gauges of
requests and streams in flight are summed over the live processes
(``livesum``); a worker that ends is marked dead as the library documents
(its gauges go, its counters and histograms stay in the totals).

Usage (``relay_usage_*``): the tokens, server tool requests and cost of every
metered answer, by relay key name (``-`` when the relay takes every client),
its group and model. Label sets are bounded: key names and groups come from
the configuration; a model gets a label of its own when the price table
knows it, or when it is one of the first :data:`MAX_UNPRICED_MODELS` other
models this process has seen; the rest are counted as ``other``.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from twisted.application.internet import TimerService
from twisted.application.service import Service

__all__ = [
    "MAX_UNPRICED_MODELS",
    "MULTIPROCESS_VARIABLE",
    "NO_KEY_LABEL",
    "OTHER_MODEL_LABEL",
    "RelayMetrics",
    "SharedMetricsFolder",
    "forget_process",
]

#: The variable ``prometheus_client`` reads its multiprocess folder from.
MULTIPROCESS_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
# Seconds between two copies of a process's own figures to the shared files.
_SYNC_INTERVAL = 1.0

#: Models outside the price table that get a ``model`` label of their own
#: (per process); later ones are counted as :data:`OTHER_MODEL_LABEL`.
MAX_UNPRICED_MODELS = 20
#: The ``model`` label of models beyond :data:`MAX_UNPRICED_MODELS`.
OTHER_MODEL_LABEL = "other"
#: The ``key`` label of answers to a relay that takes every client.
NO_KEY_LABEL = "-"
# The token kinds of the usage metrics' ``kind`` label, by record kind.
_TOKEN_LABELS = (
    ("input_tokens", "input"),
    ("output_tokens", "output"),
    ("cache_creation_5m_tokens", "cache_write_5m"),
    ("cache_creation_1h_tokens", "cache_write_1h"),
    ("cache_read_tokens", "cache_read"),
)
_TOOL_LABELS = (("web_search_requests", "web_search"), ("web_fetch_requests", "web_fetch"))


def _multiprocess_folder() -> str | None:
    return os.environ.get(MULTIPROCESS_VARIABLE) or None


def _use_multiprocess_values() -> None:
    """
    Make metrics created from now on write to the shared folder
    (``prometheus_client`` picks its value class when it is imported, from
    the environment; the first process sets the variable later than that).
    """
    if not getattr(values.ValueClass, "_multiprocess", False):
        values.ValueClass = values.MultiProcessValue()


def forget_process(pid: int | None) -> None:
    """A worker process has ended: drop its live gauges from the shared folder."""
    folder = _multiprocess_folder()
    if pid is not None and folder is not None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, folder)


class SharedMetricsFolder(Service):
    """
    The folder of the workers' metrics files, set up by the first process
    before any metric is created: ``$PROMETHEUS_MULTIPROC_DIR`` when set
    (emptied of the files of earlier runs, as the library asks), else a new
    temporary folder, removed when the relay stops.
    """

    def __init__(self):
        self._previous_variable = os.environ.get(MULTIPROCESS_VARIABLE)
        self._previous_values = values.ValueClass
        folder = _multiprocess_folder()
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
            for path in glob.glob(os.path.join(folder, "*.db")):
                os.remove(path)
            self.created = False
        else:
            folder = tempfile.mkdtemp(prefix="twisted-relay-metrics-")
            os.environ[MULTIPROCESS_VARIABLE] = folder
            self.created = True
        self.path = folder
        _use_multiprocess_values()

    def stopService(self):
        Service.stopService(self)
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
            if self._previous_variable is None:
                os.environ.pop(MULTIPROCESS_VARIABLE, None)
            else:
                os.environ[MULTIPROCESS_VARIABLE] = self._previous_variable
            values.ValueClass = self._previous_values

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


# The usage ledger's figures: the Ledger's attribute, the metric's name, help and kind.
_LEDGER_FIGURES = (
    ("written", "relay_ledger_rows_written", "Usage rows written to the ledger's database.", "counter"),
    ("dropped", "relay_ledger_rows_dropped", "Usage rows dropped: the queue was full, the ledger had stopped, or the database refused the row.", "counter"),
    ("failures", "relay_ledger_write_failures", "Ledger writes that failed (their rows kept and tried again).", "counter"),
    ("pending", "relay_ledger_rows_pending", "Usage rows not written yet (queued or being written).", "gauge"),
)


class _LedgerCollector:
    """Reads the usage ledger's own counters when metrics are scraped (one process)."""

    def __init__(self, ledger):
        self._ledger = ledger

    def collect(self):
        for attribute, name, doc, kind in _LEDGER_FIGURES:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc)
            family.add_metric([], getattr(self._ledger, attribute))
            yield family


def _add_increases(counted: dict, source, counter_of) -> None:
    """
    Add to each shared counter what ``source``'s attribute of that name
    counted since the last copy (``counted``: name -> the value copied).
    """
    for name, before in counted.items():
        now = getattr(source, name, 0)
        if now > before:
            counter_of(name).inc(now - before)
            counted[name] = now


# The thread store's counters, as its attributes.
_THREAD_COUNTERS = ("hits", "misses", "evictions", "expirations", "failures")


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


_BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}


def _router_figures(router):
    """``(upstream, breaker state as a number, keys resting)`` for each upstream of ``router``."""
    for upstream in router.config.upstreams:
        name = upstream.name
        yield name, _BREAKER_STATES[router.state(name)], len(router.keys_resting(name))


class _RouterCollector:
    """Each upstream's breaker state and resting keys, read from the router when scraped."""

    def __init__(self, router):
        self._router = router

    def collect(self):
        state = GaugeMetricFamily(
            "relay_upstream_breaker_state",
            "Each upstream's circuit breaker: 0 closed, 1 half-open (probing), 2 open (skipped).",
            labels=["upstream"],
        )
        resting = GaugeMetricFamily(
            "relay_upstream_keys_resting",
            "Keys of each upstream's pool resting (refused or rate-limited).",
            labels=["upstream"],
        )
        for name, number, keys in _router_figures(self._router()):
            state.add_metric([name], number)
            resting.add_metric([name], keys)
        yield state
        yield resting


#: The usage families: name, help, labels (``relay_usage_*``).
_USAGE_FAMILIES = (
    (
        "relay_usage_answers",
        "Messages answers metered, by relay key, group, model, whether complete (a stream the client "
        "left or the upstream cut is partial) and whether the price table priced it.",
        ["key", "group", "model", "complete", "priced"],
    ),
    (
        "relay_usage_tokens",
        "Tokens the upstream reported, by relay key, group, model and kind (input, output, "
        "cache_write_5m, cache_write_1h, cache_read).",
        ["key", "group", "model", "kind"],
    ),
    (
        "relay_usage_server_tool_requests",
        "Server tool requests the upstream reported, by relay key, group, model and tool.",
        ["key", "group", "model", "tool"],
    ),
    (
        "relay_usage_cost_usd",
        "What the answers cost by the price table, in US dollars, by relay key, group and model "
        "(answers the table does not price count in tokens only).",
        ["key", "group", "model"],
    ),
)

# Where each kind of usage is counted: (record's kind, family, label).
_USAGE_KINDS = tuple(
    [(kind, "relay_usage_tokens", label) for kind, label in _TOKEN_LABELS]
    + [(kind, "relay_usage_server_tool_requests", label) for kind, label in _TOOL_LABELS]
)


class _UsageTally:
    """The usage counters of one process, as plain numbers by (key, group, model)."""

    def __init__(self):
        # (key, group, model) -> {(family, extra label) or family: value}
        self._counts: dict[tuple, dict] = {}

    def count(self, record, labels: tuple) -> None:
        """Count one record under ``labels`` (key, group, model)."""
        counts = self._counts.get(labels)
        if counts is None:
            counts = self._counts[labels] = {}
        priced = record.cost is not None
        answers = ("relay_usage_answers", "true" if not record.partial else "false", "true" if priced else "false")
        counts[answers] = counts.get(answers, 0) + 1
        tokens = record.tokens
        for kind, family, label in _USAGE_KINDS:
            count = tokens.get(kind, 0)
            if count:
                counts[family, label] = counts.get((family, label), 0) + count
        if priced:
            counts["relay_usage_cost_usd",] = counts.get(("relay_usage_cost_usd",), 0.0) + float(record.cost)

    def samples(self):
        """``((family, *labels), value)`` for everything counted."""
        # Copies: a scrape reads on the reactor's thread pool while the
        # reactor thread counts (copying a dict is atomic, walking it is not).
        for labels, counts in list(self._counts.items()):
            for (family, *extra), value in list(counts.items()):
                yield (family, *labels, *extra), value


class _UsageCollector:
    """Reads a :class:`_UsageTally` when metrics are scraped (one process)."""

    def __init__(self, tally: _UsageTally):
        self._tally = tally

    def collect(self):
        families = {name: CounterMetricFamily(name, doc, labels=labels) for name, doc, labels in _USAGE_FAMILIES}
        for (family, *labels), value in self._tally.samples():
            families[family].add_metric(labels, value)
        yield from families.values()


class RelayMetrics:
    """
    The relay's counters, gauges and histograms.

    :ivar registry: the registry to expose (``prometheus_client``'s
        ``MetricsResource(registry)``).
    """

    def __init__(self, dumps=None):
        self._children: dict = {}
        self._dumps = dumps
        self._count_active = None
        self._thread_store = None
        # In a worker, or a first process that set the folder up.
        self.multiprocess = _multiprocess_folder() is not None
        if self.multiprocess:
            _use_multiprocess_values()
        live = {"multiprocess_mode": "livesum"} if self.multiprocess else {}
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
            "relay_active_streams", "Streams being relayed now.", registry=self.registry, **live
        )
        self.active_requests = Gauge(
            "relay_active_requests", "Requests being relayed upstream now.", registry=self.registry, **live
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
        self.upstream_requests = Counter(
            "relay_upstream_attempts",
            "Attempts sent to each upstream (a request tried on two upstreams counts once on each).",
            ["upstream"],
            registry=self.registry,
        )
        self.upstream_attempt_failures = Counter(
            "relay_upstream_attempt_failures",
            "Attempts an upstream failed, by upstream and kind (a status such as 529, or connect, "
            "timeout, dropped, idle, cut...).",
            ["upstream", "kind"],
            registry=self.registry,
        )
        self.failovers = Counter(
            "relay_upstream_failovers",
            "Attempts on an upstream (or one key of its pool) followed by another attempt.",
            ["upstream"],
            registry=self.registry,
        )
        self.conversation_moves = Counter(
            "relay_conversation_moves",
            "Answers from another key or upstream than their conversation's own, by upstream and "
            "across (key: a key of the same account; account: another account or upstream).",
            ["upstream", "across"],
            registry=self.registry,
        )
        self.binding_recoveries = Counter(
            "relay_binding_recoveries",
            'Requests sent again with prefix_mismatch_behavior "drop_block" after the upstream\'s '
            '"bound to a different conversation" 400, by upstream.',
            ["upstream"],
            registry=self.registry,
        )
        self.telemetry_exports = Counter(
            "relay_telemetry_exports",
            "OTLP exports taken at /v1/logs, /v1/metrics and /v1/traces (signin/telemetry.py), by signal and "
            "outcome: forwarded, failed (refused by the collector or not reached, retries included), "
            "dropped_full (its queue was full), dropped_no_endpoint (no collector set), dropped_stopped.",
            ["signal", "outcome"],
            registry=self.registry,
        )
        # Usage is tallied as plain numbers (once an answer, on the reactor: no
        # prometheus_client lock and checks per increment); read when scraped
        # in one process, copied to the shared files every second with workers.
        self._usage = _UsageTally()
        if self.multiprocess:
            self._usage_counters = {name: Counter(name, doc, labels, registry=self.registry)
                                    for name, doc, labels in _USAGE_FAMILIES}
            self._usage_copied: dict = {}
        else:
            self.registry.register(_UsageCollector(self._usage))
        self._priced_models: frozenset = frozenset()
        self._unpriced_models: set = set()
        self._unpriced_said: set = set()
        self._router = None
        if self.multiprocess:
            # Copied from this process's router (sync).
            self.breaker_state = Gauge(
                "relay_upstream_breaker_state",
                "Each upstream's circuit breaker: 0 closed, 1 half-open (probing), 2 open (skipped).",
                ["upstream"],
                registry=self.registry,
                multiprocess_mode="livemax",
            )
            self.keys_resting = Gauge(
                "relay_upstream_keys_resting",
                "Keys of each upstream's pool resting (refused or rate-limited).",
                ["upstream"],
                registry=self.registry,
                multiprocess_mode="livemax",
            )
        self._dumps_counted = {"written": 0, "dropped": 0, "failed": 0}
        self._ledger = None
        if self.multiprocess:
            # Copied from the dump writer's own counters (sync).
            self.dumps_total = Counter(
                "relay_dumps", "Diagnostic dumps of upstream 4xx answers, by outcome.", ["outcome"],
                registry=self.registry,
            )
        elif dumps is not None:
            self.registry.register(_DumpCollector(dumps))

    def know_models(self, models) -> None:
        """The models of the price table: each has a ``model`` label of its own."""
        self._priced_models = frozenset(models)

    def _model_label(self, model: str) -> str:
        if model in self._priced_models or model in self._unpriced_models:
            return model
        if len(self._unpriced_models) < MAX_UNPRICED_MODELS:
            self._unpriced_models.add(model)
            return model
        return OTHER_MODEL_LABEL

    def count_usage(self, record) -> bool:
        """
        Count one answer's :class:`~twisted_relay.usage.UsageRecord`; return
        whether it is the first answer of its model this process could not
        price (to be said once in the log).
        """
        key = NO_KEY_LABEL if record.key_name is None else record.key_name
        self._usage.count(record, (key, record.key_group or "", self._model_label(record.model)))
        if record.cost is not None:
            return False
        said = self._unpriced_said
        if record.model in said or len(said) >= 10 * MAX_UNPRICED_MODELS:
            return False
        said.add(record.model)
        return True

    def watch_thread_store(self, store):
        """Export ``store``'s hits, misses, evictions, failures and size
        (an :class:`~twisted_relay.message_threads.store.IThreadStore`): read when
        scraped in one process; copied to the shared files every second
        with workers (summed over them)."""
        if not self.multiprocess:
            self.registry.register(_ThreadStoreCollector(store))
            return
        self._thread_store = store
        self._threads_counted = dict.fromkeys(_THREAD_COUNTERS, 0)
        lookups = Counter(
            "relay_thread_lookups", "Thread continues looked up, by outcome.", ["outcome"], registry=self.registry
        )
        evictions = Counter(
            "relay_thread_evictions", "Threads dropped before a continue, by reason.", ["reason"],
            registry=self.registry,
        )
        failures = Counter(
            "relay_thread_store_failures", "Thread store operations that failed.", registry=self.registry
        )
        self._thread_counters = {
            "hits": lookups.labels("hit"),
            "misses": lookups.labels("miss"),
            "evictions": evictions.labels("bound"),
            "expirations": evictions.labels("expired"),
            "failures": failures,
        }
        self._threads_held = Gauge(
            "relay_threads_held", "Threads the relay holds.", registry=self.registry, multiprocess_mode="livesum"
        )
        self._thread_bytes_held = Gauge(
            "relay_thread_bytes_held", "Bytes of the threads the relay holds.", registry=self.registry,
            multiprocess_mode="livesum",
        )

    def _sync_threads(self) -> None:
        store = self._thread_store
        _add_increases(self._threads_counted, store, self._thread_counters.__getitem__)
        size = store.size()
        if size is not None:
            self._threads_held.set(size[0])
            self._thread_bytes_held.set(size[1])

    def watch_ledger(self, ledger) -> None:
        """
        Export the usage ledger's rows written, dropped and pending and its
        failed writes (a :class:`~twisted_relay.ledger.Ledger`): read when
        scraped in one process; copied to the shared files every second with
        workers (summed over them).
        """
        if not self.multiprocess:
            self.registry.register(_LedgerCollector(ledger))
            return
        self._ledger = ledger
        self._ledger_counted = {attribute: 0 for attribute, *_, kind in _LEDGER_FIGURES if kind == "counter"}
        self._ledger_metrics = {
            attribute: Counter(name, doc, registry=self.registry)
            if kind == "counter"
            else Gauge(name, doc, registry=self.registry, multiprocess_mode="livesum")
            for attribute, name, doc, kind in _LEDGER_FIGURES
        }

    def _sync_ledger(self) -> None:
        _add_increases(self._ledger_counted, self._ledger, self._ledger_metrics.__getitem__)
        self._ledger_metrics["pending"].set(self._ledger.pending)

    def watch_active_requests(self, count) -> None:
        """
        Report ``count()`` as the requests in flight: read when scraped in
        one process; copied to the shared files every second with workers.
        """
        if self.multiprocess:
            self._count_active = count
        else:
            self.active_requests.set_function(count)

    def watch_router(self, router) -> None:
        """
        Report each upstream's breaker state and resting keys from
        ``router()`` (a :class:`~twisted_relay.routing.Router`): read when
        scraped in one process; copied to the shared files every second
        with workers.
        """
        if self.multiprocess:
            self._router = router
        else:
            self.registry.register(_RouterCollector(router))

    def sync(self) -> None:
        """Copy this process's own figures (requests in flight, dumps, breakers, ledger) to the shared files."""
        if not self.multiprocess:
            return
        if self._count_active is not None:
            self.active_requests.set(self._count_active())
        if self._thread_store is not None:
            self._sync_threads()
        if self._ledger is not None:
            self._sync_ledger()
        if self._router is not None:
            for name, state, resting in _router_figures(self._router()):
                self.labelled(self.breaker_state, name).set(state)
                self.labelled(self.keys_resting, name).set(resting)
        for (name, *labels), value in list(self._usage.samples()):
            copied = self._usage_copied.get((name, *labels), 0)
            if value > copied:
                self.labelled(self._usage_counters[name], *labels).inc(value - copied)
                self._usage_copied[(name, *labels)] = value
        if self._dumps is not None:
            _add_increases(self._dumps_counted, self._dumps, self.dumps_total.labels)

    def sync_service(self):
        """A service that calls :meth:`sync` every second (with workers), else ``None``."""
        if not self.multiprocess:
            return None
        return TimerService(_SYNC_INTERVAL, self.sync)

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

        if self.multiprocess:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, _multiprocess_folder())
            return MetricsResource(registry=registry)
        return MetricsResource(registry=self.registry)
