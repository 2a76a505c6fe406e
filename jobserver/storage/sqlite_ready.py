"""SQLite's reads of the ready jobs in nextRun order across priorities: the
clock's next future job and the dashboard's Scheduled.

Since schema version 11 SQLite keeps no index of the ready jobs by nextRun
alone: every create wrote one more page to the log for it, and every
hand-out one more. jobsReadyPriority (priority, nextRun, name) answers the
same questions with one index range per priority, because a job's priority
is one of the six of protocol.md (wire/limits.PRIORITIES), checked as it
arrives; the hand-out search already reads one range per priority. A job of
another priority could only have been written into the file by hand, and
no GetJob would hand it out either.
"""

from __future__ import annotations

from jobserver.storage.sql import JOB, QUEUED_SQL, READY_SQL, WAITING_SQL, Clause
from jobserver.wire.limits import PRIORITIES

# Parameters are numbered (?1, ?2) so each range binds the same moment.
_READY = f"jobs INDEXED BY jobsReadyPriority WHERE state IN ({READY_SQL})"


def _per_priority(columns: str, where: str) -> str:
    """One SELECT per priority, each an index range of jobsReadyPriority
    after ?1, joined by UNION ALL."""
    return " UNION ALL ".join(
        f"SELECT {columns} FROM {_READY}{where} AND priority = {priority} AND nextRun > ?1"
        for priority in PRIORITIES
    )


# The earliest nextRun after ?1 of a job waiting to run (the first row of
# each priority's range: SQLite's MIN over an index reads one entry), and of
# a reply deadline.
NEXT_DUE = (
    f"SELECT MIN(due) FROM ({_per_priority('MIN(nextRun) AS due', '')} UNION ALL "
    f"SELECT MIN(nextRun) FROM jobs WHERE state = {WAITING_SQL} AND nextRun > ?1) AS times"
)


def scheduled(now: str, limit: int, most: int) -> tuple[Clause, Clause]:
    """The dashboard's Scheduled (sql.later_jobs' meaning on SQLite): the
    `limit` QUEUED jobs due soonest after `now`, in hand-out order within
    a moment (nextRun, name, jobID: each priority's range is read in that
    order and merged, so no more than `limit` rows of each are read), and
    their count up to `most` + 1. Both pass over the jobs running under a
    lease (RUNQUEUED), which are in the same index."""
    queued = f" AND state = {QUEUED_SQL}"
    listed = f"{_per_priority(JOB, queued)} ORDER BY nextRun, name, jobID LIMIT ?2"
    priorities = ", ".join(map(str, PRIORITIES))
    counted = (
        f"SELECT COUNT(*) FROM (SELECT jobID FROM {_READY}{queued} "
        f"AND priority IN ({priorities}) AND nextRun > ?1 LIMIT ?2) AS later"
    )
    return (listed, [now, limit]), (counted, [now, most + 1])
