"""
Routing on real sockets on 127.0.0.1: the relay in front of several
scripted upstreams (:class:`tests.faulty_upstream.FaultyUpstream`), with a
configuration of upstreams and routes.

Route matching and model renames on real requests; each failover trigger
(a refused connection, a reset, no headers in time, 5xx, 529, 429) and each
non-trigger (a 400, anything after the first byte); key rotation and
resting; the circuit breaker opening, probing and closing; the answer when
every target fails; and ``x-relay-upstream`` on every answer. How the wait
an upstream asks for (``retry-after``) is read.
"""

from __future__ import annotations

import treq
import ujson
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.http_headers import Headers

from twisted_relay.affinity import conversation_of, key_digest, key_order
from twisted_relay.attempts import retry_after
from twisted_relay.config import RelayConfig, Route, Target, Upstream, one_upstream

from tests.faulty_upstream import (
    Answer,
    FaultyUpstream,
    Hang,
    Reset,
    closed_port_url,
    cut_after,
    error_answer,
    message_json,
)
from tests.helpers import encode, messages_body, serve_relay

FAST = dict(
    connect_timeout=1.0,
    response_timeout=1.0,
    idle_timeout=2.0,
    ping_interval=0,
    shutdown_grace=0.5,
    dump_dir=None,
    listen=(),
)
KEY_A = "sk-ant-failover-key-aaaa"
KEY_B = "sk-ant-failover-key-bbbb"


def sleep(seconds: float):
    return deferLater(reactor, seconds, lambda: None)


class RelayOverUpstreams:
    """A relay with upstreams and routes, on a real port; the upstreams scripted."""

    def start_relay(self, upstreams, routes=(), **settings) -> str:
        config = RelayConfig(upstreams=tuple(upstreams), routes=tuple(routes), **dict(FAST, **settings))
        served = serve_relay(self, config, reactor)
        self.relay = served.relay
        self.base = served.url
        return self.base

    def upstream(self) -> tuple[FaultyUpstream, str]:
        upstream = FaultyUpstream(reactor)
        url = upstream.listen()
        self.addCleanup(upstream.stop)
        return upstream, url

    async def post(self, body: dict, path: str = "/v1/messages", key: str = "sk-ant-client-own"):
        response = await treq.post(
            self.base + path,
            data=encode(body),
            headers={"content-type": ["application/json"], "x-api-key": [key]},
            persistent=False,
        )
        return response, await response.content()

    async def get(self, path: str):
        response = await treq.get(self.base + path, headers={"x-api-key": ["sk-ant-client-own"]}, persistent=False)
        return response, await response.content()


def served_by(response) -> str | None:
    values = response.headers.getRawHeaders(b"x-relay-upstream")
    return values[0].decode("ascii") if values else None


def sent_model(record) -> str:
    return ujson.loads(record.body)["model"]


class RouteTests(RelayOverUpstreams, TestCase):
    """The first route that matches chooses the upstream; a target's model is the name sent."""

    def setUp(self):
        self.a, url_a = self.upstream()
        self.b, url_b = self.upstream()
        self.start_relay(
            [Upstream("cheap", url_a), Upstream("main", url_b)],
            [
                Route(targets=(Target("cheap", "qwen3-coder"), Target("main")), models=("claude-haiku-*",)),
                Route(targets=(Target("main"),), models=("claude-sonnet-*", "claude-opus-*")),
            ],
        )

    async def test_model_routes_and_renames(self):
        """A haiku request goes to ``cheap`` as ``qwen3-coder``; a sonnet one to ``main`` unchanged; each answer names its upstream."""
        response, _ = await self.post(messages_body(model="claude-haiku-4-5"))
        self.assertEqual(response.code, 200)
        self.assertEqual(served_by(response), "cheap")
        self.assertEqual([sent_model(r) for r in self.a.received], ["qwen3-coder"])
        response, _ = await self.post(messages_body(model="claude-sonnet-4-5"))
        self.assertEqual(served_by(response), "main")
        self.assertEqual([sent_model(r) for r in self.b.received], ["claude-sonnet-4-5"])

    async def test_no_route(self):
        """A model no route takes gets 404 ``not_found_error`` naming it, and nothing is sent."""
        response, body = await self.post(messages_body(model="gpt-5"))
        self.assertEqual(response.code, 404)
        error = ujson.loads(body)["error"]
        self.assertEqual(error["type"], "not_found_error")
        self.assertIn("'gpt-5'", error["message"])
        self.assertEqual(self.a.received + self.b.received, [])

    async def test_count_tokens_and_models(self):
        """``count_tokens`` is routed like messages; ``/v1/models/{id}`` like a request for that model, renamed."""
        response, _ = await self.post(messages_body(model="claude-haiku-4-5"), "/v1/messages/count_tokens")
        self.assertEqual(served_by(response), "cheap")
        self.assertEqual(self.a.received[-1].path, b"/v1/messages/count_tokens")
        self.assertEqual(sent_model(self.a.received[-1]), "qwen3-coder")
        response, _ = await self.get("/v1/models/claude-haiku-4-5")
        self.assertEqual(served_by(response), "cheap")
        self.assertEqual(self.a.received[-1].path, b"/v1/models/qwen3-coder")
        response, _ = await self.get("/v1/models/claude-opus-4-1")
        self.assertEqual(served_by(response), "main")
        self.assertEqual(self.b.received[-1].path, b"/v1/models/claude-opus-4-1")
        response, _ = await self.get("/v1/models/gpt-5")
        self.assertEqual(response.code, 404)

    async def test_listing_goes_to_the_route_for_any_model(self):
        """``GET /v1/models``: no route takes any model here, so the first route's first target."""
        response, _ = await self.get("/v1/models")
        self.assertEqual(served_by(response), "cheap")
        self.assertEqual(self.a.received[-1].path, b"/v1/models")


