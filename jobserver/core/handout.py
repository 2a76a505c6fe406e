"""Handing jobs out: GetJob and GetJobs selection, retryAfter leases, replies.

A job handed out without retryAfter becomes RUNNING. With retryAfter it
becomes RUNQUEUED and its nextRun moves to the end of the lease: if its
worker never reports, the job is simply due again then, and the same timer
that wakes waiters for future jobs hands it to the next worker. Each such
automatic hand-out is counted in the job's data; the tenth fails the job.
A job with a retry policy counts its hand-outs in `attempts` instead, and
dies when an expired lease has used up its last attempt.

Every hand-out gets a fresh lease token (`leaseID`); reports that carry an
older one are refused, so a worker whose lease ran out cannot finish a job
that another worker now runs.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from jobserver.core import params, repeat, times, windows
from jobserver.core.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.globmatch import glob_match
from jobserver.storage.sqlite import Job
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request, Response
from jobserver.wire.jsonbody import Raw

# Bedrock's limit: a job whose lease expired this many times without a
# report is failed instead of being handed out again.
MAX_LEASES = 10

# Names with this prefix are retried forever and never counted, as in Bedrock.
UNCOUNTED_PREFIX = "manual"

# A WAITING child (protocol.md 14.11) holds its parent back like a running one.
PENDING_STATES = ("QUEUED", "RUNQUEUED", "RUNNING", "PAUSED", "WAITING")

# Random bytes per lease token: 2^64 tokens make a collision between two
# hand-outs of one job practically impossible.
LEASE_BYTES = 8

# Exponential backoff adds up to this fraction of the delay, so jobs that
# failed together do not all come back in the same instant.
JITTER = 0.1
# 2^64 times any allowed base is far beyond any cap: larger exponents only
# risk overflowing a float.
MAX_EXPONENT = 64

# A GetJob passes over at most this many due jobs that a concurrency limit
# holds back before it gives up: the search stays bounded (one query's
# bound parameters) even when a limit blocks a long queue of heavy jobs.
MAX_SKIPPED = 1000

# The last error of a job whose lease ran out without a report.
LEASE_EXPIRED = "lease expired without a report"


@dataclass(frozen=True)
class JobQuery:
    """Which jobs a GetJob or GetJobs asks for."""

    pattern: str | None
    names: tuple[str, ...]
    priority: int | None
    limit: int
    # Put each job's lease token in its reply object (`includeLeaseID`).
    include_lease_id: bool = False

    @property
    def selector(self) -> tuple[object, ...]:
        """What the query matches, whatever its limit."""
        return (self.pattern, self.names, self.priority)

    @property
    def priorities(self) -> tuple[int, ...]:
        return params.PRIORITIES if self.priority is None else (self.priority,)


def job_query(request: Request, limit: int = 1) -> JobQuery:
    pattern, names = name_selector(params.require(request, "name"))
    priority = params.priority(request, "jobPriority")
    return JobQuery(pattern, names, priority, limit)


def name_selector(text: str) -> tuple[str | None, tuple[str, ...]]:
    """A `name` parameter as a GLOB pattern, or as a comma list of exact
    names when it has more than one item: (pattern, ()) or (None, names)."""
    if len(text.encode("utf-8")) > params.MAX_PATTERN:
        raise CommandError("402 Malformed name")
    names = tuple(n.lstrip(" ") for n in text.split(",") if n.lstrip(" "))
    if len(names) > 1:
        return None, names
    return text, ()


def query_for(request: Request) -> tuple[JobQuery, bool]:
    """The query of a GetJob or GetJobs request, and whether it is GetJobs."""
    many = request.verb.lower() == "getjobs"
    if many:
        query = job_query(request, params.num_results(request))
    elif request.has("numResults"):
        raise CommandError("402 Cannot use numResults with GetJob; try GetJobs")
    else:
        query = job_query(request)
    if params.is_true(request.get("includeLeaseID")):
        query = replace(query, include_lease_id=True)
    return query, many


@dataclass
class Taken:
    """A job as it was before it was handed out, and its reply object."""

    job: Job
    reply: dict[str, Any]
    # This hand-out's lease token.
    lease: str
    # The data and nextRun the hand-out wrote: a give-back restores them
    # only if nobody changed them since (an UpdateJob it must not undo).
    handed_data: str
    handed_next_run: str


@dataclass
class Handout(Response):
    """A reply that hands out jobs: if it cannot be delivered, the server
    gives `taken` back to the queue."""

    taken: list[Taken] = field(default_factory=list)


def reply(taken: list[Taken], many: bool) -> Handout:
    """The reply, with the lease tokens in a `leaseID` header when a job
    has a lease or the request asked for them: a plain Bedrock hand-out of
    jobs without retryAfter stays the same byte for byte."""
    objects = [t.reply for t in taken]
    body = {"jobs": objects} if many else objects[0]
    headers = {}
    if any(t.job.retryAfter or "leaseID" in t.reply for t in taken):
        headers["leaseID"] = ",".join(t.lease for t in taken)
    return Handout("200 OK", jsonbody.encode(body), headers, taken=taken)


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
        if job.maxAttempts:
            # Only jobs with a policy: Bedrock's ten keys stay as they are.
            obj["attempt"] = job.attempts
            obj["maxAttempts"] = job.maxAttempts
            obj["lastError"] = job.lastError
            obj["retryBackoff"] = job.retryBackoff
            obj["retryDelay"] = _number(job.retryDelay)
            obj["retryMaxDelay"] = _number(job.retryMaxDelay)
    if with_state and job.state == "WAITING":
        # The deadline is the nextRun; named again so nobody has to know.
        obj["replyKey"] = job.replyKey
        obj["replyDeadline"] = job.nextRun
    # Flow control, only for jobs that use it.
    if job.cost != 1:
        obj["cost"] = job.cost
    if job.timeWindows:
        obj["timeWindows"] = job.timeWindows
        obj["timeZone"] = job.timeZone
    return obj


def _number(value: float) -> int | float:
    """Seconds as the client most likely wrote them: 30, not 30.0."""
    return int(value) if value.is_integer() else value


def backoff_delay(job: Job, attempt: int, rng: Callable[[], float] = random.random) -> float:
    """Seconds before a job whose `attempt` failed runs again.

    fixed: retryDelay. exponential: retryDelay x 2^(attempt - 1), at most
    retryMaxDelay, plus up to JITTER of that; `rng` gives a number in
    [0, 1), so the result lies in [delay, delay x (1 + JITTER)].
    """
    if job.retryBackoff == "fixed":
        return job.retryDelay
    exponent = min(max(attempt, 1) - 1, MAX_EXPONENT)
    delay = min(job.retryDelay * 2.0**exponent, job.retryMaxDelay)
    return delay * (1 + JITTER * rng())


def retry_time(ctx: Context, delay: float) -> str:
    """now + delay, to the millisecond, as nextRun is stored."""
    return times.to_millis(ctx.now + timedelta(seconds=delay))


def fail_run(ctx: Context, job: Job, error: str, **changes: Any) -> None:
    """A run of `job` failed with `error`: FAILED; or, with a retry policy
    that has attempts left, QUEUED again after its backoff delay."""
    changes.update(state="FAILED", lastError=error, ended=ctx.now_s)
    freed(ctx, job)
    if job.maxAttempts and job.attempts < job.maxAttempts:
        delay = backoff_delay(job, job.attempts)
        next_run = in_window(job.timeWindows, job.timeZone, retry_time(ctx, delay))
        changes.update(state="QUEUED", nextRun=next_run)
        del changes["ended"]
        ctx.scheduled(job.name, next_run)
    ctx.store.update(job.jobID, **changes)


def dequeue(ctx: Context, query: JobQuery) -> list[Taken]:
    """Take up to `query.limit` due jobs, highest priority first.

    Jobs that run out of leases on the way are failed and skipped, and the
    search goes on, so a GetJob gets a job whenever one can be had. So are
    jobs outside their time window (moved to its next start), jobs of a
    paused pattern and jobs that would take a concurrency limit over its
    capacity (both left where they are).
    """
    store = ctx.store
    taken: list[Taken] = []
    # Flow control, only when some is set: a plain queue pays nothing.
    usage = _usage(ctx) if store.limits else {}
    skipped: list[int] = []
    while len(taken) < query.limit:
        blocked = [*store.paused, *(p for p, used in usage.items() if used >= store.limits[p])]
        candidates = store.find_ready(
            now=ctx.now_ms,
            priorities=query.priorities,
            limit=query.limit - len(taken),
            pattern=query.pattern,
            names=query.names,
            blocked=blocked,
            skipped=skipped,
        )
        if not candidates:
            break
        for job in candidates:
            if job.timeWindows and not _in_window(ctx, job):
                continue
            if usage and not _fits(store.limits, usage, job):
                skipped.append(job.jobID)
                continue
            obj = _handout_object(ctx, job)
            started = _start(ctx, job)
            if started is None:
                continue
            lease, handed_data, handed_next_run = started
            for pattern in usage:
                if glob_match(pattern, job.name):
                    usage[pattern] += job.cost
            if job.maxAttempts:
                obj["attempt"] = job.attempts + 1
                obj["maxAttempts"] = job.maxAttempts
            if query.include_lease_id:
                obj["leaseID"] = lease
            taken.append(Taken(job, obj, lease, handed_data, handed_next_run))
        if len(skipped) >= MAX_SKIPPED:
            break
    return taken


def _usage(ctx: Context) -> dict[str, int]:
    """What the running jobs use of each concurrency limit."""
    return {pattern: ctx.store.usage(pattern, ctx.now_ms) for pattern in ctx.store.limits}


def _fits(limits: dict[str, int], usage: dict[str, int], job: Job) -> bool:
    return all(
        usage[pattern] + job.cost <= capacity
        for pattern, capacity in limits.items()
        if glob_match(pattern, job.name)
    )


def _in_window(ctx: Context, job: Job) -> bool:
    """True if the job may run now; else it moves to its next window."""
    start = windows.place(job.timeWindows, job.timeZone, ctx.now)
    if start <= ctx.now:
        return True
    next_run = times.to_millis(start)
    ctx.store.update(job.jobID, nextRun=next_run)
    ctx.scheduled(job.name, next_run)
    return False


def in_window(time_windows: str, zone: str, next_run: str) -> str:
    """A nextRun for a job with these windows: `next_run`, or the start of
    the next window if `next_run` falls outside every window."""
    if not time_windows:
        return next_run
    try:
        moment = times.parse_stored(next_run)
    except ValueError:
        return next_run
    start = windows.place(time_windows, zone, moment)
    return next_run if start <= moment else times.to_millis(start)


def freed(ctx: Context, job: Job) -> None:
    """A running job stops running: if it held capacity of a concurrency
    limit, every waiting GetJob may now get a job."""
    limits = ctx.store.limits
    if job.state in ("RUNNING", "RUNQUEUED") and limits:
        if any(glob_match(pattern, job.name) for pattern in limits):
            ctx.wake_all()


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


def _start(ctx: Context, job: Job) -> tuple[str, str, str] | None:
    """Mark a job as handed out; its new lease token, and the data and
    nextRun it now has. None if the job was failed instead."""
    lease = secrets.token_hex(LEASE_BYTES)
    changes: dict[str, Any] = {"lastRun": ctx.now_s, "leaseID": lease}
    policy = job.maxAttempts > 0
    if policy:
        if job.state == "RUNQUEUED":
            # Due while still leased: the last attempt's lease ran out.
            changes["lastError"] = LEASE_EXPIRED
            if job.attempts >= job.maxAttempts:
                _fail(ctx, job, LEASE_EXPIRED)
                return None
        changes["attempts"] = job.attempts + 1
    if not job.retryAfter:
        ctx.store.update(job.jobID, state="RUNNING", lastReport=ctx.now_ms, **changes)
        watch_for_staleness(ctx)
        return lease, job.data, job.nextRun
    data = jsonbody.parse_object(job.data)
    counted = not job.name.startswith(UNCOUNTED_PREFIX)
    # A policy's maxAttempts replaces Bedrock's counter in the data.
    count_leases = counted and not policy
    count = data.get("retryAfterCount", 0) if count_leases else 0
    if not isinstance(count, int) or isinstance(count, bool):
        count = 0
    if count >= MAX_LEASES:
        _fail(ctx, job, f"out of leases: handed out {MAX_LEASES} times without a report")
        return None
    try:
        next_run = lease_end(ctx, job)
    except RepeatStalled as stalled:
        # A lease that ends at once would hand the job out again and again.
        _fail(ctx, job, str(stalled))
        return None
    if next_run is None:
        # A stored time SQLite cannot read (imported from elsewhere, written
        # by hand) must not block the queue: fail the job, as Bedrock does.
        _fail(ctx, job, "cannot compute the end of the lease")
        return None
    if count_leases:
        data["retryAfterCount"] = count + 1
    scheduled = counted and "SCHEDULED" in job.repeat
    if scheduled:
        data["originalNextRun"] = job.nextRun
    # A plain leased job's data is written back at every hand-out, as it
    # always was; a policy job's only when it records originalNextRun.
    if not policy or scheduled:
        changes["data"] = jsonbody.compact(data)
    ctx.store.update(job.jobID, state="RUNQUEUED", nextRun=next_run, **changes)
    ctx.scheduled(job.name, next_run)
    return lease, changes.get("data", job.data), next_run


class RepeatStalled(Exception):
    """A repeat rule gave a next run that is not later than its base (a
    rule stored before rules were checked, or one whose problem the
    checks' sample moments did not meet)."""

    def __init__(self, base: str, computed: str) -> None:
        # As the job's lastError.
        super().__init__(f"repeat rule did not move forward from {base} (gave {computed})")
        # As a status line's detail, worded like CreateJob's refusal.
        self.reason = f"does not move forward from {base} (gives {computed})"


def watch_for_staleness(ctx: Context) -> None:
    """A job became RUNNING or was reported on just now: the clock must fire
    when it would become stale (stale.py), unless it fires sooner anyway."""
    if ctx.settings.stale_after:
        ctx.fire_at(retry_time(ctx, ctx.settings.stale_after))


def _fail(ctx: Context, job: Job, error: str, **changes: Any) -> None:
    ctx.store.update(job.jobID, state="FAILED", lastError=error, ended=ctx.now_s, **changes)


def fail_stalled(ctx: Context, job: Job, stalled: RepeatStalled, **changes: Any) -> None:
    """A job whose repeat would run it again for the same base moment is
    FAILED, not queued: its retry policy would only meet the same rule."""
    freed(ctx, job)
    _fail(ctx, job, str(stalled), **changes)


def lease_end(ctx: Context, job: Job) -> str | None:
    """now + retryAfter, or the next repeat if that comes first; None when
    the job's stored times cannot be computed with. Raises RepeatStalled."""
    try:
        end = ctx.store.datetime_after(ctx.now_s, repeat.parse_modifiers(job.retryAfter))
        if end is not None and job.repeat:
            started = Job(**{**job.__dict__, "lastRun": ctx.now_s})
            end = min(end, next_run_from_repeat(ctx, started, job.repeat))
    except (CommandError, ValueError):
        return None
    return end


def next_run_from_repeat(ctx: Context, job: Job, rule_text: str) -> str:
    """When a job with this repeat runs next, counted from its base.
    Raises RepeatStalled when that is not later than the base."""
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
    # A job must never run twice for one base. Compared as SQLite writes
    # both (a base from the data may be written otherwise), text order is
    # time order.
    base = ctx.store.datetime_after(base, ()) or base
    if computed <= base:
        raise RepeatStalled(base, computed)
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
    """Undo a hand-out whose reply never reached its client. A job that has
    moved on since (its lease ran out and another worker has it, or it was
    requeued) is left alone, and data or a nextRun that an UpdateJob set
    meanwhile is kept: only this hand-out is undone."""
    for item in taken:
        job = item.job
        current = ctx.store.get(job.jobID)
        if current is None or current.state not in ("RUNNING", "RUNQUEUED"):
            continue
        if current.leaseID != item.lease:
            continue
        data = job.data if current.data == item.handed_data else current.data
        next_run = job.nextRun if current.nextRun == item.handed_next_run else current.nextRun
        ctx.store.update(
            job.jobID,
            state=job.state,
            nextRun=next_run,
            lastRun=job.lastRun,
            data=data,
            attempts=job.attempts,
            lastError=job.lastError,
            leaseID=job.leaseID,
            lastReport=job.lastReport,
        )
        ctx.scheduled(job.name, next_run)
        freed(ctx, current)
