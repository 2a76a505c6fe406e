"""The SQLite backend of storage (interface.py): one SQLite file, one
`jobs` table, WAL mode, served by one process (lockfile.py).

The named operations are sql_store.py's, in SQLite's dialect; this module
adds the connection, the transactions (and SQLite's own durability: syncs
and checkpoints), the hand-out search, and two caches that let a plain
queue skip queries (the priorities in use, the jobs that are parents).
Every value reaches SQLite as a bound parameter.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jobserver.model.globmatch import is_glob
from jobserver.model.jobs import Job
from jobserver.model.limits import Limit
from jobserver.storage import (
    sqlite_backup,
    sqlite_path,
    sqlite_readers,
    sqlite_ready,
    sqlite_rows,
    sqlite_schema,
    sqlite_search,
)
from jobserver.storage.backup_types import BackupCopy, BackupDirectory, BackupUnsupported
from jobserver.storage.interface import Heard
from jobserver.storage.reader_types import LaterJobs, QueryRows, QueueStats, RunningStats
from jobserver.storage.searches import NOTHING_PASSED, PassedOver
from jobserver.storage.sql import (
    SQLITE,
    priorities_from,
)
from jobserver.storage.sql_store import SqlStore
from jobserver.storage.sqlite_known import KnownJobs
from jobserver.storage.sqlite_schema import StoreError

SYNCHRONOUS_MODES = ("FULL", "NORMAL")

# How long a transaction waits for another process's lock before failing.
BUSY_MS = 2000
# The same while the server stops, so that a locked database cannot hold a
# shutdown past its few seconds.
STOPPING_BUSY_MS = 100

# How often the sync thread moves the log's pages into the database file (a
# checkpoint, which syncs that file too): often enough that the log, and
# every read's search of it, stays short; rarely enough to cost little.
CHECKPOINT_SECONDS = 0.25

# The log's size past which checkpoints make SQLite start it over, and to
# which its file is cut back then: a few seconds of writes at full speed.
LOG_BOUND = 32 * 1024 * 1024
# How long the checkpoint that starts the log over waits for the writer's
# transaction under way to end: a heavy batch's, at most a few hundred ms.
RESTART_WAIT_MS = 200
# After a RESTART checkpoint that could not finish, the pause before the
# next try: doubling from the first to the last while they keep failing.
RESTART_BACKOFF_MIN = 1.0
RESTART_BACKOFF_MAX = 30.0

# Free pages worth a vacuum on their own: 1 MiB of 4 KiB pages. Below
# that, the next jobs will reuse them anyway.
RECLAIM_MIN_PAGES = 256
# Pages given back per transaction: 8 MiB of 4 KiB pages, bounded work.
RECLAIM_PAGES = 2048
class Store(KnownJobs, SqlStore):
    dialect = SQLITE
    # A local file: every call is quick enough for the event loop.
    blocking = False
    _rows: sqlite_rows.Rows

    def __init__(
        self, path: str, synchronous: str = "FULL", limits: Mapping[str, Limit] | None = None
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
            # The rows read or written last, as stored (sqlite_rows.py).
            self._rows = sqlite_rows.Rows(self._db)
            # What the stored jobs are known to hold (sqlite_known.py).
            self._know_stored_jobs()
            # Flow control, read on every hand-out: kept in memory, so that
            # a GetJob costs nothing more when no limit or pause is set.
            # Limits given at start (--limit) are the base; those set by
            # SetLimit are stored and win.
            self._base_limits = dict(limits or {})
            self.limits: dict[str, Limit] = {}
            self.paused: frozenset[str] = frozenset()
            self._load_flow_control()
        except sqlite3.DatabaseError as error:
            reason = sqlite_path.unwritable(path)
            detail = f"{reason} (SQLite: {error})" if reason else str(error)
            raise StoreError(f"cannot use {path!r} as a job database: {detail}") from error

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
            # When this connection starts the log over, its file is cut
            # back to this size (see _restart_log).
            self._db.execute(f"PRAGMA journal_size_limit = {LOG_BOUND}")
        self._db.execute("PRAGMA busy_timeout = 0")
        self._log_fd: int | None = None
        self._checkpointer: sqlite3.Connection | None = None
        self._last_checkpoint = time.monotonic()
        self._restart_after = 0.0
        self._restart_backoff = RESTART_BACKOFF_MIN
        # Held while a checkpoint starts the log over (_restart_log).
        self._restarting = threading.Lock()

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

    @property
    def origin(self) -> Store:
        return self

    def writers(self) -> list[Store]:
        """One: a SQLite file has one writer at a time."""
        return [self]

    # Transactions. The writer opens one, gives each request a savepoint so
    # that a failing request undoes only its own changes, and commits once.

    @property
    def total_changes(self) -> int:
        return self._db.total_changes

    @property
    def in_transaction(self) -> bool:
        return self._db.in_transaction

    def begin(self, savepoint: bool = False) -> None:
        # A checkpoint that starts the log over goes first (_restart_log).
        with self._restarting:
            pass
        wait_ms = STOPPING_BUSY_MS if self._stopping else BUSY_MS
        self._db.execute(f"PRAGMA busy_timeout = {wait_ms}")
        try:
            self._db.execute("BEGIN IMMEDIATE")
        finally:
            self._db.execute("PRAGMA busy_timeout = 0")
        self._outside_writes()
        if savepoint:
            self.savepoint()

    def try_begin(self) -> bool:
        if self._restarting.locked():
            return False
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as error:
            # The primary code, whatever the extended one (BUSY_RECOVERY...).
            if error.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY:
                return False
            raise
        self._outside_writes()
        return True

    def commit(self) -> None:
        self._db.execute("COMMIT")

    def commit_reading_next_due(self, after: str) -> str | None:
        due = self.next_due(after)
        self.commit()
        return due

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
            # It never waits for a lock (timeout 0): see _restart_log.
            self._checkpointer = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=0
            )
        # PASSIVE: copies what no reader still needs, and never waits.
        self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        if self._log_bytes() > LOG_BOUND and time.monotonic() >= self._restart_after:
            self._restart_log()

    def _log_bytes(self) -> int:
        try:
            return os.stat(self.path + "-wal").st_size
        except FileNotFoundError:
            return 0

    def _restart_log(self) -> None:
        """Under writes that never pause, a PASSIVE checkpoint never copies
        the whole log (the writer appends while it copies), so SQLite never
        starts the log over and it only grows. Past LOG_BOUND, a RESTART
        checkpoint right after the PASSIVE one waits for the transaction
        under way to end (up to RESTART_WAIT_MS; past that it gives up and
        is tried again later), copies the little written since
        the PASSIVE one, holding the write lock only for that; the writer's
        next transaction then starts the log over, and journal_size_limit
        cuts the file back. Meanwhile a batch waits for the lock in a
        thread, never on the event loop (writer.py)."""
        checkpointer = self._checkpointer
        assert checkpointer is not None
        checkpointer.execute(f"PRAGMA busy_timeout = {RESTART_WAIT_MS}")
        # Meanwhile this process's writer opens no transaction: SQLite's
        # busy handler looks for the lock only now and then, and a writer
        # that begins again at once after each commit took it every time
        # (every try failed while the writes lasted).
        try:
            with self._restarting:
                (busy, _, _), = checkpointer.execute("PRAGMA wal_checkpoint(RESTART)").fetchall()
        finally:
            checkpointer.execute("PRAGMA busy_timeout = 0")
        # While it waits (for the writer, then for readers of the old log)
        # it holds new writes back. A reader that stays (a long Query, a
        # scan of every job) would make every try hold them back for the
        # whole wait: after a try that could not finish, the next waits
        # longer, doubling up to RESTART_BACKOFF_MAX seconds.
        if busy:
            self._restart_after = time.monotonic() + self._restart_backoff
            self._restart_backoff = min(self._restart_backoff * 2, RESTART_BACKOFF_MAX)
        else:
            self._restart_backoff = RESTART_BACKOFF_MIN

    def rollback(self) -> None:
        # Undone without triggers: no kept row may outlive it.
        self._rows.clear()
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")
        self._load_flow_control()

    def rollback_savepoint(self, name: str = "request") -> None:
        self._rows.clear()
        super().rollback_savepoint(name)

    # One process per file (lockfile.py): there are no other nodes.

    def announce(self, ready: set[str], due: str | None, ended: set[int]) -> None:
        pass

    async def listen(self, heard: Heard) -> None:
        pass

    # Hooks of the shared operations (sql_store.py).

    def _run(self, statement: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
        return self._db.execute(statement, args)

    def _run_many(self, statement: str, args: list[list[Any]]) -> None:
        self._db.executemany(statement, args)

    def _insert_row(self, statement: str, args: Sequence[Any]) -> int:
        # The cursor's lastrowid: SQLite's RETURNING costs more than the insert.
        job_id = self._db.execute(statement, args).lastrowid
        assert job_id is not None
        return job_id

    def hold_limits(self) -> None:
        """Nothing to do: this process is the file's only writer."""

    def find_ready(
        self,
        *,
        now: str,
        priorities: Sequence[int],
        limit: int,
        patterns: Sequence[str] = (),
        names: Sequence[str] = (),
        passed: PassedOver = NOTHING_PASSED,
    ) -> list[Job]:
        """Due QUEUED/RUNQUEUED jobs, highest priority first, then oldest nextRun.

        Either `patterns` (GLOBs, a job matching any) or `names` (exact
        names) selects the jobs; patterns without a wildcard are names.
        One index range per priority, so that no query scans jobs that are
        not due yet; priorities no job has ever used are not asked about.
        What the search has `passed` over is left out in the query: held
        names and patterns are tested in C on the index's entries, and
        the jobs already read lie before the range.
        """
        globs = any(map(is_glob, patterns))
        # What the name clause binds: names or a GLOB.
        name_args: list[str | int] = list(patterns if globs else patterns or names)
        excluded = passed.names or passed.patterns or passed.pairs or passed.keyed
        kept = not excluded and len(name_args) <= sqlite_search.KEPT_SHAPE
        shape = (globs, len(name_args))
        sql = sqlite_search.STATEMENTS.get(shape) if kept else None
        if sql is None:
            sql = sqlite_search.statement(globs, len(name_args), passed, name_args)
            if kept:
                sqlite_search.STATEMENTS[shape] = sql
        found: list[Job] = []
        for priority in priorities_from(priorities, passed.after):
            if priority not in self._priorities:
                continue
            after, after_args = "", ()  # type: tuple[str, tuple[str | int, ...]]
            if passed.after is not None and passed.after[0] == priority:
                after, after_args = sqlite_search.AFTER, passed.after[1:]
            rows = self._execute(
                sql.replace("{after}", after),
                (priority, now, *name_args, *after_args, limit - len(found)),
            )
            found += [Job(*row) for row in rows.fetchall()]
            if len(found) >= limit:
                break
        # Kept: the hand-out writes them, and the report reads them again.
        self._rows.keep(found)
        return self._found(found)

    def next_due(self, after: str) -> str | None:
        """As SqlStore's, without an index of ready jobs by nextRun alone:
        one range of jobsReadyPriority per priority (sqlite_ready.py)."""
        return self._one(sqlite_ready.NEXT_DUE, (after,))[0]

    # Retention: giving space back.

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

    def keep_statistics(self) -> bool:
        """SQLite plans without statistics of the table's size."""
        return False

    def prune_pending(self, before: Mapping[str, str], now: str) -> bool:
        return sqlite_readers.prune_pending(self.path, before, RECLAIM_MIN_PAGES, now)

    def run_query(self, sql: str, seconds: float, rows: QueryRows) -> None:
        sqlite_readers.query_in_child(self.path, sql, seconds, rows)

    def queue_stats(self, now: str) -> QueueStats:
        return sqlite_readers.queue_stats(self.path, now, self.paused)

    def running_by_name(self, now: str) -> list[tuple[str, str, int]]:
        return sqlite_readers.running_by_name(self.path, now)

    def handouts_in_windows(self, windows: Mapping[str, str]) -> dict[str, int]:
        return sqlite_readers.handouts_in_windows(self.path, windows)

    def ready_by_queue(self) -> dict[str, int]:
        return sqlite_readers.ready_by_queue(self.path)

    def find_matching(self, pattern: str, limit: int) -> list[Job]:
        rows = sqlite_readers.find_matching(self.path, pattern, limit)
        return [Job(*row) for row in rows]

    def later_jobs(self, now: str, retrying: bool, limit: int, most: int) -> LaterJobs:
        return sqlite_readers.later_jobs(self.path, now, retrying, limit, most)

    def running_jobs(
        self, now: str, pattern: str | None, limit: int, newest: bool = False
    ) -> RunningStats:
        return sqlite_readers.running_jobs(self.path, now, pattern, limit, newest)

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

