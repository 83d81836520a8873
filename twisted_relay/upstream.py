# -*- test-case-name: tests.test_upstream -*-
"""
The upstream side: one persistent connection pool, header hygiene, timeouts.

This module knows Twisted's HTTP client; it knows nothing of tool-use ids or SSE.
"""

from __future__ import annotations

import re
from typing import Iterable
from urllib.parse import urlsplit

from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.endpoints import (
    HostnameEndpoint,
    TCP4ClientEndpoint,
    TCP6ClientEndpoint,
    wrapClientTLS,
)
from twisted.internet.error import ConnectError, ConnectingCancelledError, DNSLookupError, TimeoutError
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.web._newclient import HTTP11ClientProtocol, HTTPParser, Request, TransportProxyProducer
from twisted.web.client import (
    BrowserLikePolicyForHTTPS,
    HTTPConnectionPool,
    ResponseDone,
    ResponseFailed,
    ResponseNeverReceived,
    _HTTP11ClientFactory,
)
from twisted.web.error import SchemeNotSupported
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer, IResponse
from zope.interface import implementer

from twisted_relay.chunked import CoalescingChunkedDecoder
from twisted_relay.errors import RelayError
from twisted_relay.writethrough import send_now

__all__ = [
    "HOP_BY_HOP",
    "display_url",
    "read_body",
    "UpstreamClient",
    "client_response_headers",
    "connection_tokens",
    "upstream_request_headers",
]

#: Headers that describe one connection, never the message (RFC 9110 7.6.1).
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)

# Not hop-by-hop, but the relay sets them itself on each side: the length of
# a body it may rewrite, the host it talks to, and no compression, because
# the relay must read the bytes it forwards.
_NOT_FORWARDED_UPSTREAM = HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"accept-encoding",
    b"expect",
}
_NOT_FORWARDED_TO_CLIENT = HOP_BY_HOP | {
    b"content-length",
    b"date",
    b"server",
}
_CREDENTIALS = (b"x-api-key", b"authorization")


def _connection_tokens(headers: Headers) -> set[bytes]:
    """Header names listed in ``Connection``: hop-by-hop for this message."""
    tokens = set()
    for value in headers.getRawHeaders(b"connection", []):
        for token in value.split(b","):
            token = token.strip().lower()
            if token:
                tokens.add(token)
    return tokens


def _copy_headers(headers: Headers, skip: Iterable[bytes]) -> Headers:
    skip = set(skip) | _connection_tokens(headers)
    copied = Headers()
    for name, values in headers.getAllRawHeaders():
        if name.lower() not in skip:
            copied.setRawHeaders(name, list(values))
    return copied


# What RFC 9110 5.5 does not allow in a field value: control bytes other
# than horizontal tab, and DEL. (Twisted's server refuses CR, LF and NUL itself.)
_CONTROL_BYTES = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def _refuse_control_bytes(headers: Headers) -> None:
    """
    Refuse (400) headers whose values hold control bytes: forwarded, they
    could be read differently by each server on the way.
    """
    for name, values in headers.getAllRawHeaders():
        for value in values:
            if _CONTROL_BYTES.search(value) is not None:
                raise RelayError(
                    400,
                    "The value of header %s holds a control character, which HTTP does not allow."
                    % (name.decode("latin-1")[:100],),
                )


def upstream_request_headers(
    client_headers: Headers, upstream_key: str | None, *, strip_credentials: bool = False
) -> Headers:
    """
    The headers to send upstream for a client's request.

    Every end-to-end header passes through verbatim (``anthropic-*``,
    ``x-claude-code-*``, ``user-agent``, ``content-type``, ...). With an
    upstream key configured, the client's own credentials are replaced by it;
    with ``strip_credentials`` (the client's key is a relay key) they are
    never forwarded.

    :raises RelayError: 400 for a forwarded value holding a control byte.
    """
    headers = _copy_headers(client_headers, _NOT_FORWARDED_UPSTREAM)
    _refuse_control_bytes(headers)
    if upstream_key or strip_credentials:
        for name in _CREDENTIALS:
            headers.removeHeader(name)
    if upstream_key:
        headers.setRawHeaders(b"x-api-key", [upstream_key.encode("utf-8")])
    return headers


