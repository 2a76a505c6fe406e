"""A batch's requests in one open transaction, each undone alone if it fails.

The engine (engine.py) opens a transaction, hands the writer a batch of
work, serves the waiting GetJobs that the batch made ready, and commits;
the writer runs each piece of work on a Context of its own and returns
every outcome, and what the batch made due. Most requests either succeed
or fail before they write anything, so a batch first runs without a
savepoint per request; only if a request failed after writing is the batch
rolled back and run again with savepoints. A transaction that fails as a
whole is rolled back here, and each of its requests gets the status that
says why. A transaction that ends under the batch (SQLite rolled it back,
PostgreSQL's connection was lost) takes every request of the batch with
it: the writer never opens another in its place midway, since the commit
of that one would seem to confirm what the lost one held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import outcome

from jobserver.core.engine.clock import Clock
from jobserver.core.engine.context import Context, Settings
from jobserver.core.engine.history import Events
from jobserver.core.engine.work import Work
from jobserver.core.errors import CommandError
from jobserver.core.rules.selection import Taken
from jobserver.model import times
from jobserver.storage.interface import OutcomeUnknown, Storage

log = logging.getLogger("jobserver")

# A failed transaction is logged at most once in this long.
REPEAT_LOG_SECONDS = 10.0
# Runs of a batch that the database undid for a reason that running it
# again removes (a deadlock between nodes), before its requests get 503.
TRANSIENT_ATTEMPTS = 3

# The outcome of each piece of work and, if it succeeded, its Context.
Results = list[tuple[outcome.Maybe[Any], Context | None]]


@dataclass
class Ran:
    """A batch run in the open transaction: one outcome per piece of work,
    the names it made due now, and the earliest future time it wrote."""

    outcomes: list[outcome.Maybe[Any]]
    ready: set[str]
    due: str | None
    # What the requests that succeeded count in the history.
    events: list[Events] = field(default_factory=list)
    # The jobs they handed out.
    taken: list[Taken] = field(default_factory=list)
    # The awaited jobs they ended (AwaitJob).
    ended: set[int] = field(default_factory=set)
    # Whether a cascade left dependents for later (cascade.left_over).
    cascade_left: bool = False

    @staticmethod
    def nothing() -> Ran:
        """The run of no work."""
        return Ran([], set(), None)

    def followed_by(self, after: Ran) -> Ran:
        """This run and `after`, run next in the same transaction, as one."""
        return Ran(
            self.outcomes + after.outcomes, self.ready | after.ready,
            earliest(self.due, after.due), self.events + after.events, self.taken + after.taken,
            self.ended | after.ended, self.cascade_left or after.cascade_left,
        )

    def announced(self) -> Ran:
        """This run, its names and due time told already (to the waiters
        it woke, whose tries follow it)."""
        return Ran(
            self.outcomes, set(), None, self.events, self.taken, self.ended, self.cascade_left
        )


class Writer:
    def __init__(self, store: Storage, clock: Clock, settings: Settings) -> None:
        self._store = store
        self._clock = clock
        self.settings = settings
        # When a failure was last logged, and how many went unlogged since.
        self._failure_logged = -REPEAT_LOG_SECONDS
        self._failures_unlogged = 0

    def execute(self, batch: Sequence[Work]) -> Ran:
        """Run a batch in the open transaction (not committed)."""
        store = self._store
        results = self.run_all(batch, savepoints=False)
        if results is None:
            store.rollback()
            store.begin()
            results = self.run_all(batch, savepoints=True)
            assert results is not None
        return ran(results)

    def now_ms(self) -> str:
        """The writer's clock now, to the millisecond."""
        return times.to_millis(self._clock.now())

    def run_all(
        self, batch: Sequence[Work], savepoints: bool, first_open: bool = False
    ) -> Results | None:
        """Each request's outcome and, if it succeeded, its context. None
        when, without savepoints, a failed request left changes behind or
        lost the transaction; with savepoints, a lost transaction raises
        TransactionLost. `first_open`: the first request's savepoint is
        open already (opened with the transaction, Storage.begin)."""
        store = self._store
        settings = self.settings
        now = self._clock.now()
        now_ms = times.to_millis(now)
        results: Results = []
        for work in batch:
            ctx = Context(store, now, settings, now_ms=now_ms)
            before = store.total_changes
            if savepoints and not first_open:
                store.savepoint()
            first_open = False
            result = self._run_one(work, ctx)
            if isinstance(result, outcome.Value):
                if savepoints:
                    store.release()
                results.append((result, ctx))
                continue
            if not savepoints and (store.total_changes != before or not store.in_transaction):
                # The batch starts over (execute): nothing of this run is kept.
                return None
            if not store.in_transaction:
                # The whole transaction is gone: SQLite rolled it back (disk
                # full, I/O error), or PostgreSQL's connection was lost. The
                # requests before this one, and the batch these tries were
                # added to, went with it: none of them may be answered as
                # done, and no later one may open a new transaction whose
                # commit their answers would then seem to follow.
                raise TransactionLost(_failure(result))
            if savepoints:
                store.rollback_savepoint()
            results.append((result, None))
        return results

    def failed(self, works: Sequence[Work], error: Exception) -> list[outcome.Maybe[Any]]:
        """Roll a failed transaction back: one outcome for each of its
        requests (an outcome can be unwrapped only once)."""
        status = self.abandon(error)
        return [outcome.Error(CommandError(status)) for _ in works]

    def unknown(self, works: Sequence[Work], error: OutcomeUnknown) -> list[outcome.Maybe[Any]]:
        """A transaction whose COMMIT was cut off, and whose outcome could
        not be learned: its requests' outcomes."""
        self._log_failure(error)
        # Nothing is left to undo on the lost connection: this makes the
        # store read flow control again.
        self._store_rollback()
        return outcomes_unknown(works, str(error))

    def abandon(self, error: Exception) -> str:
        """Roll a failed transaction back; the status its requests get."""
        if isinstance(error, TransientFailed | TransactionLost):
            status = f"503 Database unavailable: {error}"
        elif isinstance(error, self._store.errors):
            self._log_failure(error)
            status = f"503 Database unavailable: {error}"
        else:
            log.exception("transaction failed")
            status = "500 Unhandled Exception"
        self._store_rollback()
        return status

    def _store_rollback(self) -> None:
        try:
            self._store.rollback()
        except self._store.errors as rollback_error:
            # SQLite undoes an uncommitted transaction itself when it next
            # opens one; the engine must live on to answer the next batch.
            log.error("rollback failed: %s", rollback_error)

    def _log_failure(self, error: Exception) -> None:
        """Log a failed transaction, at most once every REPEAT_LOG_SECONDS
        at error level (the others at debug, counted), so that an outage,
        which fails every batch, does not flood the log."""
        now = time.monotonic()
        if now - self._failure_logged < REPEAT_LOG_SECONDS:
            self._failures_unlogged += 1
            log.debug("transaction failed: %s", error)
            return
        unlogged, self._failures_unlogged = self._failures_unlogged, 0
        self._failure_logged = now
        more = f" ({unlogged} more failed since the last such line)" if unlogged else ""
        log.error("transaction failed: %s%s", error, more)

    def _run_one(self, work: Work, ctx: Context) -> outcome.Maybe[Any]:
        try:
            return outcome.Value(work.run(ctx))
        except CommandError as error:
            return outcome.Error(error)
        except self._store.transient:
            # The whole batch is run again (see batch.Batches._transact).
            raise
        except self._store.errors as error:
            log.error("query failed: %s", error)
            return outcome.Error(CommandError(f"502 Query failed: {error}"))
        except Exception as error:
            log.exception("unhandled error in a request")
            return outcome.Error(CommandError(f"500 Unhandled Exception: {type(error).__name__}"))


