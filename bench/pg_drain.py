"""Where PostgreSQL's CPU goes in a drain: bench/pg_peers.py's drain shape
for jobserver alone, with the database's side taken apart.

    python bench/pg_drain.py                     # 50,000 jobs, fresh database
    python bench/pg_drain.py --durations         # + each statement's time
    python bench/pg_drain.py --explain 0.01      # + sampled plans (auto_explain)
    python bench/pg_drain.py --hold-snapshot     # + a transaction held open
    python bench/pg_drain.py --dead 22000 --analyze-empty  # statistics of an emptied table
    python bench/pg_drain.py --profile node.txt  # + the node sampled by py-spy

One node serves a database made for the run (dropped after); --jobs jobs
are inserted with CreateJobs of 1,000, then the drain driver of
bench/peers/jobserver_driver.py (4 threads, GetJobs of 100 + one FinishJobs
each, on connections of their own) empties the queue. Printed: jobs/s; CPU
per job of the database's backends, the node and the driver (/proc, as
pg_peers.py counts them) and of every other PostgreSQL process; WAL bytes
per job; buffers per job of the jobs table and each of its indexes
(pg_statio_user_*). The optional settings are ALTER DATABASE ... SET on the
run's database only, in place before the node connects (no restart, no
server-wide change): --durations sets log_min_duration_statement = 0 and
sums the durations per statement; --explain loads auto_explain with
log_analyze, log_buffers and log_nested_statements (so the plan of the
search inside jobserver_find_ready_after is shown) for that fraction of
statements, and writes the plans to --out; --setting NAME=VALUE sets any
other (plan_cache_mode, say). The first two read the server's log
through SQL (bench/pg_statements.py's StatementLog: log_line_prefix must
hold %d). --hold-snapshot keeps a REPEATABLE READ transaction open in the
database during the drain, as a forgotten session would: dead index entries
can then not be marked dead, and each search visits their rows. --dead N
creates and deletes N jobs before the fill (the dead rows pg_peers.py's
earlier shapes leave, autovacuum off), and --analyze-empty runs ANALYZE of
the emptied table then: statistics that take the table for empty.
--profile FILE samples the node with py-spy (on PATH) during the drain
alone and writes its stacks, collapsed (one line a stack, then its count),
to FILE.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import psycopg
import scale
from pg_peers_drivers import DRIVERS, Driver, Peer, cpu_used
from pg_statements import StatementLog
from psycopg import sql
from run import BenchDatabase, Node, free_port, server_cpu, wait_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
DURATION = re.compile(r"duration: ([0-9.]+) ms\s+(\w+)(?: [^:]*)?:\s?(.*)$")


def postgres_cpu(database: str) -> dict[int, tuple[str, float]]:
    """Every PostgreSQL process's CPU seconds so far, by PID, with its kind:
    a backend of `database`, another backend, or the auxiliary's title."""
    used = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            command = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if not command.startswith(("postgres", "/usr/lib/postgresql")):
                continue
            if f" {database} " in command:
                kind = "this database's backends"
            elif "127.0.0.1(" in command or "[local]" in command:
                kind = "other backends"
            else:
                kind = command.split(":", 1)[-1].strip()[:40]
            used[int(entry.name)] = (kind, server_cpu(int(entry.name)))
        except OSError:
            continue
    return used


def buffers(db: psycopg.Connection) -> dict[str, int]:
    """Buffers read or hit so far, the jobs table's and each of its indexes'."""
    rows = db.execute(
        "SELECT indexrelname, idx_blks_hit + idx_blks_read FROM pg_statio_user_indexes"
        " WHERE relname = 'jobs'"
    ).fetchall()
    heap = db.execute(
        "SELECT heap_blks_hit + heap_blks_read FROM pg_statio_user_tables WHERE relname = 'jobs'"
    ).fetchone()
    return {**{name: int(n) for name, n in rows}, "(heap)": int(heap[0]) if heap else 0}


