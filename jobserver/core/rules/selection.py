"""Which jobs a GetJob gets: its query, the search, and waiting GetJobs.

A search takes due jobs highest priority first, then oldest nextRun, and
hands each out (leases.hand_out). On the way it moves jobs outside their
time windows to the next window, and passes over jobs of paused patterns
and jobs that would take a concurrency limit over its capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from jobserver.core.commands import params
from jobserver.core.commands.views import handout_json, handout_object
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import leases, lifecycle, schedule
from jobserver.core.rules.holds import Holds
from jobserver.model.globmatch import MAX_PATTERNS, is_glob, listed_names
from jobserver.model.jobs import Job
from jobserver.storage.searches import NOTHING_PASSED, PassedOver
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request, Response

# With limits or pauses set, after a page that held every job in it the
# next reads this many, and twice as many after each such page, up to
# MOST_PAGE: a page reveals the held names in it, and a backlog of many
# held names took a round trip each ten of them.
PAGE = 100
MOST_PAGE = 1600
# Times a search under fair patterns begins again from the first job, once
# the jobs held for their keys' turns have gone: a GetJobs that has taken
# some answers with those past it rather than read its queue again.
MOST_RESTARTS = 2
# ... and, while it has taken nothing, this many: a GetJob never answers 404
# while a job may go because its turns ran out.
MOST_RESTARTS_EMPTY = 8
# Room in a GetJobs reply for a job's keys, numbers (jobID, priority,
# cost), what its object gains once handed out (attempt, maxAttempts,
# leaseID), its comma, and its token in the `leaseID` header; and for the
# rest of the reply (status line, headers, `{"jobs":[]}`).
PER_JOB_EXTRA = 512
REPLY_OVERHEAD = 1024


# Plain, with slots: one per GetJob, and a frozen dataclass's __init__ costs
# several times as much. Nothing changes one once made.
@dataclass(slots=True)
class JobQuery:
    """Which jobs a GetJob or GetJobs asks for: those whose name one of the
    GLOB `patterns` matches, or one of the exact `names` (job_selector)."""

    patterns: tuple[str, ...]
    names: tuple[str, ...]
    priority: int | None
    limit: int
    # Put each job's lease token in its reply object (`includeLeaseID`).
    include_lease_id: bool = False
    # GetJobs: the reply lists the jobs under "jobs".
    many: bool = False
    # Who asks (route.worker_name): each job taken records it.
    worker: str = ""
    # The lease the worker asks for (`lease`, seconds; 0: none), given to
    # each job taken that has no retryAfter of its own (protocol.md 14.24).
    lease: int = 0
    # A waiting GetJob that ended (a hang-up, a half-close, answered at
    # once): set on the event loop, read by a try under way, which takes
    # nothing more for it (serve_waiters).
    withdrawn: bool = False

    @property
    def scans(self) -> bool:
        """Whether it tries a GLOB against every due job's name, which may
        take long for a long queue (an exact name is looked up in an index)."""
        return any(map(is_glob, self.patterns))

    @property
    def selector(self) -> tuple[object, ...]:
        """What the query matches, whatever its limit."""
        return (self.patterns, self.names, self.priority)

    @property
    def priorities(self) -> tuple[int, ...]:
        return params.PRIORITIES if self.priority is None else (self.priority,)


def name_selector(text: str) -> tuple[str | None, tuple[str, ...]]:
    """A `name` parameter as a GLOB pattern, or as a comma list of exact
    names when it has more than one item: (pattern, ()) or (None, names)."""
    names = _pieces(text)
    if len(names) > 1:
        return None, names
    params.check_wildcards(text)
    return text, ()


def job_selector(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """GetJob's and GetJobs' `name` (protocol.md 5.3): (patterns, names).
    One piece: the whole text, one GLOB pattern. A comma list none of
    whose pieces holds a wildcard: Bedrock's list of exact names. A list
    with a wildcard in a piece: each piece a GLOB pattern, a job matching
    any of them (`thumb/*,email/*`), the wildcards of all counted together."""
    pieces = _pieces(text)
    if len(pieces) > 1 and not any(map(is_glob, pieces)):
        return (), pieces
    if len(pieces) > MAX_PATTERNS:
        raise CommandError(f"402 Too many patterns ({MAX_PATTERNS} at most)")
    params.check_wildcards(text)
    return (pieces if len(pieces) > 1 else (text,)), ()


def _pieces(text: str) -> tuple[str, ...]:
    # No job name holds a control character, so a pattern with one could
    # match nothing; it is refused as such names are.
    if len(text.encode("utf-8")) > params.MAX_PATTERN:
        raise params.too_large("name", params.MAX_PATTERN)
    if params.has_control(text):
        raise CommandError("402 Malformed name")
    return listed_names(text)


def query_of(request: Request, worker: str = "") -> JobQuery:
    """The query of a GetJob or GetJobs request from `worker`."""
    many = request.verb.lower() == "getjobs"
    if many:
        limit = params.num_results(request)
    elif request.has("numResults"):
        raise CommandError("402 Cannot use numResults with GetJob; try GetJobs")
    else:
        limit = 1
    patterns, names = job_selector(params.require(request, "name"))
    priority = params.priority(request, "jobPriority")
    lease = params.lease_seconds(request)
    query = JobQuery(patterns, names, priority, limit, many=many, worker=worker, lease=lease)
    if params.is_true(request.get("includeLeaseID")):
        query = replace(query, include_lease_id=True)
    return query


@dataclass
class Taken:
    """A job handed out: the row as it was before, its reply object, and
    what the hand-out wrote (to give it back if the reply never arrives)."""

    job: Job
    reply: dict[str, Any]
    lease: leases.Lease


def reply(query: JobQuery, taken: list[Taken]) -> Response:
    """The reply, with the lease tokens in a `leaseID` header when a job
    has a lease or the request asked for them or for a lease: a plain
    Bedrock hand-out of jobs without retryAfter stays the same byte for
    byte."""
    objects = [handout_json(t.reply) for t in taken]
    body = b'{"jobs":[' + b",".join(objects) + b"]}" if query.many else objects[0]
    headers = {}
    if query.lease or any(t.job.retryAfter or "leaseID" in t.reply for t in taken):
        headers["leaseID"] = ",".join(t.lease.token for t in taken)
    return Response("200 OK", body, headers)


def take(ctx: Context, query: JobQuery, holds: Holds | None = None) -> list[Taken]:
    """Take up to `query.limit` due jobs, highest priority first.

    Jobs that run out of leases on the way are failed and skipped, and the
    search goes on, so a GetJob gets a job whenever one can be had. So are
    jobs outside their time window (moved to its next start), jobs of a
    paused pattern and jobs that would take a concurrency limit over its
    capacity (both left where they are), within the search's budget for
    judging names (flow.py): each page of candidates begins after the last
    job read, and leaves out the names (or patterns) held whatever their
    cost, so held jobs cost the search a test in the query each, however
    many lie in front of a free one. A GetJobs stops before the job
    that would take its reply past --max-reply-bytes; that job and the
    rest are not taken.
    """
    if query.limit == 1 and not ctx.store.blocking:
        # No round trip to spare (SQLite): holding one job costs more.
        return _take_and_note(ctx, query, holds)
    # The hand-outs' writes are sent together (storage's held_writes.py).
    with ctx.store.holding_writes():
        return _take_and_note(ctx, query, holds)


def _take_and_note(ctx: Context, query: JobQuery, holds: Holds | None) -> list[Taken]:
    if holds is None and (ctx.store.limits or ctx.store.paused):
        holds = Holds(ctx)
    taken = _take(ctx, query, holds)
    if holds is not None:
        holds.write_rounds()
    return taken


def _take(ctx: Context, query: JobQuery, holds: Holds | None) -> list[Taken]:
    store = ctx.store
    taken: list[Taken] = []
    # Flow control, only when some is set (a plain queue pays nothing):
    # `holds` is given then.
    if holds is not None:
        holds.begin_search(query.patterns, query.names)
    room = _Room(ctx.settings.max_reply_bytes) if query.limit > 1 else None
    # Jobs a fair pattern held for their key's turn, read on the way.
    turns = _Turns(query.limit)
    passed = NOTHING_PASSED
    restarts = 0
    # The first page asks for what is wanted: on PostgreSQL a page's jobs
    # are locked as they are read, and a page of 100 for a GetJob of one
    # made another node's GetJob skip them and answer 404 with jobs left.
    page = 0
    while len(taken) < query.limit:
        # Held jobs are passed over a page at a time, and what holds them
        # (their names, or patterns) is left out of the next page's query.
        wanted = query.limit - len(taken)
        asked = max(wanted, page)
        before = len(taken)
        candidates = store.find_ready(
            now=ctx.now_ms,
            priorities=query.priorities,
            limit=asked,
            patterns=query.patterns,
            names=query.names,
            passed=passed,
        )
        # Handed out in this transaction (by this search or a waiter's
        # before it) under a lease that had already ended: due again, such
        # a job can lie after the page's position and be read once more.
        handed = {t.job.jobID for t in ctx.taken}
        for job in candidates:
            if len(taken) == query.limit:
                break
            if job.jobID in handed:
                continue
            if holds is not None and holds.held_on_sight(job, turns.has_room):
                continue
            went = _offer(ctx, query, holds, room, job, taken)
            if went is None:
                return taken
            if not went and holds is not None and holds.waiting_turn is not None:
                turns.add(holds.waiting_turn, job)
        if len(candidates) < asked:
            # Read to the end. Jobs that a fair pattern held for their
            # key's turn go now, a round at a time, as read; past them the
            # search begins again from the first job (a few times at most:
            # a GetJobs may answer with fewer jobs than it asked for, never
            # with none while one may go).
            began = bool(turns)
            if began and _take_turns(ctx, query, holds, room, turns, taken) is None:
                return taken
            if len(taken) == query.limit or holds is None:
                break
            # Past the turns' jobs: those of their keys the held pairs left
            # out of later pages may go in the new round.
            if restarts >= (MOST_RESTARTS if taken else MOST_RESTARTS_EMPTY):
                break
            if began:
                # In the round the turns left: their keys' jobs are read
                # again, those the held pairs left out too.
                holds.forget_turns()
            elif not holds.new_rounds():
                break
            restarts += 1
            passed, page, turns = holds.passed_over(None), 0, _Turns(query.limit)
            continue
        if holds is not None and len(taken) == before:
            page = min(max(page * 2, PAGE), MOST_PAGE)
        last = candidates[-1]
        after = (last.priority, last.nextRun, last.name, last.jobID)
        passed = holds.passed_over(after) if holds is not None else PassedOver(after=after)
    return taken


def _offer(
    ctx: Context,
    query: JobQuery,
    holds: Holds | None,
    room: _Room | None,
    job: Job,
    taken: list[Taken],
) -> bool | None:
    """Hand `job` out unless something holds it: True if it went, False if
    it was passed over, None when the search must end (its budget spent,
    or its reply full)."""
    if job.timeWindows:
        start = schedule.window_start(ctx, job)
        if start is not None:
            lifecycle.wait_for_window(ctx, job, start)
            return False
    if holds is not None:
        held = holds.holds_back(job)
        if held is None:
            return None
        if held:
            return False
    obj = handout_object(ctx.store, job)
    if room is not None and not room.take(_reply_bytes(job, obj), first=not taken):
        return None
    item = _hand_out(ctx, job, obj, query)
    if item is None:
        return False
    if holds is not None:
        holds.count(job)
    taken.append(item)
    return True


def _take_turns(
    ctx: Context,
    query: JobQuery,
    holds: Holds | None,
    room: _Room | None,
    turns: _Turns,
    taken: list[Taken],
) -> bool | None:
    """Hand out the jobs fair patterns held for their keys' turns, a round
    at a time: each round begins anew every pattern that held some, and
    gives each key one job (all it has, for a key alone under its
    pattern), until a key's kept jobs run out (the search then begins
    again from the first job). None when the search must end."""
    assert holds is not None  # only fair patterns fill turns
    # Fair patterns that held a turn's job for a turn of their own (two
    # fair patterns over one name): their rounds begin with the turns'.
    crossing: set[str] = set()
    while len(taken) < query.limit and turns:
        holds.new_rounds(turns.patterns() | crossing, alone=turns.alone() - crossing)
        went_any, crossed = False, set()
        for turn in turns.order():
            while len(taken) < query.limit and turns.has(turn):
                went = _offer(ctx, query, holds, room, turns.first(turn), taken)
                if went is None:
                    return None
                if not went and holds.waiting_turn is not None:
                    if holds.waiting_turn[0] != turn[0]:
                        crossed.add(holds.waiting_turn[0])
                    break  # its key's turn comes in the next round
                # Gone, or held by something else (a full key, a spent
                # rate): done with in this search either way.
                turns.pop(turn)
                if not turns.has(turn) and len(taken) < query.limit:
                    # Its key's jobs past those kept were left out of the
                    # pages read (held by pair): rotating on without them
                    # would serve the other keys twice while it waits.
                    return True
                if not went:
                    continue
                went_any = True
                if turn[0] not in holds.uncontested:
                    break
        if not went_any and crossed <= crossing:
            return False
        crossing |= crossed
    return True


class _Turns:
    """Jobs that fair patterns held for their keys' turns, by (pattern,
    key), in the order the keys were met; at most `most` of each."""

    def __init__(self, most: int) -> None:
        self._most = most
        self._jobs: dict[tuple[str, str], list[Job]] = {}

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def add(self, turn: tuple[str, str], job: Job) -> None:
        waiting = self._jobs.setdefault(turn, [])
        if len(waiting) < self._most:
            waiting.append(job)

    def order(self) -> list[tuple[str, str]]:
        return list(self._jobs)

    def patterns(self) -> set[str]:
        return {pattern for pattern, _ in self._jobs}

    def alone(self) -> set[str]:
        """The patterns under which one key alone waits its turn."""
        keys: dict[str, int] = {}
        for pattern, _ in self._jobs:
            keys[pattern] = keys.get(pattern, 0) + 1
        return {pattern for pattern, count in keys.items() if count == 1}

    def has(self, turn: tuple[str, str]) -> bool:
        return turn in self._jobs

    def has_room(self, turn: tuple[str, str]) -> bool:
        return len(self._jobs.get(turn, ())) < self._most

    def first(self, turn: tuple[str, str]) -> Job:
        return self._jobs[turn][0]

    def pop(self, turn: tuple[str, str]) -> None:
        waiting = self._jobs[turn]
        waiting.pop(0)
        if not waiting:
            del self._jobs[turn]


def _hand_out(ctx: Context, job: Job, obj: dict[str, Any], query: JobQuery) -> Taken | None:
    lease = leases.hand_out(ctx, job, query.worker, query.lease)
    if lease is None:
        return None
    if job.maxAttempts:
        obj["attempt"] = job.attempts + 1
        obj["maxAttempts"] = job.maxAttempts
    if query.include_lease_id:
        obj["leaseID"] = lease.token
    taken = Taken(job, obj, lease)
    ctx.taken.append(taken)
    return taken


class _Room:
    """What is left of a GetJobs reply's bytes (--max-reply-bytes)."""

    def __init__(self, max_bytes: int) -> None:
        self._left = max_bytes - REPLY_OVERHEAD

    def take(self, size: int, first: bool) -> bool:
        """Make room for a job's object; False if it does not fit. The
        first always does: the least --max-reply-bytes holds the largest job."""
        if size > self._left and not first:
            return False
        self._left -= size
        return True


