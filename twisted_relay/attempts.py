# -*- test-case-name: tests.test_routed_app -*-
"""
The attempts of one relayed request: where it is sent, and again where.

:class:`Attempts` makes the attempts of a request's plan
(:mod:`twisted_relay.routing`) one at a time: each gets its own body (the
target's model name and key, its upstream's id rules, the message
thread's turn), is sent, sent again to the same target when the rule says
so, and its outcome is reported to the plan, which gives the next attempt
or none. What to do with every outcome is decided by
:func:`twisted_relay.routing.judge`, never here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from email.utils import parsedate_to_datetime
from urllib.parse import quote

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import deferLater
from twisted.web.http_headers import Headers

from twisted_relay.answer import Exchange, note_repairs
from twisted_relay.bodies import BINDING_BETA, bound_elsewhere, with_beta
from twisted_relay.body_work import ThreadForm
from twisted_relay.errors import RelayError
from twisted_relay.logins import LoginError
from twisted_relay.routing import CLIENT_GONE, Verdict, judge
from twisted_relay.upstream import read_body
from twisted_relay.upstream_headers import upstream_request_headers
from twisted_relay.wires.base import ReadAnswer, betas_of, check_model_id

__all__ = ["Attempts", "Sent", "retry_after"]


@dataclass(frozen=True, slots=True)
class Sent:
    """
    What one attempt sends upstream.

    :ivar droppable: the body may be sent again with ``drop_block``
        (:func:`~twisted_relay.bodies.droppable`).
    """

    path: str
    headers: Headers
    body: bytes | None
    translation: object
    droppable: bool = False
    stream: bool = False
    #: The translation's context the wire's body form carried (an OpenAI wire's).
    context: tuple = ()
    #: The body's SHA-256 in hex, made with the body, for a login that signs it (SigV4).
    body_sha256: str | None = None


class Attempts:
    """
    The attempts of one relayed request, made until one's outcome goes to
    the client.

    :param context: the relay's parts for this request
        (:class:`~twisted_relay.relayed_request.RequestContext`).
    :param relayed: the request
        (:class:`~twisted_relay.relayed_request.RelayedRequest`): its
        deadline (``wait``), Twisted request, model id and message thread.
    :param plan: the request's plan (:class:`~twisted_relay.routing.Plan`).
    :param path: the path and query to send upstream.
    :param body: the client's body
        (:class:`~twisted_relay.body_pool.RequestBody`), or ``None`` for a
        request without one.
    :ivar attempt: the attempt made last.
    """

    def __init__(self, context, relayed, plan, path: str, body):
        self._context = context
        self._relayed = relayed
        self.plan = plan
        self._path = path
        self._body = body
        self.attempt = None
        # The answering attempt's 2xx is yet to be reported to the plan.
        self._unsettled = False

    async def make(self):
        """
        Make the plan's attempts, one at a time, until one's outcome goes to
        the client: an answer, returned with what was sent for it, or a
        failure with no answer, raised. A 2xx answer is reported to the plan
        once its body has been relayed (:meth:`settle`).
        """
        context, plan = self._context, self.plan
        metrics = context.metrics
        if self._relayed.turn is not None and context.threads.upstream_knows:
            plan.pin()  # the upstream's thread lives in the account of the key that made it
        attempt = plan.first()
        while True:
            self.attempt = attempt
            sent = await self._prepare(attempt)
            name = attempt.upstream.name
            metrics.labelled(metrics.upstream_requests, name).inc()
            try:
                response, asked_wait, sent = await self._send(context.clients[name], sent, attempt)
            except CancelledError:
                # The client went away (the deadline's cancel is a RelayError).
                plan.report(attempt, error_kind=CLIENT_GONE)
                raise
            except RelayError as e:
                following = plan.report(attempt, error_kind=e.kind)
                self._note(attempt, following)
                if following is None:
                    # Not kept in this frame, which the error's traceback
                    # holds: a cycle only a full garbage collection frees.
                    failure = plan.failure(e)
                    if failure is e:
                        del failure
                        raise
                    try:
                        raise failure from None
                    finally:
                        del failure
                attempt = following
                continue
            if response.code < 300:
                self._unsettled = True
                self._moved(attempt)
                return response, sent
            following = plan.report(attempt, response.code, retry_after=asked_wait)
            self._note(attempt, following)
            if following is None:
                self._moved(attempt)
                return response, sent
            # Read the refused answer, so its connection goes back to the pool.
            await self._discard(response, attempt)
            attempt = following

    def settle(self, error_kind: str | None = None) -> None:
        """Report the delivered 2xx attempt's outcome, once its body has gone (or broken off)."""
        if not self._unsettled:
            return
        self._unsettled = False
        attempt = self.attempt
        if error_kind is None:
            self.plan.report(attempt, 200)
        else:
            self.plan.report(attempt, error_kind=error_kind, first_byte_sent=True)
            self._note(attempt, None)

    def labels(self) -> list[str]:
        """Every attempt made, with its outcome: ``local (connect)``, ``anthropic key #2 (200)``."""
        labels = ["%s (%s)" % (t.attempt.label, t.outcome) for t in self.plan.tried]
        if self._unsettled:
            labels.append("%s (answered)" % (self.attempt.label,))
        moved = self.plan.moved(self.attempt) if self.attempt is not None else None
        if moved is not None:
            labels.append("conversation moved from %s to %s (%s)" % (
                moved[0], self.attempt.label, "another account" if moved[1] else "same account"))
        return labels

    async def _prepare(self, attempt) -> Sent:
        """The path, headers and body to send for one attempt: its model, its key, its upstream's id rules."""
        context, relayed, body = self._context, self._relayed, self._body
        path = self._path
        upstream = attempt.upstream
        wire = context.clients[upstream.name].wire
        headers = upstream_request_headers(
            relayed.request.requestHeaders,
            attempt.key,
            # A login of the relay's own: the client's credentials never go.
            # A relay key or a session token never goes upstream either.
            strip_credentials=bool(context.relay_keys) or context.signin is not None or upstream.login is not None,
            forward_attribution=context.config.forward_attribution,
        )
        if body is None:
            model_id = relayed.model_id
            if model_id is not None and attempt.model is not None and attempt.model != model_id:
                path = _renamed_model_path(path, attempt.model)
            return Sent(path, _with_own_headers(headers, upstream), None, None)
        stream = body.head.get("stream") is True
        form = None
        if wire is not None and wire.name != "anthropic":
            check_model_id(attempt.model)
            session = relayed.request.requestHeaders.getRawHeaders(b"x-claude-code-session-id")
            path, headers, form = wire.outgoing(
                relayed.route.name, path, headers, attempt.model, stream, key=attempt.key,
                session=session[0].decode("latin-1") if session else None, requested=relayed.requested_model,
            )
        headers = _with_own_headers(headers, upstream)
        turn, thread = relayed.turn, None
        if turn is not None:
            if context.threads.upstream_knows:
                thread = ThreadForm(turn.previous_message_id, turn.new_messages)
            headers = turn.upstream_headers(headers)
        conversation = self.plan.conversation
        # Remembered per upstream: another one may not know the setting.
        remembered = conversation is not None and "%s %s" % (attempt.upstream.name, conversation) in context.router.dropping
        first = not self.plan.tried
        # Worked on here for a small body, in a worker process for a large one.
        # A login that signs the body has its hash made with the body, off the reactor for a large one.
        login = context.clients[upstream.name].login
        prepared = await relayed.wait(
            body.prepare(attempt.model, context.router.rules(attempt.upstream), thread, remembered, first, form,
                         digest=login is not None and login.signs_body)
        )
        if first:
            note_repairs(context, relayed.id, prepared.repairs, prepared.repair_count)
        if prepared.dropping:
            headers = headers.copy()
            headers.setRawHeaders(b"anthropic-beta", [with_beta(headers.getRawHeaders(b"anthropic-beta"))])
        droppable = prepared.droppable and (wire is None or wire.recovers_bindings)
        sent = Sent(path, headers, prepared.body, prepared.translation, droppable, stream, form.context if form else (),
                    prepared.body_sha256)
        relayed.prepared(body.raw, sent)
        return sent

    async def _send(self, client, sent: Sent, attempt):
        """
        Send one attempt upstream, and again to the same target while the
        rule says so (:attr:`~twisted_relay.routing.Verdict.RETRY`), or once
        with invalid thinking blocks dropped
        (:attr:`~twisted_relay.routing.Verdict.RECOVER`). Return the
        response, the wait it asked for (``retry-after``), if any, and what
        was sent for it.
        """
        context, relayed = self._context, self._relayed
        clock, metrics, rule = context.reactor, context.metrics, context.retry
        pooled = attempt.key_index is not None
        retried = 0
        recovered = False
        # The wire's own second tries: the credentials fetched again, betas left out.
        logged_in_again = betas_left_out = False
        kind = relayed.route.name
        while True:
            started = clock.seconds()
            try:
                response = await relayed.wait(self._request(client, sent))
            except RelayError as e:
                judgement = judge(error_kind=e.kind, pooled=pooled, retried=retried, retry=rule)
                if judgement.verdict is Verdict.RETRY:
                    retried += 1
                    await self._pause(retried, judgement.wait, e.message)
                    continue
                metrics.upstream_errors.labels(e.kind or "other").inc()
                raise
            metrics.labelled(metrics.upstream_latency, relayed.route.name).observe(clock.seconds() - started)
            wire = client.wire
            if response.code < 300:
                if wire is not None:
                    response = wire.answered(kind, sent.stream, response, sent.context)
                return response, None, sent
            if wire is not None and wire.reads_errors:
                refusal = wire.refusal(kind, response.code, response.headers, await self._read(response, attempt),
                                       attempt.model)
                if refusal.expired and client.login is not None and not logged_in_again:
                    logged_in_again = True
                    try:
                        await relayed.wait(client.login.refresh())
                    except LoginError as e:
                        # As any attempt whose login failed: a 502, the next target tried.
                        raise _not_logged_in(e) from None
                    continue
                if refusal.unwanted_betas and not betas_left_out:
                    betas_left_out = True
                    sent = replace(sent, headers=_without_betas(sent.headers, refusal.unwanted_betas))
                    continue
                response = ReadAnswer(response, refusal.body, code=refusal.status)
            # Read only where it decides something (a 429, or a status retried).
            asked = response.code == 429 or response.code in rule.statuses
            asked_wait = retry_after(response.headers) if asked else None
            answer, droppable = None, False
            if response.code == 400 and not recovered and self._may_drop_blocks(sent):
                # Read to be judged; whoever delivers it reads it again.
                answer = await self._read(response, attempt)
                response, droppable = ReadAnswer(response, answer), True
            judgement = judge(
                response.code, pooled=pooled, retry_after=asked_wait, retried=retried, retry=rule,
                bound_elsewhere=bound_elsewhere(answer), droppable=droppable,
            )
            if judgement.verdict is Verdict.RECOVER:
                recovered = True
                sent = await self._recover(response, answer, sent, attempt)
                continue
            if judgement.verdict is Verdict.RETRY:
                retried += 1
                await self._discard(response, attempt)
                await self._pause(retried, judgement.wait, "status %d" % (response.code,))
                continue
            return response, asked_wait, sent

    def _request(self, client, sent: Sent) -> Deferred:
        """
        Send ``sent`` through ``client``, the upstream's login put on it
        first (a signature covers this send); once the login has its
        credentials, when it has none yet. A login that cannot get them
        fails the attempt (502, ``login``: the next target is tried).
        """
        method, login = self._relayed.request.method, client.login
        if sent.path is None:
            # The wire answers this one itself (a Chat upstream's count_tokens): the body is the answer.
            return succeed(ReadAnswer(None, sent.body))
        if login is None:
            return client.request(method, sent.path, sent.headers, sent.body)

        def send(_):
            headers = sent.headers.copy()
            if sent.body_sha256 is None:
                login.authorize(method, client.wire_url(sent.path), headers, sent.body)
            else:
                login.authorize(method, client.wire_url(sent.path), headers, sent.body, body_sha256=sent.body_sha256)
            return client.request(method, sent.path, headers, sent.body)

        def not_logged_in(failure):
            failure.trap(LoginError)
            raise _not_logged_in(failure.value)

        return login.ready().addCallbacks(send, not_logged_in)

    def _may_drop_blocks(self, sent: Sent) -> bool:
        """Recovery is on and the body sent may take ``drop_block`` (:func:`~twisted_relay.bodies.droppable`)."""
        return self._context.config.thinking_binding_recovery == "drop_block" and sent.droppable

    async def _recover(self, response, answer: bytes, sent: Sent, attempt) -> Sent:
        """
        Dump, log and count the "bound to a different conversation" 400,
        and give what is sent again: the body with its invalid thinking
        blocks dropped, and the beta that setting needs.
        """
        context, relayed = self._context, self._relayed
        name = attempt.upstream.name
        context.metrics.labelled(context.metrics.binding_recoveries, name).inc()
        note = (
            'The upstream answered that a thinking block is bound to a different conversation; the relay '
            'sent the request again to %s with thinking.block_binding.prefix_mismatch_behavior "drop_block" '
            "and anthropic-beta %s (--thinking-binding-recovery)." % (attempt.label, BINDING_BETA)
        )
        context.log.warn(
            "Upstream {attempt} answered 400 for {relay_request_id}: a thinking block is bound to a different "
            "conversation; sending it again with the invalid blocks dropped",
            attempt=attempt.label,
            relay_request_id=relayed.id,
            upstream=name,
        )
        if context.dumps is not None:
            exchange = Exchange(
                request_id=relayed.id,
                received_at=relayed.received_at,
                url=context.clients[name].display_url + sent.path,
                client_headers=relayed.request.requestHeaders,
                client_body=self._body.raw,
                upstream_headers=sent.headers,
                upstream_body=sent.body,
                translation=sent.translation,
                attempt=attempt,
                attempts=self.labels() + ["%s (400, bound to a different conversation)" % (attempt.label,)],
                attribution=relayed.attribution or None,
                relay_key=relayed.relay_key,
            )
            context.dumps.submit(replace(exchange.dump(response, answer), note=note))
        if self.plan.conversation is not None:
            context.router.dropping.add("%s %s" % (name, self.plan.conversation))
        headers = sent.headers.copy()
        headers.setRawHeaders(b"anthropic-beta", [with_beta(headers.getRawHeaders(b"anthropic-beta"))])
        body = await relayed.wait(self._body.dropping_blocks(sent.body))
        return Sent(sent.path, headers, body, sent.translation)

    async def _read(self, response, attempt) -> bytes:
        """Read a whole answer to judge it; only the deadline and the upstream's silence stop it."""
        return await self._relayed.wait(read_body(response, self._context.reactor, attempt.upstream.idle_timeout or None))

    async def _pause(self, retried: int, delay: float, why: str) -> None:
        context = self._context
        context.metrics.retries.inc()
        context.log.info(
            "Retrying upstream request ({why}), attempt {attempt} in {delay}s", why=why, attempt=retried + 1, delay=delay
        )
        await self._relayed.wait(deferLater(context.reactor, delay, lambda: None))

    async def _discard(self, response, attempt) -> None:
        """Read an answer that is not given to the client; only the deadline stops it."""
        try:
            await self._relayed.wait(read_body(response, self._context.reactor, attempt.upstream.idle_timeout or None))
        except RelayError as e:
            if e.kind == "total_timeout":
                raise

    def _moved(self, attempt) -> None:
        """Log and count an answer from another key or upstream than the conversation's own."""
        moved = self.plan.moved(attempt)
        if moved is None:
            return
        home, across = moved
        metrics = self._context.metrics
        metrics.labelled(metrics.conversation_moves, attempt.upstream.name, "account" if across else "key").inc()
        self._context.log.warn(
            "Conversation of {relay_request_id} moved from {home} to {attempt} ({across}): "
            "{cost}",
            relay_request_id=self._relayed.id,
            home=home,
            attempt=attempt.label,
            across="another account" if across else "same account",
            cost="its account-bound thinking is dropped and its prompt cache starts again"
            if across else "its prompt cache may start again",
            upstream=attempt.upstream.name,
        )

    def _note(self, attempt, following) -> None:
        """Log and count an attempt whose outcome did not end the request well, or moved it on."""
        tried = self.plan.tried[-1]
        if not tried.failed:
            return  # an answer the client must see, not a failure of the upstream
        metrics = self._context.metrics
        name = attempt.upstream.name
        metrics.labelled(metrics.upstream_attempt_failures, name, tried.outcome).inc()
        if following is None:
            return
        metrics.labelled(metrics.failovers, name).inc()
        self._context.log.warn(
            "Upstream {attempt} answered {outcome} for {relay_request_id}; trying {following}",
            attempt=attempt.label,
            outcome=tried.outcome,
            following=following.label,
            relay_request_id=self._relayed.id,
            upstream=name,
            upstream_model=attempt.model,
        )


