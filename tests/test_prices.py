"""
The price table (:mod:`twisted_relay.prices`): its arithmetic in decimals,
what it refuses to guess, the shipped table, and a ``[prices]`` table read
from a file.
"""

from __future__ import annotations

from decimal import Decimal

from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.prices import DEFAULT_PRICES, DEFAULT_PRICES_READ_ON, PriceTable, price_table_from

MILLION = 1_000_000


def _tokens(input=0, output=0, write_5m=0, write_1h=0, read=0) -> dict:
    return {"input_tokens": input, "output_tokens": output, "cache_creation_5m_tokens": write_5m,
            "cache_creation_1h_tokens": write_1h, "cache_read_tokens": read}


class ArithmeticTests(SynchronousTestCase):
    """Costs in decimals, from the shipped table."""

    def test_every_kind_at_its_rate(self) -> None:
        """Each kind of token at its own rate, US dollars per million, exactly (no float)."""
        cost = DEFAULT_PRICES.cost([("claude-sonnet-5-5", _tokens(1000, 200, 3000, 4000, 50000))])
        expected = (1000 * Decimal(2) + 200 * Decimal(10) + 3000 * Decimal("2.50") + 4000 * Decimal(4)
                    + 50000 * Decimal("0.10")) / MILLION
        self.assertEqual(cost, expected)
        self.assertEqual(str(cost), "0.0325")
        # A third of a cent stays a third of a cent: nothing is rounded.
        self.assertEqual(DEFAULT_PRICES.cost([("claude-haiku-5-5", _tokens(read=1))]), Decimal("0.00000001"))

    def test_parts_at_their_own_models(self) -> None:
        """Each sampling (a fallback's declined attempt, the fallback's answer) at its model's rates."""
        cost = DEFAULT_PRICES.cost([("claude-fable-5-2", _tokens(100, 1)), ("claude-sonnet-5", _tokens(100, 80))])
        self.assertEqual(cost, (100 * 8 + 1 * 40 + 100 * 2 + 80 * 10) / Decimal(MILLION))

    def test_server_tools(self) -> None:
        """Web search is $10 a thousand requests; web fetch costs its tokens only."""
        cost = DEFAULT_PRICES.cost([("claude-opus-5-5", _tokens())], web_search_requests=3, web_fetch_requests=5)
        self.assertEqual(cost, Decimal("0.03"))

    def test_fast_and_geography(self) -> None:
        """Fast mode multiplies the model's rates (2x on Opus 5.5), US-only inference by 1.1;
        together, 2.2x; the server tool fee stays."""
        tokens = [("claude-opus-5-5", _tokens(1000, 1000, read=1000))]
        standard = DEFAULT_PRICES.cost(tokens)
        self.assertEqual(DEFAULT_PRICES.cost(tokens, speed="fast"), 2 * standard)
        self.assertEqual(DEFAULT_PRICES.cost(tokens, inference_geo="us"), Decimal("1.1") * standard)
        self.assertEqual(DEFAULT_PRICES.cost(tokens, speed="fast", inference_geo="us", web_search_requests=1),
                         Decimal("2.2") * standard + Decimal("0.01"))
        self.assertEqual(DEFAULT_PRICES.cost(tokens, speed="standard", inference_geo="global",
                                             service_tier="standard"), standard)

    def test_long_prompt_rates(self) -> None:
        """Haiku 5.5 bills a prompt (input, cache writes and reads) over 100K tokens at 5x."""
        short = DEFAULT_PRICES.cost([("claude-haiku-5-5", _tokens(60_000, 1000, read=40_000))])
        long = DEFAULT_PRICES.cost([("claude-haiku-5-5", _tokens(60_001, 1000, read=40_000))])
        self.assertEqual(short, (60_000 * Decimal("0.10") + 1000 * Decimal("0.50") + 40_000 * Decimal("0.01"))
                         / MILLION)
        self.assertEqual(long, (60_001 * Decimal("0.50") + 1000 * Decimal("2.50") + 40_000 * Decimal("0.05"))
                         / MILLION)

    def test_never_guessed(self) -> None:
        """An unknown model, a fast answer of a model without a fast price, an unknown
        geography or tier: no cost at all (None), for the whole answer."""
        known = ("claude-opus-5-5", _tokens(10, 10))
        self.assertIsNone(DEFAULT_PRICES.cost([("claude-mythos-preview", _tokens(10, 10))]))
        self.assertIsNone(DEFAULT_PRICES.cost([known, ("claude-unheard-of", _tokens(1))]))
        self.assertIsNone(DEFAULT_PRICES.cost([("claude-sonnet-5-5", _tokens(10))], speed="fast"))
        self.assertIsNone(DEFAULT_PRICES.cost([known], inference_geo="eu"))
        self.assertIsNone(DEFAULT_PRICES.cost([known], service_tier="priority"))
        self.assertIsNone(DEFAULT_PRICES.cost([(None, _tokens(10))]))
        self.assertIsNone(DEFAULT_PRICES.cost([known], platform="foundry:eastus"))
        # A platform no key prices leaves the models it does not apply to priced.
        self.assertIsNotNone(DEFAULT_PRICES.cost([("claude-sonnet-4", _tokens(10))], platform="foundry:eastus"))

    def test_regional_endpoints(self) -> None:
        """Bedrock's and Vertex's regional endpoints (a region, a geography, a multi-region)
        cost 1.1x their global ones for Sonnet 4.5 and later models; the global ones, and
        Anthropic's own, 1x; with US-only inference on top, 1.21x."""
        for model in ("claude-sonnet-4-5", "claude-sonnet-4-5-20250929", "claude-haiku-4-5", "claude-opus-4-5",
                      "claude-opus-4-6", "claude-opus-5-5", "claude-sonnet-5-5", "claude-haiku-5-5"):
            tokens = [(model, _tokens(1000, 1000, 1000, 1000, 1000))]
            standard = DEFAULT_PRICES.cost(tokens)
            for platform in ("bedrock:us-east-1", "bedrock:us", "bedrock:eu", "vertex:us-east5", "vertex:us",
                             "vertex:eu"):
                self.assertEqual(DEFAULT_PRICES.cost(tokens, platform=platform), Decimal("1.1") * standard,
                                 (model, platform))
            for platform in ("bedrock:global", "vertex:global", "anthropic", None):
                self.assertEqual(DEFAULT_PRICES.cost(tokens, platform=platform), standard, (model, platform))
            self.assertEqual(DEFAULT_PRICES.cost(tokens, platform="bedrock:us", inference_geo="us"),
                             Decimal("1.21") * standard)

    def test_older_models_same_price_everywhere(self) -> None:
        """Sonnet 4, Opus 4 and 4.1, Haiku 3.5 keep their price on every endpoint; a fallback's
        parts each at their own model's (the older one without the premium)."""
        for model in ("claude-sonnet-4", "claude-sonnet-4-20250514", "claude-opus-4-1", "claude-opus-4",
                      "claude-3-5-haiku-20241022"):
            tokens = [(model, _tokens(1000, 1000))]
            self.assertEqual(DEFAULT_PRICES.cost(tokens, platform="bedrock:us-east-1"), DEFAULT_PRICES.cost(tokens))
        parts = [("claude-opus-4-1", _tokens(100, 1)), ("claude-sonnet-4-5", _tokens(100, 80))]
        self.assertEqual(DEFAULT_PRICES.cost(parts, platform="vertex:us-east5"),
                         (100 * 15 + 1 * 75) / Decimal(MILLION) + Decimal("1.1") * (100 * 3 + 80 * 15) / MILLION)

    def test_bedrock_tiers(self) -> None:
        """Bedrock's default tier is 1x; its priority, flex and reserved tiers are priced by AWS
        per model: not guessed (the file gives them)."""
        tokens = [("claude-sonnet-4-5", _tokens(1000, 1000))]
        standard = DEFAULT_PRICES.cost(tokens)
        self.assertEqual(DEFAULT_PRICES.cost(tokens, service_tier="bedrock:default", platform="bedrock:global"),
                         standard)
        for tier in ("bedrock:priority", "bedrock:flex", "bedrock:reserved"):
            self.assertIsNone(DEFAULT_PRICES.cost(tokens, service_tier=tier, platform="bedrock:global"), tier)
        table = price_table_from({"service-tier": {"standard": 1, "bedrock:default": 1, "bedrock:flex": "0.5"}},
                                 base=DEFAULT_PRICES)
        self.assertEqual(table.cost(tokens, service_tier="bedrock:flex", platform="bedrock:us-east-1"),
                         Decimal("0.55") * standard)

    def test_dated_ids(self) -> None:
        """A dated id takes its undated id's price; an id of its own wins."""
        self.assertIs(DEFAULT_PRICES.price_of("claude-haiku-4-5-20251001"), DEFAULT_PRICES.price_of("claude-haiku-4-5"))
        self.assertIsNone(DEFAULT_PRICES.price_of("claude-haiku-4-5-2025"))
        table = price_table_from({"models": {"m-20260101": dict(input=1, output=1, **{
            "cache-write-5m": 1, "cache-write-1h": 1, "cache-read": 1})}}, base=DEFAULT_PRICES)
        self.assertEqual(table.price_of("m-20260101").rates["input_tokens"], Decimal(1))
        self.assertIsNone(table.price_of("m"))


