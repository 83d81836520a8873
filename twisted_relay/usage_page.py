"""
The usage page: spend per relay key and per day, against each key's cap.

:func:`render_usage_page` turns figures already read from the ledger into
one HTML page with inline SVG charts: no script, no style sheet to fetch,
nothing to build. It is plain data in, bytes out: no Twisted, no I/O.

What a person reads at a glance, for each key: one bar for its spend in
the cap's current period against the cap (green, amber past 75 %, red past
95 %), and one small bar chart of its spend on each day of the range, with
the daily cap drawn across it when the cap is daily.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from html import escape

__all__ = ["Cap", "KeyUsage", "dollars", "render_usage_page"]

_CENT = Decimal("0.01")
# Past these shares of a cap the bar turns amber, then red (the thresholds
# Claude Code warns at).
_WARNING, _CRITICAL = Decimal("0.75"), Decimal("0.95")
_GREEN, _AMBER, _RED, _GREY = "#2e7d32", "#f9a825", "#c62828", "#9e9e9e"
_BAR = "#1565c0"

# The charts' sizes, in pixels.
_CAP_WIDTH, _CAP_HEIGHT = 260, 16
_DAY_WIDTH, _DAYS_HEIGHT = 9, 48


@dataclass(frozen=True, slots=True)
class Cap:
    """
    A spend cap and where a key stands against it.

    :ivar amount: the cap, in US dollars.
    :ivar period: ``daily``, ``weekly`` or ``monthly``.
    :ivar spent: what the key spent in the period now running, in dollars.
    :ivar scope: what the cap applies to: ``user`` (the key), ``workspace``
        (its group) or ``organization`` (the whole relay).
    """

    amount: Decimal
    period: str
    spent: Decimal
    scope: str = "user"

    @property
    def used(self) -> Decimal:
        """The share of the cap spent (1 or more: reached)."""
        if self.amount <= 0:
            return Decimal(1)
        return self.spent / self.amount


@dataclass(frozen=True, slots=True)
class KeyUsage:
    """
    One relay key's line on the page.

    :ivar name: the key's name (never the key).
    :ivar group: its group, if any.
    :ivar by_day: its spend in dollars on each day (``YYYY-MM-DD``, UTC).
    :ivar requests: requests metered in the range.
    :ivar tokens: tokens of every kind in the range.
    :ivar unpriced: requests whose model had no price (counted in tokens only).
    :ivar cap: the cap that binds the key, if any.
    """

    name: str
    group: str | None
    by_day: dict[str, Decimal] = field(default_factory=dict)
    requests: int = 0
    tokens: int = 0
    unpriced: int = 0
    cap: Cap | None = None

    @property
    def total(self) -> Decimal:
        """The key's spend over the whole range, in dollars."""
        return sum(self.by_day.values(), Decimal(0))


def dollars(amount: Decimal) -> str:
    """
    ``$1,234.57``: dollars to the cent, as the page shows them; a spend
    that rounds to no cent but is not nothing is ``<$0.01``.
    """
    rounded = amount.quantize(_CENT, rounding=ROUND_HALF_UP)
    if amount > 0 and not rounded:
        return "<$0.01"
    return "${:,.2f}".format(rounded)


def render_usage_page(keys: list[KeyUsage], days: list[str], *, generated: str) -> bytes:
    """
    The page for ``keys`` over ``days`` (oldest first), as UTF-8 HTML.
    ``generated`` says when the figures were read (shown, not parsed).
    """
    total = sum((key.total for key in keys), Decimal(0))
    first, last = (days[0], days[-1]) if days else ("", "")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>twisted-relay: usage</title>",
        "<style>%s</style>" % _STYLE,
        "</head><body>",
        "<h1>Spend by relay key</h1>",
        '<p class="range">%s to %s (UTC) &middot; total <strong id="total">%s</strong> &middot; read %s</p>'
        % (escape(first), escape(last), escape(dollars(total)), escape(generated)),
    ]
    if not keys:
        parts.append('<p id="empty">No metered request in this range.</p>')
    else:
        parts.append(_key_table(keys, days))
    parts.append(
        '<p class="note">Costs come from the relay\'s price table; a request to a model with no price is '
        "counted in tokens and shown as unpriced, never guessed.</p>"
    )
    parts.append("</body></html>")
    return "\n".join(parts).encode("utf-8")


