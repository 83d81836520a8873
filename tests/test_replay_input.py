"""
What ``twisted-relay-replay`` accepts as a dump: a JSON file that is not one
is refused, as docs/dumps.md says (exit 2).
"""

from __future__ import annotations

import io

from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.replay import main as replay_main


class ReplayNonDumpTests(SynchronousTestCase):
    """``twisted-relay-replay`` refuses a JSON file that is not a dump, as docs/dumps.md says (exit 2)."""

    def test_not_a_dump(self):
        """``{}``, a list, and an object without the dump's sections: exit 2, a sentence, no ``None`` fields."""
        for content in ("{}", "[]", '{"format": 1, "relay_request_id": "rly_1"}', '"text"'):
            path = self.mktemp()
            with open(path, "w") as f:
                f.write(content)
            out, err = io.StringIO(), io.StringIO()
            for argv in ([path], [path, "--check"]):
                self.assertEqual(replay_main(argv, stdout=out, stderr=err), 2, content)
            self.assertEqual(out.getvalue(), "")
            self.assertIn("is not a relay dump", err.getvalue())
