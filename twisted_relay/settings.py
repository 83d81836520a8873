# -*- test-case-name: tests.test_tap,tests.test_configfile,tests.test_reload -*-
"""
Where a :class:`~twisted_relay.config.RelayConfig` comes from: the options
given on a command line and a ``--config`` file, merged and checked.

Every option of ``twistd relay`` is a setting;
:data:`~twisted_relay.options.PARAMETERS` and
:data:`~twisted_relay.options.FLAGS` list them with their defaults
(``twistd relay --help`` shows the same table), and a file's ``[relay]``
table may give any of them by its long name. :func:`config_from` builds a
configuration from the options given (by long name, as text) and a file's
:class:`~twisted_relay.configfile.FileSettings`: the command line wins over
the file, the file over the defaults.
:func:`read_settings` reads the file first; :func:`reload_config` reads it
again for a running relay (:meth:`twisted_relay.service.Relay.reload`).

No Twisted here: ``twisted_relay.tap`` parses a command line into the
options given, and checks ``--listen`` endpoints with the reactor through
the ``check_listen`` callable it passes in.
"""

from __future__ import annotations

import importlib
import os
import re
import socket
from dataclasses import fields
from typing import Callable, Mapping

from twisted_relay.config import (
    BINDING_RECOVERIES,
    DEFAULT_LISTEN,
    DEFAULT_UPSTREAM_NAME,
    RelayConfig,
    default_bodies_in_flight,
    every_upstream_route,
    usage_db_setting,
    id_pattern_setting,
    one_upstream,
    parse_size,
)
from twisted_relay.configfile import ConfigFileError, FileSettings, load
from twisted_relay.message_threads.model import THREAD_MODES
from twisted_relay.options import FLAGS, PARAMETERS
from twisted_relay.relay_keys import RelayKey, parse_key_file, unique_relay_keys
from twisted_relay.signin.config import loopback_public_url
from twisted_relay.translation import POLICIES, UpstreamRules

__all__ = [
    "FLAGS",
    "PARAMETERS",
    "RELOADED_SETTINGS",
    "ReloadResult",
    "SettingsError",
    "config_from",
    "option_kinds",
    "read_settings",
    "reload_config",
]

#: The settings a reload changes; the others keep their running values
#: until the relay is started again.
RELOADED_SETTINGS = ("upstreams", "routes", "breaker_failures", "breaker_cooldown", "key_rest", "prices")

#: The simulated clouds ``--simulate`` also runs (twisted_relay.simulated.clouds.CLOUDS).
SIMULATED_CLOUDS = ("bedrock", "vertex", "foundry")
_SIMULATED_MODES = ("strict", "stateful", "lenient") + SIMULATED_CLOUDS
# The values of --simulate-threads and --simulate-api, as the simulated upstream
# names them (twisted_relay.simulated, which uses Twisted; a test keeps them the same).
_SIMULATED_THREAD_MODES = ("ignore", "rejects", "knows")
_SIMULATED_APIS = ("2026-12", "2025")
_ONE_UPSTREAM_OPTIONS = ("upstream-key", "upstream-ids", "upstream-id-pattern", "upstream-own-ids")

#: Checks one ``--listen`` endpoint: ``shared`` when worker processes will
#: share it. Raises :class:`SettingsError` (its message names ``--listen``).
ListenCheck = Callable[[str, bool], None]


class SettingsError(ValueError):
    """
    Settings that cannot be used. Its message is one line naming the
    option (``--name ...``) or the file, table and key; never a key's value.
    """


def option_kinds() -> dict[str, str]:
    """Each long option and how it takes its value, for the file's ``[relay]`` table."""
    kinds = {name: "parameter" for name, *_ in PARAMETERS}
    kinds.update({name: "flag" for name, *_ in FLAGS})
    kinds["listen"] = "multi"
    return kinds


def _defaults() -> dict:
    values: dict = {name: default for name, _, default, _ in PARAMETERS}
    values.update({name: False for name, *_ in FLAGS})
    values["listen"] = []
    return values


def read_settings(
    command_line: Mapping[str, object] | None = None,
    config_file: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    check_listen: ListenCheck | None = None,
) -> RelayConfig:
    """
    The configuration of the options given on a command line (by long name;
    see :func:`config_from`) and a ``--config`` file, read now.

    :raises SettingsError: at the first mistake, in one line.
    """
    settings = None
    if config_file is not None:
        try:
            settings = load(config_file, option_kinds(), environ)
        except ConfigFileError as e:
            raise SettingsError(str(e))
    return config_from(command_line, settings, environ=environ, check_listen=check_listen)


