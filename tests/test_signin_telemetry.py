"""
The telemetry intake (``POST /v1/logs``, ``/v1/metrics``, ``/v1/traces``):
exports in both OTLP/HTTP encodings, gzip or not, reach a collector
stand-in on 127.0.0.1 (a small Twisted server that decodes what it gets
with opentelemetry-proto) stamped with the caller's identity, whatever the
client claimed, and without the caller's bearer; a dead collector does not
delay the intake's answer; a full queue drops and counts; bad bodies get
clear 400, 413 and 415 answers.
"""

from __future__ import annotations

import gzip
import io
import json
import threading
import time
from types import SimpleNamespace

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site
from twisted.web.test.requesthelper import DummyRequest

from twisted_relay.metrics import RelayMetrics
from twisted_relay.signin.person import Person
from twisted_relay.signin.telemetry import (
    MAX_EXPORT_BYTES,
    STAMP_ON_THREAD_BYTES,
    TelemetryForwarder,
    logs_route,
    stamp_export,
)

from tests.signin_helpers import ALICE, serve_app

PERSON = Person(sub="00u1abc", email="dana@example.com", groups=("eng", "eng-platform"), name="dana@example.com", group="platform")
FORGED = {"user.email": "ceo@example.com", "user.id": "ceo", "identity.source": "gateway-oidc", "user.groups": "admins"}


def _attributes(keyvalues) -> dict[str, str]:
    return {item.key: item.value.string_value for item in keyvalues}


def logs_protobuf() -> bytes:
    """A log export as Claude Code's exporter sends it, claiming another user's identity."""
    export = ExportLogsServiceRequest()
    resource_logs = export.resource_logs.add()
    for key, value in {"service.name": "claude-code", "service.version": "2.1.332", **FORGED}.items():
        resource_logs.resource.attributes.add(key=key).value.string_value = value
    record = resource_logs.scope_logs.add().log_records.add()
    record.body.string_value = "claude_code.api_request"
    for key, value in {"event.name": "api_request", "user.email": "ceo@example.com", "session.id": "s-1"}.items():
        record.attributes.add(key=key).value.string_value = value
    return export.SerializeToString()


def metrics_json() -> bytes:
    """A metrics export in OTLP/JSON, claiming another user's identity."""
    return json.dumps({
        "resourceMetrics": [{
            "resource": {"attributes": [{"key": key, "value": {"stringValue": value}} for key, value in {"service.name": "claude-code", **FORGED}.items()]},
            "scopeMetrics": [{"metrics": [{"name": "claude_code.cost.usage", "sum": {"dataPoints": [{
                "asDouble": 0.25,
                "attributes": [{"key": "user.id", "value": {"stringValue": "ceo"}}, {"key": "model", "value": {"stringValue": "opus"}}],
            }]}}]}],
        }],
    }).encode()


class Collector(Resource):
    """An OTLP/HTTP receiver on 127.0.0.1 that keeps what it receives, decoded."""

    isLeaf = True

    def __init__(self, status: int = 200):
        super().__init__()
        self.status = status
        self.received: list[tuple[bytes, dict, object]] = []
        self.arrived: Deferred = Deferred()

    def render_POST(self, request):
        body = request.content.read()
        headers = {name.lower(): values for name, values in request.requestHeaders.getAllRawHeaders()}
        kind = headers[b"content-type"][0]
        signal = request.path.rsplit(b"/", 1)[-1]
        if kind == b"application/json":
            decoded = json.loads(body)
        else:
            decoded = {b"logs": ExportLogsServiceRequest, b"metrics": ExportMetricsServiceRequest, b"traces": ExportTraceServiceRequest}[signal].FromString(body)
        self.received.append((request.path, headers, decoded, body))
        if not self.arrived.called:
            self.arrived.callback(None)
        request.setResponseCode(self.status)
        return b""

    def serve(self, testcase) -> str:
        listening = reactor.listenTCP(0, Site(self), interface="127.0.0.1")
        testcase.addCleanup(listening.stopListening)
        return "http://127.0.0.1:%d" % (listening.getHost().port,)


class _Silent(Protocol):
    """Takes a connection and never answers."""


