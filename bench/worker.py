"""The in-process Python worker's throughput beside the drain of
bench/run.py, measured in the same run on the same server:

    python bench/worker.py                 # 100,000 jobs
    python bench/worker.py --jobs 20000    # a quicker run

jobserver serves a fresh SQLite database with `--synchronous FULL`, as in
bench/run.py. Then:

- drain: bench/run.py's scenario, as it measures it: the jobs are queued
  1,000 per CreateJobs, then 8 processes empty the queue, each taking 100
  jobs per GetJobs and reporting them with one FinishJobs;
- worker: the same number of jobs queued the same way, then one
  `jobserver worker noop_worker:worker` (bench/noop_worker.py, a no-op
  `async def` handler) at its documented settings (--concurrency 8, its
  default prefetch, --log-level INFO) empties the queue; timed from the
  moment it has taken the first job to the moment the server has none
  left (the bench asks QueryJob every 5 ms for the first and the last job,
  then Status once the last is done).

For each: jobs a second, and CPU a job (utime + stime from /proc) of the
server and, for the worker, of its process. Only ratios measured in one
run mean anything: this machine is shared.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run  # noqa: E402
from clients import CLIENTS, FILL_BATCH  # noqa: E402

from jobserver.client import Client, JobNotFound  # noqa: E402

# How often the bench looks whether the worker is done: a QueryJob by jobID
# costs the server next to nothing.
POLL = 0.005


@dataclass
class WorkerRun:
    """What the worker's run measured."""

    rate: float  # jobs per second
    server_cpu: float  # µs of the server's CPU per job
    worker_cpu: float  # µs of the worker's CPU per job, all its processes


def worker_rate(
    peer: run.Peer, jobs: int, options: list[str], log_dir: Path
) -> WorkerRun:
    """Queue `jobs` jobs, run the worker until the server has none left;
    its jobs per second, and the CPU they cost."""
    filler = CLIENTS["jobserver"](peer.port)
    for _ in range(jobs // FILL_BATCH):
        filler.fill()
    command = [
        sys.executable, "-m", "jobserver", "worker", "noop_worker:worker",
        "--server", f"127.0.0.1:{peer.port}", *options,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(run.ROOT), str(HERE)])}
    # Its log goes to a file: a pipe nobody reads would stop it when full.
    with open(log_dir / "worker.log", "w") as log:
        proc = subprocess.Popen(command, cwd=HERE, env=env, stderr=log, stdout=subprocess.DEVNULL)
    try:
        with Client("127.0.0.1", peer.port) as client:
            first, last = _first_and_last(client)
            while _exists(client, first):
                if proc.poll() is not None:
                    raise RuntimeError("the worker exited: " + (log_dir / "worker.log").read_text())
                time.sleep(POLL)
            began, cpu = time.perf_counter(), (peer.cpu().server, worker_cpu(proc.pid))
            # Jobs go in jobID order: once the last is done, the rest are
            # done or about to be. (Status counts every job: asked often
            # over a large queue, it would slow the server down.)
            while _exists(client, last):
                time.sleep(POLL)
            while client.status()["jobs"]:
                time.sleep(POLL)
        seconds = time.perf_counter() - began
        server, worker = peer.cpu().server - cpu[0], worker_cpu(proc.pid) - cpu[1]
    finally:
        proc.terminate()
        proc.wait(30)
    return WorkerRun(jobs / seconds, server / jobs * 1e6, worker / jobs * 1e6)


def worker_cpu(pid: int) -> float:
    """Seconds of CPU used so far by the worker's process and, with
    --processes, its worker processes (its children)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return run.server_cpu(pid) + sum(run.server_cpu(int(child)) for child in children)


def _first_and_last(client: Client) -> tuple[int, int]:
    """The lowest and highest jobID in the queue."""
    rows = client.query("SELECT min(jobID), max(jobID) FROM jobs;")["rows"]
    return int(rows[0][0]), int(rows[0][1])


def _exists(client: Client, job_id: int) -> bool:
    try:
        client.query_job(job_id)
    except JobNotFound:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--jobs", type=int, default=100_000, metavar="N",
        help=f"jobs in each scenario, a multiple of {FILL_BATCH} (default: 100,000)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=8, metavar="N",
        help="the worker's --concurrency (default: 8, the worker's own)",
    )
    parser.add_argument(
        "--processes", type=int, default=1, metavar="N",
        help="the worker's --processes (default: 1, the worker's own)",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=("INFO", "WARNING"),
        help="the worker's --log-level (default: INFO, a line per job)",
    )
    args = parser.parse_args()
    if args.jobs < FILL_BATCH or args.jobs % FILL_BATCH:
        parser.error(f"--jobs must be a positive multiple of {FILL_BATCH}")
    with tempfile.TemporaryDirectory(prefix="jobserver-worker-bench-") as tmp:
        peer = run.start_jobserver(Path(tmp), run.ROOT)
        try:
            measured = run.Measured()
            run.measure_bulk(peer, args.jobs, measured)
            drain = measured.figures["drain"]
            options = ["--concurrency", str(args.concurrency), "--log-level", args.log_level]
            if args.processes > 1:  # an option a checkout before it may not know
                options += ["--processes", str(args.processes)]
            worker = worker_rate(peer, args.jobs, options, Path(tmp))
        finally:
            peer.stop()
    drain_cpu = measured.figures["drain_cpu"]
    print(
        f"{args.jobs:,} jobs, jobserver on SQLite (--synchronous FULL):\n"
        f"  bench/run.py drain, 8 processes, 100 per GetJobs + FinishJobs: {drain:,.0f} jobs/s, "
        f"server {drain_cpu:.0f} µs CPU a job\n"
        f"  jobserver worker, no-op async handler, --concurrency {args.concurrency}, "
        f"--processes {args.processes}, log {args.log_level}: {worker.rate:,.0f} jobs/s "
        f"({worker.rate / drain:.2f}x the drain), server {worker.server_cpu:.0f} µs CPU a job, "
        f"worker {worker.worker_cpu:.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
