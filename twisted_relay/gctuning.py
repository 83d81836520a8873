# -*- test-case-name: tests.test_gctuning -*-
"""
The garbage collector tuned for a relay process.

A full collection walks every object the collector tracks, and no stream
moves while it runs: at 1,000 paced streams about 200,000 objects, 35 to
60 ms on a shared 2-core machine (``docs/benchmarks.md``). Python starts
one whenever enough objects have *survived* into the oldest generation (a
quarter of it, after ten middle-generation collections): a stream's objects
live as long as the stream, so under load that is every half second or so,
although a relayed request leaves no reference cycle behind
(``tests/test_garbage.py``) and those collections free nothing.

:class:`GarbageCollectorTuning`:

- freezes what exists when the relay starts (modules, classes, the
  application): no collection walks it again;
- runs a full collection when the heap has grown, not when objects have
  survived: once the memory blocks Python's allocator holds
  (``sys.getallocatedblocks``) are twice what they were after the last full
  collection, and at least three times what they were at start (measured
  once a second). Whatever cyclic garbage the process makes (Klein's render
  still leaves some for a 404) cannot pile up past that, and a steady load,
  however large, runs no full collection at all;
- leaves the young collections as Python runs them (a few milliseconds at
  most).

An earlier version ran full collections ten times less often by Python's
own count; then, each request left reference cycles, and the garbage piled
up (110 against 68 MiB in the soak) until the rare full collection paused the
relay for over a second.

It changes the whole process, so the ``twistd relay`` command turns it on
(``--no-gc-tuning`` turns it off) and an application that embeds the relay
keeps its own settings unless it asks for this (``RelayConfig.gc_tuning``).
"""

from __future__ import annotations

import gc
import sys

from twisted.application.service import Service
from twisted.internet.task import LoopingCall

__all__ = ["GarbageCollectorTuning"]

#: A threshold the oldest generation's count never reaches: Python starts no
#: full collection of its own.
_NEVER = 2**31 - 1


class GarbageCollectorTuning(Service):
    """
    Freezes what exists when the relay starts, and runs full collections
    when the heap has grown (see the module's docstring); when it stops,
    the process's collector is as it was.

    :param clock: the reactor, for the heap's measurement every
        :attr:`interval` seconds.
    :param heap: the heap's size now (memory blocks).
    """

    #: Seconds between two measurements of the heap.
    interval = 1.0
    #: A full collection once the heap is this many times its size after the last one...
    growth = 2.0
    #: ... and at least this many times its size when the relay started.
    floor = 3.0

    _frozen = False
    _saved_threshold = None

    def __init__(self, clock, heap=sys.getallocatedblocks):
        self._clock = clock
        self._heap = heap
        self._loop: LoopingCall | None = None
        self._started_at = 0
        #: Full collections this tuning has run.
        self.collections = 0
        #: The heap's size past which the next full collection runs.
        self.limit = 0

    def startService(self):
        Service.startService(self)
        # Collect first, so the garbage of start-up is not frozen with the rest.
        gc.collect()
        gc.freeze()
        self._frozen = True
        self._saved_threshold = gc.get_threshold()
        young, middle, _ = self._saved_threshold
        gc.set_threshold(young, middle, _NEVER)
        self._started_at = self._heap()
        self._set_limit()
        self._loop = LoopingCall(self.check)
        self._loop.clock = self._clock
        self._loop.start(self.interval, now=False)

    def stopService(self):
        Service.stopService(self)
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        if self._saved_threshold is not None:
            gc.set_threshold(*self._saved_threshold)
            self._saved_threshold = None
        if self._frozen:
            gc.unfreeze()
            self._frozen = False

    def check(self) -> None:
        """Run a full collection if the heap has grown past :attr:`limit`."""
        if self._heap() > self.limit:
            gc.collect()
            self.collections += 1
            self._set_limit()

    def _set_limit(self) -> None:
        self.limit = max(self.growth * self._heap(), self.floor * self._started_at)
