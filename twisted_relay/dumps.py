# -*- test-case-name: tests.test_dumps -*-
"""
Diagnostic dumps of the upstream's 4xx answers.

When the upstream refuses a request, :class:`DumpWriter` writes one
write-once JSON file holding everything needed to understand the refusal
from cold: the answer, the request as the client sent it and as the relay
sent it upstream, a one-line-per-message timeline and the translation
table. ``docs/dumps.md`` describes the file; ``twisted-relay-replay``
reads it back.

All the file work happens on the writer's own small thread pool; the
reactor thread only hands over plain values.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from twisted_relay._version import __version__
from twisted_relay.redact import header_secrets, redact_headers, redact_text, redact_url

__all__ = [
    "FORMAT_VERSION",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_MAX_QUEUE_BYTES",
    "DEFAULT_MAX_DUMP_BYTES",
    "DEFAULT_RETENTION_DAYS",
    "DEFAULT_RETENTION_BYTES",
    "RETENTION_INTERVAL",
    "DumpRequest",
    "DumpWriter",
    "RetentionResult",
    "apply_retention",
    "build_dump",
    "build_timeline",
    "load_dump",
    "render_dump",
    "write_once",
]

MiB = 1024 * 1024
GiB = 1024 * MiB

#: Version of the dump file's layout; bumped on any incompatible change.
FORMAT_VERSION = 1
#: Dumps queued or being written at most; more are dropped and counted.
DEFAULT_MAX_QUEUE = 64
#: Request and answer bytes held by queued dumps at most (a lone dump is
#: always accepted, however large).
DEFAULT_MAX_QUEUE_BYTES = 256 * MiB
#: A dump larger than this is written with its bodies cut out.
DEFAULT_MAX_DUMP_BYTES = 64 * MiB
#: Dumps older than this many days are deleted.
DEFAULT_RETENTION_DAYS = 30
#: The oldest dumps are deleted while all of them together are larger.
DEFAULT_RETENTION_BYTES = 1 * GiB
#: Seconds between two retention passes, at most one per interval.
RETENTION_INTERVAL = 60.0

# A temporary file older than this was left by a crash mid-write.
_STALE_TEMP_SECONDS = 3600.0
_MAX_NAME_ATTEMPTS = 10_000
_DATE_FOLDER = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_DUMP_FILE = re.compile(r"^(\d{6}\.\d{6})-.+\.json$")
_TEMP_FILE = re.compile(r"^\..+\.tmp$")
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")
# The top-level error summary is for reading and grepping; the whole message
# is in the answer's body.
_SUMMARY_MESSAGE_CHARS = 2000


@dataclass(frozen=True, slots=True)
class DumpRequest:
    """
    What the relay hands over for one dump: plain values only, so that it
    can cross to the writer's thread. A new field of the dump file is a
    field here, filled where the relay makes it
    (:meth:`twisted_relay.answer.Exchange.dump`) and written by
    :func:`build_dump`.
    """

    relay_request_id: str
    upstream_request_id: str | None
    received_at: float
    upstream_url: str
    status: int
    response_headers: list
    response_body: bytes
    client_headers: list
    client_body: bytes
    upstream_headers: list
    upstream_body: bytes
    table: Any
    policy: str
    stream_error: dict | None = None
    session_id: str | None = None
    upstream: str | None = None
    upstream_model: str | None = None
    attempts: tuple = ()
    attribution: dict | None = None
    #: The relay key the client presented, by name (``{"name", "group"}``), never the key.
    relay_key: dict | None = None
    #: What the relay did about this answer, when it did something (e.g.
    #: sent the request again with invalid thinking blocks dropped).
    note: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "attempts", tuple(self.attempts))

    def held_bytes(self) -> int:
        """The bytes this request keeps in memory while it waits."""
        return sum(
            len(b or b"") for b in (self.response_body, self.client_body, self.upstream_body)
        )

    def secrets(self) -> list[str]:
        """Credentials seen in this exchange's own headers."""
        return header_secrets(
            list(self.client_headers) + list(self.upstream_headers) + list(self.response_headers)
        )


@dataclass(frozen=True, slots=True)
class RetentionResult:
    """What one retention pass did."""

    removed: int
    removed_bytes: int
    kept: int
    kept_bytes: int


@dataclass(frozen=True, slots=True)
class _Written:
    path: str
    size: int
    truncated: bool


# -- the file's content ----------------------------------------------------