class FailoverTests(RelayOverUpstreams, TestCase):
    """Each outcome before the first byte that moves a request to the next target, and each that does not."""

    async def two(self, first_faults=(), second_faults=(), first_url=None, **settings):
        self.a, url_a = self.upstream()
        self.b, url_b = self.upstream()
        self.a.script(*first_faults)
        self.b.script(*second_faults)
        self.start_relay(
            [Upstream("first", first_url or url_a), Upstream("second", url_b)],
            [Route(targets=(Target("first"), Target("second")))],
            **settings,
        )

    async def assertFailedOver(self, stream=False):
        response, body = await self.post(messages_body(stream=stream))
        self.assertEqual(response.code, 200, body)
        self.assertEqual(served_by(response), "second")
        self.assertEqual(len(self.b.received), 1)
        return response, body

    async def test_connection_refused(self):
        """A refused connection fails over."""
        await self.two(first_url=await closed_port_url(reactor))
        await self.assertFailedOver()

    async def test_reset_before_answer(self):
        """A connection reset before any answer fails over."""
        await self.two([Reset()])
        await self.assertFailedOver()
        self.assertEqual(len(self.a.received), 1)

    async def test_no_headers_in_time(self):
        """No response headers within the response timeout fails over."""
        await self.two([Hang()])
        await self.assertFailedOver(stream=True)

    async def test_server_errors_and_overload(self):
        """503, 529 and 429 (no key pool) fail over; the client gets the second upstream's answer."""
        for status, kind in ((503, "api_error"), (529, "overloaded_error"), (429, "rate_limit_error")):
            await self.two([error_answer(status, kind)])
            _, body = await self.assertFailedOver(stream=True)
            self.assertIn(b"message_stop", body)
            await self.relay.service.stopService()
            await self.a.stop()
            await self.b.stop()

    async def test_bad_request_never(self):
        """A 400 goes to the client as it came; the second upstream is never asked."""
        await self.two([error_answer(400, "invalid_request_error", "messages.0: bad")])
        response, body = await self.post(messages_body())
        self.assertEqual(response.code, 400)
        self.assertEqual(served_by(response), "first")
        self.assertIn(b"messages.0: bad", body)
        self.assertEqual(self.b.received, [])

    async def test_nothing_after_first_byte(self):
        """A stream cut after its first events ends with an error event; the second upstream is never asked."""
        await self.two([cut_after(3)])
        response, body = await self.post(messages_body(stream=True))
        self.assertEqual(response.code, 200)
        self.assertEqual(served_by(response), "first")
        self.assertIn(b"event: error", body)
        self.assertEqual(self.b.received, [])

    async def test_retries_are_of_one_target(self):
        """``--retries 1``: the first upstream is asked twice, then the second."""
        await self.two([error_answer(503, "api_error"), error_answer(503, "api_error")], retries=1,
                       max_retry_wait=0.1)
        await self.assertFailedOver()
        self.assertEqual(len(self.a.received), 2)

    async def test_every_target_fails_with_answers(self):
        """When every target answers a failure, the client gets the last answer as it came."""
        await self.two([error_answer(503, "api_error")], [error_answer(529, "overloaded_error", "second busy")])
        response, body = await self.post(messages_body())
        self.assertEqual(response.code, 529)
        self.assertEqual(served_by(response), "second")
        self.assertIn(b"second busy", body)

    async def test_every_target_fails_without_answers(self):
        """When no target answers at all, a 502 ``api_error`` says what was tried."""
        await self.two([Reset()], [Reset()])
        response, body = await self.post(messages_body())
        self.assertEqual(response.code, 502)
        error = ujson.loads(body)["error"]
        self.assertEqual(error["type"], "api_error")
        self.assertEqual(error["message"], "Every upstream tried failed: first (dropped), second (dropped).")

    async def test_metrics_per_upstream(self):
        """``/metrics`` counts attempts, failures by kind and failovers per upstream."""
        await self.two([error_answer(529, "overloaded_error")])
        await self.assertFailedOver()
        _, text = await self.get("/metrics")
        text = text.decode()
        self.assertIn('relay_upstream_attempts_total{upstream="first"} 1.0', text)
        self.assertIn('relay_upstream_attempts_total{upstream="second"} 1.0', text)
        self.assertIn('relay_upstream_attempt_failures_total{kind="529",upstream="first"} 1.0', text)
        self.assertIn('relay_upstream_failovers_total{upstream="first"} 1.0', text)
        self.assertIn('relay_upstream_breaker_state{upstream="first"} 0.0', text)


