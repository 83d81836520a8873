"""
Sign-in's pure rules: session tokens (:mod:`twisted_relay.signin.tokens`),
who may sign in and as whom (:mod:`twisted_relay.signin.people`), the
device grant's codes and polls (:mod:`twisted_relay.signin.device_flow`),
and a session token on a request (:class:`~twisted_relay.signin.session.SignIn`),
on a ``Clock``.
"""

from __future__ import annotations

import base64
import json

from joserfc import jwt
from joserfc.jwk import OctKey
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers

from twisted_relay.errors import RelayError
from twisted_relay.signin.config import SignInConfig
from twisted_relay.signin.device_flow import (
    DEVICE_CODE_LIFETIME,
    RateLimit,
    new_grant,
    normalized_user_code,
    poll,
)
from twisted_relay.signin.people import Refusal, identity_of, person_of
from twisted_relay.signin.session import SignIn
from twisted_relay.signin.store import MemoryStore
from twisted_relay.signin.tokens import SessionTokenError, SessionTokens

SECRET = "a-session-secret-of-forty-characters-xx"
NOW = 1_800_000_000.0
CONFIG = SignInConfig(
    "https://relay.corp.internal", "https://idp", "relay", SECRET, allowed_email_domains=("example.com",),
    allowed_groups=("engineering",), groups=(("eng-platform", "platform"), ("engineering", "eng")),
)
ALICE = {"sub": "sub-alice", "email": "alice@example.com", "groups": ["engineering", "eng-platform"]}


def clock_at(now: float = NOW) -> Clock:
    clock = Clock()
    clock.advance(now)
    return clock


class SessionTokenTests(SynchronousTestCase):
    def test_claims(self):
        """HS256, ``kid`` from the secret, ``aud``/``iss``/``sub``/``email``/``groups``/``jti``/``iat``/``exp``, readable unverified."""
        tokens = SessionTokens(SECRET, "https://relay.corp.internal", 3600, clock_at().seconds)
        token, claims = tokens.mint(ALICE)
        header, body = (json.loads(base64.urlsafe_b64decode(part + "==")) for part in token.split(".")[:2])
        self.assertEqual(header["alg"], "HS256")
        self.assertEqual(len(header["kid"]), 8)
        self.assertEqual(
            {k: body[k] for k in ("aud", "iss", "sub", "email", "groups", "iat", "exp")},
            {"aud": "twisted-relay", "iss": "https://relay.corp.internal", "sub": "sub-alice", "email": "alice@example.com",
             "groups": ["engineering", "eng-platform"], "iat": int(NOW), "exp": int(NOW) + 3600},
        )
        self.assertEqual(tokens.verify(token), claims)
        self.assertTrue(tokens.is_ours(token))
        self.assertNotIn(SECRET, repr(tokens))

    def test_refused(self):
        clock = clock_at()
        tokens = SessionTokens(SECRET, "https://relay.corp.internal", 60, clock.seconds)
        token, _ = tokens.mint(ALICE)
        other_secret = SessionTokens("another-secret-of-forty-characters-xxxxx", "https://relay.corp.internal", 60, clock.seconds)
        self.assertFalse(other_secret.is_ours(token))
        self.assertFalse(tokens.is_ours("sk-relay-key"))
        with self.assertRaises(SessionTokenError):
            other_secret.verify(token)
        # A token of our secret for another address, or another audience.
        elsewhere = SessionTokens(SECRET, "https://elsewhere", 60, clock.seconds)
        with self.assertRaises(SessionTokenError) as caught:
            tokens.verify(elsewhere.mint(ALICE)[0])
        self.assertIn("iss", str(caught.exception))
        key = OctKey.import_key(SECRET.encode())
        foreign = jwt.encode({"alg": "HS256", "kid": tokens.kid}, {"aud": "claude-gateway", "iss": tokens.issuer,
                                                                   "sub": "x", "jti": "j", "iat": 1, "exp": 2 ** 40}, key)
        with self.assertRaises(SessionTokenError):
            tokens.verify(foreign)
        # An unsigned token naming our kid.
        unsigned = token.rsplit(".", 1)[0] + "."
        with self.assertRaises(SessionTokenError):
            tokens.verify(unsigned)
        clock.advance(61)
        with self.assertRaises(SessionTokenError) as caught:
            tokens.verify(token)
        self.assertIn("expired", str(caught.exception))
        self.assertEqual(tokens.verify(token, expired_ok=True).sub, "sub-alice")
        self.assertNotIn(token, str(caught.exception))

    def test_sealed(self):
        tokens = SessionTokens(SECRET, "https://relay", 60, clock_at().seconds)
        sealed = tokens.seal("idp-refresh-token-value")
        self.assertNotIn("idp-refresh-token-value", sealed)
        self.assertEqual(tokens.unseal(sealed), "idp-refresh-token-value")
        with self.assertRaises(SessionTokenError):
            SessionTokens("another-secret-of-forty-characters-xxxxx", "https://relay", 60, clock_at().seconds).unseal(sealed)


