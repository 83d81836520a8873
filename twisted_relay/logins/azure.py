# -*- test-case-name: tests.test_logins_azure -*-
"""
Microsoft Entra ID tokens for Microsoft Foundry, from azure-identity.

:class:`AzureLogin` sends ``Authorization: Bearer <token>`` for the scope
``https://ai.azure.com/.default``. The token comes from one of
azure-identity's credentials:

- ``default``: ``DefaultAzureCredential`` (environment, workload identity,
  managed identity, the Azure CLI... in azure-identity's order);
- ``managed``: ``ManagedIdentityCredential`` (App Service, Container Apps,
  virtual machines, Arc; ``client_id`` for a user-assigned identity);
- ``client-secret``: ``ClientSecretCredential``, its tenant, client id and
  secret read from environment variables the configuration names.

``get_token`` blocks (a metadata service, an OAuth call), so it runs only in
the login's :class:`~twisted_relay.logins.base.CredentialSource`, on the
logins' threads; the token is fetched again 4 minutes before it expires
(:data:`AZURE_MARGIN`). Neither the token nor the secret is ever shown.

azure-identity is the ``[azure]`` extra: :func:`require_azure_identity`
says how to install it, in one line, when it is missing.

azure-identity and MSAL log a failed ``get_token`` at WARNING through the
standard library's ``logging``, which the relay does not configure: Python
would print each on stderr beside the login's own one-line error. The login
gives their loggers a ``NullHandler`` (an application that configures
``logging`` still gets their records).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Mapping

from twisted.web.http_headers import Headers

from twisted_relay.logins.base import Credentials, CredentialSource, Login, LoginError, LoginThreads
from twisted_relay.logins.keys import clear_credentials
from twisted_relay.redact import REDACTED, redact_text

__all__ = [
    "AZURE_MARGIN",
    "FOUNDRY_SCOPE",
    "IDENTITIES",
    "INSTALL_HINT",
    "AzureLogin",
    "require_azure_identity",
]

#: The scope of a Microsoft Foundry token (Anthropic's docs of 2025 used
#: ``https://cognitiveservices.azure.com/.default``, which Foundry takes too).
FOUNDRY_SCOPE = "https://ai.azure.com/.default"
#: Seconds before expiry that a token is fetched again. azure-identity (MSAL)
#: hands back its cached token until it has 5 minutes left: fetching earlier
#: would get the same token again, fetching at 4 minutes gets a new one.
AZURE_MARGIN = 240.0
#: The credentials :class:`AzureLogin` can use, as the configuration names them.
IDENTITIES = ("default", "managed", "client-secret")
#: How to get azure-identity.
INSTALL_HINT = "pip install 'twisted-relay[azure]'"

# The variables of the managed-identity endpoints that hold a secret.
_ENDPOINT_SECRETS = ("IDENTITY_HEADER", "MSI_SECRET")
# Anything shaped like a JSON Web Token (an Entra access token is one).
_JWT = re.compile(r"eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*")


def require_azure_identity() -> None:
    """
    Check, at start, that azure-identity can be imported.

    :raises LoginError: in one line, saying how to install it.
    """
    try:
        import azure.identity  # noqa: F401
    except ImportError:
        raise LoginError("The azure login needs the azure-identity library: %s" % (INSTALL_HINT,)) from None
    for name in ("azure.identity", "msal"):
        logger = logging.getLogger(name)
        if not any(isinstance(handler, logging.NullHandler) for handler in logger.handlers):
            logger.addHandler(logging.NullHandler())


class AzureLogin(Login):
    """
    A bearer token from Microsoft Entra ID, fetched and refreshed off the
    reactor.

    :param reactor: schedules the refreshes.
    :param threads: where ``get_token`` runs.
    :param identity: one of :data:`IDENTITIES`.
    :param scope: the token's scope.
    :param client_id: a user-assigned managed identity's client id
        (``default`` and ``managed``); not a secret.
    :param tenant_id_env: for ``client-secret``: the variable holding the
        tenant id (and ``client_id_env``, ``client_secret_env`` likewise).
    :param margin: fetch again this many seconds before expiry.
    :param credential: an azure-identity credential (anything with
        ``get_token(scope)``) to use instead of building one from
        ``identity``: an embedding application's own.
    :param environ: where the ``*_env`` variables are read (``os.environ``).
    :raises LoginError: azure-identity is missing, or a variable that
        ``client-secret`` needs is not set (named, never its value).
    """

    name = "azure"

    def __init__(
        self,
        reactor,
        threads: LoginThreads,
        *,
        identity: str = "default",
        scope: str = FOUNDRY_SCOPE,
        client_id: str | None = None,
        tenant_id_env: str = "AZURE_TENANT_ID",
        client_id_env: str = "AZURE_CLIENT_ID",
        client_secret_env: str = "AZURE_CLIENT_SECRET",
        margin: float = AZURE_MARGIN,
        credential: Any = None,
        environ: Mapping[str, str] | None = None,
    ):
        if identity not in IDENTITIES:
            raise ValueError("identity must be one of %s" % (", ".join(IDENTITIES),))
        if credential is None:
            require_azure_identity()
        self._identity = identity
        self._scope = scope
        self._client_id = client_id
        self._secret_names = (tenant_id_env, client_id_env, client_secret_env)
        self._environ = os.environ if environ is None else environ
        self._credential = credential
        # A credential the login built is the login's to close; one given is not.
        self._owns_credential = credential is None
        self.describe = "Entra ID token for %s (%s)" % (
            scope,
            "own credential" if credential is not None else identity,
        )
        if credential is None and identity == "client-secret":
            missing = [name for name in self._secret_names if not self._environ.get(name)]
            if missing:
                raise LoginError(
                    "%s: %s not set" % (self.describe, " and ".join("$" + name for name in missing))
                )
        self.source = CredentialSource(reactor, threads, self._fetch, self.describe, margin)

    def __repr__(self) -> str:
        return "AzureLogin(identity=%r, scope=%r, client_id=%r)" % (self._identity, self._scope, self._client_id)

    # -- on the logins' threads ------------------------------------------

    def _make_credential(self) -> Any:
        from azure import identity

        if self._identity == "managed":
            return identity.ManagedIdentityCredential(client_id=self._client_id)
        if self._identity == "client-secret":
            tenant_id, client_id, secret = (self._environ[name] for name in self._secret_names)
            return identity.ClientSecretCredential(tenant_id, client_id, secret)
        return identity.DefaultAzureCredential(managed_identity_client_id=self._client_id)

    def _fetch(self) -> Credentials:
        try:
            if self._credential is None:
                self._credential = self._make_credential()
            token = self._credential.get_token(self._scope)
            value = b"Bearer " + token.token.encode("ascii")
            expires_at = float(token.expires_on)
        except Exception as error:
            raise LoginError(self._scrubbed(error)) from None
        return Credentials(value, expires_at)

    def _scrubbed(self, error: Exception) -> str:
        """
        An error's text with no secret in it: the client secret, the managed
        identity's endpoint secrets (azure-identity reads them from
        ``os.environ``), and anything shaped like a token.
        """
        text = " ".join(str(error).split()) or type(error).__name__
        found = [os.environ.get(name) for name in _ENDPOINT_SECRETS]
        if self._identity == "client-secret":
            found.append(self._environ.get(self._secret_names[2]))
        return _JWT.sub(REDACTED, redact_text(text, [secret for secret in found if secret]))

    # -- on the reactor ---------------------------------------------------

    def stop(self) -> None:
        """Stop refreshing, and close the connections of the credential the login built."""
        Login.stop(self)
        credential = self._credential
        if self._owns_credential and credential is not None:
            self._credential = None
            # Closes its HTTP sessions' sockets: no waiting.
            credential.close()

    @property
    def expires_at(self) -> float | None:
        """When the token in force expires (Unix time), ``None`` before the first."""
        current = self.source.current
        return None if current is None else current.expires_at

    def authorize(self, method: bytes, url: str, headers: Headers, body: bytes | None) -> None:
        """
        Replace the client's credentials with the bearer token in force.

        :raises LoginError: no token was fetched yet (:meth:`start` first).
        """
        current = self.source.current
        if current is None:
            raise LoginError("%s: no token yet" % (self.describe,))
        clear_credentials(headers)
        headers.setRawHeaders(b"authorization", [current.value])
