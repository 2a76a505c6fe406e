"""Failure handling beyond Bedrock: retry policies with backoff, the dead
set, lease renewal (TouchJob) and fencing (leaseID), over a real server.

Waits poll with a deadline; leases are `+1 SECOND` and fixed delays 1 s, so
the whole file runs in seconds. Times the server computes are checked
against bounds taken just before and after the request.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance_helpers import in_seconds, parse_time, query, row, utcnow
from harness import ThreadServer
from helpers import create, ok, until
from jobserver.core.rules import leases, schedule
from jobserver.model.jobs import Job
from jobserver.model.repeat import offset_seconds
from jobserver.storage.sqlite import Store
from jobserver.storage.sqlite_schema import SCHEMA_VERSION, StoreError
from wire import Client, Reply

# The same protocol on every backend (conftest.BACKENDS).
pytestmark = pytest.mark.backends

DEADLINE = 10.0
POLL = 0.05

BEDROCK_GET_KEYS = {
    "created", "data", "jobID", "lastRun", "name", "nextRun", "priority", "repeat", "retryAfter"
}
BEDROCK_QUERY_KEYS = BEDROCK_GET_KEYS | {"state"}


def query_job(client: Client, job_id: int) -> dict[str, Any]:
    return ok(client.request("QueryJob", jobID=job_id)).json


def poll_job(client: Client, name: str, **params: Any) -> Reply:
    """GetJob until it hands out a job; anything but 404 is a failure."""
    end = time.monotonic() + DEADLINE
    while True:
        reply = client.request("GetJob", name=name, **params)
        if reply.status == "200 OK":
            return reply
        assert reply.status == "404 No job found", reply
        assert time.monotonic() < end, f"no {name} job within {DEADLINE}s"
        time.sleep(POLL)


def make_due(client: Client, job_id: int) -> None:
    """Skip a backoff delay: UpdateJob sets the QUEUED job's nextRun to the past."""
    ok(client.request("UpdateJob", jobID=job_id, data={}, nextRun="2000-01-01 00:00:00"))


