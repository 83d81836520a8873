# -*- test-case-name: tests.test_upstream -*-
"""
What treq runs on in the relay: the agent that sends each request through
the relay's connection pool in one write, the endpoint of each upstream
host, the in-memory request body, the cookie jar that keeps none, and the
upstream URLs treq takes as they are.

:class:`~twisted_relay.upstream.UpstreamClient` puts these together.
"""

from __future__ import annotations

from http.cookiejar import CookieJar

from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.defer import CancelledError, fail, succeed
from twisted.internet.endpoints import (
    HostnameEndpoint,
    TCP4ClientEndpoint,
    TCP6ClientEndpoint,
    wrapClientTLS,
)
from twisted.internet.error import ConnectingCancelledError, TimeoutError
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.web.client import URI, Agent, BrowserLikePolicyForHTTPS
from twisted.web.error import SchemeNotSupported
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IAgentEndpointFactory, IBodyProducer
from hyperlink import EncodedURL
from zope.interface import implementer

from twisted_relay import _twisted

__all__ = [
    "BytesProducer",
    "NoCookies",
    "PooledAgent",
    "PreparedURL",
    "TimedEndpoint",
    "UpstreamEndpoints",
    "UpstreamTimer",
]


class UpstreamTimer:
    """
    A timer that judges the upstream (its connect, its headers, its
    silence): it calls ``f`` ``seconds`` from now, but only once the
    reactor has also read what arrived by then. When the relay itself was
    busy past that moment, the reactor runs its due timers before it reads
    its sockets again; this one then waits that one read, and what the
    upstream sent meanwhile (the connection made, the headers, a byte) can
    still stop it. (Twisted runs the calls a timer makes at its next round of
    timers, after the sockets are read: ``ReactorBase.runUntilCurrent``.)
    """

    def __init__(self, reactor, seconds: float, f):
        self._reactor = reactor
        self._f = f
        self._call = reactor.callLater(seconds, self._due)

    def _due(self) -> None:
        self._call = self._reactor.callLater(0, self._fire)

    def _fire(self) -> None:
        self._call = None
        self._f()

    def active(self) -> bool:
        """Whether it has yet to fire (and was not cancelled)."""
        return self._call is not None and self._call.active()

    def cancel(self) -> None:
        """Stop it, if it has yet to fire."""
        call, self._call = self._call, None
        if call is not None and call.active():
            call.cancel()


@implementer(IStreamClientEndpoint)
class TimedEndpoint:
    """
    ``endpoint``, whose connect fails with ``TimeoutError`` when not made
    within ``timeout`` seconds, judged by an :class:`UpstreamTimer` (not by
    the reactor's connect timer, which fires before the reactor reads a
    connection made while it was busy).

    :ivar endpoint: the endpoint it connects with.
    """

    def __init__(self, reactor, endpoint, timeout: float):
        self._reactor = reactor
        self.endpoint = endpoint
        self._timeout = timeout

    def connect(self, factory):
        d = self.endpoint.connect(factory)
        timed_out = []

        def expire() -> None:
            timed_out.append(True)
            d.cancel()

        timer = UpstreamTimer(self._reactor, self._timeout, expire)

        def settled(result):
            timer.cancel()
            if timed_out and hasattr(result, "check") and result.check(CancelledError, ConnectingCancelledError):
                raise TimeoutError(string="no connection within %g seconds" % (self._timeout,))
            return result

        return d.addBoth(settled)


@implementer(IAgentEndpointFactory)
class UpstreamEndpoints:
    """
    The endpoint of each upstream host, made once and reused: the upstream
    client's default endpoint factory (tests give one that connects in memory).

    Twisted's ``Agent`` makes a new endpoint per request. An upstream given
    by an IP address is reached with a plain TCP endpoint: ``HostnameEndpoint``
    would resolve even ``127.0.0.1`` in the reactor's thread pool, where a
    burst of new connections queues.
    """

    def __init__(self, reactor, connect_timeout: float):
        self._reactor = reactor
        self._timeout = connect_timeout
        self._policy = BrowserLikePolicyForHTTPS()
        self._made: dict[tuple[bytes, bytes, int], object] = {}

    def endpointForURI(self, uri: URI):
        """The endpoint of ``uri``'s scheme, host and port, made on first use."""
        key = (uri.scheme, uri.host, uri.port)
        endpoint = self._made.get(key)
        if endpoint is None:
            endpoint = self._made[key] = self._make(*key)
        return endpoint

    def _make(self, scheme: bytes, host: bytes, port: int):
        try:
            name = host.decode("ascii")
        except UnicodeDecodeError:
            raise ValueError("The upstream host %r is not ASCII." % (host,))
        # The connect timeout is the relay's own (TimedEndpoint); Twisted's
        # is a backstop well past it.
        backstop = max(60.0, 4 * self._timeout)
        if isIPAddress(name):
            endpoint = TCP4ClientEndpoint(self._reactor, name, port, timeout=backstop)
        elif isIPv6Address(name):
            endpoint = TCP6ClientEndpoint(self._reactor, name, port, timeout=backstop)
        else:
            endpoint = HostnameEndpoint(self._reactor, name, port, timeout=backstop)
        if self._timeout:
            endpoint = TimedEndpoint(self._reactor, endpoint, self._timeout)
        if scheme == b"http":
            return endpoint
        if scheme == b"https":
            return wrapClientTLS(self._policy.creatorForNetloc(host, port), endpoint)
        raise SchemeNotSupported("Unsupported scheme: %r" % (scheme,))


