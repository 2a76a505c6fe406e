"""One function per job command: check the request, act, build the reply.

Handlers run inside a transaction that the writer owns; they never commit
and never touch a socket. A handler returns a `Response` or raises
`CommandError`, whose status line is the reply and whose raise undoes every
change the handler made. Status lines are Bedrock's, word for word. Every
change of a job's state goes through lifecycle.py.
"""

from __future__ import annotations

from typing import Any

from jobserver.core.commands import params
from jobserver.core.commands.views import failed_object, job_object, ok
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import flow, lifecycle, schedule
from jobserver.core.rules.schedule import RepeatStalled
from jobserver.core.rules.selection import name_selector
from jobserver.model import cron
from jobserver.model.jobs import ACTIVE, PENDING, Job, NewJob, State
from jobserver.model.sqlite_functions import json_patch
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request, Response, escape
from jobserver.wire.limits import DEFAULT_PRIORITY, MAX_FINISH_JOBS


def load_job(ctx: Context, request: Request) -> Job:
    job = ctx.store.get(params.job_id(request))
    if job is None:
        raise CommandError("404 No job with this jobID")
    return job


def check_lease(request: Request, job: Job) -> None:
    """A report that names a lease must hold the job's latest one: if the
    job was handed out again since, its sender no longer owns it."""
    lease = params.lease_id(request)
    if lease is not None and lease != job.leaseID:
        raise CommandError("409 Lease expired")


# Creating jobs.


def create_job(ctx: Context, request: Request) -> Response:
    return Response("200 OK", b'{"jobID":%d}' % _create(ctx, request))


def create_jobs(ctx: Context, request: Request) -> Response:
    """All or nothing: any bad element fails the whole request."""
    elements = _job_list(request)
    ids = []
    created = []
    for element in elements:
        if not any(key.lower() == "name" for key in element):
            raise CommandError("402 Missing name")
        created.append(params.from_json(element, "CreateJob"))
        ids.append(_create(ctx, created[-1]))
    return _naming_ignored(ok({"jobIDs": ids}), created)


def _naming_ignored(response: Response, elements: list[Request]) -> Response:
    """The reply, naming the keys of `jobs` elements their command does not
    read (`jobs[1].priorty`), as a request's own headers are named."""
    ignored = params.ignored_in_elements(elements)
    if ignored:
        response.headers["ignoredHeaders"] = params.describe_ignored(ignored)
    return response


def _job_list(request: Request) -> list[dict[str, Any]]:
    text = params.present(request, "jobs")
    try:
        elements = jsonbody.parse(text) if text is not None else None
    except jsonbody.TooDeep as error:
        raise CommandError(f"401 Invalid JSON: {error}") from None
    except ValueError:
        elements = None
    if not isinstance(elements, list) or not elements:
        raise CommandError("401 Invalid JSON")
    if not all(isinstance(e, dict) and e for e in elements):
        raise CommandError("401 Invalid JSON")
    return elements


def _create(ctx: Context, request: Request) -> int:
    name = params.name(request)
    priority = params.priority(request, "jobPriority", "priority")
    data = params.data(request)
    retry_after = params.retry_after(request)
    first_run = params.time(request, "firstRun")
    rule = params.repeat_rule(request)
    policy = params.retry_policy(request)
    flow = params.flow_options(request)
    _check_cost_fits(ctx, name, flow.cost)
    parent_id = _parent_id(request)
    parent = _parent(ctx, parent_id) if parent_id else None
    if params.is_true(request.get("unique")):
        existing = ctx.store.find_by_name(name)
        if existing is not None:
            _update_unique(ctx, request, existing, parent_id, data, rule, priority)
            return existing.jobID
    next_run = first_run or _first_run(ctx, rule, flow.zone)
    if flow.windows:
        next_run = schedule.in_window(flow.windows, flow.zone, next_run)
    new = NewJob(
        name=name,
        next_run=next_run,
        repeat=rule or "",
        data=data if data is not None else "{}",
        priority=DEFAULT_PRIORITY if priority is None else priority,
        parent_id=parent_id,
        retry_after=retry_after,
        policy=policy,
        flow=flow,
    )
    return lifecycle.create(ctx, new, parent)


def _first_run(ctx: Context, rule: str | None, zone: str) -> str:
    """When a job created without firstRun is first due: now, or a CRON
    rule's first moment after now."""
    if rule is None or not cron.is_cron(rule):
        return ctx.now_ms
    try:
        return schedule.cron_run(ctx, rule, zone)
    except RepeatStalled as stalled:
        raise CommandError(f"402 Malformed repeat: {stalled.reason}") from None


