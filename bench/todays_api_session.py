# -*- test-case-name: tests.test_todays_api_session -*-
"""
A long session on today's API through the relay (issue 25, "Done when"): the
official ``anthropic`` SDK, thinking adaptive, alternating every few turns
between a Kimi-style upstream and a strict, prefix-checking Sonnet-5.5-like
one. All on 127.0.0.1, in this process::

    python -m bench.todays_api_session                        # 300 turns
    python -m bench.todays_api_session --threads              # relay-held threads
    python -m bench.todays_api_session --failover same-account
    python -m bench.todays_api_session --failover other-account
    python -m bench.todays_api_session --bad-client           # an old turn edited midway
    python -m bench.todays_api_session --bad-client --thinking-binding-recovery off
    python -m bench.todays_api_session --thinking omitted     # no thinking field
    python -m bench.todays_api_session --turns 24 --every 3 --time-limit 60

Two simulated upstreams speak today's API (:mod:`twisted_relay.simulated`):

- ``kimi`` (model ``kimi-k2``, a year-old family: it thinks when asked to,
  signs with its own secret and refuses thinking it did not sign): its tool
  calls are ``functions.NAME:N``, so the same ids come back every turn;
- ``strict`` (model ``claude-sonnet-5-5``): Anthropic's id alphabet, no
  duplicate ids, reuses ids of its history now and then, thinking bound to
  its prefix (a change is a 400), its model and its account (a block replayed
  under another account's key is dropped), its own secret; its keys name
  their accounts both in the relay's configuration and in the simulator.

The relay is built as ``twistd relay --config`` builds it (a TOML file
written here, read by :func:`twisted_relay.settings.read_settings`, served by
:class:`twisted_relay.service.Relay`). Models ``kimi-*`` go to ``kimi``,
the rest to ``strict``.

The client sends ``thinking: {"type": "adaptive"}`` (``--thinking omitted``: no field) and the beta
``thinking-binding-controls-2026-08-01`` (so the strict upstream lists every
block it drops in ``input_transformations``) on every turn, streams every
other turn, and switches model every ``--every`` turns. ``--threads`` runs
the SDK's tool runner instead, threads on (the relay holds them). With
``--failover``, the strict upstream has two keys; from the middle of the
session on, the conversation's own key is answered with 429 (by a wrapper in
front of the simulator): ``same-account`` gives it a second key of its own
account, ``other-account`` one of another account. ``--bad-client`` edits
an old turn (the first tool result) in the middle of the session and goes on
with the edited history, as a bad client would: the relay's recovery
(``--thinking-binding-recovery``) rescues it, or, ``off``, the client gets
the strict upstream's 400 at each of its turns.

Printed: turns, failed turns, tool-use ids the client saw twice, thinking
blocks each upstream dropped (from ``input_transformations``), answers with
thinking, requests that carried ``thinking``, and whether each upstream got
its own thinking back at every turn it served (its received requests held
every thinking block it had made before in the conversation, by signature),
the keys the strict upstream saw and the relay's move and recovery counters.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

from twisted.internet import defer, task
from twisted.internet.threads import deferToThread
from twisted.web.resource import Resource
from twisted.web.server import Site

from bench.targets import free_port
from twisted_relay.service import Relay
from twisted_relay.settings import read_settings
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.thinking import BINDING_BETA
from twisted_relay.translation import ANTHROPIC_ID_PATTERN, read_mark

KIMI_OWN = r"functions\.[A-Za-z_]+:[0-9]+"
KIMI_ACCEPTS = r"^(%s|[a-zA-Z0-9_-]+)$" % (KIMI_OWN,)
SECRETS = {"kimi": "kimi-thinking-secret", "strict": "strict-thinking-secret"}
MODELS = {"kimi": "kimi-k2", "strict": "claude-sonnet-5-5"}
#: The strict upstream's keys: a label (printed; the key never is), the key, its account.
KEYS = {
    "acme-1": ("sk-sim-acme-key-one", "acme"),
    "acme-2": ("sk-sim-acme-key-two", "acme"),
    "globex-1": ("sk-sim-globex-key-one", "globex"),
}
POOLS = {None: ("acme-1",), "same-account": ("acme-1", "acme-2"), "other-account": ("acme-1", "globex-1")}
SYSTEM = "You are a careful agent. Check the weather wherever you are asked."
FIRST = "Check the weather in every city of Europe, one call at a time, and keep going."
TOOLS = [{
    "name": "get_weather",
    "description": "Weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}]
#: What the client sends about thinking: ``adaptive`` says it, ``omitted`` leaves the field out
#: (adaptive on today's models; the year-old ``kimi-k2`` then does not think).
THINKING = {"adaptive": {"thinking": {"type": "adaptive"}}, "omitted": {}}

CONFIG = """\
[relay]
dump-dir = "{dumps}"
thinking-binding-recovery = "{recovery}"

