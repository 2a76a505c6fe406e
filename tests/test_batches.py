"""Batches with a completion job (protocol.md 14.25): N jobs and one that
depends on all of them with onDependencyFailure "run", made by the client
library's create_batch (blocking, and async on asyncio and trio) and by
`jobserver create --from FILE --then NAME`, followed with batch_progress
and `jobserver top --batch`, against a real server on SQLite and
PostgreSQL. The dashboard's side is in test_dashboard_batches.py."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import pg_pool
import pytest
from test_cli import Cli, CliHere
from test_worker_python import in_process

from harness import Nodes, ThreadServer
from helpers import until
from jobserver.client import (
    MAX_BATCH,
    AsyncClient,
    Batch,
    BatchProgress,
    Client,
    InvalidRequest,
    JobNotFound,
    JobServerError,
)
from jobserver.worker import Job, Worker
from relay import Relay

pytestmark = pytest.mark.backends

TIMEOUT = 10.0


@pytest.fixture
def jobs(server: ThreadServer) -> Iterator[Client]:
    with Client(port=server.port, timeout=TIMEOUT) as client:
        yield client


def progress(jobs: Client, then_id: int) -> tuple[str, dict[str, int]]:
    """The completion job's state, and its batch's counts."""
    found = jobs.batch_progress(then_id)
    counts = {
        name: getattr(found, name)
        for name in ("total", "pending", "finished", "failed", "cancelled", "deleted")
    }
    return found.state, counts


def counts(total: int, pending: int, finished: int = 0, failed: int = 0,
           cancelled: int = 0, deleted: int = 0) -> dict[str, int]:
    return {"total": total, "pending": pending, "finished": finished, "failed": failed,
            "cancelled": cancelled, "deleted": deleted}


def gone(jobs: Client, job_id: int) -> bool:
    try:
        jobs.query_job(job_id)
    except JobNotFound:
        return True
    return False


def handed(dependencies: Iterable[dict[str, Any]]) -> dict[int, tuple[str, Any]]:
    """A completion job's `dependencies`, by jobID: (final state, data)."""
    return {entry["jobID"]: (entry["state"], entry.get("data")) for entry in dependencies}


# What is refused before anything is sent.


@pytest.mark.parametrize("count", [0, MAX_BATCH + 1])
def test_a_batch_of_no_jobs_or_more_than_a_job_may_depend_on_is_refused_before_sending(count):
    # No server at all: nothing may be sent.
    client = Client(port=1)
    with pytest.raises(ValueError, match=f"create_batch takes 1 to {MAX_BATCH} jobs, not {count}"):
        client.create_batch([{"name": "part"}] * count, then="done")


@pytest.mark.parametrize("then, problem", [
    ({"data": {}}, "then needs a name"),
    ({"name": "done", "DependsOn": [1]}, "then's dependsOn is the batch's jobs"),
])
def test_a_completion_job_without_a_name_or_with_its_own_dependencies_is_refused(then, problem):
    with pytest.raises(ValueError, match=problem):
        Client(port=1).create_batch([{"name": "part"}], then=then)


# Through the blocking client.


def test_a_batch_whose_jobs_all_finish_runs_its_completion_job_with_every_result(jobs):
    batch = jobs.create_batch(
        [{"name": "batch/part", "data": {"i": i}} for i in range(5)],
        then={"name": "batch/done", "data": {"report": "daily"}, "jobPriority": 1000},
    )
    assert isinstance(batch, Batch) and len(batch.job_ids) == 5
    assert batch.then_id not in batch.job_ids
    assert progress(jobs, batch.then_id) == ("BLOCKED", counts(5, 5))
    # The completion job is never handed out while its batch runs, however
    # high its priority.
    taken = jobs.get_jobs("batch/*", 10)
    assert sorted(job["jobID"] for job in taken) == sorted(batch.job_ids)
    for job in taken[:4]:
        jobs.finish_job(job["jobID"], {"result": job["data"]["i"] ** 2}, job["leaseID"])
    assert progress(jobs, batch.then_id) == ("BLOCKED", counts(5, 1, finished=4))
    assert jobs.get_job("batch/done") is None
    last = taken[4]
    jobs.finish_job(last["jobID"], {"result": last["data"]["i"] ** 2}, last["leaseID"])
    found = jobs.batch_progress(batch.then_id)
    assert (found.state, found.ended, found.unfinished) == ("QUEUED", 5, 0)
    done = jobs.get_job("batch/done")
    assert done is not None and done["jobID"] == batch.then_id
    assert done["data"] == {"report": "daily"}
    assert handed(done["dependencies"]) == {
        job_id: ("FINISHED", {"result": i * i}) for i, job_id in enumerate(batch.job_ids)
    }
    jobs.finish_job(batch.then_id, lease_id=done["leaseID"])
    # Gone with its batch (the server keeps no finished job by default).
    with pytest.raises(JobNotFound):
        jobs.batch_progress(batch.then_id)


