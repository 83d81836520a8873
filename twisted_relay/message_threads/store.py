# -*- test-case-name: tests.test_message_thread_store -*-
"""
Where the relay keeps message threads: in its own memory (the default) or in
Redis (``--thread-store redis://...``), behind one small interface,
:class:`IThreadStore`, whose methods return Deferreds.

A store keeps, under the id of each answer a client received, the bytes of
the conversation up to that answer (:meth:`Conversation.encode
<twisted_relay.message_threads.model.Conversation.encode>`); it does not read them. It
also enforces the API's rules on ``continue``: a second ``continue`` from
the same answer is refused (``thread_already_continued``), and so is one
while another from it is in flight (``thread_continue_in_flight``); an
answer that was continued is dropped (only its successor can be continued),
so a conversation costs its own size once, whatever its length.

A store that cannot answer (Redis down or slow) answers "not found": the
client replays the whole conversation and nothing else stops. Keys and
contents never reach a log.
"""

from __future__ import annotations

import socket
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from zope.interface import Attribute, Interface, implementer

from twisted_relay.message_threads.model import (
    ThreadError,
    already_continued,
    continue_in_flight,
    thread_not_found,
)

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_THREADS",
    "DEFAULT_TTL",
    "IThreadStore",
    "MemoryThreadStore",
    "RedisThreadStore",
    "ThreadStoreUnavailable",
    "check_thread_store",
    "thread_store_for",
]

#: Seconds a thread lives after its last use.
DEFAULT_TTL = 300.0
#: Threads the memory store holds at most.
DEFAULT_MAX_THREADS = 10_000
#: Conversation bytes the memory store holds at most.
DEFAULT_MAX_BYTES = 512 * 1024 * 1024
#: Seconds a ``continue`` holds its answer before another may continue from
#: it even without an outcome (a worker that died mid-request).
DEFAULT_LEASE = 1200.0
#: Seconds a Redis command may take before the store counts as down.
DEFAULT_COMMAND_TIMEOUT = 2.0


class IThreadStore(Interface):
    """Threads kept under answer ids. Every method returns a Deferred."""

    hits = Attribute("Continues that found their thread.")
    misses = Attribute("Continues that did not (unknown, expired, evicted, store down).")
    evictions = Attribute("Threads dropped to stay within the bounds.")
    expirations = Attribute("Threads dropped after their time to live.")
    failures = Attribute("Store operations that failed (store down or slow).")

    def begin(previous_message_id: str) -> defer.Deferred:
        """
        Start a ``continue`` from ``previous_message_id``: fire with the
        stored conversation bytes and hold the answer until :meth:`commit` or
        :meth:`abort`; fail with a :class:`~twisted_relay.message_threads.model.ThreadError`
        (not found, already continued, in flight).
        """

    def commit(answer_id: str, data: bytes, previous_message_id: str | None = None) -> defer.Deferred:
        """
        Keep ``data`` under ``answer_id``, the answer the client received. For
        a ``continue``, ``previous_message_id`` is marked continued, dropped
        and released. Fires ``None``; a store that failed is logged, not
        raised (the next ``continue`` is then not found).
        """

    def abort(previous_message_id: str) -> defer.Deferred:
        """Release a ``continue`` whose answer failed: the thread does not advance."""

    def size() -> tuple[int, int] | None:
        """``(threads, bytes)`` held, or ``None`` when the store cannot tell cheaply."""

    def close() -> defer.Deferred:
        """Let go of connections."""


class _Held:
    __slots__ = ("data", "expires")

    def __init__(self, data: bytes, expires: float):
        self.data = data
        self.expires = expires


