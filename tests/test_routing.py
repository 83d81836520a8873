"""
Tests for L{twisted_relay.routing}: route matching, the attempt plan,
failover triggers, key pools and circuit breakers, on a L{Clock}.
"""

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.config import RelayConfig, Route, Target, Upstream, one_upstream
from twisted_relay.routing import (
    CLIENT_GONE,
    FAILOVER_KINDS,
    NO_RETRIES,
    NoRoute,
    Plan,
    RequestFacts,
    RetryRule,
    Router,
    Verdict,
    judge,
)

KEYS = ("sk-ant-pool-key-one", "sk-ant-pool-key-two", "sk-ant-pool-key-three")


def config(**changes):
    """Two upstreams: local (no keys) then anthropic (a pool of three)."""
    values = dict(
        upstreams=(
            Upstream("local", "http://127.0.0.1:8000", ids="original"),
            Upstream("anthropic", "https://api.anthropic.com", keys=KEYS, connect_timeout=3.0),
        ),
        routes=(
            Route(
                models=("claude-3-5-haiku*", "claude-haiku-*"),
                targets=(Target("local", "qwen3-coder"), Target("anthropic")),
            ),
            Route(targets=(Target("anthropic"),), models=("claude-opus-*",), thinking=True),
            Route(targets=(Target("local", "vision-model"),), images=True),
            Route(targets=(Target("local", "long-context"),), body_over=100_000),
            Route(targets=(Target("anthropic"),), models=("claude-*",)),
        ),
        breaker_failures=3,
        breaker_cooldown=30.0,
        key_rest=600.0,
    )
    values.update(changes)
    return RelayConfig(**values)


def body(model="claude-sonnet-4-5", **extra):
    return dict({"model": model, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}, **extra)


def labels(plan: Plan, *outcomes):
    """Run a plan, reporting each outcome in turn; the labels of the attempts made."""
    seen = []
    attempt = plan.first()
    for outcome in outcomes:
        seen.append(attempt.label)
        if isinstance(outcome, int):
            attempt = plan.report(attempt, outcome)
        else:
            attempt = plan.report(attempt, error_kind=outcome)
        if attempt is None:
            break
    return seen, attempt


class JudgeTests(SynchronousTestCase):
    """
    L{judge} is the rule of failover: which outcomes are tried elsewhere and
    which go to the client.
    """

    def test_triggers(self):
        """
        A connection failure, a timeout before the headers, 5xx and 529 fail
        over to the next target; so does 429 when no key pool can change.
        """
        for kind in ("connect", "tls", "dropped", "timeout", "failed"):
            self.assertIs(judge(error_kind=kind).verdict, Verdict.FAILOVER, kind)
        for status in (500, 502, 503, 504, 529):
            self.assertIs(judge(status).verdict, Verdict.FAILOVER, status)
            self.assertIs(judge(status, pooled=True).verdict, Verdict.FAILOVER, status)
        self.assertIs(judge(429).verdict, Verdict.FAILOVER)

    def test_next_key(self):
        """
        With a key pool, 429, 401 and 403 first try the next key of the
        same upstream.
        """
        for status in (429, 401, 403):
            self.assertIs(judge(status, pooled=True).verdict, Verdict.NEXT_KEY, status)

    def test_non_triggers(self):
        """
        An answer, and every other 4xx (deterministic: a 400 fails the same
        way everywhere), go to the client; so do 401/403 on the client's own
        credentials, and failures that are not the upstream's silence.
        """
        for status in (200, 201, 304, 400, 404, 405, 409, 413, 422):
            self.assertIs(judge(status).verdict, Verdict.DELIVER, status)
            self.assertIs(judge(status, pooled=True).verdict, Verdict.DELIVER, status)
        for status in (401, 403):
            self.assertIs(judge(status).verdict, Verdict.DELIVER, status)
        for kind in ("idle", "cut", "total_timeout", "overloaded", None):
            self.assertIs(judge(error_kind=kind).verdict, Verdict.DELIVER, kind)

    @given(
        st.one_of(st.none(), st.integers(100, 599)),
        st.one_of(st.none(), st.sampled_from(sorted(FAILOVER_KINDS) + ["idle", "cut"])),
        st.booleans(),
    )
    def test_never_after_first_byte(self, status, kind, pooled):
        """
        Once a byte reached the client, every outcome is delivered: nothing
        can be taken back.
        """
        self.assertIs(judge(status, error_kind=kind, first_byte_sent=True, pooled=pooled).verdict, Verdict.DELIVER)

    @given(st.integers(400, 499).filter(lambda s: s not in (401, 403, 429)), st.booleans())
    def test_other_4xx_never(self, status, pooled):
        """No 4xx but 401, 403 and 429 is ever tried again elsewhere."""
        self.assertIs(judge(status, pooled=pooled).verdict, Verdict.DELIVER)


