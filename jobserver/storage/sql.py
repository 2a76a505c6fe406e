"""What SQLite and PostgreSQL say alike, written once, and the few places
where they differ, as a dialect's hooks.

Both backends run the same statements for the named operations of
storage (sql_store.py); a dialect says how a statement marks a parameter,
tests a list or a GLOB pattern, locks the rows it reads, and names an
index. State lists in SQL are built here from model/jobs.py's one
definition of the states, as literals: a partial index (whose predicate
is written that way in the schemas) serves only a query that says the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from jobserver.model.globmatch import glob_to_regex, is_glob
from jobserver.model.jobs import ACTIVE, READY, State

# A job's row, in the order of Job's fields.
COLUMNS = (
    "created", "jobID", "state", "name", "nextRun", "lastRun", "repeat", "data", "priority",
    "parentJobID", "retryAfter", "maxAttempts", "retryBackoff", "retryDelay", "retryMaxDelay",
    "attempts", "lastError", "leaseID", "cost", "timeWindows", "timeZone", "ended", "replyKey",
    "lastReport", "worker", "node", "key", "lease", "dependencies", "dependents",
    "onDependencyFailure", "cancelRequested", "awaited",
)
JOB = ", ".join(COLUMNS)
# The columns that are not text, as PostgreSQL's types (a write of many
# rows reads them from text).
NOT_TEXT = {
    "jobID": "bigint", "priority": "bigint", "parentJobID": "bigint", "maxAttempts": "bigint",
    "attempts": "bigint", "cost": "bigint", "lease": "bigint", "awaited": "bigint",
    "dependencies": "bigint", "dependents": "bigint", "blockers": "bigint", "retryDelay": "float8",
    "retryMaxDelay": "float8", "cancelRequested": "bigint",
}

# Standalone jobs in these states are kept for retention, then pruned
# (CANCELLED with FAILED's keep: a job cancelled is as dead as one failed).
RETAINED = (State.FINISHED, State.FAILED, State.CANCELLED)

# Hand-out order within a priority (protocol.md 4.4): the oldest nextRun
# first, then the name (the order of the indexes' ranges), then jobID.
HAND_OUT_ORDER = "nextRun, name, jobID"
# Where a search that has read up to a job goes on within that job's
# priority: the jobs after it in HAND_OUT_ORDER.
AFTER_IN_ORDER = "(nextRun, name, jobID) > ({0}, {0}, {0})"


def priorities_from(
    priorities: Sequence[int], after: tuple[int, str, str, int] | None
) -> Sequence[int]:
    """The priorities a search has still to read, in its order: from that
    of the job it read last on (those before it gave all they had)."""
    if after is None or after[0] not in priorities:
        return priorities
    return priorities[priorities.index(after[0]) :]


def integers(values: Iterable[int]) -> str:
    """PostgreSQL's array literal of integers, bound as text: psycopg
    dumps a list parameter element by element in Python, which showed in
    the profile of a drain."""
    return "{" + ",".join(map(str, map(int, values))) + "}"


def tokens(values: Iterable[str | None]) -> str:
    """PostgreSQL's array literal of lease tokens or NULLs, bound as text
    (as `integers`, for what psycopg's list dumper costs in Python). A
    token is letters and digits alone, so nothing in it needs quoting;
    anything else is a ValueError."""
    out = []
    for value in values:
        if value is None:
            out.append("NULL")
        elif value.isascii() and value.isalnum() and value.upper() != "NULL":
            out.append(value)
        else:
            raise ValueError(f"not a lease token: {value!r}")
    return "{" + ",".join(out) + "}"


def states(names: Iterable[str]) -> str:
    """States as SQL literals, quoted and separated by commas. Only names
    of model/jobs.py's State get here (ValueError otherwise)."""
    return ", ".join(f"'{State(name).value}'" for name in names)


READY_SQL = states(READY)
ACTIVE_SQL = states(ACTIVE)
RETAINED_SQL = states(RETAINED)
RUNNING_SQL = states((State.RUNNING,))
QUEUED_SQL = states((State.QUEUED,))
WAITING_SQL = states((State.WAITING,))
FAILED_SQL = states((State.FAILED,))
FINISHED_SQL = states((State.FINISHED,))
# Leased jobs whose cancel is pending (the index jobsCancelling).
CANCELLING = f"state = {states((State.RUNQUEUED,))} AND cancelRequested = 1"
# A finished standalone job kept for retention is history, not a job.
NOT_HISTORY = f"NOT (state = {states((State.FINISHED,))} AND parentJobID = 0)"
# The cost a job holds of a concurrency limit: RUNNING, or RUNQUEUED until
# its lease runs out (the parameter: now).
HOLDING = f"state IN ({ACTIVE_SQL}) AND (state = {RUNNING_SQL} OR nextRun > {{mark}})"


class Rows(Protocol):
    """What both drivers' cursors offer."""

    @property
    def rowcount(self) -> int: ...

    @property
    def description(self) -> Any: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


# A WHERE clause's text and the parameters it binds.
Clause = tuple[str, list[Any]]


@dataclass(frozen=True)
class Dialect:
    """How one database says what differs.

    mark: a parameter's placeholder. lock: the clause that locks the rows a
    read may go on to change (so that two nodes never change one job on the
    strength of what they read before the other wrote); skip_locked: the
    same, passing over rows another transaction holds; keep: the clause that
    keeps the rows a read relies on from being deleted until its transaction
    ends, other readers free to read them too. All three are empty where
    one process owns the database. hints: whether statements name the
    index they must use (SQLite's planner may pick a worse one). returning:
    whether a write says which rows it changed (RETURNING) at little cost:
    on SQLite it costs more than the write itself (about 12 µs against 9
    for one job's UPDATE), so there each job is written by a statement of
    its own and its row count read, and a new job's ID is the cursor's."""

    mark: str
    lock: str
    skip_locked: str
    keep: str
    hints: bool
    arrays: bool
    returning: bool

    def any_of(self, column: str, values: Sequence[Any], kind: str = "text") -> Clause:
        """`column` is one of `values` (a SQL type `kind` on PostgreSQL)."""
        if self.arrays:
            if kind == "bigint" and len(values) == 1:
                # One job (a FinishJob's lock, its children check): an
                # equality's plan is the same for every value, so PostgreSQL
                # keeps one generic plan for the prepared statement; with
                # `= ANY` it planned each execution anew for its one element
                # (74 µs a bind; docs/benchmarks.md).
                return f"{column} = {self.mark}::bigint", [int(values[0])]
            if kind == "bigint":
                return f"{column} = ANY({self.mark}::bigint[])", [integers(values)]
            return f"{column} = ANY({self.mark}::{kind}[])", [list(values)]
        return f"{column} IN ({', '.join(self.mark for _ in values)})", list(values)

    def matches(self, column: str, pattern: str) -> Clause:
        """`column` matches a GLOB pattern, with GLOB's rules on both."""
        if not self.arrays:
            return f"{column} GLOB {self.mark}", [pattern]
        if is_glob(pattern):
            return f"{column} ~ {self.mark}", [glob_to_regex(pattern)]
        return f"{column} = {self.mark}", [pattern]

    def indexed_by(self, index: str) -> str:
        return f"INDEXED BY {index}" if self.hints else ""

    def holding(self) -> str:
        return HOLDING.format(mark=self.mark)


SQLITE = Dialect(
    mark="?", lock="", skip_locked="", keep="", hints=True, arrays=False, returning=False
)
POSTGRES = Dialect(
    mark="%s",
    lock=" FOR UPDATE",
    skip_locked=" FOR UPDATE SKIP LOCKED",
    keep=" FOR KEY SHARE",
    hints=False,
    arrays=True,
    returning=True,
)


# Readers on connections of their own, the same on both.


# A new job's INSERT by its columns, made once for each set (a job's
# columns differ with what it asks for).
_INSERTS: dict[tuple[str, tuple[str, ...]], str] = {}


def insert_job(d: Dialect, columns: tuple[str, ...]) -> str:
    key = (d.mark, columns)
    statement = _INSERTS.get(key)
    if statement is None:
        marks = ", ".join(d.mark for _ in columns)
        statement = _INSERTS[key] = f"INSERT INTO jobs ({', '.join(columns)}) VALUES ({marks})"
    return statement


def running_by_name(d: Dialect) -> str:
    """The cost of the running jobs by name and key (Status); binds now."""
    return f"SELECT name, key, SUM(cost) FROM jobs WHERE {d.holding()} GROUP BY name, key"


# Rates whose windows one statement reads: two parameters each, well within
# what either database binds in a statement.
WINDOWS_PER_STATEMENT = 500


def _handouts_in_windows(d: Dialect, rates: int) -> str:
    """The most hand-outs of any one key in each rate's window (Status);
    binds (pattern, the window's start) for each of `rates`. Each window is
    a range of the handouts index, of every key of its pattern."""
    windows = ", ".join(f"({d.mark}, {d.mark})" for _ in range(rates))
    return (
        f"WITH windows(pattern, since) AS (VALUES {windows}) "
        "SELECT pattern, MAX(handed) FROM ("
        "SELECT h.pattern, COUNT(*) AS handed FROM handouts h JOIN windows w "
        "ON h.pattern = w.pattern AND h.at > w.since GROUP BY h.pattern, h.key"
        ") AS byKey GROUP BY pattern"
    )


def read_windows(
    d: Dialect,
    windows: Mapping[str, str],
    read: Callable[[str, list[str]], Iterable[Sequence[Any]]],
) -> dict[str, int]:
    """`handouts_in_windows` (storage.reader_types.Readers) in statements of
    WINDOWS_PER_STATEMENT rates, each run by `read` (statement, arguments)."""
    listed = sorted(windows.items())
    found: dict[str, int] = {}
    for first in range(0, len(listed), WINDOWS_PER_STATEMENT):
        chunk = listed[first : first + WINDOWS_PER_STATEMENT]
        args = [value for pair in chunk for value in pair]
        for pattern, handed in read(_handouts_in_windows(d, len(chunk)), args):
            found[str(pattern)] = int(handed)
    return found


def find_matching(d: Dialect, pattern: str, limit: int) -> Clause:
    """Jobs in any state whose name matches, newest first (the dashboard)."""
    clause, args = d.matches("name", pattern)
    return (
        f"SELECT {JOB} FROM jobs WHERE {clause} ORDER BY jobID DESC LIMIT {d.mark}",
        [*args, limit],
    )


def later_jobs(
    d: Dialect, now: str, retrying: bool, limit: int, most: int
) -> tuple[Clause, Clause]:
    """The dashboard's Scheduled (QUEUED jobs due after `now`) or, with
    `retrying`, Retries (those of them with failed attempts, waiting for
    their backoff): the soonest `limit`, and how many there are, counted up
    to `most` + 1 (past `most`, the count is "more than most").

    Each is an index range read in nextRun order: Retries' own index holds
    only the jobs it lists; Scheduled reads the waiting jobs' index (on
    PostgreSQL, jobsReadyNextRun; SQLite has none and reads Scheduled with
    sqlite_ready.scheduled), whose other jobs (RUNQUEUED: running under a
    lease) it passes over, so it reads at most as many more rows as jobs
    run under a lease."""
    if retrying:
        source = f"jobs {d.indexed_by('jobsRetrying')}"
        where = f"state = {QUEUED_SQL} AND attempts > 0"
    else:
        source, where = "jobs", f"state IN ({READY_SQL}) AND state = {QUEUED_SQL}"
    matching = f"FROM {source} WHERE {where} AND nextRun > {d.mark}"
    listed = (f"SELECT {JOB} {matching} ORDER BY nextRun, jobID LIMIT {d.mark}", [now, limit])
    counted = (
        f"SELECT COUNT(*) FROM (SELECT jobID {matching} LIMIT {d.mark}) AS later",
        [now, most + 1],
    )
    return listed, counted


# What RunningJobs reads of a job handed out (reader_types.RunningJob).
RUNNING_JOB = "jobID, name, state, lastRun, nextRun, lastReport, worker, node"


def running_jobs(
    d: Dialect, now: str, pattern: str | None, limit: int, newest: bool = False
) -> tuple[Clause, Clause]:
    """The jobs handed out at `now` whose name matches `pattern`, the
    longest running first, or the newest first (an index range read in
    order, either way, up to `limit`), and how many there are."""
    where, args = d.holding(), [now]
    if pattern is not None:
        clause, more = d.matches("name", pattern)
        where, args = f"{where} AND {clause}", [now, *more]
    listed = (
        f"SELECT {RUNNING_JOB} FROM jobs {d.indexed_by('jobsActiveStarted')} WHERE {where} "
        f"ORDER BY {'lastRun DESC, jobID DESC' if newest else 'lastRun, jobID'} LIMIT {d.mark}",
        [*args, limit],
    )
    return listed, (f"SELECT COUNT(*) FROM jobs WHERE {where}", args)


def prunable(d: Dialect) -> str:
    """Whether a standalone job of a state ended before a time: binds both."""
    return (
        f"SELECT 1 FROM jobs {d.indexed_by('jobsEnded')} WHERE state IN ({RETAINED_SQL}) "
        f"AND parentJobID = 0 AND state = {d.mark} AND ended < {d.mark} LIMIT 1"
    )


def expired_reply(d: Dialect) -> str:
    """Whether a reply expired; binds now."""
    return f"SELECT 1 FROM replies WHERE expires <= {d.mark} LIMIT 1"


def expired_idempotency_key(d: Dialect) -> str:
    """Whether an idempotency key expired; binds now."""
    return f"SELECT 1 FROM idempotency WHERE expires <= {d.mark} LIMIT 1"


def expired_outcome(d: Dialect) -> str:
    """Whether an ended job's outcome was kept past its time; binds now."""
    return f"SELECT 1 FROM outcomes WHERE expires <= {d.mark} LIMIT 1"


def expired_handout(d: Dialect) -> str:
    """Whether a rate's hand-out is older than any window; binds the cutoff
    (limits.handouts_cutoff)."""
    return f"SELECT 1 FROM handouts WHERE at < {d.mark} LIMIT 1"
