# -*- test-case-name: tests.test_twisted -*-
"""
Every use of a private Twisted name, in one place, each one guarded.

The relay leans on five of Twisted's internals where no public API does the
job, each for a measured gain; docs/architecture.md ("Twisted internals in
one place, guarded") says what each buys and what its public fallback costs:
``write_through`` (:func:`send_now`: a write sent at once when nothing is
buffered), ``pool_hooks`` (the upstream pool's connections built by the
relay's factory, never pooled again while closing), ``coalescing_decoder``
(chunked upstream bodies read with the decoder the pool is given: one
callback per read), ``one_send_request`` (a request whose body is in memory
written in one send) and ``connection_header`` (the tokens of an upstream's
``Connection`` header, whose headers are then not passed on).

Not at import but once, by :func:`activate` (when the relay's service
starts, or on the first use of what needs it), each assumption is checked
by name and by behaviour (a probe drives the very code path on in-memory
transports). One that does not hold is switched off with one log line
(:data:`COST_WHEN_OFF`), and the relay takes Twisted's public path instead.
``tests.test_twisted`` asserts every assumption on the Twisted the suite
runs on, and runs the relay with all of them switched off.

This module imports nothing of the relay's: it is the bottom layer, and the
relay's own pieces (the chunked decoder) are given to it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields

from twisted.internet import abstract, tcp
from twisted.internet.defer import Deferred, succeed
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactor, StringTransport
from twisted.logger import Logger
from twisted.web import client as _client
from twisted.web import http as _http
from twisted.web.http_headers import Headers

__all__ = [
    "COST_WHEN_OFF", "DataLoss", "MalformedChunkedData", "TwistedChunkedDecoder", "activate", "active",
    "closing", "connection_pool", "one_send_request", "probe", "raise_listen_errors", "retire_pool",
    "send_now", "use",
]  # fmt: skip

_log = Logger(namespace="twisted_relay._twisted")

# Twisted's chunked decoder and the errors its client parser tells apart: a
# body cut before its last chunk must raise Twisted's own ``_DataLoss`` for
# the response to fail as cut. Without them the relay uses Twisted's decoder.
TwistedChunkedDecoder = getattr(_http, "_ChunkedTransferDecoder", None)
DataLoss = getattr(_http, "_DataLoss", None)
MalformedChunkedData = getattr(_http, "_MalformedChunkedDataError", None)
if DataLoss is None:  # pragma: no cover - only on a Twisted without it

    class DataLoss(Exception):  # type: ignore[no-redef]
        """Stands in for Twisted's ``_DataLoss`` (the coalescing decoder is then off)."""


if MalformedChunkedData is None:  # pragma: no cover - only on a Twisted without it

    class MalformedChunkedData(ValueError):  # type: ignore[no-redef]
        """Stands in for Twisted's ``_MalformedChunkedDataError``."""


try:
    from twisted.web._newclient import HTTP11ClientProtocol as _HTTP11ClientProtocol
    from twisted.web._newclient import HTTPClientParser as _HTTPClientParser
    from twisted.web._newclient import Request as _Request
except ImportError:  # pragma: no cover - only on a Twisted without them
    _HTTP11ClientProtocol = _HTTPClientParser = _Request = None

#: The longest header line Twisted's HTTP client reads (for error messages).
HEADER_LINE_LIMIT = getattr(_HTTPClientParser, "MAX_LENGTH", 16384)

_HTTP11ClientFactory = getattr(_client, "_HTTP11ClientFactory", None)


@dataclass
class Assumptions:
    """Which of the relay's uses of Twisted internals hold (see the module docstring)."""

    write_through: bool = False
    pool_hooks: bool = False
    coalescing_decoder: bool = False
    one_send_request: bool = False
    connection_header: bool = False

    def off(self) -> list[str]:
        """The names of the assumptions that do not hold."""
        return [f.name for f in fields(self) if not getattr(self, f.name)]


# -- write-through -------------------------------------------------------------

_PLAIN_TCP = (tcp.Server, tcp.Client)
# Pieces sent by one sendmsg before they are joined (the kernel's limit is 1024).
_MAX_PIECES = 64
_write_through = False


