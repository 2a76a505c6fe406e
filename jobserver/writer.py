"""Group commit: one thread runs every database request, many per transaction.

Requests from all connections queue up while a transaction commits; the
next transaction takes everything waiting (up to `MAX_BATCH`), runs each
request in its own savepoint so that a failing one undoes only itself,
commits once (one fsync for the whole batch) and only then reports each
outcome back to the trio thread. So a `200` is never sent for a write that
is not on disk, and the event loop never waits for the disk.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import outcome
import trio

from . import times
from .context import Context
from .errors import CommandError
from .store import Store

log = logging.getLogger("jobserver")

# Enough requests to amortise one fsync over many, few enough that the
# first request of a batch is not kept waiting long for the last.
MAX_BATCH = 512

Notify = Callable[[set[str], "str | None"], None]


@dataclass
class Work:
    run: Callable[[Context], Any]
    # Called on the trio thread with the outcome once it is committed.
    done: Callable[[outcome.Outcome], None]


_STOP = object()


class Writer:
    def __init__(self, store: Store, notify: Notify) -> None:
        self._store = store
        self._notify = notify
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._loop, name="jobserver-writer", daemon=True)
        self.batches = 0
        self.requests = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, work: Work) -> None:
        self._queue.put(work)

    async def call(self, run: Callable[[Context], Any]) -> Any:
        """Run `run` in the writer and return its committed result."""
        done = trio.Event()
        result: list[outcome.Outcome] = []

        def finished(value: outcome.Outcome) -> None:
            result.append(value)
            done.set()

        self.submit(Work(run, finished))
        # The request is already on its way to the disk; waiting for its
        # answer must survive a shutdown so nothing is left half-reported.
        with trio.CancelScope(shield=True):
            await done.wait()
        return result[0].unwrap()

    async def stop(self) -> None:
        """Finish everything queued, then stop the thread."""
        self._queue.put(_STOP)
        await trio.to_thread.run_sync(self._thread.join)

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
        try:
            outcomes, ready, due = self._transaction(batch)
        except sqlite3.Error as error:
            log.error("transaction failed: %s", error)
            self._store.rollback()
            failed = outcome.Error(CommandError(f"503 Database unavailable: {error}"))
            outcomes, ready, due = [failed] * len(batch), set(), None
        self._report(batch, outcomes, ready, due)

    def _transaction(
        self, batch: list[Work]
    ) -> tuple[list[outcome.Outcome], set[str], str | None]:
        """Run a batch in one transaction. Outcomes are final only once this
        returns: a failed commit raises, and every request fails with it."""
        store = self._store
        outcomes: list[outcome.Outcome] = []
        contexts: list[Context | None] = []
        store.begin()
        for work in batch:
            ctx = Context(store, times.utcnow())
            result = self._run_one(work, ctx)
            if not store.in_transaction:
                # SQLite rolled the whole transaction back (disk full, I/O
                # error): the requests before this one are undone too.
                lost = outcome.Error(CommandError("502 Transaction rolled back"))
                outcomes = [lost] * len(outcomes)
                contexts = [None] * len(contexts)
                store.begin()
            outcomes.append(result)
            contexts.append(ctx if isinstance(result, outcome.Value) else None)
        store.commit()
        ready: set[str] = set()
        due: str | None = None
        for ctx in contexts:
            if ctx is not None:
                ready |= ctx.ready
                if ctx.due is not None and (due is None or ctx.due < due):
                    due = ctx.due
        self.batches += 1
        self.requests += len(batch)
        return outcomes, ready, due

    def _run_one(self, work: Work, ctx: Context) -> outcome.Outcome:
        store = self._store
        store.savepoint()
        try:
            value = work.run(ctx)
        except CommandError as error:
            self._undo()
            return outcome.Error(error)
        except sqlite3.Error as error:
            log.error("query failed: %s", error)
            self._undo()
            return outcome.Error(CommandError(f"502 Query failed: {error}"))
        except Exception as error:
            log.exception("unhandled error in a request")
            self._undo()
            return outcome.Error(CommandError(f"500 Unhandled Exception: {type(error).__name__}"))
        store.release()
        return outcome.Value(value)

    def _undo(self) -> None:
        if self._store.in_transaction:
            self._store.rollback_savepoint()

    def _report(
        self,
        batch: list[Work],
        outcomes: list[outcome.Outcome],
        ready: set[str],
        due: str | None,
    ) -> None:
        def deliver() -> None:
            for work, result in zip(batch, outcomes):
                work.done(result)
            if ready or due is not None:
                self._notify(ready, due)

        self._token.run_sync_soon(deliver)
