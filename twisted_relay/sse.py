# -*- test-case-name: tests.test_sse -*-
"""
The SSE gate: the Twisted Protocol that streams an upstream's SSE answer to
the client, deciding on the way the events that can carry tool-use ids, and
reading the usage the upstream reports (for metering).

The gate (a :class:`~twisted.internet.protocol.Protocol` that treq feeds
with ``response.deliverBody``) cuts the body into raw events with the framer
of :mod:`twisted_relay.sse_events`, and writes each received chunk's
complete events to the client in one write, after the id-translation core has decided
the few events that can carry tool-use ids (``content_block_start`` and
``message_start``), and the ``content_block_delta`` events that carry a
thinking block's ``signature_delta`` (the translator marks it with its maker).
With a usage reader (``on_usage``), ``message_delta`` is parsed too (one per
answer). Every other event is never parsed and leaves as the very bytes that
came in.

A wire that makes Anthropic's events itself (an OpenAI stream translated,
Bedrock's frames decoded) hands them over whole (:meth:`SSEGate.eventsReceived`):
the same events are decided, by the same code, from the payloads the wire
parsed (or from their bytes, parsed only then), and the others leave as the
bytes the wire made; nothing is framed or searched again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import ujson
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from zope.interface import implementer

from twisted_relay.errors import RelayError
from twisted_relay.upstream_agent import UpstreamTimer
from twisted_relay.sse_events import (
    DEFAULT_MAX_EVENT_BYTES,
    EventFramer,
    EventTooLarge,
    copy_range,
    event_name_at,
    parse_event,
    sse_event,
)

if TYPE_CHECKING:
    from twisted_relay.translation import ResponseTranslator, Rewrite

__all__ = [
    "PING_EVENT",
    "SSEGate",
]

#: The event the relay sends on its own when the upstream is silent.
PING_EVENT = b'event: ping\ndata: {"type": "ping"}\n\n'

# Events whose JSON the gate reads: the two that can declare tool-use ids, and
# upstream errors (reported through ``on_error_event``).
_CONTENT_BLOCK_START = b"content_block_start"
_MESSAGE_START = b"message_start"
_ERROR = b"error"
_MESSAGE_STOP = b"message_stop"
_MESSAGE_DELTA = b"message_delta"
_PARSED = frozenset((_CONTENT_BLOCK_START, _MESSAGE_START, _ERROR))
_PARSED_WITH_USAGE = _PARSED | {_MESSAGE_DELTA}
# Bytes that every event the gate must see holds: the end of its ``event``
# line, which (with no "\r" in the stream) is the name and a "\n". Data lines
# hold JSON, where a "\n" never follows these words: text deltas full of
# code that mentions "error" or "_start" still take the fast path.
# The one that recurs in a read (a content_block_start per block) comes first:
# see EventFramer.next_marked.
_GATED_NAME_ENDS = (b"_start\n", _ERROR + b"\n", _MESSAGE_STOP + b"\n")
# A thinking block's signature arrives in a content_block_delta: when the
# translator marks thinking with its maker, ``"signature_delta"`` (in text an
# escaped quote follows the word) is gated too; otherwise it costs nothing.
_CONTENT_BLOCK_DELTA = b"content_block_delta"
_SIGNATURE_DELTA = b'"signature_delta"'
_GATED_WITH_SIGNATURES = (*_GATED_NAME_ENDS, _SIGNATURE_DELTA)
# With a usage reader: the message_delta that ends an answer (once a stream).
# (One search for "message_" would find it and message_stop together, but
# JSON text holds that word often, in code: "message_id"; a name and its
# "\n" never.)
_MESSAGE_DELTA_END = _MESSAGE_DELTA + b"\n"


def _unterminated_last_event(pending: bytes, reason: Failure | None) -> bytes | None:
    """
    The line ends that complete a last event sent without its blank line,
    or ``None`` when ``pending`` is not such an event.

    Some upstreams end a stream with ``data: {"type":"message_stop"}`` and
    no blank line (or no line end at all), then end the body properly; the
    SDKs read that event whole. It is one only when the body ended cleanly
    (``ResponseDone``, not a lost connection) and the held lines form an
    event whose data is whole JSON, as every Messages event's is.
    """
    if not pending or not (reason is None or reason.check(ResponseDone)):
        return None
    try:
        _, data = parse_event(pending)
        ujson.loads(data)
    except (UnicodeDecodeError, ValueError):
        return None
    if pending.endswith(b"\r\n"):
        return b"\r\n"
    if pending.endswith((b"\n", b"\r")):
        return pending[-1:]
    return b"\n\n"


def _signs(payload: dict) -> bool:
    """Whether a ``content_block_delta``'s payload is a thinking block's ``signature_delta``."""
    delta = payload.get("delta")
    return isinstance(delta, dict) and delta.get("type") == "signature_delta"


def _ending(reason: Failure | None) -> str:
    """How an upstream body ended, in words for an error message."""
    if reason is None or reason.check(ResponseDone):
        return "the body ended"
    if reason.check(PotentialDataLoss):
        return "the connection closed with no end marker"
    return "the connection was lost: %s" % (reason.type.__name__,)


@implementer(IPushProducer)
class SSEGate(Protocol):
    """
    Stream an upstream SSE body to the client, rewriting tool-use ids.

    Give it to ``response.deliverBody`` and register it on the client
    request with ``request.registerProducer(gate, True)``. Each received
    chunk's complete events reach ``write`` in one call, in order; an
    incomplete event is held until complete, so a ``content_block_start`` is
    decided before it or anything after it is written. Events that need no
    rewrite are written as the bytes received.

    :param write: the client sink, e.g. the request's ``write``.
    :param translator: a ``ResponseTranslator``; ``None`` passes every event
        through.
    :param clock: the time source for the ping and idle timers.
    :param idle_timeout: seconds of upstream silence after which the stream
        fails (504); ``None`` for never.
    :param ping_interval: seconds of upstream silence after which the relay
        sends a ``ping`` event of its own; ``None`` for never.
    :param max_event_bytes: the largest upstream event accepted (502 beyond).
    :param on_rewrite: called with each ``Rewrite`` the translator records.
    :param on_error_event: called with the parsed payload of every upstream
        ``error`` event.
    :param redact_error: given the bytes of every upstream ``error`` event,
        returns them with secrets removed (an upstream may repeat the key it
        was sent); ``None`` passes them as they are. Other events never
        reach it.
    :param on_usage: called with the name (``b"message_start"`` or
        ``b"message_delta"``) and the parsed payload of each event that
        reports usage; ``None`` reads no ``message_delta``.

    :ivar done: fires ``None`` when the upstream body ended after a complete
        stream; errbacks with :class:`~twisted_relay.errors.RelayError` when it
        was cut, was silent too long or sent an oversized event, and with
        ``CancelledError`` when the client went away (:meth:`stopProducing`)
        or ``done`` was cancelled. Nothing is written after it has fired.
    :ivar message_stop_seen: whether ``message_stop`` has gone through.
    :ivar events_rewritten: events whose ids were rewritten.
    :ivar bytes_received: upstream body bytes.
    :ivar bytes_written: bytes written to the client, pings included.
    :ivar pings_sent: pings the relay added.
    """

    log = Logger()

    def __init__(
        self,
        write: Callable[[bytes], None],
        translator: ResponseTranslator | None = None,
        *,
        clock: IReactorTime,
        idle_timeout: float | None = None,
        ping_interval: float | None = None,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        on_rewrite: Callable[[Rewrite], None] | None = None,
        on_error_event: Callable[[dict], None] | None = None,
        redact_error: Callable[[bytes], bytes] | None = None,
        on_usage: Callable[[bytes, dict], None] | None = None,
    ):
        self._write = write
        self._translator = translator
        self._marks_thinking = getattr(translator, "marks_thinking", False)
        gated = _GATED_WITH_SIGNATURES if self._marks_thinking else _GATED_NAME_ENDS
        if on_usage is not None:
            # After the "_start" events, which recur; message_delta comes once.
            gated = (gated[0], _MESSAGE_DELTA_END, *gated[1:])
        self._gated = gated
        self._parsed = _PARSED if on_usage is None else _PARSED_WITH_USAGE
        self._on_usage = on_usage
        self._clock = clock
        self._idle_timeout = idle_timeout
        self._ping_interval = ping_interval
        self._on_rewrite = on_rewrite
        self._on_error_event = on_error_event
        self._redact_error = redact_error
        self._framer = EventFramer(max_event_bytes)
        self.done: Deferred[None] = Deferred(lambda d: self.stopProducing())
        self._paused = False
        self._busy = False
        self._again = False
        self._held: list[bytes] = []
        self._last_byte = 0.0
        self._quiet_since = 0.0
        self._idle_call: UpstreamTimer | None = None
        self._ping_call: IDelayedCall | None = None
        self.message_stop_seen = False
        self.error_event_seen = False
        self.events_rewritten = 0
        self.bytes_received = 0
        self.bytes_written = 0
        self.pings_sent = 0

    # -- IProtocol -------------------------------------------------------

    def connectionMade(self) -> None:
        """Start the timers, or pass on a pause or stop that came first."""
        if self.done.called:
            self.transport.stopProducing()
        elif self._paused:
            self.transport.pauseProducing()
        else:
            self._start_timers()

    def dataReceived(self, data: bytes) -> None:
        """Frame a chunk and write its complete events in one write."""
        if self.done.called:
            return
        self._heard(len(data))
        if self._busy:
            # A callback of ours led here: the outer call is mid-buffer.
            self._held.append(data)
            self._again = True
            return
        self._framer.append(data)
        self._drain()

    def eventsReceived(self, events: list[tuple[bytes, dict | None, bytes]]) -> None:
        """
        Take whole events that a wire made itself (its translation of
        another protocol's stream, or its own framing's), as ``(name,
        payload, raw)``: the event's name, its data parsed (a dict, the
        gate's from now on: the translator changes it in place) or ``None``
        when the wire did not parse it, and its bytes (one ``event`` and one
        ``data`` line), which ``payload`` is, serialised. They are decided
        and written as :meth:`dataReceived` decides and writes ``raw``, in
        one write, without being framed or searched again; an event given
        no payload is parsed from ``raw`` only if the gate decides it.
        While anything waits (a pause, events not yet written, a call of
        ours under way) they join it as ``raw``, through :meth:`dataReceived`.
        """
        framer = self._framer
        if self._busy or self._paused or self.done.called or framer.position != len(framer.buffer):
            self.dataReceived(b"".join([raw for _, _, raw in events]))
            return
        self._busy, self._again = True, False
        try:
            received = 0
            pieces = []
            for name, payload, raw in events:
                received += len(raw)
                if name in self._parsed or (
                    name == _CONTENT_BLOCK_DELTA and self._marks_thinking and (
                        _signs(payload) if payload is not None else raw.find(_SIGNATURE_DELTA) >= 0)
                ):
                    replacement = self._decide(name, raw, payload)
                    pieces.append(raw if replacement is None else replacement)
                else:
                    if name == _MESSAGE_STOP:
                        self.message_stop_seen = True
                    pieces.append(raw)
            self._heard(received)
            out = b"".join(pieces)
            if out:
                self._send(out)
        except Exception:
            self._internal_failure()
        finally:
            self._busy = False
        if self._again:
            # Data came, or a resumption, while the events were written.
            self._drain()

    def connectionLost(self, reason: Failure = None) -> None:
        """
        Write what is left and judge the stream by its content: it is
        complete when ``message_stop`` (or an upstream ``error`` event) went
        through and no event was cut. ``ResponseDone`` and
        ``PotentialDataLoss`` are treated alike, since SSE says by itself
        whether it is whole.
        """
        if self.done.called:
            return
        self._cancel_timers()
        # Events held by a pause are in memory already: write them all.
        self._paused = False
        self._framer.end()
        self._drain()
        if self.done.called:
            return
        tail = _unterminated_last_event(self._framer.pending, reason)
        if tail is not None:
            self._framer.append(tail)
            self._drain()
            if self.done.called:
                return
        why = _ending(reason)
        if self._framer.pending:
            self._fail(
                RelayError(502, "The upstream stream was cut in the middle of an event (%s)." % why),
                stop=False,
            )
        elif not (self.message_stop_seen or self.error_event_seen):
            self._fail(
                RelayError(502, "The upstream stream was cut before message_stop (%s)." % why),
                stop=False,
            )
        else:
            self.done.callback(None)

    # -- IPushProducer ---------------------------------------------------

    def pauseProducing(self) -> None:
        """The client is slow: pause the upstream and hold buffered events."""
        if self.done.called:
            return
        self._paused = True
        # The silence that follows is ours, not the upstream's.
        self._cancel_timers()
        if self.transport is not None:
            self.transport.pauseProducing()

    def resumeProducing(self) -> None:
        """Resume the upstream and write the events held meanwhile."""
        if self.done.called or not self._paused:
            return
        self._paused = False
        if self.transport is not None:
            self.transport.resumeProducing()
            self._start_timers()
        self._drain()

    def stopProducing(self) -> None:
        """The client went away: stop the upstream; ``done`` fails with ``CancelledError``."""
        if self.done.called:
            return
        self._cancel_timers()
        if self.transport is not None:
            self.transport.stopProducing()
        self.done.errback(Failure(CancelledError("The client went away.")))

    # -- the hot path ------------------------------------------------------

    def _drain(self) -> None:
        # Re-entry (a write that pauses and resumes us, say) only marks more
        # work for the outer call, as LineReceiver does.
        if self._busy:
            self._again = True
            return
        self._busy = True
        try:
            while True:
                self._again = False
                if self._held:
                    for data in self._held:
                        self._framer.append(data)
                    del self._held[:]
                if self._paused or self.done.called:
                    break
                self._take_events()
                if not self._again:
                    break
        except Exception:
            self._internal_failure()
        finally:
            self._busy = False

    def _take_events(self) -> None:
        """Write every complete buffered event: one write, one slice when clean."""
        framer = self._framer
        buf = framer.buffer
        n = len(buf)
        out_start = stop = framer.position
        pieces = None
        too_large = None
        while not self._paused:
            # Only the events whose event lines end in a name the gate reads
            # come here one by one; the others pass as they are, between them.
            try:
                start, end = framer.next_marked(self._gated)
            except EventTooLarge as e:
                too_large = e
                stop = framer.position
                break
            if end < 0:
                stop = start
                break
            stop = end
            name = event_name_at(buf, start, end, framer.line_ends_vary)
            if name in self._parsed or (
                name == _CONTENT_BLOCK_DELTA
                and self._marks_thinking
                and buf.find(_SIGNATURE_DELTA, start, end) >= 0
            ):
                replacement = self._decide(name, copy_range(buf, start, end))
                if replacement is not None:
                    if pieces is None:
                        pieces = []
                    pieces.append(copy_range(buf, out_start, start))
                    pieces.append(replacement)
                    out_start = end
            elif name == _MESSAGE_STOP:
                self.message_stop_seen = True
            if end == n:
                # The read ended with this event (the common case): nothing more to ask.
                break
        if pieces is None:
            out = copy_range(buf, out_start, stop)
        else:
            pieces.append(copy_range(buf, out_start, stop))
            out = b"".join(pieces)
        framer.compact()
        if out:
            self._send(out)
        if too_large is not None:
            message = "The upstream sent an event larger than %d bytes." % (too_large.limit,)
            self._fail(RelayError(502, message))

    def _decide(self, name: bytes, raw: bytes, payload: dict | None = None) -> bytes | None:
        """
        Decide one event that may carry ids, parsed from ``raw`` unless
        ``payload`` is given; return its new bytes when the translator
        changed it, else ``None`` (the original bytes stay).
        """
        if name == _ERROR:
            # The upstream reported its own end, readable or not.
            self.error_event_seen = True
            return self._error_event(raw, payload)
        if payload is None:
            try:
                payload = ujson.loads(parse_event(raw)[1])
            except ValueError:
                self.log.warn(
                    "An upstream {name} event is not JSON; passed through.",
                    name=name.decode("ascii", "replace"),
                )
                return None
            if not isinstance(payload, dict):
                return None
        if self._on_usage is not None and (name == _MESSAGE_START or name == _MESSAGE_DELTA):
            self._on_usage(name, payload)
            if name == _MESSAGE_DELTA:
                return None
        translator = self._translator
        if translator is None:
            return None
        if name == _CONTENT_BLOCK_START:
            part = payload.get("content_block")
            if not isinstance(part, dict):
                return None
            recorded = len(translator.rewrites)
            changed = translator.translate_block(part)
        elif name == _CONTENT_BLOCK_DELTA:
            recorded = len(translator.rewrites)
            changed = translator.translate_delta(payload.get("delta"))
        else:
            part = payload.get("message")
            if not isinstance(part, dict):
                return None
            recorded = len(translator.rewrites)
            changed = translator.translate_message(part)
        if self._on_rewrite is not None:
            for rewrite in translator.rewrites[recorded:]:
                self._on_rewrite(rewrite)
        if not changed:
            return None
        self.events_rewritten += 1
        return sse_event(name, payload)

    def _error_event(self, raw: bytes, payload: dict | None) -> bytes | None:
        """
        Report an upstream ``error`` event (parsed from ``raw`` unless
        ``payload`` is given); return its bytes with secrets removed when
        that changed them, else ``None``.
        """
        if payload is None:
            try:
                payload = ujson.loads(parse_event(raw)[1])
            except ValueError:
                self.log.warn("An upstream error event is not JSON; passed through.")
        if isinstance(payload, dict) and self._on_error_event is not None:
            self._on_error_event(payload)
        if self._redact_error is None:
            return None
        redacted = self._redact_error(raw)
        return None if redacted == raw else redacted

    def _heard(self, size: int) -> None:
        """The upstream sent ``size`` bytes: count them, and tell the timers it is alive."""
        self.bytes_received += size
        if self._idle_call is not None or self._ping_call is not None:
            self._last_byte = self._quiet_since = self._clock.seconds()

    def _send(self, data: bytes) -> None:
        self.bytes_written += len(data)
        self._write(data)

    # -- timers and endings -----------------------------------------------

    def _start_timers(self) -> None:
        now = self._clock.seconds()
        self._last_byte = self._quiet_since = now
        if self._idle_timeout is not None and self._idle_call is None:
            self._idle_call = UpstreamTimer(self._clock, self._idle_timeout, self._idle_check)
        if self._ping_interval is not None and self._ping_call is None:
            self._ping_call = self._clock.callLater(self._ping_interval, self._ping_check)

    def _cancel_timers(self) -> None:
        for call in (self._idle_call, self._ping_call):
            if call is not None and call.active():
                call.cancel()
        self._idle_call = self._ping_call = None

    # Timers are not reset on every chunk (that would cost a heap operation
    # per chunk): each one, when it fires, looks at the time of the last byte
    # and sleeps again for what is left.

    def _idle_check(self) -> None:
        left = self._last_byte + self._idle_timeout - self._clock.seconds()
        if left > 0:
            self._idle_call = UpstreamTimer(self._clock, left, self._idle_check)
            return
        self._idle_call = None
        self._fail(
            RelayError(
                504,
                "The upstream sent nothing for %g seconds." % (self._idle_timeout,),
                "timeout_error",
            )
        )

    def _ping_check(self) -> None:
        now = self._clock.seconds()
        left = self._quiet_since + self._ping_interval - now
        if left <= 0:
            # The client has only ever received whole events, so a ping
            # always falls between two of them.
            self.pings_sent += 1
            self._send(PING_EVENT)
            self._quiet_since = now
            left = self._ping_interval
        if not self.done.called and self._ping_call is not None:
            self._ping_call = self._clock.callLater(left, self._ping_check)

    def _fail(self, error: RelayError, stop: bool = True) -> None:
        if self.done.called:
            return
        self._cancel_timers()
        if stop and self.transport is not None:
            self.transport.stopProducing()
        self.done.errback(Failure(error))

    def _internal_failure(self) -> None:
        self.log.failure("The SSE gate failed")
        self._fail(RelayError(500, "The relay failed while streaming the answer."))