def send_now(transport, iovec) -> bool:
    """
    Send ``iovec`` (a list or tuple of bytes) on a plain TCP ``transport``
    whose buffer is empty, in one ``sendmsg`` (no join); what the socket does
    not take goes to the transport's buffer. Returns whether ``iovec`` was
    taken; when not (TLS, a UNIX socket, data already waiting, a closing
    connection, or the assumption switched off) the caller writes it to the
    transport as usual.
    """
    # Off, or not decided yet: then decided now, once.
    if not _write_through and (_activated or not activate().write_through):
        return False
    if (
        type(transport) not in _PLAIN_TCP
        or transport.TLS
        or not transport.connected
        or transport.disconnecting
        or transport._aborting
        or transport._writeDisconnected
        or transport._tempDataLen
        or transport.offset != len(transport.dataBuffer)
    ):
        return False
    if type(iovec) not in (list, tuple) or len(iovec) > _MAX_PIECES:
        iovec = [b"".join(iovec)]
    total = sum(map(len, iovec))
    if not total:
        return True
    try:
        sent = transport.socket.sendmsg(iovec)
    except BlockingIOError:
        sent = 0
    except OSError:
        # Twisted's own write meets the error again and closes the connection.
        transport.writeSequence(iovec)
        return True
    if sent < total:
        # Leave the rest to the transport, copying only the piece cut in two.
        for i, piece in enumerate(iovec):
            if sent < len(piece):
                transport.writeSequence([piece[sent:], *iovec[i + 1 :]])
                break
            sent -= len(piece)
    return True


def _probe_write_through() -> str | None:
    """
    ``send_now`` judges "nothing buffered" by ``_tempDataLen == 0`` and
    ``offset == len(dataBuffer)``: check that these are exactly the bytes a
    ``FileDescriptor`` holds back, through ``write`` and a partial ``doWrite``.
    """
    for cls in _PLAIN_TCP:
        for name in ("TLS", "_aborting", "_writeDisconnected", "dataBuffer", "offset", "write", "doWrite"):
            if not _has(cls, name):
                return "%s.%s is gone" % (cls.__name__, name)
    if _hidden & {"_tempDataLen", "socket"}:
        return "FileDescriptor._tempDataLen or Connection.socket is hidden"
    if "self.socket" not in inspect.getsource(tcp.Connection.__init__):
        return "tcp.Connection does not keep its socket as .socket"

    taken: list[int] = []

    class Probe(abstract.FileDescriptor):
        def writeSomeData(self, data):
            n = taken.pop(0)
            return n

    def pending(fd) -> int:
        return fd._tempDataLen + len(fd.dataBuffer) - fd.offset

    fd = Probe(reactor=MemoryReactor())
    fd.connected = 1
    if pending(fd) != 0 or fd._writeDisconnected:
        return "a new descriptor does not look empty"
    fd.write(b"abc")
    fd.write(b"de")
    if pending(fd) != 5:
        return "written bytes are not counted in _tempDataLen"
    taken.append(2)
    fd.doWrite()
    if pending(fd) != 3 or fd.offset == len(fd.dataBuffer):
        return "a partial send is not kept as dataBuffer[offset:]"
    taken.append(3)
    fd.doWrite()
    if pending(fd) != 0 or fd._tempDataLen or fd.offset != len(fd.dataBuffer):
        return "an emptied buffer does not look empty"
    return None


# -- the upstream connection pool ----------------------------------------------


def closing(transport) -> bool:
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


_pool_hooks = False
_coalescing_decoder = False
_one_send_request = False
_connection_header = False


def _note_connection(response, parser):
    """
    Keep on ``response`` (as ``relay_connection_tokens``) the tokens of its
    ``Connection`` header, and write them back one per value (see the
    module docstring, ``connection_header``).
    """
    tokens = frozenset(
        token
        for value in parser.connHeaders.getRawHeaders(b"connection", [])
        for token in (part.strip().lower() for part in value.split(b","))
        if token
    )
    if tokens:
        parser.connHeaders.setRawHeaders(b"connection", sorted(tokens))
    response.relay_connection_tokens = tokens
    return response


