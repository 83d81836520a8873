# -*- test-case-name: tests.test_routing -*-
"""
Where a request goes: the route that matches it, the attempts to make in
order (targets, each with its key pool), and the health of each upstream
and key (a circuit breaker on a clock).

No HTTP and no Twisted here: the clock is injected (anything with a
``seconds()`` method, such as the reactor or ``twisted.internet.task.Clock``),
and the application reports each attempt's outcome::

    plan = router.plan(body, len(raw))
    if isinstance(plan, NoRoute):
        ...answer plan.error() (404 not_found_error naming the model)
    attempt = plan.first()
    while True:
        ...send to attempt.upstream.url with attempt.key and attempt.model
        if judge(code, retried=n, retry=rule).verdict is Verdict.RETRY:
            continue  # the same attempt again, after the judgement's wait
        following = plan.report(attempt, status=code)  # or error_kind=...
        if following is None:
            break  # give this outcome to the client (plan.failure(error) if it has no answer)
        attempt = following  # drop this answer, try the next

:func:`judge` is the one rule of retries and failover: for one outcome, it
decides whether to send it again to the same target, try the next key of
the same upstream, fail over to the next target, or give it to the client;
and whether the upstream's breaker and the failure metrics count it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from twisted_relay.affinity import RecentConversations, conversation_of, key_digest, key_order, same_account
from twisted_relay.bodies import holds_image
from twisted_relay.config import RelayConfig, Route, Upstream, rules_for
from twisted_relay.errors import RelayError

__all__ = [
    "CLIENT_GONE",
    "FAILOVER_KINDS",
    "NO_RETRIES",
    "RETRY_KINDS",
    "Attempt",
    "Breaker",
    "Judgement",
    "NoRoute",
    "Plan",
    "RequestFacts",
    "RetryRule",
    "Router",
    "Verdict",
    "judge",
]

#: Upstream failures with no response (the ``kind`` of a
#: :class:`~twisted_relay.errors.RelayError`) that fail over: nothing was
#: answered, so another upstream may answer. ``idle``, ``cut`` and
#: ``total_timeout`` happen once an answer has begun, or are the client's
#: own limit: never.
FAILOVER_KINDS = frozenset({"connect", "tls", "dropped", "timeout", "failed"})
#: Upstream failures sent again to the same target when retries are on
#: (``--retries``): the upstream never saw the request, or dropped it
#: before answering.
RETRY_KINDS = frozenset({"connect", "dropped"})
#: The ``kind`` of an outcome whose client went away: nobody is left to answer.
CLIENT_GONE = "client_gone"

_MODEL_SHOWN = 200
# Retry pauses without a ``retry-after``: 0.5s, 1s, 2s, ... at most 8s.
_FIRST_PAUSE = 0.5
_LONGEST_PAUSE = 8.0


class Verdict(enum.Enum):
    """What to do with one attempt's outcome."""

    #: Give it to the client: an answer (2xx), a 4xx the client must see,
    #: a failure that no other try would mend, or anything once a byte has
    #: reached the client. When the plan has nothing left to try, the last
    #: outcome is given too (:meth:`Plan.failure` for one with no answer).
    DELIVER = "deliver"
    #: Send the same request again to the same target with the same key,
    #: after a pause: retries are on (``--retries``) and some are left.
    RETRY = "retry"
    #: Try the next key of the same upstream's pool (429, 401, 403), then
    #: the next target.
    NEXT_KEY = "next_key"
    #: Try the next target: no answer (connection failure, timeout before
    #: the headers), 5xx, 529, or 429 without a key pool.
    FAILOVER = "failover"
    #: Send the request again to the same target with the same key, once,
    #: with ``thinking.block_binding.prefix_mismatch_behavior: "drop_block"``
    #: (and its beta): the upstream's 400 said a thinking block is bound to a
    #: different conversation, and the same body would fail the same way.
    RECOVER = "recover"
    #: The client went away: nothing is sent again and no breaker hears of
    #: it (what the upstream would have done is unknown).
    ABANDON = "abandon"


