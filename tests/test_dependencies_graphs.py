"""Random graphs of dependencies (hypothesis), on every backend: every
job runs only after its dependencies ended (and, unless its
onDependencyFailure is `run`, finished), exactly once, and ends as a
model of protocol.md 14.25 says; and three PostgreSQL nodes ending the
dependencies of shared dependents at once queue each exactly once."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_nodes import NODES, queue_url, start_nodes, status  # noqa: F401 - fixtures

from harness import ServerProcess
from helpers import ok, until
from wire import Client

pytestmark = pytest.mark.backends(nodes=True)

POLICIES = ("fail", "cancel", "run")
# Each example's names are its own: one server serves them all.
_EXAMPLES = itertools.count()


@dataclass(frozen=True)
class Node:
    depends_on: tuple[int, ...]
    policy: str
    # What its run does, if it runs: finish, or fail for good.
    finishes: bool


@st.composite
def graphs(draw: st.DrawFn) -> list[Node]:
    """A DAG: element i depends only on elements before it (sent in a
    shuffled order, so references go forward and back)."""
    size = draw(st.integers(1, 12))
    nodes = []
    for i in range(size):
        deps = draw(st.lists(st.integers(0, i - 1), max_size=4, unique=True)) if i else []
        nodes.append(Node(tuple(deps), draw(st.sampled_from(POLICIES)), draw(st.booleans())))
    return nodes


def expected_ends(nodes: list[Node]) -> list[str]:
    """The model: each job's final state, in order (dependencies first)."""
    ends: list[str] = []
    for node in nodes:
        failed = [d for d in node.depends_on if ends[d] != "FINISHED"]
        if failed and node.policy == "fail":
            ends.append("FAILED")
        elif failed and node.policy == "cancel":
            ends.append("CANCELLED")
        else:
            ends.append("FINISHED" if node.finishes else "FAILED")
    return ends


def final_state(client: Client, job_id: int) -> str:
    reply = client.request("QueryJob", jobID=job_id)
    # A finished job without --keep-finished is deleted at its finish.
    return "FINISHED" if reply.status.startswith("404") else str(ok(reply).json["state"])


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(nodes=graphs(), order=st.randoms(use_true_random=False))
def test_random_graphs_run_in_order_exactly_once(server, client, nodes, order):
    example = next(_EXAMPLES)
    name = f"g{example}"
    # Element positions, shuffled: where node i is sent.
    positions = list(range(len(nodes)))
    order.shuffle(positions)
    elements: list[dict[str, Any]] = [{} for _ in nodes]
    for i, node in enumerate(nodes):
        element: dict[str, Any] = {"name": name, "data": {"node": i}}
        if node.depends_on:
            element["dependsOn"] = [f"#{positions[d]}" for d in node.depends_on]
            element["onDependencyFailure"] = node.policy
        elements[positions[i]] = element
    ids = ok(client.request("CreateJobs", jobs=elements)).json["jobIDs"]
    job_ids = [ids[positions[i]] for i in range(len(nodes))]

    with server.client() as reporter:
        ran, ended = _run_graph(client, reporter, name, nodes, job_ids)
    expected = expected_ends(nodes)
    assert [final_state(client, job_id) for job_id in job_ids] == expected
    assert ended == dict(enumerate(expected))
    runs = [
        i for i, node in enumerate(nodes)
        if not node.depends_on or node.policy == "run"
        or all(expected[d] == "FINISHED" for d in node.depends_on)
    ]
    assert dict(ran) == {i: 1 for i in runs}


