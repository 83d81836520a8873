"""
End to end with the official ``anthropic`` SDK on real sockets: one
conversation that moves, by model, between two upstreams of different rules
behind one relay, with extended thinking on.

- ``kimi``: a Kimi-style backend (``ids = "original"``): it numbers its calls
  ``functions.echo:N`` within each answer, so the same ids come back every
  turn, and it wants them back exactly.
- ``strict``: Anthropic's rules: ids outside ``^[a-zA-Z0-9_-]+$`` and
  duplicate ids are refused, and it reuses ids of its own history now and
  then.

Each signs its thinking blocks with its own secret and refuses thinking it
did not sign, and a tool loop with thinking on whose final assistant
message does not start with thinking (Anthropic's rule). The session runs
200 turns, streaming and not in turn, the model switching every few turns,
with a plain user turn now and then that ends a tool loop.
"""

from __future__ import annotations

import io
import json
import os
import re

from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.python.filepath import FilePath
from twisted.trial.unittest import TestCase
from twisted.web.server import Site

from tests.helpers import serve_relay
from tests.test_sdk import SDKTestMixin, anthropic, sdk_client
from twisted_relay import replay
from twisted_relay.config import RelayConfig, Route, Target, Upstream
from twisted_relay.simulated import SimulatedUpstream
from twisted_relay.simulated.model import check_id_pattern, check_shape, check_strict_ids, check_thinking
from twisted_relay.translation import ANTHROPIC_ID_PATTERN, read_mark

TURNS = 200
#: Turns spent on one model before the session moves to the other.
STAY = 3
#: Every this many turns the model is asked for a plain answer (no tool),
#: and the user's next turn is plain text: the tool loop ends.
PLAIN_EVERY = 7
THINKING = {"type": "enabled", "budget_tokens": 1024}
ECHO = [
    {
        "name": "echo",
        "description": "Repeat the text given.",
        "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}},
    }
]
KIMI_MODEL = "kimi-k2"
STRICT_MODEL = "claude-sonnet-4-5"
KIMI_OWN = r"functions\.[A-Za-z_]+:[0-9]+"
#: What the Kimi-style upstream accepts: its own ids, and the ids of the
#: Anthropic alphabet the relay sends it for what other upstreams made.
KIMI_ACCEPTS = r"^(%s|[a-zA-Z0-9_-]+)$" % (KIMI_OWN,)
KIMI_SECRET = "kimi-thinking-secret"
STRICT_SECRET = "strict-thinking-secret"


