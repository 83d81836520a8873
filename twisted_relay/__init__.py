"""
twisted-relay: a relay for the Anthropic Messages API, built on Twisted.

It keeps long tool-use sessions alive when an upstream model reuses tool-use
ids, streams answers through without buffering them, and writes a replayable
dump of every 4xx the upstream returns.
"""

from twisted_relay._version import __version__

__all__ = ["__version__"]
