"""Cancelling a running job (CancelJob with running: true, protocol.md
14.26): the job's cancel is pending until its worker's next report, which
is answered `410 Job cancelled` as the job ends CANCELLED; its lease's end
or its stale deadline end it if the worker is gone. On every backend, and
on three PostgreSQL nodes (each client of a test on the next node: the
cancel asked on one, the report refused on another), over real servers.
"""

from __future__ import annotations

import json
import re
import sqlite3
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pg
import psycopg
import pytest

from harness import ThreadServer
from helpers import create, ok, until
from jobserver.client import Client as LibraryClient
from jobserver.client import JobCancelled
from jobserver.core.rules.lifecycle import CANCELLED_WHILE_RUNNING
from jobserver.model import times
from jobserver.storage import postgres_schema
from jobserver.storage.postgres import PostgresStore
from jobserver.storage.sqlite import Store
from jobserver.storage.sqlite_schema import SCHEMA
from wire import Client, encode

pytestmark = pytest.mark.backends(nodes=True)

DEADLINE = 30.0
CANCELLED = "410 Job cancelled"


def query_job(client: Client, job_id: int) -> dict[str, Any]:
    return ok(client.request("QueryJob", jobID=job_id)).json


def take(client: Client, name: str, **params: Any) -> tuple[int, str]:
    """A job of `name` handed out now: its jobID and leaseID."""
    reply = ok(client.request("GetJob", name=name, includeLeaseID="true", **params))
    return reply.json["jobID"], reply.headers["leaseID"]


def cancel(client: Client, job_id: int) -> None:
    ok(client.request("CancelJob", jobID=job_id, running="true"))


def assert_cancelled(client: Client, job_id: int) -> None:
    job = query_job(client, job_id)
    assert job["state"] == "CANCELLED"
    assert "cancelRequested" not in job


# The cancel is pending until the worker reports.


def test_a_running_job_is_marked_and_its_next_report_ends_it(client):
    job_id = create(client, "long")
    taken, lease = take(client, "long")
    assert taken == job_id
    cancel(client, job_id)
    shown = query_job(client, job_id)
    assert (shown["state"], shown["cancelRequested"]) == ("RUNNING", True)
    # Asked again: nothing more happens.
    cancel(client, job_id)
    reply = client.request("FinishJob", jobID=job_id, leaseID=lease, data='{"done":1}')
    assert reply.status == CANCELLED
    assert_cancelled(client, job_id)
    # The report was not taken: the data is the job's own.
    assert query_job(client, job_id)["data"] == {}
    row = ok(client.request(
        "Query", query=f"SELECT lastError, ended > '' FROM jobs WHERE jobID = {job_id};",
        format="json",
    )).json
    assert row["rows"] == [[CANCELLED_WHILE_RUNNING, 1]]
    # Its run is over: a late report is refused as on any ended job.
    again = client.request("FinishJob", jobID=job_id)
    assert again.status == "405 Can only retry/finish RUNNING and RUNQUEUED jobs"


@pytest.mark.parametrize(
    "command,params",
    [
        ("TouchJob", {}),
        ("FinishJob", {}),
        ("FailJob", {"error": "broke"}),
        ("RetryJob", {"delay": "0"}),
        ("AwaitReply", {"key": "k1"}),
    ],
)
def test_every_report_answers_410_and_the_job_ends_cancelled(client, command, params):
    job_id = create(client, "each", maxAttempts=3)
    _, lease = take(client, "each", lease=60)
    assert query_job(client, job_id)["state"] == "RUNQUEUED"
    cancel(client, job_id)
    assert client.request(command, jobID=job_id, leaseID=lease, **params).status == CANCELLED
    assert_cancelled(client, job_id)
    # Never handed out again, retry policy or not.
    assert client.request("GetJob", name="each").status == "404 No job found"


