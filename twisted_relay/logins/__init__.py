"""
The upstreams' logins: how the relay proves who it is to each upstream (a
key, a cloud's bearer token, AWS SigV4), credentials fetched off the reactor
and refreshed ahead of their expiry. ``base`` <- one module per cloud.
"""

from twisted_relay.logins.base import (
    DEFAULT_MARGIN,
    Credentials,
    CredentialSource,
    Login,
    LoginError,
    LoginThreads,
)

__all__ = [
    "DEFAULT_MARGIN",
    "LOGINS",
    "Credentials",
    "CredentialSource",
    "Login",
    "LoginError",
    "LoginThreads",
    "login_for",
]


#: The logins an upstream may name (``login = { kind = "..." }``).
LOGINS = ("aws", "bedrock-api-key", "google", "azure", "key")


def login_for(upstream, reactor, threads: LoginThreads) -> Login | None:
    """
    The :class:`Login` of ``upstream`` (its ``login`` setting), not started;
    ``None`` when it has none (its key pool goes in ``x-api-key``, or the
    client's own credentials pass).
    """
    spec = upstream.login
    if spec is None:
        return None
    if spec.kind == "google":
        from twisted_relay.logins.google import GoogleLogin

        return GoogleLogin(reactor, threads, credentials_file=spec.option("credentials"))
    raise LoginError("upstream %s: unknown login %r (known: %s)" % (upstream.name, spec.kind, ", ".join(LOGINS)))
