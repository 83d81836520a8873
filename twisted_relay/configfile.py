# -*- test-case-name: tests.test_configfile -*-
"""
The ``--config`` file: TOML with a ``[relay]`` table of command-line options,
``[upstreams.NAME]`` tables and ``[[routes]]`` (see ``docs/routing.md``),
``[relay-keys]`` (named relay keys), ``[prices]`` (see ``docs/usage.md``) and
``[signin]`` (:mod:`twisted_relay.signin.config`, ``docs/signin.md``).

:func:`load` reads and checks a file and gives its settings as plain values
(:class:`FileSettings`); every mistake is a :class:`ConfigFileError` whose
message is one line naming the file, the table and the key, and never holds
a key's value. :mod:`twisted_relay.settings` merges them with the command
line into a :class:`~twisted_relay.config.RelayConfig`, and reads the file
again on reload.

No Twisted here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Mapping
from urllib.parse import urlsplit

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from twisted_relay.config import (
    DEFAULT_UPSTREAM_NAME,
    LoginSpec,
    cloud_base_url,
    Route,
    Target,
    Upstream,
    id_pattern_setting,
    parse_size,
)
from twisted_relay.message_threads.model import THREAD_MODES
from twisted_relay.prices import DEFAULT_PRICES, PriceTable, price_table_from
from twisted_relay.relay_keys import RelayKey, key_name_problem, unique_relay_keys
from twisted_relay.signin.config import SignInConfig, SignInConfigError, signin_table
from twisted_relay.translation import DEFAULT_ID_PATTERN, UpstreamRules

__all__ = [
    "ConfigFileError",
    "FileSettings",
    "ONE_UPSTREAM_OPTIONS",
    "load",
]

#: How an option of ``twistd relay`` takes its value: ``parameter`` (one
#: value), ``flag`` (true or false) or ``multi`` (one value or a list).
OptionKinds = Mapping[str, str]

#: The options that describe the one upstream of a relay without
#: ``[upstreams]``; the file may not give them beside ``[upstreams]``.
ONE_UPSTREAM_OPTIONS = (
    "upstream", "upstream-key", "upstream-ids", "upstream-id-pattern", "upstream-own-ids", "simulate",
)

_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
_ENVIRONMENT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_POLICIES = ("unique", "original")
_UPSTREAM_KEYS = (
    "url",
    "keys",
    "ids",
    "connect-timeout",
    "response-timeout",
    "idle-timeout",
    "max-connections",
    "threads",
    "id-pattern",
    "own-ids",
    "wire",
    "login",
    "region",
    "project",
    "models",
    "service-tier",
    "anthropic-version",
    "headers",
    "dialect",
)
_WIRES = ("anthropic", "bedrock", "vertex", "openai-responses", "openai-chat")
_DIALECTS = ("openai", "deepseek", "kimi", "glm", "gemini", "groq", "mistral", "openrouter", "xai")
_LOGINS = ("aws", "bedrock-api-key", "google", "azure", "key")
_SERVICE_TIERS = ("default", "priority", "flex", "reserved")
_REGION = re.compile(r"^[a-z0-9-]{2,32}$")
_HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")
_ROUTE_KEYS = ("models", "targets", "thinking", "images", "body-over")
_TARGET_KEYS = ("upstream", "model")
_TABLES = ("relay", "upstreams", "routes", "relay-keys", "prices", "signin")
_KNOWN_TABLES = "[relay], [upstreams.NAME], [[routes]], [relay-keys], [prices], [signin]"


class ConfigFileError(Exception):
    """
    A configuration file that cannot be used. Its message is one line that
    names the file, the table and the key, and never holds a key's value.
    """


@dataclass(frozen=True)
class FileSettings:
    """
    What a configuration file says.

    :ivar path: the file.
    :ivar relay: the ``[relay]`` options by long name: a string for an
        option taking a value (``upstream-key`` already read from its
        ``env:`` or ``file:`` source), ``True`` for a flag that is on, a
        list of strings for ``listen``. Never shown by ``repr``.
    :ivar upstreams: the ``[upstreams.NAME]`` tables in file order; empty
        when the file has none.
    :ivar routes: the ``[[routes]]`` in file order; empty when none.
    :ivar relay_keys: the ``[relay-keys]``, each with its name (and group).
    :ivar prices: the shipped price table with the file's ``[prices]``, or
        ``None`` when the file has none.
    :ivar signin: the ``[signin]`` table, or ``None`` when the file has none.
    """

    path: str
    relay: dict = field(default_factory=dict, repr=False)
    upstreams: tuple[Upstream, ...] = ()
    routes: tuple[Route, ...] = ()
    relay_keys: tuple[RelayKey, ...] = ()
    prices: PriceTable | None = field(default=None, repr=False)
    signin: SignInConfig | None = None

    def __repr__(self) -> str:
        shown = ", ".join("%s=%r" % (f.name, getattr(self, f.name)) for f in fields(self) if f.repr)
        return "FileSettings(%s, relay=<options %s>)" % (shown, ", ".join(sorted(self.relay)))


class _Table:
    """Where in the file a value is, for error messages."""

    def __init__(self, path: str, table: str):
        self.path = path
        self.table = table

    def error(self, key: str | None, problem: str) -> ConfigFileError:
        where = "%s: %s" % (self.path, self.table)
        if key is not None:
            where += " " + key
        return ConfigFileError("%s: %s" % (where, problem))

    def only(self, values: dict, known: tuple[str, ...]) -> None:
        for key in values:
            if key not in known:
                raise self.error(
                    _shown_name(key), "unknown key (known: %s)" % (", ".join(known),)
                )


def _shown_name(name: str) -> str:
    """A key's name as an error shows it: names are never secret, but keep them short and printable."""
    name = name if name.isprintable() else name.encode("unicode_escape").decode("ascii")
    return name if len(name) <= 64 else name[:64] + "..."


