# -*- test-case-name: tests.test_simulated -*-
"""
``twisted-relay-simulated``: serve the simulated upstream on its own.

Example::

    twisted-relay-simulated --listen tcp:8081:interface=127.0.0.1 --mode strict --seed 1
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Sequence

from twisted.internet.defer import Deferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort
from twisted.logger import Logger, globalLogBeginner, textFileLogObserver
from twisted.web.server import Site

from twisted_relay._argtypes import seconds, whole_number
from twisted_relay.simulated.message_threads import THREAD_MODES
from twisted_relay.simulated.model import ID_STYLES, LEFT_OUT_IDS, MODES
from twisted_relay.simulated.resource import SimulatedUpstream
from twisted_relay.simulated.today import APIS

__all__ = ["build_parser", "main", "parse_args", "serve", "upstream_from"]

log = Logger()

_LINE_ENDINGS = {"lf": "\n", "crlf": "\r\n", "cr": "\r"}


_count = whole_number(0)
_positive = whole_number(1)
_seconds = seconds(allow_zero=True, maximum=3600)


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")


def _pattern(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {e}")
    return text


def _account(text: str) -> tuple[str, str]:
    key, separator, account = text.partition("=")
    if not separator or not key or not account:
        raise argparse.ArgumentTypeError("expected KEY=ACCOUNT")
    return key, account


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not between 0 and 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``twisted-relay-simulated``."""
    parser = argparse.ArgumentParser(
        prog="twisted-relay-simulated",
        description="Serve a simulated Anthropic Messages upstream whose model reuses tool-use ids.",
    )
    parser.add_argument(
        "--listen",
        default="tcp:8081:interface=127.0.0.1",
        help="Twisted endpoint to listen on (default: %(default)s).",
    )
    parser.add_argument(
        "--mode", choices=MODES, default="strict", help="Validation mode (default: %(default)s)."
    )
    parser.add_argument(
        "--seed", type=_integer, default=0, help="Seed of every answer (default: %(default)s)."
    )
    parser.add_argument(
        "--reuse-every",
        type=_count,
        default=3,
        help="Every N-th tool call reuses an id from the history; 0 never (default: %(default)s).",
    )
    parser.add_argument(
        "--event-delay", type=_seconds, default=0.0, help="Seconds between SSE events (default: %(default)s)."
    )
    parser.add_argument(
        "--id-style", choices=ID_STYLES, default="toolu", help="Id shape (default: %(default)s)."
    )
    parser.add_argument(
        "--parallel", type=_positive, default=1, help="tool_use blocks per answer (default: %(default)s)."
    )
    parser.add_argument(
        "--server-tools", action="store_true", help="Add a web search and its result to each answer."
    )
    parser.add_argument(
        "--lookalikes", action="store_true", help="Sometimes emit X-2 natively, X from the history."
    )
    parser.add_argument("--no-split", action="store_true", help="Write one piece per SSE event.")
    parser.add_argument(
        "--line-ending",
        choices=sorted(_LINE_ENDINGS),
        default="lf",
        help="SSE line ending (default: %(default)s).",
    )
    parser.add_argument(
        "--threads",
        choices=THREAD_MODES,
        default="ignore",
        help="Message threads: ignore the thread field, reject it (400), or know threads "
        "(default: %(default)s).",
    )
    parser.add_argument(
        "--id-pattern",
        metavar="REGEX",
        type=_pattern,
        help="Refuse tool_use ids and tool_use_ids that do not match REGEX, as Anthropic does.",
    )
    parser.add_argument(
        "--left-out-ids",
        choices=LEFT_OUT_IDS,
        default="never",
        help="Emit tool_use blocks with an empty or no id (default: %(default)s).",
    )
    parser.add_argument(
        "--thinking-secret",
        metavar="SECRET",
        help="Sign thinking blocks with SECRET and refuse thinking signed otherwise.",
    )
    parser.add_argument(
        "--api",
        choices=APIS,
        default="2026-12",
        help="Today's API (model families, bound thinking, both API versions) or the year-old one "
        "(default: %(default)s).",
    )
    parser.add_argument(
        "--account",
        metavar="KEY=ACCOUNT",
        type=_account,
        action="append",
        default=[],
        help="Name the account of an API key (repeatable): keys of one account read each other's "
        "account-bound thinking; a key not named is an account of its own.",
    )
    parser.add_argument(
        "--binding-default",
        choices=("error", "allow"),
        default="error",
        help="An account created since 2026-08-31 (a changed prefix is a 400) or an older one "
        "(default: %(default)s).",
    )
    parser.add_argument(
        "--stream-errors",
        metavar="SHARE",
        type=_share,
        default=0.0,
        help="Share of streamed answers cut by a mid-stream error event, 0 to 1 (default: %(default)s).",
    )
    parser.add_argument(
        "--stream-cuts",
        metavar="SHARE",
        type=_share,
        default=0.0,
        help="Share of streamed answers whose connection drops midway, 0 to 1 (default: %(default)s).",
    )
    parser.add_argument(
        "--refusals",
        metavar="SHARE",
        type=_share,
        default=0.0,
        help="Share of today's models' answers that are a refusal with stop_details (default: %(default)s).",
    )
    parser.add_argument(
        "--compactions",
        metavar="SHARE",
        type=_share,
        default=0.0,
        help="Share of today's models' answers that are a compaction block (default: %(default)s).",
    )
    parser.add_argument(
        "--require-key",
        metavar="KEY",
        help="Answer 401 unless x-api-key or Authorization: Bearer carries KEY.",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """
    Parse the command line; a bad value exits with status 2 and a usage
    message, as argparse does.
    """
    parser = build_parser()
    options = parser.parse_args(argv)
    try:
        serverFromString(_NoReactor(), options.listen)
    except Exception as error:
        # Endpoint parsers raise many kinds of errors (ValueError for a bad
        # port, OSError for a missing certificate...); each is a usage error.
        parser.error(f"argument --listen: {options.listen!r} is not a valid endpoint: {error}")
    return options


class _NoReactor:
    """Stands in for the reactor while an endpoint string is only parsed."""


def upstream_from(options: argparse.Namespace, reactor: object = None) -> SimulatedUpstream:
    """The :class:`SimulatedUpstream` that parsed options describe."""
    return SimulatedUpstream(
        mode=options.mode,
        seed=options.seed,
        reuse_every=options.reuse_every,
        id_style=options.id_style,
        event_delay=options.event_delay,
        split=not options.no_split,
        reactor=reactor,  # type: ignore[arg-type]
        parallel=options.parallel,
        server_tools=options.server_tools,
        lookalikes=options.lookalikes,
        line_ending=_LINE_ENDINGS[options.line_ending],
        require_key=options.require_key,
        threads=options.threads,
        id_pattern=options.id_pattern,
        left_out_ids=options.left_out_ids,
        thinking_secret=options.thinking_secret,
        api=options.api,
        accounts=dict(options.account),
        binding_default=options.binding_default,
        stream_errors=options.stream_errors,
        stream_cuts=options.stream_cuts,
        refusals=options.refusals,
        compactions=options.compactions,
    )


async def serve(reactor: object, options: argparse.Namespace) -> IListeningPort:
    """
    Listen on ``options.listen`` with the upstream ``options`` describe.

    :raises SystemExit: with status 1 if the endpoint cannot listen.
    :return: the listening port.
    """
    upstream = upstream_from(options, reactor)
    endpoint = serverFromString(reactor, options.listen)
    try:
        port = await endpoint.listen(Site(upstream.resource()))
    except CannotListenError as error:
        log.error("Cannot listen on {listen}: {error}", listen=options.listen, error=error)
        raise SystemExit(1)
    log.info(
        "Simulated upstream ({mode}, API {api}, seed {seed}, reuse every {reuse}) listening on {address}",
        mode=options.mode,
        api=options.api,
        seed=options.seed,
        reuse=options.reuse_every,
        address=port.getHost(),
    )
    return port


async def _run(reactor: object, options: argparse.Namespace) -> None:
    await serve(reactor, options)
    # Serve until the reactor is stopped (Ctrl-C, SIGTERM).
    await Deferred()


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``twisted-relay-simulated``."""
    from twisted.internet import task

    options = parse_args(argv)
    globalLogBeginner.beginLoggingTo([textFileLogObserver(sys.stderr)], redirectStandardIO=False)
    task.react(_run, (options,))


if __name__ == "__main__":
    main()
