"""Reports on a job that was handed out: FinishJob, RetryJob, FailJob and
TouchJob, and FinishJobs, FailJobs and RetryJobs, many of the first three
in one request. Every change of a job's state goes through lifecycle.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from jobserver.core.commands import json_params, known_headers, params
from jobserver.core.commands.lookup import cancelled_run, check_lease, load_job
from jobserver.core.commands.views import OK, ok
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import leases, lifecycle, schedule
from jobserver.core.rules.schedule import RepeatStalled
from jobserver.model.jobs import PENDING, Job, RetryPolicy
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request, Response
from jobserver.wire.limits import MAX_FINISH_JOBS

# TouchJob's `lease` without the lease it changes.
MISSING_LEASE_ID = "402 Missing leaseID (a lease's length is changed only with its leaseID)"


def finish_job(ctx: Context, request: Request) -> Response:
    return _report_end_of_run(ctx, request, retry=False)


def retry_job(ctx: Context, request: Request) -> Response:
    return _report_end_of_run(ctx, request, retry=True)


def _report_end_of_run(ctx: Context, request: Request, retry: bool) -> Response:
    if not ctx.store.blocking:
        # No round trip to spare (SQLite): holding one job costs more.
        return _finish_or_retry(ctx, request, retry)
    # The job, and whether it has children, in one round trip.
    with ctx.store.holding_writes():
        ctx.store.hold(_named_jobs([request]))
        return _finish_or_retry(ctx, request, retry)


# The savepoint of one element of FinishJobs, FailJobs or RetryJobs, inside
# the writer's own.
_ELEMENT = "element"

# What an element of a many-job report is: its one-job command.
Report = Callable[[Context, Request], Response]


def finish_jobs(ctx: Context, request: Request) -> Response:
    return _report_each(ctx, request, "FinishJob", _finish)


def fail_jobs(ctx: Context, request: Request) -> Response:
    return _report_each(ctx, request, "FailJob", fail_job)


def retry_jobs(ctx: Context, request: Request) -> Response:
    return _report_each(ctx, request, "RetryJob", _retry)


def _finish(ctx: Context, request: Request) -> Response:
    return _finish_or_retry(ctx, request, retry=False)


def _retry(ctx: Context, request: Request) -> Response:
    return _finish_or_retry(ctx, request, retry=True)


def _report_each(ctx: Context, request: Request, command: str, report: Report) -> Response:
    """`command` for each element of `jobs`, in order, each with its own
    outcome: an element that fails undoes its own writes and no others."""
    elements = json_params.job_list(request)
    if len(elements) > MAX_FINISH_JOBS:
        raise CommandError(f"413 Too many jobs (max {MAX_FINISH_JOBS})")
    plain, reports = _sorted_elements(elements, command, plain_allowed=report is _finish)
    # Every write is held and sent together (the plain runs' outcomes too).
    # Dependents, if any, hear of the jobs that ended all at once.
    with ctx.store.holding_writes(), lifecycle.telling_at_end(ctx):
        # The plain runs first, in one statement: none is anything to
        # another element's job (no parent, child, dependency or
        # dependent), and no element before names its job.
        finished: set[int] = set()
        if plain:
            named = [run[0] for run in plain.values()] + _named_jobs(list(reports.values()))
            finished = lifecycle.finish_plain_runs(ctx, list(plain.values()), named)
        for at, (job_id, _) in plain.items():
            if job_id not in finished:
                reports[at] = json_params.from_json(elements[at], command)
        # The others' jobs are read in one statement.
        ctx.store.hold(_named_jobs(list(reports.values())))
        results = [
            _report_element(ctx, reports[at], report)
            if at in reports
            else {"jobID": plain[at][0], "status": OK}
            for at in range(len(elements))
        ]
    return known_headers.with_ignored_elements(ok({"results": results}), reports)


def _sorted_elements(
    elements: list[dict[str, Any]], command: str, plain_allowed: bool
) -> tuple[dict[int, tuple[int, str | None]], dict[int, Request]]:
    """By position: the elements that may be plain runs (jobID, and leaseID
    or None), and every other as its command's request (each checked here,
    before anything is written). A plain run's element holds `jobID`, a
    job's number, and maybe `leaseID` in a lease token's form, and nothing
    else, and no element before it names its job."""
    plain: dict[int, tuple[int, str | None]] = {}
    reports: dict[int, Request] = {}
    named: set[int] = set()
    for at, element in enumerate(elements):
        run = _plain_run(element) if plain_allowed else None
        if run is not None and run[0] not in named:
            plain[at] = run
            named.add(run[0])
            continue
        request = reports[at] = json_params.from_json(element, command)
        job_id = params.given_job_id(request)
        if job_id is not None:
            named.add(job_id)
    return plain, reports


def _plain_run(element: dict[str, Any]) -> tuple[int, str | None] | None:
    job_id = element.get("jobID")
    if type(job_id) is not int or not 0 < job_id <= params.MAX_JOB_ID:
        return None
    lease = element.get("leaseID")
    if lease is None:
        return (job_id, None) if len(element) == 1 else None
    # Only what a hand-out's token can be: any other lease is answered the
    # long way (409), never sent (a NUL in a text PostgreSQL refuses failed
    # the whole request; 2 MB of wrong leases cost the writer more).
    if type(lease) is str and leases.is_token(lease) and len(element) == 2:
        return job_id, lease
    return None


def _named_jobs(reports: list[Request]) -> list[int]:
    """The jobIDs the elements name, of those that may be jobs."""
    ids = (params.given_job_id(report) for report in reports)
    return [job_id for job_id in ids if job_id is not None and 0 < job_id <= params.MAX_JOB_ID]


def _report_element(ctx: Context, request: Request, report: Report) -> dict[str, Any]:
    part = ctx.part()
    ctx.store.savepoint(_ELEMENT)
    # Only the command's own answers are an element's. Anything else (the
    # database failing, a bug) fails the whole request, and the writer
    # undoes all of it, this savepoint included.
    try:
        # Its job is held already (_report_each).
        status = report(part, request).status
    except CommandError as error:
        ctx.store.rollback_savepoint(_ELEMENT)
        status = error.status
    else:
        ctx.store.release(_ELEMENT)
        ctx.join(part)
    return {"jobID": params.given_job_id(request), "status": status}


def _finish_or_retry(ctx: Context, request: Request, retry: bool) -> Response:
    job = load_job(ctx, request)
    check_lease(request, job)
    cancelled = cancelled_run(ctx, job)
    if cancelled is not None:
        return cancelled
    parent = lifecycle.parent_of_ending_run(ctx, job)
    new_data = json_params.data(request) if params.present(request, "data") else None
    # Most jobs never have children: one look spares the two child queries.
    has_children = ctx.store.has_children(job.jobID)
    if has_children:
        lifecycle.delete_ended_children(ctx, job)
    text = new_data or job.data
    asks_delete = False
    # Parsed only when it may hold what this step looks at or removes.
    if '"retryAfterCount"' in text or '"delete"' in text:
        data = jsonbody.parse_object(text, stored=True)
        asks_delete = data.get("delete") is True
        data.pop("retryAfterCount", None)
        text = jsonbody.compact(data)
    changes: dict[str, Any] = {"data": text}
    if job.attempts:
        # A run that ended well, or that its worker chose to retry, did not
        # fail: the next run gets every attempt again (and every lease,
        # protocol.md 14.24).
        changes["attempts"] = 0
    if not retry and has_children and ctx.store.has_children(job.jobID, PENDING):
        lifecycle.pause_for_children(ctx, job, **changes)
        return ok()
    if retry:
        changes.update(_renamed(request))
    try:
        next_run = _next_run(ctx, request, job, retry, use_repeat=not asks_delete)
    except RepeatStalled as stalled:
        # The report is taken; the job would loop, so it ends here.
        lifecycle.fail(ctx, job, str(stalled), **changes)
        return ok()
    if next_run is not None:
        lifecycle.retry(ctx, job, next_run, repeats=not retry, **changes)
    else:
        lifecycle.finish(ctx, job, parent, **changes)
    return ok()


def _renamed(request: Request) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    new_name = params.present(request, "name")
    if new_name is not None:
        changes["name"] = params.name(request)
    priority = params.priority(request, "jobPriority")
    if priority is not None:
        changes["priority"] = priority
    return changes


def _next_run(
    ctx: Context, request: Request, job: Job, retry: bool, use_repeat: bool
) -> str | None:
    """Precedence: the job's repeat, then RetryJob's nextRun, then its delay."""
    if job.repeat and use_repeat and not (retry and params.is_true(request.get("ignoreRepeat"))):
        return schedule.next_run_after_run(ctx, job, schedule.due_moment(job))
    if not retry:
        return None
    next_run = params.time(request, "nextRun")
    if next_run is not None:
        return next_run
    return schedule.seconds_later(ctx, params.delay_seconds(request))


def fail_job(ctx: Context, request: Request) -> Response:
    """FAILED; or, for a job whose retry policy has attempts left, QUEUED
    again after its backoff delay."""
    job = load_job(ctx, request)
    check_lease(request, job)
    cancelled = cancelled_run(ctx, job)
    if cancelled is not None:
        return cancelled
    lifecycle.check(job, "fail an attempt")
    data = json_params.data(request) if params.present(request, "data") else None
    error = json_params.error_text(request, data)
    changes: dict[str, Any] = {} if data is None else {"data": data}
    policy = params.retry_policy(request)
    if policy is not None and not job.maxAttempts:
        job = _with_workers_policy(job, policy, changes)
    lifecycle.fail_attempt(ctx, job, error, **changes)
    return ok()


def _with_workers_policy(job: Job, policy: RetryPolicy, changes: dict[str, Any]) -> Job:
    """A job created without a retry policy takes the one its worker sends
    with its failure (a handler's, protocol.md 14.1): kept, as if created
    with it, and this failure counted as its attempt (after the leases it
    lost, which were attempts too). A job's own policy wins: never here."""
    adopted: dict[str, Any] = {
        "maxAttempts": policy.max_attempts, "retryBackoff": policy.backoff,
        "retryDelay": policy.delay, "retryMaxDelay": policy.max_delay,
        "attempts": job.attempts + 1,
    }
    changes.update(adopted)
    return replace(job, **adopted)


def touch_job(ctx: Context, request: Request) -> Response:
    """Extend a lease: the job is due again only retryAfter (or the lease
    its taker asked for, or `lease`) from now. A RUNNING job's report
    restarts the stale-job safety net's count."""
    lease = params.lease_seconds(request)
    if lease and params.lease_id(request) is None:
        # A renewal without a leaseID may come from anyone: it may extend a
        # lease as its taker asked, never change how long it lasts (a
        # `lease: 1` from a stranger made the holder's renewals too short
        # and the job ran twice).
        raise CommandError(MISSING_LEASE_ID)
    job = load_job(ctx, request)
    check_lease(request, job)
    cancelled = cancelled_run(ctx, job)
    if cancelled is not None:
        return cancelled
    try:
        next_run = lifecycle.touch(ctx, job, lease)
    except RepeatStalled as stalled:
        # Returned, not raised, so that the failure stays: a lease that
        # ends at once would hand the job to another worker right away.
        lifecycle.fail(ctx, job, str(stalled))
        return Response(f"402 Malformed repeat: {stalled.reason}; the job failed")
    if next_run is None:
        return _stale_at(ctx)
    return ok({"nextRun": next_run})


def _stale_at(ctx: Context) -> Response:
    """A RUNNING job's touch: when the stale-job safety net will fail it."""
    seconds = ctx.settings.stale_after
    if not seconds:
        return ok({})
    return ok({"staleAt": schedule.retry_time(ctx, seconds)})
