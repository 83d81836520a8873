# -*- test-case-name: tests.test_replay -*-
"""
``twisted-relay-replay``: read a diagnostic dump back, check it against the
current translation code, or send its request again.

- ``twisted-relay-replay DUMP`` prints the summary, timeline and translation
  table.
- ``--check`` translates the dumped client request again with the current
  code and names every difference from the dumped upstream request and
  table (exit 1), or says they are identical (exit 0).
- ``--send URL`` posts the dumped upstream-bound request to ``URL`` and
  shows the answer (exit 0 below 400, 1 from 400 up).

Exit status 2 means the dump could not be used (unreadable, truncated) or
the request could not be sent.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
from typing import IO, Any, Iterator
from urllib.parse import urlsplit

from twisted_relay._version import __version__
from twisted_relay.dumps import load_dump
from twisted_relay.redact import REDACTED, is_sensitive_header, redact_text
from twisted_relay.translation import TranslationTable, UpstreamRules, translate_request

__all__ = ["main", "differences"]

#: Largest answer ``--send`` reads.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
# Headers that describe one connection or one encoding of the body, not the
# request: http.client sets its own, and a gzip answer would be unreadable.
_NOT_REPLAYED = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "accept-encoding",
    }
)


def main(argv: list[str] | None = None, stdout: IO[str] | None = None,
         stderr: IO[str] | None = None) -> int:
    """
    Run the command line; returns the exit status.

    :param argv: the arguments, without the program name; ``sys.argv[1:]``
        when ``None``.
    """
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    options = _parser().parse_args(argv)
    try:
        dump = load_dump(options.dump)
    except (OSError, ValueError) as e:
        print(f"twisted-relay-replay: cannot read {options.dump}: {e}", file=err)
        return 2
    missing = _not_a_dump(dump)
    if missing is not None:
        print(f"twisted-relay-replay: {options.dump} is not a relay dump: {missing}", file=err)
        return 2
    if options.send:
        key = options.api_key or os.environ.get("ANTHROPIC_API_KEY")
        return _send(dump, options.send, key, options.timeout, out, err)
    _print_summary(options.dump, dump, out)
    if options.check:
        return _check(dump, out, err)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="twisted-relay-replay",
        description="Read, check or resend a twisted-relay diagnostic dump.",
    )
    parser.add_argument("dump", metavar="DUMP", help="a dump file (.json)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="translate the dumped client request with the current code and compare",
    )
    parser.add_argument(
        "--send",
        metavar="URL",
        help="POST the dumped upstream-bound request to URL (its path and query are appended)",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="x-api-key to send with --send (default: $ANTHROPIC_API_KEY)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="with --send, give up after this many seconds without data (default 120)",
    )
    return parser


# -- reading -------------------------------------------------------------------


def _print_summary(path: str, dump: dict, out: IO[str]) -> None:
    error = dump.get("error") or {}
    status = str(dump.get("status"))
    if error:
        status += f" {error.get('type')}: {error.get('message')}"
    rows = [
        ("dump", path),
        ("time", dump.get("time")),
        ("status", status),
        ("relay request", dump.get("relay_request_id")),
        ("upstream request", dump.get("upstream_request_id")),
        ("session", dump.get("session_id")),
        ("upstream url", dump.get("upstream_url")),
        ("policy", dump.get("policy")),
        ("written by", f"twisted-relay {dump.get('relay_version')} (dump format {dump.get('format')})"),
    ]
    if dump.get("truncated"):
        rows.append(("truncated", "yes: the bodies were cut out, only metadata remains"))
    if dump.get("stream_error"):
        rows.append(("stream error", json.dumps(dump["stream_error"], ensure_ascii=False)))
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label.ljust(width)}  {value}", file=out)
    timeline = dump.get("timeline") or []
    print(f"\ntimeline ({len(timeline)} messages):", file=out)
    for line in timeline:
        print(f"  {line}", file=out)
    print("\ntranslation table:", file=out)
    try:
        text = TranslationTable.from_dict(dump.get("translation_table")).format()
    except ValueError as e:
        text = f"(not readable by this version: {e})\n" + json.dumps(
            dump.get("translation_table"), indent=2, ensure_ascii=False
        ) + "\n"
    for line in text.splitlines():
        print(f"  {line}", file=out)


# What every dump holds, whatever its bodies.
_DUMP_SECTIONS = ("client_request", "upstream_request", "response")


def _not_a_dump(dump) -> str | None:
    """Why a parsed JSON file is not a dump the relay wrote, or ``None`` when it is one."""
    if not isinstance(dump, dict):
        return "it is not a JSON object"
    if not isinstance(dump.get("format"), int):
        return "it has no format number"
    if not isinstance(dump.get("relay_request_id"), str):
        return "it has no relay_request_id"
    for section in _DUMP_SECTIONS:
        if not isinstance(dump.get(section), dict):
            return f"it has no {section} section"
    return None


# -- checking ------------------------------------------------------------------


def _check(dump: dict, out: IO[str], err: IO[str]) -> int:
    if dump.get("truncated"):
        print("\ncannot check: the dump's bodies were truncated", file=err)
        return 2
    client_body = (dump.get("client_request") or {}).get("body")
    if not isinstance(client_body, dict):
        print("\ncannot check: the dumped client body is not a JSON object", file=err)
        return 2
    try:
        # the upstream's rules when the dump holds them, else its policy's defaults
        table = dump.get("translation_table")
        rules = table.get("rules") if isinstance(table, dict) else None
        translation = translate_request(
            client_body, dump.get("policy") if rules is None else UpstreamRules.from_dict(rules)
        )
    except ValueError as e:
        print(f"\ncannot check: {e}", file=err)
        return 2
    found = list(
        differences(
            "upstream_request.body",
            (dump.get("upstream_request") or {}).get("body"),
            translation.upstream_body,
        )
    )
    found += _table_differences(dump.get("translation_table"), translation.table)
    print(f"\ncheck against twisted-relay {__version__}:", file=out)
    if not found:
        print("  identical: the upstream-bound body and the translation table match", file=out)
        return 0
    for line in found:
        print(f"  {line}", file=out)
    print(f"  {len(found)} difference(s)", file=out)
    return 1


def _table_differences(dumped: Any, table: TranslationTable) -> list[str]:
    try:
        if TranslationTable.from_dict(dumped) == table:
            return []
    except ValueError as e:
        return [f"translation_table: the dumped table is not readable ({e})"]
    return list(differences("translation_table", dumped, table.to_dict())) or [
        "translation_table: differs"
    ]


def differences(path: str, dumped: Any, now: Any) -> Iterator[str]:
    """
    Each place where two JSON values differ, as ``path: dumped X, now Y``
    lines, ``path`` in ``a.b[3].c`` form.
    """
    if isinstance(dumped, dict) and isinstance(now, dict):
        for key in dumped:
            if key not in now:
                yield f"{path}.{key}: only in the dump ({_short(dumped[key])})"
            else:
                yield from differences(f"{path}.{key}", dumped[key], now[key])
        for key in now:
            if key not in dumped:
                yield f"{path}.{key}: only now ({_short(now[key])})"
    elif isinstance(dumped, list) and isinstance(now, list):
        if len(dumped) != len(now):
            yield f"{path}: dumped {len(dumped)} items, now {len(now)}"
        for i, (a, b) in enumerate(zip(dumped, now)):
            yield from differences(f"{path}[{i}]", a, b)
    elif dumped != now or type(dumped) is not type(now):
        yield f"{path}: dumped {_short(dumped)}, now {_short(now)}"


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- sending -------------------------------------------------------------------


def _send(dump: dict, base_url: str, key: str | None, timeout: float,
          out: IO[str], err: IO[str]) -> int:
    if dump.get("truncated"):
        print("cannot send: the dump's bodies were truncated", file=err)
        return 2
    sent = dump.get("upstream_request") or {}
    body = sent.get("body")
    data = (body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)).encode("utf-8")
    dumped = urlsplit(dump.get("upstream_url") or "/v1/messages")
    base = urlsplit(base_url)
    if base.scheme not in ("http", "https") or not base.hostname:
        print(f"cannot send: {base_url} is not an http(s) URL", file=err)
        return 2
    path = base.path.rstrip("/") + (dumped.path or "/") + (f"?{dumped.query}" if dumped.query else "")
    headers = _replayed_headers(sent.get("headers") or [])
    if key:
        headers["x-api-key"] = key
    secrets = [key] if key else []
    print(f"POST {base.scheme}://{base.netloc}{path} ({len(data)} bytes)", file=out)
    if REDACTED in path:
        print(f"  note: the dumped URL holds {REDACTED} values", file=out)
    connection_class = (
        http.client.HTTPSConnection if base.scheme == "https" else http.client.HTTPConnection
    )
    connection = connection_class(base.hostname, base.port, timeout=timeout)
    try:
        connection.request("POST", path, body=data, headers=headers)
        response = connection.getresponse()
        answer = response.read(MAX_ANSWER_BYTES)
    except (OSError, http.client.HTTPException) as e:
        print(f"cannot send: {type(e).__name__}: {e}", file=err)
        return 2
    finally:
        connection.close()
    print(f"status: {response.status} {response.reason}", file=out)
    for name in ("request-id", "content-type"):
        if response.getheader(name):
            print(f"{name}: {response.getheader(name)}", file=out)
    print(redact_text(_readable(answer), secrets), file=out)
    return 0 if response.status < 400 else 1


def _replayed_headers(lines: list[str]) -> dict[str, str]:
    headers = {}
    for line in lines:
        name, _, value = line.partition(": ")
        if (
            name.lower() in _NOT_REPLAYED
            or is_sensitive_header(name)
            or REDACTED in value
        ):
            continue
        name = name.lower()
        # Repeated request headers mean the same as one comma-joined header.
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    headers.setdefault("content-type", "application/json")
    return headers


def _readable(answer: bytes) -> str:
    text = answer.decode("utf-8", "replace")
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


if __name__ == "__main__":
    sys.exit(main())
