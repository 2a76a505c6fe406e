"""The dashboard's Scheduled and Retries, as Sidekiq has them: the QUEUED
jobs due later, soonest first, and those of them waiting for a retry's
backoff (a failed attempt counted: `attempts` > 0), with how many there are.

Read as a search is (reads.py): on a connection of the store's own, in a
thread, one search at a time. Bounded, whatever the table holds: a page of
the SHOWN soonest, read in nextRun order from an index (storage/sql.
later_jobs), and a count that stops past COUNTED ("10000+"), so a million
jobs due later cost what ten thousand do, and the soonest are listed
however many wait before them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobserver.storage.reader_types import LaterJobs

# Jobs listed: a screen's worth; the count says how many more.
SHOWN = 50
# Where a view's count stops (about 10 ms of index on SQLite).
COUNTED = 10_000


@dataclass(frozen=True)
class View:
    title: str
    retrying: bool
    # What the page says of its jobs, and when there are none.
    what: str
    none: str


VIEWS = {
    "/scheduled": View(
        "Scheduled", False, "queued jobs due later", "No job is queued to run later."
    ),
    "/retries": View(
        "Retries",
        True,
        "queued jobs waiting for a retry (a failed attempt counted)",
        "No job is waiting for a retry.",
    ),
}


def context(view: View, found: LaterJobs) -> dict[str, Any]:
    """What later.html shows of a view's jobs."""
    return {"view": view, "found": found, "counted": COUNTED}