def _reply_bytes(job: Job, obj: dict[str, Any]) -> int:
    """At most the bytes a job adds to a GetJobs reply, without building it
    (which would cost a second encoding of every job handed out): its data
    exactly, every other text as if each character took an escape's 6
    bytes, and PER_JOB_EXTRA for the rest. With a parent's, children's or
    dependencies' data, the object is encoded."""
    if "parentData" in obj or "finishedChildJobs" in obj or "dependencies" in obj:
        return len(jsonbody.encode(obj)) + PER_JOB_EXTRA
    texts = (
        job.created, job.name, job.nextRun, job.lastRun or "", job.repeat,
        job.retryAfter, job.timeWindows, job.timeZone,
    )
    data = len(job.data) if job.data.isascii() else len(job.data.encode("utf-8"))
    return data + 6 * sum(map(len, texts)) + PER_JOB_EXTRA


def serve_waiters(ctx: Context, queries: list[JobQuery]) -> list[list[Taken] | None]:
    """Try waiting GetJobs oldest first. A selector that found nothing is
    not tried again in the same pass, so ten thousand waiters on one name
    cost one query, not ten thousand. (When the next job falls due, for
    those that found nothing, is read with the batch's commit:
    batch.Batches.)"""
    empty: set[tuple[object, ...]] = set()
    handed: list[list[Taken] | None] = []
    # One budget and one count of usage for the whole pass.
    holds = Holds(ctx) if ctx.store.limits or ctx.store.paused else None
    with ctx.store.holding_writes():
        for query in queries:
            # A withdrawn query's client was told it got no job and may act
            # on that already: a job taken for it would be RUNNING until
            # given back. Looked at before each take, not once per pass: a
            # take before it may have waited for a lock.
            if query.withdrawn or query.selector in empty:
                handed.append(None)
                continue
            taken = take(ctx, query, holds)
            if not taken:
                empty.add(query.selector)
            handed.append(taken or None)
    return handed


def give_back(ctx: Context, taken: list[Taken]) -> None:
    """Undo hand-outs whose reply never reached the client."""
    for item in taken:
        leases.give_back(ctx, item.job, item.lease)
