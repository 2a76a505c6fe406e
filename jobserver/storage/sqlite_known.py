"""What SQLite's writer knows of the stored jobs without asking: every
priority a job has had and every job named as a parent since the file was
opened (supersets, so that GetJob skips priorities no job has, and handing
out or finishing any other job asks nothing about children), and whether
another connection has committed since it last looked (an operator's
`sqlite3 jobs.db "UPDATE ..."`: the lockfile keeps out a second server, not
that), after which the kept rows are forgotten and the supersets read again."""

from __future__ import annotations

import sqlite3
import time

from jobserver.storage import sqlite_rows

# After another connection's commit, the jobs' priorities are read again at
# most this often (_note_stored_priorities).
PRIORITIES_READ_SECONDS = 1.0


class KnownJobs:
    """Store's knowledge of its jobs; it gives the connection and kept rows."""

    _db: sqlite3.Connection
    _rows: sqlite_rows.Rows

    def _know_stored_jobs(self) -> None:
        """Read what the stored jobs hold, at the file's opening."""
        # SQLite's count of commits by other connections to the file, as
        # last seen: when it moves, kept rows may be stale (_outside_writes).
        self._data_version = self._read_data_version()
        self._priorities: set[int] = set()
        self._parents: set[int] = set()
        self._note_stored_parents()
        # When the priorities were last read from the jobs, and whether
        # another connection's commit asks for them again.
        self._priorities_read_at = -PRIORITIES_READ_SECONDS
        self._priorities_owed = True
        self._note_stored_priorities()

    def _outside_writes(self) -> None:
        """Forget the kept rows if another connection has committed since
        this one last looked: the lockfile keeps out a second server, not an
        operator's `sqlite3 jobs.db "UPDATE ..."`, whose changes the next
        report must read (the triggers see only this connection's writes).
        Read inside the transaction, so no commit can slip in after it."""
        version = self._read_data_version()
        if version != self._data_version:
            self._rows.clear()
            # A job it made may have a parent or a priority this connection
            # never wrote: without them, a finish of the parent would miss the
            # child, and GetJob would pass the job over.
            self._note_stored_parents()
            self._priorities_owed = True
            self._data_version = version
        self._note_stored_priorities()

    def _note_stored_parents(self) -> None:
        """Add the parents the stored jobs name to the superset kept in
        memory (an index of children alone: cheap at any size)."""
        self._parents.update(
            row[0]
            for row in self._db.execute(
                "SELECT DISTINCT parentJobID FROM jobs WHERE parentJobID != 0"
            )
        )

    def _note_stored_priorities(self) -> None:
        """If owed, add the priorities the stored jobs have to the superset
        kept in memory, at most once per PRIORITIES_READ_SECONDS: a read of
        every job (no index holds them all; 50 ms for a million narrow rows
        here), which an operator's script of many small commits would
        otherwise cost every transaction. A job it
        made of a new priority is handed out that much later at most."""
        now = time.monotonic()
        if not self._priorities_owed or now < self._priorities_read_at + PRIORITIES_READ_SECONDS:
            return
        self._priorities.update(
            row[0] for row in self._db.execute("SELECT DISTINCT priority FROM jobs")
        )
        self._priorities_read_at, self._priorities_owed = now, False

    def _read_data_version(self) -> int:
        return int(self._db.execute("PRAGMA data_version").fetchone()[0])

    def _noted(self, priority: int, parent_id: int) -> None:
        self._priorities.add(priority)
        if parent_id:
            self._parents.add(parent_id)

    def _may_have_children(self, parent_id: int) -> bool:
        return parent_id in self._parents
