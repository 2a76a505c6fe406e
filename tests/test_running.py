"""RunningJobs and Status' waiting GetJobs (protocol.md 14.21, 5.14): who
took each job handed out, on which node, for how long; who waits for
what. A real server on a loopback port, real sockets, on every backend."""

from __future__ import annotations

import http.client
import json
import re
import sqlite3
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pg
import psycopg
import pytest

from conformance_helpers import fmt, force, get_job, parse_time, utcnow
from harness import Nodes, ThreadServer
from helpers import create, ok, until
from jobserver.core.engine.context import Context, Settings
from jobserver.core.rules import creation, leases
from jobserver.model import times
from jobserver.model.jobs import NewJob
from jobserver.storage import postgres_schema, sql
from jobserver.storage.postgres import PostgresStore
from jobserver.storage.sqlite import Store
from jobserver.storage.sqlite_schema import SCHEMA
from wire import Client, encode

pytestmark = pytest.mark.backends

TIMEOUT = 10.0
DAY = 86400


def running(client: Client, **params: Any) -> dict[str, Any]:
    body: dict[str, Any] = ok(client.request("RunningJobs", **params)).json
    return body


def address(client: Client) -> str:
    """The client's end of its connection, as the server names a worker."""
    host, port = client.sock.getsockname()[:2]
    return f"{host}:{port}"


@pytest.fixture
def web(db: Path | str) -> Iterator[ThreadServer]:
    """A server with its HTTP side."""
    server = ThreadServer(db, http_port=0)
    until(lambda: server.server.http_port, TIMEOUT, "the HTTP side to listen")
    yield server
    server.stop()


def test_a_hand_out_on_the_wire_records_the_worker_and_the_node(server, client):
    node = f"127.0.0.1:{server.port}"
    first, second, third = (create(client, "report") for _ in range(3))
    with server.client() as worker, server.client() as other:
        get_job(worker, "report")
        ok(other.request("GetJobs", name="report", numResults=2))
        listed = running(client)
        assert (listed["total"], listed["more"]) == (3, 0)
        by_id = {job["jobID"]: job for job in listed["jobs"]}
        assert by_id[first]["worker"] == address(worker)
        assert by_id[second]["worker"] == by_id[third]["worker"] == address(other)
        assert {job["node"] for job in listed["jobs"]} == {node}
        # Once reported on, a job is no longer running: no longer listed.
        ok(worker.request("FinishJob", jobID=first))
        ok(other.request("RetryJob", jobID=second, delay=3600))
    assert [job["jobID"] for job in running(client)["jobs"]] == [third]


def test_a_waiting_get_job_records_the_worker_it_hands_the_job_to(server, client):
    with server.client() as worker:
        worker.send(encode("GetJob", {"name": "late", "Connection": "wait", "timeout": 10000}))
        until(lambda: ok(client.request("Status")).json["waitingGetJobs"] == 1, TIMEOUT, "wait")
        job_id = create(client, "late")
        assert ok(worker.read_reply()).json["jobID"] == job_id
        [job] = running(client)["jobs"]
        assert (job["jobID"], job["worker"]) == (job_id, address(worker))


def test_a_hand_out_over_http_records_the_worker(web, db):
    with web.client() as client:
        job_id = create(client, "report")
        connection = http.client.HTTPConnection("127.0.0.1", web.server.http_port, timeout=TIMEOUT)
        try:
            connection.connect()
            host, port = connection.sock.getsockname()[:2]
            connection.request(
                "POST",
                "/api/GetJob",
                json.dumps({"name": "report"}),
                {"Content-Type": "application/json"},
            )
            reply = connection.getresponse()
            assert (reply.status, json.loads(reply.read())["jobID"]) == (200, job_id)
            connection.request(
                "POST", "/api/RunningJobs", "{}", {"Content-Type": "application/json"}
            )
            listed = json.loads(connection.getresponse().read())
        finally:
            connection.close()
    [job] = listed["jobs"]
    assert (job["jobID"], job["worker"], job["node"]) == (
        job_id,
        f"{host}:{port}",
        f"127.0.0.1:{web.port}",
    )


