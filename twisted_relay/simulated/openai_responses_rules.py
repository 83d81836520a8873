# -*- test-case-name: tests.test_simulated_openai_responses -*-
"""
What the simulated OpenAI Responses API refuses in a request, in OpenAI's
words, and the request as the fake model reads it.

- :func:`read_settings`: the top-level parameters: unknown ones (``stop``,
  Anthropic's leftovers) refused by name, ``temperature``/``top_p`` refused
  by a reasoning model unless ``reasoning.effort`` is ``none``, each model's
  efforts (:data:`GPT_MODELS`), function tools as ``strict`` (the default)
  wants them.
- :func:`check_item`, :func:`check_calls`: the input items' shapes
  (``call_id`` at most 64 characters, ``summary`` on a reasoning item) and
  the pairing of function calls with their outputs.
- :func:`model_view`: the input as a Messages request for the fake model,
  ``call_id`` s as ids it takes (:func:`to_model_id`, :func:`to_call_id`),
  the whole prompt marked for the prompt cache (OpenAI caches prefixes by
  itself).

The simulator's own converters: never the relay's ``openai`` translators.
Pure: no Twisted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import ujson

__all__ = [
    "COUNT_PARAMETERS",
    "CREATE_PARAMETERS",
    "EFFORTS",
    "GPT_MODELS",
    "INCLUDABLE",
    "GptModel",
    "OpenAIError",
    "Settings",
    "check_calls",
    "check_item",
    "input_items",
    "model_view",
    "read_settings",
    "to_call_id",
    "to_model_id",
]

#: Every ``reasoning.effort`` value of the API (December 2026).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

#: The parameters of ``POST /v1/responses``.
CREATE_PARAMETERS = frozenset({
    "access_programs", "background", "background_options", "context_management", "conversation", "image",
    "include", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model", "moderation",
    "parallel_tool_calls", "previous_response_id", "prompt", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "store", "stream",
    "stream_options", "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "user",
})
#: The parameters of ``POST /v1/responses/input_tokens``.
COUNT_PARAMETERS = frozenset({
    "conversation", "input", "instructions", "model", "parallel_tool_calls", "personality",
    "previous_response_id", "reasoning", "text", "tool_choice", "tools", "truncation",
})
#: Parameters the API has and the simulator does not simulate: refused.
_NOT_SIMULATED = ("access_programs", "background_options", "conversation", "image", "moderation", "prompt")

#: The ``include`` values the API takes.
INCLUDABLE = (
    "code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
    "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content",
    "web_search_call.action.sources",
)
_TOOL_TYPES = (
    "function", "custom", "web_search", "web_search_preview", "file_search", "code_interpreter",
    "image_generation", "mcp", "shell", "apply_patch", "local_shell", "computer_use_preview",
)
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "item_reference")
_ROLES = ("user", "assistant", "system", "developer")
_INPUT_PARTS = ("input_text", "input_image", "input_file")
_OUTPUT_PARTS = ("output_text", "refusal")
_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")
_DATED = re.compile(r"^(.*)-\d{4}-\d{2}-\d{2}$")
_NATIVE_CALL = re.compile(r"^call_(?!x)[A-Za-z0-9_-]+$")
_MAX_ID = 64


class OpenAIError(Exception):
    """
    A request the simulated API refuses, as OpenAI answers: ``{"error":
    {"message", "type", "param", "code"}}``.
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


def _listed(values: tuple[str, ...]) -> str:
    quoted = [f"'{value}'" for value in values]
    if len(quoted) < 3:
        return " and ".join(quoted)
    return ", ".join(quoted[:-1]) + ", and " + quoted[-1]


def _invalid_value(param: str, value: Any, supported: tuple[str, ...]) -> OpenAIError:
    return OpenAIError(400, f"Invalid value: '{value}'. Supported values are: {_listed(supported)}.", param,
                       "invalid_value")


