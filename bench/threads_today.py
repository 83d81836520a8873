"""
What message threads do to a session today: the official SDK's default tool
runner (threads on) against the simulated upstream, straight and through the
relay, in front of an upstream that ignores the ``thread`` field (strict, it
reuses ids), one that rejects it, and one that knows threads (stateful, it
reuses ids). All on 127.0.0.1, in this process.

    python -m bench.threads_today --turns 30

Per run: the turns completed, the error that ended the session if one did,
and how many tool-use ids the client saw more than once. With the relay holding
threads (issue 15), every "through the relay" row is "all turns, no
duplicate"; the direct rows show what a session meets without it.
"""

from __future__ import annotations

import argparse
from collections import Counter

from twisted.internet import defer, task
from twisted.internet.threads import deferToThread
from twisted.web.server import Site

from bench.targets import free_port
from twisted_relay.config import RelayConfig, one_upstream
from twisted_relay.service import Relay
from twisted_relay.simulated import SimulatedUpstream

UPSTREAMS = (
    ("ignores thread (strict)", {"mode": "strict", "threads": "ignore"}),
    ("rejects thread (strict)", {"mode": "strict", "threads": "rejects"}),
    ("knows threads (stateful)", {"mode": "stateful", "threads": "knows"}),
)
#: The id policy each simulated mode needs (a stateful upstream checks it
#: gets back exactly the ids it emitted: docs/id-translation.md).
UPSTREAM_IDS = {"strict": "unique", "stateful": "original"}


def tool_runner_session(
    base_url: str, turns: int, *, fresh_connections: bool = False, on_turn=None,
    prompt: str = "Weather everywhere, one call at a time.",
) -> dict:
    """
    The SDK's default tool runner for ``turns`` turns; runs in a thread.

    :param fresh_connections: one connection per request (none kept alive),
        so that relay workers sharing a port each take some.
    :param on_turn: called with the number of turns completed after each.
    :param prompt: the first message; sessions at once need their own (the
        simulated upstream's answer, its id included, follows from the request).
    """
    import anthropic
    from anthropic import beta_tool

    @beta_tool
    def get_weather(location: str) -> str:
        """Weather at a place.

        Args:
            location: the city.
        """
        return f"sunny in {location}"

    http_client = None
    if fresh_connections:
        import httpx2 as httpx

        http_client = anthropic.DefaultHttpxClient(limits=httpx.Limits(max_keepalive_connections=0))
    client = anthropic.Anthropic(
        base_url=base_url, api_key="sk-bench", max_retries=0, timeout=30, http_client=http_client
    )
    completed, error, ids = 0, None, Counter()
    try:
        runner = client.beta.messages.tool_runner(
            model="claude-sonnet-4-5", max_tokens=256, tools=[get_weather],
            messages=[{"role": "user", "content": prompt}],
            max_iterations=turns,
        )
        for message in runner:
            completed += 1
            if on_turn is not None:
                on_turn(completed)
            ids.update(block.id for block in message.content if block.type == "tool_use")
    except anthropic.APIStatusError as caught:
        message = caught.body.get("error", {}).get("message") if isinstance(caught.body, dict) else caught.body
        error = f"{caught.status_code} {str(message)[:110]}"
    finally:
        client.close()
    return {"completed": completed, "error": error, "duplicates": sum(1 for n in ids.values() if n > 1)}


async def run(reactor, turns: int, seed: int) -> list[tuple[str, str, dict]]:
    rows = []
    for name, options in UPSTREAMS:
        for through_relay in (False, True):
            sim = SimulatedUpstream(reactor=reactor, seed=seed, **options)
            upstream_port = reactor.listenTCP(0, Site(sim.resource()), interface="127.0.0.1")
            url = f"http://127.0.0.1:{upstream_port.getHost().port}"
            relay = None
            if through_relay:
                # Served as twistd relay serves it: the relay's own service listens.
                port = free_port()
                config = RelayConfig(
                    listen=(f"tcp:{port}:interface=127.0.0.1",),
                    upstreams=one_upstream(url, ids=UPSTREAM_IDS[options["mode"]]),
                    dump_dir=None,
                )
                relay = Relay(config, reactor)
                relay.service.privilegedStartService()
                relay.service.startService()
                url = f"http://127.0.0.1:{port}"
            try:
                result = await deferToThread(tool_runner_session, url, turns)
            finally:
                if relay is not None:
                    await relay.service.stopService()
                await upstream_port.stopListening()
            rows.append((name, "relay" if through_relay else "direct", result))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    options = parser.parse_args(argv)

    async def body(reactor):
        rows = await run(reactor, options.turns, options.seed)
        print(f"{'upstream':26} {'path':7} {'turns':>9} {'dup ids':>8}  error")
        for name, path, result in rows:
            print(f"{name:26} {path:7} {result['completed']:>4}/{options.turns:<4} "
                  f"{result['duplicates']:>8}  {result['error'] or '-'}")

    task.react(lambda reactor: defer.ensureDeferred(body(reactor)))


if __name__ == "__main__":
    main()
