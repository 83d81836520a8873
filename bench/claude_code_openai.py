# -*- test-case-name: tests.test_claude_code_openai -*-
"""
The real Claude Code CLI through the relay against models that speak only
OpenAI's protocols (issue 33, "Done when"). Not run by CI unless the CLI is
installed (``.ci/run`` installs it)::

    npm install --prefix DIR @anthropic-ai/claude-code@2.1.332
    python -m bench.claude_code_openai --claude DIR/node_modules/.bin/claude              # responses, gemini
    python -m bench.claude_code_openai --claude ... --upstream deepseek --rounds 3 --max-turns 5

In this process, on 127.0.0.1 only: the simulated upstream and the relay in
front of it, built by :class:`bench.openai_session.OpenAIUpstreams` from a
TOML file as ``twistd relay --config`` builds it: GPT on the Responses API
(``gpt-5.5``), or a Chat Completions upstream in a dialect (Gemini's
``gemini-3-pro`` by default). The CLI asks for ``claude-opus-4-6`` (and turns
adaptive thinking on for it by itself); the upstream's model map sends that
to the upstream's model.

The CLI runs as :mod:`bench.claude_code` runs it (a fresh ``HOME``, a dummy
key, only ``Read`` and ``Glob``, a proxy trap; rounds after the first with
``--continue``, so the whole history, reasoning and tool ids included, goes
back to the upstream).

Printed: each round's result (the CLI's own JSON summary), what the upstream
received and whether every request was in its own protocol with the relay's
key (Responses: stateless input items, encrypted reasoning asked for;
Chat: messages, and for Gemini each step's first tool call with its thought
signature), the tool calls and reasoning sent back, the simulator's own
tally of that reasoning, whether Claude Code's per-request attribution line
reached the upstream, the CLI's transcript, the relay's 4xx dumps and what
the trap caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from twisted.internet import defer, task

from bench.claude_code import (
    CLI_VARIABLE,
    CLI_VERSION,
    CLIENT_KEY,
    cli_folder,
    print_outcome,
    print_rounds,
    run_rounds,
)
from bench.openai_session import CHAT_DIALECTS, KEY, MODEL, UPSTREAM_MODELS, OpenAIUpstreams

__all__ = ["ATTRIBUTION", "CLI_VARIABLE", "CLI_VERSION", "UPSTREAMS", "run_cli_session"]

UPSTREAMS = ("responses",) + CHAT_DIALECTS
#: The start of Claude Code's attribution line (the first system block), whose
#: per-request hash would change the prompt's prefix at every request.
ATTRIBUTION = "x-anthropic-billing-header"


def _responses_problems(body: dict) -> list[str]:
    """What in a ``/v1/responses`` body is not a stateless Responses request of the relay's."""
    wrong = []
    items = body.get("input")
    if "messages" in body or not isinstance(items, list):
        wrong.append("no input items")
    elif any(isinstance(item, dict) and "id" in item for item in items):
        wrong.append("an input item with its id (store is false)")
    if body.get("store") is not False or "reasoning.encrypted_content" not in (body.get("include") or ()):
        wrong.append("not stateless (store, include)")
    return wrong


def _chat_problems(upstream: str, body: dict) -> list[str]:
    """What in a ``/v1/chat/completions`` body is not a Chat request (Gemini: a step's first call unsigned)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or "input" in body:
        return ["no messages"]
    if upstream != "gemini":
        return []
    unsigned = sum(1 for message in messages if message.get("role") == "assistant"
                   for call in (message.get("tool_calls") or ())[:1]
                   if not ((call.get("extra_content") or {}).get("google") or {}).get("thought_signature"))
    return ["%d assistant tool calls without their thought signature" % (unsigned,)] if unsigned else []


def off_the_protocol(upstream: str, received) -> list[str]:
    """What in each request the upstream received is not in its own protocol, with the relay's key."""
    found = []
    path = "/v1/responses" if upstream == "responses" else "/v1/chat/completions"
    for n, request in enumerate(received):
        body = request.body if isinstance(request.body, dict) else {}
        wrong = []
        if request.path == "/v1/responses/input_tokens" and upstream == "responses":
            pass
        elif request.path != path:
            wrong.append("path %s" % (request.path,))
        elif upstream == "responses":
            wrong.extend(_responses_problems(body))
        else:
            wrong.extend(_chat_problems(upstream, body))
        if body.get("model") != UPSTREAM_MODELS[upstream]:
            wrong.append("model %r" % (body.get("model"),))
        if request.headers.get("authorization") != "Bearer " + KEY:
            wrong.append("not the upstream's key")
        if any(CLIENT_KEY in value for value in request.headers.values()):
            wrong.append("the CLI's own key reached the upstream")
        found.extend("request #%d: %s" % (n, what) for what in wrong)
    return found


