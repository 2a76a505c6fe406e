"""Side-by-side benchmark: jobserver on SQLite and on PostgreSQL against
durable beanstalkd and Redis.

    python bench/run.py            # full run (see below for PostgreSQL)
    python bench/run.py --quick    # smoke run, a few minutes
    python bench/run.py --server-root ../other-checkout --only jobserver
    python bench/run.py --quick --only jobserver-pg2 --postgres postgresql://u@host/db

Starts beanstalkd (binlog, fsync on every write: `-b DIR -f0`) and
redis-server (AOF, `appendfsync always`) on free loopback ports, installing
them with apt-get when they are missing, and jobserver on a fresh SQLite
database with `--synchronous FULL`. Every peer is driven by the same kind
of client (bench/clients.py): separate processes with plain sockets,
100-byte jobs.

jobserver on PostgreSQL runs as two peers, each on a database of its own
that the run creates and drops on the server named by --postgres (default
$JOBSERVER_BENCH_POSTGRES, else the local trust-authenticated `postgres`
user on 127.0.0.1:5432; it must name a database to connect to, from which
the bench's are made):

- jobserver-pg: one node;
- jobserver-pg2: two nodes on the same database. The 8-client loads'
  clients alternate between them; one-client loads and the wake go to the
  first. Its server CPU is both nodes'.

Without them the full run takes about a quarter of an hour; with them,
longer, mostly in the drain of 1,000,000 jobs, which PostgreSQL serves at
a few thousand jobs a second here.

Scenarios, each peer in turn:

- create with 1 client, then with 8: CreateJob; put; LPUSH;
- take with 8 clients: GetJob + FinishJob; reserve-with-timeout 0 +
  delete; LMOVE to a processing list + LREM (the reliable-queue pattern);
- wake: from sending a create to the worker blocked in a take holding the
  job (p50, p99);
- bulk create: one client queues the drain's 1,000,000 jobs (10,000 with
  --quick) 1,000 per round trip:
  CreateJobs; 1,000 puts pipelined (beanstalkd has no bulk command); LPUSH
  with 1,000 values;
- drain: 8 workers empty that queue 100 jobs per round trip: GetJobs
  numResults 100, then one FinishJobs for them all; 100
  reserve-with-timeout 0 pipelined, then their deletes pipelined; 100 LMOVEs
  into the worker's own processing list pipelined, then one DEL of it;
- wake across nodes, jobserver-pg2 only: the worker waits in GetJob on the
  first node, the create goes through the second, whose commit notifies
  the first (LISTEN/NOTIFY).

While jobserver on SQLite runs its scenarios, a thread samples the size of
its log (`bench.db-wal`) every 20 ms; the table's last row is the largest
it reached. SQLite reuses the log from its start only once a checkpoint has
copied all of it, which under writes that never pause may never happen.

After each scenario the server's CPU per operation is the growth of utime +
stime in /proc/PID/stat (the whole process, all its threads, and the
kernel's work on its behalf: socket calls, fsync) divided by the
operations. It is counted in clock ticks, so a scenario's total is exact to
1/SC_CLK_TCK seconds (10 ms), which makes --quick's small figures rough.
For the PostgreSQL peers the same is counted, in rows of their own, for
the PostgreSQL backends serving the bench's database (the processes on
this machine whose command line names it): the storage work that SQLite
does inside jobserver's process.

Then jobserver alone (bench/scale.py): take rate with a large queue against
a small one, thousands of connections blocked in GetJob, Ping latency while
large batches commit.

The tables, with jobserver's ratios to each peer, are printed and appended
to bench/RESULTS.md with the date, the machine and the command. Only ratios
measured in one run mean anything: these machines are shared and their
speed moves by a quarter between runs.

`--server-root DIR` benchmarks the jobserver checkout at DIR (its server and
the databases it fills), e.g. another branch's worktree; the default is the
checkout this script is in. If that jobserver lacks FinishJobs (it answers
`430 Unrecognized command`), the drain is reported as not measured.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit, urlunsplit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import scale  # noqa: E402
from clients import CLIENTS, FILL_BATCH, Client, Unsupported  # noqa: E402

WORKERS = 8


@dataclass(frozen=True)
class Sizes:
    put1: int  # creates by the one client
    put8: int  # creates by each of 8 clients
    wake: int  # wake rounds
    drain: int  # jobs in the bulk drain, a multiple of FILL_BATCH


QUICK = Sizes(put1=1000, put8=500, wake=100, drain=10_000)
FULL = Sizes(put1=5000, put8=3000, wake=500, drain=1_000_000)


# Server CPU.


def server_cpu(pid: int) -> float:
    """Seconds of CPU the process has used so far, all its threads: utime +
    stime, fields 14 and 15 of /proc/PID/stat."""
    # Field 2, the command name in parentheses, may hold spaces: count the
    # fields from the last parenthesis, where field 3 starts.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def database_cpu(database: str) -> dict[int, float]:
    """Seconds of CPU used so far by each process on this machine whose
    command line names `database`: the PostgreSQL backends serving it
    ("postgres: 15/main: USER DATABASE 127.0.0.1(PORT) idle")."""
    used = {}
    word = f" {database} ".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if word in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "):
                used[pid] = server_cpu(pid)
        except OSError:  # it ended, or is not ours to read
            continue
    return used


class Cpu(NamedTuple):
    """A peer's CPU so far, in seconds."""

    server: float  # all its nodes
    database: dict[int, float]  # its PostgreSQL backends by PID; empty for the others


