# -*- test-case-name: tests.test_signin_telemetry -*-
"""
Telemetry intake: Claude Code's OpenTelemetry exports (``POST /v1/logs``,
``/v1/metrics``, ``/v1/traces``; OTLP/HTTP, protobuf or JSON, gzip or not),
stamped with who sent them and handed on to the company's collector.

A signed-in Claude Code sends its exports to the gateway it signed in to,
with its session bearer; what it says about its user (``user.email``...)
comes from the token it holds and is not to be trusted. So every export is
parsed, and the identity attributes (:data:`STAMPED_KEYS`) are set from the
caller the relay checked: on each resource, ``identity.source``
(``gateway-oidc`` for a signed-in person, as Claude Code names it;
``relay-key`` for a relay key), ``user.id`` (the person's ``sub``, or the
key's name), ``user.email`` and ``user.groups`` (comma-joined), whatever the
client claimed; and where a record, a data point or a span carries one of
those keys itself, its value is replaced too (or removed, for a relay key,
which has no email or groups). The stamped export is serialised again in
the encoding it came in (protobuf with ``opentelemetry-proto``, the
``[telemetry]`` extra; JSON with the relay's own JSON module) and queued.

:class:`TelemetryForwarder` sends the queue to ``<endpoint>/v1/<signal>``
(an OpenTelemetry Collector's OTLP/HTTP receiver) with treq, without the
caller's bearer or any header of theirs. The queue is bounded in bytes and
in exports (in flight included): an export that does not fit is dropped and
counted (``relay_telemetry_exports_total{outcome="dropped_full"}``), so a
slow or dead collector costs the relay at most that memory, and never
delays an answer: the intake answers as soon as the export is queued. Each
export is tried at most ``attempts`` times (again after a refused
connection, a timeout, 429, 502, 503 or 504, waiting 1, 2, 4... seconds),
at most ``concurrency`` at a time, each attempt bounded by ``timeout``.
"""

from __future__ import annotations

import zlib
from collections import deque
from dataclasses import dataclass

import treq
from treq.client import HTTPClient
import ujson
from twisted.application.service import Service
from twisted.internet import defer, error
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, RequestTransmissionFailed, ResponseFailed, ResponseNeverReceived

from twisted_relay._json import to_json
from twisted_relay._version import __version__
from twisted_relay.errors import RelayError
from twisted_relay.signin.person import Person
from twisted_relay.upstream import display_url

__all__ = [
    "IDENTITY_SOURCE",
    "KEY_IDENTITY_SOURCE",
    "MAX_EXPORT_BYTES",
    "STAMP_ON_THREAD_BYTES",
    "SIGNALS",
    "STAMPED_KEYS",
    "TelemetryForwarder",
    "identity_attributes",
    "logs_route",
    "metrics_route",
    "stamp_export",
    "traces_route",
]

#: ``identity.source`` of a signed-in person's exports (Claude Code's own name).
IDENTITY_SOURCE = "gateway-oidc"
#: ``identity.source`` of a relay key holder's exports.
KEY_IDENTITY_SOURCE = "relay-key"
#: The attributes the relay sets from the caller, whatever the client said.
STAMPED_KEYS = ("identity.source", "user.id", "user.email", "user.groups")
_STAMPED = frozenset(STAMPED_KEYS)
#: The largest export the intake takes, as sent and once unzipped.
MAX_EXPORT_BYTES = 4 << 20
#: An export larger than this is stamped on a thread, not on the reactor:
#: parsing and writing again a large one takes milliseconds (17 ms for an
#: 860 KB protobuf export of 5,000 records) that every stream the relay
#: carries would otherwise wait for. Claude Code's own exports are a few KB.
STAMP_ON_THREAD_BYTES = 64 << 10
#: The signals, each with its request's list of resources (OTLP/JSON's name, and protobuf's).
SIGNALS = {
    "logs": ("resourceLogs", "resource_logs"),
    "metrics": ("resourceMetrics", "resource_metrics"),
    "traces": ("resourceSpans", "resource_spans"),
}
_JSON = b"application/json"
_PROTOBUF = b"application/x-protobuf"
_MEDIA_TYPES = {b"application/json": _JSON, b"application/x-protobuf": _PROTOBUF, b"application/protobuf": _PROTOBUF}
#: Statuses after which the same export is sent again (the OTLP/HTTP specification's retryable ones).
_RETRYABLE = frozenset({429, 502, 503, 504})
_LONGEST_WAIT = 30.0
#: What the collector's network may do to an attempt: it is made again.
_NETWORK_FAILURES = (
    error.ConnectError, error.DNSLookupError, error.TimeoutError, error.ConnectionLost, defer.TimeoutError,
    ResponseFailed, RequestTransmissionFailed, ResponseNeverReceived,
)