@dataclass(frozen=True)
class RetryRule:
    """
    When the same target is sent the same request again (``--retries``):
    at most ``retries`` times per attempt, after a connection failure or a
    drop before the answer (:data:`RETRY_KINDS`), or after a status of
    ``statuses`` that is 429 or 5xx, unless it asks to wait longer than
    ``max_wait`` seconds.
    """

    retries: int = 0
    statuses: frozenset = frozenset()
    max_wait: float = 0.0

    @classmethod
    def from_config(cls, config: RelayConfig) -> "RetryRule":
        return cls(config.retries, frozenset(config.retry_statuses), config.max_retry_wait)


#: No same-target retries (``--retries 0``, and the plan's own view).
NO_RETRIES = RetryRule()


@dataclass(frozen=True)
class Judgement:
    """
    What one outcome calls for (:func:`judge`).

    :ivar verdict: what to do next.
    :ivar upstream_failed: the upstream's breaker counts a failure (else it
        counts a success, unless the verdict is to retry or abandon).
    :ivar attempt_failed: the attempt counts in
        ``relay_upstream_attempt_failures_total``: an outcome that is not
        an answer the client must see. A retried send counts as a retry
        (``relay_retries_total``) instead.
    :ivar wait: for :attr:`Verdict.RETRY`, the seconds to pause first.
    """

    verdict: Verdict
    upstream_failed: bool = False
    attempt_failed: bool = False
    wait: float = 0.0


def judge(
    status: int | None = None,
    *,
    error_kind: str | None = None,
    first_byte_sent: bool = False,
    pooled: bool = False,
    retry_after: float | None = None,
    retried: int = 0,
    retry: RetryRule = NO_RETRIES,
    bound_elsewhere: bool = False,
    droppable: bool = False,
) -> Judgement:
    """
    Decide what one outcome calls for: the one rule of retries and failover.

    :param status: the upstream's HTTP status; ``None`` when it sent none.
    :param error_kind: when there is no status, the failure's ``kind``
        (:data:`CLIENT_GONE` when the client went away); with a status, a
        failure of the answer's body once it had begun.
    :param first_byte_sent: a byte of the answer already reached the client:
        nothing can be taken back, so it is delivered whatever it is.
    :param pooled: the attempt used a key of the relay's pool (so a refused
        or rate-limited key is the relay's to change, not the client's).
    :param retry_after: the seconds the upstream asked to wait
        (``retry-after-ms`` or ``retry-after``), if it did.
    :param retried: how many times this attempt was sent again already.
    :param retry: when the same target is sent the request again.
    :param bound_elsewhere: a 400 says a thinking block is bound to a
        different conversation (:func:`~twisted_relay.bodies.bound_elsewhere`).
    :param droppable: the request may be sent again dropping such blocks:
        recovery is on, and its body was not sent with ``block_binding``
        (nor is ``between_tools``).
    """
    if error_kind == CLIENT_GONE:
        return Judgement(Verdict.ABANDON)
    # A failure of the upstream: no answer (but past the client's own
    # deadline), or a 5xx.
    broken = (error_kind is not None and error_kind != "total_timeout") or (status is not None and status >= 500)
    # Not an answer the client must see.
    failed = status is None or error_kind is not None or status >= 500 or status in (401, 403, 429)
    if first_byte_sent:
        return Judgement(Verdict.DELIVER, upstream_failed=broken, attempt_failed=failed)
    if status == 400 and bound_elsewhere and droppable:
        return Judgement(Verdict.RECOVER)  # never a failover: another key sees the same prefix
    if retried < retry.retries and _retried_here(status, error_kind, retry_after, retry):
        wait = retry_after if retry_after is not None else min(_LONGEST_PAUSE, _FIRST_PAUSE * 2**retried)
        return Judgement(Verdict.RETRY, wait=wait)
    if status is None:
        if error_kind in FAILOVER_KINDS:
            return Judgement(Verdict.FAILOVER, upstream_failed=True, attempt_failed=True)
        return Judgement(Verdict.DELIVER, upstream_failed=broken, attempt_failed=True)
    if status == 429:
        if pooled:
            return Judgement(Verdict.NEXT_KEY, attempt_failed=True)
        return Judgement(Verdict.FAILOVER, upstream_failed=True, attempt_failed=True)
    if status in (401, 403):
        return Judgement(Verdict.NEXT_KEY if pooled else Verdict.DELIVER, attempt_failed=True)
    if 500 <= status <= 599:
        return Judgement(Verdict.FAILOVER, upstream_failed=True, attempt_failed=True)
    # Any other 4xx is deterministic (the same request fails the same way
    # elsewhere); it is dumped and passed through.
    return Judgement(Verdict.DELIVER, upstream_failed=broken, attempt_failed=failed)


