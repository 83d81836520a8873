# -*- test-case-name: tests.test_simulated -*-
"""
A simulated Anthropic upstream whose model reuses tool-use ids.

It lets a newcomer without an API key or network watch the relay work, and
gives the test suite a faithful Anthropic-protocol backend: strict (rejects
what a stateless backend rejects), stateful (remembers the ids it issued) or
lenient.  It speaks today's API by default (model families, thinking bound
to its prefix, model and account, both API versions: see docs/simulated.md)
and the year-old one with ``api="2025"``.  ``twisted-relay-simulated`` serves
it on its own.
"""

from twisted_relay.simulated.model import ID_STYLES, MODES
from twisted_relay.simulated.resource import ReceivedRequest, SimulatedUpstream
from twisted_relay.simulated.today import APIS

__all__ = ["APIS", "ID_STYLES", "MODES", "ReceivedRequest", "SimulatedUpstream"]
