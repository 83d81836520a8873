# -*- test-case-name: tests.test_signin_people -*-
"""
Who may sign in, and who they are to the relay.

:func:`person_of` reads what the identity provider said of someone (an ID
token's claims, or a session token's ``sub``, ``email`` and ``groups``)
and gives the :class:`~twisted_relay.signin.person.Person` the relay meters
and caps, or a :class:`Refusal` saying why they may not sign in:
``allowed_email_domains``, ``allowed_groups``, an email the provider says
is not verified. The person's relay group is the ``[signin.groups]`` entry
of the first listed IdP group they are in.

Pure: no Twisted, no I/O.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from twisted_relay.relay_keys import key_name_problem
from twisted_relay.signin.config import SignInConfig
from twisted_relay.signin.person import Person

__all__ = ["Refusal", "identity_of", "name_of", "person_of"]

# At most this many groups are kept of a person (an IdP may list hundreds).
_MAX_GROUPS = 200


@dataclass(frozen=True)
class Refusal:
    """Why someone may not sign in: a sentence for them (and the log)."""

    reason: str


def identity_of(claims: dict, config: SignInConfig) -> dict | Refusal:
    """
    The identity kept of someone (``sub``, ``email`` lower case, ``groups``)
    from an ID token's claims, read with the configured groups claim.
    """
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub:
        return Refusal("The identity provider gave no subject (sub) for this account.")
    email = claims.get("email")
    email = email.strip().lower() if isinstance(email, str) else ""
    if email and claims.get("email_verified") is False:
        return Refusal("The identity provider says the email address of this account is not verified.")
    groups = claims.get(config.groups_claim, [])
    if isinstance(groups, str):
        groups = [groups]
    if not isinstance(groups, list):
        groups = []
    return {"sub": sub, "email": email, "groups": [g for g in groups if isinstance(g, str)][:_MAX_GROUPS]}


def person_of(identity: dict, config: SignInConfig, session_id: str | None = None) -> Person | Refusal:
    """
    The person an identity (:func:`identity_of`, or a session token's
    claims) stands for, or why they may not sign in.
    """
    sub, email, groups = identity["sub"], identity.get("email") or "", tuple(identity.get("groups") or ())
    if config.allowed_email_domains:
        domain = email.rpartition("@")[2] if "@" in email else ""
        if domain not in config.allowed_email_domains:
            return Refusal(
                "Sign-in is open to email addresses of %s only%s."
                % (", ".join(config.allowed_email_domains), "; this account has none" if not email else "")
            )
    if config.allowed_groups and not set(groups) & set(config.allowed_groups):
        return Refusal("Sign-in is open to members of %s only." % (", ".join(config.allowed_groups),))
    group = next((relay_group for idp_group, relay_group in config.groups if idp_group in groups), None)
    return Person(sub=sub, email=email, groups=groups, name=name_of(sub, email), group=group, session_id=session_id)


def name_of(sub: str, email: str) -> str:
    """A person's user name: their email when it is a relay key's name as it is, else ``person-`` and a digest of ``sub``."""
    if email and key_name_problem(email) is None:
        return email
    return "person-" + hashlib.sha256(sub.encode("utf-8", "surrogatepass")).hexdigest()[:12]