def test_a_completion_job_runs_after_jobs_that_failed_were_cancelled_or_deleted(jobs):
    batch = jobs.create_batch(
        [
            {"name": "mixed/finish"},
            {"name": "mixed/fail"},
            # Cancelled when the job it depends on fails (a job of the
            # batch may depend on another, by its place in the batch).
            {"name": "mixed/after-fail", "dependsOn": ["#1"], "onDependencyFailure": "cancel"},
            {"name": "mixed/delete", "data": {"never": "run"}},
        ],
        then="mixed/summary",
    )
    finish, fail, cancelled, deleted = batch.job_ids
    job = jobs.get_job("mixed/finish")
    assert job is not None
    jobs.finish_job(finish, {"ok": True}, job["leaseID"])
    job = jobs.get_job("mixed/fail")
    assert job is not None
    jobs.fail_job(fail, {"partial": 1}, job["leaseID"], error="disk full")
    assert progress(jobs, batch.then_id) == (
        "BLOCKED", counts(4, 1, finished=1, failed=1, cancelled=1)
    )
    assert jobs.query_job(cancelled)["state"] == "CANCELLED"
    jobs.delete_job(deleted)
    assert progress(jobs, batch.then_id) == (
        "QUEUED", counts(4, 0, finished=1, failed=1, cancelled=1, deleted=1)
    )
    summary = jobs.get_job("mixed/summary")
    assert summary is not None and summary["jobID"] == batch.then_id
    shown = handed(summary["dependencies"])
    assert shown[finish] == ("FINISHED", {"ok": True})
    assert shown[fail] == ("FAILED", {"partial": 1})
    assert shown[cancelled][0] == "CANCELLED"
    assert set(shown) == set(batch.job_ids)
    assert shown[deleted] == ("DELETED", {"never": "run"})


def test_a_running_job_of_a_batch_that_is_cancelled_counts_as_cancelled(jobs):
    batch = jobs.create_batch([{"name": "stop/part"}, {"name": "stop/part"}], then="stop/done")
    first, second = jobs.get_jobs("stop/part", 2)
    jobs.finish_job(first["jobID"], {"r": 1}, first["leaseID"])
    # Cancelled while it runs (protocol.md 14.25): it ends at its worker's
    # next report, which is refused.
    jobs.request("CancelJob", {"jobID": second["jobID"], "running": "true"})
    assert progress(jobs, batch.then_id) == ("BLOCKED", counts(2, 1, finished=1))
    with pytest.raises(JobServerError) as refused:
        jobs.finish_job(second["jobID"], {"r": 2}, second["leaseID"])
    assert refused.value.code == 410
    assert progress(jobs, batch.then_id) == ("QUEUED", counts(2, 0, finished=1, cancelled=1))
    done = jobs.get_job("stop/done")
    assert done is not None
    assert {(d["jobID"], d["state"]) for d in done["dependencies"]} == {
        (first["jobID"], "FINISHED"), (second["jobID"], "CANCELLED")
    }


def test_a_completion_job_may_ask_to_run_only_if_every_job_finished(jobs):
    batch = jobs.create_batch(
        [{"name": "strict/part"}, {"name": "strict/part"}],
        then={"name": "strict/done", "onDependencyFailure": "fail"},
    )
    first, second = jobs.get_jobs("strict/part", 2)
    jobs.finish_job(first["jobID"], lease_id=first["leaseID"])
    jobs.fail_job(second["jobID"], lease_id=second["leaseID"], error="no")
    assert jobs.query_job(batch.then_id)["state"] == "FAILED"
    assert jobs.get_job("strict/done") is None