def client_response_headers(upstream_headers: Headers, connection_tokens: Iterable[bytes] = ()) -> Headers:
    """
    The upstream's response headers as the client should get them.

    ``request-id``, rate-limit headers, ``retry-after`` and
    ``x-should-retry`` pass through; hop-by-hop headers, those the upstream's
    ``Connection`` header names (``connection_tokens``, see
    :func:`connection_tokens`) and those the relay's own server writes do not.
    """
    return _copy_headers(upstream_headers, _NOT_FORWARDED_TO_CLIENT | frozenset(connection_tokens))


def connection_tokens(response: IResponse) -> frozenset[bytes]:
    """
    The header names, lower-cased, that an upstream response's
    ``Connection`` header lists: hop-by-hop for that response alone
    (RFC 9110 7.6.1). Empty for a response the relay's own connection pool
    did not read.
    """
    return getattr(response, "_relay_connection_tokens", frozenset())


def _note_connection_tokens(response, parser):
    """
    Keep on ``response`` the tokens of its ``Connection`` header. Twisted's
    client parser files ``Connection`` among its connection headers
    (``HTTPClientParser.connHeaders``, a Twisted internal), apart from
    ``response.headers``: this is the one place that reads them. The tokens
    are also written back one per value, so that Twisted, which looks for a
    value that is exactly ``close``, sees ``Connection: close, x-foo`` too
    and does not keep a connection the upstream is closing.
    """
    tokens = frozenset(_connection_tokens(parser.connHeaders))
    if tokens:
        parser.connHeaders.setRawHeaders(b"connection", sorted(tokens))
    response._relay_connection_tokens = tokens
    return response


class _BodyReader(Protocol):
    """
    Collects a whole (non-streamed) upstream body, giving up when the
    upstream is silent for ``idle_timeout`` seconds.
    """

    def __init__(self, done: Deferred, clock, idle_timeout: float | None, deadline: float | None):
        self._done = done
        self._clock = clock
        self._idle_timeout = idle_timeout
        self._deadline = deadline
        self._chunks: list[bytes] = []
        self._last = clock.seconds()
        self._timer = None
        self._deadline_call = None

    def connectionMade(self) -> None:
        if self._idle_timeout:
            self._timer = self._clock.callLater(self._idle_timeout, self._check_idle)
        if self._deadline is not None:
            self._deadline_call = self._clock.callLater(
                max(0.0, self._deadline - self._clock.seconds()), self._too_long
            )

    def _too_long(self) -> None:
        self._deadline_call = None
        self.transport.stopProducing()
        self._fail(RelayError(504, "The request took longer than the relay's limit.", kind="total_timeout"))

    def dataReceived(self, data: bytes) -> None:
        self._chunks.append(data)
        if self._timer is not None:
            self._last = self._clock.seconds()

    def _check_idle(self) -> None:
        silent = self._clock.seconds() - self._last
        if silent < self._idle_timeout:
            self._timer = self._clock.callLater(self._idle_timeout - silent, self._check_idle)
            return
        self._timer = None
        self.transport.stopProducing()
        self._fail(
            RelayError(
                504,
                "The upstream sent no byte of its answer for %g seconds." % (self._idle_timeout,),
                kind="idle",
            )
        )

    def stop(self) -> None:
        """Stop reading: the client went away."""
        if self.transport is not None:
            self.transport.stopProducing()

    def connectionLost(self, reason) -> None:
        if self._done.called:
            return
        self._cancel_timer()
        if reason.check(ResponseDone, PotentialDataLoss):
            self._done.callback(b"".join(self._chunks))
        else:
            self._fail(
                RelayError(
                    502,
                    "The upstream's answer was cut off: %s." % (reason.type.__name__,),
                    kind="cut",
                )
            )

    def _fail(self, error: RelayError) -> None:
        self._cancel_timer()
        if not self._done.called:
            self._done.errback(error)

    def _cancel_timer(self) -> None:
        for timer in (self._timer, self._deadline_call):
            if timer is not None and timer.active():
                timer.cancel()
        self._timer = self._deadline_call = None


