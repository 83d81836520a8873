"""
For the tests of ``twisted_relay/signin/``: a relay app with the sign-in
extras (managed settings, the telemetry intake) served on 127.0.0.1 as
production serves it (its ``RelaySite``); and the real Claude Code CLI
signing in (``claude auth login --gateway-json``, the person's browser step
played by the test), for the tests that run it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import treq
from twisted.internet import defer, error, reactor
from twisted.internet.protocol import ProcessProtocol
from twisted.web.server import Site

from twisted_relay.app import RelayApp
from twisted_relay.config import RelayConfig, RelayKey, one_upstream
from twisted_relay.site import RelaySite
from twisted_relay.upstream import UpstreamClients

from bench.claude_code import Trap

ALICE = RelayKey("sk-relay-alice-0001", "alice", "platform")
BOB = RelayKey("sk-relay-bob-0002", "bob", "research")


@dataclass
class ServedApp:
    """The app and its base URL."""

    app: RelayApp
    url: str

    def get(self, path: str, key: RelayKey | None = ALICE, **headers):
        """A GET with ``key`` as the bearer, as Claude Code sends it."""
        sent = {name.replace("_", "-"): value for name, value in headers.items()}
        if key is not None:
            sent["authorization"] = "Bearer " + key.key
        return treq.get(self.url + path, headers=sent, persistent=False)

    def post(self, path: str, body: bytes, key: RelayKey | None = ALICE, **headers):
        """A POST of ``body`` with ``key`` as the bearer."""
        sent = {name.replace("_", "-"): value for name, value in headers.items()}
        if key is not None:
            sent["authorization"] = "Bearer " + key.key
        return treq.post(self.url + path, data=body, headers=sent, persistent=False)


def serve_app(testcase, config: RelayConfig | None = None, **app_args) -> ServedApp:
    """A :class:`RelayApp` of ``config`` (alice's and bob's keys by default) with ``app_args``, on a free port."""
    if config is None:
        config = RelayConfig(listen=(), upstreams=one_upstream("http://127.0.0.1:9"), dump_dir=None).with_changes(
            relay_keys=(ALICE, BOB)
        )
    clients = UpstreamClients(reactor, config)
    testcase.addCleanup(clients.close)
    app = RelayApp(config, clients, reactor=reactor, **app_args)
    listening = reactor.listenTCP(0, RelaySite.for_config(app.resource(), config), interface="127.0.0.1")
    testcase.addCleanup(listening.stopListening)
    return ServedApp(app, "http://127.0.0.1:%d" % (listening.getHost().port,))


# -- the real Claude Code CLI ----------------------------------------------------

#: Seconds ``claude auth login --gateway-json`` may take (about 3).
LOGIN_WITHIN = 90


class GatewayLogin(ProcessProtocol):
    """
    ``claude auth login --gateway-json`` on pipes: each JSON line it writes is
    answered as the person would (accept the URL, the trust prompt, the
    account); at ``polling`` the browser step runs (``sign_in(state)``).
    Standard input stays open until ``done`` or ``error`` (EOF cancels).
    """

    def __init__(self, sign_in):
        self.sign_in = sign_in
        self.states: list[dict] = []
        self.ended: defer.Deferred = defer.Deferred()
        self.browser: defer.Deferred | None = None
        self._buffer = b""
        self.stderr = b""

    def outReceived(self, data: bytes) -> None:
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            try:
                state = json.loads(line)
            except ValueError:
                continue
            self.states.append(state)
            name = state.get("state")
            if name in ("url_input", "trust_prompt", "confirm_account"):
                answer = {"state": name, "shown": state.get("shown"), "accept": True}
                self.transport.write(json.dumps(answer).encode("utf-8") + b"\n")
            elif name == "polling" and self.browser is None:
                self.browser = defer.ensureDeferred(self.sign_in(state))
            elif name in ("done", "error"):
                self.transport.closeStdin()

    def errReceived(self, data: bytes) -> None:
        self.stderr += data

    def processEnded(self, reason) -> None:
        self.ended.callback(reason.value.exitCode)


def kill(process) -> None:
    """Kill a child process this test started (by its pid), if it still runs."""
    try:
        process.signalProcess("KILL")
    except error.ProcessExitedAlready:
        pass


def trap(testcase) -> tuple[Trap, str]:
    """A forward proxy that forwards nothing (the CLI's ``HTTPS_PROXY``), on 127.0.0.1: it and its URL."""
    caught = Trap()
    listening = reactor.listenTCP(0, Site(caught), interface="127.0.0.1")
    testcase.addCleanup(listening.stopListening)
    return caught, "http://127.0.0.1:%d" % (listening.getHost().port,)


def claude_code_folders(folder: str, gateway: str) -> tuple[str, str]:
    """
    A home (``~/.claude/settings.json`` pointing Claude Code at the gateway
    ``gateway``, as a developer's machine without managed settings has it)
    and a project folder under ``folder``.
    """
    home, project = os.path.join(folder, "home"), os.path.join(folder, "project")
    os.makedirs(os.path.join(home, ".claude"))
    os.makedirs(project)
    with open(os.path.join(home, ".claude", "settings.json"), "w") as f:
        json.dump({"forceLoginMethod": "gateway", "forceLoginGatewayUrl": gateway}, f)
    return home, project


def cli_environment(home: str, trap_url: str, **more: str) -> dict:
    """
    All a CLI under test gets: ``PATH``, its fresh ``HOME``, its own traffic to
    Anthropic off, every host but 127.0.0.1 through the trap, and ``more``.
    """
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1", "HTTPS_PROXY": trap_url, "HTTP_PROXY": trap_url, "NO_PROXY": "127.0.0.1",
        **more,
    }


async def gateway_login(claude: str, world, gateway: str, environment: dict, project: str,
                        email: str) -> tuple[int, GatewayLogin, list]:
    """
    ``claude auth login --gateway-json`` against ``gateway``, ``email`` at
    the browser (``world``: the identity provider and relays of
    ``tests.test_signin_flow``), killed after :data:`LOGIN_WITHIN` seconds:
    its exit code, the login (its screens) and the pages the browser ended on.
    """
    from tests.test_signin_flow import session

    pages = []

    async def sign_in(state: dict) -> None:
        grant = {"verification_uri": gateway + "/device", "user_code": state["userCode"],
                 "verification_uri_complete": state.get("browserUrl") or state["verificationUri"]}
        pages.append(await world.browser_signs_in(grant, email, session()))

    login = GatewayLogin(sign_in)
    process = reactor.spawnProcess(login, claude, [claude, "auth", "login", "--gateway-json"], env=environment,
                                   path=project)
    timer = reactor.callLater(LOGIN_WITHIN, kill, process)
    code = await login.ended
    if timer.active():
        timer.cancel()
    return code, login, pages


async def claude_code_signs_in(testcase, claude: str, world, gateway: str, environment: dict, project: str,
                               email: str) -> GatewayLogin:
    """:func:`gateway_login`, checked: the browser step's page a 200, the CLI ending with ``done`` and status 0."""
    code, login, pages = await gateway_login(claude, world, gateway, environment, project, email)
    testcase.assertEqual([page.status_code for page in pages], [200], [page.text for page in pages])
    names = [state.get("state") for state in login.states]
    testcase.assertEqual((code, names[-1] if names else None), (0, "done"), (login.states, login.stderr[-2000:]))
    return login