def load(path: str, options: OptionKinds, environ: Mapping[str, str] | None = None) -> FileSettings:
    """
    Read and check a configuration file.

    :param options: the long names of ``twistd relay``'s options and how each
        takes its value (see :data:`OptionKinds`); ``[relay]`` may hold these.
    :param environ: where ``env:VAR`` keys are read; ``os.environ`` by default.
    :raises ConfigFileError: at the first mistake.
    """
    environ = os.environ if environ is None else environ
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigFileError("%s: cannot read it: %s" % (path, e.strerror or e.__class__.__name__))
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigFileError("%s: not UTF-8 text" % (path,))
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError("%s: not valid TOML: %s" % (path, str(e).splitlines()[0]))

    folder = os.path.dirname(os.path.abspath(path))
    for name, value in data.items():
        if name not in _TABLES:
            if isinstance(value, (dict, list)):
                raise ConfigFileError(
                    "%s: unknown table [%s] (known: %s)" % (path, _shown_name(name), _KNOWN_TABLES)
                )
            raise ConfigFileError(
                "%s: unknown key %s outside any table (known tables: %s)"
                % (path, _shown_name(name), _KNOWN_TABLES)
            )

    relay = _relay_table(path, data.get("relay", {}), options, environ, folder)
    upstreams = _upstream_tables(path, data.get("upstreams", {}), environ, folder)
    if upstreams:
        for name in ONE_UPSTREAM_OPTIONS:
            if name in relay:
                raise _Table(path, "[relay]").error(
                    name, "describes the one upstream of a relay without [upstreams]; this file has [upstreams]"
                )
    defined = tuple(u.name for u in upstreams) or (DEFAULT_UPSTREAM_NAME,)
    routes = _routes(path, data.get("routes", []), defined)
    relay_keys = _relay_keys(path, data.get("relay-keys", {}), environ, folder)
    prices = _prices(path, data["prices"]) if "prices" in data else None
    signin = _signin(path, data["signin"], environ, folder) if "signin" in data else None
    return FileSettings(
        path=path, relay=relay, upstreams=upstreams, routes=routes, relay_keys=relay_keys, prices=prices,
        signin=signin,
    )


def _signin(path, table, environ, folder) -> SignInConfig:
    """``[signin]``: its secrets read as the file reads keys (``env:VAR``, ``file:PATH`` or written out)."""
    where = _Table(path, "[signin]")
    try:
        return signin_table(table, lambda key, source: _key(where, key, source, environ, folder), folder)
    except SignInConfigError as e:
        raise where.error(e.key, e.problem)


