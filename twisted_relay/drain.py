# -*- test-case-name: tests.test_drain -*-
"""
Draining that a load balancer can see.

When the relay is told to stop, ``/ready`` answers 503 at once while the
relay goes on accepting for ``drain_delay`` seconds (a load balancer that
checks ``/ready`` moves on meanwhile); then it stops accepting and lets
the requests in flight finish within ``shutdown_grace``. Requests that
still arrive on connections a load balancer keeps alive are served, not
refused (a balancer does not resend a refused POST), and each such
connection closes as its answer ends (``Connection: close``), so the
balancer opens its next one elsewhere.
"""

from __future__ import annotations

__all__ = ["close_after_answer"]


def close_after_answer(request) -> None:
    """
    Close ``request``'s connection once its answer ends; say so in the
    answer's headers when they are not sent yet.
    """
    if not request.startedWriting:
        request.responseHeaders.setRawHeaders(b"connection", [b"close"])
    channel = getattr(request, "channel", None)
    if channel is not None:
        # Read by Twisted's HTTPChannel when the request is done.
        channel.persistent = False