[upstreams.kimi]
url = "{kimi}"
ids = "original"
own-ids = '{own}'

[upstreams.strict]
url = "{strict}"
id-pattern = "default"
keys = [{keys}]

[[routes]]
models = ["kimi-*"]
targets = [{{ upstream = "kimi" }}]

[[routes]]
targets = [{{ upstream = "strict" }}]
"""


class RateLimitedKeys(Resource):
    """
    A simulated upstream's resource behind a wall that answers a 429
    ``rate_limit_error`` (``retry-after: 600``) to every request made with a
    key in :attr:`refused`, as an API whose key ran out of its limit does.
    """

    isLeaf = True

    def __init__(self, inner: Resource):
        super().__init__()
        self.inner = inner
        self.refused: set[str] = set()
        self.refusals = 0

    def render(self, request):
        """Refuse a request made with a refused key; pass the others on."""
        key = (request.getHeader(b"x-api-key") or b"").decode("latin-1")
        if key in self.refused:
            self.refusals += 1
            request.setResponseCode(429)
            request.setHeader(b"content-type", b"application/json")
            request.setHeader(b"retry-after", b"600")
            return (b'{"type": "error", "error": {"type": "rate_limit_error", '
                    b'"message": "This request would exceed your rate limit."}}')
        return self.inner.render(request)


@dataclass
class Turn:
    """What the client saw of one turn."""

    number: int
    upstream: str
    streamed: bool
    error: str | None = None
    tool_ids: list = field(default_factory=list)
    #: ``(maker, signature as the maker made it)`` of each thinking block.
    thinking: list = field(default_factory=list)
    transformations: list = field(default_factory=list)
    #: How many requests each upstream had received when the turn ended.
    received: dict = field(default_factory=dict)


def _thinking_of(content, upstream: str) -> list:
    found = []
    for block in content:
        if block.type == "thinking":
            marked = read_mark(block.signature)
            found.append(marked if marked is not None else (upstream, block.signature))
    return found


def _upstream_of(number: int, every: int) -> str:
    return ("kimi", "strict")[(number // every) % 2]


def _error(caught) -> str:
    body = getattr(caught, "body", None)
    message = body.get("error", {}).get("message") if isinstance(body, dict) else str(caught)
    return f"{getattr(caught, 'status_code', type(caught).__name__)} {str(message)[:300]}"


def edit_old_turn(messages: list) -> None:
    """What a bad client does: the first tool result of the conversation, changed in place."""
    for message in messages:
        if message["role"] == "user" and isinstance(message["content"], list):
            message["content"] = [dict(message["content"][0], content="rainy, edited later")] + message["content"][1:]
            return


def plain_session(base_url: str, turns: int, every: int, deadline: float, between,
                  edit_at: int | None = None, thinking: str = "adaptive") -> list[Turn]:
    """
    A loop of ``client.beta.messages.create`` (even turns) and
    ``client.beta.messages.stream`` (odd turns) with tool results, the
    model switching every ``every`` turns; runs in a thread. ``between(n)``
    runs before turn ``n`` and returns the request counts of the upstreams.
    Before turn ``edit_at``, the client edits an old turn (:func:`edit_old_turn`).
    """
    import anthropic

    client = anthropic.Anthropic(base_url=base_url, api_key="sk-client", max_retries=0, timeout=60)
    messages: list = [{"role": "user", "content": FIRST}]
    done: list[Turn] = []
    try:
        for number in range(turns):
            if time.monotonic() > deadline:
                break
            between(number)
            if number == edit_at:
                edit_old_turn(messages)
            upstream = _upstream_of(number, every)
            turn = Turn(number, upstream, streamed=number % 2 == 1)
            request = dict(model=MODELS[upstream], max_tokens=512, system=SYSTEM, tools=TOOLS,
                           messages=messages, betas=[BINDING_BETA], **THINKING[thinking])
            try:
                if turn.streamed:
                    with client.beta.messages.stream(**request) as events:
                        message = events.get_final_message()
                else:
                    message = client.beta.messages.create(**request)
            except anthropic.APIError as caught:
                turn.error = _error(caught)
            else:
                content = [block.model_dump(exclude_none=True) for block in message.content]
                turn.tool_ids = [block.id for block in message.content if block.type == "tool_use"]
                turn.thinking = _thinking_of(message.content, upstream)
                turn.transformations = [entry.model_dump() for entry in message.input_transformations or ()]
                messages.append({"role": "assistant", "content": content})
                results = [{"type": "tool_result", "tool_use_id": i, "content": "sunny"} for i in turn.tool_ids]
                messages.append({"role": "user", "content": results or "Go on."})
            turn.received = between(None)
            done.append(turn)
    finally:
        client.close()
    return done


def threaded_session(base_url: str, turns: int, every: int, deadline: float, between,
                     thinking: str = "adaptive") -> list[Turn]:
    """The SDK's tool runner, threads on (the relay holds them), non-streaming, the model
    switched every ``every`` turns with ``set_messages_params``; runs in a thread."""
    import anthropic
    from anthropic import beta_tool

    @beta_tool
    def get_weather(city: str) -> str:
        """Weather for a city.

        Args:
            city: the city.
        """
        return f"sunny in {city}"

    client = anthropic.Anthropic(base_url=base_url, api_key="sk-client", max_retries=0, timeout=60)
    done: list[Turn] = []
    between(0)
    try:
        runner = client.beta.messages.tool_runner(
            model=MODELS[_upstream_of(0, every)], max_tokens=512, system=SYSTEM, tools=[get_weather],
            messages=[{"role": "user", "content": FIRST}], betas=[BINDING_BETA], **THINKING[thinking],
            max_iterations=turns,
        )
        for message in runner:
            number = len(done)
            upstream = _upstream_of(number, every)
            turn = Turn(number, upstream, streamed=False, received=between(None))
            turn.tool_ids = [block.id for block in message.content if block.type == "tool_use"]
            turn.thinking = _thinking_of(message.content, upstream)
            turn.transformations = [entry.model_dump() for entry in message.input_transformations or ()]
            done.append(turn)
            if number + 1 >= turns or time.monotonic() > deadline:
                break
            between(number + 1)
            following = MODELS[_upstream_of(number + 1, every)]
            runner.set_messages_params(lambda params, model=following: {**params, "model": model})
    except anthropic.APIError as caught:
        number = len(done)
        done.append(Turn(number, _upstream_of(number, every), False, error=_error(caught), received=between(None)))
    finally:
        client.close()
    return done


def thinking_signatures(body) -> set:
    """The signatures of every thinking block a request's history holds."""
    found = set()
    for message in body.get("messages", []) if isinstance(body, dict) else []:
        content = message.get("content")
        for block in content if isinstance(content, list) else []:
            if isinstance(block, dict) and block.get("type") == "thinking":
                found.add(block.get("signature"))
    return found