def config_from(
    command_line: Mapping[str, object] | None = None,
    file: FileSettings | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    check_listen: ListenCheck | None = None,
) -> RelayConfig:
    """
    Build a configuration from the options given on a command line and a
    file's settings: the command line wins over the file, the file over the
    defaults of :data:`PARAMETERS` and :data:`FLAGS`.

    :param command_line: the options given, by long name: text for an
        option taking a value, ``True`` for a flag, a list of strings for
        ``listen``; ``config`` is not one of them (``file`` is its content).
    :param file: what the ``--config`` file says, or ``None``.
    :param environ: where ``TWISTED_RELAY_UPSTREAM_KEY`` is read;
        ``os.environ`` by default.
    :param check_listen: checks each ``--listen`` endpoint (``twistd relay``
        asks the reactor); ``None`` checks none.
    :raises SettingsError: at the first mistake, in one line; a mistake in a
        value the file gave names the file, ``[relay]`` and the key.
    """
    command_line = dict(command_line or {})
    command_line.pop("config", None)
    values = _defaults()
    if file is not None:
        values.update({name: value for name, value in file.relay.items() if name not in command_line})
    values.update(command_line)
    given = set(command_line)
    try:
        config = _build(values, environ=os.environ if environ is None else environ, check_listen=check_listen)
    except SettingsError as e:
        raise _named_in_file(e, file, given)
    if file is not None:
        config = _with_file(config, file, given)
    return config


def _with_file(config: RelayConfig, settings: FileSettings, given: set) -> RelayConfig:
    """Take the file's upstreams and routes, unless the command line says otherwise."""
    # Read again on reload, from wherever the process is by then.
    changes: dict = {"config_file": os.path.abspath(settings.path)}
    upstreams, routes = settings.upstreams, settings.routes
    if upstreams and given & {"upstream", "simulate"}:
        # The command line wins: one upstream for every model.
        upstreams, routes = (), ()
    if upstreams:
        for name in _ONE_UPSTREAM_OPTIONS:
            if name in given:
                raise SettingsError(
                    "--%s describes the one upstream of --upstream; %s has [upstreams] tables, "
                    "which take their own keys and ids." % (name, settings.path)
                )
        changes["upstreams"] = upstreams
        changes["routes"] = routes or every_upstream_route(upstreams)
        first = upstreams[0]
        if first.threads and "threads" not in given:
            changes["threads"] = first.threads
    elif routes:
        changes["routes"] = routes
    if settings.relay_keys:
        try:
            changes["relay_keys"] = unique_relay_keys(config.relay_keys + settings.relay_keys)
        except ValueError as e:
            raise SettingsError("%s: [relay-keys] with --relay-keys: %s" % (settings.path, e))
        if {k.key for k in config.admin_keys} & {k.key for k in settings.relay_keys}:
            raise SettingsError(
                "%s: [relay-keys] holds a key that is an admin key (--admin-keys); give each its own." % (settings.path,)
            )
    if config.simulate_idp and settings.signin is not None:
        raise SettingsError("%s: [signin] with --simulate-idp, which signs people in itself: give one or the other." % (settings.path,))
    # The file's [prices] and [signin], when it has them.
    changes.update({name: getattr(settings, name) for name in ("prices", "signin") if getattr(settings, name) is not None})
    return config.with_changes(**changes)


