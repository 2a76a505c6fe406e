"""Side-by-side benchmark: jobserver against durable beanstalkd and Redis.

    python bench/run.py            # full run, about a quarter of an hour
    python bench/run.py --quick    # smoke run, under a minute
    python bench/run.py --server-root ../other-checkout --only jobserver

Starts beanstalkd (binlog, fsync on every write: `-b DIR -f0`) and
redis-server (AOF, `appendfsync always`) on free loopback ports, installing
them with apt-get when they are missing, and jobserver on a fresh database
with `--synchronous FULL`. Every peer is driven by the same kind of client
(bench/clients.py): separate processes with plain sockets, 100-byte jobs.

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
  into the worker's own processing list pipelined, then one DEL of it.

After each scenario the server's CPU per operation is the growth of utime +
stime in /proc/PID/stat (the whole process, all its threads, and the
kernel's work on its behalf: socket calls, fsync) divided by the
operations. It is counted in clock ticks, so a scenario's total is exact to
1/SC_CLK_TCK seconds (10 ms), which makes --quick's small figures rough.

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
import multiprocessing
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import NamedTuple

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


def metered(
    pid: int, scenario: Callable[..., tuple[int, float]], *args: object
) -> tuple[float, float]:
    """Run scenario(*args), which returns (operations, seconds); return its
    operations per second and the server's CPU per operation in µs."""
    before = server_cpu(pid)
    ops, seconds = scenario(*args)
    return ops / seconds, (server_cpu(pid) - before) / ops * 1e6


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


def _parallel(target: Callable, clients: int, *args: object) -> tuple[int, float]:
    """Run `clients` processes of `target` at once; return the operations
    they did in all and the seconds the slowest took. They start together,
    once all have connected, so no one works alone while others connect."""
    out: multiprocessing.Queue = multiprocessing.Queue()
    go = Go(multiprocessing.Queue(), multiprocessing.Event())
    procs = [multiprocessing.Process(target=target, args=(go, out, *args))
             for _ in range(clients)]
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


def wake_latency(kind: str, port: int, rounds: int) -> tuple[float, float]:
    """p50 and p99, in microseconds, from sending a put to the blocked
    worker holding the job."""
    ready: multiprocessing.Queue = multiprocessing.Queue()
    out: multiprocessing.Queue = multiprocessing.Queue()
    waiter = multiprocessing.Process(target=_wake_waiter, args=(kind, port, rounds, ready, out))
    waiter.start()
    producer = CLIENTS[kind](port)
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


def ensure_installed(binary: str, package: str) -> bool:
    if shutil.which(binary):
        return True
    apt = ["apt-get", "install", "-y", "-qq", package]
    if os.geteuid() != 0:
        apt = ["sudo", "-n", *apt]
    subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
    subprocess.run(apt, capture_output=True)
    return shutil.which(binary) is not None


@dataclass
class Peer:
    name: str
    port: int
    proc: subprocess.Popen

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_jobserver(workdir: Path, root: Path) -> Peer:
    port = free_port()
    proc = scale.start_server(workdir / "bench.db", port, root, "--synchronous", "FULL")
    wait_port(port, proc)
    return Peer("jobserver", port, proc)


def start_beanstalkd(workdir: Path) -> Peer | None:
    if not ensure_installed("beanstalkd", "beanstalkd"):
        return None
    port = free_port()
    binlog = workdir / "beanstalkd"
    binlog.mkdir()
    proc = subprocess.Popen(
        ["beanstalkd", "-l", "127.0.0.1", "-p", str(port), "-b", str(binlog), "-f0"]
    )
    wait_port(port, proc)
    return Peer("beanstalkd", port, proc)


def start_redis(workdir: Path) -> Peer | None:
    if not ensure_installed("redis-server", "redis-server"):
        return None
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
    return Peer("redis", port, proc)


# The run.


@dataclass
class Measured:
    figures: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def measure(peer: Peer, sizes: Sizes) -> Measured:
    kind, port, pid = peer.name, peer.port, peer.proc.pid
    m = Measured()
    f = m.figures
    f["put1"], f["put1_cpu"] = metered(pid, _parallel, _put_worker, 1, kind, port, sizes.put1)
    f["put8"], f["put8_cpu"] = metered(
        pid, _parallel, _put_worker, WORKERS, kind, port, sizes.put8
    )
    # Each worker takes its share of what the creates queued: none runs
    # into an empty queue, whose answer would not be a take.
    share = (sizes.put1 + WORKERS * sizes.put8) // WORKERS
    f["take8"], f["take8_cpu"] = metered(pid, _parallel, _take_worker, WORKERS, kind, port, share)
    before = server_cpu(pid)
    f["wake_p50"], f["wake_p99"] = wake_latency(kind, port, sizes.wake)
    f["wake_cpu"] = (server_cpu(pid) - before) / sizes.wake * 1e6
    measure_bulk(peer, sizes.drain, m)
    return m