def _messages_requests(upstream: SimulatedUpstream) -> list:
    return [r for r in upstream.requests if r.path.startswith("/v1/messages") and "count_tokens" not in r.path]


def own_thinking_back(name: str, upstream: SimulatedUpstream, done: list[Turn]) -> dict:
    """
    For each turn ``name`` served, whether the request that got its answer
    held every thinking block ``name`` had made earlier in the conversation
    (compared by the signature it made).
    """
    requests = _messages_requests(upstream)
    made: list = []
    turns = missing_turns = missing_blocks = 0
    for turn in done:
        if turn.upstream != name or turn.error is not None:
            continue
        turns += 1
        answered = requests[turn.received[name] - 1]
        sent = thinking_signatures(answered.body)
        lost = [signature for signature in made if signature not in sent]
        missing_turns += bool(lost)
        missing_blocks += len(lost)
        made.extend(signature for maker, signature in turn.thinking if maker == name)
    return {"turns": turns, "turns_missing_own_thinking": missing_turns, "own_blocks_missing": missing_blocks,
            "own_blocks_made": len(made)}


async def run_session(reactor, *, turns: int = 300, every: int = 3, threads: bool = False,
                      failover: str | None = None, recovery: str = "drop_block", time_limit: float = 900.0,
                      seed: int = 7, folder: str | None = None, bad_client: bool = False,
                      thinking: str = "adaptive") -> dict:
    """
    Serve both simulated upstreams and the relay on 127.0.0.1, run the
    session, stop everything and return the figures (see :func:`report`).
    """
    own_folder = folder is None
    folder = folder or tempfile.mkdtemp(prefix="todays-api-")
    os.makedirs(folder, exist_ok=True)
    pool = POOLS[failover]
    upstreams = {
        "kimi": SimulatedUpstream(reactor=reactor, mode="lenient", seed=seed, id_style="kimi",
                                  id_pattern=KIMI_ACCEPTS, thinking_secret=SECRETS["kimi"],
                                  keep_requests=turns * 4 + 100),
        "strict": SimulatedUpstream(reactor=reactor, mode="strict", seed=seed + 1, id_pattern=ANTHROPIC_ID_PATTERN,
                                    thinking_secret=SECRETS["strict"], keep_requests=turns * 4 + 100,
                                    accounts={KEYS[label][0]: KEYS[label][1] for label in KEYS}),
    }
    wall = RateLimitedKeys(upstreams["strict"].resource())
    resources = {"kimi": upstreams["kimi"].resource(), "strict": wall}
    ports = {name: reactor.listenTCP(0, Site(resource), interface="127.0.0.1") for name, resource in resources.items()}
    urls = {name: "http://127.0.0.1:%d" % (port.getHost().port,) for name, port in ports.items()}
    dumps = os.path.join(folder, "dumps")
    config_file = os.path.join(folder, "relay.toml")
    keys = ", ".join('{ key = "%s", account = "%s" }' % KEYS[label] for label in pool)
    with open(config_file, "w") as f:
        f.write(CONFIG.format(dumps=dumps, recovery=recovery, kimi=urls["kimi"], strict=urls["strict"],
                              own=KIMI_OWN, keys=keys))
    port = free_port()
    config = read_settings({"listen": ["tcp:%d:interface=127.0.0.1" % (port,)]}, config_file)
    # Nothing is in flight when the session ends: stop at once rather than after twistd's drain delay.
    relay = Relay(config.with_changes(drain_delay=0.0), reactor)
    relay.service.privilegedStartService()
    relay.service.startService()
    label_of = {KEYS[label][0]: label for label in KEYS}

    def between(number):
        """Before turn ``number``: from the middle on, refuse the conversation's own key (failover);
        with ``None``: the request counts of each upstream."""
        if number is not None and failover and number == turns // 2:
            homes = [r.headers.get("x-api-key") for r in _messages_requests(upstreams["strict"])[:1]]
            wall.refused.update(homes or [KEYS[pool[0]][0]])
        return {name: len(_messages_requests(upstream)) for name, upstream in upstreams.items()}

    started = time.monotonic()
    try:
        if threads:
            done = await deferToThread(threaded_session, "http://127.0.0.1:%d" % (port,), turns, every,
                                       started + time_limit, between, thinking)
        else:
            done = await deferToThread(plain_session, "http://127.0.0.1:%d" % (port,), turns, every,
                                       started + time_limit, between, turns // 2 if bad_client else None,
                                       thinking)
        seconds = time.monotonic() - started
    finally:
        await relay.service.stopService()
        for listening in ports.values():
            await listening.stopListening()
    registry = relay.metrics.registry
    counters = {
        "moves_same_account": registry.get_sample_value(
            "relay_conversation_moves_total", {"upstream": "strict", "across": "key"}) or 0,
        "moves_other_account": registry.get_sample_value(
            "relay_conversation_moves_total", {"upstream": "strict", "across": "account"}) or 0,
        "binding_recoveries": sum(registry.get_sample_value(
            "relay_binding_recoveries_total", {"upstream": name}) or 0 for name in upstreams),
        "thread_continues_found": registry.get_sample_value("relay_thread_lookups_total", {"outcome": "hit"}) or 0,
        "thread_continues_lost": registry.get_sample_value("relay_thread_lookups_total", {"outcome": "miss"}) or 0,
    }
    dumped = [os.path.join(where, name) for where, _, names in os.walk(dumps) for name in names]
    figures = report(done, upstreams, turns, seconds)
    figures.update(counters)
    figures["dumps"] = len(dumped)
    figures["dump_notes"] = [_note_of(path) for path in dumped]
    figures["strict_keys"] = Counter(
        label_of.get(r.headers.get("x-api-key"), "other") for r in _messages_requests(upstreams["strict"]))
    figures["rate_limited"] = wall.refusals
    figures["variant"] = "threads" if threads else "plain"
    figures["failover"] = failover or "none"
    figures["bad_client"] = bad_client
    figures["thinking"] = thinking
    if own_folder and not dumped:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        figures["folder"] = folder
    return figures


