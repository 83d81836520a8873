"""
Issue 34 with the real Claude Code CLI (2.1.332, named by
``$TWISTED_RELAY_CLAUDE_CODE``; skipped without it): the managed settings
the relay serves reach the CLI, and its telemetry reaches the company's
collector stamped with the person.

The relay's ``[signin]`` table names a managed settings file whose ``env``
turns Claude Code's OpenTelemetry on (logs and metrics over OTLP/HTTP,
short export intervals) and its gateway hint headers, and a collector
stand-in on 127.0.0.1 as its ``telemetry_endpoint``. Claude Code signs in
(``claude auth login --gateway-json``, the browser step played by the
test) and runs ``claude -p``; a wire tap between the CLI and the relay (a
port forwarder that keeps the bytes both ways) shows what the CLI sent and
what the relay answered.

What the CLI does (observed, and checked here): ``-p`` applies settings
that need the person's approval (the hint headers do) without keeping them,
so it fetches them unconditionally each run; once the person accepts them
on a terminal they are kept, and the next runs poll with ``If-None-Match``
and take a 304. Settings that need no approval ``-p`` keeps at once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from urllib.parse import urlsplit

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from twisted.internet import defer, reactor
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater
from twisted.protocols import portforward
from twisted.trial.unittest import TestCase

from twisted_relay.signin.managed_settings import settings_checksum
from twisted_relay.simulated.idp import IdPClient

from bench.claude_code import installed_cli, run_cli
from tests.signin_helpers import claude_code_folders, claude_code_signs_in, cli_environment, kill, trap
from tests.test_signin_flow import CLIENT_SECRET, _World
from tests.test_signin_telemetry import Collector

CLAUDE, NOT_INSTALLED = installed_cli()

#: The settings the relay serves: Claude Code's OpenTelemetry logs and metrics over OTLP/HTTP in
#: protobuf (what Anthropic's own gateway pushes), exported every second or faster, and the gateway
#: hint headers (the managed settings' checksum among them).
SETTINGS = {"env": {
    "CLAUDE_CODE_ENABLE_TELEMETRY": "1", "OTEL_LOGS_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_METRIC_EXPORT_INTERVAL": "1000",
    "OTEL_LOGS_EXPORT_INTERVAL": "500", "CLAUDE_CODE_GATEWAY_HINT_HEADERS": "1",
}}


# -- a wire tap between the CLI and the relay ----------------------------------------


@dataclass
class Exchange:
    """One request on a connection and the answer to it, as they went over the wire."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int | None
    answer_headers: dict[str, str]


class _Wire:
    def __init__(self):
        self.asked = bytearray()
        self.answered = bytearray()


class _TapClient(portforward.ProxyClient):
    def dataReceived(self, data):
        self.peer.wire.answered += data
        super().dataReceived(data)


class _TapClientFactory(portforward.ProxyClientFactory):
    protocol = _TapClient
    noisy = False


class _TapServer(portforward.ProxyServer):
    clientProtocolFactory = _TapClientFactory

    def connectionMade(self):
        self.wire = _Wire()
        self.factory.wires.append(self.wire)
        super().connectionMade()

    def dataReceived(self, data):
        self.wire.asked += data
        super().dataReceived(data)


_REQUEST = re.compile(rb"(GET|POST|PUT|DELETE|HEAD) (/\S*) HTTP/1\.1\r\n(.*?)\r\n\r\n", re.S)
_ANSWER = re.compile(rb"HTTP/1\.1 (\d{3})[^\r\n]*\r\n(.*?)\r\n\r\n", re.S)


def _headers(block: bytes) -> dict[str, str]:
    lines = (line.partition(b":") for line in block.split(b"\r\n"))
    return {name.strip().lower().decode("latin-1"): value.strip().decode("latin-1") for name, _, value in lines}


class WireTap(portforward.ProxyFactory):
    """
    A port forwarder to the relay (``port``, set once it listens) keeping each
    connection's bytes; :meth:`exchanges` reads the HTTP/1.1 requests and
    answers back out of them, in order.
    """

    noisy = False
    protocol = _TapServer

    def __init__(self):
        super().__init__("127.0.0.1", 0)
        self.wires: list[_Wire] = []

    def exchanges(self, since: int = 0) -> list[Exchange]:
        """The exchanges of the connections made since the ``since``-th."""
        found = []
        for wire in self.wires[since:]:
            asked_bytes = bytes(wire.asked)
            answers = list(_ANSWER.finditer(bytes(wire.answered)))
            for index, asked in enumerate(_REQUEST.finditer(asked_bytes)):
                headers = _headers(asked.group(3))
                body = asked_bytes[asked.end():asked.end() + int(headers.get("content-length", "0"))]
                answer = answers[index] if index < len(answers) else None
                found.append(Exchange(
                    asked.group(1).decode(), asked.group(2).decode(), headers, body,
                    int(answer.group(1)) if answer else None, _headers(answer.group(2)) if answer else {},
                ))
        return found


