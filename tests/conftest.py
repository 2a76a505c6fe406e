"""The fixtures every test module may ask for by name; the classes behind
them are in harness.py, shared helpers in helpers.py."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from harness import ManagerProcess, ServerProcess, ThreadServer
from powercut import BuildFailed, build
from tls_certs import Certificates, tls_server
from wire import Client


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ThreadServer]:
    running = ThreadServer(tmp_path / "jobs.db")
    yield running
    running.stop()


@pytest.fixture
def client(server: ThreadServer) -> Iterator[Client]:
    with server.client() as c:
        yield c


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """start_server(db=tmp_path/"jobs.db", *extra, wrapper=()) -> ServerProcess,
    once it listens or has given up; all are killed at the end."""
    started: list[ServerProcess] = []

    def start(db: Path | None = None, *extra: str, wrapper: Sequence[str] = ()) -> ServerProcess:
        proc = ServerProcess(db or tmp_path / "jobs.db", *extra, wrapper=wrapper)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


@pytest.fixture(scope="session")
def powercut_shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/powercut/powercut.so, compiled once per run. Without gcc the
    power-cut tests fail, saying so: CI must not pass them by skipping."""
    try:
        return build(tmp_path_factory.mktemp("powercut"))
    except BuildFailed as error:
        reason = str(error)
    pytest.fail(reason, pytrace=False)  # outside the except: the reason alone


@pytest.fixture
def secure(tmp_path: Path) -> Iterator[tuple[ThreadServer, Certificates]]:
    """A real server speaking TLS, and its certificate files."""
    with tls_server(tmp_path / "tls") as pair:
        yield pair


@pytest.fixture
def workers(tmp_path: Path) -> Path:
    """An empty directory for worker executables."""
    path = tmp_path / "workers"
    path.mkdir()
    return path


@pytest.fixture
def manager(workers: Path) -> Iterator[Callable[..., ManagerProcess]]:
    """manager(port, *extra, worker_path=workers) -> ManagerProcess, once it
    has started; all are stopped at the end."""
    started: list[ManagerProcess] = []

    def start(port: int, *extra: str, worker_path: Path = workers) -> ManagerProcess:
        proc = ManagerProcess(port, worker_path, *extra)
        started.append(proc)
        return proc.started()

    yield start
    for proc in started:
        proc.stop()