def configure(admin: psycopg.Connection, database: str, args: argparse.Namespace) -> None:
    settings: list[tuple[str, str]] = []
    if args.durations:
        settings.append(("log_min_duration_statement", "0"))
    if args.explain:
        settings += [
            ("session_preload_libraries", "auto_explain"),
            ("auto_explain.log_min_duration", "0"),
            ("auto_explain.log_analyze", "on"),
            ("auto_explain.log_buffers", "on"),
            ("auto_explain.log_nested_statements", "on"),
            ("auto_explain.sample_rate", str(args.explain)),
        ]
    for setting in args.setting:
        name, _, value = setting.partition("=")
        settings.append((name, value))
    for name, value in settings:
        admin.execute(
            sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                sql.Identifier(database), sql.SQL(name), sql.Literal(value)
            )
        )


def entries(log: StatementLog, database: str, since: int) -> list[str]:
    """The log's lines about `database` since the offset `since`, with the
    continuation lines of each entry (plans are many lines)."""
    end = log.size()
    data = log.admin.execute(
        "SELECT pg_read_binary_file(%s, %s, %s)", (log.path, since, max(end - since, 0))
    ).fetchone()
    text = bytes(data[0]).decode("utf-8", "replace") if data else ""
    kept, keep = [], False
    for line in text.split("\n"):
        if line and line[0] not in " \t":
            keep = database in re.split(r"LOG:|ERROR:", line, maxsplit=1)[0]
        if keep:
            kept.append(line)
    return kept


def report_durations(lines: list[str], jobs: int) -> None:
    total: defaultdict[str, float] = defaultdict(float)
    count: Counter[str] = Counter()
    for line in lines:
        match = DURATION.search(line)
        if match:
            key = f"{match.group(2)} | {' '.join(match.group(3).split())[:70]}"
            total[key] += float(match.group(1))
            count[key] += 1
    print("statement time (server-side durations), µs per job:")
    for key, ms in sorted(total.items(), key=lambda item: -item[1])[:15]:
        print(f"  {ms / jobs * 1000:6.1f}  {count[key]:5d}x  {key}")
    print(f"  {sum(total.values()) / jobs * 1000:6.1f}  in all")


def start_sampler(pid: int, out: Path) -> subprocess.Popen:
    """py-spy sampling process `pid` until stop_sampler, once it has begun."""
    said = out.with_suffix(".log")
    with said.open("w") as log:
        sampler = subprocess.Popen(
            ["py-spy", "record", "--pid", str(pid), "--format", "raw", "--rate", "500",
             "--gil", "--nonblocking", "--output", str(out)],
            stdout=log, stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while "Sampling process" not in said.read_text():
        if sampler.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"py-spy did not start: {said.read_text()}")
        time.sleep(0.05)
    return sampler


