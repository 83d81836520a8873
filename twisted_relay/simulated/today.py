# -*- test-case-name: tests.test_simulated_today -*-
"""
The Messages API as it runs today (December 2026), for the simulated upstream.

- Model families (:data:`FAMILIES`) with today's thinking rules: adaptive
  thinking when ``thinking`` is omitted, the ``thinking.type`` values each
  takes (400 for the rest), forced ``tool_choice`` refused where the API
  refuses it, and thinking bound to its prefix, model and account
  (:mod:`twisted_relay.simulated.thinking`).  A model id of no family (the
  year-old ``claude-sonnet-4-5`` and the like) keeps the year-old rules.
- Both API versions: ``anthropic-version: 2026-10-21`` refuses ``temperature``,
  ``top_p`` and ``top_k`` (even at their defaults), ``document`` blocks in
  assistant turns and non-empty ``citations`` on user text blocks;
  ``2023-06-01`` does not.
- The answer's today shape: a fresh ``msg_`` id every time, today's usage
  (every field, :mod:`twisted_relay.simulated.usage`: the prompt cache's
  reads and writes, ``iterations``, the speed and geography the request
  chose), ``stop_details``, and ``input_transformations`` with the binding beta.

Pure: no Twisted.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

from twisted_relay.simulated.base import blocks_of, messages_of, invalid, seeded_rng
from twisted_relay.simulated.system_messages import check_system_messages
from twisted_relay.simulated.usage import Prompt, sampling, today_usage
from twisted_relay.simulated.thinking import (
    BINDING_BETA,
    Binding,
    Bound,
    account_tag,
    answer_prefix,
    bind,
    sign,
)

__all__ = [
    "APIS",
    "DEFAULT_FALLBACK",
    "FALLBACK_BETA",
    "FAMILIES",
    "FAST_FAMILIES",
    "VERSIONS",
    "Family",
    "Prepared",
    "TodayRules",
    "check_version",
    "fallback_model_of",
    "family_of",
    "fresh_message_id",
    "rare_answer",
]

#: The APIs the simulated upstream speaks: today's, and the one of a year ago.
APIS = ("2026-12", "2025")

#: The beta value that lets a request name ``fallbacks``.
FALLBACK_BETA = "server-side-fallback-2026-07-01"

#: Where ``fallbacks: "default"`` hands a refused turn.
DEFAULT_FALLBACK = "claude-sonnet-5"

#: The ``anthropic-version`` values in force.
VERSIONS = ("2023-06-01", "2026-10-21")

_EFFORTS = ("low", "medium", "high", "xhigh", "max")
_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_DATED = re.compile(r"^(.*)-\d{8}$")


@dataclass(frozen=True)
class Family:
    """
    A model family of today's API.

    :ivar name: e.g. ``"sonnet-5.5"``.
    :ivar thinking_types: the ``thinking.type`` values it takes.
    :ivar forced_tools: ``"refused"`` (400), ``"unthinking"`` (accepted,
        answered without thinking) or ``"accepted"``.
    :ivar enforces: whose prefix mismatches are errors by default:
        ``"new_accounts"`` (created since 2026-08-31), ``"all"`` or ``"never"``.
    :ivar account_bound: its blocks are read only in their account.
    :ivar reads: the families whose thinking it reads (``"legacy"``: models
        of the year-old API).
    :ivar effort: its default ``output_config.effort``.
    :ivar omitted: how it thinks when the request has no ``thinking``
        (``"adaptive"``, or ``"disabled"`` for the 4.6 models).
    :ivar display: its default ``thinking.display``.
    """

    name: str
    thinking_types: tuple
    forced_tools: str
    enforces: str
    account_bound: bool
    reads: frozenset
    effort: str
    omitted: str = "adaptive"
    display: str = "omitted"


_FIRST = frozenset({"fable-5.1", "mythos-5.1", "opus-5.5", "legacy"})

#: Today's model ids and their families.
FAMILIES = {
    "claude-fable-5-2": Family("fable-5.2", ("adaptive",), "accepted", "all", False,
                               _FIRST | {"fable-5.2", "mythos-5.2"}, "high"),
    "claude-mythos-5-2": Family("mythos-5.2", ("adaptive",), "accepted", "all", False,
                                _FIRST | {"fable-5.2", "mythos-5.2"}, "high"),
    "claude-fable-5-1": Family("fable-5.1", ("adaptive",), "refused", "new_accounts", False, _FIRST, "high"),
    "claude-mythos-5-1": Family("mythos-5.1", ("adaptive",), "refused", "never", False, _FIRST, "high"),
    "claude-opus-5-5": Family("opus-5.5", ("adaptive",), "refused", "new_accounts", False,
                              frozenset({"opus-5.5", "sonnet-5.5", "legacy"}), "medium"),
    "claude-sonnet-5-5": Family("sonnet-5.5", ("adaptive", "between_tools"), "refused", "new_accounts", True,
                                frozenset({"sonnet-5.5", "legacy"}), "high"),
    "claude-haiku-5-5": Family("haiku-5.5", ("adaptive", "disabled"), "unthinking", "new_accounts", True,
                               frozenset({"haiku-5.5", "legacy"}), "medium"),
    # The 4.6 models, still served on the clouds' InvokeModel and rawPredict:
    # adaptive thinking when asked for (no thinking when not), manual
    # thinking still taken, summarized thinking by default.
    "claude-opus-4-6": Family("opus-4.6", ("adaptive", "enabled", "disabled"), "unthinking", "never", False,
                              frozenset({"opus-4.6", "sonnet-4.6", "legacy"}), "high", "disabled", "summarized"),
    "claude-sonnet-4-6": Family("sonnet-4.6", ("adaptive", "enabled", "disabled"), "unthinking", "never", False,
                                frozenset({"sonnet-4.6", "legacy"}), "high", "disabled", "summarized"),
}

_ACCOUNT_BOUND = frozenset(family.name for family in FAMILIES.values() if family.account_bound)

#: The families that run ``speed: "fast"`` (others run it at standard speed).
FAST_FAMILIES = frozenset({"fable-5.2", "mythos-5.2", "opus-5.5"})
_GEOGRAPHIES = ("global", "us")


def family_of(model: Any) -> Family | None:
    """The family of a model id (dated ids too), or ``None`` for a model of
    the year-old API."""
    if not isinstance(model, str):
        return None
    dated = _DATED.match(model)
    return FAMILIES.get(dated.group(1) if dated else model, FAMILIES.get(model))


def _family_name(model: str) -> str:
    family = family_of(model)
    return family.name if family is not None else "legacy"


def fresh_message_id() -> str:
    """A ``msg_`` id never given before: two answers never share one."""
    return "msg_01" + "".join(secrets.choice(_BASE62) for _ in range(22))


def _betas(headers: dict[str, str]) -> set[str]:
    return {value.strip() for value in headers.get("anthropic-beta", "").split(",") if value.strip()}


# -- API versions -------------------------------------------------------------


def check_version(body: Any, version: str | None) -> None:
    """
    Refuse what ``anthropic-version: 2026-10-21`` refuses.

    :raises Rejection: sampling parameters, a ``document`` block in an
        assistant turn, non-empty ``citations`` on a user text block.
    """
    if version != "2026-10-21" or not isinstance(body, dict):
        return
    for name in ("temperature", "top_p", "top_k"):
        if name in body:
            raise invalid(f"{name}: Extra inputs are not permitted")
    for n, message in enumerate(messages_of(body)):
        role = message.get("role") if isinstance(message, dict) else None
        for m, block in enumerate(blocks_of(message)):
            if role == "assistant" and block.get("type") == "document":
                raise invalid(
                    f"messages.{n}.content.{m}: `document` blocks are not permitted in `assistant` messages"
                )
            if role == "user":
                _check_citations(f"messages.{n}.content.{m}", block)


def _check_citations(path: str, block: dict) -> None:
    if block.get("type") == "text" and block.get("citations"):
        raise invalid(f"{path}.citations: `citations` are not permitted on `text` blocks in `user` messages")
    if block.get("type") == "search_result" and isinstance(block.get("content"), list):
        for k, inner in enumerate(block["content"]):
            if isinstance(inner, dict):
                _check_citations(f"{path}.content.{k}", inner)


# -- thinking per family ------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    kind: str
    display: str
    behavior: str | None


def _not_supported(kind: str) -> Any:
    return invalid(
        f'"thinking.type.{kind}" is not supported for this model. Use "thinking.type.adaptive" and '
        '"output_config.effort" to control thinking behavior.'
    )


def _thinking_plan(body: dict, family: Family, betas: set[str]) -> _Plan:
    config = body.get("output_config")
    effort = config.get("effort") if isinstance(config, dict) and "effort" in config else family.effort
    if effort not in _EFFORTS:
        raise invalid("output_config.effort: Input should be 'low', 'medium', 'high', 'xhigh' or 'max'")
    thinking = body.get("thinking")
    if thinking is None:
        return _Plan(family.omitted, family.display, None)
    if not isinstance(thinking, dict):
        raise invalid("thinking: Input should be a valid dictionary")
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise invalid(
            f"thinking.type: Input tag '{kind}' found using 'type' does not match any of the expected tags: "
            "'enabled', 'disabled', 'between_tools', 'adaptive'"
        )
    if kind not in family.thinking_types:
        raise _not_supported(kind)
    if kind in ("between_tools", "disabled") and effort not in ("low", "medium", "high"):
        raise invalid(f'"thinking.type.{kind}" is not supported with "output_config.effort" "{effort}" for this model.')
    if kind == "enabled" and not isinstance(thinking.get("budget_tokens"), int):
        raise invalid("thinking.enabled.budget_tokens: Field required")
    if kind == "between_tools" or kind == "disabled":
        extra = sorted(set(thinking) - {"type"})
        if extra:
            raise invalid(f"thinking.{kind}.{extra[0]}: Extra inputs are not permitted")
        return _Plan(kind, "omitted", None)
    behavior = None
    if "block_binding" in thinking:
        if BINDING_BETA not in betas:
            raise invalid(f"thinking.{kind}.block_binding: Extra inputs are not permitted")
        binding = thinking["block_binding"]
        if binding is not None and not isinstance(binding, dict):
            raise invalid(f"thinking.{kind}.block_binding: Input should be a valid dictionary")
        behavior = (binding or {}).get("prefix_mismatch_behavior")
        if behavior not in (None, "error", "drop_block"):
            raise invalid(
                f"thinking.{kind}.block_binding.prefix_mismatch_behavior: Input should be 'error' or 'drop_block'"
            )
    display = thinking.get("display") or family.display
    return _Plan(kind, display if isinstance(display, str) else family.display, behavior)


def _check_tool_choice(body: dict, family: Family) -> bool:
    """Refuse a forced tool choice where the family does; say whether the
    answer may think."""
    choice = body.get("tool_choice")
    forced = isinstance(choice, dict) and choice.get("type") in ("any", "tool")
    if forced and family.forced_tools == "refused":
        raise invalid('tool_choice: type "tool" and "any" are not supported for this model.')
    return not (forced and family.forced_tools == "unthinking")


def _in_tool_loop(body: dict) -> bool:
    messages = messages_of(body)
    return bool(messages) and any(block.get("type") == "tool_result" for block in blocks_of(messages[-1]))


@dataclass
class Prepared:
    """
    A request checked by today's rules.

    :ivar body: what the model reads (dropped thinking left out).
    :ivar family: the model's family (``None``: a year-old model).
    :ivar thinks: the answer starts with a thinking block.
    :ivar display: ``"omitted"`` (empty thinking text) or ``"summarized"``.
    :ivar bound: the binding outcome (``None`` for a year-old model).
    :ivar beta: the request carries the binding beta.
    :ivar account: the tag of the request's account.
    """

    body: dict
    family: Family | None
    thinks: bool
    display: str
    bound: Bound | None
    beta: bool
    account: str


class TodayRules:
    """
    Today's API on top of the simulated upstream's year-old core.

    :param secret: the secret today's thinking is signed with.
    :param legacy_secret: the secret of year-old signatures (``None``: none).
    :param accounts: API key to account name; a key not listed is an
        account of its own.
    :param binding_default: ``"error"`` (an account created since
        2026-08-31: prefix mismatches are 400 by default) or ``"allow"`` (an
        older account: checked only when the request sets the behaviour).
    """

    def __init__(self, secret: str, legacy_secret: str | None = None, accounts: dict | None = None,
                 binding_default: str = "error"):
        if binding_default not in ("error", "allow"):
            raise ValueError("binding_default must be error or allow")
        self.secret = secret
        self.legacy_secret = legacy_secret
        self.accounts = dict(accounts or {})
        self.binding_default = binding_default

    def account_of(self, headers: dict[str, str]) -> str:
        """The tag of the account whose key the request carries (``x-api-key``
        wins over ``Authorization: Bearer``)."""
        key = headers.get("x-api-key")
        if key is None:
            authorization = headers.get("authorization", "")
            key = authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
        return account_tag(self.secret, self.accounts.get(key, "key:" + key))

    def _prefix_behavior(self, family: Family, requested: str | None) -> str:
        if family.enforces == "never":
            return "off"
        if requested is not None:
            return requested
        return "error" if family.enforces == "all" or self.binding_default == "error" else "allow"

    def prepare(self, body: dict, headers: dict[str, str]) -> Prepared:
        """
        Check ``body`` (already shape-checked) by today's rules.

        :raises Rejection: with the API's 400 where it refuses the request.
        """
        check_version(body, headers.get("anthropic-version"))
        if body.get("inference_geo") not in (None, *_GEOGRAPHIES):
            raise invalid("inference_geo: Input should be 'global' or 'us'")
        if body.get("speed") not in (None, "standard", "fast"):
            raise invalid("speed: Input should be 'standard' or 'fast'")
        betas = _betas(headers)
        beta = BINDING_BETA in betas
        account = self.account_of(headers)
        family = family_of(body.get("model"))
        if family is None:
            return Prepared(body, None, False, "omitted", None, beta, account)
        if "fallbacks" in body and FALLBACK_BETA not in betas:
            raise invalid("fallbacks: Extra inputs are not permitted")
        check_system_messages(body, betas)
        plan = _thinking_plan(body, family, betas)
        may_think = _check_tool_choice(body, family)
        binding = Binding(
            secret=self.secret,
            reader=family.name,
            reads=family.reads | {family.name},
            family_of=_family_name,
            account_bound=_ACCOUNT_BOUND,
            account=account,
            prefix=self._prefix_behavior(family, plan.behavior),
            beta=beta,
            legacy_secret=self.legacy_secret,
        )
        bound = bind(body, binding)
        if plan.kind in ("adaptive", "enabled"):
            thinks = may_think
        elif plan.kind == "between_tools":
            thinks = may_think and _in_tool_loop(body)
        else:
            thinks = False
        return Prepared(bound.body, family, thinks, plan.display, bound, beta, account)

    def finish(self, message: dict, prepared: Prepared, sent: dict, prompt: Prompt | None = None) -> dict:
        """
        Give the fake model's answer today's shape: its thinking block (signed
        for the prefix ``sent``, the request as the client sent it), a fresh
        id, today's usage fields and ``input_transformations``.

        :param prompt: how the prompt was read through the cache (``None``:
            without it).
        """
        content = list(message["content"])
        thinking_tokens = 0
        if prepared.thinks and prepared.bound is not None:
            rng = seeded_rng("thinking", message["content"])
            thought = f"Weighing {rng.choice(('the next step', 'the tool results', 'what to check'))}."
            text = thought if prepared.display == "summarized" else ""
            thinking_tokens = 20 + rng.randrange(200)
            content.insert(0, {
                "type": "thinking",
                "thinking": text,
                "signature": sign(
                    self.secret,
                    model=str(sent.get("model")),
                    account=prepared.account,
                    previous=prepared.bound.previous,
                    count=prepared.bound.count,
                    text=text,
                    prefix=answer_prefix(sent),
                ),
            })
        tools = [block.get("name") for block in content if block.get("type") == "server_tool_use"]
        if prompt is None:
            prompt = Prompt.uncached(message["usage"]["input_tokens"])
        output = message["usage"]["output_tokens"] + thinking_tokens
        speed = sent.get("speed")
        if speed is not None:
            family = prepared.family
            speed = "fast" if speed == "fast" and family is not None and family.name in FAST_FAMILIES else "standard"
        usage = today_usage(
            [sampling(prompt, output, "message")],
            thinking_tokens=thinking_tokens,
            web_search_requests=tools.count("web_search"),
            web_fetch_requests=tools.count("web_fetch"),
            inference_geo=sent.get("inference_geo") or "global",
            speed=speed,
        )
        answer = dict(message, id=fresh_message_id(), content=content, stop_details=None, usage=usage)
        if prepared.beta and prepared.family is not None:
            answer["input_transformations"] = list(prepared.bound.transformations if prepared.bound else [])
        return answer


# -- rare answers -------------------------------------------------------------


def fallback_model_of(body: Any) -> str | None:
    """The model a refused turn of ``body`` falls back to (its ``fallbacks``), or ``None``."""
    return _fallback_model(body.get("fallbacks") if isinstance(body, dict) else None)


def _fallback_model(fallbacks: Any) -> str | None:
    if fallbacks == "default":
        return DEFAULT_FALLBACK
    if isinstance(fallbacks, list) and fallbacks and isinstance(fallbacks[0], dict):
        model = fallbacks[0].get("model")
        return model if isinstance(model, str) else None
    return None


def rare_answer(message: dict, kind: str, body: dict | None = None, fallback_prompt: Prompt | None = None) -> dict:
    """
    ``message`` turned into a rarer answer of today's API, its usage
    ``iterations`` saying so: the declined attempt and the fallback
    model's (``fallback_message``), or the compaction and the answer.

    :param kind: ``"refusal"`` (a classifier stopped the answer:
        ``stop_reason`` ``refusal`` with ``stop_details``; when the request
        names ``fallbacks``, the next model serves the turn instead, after a
        ``fallback`` block) or ``"compaction"`` (the server compacted the
        context: a ``compaction`` block alone, ``stop_reason`` ``compaction``;
        send it back and go on).
    :param body: the request (its ``fallbacks``).
    :param fallback_prompt: how the fallback model read the prompt through
        its cache (``None``: as the first model did).
    """
    rng = seeded_rng(kind, message["content"])
    category = rng.choice(("cyber", "general_harms"))
    fallback = _fallback_model((body or {}).get("fallbacks"))
    if kind == "refusal" and fallback is not None:
        served = [block for block in message["content"] if block.get("type") not in ("thinking", "redacted_thinking")]
        marker = {"type": "fallback", "from": {"model": message["model"]}, "to": {"model": fallback},
                  "trigger": {"type": "refusal", "category": category}}
        usage = message["usage"]
        first = usage["iterations"][0]
        # The declined attempt read the prompt and said nothing; the
        # fallback model wrote the answer, without the thinking left out.
        thinking_tokens = usage["output_tokens_details"]["thinking_tokens"]
        if fallback_prompt is None:
            fallback_prompt = _prompt_of(first)
        iterations = [
            dict(first, model=message["model"], output_tokens=1),
            sampling(fallback_prompt, first["output_tokens"] - thinking_tokens, "fallback_message", fallback),
        ]
        usage = _retold(usage, iterations, thinking_tokens=0)
        return dict(message, model=fallback, content=[marker, *served], usage=usage)
    if kind == "refusal":
        return dict(
            message,
            content=[{"type": "text", "text": "I can't help with that part of the request."}],
            stop_reason="refusal",
            stop_details={
                "type": "refusal",
                "category": category,
                "explanation": "A safety classifier stopped this answer.",
            },
        )
    if kind == "compaction":
        opaque = "".join(rng.choice(_BASE62) for _ in range(48))
        summary = "Summary: the tools were called in turn; all went well."
        usage = message["usage"]
        first = usage["iterations"][0]
        prompt = _prompt_of(first)
        written = len(summary) // 4 + 1
        # The compaction read the whole prompt and wrote the summary; its
        # counts are outside the top level, as the API documents.
        iterations = [
            sampling(Prompt.uncached(prompt.input_tokens + prompt.cache_read + prompt.cache_write_5m
                                     + prompt.cache_write_1h), written, "compaction"),
            dict(first, output_tokens=written),
        ]
        return dict(
            message,
            content=[{"type": "compaction", "content": summary, "encrypted_content": opaque}],
            stop_reason="compaction",
            usage=_retold(usage, iterations, thinking_tokens=0, web_search_requests=0),
        )
    raise ValueError(f"unknown rare answer {kind!r}")


def _prompt_of(entry: dict) -> Prompt:
    """How the sampling of a usage entry read its prompt."""
    split = entry["cache_creation"]
    return Prompt(entry["input_tokens"], entry["cache_read_input_tokens"],
                  split["ephemeral_5m_input_tokens"], split["ephemeral_1h_input_tokens"])


def _retold(usage: dict, iterations: list[dict], **changes: Any) -> dict:
    """``usage`` with other ``iterations`` (the top level summed again), the rest kept unless changed."""
    tools = usage["server_tool_use"]
    settings = dict(
        thinking_tokens=usage["output_tokens_details"]["thinking_tokens"],
        web_search_requests=tools["web_search_requests"],
        web_fetch_requests=tools["web_fetch_requests"],
        inference_geo=usage["inference_geo"],
        speed=usage.get("speed"),
    )
    settings.update(changes)
    return today_usage(iterations, **settings)