class KeyPoolTests(RelayOverUpstreams, TestCase):
    """A key pool replaces the client's credentials, rotates, and moves past a refused or rate-limited key."""

    async def pool(self, *faults, second=False):
        self.a, url_a = self.upstream()
        self.a.script(*faults)
        upstreams = [Upstream("pool", url_a, keys=(KEY_A, KEY_B))]
        routes = ()
        if second:
            self.b, url_b = self.upstream()
            upstreams.append(Upstream("spare", url_b))
        self.start_relay(upstreams, routes)

    def keys_sent(self):
        return [r.header(b"x-api-key") for r in self.a.received]

    async def test_rotation(self):
        """
        Requests of one conversation stay on one key; conversations spread
        over the keys; the client's own key is never sent.
        """
        await self.pool()
        for n in range(4):
            for _ in range(2):
                body = messages_body([{"role": "user", "content": "conversation %d" % (n,)}])
                response, _ = await self.post(body)
                self.assertEqual(response.code, 200)
        sent = self.keys_sent()
        self.assertEqual([sent[i] for i in range(0, 8, 2)], [sent[i] for i in range(1, 8, 2)])
        self.assertEqual(sorted(set(k[0] for k in sent)), [KEY_A.encode(), KEY_B.encode()])

    async def test_refused_key_rests(self):
        """A 401 on the first key: the second key answers at once, and the first rests for later requests."""
        await self.pool(error_answer(401, "authentication_error"))
        # A conversation whose own key is the pool's first (keys go by conversation).
        pool = [key_digest(KEY_A), key_digest(KEY_B)]
        body = next(
            b for b in (messages_body([{"role": "user", "content": "conversation %d" % (n,)}]) for n in range(20))
            if key_order(conversation_of(b), pool)[0] == 0
        )
        response, _ = await self.post(body)
        self.assertEqual(response.code, 200)
        for _ in range(2):
            await self.post(body)
        self.assertEqual(self.keys_sent(), [[k.encode()] for k in (KEY_A, KEY_B, KEY_B, KEY_B)])
        self.assertEqual(self.relay.router.keys_resting("pool"), (1,))

    async def test_rate_limited_keys_then_next_target(self):
        """429 on both keys: the next target answers."""
        await self.pool(
            error_answer(429, "rate_limit_error", retry_after="30"),
            error_answer(429, "rate_limit_error", retry_after="30"),
            second=True,
        )
        response, _ = await self.post(messages_body())
        self.assertEqual(response.code, 200)
        self.assertEqual(served_by(response), "spare")
        self.assertEqual(len(self.a.received), 2)
        self.assertEqual(self.relay.router.keys_resting("pool"), (1, 2))


