# -*- test-case-name: tests.test_metering -*-
"""
Metering: what one answer used, from what the upstream reported.

An :class:`AnswerMeter` follows one Messages answer: a stream's
``message_start`` (the input side) and each ``message_delta`` (cumulative
counts: the last one is the total), or a whole body's ``usage``. It never
reads ``count_tokens``. :meth:`AnswerMeter.record` makes the answer's
:class:`~twisted_relay.usage.UsageRecord`: its tokens by kind
(:data:`~twisted_relay.usage.TOKEN_KINDS`) and its cost by the price table
(:mod:`twisted_relay.prices`).

The rules (``docs/usage.md``):

- A stream's usage is ``message_start``'s ``usage`` with each
  ``message_delta``'s ``usage`` laid over it, field by field, a null field
  leaving the count before it, as the SDKs do; a stream that ended early
  keeps what was reported by then.
- Cache writes are split by lifetime: the 1-hour ones are
  ``cache_creation.ephemeral_1h_input_tokens``, the rest of
  ``cache_creation_input_tokens`` are 5-minute ones (a write the upstream
  does not split counts as a 5-minute write).
- When the usage holds ``iterations`` (each sampling of the answer: tool
  loop turns, a compaction, an advisor's sub-inference, the attempt a
  fallback served), they are the bill: the tokens are their sum (a
  ``compaction`` entry's tokens are outside the top-level fields), each
  priced at its own ``model`` (the answer's model when it names none).
  Otherwise the top-level fields are.
- Server tool requests come from the top-level ``server_tool_use``.
- The platform that served the answer prices it too (a regional endpoint
  of Bedrock or Vertex costs more than a global one), and on Bedrock the
  service tier is the platform's (:mod:`twisted_relay.platforms`).

Pure: no Twisted.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Mapping

import ujson

from twisted_relay.logs import bounded
from twisted_relay.prices import PRICED_KINDS, PriceTable
from twisted_relay.usage import TOKEN_KINDS, UsageRecord, storable_text

__all__ = ["AnswerMeter", "counted", "parts_of", "tokens_of"]


# More than any answer uses: a larger count is taken as this, which keeps
# the ledger's 64-bit token columns in range (a cost past its column, from
# many such iterations, is stored as the column's most: ledger_sql).
_MOST = 2**32


def _count(value: Any) -> int:
    """A token count as reported: a whole number, zero or more (at most :data:`_MOST`); anything else is 0."""
    return min(value, _MOST) if type(value) is int and value > 0 else 0


def counted(usage: dict) -> dict[str, int]:
    """The token counts of one usage object (the top level, or one iteration), by kind of :data:`PRICED_KINDS`."""
    split = usage.get("cache_creation")
    one_hour = five_minutes = 0
    # dict, not Mapping: these are parsed JSON, and an ABC's check costs
    # more than the rest of the line (once an answer, on the reactor).
    if isinstance(split, dict):
        one_hour = _count(split.get("ephemeral_1h_input_tokens"))
        five_minutes = _count(split.get("ephemeral_5m_input_tokens"))
    if usage.get("cache_creation_input_tokens") is not None:
        written = _count(usage["cache_creation_input_tokens"])
    else:
        written = one_hour + five_minutes
    one_hour = min(one_hour, written)
    return {
        "input_tokens": _count(usage.get("input_tokens")),
        "output_tokens": _count(usage.get("output_tokens")),
        "cache_creation_5m_tokens": written - one_hour,
        "cache_creation_1h_tokens": one_hour,
        "cache_read_tokens": _count(usage.get("cache_read_input_tokens")),
    }


def parts_of(usage: dict, model: str | None) -> list[tuple[str | None, dict[str, int]]]:
    """
    The samplings ``usage`` bills, as ``(model, tokens)`` pairs: its
    ``iterations`` when it has them (each at its own model, or ``model``),
    else the top level at ``model``.
    """
    iterations = usage.get("iterations")
    if isinstance(iterations, list):
        parts = [
            (entry["model"] if isinstance(entry.get("model"), str) else model, counted(entry))
            for entry in iterations
            if isinstance(entry, dict)
        ]
        if parts:
            return parts
    return [(model, counted(usage))]


def tokens_of(usage: dict, parts: list[tuple[str | None, dict[str, int]]]) -> dict[str, int]:
    """Every kind of :data:`~twisted_relay.usage.TOKEN_KINDS` an answer used: its parts' tokens summed, and its server tool requests."""
    tokens = dict.fromkeys(TOKEN_KINDS, 0)
    for _, part in parts:
        for kind in PRICED_KINDS:
            tokens[kind] += part[kind]
    tools = usage.get("server_tool_use")
    if isinstance(tools, dict):
        tokens["web_search_requests"] = _count(tools.get("web_search_requests"))
        tokens["web_fetch_requests"] = _count(tools.get("web_fetch_requests"))
    return tokens


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _model_name(model: str) -> str:
    """A model name fit for a record, a label and a log line: bounded, a NUL
    or a lone surrogate (which a client or upstream may send) escaped."""
    return storable_text(bounded(model))


