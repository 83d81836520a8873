# -*- test-case-name: tests.test_tap,tests.test_command_line -*-
"""
The options of ``twistd relay``: each one's long and short name, default
and help, as ``twisted.python.usage.Options`` takes them (``twistd relay
--help`` shows this table). :mod:`twisted_relay.settings` reads them into a
:class:`~twisted_relay.config.RelayConfig`; a ``--config`` file's ``[relay]``
table gives any of them by its long name.

Pure data: no Twisted, no I/O.
"""

from __future__ import annotations

from twisted_relay.config import DEFAULT_UPSTREAM

__all__ = ["FLAGS", "PARAMETERS"]

#: Options that take a value: long name, short name, default, help (the
#: shape of ``twisted.python.usage.Options.optParameters``).
PARAMETERS = [
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
        "Run the embedded simulated upstream in this mode (strict, stateful or lenient), or a "
        "simulated cloud (bedrock, vertex or foundry: its wire and login), and relay to it: "
        "no key and no network needed.",
    ],
    ["total-timeout", None, "0", "Seconds a request may take end to end, stream included (0: no limit)."],
    ["request-read-timeout", None, "120", "Seconds a client may take to send a whole request (0: no limit)."],
    [
        "relay-keys",
        None,
        None,
        "File of keys clients must present (one a line, # comments); a relay key is never sent upstream.",
    ],
    [
        "admin-keys",
        None,
        None,
        "File of admin keys (the --relay-keys format) that open /admin/usage and the spend-limit endpoints; "
        "never accepted on /v1/messages.",
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
    [
        "thinking-binding-recovery",
        None,
        "drop_block",
        "After an upstream's 400 saying a thinking block is bound to a different conversation (before any "
        "byte reached the client): drop_block sends the request once more with "
        "thinking.block_binding.prefix_mismatch_behavior drop_block and its beta; off passes the 400 on.",
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
        "simulate-api", None, "2026-12",
        "The API the simulated upstream speaks: 2026-12 (today's, see docs/simulated.md) or 2025 (the year-old one).",
    ],
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
    ["simulate-threads", None, "ignore", "How the simulated upstream treats message threads: ignore, rejects or knows."],
    [
        "usage-db",
        None,
        None,
        "The usage ledger, one row a relayed request: an SQLite file (usage.sqlite) or "
        "postgresql://user@host/db, shared by several relays (pip install 'twisted-relay[postgres]'). "
        "Default: no ledger.",
    ],
    ["usage-flush-interval", None, "1", "Seconds between two writes of the ledger (what a killed relay may lose)."],
    ["usage-retention-days", None, "400", "Delete ledger rows older than this many days (0: keep them all)."],
    ["usage-max-queue", None, "50000", "Ledger rows held in memory at most while its database is down."],
    ["spend-refresh-interval", None, "5", "Seconds between two reads of spend limits and spend from the ledger (and renewals of cap shares)."],
]

#: Options that are on or off: long name, short name, help (the shape of
#: ``twisted.python.usage.Options.optFlags``); all are off by default.
FLAGS = [
    ["no-dumps", None, "Write no diagnostic dumps."],
    ["no-metrics", None, "Serve no Prometheus metrics at /metrics."],
    [
        "no-gc-tuning",
        None,
        "Leave Python's garbage collector as it is (by default the relay freezes what exists "
        "at start, and runs full collections when the heap has doubled, not Python's).",
    ],
    [
        "simulate-idp",
        None,
        "Sign people in with an embedded simulated identity provider, served at /_idp "
        "(users alice@example.com and bob@example.com; carol@example.com is refused), for a "
        "keyless demo of claude auth login: no [signin] table, one process, a tcp: --listen on a fixed port.",
    ],
    [
        "forward-attribution",
        None,
        "Send Claude Code's attribution headers (x-app, x-claude-code-*) upstream too "
        "(by default they are only logged and dumped).",
    ],
]