def record_cpu(figures: dict[str, float], key: str, peer: Peer, before: Cpu, ops: int) -> None:
    """Figures `key`_cpu and, for a peer on PostgreSQL, `key`_pgcpu: the CPU
    its nodes and its backends used since `before`, in µs per operation."""
    after = peer.cpu()
    figures[f"{key}_cpu"] = (after.server - before.server) / ops * 1e6
    if after.database:
        # A backend that started since counts from zero; one that ended
        # since is lost (the nodes keep theirs open, so there are few).
        used = sum(t - before.database.get(pid, 0.0) for pid, t in after.database.items())
        figures[f"{key}_pgcpu"] = used / ops * 1e6


def metered(
    figures: dict[str, float], key: str, peer: Peer,
    scenario: Callable[..., tuple[int, float]], *args: object,
) -> None:
    """Run scenario(*args), which returns (operations, seconds); record its
    operations per second as figure `key`, and its CPU per operation."""
    before = peer.cpu()
    ops, seconds = scenario(*args)
    figures[key] = ops / seconds
    record_cpu(figures, key, peer, before, ops)


# Workloads. Those with several clients run each in its own process, so the
# clients' Python does not share one interpreter.


class Go(NamedTuple):
    """How _parallel starts its workers together."""

    ready: multiprocessing.Queue  # each worker puts one item once connected
    event: Event  # set when all are


def _ready(go: Go) -> float:
    """Say this worker is connected, wait for the others; return the start."""
    go.ready.put(None)
    go.event.wait()
    return time.perf_counter()


def _put_worker(go: Go, out: multiprocessing.Queue, kind: str, port: int, count: int) -> None:
    client = CLIENTS[kind](port)
    began = _ready(go)
    for _ in range(count):
        client.put()
    out.put((count, time.perf_counter() - began))


def _take_worker(go: Go, out: multiprocessing.Queue, kind: str, port: int, count: int) -> None:
    client = CLIENTS[kind](port)
    began = _ready(go)
    done = 0
    while done < count and client.take():
        done += 1
    out.put((done, time.perf_counter() - began))


def _drain_worker(go: Go, out: multiprocessing.Queue, kind: str, port: int) -> None:
    client = CLIENTS[kind](port)
    began = _ready(go)
    done = 0
    while taken := client.drain_batch():
        done += taken
    out.put((done, time.perf_counter() - began))


def _parallel(
    target: Callable, kind: str, ports: list[int], *args: object
) -> tuple[int, float]:
    """Run a process of `target` for each of `ports`, a client of `kind`
    connected to that port, all at once; return the operations they did in
    all and the seconds the slowest took. They start together, once all
    have connected, so no one works alone while others connect."""
    out: multiprocessing.Queue = multiprocessing.Queue()
    go = Go(multiprocessing.Queue(), multiprocessing.Event())
    procs = [multiprocessing.Process(target=target, args=(go, out, kind, port, *args))
             for port in ports]
    for p in procs:
        p.start()
    for _ in procs:
        go.ready.get(timeout=60)
    go.event.set()
    results = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    return sum(n for n, _ in results), max(t for _, t in results)


