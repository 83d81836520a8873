"""
Benchmark of the tool-use id translation core.

Measures the inbound translation of a request against its history length
(clean histories and histories with collisions, both policies; and a
conversation that crosses two upstreams, with marked thinking, under
adaptive and manual thinking) and the cost of one response decision
(``ResponseTranslator.translate_block``). Run it
from the work tree's root::

    python bench/bench_translation.py

It prints a table, with the time per turn to show that the walk is linear.
Its runtime is bounded (well under a minute).
"""

from __future__ import annotations

import gc
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from twisted_relay.translation import (  # noqa: E402
    ORIGINAL,
    POLICIES,
    UNIQUE,
    UpstreamRules,
    mark_signature,
    translate_request,
)

TURNS = (100, 1_000, 5_000, 10_000)
BUDGET_SECONDS = 1.0  # per measurement: repeat until spent, take the best run


def history(turns: int, colliding: bool) -> dict:
    """
    A Claude Code-shaped session: per turn, an assistant message with text and
    one ``tool_use``, then a user message with its ``tool_result``. When
    ``colliding``, the upstream reused one of five ids, so most declarations
    are rewritten forms (``X-k``) that decode to a repeated original.
    """
    messages = []
    counts: dict[str, int] = {}
    for n in range(turns):
        if colliding:
            original = "toolu_%d" % (n % 5)
            k = counts[original] = counts.get(original, 0) + 1
            client_id = original if k == 1 else "%s-%d" % (original, k)
        else:
            client_id = "toolu_01%020d" % n
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": "Let me look at that."},
            {"type": "tool_use", "id": client_id, "name": "Bash", "input": {"command": "ls -la"}},
        ]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": client_id, "content": "total 0"},
        ]})
    return {"model": "m", "max_tokens": 1024, "messages": messages}


def best_of(fn, budget: float = BUDGET_SECONDS, at_most: int = 200) -> tuple[float, int]:
    """The best wall time of ``fn()`` over repeated runs within ``budget``."""
    best = float("inf")
    runs = 0
    deadline = time.perf_counter() + budget
    while runs < at_most and (runs < 3 or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        runs += 1
    return best, runs


def bench_requests() -> None:
    print("inbound: translate_request(body, policy), best of repeated runs")
    print("%-9s %-10s %7s %10s %12s %12s %8s" % (
        "policy", "history", "turns", "ms", "us/turn", "+table ms", "changed"))
    for policy in POLICIES:
        for colliding in (False, True):
            for turns in TURNS:
                body = history(turns, colliding)
                t = translate_request(body, policy)
                gc.collect()
                elapsed, _ = best_of(lambda body=body, policy=policy: translate_request(body, policy))
                with_table, _ = best_of(lambda body=body, policy=policy: translate_request(body, policy).table, budget=0.5)
                print("%-9s %-10s %7d %10.2f %12.2f %12.2f %8s" % (
                    policy, "colliding" if colliding else "clean", turns,
                    elapsed * 1e3, elapsed * 1e6 / turns, with_table * 1e3, t.changed))


def crossing_history(turns: int, thinking: dict) -> dict:
    """
    One tool loop that moves every 3 turns between two upstreams, each answer
    a marked thinking block and a ``tool_use`` (Kimi-style ids at one of them).
    """
    messages = [{"role": "user", "content": "work"}]
    for n in range(turns):
        maker = ("strict", "kimi")[n // 3 % 2]
        tool_id = "functions.Bash:%d" % (n % 2) if maker == "kimi" else "toolu_01%020d" % n
        if maker == "kimi" and n >= 2:
            tool_id += "-%d" % (n // 2)
        messages.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": "", "signature": mark_signature(maker, "EqQBCkgIBRABGAIiQL%d" % n)},
            {"type": "tool_use", "id": tool_id, "name": "Bash", "input": {"command": "ls -la"}},
        ]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": tool_id, "content": "total 0"},
        ]})
    return {"model": "m", "max_tokens": 1024, "thinking": thinking, "messages": messages}


def bench_crossing() -> None:
    print()
    print("crossing: translate_request(body, rules) for one of two upstreams, marked thinking")
    print("%-9s %-10s %7s %10s %12s %9s" % ("to", "thinking", "turns", "ms", "us/turn", "disabled"))
    rules = {"strict": UpstreamRules("strict", UNIQUE, mark_thinking=True),
             "kimi": UpstreamRules("kimi", ORIGINAL, own_ids=r"^functions\.[A-Za-z]+:[0-9]+$", mark_thinking=True)}
    for name in ("strict", "kimi"):
        for label, thinking in (("adaptive", {"type": "adaptive"}), ("manual", {"type": "enabled", "budget_tokens": 1024})):
            for turns in (1_000, 10_000):
                body = crossing_history(turns, thinking)
                t = translate_request(body, rules[name])
                gc.collect()
                elapsed, _ = best_of(lambda body=body, r=rules[name]: translate_request(body, r), budget=0.5)
                print("%-9s %-10s %7d %10.2f %12.2f %9s" % (
                    name, label, turns, elapsed * 1e3, elapsed * 1e6 / turns, t.thinking_disabled))


def bench_decisions() -> None:
    print()
    print("response: one translate_block decision on a 10,000-turn history, best mean over batches")
    print("(the long-lived history is gc.freeze()d: otherwise the batch's own allocations make the")
    print(" collector walk the whole history, and that, not the decision, is what gets measured)")
    print("%-9s %-44s %8s %8s" % ("policy", "block", "us/block", "changed"))
    batch = 5_000
    for policy in (UNIQUE, ORIGINAL):
        for colliding in (False, True):
            t = translate_request(history(10_000, colliding), policy)
            cases = (
                ("text", lambda: {"type": "text", "text": ""}),
                ("tool_use, fresh id", lambda: {"type": "tool_use", "id": "toolu_new", "name": "Bash", "input": {}}),
                ("tool_use, repeats toolu_3", lambda: {"type": "tool_use", "id": "toolu_3", "name": "Bash", "input": {}}),
                ("web_search_tool_result -> history", lambda: {"type": "web_search_tool_result", "tool_use_id": "toolu_3", "content": []}),
            )
            gc.collect()
            gc.freeze()
            for name, make in cases:
                best = float("inf")
                for _ in range(5):
                    blocks = [make() for _ in range(batch)]
                    # a fresh translator per block: each decision is the
                    # first of its response, as on the streaming hot path
                    translators = [t.response() for _ in range(batch)]
                    start = time.perf_counter()
                    for r, block in zip(translators, blocks):
                        r.translate_block(block)
                    best = min(best, time.perf_counter() - start)
                print("%-9s %-44s %8.2f %8s" % (
                    policy, "%s (%s)" % (name, "colliding" if colliding else "clean"),
                    best * 1e6 / batch, blocks[0] != make()))
            gc.unfreeze()
    start = time.perf_counter()
    for _ in range(batch):
        t.response()
    print("%-9s %-44s %8.2f" % ("", "t.response() itself", (time.perf_counter() - start) * 1e6 / batch))


def main() -> None:
    started = time.perf_counter()
    print("python %s" % sys.version.split()[0])
    bench_requests()
    bench_crossing()
    bench_decisions()
    print()
    print("total %.1f s" % (time.perf_counter() - started))


if __name__ == "__main__":
    main()
