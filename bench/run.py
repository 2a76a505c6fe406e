"""Side-by-side benchmark: jobserver against durable beanstalkd and Redis.

    python bench/run.py            # full run, a few minutes
    python bench/run.py --quick    # smoke run, under a minute

Starts beanstalkd (binlog, fsync on every write: `-b DIR -f0`) and
redis-server (AOF, `appendfsync always`) on free loopback ports, installing
them with apt-get when they are missing, and jobserver on a fresh database
with `--synchronous FULL`. Every peer is driven by the same kind of client:
separate processes with plain sockets, 100-byte jobs. Prints one table with
the ratios against the peers, and appends it to bench/RESULTS.md.

Only ratios measured in one run mean anything: these machines are shared
and their speed moves by a quarter between runs.

`--server-root DIR` benchmarks the jobserver checkout at DIR (its server and
the databases it fills), e.g. another branch's worktree; the default is the
checkout this script is in.
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
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import scale  # noqa: E402
from clients import CLIENTS  # noqa: E402

# Workloads, each run in separate client processes.


def _put_worker(kind: str, port: int, count: int, start: float, out: multiprocessing.Queue) -> None:
    client = CLIENTS[kind](port)
    while time.time() < start:
        time.sleep(0.001)
    began = time.perf_counter()
    for _ in range(count):
        client.put()
    out.put((count, time.perf_counter() - began))


def _take_worker(
    kind: str, port: int, count: int, start: float, out: multiprocessing.Queue
) -> None:
    client = CLIENTS[kind](port)
    while time.time() < start:
        time.sleep(0.001)
    began = time.perf_counter()
    done = 0
    while done < count and client.take():
        done += 1
    out.put((done, time.perf_counter() - began))


def _parallel(target: Callable, kind: str, port: int, clients: int, per_client: int) -> float:
    """Run `clients` processes at once; return operations per second."""
    out: multiprocessing.Queue = multiprocessing.Queue()
    start = time.time() + 0.5
    procs = [
        multiprocessing.Process(target=target, args=(kind, port, per_client, start, out))
        for _ in range(clients)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    total = sum(n for n, _ in results)
    return total / max(t for _, t in results)


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
        return s.getsockname()[1]


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


def measure(peer: Peer, quick: bool) -> dict[str, float]:
    n1 = 1000 if quick else 5000
    n8 = 500 if quick else 3000
    rounds = 100 if quick else 500
    kind, port = peer.name, peer.port
    figures: dict[str, float] = {}
    figures["put1"] = _parallel(_put_worker, kind, port, 1, n1)
    figures["put8"] = _parallel(_put_worker, kind, port, 8, n8)
    total = n1 + 8 * n8
    figures["take8"] = _parallel(_take_worker, kind, port, 8, total // 8)
    figures["wake_p50"], figures["wake_p99"] = wake_latency(kind, port, rounds)
    return figures


COLUMNS = [
    ("put1", "put, 1 client (/s)", "{:,.0f}"),
    ("put8", "put, 8 clients (/s)", "{:,.0f}"),
    ("take8", "take, 8 clients (/s)", "{:,.0f}"),
    ("wake_p50", "wake p50 (µs)", "{:,.0f}"),
    ("wake_p99", "wake p99 (µs)", "{:,.0f}"),
]


def table(results: dict[str, dict[str, float]]) -> str:
    lines = ["| peer | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for name, figures in results.items():
        cells = [fmt.format(figures[key]) for key, _, fmt in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ours = results.get("jobserver")
    for name, figures in results.items():
        if name == "jobserver" or ours is None:
            continue
        cells = [f"{ours[key] / figures[key]:.2f}x" for key, _, _ in COLUMNS]
        lines.append(f"| jobserver / {name} | " + " | ".join(cells) + " |")
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
            port, 5 if quick else 15
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


def measure_peers(names: list[str], quick: bool, root: Path) -> dict[str, dict[str, float]]:
    starters: dict[str, Callable[[Path], Peer | None]] = {
        "jobserver": lambda workdir: start_jobserver(workdir, root),
        "beanstalkd": start_beanstalkd,
        "redis": start_redis,
    }
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="jobserver-bench-") as tmp:
        for name in names:
            peer = starters[name](Path(tmp))
            if peer is None:
                print(f"skipped {name}: not installable here")
                continue
            try:
                results[name] = measure(peer, quick)
            finally:
                peer.stop()
    return results


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
    root = args.server_root.resolve()
    results = measure_peers(args.only or ["jobserver", "beanstalkd", "redis"], args.quick, root)
    if "jobserver" in results:
        with tempfile.TemporaryDirectory(prefix="jobserver-scale-") as tmp:
            scaling = measure_scaling(Path(tmp), args.quick, root)
    else:
        scaling = {}
    report = table(results) + ("\n\n" + scaling_table(scaling) if scaling else "")
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n{stamp}; {machine()}; `{command}`\n\n{report}\n")
    if not (args.no_record or args.only or root != ROOT):
        with open(HERE / "RESULTS.md", "a") as results_file:
            results_file.write(f"\n## {stamp}\n\n{machine()}; `{command}`\n\n{report}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
