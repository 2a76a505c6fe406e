"""What a PostgreSQL batch's begin costs the database, three ways:

    python bench/pg_begin.py                 # 8 rounds of 300 begins each way
    python bench/pg_begin.py --rounds 12 --begins 500

A node begins every batch with one simple query: BEGIN, then the
transaction's ID and backend and the limits and pauses other nodes
stored (postgres_commit.BEGIN). Until this script was written those were
two SELECTs in the query itself, which PostgreSQL parses and plans again
each time; now they are one statement each connection prepares once
(postgres_commit.PREPARE) and the query EXECUTEs. Measured here on
one connection to a database made for the run (its schema a node's), each
begin followed by ROLLBACK, in interleaved rounds:

- `BEGIN` alone: the floor, what any begin costs;
- `planned each time`: the two SELECTs in the query, as before;
- `prepared`: postgres_commit.BEGIN, as now.

CPU is the backend's own (utime + stime from /proc/PID/stat, so the
script must run on PostgreSQL's machine), wall time the client's; each a
median over the rounds, per begin.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from run import BenchDatabase

from jobserver.storage import postgres, postgres_commit
from jobserver.storage.sql_flow import FLOW_CONTROL

DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
PLANNED_EACH_TIME = (
    f"BEGIN; SELECT pg_current_xact_id()::text, pg_backend_pid(); {FLOW_CONTROL}".encode()
)
WAYS = {
    "BEGIN alone": b"BEGIN",
    "planned each time": PLANNED_EACH_TIME,
    "prepared": postgres_commit.BEGIN,
}


def backend_cpu(pid: int) -> float:
    """Seconds of CPU the backend `pid` has used."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def begin_and_roll_back(db: psycopg.Connection, query: bytes, times: int) -> None:
    for _ in range(times):
        results = db.execute(query)
        while results.nextset():
            pass
        db.execute(b"ROLLBACK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--postgres", default=os.environ.get("JOBSERVER_BENCH_POSTGRES", DEFAULT_POSTGRES)
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--begins", type=int, default=300, help="begins each way, each round")
    args = parser.parse_args()
    database = BenchDatabase.create(args.postgres)
    try:
        postgres.PostgresStore(database.url).close()  # the schema, as a node makes it
        with psycopg.connect(database.url, autocommit=True) as db:
            db.execute(postgres_commit.PREPARE)
            (pid,) = db.execute("SELECT pg_backend_pid()").fetchone() or (0,)
            for query in WAYS.values():
                begin_and_roll_back(db, query, 50)  # warm
            cpu: dict[str, list[float]] = {way: [] for way in WAYS}
            wall: dict[str, list[float]] = {way: [] for way in WAYS}
            for _ in range(args.rounds):
                for way, query in WAYS.items():
                    used, began = backend_cpu(pid), time.perf_counter()
                    begin_and_roll_back(db, query, args.begins)
                    wall[way].append((time.perf_counter() - began) / args.begins * 1e6)
                    cpu[way].append((backend_cpu(pid) - used) / args.begins * 1e6)
    finally:
        database.drop()
    print(f"PostgreSQL {database.described}; {args.rounds} rounds of {args.begins} begins")
    print("| begin (then ROLLBACK) | PostgreSQL CPU (µs) | wall (µs) |")
    print("|---|---|---|")
    for way in WAYS:
        print(f"| {way} | {statistics.median(cpu[way]):.0f} | {statistics.median(wall[way]):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
