# -*- test-case-name: tests.test_simulated_today -*-
"""
Signed thinking as today's API binds it: to its prefix, its model and its
account.

A block's signature is verifiable without state: it carries the model that
made it, a tag of the account (never the key), its place in the run of
thinking blocks before it, and two HMACs under the upstream's secret, one
over the block itself (a forged or edited block: "Invalid `signature`") and
one over the block and the digest of its prefix (an edited conversation:
"bound to a different conversation").  Restarted upstreams, and several
upstreams sharing a secret, agree on every signature.

The prefix of a block is ``system`` + ``tools`` + every earlier message and
the blocks before it in its own message, compared by value: keys are sorted,
``cache_control`` is left out, a string ``content`` or ``system`` is the same
as one text block, a ``defer_loading`` tool counts only from the block that
first uses or loads it on (so a block before that point never depends on it),
and thinking blocks are not part of it.  Their order is checked on its own:
each signature names the thinking block just before it and how many came
before it, so that dropping a leading or trailing run (or all) is fine and
removing one from the middle, or putting one back, is an edit.  Pure: no
Twisted.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass
from typing import Any, Callable

import ujson

from twisted_relay.simulated.base import messages_of, canonical, invalid
from twisted_relay.simulated.system_messages import names_loaded

__all__ = [
    "BINDING_BETA",
    "DEFAULT_SECRET",
    "Binding",
    "Signed",
    "account_tag",
    "answer_prefix",
    "bind",
    "prefix_mismatch_message",
    "read_signature",
    "sign",
]

#: The beta value that lets a request set ``thinking.block_binding``.
BINDING_BETA = "thinking-binding-controls-2026-08-01"

#: The secret thinking is signed with when the upstream is given none: the
#: same in every instance, so that they agree.
DEFAULT_SECRET = "twisted-relay-simulated"

_THINKING_KINDS = ("thinking", "redacted_thinking")


def _mac(secret: str, *parts: Any) -> str:
    return hmac.new(secret.encode("utf-8"), canonical(list(parts)), hashlib.sha256).hexdigest()


def account_tag(secret: str, account: str) -> str:
    """A short tag naming ``account`` in signatures (the key never appears)."""
    return _mac(secret, "account", account)[:16]


@dataclass(frozen=True)
class Signed:
    """
    What a valid signature says about its block.

    :ivar model: the model that made it (``None``: a year-old signature, which
        names none and carries no record of a prefix).
    :ivar account: the tag of the account it was made for.
    :ivar previous: the tag of the thinking block before it ("" for none).
    :ivar count: how many thinking blocks came before it.
    :ivar block_mac: the HMAC over the block itself.
    :ivar prefix_mac: the HMAC over the block and its prefix.
    """

    model: str | None
    account: str
    previous: str
    count: int
    block_mac: str
    prefix_mac: str

    @property
    def tag(self) -> str:
        """This block's own tag, as the next block names it."""
        return self.block_mac[:16]


def sign(secret: str, *, model: str, account: str, previous: str, count: int, text: str, prefix: str) -> str:
    """The signature of a thinking block of ``text`` made by ``model`` for the
    account tagged ``account`` after the prefix whose digest is ``prefix``."""
    head = [1, model, account, previous, count]
    block_mac = _mac(secret, "block", head, text)[:32]
    prefix_mac = _mac(secret, "prefix", block_mac, prefix)[:32]
    return base64.b64encode(canonical([*head, block_mac, prefix_mac])).decode("ascii")


def read_signature(secret: str, signature: Any, text: Any) -> Signed | None:
    """The :class:`Signed` of a signature this secret made for ``text``, or
    ``None`` (empty, forged, edited, or for another text)."""
    if not isinstance(signature, str) or not signature or not isinstance(text, str):
        return None
    try:
        fields = ujson.loads(base64.b64decode(signature.encode("ascii"), validate=True))
    except (ValueError, UnicodeEncodeError, binascii.Error):
        return None
    if not (isinstance(fields, list) and len(fields) == 7 and fields[0] == 1):
        return None
    _, model, account, previous, count, block_mac, prefix_mac = fields
    if not (isinstance(model, str) and isinstance(account, str) and isinstance(previous, str)
            and isinstance(count, int) and isinstance(block_mac, str) and isinstance(prefix_mac, str)):
        return None
    expected = _mac(secret, "block", [1, model, account, previous, count], text)[:32]
    if not hmac.compare_digest(expected, block_mac):
        return None
    return Signed(model, account, previous, count, block_mac, prefix_mac)


