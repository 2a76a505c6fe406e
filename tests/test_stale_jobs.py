"""The stale-job safety net (--stale-after): a RUNNING job whose worker
stopped reporting is failed through its retry policy, on the clock.

These run on real time with a two-second setting: each check is a lower
bound (never failed before its deadline) or a poll with a generous limit.
"""

from __future__ import annotations

import signal
import socket
import sqlite3
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from test_replies import schema, v3_file

from harness import ThreadServer
from helpers import until
from jobserver.core.engine.context import Context, Settings
from jobserver.core.engine.stale import expire, lost_error
from jobserver.model import times
from jobserver.model.jobs import JobChanges, NewJob
from jobserver.storage.sqlite import Store
from jobserver.storage.sqlite_schema import MIGRATIONS, SCHEMA_VERSION

STALE = 2.0
DEADLINE = 30.0


def query(client, job_id: int) -> dict:
    reply = client.request("QueryJob", jobID=job_id)
    assert reply.code == 200, reply.status
    return reply.json


def test_a_running_job_with_no_report_fails_after_stale_after(tmp_path: Path) -> None:
    server = ThreadServer(tmp_path / "jobs.db", stale_after=STALE)
    try:
        with server.client() as client:
            job_id = client.request("CreateJob", name="lost").json["jobID"]
            handed = time.monotonic()
            assert client.request("GetJob", name="lost").code == 200
            # Bedrock clients see an ordinary RUNNING job until the deadline.
            assert query(client, job_id)["state"] == "RUNNING"
            until(lambda: query(client, job_id)["state"] == "FAILED", DEADLINE, "the net")
            assert time.monotonic() - handed >= STALE - 0.01  # times are kept to the millisecond
            failed = client.request("FailedJobs").json["jobs"]
            assert [(j["jobID"], j["lastError"]) for j in failed] == [(job_id, lost_error(STALE))]
            assert (
                lost_error(STALE)
                == "no report for 2s (--stale-after): presumed lost with its worker"
            )
    finally:
        server.stop()


def test_a_stale_job_with_a_retry_policy_is_retried_and_counted(tmp_path: Path) -> None:
    server = ThreadServer(tmp_path / "jobs.db", stale_after=STALE)
    try:
        with server.client() as client, server.client() as worker:
            job_id = client.request(
                "CreateJob", name="flaky", maxAttempts=2, retryBackoff="fixed", retryDelay=0
            ).json["jobID"]
            first = client.request("GetJob", name="flaky", includeLeaseID="true")
            assert first.json["attempt"] == 1
            # The second attempt goes to a waiting worker when the first is lost.
            second = worker.request(
                "GetJob", name="flaky", Connection="wait", timeout=int(DEADLINE * 1000)
            )
            assert second.code == 200 and second.json["jobID"] == job_id
            assert second.json["attempt"] == 2
            assert query(client, job_id)["lastError"] == lost_error(STALE)
            # The first worker's late report is refused: it lost the job.
            late = client.request("FinishJob", jobID=job_id, leaseID=first.headers["leaseID"])
            assert late.status == "409 Lease expired"
            # The last attempt lost as well: the job is dead.
            until(lambda: query(client, job_id)["state"] == "FAILED", DEADLINE, "the end")
    finally:
        server.stop()


def test_reports_restart_the_count(tmp_path: Path) -> None:
    server = ThreadServer(tmp_path / "jobs.db", stale_after=STALE)
    try:
        with server.client() as client:
            touched_id = client.request("CreateJob", name="touched").json["jobID"]
            updated_id = client.request("CreateJob", name="updated").json["jobID"]
            assert client.request("GetJob", name="touched").code == 200
            assert client.request("GetJob", name="updated").code == 200
            reported = time.monotonic()
            touch = client.request("TouchJob", jobID=touched_id)
            assert touch.code == 200 and set(touch.json) == {"staleAt"}
            assert client.request("UpdateJob", jobID=updated_id, data={"progress": 1}).code == 200
            for job_id in (touched_id, updated_id):
                until(
                    lambda job_id=job_id: query(client, job_id)["state"] == "FAILED",
                    DEADLINE,
                    "the net",
                )
            assert time.monotonic() - reported >= STALE - 0.01  # times are kept to the millisecond
            # A finished job is none of the net's business.
            done = client.request("CreateJob", name="done").json["jobID"]
            assert client.request("GetJob", name="done").code == 200
            assert client.request("FinishJob", jobID=done).code == 200
            assert client.request("QueryJob", jobID=done).code == 404
    finally:
        server.stop()