# The rule's table: (outcome, judge's keywords, pooled, verdict with retries
# left, verdict with none left, upstream_failed, attempt_failed). The two
# flags are those of the verdict without retries (a retried send touches no
# breaker and counts as a retry). Retries: ``--retries 2`` with the default
# ``retry_statuses`` (429, 500, 502, 503, 504, 529) and ``max_retry_wait`` 10s.
DELIVER, RETRY, NEXT_KEY, FAILOVER, ABANDON, RECOVER = (
    Verdict.DELIVER, Verdict.RETRY, Verdict.NEXT_KEY, Verdict.FAILOVER, Verdict.ABANDON, Verdict.RECOVER,
)
# A 400 saying a thinking block is bound to a different conversation
# (``bound_elsewhere``), whose body may be sent again dropping such blocks
# (``droppable``: recovery on, not between_tools, not sent so already).
BOUND = dict(status=400, bound_elsewhere=True)
OUTCOMES = [
    ("connect failure", dict(error_kind="connect"), False, RETRY, FAILOVER, True, True),
    ("connect failure", dict(error_kind="connect"), True, RETRY, FAILOVER, True, True),
    ("dropped before the answer", dict(error_kind="dropped"), False, RETRY, FAILOVER, True, True),
    ("TLS failure", dict(error_kind="tls"), False, FAILOVER, FAILOVER, True, True),
    ("timeout before headers", dict(error_kind="timeout"), False, FAILOVER, FAILOVER, True, True),
    ("timeout before headers", dict(error_kind="timeout"), True, FAILOVER, FAILOVER, True, True),
    ("other failure", dict(error_kind="failed"), False, FAILOVER, FAILOVER, True, True),
    ("the request's own deadline", dict(error_kind="total_timeout"), False, DELIVER, DELIVER, False, True),
    ("relay overloaded", dict(error_kind="overloaded"), False, DELIVER, DELIVER, True, True),
    ("2xx", dict(status=200), False, DELIVER, DELIVER, False, False),
    ("2xx", dict(status=200), True, DELIVER, DELIVER, False, False),
    ("3xx", dict(status=304), False, DELIVER, DELIVER, False, False),
    ("4xx", dict(status=400), False, DELIVER, DELIVER, False, False),
    ("4xx", dict(status=400), True, DELIVER, DELIVER, False, False),
    ("4xx", dict(status=404), False, DELIVER, DELIVER, False, False),
    ("4xx", dict(status=413), True, DELIVER, DELIVER, False, False),
    ("400 bound elsewhere", dict(BOUND, droppable=True), False, RECOVER, RECOVER, False, False),
    ("400 bound elsewhere per key", dict(BOUND, droppable=True), True, RECOVER, RECOVER, False, False),
    ("400 bound elsewhere, not droppable", BOUND, True, DELIVER, DELIVER, False, False),
    ("400 droppable, not bound elsewhere", dict(status=400, droppable=True), True, DELIVER, DELIVER, False, False),
    (
        "after the first byte: 400 bound elsewhere",
        dict(BOUND, droppable=True, first_byte_sent=True), True, DELIVER, DELIVER, False, False,
    ),
    ("401 client's credentials", dict(status=401), False, DELIVER, DELIVER, False, True),
    ("401 per key", dict(status=401), True, NEXT_KEY, NEXT_KEY, False, True),
    ("403 client's credentials", dict(status=403), False, DELIVER, DELIVER, False, True),
    ("403 per key", dict(status=403), True, NEXT_KEY, NEXT_KEY, False, True),
    ("429 per target", dict(status=429), False, RETRY, FAILOVER, True, True),
    ("429 per key", dict(status=429), True, RETRY, NEXT_KEY, False, True),
    ("429 retry-after 5s", dict(status=429, retry_after=5.0), False, RETRY, FAILOVER, True, True),
    ("429 retry-after 5s per key", dict(status=429, retry_after=5.0), True, RETRY, NEXT_KEY, False, True),
    ("429 retry-after 60s", dict(status=429, retry_after=60.0), False, FAILOVER, FAILOVER, True, True),
    ("429 retry-after 60s per key", dict(status=429, retry_after=60.0), True, NEXT_KEY, NEXT_KEY, False, True),
    ("5xx", dict(status=500), False, RETRY, FAILOVER, True, True),
    ("5xx", dict(status=503), True, RETRY, FAILOVER, True, True),
    ("5xx retry-after 60s", dict(status=503, retry_after=60.0), False, FAILOVER, FAILOVER, True, True),
    ("5xx not in retry_statuses", dict(status=501), False, FAILOVER, FAILOVER, True, True),
    ("529", dict(status=529), False, RETRY, FAILOVER, True, True),
    ("529", dict(status=529), True, RETRY, FAILOVER, True, True),
    ("after the first byte: answered", dict(status=200, first_byte_sent=True), True, DELIVER, DELIVER, False, False),
    ("after the first byte: idle", dict(error_kind="idle", first_byte_sent=True), False, DELIVER, DELIVER, True, True),
    ("after the first byte: cut", dict(error_kind="cut", first_byte_sent=True), True, DELIVER, DELIVER, True, True),
    (
        "after the first byte: error event",
        dict(error_kind="stream_error", first_byte_sent=True), False, DELIVER, DELIVER, True, True,
    ),
    (
        "after the first byte: deadline",
        dict(error_kind="total_timeout", first_byte_sent=True), False, DELIVER, DELIVER, False, True,
    ),
    ("after the first byte: 5xx", dict(status=503, first_byte_sent=True), False, DELIVER, DELIVER, True, True),
    ("client gone", dict(error_kind=CLIENT_GONE), False, ABANDON, ABANDON, False, False),
    ("client gone", dict(error_kind=CLIENT_GONE), True, ABANDON, ABANDON, False, False),
    ("client gone mid-stream", dict(error_kind=CLIENT_GONE, first_byte_sent=True), True, ABANDON, ABANDON, False, False),
]


