"""
The real Claude Code CLI through the relay, one session crossing two
upstreams of different rules. Not run by CI (it needs the CLI)::

    npm install -g @anthropic-ai/claude-code      # or: --prefix DIR
    python bench/claude_code_crossing.py            # 6 rounds
    python bench/claude_code_crossing.py --claude DIR/bin/claude --rounds 10

In this process, on 127.0.0.1 and free ports only: two simulated upstreams
and the relay, whose configuration is read from a TOML file written here
(``[upstreams.kimi]`` with ``ids = "original"`` and ``own-ids``, and
``[upstreams.strict]``; models ``kimi-*`` go to the first, every other model
to the second), as ``twistd relay --config`` reads it.

- ``kimi`` answers like a Kimi-family backend: its calls are numbered
  ``functions.NAME:N`` within each answer, so the same ids come back every
  turn; it accepts them back and ids of Anthropic's alphabet.
- ``strict`` refuses, as Anthropic does, ids outside ``^[a-zA-Z0-9_-]+$`` and
  duplicate ids, and reuses ids of its own history now and then.
- Each signs its thinking blocks with its own secret and refuses thinking it
  did not sign (``MAX_THINKING_TOKENS`` turns thinking on in the CLI).

Then ``claude -p ... --output-format json`` runs once with ``--model
kimi-k2``, and then with ``--continue`` (the same session, its whole history)
alternately with ``--model claude-sonnet-4-5`` and ``kimi-k2``. The CLI gets
only the ``Read`` and ``Glob`` tools (the simulated models call them with
made-up arguments) and ``--max-turns`` bounds each round, since a simulated
model always calls a tool when it has one. The CLI runs with a dummy key,
``ANTHROPIC_BASE_URL`` pointing at the relay, a fresh ``HOME`` and its
non-essential traffic off: it reaches nothing but the relay.

Printed: each round's result (the CLI's own JSON summary), the requests each
upstream received, and every request checked again against that upstream's
rules. The run fails if a round ended with an API error, or an upstream
received a request it would refuse, or the relay dumped a 4xx.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

from twisted.internet import defer, task
from twisted.internet.threads import deferToThread
from twisted.web.server import Site

from targets import free_port  # bench/targets.py: this script runs from bench/
from twisted_relay.service import Relay
from twisted_relay.settings import read_settings
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.model import check_id_pattern, check_shape, check_strict_ids, check_thinking
from twisted_relay.translation import ANTHROPIC_ID_PATTERN

KIMI_OWN = r"functions\.[A-Za-z_]+:[0-9]+"
KIMI_ACCEPTS = r"^(%s|[a-zA-Z0-9_-]+)$" % (KIMI_OWN,)
SECRETS = {"kimi": "kimi-thinking-secret", "strict": "strict-thinking-secret"}
MODELS = ("kimi-k2", "claude-sonnet-4-5")

CONFIG = """\
[relay]
dump-dir = "{dumps}"

[upstreams.kimi]
url = "{kimi}"
ids = "original"
own-ids = '{own}'

[upstreams.strict]
url = "{strict}"
id-pattern = "default"

[[routes]]
models = ["kimi-*"]
targets = [{{ upstream = "kimi" }}]