def _retried_here(status: int | None, error_kind: str | None, retry_after: float | None, retry: RetryRule) -> bool:
    """The outcome is one that the same target is sent again after (:class:`RetryRule`)."""
    if status is None:
        return error_kind in RETRY_KINDS
    return (
        status in retry.statuses
        and (status == 429 or status >= 500)
        and (retry_after is None or retry_after <= retry.max_wait)
    )


class Breaker:
    """
    One upstream's (or one key's) health: after ``threshold`` failures in a
    row it is *open* (skipped) for a cooldown; then *half-open*: one request
    is let through to probe it, and its outcome closes or opens it again.
    A probe that never reports lets another through after a cooldown.
    """

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    def __init__(self) -> None:
        self.failures = 0
        self._open_until: float | None = None
        self._probing = False

    def state(self, now: float) -> str:
        if self._open_until is None:
            return self.CLOSED
        return self.OPEN if now < self._open_until else self.HALF_OPEN

    def take(self, now: float, cooldown: float) -> None:
        """A request is sent through it (a probe unless it is closed)."""
        if self._open_until is not None:
            self._probing = True
            if now >= self._open_until:
                # Until this probe reports, the others keep away.
                self._open_until = now + cooldown

    def succeeded(self) -> None:
        self.failures = 0
        self._open_until = None
        self._probing = False

    def failed(self, now: float, threshold: int, cooldown: float) -> None:
        self.failures += 1
        if self.failures >= threshold or self._probing:
            self.rest(now, cooldown)

    def rest(self, now: float, seconds: float) -> None:
        """Open now, for ``seconds``."""
        self._open_until = now + seconds
        self._probing = False

    def __repr__(self) -> str:
        return "<Breaker failures=%d open_until=%r>" % (self.failures, self._open_until)


class _UpstreamHealth:
    """An upstream's breaker, its keys' breakers (by position) and its key rotation."""

    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self.breaker = Breaker()
        self.keys = [Breaker() for _ in upstream.keys]
        self.rotation = 0
        self.key_digests = [key_digest(key) for key in upstream.keys]

    def available(self, now: float) -> bool:
        """Neither the upstream nor every key of its pool is resting."""
        if self.breaker.state(now) == Breaker.OPEN:
            return False
        return not self.keys or any(key.state(now) != Breaker.OPEN for key in self.keys)

    def same_backend(self, upstream: Upstream) -> bool:
        return upstream.url == self.upstream.url and upstream.keys == self.upstream.keys


class RequestFacts:
    """
    What a route may match on in one request.

    :ivar model: the body's ``model``, or ``None`` when it has none.
    :ivar size: the body's size in bytes.
    :ivar thinking: extended thinking is enabled (``thinking.type`` is not
        ``disabled``).
    :ivar images: the request holds an image (looked for only when a route
        asks, since it walks the whole history).
    """

    def __init__(self, body: Any, size: int, *, images: bool | None = None, conversation: str | None = None):
        self._body = body if isinstance(body, dict) else {}
        model = self._body.get("model")
        self.model: str | None = model if isinstance(model, str) else None
        self.size = size
        thinking = self._body.get("thinking")
        self.thinking = isinstance(thinking, dict) and thinking.get("type", "enabled") != "disabled"
        self._images: bool | None = images
        self._conversation: str | None = conversation

    @property
    def conversation(self) -> str | None:
        """The conversation the request belongs to (:func:`~twisted_relay.affinity.conversation_of`)."""
        if self._conversation is None:
            self._conversation = conversation_of(self._body) or ""
        return self._conversation or None

    @classmethod
    def known(cls, head: dict, size: int, images: bool, conversation: str | None) -> "RequestFacts":
        """
        The facts of a body read elsewhere (a worker process): its top-level
        fields ``head`` (``model``, ``thinking``), and what was found in it.
        """
        return cls(head, size, images=images, conversation=conversation or "")

    @classmethod
    def for_model(cls, model: str) -> "RequestFacts":
        """The facts of a request that names a model only (``GET /v1/models/{id}``)."""
        return cls({"model": model}, 0)

    @property
    def images(self) -> bool:
        if self._images is None:
            self._images = holds_image(self._body.get("messages"))
        return self._images