class ShippedTableTests(SynchronousTestCase):
    """The table the relay ships."""

    def test_models_of_today(self) -> None:
        """Today's model families of the simulated upstream and the current models of the SDK
        are priced, with the date their prices were read."""
        for model in ("claude-fable-5-2", "claude-mythos-5-2", "claude-fable-5-1", "claude-mythos-5-1",
                      "claude-opus-5-5", "claude-sonnet-5-5", "claude-haiku-5-5", "claude-sonnet-5",
                      "claude-fable-5", "claude-mythos-5", "claude-opus-5", "claude-opus-4-8", "claude-opus-4-7",
                      "claude-opus-4-6", "claude-sonnet-4-6", "claude-haiku-4-5", "claude-haiku-4-5-20251001",
                      "claude-opus-4-5", "claude-opus-4-5-20251101"):
            self.assertIsNotNone(DEFAULT_PRICES.price_of(model), model)
        self.assertEqual(DEFAULT_PRICES.read_on, DEFAULT_PRICES_READ_ON)
        rates = DEFAULT_PRICES.price_of("claude-fable-5-1").rates
        self.assertEqual((rates["input_tokens"], rates["cache_read_tokens"]), (Decimal(10), Decimal("0.25")))

    def test_round_trip(self) -> None:
        """to_dict, then from_dict: the same table (what worker processes receive)."""
        self.assertEqual(PriceTable.from_dict(DEFAULT_PRICES.to_dict()), DEFAULT_PRICES)


