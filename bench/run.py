# -*- test-case-name: bench.test_harness -*-
"""
Run every benchmark scenario against every target in one run, and print the
figures, their ratios, and the relay's targets met or not.

Scenarios (see ``docs/benchmarks.md``):

- S1: paced streams (50 deltas, 20 ms apart; `--s1-events`) at 200 and 1,000 concurrent
  streams: latency added per event over direct, and the target's CPU per
  event; then the largest count held with zero errors, searched upwards.
- S2: unpaced streams (32 at once of 2,000 deltas), read by curl (C, so that
  the reader is not the bottleneck): throughput, CPU seconds per MB.
- S3: non-streaming small requests, 32 concurrent keep-alive clients: req/s.
- S4: memory per idle open stream.
- S5: inbound translation cost against history size, in process; and large
  request bodies (to 32 MiB) end to end.
- flood: 100 paced streams (20 events, 50 ms apart) while ten 32 MB bodies of
  tiny messages arrive at once (issue 22): the streams' worst gap between two
  events and worst wait for a first event, the bodies' answers, the target's
  peak memory (``bench/flood.py``); on fresh processes, after the rest.

The headline, printed first: CPU per paced event (S1), CPU-seconds per MB
(S2), latency added per event at 200 and 1,000 paced streams (S1).

Targets: direct, nginx, plain ``twisted.web.proxy``, aiohttp (a plain asyncio
proxy on uvloop, from its own virtual environment), the relay, the relay with
``--workers 2`` (``relay2``, on request), the relay with a ``--config`` of two
upstreams and two routes, routing to the first (``relay-routed``, on request), the relay with a ``--config`` of
one upstream on the ``bedrock`` wire (``relay-bedrock``, on request: the fake
upstream answers Bedrock's InvokeModel routes in event-stream frames, every
request signed), the relay with one upstream on the ``openai-responses``
wire (``relay-responses``, on request: the fake upstream answers
``/v1/responses`` with Responses stream events), LiteLLM. With ``relay-bedrock``
beside ``relay``, issue 32's
goals are judged on the same run: CPU per paced event through the Bedrock wire
at most 1.3x the Anthropic wire's, and SigV4 signing (measured in process at the
end, by body size) at most 0.1 ms a request. With ``relay-responses`` beside
``relay``, issue 33's: CPU per paced event through the Responses wire at most
1.5x the Anthropic wire's.
The kernel places the processes; ``--pin`` gives the targets CPU 1 and the
fake upstream and the load generator CPU 0 (which then saturates first, at
about 1,000 paced streams).

Usage, from the work tree's root::

    python bench/run.py --quick          # small counts, a few minutes
    python bench/run.py                  # the full run
    python bench/run.py --targets direct,relay --scenarios S1,S3
    python bench/run.py --relay-tree before=/path/to/tree   # the relay before a change, judged against
    python bench/run.py --targets direct,nginx,plain,aiohttp,relay,relay2,litellm  # relay2: --workers 2
    python bench/run.py --targets relay,relay-routed --scenarios S1,S2  # a config of two upstreams beside one
    python bench/run.py --targets relay,relay-ledger --scenarios S2,S3  # the usage ledger on, beside off
    python bench/run.py --targets relay,relay-bedrock --scenarios S1,S2,S3 --s1-search ""  # Bedrock's wire beside Anthropic's
    python bench/run.py --targets relay,relay-bedrock --bedrock-tree bedrock-before=/path/to/tree --scenarios S1
    python bench/run.py --targets relay,relay-responses --scenarios S1 --s1-counts 200 --s1-search ""  # issue 33
    python bench/run.py --targets relay-ledger --ledger-tree ledger-before=/path/to/tree --scenarios S3
    python bench/run.py --targets direct,relay --relay-tree before=/path/to/tree --scenarios flood

It is not a test and is not run by CI.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

import targets as _targets  # noqa: E402

__all__ = ["Settings", "main", "run_all"]

MiB = 1024 * 1024
_LITELLM_VENV = os.environ.get("BENCH_LITELLM", os.path.join(tempfile.gettempdir(), "litellm-venv", "bin", "litellm"))
_AIOHTTP_PYTHON = os.environ.get(
    "BENCH_AIOHTTP", os.path.join(tempfile.gettempdir(), "aiohttp-venv", "bin", "python")
)


@dataclass(frozen=True)
class Settings:
    """The counts of one run."""

    s1_counts: tuple[int, ...] = (200, 1000)
    s1_rounds: int = 2
    s1_events: int = 50
    s1_interval_ms: int = 20
    s1_search: tuple[int, ...] = (2000, 3000, 4000)
    s2_streams: int = 32
    s2_events: int = 2000
    s2_rounds: int = 10
    s3_concurrency: int = 32
    s3_seconds: float = 10.0
    s4_streams: int = 1000
    s5_turns: tuple[int, ...] = (100, 1000, 2000, 5000, 10000)
    s5_sizes: tuple[int, ...] = (1 * MiB, 8 * MiB, 32 * MiB)
    s5_repeats: int = 3
    flood_streams: int = 100
    flood_pace_ms: int = 50
    flood_events: int = 20
    flood_bodies: int = 10
    flood_body_bytes: int = 32_000_000
    #: Body sizes SigV4 signing is measured at (with a bedrock target): about
    #: the bench's own request as the Bedrock wire sends it (107 bytes), then
    #: turns of 10 KB, 200 KB and 2 MB.
    sigv4_sizes: tuple[int, ...] = (107, 10_000, 200_000, 2_000_000)
    timeout: float = 120.0


QUICK = Settings(
    s1_rounds=1,
    s1_search=(2000,),
    s2_rounds=3,
    s3_seconds=3.0,
    s4_streams=200,
    s5_turns=(100, 1000, 10000),
    s5_sizes=(1 * MiB, 8 * MiB),
    s5_repeats=1,
    flood_streams=20,
    flood_bodies=3,
    flood_body_bytes=8_000_000,
    timeout=60.0,
)


# -- measuring one load --------------------------------------------------------


class _Meter:
    """
    What the target, the fake upstream, the load (this process's children)
    and the rest of the machine used from now until :meth:`read`; the
    target's peak memory is counted afresh from now.
    """

    def __init__(self, target: _targets.Target, upstream):
        self._target, self._upstream = target, upstream
        self._pids = target.pids()
        _targets.reset_peak(self._pids)
        target.gc_reset()
        # Per process: one started meanwhile (a body worker) counts whole.
        self._target_cpu = {pid: _targets.cpu_seconds([pid]) for pid in self._pids}
        self._upstream_cpu = _targets.cpu_seconds(upstream.pids())
        self._busy = _machine_busy_seconds()
        self._children = _children_cpu_seconds()
        self._began = time.monotonic()

    def read(self) -> dict:
        """CPU seconds of each since the start, the window's length, the target's peak memory."""
        window = time.monotonic() - self._began
        load = _children_cpu_seconds() - self._children
        target = sum(_targets.cpu_seconds([pid]) - self._target_cpu.get(pid, 0.0) for pid in self._target.pids())
        upstream = _targets.cpu_seconds(self._upstream.pids()) - self._upstream_cpu
        collector = self._target.gc_read()
        return {
            # Its collector's collections meanwhile (a Python target of one process), per generation.
            "gc": collector,
            "window_s": window,
            "load_cpu_s": load,
            "target_cpu_s": target,
            "upstream_cpu_s": upstream,
            "target_peak_kib": _targets.peak_rss_kib(self._target.pids()),
            # What the rest of the machine used meanwhile: on a shared
            # machine, the noise in every figure.
            "other_cpu_s": max(0.0, _machine_busy_seconds() - self._busy - target - upstream - load),
        }


def _machine_busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]
    return busy / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Runner:
    """Runs the load generator against targets and measures around it."""

    def __init__(self, upstream: _targets.FakeUpstreamProcess, load_cpus: set[int] | None, log):
        self.upstream = upstream
        self.load_cpus = load_cpus
        self.log = log

    def load(
        self,
        target: _targets.Target,
        model: str,
        concurrency: int,
        *,
        requests: int | None = None,
        duration: float | None = None,
        latency: bool = False,
        ramp: float = 0.0,
        timeout: float = 120.0,
        body_file: str | None = None,
        count_only: bool = False,
    ) -> dict:
        """One load run; the load generator's summary plus CPU and memory of the processes."""
        argv = [
            sys.executable,
            os.path.join(BENCH_DIR, "loadgen.py"),
            "--port", str(target.port),
            "--path", target.path,
            "--model", model,
            "--concurrency", str(concurrency),
            "--ramp", str(ramp),
            "--timeout", str(timeout),
        ]
        if requests is not None:
            argv += ["--requests", str(requests)]
        if duration is not None:
            argv += ["--duration", str(duration)]
        if latency:
            argv.append("--latency")
        if body_file:
            argv += ["--body-file", body_file]
        if count_only:
            argv += ["--count-only", "--wire", target.wire]
        meter = _Meter(target, self.upstream)
        bound = (duration or 0) + timeout * max(1, (requests or concurrency) // concurrency) + 60
        done = subprocess.run(
            argv,
            capture_output=True,
            timeout=bound,
            preexec_fn=_targets._preexec(self.load_cpus),
        )
        used = meter.read()
        lines = done.stdout.decode().strip().splitlines()
        if done.returncode != 0 or not lines:
            raise RuntimeError("the load generator failed: %s" % (done.stderr.decode()[-2000:],))
        summary = json.loads(lines[-1])
        del used["load_cpu_s"]
        summary.update(used)
        return summary

    def throughput(self, target: _targets.Target, model: str, streams: int, rounds: int, timeout: float,
                   workdir: str) -> dict:
        """
        Unpaced streams read by a reader that is not the bottleneck: one curl
        process (HTTP/1.1 chunked decoded in C, bodies thrown away) running
        ``streams`` transfers at once (``--parallel``), ``streams * rounds``
        in all over keep-alive connections; without curl, the load generator
        counting bytes only. Every body must have the fake upstream's exact
        length.
        """
        curl = shutil.which("curl")
        if curl is None:
            summary = self.load(target, model, streams, requests=streams * rounds, timeout=timeout,
                                count_only=True)
            summary["reader"] = "loadgen --count-only"
            return summary
        from loadgen import _expected_bytes, request_body

        body_file = os.path.join(workdir, "s2-body.json")
        with open(body_file, "wb") as f:
            f.write(request_body(model, True))
        url = "http://127.0.0.1:%d%s" % (target.port, target.path)
        requests = streams * rounds
        argv = [curl, "--silent", "--show-error", "--http1.1", "--parallel", "--parallel-max", str(streams),
                "--max-time", str(timeout),
                "--header", "content-type: application/json", "--header", "x-api-key: sk-bench",
                "--header", "anthropic-version: 2023-06-01", "--data-binary", "@" + body_file,
                "--write-out", "%{http_code} %{size_download}\\n"]
        for _ in range(requests):
            argv += [url, "--output", os.devnull]
        expected = _expected_bytes(model, target.wire)
        meter = _Meter(target, self.upstream)
        done = subprocess.run(argv, capture_output=True, timeout=timeout * rounds + 60,
                              preexec_fn=_targets._preexec(self.load_cpus))
        used = meter.read()
        wall = used["window_s"]
        body_bytes = 0
        errors: dict[str, int] = {}
        lines = done.stdout.decode().split()
        for code, size in zip(lines[0::2], lines[1::2]):
            body_bytes += int(size)
            if code != "200":
                kind = "http_" + code
            elif expected is not None and int(size) != expected:
                kind = "wrong_body_bytes"
            else:
                continue
            errors[kind] = errors.get(kind, 0) + 1
        missing = requests - len(lines) // 2
        if done.returncode != 0 or missing:
            self.log("curl (exit %d): %s" % (done.returncode, done.stderr.decode(errors="replace").strip()[-300:]))
            errors["curl_exit_%d" % (done.returncode,)] = max(1, missing)
        summary = {
            "reader": "curl",
            "requests": requests,
            "errors": sum(errors.values()),
            "error_kinds": errors,
            "wall_s": wall,
            "cpu_s": used.pop("load_cpu_s"),
            "body_bytes": body_bytes,
            "mb_per_s": body_bytes / wall / 1e6,
        }
        summary.update(used)
        return summary

    def flood(self, target: _targets.Target, settings: Settings) -> dict:
        """``bench/flood.py`` against ``target``; its figures, with the target's CPU and peak memory."""
        argv = [
            sys.executable, os.path.join(BENCH_DIR, "flood.py"),
            "--port", str(target.port),
            "--path", target.path,
            "--streams", str(settings.flood_streams),
            "--pace-ms", str(settings.flood_pace_ms),
            "--events", str(settings.flood_events),
            "--bodies", str(settings.flood_bodies),
            "--body-bytes", str(settings.flood_body_bytes),
            "--timeout", str(settings.timeout * 5),
        ]
        meter = _Meter(target, self.upstream)
        done = subprocess.run(argv, capture_output=True, timeout=settings.timeout * 10,
                              preexec_fn=_targets._preexec(self.load_cpus))
        used = meter.read()
        lines = done.stdout.decode().strip().splitlines()
        if done.returncode != 0 or not lines:
            raise RuntimeError("the flood failed: %s" % (done.stderr.decode()[-2000:],))
        summary = json.loads(lines[-1])
        summary.update(used)
        return summary

    def hold(self, target: _targets.Target, streams: int, timeout: float) -> dict:
        """Open ``streams`` idle streams; return the target's RSS before and with them open."""
        argv = [
            sys.executable,
            os.path.join(BENCH_DIR, "loadgen.py"),
            "--port", str(target.port),
            "--path", target.path,
            "--model", "bench:idle:300",
            "--concurrency", str(streams),
            "--ramp", str(streams / 2000.0),
            "--timeout", str(timeout + 30),
            "--hold",
            "--hold-timeout", str(timeout),
        ]
        pids = target.pids()
        gc_settle = 0.5
        time.sleep(gc_settle)
        before = _targets.rss_kib(target.pids())
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_targets._preexec(self.load_cpus),
        )
        try:
            ready = json.loads(process.stdout.readline() or b"{}")
            time.sleep(gc_settle)
            during = _targets.rss_kib(target.pids())
            process.stdin.write(b"\n")
            process.stdin.flush()
            out, err = process.communicate(timeout=timeout + 60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        del pids
        lines = out.decode().strip().splitlines()
        summary = json.loads(lines[-1]) if lines else {}
        failed = {k: v for k, v in summary.get("error_kinds", {}).items() if k != "held"}
        return {
            "streams": streams,
            "ready": ready.get("ready", 0),
            "before_kib": before,
            "during_kib": during,
            "kib_per_stream": (during - before) / streams if streams else 0.0,
            "errors": sum(failed.values()),
            "error_kinds": failed,
        }


# -- scenarios ---------------------------------------------------------------------


def _log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def scenario_s1(runner: Runner, targets: list, settings: Settings) -> dict:
    """Paced streams at each count, then the search for the largest count held."""
    model = "bench:paced:%d:%d" % (settings.s1_events, settings.s1_interval_ms)
    results: dict = {"paced": {}, "search": {}}
    for count in settings.s1_counts:
        results["paced"][count] = {}
        for target in targets:
            _log("S1 %s: %d paced streams" % (target.name, count))
            results["paced"][count][target.name] = runner.load(
                target,
                model,
                count,
                requests=count * settings.s1_rounds,
                latency=True,
                ramp=count / 2000.0,
                timeout=settings.timeout,
            )
    for target in targets:
        held = {"max_held": None, "first_failed": None, "runs": {}}
        largest = max(settings.s1_counts)
        if results["paced"][largest][target.name]["errors"]:
            # It already failed below the search's range: no need to try more.
            held["first_failed"] = largest
            counts = ()
        else:
            counts = settings.s1_search
        for count in counts:
            _log("S1 search %s: %d paced streams" % (target.name, count))
            summary = runner.load(
                target, model, count, requests=count, ramp=count / 2000.0, timeout=settings.timeout
            )
            held["runs"][count] = summary
            if summary["errors"]:
                held["first_failed"] = count
                break
            held["max_held"] = count
        if held["max_held"] is None:
            # Below the search's range: the paced counts tell what it held.
            for count in sorted(settings.s1_counts):
                if results["paced"][count][target.name]["errors"] == 0:
                    held["max_held"] = count
        results["search"][target.name] = held
    return results


def scenario_s2(runner: Runner, targets: list, settings: Settings, workdir: str) -> dict:
    """Unpaced streams: throughput and CPU seconds per MB, read by curl."""
    model = "bench:burst:%d" % (settings.s2_events,)
    results = {}
    for target in targets:
        _log("S2 %s: %d unpaced streams" % (target.name, settings.s2_streams))
        summary = runner.throughput(
            target, model, settings.s2_streams, settings.s2_rounds, settings.timeout * 2, workdir
        )
        mb = summary["body_bytes"] / 1e6
        summary["target_cpu_s_per_mb"] = summary["target_cpu_s"] / mb if mb else None
        results[target.name] = summary
    return results


def scenario_s3(runner: Runner, targets: list, settings: Settings) -> dict:
    """Small non-streaming requests over keep-alive connections: requests/s."""
    results = {}
    for target in targets:
        _log("S3 %s: %d concurrent, %gs" % (target.name, settings.s3_concurrency, settings.s3_seconds))
        results[target.name] = runner.load(
            target,
            "bench:json",
            settings.s3_concurrency,
            duration=settings.s3_seconds,
            timeout=settings.timeout,
        )
    return results


def scenario_s4(runner: Runner, targets: list, settings: Settings) -> dict:
    """Memory per idle open stream (after a small warm-up hold)."""
    results = {}
    for target in targets:
        if not target.pids():
            continue
        _log("S4 %s: %d idle streams" % (target.name, settings.s4_streams))
        runner.hold(target, min(50, settings.s4_streams), settings.timeout)
        results[target.name] = runner.hold(target, settings.s4_streams, settings.timeout)
    return results


def scenario_flood(runner: Runner, targets: list, settings: Settings) -> dict:
    """Paced streams while large bodies of tiny messages arrive: does one body stop the others?"""
    results = {}
    for target in targets:
        _log("flood %s: %d paced streams, %d bodies of %d bytes" % (
            target.name, settings.flood_streams, settings.flood_bodies, settings.flood_body_bytes))
        results[target.name] = runner.flood(target, settings)
    return results


def flood_rows(results: dict, names: list[str]) -> list[list[str]]:
    """The flood's figures per target."""
    flood = results.get("flood")
    if not flood:
        return []
    rows = [["flood"] + [n for n in names if n in flood]]

    def add(label, value):
        rows.append([label] + [value(flood[n]) for n in names if n in flood])

    add("paced streams: worst gap between two events, ms (pace %d)" % (next(iter(flood.values()))["paced"]["pace_ms"],),
        lambda r: _fmt(r["paced"]["worst_gap_ms"], "%.0f"))
    add("paced streams: p99 of each stream's worst gap, ms", lambda r: _fmt(r["paced"]["p99_gap_ms"], "%.0f"))
    add("paced streams: worst wait for a first event, ms", lambda r: _fmt(r["paced"]["worst_first_event_ms"], "%.0f"))
    add("paced streams: median wait for a first event, ms",
        lambda r: _fmt(r["paced"]["median_first_event_ms"], "%.1f"))
    add("paced streams: run / failed", lambda r: "%d / %d" % (r["paced"]["streams"], r["paced"]["errors"]))
    add("large bodies: answers", lambda r: ", ".join(
        "%s x%d" % (status, n) for status, n in sorted(r["bodies"]["statuses"].items())))
    add("large bodies: seconds to the last answer", lambda r: _fmt(max(r["bodies"]["seconds"], default=None), "%.1f"))
    add("target's peak memory, MiB (its processes)", lambda r: _fmt(r["target_peak_kib"] / 1024, "%.0f"))
    add("others on the machine, CPU-s / s", lambda r: _fmt(r["other_cpu_s"] / (r["window_s"] or 1e-9)))
    return rows


#: The peak memory of the relay's processes in the full flood (ten 32 MB
#: bodies of tiny messages, the default budget), documented in
#: docs/benchmarks.md: about 1.5 GB on a 24 GiB machine.
FLOOD_PEAK_MIB = 1536
#: How much longer than its pace a paced stream's gap between two events may grow.
FLOOD_GAP_ALLOWED_MS = 250


#: Issue 32: a paced stream through the Bedrock wire costs at most this many
#: times the CPU per event of the Anthropic wire, side by side in one run.
WIRE_CPU_LIMIT = 1.3
#: Issue 33: the same for a paced stream through the Responses wire.
RESPONSES_CPU_LIMIT = 1.5
#: Issue 32: what SigV4 signing may add to a request, in microseconds.
SIGV4_LIMIT_US = 100.0


def wire_verdicts(results: dict, bedrock: str = "relay-bedrock", anthropic: str = "relay",
                  signing: bool = True, *, limit: float = WIRE_CPU_LIMIT, issue: str = "issue 32") -> list[list[str]]:
    """
    Issue 32's bench goals: the ``bedrock`` target's CPU per paced event
    over the ``anthropic`` target's in the same run (per stream beside it:
    a Bedrock stream has one event fewer, no ``ping``); per MB and per small
    request, reported; with ``signing``, SigV4 signing per request,
    measured in process in the same run, by body size. Another wire's
    target (issue 33's ``relay-responses``) is judged the same way against
    its own ``limit``, ``signing`` off.
    """
    rows = [["goal (%s)" % (issue,), "figure", "goal", "met"]]

    def add(name, value, goal, ok):
        rows.append([name, value, goal, "-" if ok is None else ("met" if ok else "NOT met")])

    paced = (results.get("S1") or {}).get("paced", {})
    for count in sorted(paced):
        mine, theirs = paced[count].get(bedrock), paced[count].get(anthropic)
        ratio = _ratio(cpu_per_event_us(mine), cpu_per_event_us(theirs))
        if ratio is None:
            continue
        per_stream = _ratio(mine["target_cpu_s"] / max(1, mine["ok"]), theirs["target_cpu_s"] / max(1, theirs["ok"]))
        add("S1 %d: CPU per paced event, %s / %s" % (count, bedrock, anthropic),
            "%.1f / %.1f us: %.2fx (per stream %.2fx)" % (
                cpu_per_event_us(mine), cpu_per_event_us(theirs), ratio, per_stream),
            "<= %gx" % (limit,), ratio <= limit)
    s2 = results.get("S2") or {}
    ratio = _ratio(_get(s2, bedrock, "target_cpu_s_per_mb"), _get(s2, anthropic, "target_cpu_s_per_mb"))
    if ratio is not None:
        add("S2: CPU-seconds per MB, %s / %s" % (bedrock, anthropic), "%.4f / %.4f: %.2fx" % (
            _get(s2, bedrock, "target_cpu_s_per_mb"), _get(s2, anthropic, "target_cpu_s_per_mb"), ratio),
            "reported", None)
    s3 = results.get("S3") or {}
    if bedrock in s3 and anthropic in s3:
        mine, theirs = (s3[n]["target_cpu_s"] / max(1, s3[n]["ok"]) * 1e6 for n in (bedrock, anthropic))
        add("S3: CPU per small request, %s - %s" % (bedrock, anthropic),
            "%.0f - %.0f us: %+.0f us" % (mine, theirs, mine - theirs), "reported", None)
    for size, figures in sorted((results.get("sigv4") or {}).items() if signing else ()):
        add("SigV4 signing per request, %s body (in process)" % (_size(size),),
            "%.1f us on the reactor (signing %.1f, the body's SHA-256 %.1f %s; botocore %.1f)" % (
                figures["reactor"], figures["signing"], figures["sha256"],
                "on a thread, its hand-over %.1f" % (figures["handover"],) if "handover" in figures
                else "on the reactor", figures["botocore"]),
            "<= %g us" % (SIGV4_LIMIT_US,), figures["reactor"] <= SIGV4_LIMIT_US)
    return rows if len(rows) > 1 else []


def _size(size: int) -> str:
    return "%d-byte" % (size,) if size < 1000 else "%g KB" % (size / 1000) if size < 1_000_000 else "%g MB" % (size / 1e6)


def sigv4_costs(sizes: tuple[int, ...]) -> dict:
    """``bench/bench_sigv4.py``'s figures per body size, in this process (about 2.5 s a size)."""
    import bench_sigv4

    return {size: bench_sigv4.measure(size) for size in sizes}


def flood_verdicts(results: dict, relay: str = "relay") -> list[list[str]]:
    """Issue 22's "done when" for the flood."""
    r = (results.get("flood") or {}).get(relay)
    if r is None:
        return []
    rows = []
    paced = r["paced"]
    allowed = paced["pace_ms"] + FLOOD_GAP_ALLOWED_MS
    rows.append(["flood: worst gap between events of a paced stream", "%.0f ms" % (paced["worst_gap_ms"] or 0),
                 "<= %d ms" % (allowed,), "met" if (paced["worst_gap_ms"] or 0) <= allowed else "NOT met"])
    statuses = r["bodies"]["statuses"]
    rows.append(["flood: every large body answered 200 or 529", ", ".join(sorted(statuses)), "200, 529",
                 "met" if set(statuses) <= {"200", "529"} else "NOT met"])
    peak = r["target_peak_kib"] / 1024
    full = r["bodies"]["count"] >= 10 and r["bodies"]["bytes"] >= 32_000_000
    rows.append(["flood: peak memory of the relay's processes", "%.0f MiB" % (peak,), "<= %d MiB" % (FLOOD_PEAK_MIB,),
                 ("met" if peak <= FLOOD_PEAK_MIB else "NOT met") if full else "-"])
    return rows


def _large_body(size: int, path: str) -> None:
    """A Claude Code-shaped history padded to exactly ``size`` bytes."""
    turns = 1000
    overhead = 300 * turns + 200
    filler = "x" * max(1, (size - overhead) // turns)
    messages = []
    for n in range(turns):
        tool_id = "toolu_01%020d" % (n,)
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look at that."},
                    {"type": "tool_use", "id": tool_id, "name": "Bash", "input": {"command": "ls -la"}},
                ],
            }
        )
        messages.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": filler}]}
        )
    body = json.dumps(
        {"model": "bench:json", "max_tokens": 1024, "messages": messages}, separators=(",", ":")
    ).encode()
    if len(body) > size:
        cut = len(body) - size
        messages[-1]["content"][0]["content"] = filler[: len(filler) - cut]
        body = json.dumps(
            {"model": "bench:json", "max_tokens": 1024, "messages": messages}, separators=(",", ":")
        ).encode()
    # JSON allows whitespace before the closing brace: pad to the exact size.
    body = body[:-1] + b" " * (size - len(body)) + b"}"
    with open(path, "wb") as f:
        f.write(body)