class OutcomeTableTests(SynchronousTestCase):
    """
    L{judge} decides every outcome, as the table L{OUTCOMES} lists them:
    sent again to the same target, the next key, the next target, given to
    the client, or abandoned; and whether the breaker and the failure
    metrics count it.
    """

    rule = RetryRule.from_config(RelayConfig(retries=2, max_retry_wait=10.0))

    def test_with_retries_left(self):
        """With retries left, the outcomes the retry rule covers are sent again to the same target."""
        for name, outcome, pooled, verdict, _, _, _ in OUTCOMES:
            for retried in (0, 1):
                judged = judge(pooled=pooled, retried=retried, retry=self.rule, **outcome)
                self.assertIs(judged.verdict, verdict, (name, pooled, retried))

    def test_without_retries_left(self):
        """Without retries (none configured, or all made), every outcome is judged as the plan judges it."""
        for name, outcome, pooled, _, verdict, upstream_failed, attempt_failed in OUTCOMES:
            for judged in (
                judge(pooled=pooled, retried=2, retry=self.rule, **outcome),
                judge(pooled=pooled, retry=NO_RETRIES, **outcome),
                judge(pooled=pooled, **outcome),
            ):
                self.assertEqual(
                    (judged.verdict, judged.upstream_failed, judged.attempt_failed),
                    (verdict, upstream_failed, attempt_failed),
                    (name, pooled),
                )

    def test_retry_counts_nothing(self):
        """A retried send is no failure of the breaker or the attempt: it counts as a retry."""
        for name, outcome, pooled, verdict, _, _, _ in OUTCOMES:
            judged = judge(pooled=pooled, retry=self.rule, **outcome)
            if verdict is RETRY:
                self.assertEqual((judged.upstream_failed, judged.attempt_failed), (False, False), name)

    def test_retry_waits(self):
        """
        A retry waits what the upstream asked (``retry-after``), else 0.5s,
        1s, 2s... doubling per retry made, at most 8s.
        """
        rule = RetryRule.from_config(RelayConfig(retries=10, max_retry_wait=10.0))
        self.assertEqual(judge(429, retry_after=5.0, retry=rule).wait, 5.0)
        self.assertEqual(judge(429, retry_after=0.0, retry=rule).wait, 0.0)
        waits = [judge(error_kind="connect", retried=n, retry=rule).wait for n in range(6)]
        self.assertEqual(waits, [0.5, 1.0, 2.0, 4.0, 8.0, 8.0])

    def test_only_429_and_5xx_retried(self):
        """A status in ``retry_statuses`` is retried only when it is 429 or 5xx."""
        rule = RetryRule(retries=1, statuses=frozenset({401, 404, 429, 503}), max_wait=60.0)
        self.assertIs(judge(401, retry=rule).verdict, Verdict.DELIVER)
        self.assertIs(judge(404, retry=rule).verdict, Verdict.DELIVER)
        self.assertIs(judge(429, retry=rule).verdict, Verdict.RETRY)
        self.assertIs(judge(503, retry=rule).verdict, Verdict.RETRY)
        self.assertIs(judge(502, retry=rule).verdict, Verdict.FAILOVER)

    def test_plan_never_retries(self):
        """The plan judges without retries: same-target retries happen before it is told."""
        for name, outcome, pooled, _, verdict, _, _ in OUTCOMES:
            if verdict is ABANDON or "bound_elsewhere" in outcome or "droppable" in outcome:
                continue  # the plan is told the outcome once a recovery is done
            router = Router(config(), Clock())
            plan = router.plan(body("claude-haiku-4-5" if not pooled else "claude-sonnet-4-5"), 10)
            attempt = plan.first()
            self.assertEqual(attempt.key_index is not None, pooled)
            plan.report(attempt, **outcome)
            self.assertIs(plan.tried[-1].verdict, verdict, name)

    def test_give_up(self):
        """
        When nothing is left to try, a failure without an answer is given
        as it is after one attempt, as L{Plan.error} (502 ``exhausted``)
        after several; a failure delivered as it is stays itself.
        """
        from twisted_relay.errors import RelayError

        plan = Router(config(), Clock()).plan(body("claude-haiku-4-5"), 10)
        attempt = plan.first()
        attempt = plan.report(attempt, error_kind="connect")
        self.assertIsNone(plan.report(attempt, 503))
        refused = RelayError(502, "down", kind="connect")
        self.assertEqual(plan.failure(refused).kind, "exhausted")

        plan = Router(config(), Clock()).plan(body(), 10)
        attempt = plan.first()
        deadline = RelayError(504, "late", kind="total_timeout")
        self.assertIsNone(plan.report(attempt, error_kind="total_timeout"))
        self.assertIs(plan.failure(deadline), deadline)

        plan = Router(config(upstreams=config().upstreams[:1], routes=(Route(targets=(Target("local"),)),)), Clock())
        single = plan.plan(body(), 10)
        self.assertIsNone(single.report(single.first(), error_kind="connect"))
        self.assertIs(single.failure(refused), refused)

    def test_abandon_touches_nothing(self):
        """A client gone is not an attempt's outcome: no breaker hears of it, the plan records nothing."""
        router = Router(config(), Clock())
        plan = router.plan(body(), 10)
        attempt = plan.first()
        self.assertIsNone(plan.report(attempt, error_kind=CLIENT_GONE))
        self.assertEqual(plan.tried, [])
        self.assertEqual(router.health_of("anthropic").breaker.failures, 0)


