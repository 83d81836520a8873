"""
Tests of the logins' base (twisted_relay.logins.base): credentials fetched
once and shared, refreshed ahead of their expiry on the clock, a failed
refresh that keeps what worked and tries again, errors in one line, and
every fetch off the reactor thread.

The timing tests run on a ``Clock`` with :class:`HeldThreads` or
:class:`InlineThreads` standing in for the logins' thread pool (the logic of
when to fetch is the same whoever runs the fetch); the thread tests run the
real :class:`LoginThreads` on trial's reactor.
"""

from __future__ import annotations

import threading

from twisted.internet import reactor
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.task import Clock
from twisted.python import threadable
from twisted.trial.unittest import SynchronousTestCase, TestCase

from twisted_relay.logins.base import RETRY_DELAY, Credentials, CredentialSource, LoginError, LoginThreads


class HeldThreads:
    """
    Stands in for :class:`LoginThreads` in clock tests: each fetch waits
    until the test lets it run (:meth:`finish`), so a test sees what is
    asked for and when.
    """

    def __init__(self):
        self.held: list[tuple] = []

    def run(self, fetch) -> Deferred:
        d: Deferred = Deferred()
        self.held.append((fetch, d))
        return d

    def finish(self) -> None:
        """Run the oldest held fetch and report its result."""
        fetch, d = self.held.pop(0)
        maybeDeferred(fetch).chainDeferred(d)


class InlineThreads:
    """Stands in for :class:`LoginThreads` in clock tests: runs each fetch at once."""

    def run(self, fetch) -> Deferred:
        return maybeDeferred(fetch)


class Minted:
    """A fetch that mints numbered credentials living ``life`` seconds on ``clock`` (or never expiring)."""

    def __init__(self, clock, life: float | None = 3600.0):
        self.clock = clock
        self.life = life
        self.count = 0
        self.attempts: list[float] = []
        self.failing: Exception | None = None

    def __call__(self) -> Credentials:
        self.attempts.append(self.clock.seconds())
        if self.failing is not None:
            raise self.failing
        self.count += 1
        expires = None if self.life is None else self.clock.seconds() + self.life
        return Credentials("token-%d" % (self.count,), expires)


class RefreshTimingTests(SynchronousTestCase):
    """When a source fetches: at start, ``margin`` before expiry, at half a short life."""

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1_000_000)
        self.threads = HeldThreads()
        self.fetch = Minted(self.clock)
        self.source = CredentialSource(self.clock, self.threads, self.fetch, "test credentials", margin=600)

    def start(self) -> None:
        d = self.source.start()
        self.threads.finish()
        self.successResultOf(d)

    def test_start_fetches_once_and_keeps(self):
        """start() fetches the credentials, which the source then holds."""
        self.assertIsNone(self.source.current)
        self.start()
        self.assertEqual(self.source.current.value, "token-1")
        self.assertEqual(self.fetch.count, 1)
        self.assertEqual(self.threads.held, [])

    def test_refresh_margin_ahead_of_expiry(self):
        """Credentials living an hour are fetched again 600 s (the margin) before they expire, not sooner."""
        self.start()
        self.clock.advance(3600 - 600 - 1)
        self.assertEqual(self.threads.held, [])
        self.clock.advance(1)
        self.assertEqual(len(self.threads.held), 1)
        self.threads.finish()
        self.assertEqual(self.source.current.value, "token-2")
        self.assertEqual(self.source.current.expires_at, self.clock.seconds() + 3600)

    def test_short_lived_at_half_their_life(self):
        """
        Credentials living less than the margin (300 s against 600) are
        fetched again at half their life, not every second.
        """
        self.fetch.life = 300.0
        self.start()
        self.clock.advance(149)
        self.assertEqual(self.threads.held, [])
        self.clock.advance(1)
        self.assertEqual(len(self.threads.held), 1)

    def test_under_twice_the_margin_still_the_margin_ahead(self):
        """Credentials living 900 s are fetched again 600 s (the margin) before they expire: at 300 s."""
        self.fetch.life = 900.0
        self.start()
        self.clock.advance(299)
        self.assertEqual(self.threads.held, [])
        self.clock.advance(1)
        self.assertEqual(len(self.threads.held), 1)

    def test_expired_on_arrival_tried_again_in_a_second(self):
        """Credentials already expired when fetched are fetched again a second later, no sooner."""
        self.fetch.life = -5.0
        self.start()
        self.clock.advance(0.9)
        self.assertEqual(self.threads.held, [])
        self.clock.advance(0.1)
        self.assertEqual(len(self.threads.held), 1)

    def test_no_expiry_no_refresh(self):
        """Credentials that never expire are never fetched again on a timer."""
        self.fetch.life = None
        self.start()
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stop_ends_the_timer(self):
        """After stop() no refresh is scheduled."""
        self.start()
        self.source.stop()
        self.clock.advance(7200)
        self.assertEqual(self.threads.held, [])


