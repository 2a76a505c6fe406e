"""Dependencies in the SQL both backends speak (dependency_types.py says
what each operation means; protocol.md 14.25 what they are for).

Two tables: jobDependencies holds the graph's edges (jobID waits for
dependsOn), dependencyOutcomes how each job depended on ended, kept after
it is deleted (FinishJob deletes a finished job by default). A job's own
row counts its dependencies, those of them not ended yet (`blockers`) and
its dependents: a job with neither is never looked up here.

A dependent's count is not decremented but counted again from the stored
outcomes (`settle`): the same answer however often it is asked, so a
cascade left for a later transaction (core/rules/cascade.py) is found
from the rows (`behind`) and finished by whichever node gets to it.
On PostgreSQL two nodes may end two dependencies of one job at once:
each takes the dependents' row locks in jobID order before it counts, so
neither waits for the other in a circle, and the second to count sees
the first's outcome (its count is a statement run once the lock is
granted): the dependent is queued once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from jobserver.model.jobs import Job, State
from jobserver.storage import sql
from jobserver.storage.dependency_types import Outcome
from jobserver.storage.sql import FINISHED_SQL, JOB, states
from jobserver.storage.sql_statements import Statements

_BLOCKED = states((State.BLOCKED,))
# Outcomes kept in one statement at most.
_CHUNK = 1000


def _pending(job: str) -> str:
    """How many dependencies of `job` (a table's alias) have no outcome."""
    return (
        f"(SELECT COUNT(*) FROM jobDependencies e WHERE e.jobID = {job}.jobID AND NOT EXISTS "
        "(SELECT 1 FROM dependencyOutcomes o WHERE o.jobID = e.dependsOn))"
    )


def _failed(job: str) -> str:
    """The lowest dependency of `job` that ended other than FINISHED."""
    return (
        "(SELECT MIN(e.dependsOn) FROM jobDependencies e JOIN dependencyOutcomes o "
        f"ON o.jobID = e.dependsOn WHERE e.jobID = {job}.jobID AND o.state <> {FINISHED_SQL})"
    )


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
        d = self.dialect
        by_id, args = d.any_of("jobID", sorted(set(ids)), "bigint")
        # Kept until this transaction ends: a dependent counted with the
        # outcome is added under it, and no other node forgets it meanwhile
        # (forget_dependencies).
        rows = self._execute(
            f"SELECT jobID, state, data FROM dependencyOutcomes WHERE {by_id} "
            f"ORDER BY jobID{d.keep}",
            args,
        ).fetchall()
        return {int(r[0]): Outcome(int(r[0]), str(r[1]), str(r[2])) for r in rows}

    def add_dependencies(self, edges: Sequence[tuple[int, int]]) -> None:
        if not edges:
            return
        d = self.dialect
        # In jobID order: the locks other nodes take in the same order.
        added = sorted(Counter(on for _, on in edges).items())
        if d.arrays:
            # One statement each, however many edges (a round trip a
            # statement: the pipeline of a thousand took a third of a second).
            self._execute(
                "INSERT INTO jobDependencies (jobID, dependsOn) "
                f"SELECT * FROM unnest({d.mark}::bigint[], {d.mark}::bigint[])",
                [sql.integers(j for j, _ in edges), sql.integers(on for _, on in edges)],
            )
            self._execute(
                "UPDATE jobs SET dependents = dependents + c.n FROM unnest("
                f"{d.mark}::bigint[], {d.mark}::bigint[]) AS c(id, n) WHERE jobs.jobID = c.id",
                [sql.integers(on for on, _ in added), sql.integers(n for _, n in added)],
            )
            return
        m = d.mark
        insert = f"INSERT INTO jobDependencies (jobID, dependsOn) VALUES ({m}, {m})"
        self._settle(insert)
        self._run_many(insert, [[job_id, on] for job_id, on in edges])
        count = f"UPDATE jobs SET dependents = dependents + {m} WHERE jobID = {m}"
        self._run_many(count, [[n, on] for on, n in added])

    def keep_outcomes(self, outcomes: Sequence[Outcome], only_if_depended_on: bool) -> list[int]:
        kept: list[int] = []
        for start in range(0, len(outcomes), _CHUNK):
            kept += self._keep_outcomes(outcomes[start : start + _CHUNK], only_if_depended_on)
        return kept

    def _keep_outcomes(self, outcomes: Sequence[Outcome], only_if_depended_on: bool) -> list[int]:
        d = self.dialect
        if d.arrays:
            rows = f"SELECT * FROM unnest({d.mark}::bigint[], {d.mark}::text[], {d.mark}::text[])"
            args: list[object] = [
                sql.integers(o.job_id for o in outcomes),
                [o.state for o in outcomes],
                [o.data for o in outcomes],
            ]
        else:
            rows = "VALUES " + ", ".join(f"({d.mark}, {d.mark}, {d.mark})" for _ in outcomes)
            args = [value for o in outcomes for value in (o.job_id, o.state, o.data)]
        # A SELECT with a WHERE: SQLite reads ON CONFLICT after it so.
        condition = (
            "EXISTS (SELECT 1 FROM jobDependencies e WHERE e.dependsOn = v.jobID)"
            if only_if_depended_on
            else "1 = 1"
        )
        return self._ids(
            f"WITH v(jobID, state, data) AS ({rows}) "
            "INSERT INTO dependencyOutcomes (jobID, state, data) "
            f"SELECT jobID, state, data FROM v WHERE {condition} "
            "ON CONFLICT (jobID) DO NOTHING RETURNING jobID",
            args,
        )

    def forget_outcomes(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        on, args = self.dialect.any_of("jobID", sorted(set(ids)), "bigint")
        self._execute(f"DELETE FROM dependencyOutcomes WHERE {on}", args)

    def edges_from(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        if not ids:
            return []
        on, args = self.dialect.any_of("dependsOn", sorted(set(ids)), "bigint")
        rows = self._execute(
            f"SELECT jobID, dependsOn FROM jobDependencies WHERE {on}", args
        ).fetchall()
        return [(int(row[0]), int(row[1])) for row in rows]

    def blocked_dependents(self, ended: Sequence[int], limit: int) -> list[int]:
        if not ended or limit <= 0:
            return []
        d = self.dialect
        on, args = d.any_of("dependsOn", sorted(set(ended)), "bigint")
        rows = self._execute(
            f"SELECT jobID FROM jobs WHERE jobID IN (SELECT jobID FROM jobDependencies "
            f"WHERE {on}) AND state = {_BLOCKED} ORDER BY jobID LIMIT {int(limit)}{d.lock}",
            args,
        ).fetchall()
        return [int(row[0]) for row in rows]

    def behind(self, after: int, examine: int) -> list[tuple[int, bool]]:
        d = self.dialect
        rows = self._execute(
            f"SELECT b.jobID, CASE WHEN b.blockers <> {_pending('b')} OR b.blockers <= 0 "
            f"OR (b.onDependencyFailure <> 'run' AND {_failed('b')} IS NOT NULL) "
            "THEN 1 ELSE 0 END FROM (SELECT jobID, blockers, onDependencyFailure FROM jobs "
            f"WHERE state = {_BLOCKED} AND jobID > {d.mark} ORDER BY jobID "
            f"LIMIT {int(examine)}) AS b ORDER BY b.jobID",
            (after,),
        ).fetchall()
        return [(int(row[0]), bool(row[1])) for row in rows]

    def settle(self, ids: Sequence[int]) -> list[tuple[Job, int, Outcome | None]]:
        if not ids:
            return []
        d = self.dialect
        by_id, args = d.any_of("jobID", sorted(set(ids)), "bigint")
        if d.lock:
            # Locked in jobID order first (see above), in a statement of its
            # own: the count below, a statement after the lock was granted,
            # reads every outcome committed before (READ COMMITTED), so two
            # nodes ending two dependencies of one job at once count both.
            locked = self._execute(
                f"SELECT jobID FROM jobs WHERE {by_id} AND state = {_BLOCKED} "
                f"ORDER BY jobID{d.lock}",
                args,
            ).fetchall()
            if not locked:
                return []
            by_id, args = d.any_of("jobID", [int(row[0]) for row in locked], "bigint")
        rows = self._execute(
            f"UPDATE jobs SET blockers = {_pending('jobs')} WHERE {by_id} "
            f"AND state = {_BLOCKED} RETURNING {JOB}, blockers",
            args,
        ).fetchall()
        if not rows:
            return []
        settled = sorted(((Job(*row[:-1]), int(row[-1])) for row in rows), key=lambda p: p[0].jobID)
        by_id, args = d.any_of("j.jobID", [job.jobID for job, _ in settled], "bigint")
        failed = dict(
            self._execute(f"SELECT j.jobID, {_failed('j')} FROM jobs j WHERE {by_id}", args)
            .fetchall()
        )
        first = [int(f) for f in failed.values() if f is not None]
        outcomes = self.outcomes_of(first) if first else {}
        # Locked (or this process's alone): while writes are held, their
        # moves are sent together, not a statement each.
        self._found([job for job, _ in settled])
        return [
            (job, left, outcomes.get(int(failed[job.jobID])) if failed.get(job.jobID) else None)
            for job, left in settled
        ]

    def dependency_outcomes(self, job_id: int, budget: int) -> list[Outcome]:
        d = self.dialect
        size = "octet_length(o.data)" if d.arrays else "length(CAST(o.data AS BLOB))"
        # The budget is applied in the statement: data past it never
        # leaves the database (read whole and cut in Python, a hundred
        # dependencies of a megabyte each cost one GetJob 100 MB and 0.26 s).
        rows = self._execute(
            f"SELECT dependsOn, state, CASE WHEN running <= {d.mark} THEN data END, "
            "data IS NOT NULL FROM ("
            "SELECT e.dependsOn, o.state, o.data, "
            f"SUM(COALESCE({size}, 0)) OVER (ORDER BY e.dependsOn) AS running "
            "FROM jobDependencies e LEFT JOIN dependencyOutcomes o ON o.jobID = e.dependsOn "
            f"WHERE e.jobID = {d.mark}) AS w ORDER BY dependsOn",
            (budget, job_id),
        ).fetchall()
        outcomes = []
        for on, state, data, has_data in rows:
            omitted = bool(has_data) and data is None
            outcomes.append(Outcome(int(on), state or "", data or "", omitted))
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
        unnamed = (
            f"{on} AND NOT EXISTS (SELECT 1 FROM jobDependencies e "
            "WHERE e.dependsOn = dependencyOutcomes.jobID)"
        )
        forget = (f"DELETE FROM dependencyOutcomes WHERE {unnamed}", on_args)
        if not d.lock:
            self._execute(*forget)
            return
        # The outcomes no edge names are locked first, and the delete is a
        # statement begun once they are held: another node adding a
        # dependent keeps the outcome it read (outcomes_of), and the edge it
        # commits while this waits must be seen, which the snapshot of a
        # statement that waited would miss (the outcome deleted under the
        # edge, its dependent waiting for good). An outcome other edges
        # still name is not locked: the finishes of its dependents neither
        # queue behind nor deadlock with each other.
        lock = (
            f"SELECT jobID FROM dependencyOutcomes WHERE {unnamed} ORDER BY jobID{d.lock}",
            on_args,
        )
        self._settle(forget[0])
        self._run_pair(lock, forget)