@pytest.mark.parametrize("command", ["FinishJobs", "FailJobs", "RetryJobs"])
def test_a_many_report_answers_410_for_the_cancelled_element_alone(client, command):
    kept = create(client, "pair")
    cancelled = create(client, "pair")
    leases = dict(take(client, "pair") for _ in range(2))
    cancel(client, cancelled)
    jobs = [{"jobID": job_id, "leaseID": leases[job_id]} for job_id in (kept, cancelled)]
    results = ok(client.request(command, jobs=json.dumps(jobs))).json["results"]
    assert results == [
        {"jobID": kept, "status": "200 OK"}, {"jobID": cancelled, "status": CANCELLED},
    ]
    assert_cancelled(client, cancelled)


def test_a_report_under_another_lease_is_still_refused(client):
    job_id = create(client, "fenced")
    take(client, "fenced")
    cancel(client, job_id)
    reply = client.request("FinishJob", jobID=job_id, leaseID="0123456789abcdef")
    assert reply.status == "409 Lease expired"
    assert query_job(client, job_id)["cancelRequested"] is True


# Bedrock's CancelJob is kept unless asked.


def test_without_running_bedrocks_answers_are_kept(client):
    job_id = create(client, "plain")
    take(client, "plain")
    reply = client.request("CancelJob", jobID=job_id)
    assert reply.status == "404 Invalid jobID - Cannot cancel a job without a parent"
    assert "cancelRequested" not in query_job(client, job_id)
    ok(client.request("FinishJob", jobID=job_id))
    # running changes nothing for a job that is not handed out.
    queued = create(client, "plain")
    reply = client.request("CancelJob", jobID=queued, running="true")
    assert reply.status == "404 Invalid jobID - Cannot cancel a job without a parent"
    assert client.request("CancelJob", jobID=queued, running="yes").status == (
        "402 Malformed running (true or false)"
    )


# A child, and its parent.


def test_a_running_child_cancelled_lets_its_parent_resume(client):
    parent_id = create(client, "parent")
    take(client, "parent")
    child_id = create(client, "child", parentJobID=parent_id)
    ok(client.request("FinishJob", jobID=parent_id))
    assert query_job(client, parent_id)["state"] == "PAUSED"
    take(client, "child")
    # Bedrock's CancelJob leaves a RUNNING child as it is ...
    ok(client.request("CancelJob", jobID=child_id))
    assert query_job(client, child_id)["state"] == "RUNNING"
    # ... running: true cancels it at its next report.
    cancel(client, child_id)
    assert client.request("TouchJob", jobID=child_id).status == CANCELLED
    assert query_job(client, child_id)["state"] == "CANCELLED"
    assert query_job(client, parent_id)["state"] == "QUEUED"
    handed = ok(client.request("GetJob", name="parent")).json
    assert [c["jobID"] for c in handed["cancelledChildJobs"]] == [child_id]


def test_a_parent_whose_cancel_is_pending_takes_no_child(client):
    parent_id = create(client, "parent")
    take(client, "parent")
    cancel(client, parent_id)
    reply = client.request("CreateJob", name="child", parentJobID=parent_id)
    assert reply.status == CANCELLED
    # Refused, not ended: its worker's report ends it.
    assert query_job(client, parent_id)["state"] == "RUNNING"


# What runs again, and what it held.


def test_a_repeating_job_cancelled_while_running_does_not_repeat(client):
    job_id = create(client, "daily", repeat="STARTED, +1 HOUR")
    take(client, "daily")
    cancel(client, job_id)
    assert client.request("FinishJob", jobID=job_id).status == CANCELLED
    assert_cancelled(client, job_id)


