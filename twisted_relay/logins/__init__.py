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

__all__ = ["DEFAULT_MARGIN", "Credentials", "CredentialSource", "Login", "LoginError", "LoginThreads"]