[[routes]]
targets = [{{ upstream = "strict" }}]
"""


def _arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claude", default=shutil.which("claude"), help="the claude executable")
    parser.add_argument("--rounds", type=int, default=6, help="claude -p runs, the model switching each time")
    parser.add_argument("--max-turns", type=int, default=4, help="agentic turns per round")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one round may take")
    return parser.parse_args(argv)


def _serve(reactor, upstream: SimulatedUpstream) -> str:
    port = reactor.listenTCP(0, Site(upstream.resource()), interface="127.0.0.1")
    return "http://127.0.0.1:%d" % (port.getHost().port,)


def _ids(body) -> list[str]:
    return [
        block.get("id")
        for message in body.get("messages", [])
        if isinstance(message.get("content"), list)
        for block in message["content"]
        if isinstance(block, dict) and block.get("type") == "tool_use"
    ]


def _refusals(name: str, upstream: SimulatedUpstream) -> list[str]:
    """Every request ``upstream`` received that its rules refuse, checked again."""
    found = []
    for n, received in enumerate(upstream.requests):
        body = received.body
        if not received.path.startswith("/v1/messages") or "count_tokens" in received.path:
            continue
        try:
            check_shape(body, for_count=False)
            if name == "strict":
                check_id_pattern(body["messages"], ANTHROPIC_ID_PATTERN)
                check_strict_ids(body["messages"], check_pattern=False)
            else:
                check_id_pattern(body["messages"], KIMI_ACCEPTS)
                foreign = [i for i in _ids(body) if not re.fullmatch(KIMI_OWN, i)]
                if len(foreign) != len(set(foreign)):
                    raise ValueError("ids other upstreams made reached it twice")
            check_thinking(body, SECRETS[name])
        except Exception as e:
            found.append("%s request #%d: %s" % (name, n, getattr(e, "message", e)))
    return found


def _round(claude: str, folder: str, home: str, base_url: str, model: str, first: bool, max_turns: int,
           timeout: float) -> dict:
    prompt = "Look around this folder and report what you find." if first else "Go on, and look again."
    command = [claude, "-p", prompt, "--output-format", "json", "--model", model, "--tools", "Read,Glob",
               "--max-turns", str(max_turns)]
    if not first:
        command.append("--continue")
    environment = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": home,
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "sk-ant-dummy-key-for-the-relay",
        "MAX_THINKING_TOKENS": "1024",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    done = subprocess.run(command, cwd=folder, env=environment, capture_output=True, text=True, timeout=timeout)
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        result = {"unparsed_stdout": done.stdout[-2000:]}
    result["exit_status"] = done.returncode
    if done.returncode and done.stderr:
        result["stderr"] = done.stderr[-2000:]
    return result


async def _main(reactor, options) -> int:
    folder = tempfile.mkdtemp(prefix="claude-crossing-")
    home = os.path.join(folder, "home")
    project = os.path.join(folder, "project")
    for path in (home, project):
        os.makedirs(path)
    with open(os.path.join(project, "notes.txt"), "w") as f:
        f.write("Nothing to see here.\n")
    upstreams = {
        "kimi": SimulatedUpstream(reactor=reactor, mode="lenient", seed=21, id_style="kimi", id_pattern=KIMI_ACCEPTS,
                                  thinking_secret=SECRETS["kimi"], keep_requests=10000),
        "strict": SimulatedUpstream(reactor=reactor, mode="strict", seed=22, id_pattern=ANTHROPIC_ID_PATTERN,
                                    thinking_secret=SECRETS["strict"], keep_requests=10000),
    }
    urls = {name: _serve(reactor, upstream) for name, upstream in upstreams.items()}
    dumps = os.path.join(folder, "dumps")
    config_file = os.path.join(folder, "relay.toml")
    with open(config_file, "w") as f:
        f.write(CONFIG.format(dumps=dumps, kimi=urls["kimi"], strict=urls["strict"], own=KIMI_OWN))
    # Served as twistd relay serves it, from the same command line and file.
    port = free_port()
    relay = Relay(read_settings({"listen": ["tcp:%d:interface=127.0.0.1" % (port,)]}, config_file), reactor)
    relay.service.privilegedStartService()
    relay.service.startService()
    base_url = "http://127.0.0.1:%d" % (port,)
    print("configuration:\n" + textwrap.indent(open(config_file).read(), "    "))
    failed = []
    try:
        for n in range(options.rounds):
            model = MODELS[n % 2]
            result = await deferToThread(
                _round, options.claude, project, home, base_url, model, n == 0, options.max_turns, options.timeout
            )
            shown = {k: result.get(k) for k in ("subtype", "is_error", "num_turns", "exit_status", "session_id")}
            print("round %d (%s): %s" % (n + 1, model, json.dumps(shown)))
            if result.get("subtype") not in ("success", "error_max_turns") or "stderr" in result:
                failed.append("round %d: %s" % (n + 1, json.dumps(result)[:2000]))
    finally:
        await relay.service.stopService()
    for name, upstream in upstreams.items():
        messages = [r for r in upstream.requests if r.path.startswith("/v1/messages") and "count" not in r.path]
        models = sorted({str(r.body.get("model")) for r in messages})
        thinking = sum(1 for r in messages if isinstance(r.body.get("thinking"), dict))
        own = sum(1 for r in messages for i in _ids(r.body) if re.fullmatch(KIMI_OWN, i or ""))
        encoded = sum(1 for r in messages for i in _ids(r.body) if (i or "").startswith("twr_"))
        print("%s: %d requests (%d with thinking; models %s); tool_use ids sent: %d Kimi-form, %d encoded"
              % (name, len(messages), thinking, ", ".join(models), own, encoded))
        failed.extend(_refusals(name, upstream))
    written = [name for _, _, names in os.walk(dumps) for name in names] if os.path.isdir(dumps) else []
    print("dumps of upstream 4xx answers: %d" % (len(written),))
    if written:
        failed.append("the relay dumped %d 4xx answers (in %s)" % (len(written), dumps))
    for line in failed:
        print("FAILED: " + line)
    if not failed:
        shutil.rmtree(folder, ignore_errors=True)
    print("result: %s" % ("every round ran, every request was valid for its upstream" if not failed else "failed"))
    return 1 if failed else 0


def main(argv=None) -> None:
    options = _arguments(argv)
    if not options.claude:
        sys.exit("claude is not installed (npm install -g @anthropic-ai/claude-code), or give --claude")
    outcome = []

    async def run(reactor):
        outcome.append(await _main(reactor, options))

    task.react(lambda reactor: defer.ensureDeferred(run(reactor)))
    sys.exit(outcome[0] if outcome else 1)


if __name__ == "__main__":
    main()
