# -*- test-case-name: tests.test_demo -*-
"""
``twisted-relay-demo``: drive a long tool-use session through a relay.

Each turn sends the whole history with a ``tools`` list, appends the
assistant's answer and answers every ``tool_use`` with a ``tool_result``,
as Claude Code does.  It shows progress as it goes and ends with a summary:
turns completed, tool calls, ids the relay renamed (``X-2``), duplicate ids
the client saw (0 behind the relay), which upstream served each turn (from
the relay's ``x-relay-upstream`` header, when it sends one), and the first
failure's error body. Exit status 0 when every turn succeeded, 1 otherwise.

Example, with a relay on its embedded simulated upstream::

    twistd -n relay --simulate strict &
    twisted-relay-demo --turns 100
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence, TextIO

import ujson
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.http import PotentialDataLoss
from treq.client import HTTPClient

from twisted_relay._version import __version__
from twisted_relay._argtypes import seconds, whole_number
from twisted_relay.sse_events import EventFramer, parse_event

__all__ = [
    "DEFAULT_BASE_URL",
    "TOOLS",
    "SessionReport",
    "TurnFailure",
    "build_parser",
    "main",
    "parse_args",
    "run",
    "run_session",
]

DEFAULT_BASE_URL = "http://127.0.0.1:8080"
DEFAULT_MODEL = "claude-sonnet-5-5"
_DUMMY_KEY = "sk-ant-demo-not-a-real-key"
_BODY_SHOWN = 2000

#: The tools the demo offers the model, shaped like Claude Code's.
TOOLS = (
    {
        "name": "Bash",
        "description": "Run a shell command.",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
            "required": ["command"],
        },
    },
    {
        "name": "Read",
        "description": "Read a file.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["file_path"],
        },
    },
    {
        "name": "get_weather",
        "description": "The weather at a place.",
        "input_schema": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["location"],
        },
    },
)

# How the relay renames the k-th occurrence of an id: "-k" for tool_use,
# "_k" for server_tool_use (its pattern has no hyphen).
_REWRITTEN = re.compile(r"-\d+$")
_REWRITTEN_SERVER = re.compile(r"^srvtoolu_.*_\d+$")


@dataclass
class TurnFailure:
    """
    A turn that did not produce an answer.

    :ivar turn: 1-based turn number.
    :ivar status: the HTTP status, or ``None`` when no response came.
    :ivar body: the error body (or a description of what went wrong).
    """

    turn: int
    status: int | None
    body: str


@dataclass
class SessionReport:
    """What a session saw, turn by turn."""

    turns: int
    completed: int = 0
    tool_calls: int = 0
    ids: set[str] = field(default_factory=set)
    rewritten: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    failures: list[TurnFailure] = field(default_factory=list)
    #: Per completed turn, the upstream that served it (``x-relay-upstream``),
    #: or ``None`` when the answer did not say.
    served_by: list[str | None] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every turn succeeded."""
        return not self.failures and self.completed == self.turns

    def observe(self, message: dict, upstream: str | None = None) -> None:
        """Account for one assistant answer, and the upstream that served it if known."""
        self.served_by.append(upstream)
        for block in message.get("content", ()):
            kind = block.get("type", "")
            if kind != "tool_use" and not kind.endswith("_tool_use"):
                continue
            tool_id = block.get("id", "")
            if kind == "tool_use":
                self.tool_calls += 1
            if tool_id in self.ids:
                self.duplicates.append(tool_id)
            self.ids.add(tool_id)
            if _REWRITTEN.search(tool_id) or _REWRITTEN_SERVER.match(tool_id):
                self.rewritten.append(tool_id)
        self.completed += 1

    def progress(self, turn: int) -> str:
        """One progress line."""
        line = (
            f"turn {turn}/{self.turns}  ids seen {len(self.ids)}  "
            f"client duplicates {len(self.duplicates)}  failures {len(self.failures)}"
        )
        if self.served_by and self.served_by[-1] is not None:
            line += f"  upstream {self.served_by[-1]}"
        return line

    def served_summary(self) -> str | None:
        """
        Which upstream served which turns, as runs of turns
        (``local 1-60, 141-200; anthropic 61-140``); ``None`` when no
        answer named its upstream.
        """
        if not any(self.served_by):
            return None
        runs: dict[str, list[tuple[int, int]]] = {}
        start = 0
        for turn in range(1, len(self.served_by) + 1):
            name = self.served_by[turn - 1]
            if turn == len(self.served_by) or self.served_by[turn] != name:
                spans = runs.setdefault(name or "(not said)", [])
                spans.append((start + 1, turn))
                start = turn
        return "; ".join(
            name + " " + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) for name, spans in runs.items()
        )

    def summary(self) -> list[str]:
        """The lines of the final summary."""
        lines = [
            f"  turns completed:         {self.completed}/{self.turns}",
            f"  tool calls:              {self.tool_calls}",
            f"  distinct ids seen:       {len(self.ids)}",
            f"  ids that look rewritten: {len(self.rewritten)} (ending in -N: renamed by the relay)",
            f"  duplicate ids seen:      {len(self.duplicates)}",
            f"  failed turns:            {len(self.failures)}",
        ]
        served = self.served_summary()
        if served is not None:
            lines.append(f"  served by (turns):       {served}")
        if self.failures:
            first = self.failures[0]
            if first.status is None:
                status = "no response"
            elif first.status == 200:
                status = "HTTP 200 but a broken answer"
            else:
                status = f"HTTP {first.status}"
            lines.append(f"  first failure:           turn {first.turn}, {status}")
            body = first.body if len(first.body) <= _BODY_SHOWN else first.body[:_BODY_SHOWN] + "..."
            lines.append(f"  first error body:        {body}")
            lines.append(f"FAILED: the session died at turn {first.turn}.")
        else:
            if self.duplicates:
                lines.append(
                    "  note: the client saw repeated ids; a strict upstream rejects the next turn "
                    "after one (put the relay in front)."
                )
            lines.append("OK: the session survived every turn.")
        return lines


