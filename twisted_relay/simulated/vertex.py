# -*- test-case-name: tests.test_simulated_vertex -*-
"""
Claude on a simulated Google Vertex AI, on top of a :class:`SimulatedUpstream`
(the same fake model, id reuse, thinking signatures and usage).

Routes, with or without the ``/v1`` the real service requires
(``require_version=True`` refuses the versionless ones as Vertex does)::

    POST [/v1]/projects/{project}/locations/{location}/publishers/anthropic/models/{model}:rawPredict
    POST [/v1]/projects/{project}/locations/{location}/publishers/anthropic/models/{model}:streamRawPredict
    POST [/v1]/projects/{project}/locations/{location}/publishers/anthropic/models/count-tokens:rawPredict

What Google's layer refuses comes as ``google.rpc`` statuses,
``{"error": {"code", "message", "status"}}`` (a one-element JSON array of
them on ``streamRawPredict``, as Google's streaming methods answer): 401
``UNAUTHENTICATED`` for a missing, unknown or expired bearer token (only
tokens the simulated token endpoint minted are good), 403 for another
project or a token without the ``cloud-platform`` scope, 404 ``Publisher
Model ... was not found`` for a location, publisher or model it does not
serve (today's models only at ``global``, ``us`` and ``eu``), 429
``RESOURCE_EXHAUSTED`` for the quota (``quota_errors``). What the model
refuses comes in Anthropic's envelope with a ``req_vrtx_`` request id:
a missing or unknown ``anthropic_version`` in the body, a ``model`` in a
rawPredict body, an ``anthropic-beta`` value Vertex does not take (any on
count-tokens), and every 400 of the fake model.

Ids are Vertex's: ``msg_vrtx_``, ``toolu_vrtx_``. The fake model sees
first-party ids (``toolu_vrtx_X`` in a request is ``toolu_X`` to it, and
back), so its id reuse and the thinking signatures' prefixes stay whole.
The account that binds thinking and the prompt cache is the project.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Iterable
from urllib.parse import unquote

import ujson
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET

from twisted_relay._json import to_json
from twisted_relay.errors import error_body
from twisted_relay.message_threads.model import ThreadError
from twisted_relay.simulated.base import Rejection, invalid, seeded_rng
from twisted_relay.simulated.google_tokens import CLOUD_PLATFORM, SimulatedGoogleTokens, headers_of
from twisted_relay.simulated.model import MODELS
from twisted_relay.simulated.resource import MAX_BODY, PacedWriter, ReceivedRequest, SimulatedUpstream
from twisted_relay.simulated.system_messages import INLINE_TOOLS_BETA, TOOL_CHANGES_BETA
from twisted_relay.simulated.thinking import BINDING_BETA
from twisted_relay.simulated.today import FALLBACK_BETA, FAMILIES

__all__ = [
    "ANTHROPIC_VERSIONS",
    "ERROR_ARRAYS",
    "GoogleError",
    "LOCATIONS",
    "MULTI_REGIONS",
    "VERTEX_BETAS",
    "SimulatedVertex",
    "foreign_ids",
    "from_vertex_ids",
    "to_vertex_ids",
    "vertex_model_ids",
]

#: The body's ``anthropic_version`` values taken, and the API version each is.
ANTHROPIC_VERSIONS = {"vertex-2023-10-16": "2023-06-01", "2026-10-21": "2026-10-21"}

#: Vertex's locations for Claude: the global endpoint, the multi-regions
#: (``aiplatform.{us,eu}.rep.googleapis.com``) and regions.
MULTI_REGIONS = ("global", "us", "eu")
LOCATIONS = MULTI_REGIONS + (
    "us-east5", "us-central1", "us-east1", "us-west1", "europe-west1", "europe-west4",
    "asia-east1", "asia-southeast1",
)

#: The ``anthropic-beta`` values the simulated Vertex takes on the model
#: routes (its choice; the refused ones seen in trackers are not here:
#: ``prompt-caching-scope-2026-01-05``, ``effort-2025-11-24``,
#: ``adaptive-thinking-2026-01-28``, ``structured-outputs-2025-11-13``).
VERTEX_BETAS = frozenset({
    "claude-code-20250219",
    "interleaved-thinking-2025-05-14",
    "fine-grained-tool-streaming-2025-05-14",
    "context-1m-2025-08-07",
    "context-management-2025-06-27",
    "prompt-caching-2024-07-31",
    "computer-use-2025-01-24",
    "token-efficient-tools-2025-02-19",
    "output-128k-2025-02-19",
    "web-search-2025-03-05",
    "tool-search-tool-2025-10-19",
    # The fake model's own features of today's API.
    BINDING_BETA,
    FALLBACK_BETA,
    TOOL_CHANGES_BETA,
    INLINE_TOOLS_BETA,
})

#: When ``google.rpc`` errors come as a one-element JSON array.
ERROR_ARRAYS = ("never", "stream", "always")

_ROUTE = re.compile(
    r"^(?P<version>/v1)?/projects/(?P<project>[^/]+)/locations/(?P<location>[^/]+)"
    r"/publishers/(?P<publisher>[^/]+)/models/(?P<model>[^/:]+):(?P<method>rawPredict|streamRawPredict)$"
)
_DATED = re.compile(r"^(.*)-(\d{8})$")
_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_CREDENTIALS = (
    "Expected OAuth 2 access token, login cookie or other valid authentication credential. "
    "See https://developers.google.com/identity/sign-in/web/devconsole-project."
)


def vertex_model_ids() -> frozenset:
    """The fake model's ids as Vertex names them: ``claude-sonnet-4-5``,
    ``claude-sonnet-4-5@20250929``, today's ``claude-opus-5-5``..."""
    ids = set(FAMILIES)
    for model in MODELS:
        dated = _DATED.match(model["id"])
        if dated:
            ids.update((dated.group(1), "%s@%s" % dated.groups()))
    return frozenset(ids)