# -- the prefix, by value -----------------------------------------------------


def _without_cache_control(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_cache_control(item) for key, item in value.items() if key != "cache_control"}
    if isinstance(value, list):
        return [_without_cache_control(item) for item in value]
    return value


def _as_blocks(content: Any) -> Any:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _is_deferred(tool: Any) -> bool:
    return isinstance(tool, dict) and tool.get("defer_loading") is True


def _deferred_tools(body: dict) -> dict:
    tools = body.get("tools")
    if not isinstance(tools, list):
        return {}
    return {tool.get("name"): tool for tool in tools if _is_deferred(tool) and isinstance(tool.get("name"), str)}


def _tools_by_value(body: dict) -> Any:
    """``tools`` without its ``defer_loading`` tools: a deferred tool enters
    the prefix where a message first uses or loads it, not up front."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return tools
    return [tool for tool in tools if not _is_deferred(tool)]


def _hasher(body: dict) -> Any:
    digest = hashlib.sha256()
    digest.update(canonical(["system", _without_cache_control(_as_blocks(body.get("system")))]))
    digest.update(canonical(["tools", _without_cache_control(_tools_by_value(body))]))
    return digest


def _walk(body: dict, at_block: Callable[[int, int, dict, str], None]) -> Any:
    """Feed the prefix to a digest, calling ``at_block`` at each thinking
    block with the digest of everything before it; return the digest.

    A ``defer_loading`` tool's definition is fed right after the block that
    first uses or loads it, so that a block before that point does not
    depend on it (its prefix is the same whether or not a later message
    loads the tool)."""
    digest = _hasher(body)
    deferred = _deferred_tools(body)
    loaded: set = set()
    for n, message in enumerate(messages_of(body)):
        role = message.get("role") if isinstance(message, dict) else None
        digest.update(canonical(["message", role]))
        content = _as_blocks(message.get("content")) if isinstance(message, dict) else None
        for m, block in enumerate(content if isinstance(content, list) else []):
            if isinstance(block, dict) and block.get("type") in _THINKING_KINDS:
                at_block(n, m, block, digest.copy().hexdigest())
                continue
            digest.update(canonical(["block", _without_cache_control(block)]))
            for name in names_loaded(block):
                if name in deferred and name not in loaded:
                    loaded.add(name)
                    digest.update(canonical(["loaded_tool", _without_cache_control(deferred[name])]))
    return digest


def answer_prefix(body: dict) -> str:
    """The prefix digest of a block at the start of the answer to ``body``."""
    digest = _walk(body, lambda n, m, block, prefix: None)
    digest.update(canonical(["message", "assistant"]))
    return digest.hexdigest()


# -- the check ----------------------------------------------------------------


def prefix_mismatch_message(n: int, m: int, beta: bool) -> str:
    """The 400 message for a block whose prefix changed, as Anthropic words it."""
    message = (
        f"messages.{n}.content.{m}: Invalid `signature` in `thinking` block. The block is bound to a "
        "different conversation. Remove the block, or set `thinking.block_binding.prefix_mismatch_behavior` "
        'to "drop_block".'
    )
    if not beta:
        message += f" That setting requires the `{BINDING_BETA}` value in the `anthropic-beta` header."
    return message


@dataclass(frozen=True)
class Binding:
    """
    How one request checks the thinking it sends back.

    :ivar secret: the signing secret.
    :ivar reader: the family name of the requested model.
    :ivar reads: the family names whose blocks it can read.
    :ivar family_of: a block's model id to its family name (``"legacy"`` for
        a model of the year-old API).
    :ivar account_bound: the family names whose blocks only their account reads.
    :ivar account: the tag of the request's account.
    :ivar prefix: ``"error"``, ``"drop_block"``, ``"allow"`` (checked, kept,
        reported) or ``"off"`` (not checked).
    :ivar beta: the request carries :data:`BINDING_BETA`.
    :ivar legacy_secret: the secret of year-old signatures, if any.
    """

    secret: str
    reader: str
    reads: frozenset
    family_of: Callable[[str], str]
    account_bound: frozenset
    account: str
    prefix: str
    beta: bool
    legacy_secret: str | None = None


@dataclass
class Bound:
    """
    The outcome of :func:`bind`.

    :ivar body: the request without the dropped blocks (what the model reads).
    :ivar transformations: the ``input_transformations`` entries.
    :ivar previous: the tag of the last thinking block the model read.
    :ivar count: how many thinking blocks it read.
    """

    body: dict
    transformations: list
    previous: str
    count: int


def _legacy(binding: Binding, text: Any, signature: Any) -> Signed | None:
    if binding.legacy_secret is None or not isinstance(text, str) or not isinstance(signature, str):
        return None
    digest = hmac.new(binding.legacy_secret.encode("utf-8"), text.encode("utf-8"), hashlib.sha256).digest()
    if not hmac.compare_digest(signature, base64.b64encode(digest).decode("ascii")):
        return None
    return Signed(None, "", "", 0, signature[:32], "")


def bind(body: dict, binding: Binding) -> Bound:
    """
    Check every thinking block of ``body`` against its signature, account,
    model and prefix, in that order of precedence; drop what fails where
    the API drops it.

    :raises Rejection: a block signed by no one (``Invalid `signature```), or
        a changed prefix when ``binding.prefix`` is ``"error"``.
    """
    dropped: dict[tuple[int, int], str] = {}
    transformations: list[dict] = []
    # Every block whose signature verified, dropped or not, in order: the
    # client sends the dropped ones again, and the next answer names the last.
    chain: list[str] = []
    run_dropped: list = [None]  # the message whose consecutive run is being dropped

    def at_block(n: int, m: int, block: dict, prefix: str) -> None:
        path = f"messages.{n}.content.{m}"
        field = "signature" if block["type"] == "thinking" else "data"
        text = block.get("thinking") if block["type"] == "thinking" else ""
        signature = block.get(field)
        signed = read_signature(binding.secret, signature, text) or _legacy(binding, text, signature)
        if signed is None:
            raise invalid(f"{path}: Invalid `{field}` in `{block['type']}` block")
        chain_holds = not chain or (chain[-1] == signed.previous and len(chain) <= signed.count)
        chain.append(signed.tag)
        if run_dropped[0] == (n, m - 1):
            dropped[(n, m)] = "prefix_binding_mismatch"
            run_dropped[0] = (n, m)
            return
        family = binding.family_of(signed.model) if signed.model is not None else "legacy"
        if family in binding.account_bound and signed.account != binding.account:
            dropped[(n, m)] = "organization_binding_mismatch"
            return
        if family not in binding.reads:
            dropped[(n, m)] = "model_binding_mismatch"
            return
        if binding.prefix != "off":
            expected = _mac(binding.secret, "prefix", signed.block_mac, prefix)[:32]
            # A block from before binding (a year-old model's) carries no prefix to mismatch.
            same = signed.model is None or (chain_holds and hmac.compare_digest(expected, signed.prefix_mac))
            if not same:
                if binding.prefix == "error":
                    raise invalid(prefix_mismatch_message(n, m, binding.beta))
                if binding.prefix == "drop_block":
                    dropped[(n, m)] = "prefix_binding_mismatch"
                    run_dropped[0] = (n, m)
                    return
                transformations.append({"type": "thinking_mismatch_allowed", "path": path,
                                        "reason": "prefix_binding_mismatch"})

    _walk(body, at_block)
    for (n, m), reason in sorted(dropped.items()):
        transformations.append({"type": "thinking_dropped", "path": f"messages.{n}.content.{m}", "reason": reason})
    transformations.sort(key=lambda entry: tuple(int(part) for part in entry["path"].split(".")[1::2]))
    return Bound(_without(body, dropped), transformations, chain[-1] if chain else "", len(chain))


def _without(body: dict, dropped: dict) -> dict:
    if not dropped:
        return body
    messages = []
    for n, message in enumerate(messages_of(body)):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any((n, m) in dropped for m in range(len(content))):
            message = dict(message, content=[block for m, block in enumerate(content) if (n, m) not in dropped])
        messages.append(message)
    return dict(body, messages=messages)