def _relay_keys(path, table, environ, folder) -> tuple[RelayKey, ...]:
    """
    ``[relay-keys]``: ``NAME = SOURCE`` or ``NAME = { key = SOURCE, group =
    "GROUP" }``, a source being ``"env:VAR"``, ``"file:PATH"`` or the key.
    """
    if not isinstance(table, dict):
        raise ConfigFileError("%s: relay-keys must be a table, [relay-keys]" % (path,))
    where = _Table(path, "[relay-keys]")
    keys = []
    for name, item in table.items():
        label = _shown_name(name)
        problem = key_name_problem(name)
        if problem is not None:
            raise where.error(label, "a name " + problem)
        group = None
        if isinstance(item, dict):
            unknown = sorted(set(item) - {"key", "group"})
            if unknown:
                raise where.error(label, "takes key and group only, not %s" % (", ".join(unknown),))
            group = item.get("group")
            if group is not None and key_name_problem(group) is not None:
                raise where.error(label, "group " + key_name_problem(group))
            item = item.get("key")
        if not isinstance(item, str) or not item:
            raise where.error(label, 'must be "env:VAR", "file:PATH" or the key, or { key = ..., group = ... }')
        keys.append(RelayKey(_key(where, label, item, environ, folder), name, group))
    try:
        return unique_relay_keys(keys)
    except ValueError as e:
        raise where.error(None, str(e))


def _prices(path, table) -> PriceTable:
    """``[prices]``: models added to (or replacing those of) the shipped table."""
    try:
        return price_table_from(table, base=DEFAULT_PRICES)
    except ValueError as e:
        raise ConfigFileError("%s: [prices] %s" % (path, _one_line(e)))


def _relay_table(path, table, options: OptionKinds, environ, folder) -> dict:
    where = _Table(path, "[relay]")
    if not isinstance(table, dict):
        raise ConfigFileError("%s: relay must be a table, [relay]" % (path,))
    settings: dict = {}
    for name, value in table.items():
        if name == "config":
            raise where.error(name, "a configuration file cannot name another")
        kind = options.get(name)
        if kind is None:
            raise where.error(
                _shown_name(name), "unknown option (every long option of twistd relay --help may be given here)"
            )
        if kind == "flag":
            if not isinstance(value, bool):
                raise where.error(name, "must be true or false")
            if value:
                settings[name] = True
        elif kind == "multi":
            values = [value] if isinstance(value, str) else value
            if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
                raise where.error(name, "must be a string or a list of strings")
            settings[name] = list(values)
        elif name == "upstream-key":
            if not isinstance(value, str) or not value:
                raise where.error(name, 'must be a string: "env:VAR", "file:PATH" or the key')
            settings[name] = _key(where, name, value, environ, folder)
        else:
            settings[name] = _option_text(where, name, value)
    return settings