def test_a_batch_is_created_all_or_none(jobs):
    with pytest.raises(InvalidRequest):
        jobs.create_batch(
            [{"name": "whole/part"}, {"name": "whole/part", "repeat": "SOMETIMES"}],
            then="whole/done",
        )
    assert jobs.queues()["queues"] == []


def test_a_batch_longer_than_a_request_line_is_refused_whole(jobs):
    big = {"name": "long/part", "data": {"blob": "x" * 900_000}}
    with pytest.raises(JobServerError, match="414 Line too long"):
        jobs.create_batch([big] * 3, then="long/done")
    assert jobs.queues()["queues"] == []


def test_a_batch_sent_again_under_its_key_is_created_once(jobs):
    parts = [{"name": "again/part", "data": {"i": i}} for i in range(3)]
    first = jobs.create_batch(parts, then="again/done", idempotency_key="nightly-1")
    assert jobs.create_batch(parts, then="again/done", idempotency_key="nightly-1") == first
    assert jobs.queues()["queues"][0]["total"] == 4


def test_a_batch_of_a_thousand_jobs(server):
    # 3 s in all on PostgreSQL when quiet; a loaded CI machine took over 10
    # for one of its requests.
    jobs = Client(port=server.port, timeout=60)
    batch = jobs.create_batch([{"name": "big/part"}] * MAX_BATCH, then="big/done")
    assert progress(jobs, batch.then_id) == ("BLOCKED", counts(MAX_BATCH, MAX_BATCH))
    taken = jobs.get_jobs("big/*", MAX_BATCH)
    assert len(taken) == MAX_BATCH
    jobs.finish_jobs([(job["jobID"], job["leaseID"], None) for job in taken])
    assert progress(jobs, batch.then_id) == ("QUEUED", counts(MAX_BATCH, 0, finished=MAX_BATCH))
    done = jobs.get_job("big/done")
    assert done is not None and len(done["dependencies"]) == MAX_BATCH
    jobs.close()


def test_a_job_that_depends_on_nothing_counts_nothing(jobs):
    job_id = jobs.create_job("plain/job")
    assert jobs.batch_progress(job_id) == BatchProgress(job_id, "QUEUED", 0, 0, 0, 0, 0, 0)


def test_across_three_nodes_the_last_end_wakes_a_getjob_waiting_on_another():
    with pg_pool.pooled_schema() as url:
        nodes = Nodes(url, 3)
        try:
            maker, doer, waiter = (
                Client(port=node.port, timeout=TIMEOUT) for node in nodes.nodes
            )
            batch = maker.create_batch([{"name": "far/part"}] * 3, then="far/done")
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(waiter.get_job, "far/done", wait=TIMEOUT)
                with Client(port=nodes.nodes[2].port, timeout=TIMEOUT) as watcher:
                    until(lambda: watcher.status()["waitingGetJobs"] == 1, TIMEOUT,
                          "the GetJob to wait on the third node")
                for job in doer.get_jobs("far/part", 3):
                    doer.finish_job(job["jobID"], {"node": 1}, job["leaseID"])
                done = waiting.result(timeout=TIMEOUT)
            assert done is not None and done["jobID"] == batch.then_id
            assert handed(done["dependencies"]) == {
                job_id: ("FINISHED", {"node": 1}) for job_id in batch.job_ids
            }
            for client in (maker, doer, waiter):
                client.close()
        finally:
            nodes.stop()


# Through the async client, on asyncio and on trio.


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_the_async_client_makes_and_follows_a_batch(server, loop):
    async def scenario() -> None:
        async with AsyncClient(port=server.port, timeout=TIMEOUT) as jobs:
            batch = await jobs.create_batch(
                [{"name": "async/part", "data": {"i": i}} for i in range(3)],
                then={"name": "async/done"},
            )
            taken = await jobs.get_jobs("async/part", 3)
            await jobs.finish_job(taken[0]["jobID"], {"r": 0}, taken[0]["leaseID"])
            await jobs.fail_job(taken[1]["jobID"], None, taken[1]["leaseID"], error="bad")
            found = await jobs.batch_progress(batch.then_id)
            assert (found.state, found.ended, found.finished, found.failed) == (
                "BLOCKED", 2, 1, 1
            )
            await jobs.finish_job(taken[2]["jobID"], {"r": 2}, taken[2]["leaseID"])
            done = await jobs.get_job("async/done")
            assert done is not None and done["jobID"] == batch.then_id
            states = {entry["jobID"]: entry["state"] for entry in done["dependencies"]}
            assert sorted(states.values()) == ["FAILED", "FINISHED", "FINISHED"]

    anyio.run(scenario, backend=loop)


