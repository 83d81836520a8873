# -*- test-case-name: tests.test_hardening -*-
"""
Log observers for twistd's ``--logger`` option, and :func:`bounded` for
values that go into log events.

The relay logs structured ``twisted.logger`` events (named fields such as
``relay_request_id``, ``status``, ``duration_ms``, ``upstream_id``); these
observers write them one JSON object a line, for log shippers:

    twistd -n --logger twisted_relay.logs.json_stdout relay ...
"""

from __future__ import annotations

import sys

from twisted.logger import jsonFileLogObserver

__all__ = ["bounded", "json_stdout", "json_stderr"]

# The most characters of one client- or model-given value a log event keeps.
BOUNDED_CHARS = 200


def bounded(text: str, limit: int = BOUNDED_CHARS) -> str:
    """
    A value fit for a log event: ids and messages come from clients and
    models and may be huge; past ``limit`` characters, the start and the length.
    """
    if len(text) <= limit:
        return text
    return "%s...(%d chars)" % (text[:limit], len(text))


def json_stdout():
    """A twistd ``--logger`` factory: JSON events, one a line, on standard output."""
    return jsonFileLogObserver(sys.stdout)


def json_stderr():
    """A twistd ``--logger`` factory: JSON events, one a line, on standard error."""
    return jsonFileLogObserver(sys.stderr)