class _Failed(Exception):
    """A turn failed; carries the status and body to report."""

    def __init__(self, status: int | None, body: str):
        super().__init__(body)
        self.status = status
        self.body = body


_MESSAGE_EVENTS = frozenset(
    (
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    )
)


class _MessageBuilder:
    """Rebuild an assistant message from Anthropic stream events, as the SDKs do."""

    def __init__(self) -> None:
        self.message: dict | None = None
        self.stopped = False
        self._json: dict[int, list[str]] = {}
        self._blocks: dict[int, dict] = {}

    def event(self, name: str | None, data: str) -> None:
        """
        Take one event.

        :raises _Failed: on an ``error`` event or a malformed one.
        """
        if name == "error":
            raise _Failed(200, data)
        if name not in _MESSAGE_EVENTS:
            return  # ping, and event types added after this was written
        try:
            self._take(name, ujson.loads(data))
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise _Failed(200, f"malformed {name} event ({error!r}): {data[:200]}")

    def _take(self, name: str, payload: dict) -> None:
        if name == "message_start":
            self.message = dict(payload["message"], content=[])
            return
        if self.message is None:
            raise _Failed(200, f"{name} before message_start")
        if name == "content_block_start":
            index = payload["index"]
            self._blocks[index] = dict(payload["content_block"])
            self._json[index] = []
        elif name == "content_block_delta":
            self._delta(self._blocks[payload["index"]], payload["index"], payload["delta"])
        elif name == "content_block_stop":
            index = payload["index"]
            block = self._blocks[index]
            if self._json[index]:
                block["input"] = ujson.loads("".join(self._json[index]))
            self.message["content"].append(block)
        elif name == "message_delta":
            self.message.update(payload.get("delta", {}))
            self.message.setdefault("usage", {}).update(payload.get("usage", {}))
        else:
            self.stopped = True

    def _delta(self, block: dict, index: int, delta: dict) -> None:
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = block.get("text", "") + delta["text"]
        elif kind == "input_json_delta":
            self._json[index].append(delta["partial_json"])
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + delta["thinking"]
        elif kind == "signature_delta":
            block["signature"] = delta["signature"]
        elif kind == "citations_delta":
            block.setdefault("citations", []).append(delta["citation"])


