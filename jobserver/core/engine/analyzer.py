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


# After a look fails (PostgreSQL down, a statement refused), the next comes
# twice as late, up to this: a warning and a connection a second, per node,
# for as long as it lasted, said nothing more.
MOST_INTERVAL = 60.0


async def run_analyzer(store: Storage, interval: float = ANALYZE_INTERVAL) -> None:
    wait = interval
    while True:
        await trio.sleep(wait)
        try:
            await trio.to_thread.run_sync(store.keep_statistics)
        except Exception as error:  # noqa: BLE001 - it lives on and looks again later
            log.warning(
                "cannot look at the jobs table's statistics: %s; again in %gs", error, wait
            )
            wait = min(2 * wait, MOST_INTERVAL)
        else:
            wait = interval
