"""The Python worker through a burst of failures: half of the jobs fail
their first attempt, all have a lease.

    python bench/worker_failures.py [--jobs 20000] [--server-root DIR]

jobserver serves a fresh SQLite database (`--synchronous FULL`). The jobs
(`retryAfter: +30 SECONDS`, `maxAttempts: 2`, `retryDelay: 0`) are queued
1,000 per CreateJobs; then one `jobserver worker flaky_worker:worker`
process (bench/flaky_worker.py: every job of an odd jobID raises on its
first attempt) with `--concurrency 200` empties the queue: each job is
handed out once or twice, failed once or not, and finished. Printed: the
time from the first hand-out to an empty queue, jobs per second, the
worker's CPU seconds, how many reports the server refused (`409 Lease
expired` and the like, from the worker's log), and how long the worker
took to exit after SIGTERM sent when half the jobs were done.
`--server-root DIR` runs another checkout's server and worker (say, the
commit before FailJobs) for comparison in the same sitting. Only the
ratio of two runs on one machine means much.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run  # noqa: E402

from jobserver.client import Client  # noqa: E402

POLL = 0.01
BATCH = 1000


def queue(port: int, jobs: int) -> None:
    job = {"name": "flaky", "retryAfter": "+30 SECONDS", "maxAttempts": 2, "retryDelay": 0}
    with Client("127.0.0.1", port, timeout=60) as client:
        for _ in range(jobs // BATCH):
            client.create_jobs([job] * BATCH)


def jobs_left(client: Client) -> int:
    return sum(client.status()["jobs"].values())


def worker_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drain(port: int, jobs: int, root: Path, log_path: Path) -> dict[str, float]:
    command = [
        sys.executable, "-m", "jobserver", "worker", "flaky_worker:worker",
        "--server", f"127.0.0.1:{port}", "--concurrency", "200", "--log-level", "WARNING",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(HERE)])}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=HERE, env=env, stderr=log, stdout=subprocess.DEVNULL)
    try:
        with Client("127.0.0.1", port, timeout=60) as client:
            while jobs_left(client) == jobs and proc.poll() is None:
                time.sleep(POLL)
            began = time.perf_counter()
            while jobs_left(client) > jobs // 2:
                time.sleep(POLL)
            cpu = worker_cpu(proc.pid)
            halfway = time.perf_counter() - began
            # A stop with reports still on their way: how long it takes.
            proc.send_signal(signal.SIGTERM)
            stopping = time.perf_counter()
            proc.wait(120)
            stopped = time.perf_counter() - stopping
            left = jobs_left(client)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = jobs - left
    text = log_path.read_text()
    return {
        "done": done,
        "seconds": halfway,
        "rate": (jobs - jobs // 2) / halfway,
        "cpu_ms_per_job": cpu * 1000 / (jobs - jobs // 2),
        "refused": len(re.findall(r"refused", text)),
        "stop_seconds": stopped,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000, metavar="N")
    parser.add_argument("--server-root", type=Path, default=run.ROOT, metavar="DIR")
    args = parser.parse_args()
    if args.jobs < BATCH or args.jobs % BATCH:
        parser.error(f"--jobs must be a positive multiple of {BATCH}")
    root = args.server_root.resolve()
    with tempfile.TemporaryDirectory(prefix="jobserver-failures-bench-") as tmp:
        peer = run.start_jobserver(Path(tmp), root)
        try:
            queue(peer.port, args.jobs)
            figures = drain(peer.port, args.jobs, root, Path(tmp) / "worker.log")
        finally:
            peer.stop()
    print(
        f"{args.jobs:,} jobs, half failing their first attempt, leased 30 s, "
        f"jobserver worker --concurrency 200 ({root}):\n"
        f"  first half done in {figures['seconds']:.1f} s: {figures['rate']:,.0f} jobs/s, "
        f"{figures['cpu_ms_per_job']:.2f} ms of the worker's CPU a job\n"
        f"  reports refused: {figures['refused']:.0f}; stopped "
        f"{figures['stop_seconds']:.1f} s after SIGTERM, {figures['done']:,.0f} jobs done"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
