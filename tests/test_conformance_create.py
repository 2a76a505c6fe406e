"""Bedrock's conformance checklist, section 4: CreateJobTest and CreateJobsTest.

One test per case of the reference's checklist, named after it. Cases that
need mockRequest are left out (jobserver ignores it on purpose).
"""

from __future__ import annotations

import json

import pytest

from conformance_helpers import (
    count,
    finish,
    fmt,
    get_job,
    no_job,
    poll,
    row,
    seconds_between,
    state,
    utcnow,
)
from helpers import create, ok

# The same protocol on every backend, and through any of three nodes.
pytestmark = pytest.mark.backends(nodes=True)


def _assert_new_row(job: dict, job_id: int, name: str) -> None:
    assert job["jobID"] == job_id
    assert job["state"] == "QUEUED"
    assert job["name"] == name
    # Bedrock's default nextRun has milliseconds; created has seconds.
    assert job["nextRun"][:19] == job["created"]
    assert job["lastRun"] == ""
    assert job["parentJobID"] == 0


# CreateJobTest


def test_create_job__create(client):
    job_id = create(client, "testCreate")
    job = row(client, job_id)
    _assert_new_row(job, job_id, "testCreate")
    assert job["repeat"] == ""
    assert job["data"] == "{}"
    assert job["priority"] == 500
    assert job["retryAfter"] == ""


def test_create_job__create_with_http(client):
    reply = ok(client.request("CreateJob / HTTP/1.1", name="testCreate"))
    job_id = reply.json["jobID"]
    assert job_id > 0
    job = row(client, job_id)
    _assert_new_row(job, job_id, "testCreate")
    assert job["repeat"] == ""
    assert job["data"] == "{}"
    assert job["priority"] == 500


def test_create_job__create_with_priority(client):
    job_id = create(client, "testCreate", priority="1000")
    job = row(client, job_id)
    _assert_new_row(job, job_id, "testCreate")
    assert job["data"] == "{}"
    assert job["priority"] == 1000


def test_create_job__create_with_data(client):
    data = '{"blabla":"blabla"}'
    start = fmt(utcnow())
    job_id = create(client, "testCreate", data=data)
    job = row(client, job_id)
    assert job["jobID"] == job_id
    assert job["state"] == "QUEUED"
    assert job["name"] == "testCreate"
    assert job["created"] >= start
    assert job["nextRun"] >= start
    assert job["lastRun"] == ""
    assert job["repeat"] == ""
    assert job["data"] == data
    assert job["priority"] == 500
    assert job["parentJobID"] == 0


def test_create_job__create_with_repeat(client):
    job_id = create(client, "testCreate", repeat="SCHEDULED, +1 HOUR")
    job = row(client, job_id)
    _assert_new_row(job, job_id, "testCreate")
    assert job["repeat"] == "SCHEDULED, +1 HOUR"
    assert job["data"] == "{}"
    assert job["priority"] == 500


def test_create_job__unique_job(client):
    job_id = create(client, "blabla", unique="true")
    original = row(client, job_id)

    # Same data (none): same job, nothing written.
    assert create(client, "blabla", unique="true") == job_id
    assert row(client, job_id) == original

    # New data: same job, data patched onto {}.
    data = '{"blabla":"test"}'
    assert create(client, "blabla", unique="true", data=data) == job_id
    updated = row(client, job_id)
    assert updated == {**original, "data": data}

    # overwrite: false keeps the row as it is.
    assert create(client, "blabla", unique="true", data='{"blabla2":"test2"}',
                  overwrite="false") == job_id
    assert row(client, job_id) == updated
    assert count(client) == 1


def test_create_job__unique_job_merge_data(client):
    first = '{"a":1, "b":2, "nestedObject": {"A":1, "B":2}, "nestedArray":[1,2]}'
    job_id = create(client, "blabla", unique="true", data=first)
    original = row(client, job_id)

    assert create(client, "blabla", unique="true", data=first) == job_id

    second = '{"c":3, "d":4, "nestedObject": {"C":3, "D":4}, "nestedArray":[3,4]}'
    assert create(client, "blabla", unique="true", data=second) == job_id
    updated = row(client, job_id)
    assert updated["data"] == (
        '{"a":1,"b":2,"nestedObject":{"A":1,"B":2,"C":3,"D":4},"nestedArray":[3,4],"c":3,"d":4}'
    )
    assert {k: v for k, v in updated.items() if k != "data"} == {
        k: v for k, v in original.items() if k != "data"
    }


