# -*- test-case-name: tests.test_claude_code_clouds -*-
"""
The real Claude Code CLI through the relay against each simulated cloud
(issue 32, "Done when"). Not run by CI unless the CLI is installed (``.ci/run``
installs it)::

    npm install --prefix DIR @anthropic-ai/claude-code@2.1.332
    python -m bench.claude_code_clouds --claude DIR/node_modules/.bin/claude                # bedrock, vertex, foundry
    python -m bench.claude_code_clouds --claude ... --cloud vertex --rounds 3 --max-turns 5

In this process, on 127.0.0.1 only: the simulated cloud and the relay in
front of it, built by :class:`bench.clouds_session.Clouds` from a TOML file
as ``twistd relay --config`` builds it (Bedrock logged in to with SigV4,
Vertex with a service account through the simulated token endpoint, Foundry
with an API key). The CLI speaks Anthropic's API to the relay
(``ANTHROPIC_BASE_URL``); the relay speaks the cloud's wire to the cloud.

Each round is ``claude -p ... --model claude-opus-4-6`` with ``Read`` and
``Glob`` (:mod:`bench.claude_code`: a fresh ``HOME``, a dummy key, a proxy
trap); rounds after the first add ``--continue``, so the whole history,
thinking and tool ids included, goes back to the cloud. Opus 4.6 is what the
CLI asks for and what each cloud's wire serves (its aliases, ``opus`` and
the default, are 5.x models that InvokeModel does not serve); the CLI turns
adaptive thinking on for it by itself.

Printed: each round's result (the CLI's own JSON summary), what the cloud
received and whether every request was on the cloud's wire, the tool calls
and thinking blocks in the CLI's own transcript (ids it saw twice), the
relay's 4xx dumps, and what the trap caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from urllib.parse import quote

from twisted.internet import defer, task

from bench.claude_code import (
    CLI_VARIABLE,
    CLI_VERSION,
    CLIENT_KEY,
    blocks,
    cli_folder,
    print_outcome,
    print_rounds,
    run_rounds,
)
from bench.clouds_session import (
    AWS_KEY_ID,
    AWS_TOKEN,
    FOUNDRY_KEY,
    MODEL,
    PLATFORM_MODELS,
    PROJECT,
    Clouds,
    login_environment,
)

__all__ = ["BEDROCK_BETA_REFUSAL", "CLI_VARIABLE", "CLI_VERSION", "CLOUDS", "run_cli_session"]

CLOUDS = ("bedrock", "vertex", "foundry")
#: Bedrock refuses a body beta it does not take with this 400, not naming the
#: beta; the relay passes it on with its words, and the CLI sends the request
#: again without its newest betas.
BEDROCK_BETA_REFUSAL = "invalid beta flag"


def off_the_wire(cloud: str, received) -> list[str]:
    """What in each request ``cloud`` received is not on its own wire with the relay's login."""
    found = []
    for n, request in enumerate(received):
        body = request.body if isinstance(request.body, dict) else {}
        headers = request.headers
        wrong = []
        if cloud == "bedrock":
            model = quote(PLATFORM_MODELS["bedrock"], safe=":")
            if request.path not in ("/model/%s/invoke" % (model,), "/model/%s/invoke-with-response-stream" % (model,)):
                wrong.append("path %s" % (request.path,))
            if not headers.get("authorization", "").startswith(
                    "AWS4-HMAC-SHA256 Credential=%s/" % (AWS_KEY_ID,)) or headers.get("x-amz-security-token") != AWS_TOKEN:
                wrong.append("not signed with the session's SigV4 credentials")
            if body.get("anthropic_version") != "bedrock-2023-05-31" or "model" in body or "stream" in body:
                wrong.append("body not InvokeModel's")
            if "claude-code-20250219" not in body.get("anthropic_beta", ()):
                wrong.append("the CLI's betas not in the body")
        elif cloud == "vertex":
            prefix = "/v1/projects/%s/locations/global/publishers/anthropic/models/%s:" % (PROJECT, PLATFORM_MODELS["vertex"])
            if request.path not in (prefix + "rawPredict", prefix + "streamRawPredict"):
                wrong.append("path %s" % (request.path,))
            if not headers.get("authorization", "").startswith("Bearer ya29."):
                wrong.append("no access token from the token endpoint")
            if body.get("anthropic_version") != "vertex-2023-10-16" or "model" in body:
                wrong.append("body not rawPredict's")
        else:
            if request.path.split("?")[0] != "/anthropic/v1/messages":
                wrong.append("path %s" % (request.path,))
            if FOUNDRY_KEY not in (headers.get("x-api-key"), headers.get("api-key")):
                wrong.append("not the resource's key")
            if body.get("model") != PLATFORM_MODELS["foundry"]:
                wrong.append("model %r, not the deployment" % (body.get("model"),))
        if any(CLIENT_KEY in value for value in headers.values()):
            wrong.append("the CLI's own key reached the cloud")
        found.extend("%s request #%d: %s" % (cloud, n, what) for what in wrong)
    return found


