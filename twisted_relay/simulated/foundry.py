# -*- test-case-name: tests.test_simulated_foundry -*-
"""
A simulated Microsoft Foundry endpoint for Claude, and a simulated Azure
managed-identity endpoint that mints the Entra ID tokens it accepts.

:class:`SimulatedFoundry` serves ``POST /anthropic/v1/messages`` and
``/anthropic/v1/messages/count_tokens`` in front of a
:class:`~twisted_relay.simulated.resource.SimulatedUpstream` (the same fake
model, ids, thinking and usage as the Anthropic simulator), with what
Foundry adds:

- a key in ``api-key`` or ``x-api-key``, or ``Authorization: Bearer`` with
  an unexpired token that :class:`SimulatedIdentity` minted for Foundry's
  audience; else Azure's 401 (not Anthropic's envelope);
- ``model`` is a deployment name, mapped to a model by a deployment table;
  an unknown one is Azure's 404 ``DeploymentNotFound``;
- the ``anthropic-version`` header is required;
- a deployment hosted on Azure refuses server tools, the MCP connector and
  structured outputs with a 400;
- ``apim-request-id`` and ``request-id`` on every answer, and no
  ``anthropic-ratelimit-*`` headers.

:class:`SimulatedIdentity` is the managed-identity endpoint of App Service
and Container Apps (``IDENTITY_ENDPOINT`` + ``IDENTITY_HEADER``, plain
http), which azure-identity's ``ManagedIdentityCredential`` reads; its
tokens are signed, so they are checked without state, and live
``lifetime`` seconds. docs/simulated.md says which wording is Azure's and
which is the simulator's.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import math
import secrets
import uuid
from collections import deque
from typing import Any, Iterable, Mapping, NamedTuple
from urllib.parse import parse_qs

import ujson
from twisted.internet.interfaces import IReactorTime
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource

from twisted_relay._json import to_json
from twisted_relay.errors import error_body
from twisted_relay.simulated.base import Rejection, invalid
from twisted_relay.simulated.resource import MAX_BODY, ReceivedRequest, SimulatedUpstream

__all__ = [
    "ANTHROPIC_HOSTED",
    "AzureRefusal",
    "AZURE_HOSTED",
    "DEFAULT_DEPLOYMENTS",
    "FOUNDRY_AUDIENCES",
    "IDENTITY_PATH",
    "Deployment",
    "SimulatedFoundry",
    "SimulatedIdentity",
    "azure_hosted_refusal",
]

#: A deployment served on Azure's own infrastructure (fewer features).
AZURE_HOSTED = "azure"
#: A deployment served by Anthropic, billed through Azure (every feature).
ANTHROPIC_HOSTED = "anthropic"

#: The audiences of the tokens Foundry takes (``scope`` without ``/.default``).
FOUNDRY_AUDIENCES = ("https://ai.azure.com", "https://cognitiveservices.azure.com")
#: Where :class:`SimulatedIdentity` answers (``IDENTITY_ENDPOINT``'s path).
IDENTITY_PATH = "/msi/token"
#: The api-version of App Service's identity endpoint that azure-identity sends.
IDENTITY_API_VERSION = "2019-08-01"

_MESSAGES = b"/anthropic/v1/messages"
_COUNT = b"/anthropic/v1/messages/count_tokens"

# Azure's own wording (Azure OpenAI and AI Services answer these; that the
# /anthropic route answers the same is the simulator's assumption).
_NO_DEPLOYMENT = (
    "The API deployment for this resource does not exist. If you created the deployment within "
    "the last 5 minutes, please wait a moment and try again."
)
_BAD_KEY = (
    "Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a "
    "valid key for an active subscription and use a correct regional API endpoint for your resource."
)
_NO_KEY = (
    "Access denied due to missing subscription key. Make sure to include subscription key when "
    "making requests to an API."
)
_BAD_TOKEN = (
    "Unauthorized. Access token is missing, invalid, audience is incorrect "
    "(https://cognitiveservices.azure.com), or have expired."
)


class Deployment(NamedTuple):
    """
    One Foundry deployment: the model it serves and where it is hosted
    (:data:`AZURE_HOSTED` or :data:`ANTHROPIC_HOSTED`).
    """

    model: str
    hosting: str = AZURE_HOSTED


#: Deployments named after their models, as Foundry names them by default.
DEFAULT_DEPLOYMENTS: Mapping[str, Deployment] = {
    model: Deployment(model)
    for model in (
        "claude-opus-5-5",
        "claude-sonnet-5-5",
        "claude-haiku-5-5",
        "claude-opus-4-6",
        "claude-sonnet-4-5",
        "claude-haiku-4-5",
    )
}


class AzureRefusal(Exception):
    """
    A refusal in Azure's shape (its gateway's), not Anthropic's.

    :ivar status: the HTTP status.
    :ivar body: the JSON body (``{"error": {"code", "message"}}`` or
        ``{"statusCode", "message"}``).
    """

    def __init__(self, status: int, body: dict):
        super().__init__(status)
        self.status = status
        self.body = body


# -- the identity endpoint ----------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class SimulatedIdentity:
    """
    App Service's managed-identity endpoint: ``GET {IDENTITY_PATH}
    ?api-version=2019-08-01&resource=...`` with the ``X-IDENTITY-HEADER``
    secret mints a token for ``resource``, signed with HMAC-SHA256 (a JSON
    Web Token in form, as Entra's are).

    :param lifetime: seconds a token lives (whole seconds, 1 or more).
    :param reactor: the clock of expiry (Unix time: the global reactor when
        ``None``, as azure-identity reads the system clock).
    :param header: the ``IDENTITY_HEADER`` secret (drawn when ``None``).
    :param audiences: the audiences :meth:`check` accepts.

    :ivar minted: how many tokens were minted.
    """

    def __init__(
        self,
        lifetime: int = 3600,
        reactor: IReactorTime | None = None,
        *,
        header: str | None = None,
        audiences: Iterable[str] = FOUNDRY_AUDIENCES,
    ):
        if int(lifetime) != lifetime or lifetime < 1:
            raise ValueError("lifetime must be a whole number of seconds, 1 or more")
        self.lifetime = int(lifetime)
        self._reactor = reactor
        self.header = header or secrets.token_urlsafe(24)
        self.audiences = frozenset(audience.rstrip("/") for audience in audiences)
        self._key = secrets.token_bytes(32)
        self.minted = 0

    @property
    def reactor(self) -> IReactorTime:
        if self._reactor is None:
            from twisted.internet import reactor

            self._reactor = reactor  # type: ignore[assignment]
        return self._reactor  # type: ignore[return-value]

    def environ(self, base_url: str) -> dict[str, str]:
        """
        The environment variables azure-identity reads on App Service, for
        this endpoint served at ``base_url`` (``http://127.0.0.1:PORT``).
        """
        return {"IDENTITY_ENDPOINT": base_url.rstrip("/") + IDENTITY_PATH, "IDENTITY_HEADER": self.header}

    def mint(self, resource: str, client_id: str | None = None) -> tuple[str, int]:
        """A token for ``resource`` and its expiry (Unix seconds)."""
        now = self.reactor.seconds()
        # Rounded up: the token lives at least ``lifetime`` seconds.
        expires_on = math.ceil(now) + self.lifetime
        claims = {
            "aud": resource.rstrip("/"),
            "iss": "https://sts.windows.net/simulated-tenant/",
            "iat": int(now),
            "nbf": int(now),
            "exp": expires_on,
            "appid": client_id or "simulated-system-assigned",
            "jti": secrets.token_urlsafe(9),
        }
        signed = _b64(b'{"alg":"HS256","typ":"JWT"}') + "." + _b64(to_json(claims))
        signature = hmac.new(self._key, signed.encode("ascii"), hashlib.sha256).digest()
        self.minted += 1
        return signed + "." + _b64(signature), expires_on

    def check(self, token: str) -> bool:
        """Whether ``token`` was minted here, for an accepted audience, and has not expired."""
        parts = token.split(".")
        if len(parts) != 3:
            return False
        expected = hmac.new(self._key, (parts[0] + "." + parts[1]).encode("ascii", "replace"), hashlib.sha256).digest()
        try:
            if not hmac.compare_digest(_unb64(parts[2]), expected):
                return False
            claims = ujson.loads(_unb64(parts[1]))
        except ValueError:
            return False
        if not isinstance(claims, dict) or not isinstance(claims.get("exp"), int):
            return False
        return claims.get("aud") in self.audiences and self.reactor.seconds() < claims["exp"]

    def answer(self, query: Mapping[str, list[str]], headers: Mapping[str, str]) -> tuple[int, dict]:
        """
        The endpoint's answer to a token request: its status and JSON body
        (App Service's ``{access_token, expires_on, resource, token_type,
        client_id}``, or ``{statusCode, message}``).
        """
        presented = headers.get("x-identity-header", "")
        if not hmac.compare_digest(presented.encode(), self.header.encode()):
            return 401, {"statusCode": 401, "message": "The X-IDENTITY-HEADER header is missing or wrong."}
        version = query.get("api-version", [""])[-1]
        if version != IDENTITY_API_VERSION:
            return 400, {"statusCode": 400, "message": "Unsupported api-version %r." % (version[:40],)}
        resource = query.get("resource", [""])[-1]
        if not resource:
            return 400, {"statusCode": 400, "message": "The resource parameter is required."}
        client_id = query.get("client_id", [None])[-1]
        token, expires_on = self.mint(resource, client_id)
        return 200, {
            "access_token": token,
            "expires_on": str(expires_on),
            "resource": resource,
            "token_type": "Bearer",
            "client_id": client_id or "simulated-system-assigned",
        }

    def resource(self) -> IResource:
        """The endpoint alone: ``GET /msi/token``; any other path is a 404."""
        return _IdentityResource(self)


class _IdentityResource(Resource):
    isLeaf = True

    def __init__(self, identity: SimulatedIdentity):
        super().__init__()
        self._identity = identity

    def render(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        if request.path != IDENTITY_PATH.encode("ascii"):
            status, body = 404, {"statusCode": 404, "message": "Not found."}
        elif request.method != b"GET":
            status, body = 405, {"statusCode": 405, "message": "Only GET is allowed."}
        else:
            query = parse_qs(request.uri.decode("utf-8", "replace").partition("?")[2])
            status, body = self._identity.answer(query, _headers_of(request))
        request.setResponseCode(status)
        return to_json(body)


# -- what a deployment hosted on Azure refuses --------------------------------

_SERVER_TOOL_PREFIXES = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_", "mcp_toolset")


def azure_hosted_refusal(body: Any) -> Rejection | None:
    """
    The 400 a deployment hosted on Azure answers to ``body``, or ``None``:
    server tools (web search and fetch, code execution, tool search), the
    MCP connector (``mcp_servers``) and structured outputs
    (``output_config.format``, ``output_format``). The wording is the
    simulator's own.
    """
    if not isinstance(body, dict):
        return None
    tools = body.get("tools")
    for index, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind.startswith(_SERVER_TOOL_PREFIXES):
            return invalid(
                "tools.%d: The %s tool is not supported on this deployment: server tools are not "
                "available for Claude models hosted on Azure." % (index, kind)
            )
    if body.get("mcp_servers"):
        return invalid(
            "mcp_servers: The MCP connector is not supported on this deployment: it is not available "
            "for Claude models hosted on Azure."
        )
    output_config = body.get("output_config")
    if isinstance(output_config, dict) and output_config.get("format") is not None:
        return invalid(
            "output_config.format: Structured outputs are not supported on this deployment: they are "
            "not available for Claude models hosted on Azure."
        )
    if body.get("output_format") is not None:
        return invalid(
            "output_format: Structured outputs are not supported on this deployment: they are not "
            "available for Claude models hosted on Azure."
        )
    return None


# -- the Foundry endpoint -------------------------------------------------------


class SimulatedFoundry:
    """
    A Microsoft Foundry resource's Anthropic endpoint, in front of a
    simulated upstream.

    :param upstream: the fake model (its ``require_key`` must be ``None``:
        Foundry checks the credentials). Every request reaches it under one
        key, the resource's ``name``, so thinking and the prompt cache are
        bound to the resource, whichever key or token was presented.
    :param keys: the resource's keys (Azure gives two).
    :param identity: the managed-identity endpoint whose tokens are taken;
        without one, only keys are.
    :param deployments: deployment name -> :class:`Deployment`
        (:data:`DEFAULT_DEPLOYMENTS` when ``None``).
    :param name: the resource's name.
    :param keep_requests: how many requests :attr:`requests` keeps.

    :ivar requests: the last requests as received (credentials included:
        tests read which headers a client sent), oldest first.
    """

    def __init__(
        self,
        upstream: SimulatedUpstream,
        *,
        keys: Iterable[str] = ("foundry-key-1", "foundry-key-2"),
        identity: SimulatedIdentity | None = None,
        deployments: Mapping[str, Deployment] | None = None,
        name: str = "simulated-resource",
        keep_requests: int = 100,
    ):
        self.upstream = upstream
        self.keys = tuple(keys)
        self.identity = identity
        self.deployments = dict(DEFAULT_DEPLOYMENTS if deployments is None else deployments)
        self.name = name
        self.requests: deque[ReceivedRequest] = deque(maxlen=keep_requests)
        self._inner = upstream.resource()

    def resource(self) -> IResource:
        """
        The root resource: ``/anthropic/v1/messages``,
        ``/anthropic/v1/messages/count_tokens`` and, with an identity, its
        ``/msi/token`` (one port serves both); anything else is Azure's 404.
        """
        return _FoundryResource(self, self._inner)

    def authenticate(self, headers: Mapping[str, str]) -> None:
        """
        Accept a key in ``api-key`` or ``x-api-key``, or a bearer token the
        identity minted and that has not expired.

        :raises AzureRefusal: Azure's 401.
        """
        keys = [headers.get("api-key"), headers.get("x-api-key")]
        for presented in keys:
            if presented is not None and any(
                hmac.compare_digest(presented.encode(), key.encode()) for key in self.keys
            ):
                return
        authorization = headers.get("authorization", "")
        if authorization[:7].lower() == "bearer ":
            if self.identity is not None and self.identity.check(authorization[7:].strip()):
                return
            raise AzureRefusal(401, {"statusCode": 401, "message": _BAD_TOKEN})
        message = _NO_KEY if keys == [None, None] else _BAD_KEY
        raise AzureRefusal(401, {"error": {"code": "401", "message": message}})

    def deployment_of(self, body: Any) -> Deployment | None:
        """
        The deployment ``body`` names in ``model`` (``None`` when the body
        names none: the model's own checks answer that).

        :raises AzureRefusal: Azure's 404 ``DeploymentNotFound``.
        """
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str):
            return None
        deployment = self.deployments.get(model)
        if deployment is None:
            raise AzureRefusal(404, {"error": {"code": "DeploymentNotFound", "message": _NO_DEPLOYMENT}})
        return deployment


class _FoundryResource(Resource):
    """Foundry's checks, then the request handed to the simulated upstream."""

    isLeaf = True

    def __init__(self, foundry: SimulatedFoundry, inner: IResource):
        super().__init__()
        self._foundry = foundry
        self._inner = inner
        self._identity = None if foundry.identity is None else foundry.identity.resource()

    def render(self, request: IRequest) -> bytes | int:
        foundry = self._foundry
        if self._identity is not None and request.path == IDENTITY_PATH.encode("ascii"):
            return self._identity.render(request)
        request.setHeader(b"apim-request-id", str(uuid.uuid4()).encode("ascii"))
        headers = _headers_of(request)
        raw = request.content.read() if request.content is not None else b""
        body = _parse(raw) if len(raw) <= MAX_BODY else None
        foundry.requests.append(ReceivedRequest(
            request.method.decode("latin-1"), request.uri.decode("utf-8", "replace"), headers, body
        ))
        try:
            if request.path not in (_MESSAGES, _COUNT):
                raise AzureRefusal(404, {"error": {"code": "404", "message": "Resource not found"}})
            foundry.authenticate(headers)
            deployment = foundry.deployment_of(body)
            if not headers.get("anthropic-version"):
                raise invalid("anthropic-version: header is required")
            if deployment is not None and deployment.hosting == AZURE_HOSTED:
                refusal = azure_hosted_refusal(body)
                if refusal is not None:
                    raise refusal
        except AzureRefusal as error:
            request.setResponseCode(error.status)
            request.setHeader(b"content-type", b"application/json")
            return to_json(error.body)
        except Rejection as rejection:
            request_id = "req_foundry_" + secrets.token_hex(12)
            request.setResponseCode(rejection.status)
            request.setHeader(b"content-type", b"application/json")
            request.setHeader(b"request-id", request_id.encode("ascii"))
            return error_body(rejection.error_type, rejection.message, request_id)
        # The upstream sees an Anthropic request: the model, its own path,
        # and the resource as the account (never the presented credential).
        if deployment is not None and deployment.model != body["model"]:
            raw = to_json({**body, "model": deployment.model})
        request.content = io.BytesIO(raw)
        request.path = request.path[len(b"/anthropic"):]
        if request.uri.startswith(b"/anthropic/"):
            request.uri = request.uri[len(b"/anthropic"):]
        for name in (b"api-key", b"authorization"):
            request.requestHeaders.removeHeader(name)
        request.requestHeaders.setRawHeaders(b"x-api-key", [foundry.name.encode("utf-8")])
        return self._inner.render(request)


def _headers_of(request: IRequest) -> dict[str, str]:
    return {
        name.decode("latin-1").lower(): ", ".join(value.decode("latin-1") for value in values)
        for name, values in request.requestHeaders.getAllRawHeaders()
    }


def _parse(raw: bytes) -> Any:
    try:
        return ujson.loads(raw) if raw else None
    except ValueError:
        return None
