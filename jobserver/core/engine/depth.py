"""The history's depth series: each queue's waiting jobs, once a minute.

A background task reads the jobs by queue and state the way Queues does
(`Storage.queue_stats`, on a read-only connection of its own, in a
thread), a few seconds into each minute, and gives the ring the jobs
QUEUED or RUNQUEUED per queue. The writer never waits for it.
"""

from __future__ import annotations

import logging

import trio

from jobserver.core.engine.clock import Clock
from jobserver.core.engine.history import INTERVAL_SECONDS, History
from jobserver.model import times
from jobserver.model.jobs import READY
from jobserver.storage.interface import QueueStats, Storage

log = logging.getLogger("jobserver")

# Seconds into a minute the sample is read: after a worker's batch that
# ended the last minute has committed, well before the next one.
SAMPLE_OFFSET_SECONDS = 2.0


def depths(stats: QueueStats) -> dict[str, int]:
    """The jobs waiting to be handed out (due or not), by queue."""
    counts, _, _ = stats
    found: dict[str, int] = {}
    for (queue, state), count in counts.items():
        if state in READY:
            found[queue] = found.get(queue, 0) + count
    return found


async def sample_once(store: Storage, history: History, clock: Clock) -> None:
    """Read every queue's depth now into this minute of the history."""
    now = times.to_millis(clock.now())
    try:
        stats = await trio.to_thread.run_sync(store.queue_stats, now)
    except Exception as error:  # noqa: BLE001 - the sampler lives on and reads again next minute
        log.warning("history cannot read the queues' depths: %s", error)
        return
    history.sample_depth(depths(stats))


async def run_sampler(store: Storage, history: History, clock: Clock) -> None:
    """Sample once now, then a few seconds into every minute, until cancelled."""
    if not history.enabled:
        return
    while True:
        await sample_once(store, history, clock)
        into_minute = clock.now().timestamp() % INTERVAL_SECONDS
        await trio.sleep(INTERVAL_SECONDS - into_minute + SAMPLE_OFFSET_SECONDS)