def _check_cost_fits(ctx: Context, name: str, cost: int) -> None:
    """A job that costs more than a limit on its name holds can never run."""
    limits = ctx.store.limits
    if not limits:
        return
    index = flow.index_of(ctx.store)
    # The usual job (cost 1) fits every limit without matching a pattern.
    if cost <= index.min_capacity:
        return
    for pattern in index.verdict(name).limits:
        capacity = index.limits[pattern]
        if cost > capacity:
            # Escaped as a header value: a pattern may hold a line break.
            raise CommandError(f"402 Cost {cost} exceeds limit {escape(pattern)} (max {capacity})")


def _parent_id(request: Request) -> int:
    text = params.present(request, "parentJobID")
    if text is None or text == "0":
        return 0
    return params.parse_job_id(text, "parentJobID")


def _parent(ctx: Context, parent_id: int) -> Job:
    parent = ctx.store.get(parent_id)
    if parent is None:
        raise CommandError("404 parentJobID does not exist")
    if parent.state not in (*ACTIVE, State.PAUSED):
        raise CommandError(
            "405 Can only create child job when parent is RUNNING, RUNQUEUED or PAUSED"
        )
    if parent.parentJobID:
        raise CommandError("405 Cannot create grandchildren")
    return parent


def _update_unique(
    ctx: Context,
    request: Request,
    existing: Job,
    parent_id: int,
    data: str | None,
    rule: str | None,
    priority: int | None,
) -> None:
    """unique=true found a job of this name: merge the new data into it."""
    if existing.parentJobID and existing.parentJobID != parent_id:
        raise CommandError(
            "404 Trying to create a child that already exists, but it is tied to a different parent"
        )
    if data is None or data == existing.data:
        return
    overwrite = params.present(request, "overwrite")
    if overwrite is not None and not params.is_true(overwrite):
        return
    changes: dict[str, Any] = {"data": json_patch(existing.data, data)}
    if rule is not None:
        changes["repeat"] = rule
    if priority is not None:
        changes["priority"] = priority
    ctx.store.update(existing.jobID, **changes)


# Handing out and looking at jobs.


def query_job(ctx: Context, request: Request) -> Response:
    job = load_job(ctx, request)
    shown = job_object(job, with_state=True)
    if cron.is_cron(job.repeat):
        shown["nextRuns"] = schedule.cron_upcoming(ctx.now, job)
    return ok(shown)


def update_job(ctx: Context, request: Request) -> Response:
    job_id = params.job_id(request)
    if params.present(request, "data") is None:
        raise CommandError("402 Missing data")
    data = params.data(request)
    rule = params.repeat_rule(request)
    priority = params.priority(request, "jobPriority")
    next_run = params.time(request, "nextRun")
    job = ctx.store.get(job_id)
    if job is None:
        raise CommandError("404 No job with this jobID")
    check_lease(request, job)
    changes: dict[str, Any] = {"data": data}
    if next_run is None and rule is not None:
        # Not a run: the moment may be the one the job already has.
        next_run = schedule.next_run_from_repeat(ctx, job, rule)
    if params.is_true(request.get("shouldClearRepeat")):
        changes["repeat"] = ""
    elif rule is not None:
        changes["repeat"] = rule
    if priority is not None:
        changes["priority"] = priority
    lifecycle.update(ctx, job, next_run, **changes)
    return ok()


# Reporting on a job that was handed out.


def finish_job(ctx: Context, request: Request) -> Response:
    return _finish_or_retry(ctx, request, retry=False)


def retry_job(ctx: Context, request: Request) -> Response:
    return _finish_or_retry(ctx, request, retry=True)


# The savepoint of one FinishJobs element, inside the writer's own.
_ELEMENT = "element"


def finish_jobs(ctx: Context, request: Request) -> Response:
    """FinishJob for each element of `jobs`, in order, each with its own
    outcome: an element that fails undoes its own writes and no others."""
    elements = _job_list(request)
    if len(elements) > MAX_FINISH_JOBS:
        raise CommandError(f"413 Too many jobs (max {MAX_FINISH_JOBS})")
    reports = [params.from_json(element, "FinishJob") for element in elements]
    results = [_finish_element(ctx, report) for report in reports]
    return _naming_ignored(ok({"results": results}), reports)


