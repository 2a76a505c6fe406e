"""The named operations of storage (interface.Jobs), written once in the
SQL both backends speak (sql.py), for the writer's connection.

A backend subclasses SqlStore and gives it a connection (`_run`) and
its dialect, and overrides the few hooks where it must do more: take a
lock other nodes respect (PostgreSQL), or keep a cache of what the file
holds (SQLite). The hand-out search, `find_ready`, is each backend's own:
its fastest form differs (a query per priority on SQLite, a function
that does them all in one round trip on PostgreSQL).

Every operation that writes jobs takes many jobIDs at once and says which
it changed; a state change is fenced (`set_state_if`): only rows still in
an expected state, and holding an expected lease if one is given, change.

The jobs' own operations are here; those of the tables beside them come
in with their classes: flow control (sql_flow.py), replies and
idempotency keys (sql_replies.py), outcomes kept for AwaitJob
(sql_outcomes.py), dependencies (sql_dependencies.py); and the reads of
due times, pending cancels and stale jobs, which write nothing, in
sql_clock.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from jobserver.model.jobs import (
    NO_CHANGES,
    PLAIN,
    FinishedRun,
    Job,
    JobChanges,
    NewJob,
    OutcomesKept,
    State,
)
from jobserver.storage import sql, sql_bulk, sql_outcomes
from jobserver.storage.held_writes import Write
from jobserver.storage.searches import Found, NameMatch
from jobserver.storage.sql import JOB, Dialect
from jobserver.storage.sql_clock import ClockStatements
from jobserver.storage.sql_dependencies import DependencyStatements
from jobserver.storage.sql_flow import FlowStatements
from jobserver.storage.sql_outcomes import Outcomes
from jobserver.storage.sql_replies import ReplyStatements


class KeptRows(Protocol):
    """Job rows a backend keeps as they are stored (SQLite's writer,
    sqlite_rows.py), so that a row just read is not read again."""

    def get(self, job_id: int) -> Job | None: ...

    def keep(self, jobs: list[Job]) -> None:
        """Rows just read from the database."""

    def written(self, job_id: int, columns: dict[str, object]) -> None:
        """The last statement updated one job's row, setting `columns`."""


