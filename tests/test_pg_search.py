"""GetJob's search on PostgreSQL: whether each job it finds has children
comes with the job, a search goes on after what it passed over, and a
schema of version 10 is brought to version 11 (the search's range starts
after what it passed over) with the same functions as a new one."""

from __future__ import annotations

from collections.abc import Iterator

import pg
import psycopg
import pytest
from driver import NOW, PAST, create, job, transaction

from jobserver.model.jobs import Job, State
from jobserver.storage import postgres_schema
from jobserver.storage.postgres import PostgresStore
from jobserver.storage.postgres_functions import FIND_READY_AFTER_FUNCTION
from jobserver.storage.searches import PassedOver
from jobserver.storage.sql import JOB


@pytest.fixture
def url() -> Iterator[str]:
    with pg.fresh_schema() as schema_url:
        yield schema_url


def functions(url: str) -> list[tuple[str, str, str, str]]:
    """The schema's functions: name, arguments, result, body (the
    schema's own name, which the enqueue's channel holds, left out)."""
    with psycopg.connect(url) as db:
        schema = str(db.execute("SELECT current_schema()").fetchone()[0])  # type: ignore[index]
        rows = db.execute(
            "SELECT p.proname, pg_get_function_identity_arguments(p.oid), "
            "pg_get_function_result(p.oid), p.prosrc FROM pg_proc p "
            "WHERE p.pronamespace = current_schema()::regnamespace ORDER BY 1, 2"
        ).fetchall()
    return [(str(a), str(b), str(c), str(d).replace(schema, "")) for a, b, c, d in rows]


def test_each_job_found_says_whether_it_has_children(url: str) -> None:
    store = PostgresStore(url)
    try:
        parent, alone = create(store, job("p"), job("q"))
        create(store, job("child", parent_id=parent), state=State.WAITING)
        with transaction(store), store.holding_writes():
            found = store.find_ready(now=NOW, priorities=[500], limit=10, patterns=["p", "q"])
            assert {j.jobID for j in found} == {parent, alone}
            # Answered from what the search said: the child, deleted by
            # another connection meanwhile, is still counted.
            pg.execute(url, "DELETE FROM jobs WHERE name = 'child'")
            assert store.has_children(parent) is True
            assert store.has_children(alone) is False
    finally:
        store.close()


def test_a_search_goes_on_after_the_job_it_passed_over(url: str) -> None:
    store = PostgresStore(url)
    try:
        ids = create(store, *(job(f"n{i}", next_run=PAST) for i in range(5)))
        with transaction(store):
            first = store.find_ready(now=NOW, priorities=[500], limit=2, patterns=["n*"])
        assert [j.jobID for j in first] == ids[:2]
        last = first[-1]
        after = PassedOver(after=(500, last.nextRun, last.name, last.jobID))
        with transaction(store):
            rest = store.find_ready(
                now=NOW, priorities=[1000, 500, 0], limit=10, patterns=["n*"], passed=after
            )
        assert [j.jobID for j in rest] == ids[2:]
    finally:
        store.close()


def test_a_version_10_schema_is_brought_to_version_11(url: str) -> None:
    PostgresStore(url).close()
    # Version 10's search: what it passed over left out from the priority's
    # first entry on.
    old_after = "AND (priority, nextRun, name, jobID) > (level, after_next"
    old = FIND_READY_AFTER_FUNCTION.replace("AND (nextRun, name, jobID) > (after_next", old_after)
    assert old.count(old_after) == 2
    pg.execute(url, old)
    pg.execute(url, "UPDATE jobserver_schema SET version = 10")
    assert old_after in str(functions(url))
    store = PostgresStore(url)
    try:
        ids = create(store, *(job(f"n{i}") for i in range(3)))
        first = Job(*pg_row(url, ids[0]))
        after = PassedOver(after=(500, first.nextRun, first.name, first.jobID))
        with transaction(store):
            found = store.find_ready(
                now=NOW, priorities=[500], limit=10, patterns=["n*"], passed=after
            )
        assert [j.jobID for j in found] == ids[1:]
    finally:
        store.close()
    with psycopg.connect(url) as db:
        row = db.execute("SELECT version FROM jobserver_schema").fetchone()
    assert row == (postgres_schema.SCHEMA_VERSION,) == (11,)
    with pg.fresh_schema() as fresh:
        PostgresStore(fresh).close()
        assert functions(url) == functions(fresh)


def pg_row(url: str, job_id: int) -> tuple[object, ...]:
    with psycopg.connect(url) as db:
        row = db.execute(f"SELECT {JOB} FROM jobs WHERE jobID = %s", (job_id,)).fetchone()
    assert row is not None
    return tuple(row)
