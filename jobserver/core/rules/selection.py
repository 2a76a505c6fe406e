"""Which jobs a GetJob gets: its query, the search, and waiting GetJobs.

A search takes due jobs highest priority first, then oldest nextRun, and
hands each out (lifecycle.hand_out). On the way it moves jobs outside their
time windows to the next window, and passes over jobs of paused patterns
and jobs that would take a concurrency limit over its capacity.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from jobserver.core.commands import params
from jobserver.core.commands.views import handout_object
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import flow, lifecycle, schedule
from jobserver.model import times
from jobserver.model.globmatch import MAX_PATTERNS, is_glob, listed_names
from jobserver.model.jobs import Job
from jobserver.model.limits import Limit, Rate
from jobserver.storage.searches import NOTHING_PASSED, PassedOver
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request, Response

# A search reads this many limits' usage one statement each; past them it
# reads every limit's at once (Holds._used_of_all).
USAGES_ONE_BY_ONE = 8
# ... if the running jobs have at most this many names: a client that
# takes a million jobs and never reports would make each search read them.
MOST_RUNNING_NAMES = 10_000
# A pattern that has held this many names in one search is left out of its
# next pages as a pattern: names made for each job would otherwise make a
# list as long as the queue.
HELD_NAMES_BY_PATTERN = 8
# With limits or pauses set, after a page that held every job in it the
# next reads this many, and twice as many after each such page, up to
# MOST_PAGE: a page reveals the held names in it, and a backlog of many
# held names took a round trip each ten of them.
PAGE = 100
MOST_PAGE = 1600
# What reading a row of a pattern's usage by key, rate window by key or
# fair round costs a search's budget (about a microsecond each).
ROW_COST = 20
# Times a search under fair patterns begins again from the first job, once
# the jobs held for their keys' turns have gone: a GetJobs that has taken
# some answers with those past it rather than read its queue again.
MOST_RESTARTS = 2
# Room in a GetJobs reply for a job's keys, numbers (jobID, priority,
# cost), what its object gains once handed out (attempt, maxAttempts,
# leaseID), its comma, and its token in the `leaseID` header; and for the
# rest of the reply (status line, headers, `{"jobs":[]}`).
PER_JOB_EXTRA = 512
REPLY_OVERHEAD = 1024


@dataclass(frozen=True)
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
    query = JobQuery(patterns, names, priority, limit, many=many, worker=worker)
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
        holds.begin_search(query)
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
            if holds is not None and holds.held_on_sight(job, turns):
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
            if restarts == MOST_RESTARTS and (taken or began):
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
    while len(taken) < query.limit and turns:
        holds.new_rounds(turns.patterns(), alone=turns.alone())
        went_any = False
        for turn in turns.order():
            while len(taken) < query.limit and turns.has(turn):
                went = _offer(ctx, query, holds, room, turns.first(turn), taken)
                if went is None:
                    return None
                if not went and holds.waiting_turn is not None:
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
        if not went_any:
            return False
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
    lease = lifecycle.hand_out(ctx, job, query.worker)
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


class Holds:
    """Whether a pause or a limit (its capacity, its rate, its rotation
    between keys) holds a job back, for the searches of one transaction.
    What a limit has used, its rate's window and its fair round are read
    once per search for the whole pattern (every key at once, for a
    per-key one), when a job under it is first considered, and counted on
    from there. What holds jobs whatever their cost (a pause, a full limit,
    a spent rate, a key served this round) is kept, to be left out of the
    search's next page: the names it held (of one key, for a per-key or
    fair limit), and, once one pattern (of one key) has held
    HELD_NAMES_BY_PATTERN names, the pattern."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._index = flow.index_of(ctx.store)
        self._budget = flow.Budget()
        self._locked = False
        # By (pattern, key): key "" for a limit that counts keys together.
        self._usage: dict[tuple[str, str], int] = {}
        # Per-key limits whose every key's usage is in _usage.
        self._usage_read: set[str] = set()
        self._rates: dict[tuple[str, str], _Window] = {}
        self._rates_read: set[str] = set()
        # The keys each fair pattern has served in its round, once read;
        # what of it is not yet stored: the patterns whose round began anew
        # and the keys served since (write_rounds).
        self._served: dict[str, set[str]] = {}
        self._restarted: set[str] = set()
        self._newly_served: dict[str, set[str]] = {}
        self._held_names: set[str] = set()
        self._names_by_pattern: dict[str, int] = {}
        self._held_patterns: set[str] = set()
        # Held names and patterns of one key, as (name or pattern, key).
        self._held_pairs: set[tuple[str, str]] = set()
        self._pairs_by_pattern: dict[tuple[str, str], int] = {}
        self._held_keyed: set[tuple[str, str]] = set()
        # What fair patterns held, by pattern: the keys, and the pairs and
        # keyed patterns they put in the lists above, taken out again when
        # the pattern begins a new round (new_rounds).
        self._fair_keys: dict[str, set[str]] = {}
        self._fair_holds: dict[str, set[tuple[str, str]]] = {}
        # The pattern whose turn each held (name, key) pair waits for.
        self._fair_pairs: dict[tuple[str, str], str] = {}
        # Fair patterns that have met one key alone in this search.
        self.uncontested: set[str] = set()
        # Fair patterns whose round this search began for itself alone: it
        # asks for some of their names only, and the keys it cannot see
        # keep their turns (nothing of such a round is stored).
        self._local: set[str] = set()
        self._query: JobQuery | None = None
        # The (pattern, key) whose turn the job last held back waits for.
        self.waiting_turn: tuple[str, str] | None = None
        self._read_all_tried = False
        self._all_read = False

    def held_on_sight(self, job: Job, turns: _Turns) -> bool:
        """Whether a job of a page is held by what held one before it in
        the same page (its name, or its name and key): a set's test, where
        judging it again costs microseconds, and the pages of a round of a
        thousand keys hold a hundred thousand such jobs. A job its key's
        turn may still keep (the turns have room) is judged."""
        if job.name in self._held_names:
            return True
        pair = (job.name, job.key)
        if pair not in self._held_pairs:
            return False
        pattern = self._fair_pairs.get(pair)
        return pattern is None or not turns.has_room((pattern, job.key))

    def begin_search(self, query: JobQuery) -> None:
        """A search begins (the waiters of one pass share their holds):
        a key alone under a fair pattern in another's search need not be
        alone in this one, and a round another began for itself alone is
        not this one's."""
        self.uncontested = set()
        self._query = query
        for pattern in self._local:
            self._served.pop(pattern, None)
        self._local = set()

    def _asks_for_all(self, pattern: str) -> bool:
        """Whether the search asks for every name `pattern` may match."""
        query = self._query
        if query is None:
            return False
        return any(asked in ("*", pattern) for asked in query.patterns) or (
            not is_glob(pattern) and pattern in query.names
        )

    def holds_back(self, job: Job) -> bool | None:
        """True if the job must wait, False if it may go, None when the
        budget is spent before that is known."""
        self.waiting_turn = None
        verdict = self._verdict(job.name)
        if verdict is None:
            return None
        if verdict.paused:
            self._hold_all(job.name, verdict.paused)
            return True
        for pattern in verdict.limits:
            limit = self._index.limits[pattern]
            key = job.key if limit.per_key else ""
            held = self._holds(pattern, limit, key, job)
            if held is not False:
                return held
        return False

    def _holds(self, pattern: str, limit: Limit, key: str, job: Job) -> bool | None:
        """Whether one limit holds the job: its capacity, its rate, its turn."""
        if limit.max:
            used = self._used(pattern, key, limit.per_key)
            if used is None:
                return None
            if used + job.cost > limit.max:
                if used >= limit.max:
                    # Full: no job under it fits, whatever it costs.
                    self._hold_for(job.name, pattern, key, limit.per_key)
                return True
        if limit.rate is not None:
            window = self._window(pattern, key, limit.rate)
            if window is None:
                return None
            if window.count >= limit.rate.count:
                self._ctx.fire_at(window.frees_at(limit.rate))
                self._hold_for(job.name, pattern, key, limit.per_key)
                return True
        if limit.fair and pattern not in self.uncontested:
            served = self._served_keys(pattern)
            if served is None:
                return None
            if job.key in served:
                self._hold_turn(job.name, pattern, job.key)
                return True
        return False

    def count(self, job: Job) -> None:
        """A job was handed out: its cost now counts against its limits,
        the hand-out against their rates, its key as served."""
        ctx = self._ctx
        for pattern in self._index.verdict(job.name).limits:
            limit = self._index.limits[pattern]
            key = job.key if limit.per_key else ""
            if limit.max:
                # A scope read at once with every other may have had none.
                self._usage[pattern, key] = self._usage.get((pattern, key), 0) + job.cost
            if limit.rate is not None:
                self._rates[pattern, key].count += 1
                forget = _before(ctx.now_ms, limit.rate.window_ms)
                ctx.store.note_handout(pattern, key, ctx.now_ms, forget)
            if limit.fair and pattern in self._served:
                self._served[pattern].add(job.key)
                if pattern not in self._local:
                    self._newly_served.setdefault(pattern, set()).add(job.key)

    def passed_over(self, after: tuple[int, str, str, int] | None) -> PassedOver:
        """What the search's next page leaves out, having read up to `after`."""
        return PassedOver(
            after=after,
            names=frozenset(self._held_names),
            patterns=tuple(sorted(self._held_patterns)),
            pairs=frozenset(self._held_pairs),
            keyed=tuple(sorted(self._held_keyed)),
        )

    def new_rounds(
        self, patterns: set[str] | None = None, alone: Set[str] = frozenset()
    ) -> bool:
        """Begin a new round of each of `patterns` (by default, every fair
        pattern that held a key back in this search); False if there are
        none, or the budget is spent. A pattern under which one key alone
        waited has no other key to rotate to: it holds none for the rest
        of the search (a GetJobs of 100 jobs of one customer is one
        search, not 100)."""
        if patterns is None:
            patterns = set(self._fair_keys)
            alone = {p for p, keys in self._fair_keys.items() if len(keys) == 1}
        if not patterns or not self._budget.spend(ROW_COST * len(patterns)):
            return False
        for pattern in patterns:
            if self._asks_for_all(pattern):
                # Written once, when the search ends (write_rounds): a
                # GetJobs of 1,000 jobs of two keys is 500 rounds.
                self._restarted.add(pattern)
                self._newly_served.pop(pattern, None)
            else:
                # A GetJob of one customer's names would otherwise begin a
                # new round for every customer, and the others' turns be lost.
                self._local.add(pattern)
            self._served[pattern] = set()
            for held in self._fair_holds.pop(pattern, set()):
                self._held_pairs.discard(held)
                self._held_keyed.discard(held)
                self._fair_pairs.pop(held, None)
            self._fair_keys.pop(pattern, None)
        self.uncontested |= alone
        return True

    def forget_turns(self) -> None:
        """Leave out of the next pages no job for its key's turn alone:
        the search begins again, in the same round."""
        for held in set().union(*self._fair_holds.values()):
            self._held_pairs.discard(held)
            self._held_keyed.discard(held)
        self._fair_holds = {}
        self._fair_pairs = {}
        self._fair_keys = {}

    def write_rounds(self) -> None:
        """Store what this search did to fair rounds: a round begun anew,
        and the keys served since."""
        store = self._ctx.store
        for pattern in self._restarted:
            store.new_round(pattern)
        for pattern, keys in self._newly_served.items():
            for key in sorted(keys):
                store.note_served(pattern, key)
        self._restarted = set()
        self._newly_served = {}

    def _hold_all(self, name: str, patterns: tuple[str, ...]) -> None:
        """Every job of `name` is held, by each of `patterns`, whatever it costs."""
        if name in self._held_names or not self._held_patterns.isdisjoint(patterns):
            return
        self._held_names.add(name)
        for pattern in patterns:
            count = self._names_by_pattern.get(pattern, 0) + 1
            self._names_by_pattern[pattern] = count
            if count >= HELD_NAMES_BY_PATTERN:
                # Names of their own for each job (`report/2026-11-29/7`):
                # one test of the pattern instead of a list without end.
                self._held_patterns.add(pattern)

    def _hold_for(
        self, name: str, pattern: str, key: str, per_key: bool
    ) -> list[tuple[str, str]]:
        """Every job of `name` that a limit holds whatever it costs: of any
        key, or of `key` alone for a per-key limit. What it adds to the
        lists of one key's holds (a name, and past
        HELD_NAMES_BY_PATTERN names the pattern, each with the key)."""
        if not per_key:
            self._hold_all(name, (pattern,))
            return []
        if (pattern, key) in self._held_keyed or (name, key) in self._held_pairs:
            return []
        added = [(name, key)]
        self._held_pairs.add((name, key))
        count = self._pairs_by_pattern.get((pattern, key), 0) + 1
        self._pairs_by_pattern[pattern, key] = count
        if count >= HELD_NAMES_BY_PATTERN:
            self._held_keyed.add((pattern, key))
            added.append((pattern, key))
        return added

    def _hold_turn(self, name: str, pattern: str, key: str) -> None:
        """A fair pattern has served `key` in this round: its jobs wait for
        the next, which begins when no other key's job is left (new_rounds)."""
        self.waiting_turn = (pattern, key)
        self._fair_keys.setdefault(pattern, set()).add(key)
        added = self._hold_for(name, pattern, key, per_key=True)
        self._fair_holds.setdefault(pattern, set()).update(added)
        if added:
            self._fair_pairs[added[0]] = pattern

    def _verdict(self, name: str) -> flow.Verdict | None:
        found = self._index.cached(name)
        if found is None and self._budget.spend(self._index.name_cost(name)):
            found = self._index.verdict(name)
        return found

    def _lock(self) -> None:
        """Before the first count: from here on no other node hands out a
        job under any limit until this transaction ends."""
        if not self._locked:
            self._locked = True
            self._ctx.store.hold_limits()

    def _read(self, rows: int) -> bool:
        """Spend what a read of `rows` rows costs."""
        return self._budget.spend(flow.USAGE_COST + ROW_COST * rows)

    def _used(self, pattern: str, key: str, per_key: bool) -> int | None:
        if (pattern, key) in self._usage:
            return self._usage[pattern, key]
        if self._all_read or pattern in self._usage_read:
            # Every (name, key) with a running job was read.
            return self._usage.setdefault((pattern, key), 0)
        self._lock()
        if len(self._usage) >= USAGES_ONE_BY_ONE and not self._read_all_tried:
            return self._used_of_all(pattern, key, per_key)
        if per_key:
            # Every key's at once: one statement, however many keys.
            by_key = self._ctx.store.usage_by_key(pattern, self._ctx.now_ms)
            if not self._read(len(by_key)):
                return None
            self._usage.update(((pattern, k), cost) for k, cost in by_key.items())
            self._usage_read.add(pattern)
            return self._usage.setdefault((pattern, key), 0)
        if not self._budget.spend(flow.usage_cost(pattern)):
            return None
        used = self._ctx.store.usage(pattern, self._ctx.now_ms)
        self._usage[pattern, key] = used
        return used

    def _used_of_all(self, pattern: str, key: str, per_key: bool) -> int | None:
        """Every limit's usage at once, from the running jobs' costs by name
        and key and what holds each name: read one by one, 200 full limits
        in front of a free job spent the search's budget, and every GetJob
        answered 404 while they waited."""
        self._read_all_tried = True
        by_name = self._ctx.store.usage_by_name(self._ctx.now_ms, MOST_RUNNING_NAMES)
        if len(by_name) > MOST_RUNNING_NAMES:
            # More running names than a search may read: each limit's
            # usage an index range of its own again.
            return self._used(pattern, key, per_key)
        if not self._budget.spend(flow.USAGE_SCAN_COST + len(by_name)):
            return None
        # Counted from the start: the hand-outs of this search are running.
        usage: dict[tuple[str, str], int] = {}
        for name, job_key, cost in by_name:
            verdict = self._verdict(name)
            if verdict is None:
                return None
            for limit_pattern in verdict.limits:
                limit = self._index.limits[limit_pattern]
                if limit.max:
                    scope = (limit_pattern, job_key if limit.per_key else "")
                    usage[scope] = usage.get(scope, 0) + cost
        # A limit (or a key of one) without a running job uses nothing.
        self._usage = usage
        self._all_read = True
        return usage.setdefault((pattern, key), 0)

    def _window(self, pattern: str, key: str, rate: Rate) -> _Window | None:
        """The hand-outs of a rate's current window (of one key): every
        key's read at once."""
        if pattern not in self._rates_read:
            self._lock()
            ctx = self._ctx
            since = _before(ctx.now_ms, rate.window_ms)
            by_key = ctx.store.handouts_by_key(pattern, since)
            if not self._read(len(by_key)):
                return None
            for counted_key, (count, earliest) in by_key.items():
                self._rates[pattern, counted_key] = _Window(count, earliest)
            self._rates_read.add(pattern)
        return self._rates.setdefault((pattern, key), _Window(0, self._ctx.now_ms))

    def _served_keys(self, pattern: str) -> set[str] | None:
        """The keys a fair pattern has served in its current round."""
        served = self._served.get(pattern)
        if served is None:
            self._lock()
            keys = self._ctx.store.served_keys(pattern)
            if not self._read(len(keys)):
                return None
            served = self._served[pattern] = set(keys)
        return served