def _first_party_model(model: str) -> str:
    """``claude-sonnet-4-5@20250929`` -> ``claude-sonnet-4-5-20250929``."""
    return model.replace("@", "-", 1)


def _base_model(model: str) -> str:
    """The model without its version: what Vertex's quotas are per."""
    model = model.split("@", 1)[0]
    dated = _DATED.match(model)
    return dated.group(1) if dated else model


# -- ids ----------------------------------------------------------------------


def _swap_ids(value: Any, old: str, new: str) -> Any:
    """``value`` with every ``id``/``tool_use_id`` that starts with ``old``
    starting with ``new`` instead (a copy; the rest is shared)."""
    if isinstance(value, list):
        return [_swap_ids(item, old, new) for item in value]
    if not isinstance(value, dict):
        return value
    swapped = {}
    for key, item in value.items():
        if key in ("id", "tool_use_id") and isinstance(item, str) and item.startswith(old):
            item = new + item[len(old):]
        elif isinstance(item, (list, dict)):
            item = _swap_ids(item, old, new)
        swapped[key] = item
    return swapped


def to_vertex_ids(message: dict, foreign: frozenset = frozenset()) -> dict:
    """An answer of the fake model with Vertex's ids (``msg_vrtx_``,
    ``toolu_vrtx_``); a copy of a ``foreign`` id (one Vertex did not make)
    stays as it was: prefixed, it would be read back as one of Vertex's own
    and could meet its twin."""
    answer = dict(message)
    if isinstance(answer.get("id"), str) and answer["id"].startswith("msg_"):
        answer["id"] = "msg_vrtx_" + answer["id"][4:]
    if "content" in answer:
        answer["content"] = [
            block if isinstance(block, dict) and block.get("id") in foreign else _swap_ids(block, "toolu_", "toolu_vrtx_")
            for block in answer["content"]
        ]
    return answer


def foreign_ids(messages: Any) -> frozenset:
    """The tool ids of a request's history that Vertex did not make."""
    found = set()
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            if isinstance(block, dict) and block.get("type") == "tool_use":
                value = block.get("id")
                if isinstance(value, str) and not value.startswith("toolu_vrtx_"):
                    found.add(value)
    return frozenset(found)


def from_vertex_ids(messages: Any) -> Any:
    """A request's ``messages`` with the ids the fake model gave
    (``toolu_vrtx_X`` -> ``toolu_X``)."""
    return _swap_ids(messages, "toolu_vrtx_", "toolu_")


def _request_id() -> str:
    return "req_vrtx_01" + "".join(secrets.choice(_BASE62) for _ in range(22))


# -- Google's errors ----------------------------------------------------------


