"""The handler bench/worker_failures.py runs: every job of an odd jobID
fails its first attempt (its retry policy queues it again), the others
finish."""

from typing import Any

from jobserver.worker import Job, Worker

worker = Worker()


@worker.handler("flaky")
async def flaky(data: dict[str, Any], job: Job) -> None:
    if job.id % 2 and job.attempt == 1:
        raise RuntimeError("the first attempt of an odd job fails")
