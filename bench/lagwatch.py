"""
Run ``twistd`` with its reactor watched: a call every 10 ms notes how late
it ran, and the worst lateness (the reactor's longest block, in ms) and how
many were over 100 ms are written to ``OUT`` every second and when the
reactor stops. Usage::

    PYTHONPATH=TREE python bench/lagwatch.py OUT -- -n relay --listen tcp:8080:interface=127.0.0.1 ...

``PYTHONPATH`` names the tree whose ``twisted_relay`` runs, as for
``bench/gcwatch.py``. It is not a test and CI does not run it
(``docs/architecture.md``, "Big bodies": the flood, the work on large bodies
run three ways).
"""

from __future__ import annotations

import sys
import time

__all__ = ["LagWatch", "main"]

#: How often the watch's call is due, in seconds.
TICK = 0.01


class LagWatch:
    """The reactor's worst lateness on a call due every :data:`TICK`, and the count of those over 100 ms."""

    def __init__(self, out: str):
        self.out = out
        self.worst_ms = 0.0
        self.over_100ms = 0
        self._last: float | None = None

    def tick(self) -> None:
        now = time.monotonic()
        if self._last is not None:
            late = (now - self._last - TICK) * 1000.0
            self.worst_ms = max(self.worst_ms, late)
            self.over_100ms += late > 100.0
        self._last = now

    def write(self) -> None:
        """Write the figures to ``out``."""
        with open(self.out, "w") as f:
            f.write("worst lateness %.1f ms, %d over 100 ms\n" % (self.worst_ms, self.over_100ms))


def main(argv: list[str]) -> None:
    """``lagwatch.py OUT -- TWISTD-ARGS...``"""
    out = argv[: argv.index("--")][0]
    watch = LagWatch(out)
    from twisted.internet import reactor
    from twisted.internet.task import LoopingCall
    from twisted.scripts.twistd import run

    def start() -> None:
        LoopingCall(watch.tick).start(TICK)
        LoopingCall(watch.write).start(1.0, now=False)

    reactor.callWhenRunning(start)
    reactor.addSystemEventTrigger("after", "shutdown", watch.write)
    sys.argv = ["twistd"] + argv[argv.index("--") + 1 :]
    run()


if __name__ == "__main__":
    main(sys.argv[1:])
