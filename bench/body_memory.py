"""
Peak memory of a relay process for large request bodies.

Starts the fake upstream (``bench/fake_upstream.py``) and ``twistd -n relay``
in front of it, each in its own process, sends ``--concurrent`` requests at
once whose bodies are ``--size`` bytes of many tiny messages (the worst case
for a parsed body: one small dict per few dozen bytes), waits for every
answer, and prints the relay's resident memory before and its peak
(``VmHWM`` of ``/proc/PID/status``, summed over the relay and its body
workers) after, with the statuses received::

    python bench/body_memory.py --concurrent 1
    python bench/body_memory.py --concurrent 10
    python bench/body_memory.py --concurrent 10 --tree OTHER_CHECKOUT  # another version

``--tree`` runs the relay from another checkout of the project (its
directory goes first on ``PYTHONPATH``); extra relay options follow ``--``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)

from targets import tree_pids  # noqa: E402


def free_port() -> int:
    """A port of 127.0.0.1 free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_messages_body(size: int) -> bytes:
    """A Messages body of about ``size`` bytes (never more), all tiny alternating messages."""
    head = b'{"model":"bench:json","max_tokens":16,"messages":['
    tail = b"]}"
    pieces = []
    used = len(head) + len(tail)
    n = 0
    while True:
        role = b"user" if n % 2 == 0 else b"assistant"
        piece = b'{"role":"%s","content":"m%d"}' % (role, n)
        if used + len(piece) + 1 > size:
            break
        pieces.append(piece)
        used += len(piece) + 1
        n += 1
    if n % 2 == 0:  # end on a user turn
        pieces.pop()
    return head + b",".join(pieces) + tail


def memory_kib(pid: int) -> dict:
    """``VmRSS`` and ``VmHWM`` of a process and its children (the relay's body workers), in KiB, summed."""
    found = {"VmRSS": 0, "VmHWM": 0}
    for each in tree_pids(pid):
        try:
            with open("/proc/%d/status" % (each,)) as f:
                for line in f:
                    name, _, value = line.partition(":")
                    if name in found:
                        found[name] += int(value.split()[0])
        except OSError:
            continue
    return found


def post(port: int, body: bytes, results: list, index: int) -> None:
    """POST ``body`` to the relay; store the status and the error type, if any."""
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        connection.request("POST", "/v1/messages", body, {"content-type": "application/json", "x-api-key": "sk-bench"})
        response = connection.getresponse()
        answer = response.read()
        kind = None
        if response.status >= 400:
            try:
                kind = json.loads(answer)["error"]["type"]
            except (ValueError, KeyError, TypeError):
                kind = "?"
        results[index] = (response.status, kind)
        connection.close()
    except OSError as e:
        results[index] = (0, type(e).__name__)


def wait_for_port(port: int, process: subprocess.Popen, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("the process exited with %s" % (process.returncode,))
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("nothing listens on %d" % (port,))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=32_000_000, help="bytes per body (default 32,000,000)")
    parser.add_argument("--concurrent", type=int, default=1, help="requests sent at once")
    parser.add_argument("--tree", default=ROOT, help="checkout of the project to run the relay from")
    parser.add_argument("relay_options", nargs="*", help="more options for twistd relay (after --)")
    args = parser.parse_args(argv)

    workdir = tempfile.mkdtemp(prefix="body-memory-")
    port_file = os.path.join(workdir, "upstream.port")
    upstream = subprocess.Popen(
        [sys.executable, os.path.join(BENCH_DIR, "fake_upstream.py"), "--port-file", port_file],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    relay = None
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(port_file) or not open(port_file).read().strip():
            if time.monotonic() > deadline:
                raise RuntimeError("the fake upstream did not start")
            time.sleep(0.05)
        upstream_port = int(open(port_file).read())
        port = free_port()
        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.tree))
        relay = subprocess.Popen(
            [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "--pidfile=", "-n", "relay",
             "--listen", "tcp:%d:interface=127.0.0.1" % (port,),
             "--upstream", "http://127.0.0.1:%d" % (upstream_port,), "--no-dumps"] + args.relay_options,
            cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for_port(port, relay)
        body = tiny_messages_body(args.size)
        messages = body.count(b'"role"')
        before = memory_kib(relay.pid)
        results = [None] * args.concurrent
        threads = [threading.Thread(target=post, args=(port, body, results, i)) for i in range(args.concurrent)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.monotonic() - started
        after = memory_kib(relay.pid)
        statuses: dict = {}
        for status, kind in results:
            key = "%d%s" % (status, "" if kind is None else " " + kind)
            statuses[key] = statuses.get(key, 0) + 1
        print(
            "%d x %d-byte bodies (%d messages each): RSS before %.0f MiB, peak %.0f MiB, after %.0f MiB; "
            "answers %s in %.1f s"
            % (
                args.concurrent, len(body), messages, before["VmRSS"] / 1024, after["VmHWM"] / 1024,
                after["VmRSS"] / 1024, ", ".join("%s: %d" % item for item in sorted(statuses.items())), seconds,
            )
        )
    finally:
        for process in (relay, upstream):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()


if __name__ == "__main__":
    main()
