"""
Paths and URLs: no client path leaves the upstream's base path, a path that
is not UTF-8 gets the relay's own error answer, and an upstream URL's
credentials never show in what the relay writes. Requests go over real
sockets on 127.0.0.1, to the faulty upstream of :mod:`tests.faulty_upstream`.
"""

from __future__ import annotations

import ujson
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.config import one_upstream
from twisted_relay.upstream import display_url

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
        self.start_relay(upstreams=one_upstream(self.upstream_url + "/base", key=UPSTREAM_KEY))
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
        self.start_relay(upstreams=one_upstream(self.upstream_url + "/base", key=UPSTREAM_KEY))
        for path in (b"/v1/models/claude-sonnet-4-5", b"/v1/models/claude-3.5%20x?beta=true", b"/v1/models"):
            response = await self.get(path)
            self.assertEqual(response.status, 200, path)
        self.assertEqual(
            [record.path for record in self.upstream.received],
            [b"/base/v1/models/claude-sonnet-4-5", b"/base/v1/models/claude-3.5%20x?beta=true", b"/base/v1/models"],
        )
        await self.assert_clean()


class NonUtf8PathTests(FaultTestCase):
    """A path or a Host header that is not UTF-8 gets the relay's own error answer."""

    async def test_non_utf8_path_refused(self):
        """
        ``/v1/models/%FF`` gets an Anthropic-shaped 400 with its request id
        (in the header and the body) and its length, and nothing reaches
        the upstream.
        """
        self.start_relay()
        client = self.raw(b"GET /v1/models/%FF HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
        response = parse_response(await client.done)
        self.assertEqual(response.status, 400)
        self.assertTrue(response.complete)
        self.assertEqual(response.header(b"content-type"), b"application/json")
        body = ujson.loads(response.body)
        self.assertEqual(body["error"]["type"], "invalid_request_error")
        self.assertEqual(body["request_id"].encode("ascii"), response.header(b"x-relay-request-id"))
        self.assertEqual(self.upstream.request_count, 0)
        await self.assert_clean()

    async def test_non_utf8_host_refused(self):
        """
        A Host header that is not UTF-8 (which Klein cannot make a URL of)
        gets an Anthropic-shaped 400, not Klein's HTML page and a traceback.
        """
        self.start_relay()
        client = self.raw(b"GET /v1/models HTTP/1.1\r\nHost: \x80\r\nConnection: close\r\n\r\n")
        response = parse_response(await client.done)
        self.assertEqual(response.status, 400)
        self.assertEqual(response.header(b"content-type"), b"application/json")
        body = ujson.loads(response.body)
        self.assertEqual(body["error"]["type"], "invalid_request_error")
        self.assertIn("Host", body["error"]["message"])
        self.assertEqual(self.upstream.request_count, 0)
        await self.assert_clean()


class DisplayURLTests(SynchronousTestCase):
    """
    An upstream URL with credentials in it never shows them in what the
    relay writes.
    """

    def test_credentials_removed(self):
        """
        ``user:password@`` is dropped, the rest kept.
        """
        self.assertEqual(
            display_url("https://me:s3cret@host.example:8443/base"), "https://host.example:8443/base"
        )
        self.assertEqual(display_url("https://host.example"), "https://host.example")