class RouteMatchingTests(SynchronousTestCase):
    """
    The first route that matches a request wins; a route's conditions are
    model globs, thinking, images and body size.
    """

    def setUp(self):
        self.router = Router(config(), Clock())

    def route_index(self, request_body, size=1000):
        plan = self.router.plan(request_body, size)
        if isinstance(plan, NoRoute):
            return None
        return self.router.config.routes.index(plan.route)

    def test_model_globs_and_rename(self):
        """
        Glob patterns pick the route; the target's model is the name sent
        upstream, and a target without one sends the client's.
        """
        plan = self.router.plan(body("claude-3-5-haiku-20241022"), 1000)
        first = plan.first()
        self.assertEqual((first.upstream.name, first.model), ("local", "qwen3-coder"))
        second = plan.report(first, 503)
        self.assertEqual((second.upstream.name, second.model), ("anthropic", "claude-3-5-haiku-20241022"))
        self.assertEqual(self.route_index(body("claude-haiku-4-5")), 0)
        self.assertEqual(self.route_index(body("claude-sonnet-4-5")), 4)

    def test_first_match_wins(self):
        """
        A request several routes match goes by the first: a haiku request
        with an image goes to the haiku route, not the image route.
        """
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
        request = body("claude-haiku-4-5")
        request["messages"] = [{"role": "user", "content": [image]}]
        self.assertEqual(self.route_index(request), 0)

    def test_thinking(self):
        """
        ``thinking = true`` matches requests with extended thinking enabled
        only; disabled thinking, or none, goes on to the next route.
        """
        enabled = body("claude-opus-4-1", thinking={"type": "enabled", "budget_tokens": 2048})
        self.assertEqual(self.route_index(enabled), 1)
        disabled = body("claude-opus-4-1", thinking={"type": "disabled"})
        self.assertEqual(self.route_index(disabled), 4)
        self.assertEqual(self.route_index(body("claude-opus-4-1")), 4)

    def test_images(self):
        """
        ``images = true`` matches a request holding an image, in a message
        or inside a tool result (a screenshot read by a tool).
        """
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
        in_message = body("gpt-like")
        in_message["messages"] = [{"role": "user", "content": [{"type": "text", "text": "look"}, image]}]
        self.assertEqual(self.route_index(in_message), 2)
        in_result = body("gpt-like")
        in_result["messages"] = [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [image]}]}
        ]
        self.assertEqual(self.route_index(in_result), 2)
        self.assertIsNone(self.route_index(body("gpt-like")))

    def test_body_over(self):
        """``body-over`` matches bodies larger than the size only (long contexts)."""
        self.assertEqual(self.route_index(body("other"), 100_001), 3)
        self.assertIsNone(self.route_index(body("other"), 100_000))

    def test_no_route(self):
        """
        A request no route matches gets a 404 ``not_found_error`` that names
        its model.
        """
        plan = self.router.plan(body("gpt-4o"), 10)
        self.assertIsInstance(plan, NoRoute)
        error = plan.error()
        self.assertEqual((error.status, error.error_type), (404, "not_found_error"))
        self.assertIn("'gpt-4o'", error.message)
        self.assertIn("without a model", NoRoute(None).error().message)

    def test_catch_all_of_one_upstream(self):
        """
        A configuration without upstreams has the one upstream ``default``
        and a route that sends every model to it, as before.
        """
        router = Router(RelayConfig(upstreams=one_upstream("http://127.0.0.1:9", key="sk-ant-single")), Clock())
        attempt = router.plan({"model": "anything"}, 10).first()
        self.assertEqual((attempt.upstream.name, attempt.upstream.url), ("default", "http://127.0.0.1:9"))
        self.assertEqual((attempt.key, attempt.key_index, attempt.model), ("sk-ant-single", 0, "anything"))

    def test_model_lookup(self):
        """``GET /v1/models/{id}`` is routed like a request for that model."""
        plan = self.router.plan_for(RequestFacts.for_model("claude-haiku-4-5"))
        self.assertEqual(plan.first().upstream.name, "local")

    def test_model_listing(self):
        """
        ``GET /v1/models`` goes to the first target of the route that takes
        any model (a catch-all after the haiku route); with none, of the
        first route.
        """
        routes = config().routes[:1] + (Route(targets=(Target("anthropic"),)),)
        plan = Router(config(routes=routes), Clock()).plan_for_listing()
        self.assertEqual(plan.route, routes[1])
        attempt = plan.first()
        self.assertEqual((attempt.upstream.name, attempt.model), ("anthropic", None))
        self.assertEqual(self.router.plan_for_listing().route, self.router.config.routes[0])

    def test_upstream_settings_filled_in(self):
        """
        An attempt's upstream carries its own settings, and the relay's
        where it leaves them.
        """
        router = Router(config(response_timeout=42.0), Clock())
        attempt = router.plan(body(), 10).first()
        self.assertEqual((attempt.upstream.connect_timeout, attempt.upstream.response_timeout), (3.0, 42.0))


