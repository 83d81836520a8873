# -*- test-case-name: tests.test_wires -*-
"""
What every wire has: how one attempt's request is sent to an upstream of
its kind, and how the upstream's answer becomes Anthropic's.

The request path is one path for every wire (ids, routing, failover,
affinity, metering, dumps): a wire only

- maps the outgoing request (:meth:`Wire.outgoing`): the upstream path (a
  cloud puts the model in the URL), the headers, and a :class:`BodyForm`,
  the few top-level edits of the body done while it is serialised (in
  :func:`twisted_relay.body_work.prepare`, in a body worker for a large body);
- turns its answer into Anthropic's before the gate (:meth:`Wire.answered`
  for a 2xx, :meth:`Wire.refusal` for an error, whose body it reads).

The ``anthropic`` wire changes nothing, so an Anthropic upstream's bytes
stay the client's.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import ujson
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH

from twisted_relay.body_form import NO_EDIT, BodyForm
from twisted_relay.errors import RelayError
from twisted_relay.logs import bounded

__all__ = [
    "BodyForm",
    "Outgoing",
    "ReadAnswer",
    "Refusal",
    "WholeBodyMapped",
    "Wire",
    "anthropic_error",
    "betas_of",
    "check_model_id",
    "forwarded",
]


class Outgoing(NamedTuple):
    """What an attempt sends: the upstream path and query, the headers, the body's edits."""

    path: str
    headers: Headers
    form: BodyForm = NO_EDIT


class Refusal(NamedTuple):
    """
    An upstream's error answer, as the client gets it.

    :ivar status: the HTTP status.
    :ivar body: Anthropic's error envelope (or the upstream's own, when it
        already is one).
    :ivar expired: the upstream refused the relay's credentials as expired
        or no longer valid: fetched again and the request sent once more.
    :ivar unwanted_betas: betas the upstream refused by name: sent again
        once without them (and left out for a while).
    :ivar retry_after: seconds the upstream asked to wait, if it said.
    """

    status: int
    body: bytes
    expired: bool = False
    unwanted_betas: tuple[str, ...] = ()
    retry_after: float | None = None


def anthropic_error(error_type: str, message: str, request_id: str | None = None) -> bytes:
    """Anthropic's error envelope."""
    body: dict = {"type": "error", "error": {"type": error_type, "message": message}}
    if request_id:
        body["request_id"] = request_id
    return ujson.dumps(body, ensure_ascii=False, escape_forward_slashes=False).encode("utf-8")


# What a model id sent in a URL path may hold: letters, digits and the
# punctuation of Bedrock's ids, profiles and ARNs, Vertex's ``@`` versions.
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,255}")


def check_model_id(model: str | None) -> None:
    """
    Refuse (400) a model id that a cloud wire could not put in its URL path
    as one plain segment: a path the relay signs must not be steered
    elsewhere (``..``, a query, a fragment).
    """
    if model is None or not _MODEL_ID.fullmatch(model) or ".." in model:
        raise RelayError(
            400,
            "model: %s is not a model id this upstream takes." % (bounded(str(model)),)
            if model is not None else "model: a model is required.",
        )


def forwarded(headers: Headers, names: tuple[bytes, ...]) -> Headers:
    """New headers holding the first value of each of ``names`` that ``headers`` has (what a cloud's wire lets through)."""
    sent = Headers()
    for name in names:
        values = headers.getRawHeaders(name)
        if values:
            sent.setRawHeaders(name, values[:1])
    return sent


def betas_of(headers: Headers) -> list[str]:
    """The ``anthropic-beta`` values of ``headers``, each once, in order."""
    found: dict[str, None] = {}
    for value in headers.getRawHeaders(b"anthropic-beta", []):
        for beta in value.decode("latin-1").split(","):
            beta = beta.strip()
            if beta:
                found[beta] = None
    return list(found)