def _translation_costs(settings: Settings) -> dict:
    """
    ``translate_request`` on clean and colliding histories, best of a few
    runs, under the garbage collector settings ``twistd relay`` runs with.
    """
    sys.path.insert(0, _targets.REPO_ROOT)
    from bench_translation import history  # the translation bench's session shape
    from twisted.internet.task import Clock

    from twisted_relay.gctuning import GarbageCollectorTuning
    from twisted_relay.translation import translate_request

    tuning = GarbageCollectorTuning(Clock())
    tuning.startService()
    try:
        return _translation_runs(settings, history, translate_request)
    finally:
        tuning.stopService()


def _translation_runs(settings: Settings, history, translate_request) -> dict:
    results = {}
    for colliding in (False, True):
        rows = {}
        for turns in settings.s5_turns:
            body = history(turns, colliding)
            best = float("inf")
            deadline = time.perf_counter() + 1.0
            runs = 0
            gc.collect()
            while runs < 3 or (runs < 50 and time.perf_counter() < deadline):
                start = time.perf_counter()
                translate_request(body, "unique")
                best = min(best, time.perf_counter() - start)
                runs += 1
            rows[turns] = {"ms": best * 1e3, "us_per_turn": best * 1e6 / turns}
        results["colliding" if colliding else "clean"] = rows
    return results


