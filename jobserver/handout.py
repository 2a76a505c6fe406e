"""Handing jobs out: GetJob and GetJobs selection, retryAfter leases, replies.

A job handed out without retryAfter becomes RUNNING. With retryAfter it
becomes RUNQUEUED and its nextRun moves to the end of the lease: if its
worker never reports, the job is simply due again then, and the same timer
that wakes waiters for future jobs hands it to the next worker. Each such
automatic hand-out is counted in the job's data; the tenth fails the job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import jsonbody, params, repeat, times
from .context import Context
from .errors import CommandError
from .jsonbody import Raw
from .protocol import Request, Response
from .store import Job

# Bedrock's limit: a job whose lease expired this many times without a
# report is failed instead of being handed out again.
MAX_LEASES = 10

# Names with this prefix are retried forever and never counted, as in Bedrock.
UNCOUNTED_PREFIX = "manual"

PENDING_STATES = ("QUEUED", "RUNQUEUED", "RUNNING", "PAUSED")


@dataclass(frozen=True)
class JobQuery:
    """Which jobs a GetJob or GetJobs asks for."""

    pattern: str | None
    names: tuple[str, ...]
    priority: int | None
    limit: int

    @property
    def selector(self) -> tuple[object, ...]:
        """What the query matches, whatever its limit."""
        return (self.pattern, self.names, self.priority)

    @property
    def priorities(self) -> tuple[int, ...]:
        return params.PRIORITIES if self.priority is None else (self.priority,)


def job_query(request: Request, limit: int = 1) -> JobQuery:
    """`name` is a GLOB pattern, or a comma list of exact names."""
    pattern = params.require(request, "name")
    if len(pattern.encode("utf-8")) > params.MAX_PATTERN:
        raise CommandError("402 Malformed name")
    priority = params.priority(request, "jobPriority")
    names = tuple(n.lstrip(" ") for n in pattern.split(",") if n.lstrip(" "))
    if len(names) > 1:
        return JobQuery(None, names, priority, limit)
    return JobQuery(pattern, (), priority, limit)


def query_for(request: Request) -> tuple[JobQuery, bool]:
    """The query of a GetJob or GetJobs request, and whether it is GetJobs."""
    many = request.verb.lower() == "getjobs"
    if many:
        return job_query(request, params.num_results(request)), True
    if request.has("numResults"):
        raise CommandError("402 Cannot use numResults with GetJob; try GetJobs")
    return job_query(request), False


@dataclass
class Taken:
    """A job as it was before it was handed out, and its reply object."""

    job: Job
    reply: dict[str, Any]


@dataclass
class Handout(Response):
    """A reply that hands out jobs: if it cannot be delivered, the server
    gives `taken` back to the queue."""

    taken: list[Taken] = field(default_factory=list)


def reply(taken: list[Taken], many: bool) -> Handout:
    objects = [t.reply for t in taken]
    body = {"jobs": objects} if many else objects[0]
    return Handout("200 OK", jsonbody.encode(body), taken=taken)


def job_object(job: Job, with_state: bool = False) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "created": job.created,
        "data": Raw(job.data),
        "jobID": job.jobID,
        "lastRun": job.lastRun or "",
        "name": job.name,
        "nextRun": job.nextRun,
        "priority": job.priority,
        "repeat": job.repeat,
        "retryAfter": job.retryAfter,
    }
    if with_state:
        obj["state"] = job.state
    return obj


def dequeue(ctx: Context, query: JobQuery) -> list[Taken]:
    """Take up to `query.limit` due jobs, highest priority first.

    Jobs that run out of leases on the way are failed and skipped, and the
    search goes on, so a GetJob gets a job whenever one can be had.
    """
    taken: list[Taken] = []
    while len(taken) < query.limit:
        candidates = ctx.store.find_ready(
            now=ctx.now_ms,
            priorities=query.priorities,
            limit=query.limit - len(taken),
            pattern=query.pattern,
            names=query.names,
        )
        if not candidates:
            break
        for job in candidates:
            obj = _handout_object(ctx, job)
            if _start(ctx, job):
                taken.append(Taken(job, obj))
    return taken


def _handout_object(ctx: Context, job: Job) -> dict[str, Any]:
    obj = job_object(job)
    if job.parentJobID:
        parent = ctx.store.get(job.parentJobID)
        obj["parentJobID"] = job.parentJobID
        obj["parentData"] = Raw(parent.data if parent else "{}")
    done = ctx.store.children(job.jobID, ("FINISHED", "CANCELLED"))
    if done:
        finished = [c for c in done if c.state == "FINISHED"]
        cancelled = [c for c in done if c.state == "CANCELLED"]
        obj["finishedChildJobs"] = [_child(c) for c in finished]
        obj["cancelledChildJobs"] = [_child(c) for c in cancelled]
    return obj


def _child(job: Job) -> dict[str, Any]:
    return {"data": Raw(job.data), "jobID": job.jobID}


def _start(ctx: Context, job: Job) -> bool:
    """Mark a job as handed out; False if it was failed instead."""
    if not job.retryAfter:
        ctx.store.update(job.jobID, state="RUNNING", lastRun=ctx.now_s)
        return True
    data = jsonbody.parse_object(job.data)
    counted = not job.name.startswith(UNCOUNTED_PREFIX)
    count = data.get("retryAfterCount", 0) if counted else 0
    if not isinstance(count, int) or isinstance(count, bool):
        count = 0
    if count >= MAX_LEASES:
        ctx.store.update(job.jobID, state="FAILED")
        return False
    next_run = _lease_end(ctx, job)
    if next_run is None:
        # A stored time SQLite cannot read (imported from elsewhere, written
        # by hand) must not block the queue: fail the job, as Bedrock does.
        ctx.store.update(job.jobID, state="FAILED")
        return False
    if counted:
        data["retryAfterCount"] = count + 1
        if "SCHEDULED" in job.repeat:
            data["originalNextRun"] = job.nextRun
    ctx.store.update(
        job.jobID,
        state="RUNQUEUED",
        lastRun=ctx.now_s,
        nextRun=next_run,
        data=jsonbody.compact(data),
    )
    ctx.scheduled(job.name, next_run)
    return True


def _lease_end(ctx: Context, job: Job) -> str | None:
    """now + retryAfter, or the next repeat if that comes first; None when
    the job's stored times cannot be computed with."""
    try:
        end = ctx.store.datetime_after(ctx.now_s, repeat.parse_modifiers(job.retryAfter))
        if end is not None and job.repeat:
            started = Job(**{**job.__dict__, "lastRun": ctx.now_s})
            end = min(end, next_run_from_repeat(ctx, started, job.repeat))
    except (CommandError, ValueError):
        return None
    return end