@implementer(IThreadStore)
class MemoryThreadStore:
    """
    Threads in this process's memory, least recently used first out.

    :param clock: the time source (a ``Clock`` in tests).
    :param ttl: seconds a thread lives after its last use; ``None``: until
        evicted.
    :param max_threads: threads held at most.
    :param max_bytes: bytes held at most (conversation bytes plus keys); a
        conversation larger than this on its own is not kept.
    :param lease: seconds a ``continue`` in flight holds its answer at most.
    """

    def __init__(
        self,
        clock: IReactorTime,
        *,
        ttl: float | None = DEFAULT_TTL,
        max_threads: int = DEFAULT_MAX_THREADS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        lease: float = DEFAULT_LEASE,
    ):
        if max_threads < 1 or max_bytes < 1:
            raise ValueError("max_threads and max_bytes must be 1 or more")
        self._clock = clock
        self._ttl = ttl
        self._max_threads = max_threads
        self._max_bytes = max_bytes
        self._lease = lease
        # Oldest use first: with one time to live for all, also soonest to expire.
        self._threads: OrderedDict[str, _Held] = OrderedDict()
        # Answers continued, kept to answer thread_already_continued, with
        # their expiry; at most as many as threads.
        self._continued: OrderedDict[str, float] = OrderedDict()
        # Holds of continues in flight, with their end; oldest first.
        self._in_flight: OrderedDict[str, float] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = self.evictions = self.expirations = self.failures = 0

    def _expiry(self, now: float) -> float:
        return float("inf") if self._ttl is None else now + self._ttl

    def _drop(self, key: str) -> None:
        held = self._threads.pop(key)
        self._bytes -= len(held.data) + len(key)

    def _expire(self, now: float) -> None:
        threads = self._threads
        while threads:
            key, held = next(iter(threads.items()))
            if held.expires > now:
                break
            self._drop(key)
            self.expirations += 1
        for marks in (self._continued, self._in_flight):
            while marks:
                key, expires = next(iter(marks.items()))
                if expires > now:
                    break
                del marks[key]

    def begin(self, previous_message_id: str) -> defer.Deferred:
        now = self._clock.seconds()
        self._expire(now)
        key = previous_message_id
        if key in self._in_flight:
            return defer.fail(continue_in_flight())
        if key in self._continued:
            return defer.fail(already_continued())
        held = self._threads.get(key)
        if held is None:
            self.misses += 1
            return defer.fail(thread_not_found())
        self.hits += 1
        held.expires = self._expiry(now)
        self._threads.move_to_end(key)
        self._in_flight[key] = now + self._lease
        return defer.succeed(held.data)

    def commit(self, answer_id: str, data: bytes, previous_message_id: str | None = None) -> defer.Deferred:
        now = self._clock.seconds()
        self._expire(now)
        if previous_message_id is not None:
            self._in_flight.pop(previous_message_id, None)
            if previous_message_id in self._threads:
                self._drop(previous_message_id)
            self._continued[previous_message_id] = self._expiry(now)
            self._continued.move_to_end(previous_message_id)
            while len(self._continued) > self._max_threads:
                self._continued.popitem(last=False)
        if answer_id in self._threads:
            self._drop(answer_id)
        self._continued.pop(answer_id, None)
        cost = len(data) + len(answer_id)
        if cost > self._max_bytes:
            self.evictions += 1
            return defer.succeed(None)
        self._threads[answer_id] = _Held(data, self._expiry(now))
        self._bytes += cost
        while len(self._threads) > self._max_threads or self._bytes > self._max_bytes:
            key = next(iter(self._threads))
            self._drop(key)
            self.evictions += 1
        return defer.succeed(None)

    def abort(self, previous_message_id: str) -> defer.Deferred:
        self._in_flight.pop(previous_message_id, None)
        return defer.succeed(None)

    def size(self) -> tuple[int, int]:
        self._expire(self._clock.seconds())
        return len(self._threads), self._bytes

    def close(self) -> defer.Deferred:
        return defer.succeed(None)


# -- Redis ------------------------------------------------------------------------

# KEYS: thread, continued marker, lease. ARGV: ttl ms, lease ms.
_BEGIN = b"""
if redis.call('EXISTS', KEYS[3]) == 1 then return {'in_flight'} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {'continued'} end
local v = redis.call('GET', KEYS[1])
if not v then return {'missing'} end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('SET', KEYS[3], '1', 'PX', ARGV[2])
return {'ok', v}
"""

# KEYS: new thread, its continued marker[, previous thread, previous continued
# marker, previous lease]. ARGV: data, ttl ms. The previous answer is settled
# first, so that an answer under its own previous id is kept.
_COMMIT = b"""
if #KEYS > 2 then
  redis.call('DEL', KEYS[3], KEYS[5])
  redis.call('SET', KEYS[4], '1', 'PX', ARGV[2])
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('DEL', KEYS[2])
return 1
"""

