"""
The real Claude Code CLI through the relay, as the runs against simulated
upstreams drive it (:mod:`bench.claude_code_clouds`,
:mod:`bench.claude_code_openai`): a folder with a small project and a fresh
``HOME``, the relay started from a TOML file, ``claude -p`` run a few rounds
(each after the first with ``--continue``, so the whole history goes back),
and what the CLI's own transcript, the relay and a proxy trap saw.

The CLI gets a dummy key, a fresh ``HOME``, its non-essential traffic off,
and ``HTTPS_PROXY``/``HTTP_PROXY`` pointing at a trap on 127.0.0.1 that
records and refuses whatever it is asked to reach (``NO_PROXY`` lets it reach
the relay): it reaches nothing but 127.0.0.1, and a run shows what it tried.

Each round is ``claude -p ... --output-format json --model MODEL`` with only
the ``Read`` and ``Glob`` tools and ``--max-turns`` (a simulated model calls
a tool whenever it has one, so a round ends at its turn limit).
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

from twisted.internet import defer, error
from twisted.internet.protocol import ProcessProtocol
from twisted.web.resource import Resource
from twisted.web.server import Site

from bench.clouds_session import start_relay

#: The CLI these runs were written against (``.ci/run`` installs it).
CLI_VERSION = "2.1.332"
#: The environment variable ``.ci/run`` names the installed CLI in.
CLI_VARIABLE = "TWISTED_RELAY_CLAUDE_CODE"
#: The key the CLI sends the relay: it must never reach an upstream.
CLIENT_KEY = "sk-ant-cli-dummy-key-for-the-relay"
PROMPT = ("Look around this folder and report what you find.", "Go on, and look again.")
FILES = {"notes.txt": "Nothing to see here.\n", "src/app.py": "print('hello')\n", "README.md": "# A project\n"}


def installed_cli() -> tuple[str, str | None]:
    """The CLI ``$TWISTED_RELAY_CLAUDE_CODE`` names, and why it cannot run (``None``: it can), for tests to skip."""
    claude = os.environ.get(CLI_VARIABLE, "")
    if not claude:
        return claude, ("the Claude Code CLI is not installed: set $%s to its claude executable "
                        "(npm install --prefix DIR @anthropic-ai/claude-code@%s; .ci/run does)" % (CLI_VARIABLE, CLI_VERSION))
    if not os.access(claude, os.X_OK):
        return claude, "$%s names %s, which is not an executable" % (CLI_VARIABLE, claude)
    return claude, None


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


def conversation(entries: list[dict]) -> list[dict]:
    """The messages of a transcript (its other lines record requests, attachments, state)."""
    return [entry["message"] for entry in entries if entry.get("type") in ("user", "assistant")
            and isinstance(entry.get("message"), dict)]


def blocks(messages, kind: str) -> list[dict]:
    """The content blocks of type ``kind`` in ``messages``."""
    found = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            found.extend(block for block in content if isinstance(block, dict) and block.get("type") == kind)
    return found


def dumps(folder: str) -> list[dict]:
    """The relay's dumps in ``folder/dumps``: status, message, upstream, the upstream's request id."""
    found = []
    for path in sorted(glob.glob(os.path.join(folder, "dumps", "*", "*.json"))):
        with open(path, encoding="utf-8") as f:
            dump = json.load(f)
        found.append({"status": dump.get("status"), "message": (dump.get("error") or {}).get("message"),
                      "upstream": dump.get("upstream"), "upstream_request_id": dump.get("upstream_request_id")})
    return found


def cli_folder(prefix: str) -> str:
    """A new folder holding ``home`` (empty) and ``project`` (:data:`FILES`)."""
    folder = tempfile.mkdtemp(prefix=prefix)
    project = os.path.join(folder, "project")
    for name, text in FILES.items():
        os.makedirs(os.path.dirname(os.path.join(project, name)), exist_ok=True)
        with open(os.path.join(project, name), "w") as f:
            f.write(text)
    os.makedirs(os.path.join(folder, "home"))
    return folder


async def run_rounds(reactor, *, claude: str, folder: str, config_file: str, model: str, rounds: int,
                     max_turns: int, timeout: float) -> dict:
    """
    Start the relay of ``config_file`` and the trap on 127.0.0.1, run the CLI
    ``rounds`` times in ``folder`` (:func:`cli_folder`), stop them; the
    figures every run has: each round's result, the CLI's transcript (tool
    calls, results, ids seen twice, thinking blocks), the ids the relay
    renamed, its 4xx dumps and what the trap caught.
    """
    home = os.path.join(folder, "home")
    project = os.path.join(folder, "project")
    trap = Trap()
    trap_port = reactor.listenTCP(0, Site(trap), interface="127.0.0.1")
    trap_url = "http://127.0.0.1:%d" % (trap_port.getHost().port,)
    runs: list[Run] = []
    relay, base_url = start_relay(reactor, config_file)
    environment = cli_environment(home, base_url, trap_url)
    try:
        for n in range(rounds):
            argv = [claude, "-p", PROMPT[min(n, 1)], "--output-format", "json", "--model", model,
                    "--tools", "Read,Glob", "--allowedTools", "Read,Glob", "--max-turns", str(max_turns)]
            runs.append(await run_cli(reactor, argv + (["--continue"] if n else []), environment, project, timeout))
    finally:
        await relay.service.stopService()
        await trap_port.stopListening()
    version = await run_cli(reactor, [claude, "--version"], environment, project, timeout)
    # --continue keeps the session id: one transcript holds every round.
    sessions = dict.fromkeys(run.result.get("session_id") for run in runs if run.result.get("session_id"))
    seen = [message for session in sessions for message in conversation(transcript(home, session))]
    tool_ids = Counter(block.get("id") for block in blocks(seen, "tool_use"))
    registry = relay.metrics.registry
    return {
        "cli": version.stdout.strip(),
        "rounds": [{
            "exit": run.code, "seconds": round(run.seconds, 1), "timed_out": run.timed_out,
            **{key: run.result.get(key) for key in ("subtype", "terminal_reason", "num_turns", "is_error",
                                                    "api_error_status", "errors")},
            **({"result": str(run.result.get("result"))[:500]} if run.result.get("api_error_status") else {}),
            **({"stderr": run.stderr[-1000:]} if not run.result else {}),
        } for run in runs],
        "tool_uses": sum(tool_ids.values()),
        "tools": sorted({block.get("name") for block in blocks(seen, "tool_use")}),
        "tool_results": len(blocks(seen, "tool_result")),
        "duplicate_ids": sum(1 for count in tool_ids.values() if count > 1),
        "ids_renamed": registry.get_sample_value("relay_ids_rewritten_total", {"block_type": "tool_use"}) or 0,
        "thinking_blocks": len(blocks(seen, "thinking")),
        "dumps": dumps(folder),
        "outside": trap.caught,
    }


def print_rounds(name: str, figures: dict) -> None:
    """The lines every run prints: its rounds, the CLI's transcript; the dumps and the trap's catch come last."""
    print("%s (%s):" % (name, figures["cli"]))
    for n, run in enumerate(figures["rounds"]):
        print("  round %d: %s" % (n + 1, json.dumps(run)))
    print("  the CLI's transcript: %d tool calls (%s), %d results, %d thinking blocks; ids seen twice: %d "
          "(the relay renamed %d reused ones)" % (
              figures["tool_uses"], ", ".join(figures["tools"]), figures["tool_results"], figures["thinking_blocks"],
              figures["duplicate_ids"], figures["ids_renamed"]))


def print_outcome(figures: dict) -> None:
    """The relay's 4xx dumps and what the trap caught."""
    print("  4xx dumps: %s; the CLI tried to reach: %s" % (
        figures["dumps"] or "none", figures["outside"] or "nothing else"))