def _resource_attributes(body: bytes, media_type: str, signal: str) -> dict[str, str]:
    """The attributes of an OTLP export's first resource (``signal`` logs or metrics)."""
    if media_type == "application/json":
        resource = json.loads(body)["resourceLogs" if signal == "logs" else "resourceMetrics"][0]["resource"]
        return {item["key"]: item["value"].get("stringValue") for item in resource["attributes"]}
    request = ExportLogsServiceRequest if signal == "logs" else ExportMetricsServiceRequest
    export = request.FromString(body)
    resources = export.resource_logs if signal == "logs" else export.resource_metrics
    return {item.key: item.value.string_value for item in resources[0].resource.attributes}


@dataclass
class _SignedIn:
    """What a test has once Claude Code has signed in through the tap."""

    tap: WireTap
    collector: Collector
    environment: dict
    home: str
    project: str
    folder: str
    bearer: str


class _Screen(ProcessProtocol):
    """An interactive ``claude`` on a terminal: what it shows, escape sequences taken out."""

    def __init__(self):
        self.shown = b""
        self.ended: defer.Deferred = defer.Deferred()

    def outReceived(self, data: bytes) -> None:
        self.shown += data

    def text(self) -> str:
        return re.sub(r"\s+", " ", re.sub(r"\x1b\[[0-9;?>]*[a-zA-Z~]", " ", self.shown.decode("utf-8", "replace")))

    def processEnded(self, reason) -> None:
        self.ended.callback(None)


async def _within(seconds: float, done) -> bool:
    """Whether ``done()`` came true within ``seconds`` (looked at every 50 ms)."""
    for _ in range(int(seconds / 0.05)):
        if done():
            return True
        await deferLater(reactor, 0.05, lambda: None)
    return bool(done())


