"""What the per-minute history (History, --history-minutes) costs the server.

    python bench/history.py            # 3 rounds of 3,000 jobs each way
    python bench/history.py --quick    # 1 round of 1,000 jobs

- CPU per job: `jobserver serve` on a fresh SQLite file with
  `--history-minutes 1440` and with `0`, in turns, under the same load from
  one client (CreateJob, then GetJob and FinishJob, jobs spread over 20
  queues); the server's CPU (/proc/PID/stat) per job, the median of the
  rounds, and the ratio; and, in this process, what noting one event and
  adding it to the ring costs (the per-job cost without the noise of a
  shared machine).
- CPU per minute: what the ring does once a minute, in this process: the
  turn of a minute with 100 queues tracked (clearing a slot of each
  series), and the depth sample's read of the queues (`ready_by_queue`, in
  a thread of the server, four times a minute) at 100,000 jobs waiting.
- Bytes per minute of window: the ring's arrays for the totals and 100
  queues, by tracemalloc, divided by the window.

Prints a table; nothing is recorded.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
import time
import tracemalloc
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clients import JobserverClient
from run import free_port, server_cpu, wait_port
from scale import start_server

from jobserver.core.engine import history
from jobserver.core.engine.context import Context
from jobserver.storage import sqlite_readers
from jobserver.storage.sqlite import Store

ROOT = Path(__file__).resolve().parent.parent
QUEUES = 20


def load(port: int, jobs: int) -> None:
    client = JobserverClient(port)
    for i in range(jobs):
        name = f"q{i % QUEUES}/job".encode()
        status, _ = client.request(b"CreateJob\r\nname: " + name + b"\r\n\r\n")
        assert status.startswith("200"), status
    for i in range(jobs):
        name = f"q{i % QUEUES}/job".encode()
        status, body = client.request(b"GetJob\r\nname: " + name + b"\r\n\r\n")
        assert status.startswith("200"), status
        job_id = json.loads(body)["jobID"]
        status, _ = client.request(f"FinishJob\r\njobID: {job_id}\r\n\r\n".encode())
        assert status.startswith("200"), status


def cpu_per_job(minutes: int, jobs: int) -> float:
    """Server CPU microseconds per job (create, take, finish)."""
    with tempfile.TemporaryDirectory() as scratch:
        port = free_port()
        proc = start_server(
            Path(scratch) / "jobs.db",
            port,
            ROOT,
            "--synchronous",
            "NORMAL",
            "--history-minutes",
            str(minutes),
        )
        try:
            wait_port(port, proc)
            before = server_cpu(proc.pid)
            load(port, jobs)
            return (server_cpu(proc.pid) - before) / jobs * 1e6
        finally:
            proc.terminate()
            proc.wait(30)


class StepClock:
    """A clock that moves a minute each time it is told to."""

    def __init__(self) -> None:
        self.moment = 1_800_000_000.0

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.moment, UTC)


def full_ring(clock: StepClock) -> history.History:
    """A day's ring with the most queues tracked, every series written."""
    ring = history.History(history.DEFAULT_MINUTES, clock)
    events = history.new_events()
    for kind in range(history.EVENT_KINDS):
        for q in range(history.MAX_TRACKED_QUEUES):
            events[kind][f"q{q}/x"] = 1
    ring.record([events])
    return ring


def event_seconds(events: int = 200_000) -> float:
    """CPU seconds the history adds per job moved, in this process: a
    request's Context noting one event and the engine adding it to the
    ring after the commit (a batch of one, the dearest case), less the same
    loop without them."""
    clock = StepClock()
    ring = history.History(history.DEFAULT_MINUTES, clock)
    now = clock.now()

    def run(counted: bool) -> float:
        began = time.process_time()
        for _ in range(events):
            ctx = Context(None, now)  # type: ignore[arg-type]
            if counted:
                ctx.note(history.CREATED, "q1/job")
                ring.record([ctx.events])  # type: ignore[list-item]
        return time.process_time() - began

    return (run(True) - run(False)) / events


def ring_bytes() -> tuple[int, int]:
    """(bytes the full ring takes, what bytes_per_minute says it costs)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ring = full_ring(StepClock())
    taken = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return taken, ring.bytes_per_minute()


def minute_turn_seconds(turns: int = 200) -> float:
    """CPU seconds of one minute's turn of the full ring (and one event)."""
    clock = StepClock()
    ring = full_ring(clock)
    events = [history.new_events()]
    events[0][history.CREATED]["q1/x"] = 1
    began = time.process_time()
    for _ in range(turns):
        clock.moment += 60
        ring.record(events)
    return (time.process_time() - began) / turns


def depth_read_seconds(jobs: int) -> float:
    """Seconds the depth sample's read takes at `jobs` jobs in 100 queues."""
    with tempfile.TemporaryDirectory() as scratch:
        path = str(Path(scratch) / "jobs.db")
        Store(path, "NORMAL").close()
        db = sqlite3.connect(path, isolation_level=None)
        db.execute(
            "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
            "INSERT INTO jobs (name, created, nextRun, state) "
            "SELECT 'q' || (i % 100) || '/x', '2026-01-01 00:00:00', "
            "'2026-01-01 00:00:00.000', 'QUEUED' FROM n",
            (jobs - 1,),
        )
        db.close()
        began = time.perf_counter()
        sqlite_readers.ready_by_queue(path)
        seconds = time.perf_counter() - began
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, jobs = (1, 1000) if args.quick else (3, 3000)
    on: list[float] = []
    off: list[float] = []
    for _ in range(rounds):
        # In turns, so that a busy moment of the machine falls on both.
        on.append(cpu_per_job(history.DEFAULT_MINUTES, jobs))
        off.append(cpu_per_job(0, jobs))
    with_history, without = statistics.median(on), statistics.median(off)
    taken, per_minute = ring_bytes()
    turn = minute_turn_seconds()
    event = event_seconds()
    read = depth_read_seconds(100_000)
    print(
        f"{jobs:,} jobs x {rounds} rounds, {QUEUES} queues; server CPU per job "
        "(CreateJob + GetJob + FinishJob), median:"
    )
    print(
        f"  --history-minutes 1440  {with_history:8.1f} us   rounds: "
        + ", ".join(f"{v:.1f}" for v in on)
    )
    print(
        f"  --history-minutes 0     {without:8.1f} us   rounds: "
        + ", ".join(f"{v:.1f}" for v in off)
    )
    print(f"  ratio                   {with_history / without:8.3f}")
    print(
        f"  in-process: noting an event and adding it after the commit  {event * 1e6:.2f} us "
        f"(3 events a job: {3 * event * 1e6:.2f} us)"
    )
    print("once a minute:")
    print(f"  the ring's turn, 100 queues tracked   {turn * 1e6:8.1f} us CPU")
    print(
        f"  the depth read at 100,000 jobs        {read * 1e3:8.1f} ms in a reader thread, "
        f"4 a minute: {4 * read * 1e3:.1f} ms"
    )
    print("memory, a day's window (1,440 minutes), totals + 100 queues:")
    print(f"  measured (tracemalloc)  {taken:,} bytes = {taken / 1440:,.0f} bytes per minute")
    print(
        f"  bytes_per_minute()      {per_minute:,} bytes per minute "
        f"({per_minute // (history.MAX_TRACKED_QUEUES + 1)} per queue)"
    )


if __name__ == "__main__":
    main()
