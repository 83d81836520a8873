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

Each round is ``claude -p ... --output-format json --model claude-opus-4-6``
with only the ``Read`` and ``Glob`` tools and ``--max-turns`` (the simulated
model calls a tool whenever it has one, so a round ends at its turn limit);
rounds after the first add ``--continue``, so the whole history, thinking
and tool ids included, goes back to the cloud. Opus 4.6 is what the CLI asks
for and what each cloud's wire serves (its aliases, ``opus`` and the
default, are 5.x models that InvokeModel does not serve); the CLI turns
adaptive thinking on for it by itself.

The CLI gets a dummy key, a fresh ``HOME``, its non-essential traffic off,
and ``HTTPS_PROXY``/``HTTP_PROXY`` pointing at a trap on 127.0.0.1 that
records and refuses whatever it is asked to reach (``NO_PROXY`` lets it reach
the relay): it reaches nothing but 127.0.0.1, and a run shows what it tried.

Printed: each round's result (the CLI's own JSON summary), what the cloud
received and whether every request was on the cloud's wire, the tool calls
and thinking blocks in the CLI's own transcript (ids it saw twice), the
relay's 4xx dumps, and what the trap caught.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from urllib.parse import quote

from twisted.internet import defer, error, task
from twisted.internet.protocol import ProcessProtocol
from twisted.web.resource import Resource
from twisted.web.server import Site

from bench.clouds_session import (
    AWS_KEY_ID,
    AWS_TOKEN,
    FOUNDRY_KEY,
    MODEL,
    PLATFORM_MODELS,
    PROJECT,
    Clouds,
    login_environment,
    start_relay,
)

#: The CLI these runs were written against (``.ci/run`` installs it).
CLI_VERSION = "2.1.332"
#: The environment variable ``.ci/run`` names the installed CLI in.
CLI_VARIABLE = "TWISTED_RELAY_CLAUDE_CODE"
CLOUDS = ("bedrock", "vertex", "foundry")
#: The key the CLI sends the relay: it must never reach a cloud.
CLIENT_KEY = "sk-ant-cli-dummy-key-for-the-relay"
#: Bedrock refuses a body beta it does not take with this 400, not naming the
#: beta; the relay passes it on with its words, and the CLI sends the request
#: again without its newest betas.
BEDROCK_BETA_REFUSAL = "invalid beta flag"
PROMPT = ("Look around this folder and report what you find.", "Go on, and look again.")
FILES = {"notes.txt": "Nothing to see here.\n", "src/app.py": "print('hello')\n", "README.md": "# A project\n"}


class Trap(Resource):
    """A forward proxy that forwards nothing: it records each request (a ``CONNECT`` too) and refuses it."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.caught: list[str] = []

    def render(self, request):
        self.caught.append("%s %s" % (request.method.decode("latin-1"), request.uri.decode("latin-1")))
        request.setResponseCode(403)
        return b""


@dataclass
class Run:
    """One CLI process: its exit, its output, and its JSON result."""

    code: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    result: dict


class _Output(ProcessProtocol):
    """A child's output, and its exit code when it has ended."""

    def __init__(self, ended: defer.Deferred):
        self.ended = ended
        self.out: list[bytes] = []
        self.err: list[bytes] = []

    def outReceived(self, data: bytes) -> None:
        self.out.append(data)

    def errReceived(self, data: bytes) -> None:
        self.err.append(data)

    def processEnded(self, reason) -> None:
        self.ended.callback(reason.value.exitCode)


async def run_cli(reactor, argv: list[str], environment: dict, folder: str, timeout: float) -> Run:
    """Run ``argv`` in ``folder`` with only ``environment``; killed (by its pid) after ``timeout`` seconds."""
    ended: defer.Deferred = defer.Deferred()
    output = _Output(ended)
    started = time.monotonic()
    process = reactor.spawnProcess(output, argv[0], argv, env=environment, path=folder)
    # An open stdin is input to come: claude -p would wait 3 s for it.
    process.closeStdin()
    timed_out = []

    def kill() -> None:
        timed_out.append(True)
        try:
            process.signalProcess("KILL")
        except error.ProcessExitedAlready:
            pass

    timer = reactor.callLater(timeout, kill)
    try:
        code = await ended
    finally:
        if timer.active():
            timer.cancel()
    stdout = b"".join(output.out).decode("utf-8", "replace")
    try:
        result = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        result = {}
    return Run(code, stdout, b"".join(output.err).decode("utf-8", "replace"), time.monotonic() - started,
               bool(timed_out), result if isinstance(result, dict) else {})