def _fill(client: Client, jobs: int) -> tuple[int, float]:
    began = time.perf_counter()
    for _ in range(jobs // FILL_BATCH):
        client.fill()
    return jobs, time.perf_counter() - began


def _wake_waiter(
    kind: str, port: int, rounds: int, ready: multiprocessing.Queue, out: multiprocessing.Queue
) -> None:
    client = CLIENTS[kind](port)
    for _ in range(rounds):
        ready.put(None)
        handle = client.wait_take()
        out.put(time.perf_counter())
        client.done(handle)


def wake_latency(
    kind: str, waiter_port: int, producer_port: int, rounds: int
) -> tuple[float, float]:
    """p50 and p99, in microseconds, from sending a put to producer_port to
    the worker blocked on waiter_port holding the job."""
    ready: multiprocessing.Queue = multiprocessing.Queue()
    out: multiprocessing.Queue = multiprocessing.Queue()
    waiter = multiprocessing.Process(
        target=_wake_waiter, args=(kind, waiter_port, rounds, ready, out)
    )
    waiter.start()
    producer = CLIENTS[kind](producer_port)
    samples = []
    for _ in range(rounds):
        ready.get(timeout=30)
        time.sleep(0.005)  # let the waiter's request reach the server and block
        sent = time.perf_counter()
        producer.wake_put()
        samples.append((out.get(timeout=30) - sent) * 1e6)
    waiter.join()
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


# Peers.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_port(port: int, proc: subprocess.Popen) -> None:
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{proc.args!r} did not open port {port}")


class Unavailable(Exception):
    """A peer that cannot run here; the message says why."""


def ensure_installed(binary: str, package: str) -> bool:
    if shutil.which(binary):
        return True
    apt = ["apt-get", "install", "-y", "-qq", package]
    if os.geteuid() != 0:
        apt = ["sudo", "-n", *apt]
    subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
    subprocess.run(apt, capture_output=True)
    return shutil.which(binary) is not None


class Node(NamedTuple):
    """One server process and the port it serves."""

    port: int
    proc: subprocess.Popen

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Peer:
    """A server under test: one process, or several nodes serving one queue."""

    name: str  # its column in the table
    client: str  # its client in bench/clients.py
    nodes: list[Node]
    database: BenchDatabase | None = None  # where jobserver-pg keeps its queue
    wal: Path | None = None  # jobserver's SQLite log, watched for its size

    @property
    def port(self) -> int:
        """Where the one-client loads go: the first node."""
        return self.nodes[0].port

    def ports(self, clients: int) -> list[int]:
        """The ports of `clients` clients spread evenly over the nodes."""
        return [self.nodes[n % len(self.nodes)].port for n in range(clients)]

    def cpu(self) -> Cpu:
        database = database_cpu(self.database.name) if self.database else {}
        return Cpu(sum(server_cpu(node.proc.pid) for node in self.nodes), database)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self.database:
            self.database.drop()


def start_jobserver(workdir: Path, root: Path) -> Peer:
    port = free_port()
    proc = scale.start_server(workdir / "bench.db", port, root, "--synchronous", "FULL")
    wait_port(port, proc)
    return Peer("jobserver", "jobserver", [Node(port, proc)], wal=workdir / "bench.db-wal")


DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"


@dataclass(frozen=True)
class BenchDatabase:
    """A PostgreSQL database made for one peer and dropped after it. Its
    name is new, so the processes whose command line names it are the
    backends serving this peer and no one else."""

    server: str  # the URL of a database on the same server, to create and drop from
    name: str
    described: str  # the server's version and durability settings, for the notes

    @classmethod
    def create(cls, server: str) -> BenchDatabase:
        # Imported here: only the PostgreSQL peers need psycopg.
        try:
            import psycopg
            from psycopg import sql
        except ImportError as error:
            raise Unavailable("psycopg is missing: pip install 'jobserverd[postgres]'") from error
        name = f"jobserver_bench_{secrets.token_hex(4)}"
        try:
            with psycopg.connect(server, autocommit=True, connect_timeout=5) as db:
                db.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                version = db.info.server_version  # e.g. 150020 for 15.20
                settings = db.execute(
                    "SELECT string_agg(name || ' ' || setting, ', ' ORDER BY name) FROM pg_settings"
                    " WHERE name IN ('fsync', 'synchronous_commit')"
                ).fetchone()
        except psycopg.Error as error:
            raise Unavailable(f"PostgreSQL at {server} cannot be used: {error}") from error
        described = f"{version // 10000}.{version % 10000} ({settings[0] if settings else '?'})"
        return cls(server, name, described)

    @property
    def url(self) -> str:
        return urlunsplit(urlsplit(self.server)._replace(path=f"/{self.name}"))

    def drop(self) -> None:
        """The database, and the Query role its node made (roles are the
        whole server's: each run left one behind)."""
        import psycopg
        from psycopg import sql

        from jobserver.storage.postgres_query import role_name

        with psycopg.connect(self.server, autocommit=True, connect_timeout=5) as db:
            db.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name))
            )
            role = role_name(self.name, "public")
            db.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def start_jobserver_pg(root: Path, server: str, name: str, nodes: int) -> Peer:
    """`nodes` jobserver nodes serving one queue in a new database."""
    if not (root / "jobserver" / "storage" / "postgres.py").exists():
        raise Unavailable(f"the jobserver at {root} has no PostgreSQL backend")
    database = BenchDatabase.create(server)
    peer = Peer(name, "jobserver", [], database)
    try:
        # One after the other: the first creates the tables the next finds.
        for _ in range(nodes):
            port = free_port()
            proc = scale.start_server(database.url, port, root)
            peer.nodes.append(Node(port, proc))
            wait_port(port, proc)
    except BaseException:
        peer.stop()
        raise
    return peer


