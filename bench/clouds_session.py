# -*- test-case-name: tests.test_clouds_session -*-
"""
A long tool-use session through the relay against the simulated clouds
(issue 32, "Done when"): the official ``anthropic`` SDK, thinking adaptive,
streamed and whole turns alternating, a model whose upstream reuses tool-use
ids. All on 127.0.0.1, in this process::

    python -m bench.clouds_session --cloud bedrock            # 300 turns
    python -m bench.clouds_session --cloud vertex
    python -m bench.clouds_session --cloud foundry
    python -m bench.clouds_session --cloud switch             # Anthropic, then Bedrock, then Vertex

Each cloud is its simulator (:mod:`twisted_relay.simulated`), logged in to
as the relay logs in to the real one: Bedrock with SigV4 (temporary
credentials from the environment), Vertex with a service account's key file
through the simulated Google token endpoint, Foundry with an API key. The
relay is built as ``twistd relay --config`` builds it, from a TOML file
written here; the client asks for ``claude-opus-4-6``, which each upstream's
model map names in the platform's words (a Bedrock inference profile).

``switch``: one route whose targets are the simulated Anthropic API, then
Bedrock, then Vertex. A third into the session the Anthropic upstream
answers every request with 529 (overloaded), two thirds in Bedrock answers
429 (throttled): the conversation moves on only by failover, before the
first byte of an answer.

Printed: turns, failed turns, tool-use ids the client saw twice, and for
each upstream the turns it served, the answers with thinking, and whether
it got its own thinking back at every turn it served (the requests it
received held every thinking block it had made earlier, by signature).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

from twisted.internet import defer, task
from twisted.internet.threads import deferToThread
from twisted.web.resource import Resource
from twisted.web.server import Site

from bench.targets import free_port
from bench.todays_api_session import thinking_signatures
from twisted_relay.service import Relay
from twisted_relay.settings import read_settings
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.translation import ANTHROPIC_ID_PATTERN, read_mark

MODEL = "claude-opus-4-6"
#: The model each upstream is asked for, in its platform's words.
PLATFORM_MODELS = {"anthropic": MODEL, "bedrock": "global.anthropic.claude-opus-4-6-v1", "vertex": MODEL,
                   "foundry": "opus-46-deployment"}
SYSTEM = "You are a careful agent. Check the weather wherever you are asked."
FIRST = "Check the weather in every city of Europe, one call at a time, and keep going."
TOOLS = [{
    "name": "get_weather",
    "description": "Weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}]
# The simulated clouds' credentials (made up here; nothing real).
AWS_KEY_ID = "ASIASIMULATEDKEY0001"
AWS_SECRET = "simulated/secret/access/key/0001"
AWS_TOKEN = "simulated-session-token-0001"
FOUNDRY_KEY = "simulated-foundry-key-0001"
ANTHROPIC_KEY = "sk-sim-anthropic-key-0001"
PROJECT = "sim-project"
SERVICE_ACCOUNT = "relay@sim-project.iam.gserviceaccount.com"
#: Where the Bedrock upstream's login reads its keys (``env:`` in its login table).
LOGIN_ENVIRON = {"SIM_AWS_ACCESS_KEY_ID": AWS_KEY_ID, "SIM_AWS_SECRET_ACCESS_KEY": AWS_SECRET,
                 "SIM_AWS_SESSION_TOKEN": AWS_TOKEN}

UPSTREAM_TABLES = {
    "anthropic": """
[upstreams.anthropic]
url = "{url}"
keys = ["{anthropic_key}"]
""",
    "bedrock": """
[upstreams.bedrock]
wire = "bedrock"
url = "{url}"
region = "us-east-1"
login = {{ kind = "aws", access-key-id = "env:SIM_AWS_ACCESS_KEY_ID", secret-access-key = "env:SIM_AWS_SECRET_ACCESS_KEY", session-token = "env:SIM_AWS_SESSION_TOKEN" }}
models = {{ "{model}" = "{bedrock_model}" }}
""",
    "vertex": """
[upstreams.vertex]
wire = "vertex"
url = "{url}"
project = "{project}"
region = "global"
login = {{ kind = "google", credentials = "{credentials}" }}
""",
    "foundry": """
[upstreams.foundry]
url = "{url}/anthropic"
keys = ["{foundry_key}"]
models = {{ "{model}" = "{foundry_model}" }}
""",
}


class Wall(Resource):
    """A simulator's resource behind a wall that answers every request with ``status`` once it is up."""

    isLeaf = True

    def __init__(self, inner: Resource, status: int, body: bytes, headers: dict[bytes, bytes]):
        super().__init__()
        self.inner = inner
        self.status = status
        self.body = body
        self.headers = headers
        self.up = False
        self.refusals = 0

    def render(self, request):
        if not self.up:
            return self.inner.render(request)
        self.refusals += 1
        request.setResponseCode(self.status)
        for name, value in self.headers.items():
            request.setHeader(name, value)
        return self.body


