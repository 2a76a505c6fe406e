"""RunningJobs: what runs now, where, and for how long.

The jobs handed out now (RUNNING, and RUNQUEUED under a lease that has not
ended), the longest running first, each with the worker that took it (its
connection's address), the node it was taken on, when it started, when
its lease or stale deadline ends and when it was last reported on. Read
on a connection of the store's own in a thread, through an index of the
jobs handed out, bounded by `limit`: it never holds up the writer.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import trio

from jobserver.core.commands import params
from jobserver.core.commands.route import Answer, Services
from jobserver.core.commands.views import ok
from jobserver.core.errors import CommandError
from jobserver.model import times
from jobserver.model.jobs import State
from jobserver.storage.reader_types import RunningJob
from jobserver.wire.framing import Request, Response

# A page people read and `jobserver top` fits in a frame; the largest
# bounds the reply (each job is under 700 bytes: a name of 255, a worker
# and a node of 100 each) to well under a megabyte.
DEFAULT_RUNNING = 100
MAX_RUNNING = 1000
# `order`: the longest running first (the default), or the last handed out.
ORDERS = ("oldest", "newest")


async def running_jobs(services: Services, request: Request, peer: str) -> Answer:
    pattern = name_pattern(request)
    limit = running_limit(request)
    newest = newest_first(request)
    now = times.utcnow()
    store = services.store
    try:
        jobs, total = await trio.to_thread.run_sync(
            store.running_jobs,
            times.to_millis(now),
            pattern,
            limit,
            newest,
            limiter=services.query_threads,
        )
    except store.errors as error:
        return Answer(Response(f"503 Database unavailable: {error}"))
    stale_after = services.engine.settings.stale_after
    body = {
        "jobs": [job_view(job, now, stale_after) for job in jobs],
        "total": total,
        "more": max(0, total - len(jobs)),
        "now": times.to_seconds(now),
    }
    return Answer(ok(body))


def name_pattern(request: Request) -> str | None:
    """The optional `name`: a GLOB pattern, as GetJob's."""
    text = params.present(request, "name")
    if text is None:
        return None
    if len(text.encode("utf-8")) > params.MAX_PATTERN:
        raise params.too_large("name", params.MAX_PATTERN)
    if not text or params.has_control(text):
        raise CommandError("402 Malformed name")
    params.check_wildcards(text)
    return text


def running_limit(request: Request) -> int:
    """The optional `limit`, 1 to MAX_RUNNING; anything else is refused."""
    text = params.present(request, "limit")
    if text is None:
        return DEFAULT_RUNNING
    # Plain ASCII digits: int() would also take "+5", "1_0" and other
    # scripts' digits, and a long run of digits is no limit either.
    if not (text.isascii() and text.isdigit() and len(text) <= 8):
        raise CommandError("402 Malformed limit")
    number = int(text)
    if not 1 <= number <= MAX_RUNNING:
        raise CommandError(f"402 Malformed limit: 1 to {MAX_RUNNING}")
    return number


def newest_first(request: Request) -> bool:
    """The optional `order`: `oldest` (the longest running first) or `newest`."""
    text = (params.present(request, "order") or ORDERS[0]).lower()
    if text not in ORDERS:
        raise CommandError("402 Malformed order: oldest or newest")
    return text == "newest"


def job_view(job: RunningJob, now: datetime, stale_after: float) -> dict[str, object]:
    """A job handed out, as RunningJobs lists it."""
    started = times.parse_stored(job.started) if job.started else None
    return {
        "jobID": job.jobID,
        "name": job.name,
        "state": job.state,
        "worker": job.worker,
        "node": job.node,
        "started": job.started or "",
        "lastReport": job.last_report[:19],
        "leaseEnds": _lease_end(job, stale_after),
        "runningSeconds": _seconds_since(started, now),
    }


def _lease_end(job: RunningJob, stale_after: float) -> str | None:
    """When the worker's hold ends without a report: a leased job's
    nextRun; a RUNNING job's stale deadline (--stale-after), None with none."""
    if job.state != State.RUNNING:
        return job.next_run[:19]
    if not stale_after or not job.last_report:
        return None
    deadline = times.parse_stored(job.last_report) + timedelta(seconds=stale_after)
    return times.to_seconds(deadline)


def _seconds_since(moment: datetime | None, now: datetime) -> float | None:
    if moment is None:
        return None
    # A run started a moment after `now` was read (clocks of two nodes) has not run.
    return round(max(0.0, (now - moment).total_seconds()), 3)
