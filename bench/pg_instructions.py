"""Count the instructions a PostgreSQL node executes per job, with callgrind:
bench/instructions.py's method for bench/pg_drain.py's shapes.

    python bench/pg_instructions.py                 # 5,000 jobs
    python bench/pg_instructions.py --jobs 10000 --server-root DIR

The node's CPU per job in a drain moves by a tenth between runs on a
shared machine; its instruction count does not. A database is made for
the run (dropped after); the node (`python -m jobserver serve --db URL`)
runs under `valgrind --tool=callgrind`, driven over plain sockets
(wire_client.py). After a warm-up, each workload zeroes the counters,
runs and dumps them:

- batch insert: CreateJobs of 1,000 jobs with 100 bytes of data each;
- drain, 1 connection: GetJobs of 100 then FinishJobs of them, in turn;
- drain, 4 connections: the same from 4 threads (pg_drain.py's shape;
  how requests share transactions varies a little from run to run);
- single enqueue: CreateJob, one at a time (--jobs / 10 of them).

Counted: instructions per job in the node's user space, every thread (the
interpreter, psycopg and libpq, the C library), not the database's; less
what the idle node executes in as long (measured first, for 10 s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from instructions import counted, start
from run import BenchDatabase
from wire_client import Client

DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
DATA = {"p": "x" * 90}
BATCH = 1000
DRAIN_BATCH = 100
# An idle node still works (its clock, the listener's recheck once a
# second): measured alone and subtracted, as a workload's time under
# valgrind grows with the machine's load.
IDLE_SECONDS = 10.0


def insert(client: Client, jobs: int, name: str) -> None:
    batch = [{"name": name, "data": DATA}] * BATCH
    for _ in range(jobs // BATCH):
        client.ok("CreateJobs", jobs=batch)


def drain(port: int, connections: int, name: str) -> None:
    def take() -> None:
        client = Client(port)
        while True:
            status, body = client.request("GetJobs", name=name, numResults=DRAIN_BATCH)
            if status.startswith("404"):
                break
            if not status.startswith("200"):
                raise RuntimeError(f"GetJobs: {status} {body[:200]!r}")
            ids = [job["jobID"] for job in json.loads(body)["jobs"]]
            results = client.ok("FinishJobs", jobs=[{"jobID": i} for i in ids])["results"]
            if any(r["status"] != "200 OK" for r in results):
                raise RuntimeError(f"FinishJobs: {results}")
        client.close()

    threads = [threading.Thread(target=take) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def single(client: Client, jobs: int) -> None:
    for _ in range(jobs):
        client.ok("CreateJob", name="single", data=DATA)


def measure(root: Path | None, out: Path, url: str, jobs: int) -> None:
    # Patient: valgrind on a loaded machine, and a schema to make.
    server, port = start(root, out, url, patience=900)
    try:
        client = Client(port)
        insert(client, BATCH, "warm")
        drain(port, 1, "warm")
        single(client, 100)
        workloads: list[tuple[str, int, Callable[[], None]]] = [
            ("batch insert", jobs, lambda: insert(client, jobs, "one")),
            ("drain, 1 connection", jobs, lambda: drain(port, 1, "one")),
            ("batch insert (4)", jobs, lambda: insert(client, jobs, "four")),
            ("drain, 4 connections", jobs, lambda: drain(port, 4, "four")),
            ("single enqueue", jobs // 10, lambda: single(client, jobs // 10)),
        ]
        idle = counted(out, server, "idle", lambda: time.sleep(IDLE_SECONDS)) / IDLE_SECONDS
        print(f"{'idle':22} {idle:>12,.0f} instructions/s (subtracted below)", flush=True)
        for index, (label, count, run) in enumerate(workloads):
            began = time.monotonic()
            total = counted(out, server, f"w{index}", run)
            busy = total - idle * (time.monotonic() - began)
            print(f"{label:22} {busy / count:>12,.0f} instructions/job", flush=True)
    finally:
        server.terminate()
        server.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-root", type=Path, help="the checkout to run")
    parser.add_argument("--jobs", type=int, default=5000, help="a multiple of 1,000")
    parser.add_argument(
        "--postgres", default=os.environ.get("JOBSERVER_BENCH_POSTGRES", DEFAULT_POSTGRES)
    )
    args = parser.parse_args()
    jobs = args.jobs - args.jobs % BATCH
    database = BenchDatabase.create(args.postgres)
    # Dropped whatever happens, a node that never started included.
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            measure(args.server_root, Path(out_dir), database.url, jobs)
    finally:
        database.drop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
