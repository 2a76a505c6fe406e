"""Dependencies in the SQL both backends speak (dependency_types.py says
what each operation means; protocol.md 14.25 what they are for).

Two tables: jobDependencies holds the graph's edges (jobID waits for
dependsOn), dependencyOutcomes how each job depended on ended, kept after
it is deleted (FinishJob deletes a finished job by default). A job's own
row counts its dependencies, those of them not ended yet (`blockers`) and
its dependents: a job with neither is never looked up here.

On PostgreSQL two nodes may end two dependencies of one job at once:
each takes the dependents' row locks in jobID order before it counts
(`release_dependents`), so neither waits for the other in a circle, and
the second to count sees the first's count (the UPDATE reads the row as
committed once its lock is granted): the dependent is queued once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from jobserver.model.jobs import Job, State
from jobserver.storage.dependency_types import Outcome
from jobserver.storage.sql import COLUMNS, JOB, states
from jobserver.storage.sql_statements import Statements

_BLOCKED = states((State.BLOCKED,))
_JOB_OF_JOBS = ", ".join(f"jobs.{column}" for column in COLUMNS)
# The dependents of one job (the parameter), through the edges' index.
_DEPENDENTS = "SELECT jobID FROM jobDependencies WHERE dependsOn = {0}"


class DependencyStatements(Statements):
    """storage/dependency_types.Dependencies for SqlStore."""

    def depended_on(self, ids: Sequence[int]) -> dict[int, Job]:
        if not ids:
            return {}
        d = self.dialect
        by_id, args = d.any_of("jobID", sorted(set(ids)), "bigint")
        jobs = self._jobs(f"SELECT {JOB} FROM jobs WHERE {by_id} ORDER BY jobID{d.lock}", args)
        return {job.jobID: job for job in jobs}

    def outcomes_of(self, ids: Sequence[int]) -> dict[int, Outcome]:
        if not ids:
            return {}
        by_id, args = self.dialect.any_of("jobID", sorted(set(ids)), "bigint")
        rows = self._execute(
            f"SELECT jobID, state, data FROM dependencyOutcomes WHERE {by_id}", args
        ).fetchall()
        return {int(r[0]): Outcome(int(r[0]), str(r[1]), str(r[2])) for r in rows}

    def add_dependencies(self, edges: Sequence[tuple[int, int]]) -> None:
        if not edges:
            return
        m = self.dialect.mark
        insert = f"INSERT INTO jobDependencies (jobID, dependsOn) VALUES ({m}, {m})"
        self._settle(insert)
        self._run_many(insert, [[job_id, on] for job_id, on in edges])
        count = f"UPDATE jobs SET dependents = dependents + {m} WHERE jobID = {m}"
        # In jobID order: the locks other nodes take in the same order.
        added = sorted(Counter(on for _, on in edges).items())
        self._run_many(count, [[n, on] for on, n in added])

    def keep_outcome(self, outcome: Outcome, only_if_depended_on: bool) -> bool:
        m = self.dialect.mark
        condition = (
            f" WHERE EXISTS (SELECT 1 FROM jobDependencies WHERE dependsOn = {m})"
            if only_if_depended_on
            else " WHERE 1 = 1"
        )
        args: list[object] = [outcome.job_id, outcome.state, outcome.data]
        if only_if_depended_on:
            args.append(outcome.job_id)
        # A SELECT with a WHERE: SQLite reads ON CONFLICT after it so.
        rows = self._execute(
            f"INSERT INTO dependencyOutcomes (jobID, state, data) SELECT {m}, {m}, {m}"
            f"{condition} ON CONFLICT (jobID) DO NOTHING",
            args,
        )
        return rows.rowcount > 0

    def release_dependents(self, job_id: int) -> list[tuple[Job, int]]:
        d = self.dialect
        dependents = _DEPENDENTS.format(d.mark)
        if d.lock:
            # One statement that locks the dependents in jobID order before
            # it writes any (see above); the lock's wait reads each row
            # again, so one that left BLOCKED meanwhile is passed over.
            statement = (
                "UPDATE jobs SET blockers = blockers - 1 FROM (SELECT jobID AS locked FROM jobs "
                f"WHERE jobID IN ({dependents}) AND state = {_BLOCKED} ORDER BY jobID{d.lock}) "
                f"AS l WHERE jobs.jobID = l.locked RETURNING {_JOB_OF_JOBS}, blockers"
            )
        else:
            statement = (
                f"UPDATE jobs SET blockers = blockers - 1 WHERE jobID IN ({dependents}) "
                f"AND state = {_BLOCKED} RETURNING {JOB}, blockers"
            )
        rows = self._execute(statement, (job_id,)).fetchall()
        released = [(Job(*row[:-1]), int(row[-1])) for row in rows]
        released.sort(key=lambda pair: pair[0].jobID)
        return released

    def dependency_outcomes(self, job_id: int, budget: int) -> list[Outcome]:
        d = self.dialect
        size = "octet_length(o.data)" if d.arrays else "length(CAST(o.data AS BLOB))"
        rows = self._execute(
            "SELECT e.dependsOn, o.state, o.data, "
            f"SUM(COALESCE({size}, 0)) OVER (ORDER BY e.dependsOn) "
            "FROM jobDependencies e LEFT JOIN dependencyOutcomes o ON o.jobID = e.dependsOn "
            f"WHERE e.jobID = {d.mark} ORDER BY e.dependsOn",
            (job_id,),
        ).fetchall()
        outcomes = []
        for on, state, data, running in rows:
            omitted = data is not None and int(running) > budget
            outcomes.append(
                Outcome(int(on), state or "", "" if omitted or data is None else data, omitted)
            )
        return outcomes

    def dependency_counts(self, job_id: int) -> dict[str, int]:
        m = self.dialect.mark
        rows = self._execute(
            "SELECT o.state, COUNT(*) FROM jobDependencies e "
            "LEFT JOIN dependencyOutcomes o ON o.jobID = e.dependsOn "
            f"WHERE e.jobID = {m} GROUP BY o.state",
            (job_id,),
        ).fetchall()
        return {str(state or ""): int(count) for state, count in rows}

    def forget_dependencies(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        d = self.dialect
        by_id, args = d.any_of("jobID", sorted(set(ids)), "bigint")
        gone = self._execute(
            f"SELECT DISTINCT dependsOn FROM jobDependencies WHERE {by_id}", args
        ).fetchall()
        self._execute(f"DELETE FROM jobDependencies WHERE {by_id}", args)
        if not gone:
            return
        on, on_args = d.any_of("jobID", sorted(int(row[0]) for row in gone), "bigint")
        self._execute(
            f"DELETE FROM dependencyOutcomes WHERE {on} AND NOT EXISTS (SELECT 1 FROM "
            "jobDependencies e WHERE e.dependsOn = dependencyOutcomes.jobID)",
            on_args,
        )