def test_leased_waiting_and_paused_jobs_are_left_to_their_own_rules(tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    store = Store(str(db))
    long_ago = "2000-01-01 00:00:00"
    for state in ("RUNQUEUED", "WAITING", "PAUSED", "QUEUED", "RUNNING"):
        ids = store.create(
            [NewJob(name=state, next_run="2999-01-01 00:00:00", priority=500)],
            created=long_ago, state=state,
        )
        store.amend(ids, JobChanges(lastReport=long_ago, lastRun=long_ago))
    ctx = Context(store, times.utcnow(), Settings(stale_after=STALE))
    store.begin()
    expire(ctx)
    store.commit()
    states = dict(store._db.execute("SELECT name, state FROM jobs").fetchall())
    assert states == {
        "RUNQUEUED": "RUNQUEUED", "WAITING": "WAITING", "PAUSED": "PAUSED",
        "QUEUED": "QUEUED", "RUNNING": "FAILED",
    }
    store.close()


def test_stale_after_0_keeps_bedrocks_running_forever(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "jobs.db"))
    (job_id,) = store.create(
        [NewJob(name="forever", next_run="2000-01-01 00:00:00", priority=500)],
        created="2000-01-01 00:00:00", state="RUNNING",
    )
    store.note_report([job_id], "2000-01-01 00:00:00")
    store.begin()
    expire(Context(store, times.utcnow(), Settings(stale_after=0)))
    store.commit()
    job = store.get(job_id)
    assert job is not None and job.state == "RUNNING"
    store.close()


def test_time_the_server_was_down_does_not_count_against_workers(
    start_server, tmp_path: Path
) -> None:
    db = tmp_path / "jobs.db"
    first = start_server(db, "--stale-after", "0")
    with first.client() as client:
        job_id = client.request("CreateJob", name="orphan").json["jobID"]
        assert client.request("GetJob", name="orphan").code == 200
    first.signal(signal.SIGTERM)
    assert first.wait() == 0
    # The server is down for a day: its worker could not have reported.
    yesterday = (datetime.now(UTC) - timedelta(days=1)).strftime("%Y-%m-%d %H:%M:%S")
    with sqlite3.connect(db) as raw:
        raw.execute("UPDATE jobs SET lastReport = ? WHERE jobID = ?", (yesterday, job_id))
    before_start = time.monotonic()
    second = start_server(db, "--stale-after", "2s")
    with second.client() as client:
        assert query(client, job_id)["state"] == "RUNNING"
        # Silence is counted from the start: the deadline still fires by
        # itself, with nobody waiting and nothing else due.
        until(lambda: query(client, job_id)["state"] == "FAILED", DEADLINE, "the net")
        assert time.monotonic() - before_start >= STALE - 0.01  # times are kept to the millisecond
        [failed] = client.request("FailedJobs").json["jobs"]
        assert failed["lastError"].startswith("no report for 2s")


def test_a_version_4_file_is_migrated_to_version_5(tmp_path: Path) -> None:
    old = v3_file(tmp_path / "old.db")
    with sqlite3.connect(old) as db:
        for statement in MIGRATIONS[3]:
            db.execute(statement)
        db.execute("PRAGMA user_version = 4")
        db.execute(
            "INSERT INTO jobs (created, state, name, nextRun, lastRun) VALUES "
            "('2026-01-01 00:00:00', 'RUNNING', 'was running', '2026-01-01 00:00:00', "
            "'2026-01-02 03:04:05')"
        )
    Store(str(old)).close()
    Store(str(tmp_path / "fresh.db")).close()
    assert SCHEMA_VERSION == 11
    assert schema(old) == schema(tmp_path / "fresh.db")
    with sqlite3.connect(old) as db:
        rows = db.execute("SELECT name, lastReport FROM jobs ORDER BY jobID").fetchall()
    # A job running before the upgrade counts from its hand-out; others
    # have no report to count from.
    assert ("was running", "2026-01-02 03:04:05") in rows
    assert all(report == "" for name, report in rows if name != "was running")


def test_a_late_give_back_does_not_undo_a_newer_hand_out(start_server, tmp_path: Path) -> None:
    """A reply stuck in a client that stopped reading is given back only
    after --request-timeout; by then the job's lease ran out and another
    worker has it. The give-back must leave that hand-out alone."""
    server = start_server(tmp_path / "jobs.db", "--request-timeout", "3")
    with server.client() as admin, server.client() as second:
        job_id = admin.request(
            "CreateJob", name="leased", retryAfter="+1 SECONDS", data={"x": "y" * 300_000}
        ).json["jobID"]
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(("127.0.0.1", server.port))
        stuck.sendall(b"GetJob\r\nname: leased\r\n\r\n")
        until(lambda: query(admin, job_id)["state"] == "RUNQUEUED", DEADLINE, "the hand-out")
        taken = second.request(
            "GetJob", name="leased", Connection="wait", timeout=int(DEADLINE * 1000)
        )
        assert taken.code == 200, taken.status
        lease = taken.headers["leaseID"]
        until(lambda: "put back" in server.log, DEADLINE, "the stuck reply to time out")
        # Written by the same writer thread: a QueryJob now sees its result.
        job = query(admin, job_id)
        assert job["state"] == "RUNQUEUED" and taken.json["jobID"] == job_id
        assert admin.request("FinishJob", jobID=job_id, leaseID=lease).code == 200
        stuck.close()
