# -*- test-case-name: tests.test_upstream -*-
"""
The upstream side: one client (one persistent connection pool) per
upstream, requests sent with timeouts, whole bodies read, connection
failures said in words, and the upstream URL rules (the base URL, paths
that would leave it).

What treq runs on is in :mod:`twisted_relay.upstream_agent`, the header
rules in :mod:`twisted_relay.upstream_headers`. This module knows Twisted's
HTTP client; it knows nothing of tool-use ids or SSE.
"""

from __future__ import annotations

from urllib.parse import unquote_to_bytes, urlsplit

from twisted.internet.defer import CancelledError, Deferred, DeferredList, fail, succeed
from twisted.internet.error import ConnectError, ConnectingCancelledError, DNSLookupError, TimeoutError
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.web.client import ResponseDone, ResponseFailed, ResponseNeverReceived
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse
from hyperlink import EncodedURL
from treq.client import HTTPClient

from twisted_relay import _twisted
from twisted_relay.chunked import CoalescingChunkedDecoder
from twisted_relay.errors import RelayError
from twisted_relay.logins import LoginThreads, login_for
from twisted_relay.upstream_agent import (
    BytesProducer,
    NoCookies,
    PooledAgent,
    PreparedURL,
    UpstreamEndpoints,
    UpstreamTimer,
)
from twisted_relay.wires import wire_for

__all__ = [
    "display_url",
    "path_escapes",
    "read_body",
    "UpstreamClient",
    "UpstreamClients",
]


class _BodyReader(Protocol):
    """
    Collects a whole (non-streamed) upstream body, giving up when the
    upstream is silent for ``idle_timeout`` seconds.
    """

    def __init__(self, done: Deferred, clock, idle_timeout: float | None):
        self._done = done
        self._clock = clock
        self._idle_timeout = idle_timeout
        self._chunks: list[bytes] = []
        self._last = clock.seconds()
        self._timer = None

    def connectionMade(self) -> None:
        if self._idle_timeout:
            self._timer = UpstreamTimer(self._clock, self._idle_timeout, self._check_idle)

    def dataReceived(self, data: bytes) -> None:
        self._chunks.append(data)
        if self._timer is not None:
            self._last = self._clock.seconds()

    def _check_idle(self) -> None:
        silent = self._clock.seconds() - self._last
        if silent < self._idle_timeout:
            self._timer = UpstreamTimer(self._clock, self._idle_timeout - silent, self._check_idle)
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
        """Stop reading: the client went away, or the request's deadline came."""
        self._cancel_timer()
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
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None


def read_body(
    response: IResponse, clock, idle_timeout: float | None
) -> "Deferred[bytes]":
    """
    Read a whole upstream body. Fails with a :class:`RelayError` when the
    upstream cuts it (502) or goes silent for ``idle_timeout`` seconds (504);
    cancelling (the client left, or the request's deadline came) stops the
    upstream transport.
    """
    if response.length == 0:
        return succeed(b"")
    reader = None

    def cancel(d):
        reader.stop()

    d = Deferred(cancel)
    reader = _BodyReader(d, clock, idle_timeout)
    response.deliverBody(reader)
    return d


# Prepared URLs kept, by path and query (a relay sees a few distinct ones).
_MAX_PREPARED = 256


