"""Jobs that depend on other jobs (protocol.md 14.25): dependsOn,
BLOCKED, onDependencyFailure, the hand-out's `dependencies` and QueryJob's
`dependencyCounts`, over a real server on every backend."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pg
import pytest
from test_flow_control import Waiter

from harness import ThreadServer
from helpers import create, ok, until
from wire import Client

# The client's wait for a heavy request's reply: generous, for a shared
# machine (one took 3.3 s alone and passed 10 s under a full test run).
SLOW = 120.0

# The same protocol on every backend (conftest.BACKENDS).
pytestmark = pytest.mark.backends(nodes=True)


def query(client: Client, job_id: int) -> dict[str, Any]:
    return ok(client.request("QueryJob", jobID=job_id)).json


def state(client: Client, job_id: int) -> str:
    return str(query(client, job_id)["state"])


def take(client: Client, name: str) -> dict[str, Any] | None:
    reply = client.request("GetJob", name=name)
    if reply.status.startswith("404"):
        return None
    return ok(reply).json


def finish(client: Client, job_id: int, data: dict[str, Any] | None = None) -> None:
    params: dict[str, Any] = {"jobID": job_id}
    if data is not None:
        params["data"] = data
    ok(client.request("FinishJob", **params))


def run(client: Client, name: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """Take a job of `name` and finish it; the job as handed out."""
    job = take(client, name)
    assert job is not None, f"no {name} to run"
    finish(client, job["jobID"], data)
    return job


def create_jobs(client: Client, jobs: list[dict[str, Any]]) -> list[int]:
    return list(ok(client.request("CreateJobs", jobs=jobs)).json["jobIDs"])


def test_a_job_runs_only_after_its_dependency_finished(server, client):
    first = create(client, "first")
    then = create(client, "then", dependsOn=json.dumps([first]))
    assert state(client, then) == "BLOCKED"
    assert take(client, "then") is None
    counts = query(client, then)["dependencyCounts"]
    assert counts == {
        "total": 1, "pending": 1, "finished": 0, "failed": 0, "cancelled": 0, "deleted": 0
    }
    run(client, "first", {"result": 42})
    assert state(client, then) == "QUEUED"
    job = take(client, "then")
    assert job is not None
    assert job["dependencies"] == [{"jobID": first, "state": "FINISHED", "data": {"result": 42}}]
    assert query(client, then)["dependencyCounts"]["finished"] == 1


def test_a_diamond_in_one_request(server, client):
    top, left, right, bottom = create_jobs(client, [
        {"name": "top"},
        {"name": "left", "dependsOn": ["#0"]},
        {"name": "right", "dependsOn": ["#0"]},
        {"name": "bottom", "dependsOn": ["#1", "#2"]},
    ])
    assert [state(client, j) for j in (top, left, right, bottom)] == [
        "QUEUED", "BLOCKED", "BLOCKED", "BLOCKED"
    ]
    run(client, "top", {"n": 1})
    assert take(client, "bottom") is None
    run(client, "left", {"n": 2})
    assert state(client, bottom) == "BLOCKED"
    run(client, "right", {"n": 3})
    job = take(client, "bottom")
    assert job is not None
    assert job["dependencies"] == [
        {"jobID": left, "state": "FINISHED", "data": {"n": 2}},
        {"jobID": right, "state": "FINISHED", "data": {"n": 3}},
    ]


def test_a_forward_reference(server, client):
    then, _first = create_jobs(client, [
        {"name": "then", "dependsOn": ["#1"]},
        {"name": "first"},
    ])
    assert state(client, then) == "BLOCKED"
    run(client, "first")
    assert state(client, then) == "QUEUED"


@pytest.mark.parametrize(
    ("policy", "ends"), [("fail", "FAILED"), ("cancel", "CANCELLED"), (None, "FAILED")]
)
def test_a_failed_dependency_ends_the_dependent_and_its_own(server, client, policy, ends):
    extra = {} if policy is None else {"onDependencyFailure": policy}
    first, then, after = create_jobs(client, [
        {"name": "first"},
        {"name": "then", "dependsOn": ["#0"], **extra},
        {"name": "after", "dependsOn": ["#1"]},
    ])
    job = take(client, "first")
    assert job is not None
    ok(client.request("FailJob", jobID=first, error="boom"))
    shown = query(client, then)
    assert shown["state"] == ends
    assert shown["lastError"] == f"dependency {first} ended FAILED"
    assert shown["dependencyCounts"]["failed"] == 1
    # The cascade: `after` depended on `then`, which did not finish.
    assert state(client, after) == "FAILED"
    assert take(client, "then") is None and take(client, "after") is None


def test_run_runs_whatever_the_outcomes(server, client):
    ok_job, bad, gone = create_jobs(client, [{"name": "a"}, {"name": "b"}, {"name": "c"}])
    finally_ = create(
        client, "finally", dependsOn=json.dumps([ok_job, bad, gone]), onDependencyFailure="run"
    )
    run(client, "a", {"x": 1})
    assert take(client, "b") is not None
    ok(client.request("FailJob", jobID=bad, error="no"))
    assert state(client, finally_) == "BLOCKED"
    ok(client.request("DeleteJob", jobID=gone))
    job = take(client, "finally")
    assert job is not None
    assert [(d["jobID"], d["state"]) for d in job["dependencies"]] == [
        (ok_job, "FINISHED"), (bad, "FAILED"), (gone, "DELETED")
    ]
    counts = query(client, finally_)["dependencyCounts"]
    assert counts == {
        "total": 3, "pending": 0, "finished": 1, "failed": 1, "cancelled": 0, "deleted": 1
    }


def test_ended_dependencies_count_as_ended_at_create(server, client):
    bad = create(client, "bad")
    assert take(client, "bad") is not None
    ok(client.request("FailJob", jobID=bad, error="no"))
    assert state(client, create(client, "x", dependsOn=json.dumps([bad]))) == "FAILED"
    ran = create(client, "y", dependsOn=json.dumps([bad]), onDependencyFailure="run")
    assert state(client, ran) == "QUEUED"


def test_cancel_and_delete_of_a_blocked_job(server, client):
    first = create(client, "first")
    a = create(client, "a", dependsOn=json.dumps([first]))
    b = create(client, "b", dependsOn=json.dumps([first]))
    after = create(client, "after", dependsOn=json.dumps([a]), onDependencyFailure="cancel")
    ok(client.request("CancelJob", jobID=a))
    assert state(client, a) == "CANCELLED"
    assert state(client, after) == "CANCELLED"
    ok(client.request("DeleteJob", jobID=b))
    assert client.request("QueryJob", jobID=b).status.startswith("404")
    run(client, "first")


@pytest.mark.parametrize(
    ("jobs", "status"),
    [
        ([{"name": "a", "dependsOn": ["#0"]}], "402 Element 0 depends on itself"),
        ([{"name": "a", "dependsOn": ["#1"]}], "402 Malformed dependsOn: #1 names no element"),
        ([{"name": "a", "dependsOn": ["#1"]}, {"name": "b", "dependsOn": ["#0"]}],
         "402 Dependency cycle: elements 0, 1"),
        ([{"name": "a", "dependsOn": [999999]}], "404 Dependency 999999 does not exist"),
        ([{"name": "a", "dependsOn": "nope"}], "402 Malformed dependsOn"),
        ([{"name": "a", "dependsOn": [True]}], "402 Malformed dependsOn"),
        ([{"name": "a", "dependsOn": list(range(1, 1002))}],
         "413 Too many dependencies (max 1000)"),
        ([{"name": "a", "onDependencyFailure": "maybe"}],
         "402 Malformed onDependencyFailure"),
        # Read in any case; of two names that differ only in case, the first.
        ([{"name": "a", "DEPENDSON": ["#0"]}], "402 Element 0 depends on itself"),
        ([{"name": "a", "dependsOn": "nope", "DependsOn": [1]}], "402 Malformed dependsOn"),
        ([{"name": "a", "ONDEPENDENCYFAILURE": "maybe", "onDependencyFailure": "fail"}],
         "402 Malformed onDependencyFailure"),
    ],
)
def test_bad_references_are_refused(server, client, jobs, status):
    reply = client.request("CreateJobs", jobs=jobs)
    assert reply.status.startswith(status), reply.status
    # All or nothing: no job of the request was created.
    assert take(client, "a") is None


def test_a_request_past_its_bound_of_edges_is_refused(server, client):
    jobs = [{"name": f"x{i}", "dependsOn": list(range(1, 1001))} for i in range(21)]
    reply = client.request("CreateJobs", jobs=jobs)
    assert reply.status == "413 Too many dependencies in one request (max 20000)"


def test_createjob_takes_no_element_reference(server, client):
    reply = client.request("CreateJob", name="a", dependsOn='["#0"]')
    assert reply.status.startswith("402 Malformed dependsOn")


# Heavy, or a server of its own: SQLite and PostgreSQL, not three nodes.
@pytest.mark.backends()
def test_a_fan_out_and_fan_in_of_a_thousand(server, client):
    # A long request on a shared machine: a client that waits longer.
    with server.client(timeout=SLOW) as patient:
        _a_fan_out_and_fan_in_of_a_thousand(patient)


def _a_fan_out_and_fan_in_of_a_thousand(client: Client) -> None:
    width = 1000
    jobs = [{"name": "root"}]
    jobs += [{"name": "part", "dependsOn": ["#0"], "data": {"i": i}} for i in range(width)]
    jobs.append({"name": "join", "dependsOn": [f"#{i}" for i in range(1, width + 1)]})
    ids = create_jobs(client, jobs)
    parts, join = ids[1:-1], ids[-1]
    assert take(client, "part") is None
    run(client, "root")
    taken = ok(client.request("GetJobs", name="part", numResults=1000)).json["jobs"]
    assert sorted(job["jobID"] for job in taken) == parts
    assert take(client, "join") is None
    half = width // 2
    done = [{"jobID": job["jobID"], "data": {"out": job["data"]["i"]}} for job in taken]
    ok(client.request("FinishJobs", jobs=done[:half]))
    assert query(client, join)["dependencyCounts"] == {
        "total": width, "pending": half, "finished": half, "failed": 0, "cancelled": 0,
        "deleted": 0,
    }
    ok(client.request("FinishJobs", jobs=done[half:]))
    job = take(client, "join")
    assert job is not None and len(job["dependencies"]) == width
    assert job["dependencies"][0] == {"jobID": parts[0], "state": "FINISHED", "data": {"out": 0}}
    assert all(d["state"] == "FINISHED" for d in job["dependencies"])


def test_a_waiting_getjob_is_served_when_its_job_unblocks(server, client):
    first = create(client, "first")
    then = create(client, "then", dependsOn=json.dumps([first]))
    waiter = Waiter(server, "then", timeout_ms=10_000)
    run(client, "first")
    reply = waiter.result()
    assert reply.status == "200 OK" and reply.json["jobID"] == then


# Heavy, or a server of its own: SQLite and PostgreSQL, not three nodes.
@pytest.mark.backends()
def test_the_hand_out_leaves_out_data_past_its_budget(server, client):
    big = {"blob": "x" * 400_000}
    deps = create_jobs(client, [{"name": "big"} for _ in range(4)])
    then = create(client, "then", dependsOn=json.dumps(deps))
    for _ in deps:
        run(client, "big", big)
    job = take(client, "then")
    assert job is not None and job["jobID"] == then
    entries = job["dependencies"]
    assert [e.get("data") == big for e in entries] == [True, True, False, False]
    assert [e.get("dataOmitted", False) for e in entries] == [False, False, True, True]
    assert all(e["state"] == "FINISHED" for e in entries)


def test_a_dependency_finished_and_deleted_counts_while_its_outcome_is_kept(server, client):
    first = create(client, "first")
    create(client, "a", dependsOn=json.dumps([first]))
    run(client, "first", {"r": 1})
    # Deleted at its finish, its outcome kept for `a`: a new dependent may name it.
    late = create(client, "late", dependsOn=json.dumps([first]))
    assert state(client, late) == "QUEUED"
    job = take(client, "late")
    assert job is not None and job["dependencies"][0]["data"] == {"r": 1}


def test_unknown_dependency_of_createjob_is_refused(server, client):
    reply = client.request("CreateJob", name="x", dependsOn="[123456789]")
    assert reply.status == "404 Dependency 123456789 does not exist"
    reply = client.request("CreateJob", name="x", dependsOn="[1]", parentJobID=5)
    assert reply.status.startswith("40")


def graph_rows(db: Path | str) -> tuple[int, int]:
    """Rows of the edges' and the outcomes' tables."""
    counts = []
    for table in ("jobDependencies", "dependencyOutcomes"):
        statement = f"SELECT 1 FROM {table}"
        if isinstance(db, Path):
            with sqlite3.connect(db) as raw:
                counts.append(len(raw.execute(statement).fetchall()))
        else:
            counts.append(pg.execute(str(db), statement))
    return counts[0], counts[1]


# Heavy, or a server of its own: SQLite and PostgreSQL, not three nodes.
@pytest.mark.backends()
def test_jobs_that_go_take_their_edges_and_outcomes_with_them(backend, db):
    server = ThreadServer(db, keep_failed=1.0, prune_interval=0.05)
    try:
        with server.client() as client:
            # Finished and deleted at once, with its dependency's outcome.
            create(client, "e")
            create(client, "y", dependsOn=json.dumps([create(client, "e2")]))
            run(client, "e2", {"r": 1})
            assert graph_rows(db) == (1, 1)
            run(client, "y")
            assert graph_rows(db) == (0, 0)
            # Deleted while BLOCKED.
            blocked = create(client, "z", dependsOn=json.dumps([create(client, "e3")]))
            assert graph_rows(db) == (1, 0)
            ok(client.request("DeleteJob", jobID=blocked))
            assert graph_rows(db) == (0, 0)
            run(client, "e3")
            assert graph_rows(db) == (0, 0)
            # Failed for its dependency, then pruned with it (--keep-failed).
            dep = create(client, "d")
            failed = create(client, "x", dependsOn=json.dumps([dep]))
            assert take(client, "d") is not None
            ok(client.request("FailJob", jobID=dep, error="no"))
            assert state(client, failed) == "FAILED"
            assert graph_rows(db) == (1, 1)
            until(lambda: graph_rows(db) == (0, 0), 10.0, "the pruner to take the edges")
            assert client.request("QueryJob", jobID=failed).status.startswith("404")
    finally:
        server.stop()


def test_a_running_dependency_cancelled_ends_its_dependent(server, client):
    first = create(client, "first")
    then = create(client, "then", dependsOn=json.dumps([first]))
    assert take(client, "first") is not None
    ok(client.request("CancelJob", jobID=first, running="true"))
    assert state(client, then) == "BLOCKED"
    # The worker hears of it at its next report, and the run ends CANCELLED.
    assert client.request("FinishJob", jobID=first).status == "410 Job cancelled"
    shown = query(client, then)
    assert shown["state"] == "FAILED"
    assert shown["lastError"] == f"dependency {first} ended CANCELLED"


# Heavy, or a server of its own: SQLite and PostgreSQL, not three nodes.
@pytest.mark.backends()
def test_standalone_cancelled_jobs_are_pruned_with_keep_failed(backend, db):
    server = ThreadServer(db, keep_failed=1.0, prune_interval=0.05)
    try:
        with server.client() as client:
            first = create(client, "first")
            cancelled = create(client, "c", dependsOn=json.dumps([first]))
            by_policy = create(
                client, "p", dependsOn=json.dumps([cancelled]), onDependencyFailure="cancel"
            )
            ok(client.request("CancelJob", jobID=cancelled))
            assert state(client, by_policy) == "CANCELLED"
            assert graph_rows(db) == (2, 1)

            def gone() -> bool:
                return all(
                    client.request("QueryJob", jobID=j).status.startswith("404")
                    for j in (cancelled, by_policy)
                )

            until(gone, 10.0, "the pruner to delete the cancelled jobs")
            until(lambda: graph_rows(db) == (0, 0), 10.0, "their edges to go")
            assert state(client, first) == "QUEUED"
    finally:
        server.stop()


# Heavy, or a server of its own: SQLite and PostgreSQL, not three nodes.
@pytest.mark.backends()
def test_a_chain_of_a_thousand_fails_to_its_end(server, client):
    # A long request on a shared machine: a client that waits longer.
    with server.client(timeout=SLOW) as patient:
        _a_chain_of_a_thousand_fails_to_its_end(patient)


def _a_chain_of_a_thousand_fails_to_its_end(client: Client) -> None:
    length = 1000
    jobs = [{"name": "link0"}] + [
        {"name": f"link{i}", "dependsOn": [f"#{i - 1}"]} for i in range(1, length)
    ]
    ids = create_jobs(client, jobs)
    assert take(client, "link0") is not None
    # One end, a cascade a thousand deep: a loop, not nested calls.
    ok(client.request("FailJob", jobID=ids[0], error="no"))
    until(lambda: state(client, ids[-1]) == "FAILED", SLOW, "the chain's end")
    assert query(client, ids[-1])["lastError"] == f"dependency {ids[-2]} ended FAILED"


def test_pauses_and_limits_apply_once_it_is_queued(server, client):
    first = create(client, "first")
    then = create(client, "then", dependsOn=json.dumps([first]), jobPriority=1000)
    later = create(client, "then")
    ok(client.request("PauseJobs", name="then"))
    run(client, "first")
    assert state(client, then) == "QUEUED"
    assert take(client, "then") is None
    ok(client.request("ResumeJobs", name="then"))
    ok(client.request("SetLimit", name="then", max=1))
    # Its priority counts from now on: it goes before the older job.
    job = take(client, "then")
    assert job is not None and job["jobID"] == then
    assert take(client, "then") is None  # the limit holds `later` back
    finish(client, then)
    job = take(client, "then")
    assert job is not None and job["jobID"] == later


# SQLite alone: its statements bind at most 32,766 parameters, which the
# ends are told within. PostgreSQL binds them as three arrays, however many
# (sql_dependencies._keep_outcomes), so there it was a wide cascade of 17,000
# (25 s of a run at -n 3), which test_dependencies_cascade's twenty thousand
# dependents failing at once cover on PostgreSQL, through the same chunks.
@pytest.mark.backends(only="sqlite")
def test_a_failure_fans_out_to_more_dependents_than_a_statement_binds(server, client):
    # A long request on a shared machine: a client that waits longer.
    with server.client(timeout=SLOW) as patient:
        _a_failure_fans_out_to_more_dependents_than_a_statement_binds(patient)


def _a_failure_fans_out_to_more_dependents_than_a_statement_binds(client: Client) -> None:
    # 17,000 dependents fail at once, and their 17,000 ends are told in
    # turn: in chunks of 1,000, each within the 32,766 parameters a SQLite
    # statement binds (each end's jobID is bound twice). Told in one go,
    # the FailJob got no answer within the client's 10 s.
    width = 17_000
    root = create(client, "root")
    leaves = create_jobs(client, [{"name": "leaf", "dependsOn": [root]} for _ in range(width)])
    tails = create_jobs(client, [
        {"name": "tail", "dependsOn": leaves[i : i + 1000]} for i in range(0, width, 1000)
    ])
    assert take(client, "root") is not None
    ok(client.request("FailJob", jobID=root, error="no"))
    # A cascade this wide is told over a few transactions (cascade.py).
    until(
        lambda: [state(client, t) for t in tails] == ["FAILED"] * len(tails), SLOW, "the tails"
    )