class GoogleError(Exception):
    """A refusal of Google's layer: a ``google.rpc`` status."""

    def __init__(self, code: int, status: str, message: str, reason: str | None = None):
        super().__init__(message)
        self.code = code
        self.status = status
        self.message = message
        self.reason = reason

    def body(self, as_array: bool) -> bytes:
        error: dict = {"code": self.code, "message": self.message, "status": self.status}
        if self.reason is not None:
            error["details"] = [{
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": self.reason,
                "domain": "googleapis.com",
                "metadata": {"service": "aiplatform.googleapis.com"},
            }]
        wrapped = {"error": error}
        return to_json([wrapped] if as_array else wrapped)


def _not_found(project: str, location: str, publisher: str, model: str) -> GoogleError:
    return GoogleError(
        404,
        "NOT_FOUND",
        f"Publisher Model `projects/{project}/locations/{location}/publishers/{publisher}/models/{model}` "
        "was not found or your project does not have access to it. Please ensure you are using a valid "
        "model version. For more information, see: "
        "https://cloud.google.com/vertex-ai/generative-ai/docs/learn/model-versions",
    )


class SimulatedVertex:
    """
    Claude on Vertex AI, simulated: the routes of one project.

    :param upstream: the fake model (its mode, seed, stream options,
        ``stream_errors`` for mid-stream ``overloaded_error`` events, its
        ``requests`` and ``reported`` record these routes too).
    :param project: the project whose routes these are (another: 403).
    :param tokens: the token endpoint whose tokens are good here; its routes
        are served by :meth:`resource` too.
    :param locations: the locations served (others: 404).
    :param models: the model ids served, as Vertex names them (default:
        :func:`vertex_model_ids`); today's models only at the multi-regions.
    :param betas: the ``anthropic-beta`` values the model routes take.
    :param quota_errors: the share of model requests answered 429
        ``RESOURCE_EXHAUSTED`` (drawn in order from the upstream's seed; may
        be changed at any time).
    :param error_arrays: ``"stream"`` (``streamRawPredict``'s ``google.rpc``
        errors are a JSON array), ``"always"`` or ``"never"``.
    :param require_version: refuse a path without ``/v1``, as Vertex does.
    """

    def __init__(
        self,
        upstream: SimulatedUpstream,
        project: str,
        tokens: SimulatedGoogleTokens,
        *,
        locations: Iterable[str] = LOCATIONS,
        models: Iterable[str] | None = None,
        betas: Iterable[str] = VERTEX_BETAS,
        quota_errors: float = 0.0,
        error_arrays: str = "stream",
        require_version: bool = False,
    ):
        if error_arrays not in ERROR_ARRAYS:
            raise ValueError("error_arrays must be one of " + ", ".join(ERROR_ARRAYS))
        if not 0.0 <= quota_errors <= 1.0:
            raise ValueError("quota_errors must be between 0 and 1")
        self.upstream = upstream
        self.project = project
        self.tokens = tokens
        self.locations = frozenset(locations)
        self.models = vertex_model_ids() if models is None else frozenset(models)
        self.betas = frozenset(betas)
        self.quota_errors = quota_errors
        self.error_arrays = error_arrays
        self.require_version = require_version
        self._drawn = 0

    def resource(self) -> IResource:
        """The root resource: the Vertex routes and the token endpoint's."""
        return _VertexResource(self)

    # -- Google's layer -------------------------------------------------------

    def authenticate(self, headers: dict[str, str]) -> None:
        """
        Refuse a request without a good token, as Google does.

        :raises GoogleError: 401 or 403.
        """
        authorization = headers.get("authorization", "")
        if authorization[:7].lower() != "bearer " or not authorization[7:].strip():
            raise GoogleError(401, "UNAUTHENTICATED", "Request is missing required authentication credential. "
                              + _CREDENTIALS, "CREDENTIALS_MISSING")
        issued = self.tokens.check(authorization[7:].strip())
        if issued is None or self.tokens.expired(issued):
            reason = "ACCESS_TOKEN_TYPE_UNSUPPORTED" if issued is None else "ACCESS_TOKEN_EXPIRED"
            raise GoogleError(401, "UNAUTHENTICATED", "Request had invalid authentication credentials. "
                              + _CREDENTIALS, reason)
        if CLOUD_PLATFORM not in issued.scopes:
            raise GoogleError(403, "PERMISSION_DENIED", "Request had insufficient authentication scopes.",
                              "ACCESS_TOKEN_SCOPE_INSUFFICIENT")

    def check_resource(self, project: str, location: str, publisher: str, model: str | None) -> None:
        """
        Refuse another project (403), or a location, publisher or model
        (``None``: count-tokens, whose model is checked with its body) not
        served here (404).
        """
        if project != self.project:
            raise GoogleError(
                403,
                "PERMISSION_DENIED",
                f"Permission 'aiplatform.endpoints.predict' denied on resource '//aiplatform.googleapis.com/"
                f"projects/{project}/locations/{location}/publishers/{publisher}/models/{model or 'count-tokens'}' "
                "(or it may not exist).",
                "IAM_PERMISSION_DENIED",
            )
        served = location in self.locations and publisher == "anthropic"
        if model is not None:
            # Newer models are served by the global and multi-region endpoints only.
            regional = location not in MULTI_REGIONS and _base_model(model) in FAMILIES
            served = served and model in self.models and not regional
        if not served:
            raise _not_found(project, location, publisher, model or "count-tokens")

    def draw_quota(self, model: str) -> None:
        """
        :raises GoogleError: 429 for the share ``quota_errors`` of requests.
        """
        if not self.quota_errors:
            return
        self._drawn += 1
        if seeded_rng(self.upstream.options.seed, "vertex quota", self._drawn).random() < self.quota_errors:
            raise GoogleError(
                429,
                "RESOURCE_EXHAUSTED",
                "Quota exceeded for aiplatform.googleapis.com/online_prediction_requests_per_base_model with "
                f"base model: anthropic-{_base_model(model)}. Please submit a quota increase request. "
                "https://cloud.google.com/vertex-ai/docs/generative-ai/quotas-genai.",
            )

    # -- the model's layer ----------------------------------------------------

    def check_body(self, body: Any, headers: dict[str, str], counting: bool) -> str:
        """
        Refuse what Claude on Vertex refuses before the model reads the
        request; the API version the body's ``anthropic_version`` is.

        :raises Rejection: 400 in Anthropic's words.
        """
        if not isinstance(body, dict):
            raise invalid("There was an error parsing the body of your request: expected a JSON object")
        if "anthropic_version" not in body:
            raise invalid("anthropic_version: Field required")
        version = ANTHROPIC_VERSIONS.get(body["anthropic_version"])
        if version is None:
            raise invalid("anthropic_version: Input should be " + " or ".join(map(repr, ANTHROPIC_VERSIONS)))
        if not counting and "model" in body:
            raise invalid("model: Extra inputs are not permitted")
        betas = [value.strip() for value in headers.get("anthropic-beta", "").split(",") if value.strip()]
        refused = betas if counting else [beta for beta in betas if beta not in self.betas]
        if refused:
            raise invalid(
                "Unexpected value(s) %s for the `anthropic-beta` header. Please consult our documentation at "
                "docs.anthropic.com or try again without the header." % ", ".join("`%s`" % b for b in refused)
            )
        return version

    def upstream_request(self, body: dict, headers: dict[str, str], version: str, model: str | None):
        """The body and headers the fake model reads: first-party ids, the
        model from the path, the project as the account."""
        plain = {key: value for key, value in body.items() if key != "anthropic_version"}
        if model is not None:
            plain["model"] = _first_party_model(model)
        elif isinstance(plain.get("model"), str):
            plain["model"] = _first_party_model(plain["model"])
        if "messages" in plain:
            plain["messages"] = from_vertex_ids(plain["messages"])
        seen = {name: value for name, value in headers.items() if name not in ("authorization", "x-api-key")}
        seen["anthropic-version"] = version
        seen["x-api-key"] = "vertex:" + self.project
        return plain, seen

    def error_as_array(self, streaming: bool) -> bool:
        return self.error_arrays == "always" or (self.error_arrays == "stream" and streaming)