class UpstreamClient:
    """
    Sends requests to the upstream through a ``treq.HTTPClient`` over one
    persistent connection pool.

    treq is set up as a relay needs it: no cookie kept or sent (a jar that
    takes none), no redirect followed (the client sees the upstream's 3xx),
    no compression asked for, and bodies not buffered (``unbuffered=True``:
    the answer streams to whoever ``deliverBody`` is given).

    :param reactor: the reactor (a ``MemoryReactorClock`` in tests).
    :param base_url: the upstream's base URL, e.g. ``https://api.anthropic.com``;
        may be set later (the embedded simulated upstream learns its port
        when it starts listening).
    :param endpoint_factory: an ``IAgentEndpointFactory`` for the upstream's
        connections; :class:`UpstreamEndpoints` (TCP, TLS) when ``None``.
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
        endpoint_factory=None,
        wire=None,
        login=None,
    ):
        self._reactor = reactor
        #: How requests are sent to this upstream and answers read back
        #: (:class:`~twisted_relay.wires.Wire`); ``None``: Anthropic's own.
        self.wire = wire
        #: How the relay logs in to it (:class:`~twisted_relay.logins.Login`);
        #: ``None``: a key in ``x-api-key``, or the client's own.
        self.login = login
        self.base_url = base_url
        self.response_timeout = response_timeout
        self._pool = _twisted.connection_pool(reactor, CoalescingChunkedDecoder)
        self._pool.maxPersistentPerHost = max_connections
        # An idle upstream connection is kept for a while, but not for
        # as long as a typical load balancer keeps it (often 60 s):
        # reusing a connection the far end has already closed costs a retry.
        self._pool.cachedConnectionTimeout = 50
        if endpoint_factory is None:
            endpoint_factory = UpstreamEndpoints(reactor, connect_timeout)
        self._no_cookies = NoCookies()
        self._http = HTTPClient(
            PooledAgent(reactor, self._pool, endpoint_factory),
            cookiejar=self._no_cookies,
            data_to_body_producer=BytesProducer,
        )

    @property
    def base_url(self) -> str | None:
        """The upstream's base URL."""
        return self._base_url

    @base_url.setter
    def base_url(self, value: str | None) -> None:
        self._base_url = value.rstrip("/") if value else value
        self.display_url = display_url(self._base_url) if value else value
        self._checked = False
        self._prepared: dict[str, PreparedURL] = {}

    def url_for(self, path_and_query: str) -> str:
        """The upstream URL for a client's path and query string."""
        if not self._checked:
            parts = urlsplit(self._base_url)
            if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
                raise ValueError(
                    "the upstream URL %s may hold no user name, password, query or fragment"
                    % (self.display_url,)
                )
            self._checked = True
        return self._base_url + path_and_query

    def wire_url(self, path_and_query: str) -> str:
        """The upstream URL for ``path_and_query`` exactly as it goes on the wire (what a signature covers)."""
        return self._prepared_url(path_and_query).uri_text

    def _prepared_url(self, path_and_query: str) -> PreparedURL:
        """The upstream URL for ``path_and_query`` as a URI, made once per path."""
        url = self._prepared.get(path_and_query)
        if url is None:
            text = EncodedURL.from_text(self.url_for(path_and_query)).to_uri().to_text()
            url = PreparedURL.of(text)
            if len(self._prepared) >= _MAX_PREPARED:
                self._prepared.clear()
            self._prepared[path_and_query] = url
        return url

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
        try:
            d = self._http.request(
                method.decode("ascii"),
                self._prepared_url(path_and_query),
                headers=headers,
                data=body,
                allow_redirects=False,
                unbuffered=True,
                # A jar, not None: treq makes a new empty jar for None on every request.
                cookies=self._no_cookies,
            )
        except Exception:
            d = fail()

        def on_timeout() -> None:
            timed_out.append(True)
            d.cancel()

        # Judged once the reactor has read what arrived: headers that came
        # while the relay itself was busy are not "no response".
        timer = UpstreamTimer(self._reactor, timeout, on_timeout)

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
        d.addCallbacks(_without_empty_encoding, failed)
        return d

    def close(self) -> Deferred:
        """Close the pooled connections; fires when they are closed."""
        return self._pool.closeCachedConnections()

    def retire(self) -> Deferred:
        """
        This client is no longer used (a reload removed or changed its
        upstream): its idle connections close now, and those of requests in
        flight when their answers end. Fires when the idle ones are closed.
        """
        if self.login is not None:
            self.login.stop()
        return _twisted.retire_pool(self._pool)


#: How many rounds of percent-decoding a path segment is checked through
#: (a server that decodes twice still sees no dot segment).
DECODING_ROUNDS = 3


def path_escapes(uri: bytes) -> bool:
    """
    Whether the path of ``uri`` holds a segment that is not plainly one
    segment: ``.`` or ``..``, or one holding ``/`` or ``\\`` once
    percent-decoded (up to :data:`DECODING_ROUNDS` times), or a backslash
    as it is. Any of these can take a request, signed with the relay's
    upstream key, outside the upstream's base path.
    """
    path = uri.partition(b"?")[0].partition(b"#")[0]
    if b"." not in path and b"%" not in path and b"\\" not in path:
        return False
    for segment in path.split(b"/"):
        for _ in range(DECODING_ROUNDS + 1):
            if segment in (b".", b"..") or b"\\" in segment:
                return True
            if b"%" not in segment:
                break
            segment = unquote_to_bytes(segment)
            if b"/" in segment:
                return True
    return False