def _note_of(path: str) -> str | None:
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("note")


def report(done: list[Turn], upstreams: dict, turns: int, seconds: float) -> dict:
    """The figures of a finished session."""
    ids = Counter(i for turn in done for i in turn.tool_ids)
    figures = {
        "turns": len(done), "turns_asked": turns, "seconds": round(seconds, 1),
        "failed_turns": sum(1 for turn in done if turn.error is not None),
        "errors": [f"turn {turn.number} ({turn.upstream}): {turn.error}" for turn in done if turn.error][:5],
        "duplicate_ids": sum(1 for n in ids.values() if n > 1),
        "streamed_turns": sum(1 for turn in done if turn.streamed),
    }
    for name, upstream in upstreams.items():
        served = [turn for turn in done if turn.upstream == name and turn.error is None]
        requests = _messages_requests(upstream)
        dropped = [entry for turn in served for entry in turn.transformations if entry.get("type") == "thinking_dropped"]
        figures[name] = {
            "turns_served": len(served),
            "answers_with_thinking": sum(1 for turn in served if turn.thinking),
            "requests": len(requests),
            "requests_with_thinking_field": sum(1 for r in requests if isinstance(r.body, dict) and "thinking" in r.body),
            "thinking_dropped": len(dropped),
            "dropped_reasons": dict(Counter(entry.get("reason") for entry in dropped)),
            **own_thinking_back(name, upstream, done),
        }
    return figures


