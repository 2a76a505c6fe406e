"""Which jobs a GetJob gets: its query, the search, and waiting GetJobs.

A search takes due jobs highest priority first, then oldest nextRun, and
hands each out (lifecycle.hand_out). On the way it moves jobs outside their
time windows to the next window, and passes over jobs of paused patterns
and jobs that would take a concurrency limit over its capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from jobserver.core import lifecycle, params, schedule
from jobserver.core.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.globmatch import glob_match
from jobserver.core.jobs import Job
from jobserver.core.views import handout_object
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request, Response

# A GetJob passes over at most this many due jobs that a concurrency limit
# holds back before it gives up: the search stays bounded (one query's
# bound parameters) even when a limit blocks a long queue of heavy jobs.
MAX_SKIPPED = 1000


@dataclass(frozen=True)
class JobQuery:
    """Which jobs a GetJob or GetJobs asks for."""

    pattern: str | None
    names: tuple[str, ...]
    priority: int | None
    limit: int
    # Put each job's lease token in its reply object (`includeLeaseID`).
    include_lease_id: bool = False
    # GetJobs: the reply lists the jobs under "jobs".
    many: bool = False

    @property
    def selector(self) -> tuple[object, ...]:
        """What the query matches, whatever its limit."""
        return (self.pattern, self.names, self.priority)

    @property
    def priorities(self) -> tuple[int, ...]:
        return params.PRIORITIES if self.priority is None else (self.priority,)


def name_selector(text: str) -> tuple[str | None, tuple[str, ...]]:
    """A `name` parameter as a GLOB pattern, or as a comma list of exact
    names when it has more than one item: (pattern, ()) or (None, names)."""
    # No job name holds a control character, so a pattern with one could
    # match nothing; it is refused as such names are.
    if params.has_control(text) or len(text.encode("utf-8")) > params.MAX_PATTERN:
        raise CommandError("402 Malformed name")
    names = tuple(n.lstrip(" ") for n in text.split(",") if n.lstrip(" "))
    if len(names) > 1:
        return None, names
    return text, ()


def query_of(request: Request) -> JobQuery:
    """The query of a GetJob or GetJobs request."""
    many = request.verb.lower() == "getjobs"
    if many:
        limit = params.num_results(request)
    elif request.has("numResults"):
        raise CommandError("402 Cannot use numResults with GetJob; try GetJobs")
    else:
        limit = 1
    pattern, names = name_selector(params.require(request, "name"))
    priority = params.priority(request, "jobPriority")
    query = JobQuery(pattern, names, priority, limit, many=many)
    if params.is_true(request.get("includeLeaseID")):
        query = replace(query, include_lease_id=True)
    return query


@dataclass
class Taken:
    """A job handed out: the row as it was before, its reply object, and
    what the hand-out wrote (to give it back if the reply never arrives)."""

    job: Job
    reply: dict[str, Any]
    lease: lifecycle.Lease


def reply(query: JobQuery, taken: list[Taken]) -> Response:
    """The reply, with the lease tokens in a `leaseID` header when a job
    has a lease or the request asked for them: a plain Bedrock hand-out of
    jobs without retryAfter stays the same byte for byte."""
    objects = [t.reply for t in taken]
    body = {"jobs": objects} if query.many else objects[0]
    headers = {}
    if any(t.job.retryAfter or "leaseID" in t.reply for t in taken):
        headers["leaseID"] = ",".join(t.lease.token for t in taken)
    return Response("200 OK", jsonbody.encode(body), headers)


def take(ctx: Context, query: JobQuery) -> list[Taken]:
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
            if job.timeWindows:
                start = schedule.window_start(ctx, job)
                if start is not None:
                    lifecycle.wait_for_window(ctx, job, start)
                    continue
            if usage and not _fits(store.limits, usage, job):
                skipped.append(job.jobID)
                continue
            item = _hand_out(ctx, job, query)
            if item is None:
                continue
            for pattern in usage:
                if glob_match(pattern, job.name):
                    usage[pattern] += job.cost
            taken.append(item)
        if len(skipped) >= MAX_SKIPPED:
            break
    return taken


def _hand_out(ctx: Context, job: Job, query: JobQuery) -> Taken | None:
    obj = handout_object(ctx.store, job)
    lease = lifecycle.hand_out(ctx, job)
    if lease is None:
        return None
    if job.maxAttempts:
        obj["attempt"] = job.attempts + 1
        obj["maxAttempts"] = job.maxAttempts
    if query.include_lease_id:
        obj["leaseID"] = lease.token
    return Taken(job, obj, lease)


def _usage(ctx: Context) -> dict[str, int]:
    """What the running jobs use of each concurrency limit."""
    return {pattern: ctx.store.usage(pattern, ctx.now_ms) for pattern in ctx.store.limits}


def _fits(limits: dict[str, int], usage: dict[str, int], job: Job) -> bool:
    return all(
        usage[pattern] + job.cost <= capacity
        for pattern, capacity in limits.items()
        if glob_match(pattern, job.name)
    )


def serve_waiters(
    ctx: Context, queries: list[JobQuery]
) -> tuple[list[list[Taken] | None], str | None]:
    """Try waiting GetJobs oldest first. A selector that found nothing is
    not tried again in the same pass, so ten thousand waiters on one name
    cost one query, not ten thousand."""
    empty: set[tuple[object, ...]] = set()
    handed: list[list[Taken] | None] = []
    for query in queries:
        taken = [] if query.selector in empty else take(ctx, query)
        if not taken:
            empty.add(query.selector)
        handed.append(taken or None)
    return handed, ctx.store.next_due(ctx.now_ms)


def give_back(ctx: Context, taken: list[Taken]) -> None:
    """Undo hand-outs whose reply never reached the client."""
    for item in taken:
        lifecycle.give_back(ctx, item.job, item.lease)
