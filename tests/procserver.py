"""A `python -m jobserver serve` subprocess for the reliability tests.

Like conftest's ProcessServer, but its standard error is read to the end by
a thread, so a server that logs a lot (disk full, locked database) never
blocks on a full pipe, and a server that refuses to start is a result to
look at rather than an exception.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from wire import Client

START_TIMEOUT = 15.0


def poll_until(check: Callable[[], object], timeout: float, what: str, every: float = 0.005) -> object:
    """Call `check` until it returns something true; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


class ServerProcess:
    def __init__(self, db: Path, *extra: str, wrapper: Sequence[str] = ()) -> None:
        """`wrapper`: a command that runs the server, such as setpriv."""
        self.db = db
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "jobserver", "serve", "--port", "0", "--db", str(db), *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.port: int | None = None
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._listening = threading.Event()
        self._eof = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not (self._listening.is_set() or self._eof.is_set()):
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("server did not start: " + self.log)
            self._listening.wait(0.01)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._lock:
                self._lines.append(line)
            if self.port is None:
                found = re.search(r"listening on [\d.]+:(\d+)", line)
                if found:
                    self.port = int(found.group(1))
                    self._listening.set()
        self._eof.set()

    @property
    def started(self) -> bool:
        return self.port is not None

    @property
    def log(self) -> str:
        with self._lock:
            return "".join(self._lines)

    def client(self, timeout: float = 10.0) -> Client:
        assert self.port is not None, "the server did not start:\n" + self.log
        return Client(self.port, timeout)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 10.0) -> int:
        """The exit status, once the process has ended and its log is read."""
        code = self.proc.wait(timeout)
        self._eof.wait(timeout)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._eof.wait(10)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """start_server(db, *extra, wrapper=()) -> ServerProcess; all are killed at the end."""
    started: list[ServerProcess] = []

    def start(db: Path | None = None, *extra: str, wrapper: Sequence[str] = ()) -> ServerProcess:
        proc = ServerProcess(db or tmp_path / "jobs.db", *extra, wrapper=wrapper)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


LOCKER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=0)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
db.execute("ROLLBACK")
print("released", flush=True)
"""


@contextmanager
def locked(db: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holds the database's write lock until the block ends."""
    locker = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert locker.stdout is not None and locker.stdin is not None
    try:
        assert locker.stdout.readline() == "locked\n"
        yield locker
        locker.stdin.write("\n")
        locker.stdin.flush()
        assert locker.stdout.readline() == "released\n"
        assert locker.wait(10) == 0
    finally:
        if locker.poll() is None:
            locker.kill()
            locker.wait()