class FailoverTests(SynchronousTestCase):
    """
    The plan tries the route's targets in order while the outcomes call for
    it, and stops at the first answer for the client.
    """

    def setUp(self):
        self.clock = Clock()
        self.router = Router(config(), self.clock)

    def test_order_and_stop(self):
        """
        A 5xx, a 529 or a connection failure moves on to the next target;
        an answer stops the plan.
        """
        for trigger in (500, 529, "connect", "timeout"):
            router = Router(config(), self.clock)
            seen, following = labels(router.plan(body("claude-haiku-4-5"), 10), trigger, 200)
            self.assertEqual(seen[0], "local", trigger)
            self.assertTrue(seen[1].startswith("anthropic key #"), trigger)
            self.assertIsNone(following)

    def test_400_delivered(self):
        """A 400 from the first target is the answer: nothing else is tried."""
        seen, following = labels(self.router.plan(body("claude-haiku-4-5"), 10), 400)
        self.assertEqual(seen, ["local"])
        self.assertIsNone(following)

    def test_nothing_after_first_byte(self):
        """A failure once a byte reached the client is delivered as it is."""
        plan = self.router.plan(body("claude-haiku-4-5"), 10)
        attempt = plan.first()
        self.assertIsNone(plan.report(attempt, error_kind="cut", first_byte_sent=True))

    def test_every_target_failed(self):
        """
        When every attempt failed the plan ends; its error says what was
        tried, naming keys by position only.
        """
        plan = self.router.plan(body("claude-haiku-4-5"), 10)
        seen, following = labels(plan, "connect", 529)
        self.assertIsNone(following)
        error = plan.error()
        self.assertEqual(error.status, 502)
        self.assertRegex(error.message, r"local \(connect\), anthropic key #\d \(529\)")
        for key in KEYS:
            self.assertNotIn(key, error.message)
            self.assertNotIn(key, repr(plan.tried))

    def test_report_in_order(self):
        """Reporting an attempt the plan did not give last is a mistake, said at once."""
        plan = self.router.plan(body("claude-haiku-4-5"), 10)
        attempt = plan.first()
        plan.report(attempt, 503)
        self.assertRaises(ValueError, plan.report, attempt, 503)
        self.assertRaises(ValueError, plan.first)