def _key_table(keys: list[KeyUsage], days: list[str]) -> str:
    rows = [
        '<table id="keys"><thead><tr>',
        "<th>key</th><th>group</th><th>spend in range</th><th>requests</th><th>tokens</th>",
        "<th>unpriced</th><th>against its cap</th><th>each day</th>",
        "</tr></thead><tbody>",
    ]
    for key in sorted(keys, key=lambda k: (-k.total, k.name)):
        name = escape(key.name, quote=True)
        rows.append(
            '<tr data-key="%s">'
            '<td class="name">%s</td><td class="group">%s</td>'
            '<td class="spend num">%s</td><td class="requests num">%d</td><td class="tokens num">%s</td>'
            '<td class="unpriced num">%d</td><td class="cap">%s</td><td class="days">%s</td></tr>'
            % (
                name,
                name,
                escape(key.group or ""),
                escape(dollars(key.total)),
                key.requests,
                "{:,}".format(key.tokens),
                key.unpriced,
                _cap_cell(key.cap),
                _days_chart(key, days),
            )
        )
    rows.append("</tbody></table>")
    return "".join(rows)


def _cap_cell(cap: Cap | None) -> str:
    if cap is None:
        return '<span class="nocap">no cap</span>'
    used = cap.used
    colour = _RED if used >= _CRITICAL else _AMBER if used >= _WARNING else _GREEN
    filled = int(_CAP_WIDTH * min(used, Decimal(1)))
    percent = int((used * 100).to_integral_value(rounding=ROUND_HALF_UP))
    label = "%s of %s %s%s (%d%%)" % (
        escape(dollars(cap.spent)),
        escape(dollars(cap.amount)),
        escape(cap.period),
        "" if cap.scope == "user" else ", " + _SCOPE_NAMES.get(cap.scope, escape(cap.scope)),
        percent,
    )
    return (
        '<svg class="capbar" width="%d" height="%d" role="img" aria-label="%s">'
        '<rect width="%d" height="%d" fill="#eeeeee"/><rect width="%d" height="%d" fill="%s"/></svg>'
        '<div class="caplabel">%s</div>'
        % (_CAP_WIDTH, _CAP_HEIGHT, label, _CAP_WIDTH, _CAP_HEIGHT, filled, _CAP_HEIGHT, colour, label)
    )


_SCOPE_NAMES = {"workspace": "its group's cap", "organization": "the relay's cap"}


def _days_chart(key: KeyUsage, days: list[str]) -> str:
    """A bar a day; the daily cap as a dashed line when the cap is daily."""
    daily_cap = key.cap.amount if key.cap is not None and key.cap.period == "daily" else None
    top = max([key.by_day.get(day, Decimal(0)) for day in days] + [daily_cap or Decimal(0)])
    width = max(len(days), 1) * _DAY_WIDTH
    shapes = []
    for index, day in enumerate(days):
        spent = key.by_day.get(day, Decimal(0))
        if spent <= 0 or top <= 0:
            continue
        height = max(1, int(_DAYS_HEIGHT * spent / top))
        over = daily_cap is not None and spent >= daily_cap
        shapes.append(
            '<rect x="%d" y="%d" width="%d" height="%d" fill="%s"><title>%s: %s</title></rect>'
            % (
                index * _DAY_WIDTH,
                _DAYS_HEIGHT - height,
                _DAY_WIDTH - 2,
                height,
                _RED if over else _BAR,
                day,
                escape(dollars(spent)),
            )
        )
    if daily_cap is not None and top > 0:
        y = _DAYS_HEIGHT - int(_DAYS_HEIGHT * daily_cap / top)
        shapes.append(
            '<line x1="0" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-dasharray="3 2"><title>daily cap %s</title></line>'
            % (width, y, y, _GREY, escape(dollars(daily_cap)))
        )
    return '<svg class="daybars" width="%d" height="%d" role="img" aria-label="spend per day">%s</svg>' % (
        width,
        _DAYS_HEIGHT,
        "".join(shapes),
    )


_STYLE = (
    "body{font:14px system-ui,sans-serif;margin:24px;color:#212121}"
    "h1{font-size:20px;margin:0 0 4px}"
    ".range,.note{color:#616161}"
    "table{border-collapse:collapse;margin-top:16px}"
    "th,td{padding:6px 10px;border-bottom:1px solid #e0e0e0;text-align:left;vertical-align:middle}"
    ".num{text-align:right;font-variant-numeric:tabular-nums}"
    ".caplabel{font-size:12px;color:#424242}"
    ".nocap{color:#9e9e9e}"
)
