"""FinishJobs (protocol.md 14.15): many FinishJobs in one request, each
element answered as FinishJob would answer it, in order, each undone alone
when it fails. A real server on a loopback port; the twin test sends the
same elements as FinishJobs and, to twin jobs, as FinishJob one by one."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance_helpers import force, state
from helpers import create, ok, until
from jobserver.client import Client as LibraryClient
from jobserver.client import (
    Conflict,
    Finish,
    FinishResult,
    IllegalState,
    JobNotFound,
    TrioClient,
)
from jobserver.wire.limits import MAX_FINISH_JOBS
from wire import Client, Reply, encode

# The same protocol on every backend (conftest.BACKENDS).
pytestmark = pytest.mark.backends

# A jobID no test creates.
UNKNOWN = 2**62
WRONG_LEASE = "0123456789abcdef"


def finish_jobs(client: Client, jobs: Any) -> list[dict[str, Any]]:
    """FinishJobs, which must be answered `200 OK`; its results."""
    reply = ok(client.request("FinishJobs", jobs=jobs))
    assert set(reply.json) == {"results"}, reply.json
    return reply.json["results"]


def hand_out(client: Client, name: str, count: int = 1) -> dict[int, str]:
    """GetJobs for exactly `count` jobs called `name`: jobID -> leaseID."""
    reply = ok(client.request("GetJobs", name=name, numResults=count, includeLeaseID="true"))
    jobs = reply.json["jobs"]
    assert len(jobs) == count, jobs
    return {job["jobID"]: job["leaseID"] for job in jobs}


def query(client: Client, job_id: int) -> dict[str, Any] | None:
    reply = client.request("QueryJob", jobID=job_id)
    if reply.status == "404 No job with this jobID":
        return None
    return ok(reply).json


def result(job_id: int | None, status: str = "200 OK") -> dict[str, Any]:
    return {"jobID": job_id, "status": status}


# Outcomes, one per element.


def test_each_element_gets_the_answer_finish_job_would_give_in_order(client):
    done = create(client, "mixed", data={"old": 1})
    stolen = create(client, "mixed")
    bad_data = create(client, "mixed", data={"kept": True})
    leases = hand_out(client, "mixed", 3)
    queued = create(client, "idle")
    results = finish_jobs(client, [
        {"jobID": done, "leaseID": leases[done], "data": {"new": 2}},
        {"jobID": stolen, "leaseID": WRONG_LEASE},
        {"jobID": UNKNOWN},
        {"jobID": "abc"},
        {"jobID": 0},
        {"leaseID": leases[done]},
        {"jobID": queued},
        {"jobID": bad_data, "data": "[1, 2]"},
    ])
    assert results == [
        result(done),
        result(stolen, "409 Lease expired"),
        result(UNKNOWN, "404 No job with this jobID"),
        result(None, "402 Malformed jobID"),
        result(0, "402 Malformed jobID"),
        result(None, "402 Missing jobID"),
        result(queued, "405 Can only retry/finish RUNNING and RUNQUEUED jobs"),
        result(bad_data, "402 Data is not a valid JSON Object"),
    ]
    assert query(client, done) is None
    assert query(client, stolen)["state"] == "RUNNING"
    assert query(client, queued)["state"] == "QUEUED"
    kept = query(client, bad_data)
    assert (kept["state"], kept["data"]) == ("RUNNING", {"kept": True})


def test_elements_run_in_order_so_a_job_named_twice_is_finished_once(client):
    first = create(client, "twice")
    second = create(client, "twice")
    hand_out(client, "twice", 2)
    results = finish_jobs(client, [{"jobID": second}, {"jobID": first}, {"jobID": second}])
    assert results == [result(second), result(first), result(second, "404 No job with this jobID")]


def test_keys_are_case_insensitive_and_values_read_as_create_jobs_reads_them(client):
    job_id = create(client, "values", repeat="FINISHED, +1 HOUR")
    lease = hand_out(client, "values")[job_id]
    results = finish_jobs(
        client, [{"JOBID": str(job_id), "LeaseId": lease, "Data": '{"as":"text"}', "delay": 5}]
    )
    assert results == [result(job_id)]
    assert query(client, job_id)["data"] == {"as": "text"}


# Each element undone alone.


def test_a_failing_elements_writes_are_undone_and_the_others_kept(server, client):
    # A parent whose finished child FinishJob deletes (a write) before it
    # computes the parent's next run, which fails: past the year 9999.
    parent = create(client, "parent", repeat="SCHEDULED, +999 YEARS")
    hand_out(client, "parent")
    child = create(client, "child", parentJobID=parent)
    assert finish_jobs(client, [{"jobID": parent}]) == [result(parent)]
    hand_out(client, "child")
    assert finish_jobs(client, [{"jobID": child}]) == [result(child)]
    assert state(client, child) == "FINISHED"
    hand_out(client, "parent")
    force(server.db, "UPDATE jobs SET nextRun = '9990-01-01 00:00:00' WHERE jobID = ?", (parent,))
    before = create(client, "neighbour")
    after = create(client, "neighbour")
    hand_out(client, "neighbour", 2)
    results = finish_jobs(client, [{"jobID": before}, {"jobID": parent}, {"jobID": after}])
    assert results == [
        result(before), result(parent, "502 Failed to compute nextRun"), result(after)
    ]
    assert state(client, child) == "FINISHED"
    assert state(client, parent) == "RUNNING"
    assert state(client, before) is None and state(client, after) is None


# Finished exactly as FinishJob finishes: repeats, parents and children.


def test_a_repeating_job_is_queued_for_its_next_run_with_its_new_data(client):
    job_id = create(client, "daily", repeat="FINISHED, +1 DAY", retryAfter="+1 HOUR")
    lease = hand_out(client, "daily")[job_id]
    assert query(client, job_id)["data"] == {"retryAfterCount": 1}
    results = finish_jobs(client, [{"jobID": job_id, "leaseID": lease, "data": {"n": 1}}])
    assert results == [result(job_id)]
    job = query(client, job_id)
    assert (job["state"], job["data"]) == ("QUEUED", {"n": 1})
    assert job["nextRun"] > job["lastRun"]


def test_a_parent_waits_for_its_children_and_resumes_when_the_last_is_finished(server, client):
    parent = create(client, "family/parent")
    hand_out(client, "family/parent")
    children = [create(client, "family/child", parentJobID=parent) for _ in range(2)]
    assert finish_jobs(client, [{"jobID": parent}]) == [result(parent)]
    assert [query(client, c)["state"] for c in children] == ["QUEUED", "QUEUED"]
    assert query(client, parent)["state"] == "PAUSED"
    hand_out(client, "family/child", 2)
    with Waiter(server, "family/parent") as waiter:
        results = finish_jobs(client, [{"jobID": c} for c in children])
        assert results == [result(c) for c in children]
        assert [state(client, c) for c in children] == ["FINISHED", "FINISHED"]
        # The resumed parent goes at once to the GetJob waiting for it,
        # with what its children left.
        handed = ok(waiter.reply()).json
    assert handed["jobID"] == parent
    assert sorted(c["jobID"] for c in handed["finishedChildJobs"]) == sorted(children)


def test_capacity_freed_by_finish_jobs_wakes_a_get_job_held_back_by_a_limit(server, client):
    ok(client.request("SetLimit", name="limited/*", max=1))
    running = create(client, "limited/a")
    hand_out(client, "limited/a")
    held = create(client, "limited/b")
    with Waiter(server, "limited/b", timeout_ms=10_000) as waiter:
        started = time.monotonic()
        assert finish_jobs(client, [{"jobID": running}]) == [result(running)]
        assert ok(waiter.reply()).json["jobID"] == held
    # Woken by the freed capacity, not by the end of its wait.
    assert time.monotonic() - started < 8


# The whole request.


def test_as_many_jobs_as_one_get_jobs_hands_out_are_finished_in_one_request(client):
    ok(client.request("CreateJobs", jobs=[{"name": "bulk"}] * MAX_FINISH_JOBS))
    leases = hand_out(client, "bulk", MAX_FINISH_JOBS)
    elements = [{"jobID": j, "leaseID": lease} for j, lease in leases.items()]
    assert finish_jobs(client, elements) == [result(j) for j in leases]
    assert client.request("GetJob", name="bulk").status == "404 No job found"
    assert state(client, next(iter(leases))) is None


def test_more_jobs_than_the_limit_are_refused_and_none_is_finished(client):
    job_id = create(client, "over")
    hand_out(client, "over")
    reply = client.request("FinishJobs", jobs=[{"jobID": job_id}] * (MAX_FINISH_JOBS + 1))
    assert reply.status == f"413 Too many jobs (max {MAX_FINISH_JOBS})"
    assert query(client, job_id)["state"] == "RUNNING"


@pytest.mark.parametrize(
    "jobs",
    [None, "", "not json", "{}", '{"jobID":1}', "[]", "[1]", "[{}]", "[[]]", '[{"jobID":1},5]',
     '[{"jobID":1},{}]', '"[]"', "null"],
)
def test_jobs_that_are_not_a_non_empty_array_of_non_empty_objects_is_401(client, jobs):
    job_id = create(client, "invalid")
    hand_out(client, "invalid")
    params = {} if jobs is None else {"jobs": jobs.replace("1", str(job_id))}
    reply = client.request("FinishJobs", **params)
    assert reply.status == "401 Invalid JSON" and reply.body == b""
    assert query(client, job_id)["state"] == "RUNNING"


# Every element is FinishJob: the same parameters, as FinishJobs elements
# and as FinishJob requests to twin jobs, give the same answers and leave
# the twins alike.

_names = itertools.count()

# How an element names its job: one of the two jobs, as a number or as
# text, or something that is not a usable jobID.
job_refs = st.one_of(
    st.tuples(st.sampled_from(["job"]), st.integers(0, 1), st.sampled_from([int, str])),
    st.tuples(
        st.just("literal"),
        st.sampled_from([UNKNOWN, 0, -1, 2**63, 1.5, "007", "abc", "", True, None, [1], {}]),
        st.just(None),
    ),
    st.just(("absent", None, None)),
)
leases = st.sampled_from(["absent", "own", "wrong", "", None])
datas = st.sampled_from([
    "absent", None, {}, {"k": "v"}, {"n": [1, {"x": None}]}, [], "", '{"s":1}', "not json", "[1]",
    5, True,
])
key_cases = st.sampled_from([str, str.lower, str.upper])
elements = st.lists(st.tuples(job_refs, leases, datas, key_cases), min_size=1, max_size=4)


def _element(spec: tuple[Any, ...], ids: list[int], leases_of: dict[int, str]) -> dict[str, Any]:
    (kind, value, form), lease, data, case = spec
    element: dict[str, Any] = {}
    job_id = None
    if kind == "job":
        job_id = ids[value]
        element[case("jobID")] = form(job_id)
    elif kind == "literal":
        element[case("jobID")] = value
    if lease == "own":
        element[case("leaseID")] = leases_of.get(job_id, WRONG_LEASE) if job_id else WRONG_LEASE
    elif lease == "wrong":
        element[case("leaseID")] = WRONG_LEASE
    elif lease != "absent":
        element[case("leaseID")] = lease
    if data != "absent":
        element[case("data")] = data
    if not element:
        # An empty object refuses the whole request; FinishJob ignores nextRun.
        element["nextRun"] = "2000-01-01"
    return element


def _headers(element: dict[str, Any]) -> dict[str, str]:
    """An element as FinishJob's header lines, by the rule of protocol.md
    5.2: text as it is, numbers in decimal, true and false, null left out,
    objects and arrays as compact JSON (`data: []` as `{}`)."""
    headers = {}
    for key, value in element.items():
        if key.lower() == "data" and value == []:
            value = {}
        if value is None:
            continue
        if isinstance(value, bool):
            headers[key] = "true" if value else "false"
        elif isinstance(value, (dict, list)):
            headers[key] = json.dumps(value, separators=(",", ":"))
        else:
            headers[key] = str(value)
    return headers


def _expected_id(element: dict[str, Any]) -> int | None:
    value = next((v for k, v in element.items() if k.lower() == "jobid"), None)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    if isinstance(value, int):
        return value
    return int(value) if value.isdigit() and str(int(value)) == value else None


def _world(client: Client) -> tuple[list[int], dict[int, str]]:
    """Two jobs handed out, one of them repeating; their leases."""
    name = f"twin{next(_names)}"
    ids = [create(client, name, data={"a": 1}), create(client, name, repeat="FINISHED, +1 HOUR")]
    return ids, hand_out(client, name, 2)


def _state(client: Client, job_id: int) -> tuple[Any, ...] | None:
    job = query(client, job_id)
    return None if job is None else (job["state"], job["data"], job["repeat"])


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(specs=elements)
def test_each_element_is_finished_exactly_as_finish_job_would_finish_it(client, specs):
    _finished_both_ways(client, specs, _world)


World = Callable[[Client], tuple[list[int], dict[int, str]]]


def _finished_both_ways(client: Client, specs: list[Any], world: World) -> tuple[list[int], ...]:
    """The elements `specs` sent as one FinishJobs to one world's jobs and
    as FinishJob one by one to a twin world's: the same answers and
    states. The two worlds' jobIDs."""
    batch_ids, batch_leases = world(client)
    twin_ids, twin_leases = world(client)
    batch = [_element(spec, batch_ids, batch_leases) for spec in specs]
    results = finish_jobs(client, batch)
    assert [r["jobID"] for r in results] == [_expected_id(e) for e in batch]
    for spec, got in zip(specs, results, strict=True):
        element = _element(spec, twin_ids, twin_leases)
        reply: Reply = client.request("FinishJob", headers=_headers(element))
        assert got["status"] == reply.status, (spec, element)
    assert [_state(client, j) for j in batch_ids] == [_state(client, j) for j in twin_ids]
    return batch_ids, twin_ids