class KeyPoolTests(SynchronousTestCase):
    """
    A key pool spreads requests over its keys; 429, 401 and 403 try the
    next key of the same upstream first; refused keys rest longer.
    """

    def setUp(self):
        self.clock = Clock()
        self.router = Router(config(), self.clock)

    def plan(self):
        """A request of no conversation, which takes the pool's rotation (conversations: tests.test_affinity)."""
        return self.router.plan(body("claude-sonnet-4-5", messages=[]), 10)

    def test_rotation(self):
        """Successive requests of no conversation (no user message) start at successive keys of the pool."""
        starts = []
        for _ in range(4):
            plan = self.plan()
            attempt = plan.first()
            starts.append(attempt.key_index)
            self.assertEqual(attempt.key, KEYS[attempt.key_index])
            plan.report(attempt, 200)
        self.assertEqual(starts, [0, 1, 2, 0])

    def test_429_next_key_then_rests(self):
        """
        A 429 tries the next key of the same upstream; the limited key rests
        for the cooldown (or the retry-after, when longer), then is used again.
        """
        plan = self.plan()
        first = plan.first()
        second = plan.report(first, 429, retry_after=45.0)
        self.assertEqual((second.upstream.name, second.key_index), ("anthropic", 1))
        self.assertIsNone(plan.report(second, 200))
        self.assertEqual(self.router.keys_resting("anthropic"), (1,))
        used = set()
        for _ in range(4):
            p = self.plan()
            a = p.first()
            used.add(a.key_index)
            p.report(a, 200)
        self.assertNotIn(0, used)
        self.clock.advance(45.0)
        self.assertEqual(self.router.keys_resting("anthropic"), ())

    def test_refused_key_rests_longer(self):
        """
        A key refused with 401 or 403 rests for ``key_rest``; it is then
        probed with one request, and a success puts it back in rotation.
        """
        plan = self.plan()
        first = plan.first()
        following = plan.report(first, 401)
        self.assertEqual(following.key_index, 1)
        plan.report(following, 200)
        self.clock.advance(599.0)
        self.assertEqual(self.router.keys_resting("anthropic"), (1,))
        self.clock.advance(1.0)
        self.assertEqual(self.router.keys_resting("anthropic"), ())
        # The rested key is probed by one request and is back after it.
        keys = []
        for _ in range(3):
            p = self.plan()
            a = p.first()
            keys.append(a.key_index)
            p.report(a, 200)
        self.assertIn(0, keys)

    def test_every_key_refused_fails_over(self):
        """
        When every key of an upstream is refused, the next target is tried;
        with no next target, the last answer goes to the client.
        """
        plan = self.router.plan(body("claude-haiku-4-5"), 10)
        seen, following = labels(plan, 503, 403, 403, 403)
        self.assertEqual(seen[0], "local")
        self.assertEqual(sorted(seen[1:]), ["anthropic key #1", "anthropic key #2", "anthropic key #3"])
        self.assertIsNone(following)
        self.assertEqual(self.router.keys_resting("anthropic"), (1, 2, 3))

    def test_resting_keys_still_tried(self):
        """
        When every key is resting, the keys are still tried in turn rather
        than the request failing untried.
        """
        for index in range(3):
            self.router.health_of("anthropic").keys[index].rest(self.clock.seconds(), 600)
        plan = self.plan()
        attempt = plan.first()
        self.assertTrue(attempt.resting)
        self.assertEqual(attempt.upstream.name, "anthropic")
        self.assertIsNone(plan.report(attempt, 200))
        self.assertEqual(len(self.router.keys_resting("anthropic")), 2)