def read_body(
    response: IResponse, clock, idle_timeout: float | None, deadline: float | None = None
) -> "Deferred[bytes]":
    """
    Read a whole upstream body. Fails with a :class:`RelayError` when the
    upstream cuts it (502), goes silent for ``idle_timeout`` seconds, or is
    not done by ``deadline`` (a ``clock.seconds()`` value) (504); cancelling
    stops the upstream transport.
    """
    if response.length == 0:
        return succeed(b"")
    reader = None

    def cancel(d):
        reader.stop()

    d = Deferred(cancel)
    reader = _BodyReader(d, clock, idle_timeout, deadline)
    response.deliverBody(reader)
    return d


_TRANSFER_DECODERS = {b"chunked": CoalescingChunkedDecoder}


class _PauseLater(TransportProxyProducer):
    """
    The transport as a response's parser sees it, with its pause put off
    to the reactor's next run of timed calls.

    Twisted's parser pauses the transport once a response's headers are in,
    until the body is asked for; the relay always asks at once, in the same
    turn, so the pause and the resume cost two ``epoll_ctl`` calls for
    nothing. A pause still pending when the resume comes is dropped; one
    that is not resumed takes effect with the next timed calls (before the
    next read, unless the pause itself came from a timed call: then one read
    may come first, which the body's reader buffers). A resume always
    resumes, as Twisted's proxy does.
    """

    _pending = None

    def __init__(self, producer, clock):
        super().__init__(producer)
        self._clock = clock

    def pauseProducing(self):
        if self._pending is None and self._producer is not None:
            self._pending = self._clock.callLater(0, self._pause_now)

    def _pause_now(self):
        self._pending = None
        TransportProxyProducer.pauseProducing(self)

    def resumeProducing(self):
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        TransportProxyProducer.resumeProducing(self)


class _RelayClientProtocol(HTTP11ClientProtocol):
    """
    Twisted's HTTP/1.1 client connection, reading chunked bodies with the
    :class:`~twisted_relay.chunked.CoalescingChunkedDecoder` (one callback
    per read, not one per chunk) and pausing for a body only when it is not
    asked for at once (:class:`_PauseLater`).
    """

    def __init__(self, quiescentCallback, clock):
        super().__init__(quiescentCallback)
        self._clock = clock

    def request(self, request):
        d = super().request(request)
        parser = self._parser
        # (A request refused because another is in flight leaves that one's parser.)
        if parser is not None and self._currentRequest is request:
            # The parser picks its decoder once the headers are in, which is
            # never before this call returns: no response byte has been read.
            parser._transferDecoders = _TRANSFER_DECODERS
            self._transportProxy = parser.transport = _PauseLater(self.transport, self._clock)
            d.addCallback(_note_connection_tokens, parser)
        return d


class _QuietClientFactory(_HTTP11ClientFactory):
    """The pool's connection factory: no log line per connection, coalesced bodies."""

    noisy = False

    def __init__(self, quiescentCallback, metadata, clock):
        super().__init__(quiescentCallback, metadata)
        self._clock = clock

    def buildProtocol(self, addr):
        return _RelayClientProtocol(self._quiescentCallback, self._clock)


class _RelayConnectionPool(HTTPConnectionPool):
    """
    A persistent pool that never keeps a connection already being closed.

    When a client leaves in the reactor turn in which its upstream body
    ends, the relay closes that connection while Twisted's HTTP client,
    seeing a finished response, hands it back to the pool: the next
    request would be written on a closing socket and cut.
    """

    def __init__(self, reactor, persistent=True):
        super().__init__(reactor, persistent)
        self._factory = lambda callback, metadata: _QuietClientFactory(callback, metadata, reactor)

    def _putConnection(self, key, connection):
        if _closing(connection.transport):
            return
        super()._putConnection(key, connection)


