"""A lease asked for by the worker (GetJob's and GetJobs' `lease`,
protocol.md 14.24): a job without retryAfter taken under one is due again
when it ends, unless renewed (TouchJob) or reported; a job's own lease and
retry policy win. On every backend, over a real server.

Leases are one or two seconds; waits poll with a generous deadline.
"""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import pg
import psycopg
import pytest

from conformance_helpers import row
from harness import ThreadServer
from helpers import create, ok
from jobserver.core.rules import leases
from jobserver.core.rules.leases import LEASE_EXPIRED, OUT_OF_LEASES
from jobserver.storage import postgres_schema
from jobserver.storage.postgres import PostgresStore
from jobserver.storage.sqlite import Store
from jobserver.storage.sqlite_schema import SCHEMA, SCHEMA_VERSION
from wire import Client, Reply

pytestmark = pytest.mark.backends

DEADLINE = 30.0
# Past a lease's end, how long its job may take to come back on a loaded machine.
SLACK = 3.0
# Lost leases before a job is failed, in place of Bedrock's ten (MAX_LEASES)
# for the tests that lose them all: each lost lease is a second waited, and
# ten took 11 s a test on each backend. The server runs in the test's
# process (ThreadServer), so the rule counts to this; test_clock.py counts
# the ten of a job's own lease on a clock that does not wait.
FEW_LEASES = 3