def start_beanstalkd(workdir: Path) -> Peer:
    if not ensure_installed("beanstalkd", "beanstalkd"):
        raise Unavailable("not installable here")
    port = free_port()
    binlog = workdir / "beanstalkd"
    binlog.mkdir()
    proc = subprocess.Popen(
        ["beanstalkd", "-l", "127.0.0.1", "-p", str(port), "-b", str(binlog), "-f0"]
    )
    wait_port(port, proc)
    return Peer("beanstalkd", "beanstalkd", [Node(port, proc)])


def start_redis(workdir: Path) -> Peer:
    if not ensure_installed("redis-server", "redis-server"):
        raise Unavailable("not installable here")
    port = free_port()
    data = workdir / "redis"
    data.mkdir()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
         "--appendonly", "yes", "--appendfsync", "always", "--save", "",
         "--daemonize", "no", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL,
    )
    wait_port(port, proc)
    return Peer("redis", "redis", [Node(port, proc)])


# The run.


@dataclass
class Measured:
    figures: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class WalWatch:
    """The largest size SQLite's log (`-wal`) reaches while the scenarios
    run, sampled every WAL_SAMPLE_SECONDS in a thread of its own: under
    sustained writes a log whose checkpoints never complete only grows."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self.largest = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> WalWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(WAL_SAMPLE_SECONDS):
            with contextlib.suppress(FileNotFoundError):
                self.largest = max(self.largest, self._path.stat().st_size)


WAL_SAMPLE_SECONDS = 0.02


def measure(peer: Peer, sizes: Sizes) -> Measured:
    if peer.wal is None:
        return measure_scenarios(peer, sizes)
    with WalWatch(peer.wal) as watch:
        m = measure_scenarios(peer, sizes)
    m.figures["wal_mb"] = watch.largest / 1e6
    return m


def measure_scenarios(peer: Peer, sizes: Sizes) -> Measured:
    kind, one, spread = peer.client, [peer.port], peer.ports(WORKERS)
    m = Measured()
    f = m.figures
    metered(f, "put1", peer, _parallel, _put_worker, kind, one, sizes.put1)
    metered(f, "put8", peer, _parallel, _put_worker, kind, spread, sizes.put8)
    # Each worker takes its share of what the creates queued: none runs
    # into an empty queue, whose answer would not be a take.
    share = (sizes.put1 + WORKERS * sizes.put8) // WORKERS
    metered(f, "take8", peer, _parallel, _take_worker, kind, spread, share)
    measure_wake(peer, "wake", peer.nodes[0], peer.nodes[0], sizes.wake, m)
    if len(peer.nodes) > 1:
        measure_wake(peer, "xwake", peer.nodes[0], peer.nodes[1], sizes.wake, m)
    measure_bulk(peer, sizes.drain, m)
    if peer.database and "put1_pgcpu" not in f:
        m.notes.append(
            f"{peer.name}: PostgreSQL CPU not measured: no process on this machine"
            f" names the database {peer.database.name}."
        )
    return m


def measure_wake(
    peer: Peer, key: str, waiter: Node, producer: Node, rounds: int, m: Measured
) -> None:
    """Wake latency with the worker waiting on one node and the create sent
    to another (or the same), and the CPU of a whole round."""
    before = peer.cpu()
    m.figures[f"{key}_p50"], m.figures[f"{key}_p99"] = wake_latency(
        peer.client, waiter.port, producer.port, rounds
    )
    record_cpu(m.figures, key, peer, before, rounds)


def measure_bulk(peer: Peer, jobs: int, m: Measured) -> None:
    """Queue `jobs` jobs in bulk from one client, then drain them with 8."""
    client = CLIENTS[peer.client](peer.port)
    try:
        client.check_drain()
        drainable = True
    except Unsupported as unsupported:
        m.notes.append(f"{peer.name}: drain not measured, the server answered {unsupported}.")
        drainable = False
    metered(m.figures, "fill", peer, _fill, client, jobs)
    if drainable:
        metered(m.figures, "drain", peer, _drain, peer, jobs)


def _drain(peer: Peer, jobs: int) -> tuple[int, float]:
    done, seconds = _parallel(_drain_worker, peer.client, peer.ports(WORKERS))
    if done != jobs:
        raise RuntimeError(f"{peer.name}: the drain took {done:,} jobs of {jobs:,}")
    return done, seconds


def rows(sizes: Sizes) -> list[tuple[str, str, str]]:
    """(figure, title, format) for each row of the peers' table."""
    rate, latency = "{:,.0f}", "{:,.0f}"
    return [
        ("put1", "create, 1 client (/s)", rate),
        *_cpu_rows("put1", "create, 1 client", "op"),
        ("put8", "create, 8 clients (/s)", rate),
        *_cpu_rows("put8", "create, 8 clients", "op"),
        ("take8", "take, 8 clients (/s)", rate),
        *_cpu_rows("take8", "take, 8 clients", "op"),
        ("wake_p50", "wake p50 (µs)", latency),
        ("wake_p99", "wake p99 (µs)", latency),
        *_cpu_rows("wake", "wake", "wake"),
        ("xwake_p50", "wake across nodes p50 (µs)", latency),
        ("xwake_p99", "wake across nodes p99 (µs)", latency),
        *_cpu_rows("xwake", "wake across nodes", "wake"),
        ("fill", f"bulk create {sizes.drain:,}, 1 client (jobs/s)", rate),
        *_cpu_rows("fill", "bulk create", "job"),
        ("drain", f"drain {sizes.drain:,}, 8 workers (jobs/s)", rate),
        *_cpu_rows("drain", "drain", "job"),
        ("wal_mb", "SQLite log (-wal) high-water mark, all scenarios (MB)", "{:,.1f}"),
    ]