def _closing(transport) -> bool:
    """
    Whether a connection's transport, or one it wraps, is closing. Over TLS
    the connection's transport is the TLS layer, which does not hear of a
    close asked of the TCP transport beneath it (``stopProducing``).
    """
    if transport is None:
        return True
    while transport is not None:
        if getattr(transport, "disconnecting", False) or getattr(transport, "_aborting", False):
            return True
        transport = getattr(transport, "transport", None)
    return False


class _UpstreamEndpoints:
    """
    The endpoint of each upstream host, made once and reused.

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

    def endpoint_for(self, scheme: bytes, host: bytes, port: int):
        """The endpoint of ``scheme://host:port``, made on first use."""
        key = (scheme, host, port)
        endpoint = self._made.get(key)
        if endpoint is None:
            endpoint = self._made[key] = self._make(*key)
        return endpoint

    def _make(self, scheme: bytes, host: bytes, port: int):
        try:
            name = host.decode("ascii")
        except UnicodeDecodeError:
            raise ValueError("The upstream host %r is not ASCII." % (host,))
        if isIPAddress(name):
            endpoint = TCP4ClientEndpoint(self._reactor, name, port, timeout=self._timeout)
        elif isIPv6Address(name):
            endpoint = TCP6ClientEndpoint(self._reactor, name, port, timeout=self._timeout)
        else:
            endpoint = HostnameEndpoint(self._reactor, name, port, timeout=self._timeout)
        if scheme == b"http":
            return endpoint
        if scheme == b"https":
            return wrapClientTLS(self._policy.creatorForNetloc(host, port), endpoint)
        raise SchemeNotSupported("Unsupported scheme: %r" % (scheme,))


@implementer(IBodyProducer)
class _BytesProducer:
    """
    A request body that is already in memory, written in one go.

    treq wraps bytes in a ``FileBodyProducer``, which hands them out in
    cooperator-scheduled chunks: latency for nothing when the body is whole.
    """

    def __init__(self, body: bytes):
        self._body = body
        self.length = len(body)

    def startProducing(self, consumer):
        consumer.write(self._body)
        return succeed(None)

    def stopProducing(self) -> None:
        pass

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass


class _UpstreamRequest(Request):
    """
    A request whose body is already in memory: request line, headers and
    body leave in one write (one send when nothing is buffered). Twisted's
    ``Request`` writes the headers, then hands the body to a producer through
    a length-checking consumer, with half a dozen Deferreds per request.
    """

    def __init__(self, method: bytes, uri: bytes, headers: Headers, body: bytes | None, host: bytes):
        # Twisted's constructor checks the method and the URI for bytes
        # that would break the request line.
        super().__init__(method, uri, headers, None, persistent=True)
        self._body = body
        self._host = None if headers.hasHeader(b"host") else host

    def writeTo(self, transport):
        lines = [self.method, b" ", self.uri, b" HTTP/1.1\r\n"]
        if self._host is not None:
            lines.extend((b"Host: ", self._host, b"\r\n"))
        body = self._body
        if body is not None:
            lines.append(b"Content-Length: %d\r\n" % (len(body),))
        elif self.method in (b"POST", b"PUT"):
            lines.append(b"Content-Length: 0\r\n")
        for name, values in self.headers.getAllRawHeaders():
            for value in values:
                lines.extend((name, b": ", value, b"\r\n"))
        lines.append(b"\r\n")
        # The head joined (a few hundred bytes), the body as it is: never copied.
        pieces = [b"".join(lines), body] if body else [b"".join(lines)]
        if not send_now(transport, pieces):
            transport.writeSequence(pieces)
        return succeed(None)

    def stopWriting(self) -> None:
        # Never called: writeTo has written everything when it returns.
        pass