@pytest.fixture
def few_leases(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(leases, "MAX_LEASES", FEW_LEASES)
    return FEW_LEASES


def query_job(client: Client, job_id: int) -> dict[str, Any]:
    return ok(client.request("QueryJob", jobID=job_id)).json


def take(client: Client, name: str, **params: Any) -> Reply:
    """GetJob until it hands out a job (waiting for one, within DEADLINE)."""
    return ok(
        client.request(
            "GetJob", name=name, Connection="wait", timeout=int(DEADLINE * 1000), **params
        )
    )


def last_look(client: Client, name: str) -> Reply:
    """A GetJob that waits past a one-second lease's end."""
    return client.request("GetJob", name=name, Connection="wait", timeout=2500)


def test_a_job_taken_under_a_lease_is_due_again_when_it_ends(server, client):
    job_id = create(client, "thumb")
    asked = time.monotonic()
    first = take(client, "thumb", lease=1)
    assert first.json["jobID"] == job_id and "leaseID" in first.headers
    assert query_job(client, job_id)["state"] == "RUNQUEUED"
    # Nobody else gets it while the lease runs...
    assert client.request("GetJob", name="thumb").status == "404 No job found"
    # ... and a waiting worker gets it once the lease ends, with no report.
    with server.client() as other:
        second = take(other, "thumb")
    assert time.monotonic() - asked >= 0.99
    assert second.json["jobID"] == job_id
    assert second.headers.get("leaseID", "") != first.headers["leaseID"]
    # Taken without a lease this time: RUNNING, as in Bedrock.
    job = query_job(client, job_id)
    assert job["state"] == "RUNNING" and job["data"] == {}
    late = client.request("FinishJob", jobID=job_id, leaseID=first.headers["leaseID"])
    assert late.status == "409 Lease expired"


def test_touch_job_renews_the_takers_lease(server, client):
    job_id = create(client, "long")
    lease = take(client, "long", lease=1).headers["leaseID"]
    with server.client() as other:
        end = time.monotonic() + 3
        while time.monotonic() < end:
            reply = ok(client.request("TouchJob", jobID=job_id, leaseID=lease))
            assert query_job(client, job_id)["nextRun"] == reply.json["nextRun"]
            assert other.request("GetJob", name="long").status == "404 No job found"
            time.sleep(0.2)
    ok(client.request("FinishJob", jobID=job_id, leaseID=lease))
    assert client.request("QueryJob", jobID=job_id).status == "404 No job with this jobID"


def test_touch_job_with_a_lease_replaces_the_takers(server, client):
    """A handler's own lease (protocol.md 14.4): TouchJob's `lease` is the
    job's lease from then on, renewed by it, and ends by it."""
    job_id = create(client, "handled")
    lease = take(client, "handled", lease=60).headers["leaseID"]
    ok(client.request("TouchJob", jobID=job_id, leaseID=lease, lease=1))
    with server.client() as other:
        # Plain renewals now renew by one second...
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            ok(client.request("TouchJob", jobID=job_id, leaseID=lease))
            assert other.request("GetJob", name="handled").status == "404 No job found"
            time.sleep(0.2)
        # ... and once they stop, the job is due within a second, not sixty.
        stopped = time.monotonic()
        assert take(other, "handled").json["jobID"] == job_id
    assert time.monotonic() - stopped < 1 + SLACK


def test_a_jobs_own_lease_wins_over_touch_jobs(server, client):
    job_id = create(client, "own lease", retryAfter="+1 HOUR")
    lease = take(client, "own lease", lease=60).headers["leaseID"]
    ok(client.request("TouchJob", jobID=job_id, leaseID=lease, lease=1))
    time.sleep(1.5)
    assert client.request("GetJob", name="own lease").status == "404 No job found"


def test_touch_job_with_a_lease_leaves_a_job_taken_without_one_running(server, client):
    """Taken without a lease, a job has no leaseID: `lease` is refused and
    a plain TouchJob is its sign of life, as in Bedrock."""
    job_id = create(client, "no lease")
    assert "leaseID" not in take(client, "no lease").headers
    refused = client.request("TouchJob", jobID=job_id, lease=1).status
    assert refused.startswith("402 Missing leaseID")
    ok(client.request("TouchJob", jobID=job_id))
    assert query_job(client, job_id)["state"] == "RUNNING"


def test_only_the_leases_holder_changes_its_length(server, client):
    """A renewal without a leaseID may come from anyone: `lease` with it
    is refused, so a stranger cannot shorten a holder's lease until the
    job runs twice (a `lease: 1` was kept for the holder's renewals)."""
    job_id = create(client, "held")
    lease = take(client, "held", lease=60).headers["leaseID"]
    before = query_job(client, job_id)["nextRun"]
    with server.client() as stranger:
        reply = stranger.request("TouchJob", jobID=job_id, lease=1)
    assert reply.status == "402 Missing leaseID (a lease's length is changed only with its leaseID)"
    time.sleep(0.01)
    renewed = ok(client.request("TouchJob", jobID=job_id, leaseID=lease)).json["nextRun"]
    assert renewed >= before  # still sixty seconds from now, not one
    time.sleep(1.5)
    assert client.request("GetJob", name="held").status == "404 No job found"


@pytest.mark.parametrize(
    ("value", "status"),
    [("x", "402 Malformed lease"), ("0", "402 Lease out of range (1 to 86400 seconds)")],
)
def test_a_bad_lease_on_touch_job_is_refused(server, client, value, status):
    job_id = create(client, "bad touch")
    lease = take(client, "bad touch", lease=60).headers["leaseID"]
    before = query_job(client, job_id)["nextRun"]
    reply = client.request("TouchJob", jobID=job_id, leaseID=lease, lease=value)
    assert reply.status == status
    assert query_job(client, job_id)["nextRun"] == before


def test_a_job_taken_again_without_a_lease_keeps_none_of_its_last_takers(server, client):
    """Taken under a lease, put back, then taken without one: the row
    keeps no lease (a hand-out of a job without one of its own is written
    the short way, lifecycle.hand_out_plain, which must not be it), so it
    stays RUNNING, as a job never leased does."""
    job_id = create(client, "relet")
    lease = take(client, "relet", lease=60).headers["leaseID"]
    ok(client.request("RetryJob", jobID=job_id, leaseID=lease, delay=0))
    assert "leaseID" not in take(client, "relet").headers
    assert row(client, job_id)["lease"] == 0
    assert query_job(client, job_id)["state"] == "RUNNING"


def test_a_jobs_own_lease_wins_over_the_takers(server, client):
    job_id = create(client, "own", retryAfter="+1 HOUR")
    ok(client.request("GetJob", name="own", lease=1))
    time.sleep(1.5)
    assert client.request("GetJob", name="own").status == "404 No job found"
    assert query_job(client, job_id)["data"] == {"retryAfterCount": 1}


def test_a_lost_lease_is_an_attempt_of_a_retry_policy(server, client):
    job_id = create(client, "flaky", maxAttempts=2, retryBackoff="fixed", retryDelay=60)
    assert take(client, "flaky", lease=1).json["attempt"] == 1
    second = take(client, "flaky", lease=1)
    # The lease was the wait: no backoff, the next attempt at once.
    assert second.json["attempt"] == 2
    assert query_job(client, job_id)["lastError"] == LEASE_EXPIRED
    # The GetJob that finds the last attempt's lease over fails the job.
    assert last_look(client, "flaky").status == "404 No job found"
    assert query_job(client, job_id)["state"] == "FAILED"


def test_a_job_without_a_policy_is_failed_after_max_leases_lost_leases(
    server, client, few_leases
):
    job_id = create(client, "poison", data='{"k":1}')
    for _ in range(few_leases):
        take(client, "poison", lease=1)
    assert last_look(client, "poison").status == "404 No job found"
    assert query_job(client, job_id)["state"] == "FAILED"
    failed = ok(client.request("FailedJobs")).json["jobs"]
    assert [(j["jobID"], j["lastError"]) for j in failed] == [(job_id, OUT_OF_LEASES)]
    # The count is not in its data.
    assert query_job(client, job_id)["data"] == {"k": 1}


def test_a_report_starts_the_count_of_lost_leases_again(server, client, few_leases):
    job_id = create(client, "again")
    for _ in range(few_leases - 1):
        take(client, "again", lease=1)
    # One lost lease short of the last, a run its worker retries: its next
    # has them all again (counted on, the lease lost below would fail it).
    lease = take(client, "again", lease=1).headers["leaseID"]
    ok(client.request("RetryJob", jobID=job_id, leaseID=lease))
    take(client, "again", lease=1)
    take(client, "again", lease=1)
    assert query_job(client, job_id)["state"] == "RUNQUEUED"


def test_getjobs_takes_its_jobs_under_the_lease(server, client):
    ids = [create(client, "batch") for _ in range(3)]
    reply = ok(client.request("GetJobs", name="batch", numResults=3, lease=60))
    assert [j["jobID"] for j in reply.json["jobs"]] == ids
    assert len(reply.headers["leaseID"].split(",")) == 3
    assert {query_job(client, i)["state"] for i in ids} == {"RUNQUEUED"}


@pytest.mark.parametrize(
    ("value", "status"),
    [
        ("x", "402 Malformed lease"),
        ("1.5", "402 Malformed lease"),
        ("9" * 40, "402 Malformed lease"),
        ("0", "402 Lease out of range (1 to 86400 seconds)"),
        ("-3", "402 Lease out of range (1 to 86400 seconds)"),
        ("86401", "402 Lease out of range (1 to 86400 seconds)"),
    ],
)
def test_a_bad_lease_is_refused_and_takes_nothing(client, value, status):
    job_id = create(client, "kept")
    assert client.request("GetJob", name="kept", lease=value).status == status
    assert client.request("GetJobs", name="kept", numResults=1, lease=value).status == status
    assert query_job(client, job_id)["state"] == "QUEUED"
    # Empty is absent: no lease.
    ok(client.request("GetJob", name="kept", lease=""))
    assert query_job(client, job_id)["state"] == "RUNNING"


def test_a_version_8_database_is_migrated_and_its_jobs_take_leases(backend, db, tmp_path):
    if isinstance(db, Path):
        old = tmp_path / "v8.db"
        with sqlite3.connect(old) as raw:
            # Version 8: the schema without the lease column and the index
            # of jobs waiting for a retry.
            v8 = re.sub(r",\n    -- Seconds of the lease.*?(\n\);)", r"\1", SCHEMA,
                        count=1, flags=re.S)
            v8 = re.sub(r"CREATE INDEX jobsRetrying [^;]*;", "", v8)
            # Version 10's tables (issue 37), after every older one.
            v8 = v8[: v8.index("-- The edges of the graph")]
            raw.executescript(v8)
            raw.execute(OLD_JOB)
            raw.execute("PRAGMA user_version = 8")
        Store(str(old)).close()
        Store(str(tmp_path / "fresh.db")).close()
        fresh = sqlite_version(tmp_path / "fresh.db")
        assert sqlite_version(old) == fresh == (SCHEMA_VERSION, LEASE_COLUMN)
        assert retrying_index(old) == retrying_index(tmp_path / "fresh.db") != []
        server = ThreadServer(old)
    else:
        PostgresStore(str(db)).close()
        pg.execute(str(db), "ALTER TABLE jobs DROP COLUMN lease")
        # Version 10's column came after it: a version 8 table has neither.
        pg.execute(str(db), "ALTER TABLE jobs DROP COLUMN cancelRequested")
        pg.execute(str(db), "DROP INDEX jobsRetrying")
        pg.execute(str(db), "ALTER TABLE jobs DROP COLUMN awaited")
        pg.execute(str(db), "DROP TABLE outcomes")
        pg.execute(str(db), "UPDATE jobserver_schema SET version = 8")
        pg.execute(str(db), OLD_JOB)
        server = ThreadServer(db)
    try:
        with server.client() as client:
            job = take(client, "from before", lease=60).json
            assert query_job(client, job["jobID"])["state"] == "RUNQUEUED"
    finally:
        server.stop()
    if not isinstance(db, Path):
        with psycopg.connect(str(db)) as conn:
            row = conn.execute("SELECT version FROM jobserver_schema").fetchone()
        assert row == (postgres_schema.SCHEMA_VERSION,) == (10,)


OLD_JOB = (
    "INSERT INTO jobs (created, state, name, nextRun) VALUES "
    "('2026-01-01 00:00:00', 'QUEUED', 'from before', '2026-01-01 00:00:00')"
)
LEASE_COLUMN = ("lease", "INTEGER", 1, "0")


def sqlite_version(path: Path) -> tuple[int, tuple[object, ...]]:
    with sqlite3.connect(path) as raw:
        columns = raw.execute("PRAGMA table_info(jobs)").fetchall()
        lease = next(column for column in columns if column[1] == "lease")
        return raw.execute("PRAGMA user_version").fetchone()[0], tuple(lease[1:5])


def retrying_index(path: Path) -> list[tuple[object, ...]]:
    with sqlite3.connect(path) as raw:
        return raw.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'jobsRetrying'"
        ).fetchall()
