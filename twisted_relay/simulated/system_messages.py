# -*- test-case-name: tests.test_simulated_system_messages -*-
"""
Mid-conversation ``role: "system"`` messages, as today's API takes them.

Today's models take a ``{"role": "system"}`` message anywhere in
``messages`` (no beta needed for text).  Its content is text,
``tool_addition`` or ``tool_removal`` blocks; the tool changes need the
``mid-conversation-tool-changes-2026-07-01`` beta (a tool by reference) or
``inline-tools-2026-09-15`` (which also allows a ``tool_definition`` by
value).  A system message is part of the thinking prefix by value like any
other message (see :mod:`twisted_relay.simulated.thinking`).

Which tools the fake model may call follows from the same messages: the
request's ``tools`` minus its ``defer_loading`` ones, plus a deferred tool
once a message loads or uses it (a ``tool_reference``, a ``tool_use``), plus
each ``tool_addition`` and minus each ``tool_removal``, in message order.
Pure: no Twisted.
"""

from __future__ import annotations

from typing import Any

from twisted_relay.simulated.base import blocks_of, messages_of, invalid

__all__ = [
    "INLINE_TOOLS_BETA",
    "SYSTEM_BLOCK_TYPES",
    "TOOL_CHANGES_BETA",
    "callable_tools",
    "check_system_messages",
    "names_loaded",
    "prompt_tools",
]

#: The beta value for ``tool_addition``/``tool_removal`` by reference.
TOOL_CHANGES_BETA = "mid-conversation-tool-changes-2026-07-01"
#: The beta value that also allows a ``tool_definition`` by value.
INLINE_TOOLS_BETA = "inline-tools-2026-09-15"
#: The block types a system message may carry.
SYSTEM_BLOCK_TYPES = ("text", "tool_addition", "tool_removal")
_CLEAR_AT = ("next_user_message", "never")


def check_system_messages(body: dict, betas: set[str]) -> None:
    """
    Refuse a ``role: "system"`` message today's API would refuse: a block
    type it does not take, a tool change without its beta, a bad
    ``clear_at``.

    :raises Rejection: a 400 ``invalid_request_error``.
    """
    for n, message in enumerate(messages_of(body)):
        if message.get("role") != "system":
            continue
        if "clear_at" in message and message["clear_at"] not in (*_CLEAR_AT, None):
            raise invalid(f"messages.{n}.clear_at: Input should be 'next_user_message' or 'never'")
        for m, block in enumerate(blocks_of(message)):
            _check_system_block(f"messages.{n}.content.{m}", block, betas)


def _check_system_block(path: str, block: dict, betas: set[str]) -> None:
    kind = block.get("type")
    if kind not in SYSTEM_BLOCK_TYPES:
        expected = ", ".join(f"'{name}'" for name in SYSTEM_BLOCK_TYPES)
        raise invalid(f"{path}: Input tag '{kind}' found using 'type' does not match any of the expected tags: "
                      f"{expected}")
    if kind == "text":
        return
    if TOOL_CHANGES_BETA not in betas and INLINE_TOOLS_BETA not in betas:
        raise invalid(f"{path}: `{kind}` blocks require the `{TOOL_CHANGES_BETA}` value in the "
                      "`anthropic-beta` header.")
    tool = block.get("tool")
    if isinstance(tool, dict) and tool.get("type") == "tool_definition" and INLINE_TOOLS_BETA not in betas:
        raise invalid(f"{path}.tool: a `tool_definition` requires the `{INLINE_TOOLS_BETA}` value in the "
                      "`anthropic-beta` header.")


def _is_custom(tool: Any) -> bool:
    return isinstance(tool, dict) and isinstance(tool.get("name"), str) and tool.get("type", "custom") == "custom"


def names_loaded(value: Any) -> list[str]:
    """Tools a block loads or calls: ``tool_use`` and ``tool_reference``
    names wherever they sit (a tool search result's content included)."""
    if isinstance(value, list):
        return [name for item in value for name in names_loaded(item)]
    if not isinstance(value, dict):
        return []
    names = [value["name"]] if value.get("type") in ("tool_use", "tool_reference") and isinstance(
        value.get("name"), str) else []
    for key, item in value.items():
        if key != "input" and isinstance(item, (dict, list)):
            names.extend(names_loaded(item))
    return names


def prompt_tools(body: dict) -> Any:
    """``tools`` as the model reads them: a ``defer_loading`` tool only once a
    message uses or loads it (tool search keeps the rest out of the prompt,
    and out of the input tokens)."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not any(isinstance(tool, dict) and tool.get("defer_loading") is True
                                              for tool in tools):
        return tools
    loaded = {name for message in messages_of(body) for block in blocks_of(message) for name in names_loaded(block)}
    return [tool for tool in tools
            if not (isinstance(tool, dict) and tool.get("defer_loading") is True and tool.get("name") not in loaded)]


def callable_tools(body: dict) -> list[dict]:
    """The custom tools the model may call at the end of ``body``'s messages."""
    declared = [tool for tool in body.get("tools") or [] if _is_custom(tool)] if isinstance(
        body.get("tools"), list) else []
    by_name = {tool["name"]: tool for tool in declared}
    offered = {tool["name"]: tool for tool in declared if tool.get("defer_loading") is not True}
    for message in messages_of(body):
        for block in blocks_of(message):
            if message.get("role") == "system" and block.get("type") in ("tool_addition", "tool_removal"):
                _apply_change(block, by_name, offered)
                continue
            for name in names_loaded(block):
                if name in by_name:
                    offered.setdefault(name, by_name[name])
    return list(offered.values())


def _apply_change(block: dict, by_name: dict, offered: dict) -> None:
    tool = block.get("tool") if isinstance(block.get("tool"), dict) else {}
    if tool.get("type") == "tool_definition":
        definition = tool.get("definition")
        if _is_custom(definition):
            by_name[definition["name"]] = definition
            offered[definition["name"]] = definition
        return
    name = tool.get("name")
    if block["type"] == "tool_removal":
        offered.pop(name, None)
    elif name in by_name:
        offered[name] = by_name[name]