def _tool_output(block: dict, turn: int) -> str:
    arguments = block.get("input") or {}
    if block.get("name") == "get_weather":
        return f"{arguments.get('location', 'here')}: 21 °C, partly cloudy"
    if block.get("name") == "Read":
        return f"1\tcontents of {arguments.get('file_path', 'the file')} (turn {turn})"
    return f"$ {arguments.get('command', 'true')}\nok (turn {turn})"


def _answer_tools(message: dict, turn: int) -> dict:
    results = [
        {"type": "tool_result", "tool_use_id": block["id"], "content": _tool_output(block, turn)}
        for block in message["content"]
        if block.get("type") == "tool_use"
    ]
    return {"role": "user", "content": results or "Carry on with the next step."}


class _Session:
    """One demo session against one base URL."""

    def __init__(self, reactor: Any, options: argparse.Namespace, client: HTTPClient):
        self._reactor = reactor
        self._options = options
        self._client = client
        self._url = options.base_url.rstrip("/") + "/v1/messages"
        self._headers = {
            "x-api-key": options.api_key,
            "anthropic-version": "2023-06-01",
            "content-type": "application/json",
            "user-agent": f"twisted-relay-demo/{__version__}",
            # Claude Code sends one per session; stateful upstreams key on it.
            "x-claude-code-session-id": str(uuid.uuid4()),
        }

    async def run(self, out: TextIO) -> SessionReport:
        options = self._options
        report = SessionReport(options.turns)
        tty = out.isatty()
        messages: list[dict] = [
            {"role": "user", "content": "Work through the project's chores one tool call at a time."}
        ]
        for turn in range(1, options.turns + 1):
            try:
                message, upstream = await self._timed_turn(messages)
            except _Failed as failure:
                report.failures.append(TurnFailure(turn, failure.status, failure.body))
            else:
                report.observe(message, upstream)
                messages.append({"role": "assistant", "content": message["content"]})
                messages.append(_answer_tools(message, turn))
            if tty:
                out.write("\r" + report.progress(turn) + "  ")
            elif turn % options.progress_every == 0 or report.failures:
                out.write(report.progress(turn) + "\n")
            out.flush()
            if report.failures:
                # Without an answer the history cannot go on: the session is
                # over, as it would be for Claude Code.
                break
        if tty:
            out.write("\n")
        return report

    async def _timed_turn(self, messages: list[dict]) -> tuple[dict, str | None]:
        turn = Deferred.fromCoroutine(self._turn(messages))
        # treq's timeout covers the response headers only; this one covers
        # the whole turn, stream included.
        turn.addTimeout(self._options.timeout, self._reactor)
        try:
            return await turn
        except TimeoutError:
            raise _Failed(None, f"no complete answer within {self._options.timeout:g} s")

    async def _turn(self, messages: list[dict]) -> tuple[dict, str | None]:
        options = self._options
        body = {
            "model": options.model,
            "max_tokens": options.max_tokens,
            "messages": messages,
            "tools": list(TOOLS),
        }
        if options.stream:
            body["stream"] = True
        try:
            response = await self._client.post(
                self._url,
                data=ujson.dumps(body, ensure_ascii=False).encode("utf-8"),
                headers=self._headers,
                unbuffered=True,
            )
        except CancelledError:
            raise
        except Exception as error:
            raise _Failed(None, f"cannot reach {options.base_url}: {error}")
        if response.code != 200:
            content = await response.content()
            raise _Failed(response.code, content.decode("utf-8", "replace"))
        named = response.headers.getRawHeaders(b"x-relay-upstream")
        upstream = named[0].decode("utf-8", "replace") if named else None
        if options.stream:
            return await self._read_stream(response), upstream
        content = await response.content()
        try:
            message = ujson.loads(content)
        except ValueError:
            message = None
        if not isinstance(message, dict) or not isinstance(message.get("content"), list):
            raise _Failed(200, "the answer is not a message: " + content[:200].decode("utf-8", "replace"))
        return message, upstream

    async def _read_stream(self, response: Any) -> dict:
        reader = _StreamReader()
        response.deliverBody(reader)
        return await reader.done