if _HTTP11ClientProtocol is not None and _HTTP11ClientFactory is not None:

    class _RelayClientProtocol(_HTTP11ClientProtocol):
        """
        Twisted's HTTP/1.1 client connection, reading chunked bodies with the
        coalescing decoder (one callback per read, not one per chunk).
        """

        _decoders = None

        def connectionLost(self, reason):
            # Twisted's lost TCP connection (under TLS, the one beneath) and its connector refer to each
            # other, as do the connector and its endpoint's factory: cut, so no full collection is needed.
            tcp_transport = self.transport
            super().connectionLost(reason)
            while tcp_transport is not None and getattr(tcp_transport, "connector", None) is None:
                tcp_transport = getattr(tcp_transport, "transport", None)
            connector = getattr(tcp_transport, "connector", None)
            if getattr(connector, "transport", None) is tcp_transport is not None:
                connector.transport = None  # as Twisted does when a connection fails
                if getattr(connector.factory, "_connector", None) is connector and "_connector" not in _hidden:
                    connector.factory._connector = None

        def request(self, request):
            d = super().request(request)
            decoders = self._decoders
            parser = self._parser
            # (A request refused because another is in flight leaves that one's parser.)
            if parser is not None and self._currentRequest is request:
                if decoders is not None:
                    # The parser picks its decoder once the headers are in, which is
                    # never before this call returns: no response byte has been read.
                    parser._transferDecoders = decoders
                if _connection_header:
                    d.addCallback(_note_connection, parser)
            return d

    class _QuietClientFactory(_HTTP11ClientFactory):
        """The pool's connection factory: no log line per connection."""

        noisy = False
        decoders = None

        def buildProtocol(self, addr):
            protocol = _RelayClientProtocol(self._quiescentCallback)
            protocol._decoders = self.decoders
            return protocol

    class _RelayConnectionPool(_client.HTTPConnectionPool):
        """
        A persistent pool that never keeps a connection already being closed.

        When a client leaves in the reactor turn in which its upstream body
        ends, the relay closes that connection while Twisted's HTTP client,
        seeing a finished response, hands it back to the pool: the next
        request would be written on a closing socket and cut.
        """

        def __init__(self, reactor, persistent=True, decoders=None):
            super().__init__(reactor, persistent)

            def factory(callback, metadata):
                made = _QuietClientFactory(callback, metadata)
                made.decoders = decoders
                return made

            self._factory = factory

        retired = False

        def _putConnection(self, key, connection):
            if closing(connection.transport):
                return
            if self.retired:
                connection.transport.loseConnection()
                return
            super()._putConnection(key, connection)

else:  # pragma: no cover - only on a Twisted without them
    _RelayConnectionPool = None


def connection_pool(reactor, chunked_decoder=None):
    """
    The upstream connection pool: the relay's own when ``pool_hooks`` hold,
    else Twisted's.

    :param chunked_decoder: a drop-in for Twisted's ``_ChunkedTransferDecoder``
        (the relay's coalescing decoder) to read chunked bodies with, when
        ``coalescing_decoder`` holds too; Twisted's own otherwise, or when ``None``.
    """
    activate()
    if _pool_hooks:
        decoders = {b"chunked": chunked_decoder} if _coalescing_decoder and chunked_decoder is not None else None
        return _RelayConnectionPool(reactor, persistent=True, decoders=decoders)
    return _client.HTTPConnectionPool(reactor, persistent=True)


def retire_pool(pool) -> Deferred:
    """
    Close a pool's idle connections now, and each busy one when its answer
    ends (with the relay's own pool; Twisted's keeps those until its
    cached-connection timeout). Fires when the idle ones are closed.
    """
    pool.retired = True
    return pool.closeCachedConnections()