class FileTableTests(SynchronousTestCase):
    """A ``[prices]`` table as a configuration file gives it."""

    RATES = {"input": "1.5", "output": 7, "cache-write-5m": "1.875", "cache-write-1h": 3.0, "cache-read": "0.15"}

    def test_adds_and_replaces(self) -> None:
        """Models are added to the shipped table, or replace a shipped one whole; numbers
        as strings, integers or TOML floats are read as the decimals written."""
        table = price_table_from({
            "read-on": "2026-12-24",
            "web-search": "0.02",
            "inference-geo": {"global": 1, "us": "1.2"},
            "models": {"my-model": self.RATES, "claude-opus-5-5": dict(self.RATES, fast="3")},
        }, base=DEFAULT_PRICES)
        self.assertEqual(table.read_on, "2026-12-24")
        self.assertEqual(table.price_of("my-model").rates["cache_creation_1h_tokens"], Decimal("3.0"))
        self.assertEqual(table.price_of("claude-opus-5-5").fast, Decimal(3))
        self.assertEqual(table.price_of("claude-fable-5-2"), DEFAULT_PRICES.price_of("claude-fable-5-2"))
        self.assertEqual(table.cost([("my-model", _tokens(1000))], inference_geo="us", web_search_requests=1),
                         Decimal("1.2") * 1500 / MILLION + Decimal("0.02"))
        self.assertEqual(table.cost([("my-model", _tokens(output=3))]), Decimal("0.000021"))

    def test_platform_multipliers(self) -> None:
        """[prices.platform] adds to the shipped multipliers, or replaces those of the same key; a
        platform's own key wins over its class's; platform-multiplier = false keeps a model's
        price the same everywhere; the table goes to the workers whole."""
        table = price_table_from({
            "platform": {"bedrock:us-east-1": "1.05", "vertex:regional": "1.2"},
            "models": {"old-model": dict(self.RATES, **{"platform-multiplier": False}), "new-model": self.RATES},
        }, base=DEFAULT_PRICES)
        tokens = _tokens(1000)
        self.assertEqual(table.cost([("new-model", tokens)], platform="bedrock:us-east-1"),
                         Decimal("1.05") * 1500 / MILLION)
        self.assertEqual(table.cost([("new-model", tokens)], platform="bedrock:eu"), Decimal("1.1") * 1500 / MILLION)
        self.assertEqual(table.cost([("new-model", tokens)], platform="vertex:us"), Decimal("1.2") * 1500 / MILLION)
        self.assertEqual(table.cost([("new-model", tokens)], platform="vertex:global"), Decimal(1500) / MILLION)
        self.assertEqual(table.cost([("old-model", tokens)], platform="vertex:us"), Decimal(1500) / MILLION)
        self.assertFalse(table.price_of("old-model").platform_multiplier)
        self.assertEqual(PriceTable.from_dict(table.to_dict()), table)

    def test_mistakes_named(self) -> None:
        """A missing rate (none is guessed), a bad number, an unknown key: refused, naming it."""
        cases = [
            ({"models": {"m": {"input": 1, "output": 2}}}, "models.m needs every rate"),
            ({"models": {"m": dict(self.RATES, input="lots")}}, "models.m input must be a number"),
            ({"models": {"m": dict(self.RATES, output=-1)}}, "models.m output must be a number, zero or more"),
            ({"models": {"m": dict(self.RATES, colour="red")}}, "models.m: unknown key colour"),
            ({"models": {"m": dict(self.RATES, **{"long-prompt-over": 10})}}, "long-prompt-over and long-prompt"),
            ({"models": {"m": dict(self.RATES, input=True)}}, "models.m input must be a number"),
            ({"models": {"m": "cheap"}}, "models.m must be a table"),
            ({"rates": {}}, "unknown key rates"),
            ({"inference-geo": {"us": "x"}}, "inference-geo us must be a number"),
            ({"platform": {"bedrock:regional": "-1"}}, "platform bedrock:regional must be a number, zero or more"),
            ({"platform": "1.1"}, "platform must be a table of multipliers"),
            ({"models": {"m": dict(self.RATES, **{"platform-multiplier": "no"})}},
             "models.m platform-multiplier must be true or false"),
        ]
        for values, words in cases:
            with self.assertRaises(ValueError) as raised:
                price_table_from(values, base=DEFAULT_PRICES)
            self.assertIn(words, str(raised.exception), values)
