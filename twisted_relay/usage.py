"""
One relayed request's usage, as the ledger keeps it.

:class:`UsageRecord` is what metering makes of an answer (the tokens the
upstream reported, their cost, who asked) and what the ledger writes, one
row a request. It is plain data: no Twisted, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

__all__ = ["TOKEN_KINDS", "UsageRecord", "storable_text"]

#: The counted kinds of usage, in the ledger's column order: tokens, then
#: server tool requests. Cache writes are split by lifetime as the API reports
#: them (a write the upstream does not split counts as a 5-minute write).
TOKEN_KINDS = (
    "input_tokens",
    "output_tokens",
    "cache_creation_5m_tokens",
    "cache_creation_1h_tokens",
    "cache_read_tokens",
    "web_search_requests",
    "web_fetch_requests",
)


def storable_text(text: str | None) -> str | None:
    """
    ``text`` as every database, metric label and log line takes it: a NUL
    or a lone surrogate (which a client or an upstream may send, and which
    PostgreSQL refuses in text) written as a backslash escape.
    """
    if text is None or ("\x00" not in text and text.isascii()):
        return text
    text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


@dataclass(slots=True)
class UsageRecord:
    """
    What one relayed request used. Not to be changed once made (not frozen:
    a frozen dataclass takes three times as long to make, once an answer).

    :ivar at: when the request arrived (Unix time, seconds).
    :ivar request_id: the relay's id for it (``x-relay-request-id``).
    :ivar key_name: the name of the relay key that made it (``None`` when the
        relay takes requests without a key). Never the key itself.
    :ivar key_group: that key's group (a team), if it has one.
    :ivar session_id: Claude Code's ``x-claude-code-session-id``, if sent.
    :ivar agent_id: Claude Code's ``x-claude-code-agent-id``, if sent.
    :ivar parent_agent_id: Claude Code's ``x-claude-code-parent-agent-id``.
    :ivar upstream: the name of the upstream that answered.
    :ivar model: the model that served the answer (as the answer names it;
        the requested one when the answer names none).
    :ivar status: the HTTP status the client got.
    :ivar stream: the answer was streamed.
    :ivar partial: the answer ended early (the client left, the upstream cut
        the stream, an error event): metered with what was reported by then.
    :ivar tokens: a count for every kind in :data:`TOKEN_KINDS`, by name.
    :ivar cost: the cost in US dollars by the price table, or ``None`` when
        the model has no price (metered in tokens only, and flagged so).
    :ivar usage: the ``usage`` object as the upstream last reported it, JSON
        text (every field, the ones not counted above included), or ``""``.
    :ivar platform: where the upstream served it: ``anthropic``,
        ``bedrock:global``, ``bedrock:us-east-1``, ``vertex:us``...
        (:func:`~twisted_relay.platforms.platform_of`).
    """

    at: float
    request_id: str
    key_name: str | None
    key_group: str | None
    session_id: str | None
    agent_id: str | None
    parent_agent_id: str | None
    upstream: str
    model: str
    status: int
    stream: bool
    partial: bool
    tokens: dict[str, int]
    cost: Decimal | None
    usage: str = ""
    platform: str = "anthropic"

    @property
    def priced(self) -> bool:
        """Whether the price table knew the model."""
        return self.cost is not None
