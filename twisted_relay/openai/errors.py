# -*- test-case-name: tests.test_openai_answers -*-
"""
An OpenAI-protocol upstream's errors as Anthropic's, with the status a
client behaves on.

OpenAI answers ``{"error": {"message", "type", "param", "code"}}``; the
compatible upstreams mostly do too (Gemini's endpoint wraps it in a list,
some send ``{"error": "text"}``, ``{"message": ...}``, ``{"detail": ...}``
or plain text). The same error objects come inside a stream (a Responses
``response.failed`` or ``error`` event, a Chat chunk with ``error``).

The rules (:func:`anthropic_error_of`, :func:`failure_of`):

- a prompt past the model's context (``context_length_exceeded``, or the
  words of OpenAI, vLLM, Gemini and others for it) is 400
  ``invalid_request_error`` in Anthropic's words, ``prompt is too long: N
  tokens > M maximum`` when the numbers can be read, then the upstream's
  words: Claude Code compacts on it;
- 401, 402, 403 and ``insufficient_quota`` are about the relay's own key or
  account, never the client's: 502 ``api_error`` (a client must not think
  its own key was refused);
- 429 is ``rate_limit_error``; 503 or an overloaded upstream 529
  ``overloaded_error``; 504 ``timeout_error``; other 5xx 500 ``api_error``;
- 404 ``not_found_error``, 413 ``request_too_large``, other 4xx 400
  ``invalid_request_error``, the upstream's words kept.

Anything shaped like a key is taken out of the words first.
Pure: no Twisted, no I/O.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from twisted_relay.redact import REDACTED

__all__ = [
    "PROMPT_TOO_LONG",
    "AnthropicError",
    "UpstreamFailed",
    "anthropic_error_of",
    "failure_of",
]

#: Anthropic's words for a prompt past the model's context (Claude Code compacts on them).
PROMPT_TOO_LONG = "prompt is too long"

# The longest upstream message kept.
_MAX_WORDS = 2000

_TOO_LONG_CODES = frozenset({"context_length_exceeded", "model_max_prompt_tokens_exceeded", "string_above_max_length"})
_TOO_LONG_WORDS = re.compile(
    r"context[ _]length|context window|maximum context|too many (?:input )?tokens|prompt is too long"
    r"|input is too long|exceeds the maximum number of tokens|input token count.*exceeds|prompt token count",
    re.IGNORECASE,
)
# The limit and the prompt's size in the upstreams' words.
_LIMIT = re.compile(
    r"(?:maximum context length is|context length \(|context window of|maximum number of tokens allowed \(|"
    r"exceeds the limit of|limit of|max(?:imum)? context window of)\s*([0-9][0-9,]*)",
    re.IGNORECASE,
)
_SIZE = re.compile(
    r"(?:resulted in|you requested|input \(|token count \(|token count of|input of|prompt has|prompt too long:)\s*"
    r"([0-9][0-9,]*)",
    re.IGNORECASE,
)
_CREDENTIAL_CODES = frozenset({
    "invalid_api_key", "insufficient_quota", "account_deactivated", "billing_hard_limit_reached",
    "unsupported_country_region_territory", "permission_denied", "invalid_organization",
})
_OVERLOADED = re.compile(r"overload|slow down|capacity|temporarily unavailable|unavailable", re.IGNORECASE)
_OVERLOADED_CODES = frozenset({"server_overloaded", "engine_overloaded", "overloaded", "slow_down", "server_is_overloaded"})
_RATE_CODES = frozenset({"rate_limit_exceeded", "rate_limit_error", "tokens_per_minute", "requests_per_minute"})
_SERVER_CODES = frozenset({"server_error", "internal_error", "api_error", "vector_store_timeout"})
# Key-shaped text: OpenAI's (even masked), Gemini's, Groq's, xAI's, OpenRouter's, Anthropic's.
_KEY_SHAPED = re.compile(
    r"\b(?:sk|pk|rk|sess)-[A-Za-z0-9_*.\-]{6,}|\bAIza[0-9A-Za-z_\-]{20,}|\bgsk_[A-Za-z0-9]{20,}"
    r"|\bxai-[A-Za-z0-9]{20,}"
)


class AnthropicError(NamedTuple):
    """An upstream's error as Anthropic would have answered it: the HTTP ``status``, ``error.type``, ``message``."""

    status: int
    error_type: str
    message: str


