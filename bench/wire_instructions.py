"""
Count the instructions the relay's process runs per paced event, under
Valgrind's callgrind, for the ``relay`` target (the Anthropic wire), the
``relay-bedrock`` target (the Bedrock wire) and the ``relay-responses``
target (OpenAI's Responses wire) in front of the same fake upstream: a figure that the other work on a shared machine does not move,
beside ``bench/run.py``'s CPU seconds, which it does.

Only the relay's own user-space instructions are counted (not the kernel's
work for its sockets), from just before the measured load to just after
it (``callgrind_control --zero`` and ``--dump``), start-up and a warm-up
load left out. A few streams only: under callgrind the relay runs some 50
times slower, and paced streams must stay paced (one event a read), as at
200 streams on a quiet machine. Run it from the work tree's root (about
two minutes a target)::

    python bench/wire_instructions.py
    python bench/wire_instructions.py --bedrock-tree before=/path/to/tree   # a Bedrock wire before a change
    python bench/wire_instructions.py --targets relay,relay-responses       # issue 33's wire only

It needs ``valgrind`` (``apt-get install valgrind``). Every process binds
127.0.0.1 and is stopped by its pid; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

import targets as _targets  # noqa: E402


def _load(target: _targets.Target, model: str, streams: int, requests: int, timeout: float) -> dict:
    done = subprocess.run(
        [sys.executable, os.path.join(BENCH_DIR, "loadgen.py"), "--port", str(target.port), "--model", model,
         "--concurrency", str(streams), "--requests", str(requests), "--timeout", str(timeout)],
        capture_output=True, timeout=timeout * (requests // streams + 2),
    )
    lines = done.stdout.decode().strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError("the load generator failed: %s" % (done.stderr.decode()[-2000:],))
    return json.loads(lines[-1])


def _instructions(dump: str) -> int:
    """The instructions counted in a callgrind dump (its ``summary`` line)."""
    with open(dump) as f:
        for line in f:
            if line.startswith("summary:"):
                return int(line.split()[1])
    raise RuntimeError("no summary in %s" % (dump,))


def measure(target: _targets.Target, workdir: str, model: str, streams: int, rounds: int, timeout: float) -> dict:
    """Start ``target`` (already made with the callgrind launcher), load it, count; stop it."""
    target.start()
    try:
        _load(target, model, streams, streams * 2, timeout)  # warm: code paths, pools, caches
        control = shutil.which("callgrind_control") or "callgrind_control"
        subprocess.run([control, "--zero", str(target.pid)], capture_output=True, check=True, timeout=60)
        summary = _load(target, model, streams, streams * rounds, timeout)
        subprocess.run([control, "--dump", str(target.pid)], capture_output=True, check=True, timeout=60)
    finally:
        target.stop(grace=60)
    # The dump asked for is part 1 (the file without a part is the rest, to the exit).
    dump = "%s/%s.callgrind.%d.1" % (workdir, target.name, target.pid)
    instructions = _instructions(dump)
    return {
        "events": summary["events"],
        "streams": summary["ok"],
        "errors": summary["errors"],
        "instructions": instructions,
        "per_event": instructions / max(1, summary["events"]),
        "per_stream": instructions / max(1, summary["ok"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4, help="concurrent paced streams")
    parser.add_argument("--rounds", type=int, default=8, help="streams each, one after the other")
    parser.add_argument("--events", type=int, default=50, help="deltas per stream, 20 ms apart")
    parser.add_argument("--bedrock-tree", action="append", default=[], metavar="NAME=PATH",
                        help="also count the Bedrock wire of the twisted_relay copy under PATH, as NAME")
    parser.add_argument("--targets", default="relay,relay-bedrock,relay-responses",
                        help="which of relay, relay-bedrock, relay-responses to count (relay always)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    kinds = {"relay-bedrock": _targets.BedrockRelay, "relay-responses": _targets.ResponsesRelay}
    names = [n for n in args.targets.split(",") if n and n != "relay"]
    unknown = [n for n in names if n not in kinds]
    if unknown:
        raise SystemExit("unknown target(s): %s" % (", ".join(unknown),))
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    workdir = args.workdir or tempfile.mkdtemp(prefix="relay-instructions-")
    os.makedirs(workdir, exist_ok=True)
    model = "bench:paced:%d:20" % (args.events,)
    upstream = _targets.FakeUpstreamProcess(workdir)
    upstream.start()

    def launcher(name: str) -> list[str]:
        return ["valgrind", "--tool=callgrind", "--callgrind-out-file=%s/%s.callgrind.%%p" % (workdir, name)]

    made = [_targets.Relay(workdir, upstream, launcher=launcher("relay"))]
    made += [kinds[name](workdir, upstream, launcher=launcher(name)) for name in names]
    for item in args.bedrock_tree:
        name, tree = item.split("=", 1)
        made.append(_targets.BedrockRelay(workdir, upstream, tree=tree, name=name, launcher=launcher(name)))
    results = {}
    try:
        for target in made:
            print("counting %s (%d streams of %d deltas, %d rounds)" % (target.name, args.streams, args.events,
                                                                         args.rounds), file=sys.stderr, flush=True)
            results[target.name] = measure(target, workdir, model, args.streams, args.rounds, args.timeout)
    finally:
        upstream.stop()
    base = results["relay"]
    print("| instructions (callgrind) | per paced event | per stream | x relay, per event | errors |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print("| %s | %.1f k | %.0f k | %.2f | %d |" % (name, r["per_event"] / 1e3, r["per_stream"] / 1e3,
                                                       r["per_event"] / base["per_event"], r["errors"]))


if __name__ == "__main__":
    main(sys.argv[1:])