class PeopleTests(SynchronousTestCase):
    def test_person(self):
        person = person_of(identity_of({**ALICE, "email": "Alice@Example.COM", "email_verified": True}, CONFIG), CONFIG, "jti-1")
        self.assertEqual((person.name, person.group, person.email, person.session_id),
                         ("alice@example.com", "platform", "alice@example.com", "jti-1"))

    def test_group_map_first_listed_wins(self):
        person = person_of({"sub": "s", "email": "bo@example.com", "groups": ["engineering"]}, CONFIG)
        self.assertEqual(person.group, "eng")
        ungrouped = SignInConfig("https://r", "https://i", "c", SECRET)
        self.assertIsNone(person_of({"sub": "s", "email": "x@y.z", "groups": ["a"]}, ungrouped).group)

    def test_name_outside_the_alphabet(self):
        """An email a relay key's name cannot be (a plus sign, too long): ``person-`` and a digest of ``sub``."""
        open_config = SignInConfig("https://r", "https://i", "c", SECRET)
        for email in ("al+ice@example.com", "a" * 70 + "@example.com", ""):
            name = person_of({"sub": "sub-alice", "email": email, "groups": []}, open_config).name
            self.assertRegex(name, r"^person-[0-9a-f]{12}$")

    def test_refusals(self):
        cases = [
            ({**ALICE, "email": "alice@other.org"}, "example.com"),
            ({**ALICE, "email": ""}, "example.com"),
            ({**ALICE, "groups": ["sales"]}, "engineering"),
        ]
        for identity, reason in cases:
            refusal = person_of(identity, CONFIG)
            self.assertIsInstance(refusal, Refusal)
            self.assertIn(reason, refusal.reason)
        self.assertIsInstance(identity_of({**ALICE, "email_verified": False}, CONFIG), Refusal)
        self.assertIsInstance(identity_of({"email": "a@example.com"}, CONFIG), Refusal)

    def test_groups_claim(self):
        config = SignInConfig("https://r", "https://i", "c", SECRET, groups_claim="roles")
        self.assertEqual(identity_of({"sub": "s", "roles": "admin", "groups": ["x"]}, config)["groups"], ["admin"])


