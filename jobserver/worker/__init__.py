"""The in-process Python worker (`jobserver worker MODULE:ATTR`): handlers
registered by job-name pattern, run N at once, reporting in batches.

    from jobserver.worker import RetryLater, Worker

    worker = Worker()

    @worker.handler("email/*")
    def send(data):
        ...

Where things are:
- registry.py   Worker: handlers by pattern, their signatures, the GetJobs name
- job.py        Job (what a handler may ask for) and RetryLater
- runner.py     the Runner: slots, signals, exit status
- fetching.py   the fetchers: GetJobs for the room free, taking turns to wait
- calling.py    calling one handler: thread or task, timeout, grace period
- outcome.py    what a handler's end means: the report, the log's words
- leases.py     renewing the leases of running jobs (TouchJob)
- reporting.py  delivering reports in batches (FinishJobs), by the manager's policy
- connection.py reaching the server: the manager's addresses and backoff, on anyio
- arguments.py  the command line: options, their checks, loading MODULE:ATTR

Running is on anyio, imported when a worker runs: registering handlers
does without it.
"""

from jobserver.worker.job import Job, RetryLater
from jobserver.worker.registry import Handler, Worker

__all__ = ["Handler", "Job", "RetryLater", "Worker"]
