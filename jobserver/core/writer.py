"""Group commit: one thread runs every database request, many per transaction.

Requests from all connections queue up while a transaction commits; the
next transaction takes everything waiting (up to `MAX_BATCH`), runs the
requests, commits once (one fsync for the whole batch) and only then
reports each outcome back to the event loop. So a `200` is never sent for a
write that is not on disk, and the event loop never waits for the disk: it
keeps serving connections and gathering the next batch meanwhile.

Before committing, the thread asks the event loop which waiting GetJobs the
batch made ready and serves them in the same transaction, so a worker
blocked in GetJob gets a new job with the same fsync that stored it.

The writer can also run its batches on the event loop itself, without a
thread (`threaded=False`): for tests on trio's MockClock, which may move
time forward only when every task waits, and cannot see a thread's work.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import outcome
import trio

from jobserver.core.clock import Clock
from jobserver.core.context import Context, Settings
from jobserver.core.errors import CommandError
from jobserver.storage.interface import Storage

log = logging.getLogger("jobserver")

# Enough requests to amortise one fsync over many, few enough that the
# first request of a batch is not kept waiting long for the last.
MAX_BATCH = 256

# Rounds of late work a stopping writer runs (see Writer.stop): each one is
# what the previous round's outcomes asked for, so two or three suffice.
STOP_ROUNDS = 5

# notify(ready names, earliest future nextRun): runs on the event loop.
Notify = Callable[[set[str], "str | None"], None]


@dataclass
class Work:
    run: Callable[[Context], Any]
    # Called on the event loop with the outcome once it is committed.
    done: Callable[[outcome.Maybe[Any]], None]


_STOP = object()


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
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._token = trio.lowlevel.current_trio_token()
        self._threaded = threaded
        self._thread = threading.Thread(target=self._loop, name="jobserver-writer", daemon=True)
        # Without a thread: work waiting for the next batch on the event loop.
        self._pending: list[Work] = []
        self._drain_due = False
        # While the thread asks the loop whom a batch wakes, the requests
        # that produces are caught here instead of queued for later.
        self._caught: list[Work] | None = None
        # Read from the writer thread: whether any GetJob is waiting.
        self.anyone_waiting: Callable[[], bool] = lambda: True
        self.batches = 0
        self.requests = 0

    def start(self) -> None:
        if self._threaded:
            self._thread.start()

    def submit(self, work: Work) -> None:
        if self._caught is not None:
            self._caught.append(work)
        elif self._threaded:
            self._queue.put(work)
        else:
            self._pending.append(work)
            if not self._drain_due:
                self._drain_due = True
                self._token.run_sync_soon(self._drain)

    def _drain(self) -> None:
        """Without a thread: run what was submitted, in batches."""
        self._drain_due = False
        while self._pending:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            self._run_batch(batch)

    async def call(self, run: Callable[[Context], Any]) -> Any:
        """Run `run` in the writer and return its committed result."""
        done = trio.Event()
        result: list[outcome.Maybe[Any]] = []

        def finished(value: outcome.Maybe[Any]) -> None:
            result.append(value)
            done.set()

        self.submit(Work(run, finished))
        # The request is already on its way to the disk; waiting for its
        # answer must survive a shutdown so nothing is left half-reported.
        with trio.CancelScope(shield=True):
            await done.wait()
        return result[0].unwrap()

    async def stop(self) -> None:
        """Finish everything queued, then stop the thread. While another
        process holds the database, what is left fails fast instead of each
        batch waiting out the busy timeout.

        The last batches' outcomes are delivered on the event loop, and
        what they submit (jobs given back by a waiting GetJob that left)
        would queue behind the stop: so the writer runs again for it,
        until a round submits nothing, or STOP_ROUNDS have passed."""
        self._store.stop_waiting_long()
        if not self._threaded:
            for _ in range(STOP_ROUNDS):
                await trio.lowlevel.checkpoint()
            return
        for _ in range(STOP_ROUNDS):
            self._queue.put(_STOP)
            await trio.to_thread.run_sync(self._thread.join)
            # The outcomes delivered after the last batch run now.
            await trio.lowlevel.checkpoint()
            if self._queue.empty():
                return
            self._thread = threading.Thread(target=self._loop, name="jobserver-writer", daemon=True)
            self._thread.start()
        log.error("the writer was still given work after %d rounds of stopping", STOP_ROUNDS)

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch = [first]
            stop = False
            while len(batch) < MAX_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                batch.append(item)
            self._run_batch(batch)
            if stop:
                return

    def _run_batch(self, batch: list[Work]) -> None:
        woken = _Woken()
        try:
            outcomes, ready, due = self._execute(batch)
            self._wake_in_transaction(ready, due, woken)
            self._store.commit()
            batch = batch + woken.works
            outcomes += woken.outcomes
            self.batches += 1
            self.requests += len(batch)
        except Exception as error:  # noqa: BLE001 - a boundary: see below
            # Whatever went wrong, every request of the batch gets an answer,
            # waiting GetJobs caught for it included: a caller must never
            # wait for a commit that will not come.
            status = self._abandon(error)
            batch = batch + woken.works
            # One outcome each: an outcome can be unwrapped only once.
            outcomes = [outcome.Error(CommandError(status)) for _ in batch]
            woken = _Woken()
        self._token.run_sync_soon(self._deliver, batch, outcomes, woken)

    def _abandon(self, error: Exception) -> str:
        """Roll a failed transaction back; the status its requests get."""
        if isinstance(error, self._store.errors):
            log.error("transaction failed: %s", error)
            status = f"503 Database unavailable: {error}"
        else:
            log.exception("transaction failed")
            status = "500 Unhandled Exception"
        try:
            self._store.rollback()
        except self._store.errors as rollback_error:
            # SQLite undoes an uncommitted transaction itself when it next
            # opens one; the thread must live on to answer the next batch.
            log.error("rollback failed: %s", rollback_error)
        return status

    def _deliver(
        self, batch: list[Work], outcomes: list[outcome.Maybe[Any]], woken: _Woken
    ) -> None:
        """On the event loop. An exception from here would end the whole
        trio run, so each callback's is logged and kept to itself."""
        for work, result in zip(batch, outcomes, strict=False):
            _guarded(work.done, result)
        if woken.ready or woken.due is not None:
            _guarded(self._notify, woken.ready, woken.due)

    def _wake_in_transaction(self, ready: set[str], due: str | None, woken: _Woken) -> None:
        """Serve, before the commit, the waiting GetJobs this batch woke."""
        if not ready or not self.anyone_waiting():
            # Nobody to serve now (only a later due time, or no waiter):
            # skip the round trip to the event loop, which hears of this
            # after the commit instead. A GetJob that starts waiting
            # meanwhile tries after this commit, so it still sees the jobs.
            woken.ready, woken.due = ready, due
            return
        # Recorded before they run, so that they are answered even if the
        # transaction fails from here on.
        if self._threaded:
            woken.works = trio.from_thread.run_sync(self._catch, ready, due, trio_token=self._token)
        else:
            woken.works = self._catch(ready, due)
        if woken.works:
            results = self._run_all(woken.works, savepoints=True)
            assert results is not None
            woken.outcomes = [result for result, _ in results]
            woken.ready, woken.due = _merge(ctx for _, ctx in results)

    def _catch(self, ready: set[str], due: str | None) -> list[Work]:
        """On the event loop: the requests that notifying this produces,
        all of them even if notifying fails part way: each must be
        answered, or its waiting GetJob would wait for it forever."""
        self._caught = []
        try:
            self._notify(ready, due)
        except Exception:
            log.exception("notifying waiting GetJobs failed")
        caught, self._caught = self._caught, None
        return caught

    def _execute(self, batch: list[Work]) -> tuple[list[outcome.Maybe[Any]], set[str], str | None]:
        """Run a batch's requests in one open transaction (not committed).

        Most requests either succeed or fail before they write anything, so
        the batch first runs without a savepoint per request. Only if a
        request failed after writing is the batch rolled back and run again
        with savepoints, so that each request undoes only itself.
        """
        store = self._store
        store.begin()
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
        results: list[tuple[outcome.Maybe[Any], Context | None]] = []
        for work in batch:
            ctx = Context(store, self._clock.now(), self.settings)
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
        except self._store.errors as error:
            log.error("query failed: %s", error)
            return outcome.Error(CommandError(f"502 Query failed: {error}"))
        except Exception as error:
            log.exception("unhandled error in a request")
            return outcome.Error(CommandError(f"500 Unhandled Exception: {type(error).__name__}"))


def _guarded(callback: Callable[..., None], *args: Any) -> None:
    try:
        callback(*args)
    except Exception:
        log.exception("a commit's callback failed")


@dataclass
class _Woken:
    """Waiting GetJobs served inside a transaction, and what they changed."""

    works: list[Work] = field(default_factory=list)
    outcomes: list[outcome.Maybe[Any]] = field(default_factory=list)
    ready: set[str] = field(default_factory=set)
    due: str | None = None


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