def _run_graph(
    client: Client, reporter: Client, name: str, nodes: list[Node], job_ids: list[int]
) -> tuple[Counter[int], dict[int, str]]:
    """Take the graph's jobs as they become due and end each as its node
    says, through `reporter` (on three nodes, the next node); checks each
    hand-out against what has ended. The runs of each job, and the ends."""
    node_of = {job_id: i for i, job_id in enumerate(job_ids)}
    ran: Counter[int] = Counter()
    ended: dict[int, str] = {}
    while True:
        reply = client.request("GetJobs", name=name, numResults=5)
        if reply.status.startswith("404"):
            break
        for job in ok(reply).json["jobs"]:
            i = node_of[job["jobID"]]
            ran[i] += 1
            node = nodes[i]
            shown = {d["jobID"]: d["state"] for d in job.get("dependencies", [])}
            assert shown == {job_ids[d]: expected_ends(nodes)[d] for d in node.depends_on}
            for d in node.depends_on:
                assert d in ended, f"job {i} ran before its dependency {d} ended"
                if node.policy != "run":
                    assert ended[d] == "FINISHED"
            if node.finishes:
                ok(reporter.request("FinishJob", jobID=job["jobID"]))
                ended[i] = "FINISHED"
            else:
                ok(reporter.request("FailJob", jobID=job["jobID"], error="no"))
                ended[i] = "FAILED"
        # Jobs a failure ended at once count as ended from here on.
        for i, job_id in enumerate(job_ids):
            if i not in ended and final_state(client, job_id) in ("FAILED", "CANCELLED"):
                ended[i] = final_state(client, job_id)
    return ran, ended


# Three nodes (PostgreSQL alone: SQLite has one server per file).


@pytest.fixture
def three(
    start_nodes: Callable[..., list[ServerProcess]],  # noqa: F811 - the fixture
    queue_url: str,  # noqa: F811 - the fixture
) -> list[ServerProcess]:
    return start_nodes(*[queue_url] * NODES)


@pytest.mark.backends(only="postgres")
def test_three_nodes_ending_shared_dependencies_queue_each_dependent_once(
    three: list[ServerProcess],
) -> None:
    nodes = three
    deps_count, dependents_count = 30, 40
    with nodes[0].client() as client:
        deps = ok(client.request(
            "CreateJobs", jobs=[{"name": "dep"} for _ in range(deps_count)]
        )).json["jobIDs"]
        # Every dependent waits for every dependency: each end locks all
        # the dependents, from three nodes at once.
        dependents = ok(client.request("CreateJobs", jobs=[
            {"name": "after", "dependsOn": deps} for _ in range(dependents_count)
        ])).json["jobIDs"]
    errors: list[str] = []

    def drain(node: ServerProcess) -> None:
        with node.client() as client:
            while True:
                reply = client.request("GetJobs", name="dep", numResults=2)
                if reply.status.startswith("404"):
                    return
                if reply.status != "200 OK":
                    errors.append(reply.status)
                    return
                for job in reply.json["jobs"]:
                    done = client.request("FinishJob", jobID=job["jobID"], data=json.dumps(
                        {"by": node.port}
                    ))
                    if done.status != "200 OK":
                        errors.append(done.status)

    run_all(drain, nodes)
    assert errors == []
    taken: Counter[int] = Counter()

    def take(node: ServerProcess) -> None:
        with node.client() as client:
            while True:
                reply = client.request("GetJobs", name="after", numResults=3)
                if reply.status != "200 OK":
                    return
                for job in reply.json["jobs"]:
                    taken[job["jobID"]] += 1
                    assert len(job["dependencies"]) == deps_count

    run_all(take, nodes)
    assert dict(taken) == {job_id: 1 for job_id in dependents}


def run_all(work: Callable[[ServerProcess], None], nodes: list[ServerProcess]) -> None:
    threads = [threading.Thread(target=work, args=(node,)) for node in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


@pytest.mark.backends(only="postgres")
def test_a_getjob_waiting_on_one_node_gets_a_job_another_node_unblocked(
    three: list[ServerProcess],
) -> None:
    with three[0].client() as client:
        first = ok(client.request("CreateJob", name="first")).json["jobID"]
        then = ok(client.request("CreateJob", name="then", dependsOn=json.dumps([first])))
    got: list[Any] = []

    def wait() -> None:
        with three[1].client(timeout=20) as waiting:
            got.append(waiting.request("GetJob", name="then", Connection="wait", timeout=15_000))

    waiter = threading.Thread(target=wait)
    waiter.start()
    until(lambda: status(three[1])["waitingGetJobs"] == 1, 10.0, "the GetJob to wait")
    with three[2].client() as client:
        ok(client.request("GetJob", name="first"))
        began = time.monotonic()
        ok(client.request("FinishJob", jobID=first))
    waiter.join(20)
    assert got and got[0].status == "200 OK", got
    assert got[0].json["jobID"] == then.json["jobID"]
    # Served within its wait, promptly: the other node's notice, or at the
    # latest the recheck that comes every second.
    assert time.monotonic() - began < 5.0
