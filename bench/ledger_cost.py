"""
What the usage ledger costs per row, in process: the time ``Ledger.record``
takes on the reactor thread (what a request pays), and the whole process's
CPU per row with the writer thread's batched inserts (SQLite; PostgreSQL
too with ``--postgres URL``, the server's own CPU not counted).

Usage, from the work tree's root::

    python bench/ledger_cost.py                      # SQLite, 50,000 rows
    python bench/ledger_cost.py --rows 200000 --postgres postgresql://relay@127.0.0.1/relay

The records are made before the clock starts (making them is metering's
cost, not the ledger's). It is not a test and is not run by CI.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from twisted.internet import reactor  # noqa: E402
from twisted.internet.defer import ensureDeferred  # noqa: E402
from twisted.internet.task import deferLater  # noqa: E402

from tests.ledger_records import usage_record  # noqa: E402
from twisted_relay.ledger import Ledger  # noqa: E402
from twisted_relay.ledger_sql import describe_database, open_ledger  # noqa: E402

_USAGE = (
    '{"input_tokens": 1234, "cache_creation_input_tokens": 5000, "cache_read_input_tokens": 120000, '
    '"output_tokens": 800, "cache_creation": {"ephemeral_5m_input_tokens": 5000, '
    '"ephemeral_1h_input_tokens": 0}, "service_tier": "standard"}'
)


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


async def measure(target: str, rows: int, per_turn: int) -> dict:
    records = [
        usage_record(n, request_id="rly_bench%08d_%s" % (n, os.urandom(3).hex()), session_id="%036d" % (n % 50),
                     agent_id="agent-%d" % (n % 7), usage=_USAGE)
        for n in range(rows)
    ]
    ledger = Ledger(open_ledger(target), reactor=reactor, flush_interval=0.2)
    ledger.startService()
    in_record = 0.0
    started, cpu = time.perf_counter(), _cpu()
    for first in range(0, rows, per_turn):
        before = time.perf_counter()
        for record in records[first:first + per_turn]:
            ledger.record(record)
        in_record += time.perf_counter() - before
        # Let the reactor turn, as requests would: per_turn rows each millisecond.
        await deferLater(reactor, 0.001, lambda: None)
    await ledger.flush()
    elapsed, cpu = time.perf_counter() - started, _cpu() - cpu
    await ledger.stopService()
    return {
        "database": describe_database(target),
        "rows": rows,
        "written": ledger.written,
        "dropped": ledger.dropped,
        "record_us_per_row_on_reactor": in_record / rows * 1e6,
        "process_cpu_us_per_row": cpu / rows * 1e6,
        "seconds": elapsed,
    }


async def main_async(options) -> None:
    targets = [os.path.join(tempfile.mkdtemp(prefix="ledger-bench-"), "usage.sqlite")]
    if options.postgres:
        targets.append(options.postgres)
    for target in targets:
        result = await measure(target, options.rows, options.per_turn)
        print(
            "%(database)s: %(rows)d rows (%(written)d written, %(dropped)d dropped) in %(seconds).1fs; "
            "record(): %(record_us_per_row_on_reactor).2f us/row on the reactor thread; "
            "process CPU %(process_cpu_us_per_row).1f us/row (the feeding loop and the writer thread included)" % result
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--per-turn", type=int, default=20, help="rows recorded per reactor turn")
    parser.add_argument("--postgres", help="a postgresql:// URL to measure too")
    options = parser.parse_args()
    failures = []

    def run():
        d = ensureDeferred(main_async(options))
        d.addErrback(failures.append)
        d.addBoth(lambda _: reactor.stop())

    reactor.callWhenRunning(run)
    reactor.run()
    if failures:
        failures[0].raiseException()


if __name__ == "__main__":
    main()