def test_jobs_are_listed_the_longest_running_first_with_their_times(client, db):
    ids = [create(client, f"work/{n}") for n in range(3)]
    leased = create(client, "leased", retryAfter="+1 HOUR")
    for n in range(3):
        get_job(client, f"work/{n}")
    get_job(client, "leased")
    now = utcnow()
    # Started an hour, a minute and a second ago: the oldest first.
    ages = (timedelta(seconds=1), timedelta(hours=1), timedelta(minutes=1))
    for job_id, ago in zip(ids, ages, strict=True):
        force(db, "UPDATE jobs SET lastRun = ? WHERE jobID = ?", (fmt(now - ago), job_id))
    listed = running(client)
    assert [job["jobID"] for job in listed["jobs"]] == [ids[1], ids[2], ids[0], leased]
    oldest = listed["jobs"][0]
    assert oldest["state"] == "RUNNING"
    assert 3600 <= oldest["runningSeconds"] < 3600 + 60
    # A RUNNING job's hold ends at its stale deadline (--stale-after, a day).
    report = parse_time(oldest["lastReport"])
    assert parse_time(oldest["leaseEnds"]) - report == timedelta(seconds=DAY)
    lease = listed["jobs"][-1]
    assert lease["state"] == "RUNQUEUED"
    held = ok(client.request("QueryJob", jobID=leased)).json
    assert lease["leaseEnds"] == held["nextRun"][:19]
    # A leased job whose lease ended is no longer held by anyone.
    force(
        db, "UPDATE jobs SET nextRun = ? WHERE jobID = ?", (fmt(now - timedelta(hours=1)), leased)
    )
    assert leased not in [job["jobID"] for job in running(client)["jobs"]]


def test_a_limit_and_a_name_pattern_bound_the_list_and_the_total_counts_all(client):
    for name in ("email/a", "email/b", "email/c", "sms/a"):
        create(client, name)
        get_job(client, name)
    listed = running(client, limit=2)
    assert (len(listed["jobs"]), listed["total"], listed["more"]) == (2, 4, 2)
    emails = running(client, name="email/*")
    assert [job["name"] for job in emails["jobs"]] == ["email/a", "email/b", "email/c"]
    assert emails["total"] == 3
    newest = running(client, order="NEWEST", limit=2)
    assert [job["name"] for job in newest["jobs"]] == ["sms/a", "email/c"]
    assert newest["total"] == 4
    nothing = running(client, name="none*")
    assert (nothing["jobs"], nothing["total"], nothing["more"]) == ([], 0, 0)


@pytest.mark.parametrize(
    ("params", "status"),
    [
        ({"limit": "ten"}, "402 Malformed limit"),
        ({"limit": "+5"}, "402 Malformed limit"),
        ({"limit": "1_0"}, "402 Malformed limit"),
        ({"limit": "\u0665"}, "402 Malformed limit"),  # an Arabic-Indic 5
        ({"limit": "9" * 5000}, "402 Malformed limit"),
        ({"limit": 0}, "402 Malformed limit: 1 to 1000"),
        ({"limit": 1001}, "402 Malformed limit: 1 to 1000"),
        ({"order": "age"}, "402 Malformed order: oldest or newest"),
        ({"name": "a\x01b"}, "402 Malformed name"),
        ({"name": "x" * 12751}, "402 Name too large (12750 bytes at most)"),
    ],
)
def test_bad_parameters_are_refused_with_a_clear_status(client, params, status):
    assert client.request("RunningJobs", **params).status == status
    assert ok(client.request("Ping")).code == 200