class DeviceFlowTests(SynchronousTestCase):
    def test_codes(self):
        device_code, grant = new_grant(NOW, 5)
        self.assertGreaterEqual(len(device_code), 43)
        self.assertNotIn(device_code, repr(grant))
        self.assertRegex(grant.user_code, r"^[BCDFGHJKMNPQRSTVWXYZ]{4}-[BCDFGHJKMNPQRSTVWXYZ]{4}$")
        self.assertEqual(grant.expires_at, NOW + DEVICE_CODE_LIFETIME)
        self.assertEqual(normalized_user_code(" bcdf ghjk"), "BCDF-GHJK")
        self.assertEqual(normalized_user_code("bcdf-ghjk"), "BCDF-GHJK")
        for wrong in ("BCDF-GHJ", "ABCD-EFGH", "BCDF-GHJKL"):
            self.assertIsNone(normalized_user_code(wrong))

    def test_polls(self):
        _, grant = new_grant(NOW, 5)
        verdict, grant = poll(grant, NOW)
        self.assertEqual(verdict, "authorization_pending")
        verdict, grant = poll(grant, NOW + 2)
        self.assertEqual((verdict, grant.interval), ("slow_down", 10))
        verdict, grant = poll(grant, NOW + 7)
        self.assertEqual(verdict, "slow_down")
        verdict, grant = poll(grant, NOW + 30)
        self.assertEqual(verdict, "authorization_pending")
        self.assertEqual(poll(grant.approved(ALICE, None), NOW + 50), ("approved", None))
        self.assertEqual(poll(grant.denied(), NOW + 50), ("access_denied", None))
        self.assertEqual(poll(grant, NOW + DEVICE_CODE_LIFETIME), ("expired_token", None))

    def test_rate_limit(self):
        limit = RateLimit(2, 600, addresses=2)
        self.assertEqual([limit.allow("a", NOW + s) for s in (0, 1, 2)], [True, True, False])
        self.assertTrue(limit.allow("a", NOW + 600))
        self.assertTrue(limit.allow("b", NOW))
        self.assertTrue(limit.allow("c", NOW))  # past its bound, it forgets


class SessionOnRequestTests(SynchronousTestCase):
    """:meth:`SignIn.person_presented`: who a request's session token is, or why it is refused."""

    def setUp(self):
        self.clock = clock_at()
        self.signin = SignIn(CONFIG, MemoryStore(), None, self.clock)
        self.token, self.claims = self.signin.tokens.mint(ALICE)

    def presented(self, value: bytes, header: bytes = b"authorization"):
        return self.signin.person_presented(Headers({header: [value]}))

    def refused(self, value: bytes) -> RelayError:
        with self.assertRaises(RelayError) as caught:
            self.presented(value)
        self.assertEqual((caught.exception.status, caught.exception.retry_header()), (401, b"false"))
        self.assertNotIn(self.token, caught.exception.message)
        return caught.exception

    def test_person(self):
        person = self.presented(b"Bearer " + self.token.encode())
        self.assertEqual((person.name, person.group, person.session_id), ("alice@example.com", "platform", self.claims.jti))
        self.assertEqual(self.presented(self.token.encode(), b"x-api-key").sub, "sub-alice")
        self.assertIsNone(self.presented(b"Bearer sk-relay-key"))
        self.assertIsNone(self.signin.person_presented(Headers()))

    def test_expired(self):
        self.clock.advance(CONFIG.session_ttl)
        self.assertIn("expired", self.refused(b"Bearer " + self.token.encode()).message)

    def test_expired_once_known(self):
        """A token checked before (then only looked up) is refused all the same once it expires."""
        self.presented(b"Bearer " + self.token.encode())
        self.clock.advance(CONFIG.session_ttl - 1)
        self.presented(b"Bearer " + self.token.encode())
        self.clock.advance(1)
        self.assertIn("expired", self.refused(b"Bearer " + self.token.encode()).message)

    def test_revoked(self):
        self.presented(b"Bearer " + self.token.encode())
        self.successResultOf(ensureDeferred(self.signin.revoke(self.claims)))
        self.assertIn("revoked", self.refused(b"Bearer " + self.token.encode()).message)

    def test_bad_signature(self):
        head, body, signature = self.token.split(".")
        self.refused(("Bearer %s.%s.%s" % (head, body, signature[:-4] + "AAAA")).encode())

    def test_no_longer_allowed(self):
        """A person the rules now refuse (the table changed at a restart) is refused with their token."""
        stricter = SignIn(SignInConfig(CONFIG.public_url, "https://idp", "relay", SECRET, allowed_groups=("admins",)),
                          MemoryStore(), None, self.clock)
        with self.assertRaises(RelayError) as caught:
            stricter.person_presented(Headers({b"authorization": [b"Bearer " + self.token.encode()]}))
        self.assertIn("admins", caught.exception.message)