def _option_text(where: _Table, name: str, value) -> str:
    """An option's value as its command line would give it."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float, list)):
        raise where.error(name, "must be a string or a number")
    if isinstance(value, list):
        if not value or not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
            raise where.error(name, "must be a string, a number or a list of them")
        return ",".join(str(v) for v in value)
    return str(value)


def _upstream_tables(path, tables, environ, folder) -> tuple[Upstream, ...]:
    if not isinstance(tables, dict):
        raise ConfigFileError("%s: upstreams must be tables, one [upstreams.NAME] each" % (path,))
    upstreams = []
    for name, table in tables.items():
        where = _Table(path, "[upstreams.%s]" % (_shown_name(name),))
        if not _NAME.match(name):
            raise where.error(None, "an upstream's name holds letters, digits, - and _ only")
        if not isinstance(table, dict):
            raise ConfigFileError(
                "%s: upstreams.%s must be a table, [upstreams.%s]" % (path, _shown_name(name), _shown_name(name))
            )
        where.only(table, _UPSTREAM_KEYS)
        cloud = _cloud_settings(where, table, environ, folder)
        if "url" not in table:
            url = cloud_base_url(cloud["wire"], cloud["region"])
            if url is None:
                raise where.error("url", "missing: every upstream needs its base URL (a bedrock or vertex wire: "
                                         "or its region)")
            table = {**table, "url": url}
        ids = _policy(where, table.get("ids", "unique"))
        id_pattern, own_ids = _id_rules(where, name, ids, table)
        keys, accounts = _keys(where, table.get("keys"), environ, folder)
        upstreams.append(
            Upstream(
                name=name,
                url=_url(where, table["url"]),
                keys=keys,
                accounts=accounts,
                ids=ids,
                connect_timeout=_seconds(where, "connect-timeout", table.get("connect-timeout")),
                response_timeout=_seconds(where, "response-timeout", table.get("response-timeout")),
                idle_timeout=_seconds(where, "idle-timeout", table.get("idle-timeout")),
                max_connections=_count(where, "max-connections", table.get("max-connections")),
                threads=_threads(where, table.get("threads")),
                id_pattern=id_pattern,
                own_ids=own_ids,
                **cloud,
            )
        )
    return tuple(upstreams)


def _cloud_settings(where: _Table, table: dict, environ, folder) -> dict:
    """An upstream's wire, login and cloud settings (``docs/clouds.md``), as :class:`Upstream`'s fields."""
    wire = table.get("wire", "anthropic")
    if wire not in _WIRES:
        raise where.error("wire", "must be one of %s" % (", ".join(_WIRES),))
    settings: dict = {"wire": wire}
    for key, field_name in (("region", "region"), ("project", "project"),
                            ("anthropic-version", "anthropic_version")):
        value = table.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip() or not value.isprintable()):
            raise where.error(key, "must be a string that is not empty")
        settings[field_name] = value
    if settings["region"] is not None and not _REGION.match(settings["region"]):
        raise where.error("region", "must be a cloud region such as us-east-1, global or us")
    if wire == "bedrock" and settings["region"] is None:
        raise where.error("region", "missing: a bedrock wire signs for one region")
    if wire == "vertex" and settings["project"] is None:
        raise where.error("project", "missing: a vertex wire needs its Google Cloud project")
    tier = table.get("service-tier")
    if tier is not None and tier not in _SERVICE_TIERS:
        raise where.error("service-tier", "must be one of %s" % (", ".join(_SERVICE_TIERS),))
    settings["service_tier"] = tier
    settings["models"] = _string_pairs(where, "models", table.get("models"), None)
    settings["headers"] = _string_pairs(where, "headers", table.get("headers"), _HEADER_NAME)
    settings["login"] = _login(where, table.get("login"), environ, folder)
    dialect = table.get("dialect")
    if dialect is not None and (dialect not in _DIALECTS or wire != "openai-chat"):
        raise where.error("dialect", "applies to an openai-chat wire, and is one of %s" % (", ".join(_DIALECTS),))
    settings["dialect"] = dialect
    return settings


def _string_pairs(where: _Table, key: str, value, names) -> tuple[tuple[str, str], ...]:
    """A table of strings to strings (``models``, ``headers``), in file order."""
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(v, str) and v.isprintable() for v in value.values()):
        raise where.error(key, 'must be a table of strings, such as { "NAME" = "VALUE" }')
    if names is not None:
        for name in value:
            if not names.match(name):
                raise where.error(key, "%s is not a header name" % (_shown_name(name),))
    return tuple(value.items())


# A login's options that hold a secret, by kind: ``env:VAR`` names where it
# is (read when the login fetches, so a rotated one is read again), anything
# else is the secret itself (``file:PATH`` read here) and never shown.
_SECRET_LOGIN_OPTIONS = {"aws": ("access-key-id", "secret-access-key", "session-token"),
                         "bedrock-api-key": ("key",), "key": ("key",)}


def _login(where: _Table, value, environ, folder) -> LoginSpec | None:
    """
    ``login = { kind = "...", ... }``: its secrets as ``env:VAR`` (read by the
    login), ``file:PATH`` (read here) or written as they are; an AWS login's
    keys all one way or all the other. No error names a secret's value.
    """
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("kind") not in _LOGINS:
        raise where.error("login", 'must be a table such as { kind = "aws" } (kinds: %s)' % (", ".join(_LOGINS),))
    kind = value["kind"]
    secret_names = _SECRET_LOGIN_OPTIONS.get(kind, ())
    options = []
    for name, option in value.items():
        if name == "kind":
            continue
        label = "login " + _shown_name(name)
        if not isinstance(option, str) or not option.isprintable() or not option.strip():
            raise where.error(label, "must be a string that is not empty")
        if name in secret_names:
            if kind == "key" or option.startswith("file:"):
                # Read here, as the key pool's keys are.
                option = _key(where, label, option, environ, folder)
            elif option.startswith("env:") and not _ENVIRONMENT_NAME.match(option[4:]):
                raise where.error(label, "env: must name an environment variable")
        options.append((name, option))
    given = [option for name, option in options if name in secret_names]
    if kind == "aws" and len({option.startswith("env:") for option in given}) > 1:
        raise where.error("login", "takes its keys all from the environment (env:VAR) or all written out, not both")
    return LoginSpec(kind, tuple(options))


def _url(where: _Table, value) -> str:
    # The value is never repeated: a URL may carry credentials.
    if not isinstance(value, str):
        raise where.error("url", "must be a string, an http:// or https:// URL")
    url = value.rstrip("/")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError:
        raise where.error("url", "is not a URL")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise where.error("url", "must be an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise where.error("url", "may hold no user name, password, query or fragment (give keys in keys)")
    return url


def _keys(where: _Table, value, environ, folder) -> tuple[tuple[str, ...], tuple[str | None, ...]]:
    """
    A pool's keys and the account each names: every item is a key's source
    (``"env:VAR"``, ``"file:PATH"`` or the key) or a table ``{key = SOURCE,
    account = "NAME"}``. The accounts are ``()`` when no key names one.
    """
    if value is None:
        return (), ()
    if not isinstance(value, list) or not all(isinstance(v, (str, dict)) for v in value):
        raise where.error(
            "keys", 'must be a list of strings ("env:VAR", "file:PATH" or the key) or {key = ..., account = ...} tables'
        )
    if not value:
        raise where.error("keys", "is empty: give at least one key, or leave keys out to pass the client's own")
    keys: list[str] = []
    accounts: list[str | None] = []
    for position, item in enumerate(value, 1):
        label = "keys #%d" % (position,)
        source, account = _key_item(where, label, item)
        key = _key(where, label, source, environ, folder)
        if key in keys:
            raise where.error(label, "is the same key as keys #%d" % (keys.index(key) + 1,))
        keys.append(key)
        accounts.append(account)
    return tuple(keys), (tuple(accounts) if any(a is not None for a in accounts) else ())


def _key_item(where: _Table, label: str, item) -> tuple[str, str | None]:
    """One item of ``keys``: its source, and the account it names (or ``None``)."""
    if isinstance(item, str):
        return item, None
    unknown = sorted(set(item) - {"key", "account"})
    if unknown:
        raise where.error(label, "takes key and account only, not %s" % (", ".join(unknown),))
    if not isinstance(item.get("key"), str):
        raise where.error(label, 'needs key = "env:VAR", "file:PATH" or the key')
    account = item.get("account")
    if account is not None and (not isinstance(account, str) or not account.strip()):
        raise where.error(label, "account must be a name (a string that is not empty)")
    return item["key"], account


def _key(where: _Table, label: str, source: str, environ, folder) -> str:
    """A key from its source: ``env:VAR``, ``file:PATH`` or the key itself."""
    if source.startswith("env:"):
        variable = source[4:]
        if not _ENVIRONMENT_NAME.match(variable):
            raise where.error(label, "env: must name an environment variable")
        key = environ.get(variable, "").strip()
        if not key:
            raise where.error(label, "the environment variable %s is not set" % (variable,))
    elif source.startswith("file:"):
        name = source[5:]
        file_path = os.path.join(folder, os.path.expanduser(name))
        try:
            with open(file_path, encoding="utf-8") as f:
                key = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or "not UTF-8 text"
            raise where.error(label, "cannot read the key file %s: %s" % (name, why))
        if not key:
            raise where.error(label, "the key file %s is empty" % (name,))
        if "\n" in key:
            raise where.error(label, "the key file %s holds more than one line; one key a file" % (name,))
    else:
        key = source.strip()
        if not key:
            raise where.error(label, "is empty")
    if any(c.isspace() for c in key) or not key.isprintable():
        raise where.error(label, "holds spaces or control characters, which no key holds")
    return key


def _policy(where: _Table, value) -> str:
    if value not in _POLICIES:
        raise where.error("ids", "must be unique or original")
    return value


def _threads(where: _Table, value) -> str | None:
    if value is not None and value not in THREAD_MODES:
        raise where.error("threads", "must be relay or upstream")
    return value


def _id_rules(where: _Table, name: str, policy: str, table: dict) -> tuple[str | None, str | None]:
    """``id-pattern`` and ``own-ids``, checked as the request path will use them."""
    id_pattern = table.get("id-pattern", DEFAULT_ID_PATTERN)
    if not isinstance(id_pattern, str) or not id_pattern:
        raise where.error("id-pattern", 'must be a regular expression, "default" or "none"')
    id_pattern = id_pattern_setting(id_pattern)
    own_ids = table.get("own-ids")
    if own_ids is not None:
        if not isinstance(own_ids, str) or not own_ids:
            raise where.error("own-ids", "must be a regular expression")
        if policy != "original":
            raise where.error("own-ids", 'applies to ids = "original" only (this upstream is "unique")')
    try:
        UpstreamRules(name, policy, id_pattern, None)
    except ValueError as e:
        raise where.error("id-pattern", _one_line(e))
    try:
        UpstreamRules(name, policy, None, own_ids)
    except ValueError as e:
        raise where.error("own-ids", _one_line(e))
    return id_pattern, own_ids


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _seconds(where: _Table, key: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise where.error(key, "must be a number of seconds above zero")
    return float(value)


def _count(where: _Table, key: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise where.error(key, "must be a whole number above zero")
    return value


def _size(where: _Table, key: str, value) -> int:
    """A size: bytes as a number, or a string such as ``512K``, ``32M``, ``1G``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise where.error(key, 'must be a size: bytes, or a string such as "100K"')
    if isinstance(value, int):
        number = value
    else:
        try:
            number = parse_size(value)
        except ValueError:
            raise where.error(key, 'must be a size: bytes, or a string such as "100K"')
    if number < 0:
        raise where.error(key, "must be zero or more")
    return number


