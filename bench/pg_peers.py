"""jobserver on PostgreSQL against the PostgreSQL job queues: Graphile
Worker (npm) and PgQueuer (PyPI), each on a database of its own on the same
server.

    python bench/pg_peers.py                  # 3 rounds, full sizes
    python bench/pg_peers.py --quick          # smaller sizes
    python bench/pg_peers.py --server-root ../other-checkout --rounds 5
    python bench/pg_peers.py --record         # also append to bench/RESULTS.md

jobserver runs as one node (`python -m jobserver serve --db postgresql://...`)
from the checkout this script is in, or --server-root's. Graphile Worker's
newest release is installed with npm and PgQueuer's with pip, at run time,
into folders of their own under --peers-dir (default
~/.cache/jobserver-bench), never into the repository. Each peer gets a
database made for the run on the server --postgres names, dropped at the
end.

Four shapes, the same for each peer, each run by one process of the peer's
own (bench/peers/, described in bench/pg_peers_drivers.py):

1. single enqueue: one client, one job per request or transaction:
   CreateJob; addJob; enqueue(name, payload);
2. batch insert: one call per 1,000 jobs: CreateJobs; addJobs; enqueue of
   three lists;
3. drain: jobs inserted 1,000 a call beforehand, then one worker process
   empties the queue with a no-op handler, in the configuration each
   documents for speed: jobserver, GetJobs numResults 100 + one FinishJobs
   per batch on --jobserver-connections connections (threads, default 4);
   Graphile Worker, its performance page's: concurrentJobs 24, a pool of
   25, localQueue size 500, completeJobBatchDelay 0 and failJobBatchDelay
   0; PgQueuer, QueueManager.run in drain mode with --pgqueuer-batch jobs
   per dequeue and per batch of completions (default 500: of 10, its
   default, 100 and 500, 500 drained fastest here; 1, 4, 8 and 16
   connections for jobserver were within this machine's noise, 4 used the
   least CPU per job);
4. idle enqueue-to-start latency: a worker waits on an empty queue (GetJob
   with Connection: wait; the drain's worker configurations); a producer
   process enqueues one job; the latency is from just before the producer
   sends it to the worker's handler starting, both read from
   CLOCK_MONOTONIC. A pause of 50 to 150 ms between samples.

Rounds interleave: each round runs every shape for every peer before the
next round starts; the table gives each figure's median over the rounds.
Between shapes every job is deleted, untimed; the planner's statistics are
left to autovacuum, as in use (an ANALYZE of the emptied tables there made
jobserver's next drain half as fast).

CPU per job is split three ways: the PostgreSQL backends serving the peer's
database (processes whose command line names it, as bench/run.py counts
them), jobserver's node (the peers have none: n/a), and the peer's driver
process (the client, or the worker). Each is utime + stime from
/proc/PID/stat, exact to a clock tick (10 ms) per shape.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
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

from pg_peers_drivers import (  # noqa: E402
    DEFAULT_PEERS_DIR,
    Driver,
    Peer,
    cpu_used,
    start_graphile,
    start_jobserver,
    start_pgqueuer,
)
from run import DEFAULT_POSTGRES, Unavailable, machine, progress  # noqa: E402

BATCH = 1000  # jobs per batch insert


@dataclass(frozen=True)
class Sizes:
    single: int  # jobs enqueued one at a time
    batches: int  # batch inserts of BATCH jobs
    drain: int  # jobs drained, a multiple of BATCH
    samples: int  # latency samples


FULL = Sizes(single=2000, batches=20, drain=50_000, samples=50)
QUICK = Sizes(single=500, batches=5, drain=10_000, samples=20)
WARM_UP = 3  # latency samples not counted: the worker's first wait may not be in place


Figures = dict[str, float]


def timed(peer: Peer, jobs: int, key: str, *args: object) -> Figures:
    """Run a driver mode from `go` to `done`: its jobs per second and CPU
    per job as figures `key`, `key`_pg, `key`_server, `key`_driver."""
    driver = Driver(peer, *args)
    try:
        driver.expect("ready")
        before = peer.cpu(driver.proc)
        began = time.perf_counter()
        driver.send()
        handled = driver.expect("done")
        seconds = time.perf_counter() - began
        after = peer.cpu(driver.proc)
    finally:
        driver.close()
    if handled and int(handled[0]) != jobs:
        raise RuntimeError(f"{peer.name}: {args[0]} handled {handled[0]} jobs of {jobs}")
    database, server, client = cpu_used(before, after)
    figures = {key: jobs / seconds, f"{key}_pg": database / jobs * 1e6,
               f"{key}_driver": client / jobs * 1e6}
    if peer.node:
        figures[f"{key}_server"] = server / jobs * 1e6
    return figures


def single(peer: Peer, sizes: Sizes) -> Figures:
    return timed(peer, sizes.single, "single", "single", sizes.single)


def batch(peer: Peer, sizes: Sizes) -> Figures:
    return timed(peer, sizes.batches * BATCH, "batch", "batch", sizes.batches, BATCH, "enq")


def drain(peer: Peer, sizes: Sizes) -> Figures:
    fill = Driver(peer, "batch", sizes.drain // BATCH, BATCH, "noop")
    fill.expect("ready")
    fill.send()
    fill.expect("done")
    fill.close()
    return timed(peer, sizes.drain, "drain", "drain", sizes.drain)


def latency(peer: Peer, sizes: Sizes) -> Figures:
    """p50 and p99 in ms from enqueue to the idle worker's handler start."""
    worker, producer = Driver(peer, "work"), Driver(peer, "produce")
    samples = []
    try:
        worker.expect("ready")
        producer.expect("ready")
        for n in range(WARM_UP + sizes.samples):
            time.sleep(random.uniform(0.05, 0.15))
            producer.send()
            (sent,) = producer.expect("sent")
            (started,) = worker.expect("started")
            if n >= WARM_UP:
                samples.append((int(started) - int(sent)) / 1e6)
    finally:
        producer.close()
        worker.close()
    samples.sort()
    return {"lat_p50": statistics.median(samples),
            "lat_p99": samples[max(0, round(len(samples) * 0.99) - 1)]}