def print_figures(figures: dict) -> None:
    """The figures, one line each."""
    print(f"variant: {figures['variant']}, thinking: {figures['thinking']}, failover: {figures['failover']}"
          + (", a bad client edits an old turn midway" if figures["bad_client"] else ""))
    print(f"turns: {figures['turns']}/{figures['turns_asked']} ({figures['streamed_turns']} streamed) "
          f"in {figures['seconds']} s")
    print(f"failed turns: {figures['failed_turns']}")
    for line in figures["errors"]:
        print(f"  {line}")
    print(f"duplicate tool-use ids seen by the client: {figures['duplicate_ids']}")
    for name in ("kimi", "strict"):
        f = figures[name]
        print(f"{name}: {f['turns_served']} turns served, {f['answers_with_thinking']} answers with thinking; "
              f"{f['requests']} requests, {f['requests_with_thinking_field']} with a thinking field; "
              f"thinking dropped: {f['thinking_dropped']} {f['dropped_reasons'] or ''}; "
              f"own thinking back at every turn: {'yes' if not f['turns_missing_own_thinking'] else 'NO'} "
              f"({f['turns_missing_own_thinking']} turns missing {f['own_blocks_missing']} of its blocks; "
              f"{f['own_blocks_made']} made)")
    print(f"strict upstream's keys: {dict(figures['strict_keys'])}; 429s given: {figures['rate_limited']}")
    print(f"relay_conversation_moves_total: same account {figures['moves_same_account']:g}, "
          f"other account {figures['moves_other_account']:g}; "
          f"relay_binding_recoveries_total: {figures['binding_recoveries']:g}; dumps: {figures['dumps']}"
          + (f" (in {figures['folder']})" if "folder" in figures else ""))
    for note, count in Counter(figures["dump_notes"]).items():
        print(f"  {count} dump(s) with the note: {note}")
    print(f"thread continues the relay found: {figures['thread_continues_found']:g}, "
          f"lost: {figures['thread_continues_lost']:g}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--every", type=int, default=3, help="turns between two switches of upstream")
    parser.add_argument("--threads", action="store_true", help="the SDK's tool runner with relay-held threads")
    parser.add_argument("--failover", choices=("same-account", "other-account"),
                        help="a 429 on the strict upstream's key from the middle of the session on")
    parser.add_argument("--thinking", choices=tuple(THINKING), default="adaptive",
                        help='send thinking {"type": "adaptive"} or leave the field out')
    parser.add_argument("--bad-client", action="store_true",
                        help="the client edits an old turn (a tool result) in the middle of the session")
    parser.add_argument("--thinking-binding-recovery", default="drop_block", choices=("drop_block", "off"))
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds; the session stops after them")
    parser.add_argument("--seed", type=int, default=7)
    options = parser.parse_args(argv)

    async def body(reactor):
        figures = await run_session(
            reactor, turns=options.turns, every=options.every, threads=options.threads, failover=options.failover,
            recovery=options.thinking_binding_recovery, time_limit=options.time_limit, seed=options.seed,
            bad_client=options.bad_client, thinking=options.thinking)
        print_figures(figures)

    task.react(lambda reactor: defer.ensureDeferred(body(reactor)))


if __name__ == "__main__":
    main()