def route_matches(route: Route, facts: RequestFacts) -> bool:
    """Every condition the route gives holds for the request."""
    if route.models and (facts.model is None or not any(fnmatchcase(facts.model, g) for g in route.models)):
        return False
    if route.thinking is not None and route.thinking != facts.thinking:
        return False
    if route.body_over is not None and not facts.size > route.body_over:
        return False
    if route.images is not None and route.images != facts.images:
        return False
    return True


@dataclass(frozen=True)
class Attempt:
    """
    One try: where to send the request, with which key and model name.

    :ivar upstream: the upstream, its settings filled in from the relay's.
    :ivar model: the model name to send (the target's rename, or the
        client's); ``None`` when the request names none.
    :ivar key_index: the key's position in the pool (0-based), or ``None``
        when the client's own credentials pass through.
    :ivar key: the key to send as ``x-api-key``; never shown by ``repr``.
    :ivar resting: the upstream or key is resting, and tried anyway since
        nothing else is left.
    """

    upstream: Upstream
    model: str | None
    key_index: int | None = None
    key: str | None = field(default=None, repr=False)
    resting: bool = False

    @property
    def label(self) -> str:
        """How logs and errors name this attempt: ``anthropic`` or ``anthropic key #2``."""
        if self.key_index is None:
            return self.upstream.name
        return "%s key #%d" % (self.upstream.name, self.key_index + 1)


@dataclass(frozen=True)
class Tried:
    """
    One attempt made, with what came of it (``529``, ``connect``...), what
    that called for, and whether it counts as a failed attempt in the
    metrics (:attr:`Judgement.attempt_failed`).
    """

    attempt: Attempt
    outcome: str
    verdict: Verdict
    failed: bool = False


@dataclass(frozen=True)
class NoRoute:
    """No route matches the request: the client gets 404 ``not_found_error``."""

    model: str | None

    def error(self) -> RelayError:
        if self.model is None:
            message = "No route of this relay serves a request without a model."
        else:
            model = self.model if len(self.model) <= _MODEL_SHOWN else self.model[:_MODEL_SHOWN] + "..."
            message = "No route of this relay serves the model %r." % (model,)
        return RelayError(404, message, kind="no_route")


