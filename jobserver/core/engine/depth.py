"""The history's depth series: each queue's waiting jobs, every 15 seconds.

A background task reads the jobs QUEUED or RUNQUEUED per queue
(`Storage.ready_by_queue`: only those jobs, through an index of them, on
a read-only connection of its own, in a thread) as the server starts and
every 15 seconds, and gives them to the ring, where a minute keeps its
last sample: the graph's newest minute is at most 15 seconds old, not up
to a minute behind the queue. The writer never waits for it. It is not
Queues' read, which reads every job and matches the due ones against the
paused patterns: a node would pay that four times a minute, and a node
killed while it ran would leave PostgreSQL running it.
"""

from __future__ import annotations

import logging

import trio

from jobserver.core.engine.clock import Clock
from jobserver.core.engine.history import History
from jobserver.storage.interface import Storage

log = logging.getLogger("jobserver")

# Seconds between samples: a divisor of the minute, so that every minute
# has its samples at the same seconds.
SAMPLE_SECONDS = 15.0
# Seconds past each such moment the sample is read: the last sample of a
# minute comes 2 seconds before its end, after a batch of the minute before
# has long committed.
SAMPLE_OFFSET_SECONDS = 13.0


async def sample_once(store: Storage, history: History, clock: Clock) -> None:
    """Read every queue's depth now into this minute of the history."""
    try:
        depths = await trio.to_thread.run_sync(store.ready_by_queue)
    except Exception as error:  # noqa: BLE001 - the sampler lives on and reads again soon
        log.warning("history cannot read the queues' depths: %s", error)
        return
    history.sample_depth(depths)


async def run_sampler(store: Storage, history: History, clock: Clock) -> None:
    """Sample once now, then at 13, 28, 43 and 58 seconds into every
    minute, until cancelled."""
    if not history.enabled:
        return
    while True:
        await sample_once(store, history, clock)
        past = (clock.now().timestamp() - SAMPLE_OFFSET_SECONDS) % SAMPLE_SECONDS
        await trio.sleep(SAMPLE_SECONDS - past)
