# -*- test-case-name: tests.test_body_work -*-
"""
One worker process of the body pool: ``python -m twisted_relay.body_worker``.

:class:`~twisted_relay.body_pool.BodyPool` starts it and sends it calls on
its standard input; it answers each on its standard output, one at a time.
Each call and each answer is a frame: its length (:data:`HEADER`, 8 bytes,
big-endian), then a pickle. A call is ``(name, args)``, ``name`` one of
:data:`CALLS` (nothing else runs); an answer is ``("ok", value)`` or
``("error", text)``. It ends when its standard input closes. Only the pure
work of :mod:`twisted_relay.body_work` runs here: no reactor, no Twisted.
"""

from __future__ import annotations

import pickle
import signal
import struct
import sys

from twisted_relay.body_work import dropping_in_worker, prepare_in_worker, read_in_worker, thread_in_worker

__all__ = ["CALLS", "HEADER", "frame", "main"]

#: What a worker runs, by name.
CALLS = {
    "read": read_in_worker,
    "thread": thread_in_worker,
    "prepare": prepare_in_worker,
    "dropping": dropping_in_worker,
}

#: A frame's length, before it.
HEADER = struct.Struct("!Q")


def frame(value) -> list[bytes]:
    """``value`` as a frame: its header and its pickle."""
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return [HEADER.pack(len(data)), data]


def main() -> None:
    """Answer calls until the standard input closes."""
    # The relay's own process takes Ctrl-C, and stops this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    calls, answers = sys.stdin.buffer, sys.stdout.buffer
    # The standard output carries answers only.
    sys.stdout = sys.stderr
    while True:
        header = calls.read(HEADER.size)
        if len(header) < HEADER.size:
            return
        (size,) = HEADER.unpack(header)
        data = calls.read(size)
        if len(data) < size:
            return
        name, args = pickle.loads(data)
        del data
        try:
            answer = ("ok", CALLS[name](*args))
        except Exception as e:
            answer = ("error", "%s: %s" % (type(e).__name__, e))
        del args
        answers.writelines(frame(answer))
        answers.flush()


if __name__ == "__main__":
    main()