if _Request is not None:

    class _OneSendRequest(_Request):
        """
        A request whose body is already in memory: request line, headers and
        body leave in one write (one send when nothing is buffered).
        """

        def __init__(self, method: bytes, uri: bytes, headers, body: bytes | None, host: bytes | None):
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
            # _write_through first: a probe writes here before activate() has decided,
            # and send_now would then activate (probe) again.
            if not (_write_through and send_now(transport, pieces)):
                transport.writeSequence(pieces)
            return succeed(None)

        def stopWriting(self) -> None:
            # Never called: writeTo has written everything when it returns.
            pass


def one_send_request(method: bytes, uri: bytes, headers, body: bytes | None, host: bytes):
    """
    A request for a pooled connection's ``request()`` that writes itself in
    one send, or ``None`` when ``one_send_request`` does not hold (the caller
    then sends through Twisted's ``Agent``).
    """
    if not _activated:
        activate()
    if not _one_send_request:
        return None
    return _OneSendRequest(method, uri, headers, body, host)


class _Collect(Protocol):
    """A body reader for the probes."""

    def __init__(self):
        self.data: list[bytes] = []
        self.reason = None

    def dataReceived(self, data):
        self.data.append(data)

    def connectionLost(self, reason):
        self.reason = reason


def _exchange(pool_decoders, request, answer: bytes, responses=None):
    """
    Drive one request and answer through a connection of the relay's pool
    (on an in-memory transport); return the bytes sent, the body's parts as
    read, the body's end, the connection, and the connections the pool took
    back through ``_putConnection``. ``responses`` receives the response.
    """
    taken_back = []

    class Pool(_RelayConnectionPool):
        def _putConnection(self, key, connection):
            taken_back.append(connection)
            super()._putConnection(key, connection)

    pool = Pool(Clock(), persistent=True, decoders=pool_decoders)
    transport = StringTransport()
    made = []

    class Endpoint:
        def connect(self, factory):
            protocol = factory.buildProtocol(None)
            protocol.makeConnection(transport)
            made.append(protocol)
            return succeed(protocol)

    if responses is None:
        responses = []
    pool.getConnection(("probe",), Endpoint()).addCallback(lambda connection: connection.request(request)).addBoth(
        responses.append
    )
    made[0].dataReceived(answer)
    collect = _Collect()
    response = responses[0]
    if not hasattr(response, "deliverBody"):
        raise AssertionError("no response: %r" % (response,))
    response.deliverBody(collect)
    pool.closeCachedConnections()
    return transport.value(), collect.data, collect.reason, made[0], taken_back


def _probe_get():
    """A plain ``GET /`` for the probes."""
    return _Request(b"GET", b"/", Headers({b"host": [b"probe"]}), None, persistent=True)


def _probe_pool_hooks() -> str | None:
    if _RelayConnectionPool is None or _Request is None or "_HTTP11ClientFactory" in _hidden:
        return "twisted.web._newclient or _HTTP11ClientFactory is gone"
    pool_init = inspect.signature(_client.HTTPConnectionPool.__init__).parameters
    if "reactor" not in pool_init or not _has(_client.HTTPConnectionPool, "_putConnection"):
        return "HTTPConnectionPool has no _putConnection"
    factory = _client.HTTPConnectionPool._factory if _has(_client.HTTPConnectionPool, "_factory") else None
    if factory is not _HTTP11ClientFactory:
        return "HTTPConnectionPool._factory is not _HTTP11ClientFactory"
    if not _has(_HTTP11ClientFactory(None, None), "_quiescentCallback"):
        return "_HTTP11ClientFactory keeps no _quiescentCallback"
    request = _probe_get()
    sent, data, reason, protocol, taken_back = _exchange(
        None, request, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    )
    if type(protocol) is not _RelayClientProtocol:
        return "the pool does not build connections with _factory"
    if not sent.startswith(b"GET / HTTP/1.1\r\n") or b"".join(data) != b"ok":
        return "a request through the relay's pool was not exchanged"
    if taken_back != [protocol]:
        return "a finished connection is not given back through _putConnection"
    if not reason.check(_client.ResponseDone):
        return "the body did not end with ResponseDone"
    return None


