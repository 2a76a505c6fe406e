"""The schemas kept between tests (pg_pool.py) leave nothing of one test to
the next: a schema given out again has no rows, its job IDs start at 1,
its Query role is gone; one whose shape a test changed, or that something
wrote to after its test, is not given out again."""

from __future__ import annotations

import pg
import pg_pool
import psycopg

from harness import ThreadServer
from helpers import create, ok
from jobserver.storage import postgres_query


def _schema_of(url: str) -> str:
    with psycopg.connect(url) as db:
        row = db.execute("SELECT current_schema()").fetchone()
    assert row is not None
    return str(row[0])


def _role_exists(schema: str) -> bool:
    role = postgres_query.role_name(pg.DATABASE, schema)
    with psycopg.connect(pg.database_url()) as db:
        found = db.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
    return found is not None


def _fill(url: str) -> None:
    """What a test leaves: jobs in several states, a limit, a pause, a
    reply waited for, an idempotency key, the Query role a node made."""
    server = ThreadServer(url)
    try:
        with server.client() as client:
            for name in ("a", "b", "c"):
                create(client, name)
            ok(client.request("GetJob", name="a"))
            ok(client.request("SetLimit", name="b*", max=2))
            ok(client.request("PauseJobs", name="c*"))
            ok(client.request("CreateJob", name="d", idempotencyKey="key-1"))
    finally:
        server.stop()


def test_a_schema_given_out_again_has_nothing_of_the_last_test() -> None:
    with pg_pool.pooled_schema() as url:
        schema = _schema_of(url)
        _fill(url)
        assert _role_exists(schema)
    with pg_pool.pooled_schema() as again:
        assert _schema_of(again) == schema
        assert not _role_exists(schema)
        with psycopg.connect(again) as db:
            for table in ("jobs", "limits", "paused", "idempotency", "jobserver_query_login"):
                assert db.execute(f"SELECT count(*) FROM {table}".encode()).fetchone() == (0,)
        server = ThreadServer(again)
        try:
            with server.client() as client:
                assert create(client, "first") == 1
                assert ok(client.request("Status")).json["limits"] == {}
        finally:
            server.stop()


def test_a_schema_whose_shape_a_test_changed_is_dropped() -> None:
    with pg_pool.pooled_schema() as url:
        schema = _schema_of(url)
        pg.execute(url, "CREATE INDEX jobsByData ON jobs (data)")
    with pg_pool.pooled_schema() as other:
        assert _schema_of(other) != schema
    with psycopg.connect(pg.database_url()) as db:
        gone = db.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone()
    assert gone is None


def test_a_schema_written_to_after_its_test_is_not_given_out() -> None:
    """A node a test left running could write to its schema after the test
    gave it back."""
    with pg_pool.pooled_schema() as url:
        schema = _schema_of(url)
        stray = url
    pg.execute(stray, "INSERT INTO paused (pattern) VALUES ('late*')")
    with pg_pool.pooled_schema() as other:
        assert _schema_of(other) != schema
        assert pg.execute(other, "SELECT 1 FROM paused") == 0


def test_a_large_table_is_truncated_and_its_schema_kept() -> None:
    """Dead rows of earlier tests are bounded: a table grown past
    TRUNCATE_ABOVE_BYTES is truncated, which keeps the schema's shape."""
    with pg_pool.pooled_schema() as url:
        schema = _schema_of(url)
        pg.execute(url, "INSERT INTO paused SELECT 'p' || n FROM generate_series(1, 50000) n")
    with pg_pool.pooled_schema() as again:
        assert _schema_of(again) == schema
        with psycopg.connect(again) as db:
            size = db.execute("SELECT pg_total_relation_size('paused')").fetchone()
        assert size is not None and size[0] < pg_pool.TRUNCATE_ABOVE_BYTES


def test_a_schema_a_test_analyzed_is_dropped() -> None:
    """The planner's statistics of one test's rows would shape the plans of
    the next test's queries."""
    with pg_pool.pooled_schema() as url:
        schema = _schema_of(url)
        pg.execute(url, "INSERT INTO paused SELECT 'p' || n FROM generate_series(1, 100) n")
        pg.execute(url, "ANALYZE paused")
    with pg_pool.pooled_schema() as other:
        assert _schema_of(other) != schema