def test_create_job__create_with_bad_data(client):
    reply = client.request("CreateJob", name="blabla", data="blabla")
    assert reply.status == "402 Data is not a valid JSON Object"
    assert count(client) == 0


def test_create_job__create_with_bad_repeat(client):
    reply = client.request("CreateJob", name="blabla", repeat="blabla")
    assert reply.status == "402 Malformed repeat"
    assert count(client) == 0


def test_create_job__create_child_with_queued_parent(client):
    parent_id = create(client, "parent")
    reply = client.request("CreateJob", name="child", parentJobID=parent_id)
    assert (
        reply.status == "405 Can only create child job when parent is RUNNING, RUNQUEUED or PAUSED"
    )
    assert count(client) == 1


def test_create_job__create_child_with_running_grandparent(client):
    parent_id = create(client, "parent")
    get_job(client, "parent")
    child_id = create(client, "child", parentJobID=parent_id)
    assert state(client, parent_id) == "RUNNING"
    assert state(client, child_id) == "PAUSED"

    reply = client.request("CreateJob", name="grandchild", parentJobID=child_id)
    assert reply.status == "405 Cannot create grandchildren"
    assert count(client) == 2


def test_create_job__retry_recurring_jobs(client):
    # Bedrock uses retryAfter `+5 SECOND`; two seconds keep the test short
    # while "GetJob right after the hand-out finds nothing" stays reliable.
    repeat = "SCHEDULED, +10 SECONDS"
    job_id = create(client, "testRetryable", repeat=repeat, retryAfter="+2 SECONDS")
    original = row(client, job_id)
    _assert_new_row(original, job_id, "testRetryable")
    assert original["repeat"] == repeat
    assert original["data"] == "{}"
    assert original["priority"] == 500
    assert original["retryAfter"] == "+2 SECONDS"

    job = get_job(client, "testRetryable")
    assert (job["jobID"], job["name"], job["data"]) == (job_id, "testRetryable", {})

    leased = row(client, job_id)
    assert leased["state"] == "RUNQUEUED"
    assert seconds_between(leased["nextRun"], leased["lastRun"]) == 2
    expected_data = {"retryAfterCount": 1, "originalNextRun": original["nextRun"]}
    assert json.loads(leased["data"]) == expected_data
    # Byte for byte as Bedrock's JSON_SET writes it.
    assert leased["data"] == (
        '{"retryAfterCount":1,"originalNextRun":"' + original["nextRun"] + '"}'
    )

    # The lease has not run out yet.
    no_job(client, "testRetryable")

    # Once it runs out, the job is handed out again, with the data as it was.
    reply = poll(client, "GetJob", name="testRetryable")
    assert reply.json["jobID"] == job_id
    assert reply.json["name"] == "testRetryable"
    assert reply.json["data"] == expected_data
    no_job(client, "testRetryable")
    released = json.loads(row(client, job_id)["data"])
    assert released["retryAfterCount"] == 2
    # Each hand-out records the nextRun the job had before it.
    assert released["originalNextRun"] == leased["nextRun"]

    finish(client, job_id)
    finished = row(client, job_id)
    assert finished["state"] == "QUEUED"
    # FinishJob removes the counter and leaves originalNextRun in place.
    data = json.loads(finished["data"])
    assert "retryAfterCount" not in data
    assert "originalNextRun" in data
    gap = seconds_between(finished["nextRun"], finished["lastRun"])
    assert 9 <= gap <= 11


def test_create_job__retry_with_malformed_value(client):
    reply = client.request("CreateJob", name="test", retryAfter="10")
    assert reply.status == "402 Malformed retryAfter"
    assert count(client) == 0


def test_create_job__retry_unique(client):
    reply = client.request("CreateJob", name="test", retryAfter="+10 HOUR", unique="true")
    assert reply.status == "200 OK"
    assert row(client, reply.json["jobID"])["retryAfter"] == "+10 HOUR"