# A plain run (RUNNING, standalone and childless, with nothing to do but
# its delete) is finished in one statement with the others of its request
# where the backend can (PostgreSQL: lifecycle.finish_plain_runs); each
# other kind takes the long way. Their answers, states and outcomes are
# FinishJob's all the same, in any mix and order.

_KINDS = (
    "plain", "repeating", "parent", "depended on", "cancel asked", "retryAfterCount in data",
    "plain",
)


def _mixed_world(client: Client) -> tuple[list[int], dict[int, str]]:
    """One job of each of _KINDS, handed out, then the parent's child and
    the job that depends on the fourth; their leases."""
    name = f"mixed{next(_names)}"
    ids = [
        create(client, name, data={"a": 1}),
        create(client, name, repeat="FINISHED, +1 HOUR"),
        create(client, name),
        create(client, name),
        create(client, name),
        create(client, name, data={"retryAfterCount": 2, "b": 2}),
        create(client, name, data={"c": 3}),
    ]
    leases = hand_out(client, name, len(ids))
    ids.append(create(client, f"{name}/child", parentJobID=ids[2]))
    ids.append(create(client, f"{name}/after", dependsOn=json.dumps([ids[3]])))
    ok(client.request("CancelJob", jobID=ids[4], running="true"))
    return ids, leases


