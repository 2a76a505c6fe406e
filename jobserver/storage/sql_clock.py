"""The questions of time asked of the jobs, in the SQL both backends speak,
for the writer's connection: when the next job falls due, or the next
reply deadline or pending cancel's lease ends (the clock,
core/engine/clock.py); which cancels are pending (CancelledJobs) or due;
which RUNNING jobs have gone unheard from (the stale-job net,
core/engine/stale.py). Apart from the jobs' own operations (sql_store.py)
because they write nothing: the jobs they find (locked where other nodes
write, those another node holds passed over) are moved by lifecycle.
"""

from __future__ import annotations

from collections.abc import Sequence

from jobserver.model.jobs import Job
from jobserver.storage import sql
from jobserver.storage.sql import JOB
from jobserver.storage.sql_statements import Statements


def next_due_statement(after: str) -> str:
    """ClockStatements.next_due's statement, `after` in place of its time
    (a parameter's mark, twice)."""
    return (
        "SELECT MIN(due) FROM ("
        f"SELECT MIN(nextRun) AS due FROM jobs WHERE state IN ({sql.READY_SQL}) "
        f"AND nextRun > {after} UNION ALL "
        f"SELECT MIN(nextRun) FROM jobs WHERE state = {sql.WAITING_SQL} AND nextRun > {after}"
        ") AS times"
    )


class ClockStatements(Statements):
    """The named reads of due times, pending cancels and stale jobs."""

    def next_due(self, after: str) -> str | None:
        """The earliest nextRun later than `after` among jobs that wait to
        run, and reply deadlines of WAITING jobs; one index each."""
        row = self._one(next_due_statement(self.dialect.mark), (after, after))
        return row[0]

    def first_deadline(self) -> str | None:
        """The earliest reply deadline, or lease end of a job whose cancel
        is pending, passed or not."""
        return self._one(
            "SELECT MIN(due) FROM ("
            f"SELECT MIN(nextRun) AS due FROM jobs WHERE state = {sql.WAITING_SQL} UNION ALL "
            f"SELECT MIN(nextRun) FROM jobs WHERE {sql.CANCELLING}) AS times"
        )[0]

    def cancel_pending(self, job_ids: Sequence[int]) -> list[int]:
        """Of these jobs, those whose cancel is pending (CancelledJobs,
        protocol.md 14.26), in jobID order: one primary-key lookup each."""
        by_id, args = self.dialect.any_of("jobID", job_ids, "bigint")
        rows = self._execute(
            f"SELECT jobID FROM jobs WHERE {by_id} AND cancelRequested = 1 ORDER BY jobID", args
        )
        return [int(row[0]) for row in rows.fetchall()]

    def cancels_due(self, now: str, limit: int) -> list[Job]:
        """RUNQUEUED jobs whose cancel is pending and whose lease has ended
        by `now`, earliest first (protocol.md 14.26)."""
        d = self.dialect
        return self._jobs(
            f"SELECT {JOB} FROM jobs {d.indexed_by('jobsCancelling')} WHERE {sql.CANCELLING} "
            f"AND nextRun <= {d.mark} ORDER BY nextRun LIMIT {d.mark}{d.skip_locked}",
            (now, limit),
        )

    def oldest_report(self) -> str | None:
        """The lastReport of the RUNNING job heard from least recently. One
        without a report time (which should not exist) must not hide the
        others' deadlines; `stale` takes it at the next tick."""
        row = self._one(
            f"SELECT lastReport FROM jobs {self.dialect.indexed_by('jobsRunningReport')} "
            f"WHERE state = {sql.RUNNING_SQL} AND lastReport > '' ORDER BY lastReport LIMIT 1"
        )
        return row[0] if row else None

    def stale(self, reported_before: str, limit: int) -> list[Job]:
        """RUNNING jobs last heard from at or before `reported_before`,
        those heard from least recently first."""
        d = self.dialect
        return self._jobs(
            f"SELECT {JOB} FROM jobs {d.indexed_by('jobsRunningReport')} "
            f"WHERE state = {sql.RUNNING_SQL} AND lastReport <= {d.mark} "
            f"ORDER BY lastReport LIMIT {d.mark}{d.skip_locked}",
            (reported_before, limit),
        )