SHAPES: list[tuple[str, Callable[[Peer, Sizes], Figures]]] = [
    ("single enqueue", single), ("batch insert", batch), ("drain", drain),
    ("latency", latency),
]


def measure(peers: list[Peer], sizes: Sizes, rounds: int) -> dict[str, Figures]:
    """Every shape for every peer, round after round; the median of each
    figure over the rounds, by peer."""
    taken: dict[str, dict[str, list[float]]] = {peer.name: {} for peer in peers}
    for n in range(rounds):
        for shape, run_shape in SHAPES:
            for peer in peers:
                began = time.perf_counter()
                for key, value in run_shape(peer, sizes).items():
                    taken[peer.name].setdefault(key, []).append(value)
                peer.clear()
                progress(f"round {n + 1}/{rounds}: {peer.name} {shape}"
                         f" in {time.perf_counter() - began:.1f} s")
    return {name: {key: statistics.median(values) for key, values in figures.items()}
            for name, figures in taken.items()}


# The table.

RATE, CPU, MS = "{:,.0f}", "{:,.1f}", "{:,.2f}"


def rows(sizes: Sizes) -> list[tuple[str, str, str]]:
    """(figure, title, format) for each row."""
    return [
        ("single", f"single enqueue, {sizes.single:,} jobs (jobs/s)", RATE),
        *_cpu_rows("single", "single enqueue", "client"),
        ("batch", f"batch insert, {sizes.batches} x {BATCH:,} (jobs/s)", RATE),
        *_cpu_rows("batch", "batch insert", "client"),
        ("drain", f"drain {sizes.drain:,}, 1 worker process (jobs/s)", RATE),
        *_cpu_rows("drain", "drain", "worker"),
        ("lat_p50", "idle enqueue-to-start p50 (ms)", MS),
        ("lat_p99", "idle enqueue-to-start p99 (ms)", MS),
    ]


def _cpu_rows(key: str, shape: str, driver: str) -> list[tuple[str, str, str]]:
    return [
        (f"{key}_pg", f"{shape}: PostgreSQL CPU (µs/job)", CPU),
        (f"{key}_server", f"{shape}: server CPU (µs/job)", CPU),
        (f"{key}_driver", f"{shape}: {driver} CPU (µs/job)", CPU),
        (f"{key}_total", f"{shape}: total CPU (µs/job)", CPU),
    ]


def add_totals(figures: Figures) -> None:
    for key in ("single", "batch", "drain"):
        if f"{key}_pg" in figures:
            figures[f"{key}_total"] = sum(
                figures.get(f"{key}_{part}", 0.0) for part in ("pg", "server", "driver")
            )


OURS = "jobserver-pg"


