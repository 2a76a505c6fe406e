"""Bedrock's conformance checklist, section 4: GetJobTest, GetJobsTest and
InfiniteRetryAfter.

One test per case, named after it. The CrashBedrockJob cases are left out
(jobserver ignores that command on purpose). Waits are short (retryAfter of
one or two seconds, firstRun a few seconds ahead) and poll with a deadline.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from conformance_helpers import (
    count,
    finish,
    fmt,
    force,
    get_job,
    in_seconds,
    no_job,
    parse_time,
    poll,
    query,
    row,
    seconds_between,
    sleep_until,
    state,
    utcnow,
    wait_until_due,
)
from helpers import create, ok

# The same protocol on every backend, and through any of three nodes.
pytestmark = pytest.mark.backends(nodes=True)

JOB_KEYS = {"created", "data", "jobID", "lastRun", "name", "nextRun", "priority", "repeat",
            "retryAfter"}


# GetJobTest


def _check_get_job(client, method: str) -> None:
    job_id = create(client, "job")
    original = row(client, job_id)

    start = utcnow()
    reply = ok(client.request(method, name="job"))
    end = utcnow()
    job = reply.json
    assert set(job) == JOB_KEYS
    assert job["jobID"] == job_id
    assert job["name"] == "job"
    assert job["data"] == {}
    assert job["priority"] == original["priority"]
    assert job["repeat"] == original["repeat"]
    assert job["nextRun"] == original["nextRun"]
    assert job["lastRun"] == original["lastRun"] == ""
    assert job["created"] == original["created"] != ""

    # Only state and lastRun change.
    current = row(client, job_id)
    assert current["state"] == "RUNNING"
    assert in_seconds(start, end, current["lastRun"])
    assert len(current["lastRun"]) == 19
    unchanged = ("created", "jobID", "name", "nextRun", "repeat", "data", "priority", "parentJobID")
    assert {k: current[k] for k in unchanged} == {k: original[k] for k in unchanged}


def test_get_job__get_job(client):
    _check_get_job(client, "GetJob")


def test_get_job__get_job_with_http(client):
    _check_get_job(client, "GetJob / HTTP/1.1")


def test_get_job__with_num_results(client):
    job_id = create(client, "job")
    reply = client.request("GetJob", name="job", numResults=20)
    assert reply.status == "402 Cannot use numResults with GetJob; try GetJobs"
    assert state(client, job_id) == "QUEUED"


def test_get_job__no_job_found(client):
    reply = client.request("GetJob", name="job")
    assert reply.status == "404 No job found"


def test_get_job__test_priorities(client):
    first_run = fmt(utcnow())
    ids = [
        create(client, name, priority=priority, firstRun=first_run)
        for name, priority in (("low_5", "0"), ("high_1", "1000"), ("medium_3", "500"),
                               ("high_2", "1000"), ("medium_4", "500"))
    ]
    distinct = query(
        client, f"SELECT DISTINCT nextRun FROM jobs WHERE jobID IN ({','.join(map(str, ids))});"
    )
    assert len(distinct) == 1

    names = [get_job(client, "*")["name"] for _ in range(5)]
    assert names == ["high_1", "high_2", "medium_3", "medium_4", "low_5"]
    no_job(client, "*")


def test_get_job__test_priorities_with_different_next_run_times(client):
    # Bedrock: low/medium/high due at +1/+4/+7 s, then high/medium/low at
    # +15/+13/+10 s. Here one second apart, from the next whole second on.
    now = utcnow()
    # At least 1 s to create the six jobs and query them before the first
    # one is due (each create waits for its sync, and Query on SQLite
    # starts a process: 0.3 s was once too little on a loaded machine).
    base = now.replace(microsecond=0) + timedelta(seconds=2)
    plan = [("low", "0", 0), ("medium", "500", 1), ("high", "1000", 2),
            ("high", "1000", 5), ("medium", "500", 4), ("low", "0", 3)]
    ids = [
        create(client, name, priority=priority, firstRun=fmt(base + timedelta(seconds=offset)))
        for name, priority, offset in plan
    ]
    distinct = query(
        client, f"SELECT DISTINCT nextRun FROM jobs WHERE jobID IN ({','.join(map(str, ids))});"
    )
    assert len(distinct) == 6
    # Everything was created before the first job became due.
    assert utcnow() < base

    # The first three come out in the order they become due.
    names = [poll(client, "GetJob", name="*").json["name"] for _ in range(3)]
    assert names == ["low", "medium", "high"]

    # Once the last three are all due, they come out by priority.
    sleep_until(base + timedelta(seconds=5))
    names = [get_job(client, "*")["name"] for _ in range(3)]
    assert names == ["high", "medium", "low"]
    no_job(client, "*")


def test_get_job__test_with_finished_and_cancelled_children(client):
    parent_data = '{"foo":"bar"}'
    parent_id = create(client, "parent", data=parent_data)
    get_job(client, "parent")

    finished_data = '{"bar":"baz"}'
    finished_id = create(client, "child_finished", data=finished_data, parentJobID=parent_id)
    cancelled_data = '{"baz":"foo"}'
    cancelled_id = create(client, "child_cancelled", data=cancelled_data, parentJobID=parent_id)

    finish(client, parent_id)

    child = get_job(client, "child_finished")
    ok(client.request("CancelJob", jobID=cancelled_id))

    assert set(child) == JOB_KEYS | {"parentJobID", "parentData"}
    assert child["jobID"] == finished_id
    assert child["name"] == "child_finished"
    assert child["data"] == json.loads(finished_data)
    assert child["parentJobID"] == parent_id
    assert child["parentData"] == json.loads(parent_data)

    finish(client, finished_id)
    assert state(client, parent_id) == "QUEUED"

    reply = ok(client.request("GetJob", name="parent"))
    parent = reply.json
    assert set(parent) == JOB_KEYS | {"finishedChildJobs", "cancelledChildJobs"}
    assert parent["jobID"] == parent_id
    assert parent["name"] == "parent"
    assert parent["data"] == json.loads(parent_data)
    assert parent["finishedChildJobs"] == [
        {"data": json.loads(finished_data), "jobID": finished_id}
    ]
    assert parent["cancelledChildJobs"] == [
        {"data": json.loads(cancelled_data), "jobID": cancelled_id}
    ]
    # Child entries are {"data":...,"jobID":...}, data embedded as it is.
    assert (
        f'"finishedChildJobs":[{{"data":{finished_data},"jobID":{finished_id}}}]'
        in reply.body.decode()
    )


def test_get_job__test_priorities_with_run_queued(client):
    later = fmt(utcnow() + timedelta(seconds=2))
    create(client, "low_5", priority="0", firstRun=later)
    create(client, "high_1", priority="1000", retryAfter="+2 SECONDS")
    create(client, "medium_4", priority="500", retryAfter="+2 SECONDS")
    create(client, "high_2", priority="1000", firstRun=later)
    create(client, "medium_3", priority="500", firstRun=later)

    start = utcnow()
    high_1 = get_job(client, "high_1")["jobID"]
    medium_4 = get_job(client, "medium_4")["jobID"]
    end = utcnow()

    leased = query(client, "SELECT DISTINCT state FROM jobs WHERE name IN ('high_1', 'medium_4');")
    assert leased == [{"state": "RUNQUEUED"}]
    for job_id in (high_1, medium_4):
        next_run = row(client, job_id)["nextRun"]
        assert in_seconds(start + timedelta(seconds=2), end + timedelta(seconds=2), next_run)

    # Wait until every job is due.
    wait_until_due(query(client, "SELECT MAX(nextRun) AS m FROM jobs;")[0]["m"])

    names = [get_job(client, "*")["name"] for _ in range(5)]
    assert sorted(names[:2]) == ["high_1", "high_2"]
    assert sorted(names[2:4]) == ["medium_3", "medium_4"]
    assert names[4] == "low_5"


def test_get_job__test_multiple_names(client):
    create(client, "low", priority="0")
    create(client, "high", priority="1000")
    create(client, "medium", priority="500")
    create(client, "medium", priority="500")

    assert get_job(client, "medium,high")["name"] == "high"
    assert query(client, "SELECT DISTINCT state FROM jobs WHERE name = 'high';") == [
        {"state": "RUNNING"}
    ]

    assert get_job(client, "low,medium,high")["name"] == "medium"
    assert count(client, "name = 'medium' AND state = 'RUNNING'") == 1

    reply = ok(client.request("GetJobs", name="low,medium", numResults=2))
    jobs = reply.json["jobs"]
    assert len(jobs) == 2
    assert [j["name"] for j in jobs] == ["medium", "low"]


def test_get_job__test_priority_parameter(client):
    first_run = fmt(utcnow())
    for name, priority in (("low_5", "0"), ("high_1", "1000"), ("medium_3", "500"),
                           ("high_2", "1000"), ("medium_4", "500")):
        create(client, name, jobPriority=priority, firstRun=first_run)
    assert len(query(client, "SELECT DISTINCT nextRun FROM jobs;")) == 1

    def names(priority: str) -> list[str]:
        reply = ok(client.request("GetJobs", name="*", numResults=2, jobPriority=priority))
        return [job["name"] for job in reply.json["jobs"]]

    assert names("0") == ["low_5"]
    assert sorted(names("500")) == ["medium_3", "medium_4"]
    assert sorted(names("1000")) == ["high_1", "high_2"]


def test_get_job__test_invalid_job_priority(client):
    reply = client.request("GetJobs", name="*", numResults=1, jobPriority=111)
    assert reply.status == "402 Invalid priority value"


def test_get_job__test_retryable_parent_jobs(client):
    parent_id = create(client, "ParentJob", retryAfter="+2 SECONDS")
    assert get_job(client, "ParentJob")["jobID"] == parent_id
    assert state(client, parent_id) == "RUNQUEUED"

    child_id = create(client, "ChildJob", parentJobID=parent_id)
    assert state(client, child_id) == "PAUSED"

    # The lease runs out: the parent is handed out again, the child is not.
    no_job(client, "ChildJob")
    dequeued = utcnow()
    assert poll(client, "GetJob", name="ParentJob").json["jobID"] == parent_id
    assert state(client, parent_id) == "RUNQUEUED"
    assert state(client, child_id) == "PAUSED"
    no_job(client, "ChildJob")

    finish(client, parent_id)
    finished = utcnow()
    assert state(client, parent_id) == "PAUSED"
    assert state(client, child_id) == "QUEUED"

    assert get_job(client, "ChildJob")["jobID"] == child_id
    assert state(client, parent_id) == "PAUSED"
    assert state(client, child_id) == "RUNNING"

    finish(client, child_id)
    assert state(client, child_id) == "FINISHED"
    parent = row(client, parent_id)
    assert parent["state"] == "QUEUED"
    # FinishJob of a parent with children sets its nextRun to its lastRun:
    # the parent resumes as soon as its children are done.
    assert parent["nextRun"] == parent["lastRun"]
    assert in_seconds(dequeued, finished, parent["nextRun"])

    assert get_job(client, "ParentJob")["jobID"] == parent_id
    finish(client, parent_id)
    assert row(client, child_id) is None
    assert row(client, parent_id) is None


def test_get_job__test_invalid_next_run(client):
    # Bedrock stores a truncated nextRun (`YYYY-MM-DD HH`) through Query and
    # expects GetJob to fail the job. jobserver parses and normalises every
    # firstRun/nextRun, so such a value cannot be stored: a malformed one is
    # refused with `402 Malformed nextRun` and the job is left as it was.
    garbage = "2026-13-45 99:99"
    reply = client.request("CreateJob", name="jobWithInvalidNextRun", firstRun=garbage)
    assert reply.status == "402 Malformed firstRun"
    assert count(client) == 0

    job_id = create(client, "jobWithInvalidNextRun", firstRun=fmt(utcnow()),
                    retryAfter="+1 SECOND", repeat="SCHEDULED, +1 MINUTES")
    # A timestamp cut to the hour is a valid time and is normalised.
    hour = fmt(utcnow())[:13]
    ok(client.request("UpdateJob", jobID=job_id, data={}, nextRun=hour))
    assert row(client, job_id)["nextRun"] == hour + ":00:00"

    get_job(client, "jobWithInvalidNextRun")
    before = row(client, job_id)
    assert before["state"] == "RUNQUEUED"

    reply = client.request("UpdateJob", jobID=job_id, data={}, nextRun=garbage)
    assert reply.status == "402 Malformed nextRun"
    reply = client.request("RetryJob", jobID=job_id, nextRun=garbage, ignoreRepeat="true")
    assert reply.status == "402 Malformed nextRun"
    assert row(client, job_id) == before


# GetJobsTest


def test_get_jobs__get_jobs(client, server):
    # Bedrock sleeps 5 s twice so that "scheduled", "started" and "finished"
    # differ. Here firstRun lies 10 s in the past and lastRun is moved a
    # minute back in the file, which gives the same three distinct bases.
    repeats = ["SCHEDULED, +1 HOUR", "STARTED, +1 DAY", "FINISHED, +7 DAYS"]
    scheduled = fmt(utcnow() - timedelta(seconds=10))
    ids = [
        create(client, "TestJobName", repeat=repeat, firstRun=scheduled, retryAfter="+5 MINUTES")
        for repeat in repeats
    ]

    reply = ok(client.request("GetJobs", name="TestJobName", numResults=5))
    assert sorted(job["jobID"] for job in reply.json["jobs"]) == ids
    for job_id in ids:
        job = row(client, job_id)
        assert job["state"] == "RUNQUEUED"
        assert abs(seconds_between(job["nextRun"], job["lastRun"]) - 300) < 3

    for job_id in ids:
        earlier = parse_time(row(client, job_id)["lastRun"]) - timedelta(seconds=60)
        force(server.db, "UPDATE jobs SET lastRun = ? WHERE jobID = ?", (fmt(earlier), job_id))
    started = {job_id: row(client, job_id)["lastRun"] for job_id in ids}

    finished_at = utcnow()
    for job_id in ids:
        finish(client, job_id)

    jobs = {job_id: row(client, job_id) for job_id in ids}
    assert {job["state"] for job in jobs.values()} == {"QUEUED"}
    for job in jobs.values():
        assert "retryAfterCount" not in json.loads(job["data"])
    scheduled_run, started_run, finished_run = (parse_time(jobs[i]["nextRun"]) for i in ids)
    assert abs((scheduled_run - parse_time(scheduled)).total_seconds() - 3600) < 3
    assert abs((started_run - parse_time(started[ids[1]])).total_seconds() - 86400) < 3
    assert abs((finished_run - finished_at).total_seconds() - 7 * 86400) < 3


# InfiniteRetryAfter


def _expire_lease(db, job_id: int) -> None:
    """Move a RUNQUEUED job's lease end into the past, as if its retryAfter
    had run out (saves a second of waiting per lease)."""
    past = fmt(utcnow() - timedelta(seconds=1))
    force(db, "UPDATE jobs SET nextRun = ? WHERE jobID = ? AND state = 'RUNQUEUED'",
          (past, job_id))


def test_infinite_retry_after__test_infinite_tries(client, server):
    job_id = create(client, "infinite-job", retryAfter="+1 SECOND")

    for attempt in range(1, 11):
        if attempt > 2:
            # The first re-dequeue waits for the real lease; later ones are
            # sped up by moving the lease end into the past.
            _expire_lease(server.db, job_id)
        reply = poll(client, "GetJob", name="infinite-job")
        assert reply.json["jobID"] == job_id
        job = row(client, job_id)
        assert job["state"] == "RUNQUEUED"
        assert json.loads(job["data"])["retryAfterCount"] == attempt

    # The eleventh hand-out fails the job instead. Bedrock answers 200 with
    # `{}`; jobserver answers `404 No job found` (a documented difference).
    _expire_lease(server.db, job_id)
    reply = client.request("GetJob", name="infinite-job")
    assert reply.status == "404 No job found"
    assert state(client, job_id) == "FAILED"
    reply = client.request("GetJob", name="infinite-job")
    assert reply.status == "404 No job found"
    assert state(client, job_id) == "FAILED"
    assert json.loads(row(client, job_id)["data"])["retryAfterCount"] == 10

    # GetJobs skips such a job and goes on to hand out the others.
    worn_id = create(client, "infinite-worn", retryAfter="+1 SECOND")
    force(server.db, "UPDATE jobs SET data = '{\"retryAfterCount\":10}', state = 'RUNQUEUED' "
                     "WHERE jobID = ?", (worn_id,))
    other_id = create(client, "infinite-other")
    reply = ok(client.request("GetJobs", name="infinite-*", numResults=5))
    assert [job["jobID"] for job in reply.json["jobs"]] == [other_id]
    assert state(client, worn_id) == "FAILED"
    assert state(client, job_id) == "FAILED"


def test_infinite_retry_after__test_repeat_job_with_three_tries(client, server):
    job_id = create(client, "not-infinite-job", retryAfter="+1 SECOND", repeat="SCHEDULED, +1 DAY")

    for attempt in range(1, 5):
        if attempt > 2:
            _expire_lease(server.db, job_id)
        reply = poll(client, "GetJob", name="not-infinite-job")
        assert reply.json["jobID"] == job_id
        job = row(client, job_id)
        assert job["state"] == "RUNQUEUED"
        assert json.loads(job["data"])["retryAfterCount"] == attempt

    finish(client, job_id)
    job = row(client, job_id)
    assert job["state"] == "QUEUED"
    assert "retryAfterCount" not in json.loads(job["data"])
    # Rescheduled a day after it was scheduled (give or take the leases).
    assert abs(seconds_between(job["nextRun"], job["created"]) - 86400) <= 6


def test_get_job__test_invalid_next_run_stored_in_the_file(client, server):
    # Bedrock's own case: a job whose stored nextRun SQLite cannot compute
    # with (here cut to the hour, as data imported from Bedrock may be) is
    # failed when it is handed out, and does not block the jobs behind it.
    job_id = create(client, "jobWithInvalidNextRun", retryAfter="+1 SECOND",
                    repeat="SCHEDULED, +1 MINUTES")
    force(server.db, "UPDATE jobs SET nextRun = ? WHERE jobID = ?",
          (fmt(utcnow())[:13], job_id))
    good_id = create(client, "good")
    reply = ok(client.request("GetJobs", name="*", numResults=5))
    assert [job["jobID"] for job in reply.json["jobs"]] == [good_id]
    assert state(client, job_id) == "FAILED"