class SharedFetchTests(SynchronousTestCase):
    """Concurrent refreshes share one fetch."""

    def test_concurrent_refreshes_share_one_fetch(self):
        """Three refreshes asked while one fetch runs: one fetch, and all three learn its end."""
        clock = Clock()
        threads = HeldThreads()
        fetch = Minted(clock)
        source = CredentialSource(clock, threads, fetch, "test credentials")
        waiters = [source.refresh(), source.refresh(), source.start()]
        self.assertEqual(len(threads.held), 1)
        for waiter in waiters:
            self.assertNoResult(waiter)
        threads.finish()
        for waiter in waiters:
            self.successResultOf(waiter)
        self.assertEqual(fetch.count, 1)
        self.assertEqual(source.current.value, "token-1")

    def test_failed_fetch_fails_every_waiter(self):
        """A failed shared fetch fails each waiter with the same LoginError."""
        clock = Clock()
        threads = HeldThreads()
        fetch = Minted(clock)
        fetch.failing = OSError("metadata service unreachable")
        source = CredentialSource(clock, threads, fetch, "test credentials")
        waiters = [source.start(), source.refresh()]
        threads.finish()
        messages = {str(self.failureResultOf(waiter, LoginError).value) for waiter in waiters}
        self.assertEqual(messages, {"test credentials: metadata service unreachable"})


class FailureTests(SynchronousTestCase):
    """Fetches that fail: one-line errors, old credentials kept, a retry."""

    def setUp(self):
        self.clock = Clock()
        self.threads = InlineThreads()
        self.fetch = Minted(self.clock)
        self.source = CredentialSource(self.clock, self.threads, self.fetch, "AWS test keys", margin=600)

    def test_error_is_one_bounded_line_naming_the_source(self):
        """A fetch's multi-line error becomes one line, at most 300 characters, after the source's name."""
        self.fetch.failing = ValueError("first line\nsecond\r\n\tthird " + "x" * 1000)
        failure = self.failureResultOf(self.source.start(), LoginError)
        message = str(failure.value)
        self.assertTrue(message.startswith("AWS test keys: first line second third x"), message)
        self.assertNotIn("\n", message)
        self.assertNotIn("\r", message)
        self.assertLessEqual(len(message), len("AWS test keys: ") + 300)

    def test_error_without_message_names_its_kind(self):
        """An exception with no message is named by its class."""
        self.fetch.failing = TimeoutError()
        failure = self.failureResultOf(self.source.start(), LoginError)
        self.assertEqual(str(failure.value), "AWS test keys: TimeoutError")

    def test_first_fetch_failing_schedules_nothing(self):
        """A start that fails leaves no timer behind (the relay refuses to start)."""
        self.fetch.failing = OSError("no")
        self.failureResultOf(self.source.start(), LoginError)
        self.assertIsNone(self.source.current)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_failed_refresh_keeps_old_credentials_and_retries(self):
        """
        A refresh that fails keeps the credentials in force and tries again
        RETRY_DELAY seconds later; once that works, the new ones are in force.
        """
        self.successResultOf(self.source.start())
        old = self.source.current
        self.fetch.failing = OSError("sts unreachable")
        self.clock.advance(3000)
        self.assertIs(self.source.current, old)
        self.assertEqual(self.fetch.count, 1)
        self.clock.advance(RETRY_DELAY - 0.5)
        self.assertIs(self.source.current, old)
        self.fetch.failing = None
        self.clock.advance(0.5)
        self.assertEqual(self.source.current.value, "token-2")
        self.assertEqual(self.source.current.expires_at, self.clock.seconds() + 3600)

    def test_refresh_failing_until_expiry_retries_each_time(self):
        """While the refresh keeps failing, the source keeps trying every RETRY_DELAY seconds."""
        self.successResultOf(self.source.start())
        self.fetch.failing = OSError("still down")
        self.clock.advance(3000)
        for _ in range(5):
            self.clock.advance(RETRY_DELAY)
        self.assertEqual(self.fetch.attempts, [0] + [3000 + RETRY_DELAY * i for i in range(6)])
        self.assertEqual(self.source.current.value, "token-1")

    def test_credentials_repr_hides_value(self):
        """Credentials never show what they hold."""
        self.successResultOf(self.source.start())
        self.assertNotIn("token-1", repr(self.source.current))


class OffTheReactorTests(TestCase):
    """Fetches run on the logins' threads, never on the reactor thread (trial's real reactor)."""

    def setUp(self):
        self.threads = LoginThreads(reactor)
        self.addCleanup(self.threads.stop)

    async def test_fetch_runs_off_the_reactor_thread(self):
        """
        A source's fetch runs on another thread than the reactor's: it would
        block every request while a metadata service or STS answers.
        """
        reactor_thread = threading.get_ident()
        seen = []

        def fetch():
            seen.append((threading.get_ident(), threadable.isInIOThread()))
            return Credentials("t", None)

        source = CredentialSource(reactor, self.threads, fetch, "test credentials")
        await source.start()
        await source.refresh()
        self.assertEqual(len(seen), 2)
        for ident, in_io_thread in seen:
            self.assertNotEqual(ident, reactor_thread)
            self.assertFalse(in_io_thread)
        self.assertEqual(source.current.value, "t")

    async def test_slow_fetch_does_not_hold_the_reactor(self):
        """While a fetch blocks, the reactor keeps running (a timer fires meanwhile)."""
        release = threading.Event()
        fired = []

        def fetch():
            release.wait(10)
            return Credentials("t", None)

        source = CredentialSource(reactor, self.threads, fetch, "test credentials")
        started = source.start()

        def tick():
            fired.append(True)
            release.set()

        reactor.callLater(0.01, tick)
        await started
        self.assertEqual(fired, [True])
