# -*- test-case-name: tests.test_signin_demo -*-
"""
``twistd relay --simulate-idp``: sign-in with no identity provider of your
own, for a keyless demo of ``claude auth login`` (``docs/signin.md``).

:class:`SimulatedSignIn` makes a :class:`~twisted_relay.simulated.idp.SimulatedIdP`
with three demo users and the relay registered as its client, and the
``[signin]`` settings that sign people in with it; the relay serves it on
its own listener under :data:`IDP_PATH` (:meth:`SimulatedSignIn.mount`).
The client secret and the session secret are made anew at each start (so
sessions end with the process), and the relay's public URL is
``http://127.0.0.1:PORT`` of its first ``--listen`` (Claude Code takes
``http://`` on loopback only).
"""

from __future__ import annotations

import secrets

from twisted.application.service import Service
from twisted.logger import Logger
from twisted.web.resource import Resource

from twisted_relay.signin.config import SignInConfig, loopback_public_url
from twisted_relay.simulated.idp import IdPClient, IdPUser, SimulatedIdP

__all__ = ["DEMO_USERS", "IDP_PATH", "SimulatedSignIn"]

#: Where the simulated identity provider is served on the relay's listener.
IDP_PATH = b"_idp"
#: Who may sign in: alice and bob are in ``engineering`` (alice also in
#: ``eng-platform``, relay group ``platform``); carol is not, and is refused.
DEMO_USERS = (
    IdPUser("alice@example.com", "demo-alice", ("engineering", "eng-platform"), "Alice"),
    IdPUser("bob@example.com", "demo-bob", ("engineering",), "Bob"),
    IdPUser("carol@example.com", "demo-carol", ("sales",), "Carol"),
)
_NOTICE = (
    "Demo sign-in (twistd relay --simulate-idp): pick alice@example.com or bob@example.com; "
    "carol@example.com is not in engineering and is refused."
)


class _WithIdP(Resource):
    """The relay's resource, with the simulated identity provider under ``/_idp``."""

    def __init__(self, relay, idp):
        super().__init__()
        self._relay = relay
        self.putChild(IDP_PATH, idp)

    def getChildWithDefault(self, name, request):
        if name in self.children:
            return self.children[name]
        # Any other path is the relay's, whole (it sees where it is mounted by prepath).
        request.postpath.insert(0, request.prepath.pop())
        return self._relay


class SimulatedSignIn(Service):
    """
    The demo identity provider and the sign-in settings that use it (a
    service: it says in the log, as the relay starts, where to sign in).

    :param listen: the relay's first ``--listen`` description.
    :param reactor: the provider's clock.
    :ivar idp: the :class:`~twisted_relay.simulated.idp.SimulatedIdP`.
    :ivar signin: the :class:`~twisted_relay.signin.config.SignInConfig`.
    :raises ValueError: a ``listen`` Claude Code could not reach
        (:func:`~twisted_relay.signin.config.loopback_public_url`).
    """

    log = Logger()

    def __init__(self, listen: str, reactor):
        public_url = loopback_public_url(listen)
        issuer = public_url + "/" + IDP_PATH.decode("ascii")
        client = IdPClient("twisted-relay", secrets.token_urlsafe(32), (public_url + "/oauth/callback",))
        self.idp = SimulatedIdP(reactor, users=DEMO_USERS, clients=(client,), issuer=issuer)
        self.signin = SignInConfig(
            public_url=public_url,
            issuer=issuer,
            client_id=client.client_id,
            client_secret=client.secret,
            session_secret=secrets.token_urlsafe(48),
            allowed_groups=("engineering",),
            groups=(("eng-platform", "platform"), ("engineering", "engineering")),
            login_notice=_NOTICE,
        )

    def mount(self, relay_resource):
        """``relay_resource`` with the identity provider beside it, under ``/_idp``."""
        return _WithIdP(relay_resource, self.idp.resource())

    def startService(self):
        Service.startService(self)
        self.log.info(
            "Simulated identity provider at {issuer}: sign in with claude auth login (forceLoginMethod \"gateway\", "
            "forceLoginGatewayUrl \"{public_url}\") as {users}; {refused} is refused",
            issuer=self.signin.issuer, public_url=self.signin.public_url,
            users=" or ".join(user.email for user in DEMO_USERS[:2]), refused=DEMO_USERS[2].email,
        )