_OUTCOMES = {b"in_flight": continue_in_flight, b"continued": already_continued, b"missing": thread_not_found}


@implementer(IThreadStore)
class RedisThreadStore:
    """
    Threads in Redis, shared by every worker and machine that uses the same
    server: each rule is one Lua script, so two workers never both continue
    from one answer. Entries expire after ``ttl`` (Redis removes them); the
    memory bound is Redis's own (``maxmemory`` with ``volatile-lru``).

    :param connection: a ``txredisapi`` connection handler (``charset=None``).
    :param clock: the time source of command timeouts.
    :param ttl: seconds a thread lives after its last use.
    :param prefix: what every key starts with.
    :param command_timeout: seconds after which a command counts as failed.
    :param lease: seconds a ``continue`` in flight holds its answer at most.
    """

    log = Logger()

    def __init__(
        self,
        connection: Any,
        clock: IReactorTime,
        *,
        ttl: float = DEFAULT_TTL,
        prefix: bytes = b"twisted-relay:thread:",
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
        lease: float = DEFAULT_LEASE,
    ):
        self._redis = connection
        self._clock = clock
        self._ttl_ms = max(1, int(ttl * 1000))
        self._lease_ms = max(1, int(lease * 1000))
        self._prefix = prefix
        self._timeout = command_timeout
        self.hits = self.misses = self.evictions = self.expirations = self.failures = 0

    @classmethod
    def from_url(cls, url: str, clock: IReactorTime, **options: Any) -> RedisThreadStore:
        """
        A store on the server ``redis://[:password@]host[:port][/db]`` names,
        connected lazily (the relay starts whether Redis is up or not).

        :raises ValueError: for a URL that is not ``redis://``.
        """
        import txredisapi

        address = _RedisAddress.of(url)
        timeout = options.get("command_timeout", DEFAULT_COMMAND_TIMEOUT)
        connection = txredisapi.lazyConnection(
            address.host,
            address.port,
            dbid=address.db,
            password=address.password,
            username=address.username,
            charset=None,
            connectTimeout=timeout,
            replyTimeout=timeout,
        )
        return cls(connection, clock, **options)

    def _key(self, kind: bytes, answer_id: str) -> bytes:
        return self._prefix + kind + answer_id.encode("utf-8", "surrogatepass")

    def _run(self, script: bytes, keys: list[bytes], args: list) -> defer.Deferred:
        return self._redis.eval(script, keys, args).addTimeout(self._timeout, self._clock)

    def _failed(self, failure, operation: str) -> None:
        self.failures += 1
        # The failure's type only: a message could hold a key.
        self.log.warn(  # noqa: G010 (twisted.logger has no warning())
            "The thread store failed ({operation}): {kind}",
            operation=operation,
            kind=failure.type.__name__,
        )

    def begin(self, previous_message_id: str) -> defer.Deferred:
        keys = [self._key(kind, previous_message_id) for kind in (b"t:", b"c:", b"f:")]
        d = self._run(_BEGIN, keys, [self._ttl_ms, self._lease_ms])

        def answered(reply):
            outcome = reply[0] if isinstance(reply, list) and reply else None
            if outcome == b"ok" and len(reply) == 2 and isinstance(reply[1], bytes):
                self.hits += 1
                return reply[1]
            if outcome == b"missing":
                self.misses += 1
            make = _OUTCOMES.get(outcome)
            if make is None:
                raise ValueError("unexpected reply")
            raise make()

        def failed(failure):
            if failure.check(ThreadError):
                return failure
            self._failed(failure, "begin")
            self.misses += 1
            raise thread_not_found()

        return d.addCallback(answered).addErrback(failed)

    def commit(self, answer_id: str, data: bytes, previous_message_id: str | None = None) -> defer.Deferred:
        keys = [self._key(b"t:", answer_id), self._key(b"c:", answer_id)]
        if previous_message_id is not None:
            keys += [self._key(kind, previous_message_id) for kind in (b"t:", b"c:", b"f:")]
        d = self._run(_COMMIT, keys, [data, self._ttl_ms])
        return d.addCallbacks(lambda _: None, self._failed, errbackArgs=("commit",))

    def abort(self, previous_message_id: str) -> defer.Deferred:
        d = self._redis.delete(self._key(b"f:", previous_message_id))
        d.addTimeout(self._timeout, self._clock)
        return d.addCallbacks(lambda _: None, self._failed, errbackArgs=("abort",))

    def size(self) -> None:
        return None

    def close(self) -> defer.Deferred:
        return defer.maybeDeferred(self._redis.disconnect)

    def __repr__(self) -> str:
        return "<RedisThreadStore>"


