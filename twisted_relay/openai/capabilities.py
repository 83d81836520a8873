"""What a translation cannot carry to an upstream, refused rather than dropped (issue 33, item 8)."""

from __future__ import annotations

__all__ = ["CapabilityRejected"]


class CapabilityRejected(Exception):
    """
    The request asks for what the upstream cannot take (a server tool it
    lacks, ``stop_sequences`` on Responses, a PDF on a Chat upstream, an
    image to a model without vision): the client gets Anthropic's 400
    ``capability_rejected: <capability>`` (Claude Code's gateway protocol),
    so that it sends the request again without it.

    :ivar capability: the class, as Claude Code names it (``image_block``...).
    :ivar message: what was refused, in words, for logs.
    """

    def __init__(self, capability: str, message: str = ""):
        super().__init__(message or capability)
        self.capability = capability
        self.message = message or capability