def _ended(client: Client, job_id: int) -> tuple[str, Any]:
    """What AwaitJob says at once of a job: its end's state and data, or not yet."""
    reply = client.request("AwaitJob", jobID=job_id, timeout=0)
    if not reply.status.startswith("200"):
        return reply.status, None
    return reply.status, (reply.json.get("state"), reply.json.get("data"))


# Each job of a mixed world named once, in its own way, then a few more
# elements (the same jobs again, jobs that are none), in any order.
_naming = st.tuples(
    st.sampled_from([int, int, str]),
    st.sampled_from(["absent", "own", "wrong"]),
    st.sampled_from(["absent", "absent", {"k": "v"}]),
    st.sampled_from([str, str, str.lower]),
)
_more = st.one_of(
    st.tuples(st.integers(0, len(_KINDS) - 1), _naming),
    st.tuples(st.sampled_from([UNKNOWN, 0, "abc"]), _naming),
)


@st.composite
def mixed_elements(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    specs = []
    for at, (form, lease, data, case) in enumerate(
        draw(st.lists(_naming, min_size=len(_KINDS), max_size=len(_KINDS)))
    ):
        specs.append((("job", at, form), lease, data, case))
    for ref, (form, lease, data, case) in draw(st.lists(_more, max_size=4)):
        job_ref = ("job", ref, form) if type(ref) is int and ref < 100 else ("literal", ref, None)
        specs.append((job_ref, lease, data, case))
    return draw(st.permutations(specs))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(specs=mixed_elements())
def test_plain_runs_and_every_other_kind_are_finished_as_finish_job_would(client, specs):
    batch_ids, twin_ids = _finished_both_ways(client, specs, _mixed_world)
    assert [_ended(client, j) for j in batch_ids] == [_ended(client, j) for j in twin_ids]


def test_plain_runs_finished_together_are_gone_with_their_outcomes_kept(client):
    ids = [create(client, "plainrun", data={"n": n}) for n in range(3)]
    leases = hand_out(client, "plainrun", 3)
    elements = [{"jobID": j, "leaseID": lease} for j, lease in leases.items()]
    assert finish_jobs(client, elements) == [result(j) for j in leases]
    for n, job_id in enumerate(ids):
        assert query(client, job_id) is None
        assert _ended(client, job_id) == ("200 OK", ("FINISHED", {"n": n}))
    # Finished once: a second report finds nothing.
    assert [r["status"] for r in finish_jobs(client, elements)] == [
        "404 No job with this jobID"
    ] * 3


@pytest.mark.parametrize(
    "lease",
    [
        "ab\u0000cd", "x" * 100_000, "0123456789ABCDEF", "é" * 16,
        # What an array literal of leases (storage's sql.tokens) would read
        # as more than one element, a NULL or a quote.
        "0123456789abcde,", "{NULL,01234567}", "NULL", '0123456789abcde"', "0123456789abcde\\",
    ],
)
def test_a_lease_no_hand_out_gave_is_refused_alone(client, lease):
    # Not a lease token: the element takes the long way (409), and the
    # others are finished. A NUL sent to PostgreSQL failed the whole request.
    wrong, right = create(client, "oddlease"), create(client, "oddlease")
    hand_out(client, "oddlease", 2)
    elements = [{"jobID": wrong, "leaseID": lease}, {"jobID": right}]
    assert finish_jobs(client, elements) == [result(wrong, "409 Lease expired"), result(right)]
    assert query(client, wrong) is not None and query(client, right) is None


def test_ignored_keys_are_named_by_their_elements_place_whichever_way_it_went(client):
    plain, repeating, other = (
        create(client, "ignored"), create(client, "ignored", repeat="FINISHED, +1 HOUR"),
        create(client, "ignored"),
    )
    hand_out(client, "ignored", 3)
    # The first two are finished by number alone (the first at once where
    # the backend can, the repeating one the long way), the third not.
    elements = [{"jobID": plain}, {"jobID": repeating}, {"jobID": other, "priorty": 5}]
    reply = ok(client.request("FinishJobs", jobs=elements))
    assert reply.headers.get("ignoredHeaders") == "jobs[2].priorty"
    assert [r["status"] for r in reply.json["results"]] == ["200 OK"] * 3


# The client library: finish_jobs on Client and TrioClient.


def _refusals(results: list[FinishResult]) -> list[type[Exception] | None]:
    return [None if r.ok else type(r.error()) for r in results]


def test_the_client_reports_each_job_with_its_own_typed_result(server):
    with LibraryClient("127.0.0.1", server.port, timeout=10) as jobs:
        done = jobs.create_job("lib", {"a": 1})
        again = jobs.create_job("lib", repeat="FINISHED, +1 HOUR")
        stolen = jobs.create_job("lib")
        leases = {job["jobID"]: job["leaseID"] for job in jobs.get_jobs("lib", 3)}
        idle = jobs.create_job("idle")
        results = jobs.finish_jobs([
            Finish(done, leases[done]),
            (again, leases[again], {"b": 2}),
            Finish(stolen, lease_id="0000000000000000"),
            Finish(idle),
            Finish(UNKNOWN, data={}),
            Finish(done),
        ])
        assert [r.job_id for r in results] == [done, again, stolen, idle, UNKNOWN, done]
        assert [r.status for r in results][:3] == ["200 OK", "200 OK", "409 Lease expired"]
        assert [r.ok for r in results] == [True, True, False, False, False, False]
        assert _refusals(results) == [None, None, Conflict, IllegalState, JobNotFound, JobNotFound]
        assert results[0] == FinishResult(done, "200 OK") and results[0].error() is None
        assert jobs.query_job(again)["data"] == {"b": 2}
        assert jobs.query_job(stolen)["state"] == "RUNNING"


def test_the_client_refuses_an_empty_or_over_long_list_before_sending(server):
    with LibraryClient("127.0.0.1", server.port, timeout=10) as jobs:
        job_id = jobs.create_job("unsent")
        jobs.get_job("unsent")
        for count in (0, MAX_FINISH_JOBS + 1):
            with pytest.raises(ValueError, match=f"1 to {MAX_FINISH_JOBS} jobs"):
                jobs.finish_jobs([Finish(job_id)] * count)
        assert jobs.query_job(job_id)["state"] == "RUNNING"
        assert jobs.status()["commandsServed"] == 3


async def test_the_trio_client_reports_many_jobs_at_once(server):
    async with TrioClient("127.0.0.1", server.port, timeout=10) as jobs:
        ids = await jobs.create_jobs([{"name": "async"}] * 3)
        taken = await jobs.get_jobs("async", 3)
        reports = [Finish(job["jobID"], job["leaseID"], {"n": 1}) for job in taken]
        results = await jobs.finish_jobs([*reports, Finish(ids[0])])
        assert [(r.job_id, r.status) for r in results] == [
            *((j["jobID"], "200 OK") for j in taken), (ids[0], "404 No job with this jobID")
        ]
        assert isinstance(results[-1].error(), JobNotFound)
        assert (await jobs.status())["jobs"] == {}


# A GetJob waiting on its own connection.


class Waiter:
    """A GetJob with `Connection: wait`, registered before the block runs."""

    def __init__(self, server: Any, name: str, timeout_ms: int = 20_000) -> None:
        self.server = server
        self.client = server.client()
        before = self._waiting()
        self.client.send(encode("GetJob", {"name": name, "Connection": "wait",
                                           "timeout": timeout_ms}))
        until(lambda: self._waiting() > before, 10, "the GetJob to wait")

    def _waiting(self) -> int:
        # The queue lives in the server's thread; a read may race a change.
        while True:
            try:
                return len(self.server.server.core.engine.waits)
            except RuntimeError:
                continue

    def reply(self) -> Reply:
        return self.client.read_reply()

    def __enter__(self) -> Waiter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