def _host_value(scheme: bytes, host: bytes, port: int) -> bytes:
    """The ``Host`` header for an upstream, as Twisted's ``Agent`` computes it."""
    if isIPv6Address(host.decode("ascii", "replace")):
        host = b"[" + host + b"]"
    if (scheme, port) in ((b"http", 80), (b"https", 443)):
        return host
    return b"%b:%d" % (host, port)


class UpstreamClient:
    """
    Sends requests to the upstream over one persistent connection pool.

    :param reactor: the reactor (a ``MemoryReactorClock`` in tests).
    :param base_url: the upstream's base URL, e.g. ``https://api.anthropic.com``;
        may be set later (the embedded simulated upstream learns its port
        when it starts listening).
    """

    log = Logger()

    def __init__(
        self,
        reactor,
        base_url: str | None,
        *,
        connect_timeout: float = 10.0,
        response_timeout: float = 600.0,
        max_connections: int = 1024,
        agent=None,
    ):
        self._reactor = reactor
        self.base_url = base_url
        self.response_timeout = response_timeout
        self._pool = _RelayConnectionPool(reactor, persistent=True)
        self._pool.maxPersistentPerHost = max_connections
        # An idle upstream connection is kept for a while, but not for
        # as long as a typical load balancer keeps it (often 60 s):
        # reusing a connection the far end has already closed costs a retry.
        self._pool.cachedConnectionTimeout = 50
        # Requests go straight to the pool, not through treq's HTTPClient (a
        # relay must not keep a cookie jar shared by all its clients, nor
        # decode gzip it never asked for) nor even Twisted's Agent (which
        # parses the URL and builds an endpoint per request). ``agent``
        # replaces all that (tests pass one that talks to a resource in memory).
        self._endpoints = _UpstreamEndpoints(reactor, connect_timeout)
        self._agent = agent

    @property
    def base_url(self) -> str | None:
        """The upstream's base URL."""
        return self._base_url

    @base_url.setter
    def base_url(self, value: str | None) -> None:
        self._base_url = value.rstrip("/") if value else value
        self.display_url = display_url(self._base_url) if value else value
        self._route = None

    def _upstream(self) -> tuple:
        """The pool key, endpoint, ``Host`` value and path prefix of the base URL, worked out once."""
        route = self._route
        if route is None:
            parts = urlsplit(self._base_url)
            if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
                raise ValueError(
                    "the upstream URL %s may hold no user name, password, query or fragment"
                    % (self.display_url,)
                )
            scheme = parts.scheme.encode("ascii")
            host = (parts.hostname or "").encode("utf-8")
            port = parts.port or (443 if scheme == b"https" else 80)
            route = self._route = (
                (scheme, host, port),
                self._endpoints.endpoint_for(scheme, host, port),
                _host_value(scheme, host, port),
                parts.path,
            )
        return route

    def url_for(self, path_and_query: str) -> str:
        """The upstream URL for a client's path and query string."""
        return self._base_url + path_and_query

    def request(
        self,
        method: bytes,
        path_and_query: str,
        headers: Headers,
        body: bytes | None,
        timeout: float | None = None,
    ) -> "Deferred[IResponse]":
        """
        Send one request upstream; fire with its response once the headers
        have arrived, the body unread.

        Fails with a :class:`RelayError` that says what happened when the
        upstream cannot be reached (502) or sends no headers in time (504).
        Cancelling the returned Deferred aborts the upstream request.

        :param timeout: seconds to wait for the headers, if sooner than the
            client's ``response_timeout``.
        """
        if timeout is None or timeout > self.response_timeout:
            timeout = self.response_timeout
        timed_out = []
        if self._agent is not None:
            d = self._agent.request(
                method,
                self.url_for(path_and_query).encode("utf-8"),
                headers,
                None if body is None else _BytesProducer(body),
            )
        else:
            d = self._send(method, path_and_query, headers, body)

        def on_timeout() -> None:
            timed_out.append(True)
            d.cancel()

        timer = self._reactor.callLater(timeout, on_timeout)

        def done(result):
            if timer.active():
                timer.cancel()
            return result

        def failed(failure):
            if timed_out:
                raise RelayError(
                    504, "The upstream sent no response within %g seconds." % (timeout,), kind="timeout"
                )
            if _cancelled(failure):
                raise CancelledError("The request to the upstream was cancelled.")
            raise _relay_error_for(failure, self.display_url)

        d.addBoth(done)
        d.addErrback(failed)
        return d

    def _send(self, method: bytes, path_and_query: str, headers: Headers, body: bytes | None) -> Deferred:
        # A fragment is the client's own business, never sent (as Twisted's Agent did not).
        path_and_query = path_and_query.partition("#")[0]
        try:
            key, endpoint, host, prefix = self._upstream()
            request = _UpstreamRequest(method, (prefix + path_and_query).encode("utf-8"), headers, body, host)
        except (ValueError, SchemeNotSupported):
            return fail()
        d = self._pool.getConnection(key, endpoint)
        d.addCallback(lambda connection: connection.request(request))
        return d

    def close(self) -> Deferred:
        """Close the pooled connections; fires when they are closed."""
        return self._pool.closeCachedConnections()


