"""Group commit, pipelined: many requests per transaction, and the next
transaction runs while the previous one is being synced to disk.

Requests from all connections queue up; the writer task takes everything
waiting (up to `MAX_BATCH`), runs it in one transaction on the event loop
and commits without waiting for the disk. The batch then goes to the
durability stage (durability.py), which makes it durable with one sync of
the log in a thread, while the event loop goes on serving connections and
runs the next batch. Each request's outcome is reported only once a sync
that began after its commit has returned: a `200` is never sent for a write
that would not survive a power cut.

A batch runs in a worker thread instead when one of its requests is heavy
(a thousand jobs in one request, the pruner's deletions), so that the event
loop goes on answering meanwhile, or when another process holds the
database's lock, so that the event loop never waits for it.

Before committing, the writer serves the waiting GetJobs the batch made
ready, in the same transaction: a worker blocked in GetJob gets a new job
with the same sync that stored it.

Without threads (`threaded=False`) every batch, and its sync, runs on the
event loop: for tests on trio's MockClock, which may move time forward only
when every task waits, and cannot see a thread's work.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import outcome
import trio

from jobserver.core.engine.clock import Clock
from jobserver.core.engine.context import Context, Settings
from jobserver.core.engine.durability import Durability
from jobserver.core.engine.histogram import BATCH_BOUNDS, SECONDS_BOUNDS, Histogram
from jobserver.core.errors import CommandError
from jobserver.model import times
from jobserver.storage.interface import Storage

log = logging.getLogger("jobserver")

# Enough requests to amortise one transaction over many, few enough that
# the first request of a batch is not kept waiting long for the last.
MAX_BATCH = 256

# Runs of a batch that the database undid for a reason that running it
# again removes (a deadlock between nodes), before its requests get 503.
TRANSIENT_ATTEMPTS = 3

# A failed transaction is logged at most once in this long.
REPEAT_LOG_SECONDS = 10.0

# Rounds of late work a stopping writer runs (see Writer.stop): each one is
# what the previous round's outcomes asked for, so two or three suffice.
STOP_ROUNDS = 5

# notify(ready names, earliest future nextRun): runs on the event loop.
Notify = Callable[[set[str], "str | None"], None]


@dataclass(eq=False, slots=True)
class Work:
    run: Callable[[Context], Any]
    # Called on the event loop with the outcome once it is durable.
    done: Callable[[outcome.Maybe[Any]], None] | None = None
    # Or the task that waits for it in `call`, woken with the outcome.
    task: trio.lowlevel.Task | None = None
    # Runs long enough to hold up the event loop: its batch goes to a thread.
    heavy: bool = False


def _refuse_abort(raise_cancel: Any) -> trio.lowlevel.Abort:
    # A request handed to the writer is on its way to the disk: waiting for
    # its answer survives a cancellation, so nothing is left half-reported.
    return trio.lowlevel.Abort.FAILED


class Writer:
    def __init__(
        self,
        store: Storage,
        notify: Notify,
        clock: Clock,
        settings: Settings = Settings(),
        threaded: bool = True,
    ) -> None:
        self._store = store
        self._notify = notify
        self._clock = clock
        self.settings = settings
        self._threaded = threaded
        self._pending: deque[Work] = deque()
        # Set while the writer task sleeps for want of work.
        self._wakeup: trio.Event | None = None
        self._running = False
        self._stopping = False
        self._finished = trio.Event()
        self._batch_ended = trio.Event()
        self._durability = Durability(store, self._deliver, threaded)
        # While notifying inside a transaction, the requests that produces
        # are caught here instead of queued for the next batch.
        self._caught: list[Work] | None = None
        self.batches = 0
        self.requests = 0
        self.batch_sizes = Histogram(BATCH_BOUNDS)
        # From a batch's start to its commit (not its sync), as the event
        # loop sees it: a thread's hop included.
        self.commit_seconds = Histogram(SECONDS_BOUNDS)
        # When a failure was last logged, and how many went unlogged since.
        self._failure_logged = -REPEAT_LOG_SECONDS
        self._failures_unlogged = 0

    def start(self) -> None:
        self._durability.start()
        trio.lowlevel.spawn_system_task(self._run, name="jobserver-writer")

    def submit(self, work: Work) -> None:
        if self._caught is not None:
            self._caught.append(work)
            return
        self._pending.append(work)
        if self._wakeup is not None:
            self._wakeup.set()

    async def call(self, run: Callable[[Context], Any], heavy: bool = False) -> Any:
        """Run `run` in the writer and return its result once durable."""
        self.submit(Work(run, task=trio.lowlevel.current_task(), heavy=heavy))
        return await trio.lowlevel.wait_task_rescheduled(_refuse_abort)

    async def settled(self) -> None:
        """Until every commit made so far is durable: for replies that read
        the database some other way (Query's own connection)."""
        await self._durability.settled()

    async def stop(self) -> None:
        """Finish everything queued, then stop. While another process holds
        the database, what is left fails fast instead of each batch
        waiting out the busy timeout.

        The last batches' outcomes are delivered on the event loop, and
        what they submit (jobs given back by a waiting GetJob that left)
        queues behind them: so the writer goes on until a round submits
        nothing, or STOP_ROUNDS have passed."""
        self._store.stop_waiting_long()
        for _ in range(STOP_ROUNDS):
            await self._quiet()
            # The callbacks of the last deliveries run now.
            await trio.lowlevel.checkpoint()
            if not self._pending:
                break
        else:
            log.error("the writer was still given work after %d rounds of stopping", STOP_ROUNDS)
        self._stopping = True
        if self._wakeup is not None:
            self._wakeup.set()
        await self._finished.wait()
        await self._durability.stop()

    async def _quiet(self) -> None:
        """Until nothing is queued or running, and all of it is durable."""
        while self._pending or self._running:
            self._batch_ended = trio.Event()
            await self._batch_ended.wait()
        await self._durability.settled()

    async def _run(self) -> None:
        try:
            while self._pending or not self._stopping:
                if not self._pending:
                    self._wakeup = trio.Event()
                    await self._wakeup.wait()
                    # The task that woke the writer ran in the same round as
                    # every other task ready then: their requests are all here.
                    self._wakeup = None
                    continue
                # While the disk is behind, requests gather into a larger batch.
                await self._durability.room()
                count = min(len(self._pending), MAX_BATCH)
                batch = [self._pending.popleft() for _ in range(count)]
                self._running = True
                try:
                    await self._run_batch(batch)
                finally:
                    self._running = False
                    self._batch_ended.set()
                if self._pending:
                    # Work that followed this batch (what its notice asked
                    # for) waits a round, so connections are never starved.
                    await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._finished.set()

    @property
    def sync_seconds(self) -> Histogram:
        """How long each sync of the log to disk took."""
        return self._durability.sync_seconds

    async def _run_batch(self, batch: list[Work]) -> None:
        began = time.perf_counter()
        if not self._threaded:
            committed = self._transact(batch, begun=False, wake=True)
        elif (
            self._store.blocking
            or any(work.heavy for work in batch)
            or not self._try_begin()
        ):
            # Waiting for another process's lock, or a long run, happens off
            # the event loop. Waiters it wakes are served by the next batch.
            committed = await trio.to_thread.run_sync(self._transact, batch, False, False)
        else:
            committed = self._transact(batch, begun=True, wake=True)
        self.batches += 1
        self.requests += len(committed.works)
        self.batch_sizes.observe(len(committed.works))
        self.commit_seconds.observe(time.perf_counter() - began)
        # Waiting GetJobs hear of new jobs at once: the batch that serves
        # them is synced after this one, so nothing is handed out early.
        if committed.ready or committed.due is not None:
            _guarded(self._notify, committed.ready, committed.due)
        if committed.ok:
            self._durability.committed(committed.works, committed.outcomes, committed.wrote)
        else:
            self._deliver(committed.works, committed.outcomes)

    def _try_begin(self) -> bool:
        """Open the transaction at once, if no other process holds the lock."""
        try:
            return self._store.try_begin()
        except self._store.errors:
            # Tried again in the thread, which reports what goes wrong.
            return False

    def _transact(self, batch: list[Work], begun: bool, wake: bool) -> _Batch:
        """Run a batch and commit it (not yet durable), again if the
        database undid it for a reason that running it again removes (two
        nodes' transactions in a deadlock)."""
        for attempt in range(1, TRANSIENT_ATTEMPTS + 1):
            try:
                return self._transact_once(batch, begun and attempt == 1, wake)
            except _Transient as transient:
                log.warning(
                    "transaction undone by the database (%s); running it again (%d of %d)",
                    transient.error, attempt, TRANSIENT_ATTEMPTS,
                )
                self._abandon(transient.error)
        return self._failed(batch, _TransientFailed())

    def _transact_once(self, batch: list[Work], begun: bool, wake: bool) -> _Batch:
        """Run a batch and commit it. Whatever goes wrong, every request gets
        an outcome, waiting GetJobs caught for it included: a caller must
        never wait for a commit that will not come."""
        store = self._store
        caught: list[Work] = []
        try:
            if not begun:
                store.begin()
            changes_before = store.total_changes
            outcomes, ready, due = self._execute(batch)
            announced, announced_due = set(ready), due
            if wake and ready:
                caught, caught_outcomes, ready, due = self._wake_in_transaction(ready, due)
                outcomes += caught_outcomes
            announced |= ready
            announced_due = _earliest(announced_due, due)
            if announced or announced_due is not None:
                # Other nodes' waiters hear of it when it commits.
                store.announce(announced, announced_due)
            store.commit()
            wrote = store.total_changes != changes_before
            return _Batch(batch + caught, outcomes, True, ready, due, wrote)
        except Exception as error:  # a boundary: see above
            if isinstance(error, store.transient) and not caught:
                raise _Transient(error) from error
            return self._failed(batch + caught, error)

    def _failed(self, works: list[Work], error: Exception) -> _Batch:
        status = self._abandon(error)
        # One outcome each: an outcome can be unwrapped only once.
        failed: list[outcome.Maybe[Any]] = [outcome.Error(CommandError(status)) for _ in works]
        return _Batch(works, failed, False)

    def _abandon(self, error: Exception) -> str:
        """Roll a failed transaction back; the status its requests get."""
        if isinstance(error, _TransientFailed):
            status = f"503 Database unavailable: {error}"
        elif isinstance(error, self._store.errors):
            self._log_failure(error)
            status = f"503 Database unavailable: {error}"
        else:
            log.exception("transaction failed")
            status = "500 Unhandled Exception"
        try:
            self._store.rollback()
        except self._store.errors as rollback_error:
            # SQLite undoes an uncommitted transaction itself when it next
            # opens one; the writer must live on to answer the next batch.
            log.error("rollback failed: %s", rollback_error)
        return status

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

    def _deliver(self, works: list[Work], outcomes: list[outcome.Maybe[Any]]) -> None:
        """On the event loop. An exception from here would end the whole
        trio run, so each callback's is logged and kept to itself."""
        reschedule = trio.lowlevel.reschedule
        for work, result in zip(works, outcomes, strict=True):
            if work.task is not None:
                reschedule(work.task, result)
            elif work.done is not None:
                _guarded(work.done, result)

    def _wake_in_transaction(
        self, ready: set[str], due: str | None
    ) -> tuple[list[Work], list[outcome.Maybe[Any]], set[str], str | None]:
        """Serve, before the commit, the waiting GetJobs this batch woke:
        the requests caught, their outcomes, and what they in turn made
        ready or due (heard of after the commit)."""
        # Recorded before they run, so that they are answered even if the
        # transaction fails from here on.
        self._caught = []
        try:
            self._notify(ready, due)
        except Exception:
            log.exception("notifying waiting GetJobs failed")
        finally:
            caught, self._caught = self._caught, None
        if not caught:
            return [], [], set(), None
        results = self._run_all(caught, savepoints=True)
        assert results is not None
        later_ready, later_due = _merge(ctx for _, ctx in results)
        return caught, [result for result, _ in results], later_ready, later_due

    def _execute(self, batch: list[Work]) -> tuple[list[outcome.Maybe[Any]], set[str], str | None]:
        """Run a batch's requests in the open transaction (not committed).

        Most requests either succeed or fail before they write anything, so
        the batch first runs without a savepoint per request. Only if a
        request failed after writing is the batch rolled back and run again
        with savepoints, so that each request undoes only itself.
        """
        store = self._store
        results = self._run_all(batch, savepoints=False)
        if results is None:
            store.rollback()
            store.begin()
            results = self._run_all(batch, savepoints=True)
            assert results is not None
        ready, due = _merge(ctx for _, ctx in results)
        return [result for result, _ in results], ready, due

    def _run_all(
        self, batch: list[Work], savepoints: bool
    ) -> list[tuple[outcome.Maybe[Any], Context | None]] | None:
        """Each request's outcome and, if it succeeded, its context. None
        when, without savepoints, a failed request left changes behind."""
        store = self._store
        settings = self.settings
        now = self._clock.now()
        now_ms = times.to_millis(now)
        results: list[tuple[outcome.Maybe[Any], Context | None]] = []
        for work in batch:
            ctx = Context(store, now, settings, now_ms=now_ms)
            before = store.total_changes
            if savepoints:
                store.savepoint()
            result = self._run_one(work, ctx)
            if isinstance(result, outcome.Value):
                if savepoints:
                    store.release()
                results.append((result, ctx))
                continue
            if not savepoints and store.total_changes != before:
                return None
            if savepoints and store.in_transaction:
                store.rollback_savepoint()
            if not store.in_transaction:
                # SQLite rolled the whole transaction back (disk full, I/O
                # error): the requests before this one are undone too.
                results = [
                    (outcome.Error(CommandError("502 Transaction rolled back")), None)
                    for _ in results
                ]
                store.begin()
            results.append((result, None))
        return results

    def _run_one(self, work: Work, ctx: Context) -> outcome.Maybe[Any]:
        try:
            return outcome.Value(work.run(ctx))
        except CommandError as error:
            return outcome.Error(error)
        except self._store.transient:
            # The whole batch is run again (see _transact).
            raise
        except self._store.errors as error:
            log.error("query failed: %s", error)
            return outcome.Error(CommandError(f"502 Query failed: {error}"))
        except Exception as error:
            log.exception("unhandled error in a request")
            return outcome.Error(CommandError(f"500 Unhandled Exception: {type(error).__name__}"))


class _Transient(Exception):
    """The database undid the transaction; running it again may succeed."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _TransientFailed(Exception):
    def __init__(self) -> None:
        super().__init__(f"transaction undone {TRANSIENT_ATTEMPTS} times in a row")


def _guarded(callback: Callable[..., None], *args: Any) -> None:
    try:
        callback(*args)
    except Exception:
        log.exception("a commit's callback failed")


@dataclass
class _Batch:
    """A batch after its transaction: every request that ran in it (waiting
    GetJobs served in it included), their outcomes, whether it committed,
    and what it made ready or due."""

    works: list[Work]
    outcomes: list[outcome.Maybe[Any]]
    ok: bool
    ready: set[str] = field(default_factory=set)
    due: str | None = None
    # Whether it changed anything: a batch of reads needs no sync of its own.
    wrote: bool = True


def _earliest(a: str | None, b: str | None) -> str | None:
    if a is None or b is None:
        return a if b is None else b
    return min(a, b)


def _merge(contexts: Iterable[Context | None]) -> tuple[set[str], str | None]:
    """The names made due and the earliest future nextRun of many requests."""
    ready: set[str] = set()
    due: str | None = None
    for ctx in contexts:
        if ctx is not None:
            ready |= ctx.ready
            if ctx.due is not None and (due is None or ctx.due < due):
                due = ctx.due
    return ready, due
