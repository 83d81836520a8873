# -*- test-case-name: tests.test_site,tests.test_limits -*-
"""
The relay's HTTP server side: a ``Site`` that guards against oversized and
slow request bodies, and logs nothing of its own.
"""

from __future__ import annotations

import io

from twisted.web.http import HTTPChannel
from twisted.web.http_headers import Headers
from twisted.web.server import Request, Site

from twisted_relay import _twisted
from twisted_relay.body_work import BodyShape
from twisted_relay.config import RelayConfig
from twisted_relay.errors import RelayError

__all__ = ["BodyBudget", "RelaySite"]


class BodyBudget:
    """
    The memory request bodies cost a relay process at once, and its limit
    (0: none). A body is counted from its first byte until its request is
    finished or its connection lost, at what it is estimated to cost once
    parsed (:class:`~twisted_relay.body_work.BodyShape`: a body of tiny
    messages costs about fifteen times its size, one long string twice):
    what has arrived, and from its first 64 KiB on its whole declared length
    projected from their shape; then, once the first attempt's body is ready
    to send, only what the request keeps (its bytes, those sent, its
    translation, a thread's conversation). A body never counts for more than
    seven eighths of the limit (:meth:`counted`): one costing more than the
    whole limit is let in while the others cost less than an eighth of it,
    and leaves that eighth to small requests. When several large bodies
    arrive at once, the first whose bytes show its cost takes the room.

    :ivar held: bytes counted now.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0

    def counted(self, cost: int) -> int:
        """What a body of this estimated cost counts for."""
        if not self.limit:
            return cost
        return min(cost, self.limit - self.limit // 8)

    def reserve(self, size: int, force: bool = False) -> bool:
        """Count ``size`` more bytes, if the limit allows (or ``force``); say whether it did."""
        if self.limit and self.held + size > self.limit and not force:
            return False
        self.held += size
        return True

    def release(self, size: int) -> None:
        """Stop counting ``size`` bytes."""
        self.held -= size


class _BodyLimitedRequest(Request):
    """
    A request that stops storing its body once it is over the site's
    ``max_body``: the route then answers 413, and the relay never holds an
    oversized body in memory or on disk. A body the site's ``body_budget``
    has no room for is not stored either (``over_budget``): the route
    answers 529.

    :ivar body_cost: the body's estimated cost once parsed, as far as it
        has arrived (``None`` before it starts).
    """

    body_too_large = False
    over_budget = False
    _limit = None
    _length = None
    _received = 0
    _reserved = 0
    _released = False
    _shape = None
    _budget = None

    @property
    def body_cost(self) -> int | None:
        shape = self._shape
        return None if shape is None else shape.cost()

    def gotLength(self, length):
        self._limit = getattr(self.channel.site, "max_body", None)
        self._shape = BodyShape()
        if self._limit is not None and length is not None and length > self._limit:
            self.body_too_large = True
            self.content = io.BytesIO()
            return
        # Counted as its bytes come (handleContentChunk), not at its declared
        # length: several large bodies declared at once would each hold room
        # the first of them needs once its bytes show what it costs.
        self._length = length
        # In memory, however large: the route reads the whole body into
        # memory anyway, and max_body bounds it; Twisted's default spools a
        # body over 100 kB to a temporary file, a write and a read of disk.
        self.content = io.BytesIO()

    def write(self, data):
        if self.startedWriting or not data:
            return Request.write(self, data)
        channel = getattr(self, "channel", None)
        if channel is None or self.finished:
            return Request.write(self, data)
        # The first write with a body: the headers leave with it.
        channel.hold_headers()
        try:
            Request.write(self, data)
        finally:
            channel.release_headers()

    def handleContentChunk(self, data):
        if self.body_too_large or self.over_budget:
            return
        self._received += len(data)
        if self._limit is not None and self._received > self._limit:
            self.body_too_large = True
            self.content.close()
            self.content = io.BytesIO()
            return
        shape = self._shape
        shape.add(data)
        if not self._count(shape.projected(self._length)):
            self.content.close()
            self.content = io.BytesIO()
            return
        self.content.write(data)

    def keep_body_cost(self, cost: int) -> None:
        """
        The request's body costs ``cost`` bytes from now on: what it keeps
        once sent (less: the rest of its room goes back; more, for a message
        thread rebuilt from a stored conversation: counted, never refused).
        """
        if not self._released:
            self._count(cost, refuse=False)

    def _count(self, cost: int, refuse: bool = True) -> bool:
        """
        Count the body at ``cost`` in the site's budget, more or less than
        before; when there is no room for more (and ``refuse``), mark the
        request ``over_budget`` and say so.
        """
        budget = self._budget
        if budget is None:
            budget = getattr(getattr(self.channel, "site", None), "body_budget", None)
            if budget is None:
                return True
        counted = budget.counted(cost)
        more = counted - self._reserved
        if more > 0 and not budget.reserve(more, force=not refuse):
            self.over_budget = True
            return False
        if more < 0:
            budget.release(-more)
        if self._budget is None and counted:
            self._budget = budget
            self.notifyFinish().addBoth(self._release_body)
        self._reserved = counted
        return True

    def _release_body(self, result):
        self._released = True
        self._budget.release(self._reserved)
        self._reserved = 0
        return None


class _RelayChannel(HTTPChannel):
    """
    An HTTP/1.1 channel that gives a client ``request_read_timeout`` seconds
    to send each whole request, headers and body: a client that trickles
    bytes (slowloris) gets a 408 and is disconnected.
    """

    _read_deadline = None
    # Whether a whole request has arrived and is not answered yet (tracked
    # here, not read from Twisted's private state): its deadline is over.
    _answering = False

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

    _host = None

    def getHost(self):
        # Twisted asks on every request (a getsockname call each time); a
        # connection's own address never changes.
        host = self._host
        if host is None:
            host = self._host = super().getHost()
        return host

    _secure = None

    def isSecure(self):
        # Klein asks twice on every request, each an interface adaptation
        # of the transport; whether a connection is TLS never changes.
        secure = self._secure
        if secure is None:
            secure = self._secure = super().isSecure()
        return secure

    def _start_read_deadline(self) -> None:
        timeout = getattr(self.site, "request_read_timeout", None)
        if timeout and self._read_deadline is None and not self._answering:
            self._read_deadline = self.callLater(timeout, self._too_slow)

    def allContentReceived(self):
        self._cancel_read_deadline()
        self._answering = True
        super().allContentReceived()

    def requestDone(self, request):
        # Twisted reads a pipelined request held meanwhile from here on.
        self._answering = False
        super().requestDone(request)

    def connectionLost(self, reason):
        self._cancel_read_deadline()
        super().connectionLost(reason)

    def _cancel_read_deadline(self) -> None:
        if self._read_deadline is not None:
            if self._read_deadline.active():
                self._read_deadline.cancel()
            self._read_deadline = None

    # Writes go out at once when nothing is buffered (``_twisted.send_now``). The
    # status line and headers wait for the first piece of the body when the
    # request writes one at the same time, so a whole answer leaves in one
    # send.

    _hold_headers = False
    _held_headers = None

    def writeHeaders(self, version, code, reason, headers):
        # As Twisted's HTTPChannel.writeHeaders does, but sent through
        # writeSequence (or held for the body) instead of the transport's
        # buffer. Request.write always passes a Headers, sanitised as set;
        # anything else goes Twisted's way (which also sanitises it).
        if not isinstance(headers, Headers):
            return super().writeHeaders(version, code, reason, headers)
        lines = [version, b" ", code, b" ", reason, b"\r\n"]
        for name, values in headers.getAllRawHeaders():
            for value in values:
                lines.extend((name, b": ", value, b"\r\n"))
        lines.append(b"\r\n")
        # Joined: with the body beside it, never joined with it (no copy of the body).
        head = [b"".join(lines)]
        if self._hold_headers:
            self._held_headers = head
        else:
            self.writeSequence(head)

    def hold_headers(self) -> None:
        """Keep the next headers written until the body's first bytes, to send them together."""
        self._hold_headers = True

    def release_headers(self) -> None:
        """Send headers still held (the request wrote no body with them)."""
        self._hold_headers = False
        held = self._held_headers
        if held is not None:
            self._held_headers = None
            self.writeSequence(held)

    def write(self, data):
        held = self._held_headers
        if held is not None:
            self._held_headers = None
            held.append(data)
            self.writeSequence(held)
        elif not _twisted.send_now(self.transport, (data,)):
            self.transport.write(data)

    def writeSequence(self, iovec):
        held = self._held_headers
        if held is not None:
            self._held_headers = None
            iovec = held + list(iovec)
        if not _twisted.send_now(self.transport, iovec):
            self.transport.writeSequence(iovec)

    def _too_slow(self) -> None:
        self._read_deadline = None
        error = RelayError(
            408,
            "The request was not received within %g seconds." % (self.site.request_read_timeout,),
        )
        body = error.body()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nX-Should-Retry: %s\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (error.retry_header(), len(body), body)
        )
        self.transport.loseConnection()


