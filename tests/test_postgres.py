"""What only the PostgreSQL backend does: transactional enqueue from an
application's own transaction, Query as a read-only role, the schema and
its version, and choosing the backend by URL. (The protocol on it is
tested by the suites marked `backends`; several nodes in test_nodes.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pg
import psycopg
import pytest

from harness import ThreadServer
from helpers import create, ok, until
from jobserver.storage import postgres_schema
from jobserver.storage.postgres import PostgresStore
from jobserver.storage.postgres_connection import redact
from jobserver.storage.sqlite_schema import StoreError
from wire import Client, encode


@pytest.fixture
def url() -> Iterator[str]:
    with pg.fresh_schema() as schema_url:
        yield schema_url


@pytest.fixture
def node(url: str) -> Iterator[ThreadServer]:
    running = ThreadServer(url)
    yield running
    running.stop()


def waiting_get(node: ThreadServer, name: str, timeout_ms: int) -> Client:
    """A connection whose GetJob waits on the node's queue."""
    client = node.client(timeout=timeout_ms / 1000 + 10)
    client.send(encode("GetJob", {"name": name, "Connection": "wait", "timeout": timeout_ms}))
    until(lambda: len(node.server.core.engine.waits) > 0, 10, "the GetJob to wait")
    return client


def app_transaction(url: str, sql: str, params: tuple[Any, ...], commit: bool) -> int:
    """What an application does in its own transaction: returns the value."""
    with psycopg.connect(url) as db:
        row = db.execute(sql.encode(), params).fetchone()
        assert row is not None
        if commit:
            db.commit()
        else:
            db.rollback()
        return int(row[0])


# Transactional enqueue.


def test_a_job_created_in_a_committed_transaction_wakes_a_waiting_worker(
    node: ThreadServer, url: str
) -> None:
    worker = waiting_get(node, "mail/*", 20_000)
    started = time.monotonic()
    job_id = app_transaction(
        url, "SELECT jobserver_create_job('mail/welcome', '{\"to\":\"ann\"}')", (), commit=True
    )
    reply = ok(worker.read_reply())
    assert reply.json["jobID"] == job_id
    assert reply.json["data"] == {"to": "ann"}
    # Woken by the notice, not by the one-second fallback alone.
    assert time.monotonic() - started < 5


def test_a_rolled_back_transaction_leaves_no_job_and_wakes_nobody(
    node: ThreadServer, url: str
) -> None:
    worker = waiting_get(node, "mail/*", 1500)
    app_transaction(url, "SELECT jobserver_create_job('mail/welcome')", (), commit=False)
    assert worker.read_reply().status == "404 No job found"
    with node.client() as client:
        assert client.request("GetJob", name="mail/*").status == "404 No job found"


def test_the_function_takes_priority_and_a_first_run(node: ThreadServer, url: str) -> None:
    later = app_transaction(
        url, "SELECT jobserver_create_job('x', '{}', 1000, now() + interval '1 hour')", (),
        commit=True,
    )
    now = app_transaction(url, "SELECT jobserver_create_job('x', '{}', 0)", (), commit=True)
    with node.client() as client:
        job = ok(client.request("GetJob", name="x")).json
        assert job["jobID"] == now and job["priority"] == 0
        assert ok(client.request("QueryJob", jobID=later)).json["state"] == "QUEUED"
        assert client.request("GetJob", name="x").status == "404 No job found"


@pytest.mark.parametrize(
    "call",
    [
        "SELECT jobserver_create_job('')",
        "SELECT jobserver_create_job(repeat('x', 256))",
        "SELECT jobserver_create_job(E'a\\nb')",
        "SELECT jobserver_create_job('x', '[1]')",
        "SELECT jobserver_create_job('x', 'not json')",
        "SELECT jobserver_create_job('x', '{}', 7)",
    ],
)
def test_the_function_refuses_what_createjob_refuses(
    node: ThreadServer, url: str, call: str
) -> None:
    with pytest.raises(psycopg.Error):
        app_transaction(url, call, (), commit=True)
    with node.client() as client:
        reply = ok(client.request("Query", query="SELECT COUNT(*) AS n FROM jobs;", format="json"))
        assert reply.json["rows"] == [[0]]


# Query.


def test_query_reads_with_the_usual_column_names(node: ThreadServer) -> None:
    with node.client() as client:
        job_id = create(client, "report")
        reply = ok(client.request("Query", query="SELECT * FROM jobs;", format="json"))
        headers = reply.json["headers"]
        assert headers[:5] == ["created", "jobID", "state", "name", "nextRun"]
        assert reply.json["rows"][0][1] == job_id
        # Unquoted identifiers work as written, as on SQLite.
        reply = ok(client.request("Query", query="SELECT jobID, nextRun FROM jobs;"))
        assert reply.body.decode().splitlines()[0] == "jobID|nextRun"
        # Numbers stay numbers (SUM of a BIGINT is NUMERIC to PostgreSQL).
        sql = "SELECT SUM(priority) AS p, SUM(jobID) AS i, AVG(priority) AS a FROM jobs;"
        reply = ok(client.request("Query", query=sql, format="json"))
        assert reply.json["rows"] == [[500, job_id, 500]]