class ExportError(ValueError):
    """An export the intake cannot read; the message says why, in one sentence."""


def identity_attributes(who) -> dict[str, str]:
    """The identity attributes stamped on the exports of ``who`` (a :class:`Person` or a relay key)."""
    if isinstance(who, Person):
        return {
            "identity.source": IDENTITY_SOURCE,
            "user.id": who.sub,
            "user.email": who.email,
            "user.groups": ",".join(who.groups),
        }
    return {"identity.source": KEY_IDENTITY_SOURCE, "user.id": who.name}


# -- stamping ------------------------------------------------------------------


def _restamp_json(attributes, trusted: dict[str, str], add_all: bool) -> list:
    if not isinstance(attributes, list):
        raise ExportError("Each attributes field must be a list of {key, value} objects.")
    present = {item.get("key") for item in attributes if isinstance(item, dict)}
    kept = [item for item in attributes if not (isinstance(item, dict) and item.get("key") in STAMPED_KEYS)]
    kept.extend(
        {"key": key, "value": {"stringValue": value}}
        for key, value in trusted.items()
        if add_all or key in present
    )
    return kept


def _walk_json(value, trusted: dict[str, str]) -> None:
    """Replace the identity attributes of every ``attributes`` list below ``value`` (records, points, spans)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "attributes" and isinstance(item, list):
                value[key] = _restamp_json(item, trusted, add_all=False)
            else:
                _walk_json(item, trusted)
    elif isinstance(value, list):
        for item in value:
            _walk_json(item, trusted)


def _stamp_json(body: bytes, signal: str, trusted: dict[str, str]) -> bytes:
    try:
        document = ujson.loads(body)
    except (ValueError, RecursionError):
        raise ExportError("The body is not valid JSON.") from None
    if not isinstance(document, dict):
        raise ExportError("The body must be a JSON object (an OTLP Export%sServiceRequest)." % (_service_name(signal),))
    camel, snake = SIGNALS[signal]
    name = camel if camel in document or snake not in document else snake
    resources = document.get(name, [])
    if not isinstance(resources, list) or not all(isinstance(entry, dict) for entry in resources):
        raise ExportError("%s must be a list of objects." % (name,))
    try:
        for entry in resources:
            resource = entry.setdefault("resource", {})
            if not isinstance(resource, dict):
                raise ExportError("%s[].resource must be an object." % (name,))
            for key, item in entry.items():
                if key != "resource":
                    _walk_json(item, trusted)
            resource["attributes"] = _restamp_json(resource.get("attributes", []), trusted, add_all=True)
    except RecursionError:
        raise ExportError("The body is nested too deeply.") from None
    return to_json(document)


def _protobuf_types(signal: str):
    try:
        if signal == "logs":
            from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as module
        elif signal == "metrics":
            from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as module
        else:
            from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as module
    except ImportError:
        raise RelayError(
            415, "This relay takes OTLP exports as application/json only: protobuf needs its [telemetry] extra (opentelemetry-proto)."
        ) from None
    service = _service_name(signal)
    return getattr(module, "Export%sServiceRequest" % (service,)), getattr(module, "Export%sServiceResponse" % (service,))


def _service_name(signal: str) -> str:
    return {"logs": "Logs", "metrics": "Metrics", "traces": "Trace"}[signal]


def _restamp_protobuf(attributes, trusted: dict[str, str], add_all: bool) -> None:
    """
    Set the identity attributes in ``attributes`` (a repeated ``KeyValue``)
    to ``trusted``, in place: each one present takes the trusted value (or
    goes, with none); with ``add_all`` the missing ones are added.
    """
    stale = []
    seen = set()
    for index, item in enumerate(attributes):
        key = item.key
        if key in _STAMPED:
            value = trusted.get(key)
            if value is None or key in seen:
                stale.append(index)
            else:
                seen.add(key)
                item.value.Clear()
                item.value.string_value = value
    for index in reversed(stale):
        del attributes[index]
    if add_all:
        for key, value in trusted.items():
            if key not in seen:
                attributes.add(key=key).value.string_value = value


def _attribute_lists(export, signal: str):
    """The attribute lists of an export's scopes and records (log records; spans, their events and links; data points)."""
    if signal == "logs":
        for resource in export.resource_logs:
            for scope in resource.scope_logs:
                yield scope.scope.attributes
                for record in scope.log_records:
                    yield record.attributes
    elif signal == "traces":
        for resource in export.resource_spans:
            for scope in resource.scope_spans:
                yield scope.scope.attributes
                for span in scope.spans:
                    yield span.attributes
                    for event in span.events:
                        yield event.attributes
                    for link in span.links:
                        yield link.attributes
    else:
        for resource in export.resource_metrics:
            for scope in resource.scope_metrics:
                yield scope.scope.attributes
                for metric in scope.metrics:
                    kind = metric.WhichOneof("data")
                    if kind is not None:
                        for point in getattr(metric, kind).data_points:
                            yield point.attributes


