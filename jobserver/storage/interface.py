"""What the core needs from storage: exactly this, and nothing of SQL.

SQLite (sqlite.py) is the default; PostgreSQL (postgres.py) lets several
nodes serve one queue. A backend is three parts:

- `Transactions`: the steps the writer uses to commit many requests at
  once (one transaction per batch, a savepoint per request);
- `Jobs`: named operations on jobs, limits, paused patterns and replies,
  in the writer's transaction, in the River way: each says what the core
  means (create, move jobs from a state to another, note a report, ...),
  takes many jobs at once where the core may have many, and says which
  it changed. A state change is fenced: only jobs still in an expected
  state (and holding an expected lease) change;
- `Readers`: what is read outside the writer, on connections of their own
  (reader_types.py, with what its reads return).

A backend never decides what a command means, and never sets a job's
state on its own, except where this interface says so (pruning, deleting
the ended children of a parent). The driver suite (tests/test_driver.py,
tests/test_driver_flow.py) tests every operation on every backend: a new
backend is complete when it passes.

Date arithmetic and the merge of JSON data are not the backend's: they
follow SQLite's semantics everywhere (model/sqlite_functions.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from jobserver.model.jobs import (
    NO_CHANGES,
    FinishedRun,
    Job,
    JobChanges,
    JobOutcome,
    NewJob,
    OutcomesKept,
)
from jobserver.model.limits import Limit
from jobserver.storage.dependency_types import Dependencies
from jobserver.storage.reader_types import Readers
from jobserver.storage.searches import NOTHING_PASSED, Found, NameMatch, PassedOver

# heard(names made due, earliest future time, awaited jobs that ended)
# from another node's commit; names None: anything may have changed; ended
# None: any awaited job may have ended.
Heard = Callable[["set[str] | None", "str | None", "frozenset[int] | None"], None]


class OutcomeUnknown(Exception):
    """A commit whose outcome could not be learned: the connection to the
    database was lost after COMMIT was sent, and asking again on a new
    one found no answer in time. The transaction may or may not have
    committed."""


class Transactions(Protocol):
    """One transaction per batch of the writer, a savepoint per request
    where needed. Savepoints nest: a request may open one of its own, by
    another name, inside the writer's (FinishJobs undoes a failed element
    alone). `sync` and `checkpoint_if_due` are SQLite's own (a commit there
    is made durable afterwards, from another thread); on PostgreSQL they do
    nothing, and `announce`/`listen` are PostgreSQL's (SQLite has no other
    nodes)."""

    # Exceptions that mean the database itself failed (locked, disk full,
    # I/O): the writer answers `503` and rolls back.
    errors: tuple[type[Exception], ...]
    # Among them, those after which the same transaction may simply be run
    # again (a deadlock between two nodes' transactions).
    transient: tuple[type[Exception], ...]
    # Whether a commit is durable only once `sync` has returned (the
    # writer then delivers outcomes after a sync); False when commits are
    # not to be synced one by one (--synchronous NORMAL, a memory database).
    needs_sync: bool
    # Whether its calls wait on the network: then every batch runs in a
    # worker thread, never on the event loop.
    blocking: bool

    def stop_waiting_long(self) -> None:
        """The server stops: waits for another process's lock are cut short."""

    @property
    def origin(self) -> Storage:
        """The store of the node's first writer, which the others were made
        from (itself for the first): what a node's writers share is kept
        by it (a cascade's look, core/rules/cascade.py)."""
        ...

    def writers(self) -> Sequence[Storage]:
        """The stores the engine runs batches on at once, each in a thread
        of its own: this one first, and on PostgreSQL the node's other
        writers, each on a connection of its own (--writers)."""
        ...

    @property
    def total_changes(self) -> int:
        """Rows changed so far: the writer compares it before and after a
        request to know whether it wrote."""

    @property
    def in_transaction(self) -> bool: ...

    def begin(self, savepoint: bool = False) -> None:
        """Open a write transaction, waiting for another process's lock
        up to the busy timeout; with `savepoint`, open the savepoint that
        `savepoint()` opens too, for a batch whose first work runs in one
        (PostgreSQL sends both in one round trip)."""

    def try_begin(self) -> bool:
        """Open a write transaction if that needs no waiting; False if
        another process holds the lock."""

    def commit(self) -> None:
        """Commit, not necessarily durably: see `sync`. Returns only if the
        transaction committed; raises one of `errors` only if it certainly
        did not (a COMMIT whose connection was lost is asked about again),
        and OutcomeUnknown when that could not be learned."""

    def commit_reading_next_due(self, after: str) -> str | None:
        """`next_due(after)` as the transaction left it, then `commit`, in
        the COMMIT's round trip where the backend can; the time read, or,
        if the commit's answer was lost and it committed, `after` itself
        (not known: a time already passed)."""

    def sync(self) -> None:
        """Make every commit so far durable. Called from another thread
        while the writer goes on; raises OSError if the disk fails."""

    def checkpoint_if_due(self) -> None:
        """Keep the log of commits short; called after syncs, from the
        same thread as `sync`."""

    def rollback(self) -> None: ...

    def savepoint(self, name: str = "request") -> None: ...

    def release(self, name: str = "request") -> None: ...

    def rollback_savepoint(self, name: str = "request") -> None:
        """Undo what was written since savepoint `name`, and close it."""

    def announce(self, ready: set[str], due: str | None, ended: set[int]) -> None:
        """Inside a transaction: tell the other nodes, once it commits,
        which names it made due, the earliest future time it wrote, and
        which awaited jobs it ended (AwaitJob)."""

    async def listen(self, heard: Heard) -> None:
        """Run until cancelled, calling `heard` on the event loop for what
        other nodes announce, and now and then with None ("look again").
        Returns at once when no other node can share the jobs."""