def stop_sampler(sampler: subprocess.Popen) -> None:
    sampler.send_signal(signal.SIGINT)
    sampler.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50_000, help="a multiple of 1,000")
    parser.add_argument(
        "--postgres", default=os.environ.get("JOBSERVER_BENCH_POSTGRES", DEFAULT_POSTGRES)
    )
    parser.add_argument("--connections", type=int, default=4, help="the drain driver's threads")
    parser.add_argument(
        "--writers", type=int, help="the node's --writers, transactions at once (default: its own)"
    )
    parser.add_argument("--durations", action="store_true")
    parser.add_argument(
        "--setting", action="append", default=[], metavar="NAME=VALUE",
        help="a PostgreSQL setting for the run's database, e.g. "
        "--setting plan_cache_mode=force_generic_plan (repeatable)",
    )
    parser.add_argument(
        "--server-option", action="append", default=[], metavar="OPTION",
        help="an option for the node's `serve`, e.g. --server-option=--keep-outcomes=0 "
        "(repeatable)",
    )
    parser.add_argument("--explain", type=float, default=0.0, metavar="RATE")
    parser.add_argument("--out", type=Path, default=Path("pg_drain_plans.log"))
    parser.add_argument("--analyze", action="store_true", help="ANALYZE jobs after the fill")
    parser.add_argument("--hold-snapshot", action="store_true")
    parser.add_argument("--profile", type=Path, metavar="FILE")
    parser.add_argument(
        "--analyze-empty", action="store_true",
        help="ANALYZE jobs while it is empty, before the fill (after --dead's delete)",
    )
    parser.add_argument(
        "--dead", type=int, default=0, metavar="N",
        help="N jobs (a multiple of 1,000) created and deleted before the fill, as"
        " pg_peers.py's earlier shapes and rounds leave them (autovacuum off)",
    )
    args = parser.parse_args()
    os.environ["BENCH_JOBSERVER_CONNECTIONS"] = str(args.connections)
    database = BenchDatabase.create(args.postgres)
    admin = psycopg.connect(args.postgres, autocommit=True)
    configure(admin, database.name, args)
    log = StatementLog(admin, database.name, None)
    env = {**os.environ}
    port = free_port()
    writers = ("--writers", str(args.writers)) if args.writers else ()
    proc = scale.start_server(database.url, port, ROOT, *writers, *args.server_option)
    peer = Peer(
        "jobserver-pg", "", database, [sys.executable, str(DRIVERS / "jobserver_driver.py")],
        env, "DELETE FROM jobs", node=Node(port, proc), logs=Path(os.environ.get("TMPDIR", "/tmp")),
    )
    try:
        wait_port(port, proc)
        env["BENCH_PORT"] = str(port)
        if args.dead:
            dead = Driver(peer, "batch", args.dead // 1000, 1000, "enq")
            dead.expect("ready")
            dead.send()
            dead.expect("done")
            dead.close()
            peer.clear()
        if args.analyze_empty:
            with psycopg.connect(database.url, autocommit=True) as empty:
                empty.execute("ANALYZE jobs")
        fill = Driver(peer, "batch", args.jobs // 1000, 1000, "noop")
        fill.expect("ready")
        fill.send()
        fill.expect("done")
        fill.close()
        db = psycopg.connect(database.url, autocommit=True)
        if args.analyze:
            db.execute("ANALYZE jobs")
        if args.hold_snapshot:
            holder = psycopg.connect(database.url)
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM jobserver_locks")
        time.sleep(1.0)  # the statistics of the fill flushed
        read_before = buffers(db)
        since = log.size()
        wal = admin.execute("SELECT pg_current_wal_lsn()").fetchone()
        driver = Driver(peer, "drain", args.jobs)
        driver.expect("ready")
        everyone = postgres_cpu(database.name)
        sampler = start_sampler(proc.pid, args.profile) if args.profile else None
        try:
            before = peer.cpu(driver.proc)
            began = time.perf_counter()
            driver.send()
            driver.expect("done")
            seconds = time.perf_counter() - began
        finally:
            if sampler:
                stop_sampler(sampler)
        after = peer.cpu(driver.proc)
        everyone_after = postgres_cpu(database.name)
        driver.close()
        wal_bytes = admin.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (wal[0] if wal else None,)
        ).fetchone()
        database_s, node_s, driver_s = cpu_used(before, after)
        per = 1e6 / args.jobs
        print(
            f"drain of {args.jobs:,}: {args.jobs / seconds:,.0f} jobs/s; CPU µs a job: PostgreSQL"
            f" {database_s * per:.0f}, node {node_s * per:.0f}, driver {driver_s * per:.0f};"
            f" WAL {float(wal_bytes[0] if wal_bytes else 0) / args.jobs:,.0f} bytes a job"
        )
        kinds: defaultdict[str, float] = defaultdict(float)
        for pid, (kind, used) in everyone_after.items():
            kinds[kind] += used - everyone.get(pid, (kind, 0.0))[1]
        for kind, used in sorted(kinds.items()):
            print(f"  every PostgreSQL process, {kind}: {used * per:.1f} µs a job")
        threading.Event().wait(1.0)  # the drain's statistics flushed
        read_after = buffers(db)
        for name in sorted(read_after):
            moved = (read_after[name] - read_before.get(name, 0)) / args.jobs
            if moved >= 0.01:
                print(f"  buffers a job, {name}: {moved:.2f}")
        if args.durations or args.explain:
            lines = entries(log, database.name, since)
            if args.durations:
                report_durations(lines, args.jobs)
            if args.explain:
                args.out.write_text("\n".join(lines) + "\n")
                print(f"plans and log lines: {args.out}")
    finally:
        peer.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
