"""
Headers on the way through the relay: hop-by-hop headers stay on their
connection, control bytes in a request header are refused, every answer
carries its ``x-relay-request-id``, and an upstream header too large to
read is a 502 in words. Real sockets on 127.0.0.1, the faulty upstream of
:mod:`tests.faulty_upstream`.
"""

from __future__ import annotations

import treq
import ujson

from tests.faulty_upstream import RawBytes, parse_response
from tests.helpers import encode, messages_body, readme
from tests.test_faults import FaultTestCase
from twisted.trial.unittest import SynchronousTestCase


class HopByHopTests(FaultTestCase):
    """Headers the upstream's ``Connection`` header names stay on the upstream's connection."""

    async def test_connection_tokens_dropped(self):
        """
        ``Connection: close, x-foo`` with ``X-Foo`` (RFC 9110 7.6.1): the
        client gets the answer and its end-to-end headers, never ``X-Foo``;
        and the relay does not keep the connection the upstream closes.
        """
        body = b'{"type":"message","id":"msg_1","role":"assistant","content":[]}'
        self.upstream.script(
            RawBytes(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close, X-Foo\r\n"
                b"X-Foo: upstream-connection-only\r\nX-Keep: yes\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
        )
        self.start_relay()
        response = await self.post()
        self.assertEqual(response.code, 200)
        self.assertEqual(ujson.loads(await treq.content(response))["id"], "msg_1")
        self.assertEqual(response.headers.getRawHeaders(b"x-keep"), [b"yes"])
        self.assertIsNone(response.headers.getRawHeaders(b"x-foo"))
        await self.assert_clean()


class ControlByteHeaderTests(FaultTestCase):
    """A request header value with control bytes is refused, never forwarded."""

    async def test_control_bytes_refused(self):
        """
        ``X-Evil: a<DEL><SOH><ESC>b`` gets an Anthropic-shaped 400 and
        nothing reaches the upstream; a tab, which HTTP allows, passes.
        """
        self.start_relay()
        body = encode(messages_body(tools=False))
        for value in (b"a\x7f\x01\x1bb", b"\x1b[31mred", b"a\x08b", b"\x7f"):
            client = self.raw(
                b"POST /v1/messages HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
                b"X-Evil: " + value + b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            response = parse_response(await client.done)
            self.assertEqual(response.status, 400, value)
            self.assertEqual(ujson.loads(response.body)["error"]["type"], "invalid_request_error")
        self.assertEqual(self.upstream.request_count, 0)
        response = await self.post(headers={"x-tabbed": ["a\tb"]})
        self.assertEqual(response.code, 200)
        await treq.content(response)
        self.assertEqual(self.upstream.received[0].header(b"x-tabbed"), [b"a\tb"])
        await self.assert_clean()


class RequestIdEverywhereTests(FaultTestCase):
    """Every answer carries ``x-relay-request-id``, as the README says."""

    async def test_every_route(self):
        """``/health``, ``/ready``, ``/metrics``, ``HEAD /`` and ``HEAD /api/hello`` too, each id its own."""
        self.assertIn("every answer carries an `x-relay-request-id` header", readme())
        self.start_relay()
        ids = set()
        for method, path in ((b"GET", b"/health"), (b"GET", b"/ready"), (b"GET", b"/metrics"),
                             (b"HEAD", b"/"), (b"HEAD", b"/api/hello"), (b"GET", b"/api/hello"),
                             (b"GET", b"/nowhere"), (b"GET", b"/v1/models")):
            client = self.raw(method + b" " + path + b" HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
            response = parse_response(await client.done)
            self.assertLess(response.status, 500, path)
            request_id = response.header(b"x-relay-request-id")
            self.assertIsNotNone(request_id, path)
            self.assertTrue(request_id.startswith(b"rly_"), request_id)
            ids.add(request_id)
        self.assertEqual(len(ids), 8)
        await self.assert_clean()


class HugeHeaderTests(FaultTestCase):
    """An upstream header too large to read is a 502 that says so in words."""

    async def test_64k_header(self):
        """A 64 KB upstream response header: a 502 ``api_error`` naming the cause, no Python repr."""
        self.start_relay()
        self.upstream.script(
            RawBytes(b"HTTP/1.1 200 OK\r\nX-Huge: " + b"a" * 65536 + b"\r\nContent-Length: 2\r\n\r\n{}")
        )
        body = await self.error_of(await self.post(), 502, "api_error")
        message = body["error"]["message"]
        self.assertNotIn("<", message)
        self.assertNotIn("Failure", message)
        self.assertIn("header line longer than the relay reads", message)


class ClientCredentialsTests(SynchronousTestCase):
    """A client's credentials never go upstream when the relay holds the key (its relay key in any header)."""

    def test_every_credential_header_stripped(self):
        from twisted.web.http_headers import Headers

        from twisted_relay.upstream_headers import upstream_request_headers

        client = Headers({b"x-api-key": [b"rk-relay-key"], b"api-key": [b"rk-relay-key"],
                          b"authorization": [b"Bearer rk-relay-key"]})
        sent = upstream_request_headers(client, "pool-key", strip_credentials=True)
        self.assertEqual(sent.getRawHeaders(b"x-api-key"), [b"pool-key"])
        self.assertNotIn(b"rk-relay-key", b" ".join(v for _, values in sent.getAllRawHeaders() for v in values))
