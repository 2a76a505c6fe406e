from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from jobserver.server.app import Config, Server

sys.path.insert(0, str(Path(__file__).parent))
from wire import Client  # noqa: E402

START_TIMEOUT = 15.0


class ThreadServer:
    """A real server on a loopback port, run by trio in a thread."""

    def __init__(self, db: Path, **options: object) -> None:
        self.db = db
        settings: dict[str, object] = {"host": "127.0.0.1", "port": 0, "db": str(db), **options}
        self.server = Server(Config(**settings))  # type: ignore[arg-type]
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while self.server.port is None:
            if self.error is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {self.error!r}")
            time.sleep(0.005)
        self.port = self.server.port

    def _run(self) -> None:
        try:
            trio.run(self.server.run)
        except BaseException as error:  # reported to the test
            self.error = error

    def client(self, timeout: float = 10.0) -> Client:
        return Client(self.port, timeout)

    def stop(self) -> None:
        token = self.server.token
        if token is not None and self.thread.is_alive():
            try:
                token.run_sync_soon(self.server.request_stop)
            except trio.RunFinishedError:
                pass
        self.thread.join(15)
        assert not self.thread.is_alive(), "server did not stop"
        if self.error is not None:
            raise self.error


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ThreadServer]:
    running = ThreadServer(tmp_path / "jobs.db")
    yield running
    running.stop()


@pytest.fixture
def client(server: ThreadServer) -> Iterator[Client]:
    with server.client() as c:
        yield c


class ProcessServer:
    """The server as users run it: `python -m jobserver serve` in its own process."""

    def __init__(self, db: Path, *extra: str) -> None:
        self.db = db
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jobserver", "serve", "--port", "0", "--db", str(db), *extra],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.log: list[str] = []
        deadline = time.monotonic() + START_TIMEOUT
        assert self.proc.stderr is not None
        while True:
            line = self.proc.stderr.readline()
            if not line or time.monotonic() > deadline:
                raise RuntimeError("server did not start: " + "".join(self.log))
            self.log.append(line)
            found = re.search(r"listening on [\d.]+:(\d+)", line)
            if found:
                self.port = int(found.group(1))
                break

    def client(self, timeout: float = 10.0) -> Client:
        return Client(self.port, timeout)

    def wait(self, timeout: float = 10.0) -> int:
        code = self.proc.wait(timeout)
        assert self.proc.stderr is not None
        self.log += self.proc.stderr.readlines()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[type]:
    started: list[ProcessServer] = []

    def start(*extra: str, db: Path | None = None) -> ProcessServer:
        proc = ProcessServer(db or tmp_path / "jobs.db", *extra)
        started.append(proc)
        return proc

    yield start  # type: ignore[misc]
    for proc in started:
        proc.kill()