class RelaySite(Site):
    """
    A ``Site`` for the relay.

    It writes no access-log line (the relay logs one structured event per
    request itself), stops storing request bodies over ``max_body`` or past
    ``max_bodies_in_flight`` bytes of bodies' estimated cost held at once
    (0: no limit; :class:`BodyBudget`), and
    cuts clients that take over ``request_read_timeout`` seconds to send a
    request. Idle keep-alive connections close after ``timeout`` seconds.
    """

    requestFactory = _BodyLimitedRequest
    protocol = _RelayChannel

    def __init__(self, resource, *, max_body: int | None = None, request_read_timeout: float | None = None,
                 max_bodies_in_flight: int = 0, timeout: float = 120, **kwargs):
        # The relay reads JSON bodies, never HTML forms: no form parsing,
        # which costs every POST an email.message parse and fails on odd
        # Content-Type values (a dropped connection instead of an answer).
        # This is why Twisted 25.5 is the floor.
        kwargs.setdefault("parsePOSTFormSubmission", False)
        super().__init__(resource, timeout=timeout, **kwargs)
        self.max_body = max_body
        self.request_read_timeout = request_read_timeout
        self.body_budget = BodyBudget(max_bodies_in_flight)

    @classmethod
    def for_config(cls, resource, config: RelayConfig, **kwargs) -> "RelaySite":
        """The site the relay serves ``resource`` with under ``config`` (as ``twistd relay`` does)."""
        return cls(
            resource,
            max_body=config.max_body,
            request_read_timeout=config.request_read_timeout or None,
            max_bodies_in_flight=config.max_bodies_in_flight,
            **kwargs,
        )

    def log(self, request) -> None:
        pass