# Run by a real Python worker.


def test_a_python_workers_completion_handler_sees_what_came_of_each_job(server):
    worker = Worker(jobs="work/*")
    handed_out: list[dict[str, Any]] = []

    @worker.handler("work/part")
    def square(data: dict[str, Any]) -> dict[str, Any]:
        if data["i"] == 2:
            raise ValueError("two is right out")
        return {"square": data["i"] ** 2}

    @worker.handler("work/report")
    def report(data: dict[str, Any], job: Job) -> None:
        handed_out.extend(job.raw["dependencies"])

    with Client(port=server.port, timeout=TIMEOUT) as jobs:
        batch = jobs.create_batch(
            [{"name": "work/part", "data": {"i": i}} for i in range(4)], then="work/report"
        )
        with in_process(worker, server.port, "trio"):
            until(lambda: len(handed_out) == 4, TIMEOUT, "the completion handler")
            # It finished, and is gone (the failed job stays, FAILED).
            until(lambda: gone(jobs, batch.then_id), TIMEOUT, "the report to finish")
    assert handed(handed_out) == {
        job_id: ("FAILED" if i == 2 else "FINISHED", {"i": 2} if i == 2 else {"square": i * i})
        for i, job_id in enumerate(batch.job_ids)
    }


# Through the command line.


@pytest.fixture
def cli_here(server, capsys) -> CliHere:
    return CliHere(f"127.0.0.1:{server.port}", capsys)


def test_create_from_then_makes_a_batch_and_top_follows_it(cli_here, jobs, tmp_path: Path):
    lines = tmp_path / "parts.jsonl"
    lines.write_text("".join(
        json.dumps({"name": "cli/part", "data": {"i": i}}) + "\n" for i in range(3)
    ))
    made = cli_here.ok(
        "create", "--from", str(lines), "--then", "cli/summary",
        "--data", '{"to": "ann"}', "--priority", "1000",
    )
    assert set(made) == {"jobIDs", "thenJobID"} and len(made["jobIDs"]) == 3
    then_id = made["thenJobID"]
    shown = cli_here.ok("query", str(then_id))
    assert (shown["name"], shown["data"], shown["priority"], shown["state"]) == (
        "cli/summary", {"to": "ann"}, 1000, "BLOCKED"
    )
    assert shown["dependencyCounts"] == counts(3, 3)
    taken = jobs.get_jobs("cli/part", 3)
    jobs.finish_job(taken[0]["jobID"], None, taken[0]["leaseID"])
    jobs.fail_job(taken[1]["jobID"], None, taken[1]["leaseID"], error="oops")
    done = cli_here("top", "--once", "--batch", str(then_id), "--batch", "999999")
    assert (done.returncode, done.stderr) == (0, ""), done
    frame = done.stdout.splitlines()
    assert "BLOCKED 1" in frame[1]
    start = frame.index("batches: 2 watched")
    assert frame[start + 1].split() == [
        "BATCH", "THEN", "STATE", "ENDED", "FINISHED", "FAILED", "CANCELLED", "DELETED"
    ]
    assert frame[start + 2].split() == [str(then_id), "cli/summary", "BLOCKED", "2/3", "1", "1",
                                        "0", "0"]
    assert frame[start + 3].split() == ["999999", "-", "gone", "-", "-", "-", "-", "-"]
    jobs.finish_job(taken[2]["jobID"], None, taken[2]["leaseID"])
    row = cli_here("top", "--once", "--batch", str(then_id)).stdout.splitlines()[-1]
    assert row.split()[2:4] == ["QUEUED", "3/3"]


@pytest.fixture
def relay(server) -> Iterator[Relay]:
    """A relay in front of the server, that a test can cut."""
    cutter = Relay(("127.0.0.1", server.port))
    yield cutter
    cutter.close()


