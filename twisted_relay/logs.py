# -*- test-case-name: tests.test_logs -*-
"""
Log observers for twistd's ``--logger`` option, and :func:`bounded` for
values that go into log events.

The relay logs structured ``twisted.logger`` events (named fields such as
``relay_request_id``, ``status``, ``duration_ms``, ``upstream_id``); these
observers write them as one plain JSON object a line (no record separator,
none of Twisted's internal fields), for log shippers:

    twistd -n --logger twisted_relay.logs.json_stdout relay ...
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone

from twisted.logger import FileLogObserver, formatEvent

__all__ = ["bounded", "event_as_json", "json_stderr", "json_stdout"]

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


# Keys of legacy ``twisted.python.log`` events that are not the event's own fields.
_LEGACY_KEYS = frozenset(("message", "isError", "system", "time", "format", "why", "failure"))


def _jsonable(value):
    """``value`` if JSON can hold it as it is, else its text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


def event_as_json(event: dict) -> str:
    """
    One log event as one line of plain JSON: ``time`` (ISO 8601, UTC),
    ``level``, ``message`` (the formatted text), ``namespace``, then the
    event's own named fields (``relay_request_id``, ``status``...); never
    Twisted's internal ``log_*`` fields. A failure adds its ``traceback``.
    """
    when = event.get("log_time")
    level = event.get("log_level")
    record = {
        "time": datetime.fromtimestamp(when if when is not None else time.time(), timezone.utc).isoformat(
            timespec="milliseconds"
        ),
        "level": getattr(level, "name", "info"),
        "message": formatEvent(event),
        "namespace": event.get("log_namespace"),
    }
    for key, value in event.items():
        if key.startswith("log_") or key in _LEGACY_KEYS or key in record or not isinstance(key, str):
            continue
        record[key] = _jsonable(value)
    failure = event.get("log_failure")
    if failure is not None:
        try:
            record["traceback"] = failure.getTraceback()
        except Exception:
            record["traceback"] = str(failure)
    return json.dumps(record, ensure_ascii=False) + "\n"


def json_stdout():
    """A twistd ``--logger`` factory: one plain JSON object a line, on standard output."""
    return FileLogObserver(sys.stdout, event_as_json)


def json_stderr():
    """A twistd ``--logger`` factory: one plain JSON object a line, on standard error."""
    return FileLogObserver(sys.stderr, event_as_json)