class BreakerTests(SynchronousTestCase):
    """
    After N failures in a row an upstream is skipped for a cooldown, then
    one request probes it: a success closes it, a failure opens it again.
    """

    def setUp(self):
        self.clock = Clock()
        self.router = Router(config(), self.clock)

    def haiku(self, *outcomes):
        return labels(self.router.plan(body("claude-haiku-4-5"), 10), *outcomes)

    def test_open_probe_close(self):
        """
        Three failures in a row open the breaker: requests skip ``local``;
        after the cooldown one request probes it, while others still skip
        it; its success closes the breaker.
        """
        for _ in range(2):
            self.haiku("connect", 200)
            self.assertEqual(self.router.state("local"), "closed")
        self.haiku("connect", 200)
        self.assertEqual(self.router.state("local"), "open")
        seen, _ = self.haiku(200)
        self.assertEqual(seen[0][:9], "anthropic")

        self.clock.advance(30.0)
        self.assertEqual(self.router.state("local"), "half_open")
        probe_plan = self.router.plan(body("claude-haiku-4-5"), 10)
        probe = probe_plan.first()
        self.assertEqual(probe.upstream.name, "local")
        # While the probe is out, other requests keep away.
        seen, _ = self.haiku(200)
        self.assertEqual(seen[0][:9], "anthropic")
        self.assertIsNone(probe_plan.report(probe, 200))
        self.assertEqual(self.router.state("local"), "closed")
        seen, _ = self.haiku(200)
        self.assertEqual(seen, ["local"])

    def test_failed_probe_opens_again(self):
        """A probe that fails opens the breaker for another cooldown."""
        for _ in range(3):
            self.haiku(503, 200)
        self.clock.advance(30.0)
        seen, _ = self.haiku(503, 200)
        self.assertEqual(seen[0], "local")
        self.assertEqual(self.router.state("local"), "open")
        self.clock.advance(29.0)
        self.assertEqual(self.router.state("local"), "open")
        self.clock.advance(1.0)
        self.assertEqual(self.router.state("local"), "half_open")

    def test_lost_probe(self):
        """A probe that never reports lets another through after a cooldown."""
        for _ in range(3):
            self.haiku(503, 200)
        self.clock.advance(30.0)
        self.router.plan(body("claude-haiku-4-5"), 10).first()  # never reported
        self.assertEqual(self.router.state("local"), "open")
        self.clock.advance(30.0)
        self.assertEqual(self.router.plan(body("claude-haiku-4-5"), 10).first().upstream.name, "local")

    def test_success_resets_the_count(self):
        """Only failures in a row count: a success in between starts over."""
        for _ in range(5):
            self.haiku(503, 200)
            self.haiku(200)
        self.assertEqual(self.router.state("local"), "closed")

    def test_400_is_not_a_failure(self):
        """A deterministic 4xx says the upstream is up: it never opens the breaker."""
        for _ in range(5):
            self.haiku(400)
        self.assertEqual(self.router.state("local"), "closed")

    def test_broken_stream_counts(self):
        """
        A stream broken after its first byte is delivered, but counts as a
        failure of the upstream.
        """
        for _ in range(3):
            plan = self.router.plan(body("claude-haiku-4-5"), 10)
            self.assertIsNone(plan.report(plan.first(), 200, error_kind="idle", first_byte_sent=True))
        self.assertEqual(self.router.state("local"), "open")

    def test_all_resting_tried_in_order(self):
        """
        When every target of a route is resting they are still tried, in
        the route's order: the relay never fails a request without trying.
        """
        for _ in range(3):
            self.haiku(503, 503)
        self.assertEqual(self.router.state("local"), "open")
        self.assertEqual(self.router.state("anthropic"), "open")
        plan = self.router.plan(body("claude-haiku-4-5"), 10)
        first = plan.first()
        self.assertEqual((first.upstream.name, first.resting), ("local", True))
        second = plan.report(first, 503)
        self.assertEqual((second.upstream.name, second.resting), ("anthropic", True))
        self.assertIsNone(plan.report(second, 200))
        self.assertEqual(self.router.state("anthropic"), "closed")


