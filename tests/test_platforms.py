"""
Where an answer was served (:mod:`twisted_relay.platforms`): the platform
each form of upstream and model id makes, the keys that price it, and the
service tier a Bedrock answer is priced at.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.config import LoginSpec
from twisted_relay.platforms import platform_of, platform_tier, price_keys

SONNET = "anthropic.claude-sonnet-4-5-20250929-v1:0"


class PlatformTests(SynchronousTestCase):
    def test_bedrock_model_ids(self) -> None:
        """A global profile is global; a geographic profile is its geography (us, eu, apac,
        us-gov...); a base id is the upstream's region; an ARN its own region, a system
        profile's ARN its profile's."""
        cases = {
            "global." + SONNET: "bedrock:global",
            "us." + SONNET: "bedrock:us",
            "eu." + SONNET: "bedrock:eu",
            "apac." + SONNET: "bedrock:apac",
            "us-gov." + SONNET: "bedrock:us-gov",
            "global.anthropic.claude-opus-4-6-v1": "bedrock:global",
            "us.anthropic.claude-opus-4-8": "bedrock:us",
            SONNET: "bedrock:us-east-1",
            "anthropic.claude-opus-4-7": "bedrock:us-east-1",
            "claude-sonnet-4-5": "bedrock:us-east-1",
            "arn:aws:bedrock:us-west-2::foundation-model/" + SONNET: "bedrock:us-west-2",
            "arn:aws:bedrock:eu-west-1:123456789012:inference-profile/global." + SONNET: "bedrock:global",
            "arn:aws:bedrock:eu-west-1:123456789012:inference-profile/eu." + SONNET: "bedrock:eu",
            "arn:aws:bedrock:us-east-2:123456789012:application-inference-profile/a1b2c3": "bedrock:us-east-2",
            "arn:aws:bedrock:us-east-1:123456789012:provisioned-model/abc": "bedrock:us-east-1",
        }
        for model, platform in cases.items():
            self.assertEqual(platform_of("bedrock", "us-east-1", model), platform, model)

    def test_bedrock_odd_ids_stay_bounded(self) -> None:
        """A model id the client made up names no geography of its own: the upstream's region."""
        for model in ("Weird Prefix.x.y", "a" * 500 + ".anthropic.x", "us.anthropic", "", None):
            self.assertEqual(platform_of("bedrock", "eu-central-1", model), "bedrock:eu-central-1", model)
        self.assertEqual(platform_of("bedrock", None, SONNET), "bedrock:regional")

    def test_vertex_locations(self) -> None:
        """Vertex: its location, global when none is set."""
        for region in ("global", "us", "eu", "us-east5", "europe-west1"):
            self.assertEqual(platform_of("vertex", region, "claude-sonnet-4-5@20250929"), "vertex:" + region)
        self.assertEqual(platform_of("vertex", None, "claude-opus-4-6"), "vertex:global")

    def test_anthropic_wire(self) -> None:
        """Anthropic's API and the surfaces on its wire that bill its rates (Foundry, Claude Platform
        on AWS): anthropic. Bedrock's own surfaces on that wire (its Messages API, Mantle: an AWS
        login signing for bedrock or bedrock-mantle, a Bedrock API key) are Bedrock's."""
        self.assertEqual(platform_of("anthropic", None, "claude-opus-5-5"), "anthropic")
        self.assertEqual(platform_of("anthropic", "us-east-1", "opus-deployment", LoginSpec("azure")), "anthropic")
        self.assertEqual(platform_of("anthropic", "us-east-1", "opus-deployment", LoginSpec("key")), "anthropic")
        claude_platform = LoginSpec("aws", (("service", "aws-external-anthropic"),))
        self.assertEqual(platform_of("anthropic", "us-east-1", "claude-opus-5", claude_platform), "anthropic")
        profile = "global.anthropic.claude-opus-4-7"
        self.assertEqual(platform_of("anthropic", "us-east-1", profile, LoginSpec("aws")), "bedrock:global")
        mantle = LoginSpec("aws", (("service", "bedrock-mantle"),))
        self.assertEqual(platform_of("anthropic", "us-west-2", "anthropic.claude-opus-5", mantle), "bedrock:us-west-2")
        self.assertEqual(platform_of("anthropic", "eu-west-1", "eu.anthropic.claude-opus-4-7",
                                     LoginSpec("bedrock-api-key")), "bedrock:eu")

    def test_price_keys(self) -> None:
        """The platform, then its wire and class of endpoint, then its wire."""
        self.assertEqual(price_keys("bedrock:us-east-1"), ("bedrock:us-east-1", "bedrock:regional", "bedrock"))
        self.assertEqual(price_keys("bedrock:us"), ("bedrock:us", "bedrock:regional", "bedrock"))
        self.assertEqual(price_keys("bedrock:global"), ("bedrock:global", "bedrock"))
        self.assertEqual(price_keys("vertex:eu"), ("vertex:eu", "vertex:regional", "vertex"))
        self.assertEqual(price_keys("vertex:global"), ("vertex:global", "vertex"))
        self.assertEqual(price_keys("anthropic"), ("anthropic",))
        self.assertEqual(price_keys(None), ("anthropic",))

    def test_bedrock_tier(self) -> None:
        """Bedrock's tier: the one it reports applying, else the one asked for; on another wire, none
        (the usage's service_tier prices the answer)."""
        self.assertEqual(platform_tier("bedrock", "priority", "default"), "bedrock:default")
        self.assertEqual(platform_tier("bedrock", "flex", None), "bedrock:flex")
        self.assertEqual(platform_tier("bedrock", None, "Flex "), "bedrock:flex")
        self.assertIsNone(platform_tier("bedrock", None, None))
        self.assertIsNone(platform_tier("vertex", "flex", "flex"))
        self.assertIsNone(platform_tier("anthropic", None, "priority"))