def _stamp_protobuf(body: bytes, signal: str, trusted: dict[str, str]) -> bytes:
    from google.protobuf.message import DecodeError

    request_type, _ = _protobuf_types(signal)
    try:
        export = request_type.FromString(body)
    except (DecodeError, RecursionError):
        raise ExportError("The body is not an OTLP Export%sServiceRequest in protobuf." % (_service_name(signal),)) from None
    for attributes in _attribute_lists(export, signal):
        if attributes:
            _restamp_protobuf(attributes, trusted, add_all=False)
    for entry in getattr(export, SIGNALS[signal][1]):
        _restamp_protobuf(entry.resource.attributes, trusted, add_all=True)
    return export.SerializeToString()


def stamp_export(body: bytes, signal: str, media_type: bytes, who) -> bytes:
    """
    The export ``body`` (of ``signal``, ``media_type`` JSON or protobuf)
    with the identity attributes of ``who`` set on every resource, and
    replaced wherever else the client set them.

    :raises ExportError: the body is not such an export.
    """
    trusted = identity_attributes(who)
    if media_type == _JSON:
        return _stamp_json(body, signal, trusted)
    return _stamp_protobuf(body, signal, trusted)


# -- the queue to the collector --------------------------------------------------


@dataclass(frozen=True)
class _Export:
    signal: str
    media_type: bytes
    body: bytes


