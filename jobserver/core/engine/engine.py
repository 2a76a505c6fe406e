"""The engine: group commit, pipelined, and the waiting GetJobs it serves.

Requests from all connections queue up; the engine's task takes everything
waiting (up to `MAX_BATCH`), has the writer (writer.py) run it in one
transaction on the event loop, serves the waiting GetJobs the batch made
ready in the same transaction (the wait queue, waiters.py, says which;
`selection.serve_waiters` tries them), and commits without waiting for the
disk: a worker blocked in GetJob gets a new job with the same sync that
stored it. The batch then goes to the durability stage (durability.py),
which makes it durable with one sync of the log in a thread, while the
event loop goes on serving connections and the engine runs the next batch.
Each request's outcome is handed out only once a sync that began after its
commit has returned: a `200` is never sent for a write that would not
survive a power cut.

On PostgreSQL a batch begins on any of the node's writers not running one
(--writers; ARCHITECTURE.md, "Pipelined group commit").

A batch runs in a worker thread instead when one of its requests is heavy
(a thousand jobs in one request, the pruner's deletions), or when another
process holds the database's lock (batch.py, which runs each batch's
transaction from its begin to its commit).

The engine's clock (`_run_clock`) fires at the earliest time something is
due (a future job, a lease's end, a reply deadline, a stale deadline): it
runs the tick (deadlines.py) and tries every waiter. What other nodes
commit is heard through the store (`heard`).

Without threads (`threaded=False`) every batch, and its sync, runs on the
event loop: for tests on trio's MockClock, which may move time forward only
when every task waits, and cannot see a thread's work.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from functools import partial
from typing import Any

import outcome
import trio

from jobserver.core.engine.alarm import RETRY_SECONDS, Alarm
from jobserver.core.engine.awaits import Awaits, ended_of
from jobserver.core.engine.batch import Batches
from jobserver.core.engine.clock import Clock
from jobserver.core.engine.context import Context, Settings
from jobserver.core.engine.durability import Durability
from jobserver.core.engine.histogram import BATCH_BOUNDS, SECONDS_BOUNDS, Histogram
from jobserver.core.engine.history import History
from jobserver.core.engine.waiters import MATCH_PAUSE, Waiter, WaitQueue
from jobserver.core.engine.work import Call, GiveBack, Serve, Tick, Work, refuse_abort
from jobserver.core.engine.writer import Committed, Writer, outcomes_unknown
from jobserver.core.rules import cascade
from jobserver.core.rules.selection import JobQuery, Taken
from jobserver.model import times
from jobserver.model.globmatch import Matcher
from jobserver.storage.interface import Storage

log = logging.getLogger("jobserver")

# Enough requests to amortise one transaction over many, few enough that
# the first request of a batch is not kept waiting long for the last.
MAX_BATCH = 256
# Rounds of late work a stopping engine runs (see Engine.stop): each one is
# what the previous round's outcomes asked for, so two or three suffice.
STOP_ROUNDS = 5


class Engine:
    def __init__(
        self,
        store: Storage,
        clock: Clock,
        settings: Settings = Settings(),
        threaded: bool = True,
        history: History | None = None,
    ) -> None:
        self._store = store
        self._clock = clock
        # What committed batches moved, per minute (--history-minutes).
        self.history = history if history is not None else History(clock=clock)
        self.settings = settings
        self.waits = WaitQueue()
        # Each batch's transaction, begun to committed (batch.py), on one of
        # the store's writers (PostgreSQL's --writers) not running one.
        self._idle_writers: list[Batches] = [
            Batches(writer, Writer(writer, clock, settings), self.waits, self._woken, threaded)
            for writer in store.writers()
        ]
        self._concurrent = len(self._idle_writers) > 1
        # Set when a writer ends its batch while none was idle.
        self._writer_idle: trio.Event | None = None
        # Waiting AwaitJobs (awaits.py).
        self.awaits = Awaits()
        self._pending: deque[Work] = deque()
        # Set while the engine's task sleeps for want of work.
        self._wakeup: trio.Event | None = None
        # Batches begun and not yet committed.
        self._running = 0
        self._stopping = False
        self._finished = trio.Event()
        self._batch_ended = trio.Event()
        self._durability = Durability(store, self._delivered, threaded)
        # When the clock fires next (alarm.py).
        self._alarm = Alarm(clock)
        # Give-backs whose transaction failed: tried again when the clock
        # next fires, so no job is left RUNNING without an owner.
        self._owed: list[list[Taken]] = []
        self.batches = 0
        self.requests = 0
        self.batch_sizes = Histogram(BATCH_BOUNDS)
        # From a batch's start to its commit (not its sync), as the event
        # loop sees it: a thread's hop included.
        self.commit_seconds = Histogram(SECONDS_BOUNDS)

    @property
    def sync_seconds(self) -> Histogram:
        """How long each sync of the log to disk took."""
        return self._durability.sync_seconds

    def start(self, due: str | None = None) -> None:
        """Start committing; `due`: what the store holds at start that the
        clock must fire for (deadlines.at_start)."""
        self._alarm.lower(due)
        self._durability.start()
        trio.lowlevel.spawn_system_task(self._commit_loop, name="jobserver-engine")

    async def run(self) -> None:
        """The clock and the matcher, until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._run_clock)
            nursery.start_soon(self._run_matcher)

    async def listen(self) -> None:
        """Hear what other nodes commit (`heard`), until cancelled; returns at
        once when no other node can share the jobs. Not with `threaded=False`
        on PostgreSQL: a commit on the event loop would wait for the
        listening connection, which waits for the event loop."""
        await self._store.listen(self.heard)

    # Requests.

    def submit(self, work: Work) -> None:
        self._pending.append(work)
        if self._wakeup is not None:
            self._wakeup.set()

    async def call(self, run: Callable[[Context], Any], heavy: bool = False) -> Any:
        """Run `run` in a transaction and return its result once durable."""
        self.submit(Call(run, heavy, trio.lowlevel.current_task()))
        return await trio.lowlevel.wait_task_rescheduled(refuse_abort)

    async def settled(self) -> None:
        """Until every commit made so far is durable: for replies that read
        the database some other way (Query's own connection)."""
        await self._durability.settled()

    # Waiting GetJobs.

    # The timeout is GetJob's: it ends in None (a 404 reply), not in a cancellation.
    async def wait(
        self, query: JobQuery, timeout: float, matcher: Matcher | None = None,  # noqa: ASYNC109
    ) -> list[Taken] | None:
        """Wait up to `timeout` seconds for jobs; None if none came.
        `matcher`: the query's GLOB, compiled (waiters.Selector).

        Jobs that are returned have been taken: if the caller cannot deliver
        them it must give them back with `give_back`.
        """
        if self.waits.closed:
            return None
        waiter = self.waits.join(query, self._clock.now(), matcher)
        self._try([waiter])
        deadline = trio.current_time() + timeout
        try:
            # The first try is always seen through, so even `timeout: 0`
            # gets a job that is due now.
            await waiter.tried.wait()
            with trio.move_on_at(deadline):
                await waiter.woken.wait()
        except BaseException:
            if waiter.jobs is not None:
                self.give_back(waiter.jobs)
            raise
        finally:
            if waiter.jobs is None:
                self.waits.leave(waiter)
        return waiter.jobs

    def now(self) -> datetime:
        """The time of day by the engine's clock."""
        return self._clock.now()

    def give_back(self, taken: list[Taken]) -> None:
        """Return undeliverable jobs to the queue, as many times as it takes."""
        self.submit(GiveBack(taken))

    def heard(
        self, ready: set[str] | None, due: str | None, ended: frozenset[int] | None = frozenset()
    ) -> None:
        """What another node's commit made due (None: look at everything),
        and which awaited jobs it ended (None: any may have)."""
        if ended is None:
            self._look_for_ended()
        elif ended:
            self.awaits.ended(ended)
        if ready is None:
            self.recheck()
        else:
            self.notify(ready, due)

    def notify(self, ready: set[str], due: str | None) -> None:
        """These names became due; `due` is the earliest future time a
        commit wrote."""
        self._alarm.lower(due)
        self._try(self.waits.ready(ready))

    def recheck(self) -> None:
        """Another node may have changed what is due (or a notice of it was
        lost): run the tick now, which asks the store when the clock must
        next fire, and try every waiter."""
        if self.waits.closed:
            return
        self.submit(Tick.of(self._store))
        self._try(self.waits.everyone())

    def close(self) -> None:
        """Answer every waiter now (with no jobs) and accept no more."""
        self.waits.close()
        self.awaits.close()

    def _look_for_ended(self) -> None:
        """Notices of other nodes may have been lost: wake the awaiters of
        the awaited jobs whose outcome is kept (one read for all)."""
        awaited = self.awaits.awaited()
        if awaited:
            self.submit(Call(partial(ended_of, ids=awaited), False, None, self.awaits.ended))

    async def stop(self) -> None:
        """Finish everything queued, then stop. While another process holds
        the database, what is left fails fast instead of each batch
        waiting out the busy timeout.

        The last batches' outcomes are delivered on the event loop, and
        what they submit (jobs given back by a waiting GetJob that left)
        queues behind them: so the engine goes on until a round submits
        nothing, or STOP_ROUNDS have passed."""
        self._store.stop_waiting_long()
        # Give-backs still owed (their transaction failed, or a batch's
        # outcome was unknown) are tried once more now, not at a clock
        # that will not fire again.
        owed, self._owed = self._owed, []
        for taken in owed:
            self.give_back(taken)
        for _ in range(STOP_ROUNDS):
            await self._quiet()
            # The last deliveries run now.
            await trio.lowlevel.checkpoint()
            if not self._pending:
                break
        else:
            log.error("the engine was still given work after %d rounds of stopping", STOP_ROUNDS)
        if self._owed:
            log.warning(
                "%d jobs could not be given back before the server stopped: they come back "
                "by their lease, or by --stale-after", sum(map(len, self._owed)),
            )
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

    # Group commit.

    async def _commit_loop(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                while self._pending or not self._stopping:
                    if not self._pending:
                        self._wakeup = trio.Event()
                        await self._wakeup.wait()
                        # The task that woke the engine ran in the same round as
                        # every other task ready then: their requests are all here.
                        self._wakeup = None
                        continue
                    if not self._idle_writers:
                        # Requests gather into a larger batch meanwhile.
                        self._writer_idle = trio.Event()
                        await self._writer_idle.wait()
                        self._writer_idle = None
                        continue
                    # While the disk is behind, requests gather into a larger batch.
                    await self._durability.room()
                    count = min(len(self._pending), MAX_BATCH)
                    batch = [self._pending.popleft() for _ in range(count)]
                    self._running += 1
                    writer = self._idle_writers.pop()
                    if self._concurrent:
                        nursery.start_soon(self._run_on, writer, batch)
                    else:
                        # One writer: no task of its own, a step less a batch.
                        await self._run_on(writer, batch)
                    if self._pending:
                        # Work that followed this batch (what its outcomes
                        # asked for) waits a round, so connections are never
                        # starved.
                        await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._finished.set()

    async def _run_on(self, writer: Batches, batch: list[Work]) -> None:
        try:
            await self._run_batch(writer, batch)
        finally:
            self._running -= 1
            self._idle_writers.append(writer)
            if self._writer_idle is not None:
                self._writer_idle.set()
            self._batch_ended.set()

    async def _run_batch(self, writer: Batches, batch: list[Work]) -> None:
        began = time.perf_counter()
        committed = await writer.run(batch)
        self.batches += 1
        self.requests += len(committed.works)
        self.batch_sizes.observe(len(committed.works))
        self.commit_seconds.observe(time.perf_counter() - began)
        # Waiting GetJobs hear of new jobs at once: the batch that serves
        # them is synced after this one, so nothing is handed out early.
        if committed.cascade_left:
            cascade.look_again(self._store)
            # The clock fires now, whatever it did: a waiter's try in the
            # batch lowered it before the commit, and with several writers
            # the tick may have run, on another, before this commit.
            self._alarm.lower(times.to_millis(self._clock.now()))
        if committed.ready or committed.due is not None:
            self.notify(committed.ready, committed.due)
        if committed.ok:
            if committed.ended:
                # They look again: their look is committed after this.
                self.awaits.ended(committed.ended)
            if committed.events:
                self.history.record(committed.events)
            self._durability.committed(committed)
        else:
            self._delivered(committed, None)

    def _woken(self, ready: set[str], due: str | None) -> list[Serve]:
        """The tries of the waiters these names made ready, to run in this
        transaction."""
        try:
            self._alarm.lower(due)
            woken = self.waits.ready(ready)
            return self._tries(woken) if woken else []
        except Exception:
            log.exception("finding the waiting GetJobs to serve failed")
            return []

    # Outcomes.

    def _delivered(self, batch: Committed, sync_failed: Exception | None) -> None:
        """A batch's end: committed and durable, failed, or (its commit
        cut off, its sync failed) not known to have committed. Whether a
        batch of that last kind committed cannot be told, so its requests
        are answered `504 Outcome unknown`, and the jobs it handed out are
        given back: a give-back moves a job only if it is still as the
        hand-out left it (leases.give_back), so each job is queued again
        if the batch committed and left alone if it did not, and none stays
        RUNNING with no one to run it."""
        outcomes = batch.outcomes
        if batch.ok:
            # When the next job falls due, read with the commit of a batch
            # that tried waiters: those that found nothing are tried then.
            self._alarm.lower(batch.next_due)
        if sync_failed is not None:
            outcomes = outcomes_unknown(batch.works, f"cannot sync to disk: {sync_failed}")
        if sync_failed is not None or (batch.taken and not batch.ok):
            # Given back when the clock next fires, RETRY_SECONDS from now,
            # with everything tried again: what the batch made ready, if it
            # committed, was never heard of. Not at once: while the disk or
            # the database fails, a give-back at once would hand the job
            # out again, fail again, and spin.
            if batch.taken:
                self._owed.append(batch.taken)
            self._alarm.retry_soon()
        self._deliver(batch.works, outcomes)

    def _deliver(self, works: list[Work], outcomes: list[outcome.Maybe[Any]]) -> None:
        """On the event loop. An exception from here would end the whole
        trio run, so each delivery's is logged and kept to itself."""
        reschedule = trio.lowlevel.reschedule
        for work, result in zip(works, outcomes, strict=True):
            if isinstance(work, Call):
                if work.task is not None:
                    reschedule(work.task, result)
                elif work.then is not None and isinstance(result, outcome.Value):
                    work.then(result.value)
                continue
            try:
                if isinstance(work, Serve):
                    self._served(work, result)
                elif isinstance(work, GiveBack):
                    self._given_back(work, result)
                else:
                    self._ticked(result)
            except Exception:
                log.exception("handing out a commit's outcome failed")

    def _served(self, serve: Serve, result: outcome.Maybe[Any]) -> None:
        if serve.later:
            later = self.waits.next_later()
            if later is not None:
                self.submit(Serve.of(later, True, self._store))
        if isinstance(result, outcome.Error):
            log.error("serving waiting GetJobs failed: %s", result.error)
            handed: list[list[Taken] | None] = [None] * len(serve.waiters)
            # Whatever made them worth trying may still hold.
            self._alarm.retry_soon()
        else:
            handed = result.value
        served = self.waits.served(serve.waiters, handed)
        for taken in served.unwanted:
            self.give_back(taken)
        if served.again:
            self._try(served.again)

    def _given_back(self, give_back: GiveBack, result: outcome.Maybe[Any]) -> None:
        if isinstance(result, outcome.Error):
            log.error(
                "could not put undelivered jobs back: %s; trying again in %gs",
                result.error, RETRY_SECONDS,
            )
            self._owed.append(give_back.taken)
            self._alarm.retry_soon()

    def _ticked(self, result: outcome.Maybe[Any]) -> None:
        if isinstance(result, outcome.Error):
            log.error(
                "the clock's tick failed: %s; trying again in %gs", result.error, RETRY_SECONDS
            )
            # The due time that fired was cleared: without this the clock
            # would sleep until some later commit happened to write one.
            self._alarm.retry_soon()
            return
        self._alarm.lower(result.value)

    # Trying waiters.

    def _try(self, waiters: list[Waiter]) -> None:
        if waiters:
            for serve in self._tries(waiters):
                self.submit(serve)

    def _tries(self, waiters: list[Waiter]) -> list[Serve]:
        return [Serve.of(group, later, self._store) for group, later in self.waits.to_try(waiters)]

    async def _run_matcher(self) -> None:
        """Find the waiters of names the wait queue left for later, a slice
        of matching at a time, trying each slice's waiters as they are found.
        A waiter that arrives meanwhile is tried on arrival, as always."""
        while True:
            names = await self.waits.unmatched()
            for found in self.waits.matching_slices(names):
                self._try(found)
                # A pause, not a checkpoint: at a checkpoint the other
                # tasks ran, but the writer's and readers' threads waited
                # for the GIL, which a busy event loop gives up only every
                # 5 ms (a neighbour's Status, and /healthz, waited 0.5 to
                # 3 s while its Pings took 50 ms).
                await trio.sleep(MATCH_PAUSE)

    # The clock.

    async def _run_clock(self) -> None:
        """Wake waiters when the earliest future job becomes due, and run
        the tick then, even with nobody waiting."""
        while True:
            await self._alarm.rings()
            owed, self._owed = self._owed, []
            for taken in owed:
                self.give_back(taken)
            self.submit(Tick.of(self._store))
            self._try(self.waits.everyone())