def table(results: dict[str, Figures], peers: list[Peer], sizes: Sizes, postgres: str) -> str:
    names = [peer.name for peer in peers]
    others = [name for name in names if name != OURS]
    header = [f"shape (PostgreSQL {postgres})",
              *(f"{peer.name} {peer.version}" for peer in peers),
              *(f"{OURS} / {name}" for name in others if OURS in names)]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for key, title, fmt in rows(sizes):
        values = {name: results[name].get(key) for name in names}
        cells = [title, *("n/a" if v is None else fmt.format(v) for v in values.values())]
        if OURS in names:
            cells += [_ratio(values[OURS], values[name]) for name in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None:
        return "n/a"
    return f"{ours / theirs:.2f}x" if theirs else "n/a"


def notes(args: argparse.Namespace, sizes: Sizes, peers: list[Peer]) -> str:
    return "\n".join([
        f"Median of {args.rounds} interleaved rounds. Ratios are jobserver-pg / peer: above 1 is"
        " better for rates, below 1 is better for CPU and latency.",
        "Single enqueue: CreateJob; addJob; enqueue(name, payload), one client. Batch insert:"
        f" CreateJobs; addJobs; enqueue with lists, {BATCH:,} jobs a call. 100-byte payloads.",
        f"Drain of {sizes.drain:,} jobs inserted beforehand, by one worker process: jobserver,"
        " GetJobs numResults 100 + one FinishJobs per batch on"
        f" {args.jobserver_connections} connections (threads), the node's --writers"
        f" {args.jobserver_writers or 'its default'};"
        " Graphile Worker, concurrentJobs 24, pool 25, localQueue size 500,"
        " completeJobBatchDelay 0, failJobBatchDelay 0 (its performance page's); PgQueuer,"
        f" QueueManager.run(batch_size={args.pgqueuer_batch}, mode=drain) on asyncpg.",
        f"Latency: {sizes.samples} samples ({WARM_UP} more not counted), 50-150 ms apart, from"
        " just before the producer process sends the job to the waiting worker's handler"
        " starting (GetJob with Connection: wait returning, for jobserver).",
        "CPU: utime + stime per job of the backends serving the peer's database (PostgreSQL),"
        " jobserver's node (server; n/a for the peers, which have none) and the peer's"
        " client or worker process, exact to 10 ms per shape.",
        *(f"{peer.name}: UNLOGGED tables, not durable: {', '.join(peer.unlogged)}."
          for peer in peers if peer.unlogged),
    ])


STARTERS: dict[str, Callable[[argparse.Namespace, Path], Peer]] = {
    OURS: lambda args, logs: start_jobserver(args.server_root.resolve(), args.postgres, logs),
    "graphile-worker": lambda args, logs: start_graphile(args.peers_dir, args.postgres, logs),
    "pgqueuer": lambda args, logs: start_pgqueuer(args.peers_dir, args.postgres, logs),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    parser.add_argument(
        "--only", choices=list(STARTERS), action="append",
        help="measure only this peer (repeatable)",
    )
    parser.add_argument(
        "--postgres", metavar="URL",
        default=os.environ.get("JOBSERVER_BENCH_POSTGRES", DEFAULT_POSTGRES),
        help="a database on the server where each peer gets a new database, dropped after"
        f" (default: $JOBSERVER_BENCH_POSTGRES, else {DEFAULT_POSTGRES})",
    )
    parser.add_argument(
        "--server-root", type=Path, default=ROOT, metavar="DIR",
        help="the jobserver checkout to benchmark (default: this one)",
    )
    parser.add_argument(
        "--peers-dir", type=Path, metavar="DIR",
        default=Path(os.environ.get("JOBSERVER_BENCH_PEERS", DEFAULT_PEERS_DIR)),
        help="where Graphile Worker and PgQueuer are installed (default:"
        f" $JOBSERVER_BENCH_PEERS, else {DEFAULT_PEERS_DIR})",
    )
    parser.add_argument(
        "--jobserver-connections", type=int, default=4, metavar="N",
        help="connections (threads) of jobserver's drain worker (default 4)",
    )
    parser.add_argument(
        "--jobserver-writers", type=int, default=0, metavar="N",
        help="the jobserver node's --writers, transactions at once (default: the node's own)",
    )
    parser.add_argument(
        "--pgqueuer-batch", type=int, default=500, metavar="N",
        help="PgQueuer's batch_size, jobs per dequeue (default 500)",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    sizes = QUICK if args.quick else FULL
    command = " ".join(["python bench/pg_peers.py", *sys.argv[1:]])
    # The drivers' settings, in the environment they inherit.
    os.environ["BENCH_JOBSERVER_CONNECTIONS"] = str(args.jobserver_connections)
    os.environ["BENCH_JOBSERVER_WRITERS"] = str(args.jobserver_writers)
    os.environ["BENCH_PGQUEUER_BATCH"] = str(args.pgqueuer_batch)
    peers: list[Peer] = []
    with tempfile.TemporaryDirectory(prefix="jobserver-pg-peers-") as tmp:
        try:
            for name in args.only or list(STARTERS):
                try:
                    peers.append(STARTERS[name](args, Path(tmp)))
                except Unavailable as why:
                    print(f"skipped {name}: {why}")
            if not peers:
                return 1
            for peer in peers:
                peer.check_durable()
            results = measure(peers, sizes, args.rounds)
        finally:
            for peer in peers:
                peer.stop()
    for figures in results.values():
        add_totals(figures)
    postgres = peers[0].database.described
    report = table(results, peers, sizes, postgres) + "\n\n" + notes(args, sizes, peers)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n{stamp}; {machine()}; `{command}`\n\n{report}\n")
    if args.record:
        with open(HERE / "RESULTS.md", "a") as results_file:
            results_file.write(f"\n## {stamp}\n\n{machine()}; `{command}`\n\n{report}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