def measure_bulk(peer: Peer, jobs: int, m: Measured) -> None:
    """Queue `jobs` jobs in bulk from one client, then drain them with 8."""
    client = CLIENTS[peer.name](peer.port)
    try:
        client.check_drain()
        drainable = True
    except Unsupported as unsupported:
        m.notes.append(f"{peer.name}: drain not measured, the server answered {unsupported}.")
        drainable = False
    pid = peer.proc.pid
    m.figures["fill"], m.figures["fill_cpu"] = metered(pid, _fill, client, jobs)
    if drainable:
        m.figures["drain"], m.figures["drain_cpu"] = metered(pid, _drain, peer, jobs)


def _drain(peer: Peer, jobs: int) -> tuple[int, float]:
    done, seconds = _parallel(_drain_worker, WORKERS, peer.name, peer.port)
    if done != jobs:
        raise RuntimeError(f"{peer.name}: the drain took {done:,} jobs of {jobs:,}")
    return done, seconds


def rows(sizes: Sizes) -> list[tuple[str, str, str]]:
    """(figure, title, format) for each row of the peers' table."""
    rate, cpu, latency = "{:,.0f}", "{:,.1f}", "{:,.0f}"
    return [
        ("put1", "create, 1 client (/s)", rate),
        ("put1_cpu", "create, 1 client: server CPU (µs/op)", cpu),
        ("put8", "create, 8 clients (/s)", rate),
        ("put8_cpu", "create, 8 clients: server CPU (µs/op)", cpu),
        ("take8", "take, 8 clients (/s)", rate),
        ("take8_cpu", "take, 8 clients: server CPU (µs/op)", cpu),
        ("wake_p50", "wake p50 (µs)", latency),
        ("wake_p99", "wake p99 (µs)", latency),
        ("wake_cpu", "wake: server CPU (µs/wake)", cpu),
        ("fill", f"bulk create {sizes.drain:,}, 1 client (jobs/s)", rate),
        ("fill_cpu", "bulk create: server CPU (µs/job)", cpu),
        ("drain", f"drain {sizes.drain:,}, 8 workers (jobs/s)", rate),
        ("drain_cpu", "drain: server CPU (µs/job)", cpu),
    ]


NOT_MEASURED = "n/m"


def table(results: dict[str, Measured], sizes: Sizes) -> str:
    peers = list(results)
    others = [name for name in peers if name != "jobserver"] if "jobserver" in results else []
    header = ["scenario", *peers, *(f"jobserver / {name}" for name in others)]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for key, title, fmt in rows(sizes):
        values = {name: m.figures.get(key) for name, m in results.items()}
        cells = [title, *(_cell(values[name], fmt) for name in peers)]
        cells += [_ratio(values["jobserver"], values[name]) for name in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float | None, fmt: str) -> str:
    return NOT_MEASURED if value is None else fmt.format(value)


def _ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None:
        return NOT_MEASURED
    # A peer's CPU can be under one clock tick for a whole scenario.
    return f"{ours / theirs:.2f}x" if theirs else "n/a"


def notes(results: dict[str, Measured]) -> str:
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


def measure_peers(names: list[str], sizes: Sizes, root: Path) -> dict[str, Measured]:
    starters: dict[str, Callable[[Path], Peer | None]] = {
        "jobserver": lambda workdir: start_jobserver(workdir, root),
        "beanstalkd": start_beanstalkd,
        "redis": start_redis,
    }
    results: dict[str, Measured] = {}
    with tempfile.TemporaryDirectory(prefix="jobserver-bench-") as tmp:
        for name in names:
            peer = starters[name](Path(tmp))
            if peer is None:
                print(f"skipped {name}: not installable here")
                continue
            began = time.perf_counter()
            try:
                results[name] = measure(peer, sizes)
            finally:
                peer.stop()
            progress(f"{name} measured in {time.perf_counter() - began:.0f} s")
    return results


def progress(message: str) -> None:
    """A line on stderr, so a run of minutes shows it is moving."""
    print(message, file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, under a minute")
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    parser.add_argument(
        "--only", choices=["jobserver", "beanstalkd", "redis"], action="append",
        help="measure only this peer (repeatable); implies --no-record",
    )
    parser.add_argument(
        "--server-root", type=Path, default=ROOT, metavar="DIR",
        help="the jobserver checkout to benchmark (default: this one); implies --no-record",
    )
    args = parser.parse_args()
    command = "python bench/run.py" + (" --quick" if args.quick else "")
    sizes = QUICK if args.quick else FULL
    root = args.server_root.resolve()
    results = measure_peers(args.only or ["jobserver", "beanstalkd", "redis"], sizes, root)
    report = table(results, sizes) + "\n\n" + notes(results)
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
