"""
The request path's routing in memory, on a clock: the relay and two
upstreams served by real sites over ``iosim`` pumps, time moved by hand.
A breaker opens after failures in a row, skips its upstream for the
cooldown, lets one probe through once the cooldown has passed on the
clock, and closes on its success.
"""

from __future__ import annotations

from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource

from twisted_relay.config import RelayConfig, Route, Target, Upstream

from tests.helpers import InMemoryRelay, encode, messages_body


class _Scripted(Resource):
    """An upstream that answers each request with the next status of its script (200 when it is empty)."""

    isLeaf = True

    def __init__(self, *statuses):
        super().__init__()
        self.statuses = list(statuses)
        self.count = 0

    def render_POST(self, request):
        self.count += 1
        status = self.statuses.pop(0) if self.statuses else 200
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/json")
        if status == 200:
            return encode({"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                           "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
                           "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})
        return encode({"type": "error", "error": {"type": "api_error", "message": "down"}})


class BreakerOnClockTests(TestCase):
    """The breaker through real requests, its cooldown on a clock."""

    def setUp(self):
        self.first = _Scripted(503, 503, 503)
        self.second = _Scripted()
        config = RelayConfig(
            listen=(),
            dump_dir=None,
            breaker_failures=2,
            breaker_cooldown=30.0,
            upstreams=(Upstream("first", "http://first.test"), Upstream("second", "http://second.test")),
            routes=(Route(targets=(Target("first"), Target("second"))),),
        )
        self.relay = InMemoryRelay(
            _Scripted(), config, more_upstreams={b"first.test": self.first, b"second.test": self.second}
        )

    def served(self):
        d = self.relay.post("/v1/messages", messages_body())
        self.relay.flush()
        response = self.successResultOf(d)
        self.successResultOf(response.content())
        self.assertEqual(response.code, 200)
        return response.headers.getRawHeaders(b"x-relay-upstream")[0].decode()

    def test_open_probe_fail_probe_close(self):
        """
        Two 503s open ``first``; it is skipped until 30 s pass on the clock;
        the probe fails (503) and opens it for another 30 s; the next probe
        succeeds and closes it.
        """
        router = self.relay.app.router
        self.assertEqual([self.served(), self.served()], ["second", "second"])
        self.assertEqual(router.state("first"), "open")
        self.relay.clock.advance(29)
        self.assertEqual(self.served(), "second")
        self.assertEqual(self.first.count, 2)
        self.relay.clock.advance(1.5)
        self.assertEqual(router.state("first"), "half_open")
        self.assertEqual(self.served(), "second")  # the probe: 503, failed over
        self.assertEqual(self.first.count, 3)
        self.assertEqual(router.state("first"), "open")
        self.relay.clock.advance(31)
        self.assertEqual(self.served(), "first")
        self.assertEqual(router.state("first"), "closed")
        self.assertEqual(self.served(), "first")

    def test_refused_then_back(self):
        """
        ``first`` refusing connections: every request is served by
        ``second``; once it listens again and the cooldown has passed on
        the clock, the probe finds it and it serves again.
        """
        from twisted.web.server import Site

        self.first.statuses = []
        self.relay.network.stop_listening(b"first.test", 80)
        self.assertEqual([self.served() for _ in range(4)], ["second"] * 4)
        self.assertEqual(self.relay.app.router.state("first"), "open")
        self.relay.network.listen(b"first.test", 80, Site(self.first, reactor=self.relay.clock))
        self.assertEqual(self.served(), "second")
        self.relay.clock.advance(30)
        self.assertEqual([self.served(), self.served()], ["first", "first"])
