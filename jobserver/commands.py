"""One function per command: validate the request, use the store, build the reply.

Handlers run inside a transaction that the writer owns; they never commit
and never touch a socket. A handler either returns a `Response` or raises
`CommandError`, whose status line is the reply and whose raise undoes every
change the handler made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from . import jsonbody, repeat, times
from .jsonbody import Raw
from .protocol import Request, Response
from .store import Job, Store

PRIORITIES = (1000, 850, 750, 500, 250, 0)
DEFAULT_PRIORITY = 500

MAX_NAME = 255
# Bedrock's limit for a GetJob pattern, which may list many names.
MAX_PATTERN = 12750
MAX_DATA = 1024 * 1024
# How long a GetJob with `Connection: wait` waits when it names no timeout:
# Bedrock's default, chosen so clients can use a two-minute socket timeout.
DEFAULT_WAIT_MS = 110_000
# A longer wait is cut to this: an hour is longer than any client should
# hold a socket without hearing back.
MAX_WAIT_MS = 3_600_000


class CommandError(Exception):
    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


@dataclass
class Context:
    """What a handler may use, and what it reports back to the writer."""

    store: Store
    now: datetime
    # Names of jobs this request made due now; waiting GetJobs are matched
    # against them once the transaction commits.
    ready: set[str] = field(default_factory=set)
    # The earliest future nextRun this request wrote, for the wake-up timer.
    due: str | None = None

    @property
    def now_s(self) -> str:
        return times.to_seconds(self.now)

    @property
    def now_ms(self) -> str:
        return times.to_millis(self.now)

    def scheduled(self, name: str, next_run: str) -> None:
        """Note that a job called `name` is waiting to run at `next_run`."""
        if next_run <= self.now_ms:
            self.ready.add(name)
        elif self.due is None or next_run < self.due:
            self.due = next_run


Handler = Callable[[Context, Request], Response]


def ok(body: Any = None) -> Response:
    return Response("200 OK", b"" if body is None else jsonbody.encode(body))


# Parameters.


def require(request: Request, name: str) -> str:
    value = request.get(name)
    if value is None or value == "":
        raise CommandError(f"402 Missing {name}")
    return value


def job_id_param(request: Request, name: str = "jobID") -> int:
    return parse_job_id(require(request, name), name)


def parse_job_id(text: str, name: str = "jobID") -> int:
    # Bedrock's int64 rule: the text must be the canonical decimal form.
    try:
        number = int(text)
    except ValueError:
        raise CommandError(f"402 Malformed {name}") from None
    if str(number) != text or not 0 < number < 2**63:
        raise CommandError(f"402 Malformed {name}")
    return number


def priority_param(request: Request, *names: str) -> int | None:
    for name in names:
        value = request.get(name)
        if value is not None and value != "":
            try:
                priority = int(value)
            except ValueError:
                raise CommandError("402 Invalid priority value") from None
            if priority not in PRIORITIES:
                raise CommandError("402 Invalid priority value")
            return priority
    return None


def data_param(request: Request, name: str = "data") -> str | None:
    """The `data` header as compact JSON text, or None when absent."""
    value = request.get(name)
    if value is None:
        return None
    if len(value.encode("utf-8")) > MAX_DATA:
        raise CommandError(f"402 Malformed {name}")
    try:
        return jsonbody.compact(jsonbody.parse_object(value))
    except ValueError:
        raise CommandError("402 Data is not a valid JSON Object") from None


def time_param(request: Request, name: str) -> str | None:
    value = request.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return times.parse_user_time(value)
    except ValueError:
        raise CommandError(f"402 Malformed {name}") from None


def repeat_param(request: Request) -> str | None:
    """The repeat as stored (upper case), or None when absent or empty."""
    value = request.get("repeat")
    if value is None or value.strip() == "":
        return None
    try:
        repeat.parse_repeat(value)
    except repeat.MalformedRepeat:
        raise CommandError("402 Malformed repeat") from None
    return value.strip().upper()


def is_true(value: str | None) -> bool:
    """`true` in any case, or a non-zero number, as Bedrock reads flags."""
    if value is None:
        return False
    if value.strip().lower() == "true":
        return True
    try:
        return int(value) != 0
    except ValueError:
        return False


def wants_wait(request: Request) -> bool:
    return request.verb.lower() in WAITABLE and (
        (request.get("connection") or "").lower() == "wait"
    )


def wait_seconds(request: Request) -> float:
    """The `timeout` of a waiting GetJob, in seconds."""
    value = request.get("timeout")
    if value is None or value == "":
        return DEFAULT_WAIT_MS / 1000
    try:
        millis = int(value)
    except ValueError:
        raise CommandError("402 Malformed timeout") from None
    if millis < 0:
        raise CommandError("402 Malformed timeout")
    return min(millis, MAX_WAIT_MS) / 1000


# Replies.


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


def load_job(ctx: Context, request: Request) -> Job:
    job = ctx.store.get(job_id_param(request))
    if job is None:
        raise CommandError("404 No job with this jobID")
    return job


# Repeats.


def next_run_from_repeat(ctx: Context, job: Job, repeat_text: str) -> str:
    """When a job with this repeat runs next, counted from its base."""
    rule = repeat.parse_repeat(repeat_text)
    scheduled = job.nextRun
    if rule.base == "SCHEDULED":
        base = scheduled
    elif rule.base == "STARTED":
        base = job.lastRun or ctx.now_s
    else:
        base = ctx.now_s
    computed = ctx.store.datetime_after(base, rule.modifiers)
    if computed is None:
        raise CommandError("502 Failed to compute nextRun")
    if rule.base == "SCHEDULED" and rule.only_offsets:
        moment = repeat.reanchor(
            times.parse_stored(scheduled), times.parse_stored(computed), ctx.now
        )
        computed = times.to_seconds(moment)
    return computed


# Commands.


def create_job(ctx: Context, request: Request) -> Response:
    name = require(request, "name")
    if len(name.encode("utf-8")) > MAX_NAME:
        raise CommandError("402 Malformed name")
    priority = priority_param(request, "jobPriority", "priority")
    data = data_param(request)
    first_run = time_param(request, "firstRun")
    repeat_text = repeat_param(request)
    next_run = first_run or ctx.now_ms
    job_id = ctx.store.insert(
        created=ctx.now_s,
        state="QUEUED",
        name=name,
        next_run=next_run,
        repeat=repeat_text or "",
        data=data if data is not None else "{}",
        priority=DEFAULT_PRIORITY if priority is None else priority,
    )
    ctx.scheduled(name, next_run)
    return ok({"jobID": job_id})


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
        return PRIORITIES if self.priority is None else (self.priority,)


def job_query(request: Request, limit: int = 1) -> JobQuery:
    name = require(request, "name")
    if len(name.encode("utf-8")) > MAX_PATTERN:
        raise CommandError("402 Malformed name")
    priority = priority_param(request, "jobPriority")
    names = tuple(n.lstrip(" ") for n in name.split(",") if n.lstrip(" "))
    if len(names) > 1:
        return JobQuery(None, names, priority, limit)
    return JobQuery(name, (), priority, limit)


def dequeue(ctx: Context, query: JobQuery) -> list[Job]:
    """Take up to `query.limit` due jobs; return their rows as they were
    before this dequeue, which is what the reply shows (as in Bedrock)."""
    jobs = ctx.store.find_ready(
        now=ctx.now_ms,
        priorities=query.priorities,
        limit=query.limit,
        pattern=query.pattern,
        names=query.names,
    )
    for job in jobs:
        ctx.store.update(job.jobID, state="RUNNING", lastRun=ctx.now_s)
    return jobs


@dataclass
class Handout(Response):
    """A reply that hands out jobs: if it cannot be delivered, the server
    gives `jobs` back to the queue."""

    jobs: list[Job] = field(default_factory=list)


def get_job_reply(jobs: list[Job]) -> Handout:
    return Handout("200 OK", jsonbody.encode(job_object(jobs[0])), jobs=jobs)


def get_job(ctx: Context, request: Request) -> Response:
    if request.has("numResults"):
        raise CommandError("402 Cannot use numResults with GetJob; try GetJobs")
    jobs = dequeue(ctx, job_query(request))
    if not jobs:
        raise CommandError("404 No job found")
    return get_job_reply(jobs)


def serve_waiters(
    ctx: Context, queries: list[JobQuery]
) -> tuple[list[list[Job] | None], str | None]:
    """Try waiting GetJobs oldest first; a selector that found nothing is
    not tried again in the same pass, so ten thousand waiters on one name
    cost one query, not ten thousand."""
    empty: set[tuple[object, ...]] = set()
    handed: list[list[Job] | None] = []
    for query in queries:
        jobs = [] if query.selector in empty else dequeue(ctx, query)
        if not jobs:
            empty.add(query.selector)
        handed.append(jobs or None)
    return handed, ctx.store.next_due(ctx.now_ms)


def give_back(ctx: Context, jobs: list[Job]) -> None:
    """Undo a dequeue whose reply never reached its client."""
    for job in jobs:
        current = ctx.store.get(job.jobID)
        if current is None or current.state not in ("RUNNING", "RUNQUEUED"):
            continue
        ctx.store.update(
            job.jobID, state=job.state, nextRun=job.nextRun, lastRun=job.lastRun, data=job.data
        )
        ctx.scheduled(job.name, job.nextRun)


def query_job(ctx: Context, request: Request) -> Response:
    return ok(job_object(load_job(ctx, request), with_state=True))


def update_job(ctx: Context, request: Request) -> Response:
    job_id = job_id_param(request)
    data = data_param(request)
    if data is None or request.get("data") == "":
        raise CommandError("402 Missing data")
    repeat_text = repeat_param(request)
    priority = priority_param(request, "jobPriority")
    next_run = time_param(request, "nextRun")
    job = ctx.store.get(job_id)
    if job is None:
        raise CommandError("404 No job with this jobID")
    changes: dict[str, Any] = {"data": data}
    if next_run is None and repeat_text is not None:
        next_run = next_run_from_repeat(ctx, job, repeat_text)
    if next_run is not None:
        changes["nextRun"] = next_run
        if job.state in ("QUEUED", "RUNQUEUED"):
            ctx.scheduled(job.name, next_run)
    if is_true(request.get("shouldClearRepeat")):
        changes["repeat"] = ""
    elif repeat_text is not None:
        changes["repeat"] = repeat_text
    if priority is not None:
        changes["priority"] = priority
    ctx.store.update(job_id, **changes)
    return ok()


def finish_job(ctx: Context, request: Request) -> Response:
    job = load_job(ctx, request)
    if job.state not in ("RUNNING", "RUNQUEUED"):
        raise CommandError("405 Can only retry/finish RUNNING and RUNQUEUED jobs")
    data = data_param(request)
    if data is not None and request.get("data") != "":
        job.data = data
    if job.repeat and not _asks_delete(job.data):
        next_run = next_run_from_repeat(ctx, job, job.repeat)
        ctx.store.update(job.jobID, state="QUEUED", nextRun=next_run, data=job.data)
        ctx.scheduled(job.name, next_run)
    else:
        ctx.store.delete(job.jobID)
    return ok()


def _asks_delete(data: str) -> bool:
    return jsonbody.parse_object(data).get("delete") is True


def delete_job(ctx: Context, request: Request) -> Response:
    job = load_job(ctx, request)
    if job.state == "RUNNING":
        raise CommandError("405 Can't delete a RUNNING job")
    if job.state == "PAUSED":
        raise CommandError("405 Can't delete a parent jobs with children running")
    ctx.store.delete(job.jobID)
    return ok()


WAITABLE = ("getjob",)

COMMANDS: dict[str, Handler] = {
    "createjob": create_job,
    "getjob": get_job,
    "queryjob": query_job,
    "updatejob": update_job,
    "finishjob": finish_job,
    "deletejob": delete_job,
}


def immediate(request: Request) -> Response | None:
    """The reply to a request that needs no database, or None."""
    if request.invalid_utf8:
        return Response("400 Request is not valid UTF-8")
    verb = request.verb.lower()
    if verb == "ping":
        return Response("200 OK")
    if verb not in COMMANDS:
        return Response("430 Unrecognized command")
    return None


def execute(ctx: Context, request: Request) -> Response:
    """Run one request in the writer; a CommandError raised here rolls the
    request back and becomes its reply."""
    return COMMANDS[request.verb.lower()](ctx, request)
