"""
The upstreams' wires: how a request is sent to each kind of upstream and its
answer read back as Anthropic's (``docs/clouds.md``). ``base`` <-
``eventstream`` <- one module per wire.
"""

from twisted_relay.wires.base import BodyForm, Outgoing, Refusal, Wire

__all__ = ["WIRES", "BodyForm", "Outgoing", "Refusal", "Wire", "wire_for"]

#: The wires an upstream may name.
WIRES = ("anthropic", "bedrock", "vertex", "openai-responses", "openai-chat")


def wire_for(upstream, clock=None) -> Wire:
    """The :class:`Wire` of ``upstream`` (its ``wire`` setting)."""
    if upstream.wire == "bedrock":
        from twisted_relay.wires.bedrock import BedrockWire

        return BedrockWire(upstream, clock)
    if upstream.wire == "vertex":
        from twisted_relay.wires.vertex import VertexWire

        return VertexWire(upstream, clock)
    if upstream.wire == "openai-responses":
        from twisted_relay.wires.openai_responses import OpenAIResponsesWire

        return OpenAIResponsesWire(upstream, clock)
    if upstream.wire == "openai-chat":
        from twisted_relay.wires.openai_chat import OpenAIChatWire

        return OpenAIChatWire(upstream, clock)
    if upstream.wire != "anthropic":
        raise ValueError("unknown wire %r (known: %s)" % (upstream.wire, ", ".join(WIRES)))
    return Wire(upstream, clock)
