"""
A real PostgreSQL server for tests: ``initdb`` in a new temporary folder,
then ``postgres`` on a free 127.0.0.1 port (no Unix socket), started and
stopped by the tests themselves. PostgreSQL refuses to run as root: under
root (CI) both run as the ``postgres`` user Debian's package makes (or
``nobody``), which owns the folder.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from tests.helpers import free_port


def _bin_folder() -> str | None:
    """The newest ``/usr/lib/postgresql/N/bin`` holding ``initdb`` and ``postgres``, or one on the PATH."""
    found = []
    for folder in glob.glob("/usr/lib/postgresql/*/bin"):
        version = os.path.basename(os.path.dirname(folder))
        if version.isdigit() and os.path.exists(os.path.join(folder, "initdb")):
            found.append((int(version), folder))
    if found:
        return max(found)[1]
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


BIN = _bin_folder()

try:
    import psycopg
except ImportError:  # the [postgres] extra (in [test]) is missing
    psycopg = None

#: Why PostgreSQL tests are skipped, or ``None`` when they can run.
SKIP_REASON = (
    "PostgreSQL is not installed (apt-get install postgresql; .ci/run installs it)"
    if BIN is None
    else "psycopg is not installed (pip install 'twisted-relay[postgres]')"
    if psycopg is None
    else None
)

#: The superuser's name and password in every test server.
USER = "relay"
PASSWORD = "pg-test-secret-7q2"


def _run_as() -> tuple[int, int] | None:
    """The (uid, gid) to run PostgreSQL as when this process is root, else ``None``."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return entry.pw_uid, entry.pw_gid
    raise RuntimeError("running as root, and there is no postgres or nobody user to run PostgreSQL as")


class PostgresServer:
    """
    One PostgreSQL server, its data in a temporary folder removed by
    :meth:`destroy`; :meth:`stop` and :meth:`start` keep the data and port.

    :ivar port: where it listens.
    """

    def __init__(self):
        self.port = free_port()
        self._identity = _run_as()
        self.folder = tempfile.mkdtemp(prefix="relay-test-pg-")
        self.data = os.path.join(self.folder, "data")
        self._process: subprocess.Popen | None = None
        self._databases = 0
        password_file = os.path.join(self.folder, "password")
        with open(password_file, "w") as f:
            f.write(PASSWORD + "\n")
        if self._identity is not None:
            os.chown(self.folder, *self._identity)
            os.chown(password_file, *self._identity)
        self._call(
            [os.path.join(BIN, "initdb"), "-D", self.data, "-U", USER, "--pwfile", password_file,
             "--auth", "scram-sha-256", "-E", "UTF8", "--no-sync"],
        )

    def _demote(self):
        if self._identity is not None:
            uid, gid = self._identity
            os.setgid(gid)
            os.setuid(uid)

    def _call(self, command: list[str]) -> None:
        result = subprocess.run(
            command, preexec_fn=self._demote, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120
        )
        if result.returncode != 0:
            raise RuntimeError("%s failed: %s" % (command[0], result.stdout.decode("utf-8", "replace")[-2000:]))

    def url(self, database: str = "postgres", *, password: str | None = PASSWORD) -> str:
        """A ``postgresql://`` URL of one of its databases."""
        secret = ":" + password if password is not None else ""
        return "postgresql://%s%s@127.0.0.1:%d/%s" % (USER, secret, self.port, database)

    def start(self, timeout: float = 30.0) -> None:
        """Start it and wait (bounded) until it accepts connections."""
        with open(os.path.join(self.folder, "server.log"), "ab") as log:
            self._process = subprocess.Popen(
                [os.path.join(BIN, "postgres"), "-D", self.data, "-p", str(self.port), "-c", "listen_addresses=127.0.0.1",
                 "-c", "unix_socket_directories=", "-c", "fsync=off", "-c", "max_connections=50"],
                preexec_fn=self._demote,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.url(), connect_timeout=2) as connection:
                    connection.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                pass
            if time.monotonic() > deadline or self._process.poll() is not None:
                self.stop()
                raise RuntimeError("postgres did not start; see %s" % (os.path.join(self.folder, "server.log"),))
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop it (its own process, by its handle: a fast shutdown) and wait for it."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def destroy(self) -> None:
        """Stop it and remove its folder."""
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def new_database(self, encoding: str | None = None) -> str:
        """A new, empty database (in ``encoding``, else the server's); its URL."""
        self._databases += 1
        name = "ledger_%d" % (self._databases,)
        with psycopg.connect(self.url(), autocommit=True) as connection:
            if encoding is None:
                connection.execute("CREATE DATABASE %s" % (name,))
            else:
                connection.execute(
                    "CREATE DATABASE %s TEMPLATE template0 ENCODING '%s' LC_COLLATE 'C' LC_CTYPE 'C'" % (name, encoding)
                )
        return self.url(name)

    def accepts(self) -> bool:
        """Whether something listens on its port."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False


_shared: PostgresServer | None = None


def shared_server() -> PostgresServer:
    """
    One server for every test of this process that needs one (each takes
    a new database of it): started at the first call, removed at exit. Trial
    has no per-module fixture; one start (about a second) per run keeps CI fast.
    """
    global _shared
    if _shared is None:
        import atexit

        server = PostgresServer()
        server.start()
        atexit.register(server.destroy)
        _shared = server
    return _shared
