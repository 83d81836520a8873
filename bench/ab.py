"""
S3 (small non-streaming requests, 32 keep-alive clients) on several relay
trees side by side, alternating: a few processes of each tree in front of one
fake upstream, each loaded in turn for a few seconds, in a new random order
every round. A difference smaller than one process's spread from another of
the same tree is noise (where a process lands in memory and on which core).

Usage, from the work tree's root::

    python bench/ab.py nometer=../nometer relay=. relay+ledger=.
    python bench/ab.py --instances 3 --rounds 8 --seconds 4 a=../a b=../b

A name ending in ``+ledger`` runs its tree with the usage ledger on
(``--usage-db``, an SQLite file in the work folder). It prints requests/s
per tree (the median over its processes' medians) and per process, and each
tree against the first paired by round (the mean of each round's ratio, with
its 95 % interval over the rounds): a difference whose interval holds zero
is within the noise. One tree under two names (``a=. a2=.``) shows what the
noise alone does. It is not a test and is not run by CI.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import targets as _targets  # noqa: E402
from bench.run import Runner  # noqa: E402

_LEDGER = "+ledger"

# Student's t, two-sided 95 %, by degrees of freedom (2.0 past the table).
_T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13,
        2.12, 2.11, 2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04)


def _log(text: str) -> None:
    print("[ab] " + text, file=sys.stderr, flush=True)


def _target(name: str, tree: str, instance: int, workdir: str, upstream, cpus):
    kind = _targets.LedgerRelay if name.endswith(_LEDGER) else _targets.Relay
    # Its files' names in the work folder: tree index and instance keep them apart.
    return kind(workdir, upstream, cpus, tree=os.path.abspath(tree), name="%s-%d" % (name.replace("+", "_"), instance))


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", metavar="NAME=PATH")
    parser.add_argument("--instances", type=int, default=2, help="processes of each tree")
    parser.add_argument("--rounds", type=int, default=6, help="loads of each process")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one load")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--pin", action="store_true", help="relays on CPU 1, the upstream and load generator on CPU 0")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    trees = dict(item.split("=", 1) for item in args.trees)
    rng = random.Random(args.seed)
    pin = args.pin and (os.cpu_count() or 1) >= 2
    workdir = tempfile.mkdtemp(prefix="relay-ab-")
    _log("work folder: %s" % (workdir,))
    upstream = _targets.FakeUpstreamProcess(workdir, {0} if pin else None)
    upstream.start()
    started = []
    try:
        for instance in range(1, args.instances + 1):
            for name, tree in trees.items():
                target = _target(name, tree, instance, workdir, upstream, {1} if pin else None)
                target.start()
                started.append((name, target))
        runner = Runner(upstream, {0} if pin else None, _log)
        for _, target in started:  # warm every process up
            runner.load(target, "bench:json", args.concurrency, duration=1.0, timeout=60)
        figures: dict = {target.name: [] for _, target in started}
        by_round: list[dict] = []  # each round: tree name -> its processes' figures
        errors: dict = {}
        began = time.monotonic()
        for round_number in range(1, args.rounds + 1):
            order = list(started)
            rng.shuffle(order)
            this_round: dict = {name: [] for name in trees}
            by_round.append(this_round)
            for name, target in order:
                summary = runner.load(target, "bench:json", args.concurrency, duration=args.seconds, timeout=60)
                if summary.get("errors"):
                    errors[target.name] = errors.get(target.name, 0) + 1  # a load with errors is left out
                else:
                    figures[target.name].append(summary["requests_per_s"])
                    this_round[name].append(summary["requests_per_s"])
            _log("round %d of %d done (%.0fs)" % (round_number, args.rounds, time.monotonic() - began))
    finally:
        for _, target in reversed(started):
            target.stop()
        upstream.stop()
    print("S3 requests/s, %d processes a tree, %d loads of %gs each, %s%s"
          % (args.instances, args.rounds, args.seconds, "pinned" if pin else "not pinned",
             "; loads with errors, left out: %s" % (errors,) if errors else ""))
    print()
    print("| tree | median of its processes' medians | vs the first | each process's median (min-max) |")
    print("|---|---|---|---|")
    first = None
    for name in trees:
        own = [(t.name, figures[t.name]) for n, t in started if n == name]
        medians = [statistics.median(values) if values else 0.0 for _, values in own]
        median = statistics.median(medians)
        first = median if first is None else first
        print("| %s | %.0f | %+.1f %% | %s |" % (
            name, median, (median / first - 1) * 100 if first else 0.0,
            ", ".join("%.0f (%.0f-%.0f)" % (m, min(v, default=0), max(v, default=0)) for m, (_, v) in zip(medians, own))))
    _print_paired(trees, by_round)


def _print_paired(trees: dict, by_round: list[dict]) -> None:
    """Each tree against the first, round by round: the mean ratio and its 95 % interval."""
    names = list(trees)
    print()
    print("| tree | vs the first, paired by round (mean) | 95 % interval | rounds |")
    print("|---|---|---|---|")
    for name in names[1:]:
        ratios = [
            statistics.fmean(r[name]) / statistics.fmean(r[names[0]]) - 1
            for r in by_round if r[name] and r[names[0]]
        ]
        if len(ratios) < 2:
            print("| %s | - | - | %d |" % (name, len(ratios)))
            continue
        mean = statistics.fmean(ratios)
        t = _T95[len(ratios) - 2] if len(ratios) - 1 <= len(_T95) else 2.0
        half = t * statistics.stdev(ratios) / len(ratios) ** 0.5
        print("| %s | %+.1f %% | %+.1f to %+.1f %% | %d |" % (
            name, mean * 100, (mean - half) * 100, (mean + half) * 100, len(ratios)))


if __name__ == "__main__":
    main()
