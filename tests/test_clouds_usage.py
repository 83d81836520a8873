"""
Usage and cost per platform through the relay (issue 32, item 7): the relay,
built from a TOML file as ``twistd relay --config`` builds it, in front of
the simulated Bedrock (SigV4) and Vertex (a service account through the
simulated token endpoint) on 127.0.0.1. Each answer's usage record names the
platform that served it, and is priced with the regional endpoints'
premium where it applies: a Bedrock geographic profile or base id, a Vertex
region or multi-region; not a global endpoint, nor a model older than
Sonnet 4.5. A Bedrock upstream's service tier prices its answers as Bedrock
says it served them.
"""

from __future__ import annotations

import json
import os
from decimal import Decimal

import treq
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.server import Site

from twisted_relay.metering import parts_of
from twisted_relay.prices import DEFAULT_PRICES
from twisted_relay.settings import read_settings
from twisted_relay.simulated import SimulatedUpstream

from tests.helpers import RecordingLedger, serve_relay

SONNET_4_5 = "anthropic.claude-sonnet-4-5-20250929-v1:0"
AWS_KEY_ID = "ASIASIMUSAGEKEY0001"
AWS_SECRET = "simulated/usage/secret/key/0001"
AWS_TOKEN = "simulated-usage-session-token-0001"
AWS_VARIABLES = {"SIM_USAGE_AWS_KEY_ID": AWS_KEY_ID, "SIM_USAGE_AWS_SECRET": AWS_SECRET,
                 "SIM_USAGE_AWS_TOKEN": AWS_TOKEN}
PROJECT = "sim-usage-project"
SERVICE_ACCOUNT = "relay@sim-usage-project.iam.gserviceaccount.com"

BEDROCK = """
[upstreams.{name}]
wire = "bedrock"
url = "{url}"
region = "us-east-1"
login = {{ kind = "aws", access-key-id = "env:SIM_USAGE_AWS_KEY_ID", secret-access-key = "env:SIM_USAGE_AWS_SECRET", session-token = "env:SIM_USAGE_AWS_TOKEN" }}
{more}
"""
VERTEX = """
[upstreams.{name}]
wire = "vertex"
url = "{url}"
project = "{project}"
region = "{region}"
login = {{ kind = "google", credentials = "{credentials}" }}
"""
ROUTE = """
[[routes]]
models = ["{asked}"]
targets = [{{ upstream = "{upstream}", model = "{model}" }}]
"""