def cli_environment(home: str, base_url: str, trap_url: str) -> dict:
    """All the CLI gets: nothing of this process's own environment but ``PATH``."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": home,
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": CLIENT_KEY,
        # No update checks, telemetry, error reports, release notes...
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        # Anything else goes to the trap.
        "HTTPS_PROXY": trap_url,
        "HTTP_PROXY": trap_url,
        "NO_PROXY": "127.0.0.1",
    }


def transcript(home: str, session_id: str | None) -> list[dict]:
    """The CLI's own record of a session (``~/.claude/projects/*/SESSION.jsonl``), line by line."""
    entries: list[dict] = []
    for path in glob.glob(os.path.join(home, ".claude", "projects", "*", "%s.jsonl" % (session_id,))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    entries.append(json.loads(line))
                except ValueError:
                    continue
    return entries


def _conversation(entries: list[dict]) -> list[dict]:
    """The messages of a transcript (its other lines record requests, attachments, state)."""
    return [entry["message"] for entry in entries if entry.get("type") in ("user", "assistant")
            and isinstance(entry.get("message"), dict)]


def _blocks(messages, kind: str) -> list[dict]:
    """The content blocks of type ``kind`` in ``messages``."""
    found = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            found.extend(block for block in content if isinstance(block, dict) and block.get("type") == kind)
    return found


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


def _dumps(folder: str) -> list[dict]:
    found = []
    for path in sorted(glob.glob(os.path.join(folder, "dumps", "*", "*.json"))):
        with open(path, encoding="utf-8") as f:
            dump = json.load(f)
        found.append({"status": dump.get("status"), "message": (dump.get("error") or {}).get("message"),
                      "upstream": dump.get("upstream"), "upstream_request_id": dump.get("upstream_request_id")})
    return found


async def run_cli_session(reactor, *, claude: str, cloud: str, rounds: int = 2, max_turns: int = 3,
                          timeout: float = 60.0, seed: int = 7) -> dict:
    """Serve ``cloud`` and the relay on 127.0.0.1, run the CLI ``rounds`` times through them, give the figures."""
    folder = tempfile.mkdtemp(prefix="claude-code-%s-" % (cloud,))
    home = os.path.join(folder, "home")
    project = os.path.join(folder, "project")
    for name, text in FILES.items():
        os.makedirs(os.path.dirname(os.path.join(project, name)), exist_ok=True)
        with open(os.path.join(project, name), "w") as f:
            f.write(text)
    os.makedirs(home)
    clouds = Clouds(reactor, (cloud,), folder, seed, turns=rounds * (max_turns + 2))
    trap = Trap()
    trap_port = reactor.listenTCP(0, Site(trap), interface="127.0.0.1")
    trap_url = "http://127.0.0.1:%d" % (trap_port.getHost().port,)
    runs: list[Run] = []
    with login_environment():
        relay, base_url = start_relay(reactor, clouds.config(folder))
        try:
            for n in range(rounds):
                argv = [claude, "-p", PROMPT[min(n, 1)], "--output-format", "json", "--model", MODEL,
                        "--tools", "Read,Glob", "--allowedTools", "Read,Glob", "--max-turns", str(max_turns)]
                runs.append(await run_cli(reactor, argv + (["--continue"] if n else []),
                                          cli_environment(home, base_url, trap_url), project, timeout))
        finally:
            await relay.service.stopService()
            await clouds.stop()
            await trap_port.stopListening()
    received = clouds.requests(cloud)
    # --continue keeps the session id: one transcript holds every round.
    sessions = dict.fromkeys(run.result.get("session_id") for run in runs if run.result.get("session_id"))
    seen = [message for session in sessions for message in _conversation(transcript(home, session))]
    tool_ids = Counter(block.get("id") for block in _blocks(seen, "tool_use"))
    registry = relay.metrics.registry
    version = await run_cli(reactor, [claude, "--version"], cli_environment(home, base_url, trap_url), project, timeout)
    figures = {
        "cloud": cloud,
        "cli": version.stdout.strip(),
        "rounds": [{
            "exit": run.code, "seconds": round(run.seconds, 1), "timed_out": run.timed_out,
            **{key: run.result.get(key) for key in ("subtype", "terminal_reason", "num_turns", "is_error",
                                                    "api_error_status", "errors")},
            **({"result": str(run.result.get("result"))[:500]} if run.result.get("api_error_status") else {}),
            **({"stderr": run.stderr[-1000:]} if not run.result else {}),
        } for run in runs],
        "requests": len(received),
        "off_the_wire": off_the_wire(cloud, received),
        "refused_betas_sent": _refused_betas_sent(cloud, received),
        "tool_uses": sum(tool_ids.values()),
        "tools": sorted({block.get("name") for block in _blocks(seen, "tool_use")}),
        "tool_results": len(_blocks(seen, "tool_result")),
        "duplicate_ids": sum(1 for count in tool_ids.values() if count > 1),
        "ids_renamed": registry.get_sample_value("relay_ids_rewritten_total", {"block_type": "tool_use"}) or 0,
        "thinking_blocks": len(_blocks(seen, "thinking")),
        "requests_with_thinking_back": sum(1 for r in received if _blocks(_messages(r), "thinking")),
        "answers_sent_back_without_thinking": sum(
            1 for r in received for m in _messages(r) if m.get("role") == "assistant" and not _blocks([m], "thinking")),
        "dumps": _dumps(folder),
        "outside": trap.caught,
    }
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
    print("%s (%s):" % (figures["cloud"], figures["cli"]))
    for n, run in enumerate(figures["rounds"]):
        print("  round %d: %s" % (n + 1, json.dumps(run)))
    print("  the cloud received %d requests; off its wire: %s; carrying betas it refuses: %d" % (
        figures["requests"], figures["off_the_wire"] or "none", figures["refused_betas_sent"]))
    print("  the CLI's transcript: %d tool calls (%s), %d results, %d thinking blocks; ids seen twice: %d "
          "(the relay renamed %d reused ones)" % (
              figures["tool_uses"], ", ".join(figures["tools"]), figures["tool_results"], figures["thinking_blocks"],
              figures["duplicate_ids"], figures["ids_renamed"]))
    print("  requests that brought thinking back: %d (answers in them without their thinking: %d)" % (
        figures["requests_with_thinking_back"], figures["answers_sent_back_without_thinking"]))
    print("  4xx dumps: %s; the CLI tried to reach: %s" % (
        figures["dumps"] or "none", figures["outside"] or "nothing else"))


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