class Plan:
    """
    The attempts for one request, chosen one at a time from what the last
    one's outcome calls for (see :func:`judge`): the route's targets in
    order, healthy ones first, then resting ones (a request is never failed
    without trying); within an upstream with a key pool, a conversation's
    keys in its order (:func:`~twisted_relay.affinity.key_order`: its home
    key, then its account's), or for a request of no conversation from the
    next in rotation; healthy ones first.

    :ivar conversation: the request's conversation, or ``None``.
    """

    def __init__(self, router: "Router", route: Route, facts: RequestFacts):
        self.route = route
        self.tried: list[Tried] = []
        self._router = router
        # The model only: the facts hold the parsed body, which a request
        # waiting on the upstream must not keep.
        self._model = facts.model
        self.conversation = facts.conversation
        # The conversation's home, once known: its first upstream and key there.
        self._home: tuple[Upstream, int | None] | None = None
        self._pinned = False
        self._targets = list(route.targets)
        self._keys: list[int] = []
        self._target = None
        self._target_resting = False
        self._pending: Attempt | None = None

    def first(self) -> Attempt:
        """The first attempt (asked once)."""
        if self.tried or self._pending is not None:
            raise ValueError("a plan's first attempt is asked once; then report outcomes")
        attempt = self._next_target()
        assert attempt is not None  # a route has at least one target
        return attempt

    def pin(self) -> None:
        """
        Keep the conversation on its home key: no other key of the pool is
        tried (an upstream's thread lives in the account of the key that
        made it). Asked before :meth:`first`.
        """
        self._pinned = True

    def moved(self, attempt: Attempt) -> tuple[str, bool] | None:
        """
        Whether ``attempt`` (the answering one) took the conversation off
        its home (the first target's upstream and the conversation's key
        there): the home's label, and whether the account changed too
        (another upstream, or a key not known to share the home's account).
        ``None`` when it stayed, or the request has no conversation.
        """
        if self._home is None:
            return None
        upstream, key_index = self._home
        here = attempt.upstream.name == upstream.name
        if here and attempt.key_index == key_index:
            return None
        home = Attempt(upstream, None, key_index, None)
        return home.label, not (here and same_account(upstream.accounts, key_index, attempt.key_index))

    def report(
        self,
        attempt: Attempt,
        status: int | None = None,
        *,
        error_kind: str | None = None,
        first_byte_sent: bool = False,
        retry_after: float | None = None,
    ) -> Attempt | None:
        """
        Account for an attempt's outcome, and give the next attempt, or
        ``None`` when this outcome goes to the client (it was delivered, or
        nothing is left to try: then the last answer, or :meth:`failure`
        when it had none). Same-target retries are the caller's, before it
        reports (:attr:`Verdict.RETRY`); the plan never retries.

        :param retry_after: seconds a 429 asked to wait; the key rests that
            long (at least the breaker cooldown).
        """
        if attempt is not self._pending:
            raise ValueError("report the attempt this plan gave last")
        self._pending = None
        judgement = judge(
            status,
            error_kind=error_kind,
            first_byte_sent=first_byte_sent,
            pooled=attempt.key_index is not None,
            retry_after=retry_after,
        )
        verdict = judgement.verdict
        if verdict is Verdict.ABANDON:
            return None
        router = self._router
        now = router.now()
        health = router.health_of(attempt.upstream.name)
        outcome = str(status) if status is not None else (error_kind or "failed")
        self.tried.append(Tried(attempt, outcome, verdict, judgement.attempt_failed))
        key = health.keys[attempt.key_index] if attempt.key_index is not None else None
        if judgement.upstream_failed:
            # Also when the answer broke once it had begun: the upstream's
            # health suffers, though nothing can be tried again.
            health.breaker.failed(now, router.breaker_failures, router.breaker_cooldown)
        else:
            health.breaker.succeeded()  # the upstream answered
            if verdict is Verdict.DELIVER and key is not None:
                key.succeeded()
        if verdict is Verdict.DELIVER:
            return None
        if verdict is Verdict.NEXT_KEY:
            if status in (401, 403):
                key.rest(now, router.key_rest)
            else:
                key.rest(now, max(retry_after or 0.0, router.breaker_cooldown))
            following = self._next_key()
            if following is not None:
                return following
        return self._next_target()

    def error(self) -> RelayError:
        """The error for a request whose every attempt failed without an answer."""
        tried = ", ".join("%s (%s)" % (t.attempt.label, t.outcome) for t in self.tried)
        return RelayError(502, "Every upstream tried failed: %s." % (tried,), kind="exhausted")

    def failure(self, error: RelayError) -> RelayError:
        """
        The error to give the client when the last attempt failed with
        ``error`` (no answer) and :meth:`report` gave no next attempt: the
        failure itself when it is delivered as it is, or :meth:`error` once
        several attempts were made and none could answer.
        """
        if len(self.tried) > 1 and self.tried[-1].verdict is not Verdict.DELIVER:
            return self.error()
        return error

    def _next_target(self) -> Attempt | None:
        router = self._router
        now = router.now()
        if not self._targets:
            return None
        chosen = None
        for target in self._targets:
            if router.health_of(target.upstream).available(now):
                chosen = target
                break
        resting = chosen is None
        if resting:
            chosen = self._targets[0]
        self._targets.remove(chosen)
        self._target = chosen
        self._target_resting = resting
        health = router.health_of(chosen.upstream)
        health.breaker.take(now, router.breaker_cooldown)
        count = len(health.keys)
        if self.conversation is not None:
            upstream = router.settings[chosen.upstream]
            self._keys = key_order(self.conversation, health.key_digests, upstream.accounts)
            if self._home is None:  # where the conversation goes while nothing fails
                self._home = (upstream, self._keys[0] if count else None)
            if self._pinned:
                del self._keys[1:]
            if count:
                return self._next_key()
        elif count:
            start = health.rotation % count
            health.rotation += 1
            self._keys = [(start + i) % count for i in range(count)]
            return self._next_key()
        self._keys = []
        return self._attempt(health, None, resting)

    def _next_key(self) -> Attempt | None:
        if not self._keys:
            return None
        router = self._router
        now = router.now()
        health = router.health_of(self._target.upstream)
        chosen = None
        for index in self._keys:
            if health.keys[index].state(now) != Breaker.OPEN:
                chosen = index
                break
        resting = chosen is None
        if resting:
            chosen = self._keys[0]
        self._keys.remove(chosen)
        health.keys[chosen].take(now, router.breaker_cooldown)
        return self._attempt(health, chosen, self._target_resting or resting)

    def _attempt(self, health: _UpstreamHealth, key_index: int | None, resting: bool) -> Attempt:
        upstream = self._router.settings[self._target.upstream]
        attempt = Attempt(
            upstream=upstream,
            model=upstream.platform_model(self._target.model or self._model) if upstream.models
            else self._target.model or self._model,
            key_index=key_index,
            key=None if key_index is None else upstream.keys[key_index],
            resting=resting,
        )
        self._pending = attempt
        return attempt