def build_dump(request: DumpRequest, settings: dict) -> dict:
    """
    The dump of one refused request, as a JSON-ready dict whose key order is
    the reading order: what happened first, bodies last. Secrets are not
    removed here but by :func:`render_dump`.
    """
    client_body = _parse_body(request.client_body)
    upstream_body = _parse_body(request.upstream_body)
    response_body = _parse_body(request.response_body)
    when = datetime.fromtimestamp(request.received_at, timezone.utc)
    return {
        "format": FORMAT_VERSION,
        "truncated": False,
        "time": when.isoformat(timespec="microseconds").replace("+00:00", "Z"),
        "received_at": request.received_at,
        "relay_request_id": request.relay_request_id,
        "upstream_request_id": request.upstream_request_id,
        "session_id": request.session_id,
        "attribution": request.attribution,
        "relay_key": request.relay_key,
        "status": request.status,
        "error": _error_summary(response_body, request.stream_error),
        "upstream_url": redact_url(request.upstream_url),
        "upstream": request.upstream,
        "upstream_model": request.upstream_model,
        "attempts": list(request.attempts),
        "note": request.note,
        "policy": request.policy,
        "relay_version": __version__,
        "timeline": build_timeline(client_body, upstream_body),
        "translation_table": request.table,
        "stream_error": request.stream_error,
        "settings": settings,
        "response": _section(request.response_headers, request.response_body, response_body),
        "client_request": _section(request.client_headers, request.client_body, client_body),
        "upstream_request": _section(
            request.upstream_headers, request.upstream_body, upstream_body
        ),
    }


def render_dump(dump: dict, secrets: list[str] | tuple[str, ...], max_bytes: int) -> bytes:
    """
    Serialise a dump, redacted, in at most ``max_bytes`` if cutting bodies
    can achieve it: the request bodies go first, then the answer's, each
    replaced by ``{"truncated": true, "original_bytes": N}``, and the
    top-level ``truncated`` becomes true. Metadata, timeline and table are
    always kept, even when they alone are over the limit.

    Redaction runs on the final text, so no secret survives in any field.
    """
    data = _serialise(dump, secrets)
    for sections in (("client_request", "upstream_request"), ("response",)):
        if len(data) <= max_bytes:
            break
        dump["truncated"] = True
        for name in sections:
            dump[name]["body"] = {"truncated": True, "original_bytes": dump[name]["bytes"]}
        data = _serialise(dump, secrets)
    return data


def build_timeline(client_body: Any, upstream_body: Any = None) -> list[str]:
    """
    One line per message of the client's request: its index (0-based, as in
    the upstream's ``messages.N`` error paths), role, and each block's type
    and id fields, e.g. ``"47 assistant: text | tool_use id=toolu_x-2"``.
    Where the upstream-bound request carries another id in the same place,
    the line shows both: ``id=toolu_x-2 (upstream toolu_x)``.
    """
    messages = _messages(client_body)
    upstream = _messages(upstream_body)
    lines = []
    for index, message in enumerate(messages):
        sent = upstream[index] if index < len(upstream) else None
        lines.append(_timeline_line(index, message, sent))
    return lines


def _messages(body: Any) -> list:
    if isinstance(body, dict) and isinstance(body.get("messages"), list):
        return body["messages"]
    return []


def _timeline_line(index: int, message: Any, sent: Any) -> str:
    if not isinstance(message, dict):
        return f"{index} ?: {type(message).__name__}"
    content = message.get("content")
    if isinstance(content, str):
        blocks = "(string)"
    elif isinstance(content, list):
        sent_content = sent.get("content") if isinstance(sent, dict) else None
        if not isinstance(sent_content, list):
            sent_content = []
        blocks = " | ".join(
            _block_text(block, sent_content[i] if i < len(sent_content) else None)
            for i, block in enumerate(content)
        ) or "(empty)"
    else:
        blocks = "(no content)"
    return f"{index} {message.get('role', '?')}: {blocks}"


def _block_text(block: Any, sent: Any) -> str:
    if not isinstance(block, dict):
        return "?"
    parts = [str(block.get("type", "?"))]
    for label, value, sent_value in _block_ids(block, sent):
        text = f"{label}={value}"
        if sent_value is not None and sent_value != value:
            text += f" (upstream {sent_value})"
        parts.append(text)
    return " ".join(parts)


def _block_ids(block: dict, sent: Any):
    sent = sent if isinstance(sent, dict) else {}
    for field in ("id", "tool_use_id"):
        if field in block:
            yield field, block[field], sent.get(field)
    caller = block.get("caller")
    if isinstance(caller, dict) and "tool_id" in caller:
        sent_caller = sent.get("caller")
        yield (
            "caller",
            caller["tool_id"],
            sent_caller.get("tool_id") if isinstance(sent_caller, dict) else None,
        )


