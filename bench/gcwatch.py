"""
Run ``twistd`` with the garbage collector watched: how many collections of
each generation, how long they took (in all, and the longest: a pause of
every stream), and how many objects they freed; with ``--garbage``, which
types the cyclic garbage is made of.

Counts start at ``SIGUSR2`` (after a warm-up) and are written to ``OUT`` at
``SIGUSR1``, or when the reactor stops if ``SIGUSR1`` never came; as JSON
when ``OUT`` ends in ``.json`` (what ``bench/run.py`` reads). Usage::

    PYTHONPATH=TREE python bench/gcwatch.py OUT -- -n relay --listen tcp:8080:interface=127.0.0.1 ...
    kill -USR2 PID; (load); kill -USR1 PID

``PYTHONPATH`` names the tree whose ``twisted_relay`` runs (as
``bench/targets.py`` sets it): without it, the installed one does, whatever
the current folder. Another Python process (``bench/plain_proxy.py``,
``bench/aiohttp_proxy.py``) is watched the same way with :func:`watch_signals`,
which they call when ``$BENCH_GC_WATCH`` names an ``OUT``.

Freed objects are garbage only the collector could free (reference cycles):
an object freed by reference counting is never counted. ``--garbage`` keeps
that garbage to name its types (``gc.DEBUG_SAVEALL``), which changes the
timings: read one run for the timings, another for the types. It is not a test
and CI does not run it (``docs/benchmarks.md``, "Where issue 13's cost went").
"""

from __future__ import annotations

import collections
import gc
import json
import os
import signal
import sys
import time

__all__ = ["GarbageWatch", "main", "watch_signals"]


class GarbageWatch:
    """
    Collections, time (in all and the longest) and objects freed, per
    generation; and with ``types``, the garbage's types.
    """

    def __init__(self, out: str, *, types: bool = False):
        self.out = out
        self.types = types
        self._began = 0.0
        self.reset()
        gc.callbacks.append(self._callback)

    def reset(self, *args) -> None:
        """Start counting afresh."""
        if self.types:
            gc.collect()
            gc.garbage.clear()
            gc.set_debug(gc.DEBUG_SAVEALL)
        self.counts = {generation: [0, 0.0, 0, 0.0] for generation in (0, 1, 2)}
        self.written = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        counts = self.counts[info["generation"]]
        took = time.perf_counter() - self._began
        counts[0] += 1
        counts[1] += took
        counts[2] += info.get("collected", 0)
        if took > counts[3]:
            counts[3] = took

    def write(self, *args) -> None:
        """Write the counts (and the garbage's types) to ``out``: JSON if it ends in ``.json``."""
        if self.out.endswith(".json"):
            figures = {
                "gen%d" % (generation,): {"collections": n, "seconds": seconds, "freed": freed, "longest_s": longest}
                for generation, (n, seconds, freed, longest) in self.counts.items()
            }
            # Written whole, then renamed: a reader never sees half of it.
            with open(self.out + ".part", "w") as f:
                json.dump(figures, f)
            os.replace(self.out + ".part", self.out)
            self.written = True
            return
        lines = [
            "gen%d: %d collections, %.3f s, %d objects freed, longest %.1f ms" % (
                generation, n, seconds, freed, longest * 1e3)
            for generation, (n, seconds, freed, longest) in self.counts.items()
        ]
        if self.types:
            gc.collect()
            kinds = collections.Counter(_kind(o) for o in gc.garbage)
            gc.garbage.clear()
            lines.append("cyclic garbage by type (every object the collector freed since the start):")
            lines.extend("%9d %s" % (n, kind) for kind, n in kinds.most_common(40))
        with open(self.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        self.written = True

    def write_unless_written(self) -> None:
        """Write, unless ``SIGUSR1`` already has (its counts end where the load did)."""
        if not self.written:
            self.write()


def _kind(o) -> str:
    kind = "%s.%s" % (type(o).__module__, type(o).__qualname__)
    name = getattr(o, "__qualname__", None)
    if isinstance(name, str) and type(o).__name__ in ("function", "coroutine"):
        kind += ":" + name
    return kind


def watch_signals(out: str, *, types: bool = False) -> GarbageWatch:
    """Watch this process's collector: count afresh at ``SIGUSR2``, write to ``out`` at ``SIGUSR1``."""
    watch = GarbageWatch(out, types=types)
    signal.signal(signal.SIGUSR2, watch.reset)
    signal.signal(signal.SIGUSR1, watch.write)
    return watch


def main(argv: list[str]) -> None:
    """``gcwatch.py [--garbage] OUT -- TWISTD-ARGS...``"""
    types = "--garbage" in argv[: argv.index("--")]
    out = [a for a in argv[: argv.index("--")] if a != "--garbage"][0]
    watch = watch_signals(out, types=types)
    # Written when the reactor has stopped: twistd then ends itself with the
    # signal that stopped it, and nothing at exit would run. (This installs
    # the default reactor, the one twistd would install.)
    from twisted.internet import reactor
    from twisted.scripts.twistd import run

    reactor.addSystemEventTrigger("after", "shutdown", watch.write_unless_written)
    sys.argv = ["twistd"] + argv[argv.index("--") + 1 :]
    run()


if __name__ == "__main__":
    main(sys.argv[1:])