class SqlStore(DependencyStatements, Outcomes, FlowStatements, ReplyStatements, ClockStatements):
    """The named operations in SQL; a backend gives it a connection
    (`_run`), a dialect, and its hooks."""

    # Rows kept as stored, where a backend keeps them.
    _rows: KeptRows | None = None

    # Hooks.

    def _noted(self, priority: int, parent_id: int) -> None:
        """A job of this priority, and a child of this parent, may exist."""

    def _may_prune(self) -> bool:
        """False while another node prunes."""
        return True

    # Writing jobs.

    def create(
        self, jobs: Sequence[NewJob], *, created: str, state: str, ended: str = ""
    ) -> list[int]:
        """Store new jobs in `state`; their jobIDs, in order."""
        stored = State(state)
        return [self._insert(new, created, stored, ended) for new in jobs]

    def _insert(self, new: NewJob, created: str, state: State, ended: str) -> int:
        # Only what differs from the schema's defaults is written.
        columns: tuple[str, ...] = _NEW_JOB
        values: list[Any] = [
            created, state.value, new.name, new.next_run, new.repeat, new.data,
            new.priority, new.parent_id, new.retry_after,
        ]
        flow = new.flow
        if flow is not PLAIN and flow != PLAIN:
            columns += _FLOW
            values += (flow.cost, flow.windows, flow.zone, flow.key)
        if ended:
            columns += ("ended",)
            values.append(ended)
        policy = new.policy
        if policy is not None:
            columns += _POLICY
            values += (policy.max_attempts, policy.backoff, policy.delay, policy.max_delay)
        if new.dependencies:
            columns += _DEPENDENCIES
            values += (new.dependencies, new.blockers, new.on_dependency_failure)
        self._noted(new.priority, new.parent_id)
        held = self._held
        job_id = self._reserved_id()
        if held is not None and job_id is not None:
            values.append(job_id)
            columns = _NEW_JOB_WITH_ID if columns is _NEW_JOB else (*columns, "jobID")
            self._hold_insert(held, columns, tuple(values), job_id, new.parent_id)
            return job_id
        self._settle("INSERT")
        return self._insert_row(sql.insert_job(self.dialect, columns), values)

    def _insert_row(self, statement: str, args: Sequence[Any]) -> int:
        """Run an INSERT of one job; its jobID."""
        (job_id,) = self._ids(f"{statement} RETURNING jobID", args)
        return job_id

    def set_state_if(
        self,
        ids: Sequence[int],
        from_states: Sequence[str],
        to_state: str,
        changes: JobChanges = NO_CHANGES,
        lease: str | None = None,
    ) -> list[int]:
        """Move the jobs still in one of `from_states` (and holding `lease`,
        if given) to `to_state`, with `changes`; the jobIDs moved."""
        return self._write(ids, {"state": _state_name(to_state)}, changes, from_states, lease)

    def hand_out_plain(
        self, job_id: int, lease_id: str, worker: str, node: str, last_run: str, last_report: str
    ) -> bool:
        """Move a QUEUED job to RUNNING under `lease_id`, taken by `worker`
        on `node` at `last_run` (`last_report` to the millisecond): the
        write set_state_if makes of it, with its columns known in advance.
        Whether it moved."""
        held = self._held
        if held is None or job_id not in held.rows:
            changes = JobChanges(
                lastRun=last_run, leaseID=lease_id, lastReport=last_report, worker=worker,
                node=node,
            )
            return bool(self.set_state_if([job_id], (State.QUEUED,), State.RUNNING, changes))
        values = (_RUNNING, last_run, lease_id, last_report, worker, node)
        d = self.dialect
        write = Write(
            _update_head(d, _HANDED_OUT), _HANDED_OUT, values, job_id,
            _fence(d, _QUEUED, False), (), _fence(d, _QUEUED, False, many=True),
        )
        # _HANDED_OUT's columns, as a literal (dict(zip()) costs more).
        columns = {
            "state": _RUNNING, "lastRun": last_run, "leaseID": lease_id,
            "lastReport": last_report, "worker": worker, "node": node,
        }
        return held.write(write, columns, _QUEUED, None)

    def amend(self, ids: Sequence[int], changes: JobChanges) -> list[int]:
        """Set `changes` (never a state) on the jobs, in whatever state
        they are; the jobIDs changed."""
        return self._write(ids, {}, changes)

    def note_report(self, ids: Sequence[int], when: str) -> list[int]:
        """RUNNING jobs were heard from at `when` (the stale-job safety net)."""
        return self._write(ids, {}, JobChanges(lastReport=when), (State.RUNNING,))

    def _write(
        self,
        ids: Sequence[int],
        assigned: dict[str, object],
        changes: JobChanges,
        in_states: Sequence[str] | None = None,
        lease: str | None = None,
    ) -> list[int]:
        # Column names come from JobChanges' fields, never from a request.
        columns = {**assigned, **changes.columns()}
        if not columns or not ids:
            return []
        priority = columns.get("priority")
        if isinstance(priority, int):
            self._noted(priority, 0)
        head = _update_head(self.dialect, tuple(columns))
        states = None if in_states is None else tuple(in_states)
        fence = _fence(self.dialect, states, lease is not None, many=self._many(ids))
        leased = [] if lease is None else [lease]
        held = self._held
        if held is not None and len(ids) == 1 and ids[0] in held.rows:
            values = tuple(columns.values())
            many = _fence(self.dialect, states, lease is not None, many=True)
            write = Write(head, tuple(columns), values, ids[0], fence, tuple(leased), many)
            return list(ids) if held.write(write, columns, states, lease) else []
        changed = self._changed(head, list(columns.values()), ids, fence, leased)
        rows = self._rows
        if rows is not None and changed and len(ids) == 1:
            rows.written(ids[0], columns)
        return changed

    def delete(self, ids: Sequence[int], in_states: Sequence[str] | None = None) -> list[int]:
        """Delete the jobs (only those in one of `in_states`, if given); the
        jobIDs deleted."""
        if not ids:
            return []
        states = None if in_states is None else tuple(in_states)
        fence = _fence(self.dialect, states, False, many=self._many(ids))
        held = self._held
        if held is not None and len(ids) == 1 and ids[0] in held.rows:
            many = _fence(self.dialect, states, False, many=True)
            write = Write("DELETE FROM jobs", (), (), ids[0], fence, (), many)
            return list(ids) if held.write(write, None, states, None) else []
        return self._changed("DELETE FROM jobs", [], ids, fence, [])

    def finish_plain_runs(
        self,
        runs: Sequence[tuple[int, str | None]],
        named: Sequence[int],
        kept: OutcomesKept,
    ) -> list[FinishedRun]:
        """Delete, in one statement, the jobs of `runs` (jobID, and the
        leaseID the report holds, a lease token, or None) whose finish is only that: RUNNING
        under that lease, standalone, childless, without a repeat, a cancel
        asked for, dependencies or dependents, and data that holds neither
        `"retryAfterCount"` nor `"delete"` (which a finish rewrites or reads);
        the same statement keeps their outcomes as `kept` says. What each
        was. Every job of `named` is locked first, in key order.
        Only where one statement returns the rows it deletes (PostgreSQL);
        elsewhere none, and each run is finished the long way."""
        if not runs or not self.dialect.returning:
            return []
        named_ids = sql.integers(sorted(set(named)))
        args = [
            named_ids, sql.integers(run[0] for run in runs), sql.tokens(run[1] for run in runs),
            kept.ended, kept.awaited_until, kept.until,
        ]
        self._settle(_FINISH_PLAIN)
        _, rows = self._run_pair((_LOCK_NAMED, [named_ids]), (_FINISH_PLAIN, args))
        return [FinishedRun(int(r[0]), r[1], bool(r[2])) for r in rows]

    def _many(self, ids: Sequence[int]) -> bool:
        """Whether a write of `ids` is one statement over `jobID = ANY`."""
        return self.dialect.returning and len(ids) > 1

    def _changed(
        self, head: str, head_args: list[Any], ids: Sequence[int], where: str, args: list[Any]
    ) -> list[int]:
        """Run `head` (an UPDATE's SET, or a DELETE) on the jobs `ids` that
        also meet `where`; the jobIDs it changed. Where RETURNING is cheap,
        one statement for many; elsewhere (SQLite, whose RETURNING costs
        more than the write itself), and for one job everywhere, a
        statement a job by its key, counted: PostgreSQL plans `jobID = ANY`
        of an array for one job at a third more of its CPU than `jobID =`."""
        d = self.dialect
        if d.returning and len(ids) > 1:
            by_id, id_args = d.any_of("jobID", ids, "bigint")
            return self._ids(
                f"{head} WHERE {by_id}{where} RETURNING jobID", [*head_args, *id_args, *args]
            )
        statement = f"{head} WHERE jobID = {d.mark}{where}"
        execute = self._execute
        return [
            job_id for job_id in ids if execute(statement, [*head_args, job_id, *args]).rowcount
        ]

    # Reading jobs. A read by ID or name locks what it returns where other
    # nodes write (the caller may go on to change it).

    def get(self, job_id: int) -> Job | None:
        held = self._held
        if held is not None and job_id in held.rows:
            return held.rows[job_id]
        rows = self._rows
        kept = None if rows is None else rows.get(job_id)
        if kept is not None:
            return kept
        d = self.dialect
        job = self._job(f"SELECT {JOB} FROM jobs WHERE jobID = {d.mark}{d.lock}", (job_id,))
        if job is not None and rows is not None:
            rows.keep([job])
        return job

    def find_by_name(self, name: str) -> Job | None:
        """The oldest job with exactly this name that is not history. Two
        nodes creating the same unique job: the second waits for the first
        to commit, then finds its job."""
        d = self.dialect
        self._lock("name", name)
        oldest = (
            f"SELECT {JOB} FROM jobs WHERE name = {d.mark} AND {sql.NOT_HISTORY} "
            f"ORDER BY jobID LIMIT 1{d.lock}",
            (name,),
        )
        if not d.lock:
            return self._job(*oldest)
        # Asked again in a statement begun once the first has its lock (same
        # round trip), whose answer is taken: a transaction that held the
        # oldest job, and took no name lock (jobserver_create_job, a rename),
        # may have ended it and made another of the name, which the first
        # statement's snapshot, taken before it waited, cannot see. (The
        # second finds the first's row, locked, whenever the first found one.)
        self._settle(oldest[0])
        _, again = self._run_pair(oldest, oldest)
        return Job(*again[0]) if again else None

    def failed(self, *, pattern: str | None, names: Sequence[str], limit: int) -> list[Job]:
        """FAILED jobs whose name matches a GLOB `pattern` or is one of
        `names`, oldest first."""
        d = self.dialect
        if pattern is not None:
            clause, args = d.matches("name", pattern)
        else:
            clause, args = d.any_of("name", names)
        return self._jobs(
            f"SELECT {JOB} FROM jobs WHERE state = {sql.FAILED_SQL} AND {clause} "
            f"ORDER BY jobID LIMIT {d.mark}",
            (*args, limit),
        )

    def in_state(self, state: str, match: NameMatch, limit: int, examine: int) -> Found:
        """The oldest `limit` jobs in `state` whose name matches, among at
        most `examine` of the state's jobs whose names could (`sql_bulk.window`).
        Two statements: how many could, counted to one past `examine` in
        the index alone; then the pattern tried on those examined, the
        matches counted and the oldest listed."""
        d = self.dialect
        window, args = sql_bulk.window(d, state, match)
        (could,) = self._one(
            f"SELECT COUNT(*) FROM ({window} LIMIT {d.mark}) AS probe", (*args, examine + 1)
        )
        found, found_args = sql_bulk.found_in(d, state, match, f"{window} LIMIT {d.mark}")
        rows = self._execute(
            f"SELECT jobID, COUNT(*) OVER () FROM ({found}) AS found "
            f"ORDER BY jobID LIMIT {d.mark}",
            (*args, examine, *found_args, limit),
        ).fetchall()
        matched = int(rows[0][1]) if rows else 0
        examined = min(int(could), examine)
        return Found([int(row[0]) for row in rows], matched, examined, could <= examine)

    def count_by_state(self) -> dict[str, int]:
        rows = self._execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        return {str(state): int(count) for state, count in rows}

    # Parents and children. Every query repeats `parentJobID != 0` so that
    # SQLite may use the partial index on children.

    def children(self, parent_id: int, states: Sequence[str]) -> list[Job]:
        """Children of a job in these states, oldest first."""
        if not self._may_have_children(parent_id):
            return []
        held = self._held
        if held is not None and held.parents.get(parent_id) is False:
            return []
        clause, args = self.dialect.any_of("state", states)
        return self._jobs(
            f"SELECT {JOB} FROM jobs WHERE parentJobID != 0 AND parentJobID = "
            f"{self.dialect.mark} AND {clause} ORDER BY jobID",
            (parent_id, *args),
        )

    def has_children(self, parent_id: int, states: Sequence[str] | None = None) -> bool:
        """Whether a job has children (in these states, if given)."""
        if not self._may_have_children(parent_id):
            return False
        held = self._held
        if held is not None and states is None and parent_id in held.parents:
            return held.parents[parent_id]
        where, args = f"parentJobID != 0 AND parentJobID = {self.dialect.mark}", [parent_id]
        if states is not None:
            clause, state_args = self.dialect.any_of("state", states)
            where, args = f"{where} AND {clause}", [*args, *state_args]
        return self._one(f"SELECT 1 FROM jobs WHERE {where} LIMIT 1", args) is not None

    def delete_children(self, parent_id: int, states: Sequence[str]) -> int:
        """Delete a job's children in these states; how many went."""
        clause, args = self.dialect.any_of("state", states)
        rows = self._execute(
            f"DELETE FROM jobs WHERE parentJobID != 0 AND parentJobID = {self.dialect.mark} "
            f"AND {clause}",
            (parent_id, *args),
        )
        return max(rows.rowcount, 0)

    # Retention (protocol.md 14.10).

    def prune(self, state: str, ended_before: str, batch: int) -> int:
        """Delete up to `batch` standalone jobs in `state` (FINISHED or
        FAILED) that ended before `ended_before`, oldest first; how many went."""
        if not self._may_prune():
            return 0
        d = self.dialect
        rows = self._execute(
            f"DELETE FROM jobs WHERE jobID IN (SELECT jobID FROM jobs {d.indexed_by('jobsEnded')} "
            f"WHERE state IN ({sql.RETAINED_SQL}) AND parentJobID = 0 AND state = {d.mark} "
            f"AND ended < {d.mark} ORDER BY ended LIMIT {d.mark}{d.skip_locked}) "
            "RETURNING jobID, dependencies",
            (state, ended_before, batch),
        ).fetchall()
        # The edges of the pruned jobs that had dependencies go with them.
        self.forget_dependencies([int(row[0]) for row in rows if row[1]])
        return len(rows)



