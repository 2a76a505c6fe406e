"""The job rows the SQLite writer read or wrote last, kept as they are
stored, so that a report reads no row its GetJob has just read.

A take is a GetJob, whose search reads the job's row and whose hand-out
writes it, then a FinishJob (or another report), which reads it again.
Python's sqlite3 converts a row a column at a time, each column taking
SQLite's mutex and, on Python 3.11, releasing and taking the GIL: the
33-column row cost 84,000 instructions to read again (callgrind), more
than the statement that deletes it.

Kept rows are exactly the stored ones, whoever writes:

- a row enters as read from the file (a search's finds, a read by jobID);
- SQLite itself forgets every row any statement of this connection
  updates or deletes: temporary triggers (this connection's alone, never
  in the file) call `forgotten` for each such row, from SQL that other
  modules write as well as from ours;
- a write of one job by its key (sql_store.SqlStore._write) puts back the
  row as that write left it: the row forgotten by that very statement,
  with the columns it set (an UPDATE sets exactly those);
- a rollback, of the transaction or of a savepoint, forgets every row (it
  changes rows without triggers).

No other server writes the file (lockfile.py), and the readers'
connections only read; a commit by any other connection (an operator's
`sqlite3` at the file) moves SQLite's `data_version`, and the writer's next
transaction then forgets every row (sqlite.Store._outside_writes). A new
job's insert needs nothing: no kept row has its jobID (AUTOINCREMENT: a
jobID is never used twice).
"""

from __future__ import annotations

import sqlite3

from jobserver.model.jobs import Job

# Rows kept at most: a take holds one between its GetJob and its report; jobs
# handed out and never reported on are dropped with the rest past this.
MOST = 4096
# Only rows whose data and last error come to at most this many characters
# are kept: a job's data may be megabytes (a wire line holds 2 MiB), and
# 4,096 such rows would hold gigabytes for as long as they are kept. The
# rest are read again, as every row was before; the other columns are
# bounded small (a name, a repeat, windows).
MOST_TEXT = 4096
# The SQL function the triggers call, and the triggers.
_FUNCTION = "jobserver_forget_row"
_TRIGGERS = (
    f"CREATE TEMP TRIGGER jobserver_row_updated AFTER UPDATE ON main.jobs "
    f"BEGIN SELECT {_FUNCTION}(OLD.jobID); END",
    f"CREATE TEMP TRIGGER jobserver_row_deleted AFTER DELETE ON main.jobs "
    f"BEGIN SELECT {_FUNCTION}(OLD.jobID); END",
)


class Rows:
    """Stored job rows by jobID, for one connection that writes."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._rows: dict[int, Job] = {}
        # The last row a statement changed, and its kept copy from before
        # (None if none was kept): `written` reads the one its own write made.
        self._last: tuple[int, Job | None] = (0, None)
        db.create_function(_FUNCTION, 1, self.forgotten)
        for trigger in _TRIGGERS:
            db.execute(trigger)

    def forgotten(self, job_id: int) -> None:
        """Called by SQLite for each row a statement updates or deletes."""
        self._last = (job_id, self._rows.pop(job_id, None))

    def get(self, job_id: int) -> Job | None:
        return self._rows.get(job_id)

    def keep(self, jobs: list[Job]) -> None:
        """Rows just read from the file."""
        rows = self._rows
        if len(rows) + len(jobs) > MOST:
            rows.clear()
        for job in jobs[:MOST]:
            if len(job.data) + len(job.lastError) <= MOST_TEXT:
                rows[job.jobID] = job

    def written(self, job_id: int, columns: dict[str, object]) -> None:
        """A statement just updated the row of `job_id` alone, setting
        `columns`: if its row was kept until then, keep it as it is now."""
        last_id, before = self._last
        if last_id != job_id or before is None:
            return
        self._last = (0, None)
        if "retryDelay" in columns or "retryMaxDelay" in columns:
            # REAL columns: a whole number written reads back as a float.
            return
        # A copy with the columns set, without __init__ (as held_writes'
        # copies are made): rows handed out are never changed in place.
        copy = object.__new__(Job)
        copy.__dict__ = {**before.__dict__, **columns}
        if len(copy.data) + len(copy.lastError) <= MOST_TEXT:
            self._rows[job_id] = copy

    def clear(self) -> None:
        self._rows.clear()
        self._last = (0, None)
