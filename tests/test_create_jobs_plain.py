"""CreateJobs' plain elements (core/commands/create.py, `_plain`): an
element of a name, a data object and a priority alone is made without a
request of its own, and must be stored and answered exactly as the long
way stores and answers it. The twin of each element is the same with
`unique: false` beside it, which changes nothing it asks for but sends it
the long way. A real server on a loopback port, on every backend."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import ok
from jobserver.wire.limits import MAX_NAME, PRIORITIES
from wire import Client, encode

pytestmark = pytest.mark.backends

# Absent from the element, as opposed to null.
ABSENT = object()

names = st.one_of(
    st.text(min_size=1, max_size=12),
    st.sampled_from(["", "a\x01b", "x" * MAX_NAME, "x" * (MAX_NAME + 1), "é" * 128,
                     "\ud800", "a\udfffb", "email/send"]),
    st.integers(-5, 5), st.booleans(), st.none(), st.just(ABSENT),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.sampled_from(["\ud800", "a b", "\n"]),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4) | st.just("\udc00"), inner, max_size=3),
    max_leaves=8,
)
datas = st.one_of(
    st.dictionaries(st.text(max_size=6), json_values, max_size=4),
    # The sizes at the bound are EDGES': a request of several is too large.
    st.sampled_from([{}, [], [1], "{}", '{"a": 1}', 7, True]),
    st.none(), st.just(ABSENT),
)
priorities = st.one_of(
    st.sampled_from(PRIORITIES), st.sampled_from([1, -1, 501, 2**70]),
    st.sampled_from(["500", "0", "x", 500.0, True, False]), st.none(), st.just(ABSENT),
)
# Keys that make an element not plain, each with a value that changes
# nothing or is refused.
others = st.sampled_from([
    *[{}] * 12, {"Name": "upper"}, {"jobPriority": 250}, {"repeat": "SCHEDULED, +1 HOUR"},
    {"retryAfter": "+1 MINUTE"}, {"priorty": 500}, {"cost": 2}, {"unique": True},
])


@st.composite
def elements(draw: st.DrawFn) -> dict[str, Any]:
    element: dict[str, Any] = {}
    for key, values in (("name", names), ("data", datas), ("priority", priorities)):
        value = draw(values)
        if value is not ABSENT:
            element[key] = value
    element.update(draw(others))
    return dict(draw(st.permutations(list(element.items()))))


def create_jobs(client: Client, jobs: list[dict[str, Any]]) -> tuple[str, str, list[Any]]:
    """The reply's status line and ignoredHeaders, and each job it made."""
    reply = client.request("CreateJobs", jobs=jobs)
    if reply.status != "200 OK":
        return reply.status, "", []
    stored = []
    for job_id in reply.json["jobIDs"]:
        job = ok(client.request("QueryJob", jobID=job_id)).json
        stored.append({k: v for k, v in job.items() if k not in ("jobID", "created", "nextRun")})
    return reply.status, reply.headers.get("ignoredHeaders", ""), stored


@settings(
    max_examples=120, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)
@given(jobs=st.lists(elements(), min_size=1, max_size=4))
def test_a_plain_element_is_made_as_the_long_way_makes_it(client, jobs):
    # The long way for each: the same keys and unique false. An element
    # unique already keeps its own; an empty one ({}, refused as such) stays.
    twins = [{**job, "unique": job.get("unique", False)} if job else job for job in jobs]
    assert create_jobs(client, jobs) == create_jobs(client, twins)


# Each value a plain element may hold that the long way refuses, or reads
# otherwise than as it is, beside one that it takes.
EDGES = [
    {"name": "a\x01b"}, {"name": "\ud800"}, {"name": ""}, {"name": "x" * (MAX_NAME + 1)},
    {"name": "é" * 128}, {"name": "é" * 127}, {"name": 7}, {"name": True}, {"name": None},
    {"name": "p", "priority": 1}, {"name": "p", "priority": -1}, {"name": "p", "priority": True},
    {"name": "p", "priority": 500.0}, {"name": "p", "priority": "500"},
    {"name": "p", "priority": 0},
    {"name": "p", "priority": None}, {"name": "p", "data": []}, {"name": "p", "data": [1]},
    {"name": "p", "data": '{"a": 1}'}, {"name": "p", "data": None}, {"name": "p", "data": 3},
    {"name": "p", "data": {"a b": "c d", "\udc00": ["\ud800"]}},
    {"name": "p", "data": {"big": "x" * 1_048_560}},
    {"name": "p", "data": {"big": "x" * 1_048_600}},
]


