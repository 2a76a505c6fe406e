"""jobserver requeue-failed, delete-failed and cancel-queued (protocol.md
14.19) against a real server, run in this process for speed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from bulk_jobs import COSTLY, costly_name
from test_cli import CliHere

from harness import ThreadServer
from jobserver.client import Client


@pytest.fixture
def cli(server: ThreadServer, capsys: pytest.CaptureFixture[str]) -> CliHere:
    return CliHere(f"127.0.0.1:{server.port}", capsys)


@pytest.fixture
def jobs(server: ThreadServer) -> Iterator[Client]:
    with Client(port=server.port, timeout=10) as client:
        yield client


def failed(jobs: Client, *names: str) -> list[int]:
    ids = jobs.create_jobs([{"name": name} for name in names])
    assert len(jobs.get_jobs("*", len(ids))) == len(ids)
    for job_id in ids:
        jobs.fail_job(job_id, error="broken")
    return ids


def test_requeue_failed_by_pattern_with_a_dry_run_first(cli: CliHere, jobs: Client) -> None:
    ids = failed(jobs, "email/a", "email/b", "sms/a")
    dry = cli.ok("requeue-failed", "email/*", "--dry-run")
    assert dry == {"matched": 2, "acted": 0, "remaining": 2, "jobIDs": ids[:2], "dryRun": True}
    assert cli.ok("requeue-failed", "email/*", "--limit", "1")["jobIDs"] == ids[:1]
    assert cli.ok("requeue-failed", "email/*")["jobIDs"] == ids[1:2]
    assert [jobs.query_job(i)["state"] for i in ids] == ["QUEUED", "QUEUED", "FAILED"]


def test_delete_failed_by_ids_and_by_queue(cli: CliHere, jobs: Client) -> None:
    ids = failed(jobs, "q/a", "q/b", "r")
    assert cli.ok("delete-failed", "--ids", str(ids[2]), "999")["skipped"] == 1
    assert cli.ok("delete-failed", "--queue", "q")["acted"] == 2
    assert jobs.status()["jobs"] == {}


def test_cancel_queued_leaves_running_jobs(cli: CliHere, jobs: Client) -> None:
    running = jobs.create_job("q/run")
    assert jobs.get_job("q/run") is not None
    jobs.create_jobs([{"name": "q/a"}, {"name": "q/b"}])
    assert cli.ok("cancel-queued", "--queue", "q")["acted"] == 2
    assert jobs.status()["jobs"] == {"RUNNING": 1}
    assert jobs.query_job(running)["state"] == "RUNNING"


def test_a_run_that_stopped_short_says_so(cli: CliHere, jobs: Client) -> None:
    """A costly pattern examines few jobs (protocol.md 14.19): the reply
    says how many, and that more may match."""
    pattern, examined = COSTLY
    jobs.create_jobs([{"name": costly_name(i)} for i in range(examined + 1)])
    dry = cli.ok("cancel-queued", pattern, "--dry-run")
    assert (dry["matched"], dry["complete"], dry["examined"]) == (examined, False, examined)
    assert "complete" not in cli.ok("cancel-queued", "--queue", "n", "--dry-run")


def test_usage_errors(cli: CliHere) -> None:
    for args in (
        ("requeue-failed",),
        ("delete-failed", "a", "--queue", "b"),
        ("cancel-queued", "--queue", "a/b"),
        ("requeue-failed", "*", "--limit", "1001"),
    ):
        done = cli(*args)
        assert (done.returncode, done.stdout) == (2, ""), args
    assert "a queue is a name up to its first /" in cli("cancel-queued", "--queue", "a/b").stderr