class BreakerTests(RelayOverUpstreams, TestCase):
    """After failures in a row an upstream is skipped; after the cooldown one request probes it."""

    async def test_open_probe_close(self):
        """Two 503s open the breaker: the next request skips ``first``; after the cooldown a probe closes it."""
        self.a, url_a = self.upstream()
        self.b, url_b = self.upstream()
        self.a.script(error_answer(503, "api_error"), error_answer(503, "api_error"))
        self.start_relay(
            [Upstream("first", url_a), Upstream("second", url_b)],
            breaker_failures=2,
            breaker_cooldown=0.3,
        )
        for _ in range(2):
            response, _ = await self.post(messages_body())
            self.assertEqual(served_by(response), "second")
        self.assertEqual(self.relay.router.state("first"), "open")
        response, _ = await self.post(messages_body())
        self.assertEqual(served_by(response), "second")
        self.assertEqual(len(self.a.received), 2, "an open breaker's upstream was asked")
        await sleep(0.35)
        response, _ = await self.post(messages_body())
        self.assertEqual(served_by(response), "first")
        self.assertEqual(self.relay.router.state("first"), "closed")

    async def test_stream_broken_after_first_byte_counts(self):
        """A stream cut mid-way is the client's, but counts against the upstream's breaker."""
        self.a, url_a = self.upstream()
        self.b, url_b = self.upstream()
        self.a.script(cut_after(3))
        self.start_relay([Upstream("first", url_a), Upstream("second", url_b)], breaker_failures=1)
        response, _ = await self.post(messages_body(stream=True))
        self.assertEqual(served_by(response), "first")
        self.assertEqual(self.relay.router.state("first"), "open")
        self.assertEqual(self.b.received, [])


class OneUpstreamTests(RelayOverUpstreams, TestCase):
    """Without upstreams and routes, the one upstream is ``default`` and answers say so."""

    async def test_default(self):
        """The one-upstream relay names its upstream ``default``; its key replaces the client's."""
        self.a, url_a = self.upstream()
        self.a.script(Answer(200, ujson.dumps(message_json()).encode()))
        self.start_relay(one_upstream(url_a, key=KEY_A))
        response, _ = await self.post(messages_body())
        self.assertEqual(served_by(response), "default")
        self.assertEqual(self.a.received[0].header(b"x-api-key"), [KEY_A.encode()])


class NoKeyAnywhereTests(RelayOverUpstreams, TestCase):
    """
    Requests with keys of two upstreams' pools, through refusals, rate
    limits, failovers, a 400 (dumped), a broken stream and an unreachable
    upstream: no key appears in any log line, dump, error body or metric.
    """

    async def test_grep_everything(self):
        """Every log event (each field), every dump file, every answer and ``/metrics`` hold none of the keys."""
        from twisted.logger import eventAsJSON, formatEvent, globalLogPublisher
        from twisted.python.filepath import FilePath

        events = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        keys = ("sk-ant-pool-one-0001", "sk-ant-pool-two-0002", "sk-ant-other-pool-0003")
        self.a, url_a = self.upstream()
        self.b, url_b = self.upstream()
        echo = b'{"type": "error", "error": {"type": "authentication_error", "message": "bad key %s"}}'
        self.a.script(
            Answer(401, echo % keys[0].encode(), ((b"content-type", b"application/json"),)),
            Answer(401, echo % keys[1].encode(), ((b"content-type", b"application/json"),)),
        )
        self.b.script(
            error_answer(429, "rate_limit_error", "slow down " + keys[2]),
            error_answer(400, "invalid_request_error", "messages.0: bad request from " + keys[2]),
            cut_after(2),
            error_answer(503, "api_error", "down " + keys[2]),
        )
        dump_dir = FilePath(self.mktemp())
        unreachable = await closed_port_url(reactor)
        self.start_relay(
            [
                Upstream("one", url_a, keys=keys[:2]),
                Upstream("two", url_b, keys=keys[2:]),
                Upstream("gone", unreachable, keys=keys[:1]),
            ],
            [
                Route(targets=(Target("one"), Target("two")), models=("claude-haiku-*",)),
                Route(targets=(Target("two"), Target("gone"))),
            ],
            dump_dir=dump_dir.path,
        )
        answers = []
        for body in (
            messages_body(model="claude-haiku-4-5"),  # one: 401, 401 (keys rest); two: 429: the last answer
            messages_body(),  # two: 400, dumped
            messages_body(stream=True),  # two: cut after the first byte
            messages_body(),  # two: 503, then gone: connect refused
            messages_body(model="claude-haiku-4-5"),  # one's keys resting: two answers
        ):
            response, answer = await self.post(body)
            answers.append(answer)
        self.assertEqual(len(self.a.received), 2)
        await self.relay.dumps.drain()
        _, metrics = await self.get("/metrics")
        answers.append(metrics)
        dumped = [path.getContent() for path in dump_dir.walk() if path.isfile()]
        self.assertTrue(dumped, "nothing was dumped")
        logged = [formatEvent(e) + eventAsJSON(e) for e in events]
        self.assertTrue(any("one key #1 (401)" in line for line in logged), "attempts are not logged")
        for key in keys:
            for where, texts in (("log", logged), ("dump", dumped), ("answer or metrics", answers)):
                for text in texts:
                    text = text if isinstance(text, str) else text.decode("utf-8", "replace")
                    self.assertNotIn(key, text, "a key in a %s" % (where,))


