# -*- test-case-name: tests.test_logins -*-
"""
What every login has: credentials fetched off the reactor, kept, refreshed
ahead of their expiry, and put on each request on the reactor (cheap, CPU
only).

A :class:`Login` is one upstream's way of proving who the relay is: a
static key in a header, a bearer token that a cloud's library mints, AWS's
SigV4 signature. Its credentials come from a :class:`CredentialSource`,
whose ``fetch`` may block (a metadata service, an STS or OAuth call, a file):
it always runs on the logins' own thread pool, never on the reactor. The
source keeps the last credentials and fetches new ones ``margin`` seconds
before they expire, so a request never waits for a login; after the
upstream says the credentials are no longer good (a 401, an expired-token
403), :meth:`Login.refresh` fetches them again at once (several callers
share one fetch).

No credential is ever shown: :class:`LoginError`'s messages name the
source, never what it holds.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet.defer import Deferred, succeed
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool
from twisted.web.http_headers import Headers

__all__ = [
    "DEFAULT_MARGIN",
    "Credentials",
    "CredentialSource",
    "Login",
    "LoginError",
    "LoginThreads",
]

#: Seconds before expiry that credentials are fetched again (google-auth
#: refreshes 3 min 45 s ahead, botocore 10 to 15 min ahead: the larger).
DEFAULT_MARGIN = 600.0
#: The shortest wait between two fetches after a failed one.
RETRY_DELAY = 10.0


class LoginError(Exception):
    """
    A login could not get its credentials: one line, naming the upstream and
    the source, never a secret.
    """


class Credentials:
    """
    What a source fetched: ``value`` (the source's own kind: a token, a
    key triple) and when it expires (Unix time; ``None``: never).
    """

    __slots__ = ("value", "expires_at")

    def __init__(self, value: Any, expires_at: float | None = None):
        self.value = value
        self.expires_at = expires_at

    def __repr__(self) -> str:
        return "Credentials(<hidden>, expires_at=%r)" % (self.expires_at,)


class LoginThreads:
    """
    The one small thread pool every login's fetches run on (a fetch may
    block for seconds: a metadata service, an OAuth call). Started and
    stopped with the relay.
    """

    def __init__(self, reactor, size: int = 2):
        self._reactor = reactor
        self._size = size
        self._pool: ThreadPool | None = None

    def run(self, fetch: Callable[[], Any]) -> Deferred:
        """Run ``fetch`` on the pool; the Deferred fires on the reactor."""
        if self._pool is None:
            self._pool = ThreadPool(0, self._size, name="twisted-relay-logins")
            self._pool.start()
        return deferToThreadPool(self._reactor, self._pool, fetch)

    def stop(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()


class CredentialSource:
    """
    Credentials kept and refreshed ahead of expiry, fetched on
    :class:`LoginThreads`.

    :param reactor: the clock that schedules refreshes, and the reactor the
        fetches report to.
    :param threads: where ``fetch`` runs.
    :param fetch: called with no argument, off the reactor; returns
        :class:`Credentials` or raises (its message is logged, redacted of
        nothing: a fetch must not put a secret in an exception).
    :param describe: the source in words, for errors and logs
        (``"AWS credentials from the default chain"``).
    :param margin: fetch again this many seconds before expiry.
    """

    log = Logger()

    def __init__(self, reactor, threads: LoginThreads, fetch: Callable[[], Credentials], describe: str,
                 margin: float = DEFAULT_MARGIN):
        self._reactor = reactor
        self._threads = threads
        self._fetch = fetch
        self.describe = describe
        self._margin = margin
        self._current: Credentials | None = None
        self._pending: Deferred | None = None
        self._waiting: list[Deferred] = []
        self._timer = None
        self._stopped = False

    @property
    def current(self) -> Credentials | None:
        """The credentials in force (``None`` before the first fetch)."""
        return self._current

    def start(self) -> Deferred:
        """
        Keep the credentials fresh from now on: fetch them (fails with
        :class:`LoginError` when they cannot be had), or, when
        :meth:`fetch_now` got them a moment ago, schedule their refresh.
        """
        self._stopped = False
        current = self._current
        if current is not None and (current.expires_at is None
                                    or current.expires_at - self._reactor.seconds() > self._margin):
            self._schedule(current)
            return succeed(None)
        return self.refresh()

    def fetch_now(self) -> None:
        """
        Fetch the credentials here and now, blocking (at start, before the
        relay listens or runs its reactor: the start check of its logins).

        :raises LoginError: when they cannot be had (one line, no secret).
        """
        try:
            self._current = self._fetch()
        except Exception as e:
            raise LoginError("%s: %s" % (self.describe, _one_line(Failure(e)))) from None

    def ready(self) -> Deferred:
        """Fires once credentials are in force (at once when they are); fails as :meth:`refresh` does."""
        if self._current is not None:
            return succeed(None)
        return self.refresh()

    def stop(self) -> None:
        self._stopped = True
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def refresh(self) -> Deferred:
        """Fetch again now (one fetch shared by every caller); fires when it is done."""
        waiter: Deferred = Deferred()
        self._waiting.append(waiter)
        if self._pending is None:
            self._pending = self._threads.run(self._fetch)
            self._pending.addCallbacks(self._fetched, self._failed)
        return waiter

    def _fetched(self, credentials: Credentials) -> None:
        self._pending = None
        self._current = credentials
        self._schedule(credentials)
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            waiter.callback(None)

    def _failed(self, failure: Failure) -> None:
        self._pending = None
        message = "%s: %s" % (self.describe, _one_line(failure))
        if self._current is not None:
            self.log.warn("Refreshing {source} failed: {reason}", source=self.describe, reason=message)
            self._schedule_in(RETRY_DELAY)
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            waiter.errback(LoginError(message))

    def _schedule(self, credentials: Credentials) -> None:
        if credentials.expires_at is None:
            return
        life = credentials.expires_at - self._reactor.seconds()
        delay = life - self._margin
        if delay <= 0:
            # Credentials living less than the margin: at half their life
            # (not every second, nor after they expire).
            delay = life / 2.0
        self._schedule_in(max(delay, 1.0))

    def _schedule_in(self, delay: float) -> None:
        if self._stopped:
            return
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = self._reactor.callLater(delay, self._timed_refresh)

    def _timed_refresh(self) -> None:
        self._timer = None
        self.refresh().addErrback(lambda failure: None)  # logged in _failed


def _one_line(failure: Failure) -> str:
    text = failure.getErrorMessage() or failure.type.__name__
    return " ".join(str(text).split())[:300]


class Login:
    """
    One upstream's login: what :meth:`authorize` puts on each request.
    Subclasses say how; this base is a login with nothing to fetch.

    :ivar name: the login's kind, as the configuration names it.
    """

    name = "none"
    #: Where its credentials come from (:class:`CredentialSource`); ``None``: nothing to fetch.
    source: CredentialSource | None = None
    #: Its signature covers the body's SHA-256 (SigV4): the request path has
    #: the hash made with the body, off the reactor for a large body, and
    #: passes it to :meth:`authorize` as ``body_sha256``.
    signs_body = False

    def check(self) -> None:
        """
        Get the credentials now, blocking: the relay's start check, before it
        listens (:mod:`twisted_relay.start_checks`).

        :raises LoginError: when they cannot be had.
        """
        if self.source is not None:
            self.source.fetch_now()

    def start(self) -> Deferred:
        """Keep the credentials fresh from now on (fetching them, unless :meth:`check` just did)."""
        return succeed(None) if self.source is None else self.source.start()

    def ready(self) -> Deferred:
        """Fires once credentials are in force: a request sent before waits for it."""
        return succeed(None) if self.source is None else self.source.ready()

    def stop(self) -> None:
        """Stop refreshing."""
        if self.source is not None:
            self.source.stop()

    def refresh(self) -> Deferred:
        """The upstream refused the credentials as expired: fetch new ones now."""
        return succeed(None) if self.source is None else self.source.refresh()

    def authorize(self, method: bytes, url: str, headers: Headers, body: bytes | None) -> None:
        """
        Put the credentials on one request about to be sent (``headers``
        changed in place), on the reactor: no I/O.

        :param url: the whole URL as it goes on the wire (scheme, host, the
            encoded path and query).
        """
