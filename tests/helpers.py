"""
Test helpers: the relay wired in memory, and bodies of Messages requests.

The in-memory relay is the real stack: a real ``Agent`` talks to the relay's
Klein resource over ``iosim`` pumps (``treq.testing.StubTreq``), and the
relay's own upstream client talks, the same way, to the upstream resource
given (usually the simulated upstream). Nothing is mocked; only the sockets
are in memory and time is a ``MemoryReactorClock``.
"""

from __future__ import annotations

import ujson
from twisted.internet.testing import MemoryReactorClock
from treq.testing import RequestTraversalAgent, StubTreq

from twisted_relay.app import RelayApp
from twisted_relay.config import RelayConfig
from twisted_relay.upstream import UpstreamClient

UPSTREAM_URL = "http://upstream.test"
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def messages_body(messages=None, *, stream=False, tools=True, **extra) -> dict:
    """A Messages request body."""
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 256,
        "messages": messages if messages is not None else [{"role": "user", "content": "Hello"}],
    }
    if tools:
        body["tools"] = TOOLS
    if stream:
        body["stream"] = True
    body.update(extra)
    return body


def encode(body) -> bytes:
    """Serialise a body the way a client would."""
    return ujson.dumps(body).encode("utf-8")


class InMemoryRelay:
    """
    A relay in front of an upstream resource, both in memory.

    :ivar clock: the relay's reactor (timers).
    :ivar stub: a ``StubTreq`` to talk to the relay with.
    """

    def __init__(self, upstream_resource, config: RelayConfig | None = None, *, dumps=None, clock=None):
        self.clock = clock if clock is not None else MemoryReactorClock()
        self.config = config or RelayConfig(listen=(), upstream=UPSTREAM_URL, dump_dir=None)
        self.upstream_agent = RequestTraversalAgent(upstream_resource)
        self.client = UpstreamClient(
            self.clock,
            UPSTREAM_URL,
            response_timeout=self.config.response_timeout,
            agent=self.upstream_agent,
        )
        self.app = RelayApp(self.config, self.client, reactor=self.clock, dumps=dumps)
        self.stub = StubTreq(self.app.resource())
        # A bare agent too: treq's client keeps cookies and adds
        # content-decoding, which some tests must see past.
        self.agent = RequestTraversalAgent(self.app.resource())

    def flush(self, rounds: int = 30) -> None:
        """Move bytes both ways until nothing is left to move."""
        for _ in range(rounds):
            self.clock.advance(0)
            self.upstream_agent.flush()
            self.stub.flush()
            self.agent.flush()

    def post(self, path: str, body, headers=None):
        """Start a POST; the returned Deferred fires after :meth:`flush`."""
        data = body if isinstance(body, bytes) else encode(body)
        all_headers = {"content-type": ["application/json"], "x-api-key": ["sk-test-client"]}
        all_headers.update(headers or {})
        return self.stub.request("POST", "http://relay.test" + path, data=data, headers=all_headers)

    def raw_post(self, path: str, body, headers=None):
        """A POST through the bare agent; fires with an ``IResponse``."""
        from twisted.web.http_headers import Headers

        from twisted_relay.upstream import _BytesProducer

        all_headers = Headers({b"content-type": [b"application/json"]})
        for name, values in (headers or {}).items():
            all_headers.setRawHeaders(name, values)
        data = body if isinstance(body, bytes) else encode(body)
        return self.agent.request(b"POST", b"http://relay.test" + path.encode(), all_headers, _BytesProducer(data))

    def get(self, path: str, headers=None):
        """Start a GET; the returned Deferred fires after :meth:`flush`."""
        return self.stub.request("GET", "http://relay.test" + path, headers=headers or {})