def _messages(request) -> list:
    body = request.body if isinstance(request.body, dict) else {}
    messages = body.get("messages")
    return messages if isinstance(messages, list) else []


async def run_cli_session(reactor, *, claude: str, cloud: str, rounds: int = 2, max_turns: int = 3,
                          timeout: float = 60.0, seed: int = 7) -> dict:
    """Serve ``cloud`` and the relay on 127.0.0.1, run the CLI ``rounds`` times through them, give the figures."""
    folder = cli_folder("claude-code-%s-" % (cloud,))
    clouds = Clouds(reactor, (cloud,), folder, seed, turns=rounds * (max_turns + 2))
    try:
        with login_environment():
            figures = await run_rounds(reactor, claude=claude, folder=folder, config_file=clouds.config(folder),
                                       model=MODEL, rounds=rounds, max_turns=max_turns, timeout=timeout)
    finally:
        await clouds.stop()
    received = clouds.requests(cloud)
    figures.update({
        "cloud": cloud,
        "requests": len(received),
        "off_the_wire": off_the_wire(cloud, received),
        "refused_betas_sent": _refused_betas_sent(cloud, received),
        "requests_with_thinking_back": sum(1 for r in received if blocks(_messages(r), "thinking")),
        "answers_sent_back_without_thinking": sum(
            1 for r in received for m in _messages(r) if m.get("role") == "assistant" and not blocks([m], "thinking")),
    })
    shutil.rmtree(folder, ignore_errors=True)
    return figures


def _refused_betas_sent(cloud: str, received) -> int:
    """How many requests carried a beta the cloud refuses (Bedrock's body betas, Vertex's header)."""
    if cloud == "bedrock":
        from twisted_relay.simulated.bedrock_rules import BEDROCK_BETAS

        return sum(1 for r in received if set((r.body or {}).get("anthropic_beta", ())) - BEDROCK_BETAS)
    if cloud == "vertex":
        from twisted_relay.simulated.vertex import VERTEX_BETAS

        return sum(1 for r in received
                   if {b.strip() for b in r.headers.get("anthropic-beta", "").split(",") if b.strip()} - VERTEX_BETAS)
    return 0


def print_figures(figures: dict) -> None:
    """The figures, a few lines a cloud."""
    print_rounds(figures["cloud"], figures)
    print("  the cloud received %d requests; off its wire: %s; carrying betas it refuses: %d" % (
        figures["requests"], figures["off_the_wire"] or "none", figures["refused_betas_sent"]))
    print("  requests that brought thinking back: %d (answers in them without their thinking: %d)" % (
        figures["requests_with_thinking_back"], figures["answers_sent_back_without_thinking"]))
    print_outcome(figures)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claude", default=os.environ.get(CLI_VARIABLE) or shutil.which("claude"),
                        help="the claude executable (default: $%s, else claude on the PATH)" % (CLI_VARIABLE,))
    parser.add_argument("--cloud", choices=CLOUDS + ("all",), default="all")
    parser.add_argument("--rounds", type=int, default=2, help="claude -p runs, each after the first with --continue")
    parser.add_argument("--max-turns", type=int, default=3, help="agentic turns a round")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one round may take")
    options = parser.parse_args(argv)
    if not options.claude:
        sys.exit("claude is not installed (npm install --prefix DIR @anthropic-ai/claude-code@%s), or give --claude"
                 % (CLI_VERSION,))

    async def body(reactor):
        for cloud in CLOUDS if options.cloud == "all" else (options.cloud,):
            print_figures(await run_cli_session(reactor, claude=options.claude, cloud=cloud, rounds=options.rounds,
                                                max_turns=options.max_turns, timeout=options.timeout))

    task.react(lambda reactor: defer.ensureDeferred(body(reactor)))


if __name__ == "__main__":
    main()
