"""
Tests for spreading request starts over reactor turns
(:mod:`twisted_relay.pacing`), and for the relay's requests waiting their
turn. Time is the test's: a turn's length is what the test says it is.
"""

from itertools import count

from prometheus_client import generate_latest

from twisted.internet.defer import CancelledError
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.config import RelayConfig, one_upstream
from twisted_relay.pacing import StartPacer

from tests.helpers import UPSTREAM_URL, InMemoryRelay, encode, messages_body
from tests.test_app import FixedAnswer
from tests.test_network import ManualStream


class _Time:
    """Time that the test moves."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Reactor:
    """A reactor's turns: what is called later runs in the next turn, not in this one."""

    def __init__(self):
        self.calls = []

    def callLater(self, delay, f, *args):
        self.calls.append((f, args))

    def next_turn(self):
        calls, self.calls = self.calls, []
        for f, args in calls:
            f(*args)


class StartPacerTests(SynchronousTestCase):
    """
    A turn starts requests until it has spent its budget; the rest start in
    the next turns, in order, at least one a turn.
    """

    def setUp(self):
        self.reactor = _Reactor()
        self.time = _Time()
        self.pacer = StartPacer(self.reactor, budget=0.001, patience=0.1, ratio=0.1, clock=self.time)
        # A stream runs: starts are paced.
        self.pacer.stream_began()
        self.started = []
        # What starting one request takes.
        self.cost = 0.0006

    def ask(self, name):
        def start(_):
            self.started.append(name)
            self.time.now += self.cost

        return self.pacer.turn().addCallback(start)

    def next_turn(self):
        """The reactor's next turn."""
        self.reactor.next_turn()

    def test_within_budget_at_once(self):
        """Requests start at once while the turn has not spent its budget."""
        self.cost = 0.0004
        for name in "abc":
            self.ask(name)
        self.assertEqual((self.started, self.pacer.waiting), (["a", "b", "c"], 0))

    def test_past_budget_waits_for_next_turns(self):
        """
        Past the budget requests wait, and start in the next turns in the
        order they came; the first of each turn always starts.
        """
        for name in "abcde":
            self.ask(name)
        # 0.6 ms each: two a turn.
        self.assertEqual((self.started, self.pacer.waiting), (["a", "b"], 3))
        self.next_turn()
        self.assertEqual(self.started, ["a", "b", "c", "d"])
        # A request that comes in the same turn queues behind.
        self.ask("f")
        self.next_turn()
        self.assertEqual((self.started, self.pacer.waiting), (["a", "b", "c", "d", "e", "f"], 0))
        # Idle again: the next requests start at once.
        self.next_turn()
        self.ask("g")
        self.assertEqual(self.started[-1], "g")
        self.cost = 0.005
        self.ask("h")
        self.ask("i")
        self.assertEqual((self.started[-2:], self.pacer.waiting), (["g", "h"], 1))

    def test_cancelled_gives_up_its_place(self):
        """A request whose client left while it waited never starts; the next one takes its turn."""
        self.cost = 0.002
        self.ask("a")
        b = self.ask("b")
        self.ask("c")
        b.cancel()
        self.failureResultOf(b, CancelledError)
        self.assertEqual(self.pacer.waiting, 1)
        self.next_turn()
        self.assertEqual((self.started, self.pacer.waiting), (["a", "c"], 0))

    def test_no_stream_no_pacing(self):
        """With no stream being relayed there is nothing to hold up: every request starts at once."""
        self.pacer.stream_ended()
        for name in "abcde":
            self.ask(name)
        self.assertEqual((self.started, self.pacer.waiting, self.reactor.calls), (list("abcde"), 0, []))
        # A stream begins: the next burst is paced again.
        self.pacer.stream_began()
        for name in "fgh":
            self.ask(name)
        self.assertEqual((self.started[5:], self.pacer.waiting), (["f", "g"], 1))

    def test_lasting_overload_lets_turns_grow(self):
        """
        Once the oldest waiting request has waited past the patience, a turn
        may start requests for a tenth of the extra wait on top of its budget.
        """
        self.cost = 0.002
        for n in range(50):
            self.ask(n)
        # Within the patience: one a turn (each takes twice the budget).
        self.next_turn()
        self.next_turn()
        self.assertEqual(len(self.started), 3)
        # The oldest waiting has waited 0.3 s, 0.2 s past the patience: 21 ms
        # a turn, so eleven starts of 2 ms.
        self.time.now += 0.296
        self.next_turn()
        self.assertEqual(len(self.started), 14)


