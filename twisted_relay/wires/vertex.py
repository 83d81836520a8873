# -*- test-case-name: tests.test_wires -*-
"""
The ``vertex`` wire: Claude on Google Vertex AI (Agent Platform).

Out: ``POST /v1/projects/{project}/locations/{location}/publishers/anthropic/models/{model}:rawPredict``
(``:streamRawPredict`` for a stream), the body without ``model`` and with
``anthropic_version`` (``stream`` stays: Vertex reads it); the client's
``anthropic-beta`` header passes, less the betas this upstream refused by
name for that model a moment ago. ``count_tokens`` goes to
``.../models/count-tokens:rawPredict`` with the model kept in the body and
no beta at all (Vertex refuses every beta there, its own SDK's included).

Back: Anthropic's SSE and JSON, as they are; errors in Anthropic's envelope
pass, Google's ``google.rpc`` errors (an object, or an array of them) become
Anthropic's envelope with the status that makes clients behave. A 400
``Unexpected value(s) `X` for the `anthropic-beta` header`` is learnt: the
request goes once more without those betas, and they are left out for that
model for :data:`UNWANTED_FOR` seconds.
"""

from __future__ import annotations

import re
from urllib.parse import quote

import ujson
from twisted.web.http_headers import Headers

from twisted_relay.wires.base import BodyForm, Outgoing, Refusal, Wire, anthropic_error, betas_of

__all__ = ["UNWANTED_FOR", "VERTEX_VERSION", "VertexWire"]

#: The ``anthropic_version`` Vertex takes.
VERTEX_VERSION = "vertex-2023-10-16"
#: Seconds a beta refused by name is left out for its model.
UNWANTED_FOR = 3600.0

_UNEXPECTED = re.compile(r"Unexpected value\(s\) (.+?) for the `anthropic-beta` header")
_QUOTED = re.compile(r"`([^`]+)`")

# google.rpc status -> (HTTP status, Anthropic error type) the client gets.
_RPC = {
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (529, "overloaded_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "INTERNAL": (500, "api_error"),
}
_BY_STATUS = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED", 404: "NOT_FOUND",
              403: "PERMISSION_DENIED", 400: "INVALID_ARGUMENT", 500: "INTERNAL"}


class VertexWire(Wire):
    """
    Vertex's rawPredict wire for one upstream.

    :param upstream: the :class:`~twisted_relay.config.Upstream`: its
        ``project`` and ``region`` (the location) make the path.
    """

    name = "vertex"
    reads_errors = True
    lists_models = False

    def __init__(self, upstream, clock=None):
        super().__init__(upstream, clock)
        # model -> beta -> until when it is left out
        self._unwanted: dict[str, dict[str, float]] = {}

    def _models_path(self) -> str:
        upstream = self.upstream
        return "/v1/projects/%s/locations/%s/publishers/anthropic/models/" % (
            quote(upstream.project or "", safe=""), quote(upstream.region or "global", safe=""))

    def outgoing(self, kind: str, path: str, headers: Headers, model: str | None, stream: bool, **attempt) -> Outgoing:
        version = self.upstream.anthropic_version or VERTEX_VERSION
        sent = headers.copy()
        sent.removeHeader(b"anthropic-version")
        if kind == "count_tokens":
            sent.removeHeader(b"anthropic-beta")
            form = BodyForm(add=(("anthropic_version", version),) + ((("model", model),) if model else ()))
            return Outgoing(self._models_path() + "count-tokens:rawPredict", sent, form)
        betas = betas_of(headers)
        unwanted = self._unwanted_now(model)
        if unwanted and betas:
            kept = [beta for beta in betas if beta not in unwanted]
            if kept:
                sent.setRawHeaders(b"anthropic-beta", [",".join(kept).encode("latin-1")])
            else:
                sent.removeHeader(b"anthropic-beta")
        method = ":streamRawPredict" if stream else ":rawPredict"
        form = BodyForm(drop=("model",), add=(("anthropic_version", version),))
        return Outgoing(self._models_path() + quote(model or "", safe="@") + method, sent, form)

    def _unwanted_now(self, model: str | None) -> frozenset[str]:
        by_beta = self._unwanted.get(model or "")
        if not by_beta:
            return frozenset()
        now = self._now()
        for beta in [beta for beta, until in by_beta.items() if until <= now]:
            del by_beta[beta]
        return frozenset(by_beta)

    def _now(self) -> float:
        if self._clock is None:
            import time

            return time.time()
        return self._clock.seconds()

    def refusal(self, kind: str, status: int, headers: Headers, body: bytes, model: str | None) -> Refusal:
        parsed = _parsed(body)
        if isinstance(parsed, dict) and parsed.get("type") == "error":
            # Anthropic's envelope already: the model's own refusal.
            message = _anthropic_message(parsed)
            found = _UNEXPECTED.search(message or "") if status == 400 and kind != "count_tokens" else None
            if found is not None:
                betas = tuple(_QUOTED.findall(found.group(1)))
                if betas:
                    until = self._now() + UNWANTED_FOR
                    learnt = self._unwanted.setdefault(model or "", {})
                    for beta in betas:
                        learnt[beta] = until
                    return Refusal(status, body, unwanted_betas=betas)
            return Refusal(status, body)
        rpc = parsed[0] if isinstance(parsed, list) and parsed else parsed
        error = rpc.get("error") if isinstance(rpc, dict) else None
        if not isinstance(error, dict):
            text = body.decode("utf-8", "replace").strip()[:1000] or "Vertex answered %d with no message." % (status,)
            error = {"message": text, "status": _BY_STATUS.get(status, "")}
        message = str(error.get("message") or "Vertex answered %d." % (status,))
        if status == 401 or error.get("status") == "UNAUTHENTICATED":
            return Refusal(
                502,
                anthropic_error("api_error", "Vertex refused the relay's Google credentials: %s" % (message,)),
                expired=True,
            )
        mapped_status, error_type = _RPC.get(str(error.get("status") or ""), (None, None))
        if mapped_status is None:
            mapped_status = status if status >= 400 else 502
            error_type = "api_error" if mapped_status >= 500 else "invalid_request_error"
        return Refusal(mapped_status, anthropic_error(error_type, message))


def _parsed(body: bytes):
    try:
        return ujson.loads(body)
    except ValueError:
        return None


def _anthropic_message(parsed: dict) -> str:
    error = parsed.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return ""
