"""
What a translation to or from an OpenAI protocol needs to know of its
attempt: plain values, so that a body worker process gets them whole.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["TranslateContext"]


class TranslateContext(NamedTuple):
    """
    One attempt's translation.

    :ivar upstream: the upstream's name: its reasoning's envelopes name it
        (:mod:`twisted_relay.openai.envelope`).
    :ivar account: the account of the key the attempt is sent with
        (:func:`~twisted_relay.openai.envelope.account_of`).
    :ivar model: the model sent upstream (after the route's rename and the
        upstream's model map).
    :ivar dialect: the upstream's Chat Completions dialect
        (:mod:`twisted_relay.openai.dialects`); ``openai`` for Responses.
    :ivar session: Claude Code's session id (``x-claude-code-session-id``),
        if sent: the conversation's ``prompt_cache_key``.
    :ivar requested_model: the model the client asked for: the answer names it.
    """

    upstream: str
    account: str
    model: str
    dialect: str = "openai"
    session: str | None = None
    requested_model: str | None = None