class TelemetryForwarder(Service):
    """
    Exports on their way to the collector: a bounded queue and the senders
    that empty it (a service: stopping it drops what is queued, cancels
    what is in flight and closes its connections).

    :param endpoint: the collector's OTLP/HTTP base URL (exports go to
        ``endpoint/v1/<signal>``), or ``None``: every export is dropped
        (counted as ``dropped_no_endpoint``).
    :param reactor: the reactor (connections, timers).
    :param max_bytes: the most bytes of exports held (queued or in flight).
    :param max_requests: the most exports held (queued or in flight).
    :param metrics: the relay's :class:`~twisted_relay.metrics.RelayMetrics`
        (its ``telemetry_exports`` counter), or ``None``.
    :param attempts: how many times one export is sent at most.
    :param timeout: seconds an attempt may wait for the collector's answer.
    :param concurrency: exports sent at the same time at most.
    :ivar counts: exports by outcome (``forwarded``, ``dropped_full``,
        ``dropped_no_endpoint``, ``failed``, ``dropped_stopped``).
    """

    log = Logger()

    def __init__(
        self, endpoint: str | None, reactor, *, max_bytes: int = 16 << 20, max_requests: int = 1000, metrics=None,
        attempts: int = 3, timeout: float = 10.0, concurrency: int = 2,
    ):
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self._reactor = reactor
        self.max_bytes = max_bytes
        self.max_requests = max_requests
        self._metrics = metrics
        self.attempts = attempts
        self.timeout = timeout
        self.concurrency = concurrency
        self._queue: deque[_Export] = deque()
        self.held = 0  # exports queued or in flight
        self.held_bytes = 0
        self._senders: set[Deferred] = set()
        self._pool = None
        self._client = None
        self._failing = False
        self._stopped = False
        self.counts: dict[str, int] = {}

    def _count(self, export: _Export, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        if self._metrics is not None:
            self._metrics.labelled(self._metrics.telemetry_exports, export.signal, outcome).inc()

    def offer(self, signal: str, media_type: bytes, body: bytes) -> bool:
        """Queue an export for the collector; ``False`` when it is dropped (no collector, or no room)."""
        export = _Export(signal, media_type, body)
        if self.endpoint is None:
            self._count(export, "dropped_no_endpoint")
            return False
        if self._stopped:
            self._count(export, "dropped_stopped")
            return False
        if self.held + 1 > self.max_requests or self.held_bytes + len(body) > self.max_bytes:
            self._count(export, "dropped_full")
            return False
        self.held += 1
        self.held_bytes += len(body)
        self._queue.append(export)
        if len(self._senders) < self.concurrency:
            sender = ensureDeferred(self._send_queued())
            self._senders.add(sender)
            sender.addBoth(self._sender_done, sender)
        return True

    def _sender_done(self, result, sender) -> None:
        self._senders.discard(sender)
        if isinstance(result, Failure) and not result.check(CancelledError):
            self.log.failure("The telemetry sender stopped", result)

    async def _send_queued(self) -> None:
        while self._queue:
            export = self._queue.popleft()
            try:
                outcome = await self._send(export)
            except CancelledError:
                outcome = "dropped_stopped"
            finally:
                self.held -= 1
                self.held_bytes -= len(export.body)
            self._count(export, outcome)

    def _http(self):
        if self._client is None:
            self._pool = HTTPConnectionPool(self._reactor, persistent=True)
            self._pool.maxPersistentPerHost = self.concurrency
            self._client = HTTPClient(Agent(self._reactor, pool=self._pool))
        return self._client

    async def _send(self, export: _Export) -> str:
        """Send one export (tried again as the specification allows); its outcome."""
        url = "%s/v1/%s" % (self.endpoint, export.signal)
        headers = {b"content-type": [export.media_type], b"user-agent": [b"twisted-relay/" + __version__.encode("ascii")]}
        problem = ""
        for attempt in range(self.attempts):
            if self._stopped:
                return "dropped_stopped"
            if attempt:
                await deferLater(self._reactor, min(2.0 ** (attempt - 1), _LONGEST_WAIT), lambda: None)
            try:
                response = await self._http().post(url, data=export.body, headers=headers, timeout=self.timeout)
                await treq.collect(response, lambda data: None).addTimeout(self.timeout, self._reactor)
            except _NETWORK_FAILURES as e:  # a refused connection, a timeout, a connection lost
                problem = e.__class__.__name__
                continue
            if 200 <= response.code < 300:
                if self._failing:
                    self._failing = False
                    self.log.info("Telemetry reaches the collector at {endpoint} again", endpoint=display_url(self.endpoint))
                return "forwarded"
            problem = "HTTP %d" % (response.code,)
            if response.code not in _RETRYABLE:
                break
        if self._stopped:
            return "dropped_stopped"
        if not self._failing:
            self._failing = True
            self.log.warn(
                "Telemetry export to the collector at {endpoint} failed ({problem}); exports that fail are dropped and counted",
                endpoint=display_url(self.endpoint), problem=problem,
            )
        return "failed"

    def stopService(self):
        """Drop the exports queued, cancel those in flight, close the connections."""
        Service.stopService(self)
        self._stopped = True
        while self._queue:
            export = self._queue.popleft()
            self.held -= 1
            self.held_bytes -= len(export.body)
            self._count(export, "dropped_stopped")
        for sender in list(self._senders):
            sender.cancel()
        if self._pool is not None:
            return self._pool.closeCachedConnections()
        return None


# -- the intake routes -------------------------------------------------------------


def _body_of(request) -> bytes:
    if getattr(request, "body_too_large", False):
        raise RelayError(413, "The export is larger than the relay takes.")
    if getattr(request, "over_budget", False):
        raise RelayError(529, "The relay holds as many request bodies as its memory limit allows; try again shortly.",
                         kind="overloaded")
    content = request.content
    content.seek(0, 2)
    size = content.tell()
    if size > MAX_EXPORT_BYTES:
        raise RelayError(413, "The export is %d bytes; the relay takes at most %d." % (size, MAX_EXPORT_BYTES))
    content.seek(0)
    body = content.read()
    encoding = (request.getHeader(b"content-encoding") or b"identity").strip().lower()
    if encoding in (b"identity", b""):
        return body
    if encoding not in (b"gzip", b"x-gzip"):
        raise RelayError(415, "Content-Encoding %s is not taken: send the export as it is, or gzip it." % (encoding.decode("ascii", "replace"),))
    unzip = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        plain = unzip.decompress(body, MAX_EXPORT_BYTES + 1)
    except zlib.error:
        raise RelayError(400, "The body says gzip but is not gzip data.") from None
    if len(plain) > MAX_EXPORT_BYTES or unzip.unconsumed_tail:
        raise RelayError(413, "The export unzips to more than %d bytes, the most the relay takes." % (MAX_EXPORT_BYTES,))
    if not unzip.eof:
        raise RelayError(400, "The gzip data ends early.")
    return plain


async def _intake(context, request, who, signal: str) -> bytes:
    media_type = _MEDIA_TYPES.get((request.getHeader(b"content-type") or b"").partition(b";")[0].strip().lower())
    if media_type is None:
        raise RelayError(415, "OTLP/HTTP exports are application/x-protobuf or application/json.")
    body = _body_of(request)
    if media_type == _PROTOBUF:
        _, response_type = _protobuf_types(signal)
    try:
        if len(body) > STAMP_ON_THREAD_BYTES:
            reactor = context.reactor
            stamped = await deferToThreadPool(reactor, reactor.getThreadPool(), stamp_export, body, signal, media_type, who)
        else:
            stamped = stamp_export(body, signal, media_type, who)
    except ExportError as e:
        raise RelayError(400, str(e)) from None
    forwarder = getattr(context, "telemetry", None)
    if forwarder is not None:
        forwarder.offer(signal, media_type, stamped)
    request.setHeader(b"content-type", media_type)
    request.setHeader(b"cache-control", b"no-store")
    if media_type == _JSON:
        return b'{"partialSuccess":{}}'
    return response_type().SerializeToString()


async def logs_route(context, request, who) -> bytes:
    """``POST /v1/logs``: a log export of ``who``, stamped and queued for the collector."""
    return await _intake(context, request, who, "logs")


async def metrics_route(context, request, who) -> bytes:
    """``POST /v1/metrics``: a metrics export of ``who``, stamped and queued for the collector."""
    return await _intake(context, request, who, "metrics")


async def traces_route(context, request, who) -> bytes:
    """``POST /v1/traces``: a trace export of ``who``, stamped and queued for the collector."""
    return await _intake(context, request, who, "traces")