@dataclass
class Turn:
    """What the client saw of one turn."""

    number: int
    streamed: bool
    upstream: str | None = None
    error: str | None = None
    tool_ids: list = field(default_factory=list)
    #: the thinking blocks' signatures, as the client got them
    thinking: list = field(default_factory=list)
    #: how many requests each upstream had received when the turn ended
    received: dict = field(default_factory=dict)


def session(base_url: str, turns: int, deadline: float, between) -> list[Turn]:
    """Whole (even) and streamed (odd) turns with tool results; runs in a thread."""
    import anthropic

    client = anthropic.Anthropic(base_url=base_url, api_key="sk-client", max_retries=0, timeout=60)
    messages: list = [{"role": "user", "content": FIRST}]
    done: list[Turn] = []
    try:
        for number in range(turns):
            if time.monotonic() > deadline:
                break
            between(number)
            turn = Turn(number, streamed=number % 2 == 1)
            request = dict(model=MODEL, max_tokens=512, system=SYSTEM, tools=TOOLS, messages=messages,
                           thinking={"type": "adaptive"})
            try:
                if turn.streamed:
                    with client.messages.stream(**request) as events:
                        turn.upstream = events.response.headers.get("x-relay-upstream")
                        message = events.get_final_message()
                else:
                    raw = client.messages.with_raw_response.create(**request)
                    turn.upstream = raw.headers.get("x-relay-upstream")
                    message = raw.parse()
            except anthropic.APIError as caught:
                body = getattr(caught, "body", None)
                text = body.get("error", {}).get("message") if isinstance(body, dict) else str(caught)
                turn.error = "%s %s" % (getattr(caught, "status_code", type(caught).__name__), str(text)[:300])
            else:
                content = [block.model_dump(exclude_none=True) for block in message.content]
                turn.tool_ids = [block.id for block in message.content if block.type == "tool_use"]
                turn.thinking = [block.signature for block in message.content if block.type == "thinking"]
                messages.append({"role": "assistant", "content": content})
                results = [{"type": "tool_result", "tool_use_id": i, "content": "sunny"} for i in turn.tool_ids]
                messages.append({"role": "user", "content": results or "Go on."})
            turn.received = between(None)
            done.append(turn)
    finally:
        client.close()
    return done


def own_thinking_back(name: str, requests: list, done: list[Turn]) -> dict:
    """
    For each turn ``name`` served, whether the request that got its answer
    held every thinking block ``name`` had made earlier in the conversation
    (compared by the signature it made).
    """
    made: list = []
    turns = missing_turns = missing_blocks = 0
    for turn in done:
        if turn.upstream != name or turn.error is not None:
            continue
        turns += 1
        sent = thinking_signatures(requests[turn.received[name] - 1].body)
        lost = [signature for signature in made if signature not in sent]
        missing_turns += bool(lost)
        missing_blocks += len(lost)
        for signature in turn.thinking:
            marked = read_mark(signature)
            made.append(marked[1] if marked is not None else signature)
    return {"turns_served": turns, "answers_with_thinking": sum(1 for t in done if t.upstream == name and t.thinking),
            "turns_missing_own_thinking": missing_turns, "own_blocks_missing": missing_blocks,
            "own_blocks_made": len(made)}


