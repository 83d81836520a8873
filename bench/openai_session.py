# -*- test-case-name: tests.test_openai_session -*-
"""
A long tool-use session through the relay against models that speak only
OpenAI's protocols (issue 33, "Done when"): the official ``anthropic`` SDK,
thinking adaptive, whole and streamed turns alternating, ids the upstream
reuses. All on 127.0.0.1, in this process::

    python -m bench.openai_session --upstream responses        # 300 turns, GPT on the Responses API
    python -m bench.openai_session --upstream deepseek         # a Chat Completions dialect
    python -m bench.openai_session --upstream alternate        # Anthropic and Responses, every 3 turns

Each upstream is its simulator (:mod:`twisted_relay.simulated.openai_responses`,
:mod:`twisted_relay.simulated.openai_chat` in a dialect), which checks that
every turn sends back the reasoning it made (none dropped, none foreign).
The relay is built as ``twistd relay --config`` builds it, from a TOML file
written here: the client asks for ``claude-opus-4-6``, and the route sends it
to the upstream's model.

Printed: turns, failed turns, tool-use ids the client saw twice, ids the
relay renamed, and the upstream's reasoning tally.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

from twisted.internet import defer, task
from twisted.internet.threads import deferToThread
from twisted.web.server import Site

from bench.targets import free_port
from twisted_relay.service import Relay
from twisted_relay.settings import read_settings
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.translation import ANTHROPIC_ID_PATTERN

MODEL = "claude-opus-4-6"
KEY = "sk-sim-openai-relay-0001"
ANTHROPIC_KEY = "sk-sim-anthropic-0001"
#: The model each upstream is asked for.
UPSTREAM_MODELS = {"responses": "gpt-5.5", "openai": "gpt-5.2", "deepseek": "deepseek-v4-pro", "kimi": "kimi-k2.6",
                   "gemini": "gemini-3-pro", "groq": "openai/gpt-oss-120b", "mistral": "mistral-large-3",
                   "openrouter": "x-ai/grok-5"}
CHAT_DIALECTS = ("openai", "deepseek", "kimi", "gemini", "groq", "mistral", "openrouter")
SYSTEM = "You are a careful agent. Check the weather wherever you are asked."
FIRST = "Check the weather in every city of Europe, one call at a time, and keep going."
TOOLS = [{
    "name": "get_weather",
    "description": "Weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}]


@dataclass
class Turn:
    """What the client saw of one turn."""

    number: int
    streamed: bool
    upstream: str | None = None
    request_id: str | None = None
    message_id: str | None = None
    error: str | None = None
    tool_ids: list = field(default_factory=list)
    thinking: int = 0


def session(base_url: str, turns: int, deadline: float, models: list[str]) -> list[Turn]:
    """Whole (even) and streamed (odd) turns with tool results; ``models[n % len]`` asked; in a thread."""
    import anthropic

    client = anthropic.Anthropic(base_url=base_url, api_key="sk-client", max_retries=0, timeout=60)
    messages: list = [{"role": "user", "content": FIRST}]
    done: list[Turn] = []
    try:
        for number in range(turns):
            if time.monotonic() > deadline:
                break
            turn = Turn(number, streamed=number % 2 == 1)
            request = dict(model=models[(number // 3) % len(models)], max_tokens=1024, system=SYSTEM, tools=TOOLS,
                           messages=messages, thinking={"type": "adaptive"},
                           extra_headers={"x-claude-code-session-id": "bench-openai-session"})
            try:
                if turn.streamed:
                    with client.messages.stream(**request) as events:
                        headers = events.response.headers
                        message = events.get_final_message()
                else:
                    raw = client.messages.with_raw_response.create(**request)
                    headers = raw.headers
                    message = raw.parse()
                turn.upstream = headers.get("x-relay-upstream")
                turn.request_id = headers.get("x-relay-request-id")
                turn.message_id = message.id
            except anthropic.APIError as caught:
                body = getattr(caught, "body", None)
                text = body.get("error", {}).get("message") if isinstance(body, dict) else str(caught)
                turn.error = "%s %s" % (getattr(caught, "status_code", type(caught).__name__), str(text)[:400])
            else:
                content = [block.model_dump(exclude_none=True) for block in message.content]
                turn.tool_ids = [block.id for block in message.content if block.type == "tool_use"]
                turn.thinking = sum(1 for block in message.content if block.type == "thinking")
                messages.append({"role": "assistant", "content": content})
                results = [{"type": "tool_result", "tool_use_id": i, "content": "sunny"} for i in turn.tool_ids]
                messages.append({"role": "user", "content": results or "Go on."})
            done.append(turn)
    finally:
        client.close()
    return done


def _upstream_table(name: str, url: str, wire: str, key: str, model: str, dialect: str | None = None) -> str:
    lines = ["[upstreams.%s]" % (name,), 'url = "%s"' % (url,), 'keys = ["%s"]' % (key,)]
    if wire != "anthropic":
        lines.append('wire = "%s"' % (wire,))
        lines.append('models = { "%s" = "%s" }' % (MODEL, model))
    if dialect is not None:
        lines.append('dialect = "%s"' % (dialect,))
    return "\n".join(lines) + "\n\n"


class OpenAIUpstreams:
    """
    The simulated upstream(s) of ``upstream`` served on 127.0.0.1, and the
    relay's TOML file for them: ``responses`` (GPT on the Responses API), a
    Chat dialect, or ``alternate`` (Responses, and an Anthropic upstream for
    ``claude-sonnet-5-5``). The model the client asks for, ``claude-opus-4-6``,
    goes to the upstream's model by its model map.

    :ivar simulators: ``responses``, ``chat`` and ``anthropic``, as served.
    :ivar models: the models a client may ask for.
    """

    def __init__(self, reactor, upstream: str, seed: int = 7, keep: int = 1000):
        from twisted_relay.simulated.openai_chat import SimulatedOpenAIChat
        from twisted_relay.simulated.openai_responses import SimulatedOpenAIResponses

        self.upstream = upstream
        self.simulators: dict = {}
        self.models = [MODEL]
        self._reactor = reactor
        self._ports: list = []
        self._tables: list[str] = []
        routes = []
        if upstream in ("responses", "alternate"):
            fake = SimulatedUpstream(reactor=reactor, mode="lenient", seed=seed, keep_requests=keep)
            self.simulators["responses"] = SimulatedOpenAIResponses(fake, keys={KEY: "org-relay"}, keep_requests=keep)
            url = self._serve(self.simulators["responses"].resource()) + "/v1"
            self._tables.append(_upstream_table("gpt", url, "openai-responses", KEY, UPSTREAM_MODELS["responses"]))
        else:
            id_style = "kimi" if upstream == "kimi" else "toolu"
            fake = SimulatedUpstream(reactor=reactor, mode="lenient", seed=seed, id_style=id_style, keep_requests=keep)
            self.simulators["chat"] = SimulatedOpenAIChat(upstream, fake, keys={KEY}, reactor=reactor,
                                                          keep_requests=keep)
            url = self._serve(self.simulators["chat"].resource()) + "/v1"
            self._tables.append(_upstream_table("chat", url, "openai-chat", KEY, UPSTREAM_MODELS[upstream], upstream))
        if upstream == "alternate":
            anthropic = SimulatedUpstream(reactor=reactor, mode="strict", seed=seed + 1,
                                          id_pattern=ANTHROPIC_ID_PATTERN, thinking_secret="anthropic-thinking",
                                          keep_requests=keep)
            self.simulators["anthropic"] = anthropic
            self._tables.append(_upstream_table("anthropic", self._serve(anthropic.resource()), "anthropic",
                                                ANTHROPIC_KEY, MODEL))
            routes.append('[[routes]]\nmodels = ["claude-sonnet-5-5"]\ntargets = [{ upstream = "anthropic" }]\n')
            self.models = [MODEL, "claude-sonnet-5-5"]
        first = "gpt" if "responses" in self.simulators else "chat"
        routes.append('[[routes]]\ntargets = [{ upstream = "%s" }]\n' % (first,))
        self._routes = routes

    def _serve(self, resource) -> str:
        port = self._reactor.listenTCP(0, Site(resource), interface="127.0.0.1")
        self._ports.append(port)
        return "http://127.0.0.1:%d" % (port.getHost().port,)

    def config(self, folder: str) -> str:
        """The relay's TOML file (4xx dumps in ``folder/dumps``), written in ``folder``; its path."""
        path = os.path.join(folder, "relay.toml")
        with open(path, "w") as f:
            f.write('[relay]\ndump-dir = "%s"\n\n' % (os.path.join(folder, "dumps"),) + "".join(self._tables)
                    + "\n".join(self._routes))
        return path

    def reasoning_figures(self) -> dict:
        """The simulator's own tally of the reasoning sent back: ``reasoning_ok`` and what went wrong."""
        figures: dict = {}
        if "responses" in self.simulators:
            report = self.simulators["responses"].reasoning_report()
            figures["reasoning_ok"] = report.ok
            figures["reasoning_problems"] = report.problems()[:5]
        if "chat" in self.simulators:
            totals = self.simulators["chat"].reasoning.totals()
            figures["reasoning_totals"] = totals
            figures["reasoning_ok"] = not (totals.get("missing") or totals.get("foreign") or totals.get("refused"))
        return figures

    async def stop(self) -> None:
        for port in self._ports:
            await port.stopListening()