@pytest.mark.parametrize(
    "sql",
    [
        "DELETE FROM jobs;",
        "UPDATE jobs SET state = 'FAILED';",
        "INSERT INTO paused (pattern) VALUES ('x');",
        "SELECT jobserver_create_job('sneaky');",
        "CREATE TABLE t (x INTEGER);",
        "SET TRANSACTION READ WRITE;",
        "SELECT * FROM secrets;",
        "SELECT 1; DELETE FROM jobs;",
    ],
)
def test_query_cannot_write_or_read_other_tables(node: ThreadServer, url: str, sql: str) -> None:
    pg.execute(url, "CREATE TABLE secrets (word TEXT)")
    pg.execute(url, "INSERT INTO secrets VALUES ('swordfish')")
    with node.client() as client:
        job_id = create(client, "keep")
        reply = client.request("Query", query=sql)
        assert reply.status == "402 Bad query", reply
        assert ok(client.request("QueryJob", jobID=job_id)).json["state"] == "QUEUED"
        assert client.request("GetJob", name="sneaky").status == "404 No job found"


def test_query_past_its_time_is_stopped(url: str) -> None:
    node = ThreadServer(url, query_seconds=0.2)
    try:
        with node.client() as client:
            started = time.monotonic()
            assert client.request("Query", query="SELECT pg_sleep(30);").status == "555 Timeout"
            assert time.monotonic() - started < 10
    finally:
        node.stop()


# The schema.


def test_the_schema_records_its_version_and_a_newer_one_is_refused(url: str) -> None:
    PostgresStore(url).close()
    with psycopg.connect(url) as db:
        row = db.execute("SELECT version FROM jobserver_schema").fetchone()
        assert row == (postgres_schema.SCHEMA_VERSION,)
        db.execute("UPDATE jobserver_schema SET version = version + 1")
    with pytest.raises(StoreError, match="schema version"):
        PostgresStore(url)


def test_a_jobs_table_of_someone_else_is_refused(url: str) -> None:
    pg.execute(url, "CREATE TABLE jobs (id INTEGER)")
    with pytest.raises(StoreError, match="did not create"):
        PostgresStore(url)


def test_an_unreachable_database_is_refused_at_start() -> None:
    with pytest.raises(StoreError, match="cannot use"):
        PostgresStore("postgresql://postgres@127.0.0.1:1/none?connect_timeout=2")


def test_a_password_never_reaches_the_log() -> None:
    assert redact("postgresql://ann:s3cret@db:5432/jobs") == "postgresql://ann:***@db:5432/jobs"
    assert redact("postgres://db/jobs") == "postgres://db/jobs"


def test_postgres_scheme_is_accepted_too(url: str) -> None:
    node = ThreadServer(url.replace("postgresql://", "postgres://", 1))
    try:
        with node.client() as client:
            create(client, "x")
            status = ok(client.request("Status")).json
            assert status["database"]["path"].startswith("postgres://")
            assert status["database"]["bytes"] > 0
    finally:
        node.stop()


def test_serve_says_why_it_cannot_use_the_database() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "jobserver", "serve", "--port", "0",
         "--db", "postgresql://postgres@127.0.0.1:1/none"],
        capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 2
    assert "cannot use postgresql://postgres@127.0.0.1:1/none as a job database" in proc.stderr


# Two nodes' transactions in a deadlock.


def test_a_batch_undone_by_a_deadlock_is_run_again(node: ThreadServer, url: str) -> None:
    with node.client() as client:
        first, second = create(client, "a"), create(client, "b")
        ok(client.request("GetJobs", name="a,b", numResults=2))
        with psycopg.connect(url) as other:
            # The other transaction waits long before it looks for a
            # deadlock, so the server's transaction is the one undone.
            other.execute("SET deadlock_timeout = '30s'")
            other.execute("UPDATE jobs SET data = '{}' WHERE jobID = %s", (first,))
            jobs = json.dumps([{"jobID": second}, {"jobID": first}])
            client.send(encode("FinishJobs", {"jobs": jobs}))
            pids = [
                writer._db.info.backend_pid  # type: ignore[attr-defined]
                for writer in node.server.store.writers()  # type: ignore[union-attr]
            ]
            until(lambda: _waiting_for_a_lock(url, pids), 10, "the server to wait for the row")
            # Now each holds a row the other wants.
            other.execute("UPDATE jobs SET data = '{}' WHERE jobID = %s", (second,))
            other.commit()
        reply = ok(client.read_reply())
        assert [r["status"] for r in reply.json["results"]] == ["200 OK", "200 OK"]


def _waiting_for_a_lock(url: str, pids: list[int]) -> bool:
    """Whether one of these backends waits for a lock."""
    with psycopg.connect(url, autocommit=True) as db:
        row = db.execute(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = ANY(%s) "
            "AND wait_event_type = 'Lock'",
            (pids,),
        ).fetchone()
        return bool(row and row[0])


def test_queue_statistics_agree_with_sqlite(node: ThreadServer, tmp_path: Path) -> None:
    lite = ThreadServer(tmp_path / "jobs.db")
    try:
        for server in (node, lite):
            with server.client() as client:
                for name in ["a/x", "a/y", "/lead", "plain", "b/c/d"]:
                    create(client, name)
                create(client, "later/x", firstRun="2999-01-01")
                ok(client.request("GetJob", name="plain"))
        now = "2999-12-31 00:00:00.000"
        pg_counts, pg_oldest, pg_held = node.server.store.queue_stats(now)  # type: ignore[union-attr]
        counts, oldest, held = lite.server.store.queue_stats(now)  # type: ignore[union-attr]
        assert pg_counts == counts
        assert set(pg_oldest) == set(oldest) == {"a", "", "b", "later"}
        assert pg_held == held == {}
    finally:
        lite.stop()