class ReloadedRouterTests(SynchronousTestCase):
    """A reloaded router keeps what it learned of upstreams that did not change."""

    def test_health_kept_for_the_same_backend(self):
        """
        An upstream with the same URL and keys keeps its breaker across a
        reload; one whose URL changed starts healthy.
        """
        clock = Clock()
        router = Router(config(), clock)
        for _ in range(3):
            labels(router.plan(body("claude-haiku-4-5"), 10), 503, 200)
        self.assertEqual(router.state("local"), "open")
        same = router.reloaded(config(breaker_cooldown=60.0))
        self.assertEqual(same.state("local"), "open")
        moved = config(
            upstreams=(
                Upstream("local", "http://127.0.0.1:8001"),
                Upstream("anthropic", "https://api.anthropic.com", keys=KEYS),
            )
        )
        self.assertEqual(router.reloaded(moved).state("local"), "closed")


class NoKeyShownTests(SynchronousTestCase):
    """No repr of a routing value shows a key."""

    def test_reprs(self):
        """Attempts, plans, upstreams and configurations show keys by count or position only."""
        cfg = config(relay_keys=("sk-relay-key",))
        cfg = cfg.with_changes(upstreams=cfg.upstreams + one_upstream("http://127.0.0.1:9", key="sk-ant-single-key"))
        router = Router(cfg, Clock())
        plan = router.plan(body("claude-sonnet-4-5"), 10)
        attempt = plan.first()
        plan.report(attempt, 429)
        shown = " ".join(
            repr(x) for x in (cfg, attempt, plan.tried, cfg.upstreams, router.settings, plan.error())
        ) + plan.error().message
        for key in KEYS + ("sk-ant-single-key", "sk-relay-key"):
            self.assertNotIn(key, shown)
        self.assertIn("keys=<3>", shown)


_OUTCOMES = st.sampled_from([200, 400, 401, 403, 429, 500, 503, 529, "connect", "timeout", "idle"])


class PlanPropertyTests(SynchronousTestCase):
    """Whatever the outcomes and the health before, a plan is bounded and never gives up untried."""

    @given(
        outcomes=st.lists(_OUTCOMES, min_size=1, max_size=12),
        rested=st.lists(st.sampled_from(["local", "anthropic", 0, 1, 2]), max_size=5),
        model=st.sampled_from(["claude-haiku-4-5", "claude-sonnet-4-5"]),
    )
    def test_bounded_and_thorough(self, outcomes, rested, model):
        """
        Each upstream and key is tried at most once per request; the plan
        ends; and when it ends on a failure that calls for another try,
        every target of the route was tried.
        """
        clock = Clock()
        router = Router(config(), clock)
        for what in rested:
            if isinstance(what, str):
                router.health_of(what).breaker.rest(0.0, 100.0)
            else:
                router.health_of("anthropic").keys[what].rest(0.0, 100.0)
        plan = router.plan(body(model), 10)
        attempt = plan.first()
        made = []
        outcomes = list(outcomes)
        while attempt is not None:
            made.append((attempt.upstream.name, attempt.key_index))
            self.assertLessEqual(len(made), 4)
            outcome = outcomes.pop(0) if outcomes else 503
            if isinstance(outcome, int):
                attempt = plan.report(attempt, outcome)
            else:
                attempt = plan.report(attempt, error_kind=outcome)
        self.assertEqual(len(made), len(set(made)))
        if plan.tried[-1].verdict is not Verdict.DELIVER:
            self.assertEqual(
                {name for name, _ in made}, {t.upstream for t in plan.route.targets}
            )
