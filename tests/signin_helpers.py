"""
A relay app with the sign-in extras (managed settings, the telemetry
intake) served on 127.0.0.1 as production serves it (its ``RelaySite``),
for the tests of ``twisted_relay/signin/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import treq
from twisted.internet import reactor

from twisted_relay.app import RelayApp
from twisted_relay.config import RelayConfig, RelayKey, one_upstream
from twisted_relay.site import RelaySite
from twisted_relay.upstream import UpstreamClients

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