class Clouds:
    """The simulated clouds a session needs, served on 127.0.0.1, and what each received."""

    def __init__(self, reactor, names: tuple[str, ...], folder: str, seed: int, turns: int):
        self.names = names
        self.walls: dict[str, Wall] = {}
        self._requests = {}
        self._ports = []
        self.urls: dict[str, str] = {}
        self.values = {"model": MODEL, "bedrock_model": PLATFORM_MODELS["bedrock"], "project": PROJECT,
                       "foundry_key": FOUNDRY_KEY, "foundry_model": PLATFORM_MODELS["foundry"],
                       "anthropic_key": ANTHROPIC_KEY}
        keep = turns * 3 + 100
        for offset, name in enumerate(names):
            upstream = SimulatedUpstream(reactor=reactor, mode="strict", seed=seed + offset,
                                         id_pattern=ANTHROPIC_ID_PATTERN, thinking_secret="%s-thinking" % (name,),
                                         keep_requests=keep)
            resource, requests = getattr(self, "_" + name)(reactor, upstream, folder, keep)
            if name in ("anthropic", "bedrock"):
                status, body, headers = _WALLS[name]
                resource = self.walls[name] = Wall(resource, status, body, headers)
            port = reactor.listenTCP(0, Site(resource), interface="127.0.0.1")
            self._ports.append(port)
            self.urls[name] = "http://127.0.0.1:%d" % (port.getHost().port,)
            self._requests[name] = requests
        if "vertex" in names:
            self._write_service_account(folder)

    def _anthropic(self, reactor, upstream, folder, keep):
        return upstream.resource(), lambda: [r for r in upstream.requests
                                             if r.path.startswith("/v1/messages") and "count_tokens" not in r.path]

    def _bedrock(self, reactor, upstream, folder, keep):
        from twisted_relay.simulated.bedrock import SimulatedBedrock
        from twisted_relay.simulated.bedrock_auth import AwsCredential

        credential = AwsCredential(AWS_SECRET, session_token=AWS_TOKEN)
        bedrock = SimulatedBedrock(upstream, access_keys={AWS_KEY_ID: credential}, keep_requests=keep)
        return bedrock.resource(), lambda: [r for r in bedrock.requests if "count-tokens" not in r.path]

    def _vertex(self, reactor, upstream, folder, keep):
        from twisted_relay.simulated.google_tokens import SimulatedGoogleTokens
        from twisted_relay.simulated.vertex import SimulatedVertex

        self._tokens = SimulatedGoogleTokens(reactor=reactor)
        vertex = SimulatedVertex(upstream, PROJECT, self._tokens)
        return vertex.resource(), lambda: [r for r in upstream.requests
                                           if "Predict" in r.path and "count-tokens" not in r.path]

    def _foundry(self, reactor, upstream, folder, keep):
        from twisted_relay.simulated.foundry import Deployment, SimulatedFoundry

        foundry = SimulatedFoundry(upstream, keys=(FOUNDRY_KEY,), keep_requests=keep,
                                   deployments={PLATFORM_MODELS["foundry"]: Deployment(MODEL)})
        return foundry.resource(), lambda: [r for r in foundry.requests
                                            if r.path.startswith("/anthropic/v1/messages") and "count" not in r.path]

    def _write_service_account(self, folder: str) -> None:
        from twisted_relay.simulated.google_tokens import make_service_account

        account = make_service_account(SERVICE_ACCOUNT, PROJECT, token_uri=self.urls["vertex"] + "/token")
        self._tokens.add_service_account(account.email, account.public_key)
        path = os.path.join(folder, "service-account.json")
        with open(path, "w") as f:
            json.dump(account.info, f)
        os.chmod(path, 0o600)
        self.values["credentials"] = path

    def requests(self, name: str) -> list:
        return self._requests[name]()

    def config(self, folder: str) -> str:
        """The relay's TOML file: every cloud an upstream, one route through them in order."""
        tables = [UPSTREAM_TABLES[name].format(url=self.urls[name], **self.values) for name in self.names]
        targets = ", ".join('{ upstream = "%s" }' % (name,) for name in self.names)
        text = '[relay]\ndump-dir = "%s"\n%s\n[[routes]]\ntargets = [%s]\n' % (
            os.path.join(folder, "dumps"), "".join(tables), targets)
        path = os.path.join(folder, "relay.toml")
        with open(path, "w") as f:
            f.write(text)
        return path

    async def stop(self) -> None:
        for port in self._ports:
            await port.stopListening()


@contextmanager
def login_environment():
    """:data:`LOGIN_ENVIRON` in ``os.environ`` while it lasts; the variables as they were after."""
    former = {name: os.environ.get(name) for name in LOGIN_ENVIRON}
    os.environ.update(LOGIN_ENVIRON)
    try:
        yield
    finally:
        for name, value in former.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_relay(reactor, config_file: str) -> tuple[Relay, str]:
    """The relay ``twistd relay --config config_file`` serves, started on a free 127.0.0.1 port; and its URL."""
    port = free_port()
    config = read_settings({"listen": ["tcp:%d:interface=127.0.0.1" % (port,)]}, config_file)
    relay = Relay(config.with_changes(drain_delay=0.0), reactor)
    relay.service.privilegedStartService()
    relay.service.startService()
    return relay, "http://127.0.0.1:%d" % (port,)


_WALLS = {
    "anthropic": (529, b'{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}',
                  {b"content-type": b"application/json"}),
    "bedrock": (429, b'{"message": "Too many requests, please wait before trying again."}',
                {b"content-type": b"application/json",
                 b"x-amzn-errortype": b"ThrottlingException:http://internal.amazon.com/coral/com.amazon.bedrock/"}),
}
CLOUDS = {"bedrock": ("bedrock",), "vertex": ("vertex",), "foundry": ("foundry",),
          "switch": ("anthropic", "bedrock", "vertex")}


