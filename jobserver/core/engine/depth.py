"""The history's depth series: each queue's waiting jobs, once a minute.

A background task reads the jobs QUEUED or RUNQUEUED per queue
(`Storage.ready_by_queue`: only those jobs, through an index of them, on
a read-only connection of its own, in a thread) a few seconds into each
minute, and gives them to the ring. The writer never waits for it. It is
not Queues' read, which reads every job and matches the due ones against
the paused patterns: a node would pay that every minute, and a node
killed while it ran would leave PostgreSQL running it.
"""

from __future__ import annotations

import logging

import trio

from jobserver.core.engine.clock import Clock
from jobserver.core.engine.history import INTERVAL_SECONDS, History
from jobserver.storage.interface import Storage

log = logging.getLogger("jobserver")

# Seconds into a minute the sample is read: after a worker's batch that
# ended the last minute has committed, well before the next one.
SAMPLE_OFFSET_SECONDS = 2.0


async def sample_once(store: Storage, history: History, clock: Clock) -> None:
    """Read every queue's depth now into this minute of the history."""
    try:
        depths = await trio.to_thread.run_sync(store.ready_by_queue)
    except Exception as error:  # noqa: BLE001 - the sampler lives on and reads again next minute
        log.warning("history cannot read the queues' depths: %s", error)
        return
    history.sample_depth(depths)


async def run_sampler(store: Storage, history: History, clock: Clock) -> None:
    """Sample once now, then a few seconds into every minute, until cancelled."""
    if not history.enabled:
        return
    while True:
        await sample_once(store, history, clock)
        into_minute = clock.now().timestamp() % INTERVAL_SECONDS
        await trio.sleep(INTERVAL_SECONDS - into_minute + SAMPLE_OFFSET_SECONDS)