def _missing(param: str) -> OpenAIError:
    return OpenAIError(400, f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def _too_long(param: str, value: str, limit: int = _MAX_ID) -> OpenAIError:
    return OpenAIError(400, f"Invalid '{param}': string too long. Expected a string with maximum length {limit}, "
                       f"but got a string with length {len(value)} instead.", param, "string_above_max_length")


_TYPE_NAMES = {bool: "a boolean", int: "an integer", str: "a string", list: "an array", dict: "an object",
               float: "a number"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number" if isinstance(value, float) else "an integer"
    return _TYPE_NAMES.get(type(value), "an object")


def _expect(param: str, value: Any, kind: type, nullable: bool = True) -> None:
    """Refuse ``value`` unless it is a ``kind`` (``float``: any number), or ``None`` when ``nullable``."""
    if value is None and nullable:
        return
    if kind in (int, float):
        ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise OpenAIError(400, f"Invalid type for '{param}': expected {_TYPE_NAMES[kind]}, but got "
                          f"{_json_type(value)} instead.", param, "invalid_type")


# -- models ---------------------------------------------------------------------


@dataclass(frozen=True)
class GptModel:
    """
    What one GPT model takes.

    :ivar efforts: the ``reasoning.effort`` values it takes (empty: not a
        reasoning model; ``reasoning`` is refused, ``temperature`` taken).
    :ivar default_effort: its effort when the request names none.
    :ivar summaries: it writes reasoning summaries (else ``reasoning.summary``
        is refused).
    :ivar foreign_reasoning: what it does with reasoning another
        organisation made: ``"refuse"`` (400 ``invalid_encrypted_content``)
        or ``"withhold"`` (leaves it out and says so in
        ``input_transformations``, as newer models do).
    """

    efforts: tuple[str, ...] = ()
    default_effort: str | None = None
    summaries: bool = True
    foreign_reasoning: str = "refuse"

    @property
    def reasons(self) -> bool:
        return bool(self.efforts)


_ALL = ("none", "low", "medium", "high", "xhigh", "max")
_NO_MAX = ("none", "low", "medium", "high", "xhigh")
_CODEX = ("low", "medium", "high", "xhigh")

#: The models the simulator serves (its choice, after the SDK's model list
#: and the trackers: 5.1 codex refuses ``none``, spark refuses summaries,
#: 5.5 has no ``max``).
GPT_MODELS: Mapping[str, GptModel] = {
    "gpt-5.6-sol": GptModel(_ALL, "medium", foreign_reasoning="withhold"),
    "gpt-5.6-terra": GptModel(_ALL, "medium", foreign_reasoning="withhold"),
    "gpt-5.6-luna": GptModel(_ALL, "medium", foreign_reasoning="withhold"),
    "gpt-5.5": GptModel(_NO_MAX, "medium"),
    "gpt-5.4": GptModel(_NO_MAX, "none"),
    "gpt-5.4-mini": GptModel(_NO_MAX, "none"),
    "gpt-5.3-codex": GptModel(_CODEX, "medium"),
    "gpt-5.3-codex-spark": GptModel(("low", "medium", "high"), "medium", summaries=False),
    "gpt-5.2": GptModel(_NO_MAX, "none"),
    "gpt-5.1-codex": GptModel(("low", "medium", "high"), "medium"),
    "gpt-5-mini": GptModel(("minimal", "low", "medium", "high"), "medium"),
    "gpt-4.1": GptModel(),
}


def _model_of(name: str, models: Mapping[str, GptModel]) -> GptModel | None:
    dated = _DATED.match(name)
    return models.get(name) or (models.get(dated.group(1)) if dated else None)


# -- the parameters ---------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """
    A request's parameters, checked.

    :ivar effort: the effort the answer reasons at (``None``: it does not
        reason: a model that does not, or ``none``).
    :ivar summary: the ``reasoning.summary`` asked for, if any.
    :ivar encrypted: ``include`` asks for ``reasoning.encrypted_content``.
    :ivar tools: the function tools, as sent.
    :ivar echo: what the response object repeats of the request as it came.
    """

    model: str
    spec: GptModel
    effort: str | None
    summary: str | None
    encrypted: bool
    store: bool
    stream: bool
    max_output_tokens: int | None
    parallel: bool
    tools: list
    tool_choice: Any
    instructions: str | None
    prompt_cache_key: str | None
    retention: str | None
    obfuscation: bool
    echo: dict


def read_settings(body: Any, models: Mapping[str, GptModel], *, counting: bool = False) -> Settings:
    """
    Check a request's top-level parameters.

    :param counting: the body is for ``/v1/responses/input_tokens`` (its
        own parameters; ``model`` may be left out).
    :raises OpenAIError: for the first fault.
    """
    if not isinstance(body, dict):
        raise OpenAIError(400, "We could not parse the JSON body of your request. (HINT: This likely means "
                          "you aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, "
                          "but what was sent was not valid JSON. If you have trouble figuring out how to fix "
                          "this, please contact us through our help center at help.openai.com.)")
    known = COUNT_PARAMETERS if counting else CREATE_PARAMETERS
    for name in body:
        if name not in known:
            raise OpenAIError(400, f"Unknown parameter: '{name}'.", name, "unknown_parameter")
    for name in _NOT_SIMULATED:
        if body.get(name) is not None:
            raise OpenAIError(400, f"The simulated Responses API does not simulate '{name}'.", name)
    if body.get("background"):
        raise OpenAIError(400, "The simulated Responses API does not simulate 'background'.", "background")
    name = body.get("model")
    if name is None and not counting:
        raise _missing("model")
    _expect("model", name, str)
    spec = _model_of(name, models) if name is not None else next(iter(models.values()))
    if spec is None:
        raise OpenAIError(400, f"The requested model '{name}' does not exist.", "model", "model_not_found")
    if "input" not in body and body.get("previous_response_id") is None:
        raise _missing("input")
    for field, kind in (("instructions", str), ("store", bool), ("stream", bool), ("parallel_tool_calls", bool),
                        ("max_output_tokens", int), ("include", list), ("tools", list), ("reasoning", dict),
                        ("previous_response_id", str), ("temperature", float), ("top_p", float),
                        ("metadata", dict)):
        _expect(field, body.get(field), kind)
    effort, summary = _reasoning(body.get("reasoning"), spec, str(name))
    for field, limit in (("temperature", 2), ("top_p", 1)):
        value = body.get(field)
        if value is None:
            continue
        if spec.reasons and effort is not None:
            raise OpenAIError(400, f"Unsupported parameter: '{field}' is not supported with this model.", field)
        if not 0 <= value <= limit:
            relation = "below minimum value. Expected a value >= 0" if value < 0 else \
                f"above maximum value. Expected a value <= {limit}"
            raise OpenAIError(400, f"Invalid '{field}': decimal {relation}, but got {value} instead.", field,
                              "decimal_below_min_value" if value < 0 else "decimal_above_max_value")
    limit = body.get("max_output_tokens")
    if limit is not None and limit < 16:
        raise OpenAIError(400, "Invalid 'max_output_tokens': integer below minimum value. Expected a value >= 16, "
                          f"but got {limit} instead.", "max_output_tokens", "integer_below_min_value")
    include = body.get("include") or []
    for index, value in enumerate(include):
        if value not in INCLUDABLE:
            raise _invalid_value(f"include[{index}]", value, INCLUDABLE)
    for field in ("prompt_cache_key", "safety_identifier", "user"):
        value = body.get(field)
        _expect(field, value, str)
        if isinstance(value, str) and len(value) > _MAX_ID:
            raise _too_long(field, value)
    retention = body.get("prompt_cache_retention")
    if retention is not None and retention not in ("in_memory", "24h"):
        raise _invalid_value("prompt_cache_retention", retention, ("in_memory", "24h"))
    _check_metadata(body.get("metadata"))
    options = body.get("stream_options")
    _expect("stream_options", options, dict)
    tools = _check_tools(body.get("tools") or [])
    _check_tool_choice(body.get("tool_choice"), tools)
    echo = {key: body.get(key) for key in ("metadata", "safety_identifier", "user", "text", "truncation",
                                           "top_logprobs", "max_tool_calls", "tools", "temperature", "top_p")}
    return Settings(
        model=str(name) if name is not None else "",
        spec=spec,
        effort=effort,
        summary=summary,
        encrypted="reasoning.encrypted_content" in include,
        store=body.get("store") is not False,
        stream=body.get("stream") is True,
        max_output_tokens=limit,
        parallel=body.get("parallel_tool_calls") is not False,
        tools=tools,
        tool_choice=body.get("tool_choice", "auto"),
        instructions=body.get("instructions"),
        prompt_cache_key=body.get("prompt_cache_key"),
        retention=retention,
        obfuscation=(options or {}).get("include_obfuscation") is not False,
        echo=echo,
    )


def _reasoning(reasoning: dict | None, spec: GptModel, name: str) -> tuple[str | None, str | None]:
    """The effort the answer reasons at (``None``: not at all) and the summary asked for."""
    reasoning = reasoning or {}
    for field in reasoning:
        if field not in ("effort", "summary", "generate_summary", "context", "mode"):
            raise OpenAIError(400, f"Unknown parameter: 'reasoning.{field}'.", f"reasoning.{field}",
                              "unknown_parameter")
    effort = reasoning.get("effort")
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if not spec.reasons:
        for field in ("effort", "summary"):
            if reasoning.get(field) is not None:
                raise OpenAIError(400, f"Unsupported parameter: 'reasoning.{field}' is not supported with this "
                                  "model.", f"reasoning.{field}", "unsupported_parameter")
        return None, None
    if effort is not None:
        if effort not in EFFORTS:
            raise _invalid_value("reasoning.effort", effort, EFFORTS)
        if effort not in spec.efforts:
            raise OpenAIError(400, f"Unsupported value: '{effort}' is not supported with the '{name}' model. "
                              f"Supported values are: {_listed(spec.efforts)}.", "reasoning.effort",
                              "unsupported_value")
    if summary is not None:
        if summary not in ("auto", "concise", "detailed"):
            raise _invalid_value("reasoning.summary", summary, ("auto", "concise", "detailed"))
        if not spec.summaries:
            raise OpenAIError(400, f"Unsupported parameter: 'reasoning.summary' is not supported with the "
                              f"'{name}' model.", "reasoning.summary", "unsupported_parameter")
    effort = effort or spec.default_effort
    return (None if effort == "none" else effort), summary


def _check_metadata(metadata: dict | None) -> None:
    if not metadata:
        return
    if len(metadata) > 16:
        raise OpenAIError(400, "Invalid 'metadata': too many properties. Expected an object with at most 16 "
                          f"properties, but got an object with {len(metadata)} properties instead.", "metadata",
                          "object_above_max_properties")
    for key, value in metadata.items():
        if len(key) > 64:
            raise _too_long("metadata", key)
        _expect(f"metadata.{key}", value, str, nullable=False)
        if len(value) > 512:
            raise _too_long(f"metadata.{key}", value, 512)


def _check_tools(tools: list) -> list:
    functions = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        _expect(where, tool, dict, nullable=False)
        kind = tool.get("type")
        if kind is None:
            raise _missing(f"{where}.type")
        if kind not in _TOOL_TYPES:
            raise _invalid_value(f"{where}.type", kind, _TOOL_TYPES)
        if kind != "function":
            continue
        name = tool.get("name")
        if name is None:
            raise _missing(f"{where}.name")
        _expect(f"{where}.name", name, str)
        if len(name) > _MAX_ID:
            raise _too_long(f"{where}.name", name)
        if not _NAME.match(name):
            raise OpenAIError(400, f"Invalid '{where}.name': string does not match pattern. Expected a string that "
                              "matches the pattern '^[a-zA-Z0-9_-]+$'.", f"{where}.name", "invalid_value")
        parameters = tool.get("parameters")
        _expect(f"{where}.parameters", parameters, dict)
        if tool.get("strict", True) is not False:
            _check_strict_schema(name, f"{where}.parameters", parameters or {})
        functions.append(tool)
    return functions


def _check_strict_schema(name: str, where: str, schema: dict) -> None:
    """What ``strict`` function tools demand of their schema (the top level)."""
    if schema.get("additionalProperties") is not False:
        raise OpenAIError(400, f"Invalid schema for function '{name}': In context=(), 'additionalProperties' is "
                          "required to be supplied and to be false.", where, "invalid_function_parameters")
    properties = schema.get("properties") or {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    missing = [key for key in properties if key not in required]
    if missing:
        raise OpenAIError(400, f"Invalid schema for function '{name}': In context=(), 'required' is required to be "
                          "supplied and to be an array including every key in properties. Missing "
                          f"'{missing[0]}'.", where, "invalid_function_parameters")


def _check_tool_choice(choice: Any, tools: list) -> None:
    if choice is None or isinstance(choice, str) and choice in ("auto", "none", "required"):
        return
    if isinstance(choice, str):
        raise _invalid_value("tool_choice", choice, ("none", "auto", "required"))
    _expect("tool_choice", choice, dict)
    if choice.get("type") == "function" and choice.get("name") not in {tool["name"] for tool in tools}:
        raise OpenAIError(400, f"Tool choice '{choice.get('name')}' not found in 'tools' parameter.", "tool_choice")


# -- the input --------------------------------------------------------------------


def input_items(body: dict) -> list:
    """The request's ``input`` as a list of items (a string is one user message)."""
    value = body.get("input")
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    _expect("input", value, list)
    return list(value)


def check_item(index: int, item: Any) -> None:
    """
    Check one input item's shape.

    :raises OpenAIError: for the first fault.
    """
    where = f"input[{index}]"
    _expect(where, item, dict, nullable=False)
    kind = item.get("type", "message")
    if kind not in _ITEM_TYPES:
        raise _invalid_value(f"{where}.type", kind, _ITEM_TYPES)
    if kind == "message":
        _check_message(where, item)
    elif kind in ("function_call", "function_call_output"):
        call_id = item.get("call_id")
        if call_id is None:
            raise _missing(f"{where}.call_id")
        _expect(f"{where}.call_id", call_id, str)
        if len(call_id) > _MAX_ID:
            raise _too_long(f"{where}.call_id", call_id)
        if kind == "function_call":
            for field in ("name", "arguments"):
                if item.get(field) is None:
                    raise _missing(f"{where}.{field}")
                _expect(f"{where}.{field}", item[field], str)
        elif "output" not in item:
            raise _missing(f"{where}.output")
        elif not isinstance(item["output"], str):
            _expect(f"{where}.output", item["output"], list)
            _check_parts(f"{where}.output", item["output"], _INPUT_PARTS)
    elif kind == "reasoning":
        if "summary" not in item:
            raise _missing(f"{where}.summary")
        _expect(f"{where}.summary", item["summary"], list, nullable=False)
        for number, part in enumerate(item["summary"]):
            if not isinstance(part, dict) or part.get("type") != "summary_text" or not isinstance(
                    part.get("text"), str):
                raise _invalid_value(f"{where}.summary[{number}].type", _type_of(part), ("summary_text",))
        _expect(f"{where}.encrypted_content", item.get("encrypted_content"), str)
    elif not isinstance(item.get("id"), str):
        raise _missing(f"{where}.id")


def _type_of(part: Any) -> Any:
    return part.get("type") if isinstance(part, dict) else part


def _check_message(where: str, item: dict) -> None:
    role = item.get("role")
    if role is None:
        raise _missing(f"{where}.role")
    if role not in _ROLES:
        raise _invalid_value(f"{where}.role", role, _ROLES)
    if "content" not in item:
        raise _missing(f"{where}.content")
    content = item["content"]
    if isinstance(content, str):
        return
    _expect(f"{where}.content", content, list, nullable=False)
    _check_parts(f"{where}.content", content, _OUTPUT_PARTS if role == "assistant" else _INPUT_PARTS)


def _check_parts(where: str, parts: list, allowed: tuple[str, ...]) -> None:
    for number, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in allowed:
            raise _invalid_value(f"{where}[{number}]", _type_of(part), allowed)
        kind = part["type"]
        field = {"input_image": "image_url", "input_file": "file_data", "refusal": "refusal"}.get(kind, "text")
        if kind == "input_image" and part.get("image_url") is None and part.get("file_id") is not None:
            continue
        if kind == "input_file" and (part.get("file_url") is not None or part.get("file_id") is not None):
            continue
        if not isinstance(part.get(field), str):
            raise _missing(f"{where}[{number}].{field}")


def check_calls(items: list[dict]) -> None:
    """
    Every function call answered by one output after it, every output
    answering a call before it, no ``call_id`` on two calls.

    :raises OpenAIError: for the first fault.
    """
    calls: dict[str, int] = {}
    answered: set[str] = set()
    for item in items:
        kind = item.get("type")
        call_id = item.get("call_id")
        if kind == "function_call":
            if call_id in calls:
                raise OpenAIError(400, f"Duplicate value for 'call_id': '{call_id}' is the call_id of more than "
                                  "one function_call item in 'input'.", "input")
            calls[call_id] = 1
        elif kind == "function_call_output":
            if call_id not in calls:
                raise OpenAIError(400, f"No tool call found for function call output with call_id {call_id}.",
                                  "input")
            if call_id in answered:
                raise OpenAIError(400, f"Duplicate function_call_output for call_id '{call_id}'. Each "
                                  "function_call must have exactly one matching function_call_output", "input")
            answered.add(call_id)
    for call_id in calls:
        if call_id not in answered:
            raise OpenAIError(400, f"No tool output found for function call {call_id}.", "input")


# -- the fake model's view ----------------------------------------------------------------


def to_model_id(call_id: Any) -> Any:
    """
    A ``call_id`` as an id the fake model takes (``toolu_...``), one to one:
    ``call_X`` is ``toolu_X``; any other id is ``toolu_x`` and its UTF-8 in
    hex (and so is ``call_x...``).
    """
    if not isinstance(call_id, str):
        return call_id
    if _NATIVE_CALL.match(call_id):
        return "toolu_" + call_id[5:]
    return "toolu_x" + call_id.encode("utf-8").hex()


def to_call_id(model_id: Any) -> Any:
    """The ``call_id`` of an id the fake model gave or copied (the inverse of :func:`to_model_id`)."""
    if not isinstance(model_id, str) or not model_id.startswith("toolu_"):
        return model_id
    rest = model_id[len("toolu_"):]
    if rest.startswith("x"):
        try:
            return bytes.fromhex(rest[1:]).decode("utf-8")
        except ValueError:
            pass
    return "call_" + rest


def _text_parts(content: Any) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    blocks = []
    for part in content or ():
        kind = part.get("type")
        if kind in ("input_text", "output_text"):
            blocks.append({"type": "text", "text": part["text"]})
        elif kind == "refusal":
            blocks.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            blocks.append(_image(part))
        elif kind == "input_file":
            blocks.append({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": str(
                part.get("file_data") or part.get("file_url") or part.get("file_id"))},
                "title": part.get("filename")})
    return blocks