def retry_after(headers: Headers) -> float | None:
    """The wait an upstream asks for: ``retry-after-ms``, or ``retry-after`` (seconds or a date)."""
    for value in headers.getRawHeaders(b"retry-after-ms", []):
        try:
            return max(0.0, float(value) / 1000.0)
        except ValueError:
            pass
    for value in headers.getRawHeaders(b"retry-after", []):
        try:
            return max(0.0, float(value))
        except ValueError:
            try:
                return max(0.0, parsedate_to_datetime(value.decode("latin-1")).timestamp() - time.time())
            except (TypeError, ValueError, OverflowError):
                pass
    return None


def _with_own_headers(headers: Headers, upstream) -> Headers:
    """``headers`` with the upstream's own (``anthropic-workspace-id``...), whatever its wire (changed in place)."""
    for name, value in upstream.headers:
        headers.setRawHeaders(name.encode("ascii"), [value.encode("utf-8")])
    return headers


def _not_logged_in(error: LoginError) -> RelayError:
    """An attempt whose upstream's login could not get credentials: 502, ``login`` (the next target is tried)."""
    return RelayError(502, "The relay could not log in to the upstream: %s" % (error,), kind="login")


def _without_betas(headers: Headers, unwanted: tuple[str, ...]) -> Headers:
    """``headers`` with the ``anthropic-beta`` values in ``unwanted`` left out."""
    kept = [beta for beta in betas_of(headers) if beta not in unwanted]
    headers = headers.copy()
    if kept:
        headers.setRawHeaders(b"anthropic-beta", [",".join(kept).encode("latin-1")])
    else:
        headers.removeHeader(b"anthropic-beta")
    return headers


def _renamed_model_path(path: str, model: str) -> str:
    """``/v1/models/{id}?query`` with the model id replaced (a target's rename)."""
    target, mark, query = path.partition("?")
    head = target.rpartition("/")[0]
    return "%s/%s%s%s" % (head, quote(model, safe=""), mark, query)
