"""FailJobs and RetryJobs (protocol.md 14.15): many FailJobs or RetryJobs in
one request, each element answered as the one-job command would answer
it, in order, each undone alone when it fails, as FinishJobs does. The
twin tests send the same elements as one request and, to twin jobs, one
by one, and require the same answers and the same jobs after."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_finish_jobs import (
    UNKNOWN,
    WRONG_LEASE,
    _element,
    _expected_id,
    _headers,
    datas,
    hand_out,
    job_refs,
    key_cases,
    leases,
    query,
)

from helpers import create, ok
from jobserver.client import Client as LibraryClient
from jobserver.client import Conflict, Fail, IllegalState, JobNotFound, Retry, TrioClient
from jobserver.core.commands import dispatch
from jobserver.wire.framing import Request
from jobserver.wire.limits import MAX_FINISH_JOBS
from wire import Client

pytestmark = pytest.mark.backends

_names = itertools.count()

# What an element adds to FinishJob's parameters: FailJob's error, or
# RetryJob's delay, nextRun and ignoreRepeat, well formed or not.
fail_extras = st.fixed_dictionaries({}, optional={
    "error": st.sampled_from(["boom", "", "x" * 70_000, None, 5]),
})
retry_extras = st.fixed_dictionaries({}, optional={
    "delay": st.sampled_from([0, 30, -1, "abc", "1.5", None]),
    "nextRun": st.sampled_from(["2030-01-01 00:00:00", "not a time", ""]),
    "ignoreRepeat": st.sampled_from([True, False, "true", None]),
})


def _world(client: Client) -> tuple[list[int], dict[int, str]]:
    """Three jobs handed out: one plain, one repeating, one with a retry
    policy of two attempts; their leases."""
    name = f"twin{next(_names)}"
    ids = [
        create(client, name, data={"a": 1}),
        create(client, name, repeat="FINISHED, +1 HOUR"),
        create(client, name, maxAttempts=2, retryDelay=60),
    ]
    return ids, hand_out(client, name, 3)


def _state(client: Client, job_id: int) -> tuple[Any, ...] | None:
    job = query(client, job_id)
    if job is None:
        return None
    return (job["state"], job["data"], job["repeat"], job.get("lastError"), job.get("attempts"))


def _twins(client: Client, command: str, specs: list[Any]) -> None:
    """The elements as one `command`s request to some jobs, and one by one
    to their twins: the same answers, and the jobs alike after."""
    batch_ids, batch_leases = _world(client)
    twin_ids, twin_leases = _world(client)
    batch = []
    for spec, extras in specs:
        element = _element(spec, batch_ids, batch_leases)
        batch.append({**element, **extras})
    results = ok(client.request(f"{command}s", jobs=batch)).json["results"]
    assert [r["jobID"] for r in results] == [_expected_id(e) for e in batch]
    for (spec, extras), got in zip(specs, results, strict=True):
        element = {**_element(spec, twin_ids, twin_leases), **extras}
        reply = client.request(command, headers=_headers(element))
        assert got["status"] == reply.status, (spec, extras, element)
    assert [_state(client, j) for j in batch_ids] == [_state(client, j) for j in twin_ids]


# Job references reach the third job (with a retry policy) too.
three_jobs = st.one_of(
    st.tuples(st.just("job"), st.integers(0, 2), st.sampled_from([int, str])), job_refs
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(specs=st.lists(
    st.tuples(st.tuples(three_jobs, leases, datas, key_cases), fail_extras),
    min_size=1, max_size=4,
))
def test_each_element_of_fail_jobs_is_failed_exactly_as_fail_job_would_fail_it(client, specs):
    _twins(client, "FailJob", specs)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(specs=st.lists(
    st.tuples(st.tuples(three_jobs, leases, datas, key_cases), retry_extras),
    min_size=1, max_size=4,
))
def test_each_element_of_retry_jobs_is_retried_exactly_as_retry_job_would_retry_it(
    client, specs
):
    _twins(client, "RetryJob", specs)


@pytest.mark.parametrize("command", ["FailJobs", "RetryJobs"])
def test_more_jobs_than_the_limit_or_no_list_are_refused_and_nothing_is_done(client, command):
    job_id = create(client, "kept")
    hand_out(client, "kept")
    too_many = [{"jobID": job_id}] * (MAX_FINISH_JOBS + 1)
    assert client.request(command, jobs=too_many).status == "413 Too many jobs (max 1000)"
    for jobs in ([], {}, "x", [{}], [1]):
        assert client.request(command, jobs=jobs).status == "401 Invalid JSON", jobs
    assert ok(client.request("QueryJob", jobID=job_id)).json["state"] == "RUNNING"


def test_a_failed_elements_writes_are_undone_and_the_others_kept(client):
    ids = [create(client, "mixed", maxAttempts=3) for _ in range(3)]
    leases_of = hand_out(client, "mixed", 3)
    results = ok(client.request("FailJobs", jobs=[
        {"jobID": ids[0], "leaseID": leases_of[ids[0]], "error": "first"},
        {"jobID": ids[1], "leaseID": WRONG_LEASE, "error": "second"},
        {"jobID": ids[2], "error": "x" * 70_000},
        {"jobID": UNKNOWN},
    ])).json["results"]
    assert [r["status"] for r in results] == [
        "200 OK", "409 Lease expired", "402 Error too large (65536 bytes at most)",
        "404 No job with this jobID",
    ]
    first = ok(client.request("QueryJob", jobID=ids[0])).json
    assert (first["state"], first["lastError"]) == ("QUEUED", "first")
    for job_id in ids[1:]:
        assert ok(client.request("QueryJob", jobID=job_id)).json["state"] == "RUNNING"


# The client library.


def test_the_client_fails_and_retries_many_jobs_with_typed_results(server):
    with LibraryClient("127.0.0.1", server.port, timeout=10) as jobs:
        ids = jobs.create_jobs([{"name": "lib", "maxAttempts": 2}] * 4)
        taken = {job["jobID"]: job["leaseID"] for job in jobs.get_jobs("lib", 4)}
        failed = jobs.fail_jobs([
            Fail(ids[0], taken[ids[0]], error="boom", data={"why": 1}),
            Fail(ids[1], "0000000000000000", error="stolen"),
        ])
        assert [(r.job_id, r.status) for r in failed] == [
            (ids[0], "200 OK"), (ids[1], "409 Lease expired"),
        ]
        assert type(failed[1].error()) is Conflict
        retried = jobs.retry_jobs([
            Retry(ids[2], taken[ids[2]], delay=3600),
            Retry(ids[3], taken[ids[3]], next_run="2030-01-01 00:00:00", ignore_repeat=True),
            Retry(UNKNOWN),
            Retry(ids[2]),
        ])
        assert [r.ok for r in retried] == [True, True, False, False]
        assert [type(r.error()) for r in retried[2:]] == [JobNotFound, IllegalState]
        job = jobs.query_job(ids[0])
        assert (job["state"], job["lastError"], job["data"]) == ("QUEUED", "boom", {"why": 1})
        assert jobs.query_job(ids[3])["nextRun"] == "2030-01-01 00:00:00"
        for call in (jobs.fail_jobs, jobs.retry_jobs):
            with pytest.raises(ValueError, match=f"1 to {MAX_FINISH_JOBS} jobs"):
                call([])


async def test_the_trio_client_fails_many_jobs_at_once(server):
    async with TrioClient("127.0.0.1", server.port, timeout=10) as jobs:
        await jobs.create_jobs([{"name": "async"}] * 3)
        taken = await jobs.get_jobs("async", 3)
        results = await jobs.fail_jobs([Fail(j["jobID"], j["leaseID"], "no") for j in taken])
        assert [r.status for r in results] == ["200 OK"] * 3
        assert [j["lastError"] for j in await jobs.failed_jobs("async")] == ["no"] * 3


@pytest.mark.parametrize("verb", ["CreateJobs", "FinishJobs", "FailJobs", "RetryJobs"])
def test_many_elements_run_off_the_event_loop_even_in_a_small_request(verb):
    """A thousand small elements fit in 16 KiB, and each may cost half a
    millisecond (a backoff placed in a job's time windows): past 64
    elements a request runs in the writer's thread."""
    few = json.dumps([{"jobID": n} for n in range(1, 60)])
    many = json.dumps([{"jobID": n} for n in range(1, 900)])
    assert len(many) < dispatch.HEAVY_REQUEST_BYTES
    assert not dispatch._is_heavy(Request(verb, {"jobs": few}))
    assert dispatch._is_heavy(Request(verb, {"jobs": many}))
