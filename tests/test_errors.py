"""
Tests for the relay's own Anthropic-shaped errors.
"""

from __future__ import annotations

import json

from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.errors import RelayError
from twisted_relay.sse_events import parse_event


class RelayErrorTests(SynchronousTestCase):
    def test_body_shape(self):
        """An error body is Anthropic's: type, error.type, error.message, request_id."""
        body = json.loads(RelayError(413, "Too big: 5 bytes.").body("rly_1"))
        self.assertEqual(
            body,
            {
                "type": "error",
                "error": {"type": "request_too_large", "message": "Too big: 5 bytes."},
                "request_id": "rly_1",
            },
        )

    def test_sse_event_shape(self):
        """After a stream began, the same error is an SSE ``error`` event."""
        name, data = parse_event(RelayError(504, "Silent.", kind="idle").sse_event())
        self.assertEqual(name, "error")
        self.assertEqual(json.loads(data), {"type": "error", "error": {"type": "timeout_error", "message": "Silent."}})

    def test_any_message_serialises(self):
        """
        A message holding text with no UTF-8 form (a lone surrogate, from
        client input) still gives valid JSON, in body and event alike.
        """
        error = RelayError(400, "Bad id \ud800 / here")
        self.assertEqual(json.loads(error.body())["error"]["message"], "Bad id \ud800 / here")
        self.assertEqual(json.loads(parse_event(error.sse_event())[1])["error"]["message"], "Bad id \ud800 / here")
