# -*- test-case-name: tests.test_ledger_report -*-
"""
``twisted-relay-usage``: usage and cost from the ledger, by key, group,
model, session, agent, upstream or day, as a table, CSV or JSON.

::

    twisted-relay-usage --usage-db usage.sqlite --by key,model --since 7d
    twisted-relay-usage --usage-db postgresql://relay@db/relay --by day --format csv

It reads the database the relays write (``--usage-db``, or
``$TWISTED_RELAY_USAGE_DB``, which keeps a password out of the process list)
and writes nothing. Times are UTC; ``--until`` is excluded.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
import time
from datetime import datetime, timezone
from decimal import Decimal
from typing import IO

from twisted_relay.ledger_sql import GROUPINGS, LedgerError, Totals, open_ledger
from twisted_relay.usage import TOKEN_KINDS

__all__ = ["main", "parse_time"]

#: Where the database is named when ``--usage-db`` is not given.
USAGE_DB_VARIABLE = "TWISTED_RELAY_USAGE_DB"
_DEFAULT_DB = "usage.sqlite"
_FORMATS = ("table", "csv", "json")
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# The table's short headings of the token kinds.
_SHORT = {
    "input_tokens": "input",
    "output_tokens": "output",
    "cache_creation_5m_tokens": "cache_write_5m",
    "cache_creation_1h_tokens": "cache_write_1h",
    "cache_read_tokens": "cache_read",
    "web_search_requests": "web_searches",
    "web_fetch_requests": "web_fetches",
}


def parse_time(text: str, now: float | None = None) -> float:
    """
    A ``--since``/``--until`` value as Unix time: an ISO date or date and
    time (UTC unless it gives an offset: ``2026-12-01``,
    ``2026-12-01T09:30``, ``2026-12-01T09:30+01:00``), or a time ago
    (``90m``, ``24h``, ``7d``, ``2w``).

    :raises ValueError: for anything else.
    """
    text = text.strip()
    relative = _RELATIVE.match(text)
    if relative:
        now = time.time() if now is None else now
        moment = now - float(relative.group(1)) * _UNITS[relative.group(2)]
        try:
            datetime.fromtimestamp(moment, timezone.utc)
        except (OverflowError, OSError, ValueError):
            raise ValueError("%r reaches back past any date" % (text,)) from None
        return moment
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError("%r is not a date (2026-12-01), a date and time (2026-12-01T09:30) or a time ago (7d)" % (text,))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _time_argument(text: str) -> float:
    try:
        return parse_time(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def _groupings(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in GROUPINGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            "cannot add up by %r (known: %s)" % (",".join(unknown) or text, ", ".join(GROUPINGS))
        )
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="twisted-relay-usage",
        description="Usage and cost of relayed requests, from twisted-relay's usage ledger (docs/usage.md).",
    )
    parser.add_argument(
        "--usage-db",
        default=None,
        help="the ledger: an SQLite file or a postgresql:// URL, as the relays' --usage-db "
        "(default: $%s, else %s)" % (USAGE_DB_VARIABLE, _DEFAULT_DB),
    )
    parser.add_argument(
        "--by",
        type=_groupings,
        action="append",
        help="add up by these, in order, comma-separated or repeated: %s (default: key)" % (", ".join(GROUPINGS),),
    )
    parser.add_argument("--since", type=_time_argument, help="from this time (2026-12-01, 2026-12-01T09:30, 7d ago...)")
    parser.add_argument("--until", type=_time_argument, help="up to this time, excluded")
    parser.add_argument("--key", help="only the requests of this relay key name")
    parser.add_argument("--group", help="only the requests of this key group")
    parser.add_argument("--format", choices=_FORMATS, default="table", help="table (default), csv or json")
    return parser


def main(argv: list[str] | None = None, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    """
    Run the command line; returns the exit status (2 when the ledger cannot
    be read, with one line on ``stderr``).
    """
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    options = _parser().parse_args(argv)
    by = [name for names in (options.by or [["key"]]) for name in names]
    target = options.usage_db or os.environ.get(USAGE_DB_VARIABLE) or _DEFAULT_DB
    try:
        database = open_ledger(target, create=False)
        try:
            database.open()
            rows = database.totals(
                by, since=options.since, until=options.until, key_name=options.key, key_group=options.group
            )
        finally:
            database.close()
    except LedgerError as e:
        print("twisted-relay-usage: %s" % (e,), file=err)
        return 2
    write = {"table": _table, "csv": _csv, "json": _json}[options.format]
    write(out, by, rows, options)
    return 0


def _total(rows: list[Totals]) -> Totals:
    return Totals(
        group={},
        requests=sum(r.requests for r in rows),
        tokens={kind: sum(r.tokens[kind] for r in rows) for kind in TOKEN_KINDS},
        cost=sum((r.cost for r in rows), Decimal(0)),
        unpriced=sum(r.unpriced for r in rows),
        partial=sum(r.partial for r in rows),
        first=min((r.first for r in rows if r.first is not None), default=None),
        last=max((r.last for r in rows if r.last is not None), default=None),
    )


def _iso(at: float | None) -> str | None:
    if at is None:
        return None
    return datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _table(out: IO[str], by: list[str], rows: list[Totals], options) -> None:
    headings = by + ["requests"] + [_SHORT[kind] for kind in TOKEN_KINDS] + ["cost_usd", "unpriced", "partial"]

    def cells(row: Totals, names: list[str]) -> list[str]:
        return (
            names
            + ["{:,}".format(row.requests)]
            + ["{:,}".format(row.tokens[kind]) for kind in TOKEN_KINDS]
            + ["{:,.6f}".format(row.cost), str(row.unpriced), str(row.partial)]
        )

    lines = [cells(row, [_shown(row.group[name], name) for name in by]) for row in rows]
    if not lines:
        out.write("No requests in the ledger%s.\n" % (_range(options),))
        return
    if len(lines) > 1 or not by:
        lines.append(cells(_total(rows), ["total"] + [""] * (len(by) - 1)) if by else cells(_total(rows), []))
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headings)]
    text_columns = len(by)

    def render(values: list[str]) -> str:
        return "  ".join(
            value.ljust(width) if i < text_columns else value.rjust(width) for i, (value, width) in enumerate(zip(values, widths))
        ).rstrip()

    out.write(render(headings) + "\n")
    for position, line in enumerate(lines):
        if position == len(rows) and position:
            out.write(render(["-" * w for w in widths]) + "\n")
        out.write(render(line) + "\n")
    unpriced = sum(r.unpriced for r in rows)
    if unpriced:
        out.write(
            "(%d %s of models without a price: counted in tokens, not in cost_usd.)\n"
            % (unpriced, "request" if unpriced == 1 else "requests")
        )


def _shown(value, name: str) -> str:
    if value is None:
        return "(no %s)" % (name,)
    return str(value)


def _range(options) -> str:
    parts = []
    if options.since is not None:
        parts.append(" since %s" % (_iso(options.since),))
    if options.until is not None:
        parts.append(" until %s" % (_iso(options.until),))
    return "".join(parts)


def _csv(out: IO[str], by: list[str], rows: list[Totals], options) -> None:
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(by + ["requests", *TOKEN_KINDS, "cost_usd", "unpriced", "partial", "first", "last"])
    for row in rows:
        writer.writerow(
            [row.group[name] if row.group[name] is not None else "" for name in by]
            + [row.requests, *(row.tokens[kind] for kind in TOKEN_KINDS), format(row.cost, "f"), row.unpriced, row.partial,
               _iso(row.first), _iso(row.last)]
        )


def _json(out: IO[str], by: list[str], rows: list[Totals], options) -> None:
    def shaped(row: Totals) -> dict:
        return {
            **{name: row.group.get(name) for name in by},
            "requests": row.requests,
            "tokens": dict(row.tokens),
            # A string: the exact decimal, which a JSON number may not keep.
            "cost_usd": format(row.cost, "f"),
            "unpriced": row.unpriced,
            "partial": row.partial,
            "first": _iso(row.first),
            "last": _iso(row.last),
        }

    document = {
        "by": by,
        "since": _iso(options.since),
        "until": _iso(options.until),
        "key": options.key,
        "group": options.group,
        "rows": [shaped(row) for row in rows],
        "total": {k: v for k, v in shaped(_total(rows)).items() if k not in by},
    }
    out.write(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
