# -*- test-case-name: tests.test_simulated_openai_chat -*-
"""
The dialects of the simulated Chat Completions upstream: what each one
refuses, in its own words and error envelope.  Pure: no Twisted.

One protocol, contradictory rules (docs/simulated.md, "The simulated Chat
Completions upstream"):

- ``openai``: GPT on ``/v1/chat/completions``; tool call ids of at most 40
  characters; today's reasoning models take no function tools with
  reasoning on, nor ``max_tokens``, nor a ``temperature`` other than 1.
- ``deepseek``, ``kimi``: ``reasoning_content`` out, and required back on
  every assistant message with ``tool_calls``; DeepSeek takes no images.
- ``gemini``: a ``thought_signature`` on the first tool call of each step,
  required back (its own, for this account) on the steps after the last user
  message; function parameters in its ``Schema`` (a subset of OpenAPI 3.0:
  a JSON Schema keyword it lacks, ``additionalProperties`` or
  ``exclusiveMinimum``, is refused).
- ``groq``: strict fields: an unknown one is refused, ``reasoning_content``
  and ``reasoning`` on messages too.
- ``mistral``: tool call ids of exactly 9 letters or digits, both ways.
- ``openrouter``: ``reasoning_details`` out, required back unmodified on the
  tool calls of the current turn (a Gemini model behind it).

Every dialect also pairs tool calls with tool messages as OpenAI does, in
OpenAI's words.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from twisted_relay._json import to_json

__all__ = [
    "DIALECTS",
    "GEMINI_CORRUPTED",
    "GEMINI_MISSING",
    "GEMINI_SCHEMA_FIELDS",
    "GEMINI_UNKNOWN_NAME",
    "GROQ_FIELDS",
    "SKIP_SIGNATURE",
    "ChatRefusal",
    "Dialect",
    "check_request",
    "error_body",
    "refusal",
    "stream_error",
    "thinking_on",
]


@dataclass(frozen=True)
class Dialect:
    """
    How one Chat Completions upstream behaves.

    :ivar name: one of :data:`DIALECTS`.
    :ivar reasoning: the reasoning it emits: ``"reasoning_content"``
        (DeepSeek, Kimi), ``"reasoning"`` (Groq with ``reasoning_format``
        ``parsed``), ``"details"`` (OpenRouter: ``reasoning`` and
        ``reasoning_details``), ``"signature"`` (Gemini: a thought signature
        only) or ``None``.
    :ivar required: which assistant tool-call messages must carry it back:
        ``"all"`` (every one in the history), ``"turn"`` (those after the last
        user message) or ``None``.
    :ivar bound: the reasoning is bound to the account (a signature).
    :ivar images: it takes ``image_url`` parts.
    :ivar whole_calls: it streams each tool call whole, in one delta.
    :ivar always_usage: it reports usage in every stream, asked or not.
    :ivar usage_on_finish: that usage rides on the chunk with the
        ``finish_reason`` (not a chunk of its own with no choices).
    :ivar writes_reported: its usage reports cache writes
        (``prompt_tokens_details.cache_write_tokens``).
    """

    name: str
    reasoning: str | None = None
    required: str | None = None
    bound: bool = False
    images: bool = True
    whole_calls: bool = False
    always_usage: bool = False
    usage_on_finish: bool = False
    writes_reported: bool = False


#: The dialects by name.
DIALECTS = {
    "openai": Dialect("openai", writes_reported=True),
    "deepseek": Dialect("deepseek", reasoning="reasoning_content", required="all", images=False),
    "kimi": Dialect("kimi", reasoning="reasoning_content", required="all"),
    "gemini": Dialect("gemini", reasoning="signature", required="turn", bound=True, whole_calls=True),
    "groq": Dialect("groq", reasoning="reasoning"),
    "mistral": Dialect("mistral", whole_calls=True, always_usage=True, usage_on_finish=True),
    "openrouter": Dialect("openrouter", reasoning="details", required="turn", bound=True, always_usage=True,
                          writes_reported=True),
}

#: The top-level fields Groq takes; any other is refused.  (Its API
#: reference, read for the simulator; ``store`` is refused, as reported.)
GROQ_FIELDS = frozenset({
    "citation_options", "compound_custom", "disable_tool_validation", "documents", "exclude_domains",
    "frequency_penalty", "function_call", "functions", "include_domains", "include_reasoning", "logit_bias",
    "logprobs", "max_completion_tokens", "max_tokens", "messages", "metadata", "model", "n",
    "parallel_tool_calls", "presence_penalty", "reasoning_effort", "reasoning_format", "response_format",
    "search_settings", "seed", "service_tier", "stop", "stream", "stream_options", "temperature",
    "tool_choice", "tools", "top_logprobs", "top_p", "user",
})
# The fields Groq takes on each role's messages (and on a tool call).
_GROQ_MESSAGE_FIELDS = {
    "system": frozenset({"role", "content", "name"}),
    "developer": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    "assistant": frozenset({"role", "content", "name", "tool_calls", "function_call"}),
    "tool": frozenset({"role", "content", "tool_call_id", "name"}),
}
_GROQ_CALL_FIELDS = frozenset({"id", "type", "function"})

_ROLES = ("system", "assistant", "user", "function", "tool", "developer")
_MISTRAL_ID = re.compile(r"[a-zA-Z0-9]{9}")
_GOOGLE_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                  429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}
#: Gemini's words for a function call of the current turn without its signature.
GEMINI_MISSING = (
    "Function call is missing a thought_signature in functionCall parts. This is required for tools to work "
    "correctly, and missing thought_signature may lead to degraded model performance. Additional data, "
    "function call `default_api:{name}` , position {position}. Please refer to "
    "https://ai.google.dev/gemini-api/docs/thought-signatures for more details."
)
GEMINI_CORRUPTED = "Corrupted thought signature."
#: The fields of Gemini's ``Schema`` (generativelanguage v1beta), which a
#: function's ``parameters`` become: any other is an unknown name.
GEMINI_SCHEMA_FIELDS = frozenset({
    "anyOf", "default", "description", "enum", "example", "format", "items", "maxItems", "maxLength",
    "maxProperties", "maximum", "minItems", "minLength", "minProperties", "minimum", "nullable", "pattern",
    "properties", "propertyOrdering", "required", "title", "type",
})
#: Gemini's words for each of them (one line each, in one message).
GEMINI_UNKNOWN_NAME = "Invalid JSON payload received. Unknown name \"{name}\" at '{where}': Cannot find field."
#: The signature Gemini documents for history another model made.
SKIP_SIGNATURE = "skip_thought_signature_validator"


class ChatRefusal(Exception):
    """
    A request a dialect refuses: its HTTP status and body.

    :ivar status: the HTTP status.
    :ivar body: the JSON body, in the dialect's envelope.
    :ivar message: the error's sentence (for logs and tests).
    """

    def __init__(self, status: int, body: bytes, message: str):
        super().__init__(message)
        self.status = status
        self.body = body
        self.message = message


def error_body(dialect: str, status: int, message: str, error_type: str = "invalid_request_error", *,
               param: str | None = None, code: Any = None, metadata: dict | None = None) -> bytes:
    """
    An error in ``dialect``'s envelope: OpenAI's ``{"error": {message, type,
    param, code}}`` (DeepSeek: ``code`` repeats the type; Kimi and Groq:
    message and type only), Gemini's ``google.rpc`` status in a one-element
    array, Mistral's flat ``{"object": "error", ...}``, OpenRouter's
    ``{"error": {message, code: <status>, metadata}}``.
    """
    if dialect == "gemini":
        return to_json([{"error": {"code": status, "message": message,
                                   "status": _GOOGLE_STATUS.get(status, "UNKNOWN")}}])
    if dialect == "mistral":
        return to_json({"object": "error", "message": message, "type": error_type, "param": param, "code": code})
    if dialect == "openrouter":
        error: dict = {"message": message, "code": status}
        if metadata is not None:
            error["metadata"] = metadata
        return to_json({"error": error})
    if dialect in ("kimi", "groq"):
        return to_json({"error": {"message": message, "type": error_type}})
    if dialect == "deepseek":
        code = error_type if code is None else code
    return to_json({"error": {"message": message, "type": error_type, "param": param, "code": code}})


def refusal(dialect: str, message: str, status: int = 400, error_type: str = "invalid_request_error",
            **fields: Any) -> ChatRefusal:
    """A :class:`ChatRefusal` with :func:`error_body`."""
    return ChatRefusal(status, error_body(dialect, status, message, error_type, **fields), message)


def stream_error(dialect: str) -> dict:
    """The chunk a stream that fails midway ends with (the SDK raises it
    as an ``APIError``): OpenRouter's chunk with ``finish_reason: "error"``,
    Gemini's status, everyone else's OpenAI-shaped ``server_error``."""
    if dialect == "openrouter":
        return {"error": {"code": 502, "message": "Provider returned error"},
                "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}]}
    if dialect == "gemini":
        return {"error": {"code": 503, "message": "The model is overloaded. Please try again later.",
                          "status": "UNAVAILABLE"}}
    return {"error": {"message": "The server had an error while processing your request. Sorry about that!",
                      "type": "server_error", "param": None, "code": None}}


# -- the request's shape --------------------------------------------------------


def thinking_on(dialect: Dialect, body: dict) -> bool:
    """The answer carries reasoning: DeepSeek and Kimi think unless
    ``thinking.type`` is ``disabled``; Groq shows its reasoning with
    ``reasoning_format`` ``parsed`` (a ``reasoning`` field) or ``raw``
    (``<think>`` in the content); Gemini and OpenRouter always."""
    if dialect.reasoning == "reasoning_content":
        thinking = body.get("thinking")
        return not (isinstance(thinking, dict) and thinking.get("type") == "disabled")
    if dialect.reasoning == "reasoning":
        return body.get("reasoning_format") in ("parsed", "raw") and body.get("include_reasoning") is not False
    return dialect.reasoning is not None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _invalid_type(dialect: str, where: str, expected: str, value: Any) -> ChatRefusal:
    return refusal(dialect, f"Invalid type for '{where}': expected {expected}, but got {_kind(value)} instead.",
                   param=where, code="invalid_type")


def _missing(dialect: str, where: str) -> ChatRefusal:
    return refusal(dialect, f"Missing required parameter: '{where}'.", param=where, code="missing_required_parameter")


def _check_parts(dialect: str, where: str, content: Any, nullable: bool) -> None:
    if isinstance(content, str) or (content is None and nullable):
        return
    if not isinstance(content, list):
        raise _invalid_type(dialect, where, "one of a string or array of objects", content)
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise _invalid_type(dialect, at, "an object", part)
        if not isinstance(part.get("type"), str):
            raise _missing(dialect, f"{at}.type")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise _invalid_type(dialect, f"{at}.text", "a string", part.get("text"))
        if part["type"] == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else None
            if not isinstance(url, str):
                raise _invalid_type(dialect, f"{at}.image_url.url", "a string", url)


def _check_calls(dialect: str, where: str, calls: Any) -> None:
    if calls is None:
        return
    if not isinstance(calls, list):
        raise _invalid_type(dialect, where, "an array", calls)
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise _invalid_type(dialect, at, "an object", call)
        function = call.get("function")
        if not isinstance(function, dict):
            raise _missing(dialect, f"{at}.function") if function is None else _invalid_type(
                dialect, f"{at}.function", "an object", function)
        for name in ("name", "arguments"):
            if not isinstance(function.get(name), str):
                raise _invalid_type(dialect, f"{at}.function.{name}", "a string", function.get(name))
        if "id" in call and not isinstance(call["id"], str):
            raise _invalid_type(dialect, f"{at}.id", "a string", call["id"])


def _check_message(dialect: str, i: int, message: Any) -> None:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _invalid_type(dialect, where, "an object", message)
    role = message.get("role")
    if role not in _ROLES:
        raise refusal(dialect, f"Invalid value: '{role}'. Supported values are: 'system', 'assistant', 'user', "
                      "'function', 'tool', and 'developer'.", param=f"{where}.role", code="invalid_value")
    if role != "assistant" and "content" not in message:
        raise _missing(dialect, f"{where}.content")
    _check_parts(dialect, f"{where}.content", message.get("content"), nullable=role == "assistant")
    if role == "assistant":
        _check_calls(dialect, f"{where}.tool_calls", message.get("tool_calls"))
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise _missing(dialect, f"{where}.tool_call_id")


def _check_shape(dialect: str, body: Any) -> list:
    if not isinstance(body, dict):
        raise refusal(dialect, "We could not parse the JSON body of your request. (HINT: This likely means you "
                      "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, but what "
                      "was sent was not valid JSON.")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise refusal(dialect, "you must provide a model parameter")
    messages = body.get("messages")
    if messages is None:
        raise _missing(dialect, "messages")
    if not isinstance(messages, list):
        raise _invalid_type(dialect, "messages", "an array", messages)
    if not messages:
        raise refusal(dialect, "Invalid 'messages': empty array. Expected an array with minimum length 1, but got "
                      "an empty array instead.", param="messages", code="empty_array")
    for i, message in enumerate(messages):
        _check_message(dialect, i, message)
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        raise _invalid_type(dialect, "tools", "an array of objects", tools)
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise _invalid_type(dialect, name, "an integer", value)
    temperature = body.get("temperature")
    if temperature is not None and (not isinstance(temperature, (int, float)) or isinstance(temperature, bool)):
        raise _invalid_type(dialect, "temperature", "a decimal", temperature)
    return messages


def _check_pairs(dialect: str, messages: list) -> None:
    """Tool messages answer the tool calls just before them, all of them
    (OpenAI's rule and words)."""
    open_calls: list[str] = []
    opened: list[str] = []
    opened_at = -1
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "tool":
            if opened_at < 0:
                raise refusal(dialect, "Invalid parameter: messages with role 'tool' must be a response to a "
                              "preceeding message with 'tool_calls'.", param=f"messages.[{i}].role")
            call_id = message.get("tool_call_id")
            if call_id not in opened:
                raise refusal(dialect, f"Invalid parameter: 'tool_call_id' of '{call_id}' not found in "
                              "'tool_calls' of previous message.", param=f"messages.[{i}].tool_call_id")
            if call_id in open_calls:
                open_calls.remove(call_id)
            continue
        if open_calls:
            break
        opened_at = -1
        calls = message.get("tool_calls") if role == "assistant" else None
        if isinstance(calls, list) and calls:
            opened = [call.get("id") for call in calls if isinstance(call, dict)]
            open_calls = list(opened)
            opened_at = i
    if open_calls:
        raise refusal(dialect, "An assistant message with 'tool_calls' must be followed by tool messages responding "
                      "to each 'tool_call_id'. The following tool_call_ids did not have response messages: "
                      + ", ".join(str(call_id) for call_id in open_calls), param=f"messages.[{opened_at}].role")


def _check_openai(body: dict, messages: list) -> None:
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls") or () if message["role"] == "assistant" else ()):
            call_id = call.get("id")
            if isinstance(call_id, str) and len(call_id) > 40:
                where = f"messages[{i}].tool_calls[{j}].id"
                raise refusal("openai", f"Invalid '{where}': string too long. Expected a string with maximum "
                              f"length 40, but got a string with length {len(call_id)} instead.", param=where,
                              code="string_above_max_length")
    model = body["model"]
    reasoning_model = model.startswith(("gpt-5", "gpt-6", "o3", "o4"))
    if not reasoning_model:
        return
    effort = body.get("reasoning_effort")
    reasons = effort not in (None, "none") or (effort is None and model.startswith(("gpt-5.6", "gpt-6")))
    if "max_tokens" in body:
        raise refusal("openai", "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                      "'max_completion_tokens' instead.", param="max_tokens", code="unsupported_parameter")
    temperature = body.get("temperature")
    if reasons and temperature is not None and temperature != 1:
        raise refusal("openai", f"Unsupported value: 'temperature' does not support {temperature} with this model. "
                      "Only the default (1) value is supported.", param="temperature", code="unsupported_value")
    tools = body.get("tools")
    has_functions = isinstance(tools, list) and any(
        isinstance(tool, dict) and tool.get("type") == "function" for tool in tools)
    if reasons and has_functions and model.startswith(("gpt-5.2", "gpt-5.4", "gpt-5.5", "gpt-5.6", "gpt-6")):
        raise refusal("openai", f"Function tools with reasoning_effort are not supported for {model} in "
                      "/v1/chat/completions. To use function tools, use /v1/responses or set reasoning_effort "
                      "to 'none'.", param="reasoning_effort")


def _groq_unsupported(where: str, role: str, name: str) -> ChatRefusal:
    return refusal("groq", f"'{where}' : for 'role:{role}' the following must be satisfied"
                   f"[('{where}' : property '{name}' is unsupported)]")


def _check_groq(body: dict, messages: list) -> None:
    for name in body:
        if name not in GROQ_FIELDS:
            raise refusal("groq", f"property '{name}' is unsupported")
    for i, message in enumerate(messages):
        role = message["role"]
        for name in message:
            if name not in _GROQ_MESSAGE_FIELDS.get(role, ()):
                raise _groq_unsupported(f"messages.{i}", role, name)
        for j, call in enumerate(message.get("tool_calls") or () if role == "assistant" else ()):
            for name in call if isinstance(call, dict) else ():
                if name not in _GROQ_CALL_FIELDS:
                    raise _groq_unsupported(f"messages.{i}.tool_calls.{j}", role, name)


def _check_mistral(messages: list) -> None:
    for message in messages:
        if message["role"] == "assistant":
            ids = [call.get("id") for call in message.get("tool_calls") or () if isinstance(call, dict)]
        elif message["role"] == "tool":
            ids = [message.get("tool_call_id")]
        else:
            continue
        for call_id in ids:
            if not isinstance(call_id, str) or _MISTRAL_ID.fullmatch(call_id) is None:
                raise refusal("mistral", f"Tool call id was {call_id} but must be a-z, A-Z, 0-9, with a length "
                              "of 9.", error_type="invalid_function_call", code="3280")


def _unknown_names(schema: Any, where: str) -> list[str]:
    """Gemini's line for every name in ``schema`` (and the schemas in it) its ``Schema`` lacks."""
    if not isinstance(schema, dict):
        return []
    lines = [GEMINI_UNKNOWN_NAME.format(name=name, where=where) for name in schema
             if name not in GEMINI_SCHEMA_FIELDS]
    properties = schema.get("properties")
    for n, value in enumerate(properties.values() if isinstance(properties, dict) else ()):
        lines.extend(_unknown_names(value, f"{where}.properties[{n}].value"))
    lines.extend(_unknown_names(schema.get("items"), f"{where}.items"))
    for n, value in enumerate(schema.get("anyOf") if isinstance(schema.get("anyOf"), list) else ()):
        lines.extend(_unknown_names(value, f"{where}.any_of[{n}]"))
    return lines


def _check_gemini(body: dict) -> None:
    """Function parameters become Gemini's ``Schema``: a name it lacks is a 400 (every one, one line each)."""
    lines: list[str] = []
    for n, tool in enumerate(body.get("tools") or ()):
        function = tool.get("function")
        if isinstance(function, dict):
            lines.extend(_unknown_names(function.get("parameters"), f"tools[0].function_declarations[{n}].parameters"))
    if lines:
        raise refusal("gemini", "\n".join(lines))


def _image_column(raw: bytes) -> tuple[int, int]:
    """Where (line, column) a strict deserializer stops at the first image part of ``raw``."""
    found = re.search(rb'"type"\s*:\s*"image_url"', raw)
    if found is None:
        return 1, 1
    before = raw[: found.end()]
    line = before.count(b"\n") + 1
    return line, len(before) - (before.rfind(b"\n") + 1)


def _check_images(messages: list, raw: bytes) -> None:
    for i, message in enumerate(messages):
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "image_url":
                line, column = _image_column(raw)
                raise refusal("deepseek", f"Failed to deserialize the JSON body into the target type: messages[{i}]: "
                              f"unknown variant `image_url`, expected `text` at line {line} column {column}")


def check_request(dialect: Dialect, body: Any, raw: bytes) -> list:
    """
    Refuse what ``dialect`` refuses before the model reads the request, but
    its reasoning rules (:mod:`~twisted_relay.simulated.openai_chat_reasoning`).

    :param raw: the body as received (DeepSeek's deserializer names a line
        and column in it).
    :return: the messages.
    :raises ChatRefusal: in the dialect's words.
    """
    name = dialect.name
    messages = _check_shape(name, body)
    if "stream_options" in body and body.get("stream") is not True and name == "openai":
        raise refusal(name, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                      param="stream_options")
    if name == "groq":
        _check_groq(body, messages)
    elif name == "openai":
        _check_openai(body, messages)
    elif name == "mistral":
        _check_mistral(messages)
    elif name == "gemini":
        _check_gemini(body)
    if not dialect.images:
        _check_images(messages, raw)
    _check_pairs(name, messages)
    return messages
