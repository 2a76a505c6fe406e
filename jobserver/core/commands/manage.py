"""What operators and clients do to a job outside its runs: QueryJob,
UpdateJob, CancelJob, DeleteJob, RequeueJobs, and FailedJobs (the dead
set). Every change of a job's state goes through lifecycle.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from jobserver.core.commands import flow_params, json_params, params
from jobserver.core.commands.lookup import check_lease, load_job
from jobserver.core.commands.views import failed_object, job_object, ok
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import dependencies, lifecycle, schedule
from jobserver.core.rules.selection import name_selector
from jobserver.model import cron
from jobserver.model.jobs import ACTIVE, Job, State
from jobserver.wire.framing import Request, Response
from jobserver.wire.limits import MAX_CANCEL_CHECK


def query_job(ctx: Context, request: Request) -> Response:
    job = load_job(ctx, request)
    shown = job_object(job, with_state=True)
    if job.cancelRequested:
        # Its worker has not reported since CancelJob (protocol.md 14.26).
        shown["cancelRequested"] = True
    if cron.is_cron(job.repeat):
        shown["nextRuns"] = schedule.cron_upcoming(ctx.now, job)
    if job.dependencies:
        shown["dependencyCounts"] = dependencies.counts(ctx, job)
        shown["onDependencyFailure"] = job.onDependencyFailure or "fail"
    return ok(shown)


def update_job(ctx: Context, request: Request) -> Response:
    job_id = params.job_id(request)
    if params.present(request, "data") is None:
        raise CommandError("402 Missing data")
    data = json_params.data(request)
    rule = params.repeat_rule(request)
    priority = params.priority(request, "jobPriority")
    next_run = params.time(request, "nextRun")
    zone = flow_params.time_zone(request)
    job = ctx.store.get(job_id)
    if job is None:
        raise CommandError("404 No job with this jobID")
    check_lease(request, job)
    changes: dict[str, Any] = {"data": data}
    if params.is_true(request.get("shouldClearRepeat")):
        changes["repeat"] = ""
    elif rule is not None:
        changes["repeat"] = rule
    if zone is not None:
        changes["timeZone"] = _zone_for(job, changes.get("repeat", job.repeat), zone)
    if next_run is None and rule is not None:
        # Not a run: the moment may be the one the job already has. A CRON
        # rule is read in the zone the job will have.
        zoned = job if zone is None else replace(job, timeZone=zone)
        next_run = schedule.next_run_from_repeat(ctx, zoned, rule)
    elif next_run is None and zone is not None and cron.is_cron(changes.get("repeat", job.repeat)):
        next_run = schedule.cron_run(ctx, job.repeat, zone)
    if priority is not None:
        changes["priority"] = priority
    lifecycle.update(ctx, job, next_run, **changes)
    return ok()


def _zone_for(job: Job, rule: str, zone: str) -> str:
    """A new timeZone, for a job it means something to: as at CreateJob,
    one with timeWindows or a CRON rule (`rule`, the one it will have)."""
    if not job.timeWindows and not cron.is_cron(rule):
        raise CommandError("402 Missing timeWindows")
    return zone


def cancel_job(ctx: Context, request: Request) -> Response:
    job = load_job(ctx, request)
    # The request's checks, not a move's: as Bedrock words them, the jobID
    # names no job CancelJob is for (only a child without children is),
    # whatever state it is in.
    running = params.flag(request, "running")
    if ctx.store.has_children(job.jobID):
        raise CommandError("404 Invalid jobID - Cannot cancel a job with children")
    if running and job.state in ACTIVE:
        # Asked explicitly (protocol.md 14.26): Bedrock leaves a RUNNING
        # job as it is, and cancels a RUNQUEUED child under its worker.
        lifecycle.ask_to_cancel(ctx, job)
        return ok()
    # A job waiting for its dependencies is cancelled as a child is
    # (protocol.md 14.25): its own dependents hear of it.
    if not job.parentJobID and job.state != State.BLOCKED:
        raise CommandError("404 Invalid jobID - Cannot cancel a job without a parent")
    lifecycle.cancel(ctx, job)
    return ok()


def cancelled_jobs(ctx: Context, request: Request) -> Response:
    """CancelledJobs (protocol.md 14.26): which of a worker's running jobs
    have a cancel pending, so that it learns sooner than at its next lease
    renewal, at one lookup per job and no write."""
    # Counted before they are parsed, as a bulk action's: parsed first, a
    # line of a million held the writer up to 1.1 s before its 413.
    if params.require(request, "jobIDs").count(",") >= MAX_CANCEL_CHECK:
        raise CommandError(f"413 Too many jobIDs (max {MAX_CANCEL_CHECK})")
    ids = params.job_ids(request)
    if len(ids) > MAX_CANCEL_CHECK:
        raise CommandError(f"413 Too many jobIDs (max {MAX_CANCEL_CHECK})")
    return ok({"jobIDs": ctx.store.cancel_pending(sorted(set(ids)))})


def delete_job(ctx: Context, request: Request) -> Response:
    job = load_job(ctx, request)
    lifecycle.delete(ctx, job)
    return ok()


def requeue_jobs(ctx: Context, request: Request) -> Response:
    """Put jobs back to QUEUED, due at their creation time; unknown IDs are
    skipped."""
    ids = params.job_ids(request)
    changes: dict[str, Any] = {}
    if params.present(request, "name") is not None:
        changes["name"] = params.name(request)
    for job_id in ids:
        job = ctx.store.get(job_id)
        if job is None:
            continue
        lifecycle.requeue(ctx, job, **changes)
    return ok()


def failed_jobs(ctx: Context, request: Request) -> Response:
    """The dead set: FAILED jobs whose name matches, with their last error."""
    pattern, names = name_selector(params.present(request, "name") or "*")
    found = ctx.store.failed(pattern=pattern, names=names, limit=params.limit(request))
    return ok({"jobs": [failed_object(job) for job in found]})
