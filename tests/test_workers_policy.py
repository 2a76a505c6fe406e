"""A retry policy sent by the worker with a failure (FailJob's and each
FailJobs element's maxAttempts, retryBackoff, retryDelay, retryMaxDelay,
protocol.md 14.1): a job created without one takes it; a job's own wins.
On every backend, over a real server."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_worker_python import in_process

from helpers import create, ok, until
from jobserver.worker import Job, Worker
from wire import Client

pytestmark = pytest.mark.backends

DEADLINE = 20.0
HANDLERS = {"maxAttempts": 3, "retryBackoff": "fixed", "retryDelay": 60}


def query_job(client: Client, job_id: int) -> dict[str, Any]:
    return ok(client.request("QueryJob", jobID=job_id)).json


def test_a_job_without_a_policy_takes_the_workers(client):
    job_id = create(client, "email/send")
    lease = ok(client.request("GetJob", name="email/send", includeLeaseID="true")).json["leaseID"]
    reply = ok(client.request("FailJob", jobID=job_id, leaseID=lease, error="451", **HANDLERS))
    assert "ignoredHeaders" not in reply.headers
    job = query_job(client, job_id)
    # Queued again after the worker's delay: this failure was attempt 1 of 3.
    assert (job["state"], job["attempt"], job["maxAttempts"]) == ("QUEUED", 1, 3)
    assert (job["retryBackoff"], job["retryDelay"], job["lastError"]) == ("fixed", 60, "451")
    assert job["nextRun"] > job["lastRun"]
    # Kept, as if created with it: the next hand-out is attempt 2.
    ok(client.request("UpdateJob", jobID=job_id, data="{}", nextRun="2020-01-01 00:00:00"))
    again = ok(client.request("GetJob", name="email/send")).json
    assert (again["attempt"], again["maxAttempts"]) == (2, 3)


def test_a_jobs_own_policy_wins_over_the_workers(client):
    job_id = create(client, "own", maxAttempts=1)
    ok(client.request("GetJob", name="own"))
    ok(client.request("FailJob", jobID=job_id, **HANDLERS))
    job = query_job(client, job_id)
    assert (job["state"], job["maxAttempts"]) == ("FAILED", 1)


def test_failjobs_elements_carry_the_policy_each(client):
    plain, other = create(client, "batch"), create(client, "batch")
    ok(client.request("GetJobs", name="batch", numResults=2))
    elements = [{"jobID": plain, **HANDLERS}, {"jobID": other}]
    reply = ok(client.request("FailJobs", jobs=json.dumps(elements)))
    assert [r["status"] for r in reply.json["results"]] == ["200 OK", "200 OK"]
    assert query_job(client, plain)["state"] == "QUEUED"
    assert client.request("QueryJob", jobID=other).json["state"] == "FAILED"


def test_a_bad_policy_is_refused_and_changes_nothing(client):
    job_id = create(client, "kept")
    ok(client.request("GetJob", name="kept"))
    assert client.request("FailJob", jobID=job_id, maxAttempts="x").status == (
        "402 Malformed maxAttempts"
    )
    assert client.request("FailJob", jobID=job_id, retryDelay="5").status == (
        "402 Missing maxAttempts"
    )
    assert query_job(client, job_id)["state"] == "RUNNING"


# The Python worker: a handler's policy, sent with its failures.


def test_a_handlers_policy_applies_to_jobs_without_their_own(server, client):
    calls: list[int] = []
    worker = Worker()

    @worker.handler("flaky/*", max_attempts=3, backoff="fixed", retry_delay=0)
    def flaky(data: dict[str, Any], job: Job) -> None:
        calls.append(job.id)
        raise ValueError("boom")

    plain = create(client, "flaky/plain")
    own = create(client, "flaky/own", maxAttempts=1)
    with in_process(worker, server.port, "asyncio"):
        for job_id in (plain, own):
            until(lambda j=job_id: query_job(client, j)["state"] == "FAILED", DEADLINE, "the end")
    assert calls.count(plain) == 3 and calls.count(own) == 1
    job = query_job(client, plain)
    assert (job["attempt"], job["maxAttempts"], job["retryBackoff"]) == (3, 3, "fixed")
    assert query_job(client, own)["maxAttempts"] == 1


@pytest.mark.parametrize(
    "policy",
    [{"max_attempts": 0}, {"max_attempts": 3, "backoff": "linear"},
     {"max_attempts": 3, "retry_delay": -1}, {"max_attempts": 3, "retry_max_delay": 1e9},
     {"lease": 0}, {"lease": 1.5}, {"lease": True}, {"lease": 86401}],
)
def test_a_handlers_policy_out_of_range_is_refused_when_registered(policy):
    with pytest.raises(ValueError):
        Worker().handler("x", **policy)


# job.client: a handler enqueues through the worker's server.


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_a_handler_enqueues_through_job_client(server, client, loop):
    worker = Worker()

    @worker.handler("fan/sync")
    def in_a_thread(data: dict[str, Any], job: Job) -> None:
        job.client.create_job("out/sync", {"from": job.id})

    @worker.handler("fan/async")
    async def in_a_task(data: dict[str, Any], job: Job) -> None:
        await job.client.create_job("out/async", {"from": job.id})

    sync_id, async_id = create(client, "fan/sync"), create(client, "fan/async")
    taken = {}
    with in_process(worker, server.port, loop):
        for name in ("out/sync", "out/async"):
            reply = client.request("GetJob", name=name, Connection="wait", timeout=20000)
            taken[name] = ok(reply).json["data"]
    assert taken == {"out/sync": {"from": sync_id}, "out/async": {"from": async_id}}
    assert client.request("QueryJob", jobID=sync_id).status == "404 No job with this jobID"
    assert client.request("QueryJob", jobID=async_id).status == "404 No job with this jobID"