def display_url(url: str) -> str:
    """A URL fit for logs and error messages: any ``user:password@`` removed."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = "%s:%d" % (host, parts.port)
    return parts._replace(netloc=host).geturl()


def _cancelled(failure) -> bool:
    """Whether a request failed because it was cancelled (the client left)."""
    if failure.check(CancelledError, ConnectingCancelledError):
        return True
    if failure.check(ResponseNeverReceived):
        return any(reason.check(CancelledError) for reason in failure.value.reasons)
    return False


def _tls_failure(failure) -> str | None:
    """What went wrong in a TLS handshake behind ``failure``, in a few words, if that is what failed."""
    try:
        from OpenSSL.SSL import Error as TLSError
    except ImportError:  # pragma: no cover - twisted[tls] is a dependency
        return None
    reasons = [failure]
    if failure.check(ResponseNeverReceived, ResponseFailed):
        reasons.extend(failure.value.reasons)
    for reason in reasons:
        if reason.check(TLSError):
            details = reason.value.args[0] if reason.value.args else None
            if isinstance(details, list) and details and isinstance(details[-1], tuple):
                return str(details[-1][-1])
            return str(reason.value) or "the handshake failed"
    return None


def _clause(message: str) -> str:
    """An exception's message fit to end a sentence of ours: its own final periods dropped."""
    return message.strip().rstrip(".")


def _relay_error_for(failure, base_url: str) -> RelayError:
    """Turn a connection-level failure into the error a client sees."""
    tls = _tls_failure(failure)
    if tls is not None:
        # Not retried: a certificate that does not verify will not verify next time.
        return RelayError(
            502, "The TLS handshake with the upstream at %s failed: %s." % (base_url, tls), kind="tls"
        )
    if failure.check(TimeoutError):
        return RelayError(
            504, "Timed out connecting to the upstream at %s." % (base_url,), kind="connect"
        )
    if failure.check(DNSLookupError):
        return RelayError(
            502, "Could not resolve the upstream host of %s." % (base_url,), kind="connect"
        )
    if failure.check(ConnectError):
        return RelayError(
            502,
            "Could not connect to the upstream at %s: %s."
            % (base_url, _clause(failure.getErrorMessage()) or failure.type.__name__),
            kind="connect",
        )
    if failure.check(ResponseNeverReceived):
        return RelayError(
            502,
            "The upstream at %s closed the connection before answering." % (base_url,),
            kind="dropped",
        )
    if failure.check(ResponseFailed):
        # Its reasons are Failures, whose text is a Python repr: say it in words.
        return RelayError(
            502,
            "The upstream at %s broke off its answer before its headers were complete, or sent a "
            "header line longer than the relay reads (%d bytes)." % (base_url, HTTPParser.MAX_LENGTH),
            kind="failed",
        )
    return RelayError(
        502,
        "The request to the upstream at %s failed: %s."
        % (base_url, _clause(failure.getErrorMessage()) or failure.type.__name__),
        kind="failed",
    )