class RequestTurnTests(SynchronousTestCase):
    """
    A relayed request waits for its turn in flight, and its client may leave
    meanwhile: it is then never sent upstream.
    """

    def setUp(self):
        self.upstream = FixedAnswer(200, encode({"type": "message", "content": []}),
                                    [(b"content-type", b"application/json")])
        config = RelayConfig(listen=(), upstreams=one_upstream(UPSTREAM_URL), dump_dir=None)
        self.relay = InMemoryRelay(self.upstream, config)
        # Every reading of the time a second later: past the first start of a
        # turn, every request waits for the next turn, which comes when the
        # test says (the in-memory network moves the test's clock as it goes).
        ticks = count()
        self.relay.app.starts.clock = lambda: float(next(ticks))
        self.turns = self.relay.app.starts.reactor = _Reactor()
        # As if a stream were being relayed: starts are paced.
        self.relay.app.starts.stream_began()

    def arrive(self):
        """Move bytes, and the clock, without a new turn of the pacer's."""
        self.relay.flush()

    def finish(self):
        """New turns until every request has started."""
        for _ in range(10):
            self.turns.next_turn()
            self.relay.flush()

    def test_second_waits_its_turn(self):
        first = self.relay.post("/v1/messages", messages_body())
        second = self.relay.post("/v1/messages", messages_body())
        self.arrive()
        # The first is answered; the second, in flight, waits.
        self.assertEqual(self.successResultOf(first).code, 200)
        self.assertNoResult(second)
        self.assertEqual((len(self.upstream.received), self.relay.app.in_flight), (1, 1))
        self.assertEqual(self.relay.app.starts.waiting, 1)
        self.finish()
        self.assertEqual(self.successResultOf(second).code, 200)
        self.assertEqual((len(self.upstream.received), self.relay.app.in_flight), (2, 0))

    def test_client_leaves_while_waiting(self):
        first = self.relay.post("/v1/messages", messages_body())
        second = self.relay.post("/v1/messages", messages_body())
        self.arrive()
        second.cancel()
        self.arrive()
        self.assertEqual(self.relay.app.starts.waiting, 0)
        self.finish()
        self.assertEqual(self.successResultOf(first).code, 200)
        self.failureResultOf(second)
        self.assertEqual((len(self.upstream.received), self.relay.app.in_flight), (1, 0))
        exposition = generate_latest(self.relay.app.metrics.registry).decode()
        self.assertIn('relay_requests_total{route="messages",status="499"} 1.0', exposition)


class StreamsCountedTests(SynchronousTestCase):
    """The pacer knows how many streams are being relayed: it paces starts only while one is."""

    def test_a_stream_counts_while_it_is_relayed(self):
        upstream = ManualStream()
        config = RelayConfig(listen=(), upstreams=one_upstream(UPSTREAM_URL), dump_dir=None)
        relay = InMemoryRelay(upstream, config)
        starts = relay.app.starts
        d = relay.post("/v1/messages", messages_body(stream=True))
        relay.flush()
        (held,) = upstream.requests
        held.write(b'event: message_start\ndata: {"type": "message_start", "message": {"id": "msg_1", '
                   b'"type": "message", "role": "assistant", "model": "m", "content": [], "usage": '
                   b'{"input_tokens": 1, "output_tokens": 1}}}\n\n')
        relay.flush()
        response = self.successResultOf(d)
        self.assertEqual((response.code, starts.streams), (200, 1))
        held.write(b'event: message_stop\ndata: {"type": "message_stop"}\n\n')
        held.finish()
        body = response.content()
        relay.flush()
        self.assertIn(b"message_stop", self.successResultOf(body))
        self.assertEqual(starts.streams, 0)
