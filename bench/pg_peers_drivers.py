"""The three peers of bench/pg_peers.py: installing them, starting them on a
database each, and the driver processes that run their shapes.

A driver is one process in the peer's own runtime (bench/peers/: Node for
Graphile Worker, PgQueuer's venv for PgQueuer, plain sockets for
jobserver), started as `DRIVER MODE ARGS`. It speaks lines:

- it connects, then says `ready`;
- the bench says `go` (any line) and starts its clock;
- it does the shape and says `done [JOBS]` (the jobs it handled, for a
  worker); the bench stops the clock and reads the CPU it and the backends
  have used, while it is still connected;
- the bench closes its stdin and it exits.

For the latency shape a worker (`work`) says `started NS` as each job's
handler starts, and a producer (`produce`) enqueues one job per line it
reads and says `sent NS`, the time just before it sent it: both read
CLOCK_MONOTONIC, one clock for every process on the machine.

Graphile Worker is installed with npm and PgQueuer with pip, each at run
time into a folder of its own under --peers-dir, never into the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NamedTuple

HERE = Path(__file__).resolve().parent
DRIVERS = HERE / "peers"
sys.path.insert(0, str(HERE))

import scale  # noqa: E402
from run import (  # noqa: E402
    BenchDatabase,
    Node,
    Unavailable,
    database_cpu,
    free_port,
    server_cpu,
    wait_port,
)

DEFAULT_PEERS_DIR = Path.home() / ".cache" / "jobserver-bench"


class Cpu(NamedTuple):
    """CPU seconds used so far by a peer's parts."""

    database: dict[int, float]  # the backends serving its database, by PID
    server: float  # jobserver's node; 0 for the peers that have none
    driver: float  # the driver process: the client, or the worker


def cpu_used(before: Cpu, after: Cpu) -> tuple[float, float, float]:
    """Seconds of (PostgreSQL, server, driver) CPU between two readings.
    A backend that started since counts from zero."""
    database = sum(t - before.database.get(pid, 0.0) for pid, t in after.database.items())
    return database, after.server - before.server, after.driver - before.driver


@dataclass
class Peer:
    """A queue under test, on a database of its own."""

    name: str  # its column in the table
    version: str  # what was installed, for the table's header
    database: BenchDatabase
    command: list[str]  # the driver, without its mode
    env: dict[str, str]
    clear_sql: str  # deletes every job it holds
    node: Node | None = None  # jobserver's server process
    logs: Path = field(default_factory=Path)  # where drivers' stderr goes
    unlogged: list[str] = field(default_factory=list)  # its UNLOGGED tables, if any

    def cpu(self, driver: subprocess.Popen) -> Cpu:
        return Cpu(
            database_cpu(self.database.name),
            server_cpu(self.node.proc.pid) if self.node else 0.0,
            server_cpu(driver.pid),
        )

    def clear(self) -> None:
        """Delete every job, between shapes, so each starts from an empty
        queue; not timed."""
        import psycopg

        with psycopg.connect(self.database.url, autocommit=True) as db:
            db.execute(self.clear_sql)

    def check_durable(self) -> None:
        """Note the tables whose writes skip PostgreSQL's log (none, for
        all three as installed): a crash would lose their jobs."""
        import psycopg

        with psycopg.connect(self.database.url, autocommit=True) as db:
            rows = db.execute(
                "SELECT relname FROM pg_class WHERE relpersistence = 'u' AND relkind = 'r'"
            ).fetchall()
        self.unlogged = [row[0] for row in rows]

    def stop(self) -> None:
        if self.node:
            self.node.stop()
        self.database.drop()


class Driver:
    """One driver process of a peer (see the module's docstring)."""

    def __init__(self, peer: Peer, *args: object) -> None:
        self.peer = peer
        self.mode = str(args[0])
        self.log = peer.logs / f"{peer.name}-{args[0]}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [*peer.command, *map(str, args)], env=peer.env, text=True, bufsize=1,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            )

    def expect(self, word: str) -> list[str]:
        """Read the next line, which must start with `word`; its other words."""
        assert self.proc.stdout
        line = self.proc.stdout.readline()
        if not line.startswith(word):
            raise RuntimeError(
                f"{self.peer.name} {self.mode}: expected {word!r}, got {line!r};"
                f" its stderr: {self.log.read_text()[-2000:]}"
            )
        return line.split()[1:]

    def send(self) -> None:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin
        stdin.write("go\n")
        stdin.flush()

    def close(self) -> None:
        """Close its stdin, which ends it, and wait for it."""
        assert self.proc.stdin
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_once(peer: Peer, *args: object) -> None:
    """A driver mode with no clock: it only says `done`."""
    driver = Driver(peer, *args)
    driver.expect("done")
    driver.close()