# The text of a write is made once per shape: a job's writes are few shapes,
# run many times (a hand-out, a finish), and building the text each time
# cost as much as SQLite's own work. Keyed by the dialect's mark (a str
# hashes at once; a frozen dataclass hashes every field, every time).
_HEADS: dict[tuple[str, tuple[str, ...]], str] = {}
_FENCES: dict[tuple[str, tuple[str, ...] | None, bool, bool], str] = {}
# A new job's columns: always, with flow options, with a retry policy.
_NEW_JOB = (
    "created", "state", "name", "nextRun", "repeat", "data", "priority", "parentJobID",
    "retryAfter",
)
_NEW_JOB_WITH_ID = (*_NEW_JOB, "jobID")
_FLOW = ("cost", "timeWindows", "timeZone", "key")
_POLICY = ("maxAttempts", "retryBackoff", "retryDelay", "retryMaxDelay")
_DEPENDENCIES = ("dependencies", "blockers", "onDependencyFailure")
_STATE_NAMES = {state.value: state.value for state in State}
# A plain hand-out's columns, in the order set_state_if writes them (the
# state, then JobChanges' fields'), so that it and a hand-out written
# through set_state_if make one statement together.
_HANDED_OUT = ("state", "lastRun", "leaseID", "lastReport", "worker", "node")
_RUNNING = State.RUNNING.value
_QUEUED: tuple[str, ...] = (State.QUEUED,)