def _parse_body(raw: bytes) -> Any:
    """The body as JSON when it is JSON, else as text."""
    raw = raw or b""
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def _section(headers: list, raw: bytes, parsed: Any) -> dict:
    return {
        "headers": [f"{name}: {value}" for name, value in redact_headers(headers)],
        "bytes": len(raw or b""),
        "body": parsed,
    }


def _error_summary(response_body: Any, stream_error: dict | None) -> dict | None:
    for source in (stream_error, response_body):
        error = source.get("error") if isinstance(source, dict) else None
        if isinstance(error, dict):
            message = error.get("message")
            if isinstance(message, str) and len(message) > _SUMMARY_MESSAGE_CHARS:
                message = message[:_SUMMARY_MESSAGE_CHARS] + "..."
            return {"type": error.get("type"), "message": message}
    return None


def _serialise(dump: dict, secrets) -> bytes:
    text = json.dumps(dump, indent=2, ensure_ascii=False, default=repr) + "\n"
    # A lone surrogate (legal in JSON input) cannot be UTF-8; its backslash
    # form is the very JSON escape it came from.
    return redact_text(text, secrets).encode("utf-8", "backslashreplace")


def load_dump(path: str) -> dict:
    """Read a dump file back."""
    with open(path, "rb") as f:
        return json.load(f)


# -- files -------------------------------------------------------------------


def write_once(dump_dir: str, received_at: float, relay_request_id: str, data: bytes) -> str:
    """
    Write ``data`` as a new file ``<dump_dir>/YYYY-MM-DD/HHMMSS.ffffff-<id>.json``
    (UTC) and return its path. The file appears whole or not at all and never
    replaces another: it is written to a temporary file (``O_EXCL``, 0600),
    synced, then hard-linked to its name, which fails rather than overwrite;
    a taken name gets a ``-2`` (``-3``, ...) suffix. Folders are made 0700.
    """
    when = datetime.fromtimestamp(received_at, timezone.utc)
    folder = os.path.join(dump_dir, when.strftime("%Y-%m-%d"))
    stem = when.strftime("%H%M%S.%f") + "-" + (_UNSAFE_NAME.sub("_", relay_request_id)[:100] or "unknown")
    os.makedirs(dump_dir, mode=0o700, exist_ok=True)
    try:
        os.mkdir(folder, mode=0o700)
    except FileExistsError:
        pass
    # mkstemp opens with O_CREAT | O_EXCL and mode 0600.
    fd, temp = tempfile.mkstemp(prefix="." + stem + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        path = _link_to_free_name(temp, folder, stem)
    finally:
        os.unlink(temp)
    _fsync_folder(folder)
    return path


def _link_to_free_name(temp: str, folder: str, stem: str) -> str:
    for attempt in range(1, _MAX_NAME_ATTEMPTS + 1):
        suffix = "" if attempt == 1 else f"-{attempt}"
        path = os.path.join(folder, f"{stem}{suffix}.json")
        try:
            os.link(temp, path)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free name for {stem} in {folder}")


def _fsync_folder(folder: str) -> None:
    # Makes the new name itself durable; some file systems refuse, harmlessly.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def apply_retention(
    dump_dir: str, now: float, max_age_seconds: float, max_total_bytes: int
) -> RetentionResult:
    """
    Delete dump files older than ``max_age_seconds`` (by the time in their
    folder and file name), then the oldest until all together hold at most
    ``max_total_bytes``; remove temporary files a crash left behind and date
    folders left empty. Files this module did not name are never touched.
    """
    if not os.path.isdir(dump_dir):
        return RetentionResult(0, 0, 0, 0)
    dumps = []
    folders = []
    for folder in os.scandir(dump_dir):
        if not (_DATE_FOLDER.match(folder.name) and folder.is_dir(follow_symlinks=False)):
            continue
        folders.append(folder.path)
        for entry in os.scandir(folder.path):
            dumped_at = _dump_time(folder.name, entry.name)
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                stat = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if dumped_at is not None:
                dumps.append((dumped_at, entry.name, entry.path, stat.st_size))
            elif _TEMP_FILE.match(entry.name) and now - stat.st_mtime > _STALE_TEMP_SECONDS:
                _remove(entry.path)
    dumps.sort()
    total = sum(size for *_, size in dumps)
    removed = removed_bytes = 0
    for dumped_at, _, path, size in dumps:
        if now - dumped_at <= max_age_seconds and total <= max_total_bytes:
            break  # the rest are younger, and the total only shrinks
        _remove(path)
        total -= size
        removed += 1
        removed_bytes += size
    for folder_path in folders:
        try:
            os.rmdir(folder_path)
        except OSError:
            pass  # not empty
    return RetentionResult(removed, removed_bytes, len(dumps) - removed, total)