class AnswerMeter:
    """
    What one answer used, as the upstream reported it.

    Feed it a stream's ``message_start`` and ``message_delta`` payloads, or
    a whole answer; then :meth:`record`.

    :param prices: the price table.
    :param requested_model: the model the request was sent for, in case the
        answer names none.
    :ivar usage: the usage reported so far (a stream's fields merged).
    :ivar model: the model the answer names, if it named one.
    :ivar final: a stream's ``message_delta`` (or a whole answer's usage)
        was seen.
    """

    def __init__(self, prices: PriceTable, requested_model: str | None = None):
        self._prices = prices
        self._requested_model = requested_model
        self.usage: dict = {}
        self.model: str | None = None
        self.final = False

    def message_start(self, payload: Any) -> None:
        """A stream's ``message_start`` payload: the answer's model and its first usage."""
        message = payload.get("message") if isinstance(payload, dict) else None
        if isinstance(message, dict):
            self._take(message)

    def message_delta(self, payload: Any) -> None:
        """A stream's ``message_delta`` payload: cumulative counts laid over those reported before."""
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if isinstance(usage, dict):
            # A null is "not reported here", as the SDKs read it (a proxy built
            # on their types sends every field): the count before it stands.
            self.usage.update({name: value for name, value in usage.items() if value is not None})
            self.final = True

    def whole(self, message: Any) -> None:
        """A whole answer, parsed (or its bytes)."""
        if isinstance(message, (bytes, str)):
            try:
                message = ujson.loads(message)
            except (ValueError, OverflowError):
                return
        if isinstance(message, dict):
            self._take(message)
            self.final = "usage" in message

    def _take(self, message: dict) -> None:
        model = _text(message.get("model"))
        if model:
            self.model = model
        usage = message.get("usage")
        if isinstance(usage, dict):
            self.usage.update(usage)

    @property
    def served_model(self) -> str:
        """The model that served the answer: as the answer names it, else the requested one."""
        return self.model or self._requested_model or ""

    def cost(
        self, platform: str | None = None, platform_tier: str | None = None
    ) -> tuple[dict[str, int], Decimal | None]:
        """
        The answer's tokens by kind, and its cost (``None``: not priced).

        :param platform: where it was served (``None``: no platform multiplier).
        :param platform_tier: the service tier the platform set
            (:func:`~twisted_relay.platforms.platform_tier`), in place of
            the usage's ``service_tier``.
        """
        usage, model = self.usage, self.served_model
        parts = parts_of(usage, model)
        tokens = tokens_of(usage, parts)
        cost = self._prices.cost(
            parts,
            web_search_requests=tokens["web_search_requests"],
            web_fetch_requests=tokens["web_fetch_requests"],
            speed=_text(usage.get("speed")),
            inference_geo=_text(usage.get("inference_geo")),
            service_tier=platform_tier or _text(usage.get("service_tier")),
            platform=platform,
        )
        return tokens, cost

    def record(
        self,
        *,
        at: float,
        request_id: str,
        relay_key: Any,
        attribution: Mapping[str, str] | None,
        upstream: str,
        status: int,
        stream: bool,
        partial: bool,
        platform: str = "anthropic",
        platform_tier: str | None = None,
    ) -> UsageRecord:
        """
        The answer's :class:`~twisted_relay.usage.UsageRecord`.

        :param relay_key: the :class:`~twisted_relay.config.RelayKey` the
            request presented, or ``None``.
        :param attribution: Claude Code's attribution headers, by name.
        :param platform: where the upstream served it
            (:func:`~twisted_relay.platforms.platform_of`).
        :param platform_tier: the service tier the platform set, which
            prices the answer in place of the usage's ``service_tier``
            (:func:`~twisted_relay.platforms.platform_tier`).
        """
        tokens, cost = self.cost(platform, platform_tier)
        attribution = attribution or {}
        return UsageRecord(
            at=at,
            request_id=request_id,
            key_name=None if relay_key is None else relay_key.name,
            key_group=None if relay_key is None else relay_key.group,
            session_id=attribution.get("x-claude-code-session-id"),
            agent_id=attribution.get("x-claude-code-agent-id"),
            parent_agent_id=attribution.get("x-claude-code-parent-agent-id"),
            upstream=upstream,
            model=_model_name(self.served_model),
            status=status,
            stream=stream,
            partial=partial,
            tokens=tokens,
            cost=cost,
            # ASCII: whatever the upstream sent, the text is UTF-8 (a lone surrogate escaped).
            usage=ujson.dumps(self.usage, escape_forward_slashes=False) if self.usage else "",
            platform=storable_text(bounded(platform)),
        )