@pytest.mark.parametrize("job", EDGES, ids=range(len(EDGES)))
def test_each_edge_of_a_plain_element_is_answered_as_the_long_way(client, job):
    first = {"name": "before"}
    twin = {**job, "unique": False}
    assert create_jobs(client, [first, job]) == create_jobs(client, [first, twin])


def test_plain_and_other_elements_keep_their_order_and_ids(client):
    jobs = [
        {"name": "p1", "data": {"i": 1}},
        {"name": "long", "repeat": "SCHEDULED, +1 HOUR"},
        {"name": "p2", "priority": 1000},
        {"name": "p3"},
        {"name": "long2", "priorty": 5},
    ]
    reply = ok(client.request("CreateJobs", jobs=jobs))
    ids = reply.json["jobIDs"]
    assert ids == sorted(ids) and len(set(ids)) == 5
    names = [ok(client.request("QueryJob", jobID=i)).json["name"] for i in ids]
    assert names == ["p1", "long", "p2", "p3", "long2"]
    assert reply.headers["ignoredHeaders"] == "jobs[4].priorty"


def test_a_waiting_get_job_is_handed_a_plain_element(server, client):
    with server.client() as worker:
        worker.send(encode("GetJob", {"name": "woken", "Connection": "wait", "timeout": 30000}))
        ok(client.request("CreateJobs", jobs=[{"name": "woken", "data": {"w": 1}}]))
        got = ok(worker.read_reply()).json
        assert (got["name"], got["data"]) == ("woken", {"w": 1})


def test_a_long_request_of_plain_and_other_elements_is_made_as_the_long_way(client):
    # Runs long enough for PostgreSQL to be sent their rows while the next
    # are made (postgres_statements.STREAM_AFTER), broken by elements that
    # read the database (unique) or are stored otherwise (a repeat).
    jobs: list[dict[str, Any]] = []
    for run in range(3):
        jobs += [{"name": f"r{run}-{i}", "data": {"i": i}, "priority": PRIORITIES[i % 3]}
                 for i in range(150)]
        jobs.append({"name": f"r{run}-unique", "unique": True})
        jobs.append({"name": f"r{run}-repeat", "repeat": "SCHEDULED, +1 HOUR"})
    twins = [{**job, "unique": job.get("unique", False)} for job in jobs]
    made = create_jobs(client, jobs)
    assert made[0] == "200 OK" and len(made[2]) == len(jobs)
    assert made == create_jobs(client, twins)


@pytest.mark.parametrize("refused", [{"name": "bad", "priority": 7},
                                     {"name": "bad", "unique": True, "priority": 7}])
def test_every_elements_parameters_are_checked_before_any_job_is_created(client, refused):
    # The first element would be refused only as it is created (its parent
    # is not there); the second for what it says, which is checked first,
    # plain or not (protocol.md 5.2).
    jobs = [{"name": "orphan", "parentJobID": 999_999}, refused]
    assert client.request("CreateJobs", jobs=jobs).status == "402 Invalid priority value"
    jobs[1] = {"name": "fine"}
    assert client.request("CreateJobs", jobs=jobs).status == "404 parentJobID does not exist"


def test_a_cost_above_a_limit_is_checked_with_the_parameters(client):
    ok(client.request("SetLimit", name="capped", max=2))
    jobs = [{"name": "orphan", "parentJobID": 999_999}, {"name": "capped", "cost": 3}]
    reply = client.request("CreateJobs", jobs=jobs)
    assert reply.status == "402 Cost 3 exceeds limit capped (max 2)"
