# -*- test-case-name: tests.test_simulated_bedrock -*-
"""
What the simulated Bedrock runtime (InvokeModel) checks in a request, in
Bedrock's words, and how it maps a Bedrock request onto the fake model.

- :class:`BedrockError`: an error as Bedrock answers it (status,
  ``x-amzn-ErrorType``, ``{"message": ...}``).
- :data:`BEDROCK_MODELS` and :func:`resolve_model`: model ids (base
  ``anthropic.claude-...``, inference profiles ``global.``/``us.``/``eu.``/
  ``apac.``..., ARNs), the Anthropic model name the fake model answers as,
  and the 400 for a profile-only model called by its base id.
- :func:`check_body`: ``anthropic_version`` (and which models take
  ``2026-10-21``), the fields Bedrock refuses (``model``, ``stream``,
  ``service_tier``...), body betas, per-model tool fields.
- :func:`to_anthropic`, :func:`from_anthropic`: the id prefixes
  (``toolu_bdrk_``, ``msg_bdrk_``) on the way in and out, so that the fake
  model's reused ids stay reused.

Pure: no Twisted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from twisted_relay.simulated.base import blocks_of, messages_of

__all__ = [
    "BEDROCK_BETAS",
    "BEDROCK_MODELS",
    "BEDROCK_VERSION",
    "HTTP_ERRORS",
    "NEW_VERSION",
    "PROFILE_PREFIXES",
    "REFUSED_FIELDS",
    "STREAM_EXCEPTIONS",
    "TOOL_SEARCH_BETA",
    "BedrockError",
    "BedrockModel",
    "Resolved",
    "check_body",
    "foreign_ids",
    "from_anthropic",
    "resolve_model",
    "to_anthropic",
    "validation",
]

#: The ``anthropic_version`` every Bedrock model takes.
BEDROCK_VERSION = "bedrock-2023-05-31"
#: The API version Bedrock takes too, for Claude 4.7 and later only.
NEW_VERSION = "2026-10-21"
#: The beta that lets a tool carry ``defer_loading`` (tool search) on Bedrock.
TOOL_SEARCH_BETA = "tool-search-tool-2025-10-19"

#: The body betas Bedrock takes (``anthropic_beta``); any other is a 400
#: ``invalid beta flag``.  Header betas are ignored, as Bedrock ignores them.
BEDROCK_BETAS = frozenset({
    "claude-code-20250219",
    "compact-2026-01-12",
    "computer-use-2024-10-22",
    "computer-use-2025-01-24",
    "computer-use-2025-11-24",
    "context-1m-2025-08-07",
    "context-management-2025-06-27",
    "dev-full-thinking-2025-05-14",
    "effort-2025-11-24",
    "fine-grained-tool-streaming-2025-05-14",
    "inline-tools-2026-09-15",
    "interleaved-thinking-2025-05-14",
    "mid-conversation-tool-changes-2026-07-01",
    "output-128k-2025-02-19",
    "thinking-binding-controls-2026-08-01",
    "token-efficient-tools-2025-02-19",
    "tool-examples-2025-10-29",
    TOOL_SEARCH_BETA,
})

#: Top-level fields Bedrock's InvokeModel refuses ("Extra inputs are not
#: permitted"): the model and streaming are chosen by the URL, the service
#: tier by the ``X-Amzn-Bedrock-Service-Tier`` header, the geography by the
#: inference profile; the rest are first-party features.
REFUSED_FIELDS = ("model", "stream", "service_tier", "inference_geo", "speed", "fallbacks", "mcp_servers",
                  "container")

#: Inference-profile prefixes, and the region groups they serve.
PROFILE_PREFIXES = {"global": None, "us": "us-", "eu": "eu-", "apac": "ap-", "jp": "ap-northeast-1",
                    "au": "ap-southeast-2", "us-gov": "us-gov-"}

#: HTTP errors the simulator can be told to answer: ``x-amzn-ErrorType``
#: -> (status, message).
HTTP_ERRORS = {
    "ThrottlingException": (429, "Too many requests, please wait before trying again."),
    "ServiceUnavailableException": (503, "Bedrock is unable to process your request."),
    "ModelNotReadyException": (429, "Model is not ready to serve inference requests. The AWS SDK will "
                                     "automatically retry the operation up to 5 times."),
    "ModelTimeoutException": (408, "Model has timed out in processing the request. Try your request again."),
    "ModelErrorException": (424, "Received error from model: Overloaded"),
    "InternalServerException": (500, "The system encountered an unexpected error during processing. "
                                     "Try your request again."),
    "ServiceQuotaExceededException": (400, "Your request exceeds the service quota for your account. "
                                           "You can view your quotas at Viewing service quotas."),
    "AccessDeniedException": (403, "You don't have access to the model with the specified model ID."),
}

#: Exception frames a stream can end with: ``:exception-type`` -> message.
STREAM_EXCEPTIONS = {
    "throttlingException": "Too many requests, please wait before trying again.",
    "modelStreamErrorException": "Received error from model: Overloaded",
    "internalServerException": "The system encountered an unexpected error during processing. "
                               "Try your request again.",
    "serviceUnavailableException": "Bedrock is unable to process your request.",
    "validationException": "Input is too long for requested model.",
    "modelTimeoutException": "Model has timed out in processing the request. Try your request again.",
}


class BedrockError(Exception):
    """
    A request the simulated Bedrock refuses, as Bedrock answers it.

    :ivar status: the HTTP status.
    :ivar error_type: the ``x-amzn-ErrorType`` (``ValidationException``...).
    :ivar message: the body's ``message``.
    :ivar fields: more body fields (``originalStatusCode``...).
    :ivar key: the body's message key: ``message``, or ``Message`` as
        Bedrock's front door writes it for authentication errors.
    """

    def __init__(self, status: int, error_type: str, message: str, fields: dict | None = None,
                 key: str = "message"):
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.fields = dict(fields or {})
        self.key = key

    def body(self) -> dict:
        """The JSON body Bedrock answers with."""
        return {self.key: self.message, **self.fields}


def validation(message: str) -> BedrockError:
    """A 400 ``ValidationException``."""
    return BedrockError(400, "ValidationException", message)


# -- models -----------------------------------------------------------------------------


@dataclass(frozen=True)
class BedrockModel:
    """
    A Claude model as Bedrock serves it.

    :ivar name: the Anthropic model name the fake model answers as (so
        today's model families apply).
    :ivar on_demand: callable by its base id (``False``: only through an
        inference profile).
    :ivar new_version: takes ``anthropic_version`` ``2026-10-21`` too
        (Claude 4.7 and later).
    :ivar refused_tool_fields: custom-tool fields this model refuses.
    """

    name: str
    on_demand: bool = False
    new_version: bool = False
    refused_tool_fields: frozenset = field(default_factory=frozenset)


#: Base model ids and their models.
BEDROCK_MODELS = {
    "anthropic.claude-opus-4-7": BedrockModel("claude-opus-4-7", new_version=True),
    "anthropic.claude-opus-4-6-v1": BedrockModel("claude-opus-4-6"),
    "anthropic.claude-sonnet-4-6": BedrockModel("claude-sonnet-4-6"),
    "anthropic.claude-opus-4-5-20251101-v1:0": BedrockModel("claude-opus-4-5-20251101"),
    "anthropic.claude-sonnet-4-5-20250929-v1:0": BedrockModel("claude-sonnet-4-5-20250929"),
    "anthropic.claude-haiku-4-5-20251001-v1:0": BedrockModel(
        "claude-haiku-4-5-20251001", refused_tool_fields=frozenset({"eager_input_streaming"})),
    "anthropic.claude-opus-4-1-20250805-v1:0": BedrockModel("claude-opus-4-1-20250805"),
    "anthropic.claude-3-5-haiku-20241022-v1:0": BedrockModel("claude-3-5-haiku-20241022", on_demand=True),
    "anthropic.claude-sonnet-5-5": BedrockModel("claude-sonnet-5-5", new_version=True),
    "anthropic.claude-haiku-5-5": BedrockModel("claude-haiku-5-5", new_version=True),
}

_ARN = re.compile(r"^arn:aws(?:-[a-z]+)?:bedrock:([a-z0-9-]+):(\d*):"
                  r"(foundation-model|inference-profile|application-inference-profile)/(.+)$")


@dataclass(frozen=True)
class Resolved:
    """A model id resolved: the id as called, the base id and its model."""

    model_id: str
    base_id: str
    model: BedrockModel


def _invalid_id() -> BedrockError:
    return validation("The provided model identifier is invalid.")


def resolve_model(model_id: str, region: str, models: dict[str, BedrockModel],
                  application_profiles: dict[str, str]) -> Resolved:
    """
    The model ``model_id`` (as decoded from the URL) names, in ``region``.

    :param application_profiles: application inference profile ARN -> the
        model id (base or system profile) it routes to.
    :raises BedrockError: an unknown id, a profile of another geography, or
        a profile-only model called by its base id (on-demand throughput).
    """
    match = _ARN.match(model_id)
    target = model_id
    via_profile = False
    if match is not None:
        arn_region, _, kind, rest = match.groups()
        if arn_region != region:
            raise _invalid_id()
        if kind == "application-inference-profile":
            routed = application_profiles.get(model_id)
            if routed is None:
                raise _invalid_id()
            resolved = resolve_model(routed, region, models, {})
            return Resolved(model_id, resolved.base_id, resolved.model)
        target = rest
        via_profile = kind == "inference-profile"
    prefix, dot, rest = target.partition(".")
    if dot and prefix in PROFILE_PREFIXES:
        serves = PROFILE_PREFIXES[prefix]
        if serves is not None and not region.startswith(serves):
            raise _invalid_id()
        target, via_profile = rest, True
    model = models.get(target)
    if model is None:
        raise _invalid_id()
    if not via_profile and not model.on_demand:
        raise validation(
            f"Invocation of model ID {target} with on-demand throughput isn't supported. Retry your request "
            "with the ID or ARN of an inference profile that contains this model."
        )
    return Resolved(model_id, target, model)


# -- the body -------------------------------------------------------------------------------


def _extra(path: str) -> BedrockError:
    return validation(f"{path}: Extra inputs are not permitted")


def _is_custom_tool(tool: Any) -> bool:
    return isinstance(tool, dict) and tool.get("type", "custom") in ("custom", None)


def _check_cache_controls(path: str, value: Any) -> None:
    """Bedrock takes ``cache_control`` with ``type`` and ``ttl`` only (no ``scope``)."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            _check_cache_controls(f"{path}.{index}", item)
        return
    if not isinstance(value, dict):
        return
    control = value.get("cache_control")
    if isinstance(control, dict):
        for name in control:
            if name not in ("type", "ttl"):
                raise _extra(f"{path}.cache_control.{control.get('type')}.{name}")
    content = value.get("content")
    if isinstance(content, list):
        _check_cache_controls(f"{path}.content", content)


def check_body(body: Any, resolved: Resolved, *, for_count: bool = False) -> list[str]:
    """
    Refuse what Bedrock's InvokeModel refuses, in its words; return the
    body betas.

    :param for_count: the inner body of a CountTokens request (which still
        needs ``max_tokens``).
    :raises BedrockError: 400 ``ValidationException``.
    """
    if not isinstance(body, dict):
        raise validation("Malformed input request, please reformat your input and try again.")
    if "anthropic_version" not in body:
        raise validation("anthropic_version: Field required")
    version = body["anthropic_version"]
    if version != BEDROCK_VERSION and not (version == NEW_VERSION and resolved.model.new_version):
        raise validation("Invalid API version")
    for name in REFUSED_FIELDS:
        if name in body:
            raise _extra(name)
    if "max_tokens" not in body:
        raise validation("max_tokens: Field required")
    betas = body.get("anthropic_beta", [])
    if not isinstance(betas, list) or not all(isinstance(beta, str) for beta in betas):
        raise validation("anthropic_beta: Input should be a valid list")
    if any(beta not in BEDROCK_BETAS for beta in betas):
        raise validation("invalid beta flag")
    tools = body.get("tools")
    for index, tool in enumerate(tools if isinstance(tools, list) else []):
        if not _is_custom_tool(tool):
            continue
        for name in sorted(resolved.model.refused_tool_fields):
            if name in tool:
                raise _extra(f"tools.{index}.custom.{name}")
        if "defer_loading" in tool and TOOL_SEARCH_BETA not in betas:
            raise _extra(f"tools.{index}.custom.defer_loading")
    _check_cache_controls("tools", tools)
    _check_cache_controls("system", body.get("system"))
    for n, message in enumerate(messages_of(body)):
        _check_cache_controls(f"messages.{n}.content", message.get("content"))
    return list(betas)


# -- ids ---------------------------------------------------------------------------------------

_PLATFORM = "bdrk_"


def _swap_ids(messages: list, old: str, new: str) -> list:
    swapped = []
    for message in messages:
        blocks = blocks_of(message)
        if not blocks:
            swapped.append(message)
            continue
        content = []
        for block in message["content"]:
            if isinstance(block, dict) and block.get("type") == "tool_use":
                block = dict(block, id=_swap(block.get("id"), old, new))
            elif isinstance(block, dict) and block.get("type") == "tool_result":
                block = dict(block, tool_use_id=_swap(block.get("tool_use_id"), old, new))
            content.append(block)
        swapped.append(dict(message, content=content))
    return swapped


def _swap(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str) and value.startswith(old):
        return new + value[len(old):]
    return value


def to_anthropic(body: dict) -> dict:
    """``body`` with Bedrock's tool ids (``toolu_bdrk_...``) as the fake model
    issued them (``toolu_...``)."""
    if "messages" not in body or not isinstance(body["messages"], list):
        return body
    return dict(body, messages=_swap_ids(body["messages"], "toolu_" + _PLATFORM, "toolu_"))


def foreign_ids(messages: Any) -> frozenset:
    """The tool ids of a request's history that Bedrock did not make (another platform's, a client's)."""
    found = set()
    for message in messages if isinstance(messages, list) else ():
        for block in blocks_of(message) or ():
            if isinstance(block, dict) and block.get("type") == "tool_use":
                value = block.get("id")
                if isinstance(value, str) and not value.startswith("toolu_" + _PLATFORM):
                    found.add(value)
    return frozenset(found)


def from_anthropic(message: dict, foreign: frozenset = frozenset()) -> dict:
    """The fake model's answer with Bedrock's ids: ``msg_bdrk_...``,
    ``toolu_bdrk_...`` (an id it copied from the history is rewritten the
    same way, so it stays a copy; a copy of a ``foreign`` id, one Bedrock did
    not make, stays as it was: prefixed, it would be read back as one of
    Bedrock's own and could meet its twin)."""
    content = []
    for block in message["content"]:
        if isinstance(block, dict) and block.get("type") == "tool_use" and block.get("id") not in foreign:
            block = dict(block, id=_swap(block.get("id"), "toolu_", "toolu_" + _PLATFORM))
        content.append(block)
    return dict(message, id=_swap(message["id"], "msg_", "msg_" + _PLATFORM), content=content)
