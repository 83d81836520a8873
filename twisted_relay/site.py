# -*- test-case-name: tests.test_hardening -*-
"""
The relay's HTTP server side: a ``Site`` that guards against oversized and
slow request bodies, and logs nothing of its own.
"""

from __future__ import annotations

import io

from twisted.internet import tcp
from twisted.web.http import HTTPChannel
from twisted.web.server import Request, Site

from twisted_relay.errors import RelayError

__all__ = ["RelaySite"]


class _RelayRequest(Request):
    """
    A request that stops storing its body once it is over the site's
    ``max_body``: the route then answers 413, and the relay never holds an
    oversized body in memory or on disk.
    """

    body_too_large = False
    _limit = None
    _received = 0

    def gotLength(self, length):
        self._limit = getattr(self.channel.site, "max_body", None)
        if self._limit is not None and length is not None and length > self._limit:
            self.body_too_large = True
            self.content = io.BytesIO()
            return
        # In memory, however large: the route reads the whole body into
        # memory anyway, and max_body bounds it; Twisted's default spools a
        # body over 100 kB to a temporary file, a write and a read of disk.
        self.content = io.BytesIO()

    def handleContentChunk(self, data):
        if self.body_too_large:
            return
        self._received += len(data)
        if self._limit is not None and self._received > self._limit:
            self.body_too_large = True
            self.content.close()
            self.content = io.BytesIO()
            return
        self.content.write(data)


class _RelayChannel(HTTPChannel):
    """
    An HTTP/1.1 channel that gives a client ``request_read_timeout`` seconds
    to send each whole request, headers and body: a client that trickles
    bytes (slowloris) gets a 408 and is disconnected.
    """

    _read_deadline = None

    def connectionMade(self):
        super().connectionMade()
        # Each event must leave at once: no Nagle delay behind a previous
        # small write (the headers, the last event) still unacknowledged.
        no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if no_delay is not None:
            try:
                no_delay(True)
            except OSError:
                pass
        # A connection that sends nothing at all is as slow as one that
        # trickles: the first request must arrive in time too.
        self._start_read_deadline()

    def dataReceived(self, data):
        self._start_read_deadline()
        super().dataReceived(data)

    def _start_read_deadline(self) -> None:
        timeout = getattr(self.site, "request_read_timeout", None)
        if timeout and self._read_deadline is None and not self._handlingRequest:
            self._read_deadline = self.callLater(timeout, self._too_slow)

    def allContentReceived(self):
        self._cancel_read_deadline()
        super().allContentReceived()

    def connectionLost(self, reason):
        self._cancel_read_deadline()
        super().connectionLost(reason)

    def _cancel_read_deadline(self) -> None:
        if self._read_deadline is not None:
            if self._read_deadline.active():
                self._read_deadline.cancel()
            self._read_deadline = None

    # Writes: Twisted buffers every write and sends it once the reactor says
    # the socket is writable, two epoll_ctl calls and a reactor turn per
    # write. A relayed stream writes once per upstream read, so when nothing
    # is buffered the channel sends at once, as asyncio does, and leaves only
    # what the socket did not take to the transport.

    def write(self, data):
        if not self._send_now((data,)):
            self.transport.write(data)

    def writeSequence(self, iovec):
        if not self._send_now(iovec):
            self.transport.writeSequence(iovec)

    def _send_now(self, iovec) -> bool:
        """
        Send on a plain TCP connection with nothing buffered, the pieces in
        one ``sendmsg`` (no join); whether ``iovec`` was taken.
        """
        transport = self.transport
        if (
            type(transport) is not tcp.Server
            or not transport.connected
            or transport.disconnecting
            or transport._aborting
            or transport._writeDisconnected
            or transport._tempDataLen
            or transport.offset != len(transport.dataBuffer)
        ):
            return False
        if type(iovec) not in (list, tuple) or len(iovec) > 64:
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

    def _too_slow(self) -> None:
        self._read_deadline = None
        body = RelayError(
            408,
            "The request was not received within %g seconds." % (self.site.request_read_timeout,),
        ).body()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        self.transport.loseConnection()


class RelaySite(Site):
    """
    A ``Site`` for the relay.

    It writes no access-log line (the relay logs one structured event per
    request itself), stops storing request bodies over ``max_body``, and
    cuts clients that take over ``request_read_timeout`` seconds to send a
    request. Idle keep-alive connections close after ``timeout`` seconds.
    """

    requestFactory = _RelayRequest
    protocol = _RelayChannel

    def __init__(self, resource, *, max_body: int | None = None, request_read_timeout: float | None = None,
                 timeout: float = 120, **kwargs):
        # The relay reads JSON bodies, never HTML forms: no form parsing,
        # which costs every POST an email.message parse and fails on odd
        # Content-Type values.
        kwargs.setdefault("parsePOSTFormSubmission", False)
        super().__init__(resource, timeout=timeout, **kwargs)
        self.max_body = max_body
        self.request_read_timeout = request_read_timeout

    def log(self, request) -> None:
        pass
