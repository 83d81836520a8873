"""
Benchmark of SigV4 signing per request: the relay's own signer
(``twisted_relay.logins.sigv4``, and ``AwsSigV4Login.authorize`` as the
request path calls it) against botocore's ``SigV4Auth.add_auth``, on the
same request: an InvokeModel POST to an inference-profile ARN with the
headers Claude Code's requests carry, bodies of 0, 10 KB, 200 KB and 2 MB.

The SHA-256 of the body is measured alone too: signing is that hash plus
a fixed part (the canonical request, its hash, one HMAC; the day's key is
kept), which the empty body shows. ``authorize`` is the signer plus setting
the three headers on Twisted's ``Headers`` (the copy of the request's
headers each call needs is measured apart and taken off), the body hashed
in the call.

"reactor" is what the request path's signing costs the reactor's thread:
the body's SHA-256 is made with the body (``RequestBody.prepare(digest=True)``),
on the reactor below ``DIGESTED_ON_THREAD`` bytes (64 KB) and on a thread
from there, and ``authorize`` is given it. So below 64 KB it is
``authorize`` itself (the hash made on the reactor, either way); from 64 KB
it is ``authorize`` with the hash given, plus the hand-over of the hash to
a thread and back (``BodyPool.digest`` under a running reactor, in a child
process: the reactor thread's own CPU time per body, ``time.thread_time``).

Run it from the work tree's root::

    python bench/bench_sigv4.py

Prints a table in microseconds per request (the best of several timed
batches). Bounded: about half a second per figure, well under a minute.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from twisted.internet.defer import maybeDeferred  # noqa: E402
from twisted.internet.task import Clock  # noqa: E402
from twisted.web.http_headers import Headers  # noqa: E402

from twisted_relay.logins.aws import AwsKeys, AwsSigV4Login  # noqa: E402
from twisted_relay.logins.base import Credentials, CredentialSource  # noqa: E402
from twisted_relay.body_pool import DIGESTED_ON_THREAD  # noqa: E402
from twisted_relay.logins.sigv4 import SigV4Signer, amz_date  # noqa: E402

SIZES = (0, 10_000, 200_000, 2_000_000)
BUDGET_SECONDS = 0.5
URL = (
    "https://bedrock-runtime.us-east-1.amazonaws.com/model/"
    "arn:aws:bedrock:us-east-1:123456789012:application-inference-profile%2Fhq2of259skzs/invoke-with-response-stream"
)
HEADERS = [
    (b"content-type", b"application/json"),
    (b"accept", b"application/vnd.amazon.eventstream"),
    (b"x-amzn-bedrock-accept", b"application/json"),
    (b"anthropic-version", b"2023-06-01"),
    (b"user-agent", b"claude-cli/2.1.104 (external, cli)"),
    (b"x-app", b"cli"),
    (b"x-claude-code-session-id", b"3f1c9a52-7d41-4f0e-9b1e-2d6c8e0f5a77"),
    (b"x-stainless-lang", b"js"),
    (b"x-stainless-package-version", b"0.70.0"),
    (b"x-stainless-os", b"Linux"),
    (b"x-stainless-arch", b"x64"),
    (b"x-stainless-runtime", b"node"),
    (b"x-stainless-retry-count", b"0"),
]
KEYS = AwsKeys("ASIAEXAMPLEEXAMPLE00", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "IQoJb3JpZ2luX2VjE" + "x" * 600)


class _Inline:
    """Runs the bench's fetch (no I/O) at once, in place of the logins' threads."""

    @staticmethod
    def run(fetch):
        return maybeDeferred(fetch)


def body_of(size: int) -> bytes:
    """A JSON-looking body of ``size`` bytes (SHA-256 costs the same whatever the bytes)."""
    unit = b'{"type":"text","text":"The quick brown fox jumps over the lazy dog."},'
    return (unit * (size // len(unit) + 1))[:size]


def per_call(run, repeat: int) -> float:
    """Best mean microseconds of ``run(repeat)`` over batches within the budget."""
    best = float("inf")
    spent = 0.0
    batches = 0
    while spent < BUDGET_SECONDS or batches < 3:
        start = time.perf_counter()
        run(repeat)
        elapsed = time.perf_counter() - start
        best = min(best, elapsed / repeat)
        spent += elapsed
        batches += 1
    return best * 1e6


def measure(size: int) -> dict[str, float]:
    body = body_of(size)
    repeat = max(5, min(2000, 20_000_000 // max(size, 1)))
    figures = {}

    def hash_only(n):
        for _ in range(n):
            hashlib.sha256(body).hexdigest()

    figures["sha256"] = per_call(hash_only, repeat)

    signer = SigV4Signer("bedrock", "us-east-1")
    date = amz_date(time.time())
    grouped = [(name, [value]) for name, value in HEADERS] + [
        (b"x-amz-date", [date.encode()]),
        (b"x-amz-security-token", [KEYS.session_token.encode()]),
    ]

    def ours(n):
        for _ in range(n):
            signer.authorization(b"POST", URL, grouped, body, KEYS.access_key_id, KEYS.secret_access_key, date)

    figures["signer"] = per_call(ours, repeat)

    clock = Clock()
    clock.advance(time.time())
    source = CredentialSource(clock, _Inline(), lambda: Credentials(KEYS, None), "bench keys")
    login = AwsSigV4Login(clock, source, "bedrock", "us-east-1")
    login.start()
    template = Headers()
    for name, value in HEADERS:
        template.addRawHeader(name, value)

    def authorize(n):
        for _ in range(n):
            login.authorize(b"POST", URL, template.copy(), body)

    def copy_only(n):
        for _ in range(n):
            template.copy()

    digest = hashlib.sha256(body).hexdigest()

    def authorize_given(n):
        for _ in range(n):
            login.authorize(b"POST", URL, template.copy(), body, body_sha256=digest)

    copying = per_call(copy_only, repeat)
    figures["authorize"] = per_call(authorize, repeat) - copying
    # The signing proper: authorize given the body's hash.
    figures["signing"] = per_call(authorize_given, max(repeat, 2000)) - copying
    if size < DIGESTED_ON_THREAD:
        figures["reactor"] = figures["authorize"]
    else:
        figures["handover"] = handover_us(size)
        figures["reactor"] = figures["signing"] + figures["handover"]

    try:
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials as BotocoreCredentials
    except ImportError:
        figures["botocore"] = float("nan")
        return figures
    auth = SigV4Auth(BotocoreCredentials(KEYS.access_key_id, KEYS.secret_access_key, KEYS.session_token), "bedrock", "us-east-1")
    text_headers = {name.decode(): value.decode() for name, value in HEADERS}
    # add_auth alone: the requests are made before each timed batch.
    best = float("inf")
    spent = 0.0
    batches = 0
    while spent < BUDGET_SECONDS or batches < 3:
        requests = [AWSRequest(method="POST", url=URL, data=body, headers=text_headers) for _ in range(repeat)]
        start = time.perf_counter()
        for request in requests:
            auth.add_auth(request)
        elapsed = time.perf_counter() - start
        best = min(best, elapsed / repeat)
        spent += elapsed
        batches += 1
    figures["botocore"] = best * 1e6
    return figures


# A child process: a running reactor hands bodies' hashes to its thread
# pool one after the other (BodyPool.digest, as the request path does),
# and prints the reactor thread's CPU time per body, in microseconds.
_HANDOVER = """
import sys, time
from twisted.internet import reactor
from twisted_relay.body_pool import BodyPool
size, count = int(sys.argv[1]), int(sys.argv[2])
body, pool, spent = b"x" * size, BodyPool(reactor, workers=0), []
async def run():
    await pool.digest(body)  # the pool's threads started
    best = float("inf")
    for _ in range(5):
        began = time.thread_time()
        for _ in range(count):
            await pool.digest(body)
        best = min(best, (time.thread_time() - began) / count)
    spent.append(best)
