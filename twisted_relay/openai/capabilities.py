# -*- test-case-name: tests.test_openai_requests -*-
"""
What a request asks for that an OpenAI-protocol upstream cannot carry
(issue 33, item 8): the translation refuses it rather than drop it, and the
relay answers Anthropic's 400 whose message is ``capability_rejected:
<class>`` (:func:`twisted_relay.errors.capability_rejected`), so that
Claude Code sends the request again without it.

The classes Claude Code itself knows (its gateway protocol; it reads them
from the message) are used where one fits: :data:`IMAGE_BLOCK`,
:data:`DOCUMENT_BLOCK`, :data:`STRUCTURED_OUTPUTS`. The others name what was
refused in the same ``name`` or ``name:value`` form: :data:`STOP_SEQUENCES`,
and :func:`tool_type` for a tool the upstream has no counterpart of.
"""

from __future__ import annotations

__all__ = [
    "DOCUMENT_BLOCK",
    "IMAGE_BLOCK",
    "STOP_SEQUENCES",
    "STRUCTURED_OUTPUTS",
    "CapabilityRejected",
    "tool_type",
]

#: An image (in a message or a ``tool_result``) to an upstream without vision.
IMAGE_BLOCK = "image_block"
#: A PDF (a ``document`` block with a base64 or URL source) to a Chat Completions upstream.
DOCUMENT_BLOCK = "document_block"
#: ``output_config.format`` (a JSON schema) to an upstream that takes none.
STRUCTURED_OUTPUTS = "structured_outputs_unsupported"
#: ``stop_sequences`` to an upstream without stop sequences (Responses has no ``stop``).
STOP_SEQUENCES = "stop_sequences"


def tool_type(name: str) -> str:
    """The class of a tool of type ``name`` the upstream lacks: ``tool_type:web_fetch_20250910``."""
    return "tool_type:%s" % (name,)


class CapabilityRejected(Exception):
    """
    The request asks for something this upstream cannot carry.

    :ivar capability: the class (``image_block``, ``tool_type:web_fetch_20250910``):
        the relay's 400 says ``capability_rejected: <capability>``.
    :ivar message: a sentence for people: what, and why this upstream cannot
        take it (for the log and the dump).
    """

    def __init__(self, capability: str, message: str = "") -> None:
        super().__init__(capability, message or capability)
        self.capability = capability
        self.message = message or capability

    def __str__(self) -> str:
        return "%s: %s" % (self.capability, self.message)
