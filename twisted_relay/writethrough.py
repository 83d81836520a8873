# -*- test-case-name: tests.test_network -*-
"""
Sending at once on a TCP connection with nothing buffered.

Twisted buffers every write and sends it once the reactor says the socket
is writable: two ``epoll_ctl`` calls and a reactor turn per write. The relay
writes once per upstream read to its client and once per request to the
upstream, so when nothing is waiting it sends at once, as asyncio does, and
leaves to the transport only what the socket did not take.
"""

from __future__ import annotations

from twisted.internet import tcp

__all__ = ["send_now"]

_PLAIN_TCP = (tcp.Server, tcp.Client)

# Pieces sent by one sendmsg before they are joined (the kernel's limit is 1024).
_MAX_PIECES = 64


def send_now(transport, iovec) -> bool:
    """
    Send ``iovec`` (a list or tuple of bytes) on a plain TCP ``transport``
    whose buffer is empty, in one ``sendmsg`` (no join); what the socket does
    not take goes to the transport's buffer. Returns whether ``iovec`` was
    taken; when not (TLS, a UNIX socket, data already waiting, a closing
    connection) the caller writes it to the transport as usual.
    """
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
