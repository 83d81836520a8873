# -*- test-case-name: tests.test_simulated -*-
"""
A simulated Anthropic upstream whose model reuses tool-use ids.

It lets a newcomer without an API key or network watch the relay work, and
gives the test suite a faithful Anthropic-protocol backend: strict (rejects
what a stateless backend rejects), stateful (remembers the ids it issued) or
lenient.  ``twisted-relay-simulated`` serves it on its own.
"""

from twisted_relay.simulated.model import ID_STYLES, MODES
from twisted_relay.simulated.resource import ReceivedRequest, SimulatedUpstream

__all__ = ["ID_STYLES", "MODES", "ReceivedRequest", "SimulatedUpstream"]
