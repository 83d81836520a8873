"""
twisted-relay: a relay for the Anthropic Messages API, built on Twisted.

It keeps long tool-use sessions alive when an upstream model reuses tool-use
ids, streams answers through without buffering them, and writes a replayable
dump of every 4xx the upstream returns.
"""

from twisted_relay._version import __version__
from twisted_relay.config import RelayConfig


def __getattr__(name):
    # The service layer imports Twisted's web stack; load it only when asked,
    # so the pure parts (twisted_relay.translation) stay light to import.
    if name in ("Relay", "make_service"):
        from twisted_relay import service

        return getattr(service, name)
    raise AttributeError(name)


__all__ = ["Relay", "RelayConfig", "__version__", "make_service"]