def test_a_cancelled_job_frees_its_limit_and_wakes_a_waiting_get_job(server, client):
    ok(client.request("SetLimit", name="slot/*", max=1))
    first = create(client, "slot/a")
    second = create(client, "slot/b")
    taken, _ = take(client, "slot/*")
    assert taken == first
    assert client.request("GetJob", name="slot/*").status == "404 No job found"
    cancel(client, first)
    # The slot is held until the worker hears of the cancel.
    assert client.request("GetJob", name="slot/*").status == "404 No job found"
    with server.client(timeout=DEADLINE) as waiter:
        waiter.send(encode(
            "GetJob", {"name": "slot/*", "Connection": "wait", "timeout": int(DEADLINE * 1000)}
        ))
        until(lambda: _waiting(server), DEADLINE, "the GetJob to wait")
        assert client.request("TouchJob", jobID=first).status == CANCELLED
        assert ok(waiter.read_reply()).json["jobID"] == second


def _waiting(server: Any) -> bool:
    """A GetJob waits at the server; on three nodes, at the one this
    look's new connection reaches (each look the next node)."""
    with server.client() as look:
        return bool(ok(look.request("Status")).json["waitingGetJobs"])


# The worker is gone.


def test_a_leased_job_ends_cancelled_when_its_lease_ends(client):
    job_id = create(client, "leased")
    take(client, "leased", lease=1)
    cancel(client, job_id)
    # No GetJob for its name: the clock ends it.
    until(lambda: query_job(client, job_id)["state"] == "CANCELLED", DEADLINE,
          "the lease's end to cancel the job")
    assert_cancelled(client, job_id)


def test_a_leased_job_whose_lease_had_ended_is_cancelled_at_once(client):
    job_id = create(client, "late")
    take(client, "late", lease=1)
    # Past its lease, with no GetJob since: nobody holds it to be told.
    until(lambda: _next_run(client, job_id) < times.to_millis(times.utcnow()), DEADLINE,
          "the lease to end")
    cancel(client, job_id)
    assert_cancelled(client, job_id)


def _next_run(client: Client, job_id: int) -> str:
    return str(query_job(client, job_id)["nextRun"])


def test_a_running_job_ends_cancelled_at_its_stale_deadline(backend, db):
    server = ThreadServer(db, stale_after=1)
    try:
        with server.client() as client:
            job_id = create(client, "lost")
            take(client, "lost")
            cancel(client, job_id)
            until(lambda: query_job(client, job_id)["state"] == "CANCELLED", DEADLINE,
                  "the stale deadline to cancel the job")
            assert query_job(client, job_id).get("attempt") is None
    finally:
        server.stop()


# HTTP.


def test_http_cancels_and_answers_410(backend, db):
    server = ThreadServer(db, http_port=0)
    try:
        until(lambda: server.server.http_port, DEADLINE, "the HTTP side to listen")
        with server.client() as client:
            job_id = create(client, "web")
            take(client, "web")
        assert api(server, "CancelJob", {"jobID": job_id, "running": True})[0] == 200
        code, headers, _ = api(server, "FinishJob", {"jobID": job_id})
        assert (code, headers["Jobserver-Status"]) == (410, CANCELLED)
    finally:
        server.stop()


def api(server: ThreadServer, command: str, params: dict[str, Any]) -> tuple[int, Any, bytes]:
    url = f"http://127.0.0.1:{server.server.http_port}/api/{command}"
    request = urllib.request.Request(
        url, data=json.dumps(params).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE) as reply:
            return reply.status, reply.headers, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


# Storage.


