"""The programs under test, run for tests: the server in a thread of the test
process (ThreadServer), and the server and the worker manager as users run
them, each in its own process (ServerProcess, ManagerProcess)."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import trio

from jobserver.server.app import Config, Server
from wire import Client

START_TIMEOUT = 15.0
# How long a manager is given to log a line a test waits for, or to stop.
MANAGER_TIMEOUT = 15.0
MANAGER = ["-m", "jobserver", "worker-manager"]
LISTENING = re.compile(r"listening on [\d.]+:(\d+)")


class ThreadServer:
    """A real server on a loopback port, run by trio in a thread."""

    def __init__(self, db: Path | str, **options: object) -> None:
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
        except BaseException as error:  # noqa: BLE001 - reported to the test
            self.error = error

    def client(self, timeout: float = 10.0) -> Client:
        return Client(self.port, timeout)

    def stop(self) -> None:
        token = self.server.token
        if token is not None and self.thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self.server.request_stop)
        self.thread.join(15)
        assert not self.thread.is_alive(), "server did not stop"
        if self.error is not None:
            raise self.error


class Nodes:
    """Several servers on one PostgreSQL queue, standing in for one server:
    each client a test opens goes to the next node, so a test that creates
    through one client and takes through another crosses nodes."""

    def __init__(self, url: str, count: int) -> None:
        self.db = url
        self.nodes: list[ThreadServer] = []
        try:
            for _ in range(count):
                self.nodes.append(ThreadServer(url))
        except BaseException:
            self.stop()
            raise
        self.port = self.nodes[0].port
        self._next = itertools.count()

    def client(self, timeout: float = 10.0) -> Client:
        return self.nodes[next(self._next) % len(self.nodes)].client(timeout)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class LoggedProcess:
    """A subprocess whose standard error a thread reads to the end: a process
    that logs a lot never blocks on a full pipe, and its log can be waited on."""

    def __init__(self, command: Sequence[str]) -> None:
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._lines: list[str] = []
        self._ended = False  # the log is read to its end
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    @property
    def log(self) -> str:
        with self._changed:
            return "".join(self._lines)

    def matching(self, pattern: str | re.Pattern[str], count: int, timeout: float) -> list[str]:
        """The first `count` log lines matching `pattern`, waiting for them at
        most `timeout` seconds; fewer when the log ends or time runs out first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [line for line in self._lines if re.search(pattern, line)]
                left = deadline - time.monotonic()
                if len(found) >= count or self._ended or left <= 0:
                    return found[:count]
                self._changed.wait(left)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 10.0) -> int:
        """The exit status, once the process has ended and its log is read."""
        code = self.proc.wait(timeout)
        with self._changed:
            self._changed.wait_for(lambda: self._ended, timeout)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait(10)


class ServerProcess(LoggedProcess):
    """`python -m jobserver serve` on a free port. A server that refuses to
    start is a result to look at (`started` is false, `wait` gives its exit
    status, `log` says why), not an exception."""

    def __init__(self, db: Path | str, *extra: str, wrapper: Sequence[str] = ()) -> None:
        """`wrapper`: a command that runs the server, such as setpriv."""
        serve = [sys.executable, "-m", "jobserver", "serve", "--port", "0", "--db", str(db)]
        super().__init__([*wrapper, *serve, *extra])
        self.db = db
        self.port: int | None = None
        found = self.matching(LISTENING, 1, START_TIMEOUT)
        listening = LISTENING.search(found[0]) if found else None
        if listening is not None:
            self.port = int(listening.group(1))
        elif not self._ended:
            self.kill()
            raise RuntimeError("server did not start: " + self.log)

    @property
    def started(self) -> bool:
        return self.port is not None

    def client(self, timeout: float = 10.0) -> Client:
        assert self.port is not None, "the server did not start:\n" + self.log
        return Client(self.port, timeout)


class ManagerProcess(LoggedProcess):
    """`jobserver worker-manager` in a subprocess, with its log collected."""

    def __init__(self, port: int, worker_path: Path, *extra: str) -> None:
        super().__init__(
            [
                sys.executable,
                *MANAGER,
                "--worker-path",
                str(worker_path),
                "--server",
                f"127.0.0.1:{port}",
                *extra,
            ]
        )

    def wait_for(
        self, pattern: str, count: int = 1, deadline: float = MANAGER_TIMEOUT
    ) -> list[str]:
        """The first `count` log lines matching `pattern`, waiting for them."""
        found = self.matching(pattern, count, deadline)
        if len(found) < count:
            raise AssertionError(f"no {count} lines matching {pattern!r} in:\n{self.log}")
        return found

    def started(self) -> ManagerProcess:
        self.wait_for("worker manager started")
        return self

    def stop(self) -> None:
        """Teardown: a second signal makes the manager kill its workers and
        exit. (Two signals sent at once would be seen as one.)"""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            with contextlib.suppress(AssertionError):
                self.wait_for("received SIGTERM", deadline=5)
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(MANAGER_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
