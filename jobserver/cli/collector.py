"""Python's cyclic garbage collector, set for `jobserver serve`'s process
before the server starts (serve.run): a program that embeds the server
keeps its own settings."""

from __future__ import annotations

import gc

# Allocations (less deallocations) of container objects between two of
# the cyclic collector's youngest collections: Python's 700 is passed
# within each GetJobs or FinishJobs of 100 jobs, whose objects then live
# through a collection for nothing. A node's requests make few cycles.
COLLECT_AFTER = 10_000


def tune_for_a_server() -> None:
    """Set Python's cyclic garbage collector for a server process: what
    is loaded by now (modules, classes, functions: tens of thousands of
    objects) is kept out of every later collection (gc.freeze), where each
    full collection walked all of it, 20 to 25 ms with the event loop
    held; and the youngest collections run after COLLECT_AFTER
    allocations. In a PostgreSQL drain the collector took 3.2 µs of the
    node's CPU a job, and a full collection held the loop every 12,000
    jobs or so (docs/benchmarks.md). The garbage of the start is
    collected first, not frozen with the rest."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(COLLECT_AFTER)
