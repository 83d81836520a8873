"""
Keys an upstream echoes never reach the client: in an error body, in a
stream's ``error`` event, in a response header. Real sockets on 127.0.0.1,
the faulty upstream of :mod:`tests.faulty_upstream`.
"""

from __future__ import annotations

import treq
import ujson

from tests.faulty_upstream import Answer, RawBytes, error_answer, sse_events
from tests.test_faults import UPSTREAM_KEY, FaultTestCase
from twisted_relay.config import one_upstream


class EchoedKeyTests(FaultTestCase):
    """An upstream error that repeats a configured key never shows it to the client."""

    async def test_key_in_error_body_replaced(self):
        """
        A 401 whose message repeats the upstream key (as it is and JSON
        escaped) reaches the client with its status, shape and type, the key
        replaced by ``[REDACTED]``; a relay key echoed in a 500 too.
        """
        relay_key = "rk-fixes-relay/key"
        self.start_relay(upstreams=one_upstream(self.upstream_url, key=UPSTREAM_KEY), relay_keys=(relay_key,))
        self.upstream.script(
            error_answer(401, "authentication_error", "invalid x-api-key: %s" % (UPSTREAM_KEY,)),
            Answer(500, b'{"type":"error","error":{"type":"api_error","message":"got rk-fixes-relay\\/key"}}'),
        )
        body = await self.error_of(await self.post(headers={"x-api-key": [relay_key]}), 401, "authentication_error")
        self.assertNotIn(UPSTREAM_KEY, ujson.dumps(body))
        self.assertEqual(body["error"]["message"], "invalid x-api-key: [REDACTED]")
        response = await self.post(headers={"x-api-key": [relay_key]})
        self.assertEqual(response.code, 500)
        raw = await treq.content(response)
        self.assertNotIn(b"rk-fixes-relay", raw)
        self.assertEqual(ujson.loads(raw)["error"]["message"], "got [REDACTED]")
        await self.assert_clean()

    async def test_key_in_stream_error_and_headers_replaced(self):
        """
        A stream whose upstream repeats the key in a response header and in
        its ``error`` event (as it is and JSON-escaped) reaches the client
        with the error event's type and shape kept, the key nowhere: not in
        the headers, not in the body.
        """
        self.start_relay(upstreams=one_upstream(self.upstream_url, key=UPSTREAM_KEY))
        error = ujson.dumps(
            {"type": "error", "error": {"type": "overloaded_error", "message": "busy for key %s" % (UPSTREAM_KEY,)}}
        ).encode("utf-8")
        body = sse_events()[0] + b"event: error\ndata: " + error + b"\n\n"
        self.upstream.script(
            RawBytes(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
                b"X-Echo: sent x-api-key=%s\r\nRequest-Id: req_echo\r\n\r\n%s"
                % (UPSTREAM_KEY.encode("ascii"), body)
            )
        )
        response = await self.stream()
        _, payload = await self.stream_error_of(response, "overloaded_error")
        self.assertEqual(payload["error"]["message"], "busy for key [REDACTED]")
        headers = list(response.headers.getAllRawHeaders())
        self.assertNotIn(UPSTREAM_KEY.encode("ascii"), repr(headers).encode("ascii"))
        self.assertEqual(response.headers.getRawHeaders(b"x-echo"), [b"sent x-api-key=[REDACTED]"])
        self.assertEqual(response.headers.getRawHeaders(b"request-id"), [b"req_echo"])
        await self.assert_clean()