class _VertexResource(Resource):
    """Routes every path; state lives on the :class:`SimulatedVertex`."""

    isLeaf = True

    def __init__(self, vertex: SimulatedVertex):
        super().__init__()
        self._vertex = vertex
        self._tokens = vertex.tokens.resource()

    def render(self, request: IRequest) -> bytes | int:
        vertex = self._vertex
        path = request.path.decode("utf-8", "replace")
        headers = headers_of(request)
        if vertex.tokens.serves(path, headers):
            return self._tokens.render(request)
        raw = request.content.read() if request.content is not None else b""
        body = _parse(raw) if len(raw) <= MAX_BODY else None
        vertex.upstream.requests.append(
            ReceivedRequest(request.method.decode("latin-1"), request.uri.decode("utf-8", "replace"), headers, body)
        )
        request_id = _request_id()
        route = _ROUTE.match(path)
        streaming = route is not None and route.group("method") == "streamRawPredict"
        try:
            return self._serve(request, route, headers, raw, body, request_id)
        except GoogleError as error:
            request.setResponseCode(error.code)
            request.setHeader(b"content-type", b"application/json; charset=UTF-8")
            if error.code == 401:
                request.setHeader(b"www-authenticate", b'Bearer realm="https://accounts.google.com/"')
            return error.body(vertex.error_as_array(streaming))
        except Rejection as rejection:
            request.setResponseCode(rejection.status)
            request.setHeader(b"content-type", b"application/json")
            request.setHeader(b"request-id", request_id.encode("ascii"))
            return error_body(rejection.error_type, rejection.message, request_id)
        except ThreadError as error:
            request.setResponseCode(error.status)
            request.setHeader(b"content-type", b"application/json")
            return error.body(request_id)

    def _serve(self, request: IRequest, route, headers: dict, raw: bytes, body: Any, request_id: str):
        vertex = self._vertex
        if (
            route is None
            or request.method != b"POST"
            or (vertex.require_version and route.group("version") is None)
        ):
            raise GoogleError(404, "NOT_FOUND", "The requested URL %s was not found on this server."
                              % request.path.decode("utf-8", "replace"))
        vertex.authenticate(headers)
        project, location, publisher, model = (
            unquote(route.group(name)) for name in ("project", "location", "publisher", "model")
        )
        counting = model == "count-tokens"
        if counting and route.group("method") != "rawPredict":
            raise _not_found(project, location, publisher, model)
        vertex.check_resource(project, location, publisher, None if counting else model)
        named = body.get("model") if counting and isinstance(body, dict) else None
        if isinstance(named, str):
            # count-tokens' model is the body's.
            vertex.check_resource(project, location, publisher, named)
        vertex.draw_quota(named if isinstance(named, str) else model)
        if len(raw) > MAX_BODY:
            raise Rejection(413, "request_too_large", "Request exceeds the maximum allowed number of bytes.")
        version = vertex.check_body(body, headers, counting)
        foreign = foreign_ids(body.get("messages"))
        plain, seen = vertex.upstream_request(body, headers, version, None if counting else model)
        upstream = vertex.upstream
        request.setHeader(b"request-id", request_id.encode("ascii"))
        request.setHeader(b"content-type", b"application/json")
        if counting:
            return to_json(upstream.count(plain, seen))
        message, turn = upstream.answer_turn(plain, seen)
        if plain.get("stream") is True:
            return self._stream(request, message, plain, turn, request_id, foreign)
        if turn is not None:
            turn.answered(message)
        upstream.reported.add(plain, message, message["usage"], stream=False, whole=True)
        return to_json(to_vertex_ids(message, foreign))

    def _stream(self, request: IRequest, message: dict, body: dict, turn, request_id: str,
                foreign: frozenset = frozenset()) -> int:
        upstream = self._vertex.upstream
        cut = upstream.cuts_stream(message)
        drop = not cut and upstream.drops_stream(message)
        plan = upstream.stream_plan(to_vertex_ids(message, foreign), cut=cut, drop=drop, request_id=request_id)
        request.setHeader(b"content-type", b"text/event-stream; charset=utf-8")
        request.setHeader(b"cache-control", b"no-cache")
        writer = PacedWriter(request, plan.pieces, upstream.reactor, drop=plan.drop)

        def ended(whole: bool) -> None:
            complete = whole and plan.whole
            if turn is not None:
                if complete and not cut:
                    turn.answered(message)
                else:
                    turn.failed()
            usage = plan.usage_sent(writer.written)
            if usage is not None:
                upstream.reported.add(body, message, usage, stream=True, whole=complete)

        writer.on_end = ended
        writer.start()
        return NOT_DONE_YET


def _parse(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return ujson.loads(raw)
    except ValueError:
        return None
