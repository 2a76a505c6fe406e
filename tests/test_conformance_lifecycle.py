"""Bedrock's conformance checklist, section 4: QueryJobTest, UpdateJobTest,
FinishJobTest, RetryJobTest, CancelJobTest, DeleteJobTest, FailJobTest and
RequeueJobsTest.

One test per case, named after it. Left out on purpose: UpdateJobTest's
updateMockedJob (mockRequest) and RequeueJobsTest's autoRequeue
(`Connection: forget` is not implemented). FinishJobTest runs single-node.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest

from conformance_helpers import (
    count,
    finish,
    fmt,
    force,
    get_job,
    parse_time,
    row,
    seconds_between,
    state,
    utcnow,
)
from harness import ThreadServer
from helpers import create, ok

# The same protocol on every backend, and through any of three nodes.
pytestmark = pytest.mark.backends(nodes=True)


def _running(client, name: str = "job", **params) -> int:
    """Create a job and hand it out."""
    job_id = create(client, name, **params)
    assert get_job(client, name)["jobID"] == job_id
    return job_id


def _parent_with_children(client, *children: str) -> tuple[int, list[int]]:
    """A RUNNING parent with PAUSED children."""
    parent_id = _running(client, "parent")
    ids = [create(client, child, parentJobID=parent_id) for child in children]
    return parent_id, ids


def _retry(client, job_id: int, **params):
    return ok(client.request("RetryJob", jobID=job_id, **params))


def _in_future(seconds: int) -> str:
    return fmt(utcnow() + timedelta(seconds=seconds))


# QueryJobTest


def test_query_job__query_job(client):
    job_id = create(client, "job", firstRun="2042-04-02 00:42:42", repeat="FINISHED, +1 DAY",
                    data='{"something":1}', priority="1000")
    reply = ok(client.request("QueryJob", jobID=job_id))
    job = reply.json
    assert set(job) == {"created", "data", "jobID", "lastRun", "name", "nextRun", "priority",
                        "repeat", "retryAfter", "state"}
    assert job["jobID"] == job_id
    assert job["name"] == "job"
    assert job["nextRun"] == "2042-04-02 00:42:42"
    assert job["repeat"] == "FINISHED, +1 DAY"
    assert job["data"] == {"something": 1}
    assert '"data":{"something":1}' in reply.body.decode()
    assert job["priority"] == 1000
    assert job["state"] == "QUEUED"
    assert job["created"] != ""


# UpdateJobTest


def test_update_job__update_job(client):
    job_id = create(client, "job", jobPriority="500")
    ok(client.request("UpdateJob", jobID=job_id, data='{"key":"value"}', repeat="HOURLY",
                      jobPriority="1000", nextRun="2020-01-01 00:00:00"))
    job = row(client, job_id)
    assert job["repeat"] == "HOURLY"
    assert job["data"] == '{"key":"value"}'
    assert job["priority"] == 1000
    assert job["nextRun"] == "2020-01-01 00:00:00"
    assert job["state"] == "QUEUED"

    # Data must be a JSON object (Bedrock silently stores `{}` instead).
    reply = client.request("UpdateJob", jobID=job_id, data="blabla")
    assert reply.status == "402 Data is not a valid JSON Object"
    assert row(client, job_id) == job


def test_update_job__update_string_value_looking_like_number(client):
    job_id = create(client, "job")
    data = '{"key":"value","anotherKey":"1234"}'
    ok(client.request("UpdateJob", jobID=job_id, data=data))
    assert row(client, job_id)["data"] == data
    reply = ok(client.request("QueryJob", jobID=job_id))
    assert reply.json["data"] == {"key": "value", "anotherKey": "1234"}


def test_update_job__clear_repeat_with_should_clear_repeat(client):
    job_id = create(client, "job", repeat="SCHEDULED, +1 HOUR")
    assert row(client, job_id)["repeat"] == "SCHEDULED, +1 HOUR"
    ok(client.request("UpdateJob", jobID=job_id, data="{}", shouldClearRepeat="1"))
    assert row(client, job_id)["repeat"] == ""


# FinishJobTest (and the same checks for RetryJob below)


def _nonexistent(client, command: str) -> None:
    reply = client.request(command, jobID=1)
    assert reply.status == "404 No job with this jobID"


def _not_running(client, command: str) -> None:
    job_id = create(client, "job")
    reply = client.request(command, jobID=job_id)
    assert reply.status == "405 Can only retry/finish RUNNING and RUNQUEUED jobs"
    assert state(client, job_id) == "QUEUED"


def _parent_not_paused(client, server, command: str) -> None:
    parent_id, (child_id,) = _parent_with_children(client, "child")
    # A child cannot be RUNNING while its parent runs; force it, as Bedrock does.
    force(server.db, "UPDATE jobs SET state = 'RUNNING' WHERE jobID = ?", (child_id,))
    reply = client.request(command, jobID=child_id)
    assert reply.status == "405 Can only retry/finish child job when parent is PAUSED"
    assert state(client, child_id) == "RUNNING"
    assert state(client, parent_id) == "RUNNING"


def _finished_and_cancelled_children(client) -> int:
    """A parent that is RUNNING again after one child FINISHED and one
    CANCELLED."""
    parent_id, (finished_id, cancelled_id) = _parent_with_children(
        client, "child_finished", "child_cancelled")
    finish(client, parent_id)
    get_job(client, "child_finished")
    ok(client.request("CancelJob", jobID=cancelled_id))
    finish(client, finished_id)
    assert state(client, parent_id) == "QUEUED"
    assert state(client, finished_id) == "FINISHED"
    assert state(client, cancelled_id) == "CANCELLED"
    get_job(client, "parent")
    return parent_id


def test_finish_job__non_existent_job(client):
    _nonexistent(client, "FinishJob")


def test_finish_job__not_in_running_state(client):
    _not_running(client, "FinishJob")


def test_finish_job__parent_is_not_paused(client, server):
    _parent_not_paused(client, server, "FinishJob")


def test_finish_job__remove_finished_and_cancelled_children(client):
    parent_id = _finished_and_cancelled_children(client)
    finish(client, parent_id)
    assert count(client, f"jobID != {parent_id}") == 0
    assert count(client) == 0


def test_finish_job__update_data(client):
    job_id = _running(client, repeat="STARTED, +1 HOUR")
    finish(client, job_id, data='{"bar":"foo","foo":"bar"}')
    job = row(client, job_id)
    assert job["data"] == '{"bar":"foo","foo":"bar"}'
    assert job["state"] == "QUEUED"


def test_finish_job__finishing_parent_un_pauses_children(client):
    parent_id, (first_id, second_id) = _parent_with_children(
        client, "child_finished", "child_cancelled")
    finish(client, parent_id)
    assert state(client, parent_id) == "PAUSED"
    assert state(client, first_id) == "QUEUED"
    assert state(client, second_id) == "QUEUED"


def test_finish_job__delete_finished_job_with_no_children(client):
    job_id = _running(client)
    finish(client, job_id)
    assert row(client, job_id) is None


def _assert_one_hour_after_start(client, job_id: int) -> None:
    job = row(client, job_id)
    assert job["state"] == "QUEUED"
    assert seconds_between(job["nextRun"], job["lastRun"]) == 3600


def test_finish_job__has_repeat(client):
    job_id = _running(client, repeat="STARTED, +1 HOUR")
    finish(client, job_id)
    _assert_one_hour_after_start(client, job_id)


def test_finish_job__in_runqueued_state(client):
    job_id = _running(client, retryAfter="+1 SECOND")
    assert state(client, job_id) == "RUNQUEUED"
    finish(client, job_id)
    assert row(client, job_id) is None


def test_finish_job__has_repeat_with_delay(client):
    job_id = _running(client, repeat="STARTED, +1 HOUR")
    finish(client, job_id, delay="5")
    _assert_one_hour_after_start(client, job_id)


def test_finish_job__has_delay(client):
    job_id = _running(client)
    finish(client, job_id, delay="5")
    assert row(client, job_id) is None


def test_finish_job__has_repeat_with_next_run(client):
    job_id = _running(client, repeat="STARTED, +1 HOUR")
    finish(client, job_id, nextRun="2017-09-07 23:11:11")
    _assert_one_hour_after_start(client, job_id)


def test_finish_job__has_data_delete(client):
    job_id = _running(client, repeat="STARTED, +1 HOUR")
    finish(client, job_id, data='{"delete":true}')
    assert row(client, job_id) is None


def test_finish_job__has_next_run(client):
    job_id = _running(client)
    finish(client, job_id, nextRun="2017-09-07 23:11:11")
    assert row(client, job_id) is None


def test_finish_job__simple_finish_job_with_http(client):
    job_id = _running(client)
    ok(client.request("FinishJob / HTTP/1.1", jobID=job_id))
    assert row(client, job_id) is None


# RetryJobTest


def test_retry_job__non_existent_job(client):
    _nonexistent(client, "RetryJob")


def test_retry_job__not_in_running_state(client):
    _not_running(client, "RetryJob")


def test_retry_job__parent_is_not_paused(client, server):
    _parent_not_paused(client, server, "RetryJob")


def test_retry_job__remove_finished_and_cancelled_children(client):
    parent_id = _finished_and_cancelled_children(client)
    _retry(client, parent_id)
    assert count(client, f"jobID != {parent_id}") == 0
    assert state(client, parent_id) == "QUEUED"


def test_retry_job__update_data(client):
    job_id = _running(client)
    _retry(client, job_id, data='{"bar":"foo","foo":"bar"}')
    job = row(client, job_id)
    assert job["data"] == '{"bar":"foo","foo":"bar"}'
    assert job["state"] == "QUEUED"


def test_retry_job__negative_delay(client):
    job_id = _running(client)
    reply = client.request("RetryJob", jobID=job_id, delay="-5")
    assert reply.status == "402 Must specify a non-negative delay when retrying"
    assert state(client, job_id) == "RUNNING"


def test_retry_job__positive_delay(client):
    job_id = _running(client)
    start = utcnow().replace(microsecond=0)
    _retry(client, job_id, delay="5")
    end = utcnow().replace(microsecond=0)
    job = row(client, job_id)
    assert job["state"] == "QUEUED"
    assert fmt(start + timedelta(seconds=5)) <= job["nextRun"] <= fmt(end + timedelta(seconds=5))


def test_retry_job__delay_error(client):
    job_id = _running(client)
    reply = client.request("RetryJob", jobID=job_id, delay="100000000")
    assert reply.status == "402 Malformed delay"
    assert state(client, job_id) == "RUNNING"


def test_retry_job__has_repeat(client):
    job_id = _running(client, repeat="STARTED, +1 HOUR")
    _retry(client, job_id)
    _assert_one_hour_after_start(client, job_id)


def _retry_with_repeat(client, repeat: str, **create_params) -> dict:
    """Create a job with this repeat, hand it out, RetryJob it; the row."""
    job_id = _running(client, repeat=repeat, **create_params)
    _retry(client, job_id)
    job = row(client, job_id)
    assert job["state"] == "QUEUED"
    return job


# These rules land on or before the moment the job was scheduled for, and
# Bedrock accepts them: the job is due again at once. Its cases schedule the
# job now; here it is yesterday at noon, so that a run at 00:00:00 cannot
# meet the moment the rule gives (protocol.md section 6).


def _yesterday_noon() -> str:
    return (utcnow() - timedelta(days=1)).strftime("%Y-%m-%d") + " 12:00:00"


def test_retry_job__has_repeat_start_of_hour(client):
    job_id = _running(client, repeat="SCHEDULED, START OF DAY, +5 MINUTES, START OF HOUR",
                      firstRun=_yesterday_noon())
    scheduled = row(client, job_id)["nextRun"]
    _retry(client, job_id)
    # The day the job was scheduled, 00:00:00: START OF HOUR comes last.
    assert row(client, job_id)["nextRun"] == scheduled[:10] + " 00:00:00"


def test_retry_job__has_repeat_start_of_hour_not_last(client):
    job_id = _running(
        client, repeat="SCHEDULED, START OF DAY, +30 MINUTES, START OF HOUR, +5 MINUTES",
        firstRun=_yesterday_noon(),
    )
    scheduled = row(client, job_id)["nextRun"]
    _retry(client, job_id)
    assert row(client, job_id)["nextRun"] == scheduled[:10] + " 00:05:00"


def _assert_reanchored(next_run: str, anchor: str, interval: int, before: datetime,
                       after: datetime) -> None:
    """nextRun is the first slot `anchor + k * interval` after the retry."""
    moment = parse_time(next_run)
    assert (moment - parse_time(anchor)).total_seconds() % interval == 0
    assert before.replace(microsecond=0) < moment <= after + timedelta(seconds=interval)


def test_retry_job__has_repeat_scheduled_missed_window_reanchors(client):
    # Scheduled an hour (and 7 s, to give it a phase of its own) ago.
    first_run = fmt(utcnow() - timedelta(hours=1, seconds=7))
    job_id = _running(client, repeat="SCHEDULED, +30 SECONDS", firstRun=first_run)
    before = utcnow()
    _retry(client, job_id)
    after = utcnow()
    job = row(client, job_id)
    assert job["state"] == "QUEUED"
    _assert_reanchored(job["nextRun"], first_run, 30, before, after)


def test_retry_job__has_repeat_scheduled_long_interval_not_reanchored(client):
    first_run = fmt(utcnow() - timedelta(hours=10))
    job = _retry_with_repeat(client, "SCHEDULED, +5 HOURS", firstRun=first_run)
    # Still in the past: it catches up one interval at a time.
    assert job["nextRun"] == fmt(parse_time(first_run) + timedelta(hours=5))


def test_retry_job__has_repeat_scheduled_snapping_modifier_not_reanchored(client):
    first_run_at = (utcnow() - timedelta(hours=3)).replace(minute=17, second=23, microsecond=0)
    job = _retry_with_repeat(
        client, "SCHEDULED, +1 HOUR, START OF HOUR", firstRun=fmt(first_run_at)
    )
    expected = (first_run_at + timedelta(hours=1)).replace(minute=0, second=0)
    assert job["nextRun"] == fmt(expected)


def test_retry_job__has_retry_after_scheduled_missed_window_reanchors(client):
    first_run = fmt(utcnow() - timedelta(hours=1, seconds=7))
    job_id = _running(client, repeat="SCHEDULED, +30 SECONDS", firstRun=first_run,
                      retryAfter="+10 MINUTES")
    leased = row(client, job_id)
    assert leased["state"] == "RUNQUEUED"
    assert json.loads(leased["data"])["originalNextRun"] == first_run
    before = utcnow()
    _retry(client, job_id)
    after = utcnow()
    job = row(client, job_id)
    assert job["state"] == "QUEUED"
    # The phase comes from originalNextRun, not from the lease end.
    _assert_reanchored(job["nextRun"], first_run, 30, before, after)


def test_retry_job__in_runqueued_state(client):
    job_id = _running(client, retryAfter="+1 SECOND")
    assert state(client, job_id) == "RUNQUEUED"
    _retry(client, job_id)
    assert state(client, job_id) == "QUEUED"


def test_retry_job__simply_retry_with_next_run(client):
    job_id = _running(client)
    next_run = _in_future(10)
    _retry(client, job_id, nextRun=next_run)
    job = row(client, job_id)
    assert job["nextRun"] == next_run
    assert job["state"] == "QUEUED"


def test_retry_job__change_name_and_priority(client):
    job_id = _running(client, jobPriority="500")
    _retry(client, job_id, name="newName", jobPriority="1000", nextRun=_in_future(10))
    job = row(client, job_id)
    assert (job["name"], job["priority"]) == ("newName", 1000)


def test_retry_job__change_name(client):
    job_id = _running(client, jobPriority="500")
    _retry(client, job_id, name="newName", nextRun=_in_future(10))
    job = row(client, job_id)
    assert (job["name"], job["priority"]) == ("newName", 500)


def test_retry_job__change_priority(client):
    job_id = _running(client, jobPriority="500")
    _retry(client, job_id, jobPriority="1000", nextRun=_in_future(10))
    job = row(client, job_id)
    assert (job["name"], job["priority"]) == ("job", 1000)


def test_retry_job__has_repeat_with_next_run(client):
    job_id = _running(client, repeat="STARTED, +1 HOUR")
    _retry(client, job_id, nextRun="2017-09-07 23:11:11")
    _assert_one_hour_after_start(client, job_id)


def test_retry_job__has_repeat_with_delay(client):
    job_id = _running(client, repeat="STARTED, +1 HOUR")
    _retry(client, job_id, delay="5")
    _assert_one_hour_after_start(client, job_id)


def test_retry_job__has_repeat_with_next_run_ignore_repeat(client):
    job_id = _running(client, repeat="STARTED, +1 HOUR")
    next_run = _in_future(10)
    _retry(client, job_id, nextRun=next_run, ignoreRepeat="true")
    job = row(client, job_id)
    assert job["nextRun"] == next_run
    assert job["repeat"] == "STARTED, +1 HOUR"


def test_retry_job__has_delay_and_next_run(client):
    job_id = _running(client)
    next_run = _in_future(10)
    _retry(client, job_id, nextRun=next_run, delay="900")
    assert row(client, job_id)["nextRun"] == next_run


def test_retry_job__simple_retry_with_http(client):
    job_id = _running(client)
    next_run = _in_future(10)
    ok(client.request("RetryJob / HTTP/1.1", jobID=job_id, nextRun=next_run))
    job = row(client, job_id)
    assert job["nextRun"] == next_run
    assert job["state"] == "QUEUED"


# CancelJobTest


def test_cancel_job__cancel_non_existent_job(client):
    reply = client.request("CancelJob", jobID=1)
    assert reply.status == "404 No job with this jobID"


def test_cancel_job__cancel_job_with_child(client):
    parent_id, (child_id,) = _parent_with_children(client, "child")
    finish(client, parent_id)
    get_job(client, "child")
    finish(client, child_id)
    assert state(client, parent_id) == "QUEUED"
    reply = client.request("CancelJob", jobID=parent_id)
    assert reply.status == "404 Invalid jobID - Cannot cancel a job with children"
    assert state(client, parent_id) == "QUEUED"


def test_cancel_job__cancel_running_job(client):
    parent_id, (child_id,) = _parent_with_children(client, "child")
    finish(client, parent_id)
    get_job(client, "child")
    assert state(client, child_id) == "RUNNING"
    ok(client.request("CancelJob", jobID=child_id))
    assert state(client, child_id) == "RUNNING"


def test_cancel_job__cancel_finished_job(client):
    parent_id, (child_id,) = _parent_with_children(client, "child")
    finish(client, parent_id)
    get_job(client, "child")
    finish(client, child_id)
    assert state(client, child_id) == "FINISHED"
    ok(client.request("CancelJob", jobID=child_id))
    assert state(client, child_id) == "FINISHED"


def test_cancel_job__cancel_paused_job(client):
    _parent_id, (child_id,) = _parent_with_children(client, "child")
    assert state(client, child_id) == "PAUSED"
    ok(client.request("CancelJob", jobID=child_id))
    assert state(client, child_id) == "PAUSED"


def test_cancel_job__cancel_child_job(client):
    parent_id, (child_id, sibling_id) = _parent_with_children(client, "child", "sibling")
    finish(client, parent_id)
    get_job(client, "sibling")
    ok(client.request("CancelJob", jobID=child_id))
    assert state(client, child_id) == "CANCELLED"
    assert state(client, sibling_id) == "RUNNING"
    assert state(client, parent_id) == "PAUSED"


def test_cancel_job__cancel_job_without_parent(client):
    job_id = create(client, "orphanChild")
    reply = client.request("CancelJob", jobID=job_id)
    assert reply.status == "404 Invalid jobID - Cannot cancel a job without a parent"
    assert state(client, job_id) == "QUEUED"


def test_cancel_job__cancel_job_with_siblings(client):
    parent_id, (child_id, child2_id) = _parent_with_children(client, "child", "child2")
    finish(client, parent_id)
    ok(client.request("CancelJob", jobID=child_id))
    assert state(client, parent_id) == "PAUSED"
    ok(client.request("CancelJob", jobID=child2_id))
    assert state(client, parent_id) == "QUEUED"


# DeleteJobTest


def test_delete_job__delete_non_existent_job(client):
    reply = client.request("DeleteJob", jobID=1)
    assert reply.status == "404 No job with this jobID"


def test_delete_job__delete_job_with_child(client):
    parent_id, _ = _parent_with_children(client, "child")
    finish(client, parent_id)
    assert state(client, parent_id) == "PAUSED"
    reply = client.request("DeleteJob", jobID=parent_id)
    assert reply.status == "405 Can't delete a parent jobs with children running"
    assert state(client, parent_id) == "PAUSED"


def test_delete_job__delete_running_job(client):
    parent_id, (child_id,) = _parent_with_children(client, "child")
    finish(client, parent_id)
    get_job(client, "child")
    assert state(client, child_id) == "RUNNING"
    reply = client.request("DeleteJob", jobID=child_id)
    assert reply.status == "405 Can't delete a RUNNING job"
    assert state(client, child_id) == "RUNNING"


def test_delete_job__delete_finished_job(client):
    parent_id, (child_id,) = _parent_with_children(client, "child")
    finish(client, parent_id)
    get_job(client, "child")
    finish(client, child_id)
    assert state(client, child_id) == "FINISHED"
    ok(client.request("DeleteJob", jobID=child_id))
    assert row(client, child_id) is None
    assert state(client, parent_id) == "QUEUED"
    ok(client.request("DeleteJob", jobID=parent_id))
    assert count(client) == 0


# FailJobTest


def test_fail_job__non_existent_job(client):
    reply = client.request("FailJob", jobID=1)
    assert reply.status == "404 No job with this jobID"


def test_fail_job__not_in_running_runqueued_state(client):
    job_id = create(client, "job")
    reply = client.request("FailJob", jobID=job_id)
    assert reply.status == "405 Can only fail RUNNING or RUNQUEUED jobs"
    assert state(client, job_id) == "QUEUED"


def test_fail_job__fail_job_in_running_state(client):
    job_id = _running(client)
    assert state(client, job_id) == "RUNNING"
    ok(client.request("FailJob", jobID=job_id))
    assert state(client, job_id) == "FAILED"


def test_fail_job__fail_job_in_runqueued_state(client):
    job_id = _running(client, retryAfter="+1 MINUTES")
    assert state(client, job_id) == "RUNQUEUED"
    ok(client.request("FailJob", jobID=job_id))
    assert state(client, job_id) == "FAILED"


# RequeueJobsTest


def test_requeue_jobs__requeue_running_job(client):
    job_id = _running(client)
    assert state(client, job_id) == "RUNNING"
    ok(client.request("RequeueJobs", jobIDs=str(job_id)))
    assert state(client, job_id) == "QUEUED"


def test_requeue_jobs__requeue_runqueued_job(client):
    job_id = _running(client, retryAfter="+1 MINUTE")
    assert state(client, job_id) == "RUNQUEUED"
    ok(client.request("RequeueJobs", jobIDs=str(job_id)))
    assert state(client, job_id) == "QUEUED"


def _three_jobs(client) -> list[int]:
    """job1 RUNNING, job2 RUNQUEUED, job3 QUEUED."""
    ids = [create(client, "job1"), create(client, "job2", retryAfter="+1 MINUTE"),
           create(client, "job3", retryAfter="+1 MINUTE")]
    get_job(client, "job1")
    get_job(client, "job2")
    assert [state(client, i) for i in ids] == ["RUNNING", "RUNQUEUED", "QUEUED"]
    return ids


def test_requeue_jobs__requeue_multiple_jobs(client):
    ids = _three_jobs(client)
    # jobserver refuses a list it cannot read (Bedrock reads garbage as 0).
    reply = client.request("RequeueJobs", jobIDs=f"{ids[0]},blabla")
    assert reply.status == "402 Malformed jobIDs"
    assert [state(client, i) for i in ids] == ["RUNNING", "RUNQUEUED", "QUEUED"]

    ok(client.request("RequeueJobs", jobIDs=",".join(map(str, ids))))
    assert [state(client, i) for i in ids] == ["QUEUED"] * 3


def test_requeue_jobs__change_multiple_job_names(client):
    ids = _three_jobs(client)
    ok(client.request("RequeueJobs", jobIDs=",".join(map(str, ids)), name="newJobName"))
    for job_id in ids:
        job = row(client, job_id)
        assert (job["state"], job["name"]) == ("QUEUED", "newJobName")


def test_requeue_jobs__test_next_run_time(client):
    job_id = create(client, "job", firstRun=_in_future(10))
    job = row(client, job_id)
    assert job["nextRun"] != job["created"]
    ok(client.request("RequeueJobs", jobIDs=str(job_id)))
    job = row(client, job_id)
    assert job["nextRun"] == job["created"]
    assert job["state"] == "QUEUED"


def test_children_stored_before_a_restart_are_still_found(tmp_path):
    """The server keeps in memory which jobs have children, to spare the
    query for all others; one started on a file must know those stored."""
    first = ThreadServer(tmp_path / "jobs.db")
    with first.client() as client:
        parent = create(client, "parent")
        ok(client.request("GetJob", name="parent"))
        child = create(client, "child", parentJobID=parent, data='{"n":1}')
        ok(client.request("FinishJob", jobID=parent))
        ok(client.request("GetJob", name="child"))
        ok(client.request("FinishJob", jobID=child))
    first.stop()
    second = ThreadServer(tmp_path / "jobs.db")
    with second.client() as client:
        handed = ok(client.request("GetJob", name="parent")).json
        assert handed["finishedChildJobs"] == [{"data": {"n": 1}, "jobID": child}]
        ok(client.request("FinishJob", jobID=parent))
        # Its ended children went with it.
        assert client.request("QueryJob", jobID=child).status == "404 No job with this jobID"
    second.stop()