class UpstreamFailed(Exception):
    """
    A whole (non-streamed) answer that reports a failure (a response whose
    status is ``failed`` or ``cancelled``, a completion holding ``error``):
    the wire answers with :attr:`error` instead of a message.
    """

    def __init__(self, error: AnthropicError):
        super().__init__(error.message)
        self.error = error


def _words(text: str) -> str:
    """An upstream's words as a client may read them: no key-shaped text, bounded."""
    text = _KEY_SHAPED.sub(REDACTED, text.strip())
    return text if len(text) <= _MAX_WORDS else text[:_MAX_WORDS] + "..."


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def _too_long(message: str) -> str:
    """``message`` in Anthropic's words for a prompt past the context."""
    if message.lower().startswith(PROMPT_TOO_LONG):
        return message
    limit, size = _LIMIT.search(message), _SIZE.search(message)
    if limit and size and _number(size.group(1)) > _number(limit.group(1)):
        return "%s: %d tokens > %d maximum (%s)" % (
            PROMPT_TOO_LONG, _number(size.group(1)), _number(limit.group(1)), message)
    return "%s: %s" % (PROMPT_TOO_LONG, message)


def _classify(status: int | None, code: str, kind: str, message: str) -> AnthropicError:
    """The mapping of the module's rules; ``status`` ``None`` for an error reported inside a stream."""
    code, kind = code.lower(), kind.lower()
    if status is None and code.isdigit():  # OpenRouter's errors carry the HTTP status as their code
        status = int(code)
    if code in _TOO_LONG_CODES or (status in (None, 400, 413, 422) and _TOO_LONG_WORDS.search(message)):
        return AnthropicError(400, "invalid_request_error", _too_long(message))
    if status in (401, 402, 403) or code in _CREDENTIAL_CODES or kind in ("authentication_error", "insufficient_quota"):
        return AnthropicError(
            502, "api_error", "The upstream refused the relay's credentials or account (%s): %s"
            % (status if status is not None else code or kind, message))
    if status == 429 or code in _RATE_CODES or kind in _RATE_CODES:
        return AnthropicError(429, "rate_limit_error", message)
    if status in (503, 529) or code in _OVERLOADED_CODES or (
            (status is None or status >= 500) and _OVERLOADED.search(message)):
        return AnthropicError(529, "overloaded_error", message)
    if status in (408, 504) or code in ("timeout", "request_timeout"):
        return AnthropicError(504, "timeout_error", message)
    if status is None:
        if code in _SERVER_CODES or not (code or kind) or kind in ("server_error", "api_error"):
            return AnthropicError(500, "api_error", message)
        return AnthropicError(400, "invalid_request_error", message)
    if status >= 500:
        return AnthropicError(500, "api_error", message)
    if status == 404:
        return AnthropicError(404, "not_found_error", message)
    if status == 413:
        return AnthropicError(413, "request_too_large", message)
    if 400 <= status < 500:
        return AnthropicError(400, "invalid_request_error", message)
    return AnthropicError(502, "api_error", message)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ("" if value is None else str(value))


def _error_object(parsed: Any) -> dict | None:
    """The error object of a parsed body, in any of the forms above (``None``: none)."""
    if isinstance(parsed, list) and parsed:
        parsed = parsed[0]
    if not isinstance(parsed, dict):
        return None
    error = parsed.get("error", parsed)
    if isinstance(error, str):
        return {"message": error}
    if not isinstance(error, dict):
        return None
    if "message" not in error and isinstance(parsed.get("detail"), str):
        return {"message": parsed["detail"]}
    return error


def failure_of(error: Any, default: str, status: int | None = None) -> AnthropicError:
    """
    An error object (``{"message", "type", "code", "param"}``, or a
    Responses ``response.error``) as Anthropic's error.

    :param default: the message when the object has none.
    :param status: the HTTP status it came with; ``None`` inside a stream.
    """
    error = error if isinstance(error, dict) else {}
    message = _words(_text(error.get("message"))) or default
    return _classify(status, _text(error.get("code")), _text(error.get("type")), message)


def anthropic_error_of(status: int, body: bytes) -> AnthropicError:
    """An OpenAI-protocol upstream's error answer (``status``, its ``body`` read whole) as Anthropic's."""
    default = "The upstream answered %d with no message." % (status,)
    try:
        parsed = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace")
        return _classify(status, "", "", _words(text) or default)
    error = _error_object(parsed)
    if error is None:
        return _classify(status, "", "", default)
    return failure_of(error, default, status)