def carried(upstream: str, received) -> dict:
    """Counts of what the answers' requests carried: tool calls and results, reasoning sent back."""
    if upstream == "responses":
        items = [item for r in received if r.path == "/v1/responses" and isinstance(r.body, dict)
                 for item in r.body.get("input") or () if isinstance(item, dict)]
        return {"function_calls": sum(1 for item in items if item.get("type") == "function_call"),
                "function_call_outputs": sum(1 for item in items if item.get("type") == "function_call_output"),
                "reasoning_items": sum(1 for item in items if item.get("type") == "reasoning")}
    messages = [m for r in received if isinstance(r.body, dict) for m in r.body.get("messages") or ()]
    calls = [call for m in messages if m.get("role") == "assistant" for call in m.get("tool_calls") or ()]
    return {"tool_calls": len(calls),
            "tool_messages": sum(1 for m in messages if m.get("role") == "tool"),
            "thought_signatures": sum(1 for call in calls if (call.get("extra_content") or {}).get("google")),
            "reasoning_content": sum(1 for m in messages if m.get("role") == "assistant" and m.get("reasoning_content"))}


def _with_attribution(received) -> int:
    """How many requests carried Claude Code's attribution line to the upstream."""
    return sum(1 for r in received if ATTRIBUTION in str(r.body))


async def run_cli_session(reactor, *, claude: str, upstream: str = "responses", rounds: int = 2,
                          max_turns: int = 3, timeout: float = 60.0, seed: int = 7) -> dict:
    """Serve ``upstream`` and the relay on 127.0.0.1, run the CLI ``rounds`` times through them, give the figures."""
    folder = cli_folder("claude-code-openai-%s-" % (upstream,))
    upstreams = OpenAIUpstreams(reactor, upstream, seed, keep=rounds * (max_turns + 2) * 4)
    try:
        figures = await run_rounds(reactor, claude=claude, folder=folder, config_file=upstreams.config(folder),
                                   model=MODEL, rounds=rounds, max_turns=max_turns, timeout=timeout)
    finally:
        await upstreams.stop()
    simulator = upstreams.simulators["responses" if upstream == "responses" else "chat"]
    received = list(simulator.requests)
    figures.update({
        "upstream": upstream,
        "requests": len(received),
        "paths": sorted({r.path for r in received}),
        "off_the_protocol": off_the_protocol(upstream, received),
        "carried": carried(upstream, received),
        "attribution_sent": _with_attribution(received),
        **upstreams.reasoning_figures(),
    })
    shutil.rmtree(folder, ignore_errors=True)
    return figures


def print_figures(figures: dict) -> None:
    """The figures, a few lines an upstream."""
    print_rounds("%s (%s)" % (figures["upstream"], UPSTREAM_MODELS[figures["upstream"]]), figures)
    print("  the upstream received %d requests (%s); off its protocol: %s" % (
        figures["requests"], ", ".join(figures["paths"]), figures["off_the_protocol"] or "none"))
    print("  carried back: %s; the attribution line sent: %d times" % (
        ", ".join("%s %d" % item for item in figures["carried"].items()), figures["attribution_sent"]))
    print("  the upstream's reasoning sent back whole: %s %s" % (
        "yes" if figures.get("reasoning_ok") else "NO",
        figures.get("reasoning_problems") or figures.get("reasoning_totals") or ""))
    print_outcome(figures)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claude", default=os.environ.get(CLI_VARIABLE) or shutil.which("claude"),
                        help="the claude executable (default: $%s, else claude on the PATH)" % (CLI_VARIABLE,))
    parser.add_argument("--upstream", choices=UPSTREAMS + ("all",), default=None,
                        help="default: responses and gemini")
    parser.add_argument("--rounds", type=int, default=2, help="claude -p runs, each after the first with --continue")
    parser.add_argument("--max-turns", type=int, default=3, help="agentic turns a round")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one round may take")
    options = parser.parse_args(argv)
    if not options.claude:
        sys.exit("claude is not installed (npm install --prefix DIR @anthropic-ai/claude-code@%s), or give --claude"
                 % (CLI_VERSION,))
    chosen = {None: ("responses", "gemini"), "all": UPSTREAMS}.get(options.upstream, (options.upstream,))

    async def body(reactor):
        for upstream in chosen:
            print_figures(await run_cli_session(reactor, claude=options.claude, upstream=upstream,
                                                rounds=options.rounds, max_turns=options.max_turns,
                                                timeout=options.timeout))

    task.react(lambda reactor: defer.ensureDeferred(body(reactor)))


if __name__ == "__main__":
    main()
