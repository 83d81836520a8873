# -*- test-case-name: bench.test_harness -*-
"""
The floor of our own stack: Twisted's plain ``ReverseProxyResource`` in front
of the upstream, nothing else (no parsing, no pooling: it opens an HTTP/1.0
connection per request and writes each chunk it reads).

Run it as::

    python bench/plain_proxy.py --listen tcp:PORT:interface=127.0.0.1 --upstream-port UPORT
"""

from __future__ import annotations

import argparse
import os
import sys

from twisted.internet import endpoints, reactor
from twisted.web.proxy import ReverseProxyResource
from twisted.web.server import Site

__all__ = ["main", "make_site"]


class _QuietSite(Site):
    """No access log: the relay writes one structured line per request, this writes none."""

    def log(self, request) -> None:
        pass


def make_site(upstream_host: str, upstream_port: int) -> Site:
    """A site that proxies every path to the upstream."""
    site = _QuietSite(ReverseProxyResource(upstream_host, upstream_port, b""))
    site.noisy = False
    return site


def main(argv: list[str] | None = None) -> None:
    """Serve the plain proxy until SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="a Twisted endpoint string")
    parser.add_argument("--upstream-host", default="127.0.0.1")
    parser.add_argument("--upstream-port", type=int, required=True)
    args = parser.parse_args(argv)
    watched = os.environ.get("BENCH_GC_WATCH")
    if watched:
        # Its collector's pauses, for bench/run.py (bench/gcwatch.py).
        from gcwatch import watch_signals

        watch_signals(watched)
    endpoint = endpoints.serverFromString(reactor, args.listen)
    endpoint.listen(make_site(args.upstream_host, args.upstream_port))
    reactor.run()


if __name__ == "__main__":
    main(sys.argv[1:])
