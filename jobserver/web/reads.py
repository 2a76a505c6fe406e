"""What the dashboard reads that no wire command shows: a job with its
parent, children, lease token and last error (QueryJob keeps Bedrock's
keys), jobs in any state by name pattern (FailedJobs lists the dead
set only), and the queued jobs due later (later_pages.py).

Both go through the Storage interface, never SQL. A job's page is read in
the writer, as QueryJob is, so that it is one consistent look at the job
and its family. A search reads on a connection of the store's own in a
thread, as Queues does: it may read every job, and must not hold up the
writer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import trio

from jobserver.core.build import Core
from jobserver.core.engine.context import Context
from jobserver.model import times
from jobserver.model.jobs import Job, State
from jobserver.storage.reader_types import LaterJobs


@dataclass(frozen=True)
class Family:
    job: Job
    parent: Job | None
    children: list[Job]


def _family(ctx: Context, job_id: int) -> Family | None:
    store = ctx.store
    job = store.get(job_id)
    if job is None:
        return None
    parent = store.get(job.parentJobID) if job.parentJobID else None
    return Family(job, parent, store.children(job_id, list(State)))


class Reads:
    def __init__(self, core: Core) -> None:
        self._core = core
        # One search at a time: each may read every job.
        self._searches = trio.CapacityLimiter(1)

    async def family(self, job_id: int) -> Family | None:
        """The job with its parent and children; None if there is no such
        job. Raises CommandError when the database fails."""
        result: Family | None = await self._core.engine.call(
            partial(_family, job_id=job_id)
        )
        return result

    async def later(self, retrying: bool, limit: int, most: int) -> LaterJobs:
        """The dashboard's Scheduled or Retries (later_pages.py). Raises one
        of the store's `errors` when the database cannot be read."""
        now = times.to_millis(times.utcnow())
        found = await trio.to_thread.run_sync(
            self._core.store.later_jobs, now, retrying, limit, most,
            limiter=self._searches, abandon_on_cancel=True,
        )
        await self._core.engine.settled()
        return found

    async def matching(self, pattern: str, limit: int) -> list[Job]:
        """The newest `limit` jobs whose name matches the GLOB `pattern`.
        Raises one of the store's `errors` when the database cannot be read."""
        store = self._core.store
        found = await trio.to_thread.run_sync(
            store.find_matching, pattern, limit,
            limiter=self._searches, abandon_on_cancel=True,
        )
        # Its own connection may have read commits not yet on disk: the
        # page waits for them, as Query's reply does.
        await self._core.engine.settled()
        return found