class Router:
    """
    Routes requests over a configuration's upstreams and keeps their health.

    :param clock: anything with a ``seconds()`` method (the reactor).
    """

    def __init__(self, config: RelayConfig, clock: Any, *, _health: dict | None = None, _dropping=None):
        self.config = config
        #: Conversations sent with ``drop_block`` since a "bound to a different conversation" 400.
        self.dropping = _dropping if _dropping is not None else RecentConversations()
        self.breaker_failures = config.breaker_failures
        self.breaker_cooldown = config.breaker_cooldown
        self.key_rest = config.key_rest
        self._clock = clock
        self.settings = {u.name: config.settings_for(u) for u in config.upstreams}
        self._rules: dict = {}
        self._health = {}
        for upstream in config.upstreams:
            kept = (_health or {}).get(upstream.name)
            if kept is not None and kept.same_backend(upstream):
                kept.upstream = upstream
                self._health[upstream.name] = kept
            else:
                self._health[upstream.name] = _UpstreamHealth(upstream)

    def now(self) -> float:
        return self._clock.seconds()

    def rules(self, upstream: Upstream):
        """The id-translation rules for ``upstream`` (:func:`~twisted_relay.config.rules_for`), made once."""
        rules = self._rules.get(upstream.name)
        if rules is None:
            rules = self._rules[upstream.name] = rules_for(upstream, self.config)
        return rules

    def health_of(self, name: str) -> _UpstreamHealth:
        return self._health[name]

    def reloaded(self, config: RelayConfig) -> "Router":
        """
        A router for a new configuration that keeps the health of every
        upstream whose URL and keys did not change.
        """
        return Router(config, self._clock, _health=self._health, _dropping=self.dropping)

    def route_for(self, facts: RequestFacts) -> Route | None:
        """The first route that matches, or ``None``."""
        for route in self.config.routes:
            if route_matches(route, facts):
                return route
        return None

    def plan(self, body: Any, size: int) -> Plan | NoRoute:
        """The plan for a request with this (parsed) body of ``size`` bytes."""
        return self.plan_for(RequestFacts(body, size))

    def plan_for(self, facts: RequestFacts) -> Plan | NoRoute:
        route = self.route_for(facts)
        if route is None:
            return NoRoute(facts.model)
        return Plan(self, route, facts)

    def plan_for_listing(self) -> Plan:
        """
        The plan for ``GET /v1/models``, which names no model: the first
        route that matches a request for any model (one without ``models``
        globs, thinking, images or a size), else the first route.
        """
        facts = RequestFacts({}, 0)
        route = self.route_for(facts) or self.config.routes[0]
        return Plan(self, route, facts)

    def state(self, name: str) -> str:
        """An upstream's breaker state: ``closed``, ``open`` or ``half_open``."""
        return self._health[name].breaker.state(self.now())

    def keys_resting(self, name: str) -> tuple[int, ...]:
        """The positions (1-based, as logs name them) of an upstream's keys that are resting."""
        now = self.now()
        return tuple(i + 1 for i, b in enumerate(self._health[name].keys) if b.state(now) == Breaker.OPEN)
