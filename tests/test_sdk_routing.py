"""
End to end with the official ``anthropic`` SDK on real sockets: a relay in
front of two simulated upstreams of different kinds (a strict one that
reuses ids, and a Kimi-style one that makes ids of its own shape, leaves
some out, and refuses ids of that shape in its history),
behind two routes. The first target of the session's route is stopped
mid-session and started again later.
"""

from __future__ import annotations

from twisted.internet import reactor
from twisted.internet.threads import blockingCallFromThread, deferToThread
from twisted.protocols.policies import WrappingFactory
from twisted.trial.unittest import SkipTest, TestCase
from twisted.web.server import Site

from twisted_relay.config import RelayConfig, Route, Target, Upstream
from twisted_relay.simulated import SimulatedUpstream

from tests.helpers import TOOLS, serve_relay
from tests.test_sdk import feed_back, sdk_client

try:
    import anthropic
except ImportError:  # pragma: no cover - the test extra installs it
    anthropic = None

TURNS = 200
DOWN_AT = 60
UP_AT = 130
SMALL_EVERY = 7


class StoppableUpstream:
    """A simulated upstream on 127.0.0.1 that can be stopped (port closed, connections cut) and started again on its port."""

    def __init__(self, **options):
        self.sim = SimulatedUpstream(reactor=reactor, **options)
        site = Site(self.sim.resource())
        site.noisy = False
        # Keeps its connections, so that stopping drops them too.
        self.factory = WrappingFactory(site)
        self.port = reactor.listenTCP(0, self.factory, interface="127.0.0.1")
        self.number = self.port.getHost().port
        self.url = "http://127.0.0.1:%d" % (self.number,)

    def stop(self):
        d = self.port.stopListening()
        for protocol in list(self.factory.protocols):
            protocol.transport.abortConnection()
        self.port = None
        return d

    def start(self):
        self.port = reactor.listenTCP(self.number, self.factory, interface="127.0.0.1")

    def cleanup(self):
        if self.port is not None:
            return self.stop()


def run_routed_session(base_url: str, strict: StoppableUpstream) -> dict:
    """
    A streaming tool-use session of :data:`TURNS` turns, every
    :data:`SMALL_EVERY`-th one with the small model; the strict upstream is
    stopped before turn :data:`DOWN_AT` and started again before turn
    :data:`UP_AT`. Runs in a thread; returns what the client saw.
    """
    client = sdk_client(base_url)
    messages = [{"role": "user", "content": "Check the weather in many cities, one call at a time."}]
    seen_ids: list[str] = []
    served: list[tuple[int, str, str]] = []
    failures: list[str] = []
    try:
        for turn in range(TURNS):
            if turn == DOWN_AT:
                blockingCallFromThread(reactor, strict.stop)
            elif turn == UP_AT:
                blockingCallFromThread(reactor, strict.start)
            model = "claude-haiku-4-5" if turn % SMALL_EVERY == SMALL_EVERY - 1 else "claude-sonnet-4-5"
            try:
                with client.messages.stream(model=model, max_tokens=256, messages=messages, tools=TOOLS) as events:
                    message = events.get_final_message()
                    served.append((turn, model, events.response.headers.get("x-relay-upstream")))
            except anthropic.APIError as e:
                failures.append("turn %d: %s" % (turn, e))
                continue
            seen_ids.extend(feed_back(messages, message))
    finally:
        client.close()
    return {"ids": seen_ids, "served": served, "failures": failures}


class RoutedSessionTests(TestCase):
    """A long session survives its first upstream going away and coming back."""

    def setUp(self):
        if anthropic is None:
            raise SkipTest("the anthropic SDK is not installed (pip install '.[test]')")

    async def test_first_target_down_and_back(self):
        """
        200 streaming turns: zero failed, no id seen twice by the client,
        turns served by the fallback while the first target was down and by
        the first again after it came back (read from ``x-relay-upstream``);
        the small model's turns go to the Kimi-style upstream throughout.
        """
        strict = StoppableUpstream(mode="strict", seed=11, reuse_every=3)
        self.addCleanup(strict.cleanup)
        kimi = StoppableUpstream(mode="strict", seed=12, id_style="kimi", reuse_every=0, left_out_ids="some")
        self.addCleanup(kimi.cleanup)
        config = RelayConfig(
            listen=(),
            dump_dir=None,
            connect_timeout=2.0,
            breaker_cooldown=0.2,
            upstreams=(Upstream("strict", strict.url), Upstream("kimi", kimi.url)),
            routes=(
                Route(targets=(Target("kimi"), Target("strict")), models=("claude-haiku-*",)),
                Route(targets=(Target("strict"), Target("kimi"))),
            ),
        )
        served = serve_relay(self, config, reactor)

        outcome = await deferToThread(run_routed_session, served.url, strict)

        self.assertEqual(outcome["failures"], [])
        self.assertEqual(len(outcome["served"]), TURNS)
        ids = outcome["ids"]
        self.assertEqual(len(ids), len(set(ids)), "the client saw an id twice")
        main = [(turn, name) for turn, model, name in outcome["served"] if model == "claude-sonnet-4-5"]
        small = {name for _, model, name in outcome["served"] if model == "claude-haiku-4-5"}
        self.assertEqual({name for turn, name in main if turn < DOWN_AT}, {"strict"})
        self.assertEqual({name for turn, name in main if DOWN_AT <= turn < UP_AT}, {"kimi"})
        after = [name for turn, name in main if turn >= UP_AT]
        self.assertEqual(after[-20:], ["strict"] * 20, "the first target did not serve again once back")
        self.assertEqual(small, {"kimi"})
        self.assertTrue(any(i.startswith("functions.") for i in ids), "no Kimi-style id reached the client")