async def run_session(reactor, *, upstream: str = "responses", turns: int = 300, time_limit: float = 900.0,
                      seed: int = 7) -> dict:
    """Serve the simulators and the relay on 127.0.0.1, run the session, stop everything, give the figures."""
    folder = tempfile.mkdtemp(prefix="openai-session-")
    upstreams = OpenAIUpstreams(reactor, upstream, seed, keep=turns * 3 + 100)
    port = free_port()
    config = read_settings({"listen": ["tcp:%d:interface=127.0.0.1" % (port,)]}, upstreams.config(folder))
    relay = Relay(config.with_changes(drain_delay=0.0), reactor)
    relay.service.privilegedStartService()
    relay.service.startService()
    started = time.monotonic()
    try:
        done = await deferToThread(session, "http://127.0.0.1:%d" % (port,), turns, started + time_limit,
                                   upstreams.models)
        seconds = time.monotonic() - started
    finally:
        await relay.service.stopService()
        await upstreams.stop()
    ids = Counter(i for turn in done for i in turn.tool_ids)
    registry = relay.metrics.registry
    figures = {
        "upstream": upstream, "turns": len(done), "turns_asked": turns, "seconds": round(seconds, 1),
        "failed_turns": sum(1 for turn in done if turn.error is not None),
        "errors": ["turn %d (%s): %s" % (turn.number, turn.upstream, turn.error) for turn in done if turn.error][:5],
        "duplicate_ids": sum(1 for n in ids.values() if n > 1),
        "ids_renamed": registry.get_sample_value("relay_ids_rewritten_total", {"block_type": "tool_use"}) or 0,
        "answers_with_thinking": sum(1 for turn in done if turn.thinking),
        "served": dict(Counter(turn.upstream for turn in done if turn.error is None)),
        "dumps": sum(len(names) for _, _, names in os.walk(os.path.join(folder, "dumps"))),
        **upstreams.reasoning_figures(),
    }
    shutil.rmtree(folder, ignore_errors=True)
    return figures


