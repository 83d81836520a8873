"""
A relay process that records usage by itself, for the ledger's process
tests (tests/test_ledger_processes.py): ``python -m tests.ledger_writer``.

It builds :class:`twisted_relay.service.Relay` from ``twistd relay``'s
options (the ledger made from ``--usage-db`` and started as a child service,
as under twistd), relays on ``--listen`` to the embedded simulated upstream,
and, standing in for metering (which makes these records from answers),
hands the relay's ledger one record every ``--every`` seconds. Each record
is printed (``recorded ID AT``) once handed over; ``started`` once the
relay serves, ``stopped`` once its services have stopped (SIGTERM).
"""

from __future__ import annotations

import argparse
import sys
import time

from twisted.internet import reactor
from twisted.internet.task import LoopingCall

from twisted_relay.service import Relay
from twisted_relay.settings import read_settings

from .ledger_records import usage_record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True, help="prefix of the request ids")
    parser.add_argument("--every", type=float, default=0.005, help="seconds between two records")
    parser.add_argument("relay_options", nargs=argparse.REMAINDER, help="twistd relay's options, after --")
    options = parser.parse_args()
    relay_options = options.relay_options[1:] if options.relay_options[:1] == ["--"] else options.relay_options
    given: dict = {"simulate": "lenient", "no-dumps": True, "drain-delay": "0", "listen": []}
    position = 0
    while position < len(relay_options):
        name = relay_options[position].removeprefix("--")
        if name == "listen":
            given["listen"].append(relay_options[position + 1])
        else:
            given[name] = relay_options[position + 1]
        position += 2
    # A port of its own unless told (never the default 8080, which another relay may hold).
    given["listen"] = given["listen"] or ["tcp:0:interface=127.0.0.1"]
    relay = Relay(read_settings(given), reactor)
    numbers = iter(range(1, 10_000_000))

    def record() -> None:
        number = next(numbers)
        at = time.time()
        request_id = "%s-%07d" % (options.name, number)
        relay.ledger.record(usage_record(number, at=at, request_id=request_id, key_name=options.name))
        sys.stdout.write("recorded %s %.6f\n" % (request_id, at))
        sys.stdout.flush()

    def started() -> None:
        try:
            relay.service.privilegedStartService()
            relay.service.startService()
        except Exception as e:
            sys.stderr.write("cannot start: %s\n" % (e,))
            reactor.stop()
            return
        sys.stdout.write("started\n")
        sys.stdout.flush()
        recording.start(options.every)

    def stopped() -> None:
        sys.stdout.write("stopped\n")
        sys.stdout.flush()

    def stop():
        # No request, no record, after the stop (as the relay drains its requests first).
        if recording.running:
            recording.stop()
        return relay.service.stopService()

    recording = LoopingCall(record)
    reactor.callWhenRunning(started)
    reactor.addSystemEventTrigger("before", "shutdown", stop)
    reactor.addSystemEventTrigger("after", "shutdown", stopped)
    reactor.run()


if __name__ == "__main__":
    main()
