# -*- test-case-name: bench.test_harness -*-
"""
The other Python floor: a plain asyncio reverse proxy, aiohttp on uvloop, in
front of the upstream. No parsing of what it relays: the request body is
read whole and sent on, the answer's body is written to the client as each
piece arrives (``iter_any``), over a keep-alive pool to the upstream.

It runs from a virtual environment of its own (aiohttp and uvloop are not
the project's dependencies; see docs/benchmarks.md)::

    python3 -m venv /tmp/aiohttp-venv
    /tmp/aiohttp-venv/bin/pip install 'aiohttp==3.14.5' 'uvloop==0.23.0'
    /tmp/aiohttp-venv/bin/python bench/aiohttp_proxy.py --port PORT --upstream-port UPORT
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

__all__ = ["main", "make_app"]

# Hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp sets itself.
_DROPPED = frozenset(
    (
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
        "content-length",
    )
)


def make_app(upstream: str):
    """An aiohttp application that relays every request to ``upstream``."""
    from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

    async def start(app) -> None:
        app["session"] = ClientSession(
            connector=TCPConnector(limit=0, keepalive_timeout=60),
            timeout=ClientTimeout(total=None, sock_read=600),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def stop(app) -> None:
        await app["session"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        async with request.app["session"].request(
            request.method, upstream + request.path_qs, headers=headers, data=body, allow_redirects=False
        ) as answer:
            response = web.StreamResponse(status=answer.status, reason=answer.reason)
            for name, value in answer.headers.items():
                if name.lower() not in _DROPPED:
                    response.headers.add(name, value)
            if answer.headers.get("Content-Length") is not None:
                response.content_length = int(answer.headers["Content-Length"])
            await response.prepare(request)
            async for piece in answer.content.iter_any():
                await response.write(piece)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


def main(argv: list[str] | None = None) -> None:
    """Serve the proxy on 127.0.0.1 until SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream-host", default="127.0.0.1")
    parser.add_argument("--upstream-port", type=int, required=True)
    args = parser.parse_args(argv)
    watched = os.environ.get("BENCH_GC_WATCH")
    if watched:
        # Its collector's pauses, for bench/run.py (bench/gcwatch.py).
        from gcwatch import watch_signals

        watch_signals(watched)
    import uvloop
    from aiohttp import web

    app = make_app("http://%s:%d" % (args.upstream_host, args.upstream_port))
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None, backlog=4096, loop=loop)


if __name__ == "__main__":
    main(sys.argv[1:])
