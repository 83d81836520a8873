# -*- test-case-name: tests.test_signin_session -*-
"""
Sign-in as a part of the relay: :class:`SignIn` holds the ``[signin]``
settings, the session tokens, the store and the identity provider, and
says who a request's session token speaks for
(:meth:`SignIn.person_presented`), wherever a relay key is checked.

Revocations reach every relay through the store: each relay reads them
every ``revocation_poll`` seconds (a :class:`SignIn` is a service, the
reading its timer) and at once those it made itself; a token revoked on
one relay is refused on every relay within that bound.
"""

from __future__ import annotations

from twisted.application.service import Service
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from twisted_relay.errors import RelayError
from twisted_relay.relay_keys import presented_keys
from twisted_relay.signin.config import SignInConfig
from twisted_relay.signin.device_flow import RateLimit
from twisted_relay.signin.people import Refusal, person_of
from twisted_relay.signin.person import Person
from twisted_relay.signin.store import store_for
from twisted_relay.signin.tokens import SessionClaims, SessionTokenError, SessionTokens

__all__ = ["SignIn", "signin_for"]

# The revocations' table is pruned every this many reads.
_PRUNE_EVERY = 30
# Session tokens kept checked at most (each a few hundred bytes).
_KNOWN_MOST = 10_000


class SignIn(Service):
    """
    Sign-in with the company's identity provider, for one relay process.

    :param config: the ``[signin]`` settings.
    :param store: where grants, refresh tokens and revocations are kept
        (:mod:`twisted_relay.signin.store`).
    :param provider: the identity provider
        (:class:`~twisted_relay.signin.oidc.OIDCProvider`).
    :param reactor: its clock is the time sessions are judged by.
    :ivar tokens: the session tokens (:class:`~twisted_relay.signin.tokens.SessionTokens`).
    :ivar device_authorizations: new device grants per client address
        (30 in 10 minutes, as Anthropic's own gateway).
    :ivar verifications: user codes typed at the verification page per
        client address (10 in 10 minutes).
    """

    log = Logger()

    def __init__(self, config: SignInConfig, store, provider, reactor):
        self.config = config
        self.store = store
        self.provider = provider
        self.reactor = reactor
        self.tokens = SessionTokens(config.session_secret, config.public_url, config.session_ttl, reactor.seconds)
        self.device_authorizations = RateLimit(30, 600)
        self.verifications = RateLimit(10, 600)
        self._revoked: dict[str, float] = {}
        self._known: dict[str, tuple[Person, int]] = {}
        self._reads = 0
        self._reading = LoopingCall(self._read_revocations)
        self._reading.clock = reactor
        self._failing = False

    def __repr__(self) -> str:
        return "SignIn(public_url=%r, store=%r)" % (self.config.public_url, self.store)

    def now(self) -> float:
        """The time, in seconds since the epoch."""
        return self.reactor.seconds()

    # -- sessions on requests ------------------------------------------------

    def person_presented(self, headers) -> Person | None:
        """
        The person whose session token a request presents
        (``Authorization: Bearer`` or ``x-api-key``), or ``None`` when it
        presents none of this relay's (a relay key may be there).

        :raises RelayError: 401 (``x-should-retry: false``) for a session
            token that is expired, revoked, badly signed, or whose person
            may no longer sign in.
        """
        for presented in presented_keys(headers):
            token = presented.decode("latin-1")
            if token in self._known or self.tokens.is_ours(token):
                return self.person_of_token(token)
        return None

    def person_of_token(self, token: str) -> Person:
        """The person a session token of ours speaks for. :raises RelayError: 401, as :meth:`person_presented`."""
        known = self._known.get(token)
        if known is None:
            # Checked once (its signature, its claims, who may sign in), then
            # known until it expires: a request after the first costs a lookup.
            known = self._check(token)
        person, expires_at = known
        if expires_at <= self.now():
            self._known.pop(token, None)
            raise RelayError(401, "Sign-in: the session token has expired; sign in again.", should_retry=False)
        if self.is_revoked(person.session_id):
            raise RelayError(401, "Sign-in: this session was signed out (revoked); sign in again.", should_retry=False)
        return person

    def _check(self, token: str) -> tuple[Person, int]:
        try:
            claims = self.tokens.verify(token)
        except SessionTokenError as e:
            raise RelayError(401, "Sign-in: %s." % (e,), should_retry=False)
        person = person_of(claims.identity(), self.config, claims.jti)
        if isinstance(person, Refusal):
            raise RelayError(401, "Sign-in: %s" % (person.reason,), should_retry=False)
        if len(self._known) >= _KNOWN_MOST:
            self._known = {t: k for t, k in self._known.items() if k[1] > self.now()}
            if len(self._known) >= _KNOWN_MOST:
                self._known.clear()
        self._known[token] = (person, claims.exp)
        return person, claims.exp

    def is_revoked(self, jti: str) -> bool:
        """Whether the session token ``jti`` is revoked, as this relay last read (or made) the revocations."""
        return jti in self._revoked

    async def revoke(self, claims: SessionClaims) -> None:
        """Revoke a session token until it expires: here at once, on the other relays at their next read."""
        self._revoked[claims.jti] = float(claims.exp)
        await self.store.revoke(claims.jti, float(claims.exp))

    # -- the revocations' reading ---------------------------------------------

    def startService(self):
        Service.startService(self)
        self._reading.start(self.config.revocation_poll, now=True)

    def stopService(self):
        if self._reading.running:
            self._reading.stop()
        return Service.stopService(self)

    def _read_revocations(self):
        self._reads += 1
        now = self.now()
        d = self.store.revocations(now, self._reads % _PRUNE_EVERY == 1)
        d.addCallbacks(self._read, self._not_read, callbackArgs=(now,))
        return d

    def _read(self, revoked: dict, now: float) -> None:
        if self._failing:
            self.log.info("Sign-in: the revocations are read again")
            self._failing = False
        # Those made here since the read began are kept.
        mine = {jti: exp for jti, exp in self._revoked.items() if exp > now and jti not in revoked}
        revoked.update(mine)
        self._revoked = revoked

    def _not_read(self, failure) -> None:
        # Once per failing streak: the last revocations read stay in force.
        if not self._failing:
            self.log.error("Sign-in: cannot read the revocations (those read before still hold): {reason}",
                           reason=str(failure.value))
            self._failing = True


def signin_for(config: SignInConfig, ledger, reactor) -> SignIn:
    """
    The :class:`SignIn` of a relay: its store the ledger's database when the
    relay has one (shared by every relay writing to it), else this process's
    memory; its identity provider the ``[signin]`` table's.
    """
    from twisted_relay.signin.oidc import OIDCProvider

    provider = OIDCProvider(
        config.issuer, config.client_id, config.client_secret or "", config.scopes, config.redirect_uri, clock=reactor,
    )
    return SignIn(config, store_for(ledger), provider, reactor)
