"""
What the spend check costs, in process: the request path's look at the caps
of a capped key far from its cap (what ``RelayedRequest._check_spend`` asks
the guard, and the answer's usage record), and one share transaction near a
cap on a ledger holding many rows in the cap's window (SQLite; PostgreSQL
too with ``--postgres URL``).

Usage, from the work tree's root::

    python bench/spend_check.py
    python bench/spend_check.py --postgres postgresql://relay:...@127.0.0.1/relay --rows 200000
    PYTHONPATH=../other-tree python bench/spend_check.py --requests-only    # another tree's guard

A tree whose guard has no ``admit`` (before spend shares) is timed through
``standing``, what its request path asked. It is not a test and is not run by CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from decimal import Decimal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)

from twisted.internet import reactor  # noqa: E402
from twisted.internet.defer import ensureDeferred  # noqa: E402

from tests.ledger_records import usage_record  # noqa: E402
from twisted_relay.ledger import Ledger  # noqa: E402
from twisted_relay.ledger_sql import describe_database, open_ledger  # noqa: E402
from twisted_relay.spend_guard import SpendGuard  # noqa: E402
from twisted_relay.spend_limits_sql import set_limit  # noqa: E402


async def request_path(target: str, requests: int, rounds: int) -> list[float]:
    """Microseconds a request, per round: ``uncapped()``, the check, and its usage record, far from a $1,000 cap."""
    ledger = Ledger(open_ledger(target), reactor=reactor, flush_interval=0.2)
    ledger.startService()
    guard = SpendGuard(ledger, reactor=reactor)
    guard.know(await ledger.on_database(set_limit, "user", "alice", "monthly", 100_000))
    check = getattr(guard, "admit", guard.standing)
    await ensureDeferred(check("alice", "team-a"))
    now = time.time()
    records = [usage_record(n, at=now, key_name="alice", key_group="team-a", cost=Decimal("0.000010"),
                            request_id="rly_bench_%08d" % (n,)) for n in range(requests * rounds)]
    rounds_us = []
    for round_ in range(rounds):
        started = time.perf_counter()
        for record in records[round_ * requests:(round_ + 1) * requests]:
            if not guard.uncapped():
                d = ensureDeferred(check("alice", "team-a"))
                if not d.called:
                    await d  # (a share taken ahead of need, or a read: rare)
            ledger.record(record)
        rounds_us.append((time.perf_counter() - started) / requests * 1e6)
        await ledger.flush()
    await ledger.stopService()
    return rounds_us


async def share_transaction(target: str, rows: int, takes: int) -> list[float]:
    """Milliseconds a share transaction takes near a cap, over ``rows`` rows of the cap's scope in its window."""
    from twisted_relay.spend_limits import window_end, window_start
    from twisted_relay.spend_shares_sql import ShareAsked, take_shares

    ledger = Ledger(open_ledger(target), reactor=reactor, flush_interval=60)
    ledger.startService()
    now = time.time()
    start = window_start("monthly", now)
    for first in range(0, rows, 5000):
        batch = [usage_record(n, at=start + (n % 86400), key_name="alice", key_group="team-a", cost=Decimal("0.01"),
                              request_id="rly_fill_%09d" % (n,)) for n in range(first, min(rows, first + 5000))]
        await ledger.on_database(lambda database, batch=batch: database.write(batch))
    limits = [await ledger.on_database(set_limit, scope, scope_id, "monthly", rows * 10)
              for scope, scope_id in (("user", "alice"), ("organization", ""))]
    timings = []
    for limit in limits:
        asked = [ShareAsked(limit.id, limit.scope_type, limit.scope_id, start, window_end("monthly", now), 0)]
        each = []
        for _ in range(takes):
            started = time.perf_counter()
            await ledger.on_database(take_shares, "bench", asked, 30.0)
            each.append((time.perf_counter() - started) * 1000)
        timings.append(each)
    await ledger.stopService()
    return timings


async def main(options) -> None:
    targets = [os.path.join(tempfile.mkdtemp(prefix="spend-check-"), "usage.sqlite")]
    if options.postgres:
        targets.append(options.postgres)
    for target in targets:
        per_request = await request_path(target, options.requests, options.rounds)
        import twisted_relay

        print("%s (%s): the request path far from a cap: median %.2f us a request (rounds: %s)"
              % (os.path.dirname(os.path.dirname(twisted_relay.__file__)), describe_database(target),
                 statistics.median(per_request), ", ".join("%.2f" % r for r in per_request)))
        if not options.requests_only:
            user, organization = await share_transaction(target, options.rows, options.takes)
            print("%s: one share transaction over %d rows in the window: user cap median %.2f ms, relay cap median %.2f ms"
                  % (describe_database(target), options.rows, statistics.median(user), statistics.median(organization)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres", help="a PostgreSQL database to measure too (its tables are written to)")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--takes", type=int, default=50)
    parser.add_argument("--requests-only", action="store_true")
    options = parser.parse_args()
    done = ensureDeferred(main(options))
    done.addErrback(lambda failure: failure.printTraceback())
    done.addBoth(lambda _: reactor.stop())
    reactor.run()
