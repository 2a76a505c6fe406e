"""One batch, from its transaction's begin to its commit.

Where it runs: on the event loop, or in a worker thread when one of its
requests is heavy (a thousand jobs in one request, the pruner's
deletions), so that the event loop goes on answering meanwhile, or when
another process holds the database's lock, so that the event loop never
waits for it; on PostgreSQL, where every call waits on the network,
always in a thread. What runs: the writer's batch (writer.py), again
when the database undid it for a reason that running it again removes
(a deadlock between two nodes); then the waiting GetJobs it made ready,
served in the same transaction (the engine's `woken` says which: the
wait queue lives on the event loop, asked from a thread there); the
notice to other nodes; the commit. Whatever goes wrong, every request
gets an outcome, the waiters' tries included.

Apart from the engine (engine.py), which decides when batches run and
hands out what they committed, so that the path of one transaction reads
in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

from jobserver.core.engine.waiters import WaitQueue
from jobserver.core.engine.work import Serve, Work
from jobserver.core.engine.writer import (
    TRANSIENT_ATTEMPTS,
    Committed,
    Ran,
    Transient,
    TransientFailed,
    Writer,
    earliest,
    ran,
)
from jobserver.storage.interface import OutcomeUnknown, Storage

log = logging.getLogger("jobserver")
T = TypeVar("T")

# The tries of the waiting GetJobs that these names (made ready, with the
# earliest future time written) woke, to run in the batch's transaction.
Woken = Callable[[set[str], str | None], list[Serve]]


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a thread of trio's cache, waited for without a cancel
    (as trio.to_thread.run_sync waits by default), its return or exception
    this call's. trio.to_thread.run_sync does the same with more: it names
    the thread and names it back for each call (two prctl calls and a
    ctypes call each), takes a capacity limiter, copies the context and
    keeps what trio.from_thread needs (a thread that calls it here passes
    the token itself)."""
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()

    def deliver(result: outcome.Outcome[T]) -> None:
        token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    trio.lowlevel.start_thread_soon(lambda: fn(*args), deliver)

    def abort(_: Any) -> trio.lowlevel.Abort:
        # A batch in the database runs to its end: its outcome is every
        # request's.
        return trio.lowlevel.Abort.FAILED

    return await trio.lowlevel.wait_task_rescheduled(abort)


