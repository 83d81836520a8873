# -*- test-case-name: tests.test_hardening -*-
"""
Log observers for twistd's ``--logger`` option.

The relay logs structured ``twisted.logger`` events (named fields such as
``relay_request_id``, ``status``, ``duration_ms``, ``upstream_id``); these
observers write them one JSON object a line, for log shippers:

    twistd -n --logger twisted_relay.logs.json_stdout relay ...
"""

from __future__ import annotations

import sys

from twisted.logger import jsonFileLogObserver

__all__ = ["json_stdout", "json_stderr"]


def json_stdout():
    """A twistd ``--logger`` factory: JSON events, one a line, on standard output."""
    return jsonFileLogObserver(sys.stdout)


def json_stderr():
    """A twistd ``--logger`` factory: JSON events, one a line, on standard error."""
    return jsonFileLogObserver(sys.stderr)
