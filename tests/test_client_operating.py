"""The client library's calls for operating a queue: RunningJobs, History
and the bulk actions (protocol.md 14.19 to 14.21), through Client and
AsyncClient against a real server on each backend."""

from __future__ import annotations

import anyio
import pytest

from harness import ThreadServer
from jobserver.client import AsyncClient, Client, InvalidRequest

pytestmark = pytest.mark.backends()


def failed(jobs: Client, name: str, count: int) -> list[int]:
    """`count` jobs named `name`, handed out and failed."""
    ids = jobs.create_jobs([{"name": name} for _ in range(count)])
    taken = jobs.get_jobs(name, count)
    assert sorted(job["jobID"] for job in taken) == sorted(ids)
    for job_id in ids:
        jobs.fail_job(job_id, error="broken")
    return ids


def test_bulk_calls_dry_run_then_act_on_failed_and_queued_jobs(server: ThreadServer) -> None:
    with Client("127.0.0.1", server.port, timeout=10) as jobs:
        mail = failed(jobs, "mail/send", 3)
        other = failed(jobs, "sms/send", 2)
        running = jobs.create_job("mail/send")
        assert jobs.get_job("mail/send")["jobID"] == running
        counted = jobs.requeue_failed_jobs("mail/*", dry_run=True)
        assert (counted["matched"], counted["acted"], counted["jobIDs"]) == (3, 0, mail)
        assert jobs.query_job(mail[0])["state"] == "FAILED"
        first = jobs.requeue_failed_jobs(queue="mail", limit=2)
        assert (first["acted"], first["remaining"], first["jobIDs"]) == (2, 1, mail[:2])
        assert jobs.requeue_failed_jobs("mail/*")["jobIDs"] == mail[2:]
        assert {jobs.query_job(i)["state"] for i in mail} == {"QUEUED"}
        # The job a worker holds is not FAILED: no bulk action touches it.
        assert jobs.query_job(running)["state"] == "RUNNING"
        assert jobs.delete_failed_jobs(job_ids=other)["acted"] == 2
        assert jobs.failed_jobs("*") == []
        cancelled = jobs.cancel_queued_jobs(queue="mail")
        assert sorted(cancelled["jobIDs"]) == mail
        assert jobs.queues()["queues"][0]["jobs"] == {"RUNNING": 1}
        with pytest.raises(InvalidRequest):
            jobs.requeue_failed_jobs()  # neither a name, a queue nor jobIDs


def test_running_jobs_and_history_calls_read_what_runs_and_what_ran(
    server: ThreadServer,
) -> None:
    with (
        Client("127.0.0.1", server.port, timeout=10) as worker,
        Client("127.0.0.1", server.port, timeout=10) as jobs,
    ):
        first = jobs.create_job("report/daily")
        second = jobs.create_job("report/weekly")
        assert worker.get_job("report/daily")["jobID"] == first
        assert worker.get_job("report/weekly")["jobID"] == second
        running = jobs.running_jobs()
        assert [job["jobID"] for job in running["jobs"]] == [first, second]
        assert running["total"] == 2 and running["jobs"][0]["worker"].startswith("127.0.0.1:")
        newest = jobs.running_jobs("report/*", limit=1, newest=True)
        assert [job["jobID"] for job in newest["jobs"]] == [second]
        assert newest["more"] == 1
        worker.finish_job(first)
        one = jobs.history("report", minutes=2)
        assert one["queue"] == "report" and one["minutes"] == 2
        assert sum(one["series"]["created"]) == 2
        assert sum(one["series"]["handedOut"]) == 2
        assert sum(one["series"]["finished"]) == 1


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_the_async_client_has_the_same_calls(server: ThreadServer, loop: str) -> None:
    async def scenario() -> None:
        async with AsyncClient("127.0.0.1", server.port, timeout=10) as jobs:
            job_id = await jobs.create_job("video/encode")
            assert (await jobs.get_job("video/encode"))["jobID"] == job_id
            assert [j["jobID"] for j in (await jobs.running_jobs())["jobs"]] == [job_id]
            await jobs.fail_job(job_id, error="codec")
            assert (await jobs.requeue_failed_jobs(job_ids=[job_id]))["acted"] == 1
            assert (await jobs.cancel_queued_jobs("video/*"))["jobIDs"] == [job_id]
            assert (await jobs.delete_failed_jobs("video/*"))["matched"] == 0
            assert sum((await jobs.history("video", minutes=2))["series"]["created"]) == 1

    anyio.run(scenario, backend=loop)