def print_figures(figures: dict) -> None:
    """The figures, one line each."""
    print("upstream: %s; turns: %d/%d in %s s; served: %s" % (
        figures["upstream"], figures["turns"], figures["turns_asked"], figures["seconds"], figures["served"]))
    print("failed turns: %d" % (figures["failed_turns"],))
    for line in figures["errors"]:
        print("  " + line)
    print("duplicate tool-use ids seen by the client: %d (the relay renamed %d reused ones); dumps: %d" % (
        figures["duplicate_ids"], figures["ids_renamed"], figures["dumps"]))
    print("answers with thinking: %d; the upstream's reasoning sent back whole: %s %s" % (
        figures["answers_with_thinking"], "yes" if figures.get("reasoning_ok") else "NO",
        figures.get("reasoning_problems") or figures.get("reasoning_totals") or ""))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", choices=("responses", "alternate") + CHAT_DIALECTS, default="responses")
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds; the session stops after them")
    parser.add_argument("--seed", type=int, default=7)
    options = parser.parse_args(argv)

    async def body(reactor):
        print_figures(await run_session(reactor, upstream=options.upstream, turns=options.turns,
                                        time_limit=options.time_limit, seed=options.seed))

    task.react(lambda reactor: defer.ensureDeferred(body(reactor)))


if __name__ == "__main__":
    main()
