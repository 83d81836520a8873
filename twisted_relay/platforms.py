# -*- test-case-name: tests.test_platforms -*-
"""
Where an answer was served, as its usage record and its price say it: the
*platform*, a short text made from the upstream's wire, its region and the
platform's model id the attempt sent:

- ``anthropic``: the ``anthropic`` wire (Anthropic's API, and the surfaces
  that speak it and bill Anthropic's rates: Microsoft Foundry, Claude
  Platform on AWS); but Bedrock's own surfaces on that wire (its Messages
  API, Mantle: an AWS login signing for ``bedrock`` or ``bedrock-mantle``,
  or a Bedrock API key) are Bedrock's, as below;
- ``bedrock:global``: Bedrock with a ``global.`` inference profile;
  ``bedrock:us``, ``bedrock:eu``, ``bedrock:apac``...: a geographic
  profile (``us.``, ``eu.``, ``apac.``...); ``bedrock:us-east-1``: a base
  model id (or an ARN) in the upstream's region (the ARN's own region);
- ``vertex:global``, ``vertex:us``, ``vertex:eu``, ``vertex:us-east5``:
  Vertex AI at its location (the upstream's ``region``, ``global`` when
  none).

A platform's endpoint is *global* (``bedrock:global``, ``vertex:global``)
or *regional* (every other Bedrock and Vertex endpoint, Vertex's
multi-regions ``us`` and ``eu`` too): the price table's platform
multipliers are looked up by the platform, then by its wire and class
(``bedrock:regional``), then by its wire (:func:`price_keys`).

The service tier that prices a Bedrock answer is Bedrock's own
(:func:`platform_tier`): the one its ``X-Amzn-Bedrock-Service-Tier``
response header says it applied, else the one the upstream asked for.

Pure: no Twisted.
"""

from __future__ import annotations

import re

__all__ = ["BEDROCK_TIER_HEADER", "GLOBAL", "REGIONAL", "platform_of", "platform_tier", "price_keys"]

#: The endpoint of a platform whose requests may be served anywhere.
GLOBAL = "global"
#: The class of every other cloud endpoint (a region, a geography, a multi-region).
REGIONAL = "regional"
#: The response header in which Bedrock says which service tier served a request.
BEDROCK_TIER_HEADER = b"x-amzn-bedrock-service-tier"

# A Bedrock inference profile's geography: ``global``, ``us``, ``eu``,
# ``apac``, ``jp``, ``au``, ``us-gov``... (a model id's first dotted part,
# when a provider and a model follow it).
_GEOGRAPHY = re.compile(r"^[a-z]{2,8}(?:-[a-z]{2,8})?$")
# A cloud region or location as the configuration takes it.
_REGION = re.compile(r"^[a-z0-9-]{2,32}$")
# The signing names of Bedrock's own Anthropic-shaped surfaces.
_BEDROCK_SERVICES = ("bedrock", "bedrock-mantle")
_ARN = re.compile(r"^arn:aws[a-z-]*:bedrock:([a-z0-9-]*):\d*:([a-z-]+)/(.+)$")


def platform_of(wire: str, region: str | None, model: str | None, login=None) -> str:
    """
    The platform of an answer an upstream of ``wire`` in ``region``, logged
    in to with ``login`` (a :class:`~twisted_relay.config.LoginSpec`, or
    ``None``), served for the platform's model id ``model`` (the attempt's,
    after the upstream's model map).
    """
    if wire == "bedrock" or (wire == "anthropic" and _bedrock_login(login)):
        return "bedrock:" + _bedrock_endpoint(model or "", region)
    if wire == "vertex":
        return "vertex:" + _region(region, GLOBAL)
    return wire


def _bedrock_login(login) -> bool:
    """A login to Bedrock's own surfaces (not to Claude Platform on AWS, which signs as ``aws-external-anthropic``)."""
    if login is None:
        return False
    if login.kind == "bedrock-api-key":
        return True
    return login.kind == "aws" and login.option("service", "bedrock") in _BEDROCK_SERVICES


def _region(region: str | None, default: str) -> str:
    return region if region is not None and _REGION.match(region) else default


def _bedrock_endpoint(model: str, region: str | None) -> str:
    """``global``, a profile's geography, or the region a base id or an ARN is called in."""
    arn = _ARN.match(model)
    if arn is not None:
        arn_region, kind, rest = arn.groups()
        if kind != "inference-profile":
            # A foundation model, a provisioned model, or an application
            # inference profile (whose source profile the id does not say).
            return _region(arn_region or region, REGIONAL)
        model = rest
    geography, dot, rest = model.partition(".")
    # ``us.anthropic.claude-...``: a geography, then the provider's base id.
    if dot and "." in rest.split(":", 1)[0] and _GEOGRAPHY.match(geography):
        return geography
    return _region(region, REGIONAL)


def price_keys(platform: str | None) -> tuple[str, ...]:
    """
    The keys of the price table's platform multipliers that may price
    ``platform``, most particular first: ``bedrock:us-east-1``, then
    ``bedrock:regional``, then ``bedrock``.
    """
    if not platform:
        return ("anthropic",)
    wire, colon, endpoint = platform.partition(":")
    if not colon:
        return (platform,)
    endpoint_class = "%s:%s" % (wire, GLOBAL if endpoint == GLOBAL else REGIONAL)
    if endpoint_class == platform:
        return (platform, wire)
    return (platform, endpoint_class, wire)


def platform_tier(wire: str, asked: str | None, reported: str | None) -> str | None:
    """
    The service tier that prices an answer when the platform sets it, not
    the answer's ``usage`` (``None``: the usage's ``service_tier`` does):
    on Bedrock, ``bedrock:`` and the tier it reported applying (``reported``,
    its ``X-Amzn-Bedrock-Service-Tier`` response header), else the one the
    upstream asked for (``asked``, its ``service_tier`` setting).
    """
    if wire != "bedrock":
        return None
    tier = (reported or "").strip().lower() or asked
    return "bedrock:" + tier if tier else None