def _probe_coalescing_decoder() -> str | None:
    if TwistedChunkedDecoder is None or not _has(_http, "_DataLoss") or "_ChunkedTransferDecoder" in _hidden:
        return "twisted.web.http's chunked decoder or _DataLoss is gone"
    if (
        _HTTPClientParser is None
        or not _has(_HTTPClientParser, "_transferDecoders")
        or _HTTPClientParser._transferDecoders.get(b"chunked") is not TwistedChunkedDecoder
    ):
        return "HTTPClientParser._transferDecoders is not the decoder table"
    if _hidden & {"_parser", "_currentRequest"}:
        return "HTTP11ClientProtocol._parser or _currentRequest is hidden"
    try:
        TwistedChunkedDecoder(lambda data: None, lambda rest: None).noMoreData()
        raised = None
    except Exception as e:
        raised = e
    if not isinstance(raised, DataLoss):
        return "Twisted's decoder does not raise _DataLoss for a cut body"
    used = []

    class Marked(TwistedChunkedDecoder):
        def __init__(self, *args):
            used.append(True)
            super().__init__(*args)

    request = _probe_get()
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    sent, data, reason, protocol, taken_back = _exchange({b"chunked": Marked}, request, answer)
    if not used or b"".join(data) != b"abcde":
        return "the client parser did not read the body with the decoder the relay set"
    if not reason.check(_client.ResponseDone):
        return "a chunked body read with the decoder the relay set did not end with ResponseDone"
    return None


def _probe_one_send_request() -> str | None:
    if _Request is None or _RelayConnectionPool is None or "_newclient.Request" in _hidden:
        return "twisted.web._newclient.Request is gone"
    request = _OneSendRequest(b"POST", b"/p?q=1", Headers({b"x-a": [b"1"]}), b"body", b"probe")
    sent, data, reason, protocol, taken_back = _exchange(
        None, request, b"HTTP/1.1 201 Created\r\nContent-Length: 1\r\n\r\nx"
    )
    expected = b"POST /p?q=1 HTTP/1.1\r\nHost: probe\r\nContent-Length: 4\r\nX-A: 1\r\n\r\nbody"
    if sent != expected:
        return "the request was not written by writeTo as it is (%r)" % (sent,)
    if data != [b"x"] or not reason.check(_client.ResponseDone):
        return "the answer to a one-send request was not read"
    return None


def _probe_connection_header() -> str | None:
    if _HTTPClientParser is None or "connHeaders" in _hidden:
        return "HTTPClientParser keeps no connHeaders"
    global _connection_header
    before, _connection_header = _connection_header, True
    try:
        request = _probe_get()
        responses = []
        answer = b"HTTP/1.1 200 OK\r\nConnection: close, X-Hop\r\nX-Hop: 1\r\nContent-Length: 1\r\n\r\nx"
        sent, data, reason, protocol, taken_back = _exchange(None, request, answer, responses)
    finally:
        _connection_header = before
    response = responses[0]
    if getattr(response, "relay_connection_tokens", None) != frozenset({b"close", b"x-hop"}):
        return "the Connection header's tokens were not found in connHeaders"
    if response.headers.getRawHeaders(b"x-hop") != [b"1"] or response.headers.hasHeader(b"connection"):
        return "Twisted no longer keeps Connection apart from the response's headers"
    if taken_back:
        return "a connection answered with Connection: close, ... was pooled again"
    return None


# -- the listening ports ---------------------------------------------------------


def raise_listen_errors(service) -> None:
    """
    Make a ``StreamServerEndpointService`` fail its start when it cannot
    listen (a port in use stops ``twistd`` with the error at once), as
    ``twistd``'s own ``--port`` services do, through the service's
    ``_raiseSynchronously``; where Twisted has no such attribute, the error
    is logged as Twisted logs it (the relay then serves on no port).
    """
    if "_raiseSynchronously" in _hidden or not hasattr(type(service), "_raiseSynchronously"):
        _log.warn("Twisted internals: a listening error will be logged, not raised at start")
        return
    service._raiseSynchronously = True


# -- checking and choosing ----------------------------------------------------

