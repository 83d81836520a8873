# -*- test-case-name: tests.test_tap -*-
"""
The ``twistd relay`` command: its options and the service it makes.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from twisted.python import usage

from twisted_relay.config import DEFAULT_LISTEN, DEFAULT_UPSTREAM, MiB, RelayConfig
from twisted_relay.translation import POLICIES

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


def _size(name: str, value: str) -> int:
    """Parse a byte size: ``1048576``, ``512K``, ``32M``, ``1G``."""
    text = value.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    for suffix, factor in (("K", 1024), ("M", MiB), ("G", 1024 * MiB)):
        if text.endswith(suffix):
            text, scale = text[:-1], factor
            break
    try:
        number = int(float(text) * scale)
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
        ["connect-timeout", None, "10", "Seconds to connect to the upstream."],
        ["response-timeout", None, "600", "Seconds to wait for the upstream's response headers."],
        ["idle-timeout", None, "300", "Seconds of upstream silence inside a stream before giving up."],
        ["ping-interval", None, "10", "Seconds of upstream silence before the relay sends a ping (0: never)."],
        ["max-body", None, "32M", "Largest request body accepted (Anthropic's own limit is 32 MiB)."],
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
        ["simulate-seed", None, "1", "Seed of the simulated upstream."],
        ["simulate-reuse-every", None, "3", "The simulated model reuses an id every N tool calls (0: never)."],
        ["simulate-event-delay", None, "0", "Seconds between the simulated upstream's stream events."],
    ]
    optFlags = [
        ["no-dumps", None, "Write no diagnostic dumps."],
    ]

    def __init__(self):
        super().__init__()
        self["listen"] = []

    def opt_listen(self, description: str) -> None:
        """
        Endpoint to listen on (repeatable), e.g. tcp:8080:interface=127.0.0.1,
        ssl:8443:privateKey=key.pem:certKey=cert.pem, unix:/run/relay.sock
        (default: tcp:8080:interface=127.0.0.1).
        """
        self["listen"].append(description)

    opt_l = opt_listen

    def postOptions(self) -> None:
        from twisted.internet import reactor
        from twisted.internet.endpoints import serverFromString

        listen = tuple(self["listen"]) or (DEFAULT_LISTEN,)
        for description in listen:
            try:
                serverFromString(reactor, description)
            except (ValueError, TypeError, KeyError) as e:
                raise usage.UsageError("--listen %r is not a valid endpoint: %s" % (description, e))

        upstream = self["upstream"].rstrip("/")
        parts = urlsplit(upstream)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise usage.UsageError(
                "--upstream must be an http:// or https:// URL, not %r." % (self["upstream"],)
            )
        if self["upstream-ids"] not in POLICIES:
            raise usage.UsageError(
                "--upstream-ids must be one of %s, not %r."
                % (", ".join(POLICIES), self["upstream-ids"])
            )
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
        try:
            max_connections = int(self["max-upstream-connections"])
        except ValueError:
            max_connections = 0
        if max_connections < 1:
            raise usage.UsageError("--max-upstream-connections must be a whole number above zero.")

        upstream_key = self["upstream-key"] or os.environ.get("TWISTED_RELAY_UPSTREAM_KEY") or None
        self.config = RelayConfig(
            listen=listen,
            upstream=upstream,
            upstream_key=upstream_key,
            upstream_ids=self["upstream-ids"],
            connect_timeout=_positive("connect-timeout", self["connect-timeout"]),
            response_timeout=_positive("response-timeout", self["response-timeout"]),
            idle_timeout=_positive("idle-timeout", self["idle-timeout"]),
            ping_interval=_positive("ping-interval", self["ping-interval"], allow_zero=True),
            max_body=_size("max-body", self["max-body"]),
            max_upstream_connections=max_connections,
            dump_dir=None if self["no-dumps"] else self["dump-dir"],
            dump_max_bytes=_size("dump-max-bytes", self["dump-max-bytes"]),
            dump_retention_days=_positive("dump-retention-days", self["dump-retention-days"]),
            dump_retention_bytes=_size("dump-retention-bytes", self["dump-retention-bytes"]),
            simulate=simulate,
            simulate_options={
                "seed": seed,
                "reuse_every": reuse_every,
                "event_delay": _positive(
                    "simulate-event-delay", self["simulate-event-delay"], allow_zero=True
                ),
            },
        )


def makeService(options: Options, reactor=None):
    """Make the relay's service from parsed ``twistd relay`` options."""
    from twisted_relay.service import make_service

    return make_service(options.config, reactor)
