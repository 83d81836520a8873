# -*- test-case-name: tests.test_wires -*-
"""
The ``bedrock`` wire: Claude on Amazon Bedrock's InvokeModel API (what
Claude Code's Bedrock mode speaks, and the models up to Opus 4.6).

Out: ``POST /model/{modelId}/invoke`` (or ``/invoke-with-response-stream``,
``/count-tokens``), the model id in the path (an ARN's ``/`` as ``%2F``),
the body without ``model``, ``stream`` and ``service_tier`` and with
``anthropic_version`` (the platform's, never the client's header), the
client's ``anthropic-beta`` header moved into the body's
``anthropic_beta``, the service tier in ``X-Amzn-Bedrock-Service-Tier``.

Back: a stream is AWS's event stream (:mod:`twisted_relay.wires.eventstream`
turns it into Anthropic's events, handed to the gate whole); an error's
``x-amzn-ErrorType`` and message become Anthropic's envelope and the status
that makes clients behave; CountTokens' ``{"inputTokens": N}`` becomes
``{"input_tokens": N}``.
"""

from __future__ import annotations

from functools import lru_cache
from urllib.parse import quote

import ujson
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH

from twisted_relay.wires.base import (
    BodyForm,
    Outgoing,
    Refusal,
    WholeBodyMapped,
    Wire,
    anthropic_error,
    betas_of,
    forwarded,
)
from twisted_relay.wires.eventstream import EventStreamToSSE, bedrock_error

__all__ = ["BEDROCK_VERSION", "BedrockWire", "error_type_of"]

#: The ``anthropic_version`` Bedrock's InvokeModel takes for every Claude model.
BEDROCK_VERSION = "bedrock-2023-05-31"

EVENT_STREAM = b"application/vnd.amazon.eventstream"

# The credentials are no longer good: fetched again, the request sent once more.
_EXPIRED = frozenset({"ExpiredTokenException", "InvalidSignatureException", "ExpiredToken"})
# Refusals of the relay's own credentials: the client gets a 502 (the next
# target is tried) naming the kind only. Their messages may hold the
# request's canonical form (the session token among its headers), the
# relay's account and role: never the client's to read.
_CREDENTIALS_REFUSED = _EXPIRED | {"AccessDeniedException", "UnrecognizedClientException",
                                   "MissingAuthenticationTokenException", "IncompleteSignatureException"}

# Client headers that go to Bedrock: the rest are Anthropic's (moved into the
# body, or meaningless there) or the client's own.
_FORWARDED = (b"user-agent",)


def error_type_of(headers: Headers) -> str | None:
    """The error's type from ``x-amzn-ErrorType`` (``ThrottlingException:http://...`` cut at the colon)."""
    values = headers.getRawHeaders(b"x-amzn-errortype")
    if not values:
        return None
    return values[0].decode("latin-1").split(":", 1)[0].strip() or None