def test_a_batch_whose_reply_is_lost_is_created_once(relay, jobs, tmp_path):
    # The library sends it again, under its key, on a new connection.
    with Client("127.0.0.1", relay.port, timeout=TIMEOUT) as far:
        relay.cut_at(b"CreateJobs", reaches=True)
        batch = far.create_batch([{"name": "lost/part"}] * 2, then="lost/done")
        assert relay.was_cut.is_set()
    assert jobs.queues()["queues"][0]["total"] == 3
    assert jobs.batch_progress(batch.then_id).total == 2
    # The server out of reach once it has the request: the command says
    # how to run it again without creating the batch twice.
    lines = tmp_path / "parts.jsonl"
    lines.write_text('{"name": "cut/part"}\n' * 2)
    cli = Cli(f"127.0.0.1:{relay.port}")
    relay.cut_at(b"CreateJobs", reaches=True, stay_cut=True)
    result = cli("create", "--from", str(lines), "--then", "cut/done")
    assert result.returncode == 5, result
    assert "the batch may or may not have been created" in result.stderr, result.stderr
    key = result.stderr.rsplit("--idempotency-key ", 1)[1].split()[0]
    relay.restore()
    made = cli.ok("create", "--from", str(lines), "--then", "cut/done", "--idempotency-key", key)
    cut = [queue for queue in jobs.queues()["queues"] if queue["queue"] == "cut"]
    assert cut[0]["total"] == 3
    assert jobs.query_job(made["thenJobID"])["dependencyCounts"] == counts(2, 2)


def test_create_from_then_reads_standard_input_too(cli_here, jobs, monkeypatch):
    import io
    import sys

    text = '{"name": "stdin/part"}\n\n{"name": "stdin/part"}\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    made = cli_here.ok("create", "--from", "-", "--then", "stdin/done")
    assert len(made["jobIDs"]) == 2
    assert jobs.query_job(made["thenJobID"])["dependencyCounts"] == counts(2, 2)


def test_create_from_then_run_again_under_its_key_creates_the_batch_once(
    cli_here, jobs, tmp_path
):
    lines = tmp_path / "parts.jsonl"
    lines.write_text('{"name": "once/part"}\n' * 3)
    key = "k" * 255  # the whole of a key: the batch is one request, not KEY/N
    args = ("create", "--from", str(lines), "--then", "once/done", "--idempotency-key", key)
    first = cli_here.ok(*args)
    assert cli_here.ok(*args) == first
    assert jobs.queues()["queues"][0]["total"] == 4


@pytest.mark.parametrize("args, problem", [
    (["--then", "x"], "--then needs --from FILE"),
    (["NAME", "--from", "-", "--then", "x"], "NAME cannot go with it"),
    (["--from", "-", "--then", "x", "--unique"], "--unique cannot go with --then"),
    (["--from", "-", "--then", "x", "--parent", "1"], "--parent cannot go with --then"),
    (["--from", "-", "--then", "x", "--retry-delay", "1"], "--retry-delay needs --max-attempts"),
])
def test_create_then_refuses_what_cannot_make_a_batch(cli_here, args, problem):
    done = cli_here("create", *args)
    assert done.returncode == 2 and problem in done.stderr, done
    assert done.stdout == ""


@pytest.mark.parametrize("count", [0, MAX_BATCH + 1])
def test_create_then_refuses_a_file_of_no_jobs_or_more_than_a_batch_holds(
    cli_here, jobs, tmp_path, count
):
    lines = tmp_path / "parts.jsonl"
    lines.write_text('{"name": "p"}\n' * count)
    done = cli_here("create", "--from", str(lines), "--then", "done")
    assert done.returncode == 2, done
    assert f"--then makes one batch of 1 to {MAX_BATCH} jobs" in done.stderr
    assert f"--from has {count}" in done.stderr
    assert jobs.queues()["queues"] == []


def test_create_then_refuses_a_batch_too_large_for_one_request(cli_here, jobs, tmp_path):
    # Each line fits a request, the batch does not: 3 lines of 900 KiB.
    big = "x" * (900 * 1024)
    lines = tmp_path / "parts.jsonl"
    lines.write_text(json.dumps({"name": "p", "data": {"blob": big}}) + "\n" * 1)
    lines.write_text(lines.read_text() * 3)
    done = cli_here("create", "--from", str(lines), "--then", "done")
    assert done.returncode == 2, done
    assert "more than a CreateJobs line holds" in done.stderr
    assert jobs.queues()["queues"] == []
