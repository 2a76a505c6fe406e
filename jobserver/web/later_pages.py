"""The dashboard's Scheduled and Retries, as Sidekiq has them: the QUEUED
jobs due later, soonest first, and those of them waiting for a retry's
backoff (a failed attempt counted: `attempts` > 0), with how many there are.

Read as a search is (reads.py): on a connection of the store's own, in a
thread, one search at a time. Bounded twice, whatever the table holds: a
page of SHOWN jobs, and at most EXAMINED jobs due later read to find and
count them (a range of the waiting jobs' index by nextRun,
storage/sql.later_jobs), so a million jobs due later cost what ten
thousand do; the page says when the count stopped there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobserver.storage.interface import LaterJobs

# Jobs listed: a screen's worth; the count says how many more.
SHOWN = 50
# Jobs due later read to find and count a view's (about 10 ms on SQLite).
EXAMINED = 10_000


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
    return {"view": view, "found": found, "examined": EXAMINED}
