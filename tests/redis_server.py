"""
A real ``redis-server`` for tests, on a free 127.0.0.1 port, started and
stopped by the test itself (no persistence, nothing written to disk).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

from tests.helpers import free_port

REDIS_SERVER = shutil.which("redis-server")

#: Why Redis tests are skipped, or ``None`` when they can run.
SKIP_REASON = (
    None
    if REDIS_SERVER is not None
    else "redis-server is not installed (apt-get install redis-server; .ci/run installs it)"
)


class RedisServer:
    """
    One ``redis-server`` process.

    :ivar port: where it listens (kept across :meth:`stop` and :meth:`start`).
    :param password: what it asks of clients (``requirepass``), if anything.
    """

    def __init__(self, port: int | None = None, *, password: str | None = None):
        self.port = port or free_port()
        self._password = password
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        """Start it and wait (bounded) until it accepts connections."""
        self._process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "yes",
             *(["--requirepass", self._password] if self._password else [])],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    # (With a password, an unauthenticated PING is refused: it answers.)
                    if sock.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self._process.poll() is not None:
                self.stop()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop it (this process only, by its own handle) and wait for it."""
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