def _without_empty_encoding(response: IResponse) -> IResponse:
    """
    The response without the empty ``Content-Encoding`` that treq's decoding
    agent leaves on every answer that had none.
    """
    if response.headers.getRawHeaders(b"content-encoding") == [b""]:
        response.headers.removeHeader(b"content-encoding")
    return response


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
            "header line longer than the relay reads (%d bytes)." % (base_url, _twisted.HEADER_LINE_LIMIT),
            kind="failed",
        )
    return RelayError(
        502,
        "The request to the upstream at %s failed: %s."
        % (base_url, _clause(failure.getErrorMessage()) or failure.type.__name__),
        kind="failed",
    )


class UpstreamClients:
    """
    One :class:`UpstreamClient` (one connection pool) per configured
    upstream, each with its own timeouts and connection limit
    (:meth:`~twisted_relay.config.RelayConfig.settings_for`).

    :param reactor: the reactor.
    :param config: the relay's configuration.
    :param endpoint_factory: as for :class:`UpstreamClient` (tests).
    :param simulated: the upstream whose URL is learnt later (the embedded
        simulated upstream's): its client starts without one.
    """

    def __init__(self, reactor, config, *, endpoint_factory=None, simulated: str | None = None, _kept=None,
                 login_threads=None):
        self._reactor = reactor
        self._login_threads = login_threads if login_threads is not None else LoginThreads(reactor)
        self._endpoint_factory = endpoint_factory
        self._simulated = simulated
        self._clients: dict[str, UpstreamClient] = {}
        self._settings: dict[str, tuple] = {}
        kept = _kept or {}
        for upstream in config.upstreams:
            settings = _client_settings(config.settings_for(upstream))
            old = kept.get(upstream.name)
            if old is not None and old[0] == settings:
                self._clients[upstream.name] = old[1]
            else:
                url, connect_timeout, response_timeout, max_connections = settings[:4]
                self._clients[upstream.name] = UpstreamClient(
                    reactor,
                    None if upstream.name == simulated else url,
                    connect_timeout=connect_timeout,
                    response_timeout=response_timeout,
                    max_connections=max_connections,
                    endpoint_factory=endpoint_factory,
                    wire=wire_for(upstream, reactor),
                    login=login_for(upstream, reactor, self._login_threads),
                )
            self._settings[upstream.name] = settings

    def __getitem__(self, name: str) -> UpstreamClient:
        return self._clients[name]

    def __iter__(self):
        return iter(self._clients)

    def items(self):
        return self._clients.items()

    def reconfigured(self, config) -> "tuple[UpstreamClients, list[UpstreamClient]]":
        """
        The clients for a new configuration: those of upstreams whose URL,
        timeouts and connection limit did not change are kept; the others
        are made anew. Also gives the clients no longer used, to close
        (:meth:`UpstreamClient.close` closes idle connections only: a
        request in flight finishes where it is).
        """
        kept = {name: (self._settings[name], client) for name, client in self._clients.items()}
        following = UpstreamClients(
            self._reactor, config, endpoint_factory=self._endpoint_factory, simulated=self._simulated, _kept=kept,
            login_threads=self._login_threads,
        )
        used = {id(client) for _, client in following.items()}
        return following, [c for c in self._clients.values() if id(c) not in used]

    def start_logins(self) -> Deferred:
        """
        Get every upstream's first credentials (at start, before the relay
        listens; after a reload, for the upstreams it made anew). Fails with
        the first :class:`~twisted_relay.logins.LoginError`.
        """
        # The embedded simulated cloud's login starts when first asked: its
        # URL (and its token endpoint) is known once it listens.
        started = [client.login.start() for client in self._clients.values()
                   if client.login is not None and client.base_url is not None]
        return DeferredList(started, fireOnOneErrback=True, consumeErrors=True).addErrback(_first_failure)

    def close(self) -> Deferred:
        """Close every pool's connections and stop refreshing logins; fires when the connections are closed."""
        for client in self._clients.values():
            if client.login is not None:
                client.login.stop()
        self._login_threads.stop()
        return DeferredList([client.close() for client in self._clients.values()], consumeErrors=True)


def _first_failure(failure):
    """The failure inside a ``DeferredList``'s ``FirstError``."""
    return failure.value.subFailure


def _client_settings(upstream) -> tuple:
    return (
        upstream.url, upstream.connect_timeout, upstream.response_timeout, upstream.max_connections,
        upstream.wire, upstream.login, upstream.region, upstream.project, upstream.models,
        upstream.service_tier, upstream.anthropic_version, upstream.headers, upstream.dialect,
    )
