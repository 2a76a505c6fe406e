"""What a dependency edge costs (protocol.md 14.25), on SQLite and on
PostgreSQL: a fan-in of 1,000 (1,000 jobs and one that depends on all of
them, one CreateJobs), then the 1,000 taken (GetJobs) and finished
(FinishJobs), each finish telling the one dependent; against the same
1,001 jobs with no dependencies, measured in the same run, in turn.

    python bench/dependencies.py [--rounds 10] [--width 1000]

CPU is the server process's (user + system, /proc), and on PostgreSQL
also that of the database's backends (the bench database holds nothing
else), read in the kernel's ticks (10 ms): each step's CPU is the mean
over the rounds, its wall time the median. The cost per edge is (with -
without) / width; the ratio is with / without. Only the figures of one
run, side by side, mean much: this machine is shared. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import psycopg

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

# The tests' helpers (a schema of its own, the server process, a plain
# client), which mypy does not check: they are not a package of the project's.
import pg  # type: ignore[import-not-found]  # noqa: E402

from harness import ServerProcess  # type: ignore[import-not-found]  # noqa: E402
from wire import Client  # type: ignore[import-not-found]  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Meter:
    """CPU of the server, and of PostgreSQL's backends of its database."""

    def __init__(self, node: ServerProcess, url: str | None) -> None:
        self.pid = node.proc.pid
        self.url = url

    def backends(self) -> list[int]:
        if self.url is None:
            return []
        with psycopg.connect(self.url, autocommit=True) as db:
            rows = db.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid()"
            ).fetchall()
        return [int(row[0]) for row in rows]

    def read(self) -> tuple[float, float]:
        database = 0.0
        for pid in self.backends():
            # A backend that ended meanwhile used nothing more.
            with suppress(OSError):
                database += cpu_seconds(pid)
        return cpu_seconds(self.pid), database


def measured(meter: Meter, work: Callable[[], None]) -> tuple[float, float, float]:
    """Wall, server CPU and database CPU seconds of `work`."""
    server, database = meter.read()
    began = time.perf_counter()
    work()
    wall = time.perf_counter() - began
    server_after, database_after = meter.read()
    return wall, server_after - server, database_after - database


def ok(reply: Any) -> Any:
    assert reply.status == "200 OK", reply.status
    return reply


def one_round(client: Client, meter: Meter, width: int, edges: bool, tag: str) -> dict[str, Any]:
    name = f"{tag}-{'e' if edges else 'p'}"
    jobs: list[dict[str, Any]] = [{"name": name} for _ in range(width)]
    last: dict[str, Any] = {"name": f"{name}-join"}
    if edges:
        last["dependsOn"] = [f"#{i}" for i in range(width)]
    jobs.append(last)

    def create() -> None:
        ok(client.request("CreateJobs", jobs=jobs))

    def finish() -> None:
        taken = ok(client.request("GetJobs", name=name, numResults=width)).json["jobs"]
        done = [{"jobID": job["jobID"], "data": {"n": 1}} for job in taken]
        ok(client.request("FinishJobs", jobs=done))

    def last_job() -> None:
        job = ok(client.request("GetJob", name=f"{name}-join")).json
        ok(client.request("FinishJob", jobID=job["jobID"]))

    return {
        "create": measured(meter, create),
        "finish": measured(meter, finish),
        "join": measured(meter, last_job),
    }


def run(node: ServerProcess, url: str | None, backend: str, rounds: int, width: int) -> None:
    meter = Meter(node, url)
    results: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    with Client(node.port, 120) as client:
        # A warm-up of each, not counted.
        one_round(client, meter, width, False, "warm")
        one_round(client, meter, width, True, "warm")
        for number in range(rounds):
            for edges in (False, True):
                results[edges].append(one_round(client, meter, width, edges, f"r{number}"))
    print(f"\n{backend}: fan-in of {width}, {rounds} rounds (wall: median; CPU: mean)")
    print(f"{'step':<8}{'plain ms':>10}{'edges ms':>10}{'CPU plain':>11}{'CPU edges':>11}"
          f"{'µs/edge':>9}{'ratio':>7}")
    for step in ("create", "finish", "join"):
        plain = _medians(results[False], step)
        with_edges = _medians(results[True], step)
        cpu_plain = plain[1] + plain[2]
        cpu_edges = with_edges[1] + with_edges[2]
        per_edge = (cpu_edges - cpu_plain) / width * 1e6
        ratio = cpu_edges / cpu_plain if cpu_plain else float("nan")
        print(f"{step:<8}{plain[0] * 1e3:>10.1f}{with_edges[0] * 1e3:>10.1f}"
              f"{cpu_plain * 1e3:>10.1f}m{cpu_edges * 1e3:>10.1f}m{per_edge:>9.1f}{ratio:>7.2f}")
        if url is not None:
            print(f"{'':<8}(database's share of the CPU: plain {plain[2] * 1e3:.1f} ms, "
                  f"edges {with_edges[2] * 1e3:.1f} ms)")


def _medians(rounds: list[dict[str, Any]], step: str) -> tuple[float, float, float]:
    return (
        statistics.median(r[step][0] for r in rounds),
        statistics.mean(r[step][1] for r in rounds),
        statistics.mean(r[step][2] for r in rounds),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, metavar="N")
    parser.add_argument("--width", type=int, default=1000, metavar="N")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jobserver-deps-bench-") as tmp:
        node = ServerProcess(Path(tmp) / "jobs.db")
        try:
            run(node, None, "sqlite", args.rounds, args.width)
        finally:
            node.kill()
    pg.recreate_database()
    try:
        with pg.fresh_schema() as url:
            node = ServerProcess(url)
            try:
                run(node, url, "postgres", args.rounds, args.width)
            finally:
                node.kill()
    finally:
        pg.drop_database()
    return 0


if __name__ == "__main__":
    sys.exit(main())
