# -*- test-case-name: tests.test_errors -*-
"""
Anthropic-shaped errors that the relay raises on its own account.

Errors that come from the upstream are never built here: they are passed to
the client exactly as the upstream sent them.
"""

from __future__ import annotations

from twisted_relay._json import to_json

__all__ = [
    "CAPABILITY_REJECTED",
    "ERROR_TYPES",
    "RETRYABLE_STATUSES",
    "RelayError",
    "capability_rejected",
    "error_body",
    "sse_error_event",
]

#: HTTP status -> Anthropic ``error.type``.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

#: The statuses of the relay's own errors that a retry of the same request
#: can cure (the upstream or the relay is busy, slow or unreachable): their
#: answers say ``x-should-retry: true``, every other one ``false``.
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504, 529})

#: Kinds of error whose status would say "retry" but where the same request
#: meets the same failure: a certificate that does not verify.
_NEVER_RETRIED_KINDS = frozenset({"tls"})

#: The ``error.details.error_code`` Anthropic gives for the same failure,
#: by status, where the relay's own error of that status is always it.
_ERROR_CODES = {408: "request_body_timeout"}

#: The message prefix of an error about a capability the upstreams lack
#: (Claude Code's gateway protocol): ``capability_rejected: <class>``.
CAPABILITY_REJECTED = "capability_rejected"


def error_body(
    error_type: str, message: str, request_id: str | None = None, error_code: str | None = None
) -> bytes:
    """
    Serialise an Anthropic error object.

    :param error_type: the ``error.type``, e.g. ``invalid_request_error``.
    :param message: a sentence that says what happened.
    :param request_id: the relay request id, echoed as ``request_id``.
    :param error_code: the ``error.details.error_code``, when the API gives one.
    """
    error = {"type": error_type, "message": message}
    if error_code is not None:
        error["details"] = {"error_code": error_code}
    body = {"type": "error", "error": error}
    if request_id is not None:
        body["request_id"] = request_id
    return to_json(body)


def sse_error_event(error_type: str, message: str) -> bytes:
    """
    Serialise an SSE ``error`` event, for failures after a stream has started.
    """
    data = to_json({"type": "error", "error": {"type": error_type, "message": message}})
    return b"event: error\ndata: " + data + b"\n\n"


class RelayError(Exception):
    """
    A failure that the relay reports to its client as an Anthropic error.

    :ivar status: the HTTP status to answer with.
    :ivar error_type: the Anthropic ``error.type``.
    :ivar message: the human-readable message.
    :ivar kind: a short word for metrics and retries (``connect``,
        ``dropped``, ``timeout``, ...), or ``None``.
    :ivar error_code: the ``error.details.error_code`` some API errors
        carry (message threads), or ``None``.
    :ivar should_retry: whether a retry of the same request can help: the
        answer's ``x-should-retry`` (by status, :data:`RETRYABLE_STATUSES`,
        unless given).
    """

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str | None = None,
        kind: str | None = None,
        error_code: str | None = None,
        should_retry: bool | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type or ERROR_TYPES.get(status, "api_error")
        self.kind = kind
        self.error_code = error_code if error_code is not None else _ERROR_CODES.get(status)
        if should_retry is None:
            should_retry = status in RETRYABLE_STATUSES and kind not in _NEVER_RETRIED_KINDS
        self.should_retry = should_retry

    def retry_header(self) -> bytes:
        """The value of the answer's ``x-should-retry`` header."""
        return b"true" if self.should_retry else b"false"

    def body(self, request_id: str | None = None) -> bytes:
        """The JSON error body for this failure."""
        return error_body(self.error_type, self.message, request_id, self.error_code)

    def sse_event(self) -> bytes:
        """The SSE ``error`` event for this failure, once a stream has begun."""
        return sse_error_event(self.error_type, self.message)


def capability_rejected(capability: str) -> RelayError:
    """
    The relay's refusal of a request for a capability that no upstream it
    may use offers: 400 ``invalid_request_error`` whose message is exactly
    ``capability_rejected: <capability>`` (Claude Code's gateway protocol,
    which reads the class from it), so that a client can send the request
    again without it; not worth a retry as it is.

    :param capability: the class, e.g. ``image_block``, ``thinking_type:enabled``.
    """
    return RelayError(400, "%s: %s" % (CAPABILITY_REJECTED, capability), kind="capability", should_retry=False)