class Jobs(Dependencies, Protocol):
    """The named operations, in the writer's transaction. Where other nodes
    write the same jobs (PostgreSQL), a job read by its ID, its name or its
    reply key is locked until the transaction ends (the caller may go on to
    change it), and the searches that hand out or expire jobs pass over
    jobs another node holds."""

    # Flow control, read on every hand-out: kept in memory, in step with
    # what is stored (reloaded whenever a transaction is rolled back).
    limits: dict[str, Limit]
    paused: frozenset[str]

    # Writing jobs.

    def create(
        self, jobs: Sequence[NewJob], *, created: str, state: str, ended: str = ""
    ) -> list[int]:
        """Store new jobs in `state`; their jobIDs, in order."""

    def set_state_if(
        self,
        ids: Sequence[int],
        from_states: Sequence[str],
        to_state: str,
        changes: JobChanges = NO_CHANGES,
        lease: str | None = None,
    ) -> list[int]:
        """Move the jobs still in one of `from_states` (and holding lease
        `lease`, if given) to `to_state`, setting `changes` too; the jobIDs
        moved. The only way a job's state changes."""

    def hand_out_plain(
        self, job_id: int, lease_id: str, worker: str, node: str, last_run: str, last_report: str
    ) -> bool:
        """Move a QUEUED job to RUNNING under `lease_id`, taken by `worker`
        on `node` at `last_run` and `last_report`: what set_state_if of
        those changes does; whether it moved."""

    def amend(self, ids: Sequence[int], changes: JobChanges) -> list[int]:
        """Set `changes` on the jobs whatever their state; the jobIDs changed."""

    def note_report(self, ids: Sequence[int], when: str) -> list[int]:
        """RUNNING jobs were heard from at `when`; the jobIDs noted."""

    def delete(self, ids: Sequence[int], in_states: Sequence[str] | None = None) -> list[int]:
        """Delete the jobs (only those in one of `in_states`, if given); the
        jobIDs deleted."""

    def finish_plain_runs(
        self, runs: Sequence[tuple[int, str | None]], named: Sequence[int], kept: OutcomesKept
    ) -> list[FinishedRun]:
        """Delete in one statement the jobs of `runs` (jobID, and the leaseID
        their report holds, of a lease token's letters and digits, or None)
        whose finish is nothing more: RUNNING under that lease, standalone and
        childless, without a repeat, a cancel asked for, dependencies or
        dependents, with data a finish leaves as it is, and keep their
        outcomes (FINISHED, with their data and lastError) as `kept` says;
        what each deleted one was. Where other nodes write, every job of
        `named` (the request's, these among them) is locked first, in the
        order of their keys, as `hold` locks (the request then takes no lock
        after another), and the delete begins once they are held (so that it
        sees a child created by a transaction the lock waited for). A backend
        may finish none this way (SQLite): the caller finishes the rest one by
        one."""

    # Many jobs in a few statements (held_writes.py).

    def holding_writes(self) -> AbstractContextManager[None]:
        """Within: writes to held jobs are checked and answered at once and
        sent together, before any other statement and at the end; a
        savepoint is sent only if a statement must run inside it. Every
        operation answers as if each write had been sent."""

    def hold(self, ids: Sequence[int]) -> None:
        """While writes are held: read these jobs (locked where other nodes
        write), and whether each has children, asked in a second statement
        once the locks are held (so that a child created by a transaction
        the read waited for is seen), in one round trip where the backend
        can. The
        finds of `find_ready` are held too."""

    def reserve_ids(self, count: int) -> None:
        """While writes are held: the next `count` jobs created take jobIDs
        given now (in one statement, where that costs a round trip less
        than an insert's own), so that their inserts can be held too."""

    # Reading jobs.

    def get(self, job_id: int) -> Job | None: ...

    def find_ready(
        self,
        *,
        now: str,
        priorities: Sequence[int],
        limit: int,
        patterns: Sequence[str] = (),
        names: Sequence[str] = (),
        passed: PassedOver = NOTHING_PASSED,
    ) -> list[Job]:
        """Due jobs in a READY state, in hand-out order (protocol.md 4.4:
        priority in the order of `priorities`, then nextRun, name and
        jobID), matching one of the GLOB `patterns` or one of `names`,
        except what the search has `passed` over; at most `limit`."""

    def find_by_name(self, name: str) -> Job | None:
        """The oldest job with exactly this name that is not history (a
        standalone FINISHED job kept for retention)."""

    def failed(self, *, pattern: str | None, names: Sequence[str], limit: int) -> list[Job]:
        """FAILED jobs matching a GLOB `pattern` or one of `names`, oldest first."""

    def count_by_state(self) -> dict[str, int]: ...

    def in_state(self, state: str, match: NameMatch, limit: int, examine: int) -> Found:
        """The jobs in `state` (FAILED or QUEUED) whose name matches, among
        at most `examine` of that state's jobs whose names could match (the
        name, the queue's range, the range a pattern's literal start spans)
        read from the state's index of names; the oldest `limit` of them,
        read without a lock (`hold` them to change them)."""

    # Parents and children.

    def children(self, parent_id: int, states: Sequence[str]) -> list[Job]:
        """A job's children in these states, oldest first."""

    def has_children(self, parent_id: int, states: Sequence[str] | None = None) -> bool: ...

    def delete_children(self, parent_id: int, states: Sequence[str]) -> int:
        """Delete a job's children in these states; how many went."""

    # The clock.

    def next_due(self, after: str) -> str | None:
        """The earliest nextRun later than `after` of a job waiting to run,
        or reply deadline of a WAITING job."""

    def first_deadline(self) -> str | None:
        """The earliest reply deadline, or lease end of a job whose cancel
        is pending, passed or not."""

    def cancel_pending(self, job_ids: Sequence[int]) -> list[int]:
        """Of these jobs, those whose cancel is pending, in jobID order."""

    def cancels_due(self, now: str, limit: int) -> list[Job]:
        """RUNQUEUED jobs whose cancel is pending and whose lease has ended
        by `now`, earliest first."""

    def oldest_report(self) -> str | None:
        """The lastReport of the RUNNING job heard from least recently."""

    def stale(self, reported_before: str, limit: int) -> list[Job]:
        """RUNNING jobs last heard from at or before `reported_before`,
        least recently first."""

    # Replies (protocol.md 14.12).

    def waiting_on(self, key: str) -> Job | None:
        """The WAITING job waiting on `key`."""

    def overdue(self, now: str, limit: int) -> list[Job]:
        """WAITING jobs whose deadline has passed, earliest first."""

    def reply(self, key: str, now: str) -> tuple[str, int] | None:
        """A kept reply's data and the job it went to (0: none yet); None
        if there is none, or it expired (and is deleted here)."""

    def keep_reply(self, key: str, data: str, received: str, expires: str, job_id: int) -> None:
        """Keep a reply (replacing one kept under the same key)."""

    def claim_reply(self, key: str, job_id: int) -> None: ...

    def early_replies(self, now: str) -> int:
        """Unexpired replies that no job has claimed yet."""

    # Outcomes of ended jobs, for AwaitJob (protocol.md 14.27).

    def keep_job_outcome(self, outcome: JobOutcome) -> None:
        """Keep a job's outcome until its `expires` (replacing an older one)."""

    def job_outcome(self, job_id: int, now: str) -> JobOutcome | None:
        """The outcome kept of a job, unless it expired by `now`."""

    def ended_of(self, ids: list[int], now: str) -> list[int]:
        """Of these jobs, those whose outcome is kept."""

    def prune_outcomes(self, now: str, batch: int) -> int:
        """Delete up to `batch` outcomes kept past their time; how many went."""

    # Idempotency keys (protocol.md 14.22).

    def idempotent(self, key: str, now: str) -> tuple[str, str] | None:
        """The request (its fingerprint) and the reply kept under `key`,
        unless it expired by `now`; where other nodes write, the key is
        locked until the transaction ends, so a request given the same key
        on another node meanwhile waits and then finds this one's."""

    def keep_idempotent(self, key: str, request: str, reply: str, expires: str) -> None:
        """Keep a request's fingerprint and reply under `key` until
        `expires` (replacing one that expired)."""

    # Flow control (protocol.md 14.7 to 14.9, 14.23).

    def set_limit(self, pattern: str, limit: Limit) -> None:
        """Store a limit; one that holds nothing (`Limit.is_set` false)
        removes it. What its rate and fairness remembered is forgotten."""

    def hold_limits(self) -> None:
        """Until the transaction ends, no other node hands out a job under
        any limit: called before the `usage` that decides a hand-out."""

    def usage(self, pattern: str, now: str, key: str | None = None) -> int:
        """The cost of the running jobs a limit's pattern matches: RUNNING,
        and RUNQUEUED whose lease has not run out at `now`; of one `key`
        alone when given."""

    def usage_by_name(self, now: str, most: int) -> list[tuple[str, str, int]]:
        """The cost of the running jobs (as `usage` counts them) of each
        name and key that has any, in one statement: at most `most` + 1
        (name, key) pairs (more than `most` says there are too many to
        read so)."""

    def usage_by_key(self, pattern: str, now: str) -> dict[str, int]:
        """What the running jobs a per-key limit's pattern matches use (as
        `usage` counts them), by key: the keys that use any."""

    def handouts_by_key(self, pattern: str, since: str) -> dict[str, tuple[int, str]]:
        """For each key ('' for a rate that counts keys together), how many
        hand-outs under a rate's `pattern` came after `since`, and the
        earliest of them: called after `hold_limits`."""

    def note_handout(self, pattern: str, key: str, at: str, forget_before: str) -> None:
        """Count a hand-out under a rate at `at`; those of the same pattern
        and key at or before `forget_before` are forgotten."""

    def served_keys(self, pattern: str) -> list[str]:
        """The keys a fair pattern has handed out a job of in its current
        round."""

    def note_served(self, pattern: str, key: str) -> None: ...

    def new_round(self, pattern: str) -> None:
        """A fair pattern's next round: no key has been served in it."""

    def prune_handouts(self, before: str, batch: int) -> int:
        """Forget up to about `batch` hand-outs under rates from before
        `before`; how many went."""

    def pause(self, pattern: str) -> None: ...

    def resume(self, pattern: str) -> bool:
        """Forget a paused pattern; False if it was not paused."""

    # Retention (protocol.md 14.10).

    def prune(self, state: str, ended_before: str, batch: int) -> int:
        """Delete up to `batch` standalone jobs in `state` (FINISHED or
        FAILED) that ended before `ended_before`; how many went."""

    def prune_replies(self, now: str, batch: int) -> int:
        """Delete up to `batch` expired replies; how many went."""

    def prune_idempotency(self, now: str, batch: int) -> int:
        """Delete up to `batch` expired idempotency keys; how many went."""

    def reclaim_space(self, pruned: bool) -> bool:
        """Give freed space back to the system, a bounded step; True when
        more is left."""

    def size_bytes(self) -> int:
        """What the database takes on disk, for Status."""


class Storage(Transactions, Jobs, Readers, Protocol):
    """The jobs database, used by one thread at a time (its writer's),
    except for its Readers."""

    # What a human reads in logs and Status: a file path, or a URL.
    path: str

    def close(self) -> None: ...
