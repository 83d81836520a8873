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
    client's own credentials pass). ``docs/clouds.md`` lists each kind's options.

    :raises LoginError: the login cannot be made (a library missing, an
        environment variable not set); one line, no secret.
    """
    spec = upstream.login
    if spec is None:
        return None
    where = "upstream %s: " % (upstream.name,)
    make = _LOGIN_MAKERS.get(spec.kind)
    if make is None:
        raise LoginError("%sunknown login %r (known: %s)" % (where, spec.kind, ", ".join(LOGINS)))
    try:
        return make(upstream, spec, reactor, threads)
    except LoginError as e:
        raise LoginError(where + str(e)) from None


def _variable(value: str | None) -> str | None:
    """The environment variable an option names (``env:NAME``); ``None`` for anything else."""
    if value is None or not value.startswith("env:"):
        return None
    return value[4:]


def _aws(upstream, spec, reactor, threads) -> Login:
    from twisted_relay.logins.aws import AwsKeys, AwsSigV4Login, aws_login

    key_id = spec.option("access-key-id")
    if key_id is not None and not key_id.startswith("env:"):
        # Keys written in the file itself (the simulated clouds' made-up ones;
        # real ones belong in the environment, named with env:).
        keys = AwsKeys(key_id, spec.option("secret-access-key") or "", spec.option("session-token"))
        source = CredentialSource(reactor, threads, lambda: Credentials(keys), "AWS keys from the configuration")
        return AwsSigV4Login(reactor, source, spec.option("service", "bedrock"), upstream.region or "")
    return aws_login(
        reactor, threads, upstream.region, spec.option("service", "bedrock"), spec.option("profile"),
        _variable(spec.option("access-key-id")), _variable(spec.option("secret-access-key")),
        _variable(spec.option("session-token")),
    )


def _bedrock_api_key(upstream, spec, reactor, threads) -> Login:
    from twisted_relay.logins.aws import BedrockApiKeyLogin

    key = spec.option("key", "env:AWS_BEARER_TOKEN_BEDROCK")
    variable = _variable(key)
    # Written out in the file, the key is the key; never shown.
    return BedrockApiKeyLogin.from_environment(variable) if variable else BedrockApiKeyLogin(key)


def _google(upstream, spec, reactor, threads) -> Login:
    from twisted_relay.logins.google import GoogleLogin

    return GoogleLogin(reactor, threads, credentials_file=spec.option("credentials"))


def _azure(upstream, spec, reactor, threads) -> Login:
    from twisted_relay.logins.azure import AzureLogin

    return AzureLogin(reactor, threads, identity=spec.option("identity", "default"),
                      client_id=spec.option("client-id"))


def _key(upstream, spec, reactor, threads) -> Login:
    from twisted_relay.logins.keys import KeyLogin

    key = spec.option("key")
    if not key:
        raise LoginError('a key login needs key = "env:VAR", "file:PATH" or the key')
    names = [name.strip() for name in spec.option("headers", "x-api-key").split(",") if name.strip()]
    try:
        return KeyLogin(key, names)
    except ValueError as e:
        raise LoginError(str(e)) from None


_LOGIN_MAKERS = {"aws": _aws, "bedrock-api-key": _bedrock_api_key, "google": _google, "azure": _azure, "key": _key}
