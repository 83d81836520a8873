# -*- test-case-name: tests.test_gctuning -*-
"""
The garbage collector tuned for a relay process.

Under load the collector runs a full collection every few seconds, and each
one walks every tracked object, the 60,000 or so that make up the modules,
classes and the application included: measured with 1,000 paced streams,
full collections of 60 to 160 ms, during which no stream moves
(``docs/benchmarks.md``).

:class:`GarbageCollectorTuning` freezes what exists when the relay starts:
the collector never walks those objects again, and every full collection is
shorter by that much. How often the collector runs is left as Python sets it:
running full collections less often (tried: once per 100 middle-generation
collections instead of 10) let the garbage of finished requests pile up
(110 against 68 MiB in the soak) and made the rare full collection a pause of
over a second.

It changes the whole process, so the ``twistd relay`` command turns it on
(``--no-gc-tuning`` turns it off) and an application that embeds the relay
keeps its own settings unless it asks for this (``RelayConfig.gc_tuning``).
"""

from __future__ import annotations

import gc

from twisted.application.service import Service

__all__ = ["GarbageCollectorTuning"]


class GarbageCollectorTuning(Service):
    """Freezes what exists when the relay starts; unfreezes it when it stops."""

    _frozen = False

    def startService(self):
        Service.startService(self)
        # Collect first, so the garbage of start-up is not frozen with the rest.
        gc.collect()
        gc.freeze()
        self._frozen = True

    def stopService(self):
        Service.stopService(self)
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