class ReloadOnRequestPathTests(RelayOverUpstreams, TestCase):
    """
    A reload applies to new requests: a new upstream gets a client of its
    own, an unchanged one keeps its client (and pool), a request in flight
    finishes where it began; an invalid file changes nothing.
    """

    def write(self, path, first_url, second_url, model="claude-sonnet-*"):
        path.setContent(
            (
                '[relay]\nno-dumps = true\nno-gc-tuning = true\nlisten = "tcp:0:interface=127.0.0.1"\n\n'
                '[upstreams.first]\nurl = "%s"\n\n[upstreams.second]\nurl = "%s"\n\n'
                '[[routes]]\nmodels = ["%s"]\ntargets = [{ upstream = "first" }, { upstream = "second" }]\n'
                % (first_url, second_url, model)
            ).encode()
        )

    async def test_valid_then_invalid(self):
        """After a reload moving ``first`` elsewhere, new requests go there; the stream in flight ends whole."""
        from twisted.python.filepath import FilePath

        from twisted_relay.tap import Options
        from tests.faulty_upstream import complete_stream

        old, old_url = self.upstream()
        new, new_url = self.upstream()
        second, second_url = self.upstream()
        old.script(complete_stream(deltas=5, delay=0.05))
        folder = FilePath(self.mktemp())
        folder.makedirs()
        path = folder.child("relay.toml")
        self.write(path, old_url, second_url)
        options = Options()
        options.parseOptions(["--config", path.path])
        served = serve_relay(self, options.config, reactor)
        self.relay = served.relay
        self.base = served.url
        second_client = self.relay.clients["second"]

        in_flight = ensureDeferred(self.post(messages_body(stream=True)))
        while not old.received:
            await sleep(0.01)
        self.write(path, new_url, second_url)
        self.assertIsNone(self.relay.reload().error)
        self.assertIs(self.relay.clients["second"], second_client)
        response, body = await self.post(messages_body())
        self.assertEqual(response.code, 200)
        self.assertEqual(len(new.received), 1)
        response, body = await in_flight
        self.assertEqual(response.code, 200)
        self.assertIn(b"message_stop", body)
        self.assertEqual(len(old.received), 1)

        path.setContent(b"[upstreams.first]\nurll = 'x'\n")
        self.assertIsNotNone(self.relay.reload().error)
        response, _ = await self.post(messages_body())
        self.assertEqual(served_by(response), "first")
        self.assertEqual(len(new.received), 2)


class StreamErrorEventTests(RelayOverUpstreams, TestCase):
    """An upstream's ``error`` event inside a 200 stream is the client's, and counts against the upstream."""

    async def test_overloaded_inside_stream(self):
        """The client gets the stream with its error event; the breaker opens; nothing fails over."""
        from tests.faulty_upstream import Stream, sse_events

        error = (
            b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}\n\n'
        )
        self.a, url_a = self.upstream()
        self.b, url_b = self.upstream()
        self.a.script(Stream([(0.0, sse_events()[0]), (0.0, error)]))
        self.start_relay([Upstream("first", url_a), Upstream("second", url_b)], breaker_failures=1)
        response, body = await self.post(messages_body(stream=True))
        self.assertEqual(served_by(response), "first")
        self.assertIn(b"overloaded_error", body)
        self.assertEqual(self.relay.router.state("first"), "open")
        self.assertEqual(self.b.received, [])


class RetryAfterTests(SynchronousTestCase):
    """
    The wait an upstream asks for is read from ``retry-after-ms`` or
    ``retry-after``, in seconds or as a date.
    """

    def test_forms(self):
        """
        Milliseconds win; seconds and HTTP dates are read; garbage is ignored.
        """
        self.assertEqual(retry_after(Headers({b"retry-after-ms": [b"1500"], b"retry-after": [b"9"]})), 1.5)
        self.assertEqual(retry_after(Headers({b"retry-after": [b"3"]})), 3.0)
        self.assertEqual(retry_after(Headers({b"retry-after": [b"Thu, 01 Jan 1970 00:00:00 GMT"]})), 0.0)
        self.assertIsNone(retry_after(Headers({b"retry-after": [b"soon"]})))
        self.assertIsNone(retry_after(Headers()))
        # A date past what the clock holds is garbage too, not a failure.
        self.assertIsNone(retry_after(Headers({b"retry-after": [b"1 Jan 99999999999 00:00:00"]})))
