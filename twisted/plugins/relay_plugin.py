"""The ``twistd relay`` plugin. Kept tiny: twistd imports every dropin."""

from twisted.application.service import ServiceMaker

Relay = ServiceMaker(
    "twisted-relay",
    "twisted_relay.tap",
    "Relay the Anthropic Messages API, keeping tool-use ids unique.",
    "relay",
)