def _cpu_rows(key: str, scenario: str, unit: str) -> list[tuple[str, str, str]]:
    return [
        (f"{key}_cpu", f"{scenario}: server CPU (µs/{unit})", "{:,.1f}"),
        (f"{key}_pgcpu", f"{scenario}: PostgreSQL CPU (µs/{unit})", "{:,.1f}"),
    ]


NOT_MEASURED = "n/m"
# The peers that are jobserver: the first of them measured is the one the
# others are compared with.
JOBSERVERS = ("jobserver", "jobserver-pg", "jobserver-pg2")


def table(results: dict[str, Measured], sizes: Sizes) -> str:
    """One row per figure some peer has, one column per peer, then the
    ratios: each other jobserver to the first, the first to each peer that
    is not jobserver."""
    peers = list(results)
    ours = [name for name in JOBSERVERS if name in results]
    ratios: list[tuple[str, str]] = []
    if ours:
        base = ours[0]
        ratios = [(name, base) for name in ours[1:]]
        ratios += [(base, name) for name in peers if name not in JOBSERVERS]
    header = ["scenario", *peers, *(f"{a} / {b}" for a, b in ratios)]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for key, title, fmt in rows(sizes):
        values = {name: m.figures.get(key) for name, m in results.items()}
        if all(value is None for value in values.values()):
            continue
        cells = [title, *(_cell(values[name], fmt) for name in peers)]
        cells += [_ratio(values[a], values[b]) for a, b in ratios]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float | None, fmt: str) -> str:
    return NOT_MEASURED if value is None else fmt.format(value)


