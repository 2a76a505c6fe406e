"""The PostgreSQL planner's statistics of the jobs table, looked at every
second and brought up to date when a burst of jobs has made them stale
(storage/postgres_statistics.py says why), in a thread, on a connection
of the store's own: the writer never waits for it.
"""

from __future__ import annotations

import logging

import trio

from jobserver.storage.interface import Storage

log = logging.getLogger("jobserver")

# How often the statistics are looked at: a stale plan of a drain costs
# about a millisecond a job more (docs/benchmarks.md), and a look is a few
# indexed catalog reads (~0.1 ms).
ANALYZE_INTERVAL = 1.0


async def run_analyzer(store: Storage, interval: float = ANALYZE_INTERVAL) -> None:
    while True:
        await trio.sleep(interval)
        try:
            await trio.to_thread.run_sync(store.keep_statistics)
        except Exception as error:  # noqa: BLE001 - it lives on and looks again later
            log.warning("cannot look at the jobs table's statistics: %s", error)