class StampTests(SynchronousTestCase):
    """What the relay sets on an export, for a signed-in person."""

    def test_protobuf_person(self):
        stamped = ExportLogsServiceRequest.FromString(stamp_export(logs_protobuf(), "logs", b"application/x-protobuf", PERSON))
        (resource_logs,) = stamped.resource_logs
        self.assertEqual(
            _attributes(resource_logs.resource.attributes),
            {"service.name": "claude-code", "service.version": "2.1.332", "identity.source": "gateway-oidc",
             "user.id": "00u1abc", "user.email": "dana@example.com", "user.groups": "eng,eng-platform"},
        )
        record = resource_logs.scope_logs[0].log_records[0]
        self.assertEqual(_attributes(record.attributes), {"event.name": "api_request", "session.id": "s-1", "user.email": "dana@example.com"})
        self.assertEqual(record.body.string_value, "claude_code.api_request")

    def test_json_person_and_relay_key(self):
        stamped = json.loads(stamp_export(metrics_json(), "metrics", b"application/json", PERSON))
        resource = stamped["resourceMetrics"][0]["resource"]
        self.assertEqual(
            {item["key"]: item["value"]["stringValue"] for item in resource["attributes"]},
            {"service.name": "claude-code", "identity.source": "gateway-oidc", "user.id": "00u1abc",
             "user.email": "dana@example.com", "user.groups": "eng,eng-platform"},
        )
        point = stamped["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][0]["sum"]["dataPoints"][0]
        self.assertEqual({item["key"]: item["value"]["stringValue"] for item in point["attributes"]}, {"model": "opus", "user.id": "00u1abc"})
        self.assertEqual(point["asDouble"], 0.25)
        # A relay key: its name; the email and groups the client claimed are gone.
        stamped = json.loads(stamp_export(metrics_json(), "metrics", b"application/json", ALICE))
        attributes = {item["key"]: item["value"]["stringValue"] for item in stamped["resourceMetrics"][0]["resource"]["attributes"]}
        self.assertEqual(attributes, {"service.name": "claude-code", "identity.source": "relay-key", "user.id": "alice"})

    def test_protobuf_metric_points_and_spans(self):
        """A data point's and a span's (and its event's) claimed identity is replaced too."""
        metrics = ExportMetricsServiceRequest()
        point = metrics.resource_metrics.add().scope_metrics.add().metrics.add(name="claude_code.cost.usage").sum.data_points.add(as_double=0.5)
        point.attributes.add(key="user.email").value.string_value = "ceo@example.com"
        point.attributes.add(key="model").value.string_value = "opus"
        stamped = ExportMetricsServiceRequest.FromString(stamp_export(metrics.SerializeToString(), "metrics", b"application/x-protobuf", PERSON))
        (point,) = stamped.resource_metrics[0].scope_metrics[0].metrics[0].sum.data_points
        self.assertEqual(_attributes(point.attributes), {"user.email": "dana@example.com", "model": "opus"})
        self.assertEqual(_attributes(stamped.resource_metrics[0].resource.attributes)["user.id"], "00u1abc")

        traces = ExportTraceServiceRequest()
        span = traces.resource_spans.add().scope_spans.add().spans.add(name="claude_code.interaction")
        span.attributes.add(key="user.id").value.string_value = "ceo"
        span.events.add(name="e").attributes.add(key="user.groups").value.string_value = "admins"
        stamped = ExportTraceServiceRequest.FromString(stamp_export(traces.SerializeToString(), "traces", b"application/x-protobuf", ALICE))
        (span,) = stamped.resource_spans[0].scope_spans[0].spans
        self.assertEqual((_attributes(span.attributes), _attributes(span.events[0].attributes)), ({"user.id": "alice"}, {}))

    def test_a_resource_with_no_attributes_gets_them(self):
        stamped = json.loads(stamp_export(b'{"resourceSpans":[{"scopeSpans":[]}]}', "traces", b"application/json", PERSON))
        self.assertEqual(len(stamped["resourceSpans"][0]["resource"]["attributes"]), 4)


class IntakeTests(TestCase):
    """The routes over HTTP on 127.0.0.1, forwarding to a collector stand-in."""

    def forwarder(self, endpoint, **bounds) -> TelemetryForwarder:
        forwarder = TelemetryForwarder(endpoint, reactor, metrics=self.metrics, **bounds)
        forwarder.startService()
        self.addCleanup(forwarder.stopService)
        return forwarder

    def setUp(self):
        self.metrics = RelayMetrics()

    def counted(self, signal: str, outcome: str) -> float:
        return self.metrics.registry.get_sample_value("relay_telemetry_exports_total", {"signal": signal, "outcome": outcome}) or 0

    async def until(self, condition, seconds: float = 10.0) -> None:
        for _ in range(int(seconds / 0.02)):
            if condition():
                return
            await deferLater(reactor, 0.02, lambda: None)
        self.fail("not reached in %s s" % (seconds,))

    async def test_protobuf_logs_and_gzip_json_metrics_reach_the_collector_stamped(self):
        collector = Collector()
        served = serve_app(self, telemetry=self.forwarder(collector.serve(self)))

        response = await served.post("/v1/logs", logs_protobuf(), content_type="application/x-protobuf")
        self.assertEqual((response.code, response.headers.getRawHeaders("content-type")), (200, ["application/x-protobuf"]))
        self.assertEqual(ExportLogsServiceResponse.FromString(await response.content()), ExportLogsServiceResponse())
        response = await served.post("/v1/metrics", gzip.compress(metrics_json()), content_type="application/json", content_encoding="gzip")
        self.assertEqual(response.code, 200)
        self.assertEqual(json.loads(await response.content()), {"partialSuccess": {}})
        await self.until(lambda: len(collector.received) == 2)

        by_path = {path: (headers, decoded, raw) for path, headers, decoded, raw in collector.received}
        headers, logs, raw = by_path[b"/v1/logs"]
        self.assertEqual(
            _attributes(logs.resource_logs[0].resource.attributes),
            {"service.name": "claude-code", "service.version": "2.1.332", "identity.source": "relay-key", "user.id": "alice"},
        )
        self.assertEqual(_attributes(logs.resource_logs[0].scope_logs[0].log_records[0].attributes), {"event.name": "api_request", "session.id": "s-1"})
        headers, metrics, raw = by_path[b"/v1/metrics"]
        self.assertEqual(headers[b"content-type"], [b"application/json"])
        resource = metrics["resourceMetrics"][0]["resource"]
        self.assertEqual({item["key"]: item["value"]["stringValue"] for item in resource["attributes"]},
                         {"service.name": "claude-code", "identity.source": "relay-key", "user.id": "alice"})
        # The bearer never goes to the collector.
        for headers, _, raw in by_path.values():
            self.assertNotIn(b"authorization", headers)
            self.assertNotIn(ALICE.key.encode(), raw + repr(headers).encode())
        self.assertEqual((self.counted("logs", "forwarded"), self.counted("metrics", "forwarded")), (1, 1))

    async def test_a_dead_collector_neither_delays_the_answer_nor_holds_more_than_its_bounds(self):
        """
        A collector that takes the connection and never answers: each
        intake still answers at once; the forwarder holds at most two
        exports, drops the next ones and counts them.
        """
        listening = reactor.listenTCP(0, Factory.forProtocol(_Silent), interface="127.0.0.1")
        self.addCleanup(listening.stopListening)
        forwarder = self.forwarder("http://127.0.0.1:%d" % (listening.getHost().port,), max_requests=2, concurrency=1, timeout=30)
        served = serve_app(self, telemetry=forwarder)
        slowest = 0.0
        for _ in range(5):
            started = time.monotonic()
            response = await served.post("/v1/logs", logs_protobuf(), content_type="application/x-protobuf")
            await response.content()
            slowest = max(slowest, time.monotonic() - started)
            self.assertEqual(response.code, 200)
        self.assertLess(slowest, 0.5)
        self.assertEqual((forwarder.held, self.counted("logs", "dropped_full"), forwarder.counts.get("dropped_full")), (2, 3, 3))
        # A byte bound too.
        small = self.forwarder("http://127.0.0.1:%d" % (listening.getHost().port,), max_bytes=10, concurrency=1)
        self.assertFalse(small.offer("logs", b"application/x-protobuf", logs_protobuf()))
        self.assertEqual(small.held_bytes, 0)

    async def test_retries_are_bounded_and_failures_counted(self):
        collector = Collector(status=503)
        forwarder = self.forwarder(collector.serve(self), attempts=2)
        served = serve_app(self, telemetry=forwarder)
        response = await served.post("/v1/traces", b'{"resourceSpans":[]}', content_type="application/json")
        self.assertEqual(response.code, 200)
        await response.content()
        await self.until(lambda: forwarder.counts.get("failed") == 1)
        self.assertEqual((len(collector.received), self.counted("traces", "failed"), forwarder.held), (2, 1, 0))

    async def test_no_collector_answers_200_and_counts(self):
        served = serve_app(self, metrics=self.metrics)
        response = await served.post("/v1/logs", logs_protobuf(), content_type="application/x-protobuf")
        self.assertEqual(response.code, 200)
        await response.content()
        self.assertEqual(self.counted("logs", "dropped_no_endpoint"), 1)

    async def test_bad_exports(self):
        served = serve_app(self, telemetry=self.forwarder(None))
        cases = [
            ("/v1/logs", b"\xff\xff\xff", {"content_type": "application/x-protobuf"}, 400, "not an OTLP ExportLogsServiceRequest"),
            ("/v1/metrics", b"{not json", {"content_type": "application/json"}, 400, "not valid JSON"),
            ("/v1/metrics", b'{"resourceMetrics": {}}', {"content_type": "application/json"}, 400, "must be a list"),
            ("/v1/logs", b"x" * 10, {"content_type": "application/json", "content_encoding": "gzip"}, 400, "not gzip"),
            ("/v1/logs", gzip.compress(b" " * (MAX_EXPORT_BYTES + 10)), {"content_type": "application/json", "content_encoding": "gzip"}, 413, "unzips to more than"),
            ("/v1/logs", b"{}", {"content_type": "text/plain"}, 415, "application/x-protobuf or application/json"),
        ]
        for path, body, headers, status, message in cases:
            response = await served.post(path, body, **headers)
            answer = json.loads(await response.content())
            self.assertEqual(response.code, status, (path, headers, answer))
            self.assertIn(message, answer["error"]["message"])
        refused = await served.post("/v1/logs", logs_protobuf(), key=None, content_type="application/x-protobuf")
        self.assertEqual((refused.code, refused.headers.getRawHeaders("x-should-retry")), (401, ["false"]))
        await refused.content()


class _KeyHolder:
    """A relay key's holder that notes whether its name was read on the reactor's thread (stamping reads it)."""

    group = None

    def __init__(self):
        self.read_on_reactor: list[bool] = []

    @property
    def name(self) -> str:
        self.read_on_reactor.append(threading.current_thread() is threading.main_thread())
        return "alice"


class StampingPlaceTests(TestCase):
    """A large export is stamped on a thread: its parsing would hold every stream of the reactor."""

    async def intake(self, body: bytes) -> _KeyHolder:
        who = _KeyHolder()
        request = DummyRequest([b""])
        request.method = b"POST"
        request.requestHeaders.setRawHeaders(b"content-type", [b"application/x-protobuf"])
        request.content = io.BytesIO(body)
        forwarder = TelemetryForwarder(None, reactor, metrics=RelayMetrics())
        answer = await logs_route(SimpleNamespace(reactor=reactor, telemetry=forwarder), request, who)
        self.assertEqual(ExportLogsServiceResponse.FromString(answer), ExportLogsServiceResponse())
        return who

    async def test_large_exports_off_the_reactor(self):
        small = logs_protobuf()
        export = ExportLogsServiceRequest.FromString(small)
        while export.ByteSize() <= STAMP_ON_THREAD_BYTES:
            export.resource_logs.append(export.resource_logs[0])
        self.assertLessEqual(len(small), STAMP_ON_THREAD_BYTES)
        self.assertTrue(all((await self.intake(small)).read_on_reactor))
        read = (await self.intake(export.SerializeToString())).read_on_reactor
        self.assertTrue(read)
        self.assertFalse(any(read))