async def run_session(reactor, *, cloud: str = "bedrock", turns: int = 300, time_limit: float = 900.0,
                      seed: int = 7) -> dict:
    """Serve the clouds and the relay on 127.0.0.1, run the session, stop everything, give the figures."""
    folder = tempfile.mkdtemp(prefix="clouds-session-")
    names = CLOUDS[cloud]
    clouds = Clouds(reactor, names, folder, seed, turns)
    environ = {"SIM_AWS_ACCESS_KEY_ID": AWS_KEY_ID, "SIM_AWS_SECRET_ACCESS_KEY": AWS_SECRET,
               "SIM_AWS_SESSION_TOKEN": AWS_TOKEN}
    former = {name: os.environ.get(name) for name in environ}
    os.environ.update(environ)
    port = free_port()
    config = read_settings({"listen": ["tcp:%d:interface=127.0.0.1" % (port,)]}, clouds.config(folder))
    relay = Relay(config.with_changes(drain_delay=0.0), reactor)
    relay.service.privilegedStartService()
    relay.service.startService()

    def between(number):
        """Before turn ``number`` (``switch``: walls go up); with ``None``: the request counts of each upstream."""
        if number is not None and cloud == "switch":
            if number == turns // 3:
                clouds.walls["anthropic"].up = True
            if number == 2 * turns // 3:
                clouds.walls["bedrock"].up = True
        return {name: len(clouds.requests(name)) for name in names}

    started = time.monotonic()
    try:
        done = await deferToThread(session, "http://127.0.0.1:%d" % (port,), turns, started + time_limit, between)
        seconds = time.monotonic() - started
    finally:
        await relay.service.stopService()
        await clouds.stop()
        for name, value in former.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    ids = Counter(i for turn in done for i in turn.tool_ids)
    registry = relay.metrics.registry
    figures = {
        "ids_renamed": registry.get_sample_value("relay_ids_rewritten_total", {"block_type": "tool_use"}) or 0,
        "cloud": cloud, "turns": len(done), "turns_asked": turns, "seconds": round(seconds, 1),
        "failed_turns": sum(1 for turn in done if turn.error is not None),
        "errors": ["turn %d (%s): %s" % (turn.number, turn.upstream, turn.error) for turn in done if turn.error][:5],
        "duplicate_ids": sum(1 for n in ids.values() if n > 1),
        "streamed_turns": sum(1 for turn in done if turn.streamed),
        "upstreams": {name: own_thinking_back(name, clouds.requests(name), done) for name in names},
        "order": [str(name) for name, _ in _runs(turn.upstream for turn in done)],
        "refusals": {name: wall.refusals for name, wall in clouds.walls.items()},
    }
    shutil.rmtree(folder, ignore_errors=True)
    return figures


def _runs(values):
    """Consecutive runs of equal values: (value, length)."""
    runs: list = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return runs


def print_figures(figures: dict) -> None:
    """The figures, one line each."""
    print("cloud: %s; turns: %d/%d (%d streamed) in %s s" % (
        figures["cloud"], figures["turns"], figures["turns_asked"], figures["streamed_turns"], figures["seconds"]))
    print("failed turns: %d" % (figures["failed_turns"],))
    for line in figures["errors"]:
        print("  " + line)
    print("duplicate tool-use ids seen by the client: %d (the relay renamed %d reused ones)" % (
        figures["duplicate_ids"], figures["ids_renamed"]))
    for name, f in figures["upstreams"].items():
        print("%s: %d turns served, %d answers with thinking; own thinking back at every turn: %s "
              "(%d turns missing %d of its %d blocks)" % (
                  name, f["turns_served"], f["answers_with_thinking"],
                  "yes" if not f["turns_missing_own_thinking"] else "NO",
                  f["turns_missing_own_thinking"], f["own_blocks_missing"], f["own_blocks_made"]))
    print("upstreams in order: %s; refusals behind the walls: %s" % (
        " -> ".join(figures["order"]), figures["refusals"]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cloud", choices=tuple(CLOUDS), default="bedrock")
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds; the session stops after them")
    parser.add_argument("--seed", type=int, default=7)
    options = parser.parse_args(argv)

    async def body(reactor):
        print_figures(await run_session(reactor, cloud=options.cloud, turns=options.turns,
                                        time_limit=options.time_limit, seed=options.seed))

    task.react(lambda reactor: defer.ensureDeferred(body(reactor)))


if __name__ == "__main__":
    main()