def _finish_element(ctx: Context, request: Request) -> dict[str, Any]:
    part = ctx.part()
    ctx.store.savepoint(_ELEMENT)
    # Only FinishJob's answers are an element's own. Anything else (the
    # database failing, a bug) fails the whole request, and the writer
    # undoes all of it, this savepoint included.
    try:
        status = finish_job(part, request).status
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
    if job.state not in ACTIVE:
        raise CommandError("405 Can only retry/finish RUNNING and RUNQUEUED jobs")
    parent = ctx.store.get(job.parentJobID) if job.parentJobID else None
    if parent is not None and parent.state != State.PAUSED:
        raise CommandError("405 Can only retry/finish child job when parent is PAUSED")
    new_data = params.data(request) if params.present(request, "data") else None
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
    if job.maxAttempts:
        # A run that ended well, or that its worker chose to retry, did not
        # fail: the next run gets every attempt again.
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
        lifecycle.retry(ctx, job, next_run, **changes)
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
    if job.state not in ACTIVE:
        raise CommandError("405 Can only fail RUNNING or RUNQUEUED jobs")
    data = params.data(request) if params.present(request, "data") else None
    error = params.error_text(request, data)
    lifecycle.fail_attempt(ctx, job, error, **({} if data is None else {"data": data}))
    return ok()


def touch_job(ctx: Context, request: Request) -> Response:
    """Extend a lease: the job is due again only retryAfter from now. A
    RUNNING job's report restarts the stale-job safety net's count."""
    job = load_job(ctx, request)
    check_lease(request, job)
    if job.state == State.RUNNING:
        return _touch_running(ctx, job)
    if job.state != State.RUNQUEUED:
        raise CommandError("405 Can only touch RUNNING or RUNQUEUED jobs")
    try:
        next_run = schedule.lease_end(ctx, job, schedule.due_moment(job))
    except RepeatStalled as stalled:
        # Returned, not raised, so that the failure stays: a lease that
        # ends at once would hand the job to another worker right away.
        lifecycle.fail(ctx, job, str(stalled))
        return Response(f"402 Malformed repeat: {stalled.reason}; the job failed")
    if next_run is None:
        raise CommandError("502 Failed to compute nextRun")
    lifecycle.extend_lease(ctx, job, next_run)
    return ok({"nextRun": next_run})


def _touch_running(ctx: Context, job: Job) -> Response:
    lifecycle.note_report(ctx, job)
    seconds = ctx.settings.stale_after
    if not seconds:
        return ok({})
    return ok({"staleAt": schedule.retry_time(ctx, seconds)})


def cancel_job(ctx: Context, request: Request) -> Response:
    job = load_job(ctx, request)
    if ctx.store.has_children(job.jobID):
        raise CommandError("404 Invalid jobID - Cannot cancel a job with children")
    if not job.parentJobID:
        raise CommandError("404 Invalid jobID - Cannot cancel a job without a parent")
    if job.state in (State.FINISHED, State.RUNNING, State.PAUSED):
        return ok()
    lifecycle.cancel(ctx, job)
    parent = ctx.store.get(job.parentJobID)
    if parent is not None:
        # PAUSED siblings do not hold the parent back here, as in Bedrock.
        lifecycle.resume_parent_if_done(ctx, parent, (State.QUEUED, *ACTIVE))
    return ok()


def delete_job(ctx: Context, request: Request) -> Response:
    job = load_job(ctx, request)
    if job.state == State.RUNNING:
        raise CommandError("405 Can't delete a RUNNING job")
    if job.state == State.PAUSED:
        raise CommandError("405 Can't delete a parent jobs with children running")
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


# Flow control (protocol.md 14.7 to 14.9).


def set_limit(ctx: Context, request: Request) -> Response:
    """Set, change or (max 0) remove a concurrency limit. A new one past
    --max-limits is refused; changing or removing one always works."""
    pattern = params.pattern(request)
    capacity = params.capacity(request)
    limits = ctx.store.limits
    most = ctx.settings.max_limits
    if capacity and pattern not in limits and len(limits) >= most:
        raise CommandError(f"413 Too many limits (max {most})")
    ctx.store.set_limit(pattern, capacity)
    # A higher or removed limit may let waiting jobs run.
    ctx.wake_all()
    return ok()


def pause_jobs(ctx: Context, request: Request) -> Response:
    """Pause a pattern. A new one past --max-limits paused patterns is
    refused: every candidate of a GetJob is matched against them."""
    pattern = params.pattern(request)
    paused = ctx.store.paused
    most = ctx.settings.max_limits
    if pattern not in paused and len(paused) >= most:
        raise CommandError(f"413 Too many paused patterns (max {most})")
    ctx.store.pause(pattern)
    return ok()


def resume_jobs(ctx: Context, request: Request) -> Response:
    if ctx.store.resume(params.pattern(request)):
        ctx.wake_all()
    return ok()
