# -*- test-case-name: tests.test_tap -*-
"""
The ``twistd relay`` command: its options and the service it makes.
"""

from __future__ import annotations

import getopt
import os
import re
import socket
import sys
from urllib.parse import urlsplit

from twisted.python import usage

from twisted_relay.config import (
    DEFAULT_LISTEN,
    DEFAULT_UPSTREAM,
    DEFAULT_UPSTREAM_NAME,
    RelayConfig,
    default_bodies_in_flight,
    id_pattern_setting,
    parse_size,
)
from twisted_relay.configfile import ConfigFileError, FileSettings, load
from twisted_relay.translation import POLICIES, UpstreamRules

__all__ = ["Options", "makeService"]

_SIMULATED_MODES = ("strict", "stateful", "lenient")


def _positive(name: str, value: str, *, allow_zero: bool = False) -> float:
    try:
        number = float(value)
    except ValueError:
        raise usage.UsageError("--%s must be a number of seconds, not %r." % (name, value))
    if number < 0 or (number == 0 and not allow_zero):
        raise usage.UsageError(
            "--%s must be %s, not %r." % (name, "zero or more" if allow_zero else "more than zero", value)
        )
    return number


def _whole(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise usage.UsageError("--%s must be a whole number, zero or more, not %r." % (name, value))
    return number


def _read_keys(path: str) -> tuple[str, ...]:
    """Read a relay keys file: one key a line; blank lines and ``#`` comments skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise usage.UsageError("--relay-keys: cannot read %r: %s" % (path, e))
    keys = tuple(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))
    if not keys:
        raise usage.UsageError("--relay-keys: %r holds no key." % (path,))
    return keys


def _bodies_in_flight(value: str | None) -> int:
    """``--max-bodies-in-flight``: a size, 0 for no limit, the machine's default when not given."""
    if value is None:
        return default_bodies_in_flight()
    if value.strip() == "0":
        return 0
    return _size("max-bodies-in-flight", value)


def _size(name: str, value: str) -> int:
    """Parse a byte size: ``1048576``, ``512K``, ``32M``, ``1G``."""
    try:
        number = parse_size(value)
    except ValueError:
        raise usage.UsageError("--%s must be a size such as 32M, not %r." % (name, value))
    if number <= 0:
        raise usage.UsageError("--%s must be more than zero, not %r." % (name, value))
    return number


class Options(usage.Options):
    """Options of ``twistd relay``."""

    synopsis = "[options]"
    longdesc = (
        "Relay the Anthropic Messages API to an upstream, de-duplicating "
        "tool-use ids in both directions and dumping every upstream 4xx. "
        "Try it with no key and no network: twistd -n relay --simulate strict"
    )

    optParameters = [
        ["upstream", "u", DEFAULT_UPSTREAM, "Base URL of the Anthropic-compatible upstream."],
        [
            "upstream-key",
            None,
            None,
            "Key sent upstream as x-api-key instead of the client's own credentials. "
            "Default: the client's x-api-key / Authorization pass through. "
            "Also read from $TWISTED_RELAY_UPSTREAM_KEY.",
        ],
        ["upstream-ids", None, "unique", "Id policy towards the upstream: unique or original."],
        [
            "upstream-id-pattern",
            None,
            "default",
            "Regular expression every tool-use id sent upstream must match; others go encoded. "
            "default: ^[a-zA-Z0-9_-]+$ under --upstream-ids unique, none under original; none: no pattern.",
        ],
        [
            "upstream-own-ids",
            None,
            None,
            "With --upstream-ids original: regular expression of the ids the upstream makes "
            "(only those go back as it emitted them). Default: every id.",
        ],
        ["connect-timeout", None, "10", "Seconds to connect to the upstream."],
        ["response-timeout", None, "600", "Seconds to wait for the upstream's response headers."],
        ["idle-timeout", None, "300", "Seconds of upstream silence inside a stream before giving up."],
        ["ping-interval", None, "10", "Seconds of upstream silence before the relay sends a ping (0: never)."],
        ["max-body", None, "32M", "Largest request body accepted (Anthropic's own limit is 32 MiB)."],
        [
            "max-bodies-in-flight",
            None,
            None,
            "Bytes of request bodies held at once; past it, 529 overloaded_error (0: no limit). "
            "Default: a 64th of the machine's memory, at least 32M.",
        ],
        ["max-upstream-connections", None, "1024", "Persistent upstream connections kept per host."],
        ["dump-dir", None, "relay-dumps", "Folder for diagnostic dumps of upstream 4xx answers."],
        ["dump-max-bytes", None, "64M", "Largest dump written whole; larger ones are truncated visibly."],
        ["dump-retention-days", None, "30", "Delete dumps older than this many days."],
        ["dump-retention-bytes", None, "1G", "Delete the oldest dumps while the folder holds more."],
        [
            "simulate",
            None,
            None,
            "Run the embedded simulated upstream in this mode (strict, stateful or lenient) "
            "and relay to it: no key and no network needed.",
        ],
        ["total-timeout", None, "0", "Seconds a request may take end to end, stream included (0: no limit)."],
        ["request-read-timeout", None, "120", "Seconds a client may take to send a whole request (0: no limit)."],
        [
            "relay-keys",
            None,
            None,
            "File of keys clients must present (one a line, # comments); a relay key is never sent upstream.",
        ],
        ["max-concurrent", None, "4096", "Requests relayed at once; past it, 529 overloaded_error (0: no limit)."],
        ["retries", None, "0", "Times to resend a request that failed before any byte reached the client."],
        ["retry-statuses", None, "429,500,502,503,504,529", "Upstream statuses worth a retry."],
        ["max-retry-wait", None, "60", "Longest retry-after the relay waits out before passing it on."],
        ["shutdown-grace", None, "30", "Seconds requests in flight may go on after the relay is told to stop."],
        [
            "drain-delay",
            None,
            "5",
            "Seconds the relay goes on accepting after it is told to stop, while /ready already "
            "says 503, so that a load balancer moves on (0: stop accepting at once).",
        ],
        [
            "workers",
            None,
            "1",
            "Relay processes sharing the tcp: listen addresses (SO_REUSEPORT), this one included: "
            "one per core uses every core.",
        ],
        ["breaker-failures", None, "3", "Failures in a row after which an upstream (or a key) is skipped a while."],
        ["breaker-cooldown", None, "30", "Seconds a failing upstream or key is skipped before it is probed."],
        ["key-rest", None, "600", "Seconds a key the upstream refused (401/403) is skipped before it is probed."],
        [
            "config",
            None,
            None,
            "A TOML file of settings ([relay]), upstreams and routes (see docs/routing.md); "
            "the command line wins over it.",
        ],
        ["simulate-seed", None, "0", "Seed of the simulated upstream (the same default as twisted-relay-simulated)."],
        ["simulate-reuse-every", None, "3", "The simulated model reuses an id every N tool calls (0: never)."],
        ["simulate-event-delay", None, "0", "Seconds between the simulated upstream's stream events."],
        [
            "threads",
            None,
            "relay",
            "How message threads are carried: relay (the relay holds each thread and sends the "
            "upstream plain, whole requests; any upstream, api.anthropic.com included) or upstream "
            "(for an upstream that knows threads: only the new messages, translated, are sent).",
        ],
        [
            "thread-store",
            None,
            "memory",
            "Where threads are kept: memory (this process) or redis://[user:password@]host[:port][/db] "
            "(shared by workers and machines).",
        ],
        ["thread-ttl", None, "300", "Seconds a thread lives after its last use (0: until evicted)."],
        ["thread-max-count", None, "10000", "Threads held in memory at most (least recently used go first)."],
        ["thread-max-bytes", None, "512M", "Bytes of threads held in memory at most (least recently used go first)."],
        [
            "simulate-threads",
            None,
            "ignore",
            "How the simulated upstream treats message threads: ignore, rejects or knows.",
        ],
    ]
    optFlags = [
        ["no-dumps", None, "Write no diagnostic dumps."],
        ["no-metrics", None, "Serve no Prometheus metrics at /metrics."],
        [
            "no-gc-tuning",
            None,
            "Leave Python's garbage collector as it is (by default the relay freezes what exists "
            "at start, so that full collections no longer walk it).",
        ],
    ]

    def __init__(self):
        super().__init__()
        self["listen"] = []
        # The options given on the command line, which win over the file's.
        self._given: set[str] = set()
        self._argv: tuple[str, ...] = ()

    def _option_kinds(self) -> dict[str, str]:
        """Each long option and how it takes its value, for the file's ``[relay]`` table."""
        kinds = {name: "parameter" for name, *_ in self.optParameters}
        kinds.update({name: "flag" for name, *_ in self.optFlags})
        kinds["listen"] = "multi"
        return kinds

    def parseOptions(self, options=None):
        """
        Parse the options; under twistd, an error is one line and exit
        status 1 (twistd itself would print its whole help before the
        message).
        """
        self._argv = tuple(sys.argv[1:] if options is None else options)
        self._given = _given_options(self._argv, self.shortOpt, self.longOpt, self.synonyms)
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
        settings = None
        if self["config"]:
            try:
                settings = load(self["config"], self._option_kinds())
            except ConfigFileError as e:
                raise usage.UsageError(str(e))
            for name, value in settings.relay.items():
                if name in self._given:
                    continue
                self[name] = value
        try:
            self._build()
        except usage.UsageError as e:
            raise _named_in_file(e, settings, self._given)
        if settings is not None:
            self._apply_file(settings)

    def _apply_file(self, settings: FileSettings) -> None:
        """Take the file's upstreams and routes, unless the command line says otherwise."""
        # Read again on reload, from wherever the process is by then.
        path = os.path.abspath(settings.path)
        config = self.config.with_changes(config_file=path, command_line=self._argv + ("--config", path))
        if settings.upstreams:
            if self._given & {"upstream", "simulate"}:
                # The command line wins: one upstream for every model.
                settings = FileSettings(settings.path, settings.relay)
            else:
                for name in ("upstream-key", "upstream-ids", "upstream-id-pattern", "upstream-own-ids"):
                    if name in self._given:
                        raise usage.UsageError(
                            "--%s describes the one upstream of --upstream; %s has [upstreams] tables, "
                            "which take their own keys and ids." % (name, settings.path)
                        )
                # Until the request path reads the routes, it relays to the
                # one upstream these settings name: the file's first.
                first = settings.upstreams[0]
                config = config.with_changes(
                    upstreams=settings.upstreams,
                    upstream=first.url,
                    upstream_key=first.keys[0] if first.keys else None,
                    upstream_ids=first.ids,
                    threads=first.threads if first.threads and "threads" not in self._given else config.threads,
                )
        if settings.routes:
            config = config.with_changes(routes=settings.routes)
        self.config = config

    def _build(self) -> None:
        from twisted.internet import reactor
        from twisted.internet.endpoints import serverFromString

        listen = tuple(self["listen"]) or (DEFAULT_LISTEN,)
        for description in listen:
            try:
                serverFromString(reactor, description)
            except IndexError:
                if description.startswith("systemd:"):
                    raise usage.UsageError(
                        "--listen %r: systemd passed no socket at that index (run the relay from a "
                        "systemd .socket unit, or under systemd-socket-activate)." % (description,)
                    )
                raise usage.UsageError("--listen %r is not a valid endpoint." % (description,))
            except OSError as e:
                raise usage.UsageError("--listen %r: %s: %s" % (description, e.strerror or e, e.filename or ""))
            except (ValueError, TypeError, KeyError) as e:
                raise usage.UsageError("--listen %r is not a valid endpoint: %s" % (description, e))

        workers = _whole("workers", self["workers"])
        if workers < 1:
            raise usage.UsageError("--workers must be 1 or more, not %r." % (self["workers"],))
        if workers > 1:
            from twisted_relay.workers import shareable

            if not hasattr(socket, "SO_REUSEPORT"):
                raise usage.UsageError("--workers needs SO_REUSEPORT, which this system lacks.")
            for description in listen:
                if not shareable(reactor, description):
                    raise usage.UsageError(
                        "--workers shares tcp: and tcp6: endpoints only, not --listen %r." % (description,)
                    )

        upstream = self["upstream"].rstrip("/")
        parts = urlsplit(upstream)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise usage.UsageError(
                "--upstream must be an http:// or https:// URL, not %r." % (self["upstream"],)
            )
        if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
            raise usage.UsageError(
                "--upstream may hold no user name, password, query or fragment "
                "(give the upstream's key with --upstream-key)."
            )
        if self["upstream-ids"] not in POLICIES:
            raise usage.UsageError(
                "--upstream-ids must be one of %s, not %r."
                % (", ".join(POLICIES), self["upstream-ids"])
            )
        upstream_id_pattern, upstream_own_ids = self._id_rules()
        simulate = self["simulate"]
        if simulate is not None and simulate not in _SIMULATED_MODES:
            raise usage.UsageError(
                "--simulate must be one of %s, not %r." % (", ".join(_SIMULATED_MODES), simulate)
            )
        try:
            seed = int(self["simulate-seed"])
            reuse_every = int(self["simulate-reuse-every"])
        except ValueError:
            raise usage.UsageError("--simulate-seed and --simulate-reuse-every must be whole numbers.")
        if reuse_every < 0:
            raise usage.UsageError("--simulate-reuse-every must be zero or more.")
        from twisted_relay.simulated.message_threads import THREAD_MODES

        if self["simulate-threads"] not in THREAD_MODES:
            raise usage.UsageError(f"--simulate-threads must be one of {', '.join(THREAD_MODES)}.")
        from twisted_relay.message_threads.turns import THREAD_MODES as RELAY_THREAD_MODES

        if self["threads"] not in RELAY_THREAD_MODES:
            raise usage.UsageError(f"--threads must be one of {', '.join(RELAY_THREAD_MODES)}, not {self['threads']!r}.")
        thread_store = self["thread-store"]
        if thread_store != "memory" and not thread_store.startswith("redis://"):
            raise usage.UsageError("--thread-store must be memory or a redis://host[:port][/db] URL.")
        thread_ttl = _positive("thread-ttl", self["thread-ttl"], allow_zero=True)
        if thread_ttl == 0 and thread_store != "memory":
            raise usage.UsageError("--thread-ttl 0 (no time limit) needs the memory store: Redis entries expire.")
        thread_max_count = _whole("thread-max-count", self["thread-max-count"])
        if thread_max_count < 1:
            raise usage.UsageError("--thread-max-count must be 1 or more.")
        thread_max_bytes = _size("thread-max-bytes", self["thread-max-bytes"])
        if thread_max_bytes < 1:
            raise usage.UsageError("--thread-max-bytes must be 1 or more.")
        try:
            max_connections = int(self["max-upstream-connections"])
        except ValueError:
            max_connections = 0
        if max_connections < 1:
            raise usage.UsageError("--max-upstream-connections must be a whole number above zero.")

        upstream_key = self["upstream-key"] or os.environ.get("TWISTED_RELAY_UPSTREAM_KEY") or None
        relay_keys = _read_keys(self["relay-keys"]) if self["relay-keys"] else ()
        max_concurrent = _whole("max-concurrent", self["max-concurrent"])
        retries = _whole("retries", self["retries"])
        try:
            retry_statuses = tuple(int(part) for part in self["retry-statuses"].split(",") if part.strip())
        except ValueError:
            raise usage.UsageError(
                "--retry-statuses must be HTTP statuses separated by commas, not %r." % (self["retry-statuses"],)
            )
        if any(status < 400 or status > 599 or 400 <= status < 429 for status in retry_statuses):
            raise usage.UsageError(
                "--retry-statuses may hold 429 and 5xx statuses only: a 4xx such as 400 will fail again."
            )
        breaker_failures = _whole("breaker-failures", self["breaker-failures"])
        if breaker_failures < 1:
            raise usage.UsageError("--breaker-failures must be 1 or more, not %r." % (self["breaker-failures"],))
        self.config = RelayConfig(
            breaker_failures=breaker_failures,
            breaker_cooldown=_positive("breaker-cooldown", self["breaker-cooldown"]),
            key_rest=_positive("key-rest", self["key-rest"]),
            listen=listen,
            upstream=upstream,
            upstream_key=upstream_key,
            upstream_ids=self["upstream-ids"],
            upstream_id_pattern=upstream_id_pattern,
            upstream_own_ids=upstream_own_ids,
            connect_timeout=_positive("connect-timeout", self["connect-timeout"]),
            response_timeout=_positive("response-timeout", self["response-timeout"]),
            idle_timeout=_positive("idle-timeout", self["idle-timeout"]),
            ping_interval=_positive("ping-interval", self["ping-interval"], allow_zero=True),
            max_body=_size("max-body", self["max-body"]),
            max_bodies_in_flight=_bodies_in_flight(self["max-bodies-in-flight"]),
            max_upstream_connections=max_connections,
            dump_dir=None if self["no-dumps"] else self["dump-dir"],
            dump_max_bytes=_size("dump-max-bytes", self["dump-max-bytes"]),
            dump_retention_days=_positive("dump-retention-days", self["dump-retention-days"]),
            dump_retention_bytes=_size("dump-retention-bytes", self["dump-retention-bytes"]),
            total_timeout=_positive("total-timeout", self["total-timeout"], allow_zero=True),
            request_read_timeout=_positive("request-read-timeout", self["request-read-timeout"], allow_zero=True),
            relay_keys=relay_keys,
            max_concurrent=max_concurrent,
            retries=retries,
            retry_statuses=retry_statuses,
            max_retry_wait=_positive("max-retry-wait", self["max-retry-wait"], allow_zero=True),
            shutdown_grace=_positive("shutdown-grace", self["shutdown-grace"], allow_zero=True),
            drain_delay=_positive("drain-delay", self["drain-delay"], allow_zero=True),
            metrics=not self["no-metrics"],
            simulate=simulate,
            workers=workers,
            gc_tuning=not self["no-gc-tuning"],
            threads=self["threads"],
            thread_store=thread_store,
            thread_ttl=thread_ttl,
            thread_max_count=thread_max_count,
            thread_max_bytes=thread_max_bytes,
            simulate_options={
                "seed": seed,
                "reuse_every": reuse_every,
                "event_delay": _positive(
                    "simulate-event-delay", self["simulate-event-delay"], allow_zero=True
                ),
                "threads": self["simulate-threads"],
            },
        )

    def _id_rules(self) -> tuple[str | None, str | None]:
        """``--upstream-id-pattern`` and ``--upstream-own-ids``, checked as requests will use them."""
        id_pattern = id_pattern_setting(self["upstream-id-pattern"])
        own_ids = self["upstream-own-ids"] or None
        if own_ids is not None and self["upstream-ids"] != "original":
            raise usage.UsageError("--upstream-own-ids applies to --upstream-ids original only.")
        for name, rules in (("upstream-id-pattern", (id_pattern, None)), ("upstream-own-ids", (None, own_ids))):
            try:
                UpstreamRules(DEFAULT_UPSTREAM_NAME, self["upstream-ids"], *rules)
            except ValueError as e:
                raise usage.UsageError("--%s: %s" % (name, " ".join(str(e).split())))
        return id_pattern, own_ids


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


def _named_in_file(error: usage.UsageError, settings: FileSettings | None, given: set) -> usage.UsageError:
    """
    A usage error about an option the file gave, told as the file's: its
    path, the ``[relay]`` table and the key, without the value (the file
    shows it, and a key pasted in the wrong place must not reach a log).
    """
    message = str(error)
    if settings is not None and message.startswith("--"):
        name = re.match(r"--([a-z-]+)", message).group(1)
        if name in settings.relay and name not in given:
            text = re.sub(r",? not '.*'\.?$", ".", message[2:])
            text = re.sub(r" '.*' is not a valid endpoint.*$", ": not a valid Twisted endpoint string.", text)
            if name != "relay-keys":  # a path, which helps and is no key
                text = re.sub(r"'[^']*'", "(the value given)", text)
            return usage.UsageError("%s: [relay] %s" % (settings.path, text))
    return error


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
    """Make the relay's service from parsed ``twistd relay`` options."""
    from twisted_relay.service import make_service

    _say_startup_errors_in_one_line()
    return make_service(options.config, reactor)
