# -*- test-case-name: tests.test_workers -*-
"""
One worker process of ``--workers``: ``python -m twisted_relay.worker_process NAME``.

The first process (:class:`twisted_relay.workers.WorkerProcesses`) starts it
with its configuration in the environment; it runs a whole relay
(:class:`twisted_relay.service.Relay`) on the shared ports, writes its log
events as JSON lines to its standard output, reads its ``--config`` file
again on SIGHUP, and stops when its standard input closes (the first
process is gone).
"""

from __future__ import annotations

import os
import signal
import sys

from twisted.internet.protocol import Protocol

from twisted_relay.workers import worker_settings

__all__ = ["main"]


class _FirstProcessWatch(Protocol):
    """Stops a worker when its standard input closes: the first process is gone."""

    def __init__(self, reactor):
        self._reactor = reactor

    def connectionLost(self, reason=None):
        if self._reactor.running:
            self._reactor.stop()


def main(argv: list[str] | None = None) -> None:
    """Run one worker process."""
    from twisted.internet import reactor
    from twisted.internet.stdio import StandardIO
    from twisted.logger import FileLogObserver, eventAsJSON, globalLogBeginner

    from twisted_relay.service import Relay
    from twisted_relay.start_checks import StartupError

    given = worker_settings(os.environ)
    if given is None:
        sys.stderr.write("twisted_relay.worker_process is started by the relay itself (--workers).\n")
        raise SystemExit(2)
    config, command_line = given
    out = sys.stdout
    globalLogBeginner.beginLoggingTo(
        [FileLogObserver(out, lambda event: eventAsJSON(event) + "\n")], redirectStandardIO=False
    )
    relay = Relay(config, reactor, worker=True, command_line=command_line)
    if config.config_file is not None:
        # The first process passes SIGHUP on once it has read the file again.
        signal.signal(signal.SIGHUP, lambda signum, frame: reactor.callFromThread(relay.reload))
    try:
        # Its resources are tried again first (the start checks), before it shares the ports.
        relay.service.startService()
    except StartupError as e:
        # One line, which the first process logs; it starts this worker again later.
        name = (sys.argv[1:] if argv is None else argv) or ["worker"]
        sys.stderr.write("twistd relay %s: %s\n" % (name[0], e))
        raise SystemExit(1)
    reactor.addSystemEventTrigger("before", "shutdown", relay.service.stopService)
    StandardIO(_FirstProcessWatch(reactor), stdin=0, stdout=os.open(os.devnull, os.O_WRONLY))
    reactor.run()


if __name__ == "__main__":
    main()