class ThreadStoreUnavailable(Exception):
    """The thread store does not answer at start; the text is one line, with no password."""


@dataclass(frozen=True)
class _RedisAddress:
    """Where a ``redis://[user:password@]host[:port][/db]`` URL points, and how to log in there."""

    host: str
    port: int
    db: int | None
    username: str | None
    password: str | None

    @classmethod
    def of(cls, url: str) -> _RedisAddress:
        """:raises ValueError: for a URL that is not ``redis://``."""
        parts = urlsplit(url)
        if parts.scheme != "redis" or not parts.hostname:
            raise ValueError("the thread store must be memory or a redis://host[:port][/db] URL")
        path = parts.path.strip("/")
        if path and not path.isdigit():
            raise ValueError("the database of a redis:// URL is a number")
        return cls(
            parts.hostname,
            parts.port or 6379,
            int(path) if path else None,
            unquote(parts.username) if parts.username else None,
            unquote(parts.password) if parts.password else None,
        )

    def __str__(self) -> str:
        # For messages: no user, no password.
        host = "[%s]" % (self.host,) if ":" in self.host else self.host
        return "redis://%s:%d%s" % (host, self.port, "" if self.db is None else "/%d" % (self.db,))


def check_thread_store(spec: str, timeout: float = DEFAULT_COMMAND_TIMEOUT) -> None:
    """
    Ask the store ``spec`` names (a ``--thread-store`` value) whether it
    answers, at once and blocking (the relay's start check, made before it
    listens; :mod:`twisted_relay.start_checks`): a Redis server must take
    the URL's password and database and answer a ``PING`` within
    ``timeout`` seconds per step. The memory store always answers.

    :raises ThreadStoreUnavailable: saying why, in one line.
    """
    if spec == "memory":
        return
    address = _RedisAddress.of(spec)
    commands = []
    if address.password is not None:
        commands.append([b"AUTH"] + ([address.username] if address.username else []) + [address.password])
    if address.db is not None:
        commands.append([b"SELECT", b"%d" % (address.db,)])
    commands.append([b"PING"])
    try:
        with socket.create_connection((address.host, address.port), timeout=timeout) as connection:
            replies = connection.makefile("rb")
            for command in commands:
                connection.sendall(_resp(command))
                reply = replies.readline(_MAX_REPLY_LINE)
                if reply.startswith(b"-"):
                    # An error reply (NOAUTH, WRONGPASS, a database out of range) never holds the password.
                    raise ThreadStoreUnavailable(
                        "%s refused %s: %s" % (address, command[0].decode(), reply[1:].decode("utf-8", "replace").strip())
                    )
                if not reply.startswith(b"+"):
                    raise ThreadStoreUnavailable("%s does not answer as a Redis server does" % (address,))
    except OSError as e:
        raise ThreadStoreUnavailable("%s: %s" % (address, e.strerror or str(e) or e.__class__.__name__)) from None


# The longest line of a Redis reply the start check reads.
_MAX_REPLY_LINE = 4096


def _resp(command: list) -> bytes:
    """One command in Redis's protocol (RESP): an array of bulk strings."""
    parts = [value.encode("utf-8") if isinstance(value, str) else value for value in command]
    return b"*%d\r\n" % (len(parts),) + b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in parts)


def thread_store_for(
    spec: str, clock: IReactorTime, *, ttl: float = DEFAULT_TTL, max_threads: int = DEFAULT_MAX_THREADS,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> IThreadStore:
    """
    The store ``--thread-store`` names: ``memory`` or a ``redis://`` URL.

    :raises ValueError: for anything else.
    """
    if spec == "memory":
        return MemoryThreadStore(clock, ttl=ttl, max_threads=max_threads, max_bytes=max_bytes)
    if spec.startswith("redis://"):
        return RedisThreadStore.from_url(spec, clock, ttl=ttl)
    raise ValueError("the thread store must be memory or a redis://host[:port][/db] URL")