def _build(values: dict, *, environ: Mapping[str, str], check_listen: ListenCheck | None) -> RelayConfig:
    """The configuration of every option's value (defaults included), checked."""
    listen = tuple(values["listen"]) or (DEFAULT_LISTEN,)
    if check_listen is not None:
        for description in listen:
            check_listen(description, False)

    workers = _whole("workers", values["workers"])
    if workers < 1:
        raise SettingsError("--workers must be 1 or more, not %r." % (values["workers"],))
    if workers > 1:
        if not hasattr(socket, "SO_REUSEPORT"):
            raise SettingsError("--workers needs SO_REUSEPORT, which this system lacks.")
        if check_listen is not None:
            for description in listen:
                check_listen(description, True)

    upstream = _upstream_url(values["upstream"])
    if values["upstream-ids"] not in POLICIES:
        raise SettingsError(
            "--upstream-ids must be one of %s, not %r." % (", ".join(POLICIES), values["upstream-ids"])
        )
    upstream_id_pattern, upstream_own_ids = _id_rules(values)
    simulate = values["simulate"]
    if simulate is not None and simulate not in _SIMULATED_MODES:
        raise SettingsError(
            "--simulate must be one of %s, not %r." % (", ".join(_SIMULATED_MODES), simulate)
        )
    try:
        seed = int(values["simulate-seed"])
        reuse_every = int(values["simulate-reuse-every"])
    except ValueError:
        raise SettingsError("--simulate-seed and --simulate-reuse-every must be whole numbers.")
    if reuse_every < 0:
        raise SettingsError("--simulate-reuse-every must be zero or more.")
    if values["simulate-threads"] not in _SIMULATED_THREAD_MODES:
        raise SettingsError(f"--simulate-threads must be one of {', '.join(_SIMULATED_THREAD_MODES)}.")
    if values["thinking-binding-recovery"] not in BINDING_RECOVERIES:
        raise SettingsError(
            "--thinking-binding-recovery must be one of %s, not %r."
            % (", ".join(BINDING_RECOVERIES), values["thinking-binding-recovery"])
        )
    if values["simulate-idp"]:
        if workers > 1:
            raise SettingsError("--simulate-idp runs in one process: leave out --workers.")
        try:
            loopback_public_url(listen[0])
        except ValueError as e:
            raise SettingsError(str(e))
    if values["threads"] not in THREAD_MODES:
        raise SettingsError(f"--threads must be one of {', '.join(THREAD_MODES)}, not {values['threads']!r}.")
    if values["simulate-api"] not in _SIMULATED_APIS:
        raise SettingsError(f"--simulate-api must be one of {', '.join(_SIMULATED_APIS)}.")
    thread_store = values["thread-store"]
    if thread_store != "memory" and not thread_store.startswith("redis://"):
        raise SettingsError("--thread-store must be memory or a redis://host[:port][/db] URL.")
    thread_ttl = _positive("thread-ttl", values["thread-ttl"], allow_zero=True)
    if thread_ttl == 0 and thread_store != "memory":
        raise SettingsError("--thread-ttl 0 (no time limit) needs the memory store: Redis entries expire.")
    thread_max_count = _whole("thread-max-count", values["thread-max-count"])
    if thread_max_count < 1:
        raise SettingsError("--thread-max-count must be 1 or more.")
    if thread_store.startswith("redis://"):
        _need("txredisapi", "redis", "--thread-store redis://...")
    thread_max_bytes = _size("thread-max-bytes", values["thread-max-bytes"])
    try:
        usage_db = usage_db_setting(values["usage-db"])
    except ValueError as e:
        raise SettingsError("--usage-db %s." % (e,))
    if usage_db is not None and "://" in usage_db:
        _need("psycopg", "postgres", "--usage-db postgresql://...")
    usage_max_queue = _whole("usage-max-queue", values["usage-max-queue"])
    if usage_max_queue < 1:
        raise SettingsError("--usage-max-queue must be 1 or more.")
    try:
        max_connections = int(values["max-upstream-connections"])
    except ValueError:
        max_connections = 0
    if max_connections < 1:
        raise SettingsError("--max-upstream-connections must be a whole number above zero.")

    upstream_key = values["upstream-key"] or environ.get("TWISTED_RELAY_UPSTREAM_KEY") or None
    relay_keys = _read_keys(values["relay-keys"]) if values["relay-keys"] else ()
    admin_keys = _read_keys(values["admin-keys"], "admin-keys") if values["admin-keys"] else ()
    if {k.key for k in admin_keys} & {k.key for k in relay_keys}:
        raise SettingsError("--admin-keys: a key is both an admin key and a relay key; give each its own.")
    max_concurrent = _whole("max-concurrent", values["max-concurrent"])
    retries = _whole("retries", values["retries"])
    try:
        retry_statuses = tuple(int(part) for part in values["retry-statuses"].split(",") if part.strip())
    except ValueError:
        raise SettingsError(
            "--retry-statuses must be HTTP statuses separated by commas, not %r." % (values["retry-statuses"],)
        )
    if any(status < 400 or status > 599 or 400 <= status < 429 for status in retry_statuses):
        raise SettingsError(
            "--retry-statuses may hold 429 and 5xx statuses only: a 4xx such as 400 will fail again."
        )
    breaker_failures = _whole("breaker-failures", values["breaker-failures"])
    if breaker_failures < 1:
        raise SettingsError("--breaker-failures must be 1 or more, not %r." % (values["breaker-failures"],))
    upstreams = one_upstream(
        upstream,
        key=upstream_key,
        ids=values["upstream-ids"],
        id_pattern=upstream_id_pattern,
        own_ids=upstream_own_ids,
    )
    return RelayConfig(
        breaker_failures=breaker_failures,
        breaker_cooldown=_positive("breaker-cooldown", values["breaker-cooldown"]),
        key_rest=_positive("key-rest", values["key-rest"]),
        listen=listen,
        upstreams=upstreams,
        connect_timeout=_positive("connect-timeout", values["connect-timeout"]),
        response_timeout=_positive("response-timeout", values["response-timeout"]),
        idle_timeout=_positive("idle-timeout", values["idle-timeout"]),
        ping_interval=_positive("ping-interval", values["ping-interval"], allow_zero=True),
        max_body=_size("max-body", values["max-body"]),
        max_bodies_in_flight=_bodies_in_flight(values["max-bodies-in-flight"]),
        max_upstream_connections=max_connections,
        dump_dir=None if values["no-dumps"] else values["dump-dir"],
        dump_max_bytes=_size("dump-max-bytes", values["dump-max-bytes"]),
        dump_retention_days=_positive("dump-retention-days", values["dump-retention-days"], unit="days"),
        dump_retention_bytes=_size("dump-retention-bytes", values["dump-retention-bytes"]),
        total_timeout=_positive("total-timeout", values["total-timeout"], allow_zero=True),
        request_read_timeout=_positive("request-read-timeout", values["request-read-timeout"], allow_zero=True),
        relay_keys=relay_keys,
        admin_keys=admin_keys,
        max_concurrent=max_concurrent,
        retries=retries,
        retry_statuses=retry_statuses,
        max_retry_wait=_positive("max-retry-wait", values["max-retry-wait"], allow_zero=True),
        shutdown_grace=_positive("shutdown-grace", values["shutdown-grace"], allow_zero=True),
        drain_delay=_positive("drain-delay", values["drain-delay"], allow_zero=True),
        metrics=not values["no-metrics"],
        simulate=simulate,
        simulate_idp=bool(values["simulate-idp"]),
        workers=workers,
        gc_tuning=not values["no-gc-tuning"],
        forward_attribution=bool(values["forward-attribution"]),
        threads=values["threads"],
        thinking_binding_recovery=values["thinking-binding-recovery"],
        thread_store=thread_store,
        thread_ttl=thread_ttl,
        thread_max_count=thread_max_count,
        thread_max_bytes=thread_max_bytes,
        usage_db=usage_db,
        usage_flush_interval=_positive("usage-flush-interval", values["usage-flush-interval"]),
        usage_retention_days=_positive(
            "usage-retention-days", values["usage-retention-days"], allow_zero=True, unit="days"
        ),
        usage_max_queue=usage_max_queue,
        spend_refresh_interval=_positive("spend-refresh-interval", values["spend-refresh-interval"]),
        simulate_options={
            "seed": seed,
            "reuse_every": reuse_every,
            "event_delay": _positive("simulate-event-delay", values["simulate-event-delay"], allow_zero=True),
            "threads": values["simulate-threads"],
            "api": values["simulate-api"],
        },
    )


