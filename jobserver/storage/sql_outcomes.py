"""The outcomes of ended jobs, kept for AwaitJob (protocol.md 14.27), in
the SQL both backends speak.

An outcome is written in the transaction that ends its job, beside the
job's own write: while a command holds its writes (held_writes.py), the
outcomes of all the jobs it ends are one multi-row insert on PostgreSQL
and one executemany on SQLite, so FinishJobs of a thousand jobs costs one
statement more, not a thousand; a plain finish's delete on PostgreSQL
keeps its jobs' outcomes in the same statement (`keep_finished`). A job
that ends again (requeued after it failed) replaces its outcome.
"""

from __future__ import annotations

from jobserver.model.jobs import JobOutcome, State
from jobserver.storage.held_writes import Write
from jobserver.storage.sql_statements import Statements

# In the order of JobOutcome's fields.
_COLUMNS = ("jobID", "name", "state", "data", "lastError", "ended", "expires")
_ON_CONFLICT = " ON CONFLICT (jobID) DO UPDATE SET " + ", ".join(
    f"{column} = excluded.{column}" for column in _COLUMNS[1:]
)


def keep_finished(deleted: str, mark: str) -> str:
    """The insert that keeps the outcomes of the jobs a plain finish
    deletes (a statement's `deleted` rows: jobID, name, data, lastError,
    awaited), in the same statement as the delete (sql_store's
    finish_plain_runs): FINISHED, ended at the first parameter, kept until
    the second for an awaited job and the third for any other, none where
    that is NULL. Their data then never travels to the node and back."""
    return (
        f"INSERT INTO outcomes ({', '.join(_COLUMNS)}) "
        f"SELECT jobID, name, '{State.FINISHED.value}', data, lastError, {mark}::text, until FROM ("
        f"SELECT *, CASE WHEN awaited <> 0 THEN {mark}::text ELSE {mark}::text END AS until "
        f"FROM {deleted}) AS ended WHERE until IS NOT NULL{_ON_CONFLICT}"
    )


# The insert of one outcome, by the dialect's parameter mark: made once,
# not for each job a FinishJobs ends.
_INSERTS: dict[str, str] = {}


class Outcomes(Statements):
    """The named operations on outcomes, for the writer's connection."""

    def keep_job_outcome(self, outcome: JobOutcome) -> None:
        """Keep `outcome` (replacing an older one of the same job): held
        with the command's other writes, if it holds them."""
        head = _INSERTS.get(self.dialect.mark)
        if head is None:
            marks = ", ".join(self.dialect.mark for _ in _COLUMNS)
            head = _INSERTS[self.dialect.mark] = (
                f"INSERT INTO outcomes ({', '.join(_COLUMNS)}) VALUES ({marks}){_ON_CONFLICT}"
            )
        values = (
            outcome.jobID, outcome.name, outcome.state, outcome.data, outcome.lastError,
            outcome.ended, outcome.expires,
        )
        held = self._held
        if held is not None:
            held.insert(
                Write(head, _COLUMNS, values, outcome.jobID, insert=True, table="outcomes",
                      on_conflict=_ON_CONFLICT)
            )
            return
        self._execute(head, values)

    def job_outcome(self, job_id: int, now: str) -> JobOutcome | None:
        """The outcome kept of a job, unless it expired by `now`."""
        m = self.dialect.mark
        row = self._one(
            f"SELECT {', '.join(_COLUMNS)} FROM outcomes WHERE jobID = {m} AND expires > {m}",
            (job_id, now),
        )
        return None if row is None else JobOutcome(int(row[0]), *map(str, row[1:]))

    def ended_of(self, ids: list[int], now: str) -> list[int]:
        """Of these jobs, those whose outcome is kept: for the awaiters'
        look after a notice from another node may have been lost."""
        if not ids:
            return []
        by_id, args = self.dialect.any_of("jobID", ids, "bigint")
        return self._ids(
            f"SELECT jobID FROM outcomes WHERE {by_id} AND expires > {self.dialect.mark}",
            [*args, now],
        )

    def prune_outcomes(self, now: str, batch: int) -> int:
        """Delete up to `batch` outcomes kept past their time; how many went."""
        d = self.dialect
        rows = self._execute(
            "DELETE FROM outcomes WHERE jobID IN (SELECT jobID FROM outcomes "
            f"WHERE expires <= {d.mark} ORDER BY expires LIMIT {d.mark}{d.skip_locked})",
            (now, batch),
        )
        return max(rows.rowcount, 0)