# finish_plain_runs' statements (PostgreSQL). First every job the request
# names is locked, in key order, as `hold` locks them: a request never
# takes a lock after another of its own, and two requests naming the same
# jobs in any order and shape wait for each other rather than deadlock.
# The delete is a statement of its own, begun once the locks are held: a
# statement sees what its snapshot, taken before it waited for a lock, saw,
# and would miss a child that the transaction it waited for created.
# It finds the runs whose lease matches among the named rows (`locked`,
# read once), and deletes them by key (an index read of the key whatever
# the planner knows of the table: joined to unnest, it once read every
# RUNNING job for each run); the state as an expression, as in _fence;
# children looked for in jobsParentJobIDState (which `!= 0` lets the
# planner use: without it, it read the whole table for each job).
_LOCK_NAMED = "SELECT jobID FROM jobs WHERE jobID = ANY(%s::bigint[]) ORDER BY jobID FOR UPDATE"
_FINISH_PLAIN = f"""WITH locked AS MATERIALIZED (
    SELECT jobID, leaseID FROM jobs WHERE jobID = ANY(%s::bigint[])
), gone AS (
DELETE FROM jobs
WHERE jobs.jobID = ANY(ARRAY(
    SELECT locked.jobID FROM locked JOIN unnest(%s::bigint[], %s::text[]) AS run(id, lease)
    ON locked.jobID = run.id WHERE run.lease IS NULL OR locked.leaseID = run.lease
))
AND (jobs.state || '') = '{State.RUNNING.value}' AND jobs.parentJobID = 0 AND jobs.repeat = ''
AND jobs.cancelRequested = 0 AND jobs.dependencies = 0 AND jobs.dependents = 0
AND strpos(jobs.data, '"retryAfterCount"') = 0 AND strpos(jobs.data, '"delete"') = 0
AND NOT EXISTS (
    SELECT 1 FROM jobs AS child WHERE child.parentJobID = jobs.jobID AND child.parentJobID != 0
)
RETURNING jobs.jobID, jobs.name, jobs.data, jobs.lastError, jobs.awaited
), kept AS ({sql_outcomes.keep_finished("gone", "%s")})
SELECT jobID, name, awaited FROM gone"""