class Batches:
    """Runs each batch the engine takes in one transaction."""

    def __init__(
        self, store: Storage, writer: Writer, waits: WaitQueue, woken: Woken, threaded: bool
    ) -> None:
        self._store = store
        self.writer = writer
        self.waits = waits
        self._woken = woken
        self._threaded = threaded
        # For the writer's thread to reach the event loop (in_thread's
        # threads are not trio's own): the run's, set by each batch.
        self._token: trio.lowlevel.TrioToken | None = None

    async def run(self, batch: list[Work]) -> Committed:
        """Run `batch` and commit it (not yet durable), on the event loop
        or in a thread."""
        self._token = trio.lowlevel.current_trio_token()
        if not self._threaded:
            committed = self._transact(batch, begun=False, in_thread=False)
        elif self._store.blocking or any(work.heavy for work in batch) or not self._try_begin():
            # Waiting for another process's lock, or a long run, happens off
            # the event loop.
            committed = await in_thread(self._transact, batch, False, True)
        else:
            committed = self._transact(batch, begun=True, in_thread=False)
        return committed

    def _try_begin(self) -> bool:
        """Open the transaction at once, if no other process holds the lock."""
        try:
            return self._store.try_begin()
        except self._store.errors:
            # Tried again in the thread, which reports what goes wrong.
            return False

    def _transact(self, batch: list[Work], begun: bool, in_thread: bool) -> Committed:
        """Run a batch and commit it (not yet durable), again if the
        database undid it for a reason that running it again removes (two
        nodes' transactions in a deadlock)."""
        for attempt in range(1, TRANSIENT_ATTEMPTS + 1):
            try:
                return self._transact_once(batch, begun and attempt == 1, in_thread)
            except Transient as transient:
                log.warning(
                    "transaction undone by the database (%s); running it again (%d of %d)",
                    transient.error, attempt, TRANSIENT_ATTEMPTS,
                )
                self.writer.abandon(transient.error)
        return Committed(batch, self.writer.failed(batch, TransientFailed()), False)

    def _transact_once(self, batch: list[Work], begun: bool, in_thread: bool) -> Committed:
        """Run a batch, serve the waiters it made ready, and commit.
        Whatever goes wrong, every request gets an outcome, waiters' tries
        included: a caller must never wait for a commit that will not come."""
        store = self._store
        tries: list[Serve] = []
        requests: list[Work] = batch
        serves: list[Serve] = []
        done = Ran.nothing()
        try:
            # Waiters' tries queued with the batch run after the tries of
            # those its requests made ready, oldest first: else a younger
            # waiter's try queued here would take a job a request before it
            # created, ahead of an older waiter.
            requests = [work for work in batch if not isinstance(work, Serve)]
            # By their oldest waiter: tries are queued as they come (a
            # waiter's first try, a look at every waiter, a retry), which
            # may put a younger waiter's ahead of an older one's.
            serves = [work for work in batch if isinstance(work, Serve)]
            serves.sort(key=lambda serve: serve.waiters[0].seq)
            # A batch of tries alone opens the first one's savepoint as it
            # begins (on PostgreSQL in the begin's round trip).
            opened = not begun and not requests
            if not begun:
                store.begin(savepoint=opened)
            changes_before = store.total_changes
            done = self.writer.execute(requests)
            announced, announced_due = set(done.ready), done.due
            # When waiters were tried: the moment from which the next due
            # time is read, with the commit (its value is wanted only once
            # the batch has committed). Taken before the first try, so that
            # a job falling due while they run is in it.
            tried_from: str | None = None
            # From a thread, only if someone waits (read from here, a race
            # that loses nothing: a GetJob that joins meanwhile hears of
            # these names after the commit): the wait queue is the event
            # loop's, asked there.
            if done.ready and (not in_thread or len(self.waits)):
                # Recorded before they run, so that they are answered even
                # if the transaction fails from here on.
                woken = self._woken_from_thread if in_thread else self._woken
                tries = woken(done.ready, done.due)
                if tries:
                    tried_from = self.writer.now_ms()
                # What the tries in turn made ready or due: heard of after
                # the commit.
                done = done.announced().followed_by(self._serve(tries))
            if serves:
                tried_from = tried_from or self.writer.now_ms()
                done = done.followed_by(self._serve(serves, first_open=opened))
            announced |= done.ready
            announced_due = earliest(announced_due, done.due)
            if announced or announced_due is not None or done.ended:
                # Other nodes' waiters hear of it when it commits.
                store.announce(announced, announced_due, done.ended)
            next_due = None
            if tried_from is None:
                store.commit()
            else:
                next_due = store.commit_reading_next_due(tried_from)
            wrote = store.total_changes != changes_before
            return Committed(
                [*requests, *tries, *serves], done.outcomes, True, done.ready, done.due, wrote,
                done.events, done.taken, done.ended, done.cascade_left, next_due,
            )
        except Exception as error:  # a boundary: see above
            if isinstance(error, store.transient) and not tries:
                raise Transient(error) from error
            works: list[Work] = [*requests, *tries, *serves]
            if isinstance(error, OutcomeUnknown):
                # It may have committed what a cascade left: looked for again.
                return Committed(
                    works, self.writer.unknown(works, error), False, taken=done.taken,
                    cascade_left=done.cascade_left,
                )
            return Committed(works, self.writer.failed(works, error), False)

    def _serve(self, serves: list[Serve], first_open: bool = False) -> Ran:
        """Waiters' tries, each in a savepoint of the open transaction
        (the first one's open already if `first_open`)."""
        if not serves:
            return Ran.nothing()
        return ran(self.writer.run_all(serves, savepoints=True, first_open=first_open) or [])

    def _woken_from_thread(self, ready: set[str], due: str | None) -> list[Serve]:
        """`_woken`, from the writer's thread: run on the event loop while
        the thread waits. Serving the waiters in this transaction spares
        them one of their own (on PostgreSQL, four round trips more)."""
        try:
            return trio.from_thread.run_sync(self._woken, ready, due, trio_token=self._token)
        except trio.RunFinishedError:
            # The server stopped: the waiters are answered as it ends. (Run
            # by the token, as a callback, it is never cancelled.)
            return []
