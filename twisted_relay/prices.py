# -*- test-case-name: tests.test_prices -*-
"""
What answers cost: the price table, per model and per kind of token.

A :class:`PriceTable` holds, for each model, its rates in US dollars per
million tokens (:class:`ModelPrice`), the multipliers of fast mode, of the
inference geography, of the service tier and of the platform that served
the answer (Bedrock's and Vertex's regional endpoints cost more than their
global ones: :mod:`twisted_relay.platforms`), and the fee of each server
tool request. :meth:`PriceTable.cost` prices what one answer used, in
:class:`~decimal.Decimal` (no float arithmetic), or says it cannot: a model
the table does not know, a fast answer of a model without a fast-mode price,
an unknown geography, tier or platform is never guessed (``None``).

:data:`DEFAULT_PRICES` is the table the relay ships, read from Anthropic's
pricing pages on :data:`DEFAULT_PRICES_READ_ON`; a ``--config`` file's
``[prices]`` table adds models to it or replaces them (:func:`price_table_from`).
``docs/usage.md`` has the table and the rules.

Pure: no Twisted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Iterable, Mapping

from twisted_relay.platforms import price_keys

__all__ = [
    "DEFAULT_PRICES",
    "DEFAULT_PRICES_READ_ON",
    "PRICED_KINDS",
    "ModelPrice",
    "PriceTable",
    "price_table_from",
]

#: The kinds of token a model's rates price, in the order of
#: :data:`twisted_relay.usage.TOKEN_KINDS`.
PRICED_KINDS = (
    "input_tokens",
    "output_tokens",
    "cache_creation_5m_tokens",
    "cache_creation_1h_tokens",
    "cache_read_tokens",
)

#: Where each priced kind is in a ``[prices.models.NAME]`` table.
_FILE_NAMES = {
    "input": "input_tokens",
    "output": "output_tokens",
    "cache-write-5m": "cache_creation_5m_tokens",
    "cache-write-1h": "cache_creation_1h_tokens",
    "cache-read": "cache_read_tokens",
}
_KIND_FILE_NAMES = {kind: name for name, kind in _FILE_NAMES.items()}
_MODEL_KEYS = (*_FILE_NAMES, "fast", "long-prompt-over", "long-prompt", "platform-multiplier")
_TABLE_KEYS = ("read-on", "models", "web-search", "web-fetch", "inference-geo", "service-tier", "platform")
_MILLION = Decimal(1_000_000)
_DATED = re.compile(r"^(.*)-\d{8}$")


@dataclass(frozen=True)
class ModelPrice:
    """
    One model's price.

    :ivar rates: US dollars per million tokens, for each kind of
        :data:`PRICED_KINDS`.
    :ivar fast: what fast mode (``usage.speed`` ``"fast"``) multiplies every
        rate by; ``None`` when the model has no fast-mode price.
    :ivar long_prompt_over: prompt tokens (input, cache writes and reads of
        one sampling) above which :attr:`long_rates` apply; ``None``: one
        set of rates at every length.
    :ivar long_rates: the rates above :attr:`long_prompt_over`.
    :ivar platform_multiplier: the table's platform multipliers
        (:attr:`PriceTable.platform`) apply to this model; ``False`` for
        the models older than Claude Sonnet 4.5, whose price is the same on
        every endpoint.
    """

    rates: Mapping[str, Decimal]
    fast: Decimal | None = None
    long_prompt_over: int | None = None
    long_rates: Mapping[str, Decimal] | None = None
    platform_multiplier: bool = True

    def rates_for(self, tokens: Mapping[str, int]) -> Mapping[str, Decimal]:
        """The rates that price ``tokens`` (one sampling's counts)."""
        if self.long_prompt_over is not None and self.long_rates is not None:
            prompt = sum(tokens.get(kind, 0) for kind in PRICED_KINDS if kind != "output_tokens")
            if prompt > self.long_prompt_over:
                return self.long_rates
        return self.rates


@dataclass(frozen=True)
class PriceTable:
    """
    Prices of models and server tools, and the multipliers that apply to
    an answer as a whole.

    :ivar models: each model's price, by model id (a dated id, such as
        ``claude-haiku-4-5-20251001``, takes its undated id's price when it
        has none of its own).
    :ivar web_search: US dollars per web search request.
    :ivar web_fetch: US dollars per web fetch request.
    :ivar inference_geo: what each ``usage.inference_geo`` multiplies token
        rates by (an answer that names none is ``global``).
    :ivar service_tier: what each service tier multiplies token rates by:
        ``usage.service_tier`` (an answer that names none is ``standard``),
        or Bedrock's tier as ``bedrock:`` and its name
        (:func:`~twisted_relay.platforms.platform_tier`).
    :ivar platform: what the platform that served an answer multiplies the
        token rates of the models that take it by
        (:attr:`ModelPrice.platform_multiplier`), by platform
        (``bedrock:us-east-1``), by wire and class of endpoint
        (``bedrock:regional``, ``vertex:global``) or by wire
        (``anthropic``): the first found, in that order
        (:func:`~twisted_relay.platforms.price_keys`).
    :ivar read_on: when these prices were read (``YYYY-MM-DD``), for people.
    """

    models: Mapping[str, ModelPrice]
    web_search: Decimal = Decimal(0)
    web_fetch: Decimal = Decimal(0)
    inference_geo: Mapping[str, Decimal] = field(default_factory=lambda: {"global": Decimal(1)})
    service_tier: Mapping[str, Decimal] = field(default_factory=lambda: {"standard": Decimal(1)})
    platform: Mapping[str, Decimal] = field(default_factory=lambda: {"anthropic": Decimal(1)})
    read_on: str = ""

    def price_of(self, model: str | None) -> ModelPrice | None:
        """The price of ``model``, or ``None`` when the table has none."""
        if not isinstance(model, str):
            return None
        price = self.models.get(model)
        if price is None:
            dated = _DATED.match(model)
            if dated is not None:
                price = self.models.get(dated.group(1))
        return price

    def platform_factor(self, platform: str | None) -> Decimal | None:
        """What ``platform`` multiplies the rates of the models that take it by (``None``: the table cannot say)."""
        if platform is None:
            return Decimal(1)
        for key in price_keys(platform):
            factor = self.platform.get(key)
            if factor is not None:
                return factor
        return None

    def cost(
        self,
        parts: Iterable[tuple[str | None, Mapping[str, int]]],
        *,
        web_search_requests: int = 0,
        web_fetch_requests: int = 0,
        speed: str | None = None,
        inference_geo: str | None = None,
        service_tier: str | None = None,
        platform: str | None = None,
    ) -> Decimal | None:
        """
        What an answer cost, in US dollars, exactly; ``None`` when the table
        cannot say (the answer is then metered in tokens only).

        :param parts: the answer's samplings: ``(model, tokens)`` pairs, the
            tokens by kind of :data:`PRICED_KINDS`; each is priced at its
            own model's rates.
        :param speed: ``usage.speed``: ``"fast"`` multiplies each part's
            rates by its model's :attr:`ModelPrice.fast`.
        :param inference_geo: ``usage.inference_geo``.
        :param service_tier: ``usage.service_tier``, or the platform's tier.
        :param platform: where the answer was served
            (:func:`~twisted_relay.platforms.platform_of`); ``None``: no
            platform multiplier.
        """
        geo = self.inference_geo.get(inference_geo or "global")
        tier = self.service_tier.get(service_tier or "standard")
        if geo is None or tier is None:
            return None
        # Looked up once; missing, it fails only the models that take it.
        endpoint = self.platform_factor(platform)
        fast = speed == "fast"
        total = Decimal(0)
        for model, tokens in parts:
            price = self.price_of(model)
            if price is None:
                return None
            factor = geo * tier
            if price.platform_multiplier and endpoint != 1:
                if endpoint is None:
                    return None
                factor *= endpoint
            if fast:
                if price.fast is None:
                    return None
                factor *= price.fast
            rates = price.rates_for(tokens)
            # Decimal arithmetic is slow next to int's: only the kinds used.
            part = sum(count * rates[kind] for kind in PRICED_KINDS if (count := tokens.get(kind, 0)))
            total += (part if factor == 1 else factor * part) / _MILLION
        if web_search_requests:
            total += web_search_requests * self.web_search
        if web_fetch_requests:
            total += web_fetch_requests * self.web_fetch
        return total

    def with_models(self, models: Mapping[str, ModelPrice], **changes) -> "PriceTable":
        """This table with ``models`` added (replacing those of the same id) and other fields changed."""
        merged = dict(self.models)
        merged.update(models)
        values = dict(
            models=merged,
            web_search=self.web_search,
            web_fetch=self.web_fetch,
            inference_geo=self.inference_geo,
            service_tier=self.service_tier,
            platform=self.platform,
            read_on=self.read_on,
        )
        values.update(changes)
        return PriceTable(**values)

    def to_dict(self) -> dict:
        """The table as JSON-able values, in the shape of the file's ``[prices]`` table."""
        return {
            "read-on": self.read_on,
            "web-search": str(self.web_search),
            "web-fetch": str(self.web_fetch),
            "inference-geo": {name: str(value) for name, value in self.inference_geo.items()},
            "service-tier": {name: str(value) for name, value in self.service_tier.items()},
            "platform": {name: str(value) for name, value in self.platform.items()},
            "models": {model: _model_to_dict(price) for model, price in self.models.items()},
        }

    @classmethod
    def from_dict(cls, values: Mapping) -> "PriceTable":
        """The table :meth:`to_dict` wrote."""
        return price_table_from(values, base=None)


def _model_to_dict(price: ModelPrice) -> dict:
    values = {_KIND_FILE_NAMES[kind]: str(rate) for kind, rate in price.rates.items()}
    if price.fast is not None:
        values["fast"] = str(price.fast)
    if price.long_prompt_over is not None and price.long_rates is not None:
        values["long-prompt-over"] = price.long_prompt_over
        values["long-prompt"] = {_KIND_FILE_NAMES[kind]: str(rate) for kind, rate in price.long_rates.items()}
    if not price.platform_multiplier:
        values["platform-multiplier"] = False
    return values


# -- reading a table ----------------------------------------------------------------


def _amount(where: str, value) -> Decimal:
    """A price or multiplier as written: a string (``"0.30"``), an integer or a
    TOML float (read as the decimal it was written as); zero or more."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError("%s must be a number such as \"0.30\"" % (where,))
    try:
        amount = Decimal(str(value).strip())
    except InvalidOperation:
        raise ValueError("%s must be a number such as \"0.30\"" % (where,))
    if not amount.is_finite() or amount < 0:
        raise ValueError("%s must be a number, zero or more" % (where,))
    return amount


def _rates(where: str, table: Mapping) -> dict[str, Decimal]:
    missing = [name for name in _FILE_NAMES if name not in table]
    if missing:
        raise ValueError(
            "%s needs every rate (%s): missing %s; no rate is guessed"
            % (where, ", ".join(_FILE_NAMES), ", ".join(missing))
        )
    return {kind: _amount("%s %s" % (where, name), table[name]) for name, kind in _FILE_NAMES.items()}


def _model_price(where: str, table) -> ModelPrice:
    if not isinstance(table, Mapping):
        raise ValueError("%s must be a table of rates (US dollars per million tokens)" % (where,))
    unknown = sorted(set(table) - set(_MODEL_KEYS))
    if unknown:
        raise ValueError("%s: unknown key %s (known: %s)" % (where, unknown[0], ", ".join(_MODEL_KEYS)))
    fast = _amount(where + " fast", table["fast"]) if "fast" in table else None
    over = table.get("long-prompt-over")
    long_table = table.get("long-prompt")
    if (over is None) != (long_table is None):
        raise ValueError("%s: long-prompt-over and long-prompt go together" % (where,))
    long_rates = None
    if over is not None:
        if isinstance(over, bool) or not isinstance(over, int) or over < 0:
            raise ValueError("%s long-prompt-over must be a whole number of tokens" % (where,))
        if not isinstance(long_table, Mapping):
            raise ValueError("%s long-prompt must be a table of rates" % (where,))
        long_rates = _rates(where + " long-prompt", long_table)
    by_platform = table.get("platform-multiplier", True)
    if not isinstance(by_platform, bool):
        raise ValueError("%s platform-multiplier must be true or false" % (where,))
    return ModelPrice(_rates(where, table), fast, over, long_rates, by_platform)


def _multipliers(where: str, table, default: dict[str, Decimal]) -> dict[str, Decimal]:
    if table is None:
        return dict(default)
    if not isinstance(table, Mapping):
        raise ValueError("%s must be a table of multipliers" % (where,))
    return {str(name): _amount("%s %s" % (where, name), value) for name, value in table.items()}


def price_table_from(values: Mapping, base: PriceTable | None = None) -> PriceTable:
    """
    A price table from the shape of a ``[prices]`` table: ``read-on``,
    ``web-search`` and ``web-fetch`` (US dollars per request),
    ``inference-geo`` and ``service-tier`` (multipliers by value, replacing
    the base's), ``platform`` (multipliers by platform, added to the base's
    or replacing those of the same key) and ``models.NAME`` (``input``,
    ``output``, ``cache-write-5m``, ``cache-write-1h``, ``cache-read`` in
    US dollars per million tokens; ``fast`` a multiplier;
    ``long-prompt-over`` with ``long-prompt``; ``platform-multiplier``
    ``false`` for a model whose price is the same on every platform).

    :param base: the table whose models and settings those given add to or
        replace (:data:`DEFAULT_PRICES` for a ``--config`` file); ``None``:
        only what is given.
    :raises ValueError: naming the key at fault.
    """
    if not isinstance(values, Mapping):
        raise ValueError("prices must be a table")
    unknown = sorted(set(values) - set(_TABLE_KEYS))
    if unknown:
        raise ValueError("unknown key %s (known: %s)" % (unknown[0], ", ".join(_TABLE_KEYS)))
    base = base if base is not None else PriceTable(models={})
    models_table = values.get("models", {})
    if not isinstance(models_table, Mapping):
        raise ValueError("models must be tables, one [prices.models.\"MODEL\"] each")
    models = {str(name): _model_price("models.%s" % (name,), table) for name, table in models_table.items()}
    changes: dict = {}
    for name, attribute in (("web-search", "web_search"), ("web-fetch", "web_fetch")):
        if name in values:
            changes[attribute] = _amount(name, values[name])
    if "inference-geo" in values:
        changes["inference_geo"] = _multipliers("inference-geo", values["inference-geo"], {})
    if "service-tier" in values:
        changes["service_tier"] = _multipliers("service-tier", values["service-tier"], {})
    if "platform" in values:
        # Merged: a file names the endpoints it prices otherwise, not every one.
        changes["platform"] = {**base.platform, **_multipliers("platform", values["platform"], {})}
    if "read-on" in values:
        if not isinstance(values["read-on"], str):
            raise ValueError("read-on must be a date such as \"2026-12-03\"")
        changes["read_on"] = values["read-on"]
    return base.with_models(models, **changes)


# -- the shipped table --------------------------------------------------------------


def _price(input: str, output: str, write_5m: str, write_1h: str, read: str, fast: str | None = None,
           long_over: int | None = None, long: tuple[str, str, str, str, str] | None = None,
           platform_multiplier: bool = True) -> ModelPrice:
    def rates(values):
        return dict(zip(PRICED_KINDS, (Decimal(v) for v in values)))

    return ModelPrice(
        rates((input, output, write_5m, write_1h, read)),
        None if fast is None else Decimal(fast),
        long_over,
        None if long is None else rates(long),
        platform_multiplier,
    )


#: When :data:`DEFAULT_PRICES` was read from Anthropic's pricing pages.
DEFAULT_PRICES_READ_ON = "2026-12-03"

_FABLE_5_2 = _price("8", "40", "10", "16", "0.20", fast="2")
_FABLE_5_1 = _price("10", "50", "12.50", "20", "0.25")
_FABLE_5 = _price("10", "50", "12.50", "20", "1")
_OPUS = _price("5", "25", "6.25", "10", "0.50")
_OPUS_FAST = _price("5", "25", "6.25", "10", "0.50", fast="2")
_SONNET_4_5 = _price("3", "15", "3.75", "6", "0.30")
# The models before Claude Sonnet 4.5 cost the same on every endpoint of
# Bedrock and Vertex (Anthropic's pricing page, "Regional endpoint pricing").
_OPUS_4 = _price("15", "75", "18.75", "30", "1.50", platform_multiplier=False)
_HAIKU_5_5 = _price("0.10", "0.50", "0.125", "0.20", "0.01",
                    long_over=100_000, long=("0.50", "2.50", "0.625", "1", "0.05"))

#: The price table the relay ships (US dollars per million tokens; web
#: search $10 per 1,000 requests, web fetch free; US-only inference 1.1x;
#: Bedrock's and Vertex's regional endpoints, Vertex's multi-regions too,
#: 1.1x their global ones for Claude Sonnet 4.5 and later; Foundry and
#: Claude Platform on AWS, on the ``anthropic`` wire, at Anthropic's rates).
#: Models it does not list (``claude-mythos-preview``, whose price was not
#: found published) are metered in tokens and flagged, never guessed; so are
#: Bedrock's ``priority``, ``flex`` and ``reserved`` tiers, whose price AWS
#: sets per model (a premium, a discount, a commitment).
DEFAULT_PRICES = PriceTable(
    models={
        "claude-fable-5-2": _FABLE_5_2,
        "claude-mythos-5-2": _FABLE_5_2,
        "claude-fable-5-1": _FABLE_5_1,
        "claude-mythos-5-1": _FABLE_5_1,
        "claude-fable-5": _FABLE_5,
        "claude-mythos-5": _FABLE_5,
        "claude-opus-5-5": _price("4", "20", "5", "8", "0.20", fast="2"),
        "claude-opus-5": _OPUS_FAST,
        "claude-opus-4-8": _OPUS_FAST,
        "claude-opus-4-7": _OPUS,
        "claude-opus-4-6": _OPUS,
        "claude-opus-4-5": _OPUS,
        "claude-opus-4-1": _OPUS_4,
        "claude-opus-4": _OPUS_4,
        "claude-sonnet-5-5": _price("2", "10", "2.50", "4", "0.10"),
        "claude-sonnet-5": _price("2", "10", "2.50", "4", "0.20"),
        "claude-sonnet-4-6": _SONNET_4_5,
        "claude-sonnet-4-5": _SONNET_4_5,
        "claude-sonnet-4": _price("3", "15", "3.75", "6", "0.30", platform_multiplier=False),
        "claude-haiku-5-5": _HAIKU_5_5,
        "claude-haiku-4-5": _price("1", "5", "1.25", "2", "0.10"),
        "claude-3-5-haiku": _price("0.80", "4", "1", "1.60", "0.08", platform_multiplier=False),
    },
    web_search=Decimal("0.01"),
    web_fetch=Decimal(0),
    inference_geo={"global": Decimal(1), "us": Decimal("1.1")},
    service_tier={"standard": Decimal(1), "bedrock:default": Decimal(1)},
    platform={
        "anthropic": Decimal(1),
        "bedrock:global": Decimal(1),
        "bedrock:regional": Decimal("1.1"),
        "vertex:global": Decimal(1),
        "vertex:regional": Decimal("1.1"),
    },
    read_on=DEFAULT_PRICES_READ_ON,
)
