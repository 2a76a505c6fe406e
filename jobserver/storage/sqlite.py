"""The SQLite backend of storage (interface.py): the only module that
writes SQL for the writer.

One SQLite file, one `jobs` table, WAL mode. The store never decides what a
command means; it offers named operations on rows and the transaction
primitives the writer uses to commit many requests at once. Every value
reaches SQLite as a bound parameter.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence

from jobserver.model.globmatch import is_glob
from jobserver.model.jobs import PLAIN, Job, NewJob
from jobserver.storage import sqlite_backup, sqlite_readers, sqlite_schema
from jobserver.storage.interface import (
    BackupCopy,
    BackupDirectory,
    BackupUnsupported,
    Heard,
    QueryRows,
    QueueStats,
)
from jobserver.storage.sqlite_schema import StoreError

SYNCHRONOUS_MODES = ("FULL", "NORMAL")

_COLUMNS = (
    "created, jobID, state, name, nextRun, lastRun, repeat, data, priority, "
    "parentJobID, retryAfter, maxAttempts, retryBackoff, retryDelay, retryMaxDelay, "
    "attempts, lastError, leaseID, cost, timeWindows, timeZone, ended, replyKey, lastReport"
)

# The columns commands may change; `update` refuses any other name, so a
# column name never comes from a request.
_UPDATABLE = frozenset(
    (
        "state", "name", "nextRun", "lastRun", "repeat", "data", "priority", "retryAfter",
        "attempts", "lastError", "leaseID", "ended", "replyKey", "lastReport",
    )
)




# How long a transaction waits for another process's lock before failing.
BUSY_MS = 2000
# The same while the server stops, so that a locked database cannot hold a
# shutdown past its few seconds.
STOPPING_BUSY_MS = 100

# How often the sync thread moves the log's pages into the database file (a
# checkpoint, which syncs that file too): often enough that the log, and
# every read's search of it, stays short; rarely enough to cost little.
CHECKPOINT_SECONDS = 0.25

# Free pages worth a vacuum on their own: 1 MiB of 4 KiB pages. Below
# that, the next jobs will reuse them anyway.
RECLAIM_MIN_PAGES = 256
# Pages given back per transaction: 8 MiB of 4 KiB pages, bounded work.
RECLAIM_PAGES = 2048


class Store:
    # A local file: every call is quick enough for the event loop.
    blocking = False

    def __init__(
        self, path: str, synchronous: str = "FULL", limits: Mapping[str, int] | None = None
    ) -> None:
        if synchronous not in SYNCHRONOUS_MODES:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS_MODES}")
        self.path = path
        self.errors: tuple[type[Exception], ...] = (sqlite3.Error,)
        # One writer per file: no transaction is ever undone for another's.
        self.transient: tuple[type[Exception], ...] = ()
        # Set when the server stops (see STOPPING_BUSY_MS).
        self._stopping = False
        _create_private(path)
        try:
            self._db = sqlite3.connect(
                path, isolation_level=None, check_same_thread=False
            )
            # The schema and its migrations are synced by SQLite itself.
            sqlite_schema.prepare(self._db, path, "FULL", BUSY_MS)
            self._commit_without_syncing(synchronous)
            # Every priority a job has had since the file was opened: a
            # superset of those with waiting jobs, so GetJob skips the rest.
            self._priorities = {
                row[0] for row in self._db.execute("SELECT DISTINCT priority FROM jobs")
            }
            # Every job named as a parent since the file was opened: a
            # superset of the jobs with children, so that handing out or
            # finishing any other job asks nothing about children.
            self._parents = {
                row[0]
                for row in self._db.execute(
                    "SELECT DISTINCT parentJobID FROM jobs WHERE parentJobID != 0"
                )
            }
            # Flow control, read on every hand-out: kept in memory, so that
            # a GetJob costs nothing more when no limit or pause is set.
            # Limits given at start (--limit) are the base; those set by
            # SetLimit are stored and win.
            self._base_limits = dict(limits or {})
            self.limits: dict[str, int] = {}
            self.paused: frozenset[str] = frozenset()
            self._load_flow_control()
        except sqlite3.DatabaseError as error:
            raise StoreError(f"cannot use {path!r} as a job database: {error}") from error

    def _commit_without_syncing(self, synchronous: str) -> None:
        """In WAL mode with synchronous NORMAL a commit appends to the log
        without syncing it; SQLite syncs the log and the file only at a
        checkpoint. With FULL, `sync` makes each commit durable instead,
        from the writer's sync thread, which also runs the checkpoints, so
        that no commit stops to copy pages. The connection never waits for
        a lock by itself: `begin` says how long to wait."""
        self.needs_sync = synchronous == "FULL" and self.path != ":memory:"
        self._db.execute("PRAGMA synchronous = NORMAL")
        if self.needs_sync:
            self._db.execute("PRAGMA wal_autocheckpoint = 0")
        self._db.execute("PRAGMA busy_timeout = 0")
        self._log_fd: int | None = None
        self._checkpointer: sqlite3.Connection | None = None
        self._last_checkpoint = time.monotonic()

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
        if self._log_fd is not None:
            os.close(self._log_fd)
        # The last connection to close checkpoints the log into the file,
        # syncs it, and removes the log.
        self._db.close()

    def stop_waiting_long(self) -> None:
        self._stopping = True

    # Transactions. The writer opens one, gives each request a savepoint so
    # that a failing request undoes only its own changes, and commits once.

    @property
    def total_changes(self) -> int:
        return self._db.total_changes

    @property
    def in_transaction(self) -> bool:
        return self._db.in_transaction

    def begin(self) -> None:
        wait_ms = STOPPING_BUSY_MS if self._stopping else BUSY_MS
        self._db.execute(f"PRAGMA busy_timeout = {wait_ms}")
        try:
            self._db.execute("BEGIN IMMEDIATE")
        finally:
            self._db.execute("PRAGMA busy_timeout = 0")

    def try_begin(self) -> bool:
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as error:
            # The primary code, whatever the extended one (BUSY_RECOVERY...).
            if error.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY:
                return False
            raise
        return True

    def commit(self) -> None:
        self._db.execute("COMMIT")

    def sync(self) -> None:
        if not self.needs_sync:
            return
        if self._log_fd is None:
            # The log lives as long as this connection: SQLite removes it
            # only when the last connection closes.
            self._log_fd = os.open(self.path + "-wal", os.O_RDONLY | os.O_CLOEXEC)
            # Its name in the directory must survive a power cut too.
            _sync_directory(os.path.dirname(os.path.abspath(self.path)))
        _datasync(self._log_fd)

    def checkpoint_if_due(self) -> None:
        if not self.needs_sync or time.monotonic() - self._last_checkpoint < CHECKPOINT_SECONDS:
            return
        self._last_checkpoint = time.monotonic()
        if self._checkpointer is None:
            # A connection of its own, so the writer's goes on meanwhile;
            # its synchronous FULL makes the checkpoint sync the log before
            # copying it, and the file after.
            self._checkpointer = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False
            )
        # PASSIVE: copies what no reader still needs, and never waits.
        self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def rollback(self) -> None:
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")
        self._load_flow_control()

    # One process per file (lockfile.py): there are no other nodes.

    def announce(self, ready: set[str], due: str | None) -> None:
        pass

    async def listen(self, heard: Heard) -> None:
        pass

    # Savepoint names are the core's own constants, quoted as identifiers.

    def savepoint(self, name: str = "request") -> None:
        self._db.execute(f'SAVEPOINT "{name}"')

    def release(self, name: str = "request") -> None:
        self._db.execute(f'RELEASE "{name}"')

    def rollback_savepoint(self, name: str = "request") -> None:
        self._db.execute(f'ROLLBACK TO "{name}"')
        self._db.execute(f'RELEASE "{name}"')
        self._load_flow_control()

    # Rows.

    def insert(self, new: NewJob, *, created: str, state: str, ended: str = "") -> int:
        policy, flow = new.policy, new.flow
        row = (
            created, state, new.name, new.next_run, new.repeat, new.data, new.priority,
            new.parent_id, new.retry_after,
        )
        if flow != PLAIN or ended:
            cursor = self._db.execute(
                "INSERT INTO jobs (created, state, name, nextRun, repeat, data, "
                "priority, parentJobID, retryAfter, cost, timeWindows, timeZone, ended) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (*row, flow.cost, flow.windows, flow.zone, ended),
            )
            if policy is not None:
                self._db.execute(
                    "UPDATE jobs SET maxAttempts = ?, retryBackoff = ?, retryDelay = ?, "
                    "retryMaxDelay = ? WHERE jobID = ?",
                    (policy.max_attempts, policy.backoff, policy.delay, policy.max_delay,
                     cursor.lastrowid),
                )
        elif policy is None:
            cursor = self._db.execute(
                "INSERT INTO jobs (created, state, name, nextRun, repeat, data, "
                "priority, parentJobID, retryAfter) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                row,
            )
        else:
            cursor = self._db.execute(
                "INSERT INTO jobs (created, state, name, nextRun, repeat, data, "
                "priority, parentJobID, retryAfter, maxAttempts, retryBackoff, retryDelay, "
                "retryMaxDelay) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (*row, policy.max_attempts, policy.backoff, policy.delay, policy.max_delay),
            )
        self._priorities.add(new.priority)
        if new.parent_id:
            self._parents.add(new.parent_id)
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    def get(self, job_id: int) -> Job | None:
        row = self._db.execute(
            f"SELECT {_COLUMNS} FROM jobs WHERE jobID = ?", (job_id,)
        ).fetchone()
        return Job(*row) if row else None

    def update(self, job_id: int, **fields: object) -> None:
        unknown = set(fields) - _UPDATABLE
        if unknown:
            raise ValueError(f"not updatable: {sorted(unknown)}")
        if "priority" in fields:
            # A column value is any object to the interface; this one is a number.
            self._priorities.add(int(fields["priority"]))  # type: ignore[call-overload]
        assignments = ", ".join(f"{column} = ?" for column in fields)
        self._db.execute(
            f"UPDATE jobs SET {assignments} WHERE jobID = ?", (*fields.values(), job_id)
        )

    def delete(self, job_id: int) -> None:
        self._db.execute("DELETE FROM jobs WHERE jobID = ?", (job_id,))

    def find_ready(
        self,
        *,
        now: str,
        priorities: Sequence[int],
        limit: int,
        pattern: str | None = None,
        names: Sequence[str] = (),
        skipped: Sequence[int] = (),
    ) -> list[Job]:
        """Due QUEUED/RUNQUEUED jobs, highest priority first, then oldest nextRun.

        Either `pattern` (a GLOB) or `names` (exact names) selects the jobs.
        One index range per priority, so that no query scans jobs that are
        not due yet; priorities no job has ever used are not asked about.
        The `skipped` jobIDs are left out.
        """
        # What the name clause binds: names or a GLOB, then jobIDs.
        name_args: Sequence[str | int]
        if pattern is not None and is_glob(pattern):
            source, name_clause, name_args = "jobs", "name GLOB ?", [pattern]
        else:
            # Exact names: seek each one in the name index, however many
            # jobs of other names are due.
            names = [pattern] if pattern is not None else list(names)
            source = "jobs INDEXED BY jobsReadyName"
            name_clause = f"name IN ({', '.join('?' for _ in names)})"
            name_args = names
        if skipped:
            name_clause += f" AND jobID NOT IN ({', '.join('?' for _ in skipped)})"
            name_args = [*name_args, *skipped]
        sql = (
            f"SELECT {_COLUMNS} FROM {source} "
            "WHERE state IN ('QUEUED', 'RUNQUEUED') AND priority = ? AND nextRun <= ? "
            f"AND {name_clause} ORDER BY nextRun, name, jobID LIMIT ?"
        )
        found: list[Job] = []
        for priority in priorities:
            if priority not in self._priorities:
                continue
            rows = self._db.execute(sql, (priority, now, *name_args, limit - len(found)))
            found += (Job(*row) for row in rows)
            if len(found) >= limit:
                break
        return found

    def next_due(self, after: str) -> str | None:
        """The earliest nextRun later than `after` among jobs that wait to
        run, and reply deadlines of WAITING jobs; one index each."""
        row = self._db.execute(
            "SELECT MIN(due) FROM ("
            "SELECT MIN(nextRun) AS due FROM jobs WHERE state IN ('QUEUED', 'RUNQUEUED') "
            "AND nextRun > ? UNION ALL "
            "SELECT MIN(nextRun) FROM jobs WHERE state = 'WAITING' AND nextRun > ?)",
            (after, after),
        ).fetchone()
        return row[0]

    def first_deadline(self) -> str | None:
        """The earliest reply deadline, passed or not, for the clock at start."""
        row = self._db.execute(
            "SELECT MIN(nextRun) FROM jobs WHERE state = 'WAITING'"
        ).fetchone()
        return row[0]

    # The stale-job safety net (--stale-after).

    def oldest_report(self) -> str | None:
        """The lastReport of the RUNNING job heard from least recently."""
        # A RUNNING job without a report time (which should not exist) must
        # not hide the others' deadlines; stale() takes it at the next tick.
        row = self._db.execute(
            "SELECT lastReport FROM jobs INDEXED BY jobsRunningReport WHERE state = 'RUNNING' "
            "AND lastReport > '' ORDER BY lastReport LIMIT 1"
        ).fetchone()
        return row[0] if row else None

    def stale(self, reported_before: str, limit: int) -> list[Job]:
        """RUNNING jobs last heard from at or before `reported_before`,
        those heard from least recently first."""
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM jobs INDEXED BY jobsRunningReport WHERE state = 'RUNNING' "
            "AND lastReport <= ? ORDER BY lastReport LIMIT ?",
            (reported_before, limit),
        )
        return [Job(*row) for row in rows]

    # Replies (protocol.md 14.11).

    def waiting_on(self, key: str) -> Job | None:
        row = self._db.execute(
            f"SELECT {_COLUMNS} FROM jobs WHERE state = 'WAITING' AND replyKey = ?", (key,)
        ).fetchone()
        return Job(*row) if row else None

    def overdue(self, now: str, limit: int) -> list[Job]:
        """WAITING jobs whose reply deadline has passed, earliest first."""
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM jobs INDEXED BY jobsWaiting WHERE state = 'WAITING' "
            "AND nextRun <= ? ORDER BY nextRun LIMIT ?",
            (now, limit),
        )
        return [Job(*row) for row in rows]

    def reply(self, key: str, now: str) -> tuple[str, int] | None:
        """A kept reply's data and the job it went to (0: none yet); None
        if there is none, or it expired (and is deleted here)."""
        row = self._db.execute(
            "SELECT data, jobID, expires FROM replies WHERE replyKey = ?", (key,)
        ).fetchone()
        if row is None:
            return None
        if row[2] <= now:
            self._db.execute("DELETE FROM replies WHERE replyKey = ?", (key,))
            return None
        return row[0], row[1]

    def keep_reply(self, key: str, data: str, received: str, expires: str, job_id: int) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO replies (replyKey, data, received, expires, jobID) "
            "VALUES (?, ?, ?, ?, ?)",
            (key, data, received, expires, job_id),
        )

    def claim_reply(self, key: str, job_id: int) -> None:
        self._db.execute("UPDATE replies SET jobID = ? WHERE replyKey = ?", (job_id, key))

    def early_replies(self, now: str) -> int:
        """Unexpired replies that no job has claimed yet."""
        row = self._db.execute(
            "SELECT COUNT(*) FROM replies WHERE jobID = 0 AND expires > ?", (now,)
        ).fetchone()
        return int(row[0])

    def prune_replies(self, now: str, batch: int) -> int:
        """Delete up to `batch` expired replies; how many went."""
        cursor = self._db.execute(
            "DELETE FROM replies WHERE replyKey IN (SELECT replyKey FROM replies "
            "WHERE expires <= ? ORDER BY expires LIMIT ?)",
            (now, batch),
        )
        return cursor.rowcount

    def failed(self, *, pattern: str | None, names: Sequence[str], limit: int) -> list[Job]:
        """FAILED jobs whose name matches a GLOB `pattern` or is one of
        `names`, oldest first."""
        if pattern is not None:
            name_clause, name_args = "name GLOB ?", [pattern]
        else:
            name_clause = f"name IN ({', '.join('?' for _ in names)})"
            name_args = list(names)
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM jobs WHERE state = 'FAILED' AND {name_clause} "
            "ORDER BY jobID LIMIT ?",
            (*name_args, limit),
        )
        return [Job(*row) for row in rows]

    def count_by_state(self) -> dict[str, int]:
        rows = self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state")
        return dict(rows.fetchall())

    # Parents and children. Every query repeats `parentJobID != 0` so that
    # SQLite may use the partial index on children; without it each would
    # scan the whole table.

    def children(self, parent_id: int, states: Sequence[str]) -> list[Job]:
        """Children of a job in these states, oldest first."""
        if parent_id not in self._parents:
            return []
        marks = ", ".join("?" for _ in states)
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM jobs "
            f"WHERE parentJobID != 0 AND parentJobID = ? AND state IN ({marks}) "
            "ORDER BY jobID",
            (parent_id, *states),
        ).fetchall()
        return [Job(*row) for row in rows]

    def has_children(self, parent_id: int, states: Sequence[str] | None = None) -> bool:
        if parent_id not in self._parents:
            return False
        if states is None:
            row = self._db.execute(
                "SELECT 1 FROM jobs WHERE parentJobID != 0 AND parentJobID = ? LIMIT 1",
                (parent_id,),
            ).fetchone()
        else:
            marks = ", ".join("?" for _ in states)
            row = self._db.execute(
                "SELECT 1 FROM jobs "
                f"WHERE parentJobID != 0 AND parentJobID = ? AND state IN ({marks}) LIMIT 1",
                (parent_id, *states),
            ).fetchone()
        return row is not None

    def delete_children(self, parent_id: int, states: Sequence[str]) -> None:
        marks = ", ".join("?" for _ in states)
        self._db.execute(
            f"DELETE FROM jobs WHERE parentJobID != 0 AND parentJobID = ? AND state IN ({marks})",
            (parent_id, *states),
        )

    def find_by_name(self, name: str) -> Job | None:
        """The oldest job with exactly this name, for unique=true."""
        row = self._db.execute(
            f"SELECT {_COLUMNS} FROM jobs WHERE name = ? "
            # A finished job kept for retention is history, not a job to merge into.
            "AND NOT (state = 'FINISHED' AND parentJobID = 0) ORDER BY jobID LIMIT 1",
            (name,),
        ).fetchone()
        return Job(*row) if row else None

    # Flow control: concurrency limits and paused patterns. The tables are
    # tiny; the in-memory copies are reloaded whenever a transaction or a
    # savepoint is rolled back, so they never disagree with the file.

    def _load_flow_control(self) -> None:
        db = self._db
        try:
            stored = dict(db.execute("SELECT pattern, capacity FROM limits").fetchall())
            paused = frozenset(row[0] for row in db.execute("SELECT pattern FROM paused"))
        except sqlite3.Error:
            # A failing disk: the rollback that brought us here is what
            # matters; the copies are read again after the next rollback.
            return
        self.limits = {**self._base_limits, **stored}
        self.paused = paused

    def set_limit(self, pattern: str, capacity: int) -> None:
        """Store a limit; capacity 0 removes it (a --limit one until restart)."""
        if capacity:
            self._db.execute(
                "INSERT INTO limits (pattern, capacity) VALUES (?, ?) "
                "ON CONFLICT (pattern) DO UPDATE SET capacity = excluded.capacity",
                (pattern, capacity),
            )
            self.limits = {**self.limits, pattern: capacity}
        else:
            self._db.execute("DELETE FROM limits WHERE pattern = ?", (pattern,))
            self._base_limits.pop(pattern, None)
            self.limits = {p: c for p, c in self.limits.items() if p != pattern}

    def hold_limits(self) -> None:
        """Nothing to do: this process is the file's only writer."""

    def usage(self, pattern: str, now: str) -> int:
        """The cost of the running jobs a limit's pattern matches: RUNNING,
        and RUNQUEUED whose lease has not run out."""
        row = self._db.execute(
            "SELECT COALESCE(SUM(cost), 0) FROM jobs WHERE state IN ('RUNNING', 'RUNQUEUED') "
            "AND name GLOB ? AND (state = 'RUNNING' OR nextRun > ?)",
            (pattern, now),
        ).fetchone()
        return int(row[0])

    def pause(self, pattern: str) -> None:
        self._db.execute("INSERT OR IGNORE INTO paused (pattern) VALUES (?)", (pattern,))
        self.paused = self.paused | {pattern}

    def resume(self, pattern: str) -> bool:
        """Forget a paused pattern; False if it was not paused."""
        cursor = self._db.execute("DELETE FROM paused WHERE pattern = ?", (pattern,))
        self.paused = self.paused - {pattern}
        return cursor.rowcount > 0

    # Retention.

    def prune(self, state: str, ended_before: str, batch: int) -> int:
        """Delete up to `batch` standalone jobs in `state` (FINISHED or
        FAILED) that ended before `ended_before`; how many went."""
        cursor = self._db.execute(
            "DELETE FROM jobs WHERE jobID IN (SELECT jobID FROM jobs INDEXED BY jobsEnded "
            "WHERE state IN ('FINISHED', 'FAILED') AND parentJobID = 0 AND state = ? "
            "AND ended < ? ORDER BY ended LIMIT ?)",
            (state, ended_before, batch),
        )
        return cursor.rowcount

    def reclaim_space(self, pruned: bool) -> bool:
        free = self._free_pages()
        if free >= RECLAIM_MIN_PAGES or (pruned and free):
            self._reclaim(RECLAIM_PAGES)
            return free > RECLAIM_PAGES
        return False

    def _free_pages(self) -> int:
        return int(self._db.execute("PRAGMA freelist_count").fetchone()[0])

    def _reclaim(self, pages: int) -> None:
        """Give up to `pages` free pages back to the file system (files
        created with auto_vacuum INCREMENTAL; a no-op on others)."""
        # Python's sqlite3 steps this PRAGMA once, and each step gives back
        # one page whatever the argument, so it is run once per page; inside
        # the open transaction that costs microseconds each.
        for _ in range(min(pages, self._free_pages())):
            self._db.execute("PRAGMA incremental_vacuum(1)")

    # Connections of their own, for other threads.

    def prune_pending(self, before: Mapping[str, str], now: str) -> bool:
        return sqlite_readers.prune_pending(self.path, before, RECLAIM_MIN_PAGES, now)

    def run_query(self, sql: str, seconds: float, rows: QueryRows) -> None:
        sqlite_readers.query_in_child(self.path, sql, seconds, rows)

    def queue_stats(self, now: str) -> QueueStats:
        return sqlite_readers.queue_stats(self.path, now, self.paused)

    def running_by_name(self, now: str) -> list[tuple[str, int]]:
        return sqlite_readers.running_by_name(self.path, now)

    def find_matching(self, pattern: str, limit: int) -> list[Job]:
        rows = sqlite_readers.find_matching(self.path, _COLUMNS, pattern, limit)
        return [Job(*row) for row in rows]

    def size_bytes(self) -> int:
        total = 0
        for suffix in ("", "-wal"):
            with contextlib.suppress(OSError):
                total += os.path.getsize(self.path + suffix)
        return total

    def backup(
        self, directory: BackupDirectory, name: str, stopped: Callable[[], bool]
    ) -> BackupCopy:
        if self.path == ":memory:":
            raise BackupUnsupported("The database is in memory: there is no file to back up")
        return sqlite_backup.backup(self.path, directory, name, stopped)


def _datasync(fd: int) -> None:
    # fdatasync where the system has it: the log's size and content, not
    # its times. Both release the GIL while they wait.
    getattr(os, "fdatasync", os.fsync)(fd)


def _sync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_private(path: str) -> None:
    """A new database file readable by the server's user alone: job data
    may hold what other users of the machine must not read, and the token
    would mean nothing if they could read the file. SQLite gives its -wal
    and -shm files the same mode. An existing file keeps its own mode."""
    if path == ":memory:":
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        # It exists, or cannot be made: SQLite opens it, or says why not.
        return
    os.close(fd)

