"""The history's depth series: each queue's waiting jobs, every 15 seconds.

A background task reads the jobs QUEUED or RUNQUEUED per queue
(`Storage.ready_by_queue`: only those jobs, through an index of them, on
a read-only connection of its own, in a thread) as the server starts and
every 15 seconds, and gives them to the ring, where a minute keeps its
last sample: the graph's newest minute is at most 15 seconds old, not up
to a minute behind the queue (once a minute while a read is slow: a huge
queue). The writer never waits for it. It is not
Queues' read, which reads every job and matches the due ones against the
paused patterns: a node would pay that four times a minute, and a node
killed while it ran would leave PostgreSQL running it.
"""

from __future__ import annotations

import logging
import time

import trio

from jobserver.core.engine.clock import Clock
from jobserver.core.engine.history import INTERVAL_SECONDS, History
from jobserver.storage.interface import Storage

log = logging.getLogger("jobserver")

# Seconds between samples: a divisor of the minute, so that every minute
# has its samples at the same seconds.
SAMPLE_SECONDS = 15.0
# Samples come this long before the end of each such stretch (at 13, 28,
# 43 and 58 seconds into a minute): the last of a minute just before its
# end.
BEFORE_END_SECONDS = 2.0
# A read that took longer than this is made once a minute (at 58 s) until
# one is quick again: four reads a minute cost at most about 1% of a core
# (a read takes some 90 ms at 100,000 jobs waiting on SQLite, bench/
# history.py), and a queue of millions pays for one read a minute only.
SLOW_READ_SECONDS = 0.15


async def sample_once(store: Storage, history: History, clock: Clock) -> None:
    """Read every queue's depth now into this minute of the history."""
    try:
        depths = await trio.to_thread.run_sync(store.ready_by_queue)
    except Exception as error:  # noqa: BLE001 - the sampler lives on and reads again soon
        log.warning("history cannot read the queues' depths: %s", error)
        return
    history.sample_depth(depths)


def seconds_to_next_sample(now: float, slow: bool) -> float:
    """From `now` (seconds since 1970) to the next moment a sample is due:
    the next of 13, 28, 43 and 58 seconds into a minute, or of 58 alone
    after a `slow` read."""
    every = INTERVAL_SECONDS if slow else SAMPLE_SECONDS
    return every - (now + BEFORE_END_SECONDS) % every


async def run_sampler(store: Storage, history: History, clock: Clock) -> None:
    """Sample once now, then at 13, 28, 43 and 58 seconds into every minute
    (at 58 only while reads are slow), until cancelled."""
    if not history.enabled:
        return
    while True:
        began = time.monotonic()
        await sample_once(store, history, clock)
        slow = time.monotonic() - began > SLOW_READ_SECONDS
        await trio.sleep(seconds_to_next_sample(clock.now().timestamp(), slow))