def _routes(path, tables, defined: tuple[str, ...]) -> tuple[Route, ...]:
    if not isinstance(tables, list):
        raise ConfigFileError("%s: routes must be an array of tables, one [[routes]] each" % (path,))
    routes = []
    for position, table in enumerate(tables, 1):
        where = _Table(path, "[[routes]] #%d" % (position,))
        if not isinstance(table, dict):
            raise where.error(None, "must be a table")
        where.only(table, _ROUTE_KEYS)
        routes.append(
            Route(
                targets=_targets(where, table.get("targets"), defined),
                models=_models(where, table.get("models")),
                thinking=_condition(where, "thinking", table.get("thinking")),
                images=_condition(where, "images", table.get("images")),
                body_over=None if "body-over" not in table else _size(where, "body-over", table["body-over"]),
            )
        )
    return tuple(routes)


def _models(where: _Table, value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise where.error("models", 'must be a list of model names or globs, such as ["claude-haiku-*"]')
    return tuple(value)


def _condition(where: _Table, key: str, value) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise where.error(key, "must be true or false")
    return value


def _targets(where: _Table, value, defined: tuple[str, ...]) -> tuple[Target, ...]:
    if value is None:
        raise where.error("targets", "missing: a route needs at least one target")
    if not isinstance(value, list) or not value:
        raise where.error("targets", 'must be a list of tables such as [{ upstream = "NAME" }]')
    targets = []
    for position, target in enumerate(value, 1):
        label = "targets #%d" % (position,)
        if not isinstance(target, dict):
            raise where.error(label, 'must be a table such as { upstream = "NAME" }')
        for key in target:
            if key not in _TARGET_KEYS:
                raise where.error(
                    "%s %s" % (label, _shown_name(key)), "unknown key (known: %s)" % (", ".join(_TARGET_KEYS),)
                )
        upstream = target.get("upstream")
        if not isinstance(upstream, str):
            raise where.error(label + " upstream", "missing: the name of an upstream")
        if upstream not in defined:
            raise where.error(
                label + " upstream",
                "no upstream is named %s (defined: %s)" % (_shown_name(upstream), ", ".join(defined)),
            )
        model = target.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise where.error(label + " model", "must be a model name")
        targets.append(Target(upstream, model))
    return tuple(targets)