def next_run_from_repeat(ctx: Context, job: Job, rule_text: str) -> str:
    """When a job with this repeat runs next, counted from its base."""
    rule = repeat.parse_repeat(rule_text)
    scheduled = job.nextRun
    if rule.base == "SCHEDULED" and job.retryAfter:
        original = jsonbody.parse_object(job.data).get("originalNextRun")
        if isinstance(original, str):
            scheduled = original
    if rule.base == "SCHEDULED":
        # Whole seconds, like every time DATETIME() computes: a base with
        # milliseconds would make each interval a fraction short.
        scheduled = scheduled[:19]
        base = scheduled
    elif rule.base == "STARTED":
        base = job.lastRun or ctx.now_s
    else:
        base = ctx.now_s
    computed = ctx.store.datetime_after(base, rule.modifiers)
    if computed is None:
        raise CommandError("502 Failed to compute nextRun")
    if rule.base == "SCHEDULED" and rule.only_offsets:
        try:
            last = times.parse_stored(scheduled)
        except ValueError:
            raise CommandError("502 Failed to compute nextRun") from None
        computed = times.to_seconds(repeat.reanchor(last, times.parse_stored(computed), ctx.now))
    return computed


def serve_waiters(
    ctx: Context, queries: list[JobQuery]
) -> tuple[list[list[Taken] | None], str | None]:
    """Try waiting GetJobs oldest first. A selector that found nothing is
    not tried again in the same pass, so ten thousand waiters on one name
    cost one query, not ten thousand."""
    empty: set[tuple[object, ...]] = set()
    handed: list[list[Taken] | None] = []
    for query in queries:
        taken = [] if query.selector in empty else dequeue(ctx, query)
        if not taken:
            empty.add(query.selector)
        handed.append(taken or None)
    return handed, ctx.store.next_due(ctx.now_ms)


def give_back(ctx: Context, taken: list[Taken]) -> None:
    """Undo a hand-out whose reply never reached its client."""
    for item in taken:
        job = item.job
        current = ctx.store.get(job.jobID)
        if current is None or current.state not in ("RUNNING", "RUNQUEUED"):
            continue
        ctx.store.update(
            job.jobID, state=job.state, nextRun=job.nextRun, lastRun=job.lastRun, data=job.data
        )
        ctx.scheduled(job.name, job.nextRun)