@dataclass
class Committed:
    """A batch after its transaction: every piece of work that ran in it
    (waiters' tries served in it included), their outcomes, whether it
    committed, and what it made ready or due."""

    works: list[Work]
    outcomes: list[outcome.Maybe[Any]]
    ok: bool
    ready: set[str] = field(default_factory=set)
    due: str | None = None
    # Whether it changed anything: a batch of reads needs no sync of its own.
    wrote: bool = True
    # What its requests count in the history, once it committed.
    events: list[Events] = field(default_factory=list)
    # The jobs it handed out: given back if it is not known to have
    # committed (a commit cut off, a sync that failed).
    taken: list[Taken] = field(default_factory=list)
    # The awaited jobs it ended: their awaiters look again once it committed.
    ended: set[int] = field(default_factory=set)
    # Whether a cascade left dependents for later: looked for once it committed.
    cascade_left: bool = False
    # When the next job falls due, read with the commit of a batch that
    # tried waiters: the clock's alarm is set no later (the waiters that
    # found nothing are tried again then).
    next_due: str | None = None


class Transient(Exception):
    """The database undid the transaction; running it again may succeed."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class TransactionLost(Exception):
    """The open transaction ended under a request (rolled back by the
    database, or its connection lost): nothing in it was committed."""

    def __init__(self, failure: str) -> None:
        super().__init__(f"the transaction was lost: {failure}")


class TransientFailed(Exception):
    def __init__(self) -> None:
        super().__init__(f"transaction undone {TRANSIENT_ATTEMPTS} times in a row")


def outcomes_unknown(works: Sequence[Work], reason: str) -> list[outcome.Maybe[Any]]:
    """The outcomes of requests whose transaction may or may not have
    committed (or been made durable): `504 Outcome unknown`, which a
    client must not take for "nothing was done" (protocol.md 11)."""
    status = f"504 Outcome unknown: {reason}"
    return [outcome.Error(CommandError(status)) for _ in works]


def _failure(result: outcome.Maybe[Any]) -> str:
    """What a failed request's outcome says, for the log and the status."""
    if isinstance(result, outcome.Error):
        error = result.error
        return error.status if isinstance(error, CommandError) else str(error)
    return "the transaction ended"


def ran(results: Results) -> Ran:
    """The outcomes of many requests, the names they made due, the
    earliest future nextRun they wrote, and the events of those that
    succeeded."""
    outcomes: list[outcome.Maybe[Any]] = []
    ready: set[str] = set()
    due: str | None = None
    events: list[Events] = []
    taken: list[Taken] = []
    ended: set[int] = set()
    cascade_left = False
    for result, ctx in results:
        outcomes.append(result)
        if ctx is not None:
            ready |= ctx.ready
            ended |= ctx.ended
            cascade_left = cascade_left or ctx.cascade_left
            if ctx.due is not None and (due is None or ctx.due < due):
                due = ctx.due
            if ctx.events is not None:
                events.append(ctx.events)
            taken += ctx.taken
    return Ran(outcomes, ready, due, events, taken, ended, cascade_left)


def earliest(a: str | None, b: str | None) -> str | None:
    if a is None or b is None:
        return a if b is None else b
    return min(a, b)