def _ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None:
        return NOT_MEASURED
    # A peer's CPU can be under one clock tick for a whole scenario.
    return f"{ours / theirs:.2f}x" if theirs else "n/a"


def notes(results: dict[str, Measured], postgres: str | None) -> str:
    """What each scenario is for each peer; `postgres` describes the
    PostgreSQL server, when a peer ran on it."""
    lines = [
        "Create: CreateJob; put; LPUSH. Take: GetJob + FinishJob; reserve-with-timeout 0 +"
        " delete; LMOVE to a processing list + LREM.",
        "Wake: one create while a worker waits in GetJob with Connection: wait;"
        " reserve-with-timeout; BLMOVE. Its server CPU counts the whole round: create,"
        " hand-out, finish, the next wait.",
        f"Bulk create, {FILL_BATCH:,} jobs a round trip: CreateJobs; pipelined puts (beanstalkd"
        " has no bulk command); one LPUSH.",
        "Drain, 100 jobs a round trip: GetJobs numResults 100 + one FinishJobs for them; 100"
        " pipelined reserve-with-timeout 0 + their deletes pipelined; 100 pipelined LMOVEs to"
        " the worker's own processing list + one DEL of it.",
        "Server CPU: utime + stime of the server process over the scenario, per operation"
        f" (exact to {1000 / os.sysconf('SC_CLK_TCK'):g} ms per scenario).",
    ]
    if postgres:
        lines += [
            f"jobserver-pg: one node on PostgreSQL {postgres}, a database of its own"
            " made for the run. jobserver-pg2: two nodes on one"
            " database; 8-client loads alternate between them, 1-client loads and the wake go"
            " to the first; server CPU is both nodes'. Wake across nodes: the worker waits on"
            " the first node, the create goes through the second.",
            "PostgreSQL CPU: the same count for the backends serving the peer's database (the"
            " processes whose command line names it); the WAL writer's and checkpointer's"
            " work, shared with any other database, is not in it.",
        ]
    lines += [note for m in results.values() for note in m.notes]
    return "\n".join(lines)


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {model}, Python {platform.python_version()}"