def test_status_lists_the_waiting_get_jobs_oldest_first(server, client):
    with server.client() as first, server.client() as second, server.client() as third:
        first.send(encode("GetJob", {"name": "email/*", "Connection": "wait", "timeout": 10000}))
        until(lambda: ok(client.request("Status")).json["waitingGetJobs"] == 1, TIMEOUT, "one")
        for waiter in (second, third):
            waiter.send(encode("GetJob", {"name": "sms", "Connection": "wait", "timeout": 10000}))
        status = until(
            lambda: (s := ok(client.request("Status")).json)["waitingGetJobs"] == 3 and s,
            TIMEOUT,
            "three waiters",
        )
        waiting = status["waiting"]
        assert [w["peer"] for w in waiting[:1]] == [address(first)]
        assert {w["peer"] for w in waiting[1:]} == {address(second), address(third)}
        assert [w["name"] for w in waiting] == ["email/*", "sms", "sms"]
        assert all(w["seconds"] >= 0 and w["since"] for w in waiting)
        assert status["waitingByName"] == [
            {"name": "sms", "waiting": 2},
            {"name": "email/*", "waiting": 1},
        ]
        create(client, "email/x")
        assert ok(first.read_reply()).code == 200
        until(lambda: ok(client.request("Status")).json["waitingGetJobs"] == 2, TIMEOUT, "two")


def test_the_list_is_read_through_an_index_of_the_jobs_handed_out(server, client, db):
    create(client, "x")
    get_job(client, "x")
    now = fmt(utcnow())
    if isinstance(db, Path):
        (listed, args), _ = sql.running_jobs(sql.SQLITE, now, None, 100)
        plan = sqlite3.connect(db).execute(f"EXPLAIN QUERY PLAN {listed}", args).fetchall()
        text = " ".join(str(row[-1]) for row in plan)
        assert "jobsActiveStarted" in text and "TEMP B-TREE" not in text, text
        return
    # Enough jobs, queued and running, that the planner's choice is the
    # one a busy queue gets.
    pg.execute(
        str(db),
        "INSERT INTO jobs (created, state, name, nextRun, lastRun) SELECT '', "
        "CASE WHEN n %% 10 = 0 THEN 'RUNNING' ELSE 'QUEUED' END, 'job' || n, '', "
        "'2026-01-01 00:00:00' FROM generate_series(1, 20000) AS n",
    )
    (listed, args), _ = sql.running_jobs(sql.POSTGRES, now, None, 100)
    with psycopg.connect(str(db), autocommit=True) as conn:
        conn.execute("ANALYZE jobs")
        rows = conn.execute(f"EXPLAIN {listed}".encode(), args).fetchall()
    text = " ".join(row[0] for row in rows)
    assert "jobsactivestarted" in text.lower() and "Sort" not in text, text


def test_an_older_database_is_migrated_and_keeps_its_jobs(backend, db, tmp_path):
    if isinstance(db, Path):
        old = tmp_path / "v5.db"
        raw = sqlite3.connect(old)
        # Version 5: the schema without what step 5 adds.
        before = re.sub(r",\n    -- Who took.*?(\n\);)", r"\1", SCHEMA, flags=re.S)
        before = before.split("-- RunningJobs")[0]
        # ... and without version 8's rates, keys and fairness.
        before = re.sub(r"(capacity INTEGER NOT NULL),\n    -- A rate.*?\n\);", r"\1\n);",
                        before, flags=re.S)
        before = re.sub(r"-- Hand-outs under a rate.*?PRIMARY KEY \(pattern, key\)\n\);", "",
                        before, flags=re.S)
        assert "rate" not in before and "fairServed" not in before
        assert "worker" not in before and "jobsActiveStarted" not in before
        raw.executescript(before)
        raw.execute(
            "INSERT INTO jobs (created, state, name, nextRun, lastRun, lastReport) VALUES "
            "('2026-01-01 00:00:00', 'RUNNING', 'was running', '2026-01-01 00:00:00', "
            "'2026-01-02 03:04:05', '2026-01-02 03:04:05')"
        )
        raw.execute("PRAGMA user_version = 5")
        raw.commit()
        raw.close()
        Store(str(old)).close()
        Store(str(tmp_path / "fresh.db")).close()
        assert _sqlite_layout(old) == _sqlite_layout(tmp_path / "fresh.db")
        server = ThreadServer(old)
    else:
        PostgresStore(str(db)).close()
        # Version 4: the schema before step 5.
        pg.execute(str(db), "DROP INDEX jobsActiveStarted")
        pg.execute(str(db), "ALTER TABLE jobs DROP COLUMN worker, DROP COLUMN node")
        pg.execute(str(db), "UPDATE jobserver_schema SET version = 4")
        pg.execute(
            str(db),
            "INSERT INTO jobs (created, state, name, nextRun, lastRun, lastReport) VALUES "
            "('2026-01-01 00:00:00', 'RUNNING', 'was running', '2026-01-01 00:00:00', "
            "'2026-01-02 03:04:05', '2026-01-02 03:04:05')",
        )
        server = ThreadServer(db)
    try:
        with server.client() as client:
            [job] = running(client)["jobs"]
            assert (job["name"], job["worker"], job["node"]) == ("was running", "", "")
            assert job["started"] == "2026-01-02 03:04:05"
            create(client, "new")
            get_job(client, "new")
            assert address(client) in {j["worker"] for j in running(client)["jobs"]}
    finally:
        server.stop()
    if not isinstance(db, Path):
        with psycopg.connect(str(db)) as conn:
            row = conn.execute("SELECT version FROM jobserver_schema").fetchone()
        assert row == (postgres_schema.SCHEMA_VERSION,) == (10,)