def _image(part: dict) -> dict:
    url = part.get("image_url") or part.get("file_id") or ""
    if url.startswith("data:") and ";base64," in url:
        media_type, data = url[5:].split(";base64,", 1)
        return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _block_of(item: dict) -> tuple[str, list[dict]]:
    """The role an item speaks in and its blocks, for the fake model."""
    kind = item.get("type", "message")
    if kind == "function_call":
        try:
            arguments = ujson.loads(item["arguments"])
        except ValueError:
            arguments = {"arguments": item["arguments"]}
        return "assistant", [{"type": "tool_use", "id": to_model_id(item["call_id"]), "name": item["name"],
                              "input": arguments if isinstance(arguments, dict) else {"arguments": arguments}}]
    if kind == "function_call_output":
        output = item["output"]
        content = output if isinstance(output, str) else _text_parts(output)
        return "user", [{"type": "tool_result", "tool_use_id": to_model_id(item["call_id"]), "content": content}]
    if kind == "reasoning":
        text = "\n\n".join(part["text"] for part in item["summary"])
        return "assistant", [{"type": "thinking", "thinking": text,
                              "signature": item.get("encrypted_content") or item.get("id") or ""}]
    return ("assistant" if item["role"] == "assistant" else "user"), _text_parts(item["content"])


