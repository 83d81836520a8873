"""
Limits on what clients send: a body over ``max_body`` is refused with a 413
(declared or chunked), and what request bodies in flight cost once parsed
is bounded (``max_bodies_in_flight``), a waiting request holding no parsed
copy. Real sockets on 127.0.0.1.
"""

from __future__ import annotations

import gc
import socket
import tracemalloc

import treq
import ujson
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from tests.faulty_upstream import Hang, parse_response
from tests.helpers import encode, messages_body, serve_relay_over_simulated
from tests.test_faults import FaultTestCase, wait_for
from twisted_relay.body_work import BodyShape


class BodySizeTests(TestCase):
    """A body over ``max_body`` is refused at the HTTP layer, on real sockets."""

    def serve(self, **settings):
        served = serve_relay_over_simulated(self, "lenient", **settings)
        return served.port, served.relay

    async def test_declared_length_over_limit(self):
        """
        A body whose ``Content-Length`` is over ``max_body`` gets a 413
        ``request_too_large``; the relay does not store it.
        """
        port, _ = self.serve(max_body=1000)
        response = await treq.post(
            "http://127.0.0.1:%d/v1/messages" % (port,),
            data=encode(messages_body([{"role": "user", "content": "x" * 5000}])),
            headers={"content-type": ["application/json"]},
            persistent=False,
        )
        self.assertEqual(response.code, 413)
        body = ujson.loads(await response.content())
        self.assertEqual(body["error"]["type"], "request_too_large")

    async def test_chunked_body_over_limit(self):
        """
        A chunked body (no length declared) that grows past ``max_body`` also
        gets a 413.
        """
        port, _ = self.serve(max_body=1000)
        payload = encode(messages_body([{"role": "user", "content": "y" * 5000}]))

        def send():
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(
                    b"POST /v1/messages HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                )
                for i in range(0, len(payload), 700):
                    piece = payload[i : i + 700]
                    s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                s.sendall(b"0\r\n\r\n")
                answer = b""
                while True:
                    data = s.recv(65536)
                    if not data:
                        return answer
                    answer += data

        answer = await deferToThread(send)
        self.assertTrue(answer.startswith(b"HTTP/1.1 413"), answer[:80])
        self.assertIn(b'"request_too_large"', answer)


def tiny_messages(count: int) -> list[dict]:
    """Many tiny alternating messages, ending on a user turn: the costliest body to parse per byte."""
    messages = [{"role": "user" if n % 2 == 0 else "assistant", "content": "m%d" % (n,)} for n in range(count)]
    return messages if count % 2 else messages[:-1]


class BodyMemoryTests(FaultTestCase):
    """What request bodies in flight cost is bounded, and a waiting request holds no parsed copy."""

    async def test_budget_refuses_then_frees(self):
        """
        The budget counts what a body costs once parsed (fifteen times its
        bytes for tiny messages) while it is read and worked on, then only
        the bytes a waiting request keeps. With room for one body being
        worked on beside two and a half waiting ones, a fourth large request
        gets a 529 ``overloaded_error`` although its bytes would fit, and
        never reaches the upstream; the room comes back when a request ends,
        including one whose client hangs up half-way through its body.
        """
        body = encode(messages_body(tiny_messages(3001), stream=True, tools=False))
        cost = BodyShape.of(body).cost()
        self.assertGreater(cost, 14 * len(body))
        self.start_relay(max_bodies_in_flight=cost + 5 * len(body) // 2)
        self.upstream.script(Hang(headers=True), Hang(headers=True), Hang(headers=True))
        waiting = []
        for n in range(1, 4):
            waiting.append(self.raw(self.raw_post(body)))
            await wait_for(lambda: self.upstream.request_count == n)
            # Sent upstream: the request now keeps its bytes only.
            await wait_for(lambda: self.site.body_budget.held == n * len(body))
        body_error = await self.error_of(await self.post(body), 529, "overloaded_error")
        self.assertIn("memory", body_error["error"]["message"])
        self.assertEqual(self.upstream.request_count, 3)
        # A small request still fits.
        response = await self.post()
        self.assertEqual(response.code, 200)
        await treq.content(response)
        waiting[0].abort()
        await wait_for(lambda: self.site.body_budget.held == 2 * len(body))
        # A client that leaves in the middle of its body gives its room back.
        half = self.raw(self.raw_post(body), send_only=len(body) // 2)
        await wait_for(lambda: self.site.body_budget.held > 3 * len(body))
        half.abort()
        await wait_for(lambda: self.site.body_budget.held == 2 * len(body))
        response = await self.post(body)
        self.assertEqual(response.code, 200)
        await treq.content(response)
        for client in waiting[1:]:
            client.abort()
        await wait_for(lambda: self.site.body_budget.held == 0)
        await self.assert_clean()

    async def test_costly_body_let_in_beside_small_ones(self):
        """
        While the bodies held cost less than an eighth of the budget (small
        streaming requests in flight), one body costing more than the whole
        budget is still let in: only a relay already busy with large bodies
        turns it away.
        """
        small = encode(messages_body(stream=True, tools=False))
        body = encode(messages_body(tiny_messages(3001), stream=False, tools=False))
        # Its bytes alone fill the budget (before, it was refused for them).
        self.start_relay(max_bodies_in_flight=len(body))
        self.assertGreater(BodyShape.of(body).cost(), 10 * len(body))
        self.upstream.script(Hang(headers=True), Hang(headers=True))
        streams = [self.raw(self.raw_post(small)) for _ in range(2)]
        await wait_for(lambda: self.upstream.request_count == 2)
        self.assertGreater(self.site.body_budget.held, 0)
        response = await self.post(body)
        self.assertEqual(response.code, 200)
        await treq.content(response)
        for client in streams:
            client.abort()
        await wait_for(lambda: self.site.body_budget.held == 0)
        await self.assert_clean()

    async def test_chunked_body_counted(self):
        """A chunked body (no declared length) is counted as it comes, and refused once over the budget."""
        body = encode(messages_body(tiny_messages(3001), stream=True, tools=False))
        self.start_relay(max_bodies_in_flight=int(len(body) * 1.5))
        self.upstream.script(Hang(headers=True))
        first = self.raw(self.raw_post(body))
        await wait_for(lambda: first.received)
        head = b"POST /v1/messages HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
        chunked = self.raw(
            head + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )
        response = parse_response(await chunked.done)
        self.assertEqual(response.status, 529)
        self.assertEqual(ujson.loads(response.body)["error"]["type"], "overloaded_error")
        self.assertEqual(self.upstream.request_count, 1)
        first.abort()
        await wait_for(lambda: self.site.body_budget.held == 0)
        await self.assert_clean()

    async def test_lone_body_over_budget_let_in_either_framing(self):
        """
        With nothing else held, one body larger than the whole budget is let
        in, whether it declares its length or comes in several chunks: its
        own earlier chunks never count against it.
        """
        body = encode(messages_body(tiny_messages(3001), stream=False, tools=False))
        self.start_relay(max_bodies_in_flight=len(body) // 3)
        head = b"POST /v1/messages HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
        quarter = len(body) // 4 + 1
        chunks = b"".join(
            b"%x\r\n%s\r\n" % (len(piece), piece)
            for piece in (body[n:n + quarter] for n in range(0, len(body), quarter))
        )
        for request in (
            head + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunks + b"0\r\n\r\n",
            head + b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body),
        ):
            response = parse_response(await self.raw(request).done)
            self.assertEqual(response.status, 200, response.body[:300])
            await wait_for(lambda: self.site.body_budget.held == 0)
        self.assertEqual(self.upstream.request_count, 2)
        await self.assert_clean()

    async def test_waiting_request_holds_no_parsed_body(self):
        """
        While a large request waits on the upstream, the relay holds its
        bytes, not the parsed objects (ten times larger for tiny messages).
        """
        body = encode(messages_body(tiny_messages(40001), stream=True, tools=False))
        self.start_relay()
        self.upstream.script(Hang(headers=True))
        gc.collect()
        tracemalloc.start()
        self.addCleanup(tracemalloc.stop)
        before = tracemalloc.get_traced_memory()[0]
        client = self.raw(self.raw_post(body))
        await wait_for(lambda: client.received, timeout=30)
        del body
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        # The body is in this process three times (the test's copy, the
        # raw client's, the upstream's record) and once in the relay.
        body_size = len(self.upstream.received[0].body)
        self.assertLess(held, 5.5 * body_size, "%d bytes held for a %d-byte body" % (held, body_size))
        client.abort()
        await self.assert_clean()
