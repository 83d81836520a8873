"""
Defects found by driving the relay from outside as users and attackers
would (raw sockets, the official SDK, the README read as a newcomer reads
it), each with the behaviour a user now relies on. Real sockets on
127.0.0.1, the faulty upstream of :mod:`tests.faulty_upstream`.
"""

from __future__ import annotations

import ujson

from tests.faulty_upstream import parse_response
from tests.test_faults import UPSTREAM_KEY, FaultTestCase

#: Paths that try to leave ``/v1/models/`` (and the upstream's base path).
ESCAPING_MODEL_PATHS = [
    b"/v1/models/../../admin",
    b"/v1/models/..%2F..%2F..%2Fadmin",
    b"/v1/models/%2e%2e/%2e%2e/admin",
    b"/v1/models/%2E%2E",
    b"/v1/models/x/../../../../admin?y=1",
    b"/v1/models/..\\..\\admin",
    b"/v1/models/..",
    b"/v1/models/.",
    b"/v1/models/%252e%252e",
    b"/v1/models/a%2Fb",
    b"/v1/models/a%5Cb",
    b"/v1/models/./x",
    b"/v1/./models",
    b"/v1/models/..?beta=true",
]


class PathEscapeTests(FaultTestCase):
    """No route sends a path outside the upstream's base path, with the relay's key or not."""

    async def get(self, path: bytes):
        client = self.raw(b"GET " + path + b" HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
        return parse_response(await client.done)

    async def test_dot_segments_refused(self):
        """
        A model id that is not one plain path segment (dot segments, an
        encoded slash or backslash, percent-encoded once or twice) gets an
        Anthropic-shaped 404 and nothing reaches the upstream.
        """
        self.start_relay(upstream_key=UPSTREAM_KEY, upstream=self.upstream_url + "/base")
        for path in ESCAPING_MODEL_PATHS:
            response = await self.get(path)
            self.assertIn(response.status, (400, 404), path)
            body = ujson.loads(response.body)
            self.assertEqual(body["type"], "error", path)
            self.assertIn(body["error"]["type"], ("not_found_error", "invalid_request_error"), path)
        self.assertEqual([record.path for record in self.upstream.received], [])
        await self.assert_clean()

    async def test_plain_model_id_relayed(self):
        """A plain model id (and the model list) still reach the upstream, under its base path."""
        self.start_relay(upstream_key=UPSTREAM_KEY, upstream=self.upstream_url + "/base")
        for path in (b"/v1/models/claude-sonnet-4-5", b"/v1/models/claude-3.5%20x?beta=true", b"/v1/models"):
            response = await self.get(path)
            self.assertEqual(response.status, 200, path)
        self.assertEqual(
            [record.path for record in self.upstream.received],
            [b"/base/v1/models/claude-sonnet-4-5", b"/base/v1/models/claude-3.5%20x?beta=true", b"/base/v1/models"],
        )
        await self.assert_clean()
