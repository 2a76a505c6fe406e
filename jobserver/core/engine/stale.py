"""The stale-job safety net (--stale-after).

A job handed out without a lease (no `retryAfter`) is RUNNING until its
worker reports. If the worker dies after it took the job, nothing would
ever move the job again: Bedrock's behaviour, and its users' complaint.
With --stale-after, a RUNNING job that has had no report for that long
(FinishJob, FailJob, RetryJob, UpdateJob, TouchJob) counts as a failed
attempt: its retry policy queues it again, or it ends FAILED.

There is no scan loop. A RUNNING job's deadline is its `lastReport` plus
the setting; the clock that wakes waiting GetJobs fires at the earliest
one, as it does for future jobs and reply deadlines.
"""

from __future__ import annotations

from datetime import timedelta

from jobserver.core.engine.context import Context, Settings
from jobserver.core.rules import lifecycle
from jobserver.model import times
from jobserver.storage.interface import Storage

# Jobs failed per clock tick: the rest follow in the next tick, at once,
# so a backlog (a server down for days) never makes one long transaction.
EXPIRE_BATCH = 500


def lost_error(seconds: float) -> str:
    """The lastError of a job the safety net failed."""
    return (
        f"no report for {times.duration_text(seconds)} (--stale-after):"
        " presumed lost with its worker"
    )


def expire(ctx: Context) -> None:
    """Fail, through their retry policies, RUNNING jobs past their deadline."""
    seconds = ctx.settings.stale_after
    if not seconds:
        return
    cutoff = times.to_millis(ctx.now - timedelta(seconds=seconds))
    if ctx.settings.serving_since > cutoff:
        # Not up that long: no worker can have been silent that long to us.
        return
    stale = ctx.store.stale(cutoff, EXPIRE_BATCH)
    for job in stale:
        if job.cancelRequested:
            # Its worker is gone before it heard of its cancel (14.26).
            lifecycle.cancel_run(ctx, job)
        else:
            lifecycle.fail_attempt(ctx, job, lost_error(seconds))
    if len(stale) == EXPIRE_BATCH:
        ctx.wake_all()


def end_cancelled_leases(ctx: Context) -> None:
    """RUNQUEUED jobs whose cancel is pending and whose lease has ended
    with no report: CANCELLED (protocol.md 14.26), whether or not a GetJob
    for their name comes (a hand-out would end them too)."""
    due = ctx.store.cancels_due(ctx.now_ms, EXPIRE_BATCH)
    for job in due:
        lifecycle.cancel_run(ctx, job)
    if len(due) == EXPIRE_BATCH:
        ctx.wake_all()


def next_deadline(store: Storage, settings: Settings) -> str | None:
    """The earliest stale deadline of a RUNNING job, passed or not."""
    if not settings.stale_after:
        return None
    oldest = store.oldest_report()
    if oldest is None:
        return None
    return deadline(max(oldest, settings.serving_since), settings.stale_after)


def deadline(reported: str, seconds: float) -> str:
    """When a job last heard from at `reported` becomes stale."""
    return times.to_millis(times.parse_stored(reported) + timedelta(seconds=seconds))