_PROBES = {
    "write_through": _probe_write_through,
    "pool_hooks": _probe_pool_hooks,
    "coalescing_decoder": _probe_coalescing_decoder,
    "one_send_request": _probe_one_send_request,
    "connection_header": _probe_connection_header,
}
_NEEDS = {"coalescing_decoder": "pool_hooks", "one_send_request": "pool_hooks", "connection_header": "pool_hooks"}


#: Every private Twisted name the relay uses (``probe(hide=...)`` takes these).
PRIVATE_NAMES = frozenset(
    {
        "_aborting", "_writeDisconnected", "_tempDataLen", "dataBuffer", "offset", "socket",
        "_HTTP11ClientFactory", "_factory", "_putConnection", "_quiescentCallback",
        "_ChunkedTransferDecoder", "_DataLoss", "_transferDecoders", "_parser", "_currentRequest",
        "_newclient.Request", "connHeaders", "_connector",
    }
)  # fmt: skip
_hidden: frozenset = frozenset()


def _has(obj, name: str) -> bool:
    return name not in _hidden and hasattr(obj, name)


def probe(hide=()) -> tuple[Assumptions, dict[str, str]]:
    """
    Check every assumption on the Twisted imported now; return which hold,
    and why each of the others does not.

    :param hide: names of :data:`PRIVATE_NAMES` to check as if Twisted had
        none of them (as a release that renamed them would).
    """
    global _hidden
    _hidden = frozenset(hide)
    try:
        return _probe_all()
    finally:
        _hidden = frozenset()


def _probe_all() -> tuple[Assumptions, dict[str, str]]:
    held = Assumptions()
    why: dict[str, str] = {}
    for name, check in _PROBES.items():
        need = _NEEDS.get(name)
        if need is not None and not getattr(held, need):
            why[name] = "needs %s" % (need,)
            continue
        try:
            problem = check()
        except Exception as e:  # a probe that breaks is an assumption that does not hold
            problem = "the probe failed: %s: %s" % (type(e).__name__, e)
        if problem is None:
            setattr(held, name, True)
        else:
            why[name] = problem
    return held, why


_active = Assumptions()
# Whether activate() has run: the assumptions in use were probed, or chosen since by use().
_activated = False


def use(assumptions: Assumptions) -> Assumptions:
    """
    Switch the relay's uses of Twisted internals to ``assumptions`` (tests
    switch them off so); return those in use before, probed first if they
    were not yet.
    """
    global _active, _write_through, _pool_hooks, _coalescing_decoder, _one_send_request, _connection_header
    before = activate()
    _active = assumptions
    _write_through = assumptions.write_through
    _pool_hooks = assumptions.pool_hooks
    _coalescing_decoder = assumptions.coalescing_decoder and assumptions.pool_hooks
    _one_send_request = assumptions.one_send_request and assumptions.pool_hooks
    _connection_header = assumptions.connection_header and assumptions.pool_hooks
    return before


def active() -> Assumptions:
    """The assumptions in use (probed first if they were not yet)."""
    return activate()


#: What the relay loses with an assumption off, where it is more than speed.
COST_WHEN_OFF = {
    "connection_header": (
        "headers named in an upstream's Connection header reach the client (the standard hop-by-hop "
        "headers are still dropped), and a connection the upstream closes with 'Connection: close, "
        "<name>' may be pooled"
    ),
}


def activate() -> Assumptions:
    """
    Probe Twisted's internals and use the assumptions that hold, logging
    each one switched off; once: later calls return the assumptions in use.

    Called when the relay's service starts, and before that on first use by
    whatever needs the assumptions (the upstream client's pool, built with
    the relay; a relay that tests build in memory and never start).
    """
    global _activated
    if _activated:
        return _active
    # Set first: use() below (and anything a probe reaches) must not probe again.
    _activated = True
    held, why = probe()
    for name, problem in why.items():
        _log.warn(
            "Twisted internals: {assumption} is off, the relay takes Twisted's public path instead ({why});"
            " this costs {cost}",
            assumption=name,
            why=problem,
            cost=COST_WHEN_OFF.get(name, "speed only"),
        )
    use(held)
    return held
