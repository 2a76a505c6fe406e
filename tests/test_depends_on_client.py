"""One job's dependencies (protocol.md 14.25) from the client library's
create_job (`depends_on`, `on_dependency_failure`) and from `jobserver
create --depends-on IDS --on-dependency-failure WHAT`, against a real
server on SQLite and PostgreSQL. Graphs in one request (`#N`) are
test_dependencies.py's; batches test_batches.py's."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest
from test_batches import cli_here  # noqa: F401  (the fixture)
from test_cli import CliHere

from harness import ThreadServer
from jobserver.client import AsyncClient, Client, JobNotFound
from jobserver.wire.limits import MAX_DEPENDENCIES

pytestmark = pytest.mark.backends

TIMEOUT = 10.0


@pytest.fixture
def jobs(server: ThreadServer) -> Iterator[Client]:
    with Client(port=server.port, timeout=TIMEOUT) as client:
        yield client


def finish(jobs: Client, name: str) -> None:
    taken = jobs.get_job(name)
    assert taken is not None, name
    jobs.finish_job(taken["jobID"], None, taken.get("leaseID"))


def test_create_job_waits_for_its_dependencies_and_then_runs(jobs):
    first, second = jobs.create_job("step/a"), jobs.create_job("step/b")
    last = jobs.create_job("step/c", depends_on=[first, second], on_dependency_failure="run")
    shown = jobs.query_job(last)
    assert (shown["state"], shown["onDependencyFailure"]) == ("BLOCKED", "run")
    assert jobs.get_job("step/c") is None
    finish(jobs, "step/a")
    failed = jobs.get_job("step/b")
    assert failed is not None
    jobs.fail_job(failed["jobID"], None, failed.get("leaseID"), error="no")
    handed = jobs.get_job("step/c")
    assert handed is not None and handed["jobID"] == last
    assert {d["jobID"]: d["state"] for d in handed["dependencies"]} == {
        first: "FINISHED", second: "FAILED"
    }


def test_create_job_without_dependencies_sends_none(jobs):
    job_id = jobs.create_job("plain", depends_on=[])
    assert jobs.query_job(job_id)["state"] == "QUEUED"


def test_create_job_refuses_too_many_or_odd_dependencies_before_sending(jobs):
    with pytest.raises(ValueError, match=f"at most {MAX_DEPENDENCIES}"):
        jobs.create_job("x", depends_on=list(range(1, MAX_DEPENDENCIES + 2)))
    with pytest.raises(ValueError, match="not a list of jobIDs"):
        jobs.create_job("x", depends_on=["1"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not a list of jobIDs"):
        jobs.create_job("x", depends_on=[True])


def test_create_job_on_a_job_that_does_not_exist_is_refused(jobs):
    with pytest.raises(JobNotFound, match="Dependency 999999 does not exist"):
        jobs.create_job("x", depends_on=[999999])


def test_the_async_client_sends_dependencies_too(server: ThreadServer):
    async def main() -> tuple[str, str]:
        async with AsyncClient(port=server.port, timeout=TIMEOUT) as client:
            first = await client.create_job("async/a")
            last = await client.create_job(
                "async/b", depends_on=[first], on_dependency_failure="cancel"
            )
            shown = await client.query_job(last)
            return shown["state"], shown["onDependencyFailure"]

    assert anyio.run(main) == ("BLOCKED", "cancel")


def test_the_command_line_creates_a_job_with_dependencies(cli_here: CliHere, jobs):  # noqa: F811
    first = cli_here.ok("create", "cli/a")["jobID"]
    second = cli_here.ok("create", "cli/b")["jobID"]
    made = cli_here.ok(
        "create", "cli/c", "--depends-on", f"{first}, {second}",
        "--on-dependency-failure", "cancel",
    )
    shown = cli_here.ok("query", str(made["jobID"]))
    assert (shown["state"], shown["onDependencyFailure"]) == ("BLOCKED", "cancel")
    assert shown["dependencyCounts"]["total"] == 2
    finish(jobs, "cli/a")
    finish(jobs, "cli/b")
    assert cli_here.ok("query", str(made["jobID"]))["state"] == "QUEUED"


@pytest.mark.parametrize("args, problem", [
    (["x", "--on-dependency-failure", "run"], "--on-dependency-failure needs --depends-on"),
    (["x", "--depends-on", "1,zero"], "must be a whole number from 1"),
    (["x", "--depends-on", "0"], "must be a whole number from 1"),
    (["x", "--depends-on", ",".join(["1"] * (MAX_DEPENDENCIES + 1))], "at most 1000 jobIDs"),
    (["x", "--depends-on", "1", "--on-dependency-failure", "retry"], "invalid choice"),
    (["--from", "-", "--depends-on", "1"], "--depends-on cannot go with it"),
    (["--from", "-", "--then", "t", "--depends-on", "1"], "--depends-on cannot go with --then"),
])
def test_the_command_line_refuses_what_cannot_be_a_job_with_dependencies(
    cli_here: CliHere, args: list[str], problem: str  # noqa: F811
):
    done = cli_here("create", *args)
    assert done.returncode == 2 and problem in done.stderr, done
    assert done.stdout == ""