def scenario_s5(runner: Runner, targets: list, settings: Settings, workdir: str) -> dict:
    """Translation cost against history size, and large bodies end to end."""
    _log("S5 translation: %s turns" % (", ".join(map(str, settings.s5_turns)),))
    results: dict = {"translation": _translation_costs(settings), "bodies": {}}
    for size in settings.s5_sizes:
        path = os.path.join(workdir, "body-%d.json" % (size,))
        _large_body(size, path)
        results["bodies"][size] = {}
        for target in targets:
            _log("S5 %s: %d MiB body" % (target.name, size // MiB))
            results["bodies"][size][target.name] = runner.load(
                target,
                "bench:json",
                1,
                requests=settings.s5_repeats,
                body_file=path,
                timeout=settings.timeout,
            )
        os.unlink(path)
    return results


# -- the table ---------------------------------------------------------------------


def cpu_per_event_us(summary: dict | None) -> float | None:
    """The target's CPU microseconds per event delivered in a load (``None`` for direct)."""
    if not summary or not summary.get("events") or not summary.get("target_cpu_s"):
        return None
    return summary["target_cpu_s"] / summary["events"] * 1e6


def longest_pause_ms(summary: dict | None) -> float | None:
    """The longest garbage collection in a load, in ms (``None`` for a target not watched)."""
    collector = (summary or {}).get("gc")
    if not collector:
        return None
    return max(figures["longest_s"] for figures in collector.values()) * 1e3


def full_collections(summary: dict | None) -> int | None:
    """How many full (oldest-generation) collections a load saw."""
    collector = (summary or {}).get("gc")
    return None if not collector else collector["gen2"]["collections"]


def _pause(summary: dict | None) -> str:
    longest = longest_pause_ms(summary)
    return "-" if longest is None else "%.1f (%d full)" % (longest, full_collections(summary))


def added_ms(by_target: dict, name: str, key: str = "p50") -> float | None:
    """A target's per-event latency minus direct's, in the same load, in ms."""
    base = _get(by_target, "direct", "event_latency_ms", key)
    mine = _get(by_target, name, "event_latency_ms", key)
    return None if base is None or mine is None else mine - base


def headline(results: dict, names: list[str]) -> list[list[str]]:
    """
    The figures that say what a relay costs where users feel it: CPU per
    paced event, CPU-seconds per MB, latency added at 200 and 1,000 paced
    streams (median, p99, max), the longest garbage collection then (and how
    many were full ones), for the Python targets of one process; then
    requests/s of small non-streaming requests.
    """
    shown = [n for n in names if n != "direct"]
    rows = [["headline"] + shown]
    s1 = (results.get("S1") or {}).get("paced", {})
    for count in sorted(s1):
        rows.append(["CPU per paced event, us (S1 %d)" % (count,)]
                    + [_fmt(cpu_per_event_us(s1[count].get(n)), "%.1f") for n in shown])
    s2 = results.get("S2")
    if s2:
        rows.append(["CPU-seconds per MB (S2)"] + [_fmt(_get(s2, n, "target_cpu_s_per_mb"), "%.4f") for n in shown])
    for count in sorted(s1):
        rows.append(["latency added per event, median / p99 / max ms (S1 %d)" % (count,)]
                    + [" / ".join(_fmt(added_ms(s1[count], n, key), "%+.2f") for key in ("p50", "p99", "max"))
                       for n in shown])
    for count in sorted(s1):
        rows.append(["longest collector pause, ms (S1 %d)" % (count,)] + [_pause(s1[count].get(n)) for n in shown])
    s3 = results.get("S3")
    if s3:
        rows.append(["requests/s, small non-streaming (S3)"]
                    + [_fmt(_get(s3, n, "requests_per_s"), "%.0f") for n in shown])
    return rows if len(rows) > 1 else []


def _fmt(value, spec: str = "%.2f", none: str = "-") -> str:
    return none if value is None else spec % (value,)


def _ratio(a, b) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _get(d: dict, *keys):
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def table(results: dict, names: list[str]) -> list[list[str]]:
    """Rows of figures (and ratios) per target, as strings."""
    rows = [["scenario"] + names]
    s1 = results.get("S1")
    if s1:
        for count, by_target in s1["paced"].items():
            direct = by_target.get("direct")
            base50 = _get(direct, "event_latency_ms", "p50") if direct else None
            base99 = _get(direct, "event_latency_ms", "p99") if direct else None
            row = ["S1 %s paced: per-event latency added, median / p99 ms" % (count,)]
            err = ["S1 %s paced: errors (of requests)" % (count,)]
            for name in names:
                r = by_target.get(name)
                if r is None:
                    row.append("-")
                    err.append("-")
                    continue
                p50 = _get(r, "event_latency_ms", "p50")
                p99 = _get(r, "event_latency_ms", "p99")
                if name == "direct":
                    row.append("%s / %s (abs)" % (_fmt(p50), _fmt(p99)))
                else:
                    row.append(
                        "%s / %s"
                        % (
                            _fmt(None if p50 is None or base50 is None else p50 - base50, "%+.2f"),
                            _fmt(None if p99 is None or base99 is None else p99 - base99, "%+.2f"),
                        )
                    )
                err.append("%d of %d" % (r["errors"], r["requests"]))
            rows += [row, err]
            top = ["S1 %s paced: per-event latency added, max ms" % (count,)]
            ttfb = ["S1 %s paced: time to first delta, median / p99 ms" % (count,)]
            cpu = ["S1 %s paced: target CPU per event, us" % (count,)]
            pause = ["S1 %s paced: longest collector pause, ms (full collections)" % (count,)]
            for name in names:
                r = by_target.get(name) or {}
                top.append("%s (abs)" % (_fmt(_get(r, "event_latency_ms", "max")),) if name == "direct"
                           else _fmt(added_ms(by_target, name, "max"), "%+.2f"))
                ttfb.append("%s / %s" % (_fmt(_get(r, "ttfd_ms", "p50")), _fmt(_get(r, "ttfd_ms", "p99"))))
                cpu.append(_fmt(cpu_per_event_us(by_target.get(name)), "%.1f"))
                pause.append(_pause(by_target.get(name)))
            rows += [top, ttfb, cpu, pause]
        biggest = max(s1["paced"])
        peak = ["peak memory at %d paced streams, MB" % (biggest,)]
        for name in names:
            r = s1["paced"][biggest].get(name)
            peak.append(_fmt(r["target_peak_kib"] / 1024.0, "%.0f") if r and r["target_peak_kib"] else "-")
        rows.append(peak)
        search = ["S1 largest count held with 0 errors (tried up to %d)" % (max(
            max(h["runs"]) if h["runs"] else 0 for h in s1["search"].values()),)]
        for name in names:
            h = s1["search"].get(name)
            if h is None:
                search.append("-")
            else:
                text = _fmt(h["max_held"], "%d", "none")
                if h["first_failed"]:
                    text += " (%d failed)" % (h["first_failed"],)
                search.append(text)
        rows.append(search)
    s2 = results.get("S2")
    if s2:
        direct = _get(s2, "direct", "mb_per_s")
        nginx = _get(s2, "nginx", "mb_per_s")
        rows.append(["S2 unpaced: MB/s"] + [_fmt(_get(s2, n, "mb_per_s"), "%.1f") for n in names])
        rows.append(["S2 unpaced: x direct"] + [_fmt(_ratio(_get(s2, n, "mb_per_s"), direct), "%.3f") for n in names])
        rows.append(["S2 unpaced: x nginx"] + [_fmt(_ratio(_get(s2, n, "mb_per_s"), nginx), "%.3f") for n in names])
        rows.append(
            ["S2 unpaced: target CPU s per MB"]
            + [_fmt(_get(s2, n, "target_cpu_s_per_mb"), "%.4f") for n in names]
        )
        rows.append(["S2 unpaced: errors"] + [_fmt(_get(s2, n, "errors"), "%d") for n in names])
        rows.append(["S2 unpaced: reader CPU s per MB"]
                    + [_fmt(_ratio(_get(s2, n, "cpu_s"), (_get(s2, n, "body_bytes") or 0) / 1e6), "%.4f") for n in names])
    s3 = results.get("S3")
    if s3:
        plain = _get(s3, "plain", "requests_per_s")
        litellm = _get(s3, "litellm", "requests_per_s")
        rows.append(["S3 non-streaming: req/s"] + [_fmt(_get(s3, n, "requests_per_s"), "%.0f") for n in names])
        rows.append(["S3 non-streaming: x plain"] + [_fmt(_ratio(_get(s3, n, "requests_per_s"), plain)) for n in names])
        rows.append(["S3 non-streaming: x litellm"] + [_fmt(_ratio(_get(s3, n, "requests_per_s"), litellm), "%.1f") for n in names])
        rows.append(["S3 non-streaming: errors"] + [_fmt(_get(s3, n, "errors"), "%d") for n in names])
    s4 = results.get("S4")
    if s4:
        count = next(iter(s4.values()))["streams"] if s4 else 0
        rows.append(["S4 idle streams: KiB per stream"] + [_fmt(_get(s4, n, "kib_per_stream"), "%.1f") for n in names])
        rows.append(
            ["S4 idle streams: RSS MB with %d open" % (count,)]
            + [_fmt(None if _get(s4, n, "during_kib") is None else _get(s4, n, "during_kib") / 1024.0, "%.0f") for n in names]
        )
        rows.append(["S4 idle streams: errors"] + [_fmt(_get(s4, n, "errors"), "%d") for n in names])
    s5 = results.get("S5")
    if s5:
        for size, by_target in s5["bodies"].items():
            direct = _get(by_target, "direct", "total_ms", "p50")
            row = ["S5 %d MiB body: total ms (direct) / added ms" % (int(size) // MiB,)]
            for name in names:
                value = _get(by_target, name, "total_ms", "p50")
                errors = _get(by_target, name, "errors")
                if value is None:
                    row.append("failed" if errors else "-")
                elif name == "direct":
                    row.append(_fmt(value, "%.1f"))
                else:
                    row.append(_fmt(None if direct is None else value - direct, "%+.1f"))
            rows.append(row)
    return rows


def format_rows(rows: list[list[str]]) -> str:
    """A Markdown table."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        out.append("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")
        if n == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def translation_rows(results: dict) -> list[list[str]]:
    """S5's in-process translation figures."""
    s5 = results.get("S5")
    if not s5:
        return []
    rows = [["history", "turns", "ms", "us per turn"]]
    for kind, by_turns in s5["translation"].items():
        for turns, r in by_turns.items():
            rows.append([kind, str(turns), "%.2f" % r["ms"], "%.2f" % r["us_per_turn"]])
    return rows


#: Run-to-run noise allowed when the relay's added latency is compared with
#: the relay before a change (``--relay-tree before=PATH``), in ms: the larger
#: of this and a tenth of the figure compared.
LATENCY_NOISE_MS = 0.05

#: Run-to-run noise allowed when the relay's CPU per paced event is compared
#: with the relay before a change: this fraction of before's figure.
CPU_NOISE = 0.10

#: Issue 22's tail-latency goals: at these stream counts, the relay's added
#: p99 per event at most this many times that target's.
P99_GOALS = {200: ("aiohttp", 3.0), 1000: ("plain", 1.0)}

#: The longest garbage collection allowed during S1 at 1,000 streams and more, in ms.
PAUSE_LIMIT_MS = 20.0


def verdicts(results: dict, relay: str = "relay", before: str = "before") -> list[list[str]]:
    """
    The relay's goals (issue 13's framing): what users feel, per paced event,
    no worse than before (the median, and CPU per event); a single process at
    least as fast as plain ``twisted.web.proxy`` on small requests; CPU per
    event and per MB reported beside nginx, plain Twisted and aiohttp; the
    reader not the bottleneck. Issue 22's tail: the added p99 per event at
    200 streams within three times aiohttp's and at 1,000 at most plain
    Twisted's (:data:`P99_GOALS`), and no garbage collection at 1,000
    streams as long as :data:`PAUSE_LIMIT_MS`.

    ``before`` names a relay tree run in the same run (``--relay-tree
    before=PATH``, the code before a change); without it the latency goals
    show the figure and are not judged.
    """
    rows = [["goal", "figure", "goal", "met"]]

    def add(name, value, goal, ok):
        rows.append([name, value, goal, "-" if ok is None else ("met" if ok else "NOT met")])

    s1 = results.get("S1")
    if s1:
        paced = s1["paced"]
        for count in sorted(paced):
            by_target = paced[count]
            if relay not in by_target:
                continue
            mine = added_ms(by_target, relay)
            then = added_ms(by_target, before) if before in by_target else None
            allowed = None if then is None else then + max(LATENCY_NOISE_MS, abs(then) / 10)
            add("S1 %d: added median per event, vs before" % (count,),
                "%s ms (before %s ms)" % (_fmt(mine, "%+.2f"), _fmt(then, "%+.2f")),
                "<= before + noise",
                None if mine is None or allowed is None else mine <= allowed)
            r = by_target[relay]
            add("S1 %d: errors" % (count,), "%d of %d" % (r["errors"], r["requests"]), "0", r["errors"] == 0)
            if count in P99_GOALS:
                other, times = P99_GOALS[count]
                mine99 = added_ms(by_target, relay, "p99")
                theirs = added_ms(by_target, other, "p99") if other in by_target else None
                add("S1 %d: added p99 per event, vs %s" % (count, other),
                    "%s ms (%s %s ms)" % (_fmt(mine99, "%+.2f"), other, _fmt(theirs, "%+.2f")),
                    "<= %s" % (other if times == 1 else "%gx %s" % (times, other)),
                    None if mine99 is None or theirs is None else mine99 <= times * max(theirs, 0.0))
            pause = longest_pause_ms(r)
            if pause is not None:
                add("S1 %d: longest collector pause" % (count,), "%.1f ms (%d full collections)" % (
                    pause, full_collections(r)), "< %g ms" % (PAUSE_LIMIT_MS,) if count >= 1000 else "reported",
                    pause < PAUSE_LIMIT_MS if count >= 1000 else None)
            others = ", ".join("%s %s" % (n, _fmt(cpu_per_event_us(by_target.get(n)), "%.1f"))
                               for n in ("nginx", "plain", "aiohttp") if n in by_target)
            add("S1 %d: CPU per paced event, us" % (count,),
                "%s (%s)" % (_fmt(cpu_per_event_us(r), "%.1f"), others or "no baselines"), "reported", None)
            cpu_now = cpu_per_event_us(r)
            cpu_then = cpu_per_event_us(by_target.get(before))
            if cpu_then is not None:
                add("S1 %d: CPU per paced event, vs before" % (count,),
                    "%s us (before %.1f us)" % (_fmt(cpu_now, "%.1f"), cpu_then), "<= before + noise",
                    None if cpu_now is None else cpu_now <= cpu_then * (1 + CPU_NOISE))
        h = s1["search"].get(relay)
        if h:
            add("S1: concurrent paced streams held, 0 errors", _fmt(h["max_held"], "%d", "none"), ">= 2000",
                (h["max_held"] or 0) >= 2000)
    s2 = results.get("S2")
    if s2:
        direct = _get(s2, "direct", "mb_per_s")
        nginx = _get(s2, "nginx", "mb_per_s")
        add("S2: the reader is not the bottleneck (direct MB/s > nginx MB/s)",
            "%s vs %s MB/s" % (_fmt(direct, "%.0f"), _fmt(nginx, "%.0f")), "direct faster",
            None if direct is None or nginx is None else direct > nginx)
        if relay in s2:
            others = ", ".join("%s %s" % (n, _fmt(_get(s2, n, "target_cpu_s_per_mb"), "%.4f"))
                               for n in ("nginx", "plain", "aiohttp") if n in s2)
            add("S2: CPU-seconds per MB", "%s (%s)" % (_fmt(_get(s2, relay, "target_cpu_s_per_mb"), "%.4f"),
                                                      others or "no baselines"), "reported", None)
    s3 = results.get("S3")
    if s3 and relay in s3:
        ratio = _ratio(_get(s3, relay, "requests_per_s"), _get(s3, "plain", "requests_per_s"))
        add("S3: req/s vs plain twisted.web.proxy", _fmt(ratio) + "x", ">= 1.0x", None if ratio is None else ratio >= 1.0)
    s4 = results.get("S4")
    if s4 and relay in s4:
        r = s4[relay]
        add("S4: memory per idle stream", "%.1f KiB" % (r["kib_per_stream"],), "<= 64 KiB", r["kib_per_stream"] <= 64)
        total = r["during_kib"] / 1024.0
        add("S4: RSS with %d idle streams" % (r["streams"],), "%.0f MB" % (total,), "< 100 MB at 1,000",
            total < 100 if r["streams"] >= 1000 else None)
    s5 = results.get("S5")
    if s5:
        clean = s5["translation"]["clean"]
        turns = sorted(clean)
        if turns:
            top = clean[turns[-1]]
            add("S5: %d-turn history translated" % (turns[-1],), "%.1f ms" % (top["ms"],), "<= 100 ms at 10,000",
                top["ms"] <= 100 if turns[-1] >= 10000 else None)
            per_turn = [clean[t]["us_per_turn"] for t in turns if t >= 1000] or [clean[t]["us_per_turn"] for t in turns]
            spread = max(per_turn) / min(per_turn)
            add("S5: linear (us/turn, max/min over >= 1,000 turns)", "%.2f" % (spread,), "<= 1.5", spread <= 1.5)
    return rows


# -- the run -----------------------------------------------------------------------


def _machine() -> dict:
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem = f.readline().split()[1]
    import twisted

    try:
        nginx = subprocess.run(["nginx", "-v"], capture_output=True).stderr.decode().strip()
    except OSError:
        nginx = None
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "mem_gib": round(int(mem) / 1024 / 1024, 1),
        "python": platform.python_version(),
        "twisted": twisted.__version__,
        "kernel": platform.release(),
        "nginx": nginx,
        "loadavg": open("/proc/loadavg").read().split()[:3],
    }


def _make_targets(names: list[str], workdir: str, upstream, cpus, relay_trees: dict, profile: bool,
                  ledger_trees: dict, bedrock_trees: dict | None = None) -> list:
    made = []
    for name in names:
        if name == "direct":
            made.append(_targets.Direct(workdir, upstream))
        elif name == "nginx":
            if _targets.Nginx.available():
                made.append(_targets.Nginx(workdir, upstream, cpus))
            else:
                _log("nginx is not installed (apt-get install nginx-light): left out")
        elif name == "plain":
            made.append(_targets.PlainProxy(workdir, upstream, cpus))
        elif name == "relay":
            made.append(_targets.Relay(workdir, upstream, cpus,
                                       profile=os.path.join(workdir, "relay.prof") if profile else None))
        elif name == "relay-routed":
            made.append(_targets.RoutedRelay(workdir, upstream, cpus))
        elif name == "relay2":
            made.append(_targets.Relay(workdir, upstream, cpus, name="relay2", workers=2))
        elif name == "relay-ledger":
            made.append(_targets.LedgerRelay(workdir, upstream, cpus))
        elif name == "relay-bedrock":
            made.append(_targets.BedrockRelay(workdir, upstream, cpus))
        elif name == "relay-responses":
            made.append(_targets.ResponsesRelay(workdir, upstream, cpus))
        elif name == "aiohttp":
            if os.path.exists(_AIOHTTP_PYTHON):
                made.append(_targets.AiohttpProxy(workdir, upstream, cpus, python=_AIOHTTP_PYTHON))
            else:
                _log("aiohttp is not installed at %s (see docs/benchmarks.md): left out" % (_AIOHTTP_PYTHON,))
        elif name == "litellm":
            if os.path.exists(_LITELLM_VENV):
                made.append(_targets.LiteLLM(workdir, upstream, cpus, binary=_LITELLM_VENV))
            else:
                _log("LiteLLM is not installed at %s (see docs/benchmarks.md): left out" % (_LITELLM_VENV,))
        else:
            raise SystemExit("unknown target %r" % (name,))
    for name, tree in relay_trees.items():
        made.append(_targets.Relay(workdir, upstream, cpus, tree=tree, name=name))
    for name, tree in ledger_trees.items():
        made.append(_targets.LedgerRelay(workdir, upstream, cpus, tree=tree, name=name))
    for name, tree in (bedrock_trees or {}).items():
        made.append(_targets.BedrockRelay(workdir, upstream, cpus, tree=tree, name=name))
    return made


def run_all(settings: Settings, names: list[str], scenarios: list[str], workdir: str, *,
            pin: bool = False, relay_trees: dict | None = None, profile: bool = False,
            ledger_trees: dict | None = None, bedrock_trees: dict | None = None) -> dict:
    """Start everything, run the scenarios, stop everything; return the results."""
    pin = pin and (os.cpu_count() or 1) >= 2
    target_cpus = {1} if pin else None
    load_cpus = {0} if pin else None
    upstream = _targets.FakeUpstreamProcess(workdir, load_cpus)
    started = []
    atexit.register(lambda: [p.stop() for p in reversed(started)])
    upstream.start()
    started.append(upstream)
    targets = _make_targets(names, workdir, upstream, target_cpus, relay_trees or {}, profile, ledger_trees or {},
                            bedrock_trees)
    live = []
    for target in targets:
        _log("starting %s" % (target.name,))
        try:
            target.start()
        except RuntimeError as e:
            _log("%s could not start: %s" % (target.name, e))
            target.stop()
            continue
        started.append(target)
        live.append(target)
    runner = Runner(upstream, load_cpus, _log)
    results: dict = {
        "machine": _machine(),
        "settings": settings.__dict__,
        "pinned": pin,
        "targets": {t.name: t.description for t in live},
    }
    began = time.monotonic()
    try:
        # S4 first, on processes that have only served warm-up requests, so
        # that memory freed by earlier loads does not hide the cost of a stream.
        if "S4" in scenarios:
            results["S4"] = scenario_s4(runner, live, settings)
            # Fresh processes for the rest: a target that keeps upstream
            # streams of departed clients open (LiteLLM does) must not carry
            # them into the next scenario.
            for target in live:
                target.stop()
                target.start()
        if "S3" in scenarios:
            results["S3"] = scenario_s3(runner, live, settings)
        if "S2" in scenarios:
            results["S2"] = scenario_s2(runner, live, settings, workdir)
        if "S1" in scenarios:
            results["S1"] = scenario_s1(runner, live, settings)
        if "S5" in scenarios:
            results["S5"] = scenario_s5(runner, live, settings, workdir)
        if "flood" in scenarios:
            # Fresh processes: the peak memory is the flood's own.
            for target in live:
                target.stop()
                target.start()
            results["flood"] = scenario_flood(runner, live, settings)
        if any(t.wire == "bedrock" for t in live):
            # What a request's signature costs, by body size, in the same run.
            _log("SigV4 signing per request, in process")
            results["sigv4"] = sigv4_costs(settings.sigv4_sizes)
    finally:
        results["seconds"] = time.monotonic() - began
        for process in reversed(started):
            process.stop()
        started.clear()
    return results


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts: a few minutes")
    parser.add_argument("--targets", default="direct,nginx,plain,aiohttp,relay,litellm")
    parser.add_argument("--scenarios", default="S1,S2,S3,S4,S5")
    parser.add_argument("--relay-tree", action="append", default=[], metavar="NAME=PATH",
                        help="also run the relay from the twisted_relay copy under PATH, as NAME")
    parser.add_argument("--ledger-tree", action="append", default=[], metavar="NAME=PATH",
                        help="the same, with the usage ledger on (as the relay-ledger target)")
    parser.add_argument("--bedrock-tree", action="append", default=[], metavar="NAME=PATH",
                        help="the same, on the bedrock wire (as the relay-bedrock target)")
    parser.add_argument("--pin", action="store_true",
                        help="pin targets to CPU 1, the upstream and load generator to CPU 0")
    parser.add_argument("--profile", action="store_true", help="run the relay under cProfile (relay.prof in the work folder)")
    parser.add_argument("--s1-counts", default=None, help="paced stream counts, e.g. 200,1000")
    parser.add_argument("--s1-search", default=None, help="counts tried in the search, e.g. 2000,3000 (empty: none)")
    parser.add_argument("--s1-events", type=int, default=None,
                        help="deltas per paced stream (default 50, a one-second stream at 20 ms apart)")
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    parser.add_argument("--workdir", default=None, help="keep logs and configs here (default: a temp folder)")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else Settings()
    if args.s1_counts:
        settings = replace(settings, s1_counts=tuple(int(n) for n in args.s1_counts.split(",")))
    if args.s1_events:
        settings = replace(settings, s1_events=args.s1_events)
    if args.s1_search is not None:
        settings = replace(settings, s1_search=tuple(int(n) for n in args.s1_search.split(",") if n))
    names = [n for n in args.targets.split(",") if n]
    if "direct" not in names:
        names.insert(0, "direct")
    trees = dict(item.split("=", 1) for item in args.relay_tree)
    ledger_trees = dict(item.split("=", 1) for item in args.ledger_tree)
    bedrock_trees = dict(item.split("=", 1) for item in args.bedrock_tree)
    workdir = args.workdir or tempfile.mkdtemp(prefix="relay-bench-")
    os.makedirs(workdir, exist_ok=True)
    _log("work folder: %s" % (workdir,))
    results = run_all(settings, names, args.scenarios.split(","), workdir,
                      pin=args.pin, relay_trees=trees, profile=args.profile, ledger_trees=ledger_trees,
                      bedrock_trees=bedrock_trees)
    shown = [n for n in names + list(trees) + list(ledger_trees) + list(bedrock_trees) if n in results["targets"]]
    machine = results["machine"]
    print("machine: %d cores (%s), %s GiB, Python %s, Twisted %s, %s; load average at start %s; %s"
          % (machine["nproc"], machine["cpu"], machine["mem_gib"], machine["python"], machine["twisted"],
             machine["nginx"] or "no nginx", " ".join(machine["loadavg"]),
             "targets pinned to CPU 1, upstream and load generator to CPU 0" if results["pinned"] else "not pinned"))
    print("run took %.0f s (%s)" % (results["seconds"], "quick" if args.quick else "full"))
    rows = headline(results, shown)
    if rows:
        print()
        print(format_rows(rows))
    print()
    rows = table(results, shown)
    if len(rows) > 1:
        print(format_rows(rows))
    rows = translation_rows(results)
    if rows:
        print()
        print("S5 inbound translation (translate_request, policy unique, best of runs):")
        print(format_rows(rows))
    rows = flood_rows(results, shown)
    if rows:
        print()
        print(format_rows(rows))
    for relay in [n for n in shown if n in ("relay", "relay2") or (n in trees and n != "before")]:
        print()
        print("targets for %s:" % (relay,))
        print(format_rows(verdicts(results, relay) + flood_verdicts(results, relay)))
    for bedrock in [n for n in shown if n == "relay-bedrock" or n in bedrock_trees]:
        rows = wire_verdicts(results, bedrock, signing=bedrock == "relay-bedrock")
        if rows:
            print()
            print(format_rows(rows))
    if "relay-responses" in shown:
        rows = wire_verdicts(results, "relay-responses", signing=False, limit=RESPONSES_CPU_LIMIT, issue="issue 33")
        if rows:
            print()
            print(format_rows(rows))
    print()
    print(format_rows(_helpers_rows(results, shown)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


def _helpers_rows(results: dict, names: list[str]) -> list[list[str]]:
    """CPU used by the load generator and fake upstream, and by others on the machine, per run."""
    rows = [["helpers (CPU-s / wall-s)", "target", "load generator", "fake upstream", "others on the machine"]]

    def add(label, r):
        if not r:
            return
        wall = r["wall_s"] or 1e-9
        rows.append([label, "%.2f" % (r["target_cpu_s"] / wall,), "%.2f" % (r["cpu_s"] / wall,),
                     "%.2f" % (r["upstream_cpu_s"] / wall,),
                     "%.2f" % (r["other_cpu_s"] / (r.get("window_s") or wall),)])

    s1 = results.get("S1")
    for count, by_target in (s1 or {}).get("paced", {}).items():
        for name in names:
            add("S1 %s %s" % (count, name), by_target.get(name))
    for key in ("S2", "S3"):
        for name in names:
            add("%s %s" % (key, name), (results.get(key) or {}).get(name))
    for name in names:
        r = (results.get("flood") or {}).get(name)
        if r:
            add("flood %s" % (name,), dict(r, cpu_s=r["load_cpu_s"]))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