class BedrockWire(Wire):
    """
    Bedrock's InvokeModel wire for one upstream.

    :param upstream: the :class:`~twisted_relay.config.Upstream`; its
        ``service_tier`` goes in ``X-Amzn-Bedrock-Service-Tier``, its
        ``anthropic_version`` (when set) replaces :data:`BEDROCK_VERSION`.
    """

    name = "bedrock"
    reads_errors = True
    lists_models = False
    # The recovery's beta would go in a header, which Bedrock ignores.
    recovers_bindings = False

    def outgoing(self, kind: str, path: str, headers: Headers, model: str | None, stream: bool, **attempt) -> Outgoing:
        upstream = self.upstream
        version = upstream.anthropic_version or BEDROCK_VERSION
        sent = forwarded(headers, _FORWARDED)
        sent.setRawHeaders(b"content-type", [b"application/json"])
        if upstream.service_tier:
            sent.setRawHeaders(b"x-amzn-bedrock-service-tier", [upstream.service_tier.encode("ascii")])
        model_path = _model_path(model or "")
        betas = betas_of(headers)
        add: list[tuple[str, object]] = [("anthropic_version", version)]
        if betas:
            add.append(("anthropic_beta", betas))
        if kind == "count_tokens":
            sent.setRawHeaders(b"accept", [b"application/json"])
            # CountTokens counts an InvokeModel body, which needs max_tokens.
            form = BodyForm(drop=("model", "stream", "service_tier"), add=tuple(add),
                            defaults=(("max_tokens", 1),), envelope="bedrock-count")
            return Outgoing(model_path + "count-tokens", sent, form)
        form = BodyForm(drop=("model", "stream", "service_tier"), add=tuple(add))
        if stream:
            sent.setRawHeaders(b"accept", [EVENT_STREAM])
            sent.setRawHeaders(b"x-amzn-bedrock-accept", [b"application/json"])
            return Outgoing(model_path + "invoke-with-response-stream", sent, form)
        sent.setRawHeaders(b"accept", [b"application/json"])
        return Outgoing(model_path + "invoke", sent, form)

    def answered(self, kind: str, stream: bool, response, context: tuple = ()):
        if kind == "count_tokens":
            return WholeBodyMapped(response, self.counted)
        content_type = (response.headers.getRawHeaders(b"content-type") or [b""])[0]
        if stream and content_type.startswith(EVENT_STREAM):
            return EventStreamAnswer(response)
        return response

    def refusal(self, kind: str, status: int, headers: Headers, body: bytes, model: str | None) -> Refusal:
        kind_of_error = error_type_of(headers)
        message = _message_of(body) or "Bedrock answered %d with no message." % (status,)
        request_id = (headers.getRawHeaders(b"x-amzn-requestid") or [b""])[0].decode("latin-1") or None
        if kind_of_error in _CREDENTIALS_REFUSED:
            return Refusal(
                502,
                anthropic_error(
                    "api_error", "Bedrock refused the relay's AWS credentials (%s)." % (kind_of_error,), request_id
                ),
                expired=kind_of_error in _EXPIRED,
            )
        mapped_status, error_type, text = bedrock_error(kind_of_error or "", message, status=status)
        return Refusal(mapped_status, anthropic_error(error_type, text, request_id))

    def counted(self, body: bytes) -> bytes:
        """CountTokens' answer as Anthropic's ``count_tokens`` gives it."""
        # An answer that is not CountTokens' is a broken one (WholeBodyMapped: a 502).
        return ujson.dumps({"input_tokens": int(ujson.loads(body)["inputTokens"])}).encode("ascii")


@lru_cache(maxsize=256)
def _model_path(model: str) -> str:
    """``/model/{modelId}/``, the id encoded (an ARN's ``/`` as ``%2F``); kept for the models asked for last."""
    return "/model/%s/" % (quote(model, safe=":"),)


def _message_of(body: bytes) -> str | None:
    """The ``message`` (or ``Message``) of a Bedrock error body."""
    try:
        parsed = ujson.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace").strip()
        return text[:1000] or None
    if isinstance(parsed, dict):
        for name in ("message", "Message"):
            if isinstance(parsed.get(name), str):
                return parsed[name]
    return None


class EventStreamAnswer:
    """
    Bedrock's streamed answer as the relay reads it: Anthropic's events, its
    frames decoded on the way (:class:`~twisted_relay.wires.eventstream.EventStreamToSSE`;
    the gate is handed them whole, any other protocol their SSE bytes).
    Everything but the body's form and its content type is the response's own.
    """

    def __init__(self, response):
        self.original = response
        self.code = response.code
        self.phrase = getattr(response, "phrase", b"OK")
        self.length = UNKNOWN_LENGTH
        headers = response.headers.copy()
        headers.removeHeader(b"x-amzn-bedrock-content-type")
        headers.setRawHeaders(b"content-type", [b"text/event-stream; charset=utf-8"])
        self.headers = headers

    def __getattr__(self, name):
        return getattr(self.original, name)

    def deliverBody(self, protocol) -> None:
        self.original.deliverBody(EventStreamToSSE(protocol))