def delay_of(job: dict[str, Any], before: datetime, after: datetime) -> tuple[float, float]:
    """Bounds of the delay the server chose: nextRun minus the time of the
    request, which came between `before` and `after`. nextRun has whole
    milliseconds, cut rather than rounded, hence `before` to the millisecond."""
    next_run = parse_time(job["nextRun"])
    before = before.replace(microsecond=before.microsecond // 1000 * 1000)
    return (next_run - after).total_seconds(), (next_run - before).total_seconds()


def policy_job(backoff: str, delay: float, max_delay: float = 3600.0) -> Job:
    return Job(
        created="2026-01-01 00:00:00", jobID=1, state="RUNNING", name="x",
        nextRun="2026-01-01 00:00:00", lastRun=None, repeat="", data="{}", priority=500,
        parentJobID=0, retryAfter="", maxAttempts=10, retryBackoff=backoff, retryDelay=delay,
        retryMaxDelay=max_delay, attempts=1, lastError="", leaseID="",
    )


# The backoff schedule, without a server.


def test_fixed_backoff_is_the_delay_every_time_without_jitter():
    job = policy_job("fixed", 7.5)
    assert [schedule.backoff_delay(job, n, rng=lambda: 0.99) for n in (1, 2, 10)] == [7.5] * 3


def test_exponential_backoff_doubles_from_the_base():
    job = policy_job("exponential", 1.5)
    delays = [schedule.backoff_delay(job, n, rng=lambda: 0.0) for n in range(1, 6)]
    assert delays == [1.5, 3.0, 6.0, 12.0, 24.0]


def test_exponential_backoff_is_capped_at_an_hour_by_default_or_at_retry_max_delay():
    job = policy_job("exponential", 1000)
    assert [schedule.backoff_delay(job, n, rng=lambda: 0.0) for n in (2, 3, 4)] == [
        2000, 3600, 3600]
    assert schedule.backoff_delay(policy_job("exponential", 1, 5), 4, rng=lambda: 0.0) == 5
    # A huge attempt number does not overflow.
    assert schedule.backoff_delay(job, 10_000, rng=lambda: 0.0) == 3600


@given(
    base=st.floats(min_value=0, max_value=99_999_999),
    attempt=st.integers(min_value=1, max_value=10_000),
    cap=st.floats(min_value=0, max_value=99_999_999),
    draw=st.floats(min_value=0, max_value=1, exclude_max=True),
)
def test_jitter_adds_at_most_ten_percent(base, attempt, cap, draw):
    job = policy_job("exponential", base, cap)
    delay = min(base * 2.0 ** min(attempt - 1, 64), cap)
    jittered = schedule.backoff_delay(job, attempt, rng=lambda: draw)
    assert delay <= jittered <= delay * 1.1
    assert delay <= schedule.backoff_delay(job, attempt) <= delay * 1.1


@pytest.mark.parametrize("text, seconds", [
    ("+1 SECOND", 1), ("+5 MINUTES", 300), ("+1 HOUR, +30 MINUTES", 5400), ("+1 DAY", 86400),
    ("+1 HOUR, -10 MINUTES", 3000), ("START OF DAY, +1 HOUR", None), ("-1 HOUR", None),
    ("bogus", None),
])
def test_lease_length_without_sqlite(text, seconds):
    assert offset_seconds(text) == seconds


# Creating jobs with a policy.


@pytest.mark.parametrize("params, status", [
    ({"retryDelay": "5"}, "402 Missing maxAttempts"),
    ({"retryBackoff": "fixed"}, "402 Missing maxAttempts"),
    ({"retryMaxDelay": "60"}, "402 Missing maxAttempts"),
    ({"maxAttempts": "0"}, "402 Malformed maxAttempts"),
    ({"maxAttempts": "-1"}, "402 Malformed maxAttempts"),
    ({"maxAttempts": "03"}, "402 Malformed maxAttempts"),
    ({"maxAttempts": "2.0"}, "402 Malformed maxAttempts"),
    ({"maxAttempts": "10001"}, "402 Malformed maxAttempts"),
    ({"maxAttempts": "many"}, "402 Malformed maxAttempts"),
    ({"maxAttempts": "3", "retryBackoff": "linear"}, "402 Malformed retryBackoff"),
    ({"maxAttempts": "3", "retryDelay": "-1"}, "402 Malformed retryDelay"),
    ({"maxAttempts": "3", "retryDelay": "1e3"}, "402 Malformed retryDelay"),
    ({"maxAttempts": "3", "retryDelay": "0.0001"}, "402 Malformed retryDelay"),
    ({"maxAttempts": "3", "retryDelay": "123456789"}, "402 Malformed retryDelay"),
    ({"maxAttempts": "3", "retryMaxDelay": "soon"}, "402 Malformed retryMaxDelay"),
])
def test_bad_policies_are_refused_and_create_nothing(untouched, params, status):
    assert untouched.request("CreateJob", name="x", **params).status == status
    jobs = json.dumps([{"name": "fine"}, {"name": "x", **params}])
    assert untouched.request("CreateJobs", jobs=jobs).status == status
    assert query(untouched, "SELECT COUNT(*) AS n FROM jobs;")[0]["n"] == 0


def test_policy_defaults_and_case(client):
    job_id = create(client, "x", maxAttempts=3, retryBackoff="FIXED", retryDelay="0.25")
    job = query_job(client, job_id)
    assert (job["maxAttempts"], job["retryBackoff"], job["retryDelay"], job["retryMaxDelay"]) == (
        3, "fixed", 0.25, 3600)
    [other] = ok(client.request("CreateJobs", jobs='[{"name":"y","maxAttempts":2}]')).json["jobIDs"]
    job = query_job(client, other)
    assert (job["retryBackoff"], job["retryDelay"], job["attempt"], job["lastError"]) == (
        "exponential", 1, 0, "")


# Replies: Bedrock's shape unless asked for more.


def test_plain_jobs_keep_bedrocks_replies_and_leased_ones_get_a_lease_header(client):
    plain = create(client, "plain")
    reply = ok(client.request("GetJob", name="plain"))
    assert set(reply.json) == BEDROCK_GET_KEYS
    assert reply.headers == {"Content-Length": str(len(reply.body))}
    assert set(query_job(client, plain)) == BEDROCK_QUERY_KEYS

    create(client, "leased", retryAfter="+1 HOUR")
    reply = ok(client.request("GetJob", name="leased"))
    assert set(reply.json) == BEDROCK_GET_KEYS
    assert len(reply.headers["leaseID"]) == 16
    assert list(reply.headers) == ["leaseID", "Content-Length"]


def test_include_lease_id_puts_the_header_value_in_each_job(client):
    create(client, "one")
    reply = ok(client.request("GetJob", name="one", includeLeaseID="true"))
    assert reply.json["leaseID"] == reply.headers["leaseID"]

    ids = [create(client, "many", retryAfter="+1 HOUR"), create(client, "many")]
    reply = ok(client.request("GetJobs", name="many", numResults=5, includeLeaseID="TRUE"))
    jobs = reply.json["jobs"]
    assert [job["jobID"] for job in jobs] == ids
    assert reply.headers["leaseID"] == ",".join(job["leaseID"] for job in jobs)
    assert len(set(reply.headers["leaseID"].split(","))) == 2

    # A waiting GetJob is served by the wait queue, not the command: the same.
    create(client, "waited", retryAfter="+1 HOUR")
    reply = ok(client.request("GetJob", name="waited", Connection="wait", timeout=5000,
                              includeLeaseID="true"))
    assert reply.json["leaseID"] == reply.headers["leaseID"]


def test_lease_tokens_stay_distinct_across_draws_of_random_bytes(client):
    # Tokens are cut from random bytes drawn TOKENS_PER_DRAW at a time: a
    # GetJobs past two draws hands out only new, whole 16-digit tokens.
    count = 2 * leases.TOKENS_PER_DRAW + 10
    jobs = json.dumps([{"name": "drawn"}] * count)
    ok(client.request("CreateJobs", jobs=jobs))
    tokens: list[str] = []
    while len(tokens) < count:
        reply = ok(client.request("GetJobs", name="drawn", numResults=1000, includeLeaseID="true"))
        tokens += reply.headers["leaseID"].split(",")
    assert len(tokens) == len(set(tokens)) == count
    assert all(len(token) == 16 and int(token, 16) >= 0 for token in tokens)


def test_policy_jobs_show_their_attempt(client):
    job_id = create(client, "p", maxAttempts=4, retryBackoff="fixed", retryDelay=0)
    job = ok(client.request("GetJob", name="p")).json
    assert set(job) == BEDROCK_GET_KEYS | {"attempt", "maxAttempts"}
    assert (job["attempt"], job["maxAttempts"]) == (1, 4)
    shown = query_job(client, job_id)
    assert set(shown) == BEDROCK_QUERY_KEYS | {
        "attempt", "maxAttempts", "lastError", "retryBackoff", "retryDelay", "retryMaxDelay"}
    assert (shown["attempt"], shown["state"]) == (1, "RUNNING")


# FailJob with a policy.


def test_failing_with_attempts_left_requeues_after_the_delay_until_they_run_out(client):
    job_id = create(client, "flaky", data={"n": 0}, maxAttempts=3, retryBackoff="fixed",
                    retryDelay=1)
    errors = []
    for attempt in (1, 2, 3):
        job = poll_job(client, "flaky").json
        assert (job["jobID"], job["attempt"]) == (job_id, attempt)
        before = utcnow()
        ok(client.request("FailJob", jobID=job_id, data={"n": attempt},
                          error=f"attempt {attempt} broke"))
        after = utcnow()
        errors.append(f"attempt {attempt} broke")
        shown = query_job(client, job_id)
        assert (shown["attempt"], shown["lastError"], shown["data"]) == (
            attempt, errors[-1], {"n": attempt})
        if attempt < 3:
            assert shown["state"] == "QUEUED"
            low, high = delay_of(shown, before, after)
            assert low <= 1 <= high
            assert client.request("GetJob", name="flaky").status == "404 No job found"
    assert shown["state"] == "FAILED"
    assert client.request("GetJob", name="flaky").status == "404 No job found"


def test_exponential_schedule_with_cap_and_jitter_on_the_server(client):
    job_id = create(client, "expo", maxAttempts=6, retryDelay=100, retryMaxDelay=300)
    for attempt, delay in [(1, 100), (2, 200), (3, 300), (4, 300)]:
        assert ok(client.request("GetJob", name="expo")).json["attempt"] == attempt
        before = utcnow()
        ok(client.request("FailJob", jobID=job_id))
        after = utcnow()
        low, high = delay_of(query_job(client, job_id), before, after)
        # Within [delay, 1.1 delay] of the moment the request ran.
        assert delay <= high and low <= delay * 1.1
        make_due(client, job_id)

    # Without retryMaxDelay the cap is an hour: 3000 x 2 becomes 3600.
    capped = create(client, "capped", maxAttempts=3, retryDelay=3000)
    ok(client.request("GetJob", name="capped"))
    ok(client.request("FailJob", jobID=capped))
    make_due(client, capped)
    ok(client.request("GetJob", name="capped"))
    before = utcnow()
    ok(client.request("FailJob", jobID=capped))
    after = utcnow()
    low, high = delay_of(query_job(client, capped), before, after)
    assert high >= 3600 and low <= 3960

    # fixed is exactly the delay: no cap, no jitter.

    fixed = create(client, "fixed", maxAttempts=2, retryBackoff="fixed", retryDelay=5000)
    ok(client.request("GetJob", name="fixed"))
    before = utcnow()
    ok(client.request("FailJob", jobID=fixed))
    after = utcnow()
    low, high = delay_of(query_job(client, fixed), before, after)
    assert low <= 5000 <= high


def test_the_last_error_comes_from_the_error_parameter_or_the_datas_error_key(client):
    for name, params, expected in [
        ("param", {"error": "disk full", "data": {"error": "ignored"}}, "disk full"),
        ("text", {"data": {"error": "timeout"}}, "timeout"),
        ("object", {"data": {"error": {"exitStatus": 1, "stderr": "x"}}},
         '{"exitStatus":1,"stderr":"x"}'),
        ("none", {}, ""),
        # NUL, which PostgreSQL's text cannot hold, reads the same on both.
        ("nul", {"error": "bad\\u0000byte"}, "bad\ufffdbyte"),
        ("nul-data", {"data": {"error": "a\u0000b"}}, "a\ufffdb"),
    ]:
        job_id = create(client, name, maxAttempts=1)
        ok(client.request("GetJob", name=name))
        ok(client.request("FailJob", jobID=job_id, **params))
        job = query_job(client, job_id)
        assert (job["state"], job["lastError"]) == ("FAILED", expected)
    job_id = create(client, "long", maxAttempts=1)
    ok(client.request("GetJob", name="long"))
    reply = client.request("FailJob", jobID=job_id, error="x" * (64 * 1024 + 1))
    assert reply.status == "402 Error too large (65536 bytes at most)"
    assert query_job(client, job_id)["state"] == "RUNNING"


def test_finish_and_retry_give_the_next_run_every_attempt_again(client):
    job_id = create(client, "daily", repeat="FINISHED, +1 DAY", maxAttempts=3, retryDelay=0)
    ok(client.request("GetJob", name="daily"))
    ok(client.request("FailJob", jobID=job_id))
    assert poll_job(client, "daily").json["attempt"] == 2
    ok(client.request("FinishJob", jobID=job_id))
    assert query_job(client, job_id)["attempt"] == 0
    make_due(client, job_id)
    assert ok(client.request("GetJob", name="daily")).json["attempt"] == 1
    ok(client.request("RetryJob", jobID=job_id, ignoreRepeat="true"))
    assert ok(client.request("GetJob", name="daily")).json["attempt"] == 1


def test_requeue_jobs_revives_a_dead_job_with_all_its_attempts(client):
    job_id = create(client, "once", maxAttempts=1)
    ok(client.request("GetJob", name="once"))
    ok(client.request("FailJob", jobID=job_id, error="broken"))
    assert query_job(client, job_id)["state"] == "FAILED"
    ok(client.request("RequeueJobs", jobIDs=str(job_id)))
    job = ok(client.request("GetJob", name="once")).json
    assert (job["jobID"], job["attempt"]) == (job_id, 1)


def test_plain_fail_job_is_still_final(client):
    job_id = create(client, "plain")
    ok(client.request("GetJob", name="plain"))
    ok(client.request("FailJob", jobID=job_id, data={"error": "x"}))
    assert query_job(client, job_id)["state"] == "FAILED"
    assert set(query_job(client, job_id)) == BEDROCK_QUERY_KEYS


# Leases that expire.


def test_an_expired_lease_counts_as_an_attempt_and_uses_the_same_limit(client):
    job_id = create(client, "lost", retryAfter="+1 SECOND", maxAttempts=2)
    first = ok(client.request("GetJob", name="lost", includeLeaseID="true"))
    assert first.json["attempt"] == 1
    second = poll_job(client, "lost", includeLeaseID="true")
    assert second.json["attempt"] == 2
    assert second.json["leaseID"] != first.json["leaseID"]
    job = query_job(client, job_id)
    assert (job["lastError"], job["data"]) == (leases.LEASE_EXPIRED, {})

    def dead() -> bool:
        reply = client.request("GetJob", name="lost")
        assert reply.status == "404 No job found", reply
        return query_job(client, job_id)["state"] == "FAILED"

    until(dead, DEADLINE, "the second lease to expire")
    job = query_job(client, job_id)
    assert (job["attempt"], job["lastError"]) == (2, leases.LEASE_EXPIRED)
    # The policy replaces Bedrock's counter.
    assert "retryAfterCount" not in job["data"]


# TouchJob.


def test_touch_job_keeps_a_job_from_being_handed_out_again(server, client):
    # Leases count from the start of the current second: a one-second lease
    # renewed at x.99 would end 10 ms later, so two seconds keep at least one.
    job_id = create(client, "long", retryAfter="+2 SECONDS")
    lease = ok(client.request("GetJob", name="long")).headers["leaseID"]
    with server.client() as other:
        end = time.monotonic() + 3.5
        while time.monotonic() < end:
            before = utcnow()
            reply = ok(client.request("TouchJob", jobID=job_id, leaseID=lease))
            after = utcnow()
            # Two seconds from now, in whole seconds.
            assert in_seconds(before + timedelta(seconds=2), after + timedelta(seconds=2),
                              reply.json["nextRun"])
            assert query_job(client, job_id)["nextRun"] == reply.json["nextRun"]
            assert other.request("GetJob", name="long").status == "404 No job found"
            time.sleep(0.2)
        # Without touches, the lease runs out and the job goes to the next worker.
        taken = poll_job(other, "long")
        assert taken.headers["leaseID"] != lease


def test_touch_job_refusals(client):
    assert client.request("TouchJob").status == "402 Missing jobID"
    assert client.request("TouchJob", jobID="x").status == "402 Malformed jobID"
    assert client.request("TouchJob", jobID=99).status == "404 No job with this jobID"
    queued = create(client, "leased", retryAfter="+1 HOUR")
    assert (
        client.request("TouchJob", jobID=queued).status
        == "405 Can only touch RUNNING or RUNQUEUED jobs"
    )
    ok(client.request("GetJob", name="leased"))
    before = query_job(client, queued)
    assert client.request("TouchJob", jobID=queued, leaseID="stale").status == "409 Lease expired"
    assert query_job(client, queued) == before
    # Without a leaseID anyone may touch, as anyone may finish in Bedrock.
    ok(client.request("TouchJob", jobID=queued))


# Fencing.


def test_a_late_report_after_the_lease_went_to_another_worker_gets_409(server, client):
    job_id = create(client, "race", data={"v": 0}, retryAfter="+1 SECOND")
    lease_a = ok(client.request("GetJob", name="race")).headers["leaseID"]
    with server.client() as worker_b:
        lease_b = poll_job(worker_b, "race").headers["leaseID"]
        assert lease_b != lease_a
        before = row(client, job_id)
        for command, params in [
            ("FinishJob", {"data": {"v": "A"}}),
            ("RetryJob", {"delay": 60}),
            ("FailJob", {"error": "A"}),
            ("TouchJob", {}),
            ("UpdateJob", {"data": {"v": "A"}}),
        ]:
            reply = client.request(command, jobID=job_id, leaseID=lease_a, **params)
            assert reply.status == "409 Lease expired", (command, reply)
        assert row(client, job_id) == before
        ok(worker_b.request("UpdateJob", jobID=job_id, data={"v": "B"}, leaseID=lease_b))
        ok(worker_b.request("FinishJob", jobID=job_id, leaseID=lease_b))
    assert client.request("QueryJob", jobID=job_id).status == "404 No job with this jobID"


def test_a_report_sent_again_with_its_lease_gets_bedrocks_answer(client):
    # Jobs without retryAfter have leases too, for fencing after RequeueJobs.
    job_id = create(client, "again", repeat="FINISHED, +1 HOUR")
    lease = ok(client.request("GetJob", name="again", includeLeaseID="1")).json["leaseID"]
    ok(client.request("FinishJob", jobID=job_id, leaseID=lease))
    # Sent again after a lost reply: the job is QUEUED, handed to no one
    # since, so the answer is the usual one, not 409.
    reply = client.request("FinishJob", jobID=job_id, leaseID=lease)
    assert reply.status == "405 Can only retry/finish RUNNING and RUNQUEUED jobs"


def test_a_requeued_job_is_fenced_from_its_old_worker(client):
    job_id = create(client, "stuck")
    old = ok(client.request("GetJob", name="stuck", includeLeaseID="true")).json["leaseID"]
    ok(client.request("RequeueJobs", jobIDs=str(job_id)))
    new = ok(client.request("GetJob", name="stuck", includeLeaseID="true")).json["leaseID"]
    assert client.request("FinishJob", jobID=job_id, leaseID=old).status == "409 Lease expired"
    ok(client.request("FinishJob", jobID=job_id, leaseID=new))


# The dead set.


def test_failed_jobs_lists_dead_jobs_with_their_last_error_and_status_counts_them(client):
    for name, params in [("mail/a", {"error": "bounced"}), ("mail/b", {"data": {"error": "x"}}),
                         ("sms/c", {})]:
        job_id = create(client, name)
        ok(client.request("GetJob", name=name))
        ok(client.request("FailJob", jobID=job_id, **params))
    retried = create(client, "mail/retried", maxAttempts=2)
    ok(client.request("GetJob", name="mail/retried"))
    ok(client.request("FailJob", jobID=retried, error="will retry"))
    create(client, "mail/queued")

    jobs = ok(client.request("FailedJobs")).json["jobs"]
    assert [(j["jobID"], j["name"], j["lastError"]) for j in jobs] == [
        (1, "mail/a", "bounced"), (2, "mail/b", "x"), (3, "sms/c", "")]
    assert set(jobs[0]) == {"created", "jobID", "lastError", "lastRun", "name"}
    assert [j["jobID"] for j in ok(client.request("FailedJobs", name="mail/*")).json["jobs"]] == [
        1, 2]
    assert [j["jobID"] for j in ok(client.request("FailedJobs", name="sms/c, mail/b")).json[
        "jobs"]] == [2, 3]
    assert [j["jobID"] for j in ok(client.request("FailedJobs", limit=1)).json["jobs"]] == [1]
    assert ok(client.request("FailedJobs", name="' OR 1=1 --")).json["jobs"] == []
    assert client.request("FailedJobs", limit="lots").status == "402 Malformed limit"
    assert ok(client.request("Status")).json["jobs"] == {"FAILED": 3, "QUEUED": 2}


def test_the_failed_command_prints_the_dead_set(server, client):
    job_id = create(client, "report/daily", maxAttempts=1)
    ok(client.request("GetJob", name="report/daily"))
    ok(client.request("FailJob", jobID=job_id, error="no data"))
    create(client, "other")
    done = subprocess.run(
        [sys.executable, "-m", "jobserver", "failed", "report/*", "--json",
         "--server", f"127.0.0.1:{server.port}"],
        capture_output=True, text=True, timeout=15,
    )
    assert (done.returncode, done.stderr) == (0, "")
    [job] = json.loads(done.stdout)["jobs"]
    assert (job["jobID"], job["lastError"], job["attempt"], job["maxAttempts"]) == (
        job_id, "no data", 1, 1)


# Schema version 2.

# The schema of version 1, as the previous release created it.
V1_SCHEMA = """
CREATE TABLE jobs (
    created     TEXT NOT NULL,
    jobID       INTEGER PRIMARY KEY AUTOINCREMENT,
    state       TEXT NOT NULL,
    name        TEXT NOT NULL,
    nextRun     TEXT NOT NULL,
    lastRun     TEXT,
    repeat      TEXT NOT NULL DEFAULT '',
    data        TEXT NOT NULL DEFAULT '{}',
    priority    INTEGER NOT NULL DEFAULT 500,
    parentJobID INTEGER NOT NULL DEFAULT 0,
    retryAfter  TEXT NOT NULL DEFAULT ''
);
CREATE INDEX jobsReadyPriority ON jobs (priority, nextRun, name)
    WHERE state IN ('QUEUED', 'RUNQUEUED');
CREATE INDEX jobsReadyName ON jobs (name, priority, nextRun)
    WHERE state IN ('QUEUED', 'RUNQUEUED');
CREATE INDEX jobsReadyNextRun ON jobs (nextRun)
    WHERE state IN ('QUEUED', 'RUNQUEUED');
CREATE INDEX jobsName ON jobs (name);
CREATE INDEX jobsParentJobIDState ON jobs (parentJobID, state)
    WHERE parentJobID != 0;
PRAGMA user_version = 1;
INSERT INTO jobs (created, state, name, nextRun, data, retryAfter)
    VALUES ('2026-01-01 00:00:00', 'QUEUED', 'old', '2026-01-01 00:00:00', '{"a":1}', '+1 HOUR');
"""


def v1_file(path: Path, extra: str = "") -> Path:
    db = sqlite3.connect(path)
    db.executescript(V1_SCHEMA + extra)
    db.execute("PRAGMA journal_mode = WAL")
    db.close()
    return path


def layout(path: Path) -> tuple[Any, ...]:
    db = sqlite3.connect(path)
    try:
        columns = db.execute("PRAGMA table_info(jobs)").fetchall()
        indexes = db.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL "
            "ORDER BY name"
        ).fetchall()
        version = db.execute("PRAGMA user_version").fetchone()[0]
        return version, columns, indexes
    finally:
        db.close()


def test_a_version_1_file_is_migrated_to_the_current_schema(tmp_path):
    old = v1_file(tmp_path / "old.db")
    Store(str(old)).close()
    Store(str(tmp_path / "fresh.db")).close()
    assert SCHEMA_VERSION == 11
    assert layout(old) == layout(tmp_path / "fresh.db")

    server = ThreadServer(old)
    try:
        with server.client() as client:
            job = query_job(client, 1)
            assert set(job) == BEDROCK_QUERY_KEYS
            assert (job["name"], job["data"], job["state"]) == ("old", {"a": 1}, "QUEUED")
            reply = ok(client.request("GetJob", name="old"))
            assert "leaseID" in reply.headers
            assert create(client, "new", maxAttempts=2) == 2
    finally:
        server.stop()


def test_a_migration_that_fails_leaves_the_file_as_it_was(tmp_path):
    # A column the migration adds already exists: its ALTER TABLE fails
    # after others have run.
    path = v1_file(tmp_path / "odd.db", "ALTER TABLE jobs ADD COLUMN leaseID TEXT;")
    before = layout(path)
    with pytest.raises(StoreError):
        Store(str(path))
    assert layout(path) == before
