"""What keeping outcomes for AwaitJob (protocol.md 14.27) costs FinishJobs:
two servers on one machine, one with --keep-outcomes 0 (nothing kept: the
cost before AwaitJob) and one with the default (an hour: every finished
job's outcome written in FinishJobs' transaction, one multi-row insert),
given the same work in turn: batches of jobs created (CreateJobs), taken
(GetJobs) and finished with data (FinishJobs), on SQLite and PostgreSQL.

    python bench/outcomes_cost.py [--batches 10] [--jobs 1000] [--rounds 3]

It prints, per round, each server's FinishJobs rate and the server
process's CPU per finished job (user + system, from /proc, over the
FinishJobs alone), and the ratio of kept to not kept. On PostgreSQL the
database's own CPU is not counted (it is another process). Only the ratio
in one round means much: this machine is shared. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

# The tests' helpers (a schema of its own, the server process, a plain
# client), which mypy does not check: they are not a package of the project's.
import pg  # type: ignore[import-not-found]  # noqa: E402

from harness import ServerProcess  # type: ignore[import-not-found]  # noqa: E402
from wire import Client  # type: ignore[import-not-found]  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User and system CPU of a process so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def finish_batches(node: ServerProcess, batches: int, jobs: int) -> tuple[float, float]:
    """(FinishJobs' jobs a second, the server's CPU seconds a job), over
    `batches` of `jobs` created and taken first, finished one batch a
    request."""
    pid = node.proc.pid
    elapsed = cpu = 0.0
    with Client(node.port, 120) as client:
        for _ in range(batches):
            created = client.request("CreateJobs", jobs=[{"name": "bench", "data": {}}] * jobs)
            assert created.status == "200 OK", created.status
            taken = client.request("GetJobs", name="bench", numResults=jobs)
            assert taken.status == "200 OK", taken.status
            reports = [
                {"jobID": job["jobID"], "data": {"result": job["jobID"], "ok": True}}
                for job in taken.json["jobs"]
            ]
            before_cpu, began = cpu_seconds(pid), time.perf_counter()
            finished = client.request("FinishJobs", jobs=reports)
            elapsed += time.perf_counter() - began
            cpu += cpu_seconds(pid) - before_cpu
            assert finished.status == "200 OK", finished.status
    count = batches * jobs
    return count / elapsed, cpu / count


def rounds(
    plain: ServerProcess, kept: ServerProcess, backend: str, args: argparse.Namespace
) -> None:
    for number in range(1, args.rounds + 1):
        # In turn, so both see the same moment of a shared machine.
        rate0, cpu0 = finish_batches(plain, args.batches, args.jobs)
        rate1, cpu1 = finish_batches(kept, args.batches, args.jobs)
        print(
            f"{backend} round {number}: --keep-outcomes 0 {rate0:,.0f} jobs/s, "
            f"{cpu0 * 1e6:.0f} us CPU a job; kept {rate1:,.0f} jobs/s, {cpu1 * 1e6:.0f} us; "
            f"kept/not: time {rate0 / rate1:.2f}, CPU {cpu1 / cpu0:.2f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=10, metavar="N")
    parser.add_argument("--jobs", type=int, default=1000, metavar="N")
    parser.add_argument("--rounds", type=int, default=3, metavar="N")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jobserver-outcomes-bench-") as tmp, ExitStack() as up:
        plain = ServerProcess(Path(tmp) / "plain.db", "--keep-outcomes", "0")
        up.callback(plain.kill)
        kept = ServerProcess(Path(tmp) / "kept.db")
        up.callback(kept.kill)
        rounds(plain, kept, "sqlite", args)
    pg.recreate_database()
    try:
        with pg.fresh_schema() as plain_url, pg.fresh_schema() as kept_url, ExitStack() as up:
            plain = ServerProcess(plain_url, "--keep-outcomes", "0")
            up.callback(plain.kill)
            kept = ServerProcess(kept_url)
            up.callback(kept.kill)
            rounds(plain, kept, "postgres", args)
    finally:
        pg.drop_database()
    return 0


if __name__ == "__main__":
    sys.exit(main())
