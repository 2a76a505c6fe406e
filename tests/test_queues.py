"""Queues (protocol.md 14.17): each queue's jobs by state and the age of
its oldest ready job, the largest queue first. A real server on a loopback
port, on every backend."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from conformance_helpers import fmt, force, get_job, utcnow
from helpers import create, ok
from jobserver.client import Client as LibraryClient
from wire import Client

pytestmark = pytest.mark.backends

HOUR = timedelta(hours=1)
MINUTE = timedelta(minutes=1)


def queues(client: Client, **params: Any) -> dict[str, Any]:
    body: dict[str, Any] = ok(client.request("Queues", **params)).json
    return body


def by_name(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {queue["queue"]: queue for queue in body["queues"]}


def test_an_empty_server_has_no_queues(client):
    assert queues(client) == {"queues": [], "more": 0}


def test_jobs_are_counted_by_queue_and_state(client, db):
    sent = [create(client, "email/send") for _ in range(3)]
    create(client, "email/bounce")
    create(client, "report")
    create(client, "later/x", firstRun="2099-01-01 00:00:00")
    assert [get_job(client, "email/send")["jobID"] for _ in range(2)] == sent[:2]
    ok(client.request("FailJob", jobID=sent[1], error="boom"))
    body = queues(client)
    assert [q["queue"] for q in body["queues"]] == ["email", "later", "report"]
    email = by_name(body)["email"]
    assert email["jobs"] == {"FAILED": 1, "QUEUED": 2, "RUNNING": 1}
    assert email["total"] == 4
    # A job due in 2099 is not ready: no age.
    assert by_name(body)["later"] == {
        "queue": "later", "jobs": {"QUEUED": 1}, "total": 1, "oldestReadyAge": None,
        "paused": 0,
    }
    assert body["more"] == 0


def test_the_oldest_ready_age_is_of_the_queues_longest_waiting_ready_job(client, db):
    waiting = create(client, "email/send")
    create(client, "email/send")
    running = create(client, "report")
    # Backdated in the database: an hour and a minute of waiting.
    now = utcnow()
    force(db, "UPDATE jobs SET nextRun = ? WHERE jobID = ?", (fmt(now - HOUR), waiting))
    force(db, "UPDATE jobs SET nextRun = ? WHERE jobID = ?", (fmt(now - MINUTE), running))
    get_job(client, "report")
    listed = by_name(queues(client))
    assert 3600 <= listed["email"]["oldestReadyAge"] < 3600 + 60
    # The report job waited a minute, but it is running: nothing is ready.
    assert listed["report"]["oldestReadyAge"] is None


def test_jobs_a_pause_holds_are_counted_apart_and_not_as_ready(client, db):
    held = [create(client, "email/campaign") for _ in range(2)]
    sent = create(client, "email/send")
    create(client, "report/daily")
    now = utcnow()
    for job_id in held:
        force(db, "UPDATE jobs SET nextRun = ? WHERE jobID = ?", (fmt(now - HOUR), job_id))
    force(db, "UPDATE jobs SET nextRun = ? WHERE jobID = ?", (fmt(now - MINUTE), sent))
    ok(client.request("PauseJobs", name="email/campaign*"))
    ok(client.request("PauseJobs", name="report/*"))
    listed = by_name(queues(client))
    # The campaign waited an hour, on purpose; the rest of email a minute.
    assert listed["email"]["paused"] == 2
    assert 60 <= listed["email"]["oldestReadyAge"] < 120
    assert (listed["report"]["paused"], listed["report"]["oldestReadyAge"]) == (1, None)
    ok(client.request("ResumeJobs", name="email/campaign*"))
    listed = by_name(queues(client))
    assert (listed["email"]["paused"], listed["email"]["oldestReadyAge"] >= 3600) == (0, True)


def test_a_revived_failed_job_waits_from_its_requeue_not_its_creation(client, db):
    job_id = create(client, "email/send")
    get_job(client, "email/send")
    ok(client.request("FailJob", jobID=job_id, error="boom"))
    # Created and failed a day ago, revived now (RequeueJobs, the dashboard).
    day_ago = fmt(utcnow() - 24 * HOUR)
    force(db, "UPDATE jobs SET created = ?, nextRun = ? WHERE jobID = ?",
          (day_ago, day_ago, job_id))
    before = fmt(utcnow() - timedelta(seconds=1))
    ok(client.request("RequeueJobs", jobIDs=str(job_id)))
    job = ok(client.request("QueryJob", jobID=job_id)).json
    assert (job["state"], job["created"][:19]) == ("QUEUED", day_ago)
    assert job["nextRun"] >= before
    assert 0 <= by_name(queues(client))["email"]["oldestReadyAge"] < 60
    assert get_job(client, "email/send")["jobID"] == job_id


def test_limit_lists_the_largest_queues_and_counts_the_rest(client):
    for size, name in enumerate(["a", "b", "c", "d"], start=1):
        for _ in range(size):
            create(client, f"{name}/job")
    body = queues(client, limit=2)
    assert [(q["queue"], q["total"]) for q in body["queues"]] == [("d", 4), ("c", 3)]
    assert body["more"] == 2
    # Out of range counts as the nearest bound.
    assert [q["queue"] for q in queues(client, limit=0)["queues"]] == ["d"]
    assert len(queues(client, limit=10**9)["queues"]) == 4


def test_a_malformed_limit_is_refused(client):
    assert client.request("Queues", limit="many").status == "402 Malformed limit"


def test_the_client_library_lists_queues(server, client):
    create(client, "email/send")
    with LibraryClient("127.0.0.1", server.port, timeout=10) as library:
        body = library.queues(limit=5)
    assert [q["queue"] for q in body["queues"]] == ["email"]