def measure_scaling(workdir: Path, quick: bool, root: Path) -> dict[str, float]:
    big = 100_000 if quick else 1_000_000
    per_worker = 300 if quick else 2000
    waiters = 2000 if quick else 10_000
    figures: dict[str, float] = {"big": big, "waiters": waiters}
    for label, jobs in (("small", 1000), ("large", big)):
        db = workdir / f"{label}.db"
        scale.fill(db, jobs, root)
        port = free_port()
        proc = scale.start_server(db, port, root)
        try:
            wait_port(port, proc)
            figures[f"take_{label}"] = scale.take_rate(port, min(per_worker, jobs // 100))
        finally:
            proc.terminate()
            proc.wait(10)
    port = free_port()
    proc = scale.start_server(workdir / "waiters.db", port, root)
    try:
        wait_port(port, proc)
        figures["served"], figures["rss"] = scale.blocked_waiters(port, proc.pid, waiters)
        figures["ping_p50"], figures["ping_p99"] = scale.ping_under_batches(
            port, 3 if quick else 15
        )
    finally:
        proc.terminate()
        proc.wait(10)
    return figures


def scaling_table(f: dict[str, float]) -> str:
    return "\n".join([
        "| jobserver alone | figure |",
        "|---|---|",
        f"| take (GetJob+FinishJob), 8 workers, 1,000 queued | {f['take_small']:,.0f}/s |",
        f"| same, {f['big']:,.0f} queued (100 names) | {f['take_large']:,.0f}/s "
        f"({f['take_large'] / f['take_small']:.2f}x) |",
        f"| {f['waiters']:,.0f} connections blocked in GetJob, served exactly once | "
        f"{f['served']:,.0f} |",
        f"| server RSS with them all waiting | {f['rss']:,.0f} MB |",
        f"| Ping while 1000-job batches commit, p50 / p99 | "
        f"{f['ping_p50']:.2f} / {f['ping_p99']:.2f} ms |",
    ])


PEERS = [*JOBSERVERS, "beanstalkd", "redis"]


class Measurements(NamedTuple):
    results: dict[str, Measured]  # by peer
    postgres: str | None  # the PostgreSQL server described, if a peer ran on it


def measure_peers(names: list[str], sizes: Sizes, root: Path, postgres: str) -> Measurements:
    """Measure the peers named, in the order of PEERS; `postgres` is the
    URL of the server on which the PostgreSQL peers get their databases."""
    starters: dict[str, Callable[[Path], Peer]] = {
        "jobserver": lambda workdir: start_jobserver(workdir, root),
        "jobserver-pg": lambda _: start_jobserver_pg(root, postgres, "jobserver-pg", 1),
        "jobserver-pg2": lambda _: start_jobserver_pg(root, postgres, "jobserver-pg2", 2),
        "beanstalkd": start_beanstalkd,
        "redis": start_redis,
    }
    results: dict[str, Measured] = {}
    postgres_described = None
    with tempfile.TemporaryDirectory(prefix="jobserver-bench-") as tmp:
        for name in sorted(set(names), key=PEERS.index):
            try:
                peer = starters[name](Path(tmp))
            except Unavailable as why:
                print(f"skipped {name}: {why}")
                continue
            began = time.perf_counter()
            try:
                results[name] = measure(peer, sizes)
            finally:
                peer.stop()
            if peer.database:
                postgres_described = peer.database.described
            progress(f"{name} measured in {time.perf_counter() - began:.0f} s")
    return Measurements(results, postgres_described)


def progress(message: str) -> None:
    """A line on stderr, so a run of minutes shows it is moving."""
    print(message, file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, a few minutes")
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    parser.add_argument(
        "--only", choices=PEERS, action="append",
        help="measure only this peer (repeatable); implies --no-record",
    )
    parser.add_argument(
        "--postgres", metavar="URL",
        default=os.environ.get("JOBSERVER_BENCH_POSTGRES", DEFAULT_POSTGRES),
        help="a database on the PostgreSQL server where jobserver-pg and jobserver-pg2 each"
        " get a new database, dropped after (default: $JOBSERVER_BENCH_POSTGRES, else"
        f" {DEFAULT_POSTGRES})",
    )
    parser.add_argument(
        "--server-root", type=Path, default=ROOT, metavar="DIR",
        help="the jobserver checkout to benchmark (default: this one); implies --no-record",
    )
    args = parser.parse_args()
    command = "python bench/run.py" + (" --quick" if args.quick else "")
    sizes = QUICK if args.quick else FULL
    root = args.server_root.resolve()
    results, postgres = measure_peers(args.only or PEERS, sizes, root, args.postgres)
    report = table(results, sizes) + "\n\n" + notes(results, postgres)
    if "jobserver" in results:
        began = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="jobserver-scale-") as tmp:
            report += "\n\n" + scaling_table(measure_scaling(Path(tmp), args.quick, root))
        progress(f"jobserver alone measured in {time.perf_counter() - began:.0f} s")
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n{stamp}; {machine()}; `{command}`\n\n{report}\n")
    if not (args.no_record or args.only or root != ROOT):
        with open(HERE / "RESULTS.md", "a") as results_file:
            results_file.write(f"\n## {stamp}\n\n{machine()}; `{command}`\n\n{report}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