class CloudUsageTests(TestCase):
    timeout = 60

    def setUp(self):
        self.folder = os.path.abspath(self.mktemp())
        os.makedirs(self.folder)
        for name, value in AWS_VARIABLES.items():
            self.addCleanup(_restore, name, os.environ.get(name))
            os.environ[name] = value

    def serve(self, resource) -> str:
        port = reactor.listenTCP(0, Site(resource), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return "http://127.0.0.1:%d" % (port.getHost().port,)

    def bedrock(self) -> str:
        from twisted_relay.simulated.bedrock import SimulatedBedrock
        from twisted_relay.simulated.bedrock_auth import AwsCredential

        sim = SimulatedBedrock(SimulatedUpstream(thinking_secret="bedrock-usage"),
                               access_keys={AWS_KEY_ID: AwsCredential(AWS_SECRET, session_token=AWS_TOKEN)})
        return self.serve(sim.resource())

    def vertex(self) -> tuple[str, str]:
        """The simulated Vertex and its token endpoint; the service account's key file."""
        from twisted_relay.simulated.google_tokens import SimulatedGoogleTokens, make_service_account
        from twisted_relay.simulated.vertex import SimulatedVertex

        tokens = SimulatedGoogleTokens(reactor=reactor)
        url = self.serve(SimulatedVertex(SimulatedUpstream(thinking_secret="vertex-usage"), PROJECT, tokens).resource())
        account = make_service_account(SERVICE_ACCOUNT, PROJECT, token_uri=url + "/token")
        tokens.add_service_account(account.email, account.public_key)
        path = os.path.join(self.folder, "service-account.json")
        with open(path, "w") as f:
            json.dump(account.info, f)
        os.chmod(path, 0o600)
        return url, path

    def relay(self, tables: str) -> str:
        path = os.path.join(self.folder, "relay.toml")
        with open(path, "w") as f:
            f.write('[relay]\ndump-dir = "%s"\n%s' % (os.path.join(self.folder, "dumps"), tables))
        self.ledger = RecordingLedger()
        config = read_settings({}, path)
        return serve_relay(self, config.with_changes(drain_delay=0.0), reactor, ledger=self.ledger).url

    async def ask(self, relay: str, model: str, stream: bool = False):
        """One Messages request for ``model``; the usage record of its answer."""
        body = {"model": model, "max_tokens": 64, "stream": stream,
                "messages": [{"role": "user", "content": "Say hello."}]}
        before = len(self.ledger.records)
        response = await treq.post(relay + "/v1/messages", json=body, headers={"x-api-key": "sk-client"},
                                    persistent=False)
        text = await response.text()
        self.assertEqual(response.code, 200, text)
        for _ in range(200):
            if len(self.ledger.records) > before:
                break
            await deferLater(reactor, 0.01, lambda: None)
        (record,) = self.ledger.records[before:]
        self.assertFalse(record.partial)
        self.assertGreater(record.tokens["output_tokens"], 0)
        return record

    def assertPriced(self, record, platform: str, multiplier: str) -> None:
        """The record's platform, and its cost: the price table's for what was reported, times ``multiplier``."""
        self.assertEqual(record.platform, platform)
        standard = DEFAULT_PRICES.cost(parts_of(json.loads(record.usage), record.model))
        self.assertGreater(standard, 0)
        self.assertEqual(record.cost, Decimal(multiplier) * standard, (platform, record.model))

    async def test_bedrock(self):
        """A global profile at the global price; a geographic (us.) profile at 1.1x, streamed or
        not; Haiku 3.5 by its base id in the region, at its price on every endpoint."""
        url = self.bedrock()
        relay = self.relay(
            BEDROCK.format(name="bedrock", url=url, more="")
            + ROUTE.format(asked="sonnet-global", upstream="bedrock", model="global." + SONNET_4_5)
            + ROUTE.format(asked="sonnet-us", upstream="bedrock", model="us." + SONNET_4_5)
            + ROUTE.format(asked="haiku-in-region", upstream="bedrock",
                           model="anthropic.claude-3-5-haiku-20241022-v1:0")
        )
        self.assertPriced(await self.ask(relay, "sonnet-global"), "bedrock:global", "1")
        self.assertPriced(await self.ask(relay, "sonnet-global", stream=True), "bedrock:global", "1")
        regional = await self.ask(relay, "sonnet-us")
        self.assertEqual(regional.model, "claude-sonnet-4-5-20250929")
        self.assertPriced(regional, "bedrock:us", "1.1")
        self.assertPriced(await self.ask(relay, "sonnet-us", stream=True), "bedrock:us", "1.1")
        older = await self.ask(relay, "haiku-in-region")
        self.assertEqual(older.model, "claude-3-5-haiku-20241022")
        self.assertPriced(older, "bedrock:us-east-1", "1")

    async def test_bedrock_service_tier(self):
        """An upstream asking Bedrock for its flex tier: Bedrock says it served flex, which
        the shipped table does not price (AWS prices it per model): metered in tokens; with
        the tier's price in [prices], at that price, the regional premium on top."""
        url = self.bedrock()
        tables = (
            BEDROCK.format(name="bedrock-flex", url=url, more='service-tier = "flex"')
            + ROUTE.format(asked="sonnet-flex", upstream="bedrock-flex", model="us." + SONNET_4_5)
        )
        relay = self.relay(tables)
        record = await self.ask(relay, "sonnet-flex", stream=True)
        self.assertEqual(record.platform, "bedrock:us")
        self.assertEqual(json.loads(record.usage).get("service_tier"), "standard")
        self.assertIsNone(record.cost)
        relay = self.relay(tables + '\n[prices.service-tier]\nstandard = "1"\n"bedrock:flex" = "0.5"\n')
        self.assertPriced(await self.ask(relay, "sonnet-flex"), "bedrock:us", "0.55")

    async def test_vertex(self):
        """Vertex's global endpoint at the global price; its multi-region (us) and a region at 1.1x."""
        url, credentials = self.vertex()
        tables = ""
        for region in ("global", "us", "us-east5"):
            name = "vertex-" + region
            tables += VERTEX.format(name=name, url=url, project=PROJECT, region=region, credentials=credentials)
            tables += ROUTE.format(asked="sonnet-" + region, upstream=name, model="claude-sonnet-4-5")
        relay = self.relay(tables)
        self.assertPriced(await self.ask(relay, "sonnet-global"), "vertex:global", "1")
        self.assertPriced(await self.ask(relay, "sonnet-us", stream=True), "vertex:us", "1.1")
        self.assertPriced(await self.ask(relay, "sonnet-us-east5"), "vertex:us-east5", "1.1")


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