def run_crossing_session(base_url: str, turns: int) -> dict:
    """
    Drive the session as a client would, feeding back every answer whole
    (thinking blocks with their signatures included) and answering every
    ``tool_use``. Runs in a thread. Returns what the client saw.
    """
    client = sdk_client(base_url)
    messages: list = [{"role": "user", "content": "Echo many things, one call at a time."}]
    seen_ids: list[str] = []
    models: list[str] = []
    failures: list[str] = []
    makers: set[str] = set()
    completed = 0
    try:
        for turn in range(turns):
            model = KIMI_MODEL if (turn // STAY) % 2 == 0 else STRICT_MODEL
            plain = turn % PLAIN_EVERY == PLAIN_EVERY - 1
            request = dict(model=model, max_tokens=2048, messages=messages, tools=ECHO, thinking=THINKING)
            if plain:
                request["tool_choice"] = {"type": "none"}
            try:
                if turn % 2:
                    with client.messages.stream(**request) as events:
                        message = events.get_final_message()
                else:
                    message = client.messages.create(**request)
            except anthropic.APIStatusError as e:
                failures.append("turn %d (%s): %d %s" % (turn, model, e.status_code, e.response.text))
                break
            content = [block.model_dump(exclude_none=True) for block in message.content]
            for block in content:
                if block["type"] == "thinking":
                    mark = read_mark(block["signature"])
                    makers.add(mark[0] if mark else "(unmarked)")
            uses = [block for block in content if block["type"] == "tool_use"]
            seen_ids.extend(block["id"] for block in uses)
            models.append(model)
            messages.append({"role": "assistant", "content": content})
            if uses:
                messages.append({
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": b["id"], "content": "echoed"} for b in uses],
                })
            else:
                messages.append({"role": "user", "content": "Go on."})
            completed += 1
    finally:
        client.close()
    return {"completed": completed, "ids": seen_ids, "failures": failures, "models": models, "makers": makers}


class RoutedCrossingSDKTests(SDKTestMixin, TestCase):
    """A 200-turn session crossing a Kimi-style and a strict upstream survives only with the encoding."""

    def serve(self, **options) -> tuple[SimulatedUpstream, str]:
        sim = SimulatedUpstream(reactor=reactor, keep_requests=TURNS + 10, **options)
        port = reactor.listenTCP(0, Site(sim.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return sim, "http://127.0.0.1:%d" % (port.getHost().port,)

    def serve_pair(
        self, strict_id_pattern: str | None = "default", kimi_url: str | None = None
    ) -> tuple[SimulatedUpstream, SimulatedUpstream, str]:
        """
        Both upstreams, and a relay routing ``kimi-*`` to one (falling over
        to the other) and ``claude-*`` to the other.
        """
        kimi = None
        if kimi_url is None:
            kimi, kimi_url = self.serve(mode="lenient", seed=11, id_style="kimi", id_pattern=KIMI_ACCEPTS,
                                        thinking_secret=KIMI_SECRET)
        strict, strict_url = self.serve(mode="strict", seed=12, id_pattern=ANTHROPIC_ID_PATTERN,
                                        thinking_secret=STRICT_SECRET)
        self.dumps = FilePath(self.mktemp())
        config = RelayConfig(
            listen=(),
            dump_dir=self.dumps.path,
            upstreams=(
                Upstream("kimi", kimi_url, ids="original", own_ids=KIMI_OWN),
                Upstream("strict", strict_url, ids="unique", id_pattern=strict_id_pattern),
            ),
            routes=(
                Route(targets=(Target("kimi"), Target("strict", STRICT_MODEL)), models=("kimi-*",)),
                Route(targets=(Target("strict"),), models=("claude-*",)),
            ),
        )
        served = serve_relay(self, config, reactor)
        self.relay = served.relay
        return kimi, strict, served.url

    def assertOnlyValid(self, sim: SimulatedUpstream, checks) -> None:
        """Every request the upstream received passes its checks again (none was refused)."""
        for n, received in enumerate(sim.requests):
            body = received.body
            try:
                check_shape(body, for_count=False)
                for check in checks:
                    check(body)
            except Exception as e:
                self.fail("request #%d to this upstream was not valid for it: %s" % (n, e))

    async def test_crossing_session(self):
        """
        Every turn succeeds; the client never sees an id twice; each
        upstream received only requests valid for it: the strict one no id
        outside its pattern and no duplicate, no thinking but its own; the
        Kimi-style one its own ids back and no thinking but its own.
        """
        kimi, strict, base = self.serve_pair()
        outcome = await deferToThread(run_crossing_session, base, TURNS)
        self.assertEqual(outcome["failures"], [])
        self.assertEqual(outcome["completed"], TURNS)
        ids = outcome["ids"]
        self.assertEqual(len(ids), len(set(ids)), "the client saw a duplicate id")
        self.assertTrue(all(ids), "the client saw an empty id")
        self.assertTrue(any(re.fullmatch(KIMI_OWN, i) for i in ids), "no Kimi-style id reached the client")
        self.assertEqual(outcome["makers"], {"kimi", "strict"})
        self.assertEqual(len(kimi.requests), outcome["models"].count(KIMI_MODEL))
        self.assertEqual(len(strict.requests), outcome["models"].count(STRICT_MODEL))
        self.assertOnlyValid(strict, [
            lambda body: check_id_pattern(body["messages"], ANTHROPIC_ID_PATTERN),
            lambda body: check_strict_ids(body["messages"], check_pattern=False),
            lambda body: check_thinking(body, STRICT_SECRET),
        ])
        self.assertOnlyValid(kimi, [
            lambda body: check_id_pattern(body["messages"], KIMI_ACCEPTS),
            lambda body: check_thinking(body, KIMI_SECRET),
            self.assertDistinctForeignIds,
        ])
        encoded = [
            block["id"]
            for received in strict.requests
            for message in received.body["messages"]
            if isinstance(message["content"], list)
            for block in message["content"]
            if block["type"] == "tool_use" and block["id"].startswith("twr_")
        ]
        self.assertIn("twr_functions_2e_echo_3a_0", encoded, "no Kimi id went to the strict upstream encoded")
        self.assertEqual(os.listdir(self.dumps.path) if self.dumps.exists() else [], [], "a 4xx was dumped")

    def assertDistinctForeignIds(self, body: dict) -> None:
        """Ids the Kimi-style upstream did not make reach it pairwise distinct, and never in its own form."""
        foreign = [
            block["id"]
            for message in body["messages"]
            if isinstance(message["content"], list)
            for block in message["content"]
            if block["type"] == "tool_use" and not re.fullmatch(KIMI_OWN, block["id"])
        ]
        self.assertEqual(len(foreign), len(set(foreign)))

    async def test_without_encoding_the_session_dies(self):
        """
        The same session with the strict upstream's pattern turned off
        (``id-pattern = "none"``) fails at the first request that carries a
        Kimi id to it; the dump of that 400 holds the rules of the upstream
        the request was routed to.
        """
        kimi, strict, base = self.serve_pair(strict_id_pattern=None)
        outcome = await deferToThread(run_crossing_session, base, TURNS)
        self.assertEqual(len(outcome["failures"]), 1, outcome["failures"])
        failure = outcome["failures"][0]
        self.assertIn("400", failure)
        self.assertIn("String should match pattern", failure)
        self.assertEqual(outcome["completed"], STAY, "the first turn routed to the strict upstream fails")
        # Dumps are written in the writer's thread: wait for the ones queued.
        await self.relay.dumps.drain()
        dumps = [child for child in self.dumps.walk() if child.isfile() and child.path.endswith(".json")]
        self.assertEqual(len(dumps), 1, "the one 400 was not dumped once")
        dump = json.loads(dumps[0].getContent())
        self.assertEqual(dump["upstream"], "strict")
        self.assertEqual(
            dump["translation_table"]["rules"],
            {"name": "strict", "policy": "unique", "id_pattern": None, "own_ids": None, "mark_thinking": True},
        )
        # Replayed with those rules, the dumped translation is the one made.
        out = io.StringIO()
        self.assertEqual(replay.main(["--check", dumps[0].path], stdout=out, stderr=out), 0, out.getvalue())

    async def test_failover_translates_for_the_next_upstream(self):
        """
        A request for the Kimi-style model whose upstream is down falls over
        to the strict one, translated with the strict one's rules: its Kimi
        ids go encoded and its Kimi thinking stays home, so it is accepted,
        and the client still sees its own ids.
        """
        closed = reactor.listenTCP(0, Site(SimulatedUpstream(reactor=reactor).resource()), interface="127.0.0.1")
        down = "http://127.0.0.1:%d" % (closed.getHost().port,)
        await closed.stopListening()
        _, strict, base = self.serve_pair(kimi_url=down)
        signature = "relay:kimi:c2lnbmVkLWJ5LWtpbWk="
        messages = [
            {"role": "user", "content": "Echo twice."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Echo it.", "signature": signature},
                {"type": "tool_use", "id": "functions.echo:0", "name": "echo", "input": {"text": "a"}},
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "functions.echo:0", "content": "a"}]},
        ]

        def call():
            client = sdk_client(base)
            try:
                return client.messages.create(model=KIMI_MODEL, max_tokens=2048, messages=messages, tools=ECHO,
                                              thinking=THINKING)
            finally:
                client.close()

        message = await deferToThread(call)
        self.assertEqual(message.model, STRICT_MODEL)
        received = strict.requests[-1].body
        self.assertEqual([b["type"] for b in received["messages"][1]["content"]], ["tool_use"])
        self.assertEqual(received["messages"][1]["content"][0]["id"], "twr_functions_2e_echo_3a_0")
        self.assertEqual(received["messages"][2]["content"][0]["tool_use_id"], "twr_functions_2e_echo_3a_0")
        self.assertNotIn("thinking", received, "a tool loop whose thinking stayed home goes without thinking")
        self.assertEqual([b.type for b in message.content][-1], "tool_use")
        self.assertFalse([b.id for b in message.content if b.type == "tool_use" and b.id.startswith("twr_")])
