# -*- test-case-name: tests.test_start_checks -*-
"""
What the relay opens or checks before it listens on any port.

A relay that listens and only then finds that it cannot open its usage
ledger holds a port and serves nothing, while a supervisor and a load
balancer see it up. So every resource the configuration names is tried
first, each by a :class:`StartCheck`: every ``--listen`` endpoint is made
(an ``ssl:`` one reads its key and certificates), the usage ledger is
opened (its tables made if missing), a Redis thread store must answer, the
dump folder must take a file, the managed settings file must hold settings
Claude Code can take, and each upstream's login gets its credentials. The
first that fails is a :class:`StartupError` whose text is one line naming
it.

Who runs them (:func:`run_start_checks`): ``twistd relay`` as it makes the
service, before twistd logs, daemonizes or binds anything
(:mod:`twisted_relay.tap`); otherwise the relay's own service, before any of
its listeners (an application that embeds the relay, each ``--workers``
process). The key files and the ``--config`` file are read earlier still,
with the options (:mod:`twisted_relay.settings`).

A resource of a new kind adds its check in :func:`start_checks_for`, as the
upstreams' logins do (each gets its credentials once, blocking:
:meth:`twisted_relay.logins.Login.check`; ``twistd relay`` only, see there).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterable

from twisted.internet import endpoints
from twisted.internet.error import CannotListenError, VerifyError

from twisted_relay.config import RelayConfig
from twisted_relay.ledger_sql import LedgerError, open_ledger
from twisted_relay.logins import LoginError, LoginThreads, login_for
from twisted_relay.message_threads.store import ThreadStoreUnavailable, check_thread_store
from twisted_relay.signin.managed_settings import ManagedSettings, SettingsFileError

__all__ = [
    "ENDPOINT_ERRORS",
    "StartCheck",
    "StartupError",
    "dump_folder_takes_files",
    "ledger_opens",
    "login_gets_credentials",
    "one_line_reason",
    "run_start_checks",
    "start_checks_for",
]


class StartupError(Exception):
    """
    The relay cannot start for a reason its user can fix (a port in use, a
    folder that does not exist, a missing certificate); its text says so
    in one line.
    """


@dataclass(frozen=True)
class StartCheck:
    """
    One resource the relay needs, tried before it listens.

    :ivar failure: how the line begins when it fails, naming the resource
        (``"cannot open the usage ledger"``); the reason follows.
    :ivar run: opens or checks the resource (and lets go of it), at once.
    :ivar errors: what ``run`` raises when the resource cannot be used; any
        other exception is a bug, and is raised as it is.
    """

    failure: str
    run: Callable[[], object]
    errors: tuple[type[BaseException], ...]


def run_start_checks(checks: Iterable[StartCheck]) -> None:
    """
    Run ``checks`` in order.

    :raises StartupError: for the first that fails: its ``failure``, and why.
    """
    for check in checks:
        try:
            check.run()
        except check.errors as e:
            raise StartupError("%s: %s" % (check.failure, one_line_reason(e))) from e


#: What making a ``--listen`` endpoint raises for one that cannot be used:
#: a file it names is missing or unreadable, its TLS key and certificate do
#: not load or do not match, no socket was passed at a ``systemd:`` index,
#: a value it does not take.
ENDPOINT_ERRORS: tuple[type[BaseException], ...] = (OSError, VerifyError, ValueError, TypeError, KeyError, IndexError)
try:
    from OpenSSL import SSL, crypto
except ImportError:  # no TLS: ssl: endpoints cannot be made at all (a ValueError)
    pass
else:
    ENDPOINT_ERRORS += (crypto.Error, SSL.Error)


def one_line_reason(error: BaseException) -> str:
    """
    Why ``error`` happened, in one line: an OS error's own words (``Address
    already in use``) and the file it names, OpenSSL's reasons, or the
    error's text.
    """
    if isinstance(error, CannotListenError) and isinstance(error.socketError, Exception):
        error = error.socketError
    if isinstance(error, OSError) and error.strerror:
        # (A failed link or rename names its second file too: the one that matters.)
        filename = error.filename2 if error.filename2 is not None else error.filename
        if filename is not None:
            return "%s: %s" % (error.strerror, filename)
        return error.strerror
    if type(error).__module__.startswith("OpenSSL") and error.args and isinstance(error.args[0], list):
        # OpenSSL's error queue: (library, function, reason) for each.
        reasons = ["; ".join(part for part in entry if part) for entry in error.args[0] if isinstance(entry, tuple)]
        return "TLS key or certificate: %s" % (", ".join(reasons) or "unusable",)
    if isinstance(error, VerifyError):
        return "TLS key or certificate: %s" % (" ".join(str(error).split()),)
    return " ".join(str(error).split()) or error.__class__.__name__


def ledger_opens(target: str) -> None:
    """Open the usage ledger ``target`` names (making its file and tables if missing), then let go of it."""
    database = open_ledger(target)
    try:
        database.open()
    finally:
        database.close()


def dump_folder_takes_files(folder: str) -> None:
    """
    Make the dump folder if missing (0700, as the dump writer makes it),
    then write and remove a file in it (0600).
    """
    os.makedirs(folder, mode=0o700, exist_ok=True)
    try:
        fd, path = tempfile.mkstemp(prefix=".start-check.", suffix=".tmp", dir=folder)
    except OSError as e:
        # Named by the folder: the file's random name would say nothing.
        raise OSError(e.errno, e.strerror, folder) from None
    os.close(fd)
    os.unlink(path)


def start_checks_for(config: RelayConfig, reactor=None, *, logins: bool = True) -> list[StartCheck]:
    """
    The checks of the resources ``config`` names, in the order they run.

    :param reactor: the reactor the endpoints and logins are made for (the
        global one by default).
    :param logins: with the upstreams' logins: each gets its credentials
        here, blocking, from a server that may take long to answer (a
        cloud's token endpoint). ``twistd relay`` checks them before its
        reactor runs; a relay's own service does not (on a running reactor
        the wait could be for a server that reactor serves): its logins
        fetch off the reactor as it starts, and a failure is logged.
    """
    if reactor is None:
        from twisted.internet import reactor
    checks = [
        StartCheck(
            "cannot listen on %s" % (description,),
            lambda description=description: endpoints.serverFromString(reactor, description),
            ENDPOINT_ERRORS,
        )
        for description in config.listen
    ]
    if config.usage_db is not None:
        checks.append(StartCheck("cannot open the usage ledger", lambda: ledger_opens(config.usage_db), (LedgerError,)))
    if config.thread_store != "memory":
        checks.append(
            StartCheck("cannot reach the thread store", lambda: check_thread_store(config.thread_store), (ThreadStoreUnavailable,))
        )
    if config.dump_dir:
        checks.append(
            StartCheck(
                "cannot write dumps to %s" % (os.path.abspath(config.dump_dir),),
                lambda: dump_folder_takes_files(config.dump_dir),
                (OSError,),
            )
        )
    if config.signin is not None or config.simulate_idp:
        checks.append(StartCheck("cannot sign in", _signin_libraries, (ImportError,)))
    if config.signin is not None and config.signin.managed_settings is not None:
        checks.append(
            StartCheck(
                "cannot serve the managed settings",
                lambda: ManagedSettings(config.signin.managed_settings),
                (SettingsFileError,),
            )
        )
    if config.signin is not None and config.workers > 1 and config.usage_db is None:
        checks.append(StartCheck("cannot sign in with --workers", _signin_needs_a_database, (ValueError,)))
    if config.simulate == "bedrock":
        # The simulated Bedrock checks each signature with botocore, as AWS would.
        from twisted_relay.logins.aws import require_botocore

        checks.append(StartCheck("cannot run the simulated Bedrock", require_botocore, (LoginError,)))
    for upstream in config.upstreams if logins else ():
        if upstream.login is not None:
            checks.append(
                StartCheck(
                    "cannot log in to upstream %s" % (upstream.name,),
                    lambda upstream=upstream: login_gets_credentials(upstream, reactor),
                    (LoginError,),
                )
            )
    return checks


def login_gets_credentials(upstream, reactor) -> None:
    """
    Make ``upstream``'s login from its settings (one that cannot work fails
    here) and get its credentials now, blocking
    (:meth:`~twisted_relay.logins.Login.check`).
    """
    try:
        login = login_for(upstream, reactor, LoginThreads(reactor))
    except LoginError as e:
        # (Its text begins with the upstream's name, which the line already gives.)
        where = "upstream %s: " % (upstream.name,)
        text = str(e)
        raise LoginError(text[len(where):] if text.startswith(where) else text) from None
    login.check()


def _signin_needs_a_database() -> None:
    """Worker processes share sign-ins (grants, refresh tokens, revocations) through the ledger's database only."""
    raise ValueError("the worker processes share sign-ins through the usage ledger's database: give --usage-db")


def _signin_libraries() -> None:
    """Sign-in's libraries (joserfc, authlib), or one line naming the extra that installs them."""
    try:
        import authlib  # noqa: F401
        import joserfc  # noqa: F401
    except ImportError as e:
        raise ImportError("%s is not installed: pip install 'twisted-relay[signin]'" % (e.name,)) from None
