"""The fixtures every test module may ask for by name; the classes behind
them are in harness.py, shared helpers in helpers.py."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import pg
import pg_pool
from driver import open_store

from harness import ManagerProcess, Nodes, ServerProcess, ThreadServer
from helpers import chromium
from jobserver.storage.interface import Storage
from powercut import BuildFailed, build
from tls_certs import Certificates, tls_server
from wire import Client

BACKENDS = ("sqlite", "postgres")
# Three servers on one PostgreSQL schema, each client of a test going to
# the next one (harness.Nodes).
NODES = "postgres-3-nodes"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "backends(nodes=False, only=None): run each test of the module on every backend (the "
        "`backend` fixture), with nodes=True on three PostgreSQL nodes too, with "
        "only='sqlite' on that backend alone",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Modules marked `backends` run every test once per backend; the
    others on SQLite alone."""
    if "backend" in metafunc.fixturenames:
        mark = metafunc.definition.get_closest_marker("backends")
        backends: tuple[str, ...] = ("sqlite",)
        if mark is not None and "only" in mark.kwargs:
            backends = (mark.kwargs["only"],)
        elif mark is not None:
            backends = (*BACKENDS, NODES) if mark.kwargs.get("nodes") else BACKENDS
        metafunc.parametrize("backend", backends, indirect=True)


def pytest_sessionstart(session: pytest.Session) -> None:
    # Once per run: in the controller, before xdist's workers start.
    if not hasattr(session.config, "workerinput"):
        pg.recreate_database()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        pg.drop_database()


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    return str(getattr(request, "param", "sqlite"))


@pytest.fixture
def db(backend: str, tmp_path: Path) -> Iterator[Path | str]:
    """Where the server keeps its jobs: a SQLite file, or a PostgreSQL URL
    with a schema of the test's own, its tables made and empty (one an
    earlier test of this process emptied: pg_pool.py; pg.fresh_schema for
    one with no tables)."""
    if backend == "sqlite":
        yield tmp_path / "jobs.db"
        return
    with pg_pool.pooled_schema() as url:
        yield url


@pytest.fixture
def server(backend: str, db: Path | str) -> Iterator[ThreadServer | Nodes]:
    running = Nodes(str(db), 3) if backend == NODES else ThreadServer(db)
    yield running
    running.stop()


@pytest.fixture
def client(server: ThreadServer) -> Iterator[Client]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def module_servers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str, str], ThreadServer | Nodes]]:
    """module_servers(backend, role) -> the server of that backend (as the
    `server` fixture makes it) that the module's tests of one role share,
    started at its first test and stopped at the module's end: for tests
    that need no server of their own (a server on PostgreSQL cost some 0.1 s
    of a test, three nodes 0.3 s)."""
    started: dict[tuple[str, str], ThreadServer | Nodes] = {}
    with contextlib.ExitStack() as stack:

        def shared(backend: str, role: str) -> ThreadServer | Nodes:
            if (backend, role) not in started:
                db: Path | str
                if backend == "sqlite":
                    db = tmp_path_factory.mktemp(role) / "jobs.db"
                else:
                    db = stack.enter_context(pg_pool.pooled_schema())
                running = Nodes(str(db), 3) if backend == NODES else ThreadServer(db)
                stack.callback(running.stop)
                started[backend, role] = running
            return started[backend, role]

        yield shared


# Clients of servers a module's tests share (module_servers): tests of
# refused requests, or of jobs of their own, need no server of their own.


@pytest.fixture
def untouched(
    backend: str, module_servers: Callable[[str, str], ThreadServer | Nodes]
) -> Iterator[Client]:
    """A client of a server nothing is ever stored on: the tests of refused
    requests share it, and each still finds the queue empty after its own
    (one refusal that stored a job would fail the tests after it too)."""
    with module_servers(backend, "untouched").client() as c:
        yield c


@pytest.fixture
def shared(
    backend: str, module_servers: Callable[[str, str], ThreadServer | Nodes]
) -> Iterator[Client]:
    """A client of a server that tests create jobs on and then look at
    their own jobs alone, by jobID; none moves a job, so every job there
    stays QUEUED."""
    with module_servers(backend, "shared").client() as c:
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


@pytest.fixture
def store(backend: str, db: Path | str) -> Iterator[Storage]:
    """A store opened straight on the test's database: the driver suite
    (test_driver*.py) calls its operations itself."""
    opened = open_store(backend, db)
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for a module's browser tests."""
    with chromium() as launched:
        yield launched


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    """Where screenshots go: $JOBSERVER_TEST_ARTIFACTS, else the test's own
    directory; never the repository."""
    directory = Path(os.environ.get("JOBSERVER_TEST_ARTIFACTS") or tmp_path)
    directory.mkdir(parents=True, exist_ok=True)
    return directory