def test_a_version_9_database_is_migrated_and_its_jobs_can_be_cancelled(backend, db, tmp_path):
    if isinstance(db, Path):
        old = tmp_path / "v9.db"
        # Version 9: the jobs table without version 10's columns (issue
        # 37's, after the lease), and none of its tables and indexes (the
        # schema's last statements).
        v9 = re.sub(r",\n    -- Dependencies \(protocol.*?(\n\);)", r"\1", SCHEMA, count=1,
                    flags=re.S)
        v9 = v9[: v9.index("-- The edges of the graph")]
        with sqlite3.connect(old) as raw:
            raw.executescript(v9)
            raw.execute(OLD_JOB)
            raw.execute("PRAGMA user_version = 9")
        Store(str(old)).close()
        Store(str(tmp_path / "fresh.db")).close()
        assert sqlite_shape(old) == sqlite_shape(tmp_path / "fresh.db")
        assert sqlite_shape(old)[0] == 11
        server = ThreadServer(old)
    else:
        PostgresStore(str(db)).close()
        pg.execute(str(db), "ALTER TABLE jobs DROP COLUMN cancelRequested")
        pg.execute(str(db), "UPDATE jobserver_schema SET version = 9")
        pg.execute(str(db), OLD_JOB)
        server = ThreadServer(db)
    try:
        with server.client() as client:
            job_id, _ = take(client, "from before")
            cancel(client, job_id)
            assert client.request("FinishJob", jobID=job_id).status == CANCELLED
            assert_cancelled(client, job_id)
    finally:
        server.stop()
    if not isinstance(db, Path):
        with psycopg.connect(str(db)) as conn:
            row = conn.execute("SELECT version FROM jobserver_schema").fetchone()
            index = conn.execute(
                "SELECT 1 FROM pg_indexes WHERE indexname = 'jobscancelling'"
            ).fetchone()
        assert row == (postgres_schema.SCHEMA_VERSION,) == (10,)
        assert index == (1,)


OLD_JOB = (
    "INSERT INTO jobs (created, state, name, nextRun) VALUES "
    "('2026-01-01 00:00:00', 'QUEUED', 'from before', '2026-01-01 00:00:00')"
)


def sqlite_shape(path: Path) -> tuple[int, tuple[object, ...], list[tuple[object, ...]]]:
    with sqlite3.connect(path) as raw:
        columns = raw.execute("PRAGMA table_info(jobs)").fetchall()
        index = raw.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'jobsCancelling'"
        ).fetchall()
        return raw.execute("PRAGMA user_version").fetchone()[0], tuple(columns[-1][1:5]), index


# The client library.


def test_the_client_cancels_and_a_report_raises_job_cancelled(server):
    with LibraryClient("127.0.0.1", server.port, timeout=DEADLINE) as jobs:
        job_id = jobs.create_job("library")
        taken = jobs.get_job("library")
        assert taken is not None and taken["jobID"] == job_id
        jobs.cancel_job(job_id, running=True)
        assert jobs.query_job(job_id)["cancelRequested"] is True
        with pytest.raises(JobCancelled) as raised:
            jobs.finish_job(job_id)
        assert raised.value.status == CANCELLED
        assert jobs.query_job(job_id)["state"] == "CANCELLED"


# CancelledJobs: a worker's cheaper check.


def test_cancelled_jobs_names_those_whose_cancel_is_pending(client):
    ids = [create(client, "checked") for _ in range(3)]
    for _ in ids:
        take(client, "checked")
    cancel(client, ids[1])
    asked = ",".join(map(str, [*ids, 999999, ids[1]]))
    assert ok(client.request("CancelledJobs", jobIDs=asked)).json == {"jobIDs": [ids[1]]}
    # A read: the job's cancel is still pending, until its worker reports.
    assert query_job(client, ids[1])["state"] == "RUNNING"
    assert client.request("TouchJob", jobID=ids[1]).status == CANCELLED
    assert ok(client.request("CancelledJobs", jobIDs=asked)).json == {"jobIDs": []}


@pytest.mark.parametrize(
    "value,status",
    [
        (None, "402 Missing jobIDs"),
        ("1,x", "402 Malformed jobIDs"),
        (",".join(["1"] * 1001), "413 Too many jobIDs (max 1000)"),
        # Counted before they are parsed (a 413, not the 402 of a parse):
        # parsed first, a line of a million held the writer up to 1.1 s.
        (",".join(["1"] * 1001 + ["x"]), "413 Too many jobIDs (max 1000)"),
    ],
)
def test_cancelled_jobs_refuses_a_bad_list(client, value, status):
    params = {} if value is None else {"jobIDs": value}
    assert client.request("CancelledJobs", **params).status == status