class _StreamReader(Protocol):
    """
    Reads a streamed answer as it arrives; :attr:`done` fires with the
    rebuilt message.  Cancelling :attr:`done` drops the connection.
    """

    def __init__(self) -> None:
        self.done: Deferred[dict] = Deferred(self._cancel)
        self._framer = EventFramer()
        self._builder = _MessageBuilder()
        self._cancelled = False

    def dataReceived(self, data: bytes) -> None:
        if self.done.called:
            return
        try:
            for raw in self._framer.feed(data):
                self._builder.event(*parse_event(raw))
        except (_Failed, ValueError) as error:
            # ValueError: an event too large, or bytes that are not UTF-8.
            failure = error if isinstance(error, _Failed) else _Failed(200, f"unreadable stream: {error}")
            self.transport.stopProducing()
            if not self.done.called:
                self.done.errback(failure)

    def connectionLost(self, reason: Failure) -> None:
        if self.done.called or self._cancelled:
            return
        # A body cut without a chunked terminator (PotentialDataLoss) is
        # judged by its events: complete only if message_stop arrived.
        if not reason.check(ResponseDone, PotentialDataLoss):
            self.done.errback(_Failed(200, f"the stream broke: {reason.getErrorMessage()}"))
            return
        try:
            for raw in self._framer.close():
                self._builder.event(*parse_event(raw))
        except (_Failed, ValueError) as error:
            self.done.errback(
                error if isinstance(error, _Failed) else _Failed(200, f"unreadable stream: {error}")
            )
            return
        if self._builder.message is None or not self._builder.stopped:
            self.done.errback(_Failed(200, "the stream ended before message_stop"))
        else:
            self.done.callback(self._builder.message)

    def _cancel(self, done: Deferred) -> None:
        self._cancelled = True
        if self.transport is not None:
            self.transport.stopProducing()


async def run_session(reactor: Any, options: argparse.Namespace, out: TextIO = sys.stdout) -> SessionReport:
    """
    Run one session and print its progress to ``out``.

    :param options: as :func:`parse_args` returns them.
    :return: what the session saw; its summary is not printed.
    """
    pool = HTTPConnectionPool(reactor, persistent=True)
    client = HTTPClient(Agent(reactor, pool=pool))
    try:
        return await _Session(reactor, options, client).run(out)
    finally:
        await pool.closeCachedConnections()


async def run(reactor: Any, options: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """
    Run a session, print its summary, and return the exit status (0 when
    every turn succeeded, 1 otherwise).
    """
    mode = "streaming" if options.stream else "not streaming"
    out.write(f"twisted-relay-demo: {options.turns} turns against {options.base_url} ({mode})\n")
    report = await run_session(reactor, options, out)
    out.write("\n".join(report.summary()) + "\n")
    return 0 if report.ok else 1


_positive = whole_number(1)
_seconds = seconds(allow_zero=False)


def _base_url(text: str) -> str:
    if not re.match(r"^https?://[^/\s]+", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``twisted-relay-demo``."""
    parser = argparse.ArgumentParser(
        prog="twisted-relay-demo",
        description="Drive a long tool-use session through a relay and report how it went.",
    )
    parser.add_argument(
        "--base-url", type=_base_url, default=DEFAULT_BASE_URL, help="Relay base URL (default: %(default)s)."
    )
    parser.add_argument("--turns", type=_positive, default=50, help="Turns to run (default: %(default)s).")
    parser.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Stream the answers (default: on).",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("ANTHROPIC_API_KEY") or _DUMMY_KEY,
        help="Key sent as x-api-key (default: $ANTHROPIC_API_KEY, else a dummy).",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Model name (default: %(default)s).")
    parser.add_argument(
        "--max-tokens", type=_positive, default=1024, help="max_tokens per turn (default: %(default)s)."
    )
    parser.add_argument(
        "--progress-every",
        type=_positive,
        default=10,
        help="When not on a terminal, print progress every N turns (default: %(default)s).",
    )
    parser.add_argument(
        "--timeout", type=_seconds, default=120.0, help="Seconds allowed per turn (default: %(default)s)."
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; a bad value exits with status 2 and a usage message."""
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``twisted-relay-demo``."""
    from twisted.internet import task

    options = parse_args(argv)

    async def session(reactor: Any) -> None:
        raise SystemExit(await run(reactor, options))

    task.react(session)


if __name__ == "__main__":
    main()
