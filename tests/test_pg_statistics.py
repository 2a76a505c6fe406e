"""The nodes keep PostgreSQL's planner statistics of the jobs table true
(storage/postgres_statistics.py): a table analyzed while emptied, its dead
rows still in its pages, is taken for empty whatever is written to it
next, until it is analyzed again; the nodes do that once it holds far
more than the planner expects, or once a plain VACUUM has sized it with
no column statistics taken, and leave other tables alone."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator

import pg
import psycopg
import pytest

from harness import ThreadServer
from helpers import ok, until
from jobserver.storage import postgres_statistics, sql_store
from jobserver.storage.postgres import PostgresStore

# Queued jobs written by SQL, as many as the argument says.
_FILL = (
    "INSERT INTO jobs (created, state, name, nextRun) SELECT '2026-01-01 00:00:00', "
    "'QUEUED', 'noop', '2026-01-01 00:00:00.000' FROM generate_series(1, %s)"
)
# FinishJobs' delete (sql_store.py), planned as the node's prepared
# statement is once psycopg prepares it: generic, for any 100 jobIDs.
_DELETE = (
    "PREPARE finish(bigint[]) AS DELETE FROM jobs WHERE jobID = ANY($1) "
    "AND (state || '') IN ('RUNNING')"
)


@pytest.fixture
def url() -> Iterator[str]:
    with pg.fresh_schema() as schema_url:
        yield schema_url


def emptied_and_analyzed(url: str) -> None:
    """What autovacuum's ANALYZE, or an operator's, leaves after a queue
    drained: no rows, in the pages its dead ones still fill."""
    pg.execute(url, _FILL, (3000,))
    pg.execute(url, "DELETE FROM jobs")
    pg.execute(url, "ANALYZE jobs")


def reltuples(url: str) -> float:
    return float(pg.value(url, "SELECT reltuples FROM pg_class WHERE oid = 'jobs'::regclass"))


def live_rows(url: str) -> int:
    return int(pg.value(url, "SELECT pg_stat_get_live_tuples('jobs'::regclass)"))


def delete_plan(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("SET plan_cache_mode = force_generic_plan")
        db.execute(_DELETE)
        rows = db.execute("EXPLAIN EXECUTE finish('{1,2,3}')").fetchall()
    return "\n".join(str(row[0]) for row in rows)


# RUNNING jobs, as many as the argument says, every tenth one a parent of
# a QUEUED child.
_RUNNING = (
    "INSERT INTO jobs (created, state, name, nextRun, leaseID) SELECT '2026-01-01 00:00:00', "
    "'RUNNING', 'noop', '2026-01-01 00:00:00.000', 'lease' || n FROM generate_series(1, %s) AS n"
)
_CHILDREN = (
    "INSERT INTO jobs (created, state, name, nextRun, parentJobID) SELECT created, 'QUEUED', "
    "'child', nextRun, jobID FROM jobs WHERE mod(jobID, 10) = 0"
)


def plain_finish_plan(url: str, mode: str) -> str:
    """FinishJobs' plain finish (sql_store._FINISH_PLAIN) of 100 RUNNING
    jobs and a missing one, run (and undone) with its plan shown: `mode`
    custom (for the values, as psycopg's first five runs are planned) or
    generic (as once prepared)."""
    statement = sql_store._FINISH_PLAIN
    for number in range(1, 7):
        statement = statement.replace("%s", f"${number}", 1)
    with psycopg.connect(url) as db:
        db.execute(f"SET plan_cache_mode = force_{mode}_plan")
        db.execute(f"PREPARE plain(bigint[], bigint[], text[], text, text, text) AS {statement}")
        ids = [*range(11, 1011, 10), 10**9]
        every = "{" + ",".join(map(str, ids)) + "}"
        leases = "{" + ",".join("NULL" for _ in ids) + "}"
        rows = db.execute(
            f"EXPLAIN (ANALYZE, COSTS OFF) EXECUTE plain('{every}', '{every}', '{leases}',"
            " '2030-01-01 00:00:00.000', '2030-01-01 01:00:00.000', '2030-01-01 01:00:00.000')"
        ).fetchall()
        db.rollback()
    return "\n".join(str(row[0]) for row in rows)


def removed_by_filters(plan: str) -> int:
    return sum(int(n) for n in re.findall(r"Rows Removed by (?:Join )?Filter: (\d+)", plan))


@pytest.mark.parametrize("mode", ["custom", "generic"])
@pytest.mark.parametrize("running", [3000, 20000])
@pytest.mark.parametrize("statistics", ["never analyzed", "analyzed", "analyzed while empty"])
def test_a_plain_finish_reads_each_job_and_its_children_by_index(
    url: str, statistics: str, running: int, mode: str
) -> None:
    # The statement that finishes the jobs of a FinishJobs at once: planned
    # with the state's index and no child index, it read every RUNNING job
    # and then the whole table once a job (310 ms for 100 of 20,000); joined
    # to the runs' unnest, custom plans read 3,000 RUNNING jobs for each run
    # (64 to 92 ms).
    PostgresStore(url).close()
    if statistics == "analyzed while empty":
        emptied_and_analyzed(url)
    pg.execute(url, _RUNNING, (running,))
    pg.execute(url, _CHILDREN)
    if statistics == "analyzed":
        pg.execute(url, "ANALYZE jobs")
    plan = plain_finish_plan(url, mode)
    assert "Index Cond: (jobid = ANY ($" in plan, plan
    assert "jobsparentjobidstate" in plan, plan
    # The locks' read may scan a small table (the jobs and their children)
    # whole, once; nothing more.
    assert removed_by_filters(plan) <= running + running // 10, plan
    if running > 10000:
        assert "Seq Scan on jobs" not in plan, plan


def test_a_table_taken_for_empty_is_analyzed_once_filled(url: str) -> None:
    store = PostgresStore(url)
    try:
        emptied_and_analyzed(url)
        assert reltuples(url) == 0
        pg.execute(url, _FILL, (5000,))
        until(lambda: live_rows(url) >= 5000, 10, "the fill's rows counted")
        assert store.keep_statistics() is True
        assert reltuples(url) >= 4000
        assert "jobs_pkey" in delete_plan(url)
        # Looked at again, and left as it is.
        assert store.keep_statistics() is False
    finally:
        store.close()


def test_tables_the_planner_sizes_rightly_are_left_alone(url: str) -> None:
    store = PostgresStore(url)
    try:
        # Never analyzed: the planner counts its pages instead.
        pg.execute(url, _FILL, (5000,))
        until(lambda: live_rows(url) >= 5000, 10, "the fill's rows counted")
        assert store.keep_statistics() is False
        assert reltuples(url) < 0
        # Taken for empty, but too small for any plan to be slow.
        emptied_and_analyzed(url)
        pg.execute(url, _FILL, (postgres_statistics.MIN_ROWS - 1,))
        until(lambda: live_rows(url) >= postgres_statistics.MIN_ROWS - 1, 10, "rows counted")
        assert store.keep_statistics() is False
        assert reltuples(url) == 0
    finally:
        store.close()


def column_statistics(url: str) -> int:
    """The rows pg_stats holds for the jobs table of the url's schema."""
    return int(
        pg.value(
            url,
            "SELECT count(*) FROM pg_stats WHERE schemaname = current_schema() "
            "AND tablename = 'jobs'",
        )
    )


def test_a_vacuumed_table_without_column_statistics_is_analyzed(url: str) -> None:
    store = PostgresStore(url)
    try:
        # A plain VACUUM of a never-analyzed table: rightly sized, no
        # column statistics, so the planner guesses every selectivity.
        pg.execute(url, _FILL, (3000,))
        pg.execute(url, "VACUUM jobs")
        until(lambda: live_rows(url) >= 3000, 10, "the fill's rows counted")
        assert reltuples(url) >= 3000
        assert column_statistics(url) == 0
        assert store.keep_statistics() is True
        assert column_statistics(url) > 0
        # Once: with its column statistics taken, it is left alone.
        assert store.keep_statistics() is False
    finally:
        store.close()


def test_a_table_with_column_statistics_is_left_alone(url: str) -> None:
    store = PostgresStore(url)
    try:
        pg.execute(url, _FILL, (3000,))
        pg.execute(url, "VACUUM ANALYZE jobs")
        until(lambda: live_rows(url) >= 3000, 10, "the fill's rows counted")
        assert column_statistics(url) > 0
        assert store.keep_statistics() is False
    finally:
        store.close()


def test_a_node_analyzes_the_table_a_burst_of_jobs_filled(url: str) -> None:
    node = ThreadServer(url)
    try:
        emptied_and_analyzed(url)
        client = node.client()
        jobs = [{"name": "noop"}] * 1000
        for _ in range(3):
            ok(client.request("CreateJobs", jobs=jobs))
        until(lambda: reltuples(url) >= 2000, 30, "the node to analyze the jobs table")
    finally:
        node.stop()


@pytest.mark.parametrize(
    ("reltuples", "relpages", "pages", "live", "is_stale"),
    [
        (0, 30, 30, 5000, True),  # analyzed while emptied
        (10, 1000, 3000, 50_000, True),  # nearly empty then, filled since
        (-1, 0, 200, 50_000, False),  # never analyzed: sized by its pages
        (0, 0, 200, 50_000, False),  # analyzed with no pages: the same
        (5000, 100, 200, 10_000, False),  # grown, and counted by its pages
        (0, 30, 30, postgres_statistics.MIN_ROWS - 1, False),  # small
    ],
)
def test_which_statistics_are_stale(
    reltuples: float, relpages: int, pages: int, live: int, is_stale: bool
) -> None:
    assert postgres_statistics.stale(reltuples, relpages, pages, live) is is_stale


@pytest.mark.parametrize(
    ("reltuples", "relpages", "live", "has_columns", "is_unanalyzed"),
    [
        (3000, 17, 3000, False, True),  # vacuumed, never analyzed
        (0, 17, 3000, False, True),  # sized by a VACUUM of it emptied
        (3000, 17, 3000, True, False),  # analyzed
        (-1, 0, 3000, False, False),  # never vacuumed: sized by its pages
        (500, 3, postgres_statistics.MIN_ROWS - 1, False, False),  # small
    ],
)
def test_which_tables_lack_column_statistics(
    reltuples: float, relpages: int, live: int, has_columns: bool, is_unanalyzed: bool
) -> None:
    assert (
        postgres_statistics.unanalyzed(reltuples, relpages, live, has_columns) is is_unanalyzed
    )


def test_a_locked_table_is_passed_over_not_waited_for(url: str) -> None:
    """Another session's lock that ANALYZE conflicts with (a VACUUM, a
    node's ANALYZE, LOCK TABLE) held the analyzer's thread, and with it a
    node's shutdown, until released; now the look goes on at once."""
    store = PostgresStore(url)
    try:
        pg.execute(url, _FILL, (3000,))
        pg.execute(url, "VACUUM jobs")
        until(lambda: live_rows(url) >= 3000, 10, "the fill's rows counted")
        holder = psycopg.connect(url)
        holder.execute("LOCK TABLE jobs IN SHARE UPDATE EXCLUSIVE MODE")
        # Ended after 8 s whatever happens, so that a wait fails, not hangs.
        ending = threading.Timer(
            8, pg.execute, (url, "SELECT pg_terminate_backend(%s)", (holder.info.backend_pid,))
        )
        ending.start()
        try:
            began = time.monotonic()
            store.keep_statistics()
            assert time.monotonic() - began < 5  # waited for the lock before
            assert column_statistics(url) == 0  # passed over
        finally:
            ending.cancel()
            # Released before the next look: a close alone leaves the backend
            # to release the lock as it exits, which the next ANALYZE (SKIP
            # LOCKED) could still find held (CI once did: no statistics).
            with contextlib.suppress(psycopg.Error):
                holder.rollback()
            holder.close()
        assert store.keep_statistics() is True
        assert column_statistics(url) > 0
    finally:
        store.close()


def test_the_analyzers_connection_has_its_own_statement_timeout(url: str) -> None:
    """A role's shorter statement_timeout failed every ANALYZE of a large
    table, once a second for good."""
    PostgresStore(url).close()  # the schema's tables
    with psycopg.connect(url, autocommit=True) as role:
        role.execute("SET statement_timeout = '20ms'")  # as a role's setting would
        keeper = postgres_statistics.StatisticsKeeper(lambda: role)
        keeper.keep()
        assert role.execute("SHOW statement_timeout").fetchone() == ("1min",)