def _dump_time(folder_name: str, file_name: str) -> float | None:
    match = _DUMP_FILE.match(file_name)
    if not match:
        return None
    try:
        when = datetime.strptime(folder_name + match.group(1), "%Y-%m-%d%H%M%S.%f")
    except ValueError:
        return None
    return when.replace(tzinfo=timezone.utc).timestamp()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# -- the service ---------------------------------------------------------------


class DumpWriter(Service):
    """
    Writes dumps of refused requests off the reactor thread, a bounded
    number at a time.

    :ivar written: dumps written.
    :ivar dropped: dumps refused because the queue was full or the writer
        was not running.
    :ivar failed: dumps that could not be written (unwritable folder, full
        disk, ...); each is logged.
    """

    log = Logger()

    def __init__(
        self,
        dump_dir: str,
        *,
        reactor,
        secrets=(),
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
        max_dump_bytes: int = DEFAULT_MAX_DUMP_BYTES,
        retention_days: float = DEFAULT_RETENTION_DAYS,
        retention_bytes: int = DEFAULT_RETENTION_BYTES,
        settings: dict,
    ):
        """
        :param dump_dir: the folder dumps go to, made 0700 if missing.
        :param reactor: the reactor; its clock paces retention.
        :param secrets: keys to remove from every dump (the upstream key,
            relay keys), besides those seen in each request's headers.
        :param max_queue: dumps queued or being written at most.
        :param max_queue_bytes: body bytes held by queued dumps at most.
        :param max_dump_bytes: size past which a dump's bodies are cut out.
        :param retention_days: age past which dumps are deleted.
        :param retention_bytes: total past which the oldest are deleted.
        :param settings: the relay's version and settings that matter,
            copied into every dump.
        """
        self.dump_dir = dump_dir
        self._reactor = reactor
        self._secrets = tuple(s for s in secrets if s)
        self._max_queue = max_queue
        self._max_queue_bytes = max_queue_bytes
        self._max_dump_bytes = max_dump_bytes
        self._max_age = retention_days * 86400.0
        self._retention_bytes = retention_bytes
        self._settings = dict(settings)
        self._pool: ThreadPool | None = None
        self._in_flight: set[Deferred] = set()
        self._pending = 0
        self._queued_bytes = 0
        self._last_retention: float | None = None
        self._retaining = False
        self.written = 0
        self.dropped = 0
        self.failed = 0

    @property
    def pending(self) -> int:
        """Dumps queued or being written right now."""
        return self._pending

    def startService(self) -> None:
        """Start the thread pool and a first retention pass."""
        Service.startService(self)
        self._pool = ThreadPool(0, 1, name="twisted-relay-dumps")
        self._pool.start()
        self.log.info("Writing dumps of refused requests to {dump_dir}", dump_dir=self.dump_dir)
        self._retain_soon()

    def stopService(self) -> Deferred:
        """Refuse new dumps, finish the queued ones, then stop the pool."""
        Service.stopService(self)
        pool = self._pool
        d = self.drain()
        if pool is not None:
            d.addCallback(lambda _: pool.stop())
        return d

    def drain(self) -> "Deferred[None]":
        """A Deferred that fires once every dump queued so far is settled."""
        d = DeferredList(list(self._in_flight), consumeErrors=True)
        d.addCallback(lambda _: None)
        return d

    def add_secrets(self, secrets) -> None:
        """Remove these keys from every dump too (a reloaded configuration's)."""
        self._secrets = tuple(dict.fromkeys(self._secrets + tuple(s for s in secrets if s)))

    def submit(self, request: DumpRequest) -> "Deferred[str | None]":
        """
        Queue the dump of one refused request and return at once; call it on
        the reactor thread. It never raises: the returned Deferred fires with
        the file's path, or ``None`` when the dump was dropped or failed, and
        never errs.
        """
        try:
            return self._queue(request)
        except Exception:
            self.log.failure("Could not queue the dump of {relay_request_id}", relay_request_id=request.relay_request_id)
            return succeed(None)

    def _queue(self, request: DumpRequest) -> "Deferred[str | None]":
        if not self.running:
            return self._drop(request, "the dump writer is not running")
        size = request.held_bytes()
        if self._pending >= self._max_queue:
            return self._drop(request, "{} dumps are already waiting".format(self._pending))
        if self._pending and self._queued_bytes + size > self._max_queue_bytes:
            return self._drop(request, "waiting dumps already hold {} bytes".format(self._queued_bytes))
        self._pending += 1
        self._queued_bytes += size
        d = deferToThreadPool(self._reactor, self._pool, self._write_dump, request)
        d.addCallbacks(
            self._written, self._failed, callbackArgs=(request,), errbackArgs=(request,)
        )
        d.addBoth(self._settled, size)
        return self._track(d)

    def _drop(self, request: DumpRequest, why: str) -> "Deferred[None]":
        self.dropped += 1
        self.log.warn(
            "Dropped the dump of {relay_request_id} (status {status}): {why}",
            relay_request_id=request.relay_request_id,
            status=request.status,
            why=why,
            dropped=self.dropped,
        )
        return succeed(None)

    def _write_dump(self, request: DumpRequest) -> _Written:
        """Build, redact and write one dump; runs on the writer's thread."""
        dump = build_dump(request, self._settings)
        data = render_dump(dump, self._secrets + tuple(request.secrets()), self._max_dump_bytes)
        path = write_once(self.dump_dir, request.received_at, request.relay_request_id, data)
        return _Written(path, len(data), dump["truncated"])

    def _written(self, result: _Written, request: DumpRequest) -> str:
        self.written += 1
        self.log.info(
            "Dumped {relay_request_id} (status {status}) to {path}",
            relay_request_id=request.relay_request_id,
            status=request.status,
            path=result.path,
            size=result.size,
            truncated=result.truncated,
        )
        if result.truncated:
            self.log.warn(
                "The dump {path} was over {max_dump_bytes} bytes: its bodies were cut out",
                path=result.path,
                max_dump_bytes=self._max_dump_bytes,
            )
        return result.path

    def _failed(self, failure: Failure, request: DumpRequest) -> None:
        self.failed += 1
        if failure.check(OSError):
            # An unwritable folder or a full disk: the operator's to fix, not a bug.
            self.log.error(
                "Could not write the dump of {relay_request_id} to {dump_dir}: {error}",
                relay_request_id=request.relay_request_id,
                dump_dir=self.dump_dir,
                error=failure.getErrorMessage(),
            )
        else:
            self.log.failure(
                "Could not build the dump of {relay_request_id}",
                failure,
                relay_request_id=request.relay_request_id,
            )
        return None

    def _settled(self, result, size: int):
        self._pending -= 1
        self._queued_bytes -= size
        self._retain_soon()
        return result

    def _track(self, d: Deferred) -> Deferred:
        """Keep ``d`` until it fires, for :meth:`drain`; hand out a twin."""
        self._in_flight.add(d)
        twin: Deferred = Deferred()

        def settled(result):
            self._in_flight.discard(d)
            twin.callback(result)
            return result

        d.addBoth(settled)
        return twin

    def _retain_soon(self) -> None:
        """Run a retention pass unless one ran less than a minute ago."""
        now = self._reactor.seconds()
        if self._retaining or not self.running or self._pool is None:
            return
        if self._last_retention is not None and now - self._last_retention < RETENTION_INTERVAL:
            return
        self._retaining = True
        self._last_retention = now
        d = deferToThreadPool(
            self._reactor,
            self._pool,
            apply_retention,
            self.dump_dir,
            now,
            self._max_age,
            self._retention_bytes,
        )
        d.addCallbacks(self._retained, self._retention_failed)
        d.addBoth(self._retention_settled)
        self._track(d)

    def _retained(self, result: RetentionResult) -> None:
        if result.removed:
            self.log.info(
                "Retention removed {removed} dumps ({removed_bytes} bytes); "
                "{kept} dumps ({kept_bytes} bytes) are kept",
                removed=result.removed,
                removed_bytes=result.removed_bytes,
                kept=result.kept,
                kept_bytes=result.kept_bytes,
            )

    def _retention_failed(self, failure: Failure) -> None:
        if failure.check(OSError):
            self.log.error(
                "Could not apply retention to {dump_dir}: {error}",
                dump_dir=self.dump_dir,
                error=failure.getErrorMessage(),
            )
        else:
            self.log.failure("Retention of {dump_dir} failed", failure, dump_dir=self.dump_dir)

    def _retention_settled(self, result) -> None:
        self._retaining = False