def go():
    from twisted.internet.defer import Deferred
    Deferred.fromCoroutine(run()).addBoth(lambda _: reactor.stop())
reactor.callWhenRunning(go)
reactor.run()
print(spent[0] * 1e6)
"""


def handover_us(size: int, count: int = 200) -> float:
    """The reactor thread's CPU per body whose SHA-256 it hands to a thread (``BodyPool.digest``)."""
    import subprocess

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
    done = subprocess.run([sys.executable, "-c", _HANDOVER, str(size), str(count)], capture_output=True,
                          timeout=120, cwd=root, env=dict(os.environ, PYTHONPATH=root), check=True)
    return float(done.stdout.decode().split()[-1])


def main() -> None:
    print("SigV4 per request, microseconds (best batch mean)")
    print("%10s %10s %10s %11s %10s %10s" % ("body", "sha256", "signer", "authorize", "reactor", "botocore"))
    rows = [(size, measure(size)) for size in SIZES]
    for size, f in rows:
        print("%10s %10.1f %10.1f %11.1f %10.1f %10.1f" % (
            "%d B" % size, f["sha256"], f["signer"], f["authorize"], f["reactor"], f["botocore"]))
    empty = rows[0][1]
    print(
        "fixed part (no body): signer %.1f us, authorize %.1f us, botocore %.1f us; the rest is the body's SHA-256"
        % (empty["signer"], empty["authorize"], empty["botocore"])
    )
    print("reactor: what the request path's signing costs the reactor's thread (the hash on a thread from %d KB,"
          " its hand-over %s)" % (DIGESTED_ON_THREAD // 1024, ", ".join(
              "%.1f us at %d KB" % (f["handover"], size // 1000) for size, f in rows if "handover" in f)))


if __name__ == "__main__":
    main()
