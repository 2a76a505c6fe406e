"""SQLite without an index of ready jobs by nextRun alone (schema version
11, storage/sqlite_ready.py): a version 10 file loses jobsReadyNextRun and
keeps its jobs; the clock's next future job and the dashboard's Scheduled
are read through jobsReadyPriority, a range per priority, and read as much
at 100,000 jobs as at 1,000 (counted in SQLite's virtual-machine steps,
which do not depend on the machine's load)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_failure_handling import layout
from test_waiting import handed, soon, wait_request

from harness import ThreadServer
from helpers import create
from jobserver.storage import sqlite_ready
from jobserver.storage.sql import JOB
from jobserver.storage.sqlite import Store
from jobserver.storage.sqlite_schema import SCHEMA
from jobserver.wire.limits import PRIORITIES

# Version 10's index, as its schema wrote it.
READY_NEXT_RUN = (
    "CREATE INDEX jobsReadyNextRun ON jobs (nextRun)\n    WHERE state IN ('QUEUED', 'RUNQUEUED')"
)
NOW = "2026-06-01 00:00:00.000"
PAST, FUTURE = "2026-01-01 00:00:00.000", "2027-01-01 00:00:00.000"
SHOWN, COUNTED = 50, 10_000


def test_a_version_10_file_is_migrated_to_version_11_and_keeps_its_jobs(tmp_path: Path) -> None:
    old = tmp_path / "v10.db"
    with sqlite3.connect(old) as raw:
        raw.executescript(SCHEMA)
        raw.execute(READY_NEXT_RUN)
        raw.execute(
            "INSERT INTO jobs (created, state, name, nextRun, priority) VALUES "
            f"('{PAST}', 'QUEUED', 'from before', '{FUTURE}', 250)"
        )
        raw.execute("PRAGMA user_version = 10")
    Store(str(old)).close()
    Store(str(tmp_path / "fresh.db")).close()
    assert layout(old) == layout(tmp_path / "fresh.db")
    assert layout(old)[0] == 11
    assert "jobsReadyNextRun" not in str(layout(old))
    store = Store(str(old))
    try:
        assert store.next_due(NOW) == FUTURE
    finally:
        store.close()


def test_the_clock_fires_for_a_future_job_of_the_lowest_priority(tmp_path: Path) -> None:
    """A job of every other priority is due later: the lowest's range is
    read too, and the waiting GetJob gets its job when it falls due."""
    server = ThreadServer(tmp_path / "jobs.db")
    try:
        with server.client() as client:
            for priority in PRIORITIES[:-1]:
                create(client, "timed", firstRun="2099-01-01", priority=priority)
            first_run, _ = soon()
            lowest = create(client, "timed", firstRun=first_run, priority=PRIORITIES[-1])
            client.send(wait_request("timed"))
            assert handed(client.read_reply()) == lowest
    finally:
        server.stop()


def _jobs_file(path: Path, count: int) -> sqlite3.Connection:
    """A file of `count` ready jobs over every priority and 97 names, half
    due long ago and half due after NOW, all at one of the two moments (the
    worst case for a sort by nextRun), a quarter of them running under a
    lease (RUNQUEUED, passed over by Scheduled); and one reply deadline."""
    Store(str(path)).close()
    db = sqlite3.connect(path, isolation_level=None)
    rows = [
        ("RUNQUEUED" if n % 4 == 0 else "QUEUED", f"job/{n % 97}",
         FUTURE if n % 2 else PAST, PRIORITIES[n % len(PRIORITIES)])
        for n in range(count)
    ]
    db.execute("BEGIN")
    db.executemany(
        "INSERT INTO jobs (created, state, name, nextRun, priority) VALUES ('', ?, ?, ?, ?)", rows
    )
    db.execute(
        "INSERT INTO jobs (created, state, name, nextRun, replyKey) "
        "VALUES ('', 'WAITING', 'w', '2028-01-01 00:00:00.000', 'k')"
    )
    db.execute("COMMIT")
    return db


def _steps(db: sqlite3.Connection, statement: str, args: list[Any]) -> tuple[int, list[Any]]:
    """What a statement answers, and how many steps of SQLite's virtual
    machine it took: a measure of the rows it read, whatever the load."""
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    db.set_progress_handler(count, 1)
    try:
        return steps, db.execute(statement, args).fetchall()
    finally:
        db.set_progress_handler(None, 1)


def _reads(db: sqlite3.Connection) -> dict[str, Callable[[], tuple[int, list[Any]]]]:
    (listed, listed_args), (counted, counted_args) = sqlite_ready.scheduled(NOW, SHOWN, COUNTED)
    return {
        "next_due": lambda: _steps(db, sqlite_ready.NEXT_DUE, [NOW]),
        "scheduled": lambda: _steps(db, listed, listed_args),
        "counted": lambda: _steps(db, counted, counted_args),
    }


def test_the_reads_through_jobs_ready_priority_are_index_ranges(tmp_path: Path) -> None:
    db = _jobs_file(tmp_path / "jobs.db", 1_000)
    (listed, args), (counted, more) = sqlite_ready.scheduled(NOW, SHOWN, COUNTED)
    for statement, bound in ((sqlite_ready.NEXT_DUE, [NOW]), (listed, args), (counted, more)):
        plan = [row[3] for row in db.execute(f"EXPLAIN QUERY PLAN {statement}", bound)]
        searches = [step for step in plan if step.startswith(("SEARCH jobs", "SCAN jobs"))]
        assert searches, plan
        for step in searches:
            assert step in (
                "SEARCH jobs USING INDEX jobsReadyPriority (priority=? AND nextRun>?)",
                "SEARCH jobs USING INDEX jobsWaiting (nextRun>?)",
            ), plan
        assert not any("TEMP B-TREE" in step for step in plan), plan


@pytest.mark.parametrize("read", ["next_due", "scheduled", "counted"])
def test_each_read_costs_as_much_at_100000_jobs_as_at_1000(tmp_path: Path, read: str) -> None:
    """The answers are those of a plain reading of the table, and the steps
    do not grow with the jobs (the count stops past COUNTED either way)."""
    small = _reads(_jobs_file(tmp_path / "small.db", 1_000))[read]()
    db = _jobs_file(tmp_path / "large.db", 100_000)
    steps, answer = _reads(db)[read]()
    assert answer == _plainly(db, read)
    if read == "counted":
        assert answer == [(COUNTED + 1,)]
        # COUNTED jobs and the RUNQUEUED ones between them: about 16 steps a row.
        assert steps < 20 * (COUNTED + COUNTED // 2), steps
    else:
        assert steps <= small[0] * 1.1, (steps, small[0])


def _plainly(db: sqlite3.Connection, read: str) -> list[Any]:
    """The same answer from every row of the table, through no index."""
    after = f"FROM jobs NOT INDEXED WHERE nextRun > '{NOW}'"
    if read == "next_due":
        return db.execute(
            f"SELECT MIN(nextRun) {after} AND state IN ('QUEUED', 'RUNQUEUED', 'WAITING')"
        ).fetchall()
    if read == "scheduled":
        return db.execute(
            f"SELECT {JOB} {after} AND state = 'QUEUED' ORDER BY nextRun, name, jobID "
            f"LIMIT {SHOWN}"
        ).fetchall()
    found = db.execute(f"SELECT COUNT(*) {after} AND state = 'QUEUED'").fetchone()[0]
    return [(min(found, COUNTED + 1),)]
