"""
Memory of idle message threads in the relay's memory store.

Builds one tool-use conversation of ``--turns`` turns with the simulated
model (each turn: the model's text and tool call, then the tool's result:
``--result-bytes`` of the project's own source, text as a tool reads it),
then holds ``--threads`` threads of it, each made
distinct (its own first message, so its own bytes) and left as a real thread
leaves the store: its last answer held, the answer before it marked
continued. Prints what the store counts against its byte bound and what the
process really spends: RSS growth (from /proc), or with ``--tracemalloc``
the bytes Python allocated (tracemalloc's own bookkeeping then adds to RSS).

    python -m bench.thread_memory --threads 10000 --turns 50
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import tracemalloc

from twisted.internet.task import Clock

from twisted_relay.message_threads.model import Conversation
from twisted_relay.message_threads.store import MemoryThreadStore
from twisted_relay.simulated.model import ModelOptions, compose_answer

TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file of the project.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
    {
        "name": "run",
        "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
]


def _source_text() -> str:
    root = pathlib.Path(__file__).resolve().parent.parent / "twisted_relay"
    return "".join(path.read_text("utf-8") for path in sorted(root.glob("*.py")))


def conversation(turns: int, result_bytes: int) -> tuple[dict, dict]:
    """The last request of a ``turns``-turn session, and its answer."""
    options = ModelOptions(seed=1, reuse_every=0)
    source, offset = _source_text(), 0
    request = {"model": "m", "max_tokens": 1024, "system": "You are a careful engineer.", "tools": TOOLS,
               "messages": [{"role": "user", "content": "Fix the failing test."}]}
    for _ in range(turns - 1):
        answer = compose_answer(request, options)
        results = []
        for block in answer["content"]:
            if block["type"] == "tool_use":
                offset = (offset + result_bytes) % max(1, len(source) - result_bytes)
                results.append({"type": "tool_result", "tool_use_id": block["id"],
                                "content": source[offset:offset + result_bytes]})
        request["messages"] += [{"role": "assistant", "content": answer["content"]},
                                {"role": "user", "content": results}]
    return request, compose_answer(request, options)


def rss() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--result-bytes", type=int, default=200, help="bytes of each tool result")
    parser.add_argument("--tracemalloc", action="store_true", help="also trace Python's allocations")
    options = parser.parse_args(argv)

    request, answer = conversation(options.turns, options.result_bytes)
    store = MemoryThreadStore(Clock(), max_threads=options.threads, max_bytes=2**40)
    gc.collect()
    rss_before = rss()
    if options.tracemalloc:
        tracemalloc.start()
    for n in range(options.threads):
        mine = dict(request, messages=[{"role": "user", "content": f"Fix the failing test #{n}."},
                                       *request["messages"][1:]])
        previous, last = f"msg_01prev{n:016d}xxxxxx", f"msg_01last{n:016d}xxxxxx"
        store.commit(previous, b"{}")
        store.begin(previous)
        store.commit(last, Conversation.after(mine, answer).encode(), previous)
    gc.collect()
    rss_after = rss()
    held, counted = store.size()
    one = counted / held
    print(f"threads held: {held} ({options.turns} turns each, {one / 1024:.1f} KiB of JSON each)")
    print(f"counted against --thread-max-bytes: {counted / 2**20:.1f} MiB")
    if options.tracemalloc:
        traced, _peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"tracemalloc: {traced / 2**20:.1f} MiB ({traced / held / 1024:.1f} KiB a thread)")
    if rss_before is not None and rss_after is not None:
        print(f"RSS growth: {(rss_after - rss_before) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
