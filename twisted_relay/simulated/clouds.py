# -*- test-case-name: tests.test_simulated_clouds -*-
"""
The simulated clouds as the relay's one upstream, for a keyless first run:
``twistd -n relay --simulate bedrock`` (or ``vertex``, ``foundry``).

Each cloud is its simulator (:mod:`twisted_relay.simulated.bedrock`,
:mod:`~twisted_relay.simulated.vertex` with its token endpoint,
:mod:`~twisted_relay.simulated.foundry`) in strict mode, and the upstream
the relay sends to it is the one a team would write for the real cloud: the
cloud's wire, a login of the real kind (SigV4 with keys, a service account's
key file through the token endpoint, an API key), and a model map from
the names Claude Code asks for to the platform's ids. Only the credentials
are made up: the simulator's own.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace

from twisted.web.resource import IResource

from twisted_relay.config import LoginSpec, Upstream
from twisted_relay.simulated.bedrock import SimulatedBedrock
from twisted_relay.simulated.bedrock_auth import AwsCredential
from twisted_relay.simulated.foundry import Deployment, SimulatedFoundry
from twisted_relay.simulated.google_tokens import SimulatedGoogleTokens, make_service_account
from twisted_relay.simulated.resource import SimulatedUpstream
from twisted_relay.simulated.vertex import SimulatedVertex

__all__ = ["CLOUDS", "SimulatedCloud"]

#: The clouds ``--simulate`` runs.
CLOUDS = ("bedrock", "vertex", "foundry")

# Made up, and known to the simulators only.
_AWS_KEY_ID = "AKIASIMULATEDRELAY01"
_AWS_SECRET = "simulated/relay/secret/access/key/01"
_FOUNDRY_KEY = "simulated-foundry-relay-key"
_PROJECT = "simulated-project"
_SERVICE_ACCOUNT = "relay@simulated-project.iam.gserviceaccount.com"

#: The models Claude Code asks for, in each platform's words.
MODEL_MAPS = {
    "bedrock": (
        ("claude-opus-4-6", "global.anthropic.claude-opus-4-6-v1"),
        ("claude-sonnet-4-6", "global.anthropic.claude-sonnet-4-6"),
        ("claude-sonnet-4-5", "global.anthropic.claude-sonnet-4-5-20250929-v1:0"),
        ("claude-sonnet-4-5-20250929", "global.anthropic.claude-sonnet-4-5-20250929-v1:0"),
        ("claude-haiku-4-5", "global.anthropic.claude-haiku-4-5-20251001-v1:0"),
        ("claude-haiku-4-5-20251001", "global.anthropic.claude-haiku-4-5-20251001-v1:0"),
        ("claude-opus-4-5", "global.anthropic.claude-opus-4-5-20251101-v1:0"),
        ("claude-opus-4-5-20251101", "global.anthropic.claude-opus-4-5-20251101-v1:0"),
    ),
    "vertex": (
        ("claude-opus-4-6", "claude-opus-4-6"),
        ("claude-sonnet-4-6", "claude-sonnet-4-6"),
        ("claude-sonnet-4-5", "claude-sonnet-4-5@20250929"),
        ("claude-haiku-4-5", "claude-haiku-4-5@20251001"),
    ),
    # Deployments named after their models, as Foundry names them by default.
    "foundry": (
        ("claude-opus-4-6", "claude-opus-4-6"),
        ("claude-sonnet-4-6", "claude-sonnet-4-6"),
        ("claude-sonnet-4-5", "claude-sonnet-4-5"),
        ("claude-haiku-4-5", "claude-haiku-4-5"),
    ),
}


class SimulatedCloud:
    """
    One simulated cloud and the relay's upstream for it.

    :param cloud: one of :data:`CLOUDS`.
    :param reactor: the reactor the simulator paces its streams with.
    :param options: :class:`~twisted_relay.simulated.SimulatedUpstream`'s
        options (``--simulate-seed`` and the like).
    """

    def __init__(self, cloud: str, reactor, options: dict):
        if cloud not in CLOUDS:
            raise ValueError("cloud must be one of %s" % (", ".join(CLOUDS),))
        self.cloud = cloud
        model = SimulatedUpstream(mode="strict", reactor=reactor, **options)
        self._folder = None
        if cloud == "bedrock":
            self._simulator = SimulatedBedrock(model, access_keys={_AWS_KEY_ID: AwsCredential(_AWS_SECRET)})
        elif cloud == "vertex":
            self._tokens = SimulatedGoogleTokens(reactor=reactor)
            self._simulator = SimulatedVertex(model, _PROJECT, self._tokens)
            self._folder = tempfile.mkdtemp(prefix="twisted-relay-simulated-vertex-")
        else:
            deployments = {deployment: Deployment(model) for model, deployment in MODEL_MAPS["foundry"]}
            self._simulator = SimulatedFoundry(model, keys=(_FOUNDRY_KEY,), deployments=deployments)

    def resource(self) -> IResource:
        """What to serve."""
        return self._simulator.resource()

    @property
    def _key_file(self) -> str:
        return os.path.join(self._folder, "service-account.json")

    def upstream(self, upstream: Upstream) -> Upstream:
        """``upstream`` (the relay's one, its URL learnt later) made the cloud's."""
        if self.cloud == "bedrock":
            login = LoginSpec("aws", (("access-key-id", _AWS_KEY_ID), ("secret-access-key", _AWS_SECRET)))
            return replace(upstream, wire="bedrock", region="us-east-1", login=login, keys=(),
                           models=MODEL_MAPS["bedrock"])
        if self.cloud == "vertex":
            return replace(upstream, wire="vertex", project=_PROJECT, region="global", keys=(),
                           login=LoginSpec("google", (("credentials", self._key_file),)), models=MODEL_MAPS["vertex"])
        return replace(upstream, keys=(_FOUNDRY_KEY,), models=MODEL_MAPS["foundry"])

    def listening(self, url: str) -> str:
        """
        The simulator listens at ``url``: the base URL the relay sends to
        (Foundry's ``/anthropic``); for Vertex, the service account's key
        file is written, its token endpoint the simulator's.
        """
        if self.cloud == "vertex":
            account = make_service_account(_SERVICE_ACCOUNT, _PROJECT, token_uri=url + "/token")
            self._tokens.add_service_account(account.email, account.public_key)
            with open(os.open(self._key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump(account.info, f)
        if self.cloud == "foundry":
            return url + "/anthropic"
        return url

    def close(self) -> None:
        """Remove what :meth:`listening` wrote."""
        if self._folder is not None:
            for name in os.listdir(self._folder):
                os.unlink(os.path.join(self._folder, name))
            os.rmdir(self._folder)
            self._folder = None