@implementer(IBodyProducer)
class BytesProducer:
    """
    A request body that is already in memory, written in one go: what treq
    turns the relay's bytes into (``data_to_body_producer``).

    treq's default wraps bytes in a ``FileBodyProducer``, which hands them
    out in cooperator-scheduled chunks: latency for nothing when the body is
    whole. The relay's agent writes ``body`` with the request's head.
    """

    def __init__(self, body: bytes):
        self.body = body
        self.length = len(body)

    def startProducing(self, consumer):
        consumer.write(self.body)
        return succeed(None)

    def stopProducing(self) -> None:
        pass

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass


def _host_value(scheme: bytes, host: bytes, port: int) -> bytes:
    """The ``Host`` header for an upstream, as Twisted's ``Agent`` computes it."""
    if isIPv6Address(host.decode("ascii", "replace")):
        host = b"[" + host + b"]"
    if (scheme, port) in ((b"http", 80), (b"https", 443)):
        return host
    return b"%b:%d" % (host, port)


class NoCookies(CookieJar):
    """
    treq's cookie jar, made to keep and send none: one relay serves many
    clients, and a cookie an upstream sets for one must never reach another.
    (A client's own ``Cookie`` header passes through like any end-to-end
    header, and an upstream's ``Set-Cookie`` reaches the client that asked.)
    """

    def set_cookie(self, cookie) -> None:
        pass

    def set_cookie_if_ok(self, cookie, request) -> None:
        pass

    def extract_cookies(self, response, request) -> None:
        pass

    def make_cookies(self, response, request) -> list:
        return []

    def add_cookie_header(self, request) -> None:
        pass


class PreparedURL(EncodedURL):
    """
    An upstream URL treq takes as it is: made into a URI once (by hyperlink,
    as treq would) and kept. treq makes every ``str`` URL into a URI again
    on each request, IDNA-encoding even an IP address: 60-100 us of a small
    request's CPU, for the same few paths.
    """

    #: The URI as text, as it was made.
    uri_text = ""

    @classmethod
    def of(cls, text: str) -> "PreparedURL":
        """The URL of ``text``, already a URI (``EncodedURL.to_uri().to_text()``)."""
        url = cls.from_text(text)
        url.uri_text = text
        return url

    def to_uri(self):
        return self

    def to_text(self, with_password=False):
        return self.uri_text


# Origins (``scheme://host:port``) whose pool key, endpoint and ``Host``
# value the agent keeps; a relay talks to one upstream, a few at most.
_MAX_ORIGINS = 64


@implementer(IAgent)
class PooledAgent:
    """
    The agent under treq: each request goes to the relay's connection pool
    and is written in one send (``_twisted.one_send_request``), without
    Twisted's ``Agent``'s per-request URL parsing, endpoint and body-producer
    Deferreds. Where that path is off, Twisted's ``Agent`` over the same pool
    and endpoints sends it.

    The relay never asks for compression: it must read the bytes it relays,
    and an uncompressed stream is never held back by a compressor. treq adds
    ``Accept-Encoding: gzip`` (its ``ContentDecoderAgent``) to every request;
    it is removed here. Should an upstream compress anyway, treq's decoder
    still decodes each read as it comes.
    """

    def __init__(self, reactor, pool, endpoints):
        self._pool = pool
        self._endpoints = endpoints
        self._origins: dict[bytes, tuple] = {}
        self._agent = Agent.usingEndpointFactory(reactor, endpoints, pool=pool)

    def request(self, method, uri, headers=None, bodyProducer=None):
        if headers is None:
            headers = Headers()
        headers.removeHeader(b"accept-encoding")
        try:
            slash = uri.find(b"/", uri.find(b"://") + 3)
            origin, target = (uri, b"/") if slash < 0 else (uri[:slash], uri[slash:])
            route = self._origins.get(origin)
            if route is None:
                route = self._route(origin)
            key, endpoint, host = route
            if bodyProducer is None:
                body = None
            elif isinstance(bodyProducer, BytesProducer):
                body = bodyProducer.body
            else:
                return self._agent.request(method, uri, headers, bodyProducer)
            # A fragment is the client's own business, never sent (nor by Twisted's Agent).
            request = _twisted.one_send_request(method, target.partition(b"#")[0], headers, body, host)
        except (ValueError, SchemeNotSupported):
            return fail()
        if request is None:
            return self._agent.request(method, uri, headers, bodyProducer)
        d = self._pool.getConnection(key, endpoint)
        d.addCallback(lambda connection: connection.request(request))
        return d

    def _route(self, origin: bytes) -> tuple:
        parsed = URI.fromBytes(origin)
        route = (
            (parsed.scheme, parsed.host, parsed.port),
            self._endpoints.endpointForURI(parsed),
            _host_value(parsed.scheme, parsed.host, parsed.port),
        )
        if len(self._origins) >= _MAX_ORIGINS:
            self._origins.clear()
        self._origins[origin] = route
        return route