def _need(module: str, extra: str, what: str) -> None:
    """An optional dependency ``what`` needs: a missing one is a one-line error naming the extra that installs it."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise SettingsError(
            "%s needs %s, which is not installed: pip install 'twisted-relay[%s]'" % (what, module, extra)
        )


def _upstream_url(value: str) -> str:
    """``--upstream``: an http(s) URL without credentials, query or fragment, and no trailing slash."""
    from urllib.parse import urlsplit

    upstream = value.rstrip("/")
    parts = urlsplit(upstream)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SettingsError("--upstream must be an http:// or https:// URL, not %r." % (value,))
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise SettingsError(
            "--upstream may hold no user name, password, query or fragment "
            "(give the upstream's key with --upstream-key)."
        )
    return upstream


def _id_rules(values: dict) -> tuple[str | None, str | None]:
    """``--upstream-id-pattern`` and ``--upstream-own-ids``, checked as requests will use them."""
    id_pattern = id_pattern_setting(values["upstream-id-pattern"])
    own_ids = values["upstream-own-ids"] or None
    if own_ids is not None and values["upstream-ids"] != "original":
        raise SettingsError("--upstream-own-ids applies to --upstream-ids original only.")
    for name, rules in (("upstream-id-pattern", (id_pattern, None)), ("upstream-own-ids", (None, own_ids))):
        try:
            UpstreamRules(DEFAULT_UPSTREAM_NAME, values["upstream-ids"], *rules)
        except ValueError as e:
            raise SettingsError("--%s: %s" % (name, " ".join(str(e).split())))
    return id_pattern, own_ids


def _positive(name: str, value: str, *, allow_zero: bool = False, unit: str = "seconds") -> float:
    try:
        number = float(value)
    except ValueError:
        raise SettingsError("--%s must be a number of %s, not %r." % (name, unit, value))
    if number < 0 or (number == 0 and not allow_zero):
        raise SettingsError(
            "--%s must be %s, not %r." % (name, "zero or more" if allow_zero else "more than zero", value)
        )
    return number


def _whole(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise SettingsError("--%s must be a whole number, zero or more, not %r." % (name, value))
    return number


def _read_keys(path: str, option: str = "relay-keys") -> tuple[RelayKey, ...]:
    """Read a keys file (:func:`~twisted_relay.relay_keys.parse_key_file`); a mistake never shows a key."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise SettingsError("--%s: cannot read %r: %s" % (option, path, e))
    try:
        return parse_key_file(text)
    except ValueError as e:
        raise SettingsError("--%s: %r %s." % (option, path, e))


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
        raise SettingsError("--%s must be a size such as 32M, not %r." % (name, value))
    if number <= 0:
        raise SettingsError("--%s must be more than zero, not %r." % (name, value))
    return number


