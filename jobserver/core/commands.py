"""One function per command: check the request, use the store, build the reply.

Handlers run inside a transaction that the writer owns; they never commit
and never touch a socket. A handler returns a `Response` or raises
`CommandError`, whose status line is the reply and whose raise undoes every
change the handler made. Status lines are Bedrock's, word for word.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jobserver.core import handout, params, replies
from jobserver.core.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.globmatch import glob_match
from jobserver.core.handout import (
    PENDING_STATES,
    RepeatStalled,
    fail_stalled,
    freed,
    in_window,
    lease_end,
    next_run_from_repeat,
)
from jobserver.storage.sqlite import Job
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request, Response, escape

Handler = Callable[[Context, Request], Response]


def ok(body: Any = None) -> Response:
    return Response("200 OK", b"" if body is None else jsonbody.encode(body))


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
    for element in elements:
        if not any(key.lower() == "name" for key in element):
            raise CommandError("402 Missing name")
        ids.append(_create(ctx, params.from_json(element)))
    return ok({"jobIDs": ids})


def _job_list(request: Request) -> list[dict[str, Any]]:
    text = params.present(request, "jobs")
    try:
        elements = jsonbody.parse(text) if text is not None else None
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
    next_run = first_run or ctx.now_ms
    if flow.windows:
        next_run = in_window(flow.windows, flow.zone, next_run)
    # A child of a running parent waits until the parent finishes.
    state = "PAUSED" if parent is not None and parent.state != "PAUSED" else "QUEUED"
    job_id = ctx.store.insert(
        created=ctx.now_s,
        state=state,
        name=name,
        next_run=next_run,
        repeat=rule or "",
        data=data if data is not None else "{}",
        priority=params.DEFAULT_PRIORITY if priority is None else priority,
        parent_id=parent_id,
        retry_after=retry_after,
        policy=policy,
        flow=flow,
    )
    if state == "QUEUED":
        ctx.scheduled(name, next_run)
    return job_id


def _check_cost_fits(ctx: Context, name: str, cost: int) -> None:
    """A job that costs more than a limit on its name holds can never run."""
    for pattern, capacity in ctx.store.limits.items():
        if cost > capacity and glob_match(pattern, name):
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
    if parent.state not in ("RUNNING", "RUNQUEUED", "PAUSED"):
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
    changes: dict[str, Any] = {"data": ctx.store.json_patch(existing.data, data)}
    if rule is not None:
        changes["repeat"] = rule
    if priority is not None:
        changes["priority"] = priority
    ctx.store.update(existing.jobID, **changes)


# Handing out and looking at jobs.


def get_job(ctx: Context, request: Request) -> Response:
    query, many = handout.query_for(request)
    taken = handout.dequeue(ctx, query)
    if not taken:
        # Returned, not raised: jobs failed on the way (out of leases) must
        # stay failed, and raising would roll that back.
        return Response("404 No job found")
    return handout.reply(taken, many)


def query_job(ctx: Context, request: Request) -> Response:
    return ok(handout.job_object(load_job(ctx, request), with_state=True))


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
        try:
            next_run = next_run_from_repeat(ctx, job, rule)
        except RepeatStalled as stalled:
            raise CommandError(f"402 Malformed repeat: {stalled.reason}") from None
    if next_run is not None:
        changes["nextRun"] = next_run
        # A waiting job's nextRun is its reply deadline: the clock must
        # hear of it as of any other due time.
        if job.state in ("QUEUED", "RUNQUEUED", "WAITING"):
            ctx.scheduled(job.name, next_run)
    if params.is_true(request.get("shouldClearRepeat")):
        changes["repeat"] = ""
    elif rule is not None:
        changes["repeat"] = rule
    if priority is not None:
        changes["priority"] = priority
    if job.state == "RUNNING":
        # A report: the stale-job safety net counts from now.
        changes["lastReport"] = ctx.now_ms
    ctx.store.update(job_id, **changes)
    return ok()


# Reporting on a job that was handed out.


def finish_job(ctx: Context, request: Request) -> Response:
    return _finish_or_retry(ctx, request, retry=False)


def retry_job(ctx: Context, request: Request) -> Response:
    return _finish_or_retry(ctx, request, retry=True)


def _finish_or_retry(ctx: Context, request: Request, retry: bool) -> Response:
    job = load_job(ctx, request)
    check_lease(request, job)
    if job.state not in ("RUNNING", "RUNQUEUED"):
        raise CommandError("405 Can only retry/finish RUNNING and RUNQUEUED jobs")
    parent = ctx.store.get(job.parentJobID) if job.parentJobID else None
    if parent is not None and parent.state != "PAUSED":
        raise CommandError("405 Can only retry/finish child job when parent is PAUSED")
    new_data = params.data(request) if params.present(request, "data") else None
    # Most jobs never have children: one look spares the two child queries.
    has_children = ctx.store.has_children(job.jobID)
    if has_children:
        ctx.store.delete_children(job.jobID, ("FINISHED", "CANCELLED"))
    text = new_data or job.data
    asks_delete = False
    # Parsed only when it may hold what this step looks at or removes.
    if '"retryAfterCount"' in text or '"delete"' in text:
        data = jsonbody.parse_object(text)
        asks_delete = data.get("delete") is True
        data.pop("retryAfterCount", None)
        text = jsonbody.compact(data)
    changes: dict[str, Any] = {"data": text}
    if job.maxAttempts:
        # A run that ended well, or that its worker chose to retry, did not
        # fail: the next run gets every attempt again.
        changes["attempts"] = 0
    if not retry and has_children and ctx.store.has_children(job.jobID, PENDING_STATES):
        _pause_for_children(ctx, job, changes)
        return ok()
    if retry:
        changes.update(_renamed(request))
    try:
        next_run = _next_run(ctx, request, job, retry, use_repeat=not asks_delete)
    except RepeatStalled as stalled:
        # The report is taken; the job would loop, so it ends here.
        fail_stalled(ctx, job, stalled, **changes)
        return ok()
    freed(ctx, job)
    if next_run is not None:
        next_run = in_window(job.timeWindows, job.timeZone, next_run)
        ctx.store.update(job.jobID, state="QUEUED", nextRun=next_run, **changes)
        ctx.scheduled(changes.get("name", job.name), next_run)
    elif parent is not None:
        ctx.store.update(job.jobID, state="FINISHED", **changes)
        _resume_parent_if_done(ctx, parent, PENDING_STATES)
    elif ctx.settings.keep_finished:
        # Retention (protocol.md 14.10): kept with its final data until
        # the pruner deletes it.
        ctx.store.update(job.jobID, state="FINISHED", ended=ctx.now_s, **changes)
    else:
        ctx.store.delete(job.jobID)
    return ok()


def _pause_for_children(ctx: Context, job: Job, changes: dict[str, Any]) -> None:
    """A parent that finishes waits, PAUSED, for its children to run."""
    next_run = job.lastRun or ctx.now_s
    ctx.store.update(job.jobID, state="PAUSED", nextRun=next_run, **changes)
    for child in ctx.store.children(job.jobID, ("PAUSED",)):
        ctx.store.update(child.jobID, state="QUEUED")
        ctx.scheduled(child.name, child.nextRun)


def _resume_parent_if_done(ctx: Context, parent: Job, pending: tuple[str, ...]) -> None:
    if parent.state == "PAUSED" and not ctx.store.has_children(parent.jobID, pending):
        ctx.store.update(parent.jobID, state="QUEUED")
        ctx.scheduled(parent.name, parent.nextRun)


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
        return next_run_from_repeat(ctx, job, job.repeat)
    if not retry:
        return None
    next_run = params.time(request, "nextRun")
    if next_run is not None:
        return next_run
    delay = params.delay_seconds(request)
    later = ctx.store.datetime_after(ctx.now_s, [f"+{delay} SECONDS"])
    assert later is not None
    return later


def fail_job(ctx: Context, request: Request) -> Response:
    """FAILED; or, for a job whose retry policy has attempts left, QUEUED
    again after its backoff delay."""
    job = load_job(ctx, request)
    check_lease(request, job)
    if job.state not in ("RUNNING", "RUNQUEUED"):
        raise CommandError("405 Can only fail RUNNING or RUNQUEUED jobs")
    data = params.data(request) if params.present(request, "data") else None
    error = params.error_text(request, data)
    handout.fail_run(ctx, job, error, **({} if data is None else {"data": data}))
    return ok()


def touch_job(ctx: Context, request: Request) -> Response:
    """Extend a lease: the job is due again only retryAfter from now. A
    RUNNING job's report restarts the stale-job safety net's count."""
    job = load_job(ctx, request)
    check_lease(request, job)
    if job.state == "RUNNING":
        return _touch_running(ctx, job)
    if job.state != "RUNQUEUED":
        raise CommandError("405 Can only touch RUNNING or RUNQUEUED jobs")
    try:
        next_run = lease_end(ctx, job)
    except RepeatStalled as stalled:
        # Returned, not raised, so that the failure stays: a lease that
        # ends at once would hand the job to another worker right away.
        fail_stalled(ctx, job, stalled)
        return Response(f"402 Malformed repeat: {stalled.reason}; the job failed")
    if next_run is None:
        raise CommandError("502 Failed to compute nextRun")
    ctx.store.update(job.jobID, nextRun=next_run)
    ctx.scheduled(job.name, next_run)
    return ok({"nextRun": next_run})


def _touch_running(ctx: Context, job: Job) -> Response:
    ctx.store.update(job.jobID, lastReport=ctx.now_ms)
    handout.watch_for_staleness(ctx)
    seconds = ctx.settings.stale_after
    if not seconds:
        return ok({})
    return ok({"staleAt": handout.retry_time(ctx, seconds)})


def cancel_job(ctx: Context, request: Request) -> Response:
    job = load_job(ctx, request)
    if ctx.store.has_children(job.jobID):
        raise CommandError("404 Invalid jobID - Cannot cancel a job with children")
    if not job.parentJobID:
        raise CommandError("404 Invalid jobID - Cannot cancel a job without a parent")
    if job.state in ("FINISHED", "RUNNING", "PAUSED"):
        return ok()
    ctx.store.update(job.jobID, state="CANCELLED")
    parent = ctx.store.get(job.parentJobID)
    if parent is not None:
        # PAUSED siblings do not hold the parent back here, as in Bedrock.
        _resume_parent_if_done(ctx, parent, ("QUEUED", "RUNQUEUED", "RUNNING"))
    return ok()


def delete_job(ctx: Context, request: Request) -> Response:
    job = load_job(ctx, request)
    if job.state == "RUNNING":
        raise CommandError("405 Can't delete a RUNNING job")
    if job.state == "PAUSED":
        raise CommandError("405 Can't delete a parent jobs with children running")
    freed(ctx, job)
    ctx.store.delete(job.jobID)
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
        # A revived job gets every attempt of its retry policy again.
        next_run = in_window(job.timeWindows, job.timeZone, job.created)
        ctx.store.update(job_id, state="QUEUED", nextRun=next_run, attempts=0, **changes)
        ctx.scheduled(changes.get("name", job.name), next_run)
        freed(ctx, job)
    return ok()


def failed_jobs(ctx: Context, request: Request) -> Response:
    """The dead set: FAILED jobs whose name matches, with their last error."""
    pattern, names = handout.name_selector(params.present(request, "name") or "*")
    found = ctx.store.failed(pattern=pattern, names=names, limit=params.limit(request))
    return ok({"jobs": [_failed_object(job) for job in found]})


def _failed_object(job: Job) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "created": job.created,
        "jobID": job.jobID,
        "lastError": job.lastError,
        "lastRun": job.lastRun or "",
        "name": job.name,
    }
    if job.maxAttempts:
        obj["attempt"] = job.attempts
        obj["maxAttempts"] = job.maxAttempts
    return obj


# Flow control (protocol.md 14.7 to 14.9).


def set_limit(ctx: Context, request: Request) -> Response:
    """Set, change or (max 0) remove a concurrency limit."""
    pattern = params.pattern(request)
    capacity = params.capacity(request)
    ctx.store.set_limit(pattern, capacity)
    # A higher or removed limit may let waiting jobs run.
    ctx.wake_all()
    return ok()


def pause_jobs(ctx: Context, request: Request) -> Response:
    ctx.store.pause(params.pattern(request))
    return ok()


def resume_jobs(ctx: Context, request: Request) -> Response:
    if ctx.store.resume(params.pattern(request)):
        ctx.wake_all()
    return ok()


COMMANDS: dict[str, Handler] = {
    "createjob": create_job,
    "createjobs": create_jobs,
    "getjob": get_job,
    "getjobs": get_job,
    "queryjob": query_job,
    "updatejob": update_job,
    "finishjob": finish_job,
    "retryjob": retry_job,
    "failjob": fail_job,
    "canceljob": cancel_job,
    "deletejob": delete_job,
    "requeuejobs": requeue_jobs,
    "touchjob": touch_job,
    "failedjobs": failed_jobs,
    "setlimit": set_limit,
    "pausejobs": pause_jobs,
    "resumejobs": resume_jobs,
    "awaitreply": replies.await_reply,
    "deliverreply": replies.deliver_reply,
}

WAITABLE = ("getjob", "getjobs")


def wants_wait(request: Request) -> bool:
    return request.verb.lower() in WAITABLE and (
        (request.get("connection") or "").lower() == "wait"
    )


def execute(ctx: Context, request: Request) -> Response:
    """Run one request in the writer."""
    return COMMANDS[request.verb.lower()](ctx, request)
