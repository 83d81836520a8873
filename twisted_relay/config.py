# -*- test-case-name: tests.test_tap -*-
"""
The relay's settings, as plain frozen values.

:class:`RelayConfig` is what :mod:`twisted_relay.settings` builds from a
command line and a ``--config`` file (for ``twistd relay``, or for anyone),
and what an application embedding the relay may build itself. Its upstreams
(:class:`Upstream`) and routes (:class:`Route`, each with its
:class:`Target` list) say where each request may go; by default one upstream
named ``default`` (Anthropic's API) and one route sending every model to
every upstream in order. A relay of one upstream is written
``RelayConfig(upstreams=one_upstream(url, key=...))``.

No repr here shows a key: an upstream's pool is shown by its size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from urllib.parse import urlsplit

from twisted_relay.prices import DEFAULT_PRICES, PriceTable
from twisted_relay.relay_keys import RelayKey
from twisted_relay.signin.config import SignInConfig
from twisted_relay.translation import DEFAULT_ID_PATTERN, UpstreamRules

__all__ = [
    "DEFAULT_LISTEN",
    "DEFAULT_UPSTREAM",
    "DEFAULT_UPSTREAM_NAME",
    "MiB",
    "RelayConfig",
    "RelayKey",
    "Route",
    "Target",
    "LoginSpec",
    "Upstream",
    "default_bodies_in_flight",
    "cloud_base_url",
    "every_upstream_route",
    "id_pattern_setting",
    "one_upstream",
    "rules_for",
    "usage_db_setting",
]

MiB = 1024 * 1024
DEFAULT_LISTEN = "tcp:8080:interface=127.0.0.1"
DEFAULT_UPSTREAM = "https://api.anthropic.com"
#: The name of the upstream the one-upstream options (``--upstream``...) describe.
DEFAULT_UPSTREAM_NAME = "default"


@dataclass(frozen=True)
class Upstream:
    """
    One Anthropic-protocol backend.

    :ivar name: its name in routes, logs, metrics and the
        ``x-relay-upstream`` header (letters, digits, ``-`` and ``_``).
    :ivar url: its base URL, without a trailing slash.
    :ivar keys: the key pool sent as ``x-api-key``, in order; empty passes
        the client's own credentials through. Never shown by ``repr``.
    :ivar ids: the id policy towards it, ``unique`` or ``original``.
    :ivar connect_timeout: its own ``connect_timeout``; ``None`` takes the
        relay's (see :meth:`RelayConfig.settings_for`).
    :ivar response_timeout: likewise.
    :ivar idle_timeout: likewise.
    :ivar max_connections: likewise, for ``max_upstream_connections``.
    :ivar threads: how message threads are carried to it, ``relay`` or
        ``upstream`` (see :attr:`RelayConfig.threads`); ``None`` takes the
        relay's.
    :ivar id_pattern: the regular expression every tool-use id sent to it
        must match (an id outside it goes encoded); ``"default"``:
        Anthropic's ``^[a-zA-Z0-9_-]+$`` under ``unique``, none under
        ``original``; ``None``: none (see ``docs/id-translation.md``).
    :ivar own_ids: ``original`` only: the regular expression of the ids it
        makes (only those go back as it emitted them); ``None``: every id.
    :ivar accounts: the account (or workspace) each key of :attr:`keys`
        belongs to, in the same order (``None``: not named, an account of
        its own); empty when no key names one. A conversation that must
        leave its key goes to a key of the same account first
        (:mod:`twisted_relay.affinity`).
    :ivar wire: how requests are sent to it and answers read back
        (:mod:`twisted_relay.wires`): ``anthropic`` (Anthropic's API and
        every surface that speaks it: Foundry, Claude Platform on AWS),
        ``bedrock`` (Amazon Bedrock's InvokeModel), ``vertex`` (Google
        Vertex AI's rawPredict), ``openai-responses``, ``openai-chat``
        (OpenAI's protocols, ``docs/openai.md``).
    :ivar login: how the relay proves who it is to it
        (:class:`LoginSpec`; :mod:`twisted_relay.logins`); ``None``: the
        key pool (:attr:`keys`) as ``x-api-key``, or the client's own.
    :ivar region: the cloud region (Bedrock: for SigV4; Vertex: the
        location, ``global``, ``us``, ``eu`` or a region).
    :ivar project: the Google Cloud project (Vertex).
    :ivar models: the model a client asks for -> the platform's id for it
        (a Bedrock id, inference profile or ARN; a Vertex model; a Foundry
        deployment); a model not listed goes by its own name.
    :ivar service_tier: Bedrock's ``X-Amzn-Bedrock-Service-Tier``.
    :ivar anthropic_version: the body's ``anthropic_version`` on a cloud
        wire (``None``: the platform's).
    :ivar headers: headers sent with every request to it
        (``anthropic-workspace-id`` for Claude Platform on AWS).
    :ivar dialect: an ``openai-chat`` upstream's dialect (``deepseek``,
        ``kimi``, ``gemini``, ``groq``, ``mistral``, ``openrouter``, ``xai``,
        ``openai``; :mod:`twisted_relay.openai.dialects`); ``None``: ``openai``.
    """

    name: str
    url: str
    keys: tuple[str, ...] = field(default=(), repr=False)
    ids: str = "unique"
    connect_timeout: float | None = None
    response_timeout: float | None = None
    idle_timeout: float | None = None
    max_connections: int | None = None
    threads: str | None = None
    id_pattern: str | None = DEFAULT_ID_PATTERN
    own_ids: str | None = None
    accounts: tuple[str | None, ...] = ()
    wire: str = "anthropic"
    login: LoginSpec | None = None
    region: str | None = None
    project: str | None = None
    models: tuple[tuple[str, str], ...] = ()
    service_tier: str | None = None
    anthropic_version: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    dialect: str | None = None

    def platform_model(self, model: str | None) -> str | None:
        """The platform's id for ``model`` (:attr:`models`), or ``model`` itself."""
        for asked, platform in self.models:
            if asked == model:
                return platform
        return model

    def account_of(self, index: int) -> str | None:
        """The account key ``index`` (0-based) names, if it names one."""
        return self.accounts[index] if index < len(self.accounts) else None

    def __repr__(self) -> str:
        shown = ", ".join(
            "%s=%r" % (f.name, getattr(self, f.name)) for f in fields(self) if f.repr
        )
        return "Upstream(%s, keys=<%d>)" % (shown, len(self.keys))


#: The options of a login that may hold a secret itself (rather than name it: ``env:VAR``).
_SECRET_OPTIONS = frozenset({"key", "access-key-id", "secret-access-key", "session-token"})


@dataclass(frozen=True)
class LoginSpec:
    """
    How the relay logs in to an upstream (:mod:`twisted_relay.logins`).

    :ivar kind: ``aws`` (SigV4 from the AWS credential chain or given keys),
        ``bedrock-api-key`` (a Bedrock API key as a bearer token),
        ``google`` (a service-account file or Application Default
        Credentials), ``azure`` (an Entra ID token), ``key`` (the key pool
        in headers of the upstream's choosing: ``api-key`` and ``x-api-key``
        for Foundry).
    :ivar options: the login's settings by name (a profile, a file, the
        names of environment variables holding secrets as ``env:VAR``, or
        a secret written out in the configuration): never shown by ``repr``.
    """

    kind: str
    options: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def option(self, name: str, default: str | None = None) -> str | None:
        """The option ``name``, or ``default``."""
        for key, value in self.options:
            if key == name:
                return value
        return default


@dataclass(frozen=True)
class Target:
    """
    One place a route sends a request to.

    :ivar upstream: the name of an :class:`Upstream`.
    :ivar model: the model name sent to it; ``None`` sends the client's.
    """

    upstream: str
    model: str | None = None


@dataclass(frozen=True)
class Route:
    """
    Which requests go where. Every condition given must hold for the route
    to match; the first route that matches a request wins.

    :ivar targets: tried in this order (see :mod:`twisted_relay.routing`).
    :ivar models: ``fnmatch`` globs on the body's ``model``; empty: any.
    :ivar thinking: ``True`` matches requests with extended thinking
        enabled only, ``False`` those without only; ``None`` either.
    :ivar images: likewise for requests holding an image.
    :ivar body_over: matches request bodies larger than this many bytes
        only (long contexts); ``None`` any size.
    """

    targets: tuple[Target, ...]
    models: tuple[str, ...] = ()
    thinking: bool | None = None
    images: bool | None = None
    body_over: int | None = None


#: The values of ``thinking_binding_recovery``.
BINDING_RECOVERIES = ("drop_block", "off")


def one_upstream(
    url: str = DEFAULT_UPSTREAM,
    key: str | None = None,
    *,
    ids: str = "unique",
    id_pattern: str | None = DEFAULT_ID_PATTERN,
    own_ids: str | None = None,
) -> tuple[Upstream]:
    """
    The upstreams of a relay with one upstream, named ``default``: what the
    one-upstream options of ``twistd relay`` (``--upstream``,
    ``--upstream-key``, ``--upstream-ids``, ``--upstream-id-pattern``,
    ``--upstream-own-ids``) describe.

    :param key: sent as ``x-api-key``; ``None`` passes the client's own
        credentials through.
    """
    keys = (key,) if key else ()
    return (Upstream(DEFAULT_UPSTREAM_NAME, url, keys, ids, id_pattern=id_pattern, own_ids=own_ids),)


def cloud_base_url(wire: str, region: str | None) -> str | None:
    """
    The base URL of a cloud wire's region, for an upstream whose file gives
    none: Bedrock's runtime endpoint of the region; for Vertex, ``global``
    -> ``https://aiplatform.googleapis.com``, the multi-regions ``us`` and
    ``eu`` -> ``https://aiplatform.us.rep.googleapis.com``, a region ->
    ``https://{region}-aiplatform.googleapis.com`` (there is no
    ``global-aiplatform`` host). ``None`` for other wires.
    """
    if wire == "bedrock" and region:
        return "https://bedrock-runtime.%s.amazonaws.com" % (region,)
    if wire == "vertex":
        location = region or "global"
        if location == "global":
            return "https://aiplatform.googleapis.com"
        if location in ("us", "eu"):
            return "https://aiplatform.%s.rep.googleapis.com" % (location,)
        return "https://%s-aiplatform.googleapis.com" % (location,)
    return None


def every_upstream_route(upstreams: tuple[Upstream, ...]) -> tuple[Route]:
    """The routes of a configuration that gives none: every model to every upstream, in order."""
    return (Route(targets=tuple(Target(upstream.name) for upstream in upstreams)),)


def parse_size(text: str) -> int:
    """
    A byte size as people write it: ``1048576``, ``512K``, ``32M``, ``1G``
    (``MB``, ``MiB`` alike: powers of 1024).

    :raises ValueError: for anything else.
    """
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    for suffix, factor in (("K", 1024), ("M", MiB), ("G", 1024 * MiB)):
        if text.endswith(suffix):
            text, scale = text[:-1], factor
            break
    return int(float(text) * scale)


def default_bodies_in_flight() -> int:
    """
    The default limit of request-body bytes in flight: a 64th of the
    machine's memory, and at least one largest body (32 MiB). A body of
    many tiny messages costs about twelve times its size while it is parsed
    and translated, so the default keeps that peak near a fifth of memory.
    """
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 256 * MiB
    return max(32 * MiB, memory // 64)


@dataclass(frozen=True)
class RelayConfig:
    """
    Everything the relay needs to know to run.

    :ivar listen: Twisted endpoint strings to serve on; empty when the relay
        is mounted in someone else's ``Site``.
    :ivar connect_timeout: seconds to establish the upstream connection.
    :ivar response_timeout: seconds to wait for the upstream's response
        headers (a non-streaming answer sends them only when it is done).
    :ivar idle_timeout: seconds of upstream silence inside a stream before
        the relay gives up on it.
    :ivar ping_interval: seconds of upstream silence after which the relay
        sends its own ``ping`` event to the client; 0 disables.
    :ivar max_body: largest request body accepted, in bytes.
    :ivar max_bodies_in_flight: bytes of request bodies one relay process
        holds at once; past it a new body gets ``529 overloaded_error``
        (one body is always let in when none is held). 0 for no limit.
        The default is :func:`default_bodies_in_flight`.
    :ivar max_upstream_connections: persistent connections kept per
        upstream host (concurrent streams each hold one).
    :ivar dump_dir: folder for diagnostic dumps of upstream 4xx answers;
        ``None`` disables dumps.
    :ivar dump_max_bytes: largest dump written whole; larger ones are
        truncated visibly.
    :ivar dump_retention_days: dumps older than this are deleted.
    :ivar dump_retention_bytes: the oldest dumps are deleted while the
        folder holds more than this.
    :ivar total_timeout: seconds a request may take end to end, stream
        included; 0 for no limit.
    :ivar request_read_timeout: seconds a client may take to send a whole
        request (headers and body); slower ones are cut (slowloris).
    :ivar relay_keys: keys clients must present (``x-api-key`` or
        ``Authorization: Bearer``), each with the name of its user
        (:class:`RelayKey`; a plain string is a key named by its digest);
        empty lets every client in. A relay key is never forwarded upstream.
    :ivar admin_keys: keys that open the relay's admin pages and endpoints
        (``/admin/...``, ``/v1/organizations/...``), each named; never
        accepted on the Messages routes, never forwarded upstream. Empty:
        no admin endpoint answers.
    :ivar max_concurrent: requests relayed upstream at once; past it the
        relay answers ``529 overloaded_error`` at once. 0 for no limit.
    :ivar retries: times a request is sent again after a failure before any
        byte reached the client (connection failures, and the statuses in
        ``retry_statuses``); 0 never retries.
    :ivar retry_statuses: upstream statuses worth a retry.
    :ivar max_retry_wait: longest ``retry-after`` the relay waits out;
        longer ones are passed to the client.
    :ivar shutdown_grace: seconds streams in flight may go on after the
        relay is told to stop.
    :ivar drain_delay: seconds the relay goes on accepting connections
        after it is told to stop, while ``/ready`` already answers 503, so
        that a load balancer sees it and sends elsewhere; 0 stops accepting
        at once (``twistd relay`` waits 5 s by default).
    :ivar metrics: serve Prometheus metrics at ``/metrics``.
    :ivar simulate: run the embedded simulated upstream in this mode
        (``strict``, ``stateful`` or ``lenient``) and relay to it.
    :ivar simulate_options: keyword arguments for the simulated upstream.
    :ivar simulate_idp: sign people in with the embedded simulated identity
        provider (``--simulate-idp``, :mod:`twisted_relay.simulated.signin_demo`):
        the relay makes :attr:`signin` when it starts.
    :ivar workers: relay processes serving the ``tcp:`` listen addresses
        together (``SO_REUSEPORT``), this one included; each has its own
        pool, limits and metrics. 1 runs the relay in this process only.
    :ivar gc_tuning: freeze what exists in the process when the relay
        starts, and run full garbage collections when the heap has grown
        rather than Python's (:mod:`twisted_relay.gctuning`); it changes
        the whole process, so only ``twistd relay`` turns it on.
    :ivar forward_attribution: send Claude Code's attribution headers
        (``x-app``, ``x-claude-code-*``) upstream too; by default the relay
        only records them (log line, dumps).
    :ivar upstreams: the backends, in order (at least one); by default one
        named ``default``, Anthropic's API with the clients' own
        credentials. :func:`one_upstream` writes a single one.
    :ivar routes: in order; empty (when made): one route sending every model
        to every upstream in order (:func:`every_upstream_route`).
    :ivar breaker_failures: failures in a row after which an upstream (or
        a key of its pool) is skipped for ``breaker_cooldown``.
    :ivar breaker_cooldown: seconds a failing upstream or key is skipped
        before one request is let through to probe it.
    :ivar key_rest: seconds a key the upstream refused (401/403) is
        skipped before it is probed.
    :ivar threads: how message threads are carried (``docs/threads.md``):
        ``relay``, the relay holds each thread and sends the upstream plain,
        whole requests (any upstream, ``https://api.anthropic.com``
        included); ``upstream``, for an upstream that knows threads, the
        thread is passed on with only the new messages, translated.
    :ivar thread_store: where threads are kept: ``memory`` (this process)
        or a ``redis://`` URL (shared by workers and machines).
    :ivar thread_ttl: seconds a thread lives after its last use; 0: until
        evicted.
    :ivar thread_max_count: threads the memory store holds at most.
    :ivar thread_max_bytes: conversation bytes the memory store holds at
        most (least recently used threads go first).
    :ivar thinking_binding_recovery: what the relay does when an upstream
        answers 400 that a thinking block is bound to a different
        conversation, before any byte reached the client: ``drop_block``
        sends the request once more to the same key with
        ``thinking.block_binding.prefix_mismatch_behavior: "drop_block"``
        (and its beta); ``off`` passes the 400 on.
    :ivar prices: what answers cost (:class:`~twisted_relay.prices.PriceTable`):
        the table the relay ships, with a ``--config`` file's ``[prices]``.
    :ivar usage_db: the usage ledger's database (``docs/usage.md``): an
        SQLite file's path or a ``postgresql://`` URL; ``None``: no ledger.
        Shown by ``repr`` without its password.
    :ivar usage_flush_interval: seconds between two writes of the ledger's
        queued rows (what a process killed outright may lose).
    :ivar usage_retention_days: ledger rows older than this are deleted;
        0 keeps them all.
    :ivar usage_max_queue: ledger rows a process holds in memory at most
        while its database does not answer; more are dropped and counted.
    :ivar spend_refresh_interval: seconds between two reads of the spend
        limits and the spend against them from the ledger's database, and
        between two renewals of this relay's shares of the caps
        (``docs/usage.md``, "Spend limits").
    :ivar signin: sign-in with the company's identity provider (the
        ``[signin]`` table, :class:`~twisted_relay.signin.config.SignInConfig`;
        ``docs/signin.md``), or ``None``: none.
    :ivar config_file: the ``--config`` file these settings came from, read
        again by :meth:`twisted_relay.service.Relay.reload`; ``None`` when
        there is none.
    """

    listen: tuple[str, ...] = (DEFAULT_LISTEN,)
    connect_timeout: float = 10.0
    response_timeout: float = 600.0
    idle_timeout: float = 300.0
    ping_interval: float = 10.0
    max_body: int = 32 * MiB
    max_bodies_in_flight: int = field(default_factory=lambda: default_bodies_in_flight())
    max_upstream_connections: int = 1024
    dump_dir: str | None = "relay-dumps"
    dump_max_bytes: int = 64 * MiB
    dump_retention_days: float = 30.0
    dump_retention_bytes: int = 1024 * MiB
    total_timeout: float = 0.0
    request_read_timeout: float = 120.0
    relay_keys: tuple[RelayKey, ...] = ()
    admin_keys: tuple[RelayKey, ...] = ()
    max_concurrent: int = 4096
    retries: int = 0
    retry_statuses: tuple[int, ...] = (429, 500, 502, 503, 504, 529)
    max_retry_wait: float = 60.0
    shutdown_grace: float = 30.0
    drain_delay: float = 0.0
    metrics: bool = True
    simulate: str | None = None
    simulate_options: dict = field(default_factory=dict)
    simulate_idp: bool = False
    workers: int = 1
    gc_tuning: bool = False
    forward_attribution: bool = False
    upstreams: tuple[Upstream, ...] = one_upstream()
    routes: tuple[Route, ...] = ()
    thinking_binding_recovery: str = "drop_block"
    breaker_failures: int = 3
    breaker_cooldown: float = 30.0
    key_rest: float = 600.0
    threads: str = "relay"
    thread_store: str = "memory"
    thread_ttl: float = 300.0
    thread_max_count: int = 10_000
    thread_max_bytes: int = 512 * MiB
    prices: PriceTable = field(default=DEFAULT_PRICES, repr=False)
    usage_db: str | None = None
    usage_flush_interval: float = 1.0
    usage_retention_days: float = 400.0
    usage_max_queue: int = 50_000
    spend_refresh_interval: float = 5.0
    signin: SignInConfig | None = None
    config_file: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "relay_keys", tuple(_relay_key(key) for key in self.relay_keys))
        object.__setattr__(self, "admin_keys", tuple(_relay_key(key) for key in self.admin_keys))
        object.__setattr__(self, "upstreams", tuple(self.upstreams))
        if not self.upstreams:
            raise ValueError("a relay needs at least one upstream")
        object.__setattr__(self, "routes", tuple(self.routes) or every_upstream_route(self.upstreams))

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            if not f.repr:
                continue
            value = getattr(self, f.name)
            if f.name in ("relay_keys", "admin_keys"):
                value = "<%d keys>" % (len(value),)
            elif f.name == "usage_db" and value is not None:
                value = _without_password(value)
            shown.append("%s=%r" % (f.name, value))
        return "RelayConfig(%s)" % (", ".join(shown),)

    def with_changes(self, **changes) -> "RelayConfig":
        """
        A copy of this configuration with some settings changed. New
        upstreams without new routes keep the routes, unless those were the
        default (every model to every upstream): then the default again.
        """
        if "upstreams" in changes and "routes" not in changes and self.routes == every_upstream_route(self.upstreams):
            changes["routes"] = ()
        return replace(self, **changes)

    def upstream_named(self, name: str) -> Upstream:
        """The upstream of this name; ``KeyError`` if there is none."""
        for upstream in self.upstreams:
            if upstream.name == name:
                return upstream
        raise KeyError(name)

    def settings_for(self, upstream: Upstream) -> Upstream:
        """``upstream`` with each setting it leaves to the relay filled in."""
        return replace(
            upstream,
            connect_timeout=_first(upstream.connect_timeout, self.connect_timeout),
            response_timeout=_first(upstream.response_timeout, self.response_timeout),
            idle_timeout=_first(upstream.idle_timeout, self.idle_timeout),
            max_connections=_first(upstream.max_connections, self.max_upstream_connections),
        )

    def secrets(self) -> tuple[str, ...]:
        """Every key this configuration holds, for redaction."""
        pools = tuple(key for upstream in self.upstreams for key in upstream.keys)
        logins = tuple(
            value for upstream in self.upstreams if upstream.login is not None
            for name, value in upstream.login.options if name in _SECRET_OPTIONS and not value.startswith("env:")
        )
        relay_keys = tuple(relay_key.key for relay_key in self.relay_keys + self.admin_keys)
        signin = self.signin.secrets() if self.signin is not None else ()
        return tuple(dict.fromkeys(s for s in pools + logins + relay_keys + signin if s))

    def to_dict(self) -> dict:
        """Every setting as plain JSON-able values (keys included: keep it private)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        for name in ("relay_keys", "admin_keys"):
            values[name] = [{"key": k.key, "name": k.name, "group": k.group} for k in getattr(self, name)]
        values["prices"] = self.prices.to_dict()
        values["signin"] = None if self.signin is None else self.signin.to_dict()
        values["upstreams"] = [_upstream_to_dict(u) for u in self.upstreams]
        values["routes"] = [
            {
                "targets": [{"upstream": t.upstream, "model": t.model} for t in route.targets],
                "models": list(route.models),
                "thinking": route.thinking,
                "images": route.images,
                "body_over": route.body_over,
            }
            for route in self.routes
        ]
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "RelayConfig":
        """The configuration :meth:`to_dict` described."""
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        if "prices" in values:
            values["prices"] = PriceTable.from_dict(values["prices"])
        if values.get("signin") is not None:
            values["signin"] = SignInConfig.from_dict(values["signin"])
        upstreams = tuple(_upstream_from_dict(u) for u in values.pop("upstreams", ()))
        routes = tuple(
            Route(
                targets=tuple(Target(**t) for t in r["targets"]),
                models=tuple(r["models"]),
                thinking=r["thinking"],
                images=r["images"],
                body_over=r["body_over"],
            )
            for r in values.pop("routes", ())
        )
        return cls(upstreams=upstreams, routes=routes, **values)


def _upstream_to_dict(upstream: Upstream) -> dict:
    """An upstream as plain JSON-able values (its keys and login included: keep it private)."""
    values = {f.name: getattr(upstream, f.name) for f in fields(upstream)}
    login = upstream.login
    values["login"] = None if login is None else {"kind": login.kind, "options": [list(o) for o in login.options]}
    return values


def _upstream_from_dict(values: dict) -> Upstream:
    """The upstream :func:`_upstream_to_dict` described."""
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    for name in ("models", "headers"):
        values[name] = tuple(tuple(pair) for pair in values.get(name, ()))
    login = values.get("login")
    if login is not None:
        values["login"] = LoginSpec(login["kind"], tuple(tuple(option) for option in login["options"]))
    return Upstream(**values)


def _relay_key(value) -> RelayKey:
    """A :class:`RelayKey` from itself, a plain key (named by its digest) or the dict :meth:`RelayConfig.to_dict` writes."""
    if isinstance(value, RelayKey):
        return value
    if isinstance(value, dict):
        return RelayKey(value["key"], value["name"], value.get("group"))
    return RelayKey.unnamed(value)


def id_pattern_setting(value: str) -> str | None:
    """
    An ``id-pattern`` setting as :class:`Upstream` holds it: ``none`` (no
    pattern) is ``None``, anything else (``default`` or a regular
    expression) as it is. Neither word is a pattern the relay could use,
    since both refuse its encoded ids.
    """
    return None if value == "none" else value


def usage_db_setting(value: str | None) -> str | None:
    """
    ``--usage-db`` as :class:`RelayConfig` holds it: a ``postgresql://`` (or
    ``postgres://``) URL as it is; an SQLite file (``PATH`` or
    ``sqlite:PATH``) made absolute; ``None`` for none.

    :raises ValueError: for another ``scheme://``, in words that never
        repeat the value (a URL may hold a password).
    """
    if value is None or not value.strip():
        return None
    scheme, separator, _ = value.partition("://")
    if separator and scheme.lower() in ("postgresql", "postgres"):
        try:
            urlsplit(value).port  # noqa: B018 (a bad port raises here)
        except ValueError:
            raise ValueError("is not a valid postgresql:// URL (its port?)")
        return value
    path = value.removeprefix("sqlite:")
    path = path[2:] if path.startswith("//") else path
    if "://" in path or not path:
        raise ValueError("must be an SQLite file's path or a postgresql:// URL")
    return os.path.abspath(path)


def rules_for(upstream: Upstream, config: RelayConfig) -> UpstreamRules:
    """
    The :class:`~twisted_relay.translation.UpstreamRules` a request sent to
    ``upstream`` is translated with: its name, id policy, id pattern and own
    ids; thinking is marked with its maker when the configuration has more
    than one upstream (a conversation may move between them).

    The same settings give the same (cached) value, whose memo of accepted
    ids is kept from request to request.

    :raises ValueError: when a pattern does not compile or refuses the
        encoded ids (the configuration checks this when it is read).
    """
    return _rules(upstream.name, upstream.ids, upstream.id_pattern, upstream.own_ids, len(config.upstreams) > 1)


@lru_cache(maxsize=256)
def _rules(name: str, policy: str, id_pattern: str | None, own_ids: str | None, mark_thinking: bool) -> UpstreamRules:
    return UpstreamRules(name, policy, id_pattern, own_ids, mark_thinking)


def _without_password(url: str) -> str:
    """A database URL with its password (and query, which may hold one) replaced."""
    parts = urlsplit(url)
    if "://" not in url or (parts.password is None and not parts.query):
        return url
    netloc = parts.netloc.rpartition("@")
    user = netloc[0].partition(":")[0]
    return parts._replace(netloc="%s:***@%s" % (user, netloc[2]) if parts.password is not None else parts.netloc,
                          query="***" if parts.query else "").geturl()


def _first(value, default):
    return default if value is None else value