def _state_name(state: str) -> str:
    """A state's stored name; ValueError for anything that is not a State."""
    try:
        return _STATE_NAMES[state]
    except KeyError:
        raise ValueError(f"{state!r} is not a State") from None


def _update_head(d: Dialect, columns: tuple[str, ...]) -> str:
    key = (d.mark, columns)
    head = _HEADS.get(key)
    if head is None:
        head = _HEADS[key] = "UPDATE jobs SET " + ", ".join(f"{c} = {d.mark}" for c in columns)
    return head


def _fence(
    d: Dialect, in_states: tuple[str, ...] | None, leased: bool, many: bool = False
) -> str:
    """What a write asks of a job's row besides its ID: one of `in_states`
    (literals made from State, so a partial index serves them), and the
    lease given (a parameter). For a write of `many` jobs, found by their
    key (`jobID = ANY`), the state is tested as an expression no partial
    index matches: offered one, PostgreSQL's planner, its statistics of a
    queue table never current, ANDed it with the key's index and read all
    of it (50,000 entries of a queue to write 100 jobs, a time that grew
    with the queue)."""
    key = (d.mark, in_states, leased, many)
    fence = _FENCES.get(key)
    if fence is None:
        state = "(state || '')" if many else "state"
        where = "" if in_states is None else f" AND {state} IN ({sql.states(in_states)})"
        fence = _FENCES[key] = f"{where} AND leaseID = {d.mark}" if leased else where
    return fence