class ClaudeCodeSettingsTelemetryTests(TestCase):
    """Managed settings and telemetry with the real CLI, through a wire tap in front of the relay."""

    skip = NOT_INSTALLED
    timeout = 240

    async def signed_in(self, settings: dict) -> "_SignedIn":
        """
        The relay serving ``settings``, with a collector stand-in as its
        telemetry endpoint and the wire tap in front; Claude Code signed in
        to it (through the tap) as alice@example.com.
        """
        world = _World(self)
        collector = Collector()
        collector_url = collector.serve(self)
        tap = WireTap()
        listening = reactor.listenTCP(0, tap, interface="127.0.0.1")
        self.addCleanup(listening.stopListening)
        gateway = "http://127.0.0.1:%d" % (listening.getHost().port,)
        # Claude Code knows the relay by the tap's address, the relay's public URL.
        world.public_url = gateway
        world.idp.add_client(IdPClient("twisted-relay", CLIENT_SECRET, (gateway + "/oauth/callback",)))

        folder = tempfile.mkdtemp(prefix="claude-code-signin-settings-")
        self.addCleanup(shutil.rmtree, folder, True)
        settings_path = os.path.join(folder, "managed-settings.json")
        with open(settings_path, "w") as f:
            json.dump(settings, f, indent=2)
        relay = world.relay(managed_settings=settings_path, telemetry_endpoint=collector_url)
        tap.port = urlsplit(relay).port

        home, project = claude_code_folders(folder, gateway)
        caught, trap_url = trap(self)
        # DISABLE_TELEMETRY and CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC stop the CLI's own traffic to
        # Anthropic, not the OpenTelemetry exports an administrator turns on (observed: both sent with them).
        # A resource attribute of the developer's own passes through; the identity ones the CLI takes
        # from the session token, over OTEL_RESOURCE_ATTRIBUTES (observed), and the relay sets them anyway.
        environment = cli_environment(home, trap_url, OTEL_RESOURCE_ATTRIBUTES="user.email=ceo@example.com,user.id=ceo,team=platform")
        await claude_code_signs_in(self, CLAUDE, world, gateway, environment, project, "alice@example.com")
        with open(os.path.join(home, ".claude", ".credentials.json")) as f:
            bearer = "Bearer " + json.load(f)["enterpriseGateway"]["jwt"]
        # Nothing went to Anthropic or anywhere else off 127.0.0.1 (checked once the test is over).
        self.addCleanup(lambda: self.assertEqual(caught.caught, []))
        return _SignedIn(tap, collector, environment, home, project, folder, bearer)

    async def test_settings_reach_the_cli_and_telemetry_the_collector(self):
        signed_in = await self.signed_in(SETTINGS)
        tap, environment = signed_in.tap, signed_in.environment
        home, project, folder, bearer = signed_in.home, signed_in.project, signed_in.folder, signed_in.bearer
        served = settings_checksum(SETTINGS)
        cache = os.path.join(home, ".claude", "remote-settings.json")

        # 1. claude -p, twice: the settings are fetched and applied each time, never kept on disk
        #    (they hold a setting that needs the person's approval, which -p cannot ask for), so
        #    each fetch is unconditional; the requests carry the checksum of what was served.
        for index in range(2):
            since = len(tap.wires)
            await self.prompt(environment, project, folder, index)
            fetch, messages = self.settings_fetch_and_messages(tap.exchanges(since), bearer)
            self.assertEqual((fetch.status, fetch.answer_headers.get("etag")), (200, '"%s"' % (served,)))
            self.assertNotIn("if-none-match", fetch.headers)
            self.assertEqual({m.headers.get("x-claude-code-managed-settings-checksum") for m in messages}, {served})
            self.assertFalse(os.path.exists(cache))

        # 2. Claude Code on a terminal asks the person once; accepted, the settings are kept.
        await self.approve_on_a_terminal(environment, home, project)
        self.assertTrue(os.path.exists(cache))

        # 3. Then claude -p polls with If-None-Match and takes the relay's 304, still sending the checksum.
        since = len(tap.wires)
        await self.prompt(environment, project, folder, 2)
        fetch, messages = self.settings_fetch_and_messages(tap.exchanges(since), bearer)
        self.assertEqual((fetch.headers.get("if-none-match"), fetch.status), ('"%s"' % (served,), 304))
        self.assertEqual({m.headers.get("x-claude-code-managed-settings-checksum") for m in messages}, {served})

        # 4. The CLI's OTLP exports (protobuf, the default pushed) went to the relay with the bearer, and
        #    reached the collector stamped with the person, without the bearer.
        await self.telemetry_reached_the_collector(signed_in, "application/x-protobuf")

    async def test_json_exports_and_settings_kept_by_print_mode(self):
        """
        Settings that need no approval (OpenTelemetry only, in http/json):
        the first ``claude -p`` keeps them, the second polls with
        ``If-None-Match`` and takes the 304; the JSON exports reach the
        collector stamped with the person.
        """
        settings = {"env": {**SETTINGS["env"], "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}}
        del settings["env"]["CLAUDE_CODE_GATEWAY_HINT_HEADERS"]
        served = settings_checksum(settings)
        signed_in = await self.signed_in(settings)
        fetches = []
        for index in range(2):
            since = len(signed_in.tap.wires)
            await self.prompt(signed_in.environment, signed_in.project, signed_in.folder, index)
            fetch, _ = self.settings_fetch_and_messages(signed_in.tap.exchanges(since), signed_in.bearer)
            fetches.append((fetch.headers.get("if-none-match"), fetch.status))
        self.assertEqual(fetches, [(None, 200), ('"%s"' % (served,), 304)])
        await self.telemetry_reached_the_collector(signed_in, "application/json")

    async def telemetry_reached_the_collector(self, signed_in: "_SignedIn", media_type: str) -> None:
        """
        The CLI sent its logs and metrics to the relay in ``media_type``
        with the bearer, and each reached the collector with the person's
        identity as the relay stamped it, the developer's own attribute
        kept, and no bearer.
        """
        tap, collector, bearer = signed_in.tap, signed_in.collector, signed_in.bearer
        sent = [e for e in tap.exchanges() if e.path in ("/v1/logs", "/v1/metrics")]
        self.assertEqual({(e.path, e.status, e.headers["content-type"], e.headers["authorization"]) for e in sent},
                         {(path, 200, media_type, bearer) for path in ("/v1/logs", "/v1/metrics")})
        self.assertTrue(await _within(10, lambda: len(collector.received) >= len(sent)), collector.received)
        paths = [path for path, _, _, _ in collector.received]
        self.assertIn(b"/v1/logs", paths)
        self.assertIn(b"/v1/metrics", paths)
        claimed = _resource_attributes(next(e.body for e in sent if e.path == "/v1/logs"), media_type, "logs")
        self.assertEqual((claimed["identity.source"], claimed["user.id"], claimed["team"]), ("gateway-oidc", "sub-alice", "platform"))
        for path, headers, export, body in collector.received:
            self.assertEqual(headers[b"content-type"], [media_type.encode()])
            attributes = _resource_attributes(body, media_type, path.rsplit(b"/", 1)[-1].decode())
            self.assertEqual(
                {key: attributes.get(key) for key in ("identity.source", "user.id", "user.email", "user.groups", "team")},
                {"identity.source": "gateway-oidc", "user.id": "sub-alice", "user.email": "alice@example.com",
                 "user.groups": "engineering,eng-platform", "team": "platform"},
                path,
            )
            self.assertEqual(attributes["service.name"], "claude-code")
            self.assertNotIn(b"authorization", headers)
            self.assertNotIn(bearer[len("Bearer "):].encode(), body)

    async def prompt(self, environment: dict, project: str, folder: str, index: int) -> None:
        """``claude -p``, answered through the relay (one tool, two turns, then the CLI stops)."""
        debug = os.path.join(folder, "debug-%d.log" % (index,))
        answered = await run_cli(reactor, [CLAUDE, "-p", "Reply with pong", "--output-format", "json", "--tools", "Read",
                                           "--allowedTools", "Read", "--max-turns", "2", "--debug-file", debug],
                                 environment, project, 90)
        if answered.timed_out or not answered.result or answered.result.get("api_error_status") is not None:
            with open(debug, encoding="utf-8", errors="replace") as f:
                self.fail((answered.stdout[-2000:], answered.stderr[-2000:], f.read()[-6000:]))

    def settings_fetch_and_messages(self, exchanges: list[Exchange], bearer: str) -> tuple[Exchange, list[Exchange]]:
        """The one settings fetch of a run (with the session bearer) and its Messages requests (at least one)."""
        fetches = [e for e in exchanges if e.path == "/managed/settings"]
        self.assertEqual([(e.method, e.headers.get("authorization")) for e in fetches], [("GET", bearer)])
        messages = [e for e in exchanges if e.path.startswith("/v1/messages")]
        self.assertTrue(messages)
        self.assertEqual({(m.status, m.headers.get("authorization")) for m in messages}, {(200, bearer)})
        return fetches[0], messages

    async def approve_on_a_terminal(self, environment: dict, home: str, project: str) -> None:
        """
        ``claude`` on a terminal (its onboarding and the folder's trust taken
        as done): it shows "Managed settings require approval", naming the
        hint headers; Enter takes the first choice, "Yes, I trust these
        settings"; once the settings are kept on disk (within 30 s) the
        process is killed.
        """
        state = os.path.join(home, ".claude.json")
        kept = {}
        if os.path.exists(state):
            with open(state) as f:
                kept = json.load(f)
        kept["hasCompletedOnboarding"] = True
        kept.setdefault("projects", {}).setdefault(project, {})["hasTrustDialogAccepted"] = True
        with open(state, "w") as f:
            json.dump(kept, f)
        screen = _Screen()
        terminal = dict(environment, TERM="xterm-256color", COLUMNS="120", LINES="40")
        process = reactor.spawnProcess(screen, CLAUDE, [CLAUDE], env=terminal, path=project, usePTY=True)
        self.addCleanup(lambda: screen.ended)
        self.addCleanup(kill, process)
        asked = await _within(60, lambda: "Yes, I trust these settings" in screen.text())
        self.assertTrue(asked, screen.text()[-3000:])
        self.assertIn("Managed settings require approval", screen.text())
        self.assertIn("CLAUDE_CODE_GATEWAY_HINT_HEADERS", screen.text())
        cache = os.path.join(home, ".claude", "remote-settings.json")
        # The dialog takes keys a moment after it shows (the first ~2 s): Enter again each second until
        # the settings are kept (one more on the empty prompt behind it does nothing).
        for _ in range(30):
            process.write(b"\r")
            if await _within(1, lambda: os.path.exists(cache)):
                break
        self.assertTrue(os.path.exists(cache), screen.text()[-3000:])
        kill(process)
        await screen.ended