# Installing.


def install_graphile(peers_dir: Path) -> tuple[Path, str]:
    """graphile-worker's newest release, installed with npm into a folder
    of its own; the folder and a description of what runs it."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not (node and npm):
        raise Unavailable("node and npm are needed: apt-get install nodejs npm")
    folder = peers_dir / "graphile-worker"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "package.json").exists():
        (folder / "package.json").write_text('{"private": true}\n')
    npm_run = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--loglevel=error", "graphile-worker@latest"],
        cwd=folder, capture_output=True, text=True,
    )
    installed = folder / "node_modules" / "graphile-worker" / "package.json"
    if not installed.exists():
        raise Unavailable(f"npm install graphile-worker failed: {npm_run.stderr[-500:]}")
    version = _json_field(installed, "version")
    node_version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout
    # npm only warns when Node is older than the release asks for: say so.
    wanted = json.loads(installed.read_text()).get("engines", {}).get("node", "any")
    described = f"{version} (Node {node_version.strip()}; it asks for {wanted})"
    if npm_run.returncode:
        described += ", npm could not update it"
    return folder, described


def install_pgqueuer(peers_dir: Path) -> tuple[Path, str]:
    """pgqueuer's newest release and asyncpg, installed with pip into a venv
    of their own; the venv's Python and a description."""
    venv = peers_dir / "pgqueuer-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--upgrade", "pgqueuer", "asyncpg"],
        capture_output=True, text=True,
    )
    versions = subprocess.run(
        [str(python), "-c", "from importlib.metadata import version as v;"
         " print(v('pgqueuer'), v('asyncpg'))"],
        capture_output=True, text=True,
    )
    if versions.returncode:
        raise Unavailable(f"pip install pgqueuer failed: {pip.stderr[-500:]}")
    pgqueuer, asyncpg = versions.stdout.split()
    described = f"{pgqueuer} (asyncpg {asyncpg})"
    if pip.returncode:
        described += ", pip could not update it"
    return python, described


def _json_field(path: Path, name: str) -> str:
    value: str = json.loads(path.read_text())[name]
    return value


# Starting.


def start_jobserver(root: Path, postgres: str, logs: Path) -> Peer:
    """One jobserver node serving a new database."""
    if not (root / "jobserver" / "storage" / "postgres.py").exists():
        raise Unavailable(f"the jobserver at {root} has no PostgreSQL backend")
    database = BenchDatabase.create(postgres)
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    env = {**os.environ, "BENCH_PORT": ""}
    peer = Peer(
        "jobserver-pg", commit or str(root), database,
        [sys.executable, str(DRIVERS / "jobserver_driver.py")], env, "DELETE FROM jobs",
        logs=logs,
    )
    try:
        port = free_port()
        # Only when asked: an older checkout (--server-root) has no --writers.
        writers = os.environ.get("BENCH_JOBSERVER_WRITERS", "0")
        options = ("--writers", writers) if writers != "0" else ()
        proc = scale.start_server(database.url, port, root, *options)
        peer.node = Node(port, proc)
        wait_port(port, proc)
    except BaseException:
        peer.stop()
        raise
    env["BENCH_PORT"] = str(port)
    return peer


def start_graphile(peers_dir: Path, postgres: str, logs: Path) -> Peer:
    folder, version = install_graphile(peers_dir)
    database = BenchDatabase.create(postgres)
    env = {**os.environ, "BENCH_DATABASE_URL": database.url, "GRAPHILE_WORKER_DIR": str(folder)}
    peer = Peer(
        "graphile-worker", version, database,
        [shutil.which("node") or "node", str(DRIVERS / "graphile.mjs")], env,
        "DELETE FROM graphile_worker._private_jobs", logs=logs,
    )
    _setup(peer, "migrate")
    return peer


def start_pgqueuer(peers_dir: Path, postgres: str, logs: Path) -> Peer:
    python, version = install_pgqueuer(peers_dir)
    database = BenchDatabase.create(postgres)
    env = {**os.environ, "BENCH_DATABASE_URL": database.url}
    peer = Peer(
        "pgqueuer", version, database, [str(python), str(DRIVERS / "pgqueuer_driver.py")],
        env, "DELETE FROM pgqueuer", logs=logs,
    )
    _setup(peer, "install")
    return peer


def _setup(peer: Peer, mode: str) -> None:
    """Create the peer's tables, dropping its database if that fails."""
    try:
        run_once(peer, mode)
    except BaseException:
        peer.database.drop()
        raise