def _named_in_file(error: SettingsError, settings: FileSettings | None, given: set) -> SettingsError:
    """
    An error about an option the file gave, told as the file's: its path,
    the ``[relay]`` table and the key, without the value (the file shows
    it, and a key pasted in the wrong place must not reach a log).
    """
    message = str(error)
    if settings is not None and message.startswith("--"):
        name = re.match(r"--([a-z-]+)", message).group(1)
        if name in settings.relay and name not in given:
            text = re.sub(r",? not '.*'\.?$", ".", message[2:])
            text = re.sub(r" '.*' is not a valid endpoint.*$", ": not a valid Twisted endpoint string.", text)
            if name not in ("relay-keys", "admin-keys"):  # a path, which helps and is no key
                text = re.sub(r"'[^']*'", "(the value given)", text)
            return SettingsError("%s: [relay] %s" % (settings.path, text))
    return error


class ReloadResult:
    """
    What reading the file again gave.

    :ivar config: the configuration to run with from now on (the running one
        when the file was refused).
    :ivar error: one line saying why the file was refused, or ``None``.
    :ivar needs_restart: the settings whose new values were not applied,
        since they take effect only when the relay starts (``listen``...).
    """

    def __init__(self, config: RelayConfig, error: str | None = None, needs_restart: tuple[str, ...] = ()):
        self.config = config
        self.error = error
        self.needs_restart = needs_restart

    def __repr__(self) -> str:
        return "ReloadResult(error=%r, needs_restart=%r)" % (self.error, self.needs_restart)


# The settings a worker process runs with in place of its command line's.
_WORKER_OWN = ("listen", "workers", "simulate")


def reload_config(
    current: RelayConfig,
    command_line: Mapping[str, object] | None = None,
    *,
    worker: bool = False,
    environ: Mapping[str, str] | None = None,
    check_listen: ListenCheck | None = None,
) -> ReloadResult:
    """
    Read the ``--config`` file of a running configuration again, with the
    options given on its command line (which still win over the file).

    A valid file gives a configuration whose :data:`RELOADED_SETTINGS` are
    new and whose other settings are the running ones; an invalid one gives
    the running configuration and one line saying why.

    :param command_line: the options given on the command line the relay
        was started with, as :func:`config_from` takes them; ``None`` for
        an application that embeds the relay and gives none.
    :param worker: the configuration is a worker process's (``--workers``),
        whose listening addresses differ from its command line's by design.
    """
    if current.config_file is None:
        return ReloadResult(current, "the relay was not started with --config: there is no file to read again")
    try:
        fresh = read_settings(command_line, current.config_file, environ=environ, check_listen=check_listen)
    except SettingsError as e:
        return ReloadResult(current, str(e).splitlines()[0] if str(e) else "the configuration was refused")
    # An application that embeds the relay gives no command line: a setting
    # its file leaves alone keeps the value the application gave in code,
    # which is no change to report. Under twistd every difference is one.
    unset = config_from(None, None, environ=environ) if command_line is None else None
    changes = {name: getattr(fresh, name) for name in RELOADED_SETTINGS}
    if fresh.simulate is not None:
        # The embedded simulated upstream (whose address a worker has in
        # place of the command line's) stays the one upstream.
        del changes["upstreams"]
    needs_restart = tuple(
        f.name
        for f in fields(RelayConfig)
        if f.init
        and f.compare
        and f.name not in RELOADED_SETTINGS
        and f.name != "config_file"
        and not (worker and f.name in _WORKER_OWN)
        and not (f.name == "signin" and current.simulate_idp)  # made by the relay, not read from the file
        and getattr(fresh, f.name) != getattr(current, f.name)
        and (unset is None or getattr(fresh, f.name) != getattr(unset, f.name))
    )
    return ReloadResult(current.with_changes(**changes), None, needs_restart)
