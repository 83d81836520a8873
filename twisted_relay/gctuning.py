# -*- test-case-name: tests.test_gctuning -*-
"""
The garbage collector tuned for a relay process.

Each open stream keeps a few hundred small objects alive (the request, its
headers, Deferreds, the gate) for as long as it runs. With Python's default
settings the collector then runs a full collection every few seconds under
load, and each one walks every live object: measured with 1,000 paced
streams, twelve full collections of 60 to 160 ms each, during which no
stream moves (``docs/benchmarks.md``).

:class:`GarbageCollectorTuning` does two things when the relay starts:

- it freezes what exists by then (modules, classes, the application): the
  collector never walks those objects again;
- it runs a full collection once in 100 collections of the middle
  generation instead of once in 10 (the young generations keep Python's
  settings, so short-lived garbage goes as soon as before).

It changes the whole process, so the ``twistd relay`` command turns it on
(``--no-gc-tuning`` turns it off) and an application that embeds the relay
keeps its own settings unless it asks for this (``RelayConfig.gc_tuning``).
"""

from __future__ import annotations

import gc

from twisted.application.service import Service

__all__ = ["GarbageCollectorTuning", "FULL_COLLECTION_EVERY"]

# Collections of the middle generation between two full collections
# (Python's default is 10).
FULL_COLLECTION_EVERY = 100


class GarbageCollectorTuning(Service):
    """Tunes the garbage collector while the relay runs; restores it when it stops."""

    _saved = None

    def startService(self):
        Service.startService(self)
        self._saved = gc.get_threshold()
        young, middle, _ = self._saved
        # Collect first, so the garbage of start-up is not frozen with the rest.
        gc.collect()
        gc.freeze()
        gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)

    def stopService(self):
        Service.stopService(self)
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            gc.unfreeze()
            self._saved = None