def model_view(items: list[dict], settings: Settings) -> dict:
    """
    The request as a Messages request for the fake model: ``instructions``
    and the system and developer messages as ``system``, the items as
    alternating messages (function calls as ``tool_use``, their outputs as
    ``tool_result``, reasoning as thinking), function tools as tools, the
    last block marked for the prompt cache.
    """
    system = [{"type": "text", "text": settings.instructions}] if settings.instructions else []
    messages: list[dict] = []
    for item in items:
        if item.get("type", "message") == "message" and item.get("role") in ("system", "developer"):
            system.extend(block for block in _text_parts(item["content"]) if block["type"] == "text")
            continue
        role, blocks = _block_of(item)
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].extend(blocks)
        else:
            messages.append({"role": role, "content": list(blocks)})
    if messages and messages[-1]["content"]:
        # One marker whatever the request's retention: the count of
        # /v1/responses/input_tokens (which has no retention) stays exact.
        messages[-1]["content"][-1] = dict(messages[-1]["content"][-1], cache_control={"type": "ephemeral"})
    view: dict = {
        "model": settings.model,
        "max_tokens": settings.max_output_tokens or 32_000,
        "messages": messages,
        "tools": [{"name": tool["name"], "description": tool.get("description") or "",
                   "input_schema": tool.get("parameters") or {"type": "object", "properties": {}}}
                  for tool in settings.tools],
    }
    if system:
        view["system"] = system
    choice = settings.tool_choice
    if choice == "none":
        view["tool_choice"] = {"type": "none"}
    elif choice == "required":
        view["tool_choice"] = {"type": "any"}
    elif isinstance(choice, dict) and choice.get("type") == "function":
        view["tool_choice"] = {"type": "tool", "name": choice["name"]}
    return view
