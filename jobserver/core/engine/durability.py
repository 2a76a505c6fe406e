"""The durability stage: committed batches wait here until they are on disk.

The writer commits without waiting for the disk. Each committed batch is
handed here; a thread syncs the database's log once for every batch
committed since its previous sync began, and only then are their outcomes
delivered on the event loop. While one sync is in flight the writer runs
and commits the next batches, which the following sync covers: one sync
per round of work however many batches it holds, and the event loop never
waits for the disk.

When nothing else is in flight or ready to run and syncs are quick, the
sync runs on the event loop instead: then a trip to the thread and back
would cost more than the sync (see `_sync_here`).

A batch's outcomes are delivered in commit order, and only after a sync
that began after its commit returned. If the sync fails, the engine is
told so with the batch: the writes may or may not be on disk, so none is
confirmed (engine.py answers `504 Outcome unknown`).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import trio

from jobserver.core.engine.histogram import SECONDS_BOUNDS, Histogram
from jobserver.core.engine.writer import Committed
from jobserver.storage.interface import Storage

log = logging.getLogger("jobserver")

# deliver(batch, the sync's failure or None): on the event loop.
Deliver = Callable[[Committed, Exception | None], None]

# Committed batches that may wait for the disk at once: the one a sync is
# writing, and the next. More would only make batches smaller (and each
# request cost more): what arrives meanwhile waits to join a larger one.
MAX_UNSYNCED = 2

# A sync this quick may run on the event loop when it has nothing else to do
# (see _sync_here): a fast disk's sync is shorter than a trip to a thread.
SYNC_HERE_SECONDS = 0.0005

# How often syncs made on the event loop ask the thread for a checkpoint.
MAINTAIN_SECONDS = 0.25

_STOP = object()
_MAINTAIN = object()


class Durability:
    def __init__(self, store: Storage, deliver: Deliver, threaded: bool) -> None:
        self._store = store
        self._deliver = deliver
        # With --synchronous NORMAL nothing is synced: outcomes go out at
        # the commit, and SQLite syncs at its checkpoints only.
        self._syncs = store.needs_sync
        self._threaded = threaded
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Not `_thread`: mypyc (setup.py) names its C field `__thread`, a C keyword.
        self._syncer = threading.Thread(target=self._loop, name="jobserver-sync", daemon=True)
        self._token = trio.lowlevel.current_trio_token()
        self._committed = 0
        self._durable = 0
        # (batches that must be durable, event): callers of `settled`.
        self._settling: list[tuple[int, trio.Event]] = []
        self._room = trio.Event()
        # How long the last sync took; the first is done by the thread.
        self._last_sync = math.inf
        # Observed by whichever thread syncs; read by the metrics.
        self.sync_seconds = Histogram(SECONDS_BOUNDS)
        self._asked_maintain = time.monotonic()

    def start(self) -> None:
        if self._syncs and self._threaded:
            self._syncer.start()

    def committed(self, batch: Committed) -> None:
        """A batch was committed; deliver its outcomes once it is durable.
        One that only read is as durable as the batches before it: if they
        all are, its outcomes go out at once, with no sync."""
        if not batch.wrote and self._durable == self._committed:
            self._deliver(batch, None)
            return
        self._committed += 1
        if not self._syncs:
            self._done([batch], None)
        elif not self._threaded:
            error = self._sync()
            self._done([batch], error)
            self._maintain()
        elif self._sync_here():
            error = self._sync()
            self._done([batch], error)
            # Checkpoints stay the thread's: they take longer than a sync.
            if time.monotonic() - self._asked_maintain >= MAINTAIN_SECONDS:
                self._asked_maintain = time.monotonic()
                self._queue.put(_MAINTAIN)
        else:
            self._queue.put(batch)

    def _sync_here(self) -> bool:
        """Whether to sync on the event loop: when nothing else is in flight
        or ready to run, and syncs are quick, handing the sync to the thread
        and back costs more than the sync itself."""
        return (
            self._committed - self._durable == 1
            and self._last_sync < SYNC_HERE_SECONDS
            and trio.lowlevel.current_statistics().tasks_runnable == 0
        )

    async def room(self) -> None:
        """Until another batch may be committed (see MAX_UNSYNCED)."""
        while self._committed - self._durable >= MAX_UNSYNCED:
            self._room = trio.Event()
            await self._room.wait()

    async def settled(self) -> None:
        """Until every batch committed so far is durable and delivered."""
        target = self._committed
        if self._durable >= target:
            return
        event = trio.Event()
        self._settling.append((target, event))
        await event.wait()

    async def stop(self) -> None:
        """After the last batch: let the thread finish and end."""
        if self._syncer.is_alive():
            self._queue.put(_STOP)
            await trio.to_thread.run_sync(self._syncer.join)

    def _loop(self) -> None:
        """The sync thread: take every batch committed so far, sync once,
        hand them back to the event loop, then keep the log short."""
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            if first is _MAINTAIN:
                self._maintain()
                continue
            batches: list[Committed] = [first]
            stop = False
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                if item is not _MAINTAIN:
                    batches.append(item)
            error = self._sync()
            self._token.run_sync_soon(self._done, batches, error)
            self._maintain()
            if stop:
                return

    def _sync(self) -> Exception | None:
        began = time.perf_counter()
        try:
            self._store.sync()
        except Exception as error:  # noqa: BLE001 - reported to each request instead
            log.error("syncing the database to disk failed: %s", error)
            return error
        self._last_sync = time.perf_counter() - began
        self.sync_seconds.observe(self._last_sync)
        return None

    def _maintain(self) -> None:
        try:
            self._store.checkpoint_if_due()
        except Exception as error:  # noqa: BLE001 - the next sync tries again
            # A checkpoint that fails (the disk is full) is tried again after
            # a later sync; the log grows meanwhile, nothing is lost. One
            # line, as a failed sync gets: it is the disk's state, not a bug.
            log.error("checkpointing the database failed: %s", error)

    def _done(self, batches: list[Committed], error: Exception | None) -> None:
        """On the event loop: these batches are durable (or failed to be)."""
        for batch in batches:
            self._deliver(batch, error)
        self._durable += len(batches)
        self._room.set()
        if self._settling:
            waiting = []
            for target, event in self._settling:
                if target <= self._durable:
                    event.set()
                else:
                    waiting.append((target, event))
            self._settling = waiting