def _sqlite_layout(path: Path) -> tuple[Any, ...]:
    db = sqlite3.connect(path)
    try:
        # ALTER TABLE changes the text of jobs and limits: their columns
        # are compared instead.
        columns = [db.execute(f"PRAGMA table_info({t})").fetchall() for t in ("jobs", "limits")]
        objects = db.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL "
            "AND name NOT IN ('jobs', 'limits') ORDER BY name"
        ).fetchall()
        return db.execute("PRAGMA user_version").fetchone()[0], columns, objects
    finally:
        db.close()


def test_on_several_nodes_each_job_names_the_node_it_was_taken_on(backend, db):
    if backend != "postgres":
        pytest.skip("nodes share a PostgreSQL queue")
    nodes = Nodes(str(db), 2)
    try:
        first, second = nodes.nodes
        with first.client() as one, second.client() as two:
            taken = {}
            for worker in (one, two):
                create(worker, "shared")
                taken[get_job(worker, "shared")["jobID"]] = worker
            # Either node lists every job of the queue, each with its own node.
            for asker in (one, two):
                listed = {job["jobID"]: job for job in running(asker)["jobs"]}
                assert {job_id: (job["worker"], job["node"]) for job_id, job in listed.items()} == {
                    job_id: (address(worker), f"127.0.0.1:{node.port}")
                    for (job_id, worker), node in zip(taken.items(), (first, second), strict=True)
                }
            # Each node's waiting GetJobs are its own.
            one.send(encode("GetJob", {"name": "idle", "Connection": "wait", "timeout": 10000}))
            with first.client() as here:
                waiting = until(
                    lambda: ok(here.request("Status")).json["waiting"], TIMEOUT, "the waiter"
                )
            assert [w["peer"] for w in waiting] == [address(one)]
            assert ok(two.request("Status")).json["waiting"] == []
            create(two, "idle")
            assert ok(one.read_reply()).code == 200
    finally:
        nodes.stop()


def test_a_give_back_restores_who_had_the_job_before(store):
    """A hand-out whose reply never reached its worker is undone whole:
    the job names no worker it never reached."""
    ctx = Context(store, times.utcnow(), Settings(node="node-a:8888"))
    store.begin()
    job_id = creation.create(ctx, NewJob(name="job", next_run=ctx.now_ms, priority=500), None)
    before = store.get(job_id)
    assert before is not None
    lease = leases.hand_out(ctx, before, "10.0.0.7:4242")
    assert lease is not None
    taken = store.get(job_id)
    assert taken is not None
    assert (taken.state, taken.worker, taken.node) == ("RUNNING", "10.0.0.7:4242", "node-a:8888")
    leases.give_back(ctx, before, lease)
    back = store.get(job_id)
    assert back is not None
    assert (back.state, back.worker, back.node) == ("QUEUED", "", "")
    store.rollback()