class Wire:
    """
    The ``anthropic`` wire: Anthropic's own API, and every surface that
    speaks it (Microsoft Foundry, Claude Platform on AWS, Bedrock's Messages
    API, the many servers that serve ``/v1/messages``). Nothing changes:
    the path, headers and body go as they are; the answer comes back as it
    is. Other wires override what they change.

    :ivar name: the wire's name in the configuration.
    :ivar reads_errors: its error answers are read and mapped
        (:meth:`refusal`); the ``anthropic`` wire passes them as they are.
    :ivar lists_models: the upstream serves ``GET /v1/models`` itself.
    :ivar recovers_bindings: a "bound to a different conversation" 400 may
        be answered by sending the body again with ``drop_block`` (the
        beta that needs goes in a header).
    """

    name = "anthropic"
    reads_errors = False
    lists_models = True
    recovers_bindings = True

    def __init__(self, upstream, clock=None):
        self.upstream = upstream
        self._clock = clock

    def outgoing(self, kind: str, path: str, headers: Headers, model: str | None, stream: bool, *,
                 key: str | None = None, session: str | None = None, requested: str | None = None) -> Outgoing:
        """
        What one attempt sends.

        :param kind: ``messages``, ``count_tokens`` or ``models``.
        :param path: the client's path and query (``/v1/messages?beta=true``).
        :param headers: the headers the relay would send an Anthropic
            upstream (credentials already removed or replaced).
        :param model: the model this attempt asks for (the target's and the
            upstream's model map applied).
        :param stream: the client asked for a stream.
        :param key: the attempt's key, if any (an OpenAI wire's reasoning
            names its account).
        :param session: Claude Code's session id, if sent.
        :param requested: the model the client asked for.
        """
        return Outgoing(path, headers)

    def answered(self, kind: str, stream: bool, response, context: tuple = ()):
        """
        A 2xx response as the relay reads it: an Anthropic answer (the
        response itself here).

        :param context: the translation's context the attempt's body form
            carried, if any.
        """
        return response

    def refusal(self, kind: str, status: int, headers: Headers, body: bytes, model: str | None) -> Refusal:
        """An error answer read whole, as the client gets it (only when :attr:`reads_errors`)."""
        return Refusal(status, body)


class WholeBodyMapped:
    """
    A whole (non-streamed) 2xx answer whose body a wire maps once it has
    come (Bedrock's CountTokens answer into Anthropic's): read whole, then
    given to the reader mapped. Everything else is the response's own.
    """

    def __init__(self, response, mapping):
        self.original = response
        self.code = response.code
        self.phrase = getattr(response, "phrase", b"OK")
        self.headers = response.headers.copy()
        self.headers.removeHeader(b"content-length")
        self.length = UNKNOWN_LENGTH
        self._mapping = mapping

    def __getattr__(self, name):
        return getattr(self.original, name)

    def deliverBody(self, protocol) -> None:
        self.original.deliverBody(_MappedReader(protocol, self._mapping))


class _MappedReader(Protocol):
    """Collects a body, then hands ``protocol`` its mapped form and the end."""

    def __init__(self, protocol, mapping):
        self._protocol = protocol
        self._mapping = mapping
        self._chunks: list[bytes] = []

    def makeConnection(self, transport) -> None:
        Protocol.makeConnection(self, transport)
        self._protocol.makeConnection(transport)

    def dataReceived(self, data: bytes) -> None:
        self._chunks.append(data)

    def connectionLost(self, reason) -> None:
        body = b"".join(self._chunks)
        self._chunks = []
        if reason.check(ResponseDone, PotentialDataLoss):
            try:
                mapped = self._mapping(body)
            except Exception:
                # An answer the wire cannot read (not JSON, not its shape, a
                # failed response inside a 200) is a broken one (502), never
                # passed on as it came.
                self._protocol.connectionLost(Failure(ResponseFailed([Failure()])))
                return
            self._protocol.dataReceived(mapped)
        self._protocol.connectionLost(reason)


class ReadAnswer:
    """
    An answer whose body the relay already read (to judge it, or to map an
    error): ``deliverBody`` gives that body again, at once. With a
    ``response``, everything else is its own (``code`` replaces its status,
    the body then being the wire's Anthropic envelope); without one, a 200
    JSON answer the relay made itself (a Chat upstream's ``count_tokens``).
    """

    def __init__(self, response, body: bytes, code: int | None = None):
        self._response = response
        self._body = body
        self.length = len(body)
        if response is None:
            self.code, self.phrase = 200, b"OK"
            self.headers = Headers({b"content-type": [b"application/json"]})
            return
        self.code = response.code if code is None else code
        self.headers = response.headers
        if code is not None:
            # The wire's Anthropic envelope, not the upstream's own body.
            self.headers = response.headers.copy()
            self.headers.setRawHeaders(b"content-type", [b"application/json"])
            self.headers.removeHeader(b"content-length")

    def __getattr__(self, name):
        if self._response is None:
            raise AttributeError(name)
        return getattr(self._response, name)

    def deliverBody(self, protocol) -> None:
        protocol.makeConnection(_ReadTransport())
        if self._body:
            protocol.dataReceived(self._body)
        protocol.connectionLost(Failure(ResponseDone()))


class _ReadTransport:
    """The transport of a body already read: nothing to pause, resume or stop."""

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass

    def loseConnection(self) -> None:
        pass