def test_create_job__retry_lifecycle(client):
    # Bedrock: retryAfter `+5 SECONDS`; shortened to two seconds.
    job_id = create(client, "testRetryable", retryAfter="+2 SECONDS")
    original = row(client, job_id)
    _assert_new_row(original, job_id, "testRetryable")
    assert original["repeat"] == ""
    assert original["data"] == "{}"
    assert original["priority"] == 500
    assert original["retryAfter"] == "+2 SECONDS"

    job = get_job(client, "testRetryable")
    assert (job["jobID"], job["name"], job["data"]) == (job_id, "testRetryable", {})
    leased = row(client, job_id)
    assert leased["state"] == "RUNQUEUED"
    assert seconds_between(leased["nextRun"], leased["lastRun"]) == 2

    no_job(client, "testRetryable")

    reply = poll(client, "GetJob", name="testRetryable")
    assert reply.json["jobID"] == job_id
    assert reply.json["name"] == "testRetryable"
    assert reply.json["data"] == {"retryAfterCount": 1}

    no_job(client, "testRetryable")

    finish(client, job_id)
    assert row(client, job_id) is None


def test_create_job__retry_with_children(client):
    job_id = create(client, "testRetryable", retryAfter="+5 SECONDS")
    reply = client.request("CreateJob", name="testRetryableChild", parentJobID=job_id)
    assert (
        reply.status == "405 Can only create child job when parent is RUNNING, RUNQUEUED or PAUSED"
    )
    assert count(client) == 1


def test_create_job__get_manual_job_with_retry_after(client):
    name = "manual/testRetryable"
    job_id = create(client, name, retryAfter="+5 SECOND")
    job = get_job(client, name)
    assert (job["jobID"], job["name"], job["data"]) == (job_id, name, {})
    leased = row(client, job_id)
    assert leased["state"] == "RUNQUEUED"
    # `manual` jobs are never counted.
    assert leased["data"] == "{}"
    finish(client, job_id)
    assert row(client, job_id) is None


# CreateJobsTest


def _two_jobs() -> list[dict]:
    return [
        {"data": {"blabla": "blabla"}, "name": "testCreate", "repeat": "SCHEDULED, +1 HOUR"},
        {"data": {"nope": "nope"}, "name": "testCreate2"},
    ]


def _assert_two_created(client, reply) -> None:
    ok(reply)
    ids = reply.json["jobIDs"]
    assert len(ids) == 2
    assert ids[0] != ids[1]
    first, second = row(client, ids[0]), row(client, ids[1])
    assert (first["name"], first["data"], first["repeat"]) == (
        "testCreate", '{"blabla":"blabla"}', "SCHEDULED, +1 HOUR")
    assert (second["name"], second["data"], second["repeat"]) == (
        "testCreate2", '{"nope":"nope"}', "")
    assert first["state"] == second["state"] == "QUEUED"


def test_create_jobs__create(client):
    _assert_two_created(client, client.request("CreateJobs", jobs=_two_jobs()))


def test_create_jobs__create_with_http(client):
    _assert_two_created(client, client.request("CreateJobs / HTTP/1.1", jobs=_two_jobs()))


def test_create_jobs__create_with_invalid_json(client):
    reply = client.request("CreateJobs", jobs=json.dumps(_two_jobs()) + "}")
    assert reply.status == "401 Invalid JSON"
    assert count(client) == 0


def test_create_jobs__create_with_parent_id_not_running(client):
    parent_id = create(client, "blabla")
    jobs = _two_jobs()
    jobs[0]["parentJobID"] = parent_id
    reply = client.request("CreateJobs", jobs=jobs)
    assert (
        reply.status == "405 Can only create child job when parent is RUNNING, RUNQUEUED or PAUSED"
    )
    # All or nothing: the second element was not created either.
    assert count(client) == 1


def test_create_jobs__create_unique_child_with_wrong_parent(client):
    parent1 = create(client, "createWithParent1")
    parent2 = create(client, "createWithParent2")
    get_job(client, "createWithParent1")
    get_job(client, "createWithParent2")

    child = {"name": "createWithParent_child", "data": {"blabla": "blabla"}, "parentJobID": parent1}
    ok(client.request("CreateJobs", jobs=[child]))

    again = {**child, "unique": True, "parentJobID": parent2}
    reply = client.request("CreateJobs", jobs=[again])
    assert reply.status == (
        "404 Trying to create a child that already exists, but it is tied to a different parent"
    )
    assert count(client) == 3
    assert count(client, f"parentJobID = {parent1}") == 1
