# -*- test-case-name: tests.test_spend_limits -*-
"""
Spend limits: caps on what a relay key (``user``), a group of keys
(``workspace``) or the whole relay (``organization``) may spend a day, an
ISO week or a month (UTC calendar), on the shapes of Anthropic's Admin API
(``client.beta.organization.spend_limits``), and the standing of a key
against its caps as the ``anthropic-ratelimit-unified-*`` headers Claude
Code reads (the gateway protocol's "Usage-limit headers").

Pure values and rules: windows, which cap binds, the headers and the
refusal. The database side is :mod:`twisted_relay.spend_limits_sql`, the
cache and the admin routes :mod:`twisted_relay.spend_guard`.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal

from twisted_relay.errors import RelayError
from twisted_relay.relay_keys import key_name_problem

__all__ = [
    "PERIODS",
    "SCOPE_TYPES",
    "SpendLimit",
    "Standing",
    "binding",
    "limit_body",
    "new_limit_id",
    "parse_set_body",
    "refusal",
    "standing_headers",
    "window_start",
    "window_end",
]

#: The periods a limit resets over (the SDK's ``BetaSpendLimitPeriod``).
PERIODS = ("daily", "weekly", "monthly")
#: The scope types the relay knows, and the field naming each one's subject.
SCOPE_TYPES = {"user": "user_id", "workspace": "workspace_id", "organization": None}
#: What the SDK knows and the relay does not: a 400 names them.
_FOREIGN_SCOPE_TYPES = ("organization_service", "rbac_group", "seat_tier", "usage_tier")
#: Utilization past which Claude Code warns, highest first (the gateway's).
_THRESHOLDS = (0.95, 0.75)
_CENTS = re.compile(r"\A[0-9]{1,15}\Z")
_PREFIX = "anthropic-ratelimit-unified-"


@dataclass(frozen=True)
class SpendLimit:
    """
    One cap: ``amount`` cents (``None``: an explicit "no limit") on the
    spend of one scope per ``period``.

    :ivar scope_id: the key name (``user``), the group (``workspace``), or
        ``""`` (``organization``).
    """

    id: str
    scope_type: str
    scope_id: str
    period: str
    amount: int | None
    created_at: float
    updated_at: float

    def applies_to(self, key_name: str | None, key_group: str | None) -> bool:
        """Whether this limit caps a request made with that key."""
        if self.scope_type == "organization":
            return True
        if self.scope_type == "user":
            return key_name is not None and key_name == self.scope_id
        return key_group is not None and key_group == self.scope_id


@dataclass(frozen=True)
class Standing:
    """Where a key stands against one cap now."""

    limit: SpendLimit
    spent_cents: Decimal
    resets_at: float

    @property
    def exceeded(self) -> bool:
        return self.spent_cents >= self.limit.amount

    @property
    def utilization(self) -> float:
        return float(self.spent_cents / self.limit.amount) if self.limit.amount > 0 else 1.0

    def shown_utilization(self) -> float:
        """
        Two decimals, kept below 1 while the cap still allows requests, and
        1 once it refuses them (the gateway protocol's 429 says ``1``).
        """
        value = round(self.utilization * 100) / 100
        return 1.0 if self.exceeded else min(value, 0.99)


def new_limit_id() -> str:
    """A fresh ``spl_...`` id."""
    return "spl_" + secrets.token_hex(12)


def window_start(period: str, now: float) -> float:
    """When the window of ``period`` holding ``now`` (Unix time) began: UTC day, ISO week (Monday), month."""
    day = datetime.fromtimestamp(now, timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "weekly":
        day -= timedelta(days=day.weekday())
    elif period == "monthly":
        day = day.replace(day=1)
    return day.timestamp()


def window_end(period: str, now: float) -> float:
    """When the window of ``period`` holding ``now`` ends (its cap resets)."""
    start = datetime.fromtimestamp(window_start(period, now), timezone.utc)
    if period == "daily":
        end = start + timedelta(days=1)
    elif period == "weekly":
        end = start + timedelta(days=7)
    else:
        end = (start.replace(day=28) + timedelta(days=4)).replace(day=1)
    return end.timestamp()


def binding(standings: list[Standing]) -> Standing | None:
    """
    The cap that describes a key (the gateway's choice): one exceeded
    before one not; among exceeded ones the one that resets last; else the
    fullest.
    """
    chosen = None
    for standing in standings:
        if chosen is None:
            chosen = standing
        elif chosen.exceeded != standing.exceeded:
            chosen = chosen if chosen.exceeded else standing
        elif chosen.exceeded:
            chosen = chosen if chosen.resets_at > standing.resets_at else standing
        else:
            chosen = chosen if chosen.utilization > standing.utilization else standing
    return chosen


def standing_headers(standing: Standing) -> list[tuple[bytes, bytes]]:
    """The ``anthropic-ratelimit-unified-*`` headers of an answer to a key with a cap."""
    reset = str(int(standing.resets_at))
    if standing.exceeded:
        surpassed, status = "1", "rejected"
    else:
        surpassed = next((str(t) for t in _THRESHOLDS if standing.utilization > t), None)
        status = "allowed_warning" if surpassed else "allowed"
    headers = [
        ("status", status),
        ("reset", reset),
        ("overage-reset", reset),
        ("overage-utilization", _number(standing.shown_utilization())),
    ]
    if surpassed:
        headers.append(("overage-surpassed-threshold", surpassed))
    if standing.exceeded:
        headers.append(("overage-period", standing.limit.period))
        headers.append(("overage-disabled-reason", "org_spend_cap_reached"))
        if standing.limit.scope_type == "workspace":
            headers.append(("overage-scope", "group_pool"))
    else:
        headers.append(("representative-claim", "overage"))
        headers.append(("overage-status", status))
    return [((_PREFIX + name).encode("ascii"), value.encode("ascii")) for name, value in headers]


def refusal(standing: Standing, now: float) -> tuple[RelayError, list[tuple[bytes, bytes]]]:
    """The 429 ``billing_error`` for a key at its cap, and its headers (``retry-after`` among them)."""
    resets = datetime.fromtimestamp(standing.resets_at, timezone.utc)
    what = {"user": "your", "workspace": "your group's", "organization": "the relay's"}[standing.limit.scope_type]
    message = "spend limit reached \u00b7 resets %s %d \u00b7 %s %s spend limit is $%s; ask the relay's admin to raise it." % (
        resets.strftime("%b"),
        resets.day,
        what,
        standing.limit.period,
        _dollars(standing.limit.amount),
    )
    error = RelayError(429, message, error_type="billing_error", kind="spend_limit", should_retry=False)
    retry_after = max(1, int(standing.resets_at - now + 0.999))
    return error, [(b"retry-after", b"%d" % (retry_after,)), *standing_headers(standing)]


def parse_set_body(body) -> tuple[str, str, str, int | None]:
    """
    ``(scope_type, scope_id, period, amount)`` from the body of
    ``POST /v1/organizations/spend_limits``, or a 400 :class:`RelayError`.
    """
    if not isinstance(body, dict):
        raise RelayError(400, "The body must be a JSON object.")
    scope = body.get("scope")
    if not isinstance(scope, dict) or not isinstance(scope.get("type"), str):
        raise RelayError(400, "scope: an object with a type (user, workspace or organization).")
    scope_type, scope_id = scope_of(scope)
    period = body.get("period", "monthly")
    if period not in PERIODS:
        raise RelayError(400, "period: one of %s." % (", ".join(PERIODS),))
    if "amount" not in body:
        raise RelayError(400, "amount: a decimal string of cents, or null for no limit.")
    amount = body["amount"]
    if amount is not None:
        if not isinstance(amount, str) or not _CENTS.match(amount):
            raise RelayError(400, "amount: a non-negative whole number of cents as a string (\"50000\" is $500.00), or null.")
        amount = int(amount)
    return scope_type, scope_id, period, amount


def scope_of(scope: dict) -> tuple[str, str]:
    """``(scope_type, scope_id)`` of a scope object, or a 400."""
    scope_type = scope.get("type")
    check_scope_type(scope_type)
    field = SCOPE_TYPES[scope_type]
    if field is None:
        return scope_type, ""
    subject = scope.get(field)
    problem = key_name_problem(subject)
    if problem is not None:
        # (Such a name could not match a key's; a NUL in it PostgreSQL refuses.)
        raise RelayError(400, "scope.%s: the %s's name %s." % (field, "relay key" if scope_type == "user" else "group", problem))
    return scope_type, subject


def check_scope_type(scope_type) -> None:
    """A 400 for a scope type the relay does not know."""
    if scope_type not in SCOPE_TYPES:
        known = ", ".join(SCOPE_TYPES)
        if scope_type in _FOREIGN_SCOPE_TYPES:
            raise RelayError(400, "scope type %s does not apply to this relay (it knows %s)." % (scope_type, known))
        raise RelayError(400, "Unknown scope type %r (known: %s)." % (scope_type, known))


def limit_body(limit: SpendLimit) -> dict:
    """A limit as the SDK's ``BetaSpendLimit``."""
    scope: dict = {"type": limit.scope_type}
    field = SCOPE_TYPES[limit.scope_type]
    if field is not None:
        scope[field] = limit.scope_id
    return {
        "type": "spend_limit",
        "id": limit.id,
        "scope": scope,
        "period": limit.period,
        "amount": None if limit.amount is None else str(limit.amount),
        "currency": "USD",
        "is_enabled": True,
        "created_at": _rfc3339(limit.created_at),
        "updated_at": _rfc3339(limit.updated_at),
    }


def _rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).isoformat().replace("+00:00", "Z")


def _number(value: float) -> str:
    text = "%.2f" % (value,)
    return text.rstrip("0").rstrip(".") if "." in text else text


def _dollars(cents: int) -> str:
    return "%d.%02d" % divmod(cents, 100)
