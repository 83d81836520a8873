# -*- test-case-name: tests.test_tap -*-
"""
The ``twistd relay`` command: its options and the service it makes.

:class:`Options` only parses the command line: it finds which options were
given and hands their values, with the ``--config`` file, to
:func:`twisted_relay.settings.read_settings`, which builds the
:class:`~twisted_relay.config.RelayConfig` (the command line winning over
the file). The service keeps the values given, so that a reload (SIGHUP)
reads the file again with them.
"""

from __future__ import annotations

import getopt
import os
import sys

from twisted.python import usage
from twisted.python.util import runAsEffectiveUser

from twisted_relay.settings import FLAGS, PARAMETERS, SettingsError, read_settings

__all__ = ["Options", "makeService"]


class Options(usage.Options):
    """
    Options of ``twistd relay``.

    :ivar command_line: once parsed, the options given, by long name, as
        :func:`twisted_relay.settings.config_from` takes them.
    :ivar config: once parsed, the configuration they and the ``--config``
        file make.
    """

    synopsis = "[options]"
    longdesc = (
        "Relay the Anthropic Messages API to an upstream, de-duplicating "
        "tool-use ids in both directions and dumping every upstream 4xx. "
        "Try it with no key and no network: twistd -n relay --simulate strict"
    )

    optParameters = PARAMETERS
    optFlags = FLAGS

    def __init__(self):
        super().__init__()
        self["listen"] = []
        # The options given on the command line, which win over the file's.
        self._given: set[str] = set()
        self.command_line: dict = {}

    def parseOptions(self, options=None):
        """
        Parse the options; under twistd, an error is one line and exit
        status 1 (twistd itself would print its whole help before the
        message).
        """
        argv = tuple(sys.argv[1:] if options is None else options)
        self._given = _given_options(argv, self.shortOpt, self.longOpt, self.synonyms)
        try:
            super().parseOptions(options)
        except usage.UsageError as e:
            if self.parent is None:
                raise
            raise SystemExit("twistd relay: %s (twistd relay --help lists every option)" % (e,))

    def opt_listen(self, description: str) -> None:
        """
        Endpoint to listen on (repeatable), e.g. tcp:8080:interface=127.0.0.1,
        ssl:8443:privateKey=key.pem:certKey=cert.pem, unix:/run/relay.sock
        (default: tcp:8080:interface=127.0.0.1).
        """
        self["listen"].append(description)

    opt_l = opt_listen

    def opt_version(self) -> None:
        """Display the relay's version and Twisted's, and exit."""
        from twisted import copyright
        from twisted_relay._version import __version__

        print("twisted-relay version:", __version__)
        print("Twisted version:", copyright.version)
        sys.exit(0)

    def postOptions(self) -> None:
        from twisted_relay.service import listen_checker

        self.command_line = {
            name: (list(self[name]) if name == "listen" else bool(self[name]) if name in _FLAG_NAMES else self[name])
            for name in self._given
            if name != "config"
        }
        try:
            self.config = read_settings(self.command_line, self["config"], check_listen=listen_checker())
        except SettingsError as e:
            raise usage.UsageError(str(e))


_FLAG_NAMES = frozenset(name for name, *_ in FLAGS)


def _given_options(argv: tuple[str, ...], short: str, long: list[str], synonyms: dict[str, str]) -> set[str]:
    """
    The options ``argv`` gives, by their long names: read with ``getopt`` and
    the same option tables ``usage.Options`` parses with, so every spelling
    counts (``--name=value``, ``--name value``, a short alias, a flag, an
    unambiguous prefix of a long name). Empty when ``argv`` does not parse
    (the parse itself then says why).
    """
    try:
        pairs, _ = getopt.getopt(list(argv), short, long)
    except getopt.GetoptError:
        return set()
    given = set()
    for option, _ in pairs:
        name = option.lstrip("-")
        name = synonyms.get(name) or synonyms.get(name.replace("-", "_"))
        if name is not None:
            given.add(name)
    return given


def _say_startup_errors_in_one_line() -> None:
    """
    Under twistd, a :class:`StartupError` (a port in use...) ends the
    process with its one line instead of a traceback; twistd has removed
    its pidfile by then.
    """
    from twisted_relay.service import StartupError

    previous = sys.excepthook
    if getattr(previous, "relay_startup_errors", False):
        return

    def hook(kind, value, traceback):
        if isinstance(value, StartupError):
            sys.stderr.write("twistd relay: %s\n" % (value,))
            sys.stderr.flush()
        else:
            previous(kind, value, traceback)

    hook.relay_startup_errors = True
    sys.excepthook = hook


def makeService(options: Options, reactor=None):
    """
    Make the relay's service from parsed ``twistd relay`` options, once
    every resource they name opens (:mod:`twisted_relay.start_checks`).

    The resources are tried here, before twistd logs, daemonizes or binds
    anything, as twistd will run the relay (its ``--rundir``, ``--umask``,
    ``--uid`` and ``--gid``): one that fails ends the process with its one
    line and exit status 1, as an option error does, and no process is left
    (no daemon, no worker). Under ``--chroot``, where paths mean something
    else, the relay's service tries them itself, before it listens.
    """
    from twisted_relay.service import make_service
    from twisted_relay.start_checks import StartupError, run_start_checks, start_checks_for

    _say_startup_errors_in_one_line()
    twistd = options.parent
    checked = None
    if twistd is None or not twistd.get("chroot"):
        try:
            _as_twistd_runs(twistd, run_start_checks, start_checks_for(options.config, reactor))
        except StartupError as e:
            raise SystemExit("twistd relay: %s" % (e,))
        checked = ()
    return make_service(options.config, reactor, command_line=options.command_line, start_checks=checked)


def _as_twistd_runs(twistd, function, *args):
    """
    ``function(*args)`` in the folder, with the umask and as the user that
    twistd's options ``twistd`` (``None``: none) will give the relay's
    process once it has made the service.
    """
    if twistd is None:
        return function(*args)
    folder = os.getcwd()
    umask = twistd.get("umask")
    if umask is None and not twistd.get("nodaemon"):
        umask = 0o077  # twistd's own for a daemon
    uid, gid = twistd.get("uid"), twistd.get("gid")
    if uid is not None and gid is None:
        import pwd  # (twistd takes --uid on Unix only)

        gid = pwd.getpwuid(uid).pw_gid
    os.chdir(twistd.get("rundir") or ".")
    previous_umask = os.umask(umask) if umask is not None else None
    try:
        if os.getuid() == 0 and (uid is not None or gid is not None):
            return runAsEffectiveUser(
                uid if uid is not None else os.geteuid(), gid if gid is not None else os.getegid(), function, *args
            )
        return function(*args)
    finally:
        if previous_umask is not None:
            os.umask(previous_umask)
        os.chdir(folder)
