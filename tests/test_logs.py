"""
The relay's JSON log observer (``twistd --logger twisted_relay.logs.json_stdout``).
"""

from __future__ import annotations

import io
import json

from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.logs import json_stdout


class JSONLogTests(SynchronousTestCase):
    """
    ``twistd --logger twisted_relay.logs.json_stdout`` writes one JSON object
    a line with the event's named fields.
    """

    def test_json_lines(self):
        """
        A relay log event comes out as JSON carrying its fields.
        """
        out = io.StringIO()
        self.patch(__import__("sys"), "stdout", out)
        observer = json_stdout()
        Logger(observer=observer).info(
            "{method} {path} {status}", method="POST", path="/v1/messages", status=200
        )
        line = out.getvalue().strip().strip("\x1e")
        event = json.loads(line)
        self.assertEqual((event["method"], event["status"]), ("POST", 200))