def _before(moment: str, window_ms: int) -> str:
    """The moment `window_ms` before `moment` (stored text, UTC)."""
    return times.to_millis(times.parse_stored(moment) - timedelta(milliseconds=window_ms))


@dataclass
class _Window:
    """A rate's hand-outs in the window that ends now: how many, and when
    the earliest was."""

    count: int
    earliest: str

    def frees_at(self, rate: Rate) -> str:
        """When the earliest leaves the window, and the rate may allow one
        more (or, past a lowered rate, when the next check is due)."""
        moment = times.parse_stored(self.earliest) + timedelta(milliseconds=rate.window_ms)
        return times.to_millis(moment)


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
    bytes, and PER_JOB_EXTRA for the rest. With a parent's or children's
    data, the object is encoded."""
    if "parentData" in obj or "finishedChildJobs" in obj:
        return len(jsonbody.encode(obj)) + PER_JOB_EXTRA
    texts = (
        job.created, job.name, job.nextRun, job.lastRun or "", job.repeat,
        job.retryAfter, job.timeWindows, job.timeZone,
    )
    data = len(job.data) if job.data.isascii() else len(job.data.encode("utf-8"))
    return data + 6 * sum(map(len, texts)) + PER_JOB_EXTRA


def serve_waiters(
    ctx: Context, queries: list[JobQuery]
) -> tuple[list[list[Taken] | None], str | None]:
    """Try waiting GetJobs oldest first. A selector that found nothing is
    not tried again in the same pass, so ten thousand waiters on one name
    cost one query, not ten thousand."""
    empty: set[tuple[object, ...]] = set()
    handed: list[list[Taken] | None] = []
    # One budget and one count of usage for the whole pass.
    holds = Holds(ctx) if ctx.store.limits or ctx.store.paused else None
    with ctx.store.holding_writes():
        for query in queries:
            taken = [] if query.selector in empty else take(ctx, query, holds)
            if not taken:
                empty.add(query.selector)
            handed.append(taken or None)
    return handed, ctx.store.next_due(ctx.now_ms)


def give_back(ctx: Context, taken: list[Taken]) -> None:
    """Undo hand-outs whose reply never reached the client."""
    for item in taken:
        lifecycle.give_back(ctx, item.job, item.lease)
