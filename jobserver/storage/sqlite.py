"""The job store: the only module that speaks SQL.

One SQLite file, one `jobs` table, WAL mode. The store never decides what a
command means; it offers named operations on rows and the transaction
primitives the writer uses to commit many requests at once. Every value
reaches SQLite as a bound parameter.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from time import monotonic
from urllib.parse import quote

SCHEMA_VERSION = 5

SYNCHRONOUS_MODES = ("FULL", "NORMAL")

READY_STATES = ("QUEUED", "RUNQUEUED")

# An hour: far longer than any worker takes between sending a request and
# committing its AwaitReply, short enough that unclaimed replies do not pile up.
DEFAULT_REPLY_GRACE = 3600.0

_SCHEMA = """
CREATE TABLE jobs (
    created     TEXT NOT NULL,
    jobID       INTEGER PRIMARY KEY AUTOINCREMENT,
    state       TEXT NOT NULL,
    name        TEXT NOT NULL,
    nextRun     TEXT NOT NULL,
    lastRun     TEXT,
    repeat      TEXT NOT NULL DEFAULT '',
    data        TEXT NOT NULL DEFAULT '{}',
    priority    INTEGER NOT NULL DEFAULT 500,
    parentJobID INTEGER NOT NULL DEFAULT 0,
    retryAfter  TEXT NOT NULL DEFAULT '',
    -- The retry policy (protocol.md, "Extensions beyond Bedrock"): with
    -- maxAttempts 0 there is none, and the job behaves exactly as in Bedrock.
    maxAttempts   INTEGER NOT NULL DEFAULT 0,
    retryBackoff  TEXT NOT NULL DEFAULT '',
    retryDelay    REAL NOT NULL DEFAULT 0,
    retryMaxDelay REAL NOT NULL DEFAULT 3600,
    -- Hand-outs of the current run of a job with a policy.
    attempts      INTEGER NOT NULL DEFAULT 0,
    lastError     TEXT NOT NULL DEFAULT '',
    -- The token of the latest hand-out, for fencing late reports.
    leaseID       TEXT NOT NULL DEFAULT '',
    -- Flow control (protocol.md 14.7 to 14.10): what the job counts
    -- against concurrency limits, the daily windows it may run in, and when
    -- it became FINISHED or FAILED, for retention.
    cost          INTEGER NOT NULL DEFAULT 1,
    timeWindows   TEXT NOT NULL DEFAULT '',
    timeZone      TEXT NOT NULL DEFAULT '',
    ended         TEXT NOT NULL DEFAULT '',
    -- Replies (protocol.md 14.11): the key a WAITING job waits on. Its
    -- deadline is its nextRun, so the clock that wakes GetJobs sees it.
    replyKey      TEXT NOT NULL DEFAULT '',
    -- When a RUNNING job was handed out or last reported on (UpdateJob,
    -- TouchJob): the stale-job safety net counts from it (--stale-after).
    lastReport    TEXT NOT NULL DEFAULT ''
);
-- GetJob with a pattern: per priority, the due jobs in hand-out order
-- (nextRun, name, then jobID, which every index ends with), so the first
-- job is read straight from the index with no sort of jobs due together.
CREATE INDEX jobsReadyPriority ON jobs (priority, nextRun, name)
    WHERE state IN ('QUEUED', 'RUNQUEUED');
-- GetJob with exact names, and GLOB patterns with a literal prefix.
CREATE INDEX jobsReadyName ON jobs (name, priority, nextRun)
    WHERE state IN ('QUEUED', 'RUNQUEUED');
-- The earliest future job, for the timer that wakes waiting GetJobs.
CREATE INDEX jobsReadyNextRun ON jobs (nextRun)
    WHERE state IN ('QUEUED', 'RUNQUEUED');
-- unique=true lookups by name in any state.
CREATE INDEX jobsName ON jobs (name);
CREATE INDEX jobsParentJobIDState ON jobs (parentJobID, state)
    WHERE parentJobID != 0;
-- FailedJobs: the dead set, which is small next to the queue.
CREATE INDEX jobsFailedName ON jobs (name) WHERE state = 'FAILED';
-- What running jobs of a name use of a concurrency limit.
CREATE INDEX jobsActive ON jobs (name, state, nextRun, cost)
    WHERE state IN ('RUNNING', 'RUNQUEUED');
-- Retention: the oldest ended standalone jobs, for the pruner.
CREATE INDEX jobsEnded ON jobs (state, ended)
    WHERE state IN ('FINISHED', 'FAILED') AND parentJobID = 0;
CREATE TABLE limits (
    pattern  TEXT PRIMARY KEY,
    capacity INTEGER NOT NULL
);
CREATE TABLE paused (
    pattern TEXT PRIMARY KEY
);
-- One job at most waits on a key.
CREATE UNIQUE INDEX jobsReplyKey ON jobs (replyKey) WHERE state = 'WAITING';
-- The earliest reply deadline, for the clock.
CREATE INDEX jobsWaiting ON jobs (nextRun) WHERE state = 'WAITING';
-- Replies kept for the grace period: early ones (jobID 0) until a job
-- awaits them, delivered ones (the jobID) to refuse a second delivery.
CREATE TABLE replies (
    replyKey TEXT PRIMARY KEY,
    data     TEXT NOT NULL,
    received TEXT NOT NULL,
    expires  TEXT NOT NULL,
    jobID    INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX repliesExpires ON replies (expires);
-- The RUNNING job heard from least recently, for the stale-job deadline.
CREATE INDEX jobsRunningReport ON jobs (lastReport) WHERE state = 'RUNNING';
"""

# Statements that bring a file of version N up to N + 1. They run in one
# transaction together with the new user_version, so a file is either
# wholly migrated or untouched. The result must equal _SCHEMA (a test
# compares the two).
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "ALTER TABLE jobs ADD COLUMN maxAttempts INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN retryBackoff TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE jobs ADD COLUMN retryDelay REAL NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN retryMaxDelay REAL NOT NULL DEFAULT 3600",
        "ALTER TABLE jobs ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN lastError TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE jobs ADD COLUMN leaseID TEXT NOT NULL DEFAULT ''",
        "CREATE INDEX jobsFailedName ON jobs (name) WHERE state = 'FAILED'",
    ),
    2: (
        "ALTER TABLE jobs ADD COLUMN cost INTEGER NOT NULL DEFAULT 1",
        "ALTER TABLE jobs ADD COLUMN timeWindows TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE jobs ADD COLUMN timeZone TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE jobs ADD COLUMN ended TEXT NOT NULL DEFAULT ''",
        # Jobs that failed before retention existed count from their last run.
        "UPDATE jobs SET ended = COALESCE(lastRun, created) WHERE state IN ('FINISHED', 'FAILED')",
        # Written as in _SCHEMA: the stored text of an index is compared.
        "CREATE INDEX jobsActive ON jobs (name, state, nextRun, cost)\n"
        "    WHERE state IN ('RUNNING', 'RUNQUEUED')",
        "CREATE INDEX jobsEnded ON jobs (state, ended)\n"
        "    WHERE state IN ('FINISHED', 'FAILED') AND parentJobID = 0",
        "CREATE TABLE limits (\n    pattern  TEXT PRIMARY KEY,\n    capacity INTEGER NOT NULL\n)",
        "CREATE TABLE paused (\n    pattern TEXT PRIMARY KEY\n)",
    ),
    3: (
        "ALTER TABLE jobs ADD COLUMN replyKey TEXT NOT NULL DEFAULT ''",
        "CREATE UNIQUE INDEX jobsReplyKey ON jobs (replyKey) WHERE state = 'WAITING'",
        "CREATE INDEX jobsWaiting ON jobs (nextRun) WHERE state = 'WAITING'",
        "CREATE TABLE replies (\n    replyKey TEXT PRIMARY KEY,\n    data     TEXT NOT NULL,\n"
        "    received TEXT NOT NULL,\n    expires  TEXT NOT NULL,\n"
        "    jobID    INTEGER NOT NULL DEFAULT 0\n)",
        "CREATE INDEX repliesExpires ON replies (expires)",
    ),
    4: (
        "ALTER TABLE jobs ADD COLUMN lastReport TEXT NOT NULL DEFAULT ''",
        # Running jobs count from their hand-out, the last time they were seen.
        "UPDATE jobs SET lastReport = COALESCE(NULLIF(lastRun, ''), created) "
        "WHERE state = 'RUNNING'",
        "CREATE INDEX jobsRunningReport ON jobs (lastReport) WHERE state = 'RUNNING'",
    ),
}

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


_GLOB_SPECIALS = frozenset("*?[")


# How long a transaction waits for another process's lock before failing.
BUSY_MS = 2000
# The same while the server stops, so that a locked database cannot hold a
# shutdown past its few seconds.
STOPPING_BUSY_MS = 100


class StoreError(Exception):
    """The database file cannot be used (wrong file, newer schema, ...)."""


@dataclass
class Job:
    created: str
    jobID: int
    state: str
    name: str
    nextRun: str
    lastRun: str | None
    repeat: str
    data: str
    priority: int
    parentJobID: int
    retryAfter: str
    maxAttempts: int
    retryBackoff: str
    retryDelay: float
    retryMaxDelay: float
    attempts: int
    lastError: str
    leaseID: str
    cost: int = 1
    timeWindows: str = ""
    timeZone: str = ""
    ended: str = ""
    replyKey: str = ""
    lastReport: str = ""


@dataclass(frozen=True)
class FlowOptions:
    """What CreateJob's cost, timeWindows and timeZone ask for; the
    defaults are a plain Bedrock job."""

    cost: int = 1
    windows: str = ""
    zone: str = ""


PLAIN = FlowOptions()


@dataclass(frozen=True)
class RetryPolicy:
    """What CreateJob's maxAttempts, retryBackoff, retryDelay and
    retryMaxDelay ask for."""

    max_attempts: int
    backoff: str
    delay: float
    max_delay: float


class Store:
    def __init__(
        self, path: str, synchronous: str = "FULL", limits: Mapping[str, int] | None = None
    ) -> None:
        if synchronous not in SYNCHRONOUS_MODES:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS_MODES}")
        self.path = path
        # Set by the writer when the server stops (see STOPPING_BUSY_MS).
        self.stopping = False
        self._short_wait = False
        try:
            self._db = sqlite3.connect(
                path, isolation_level=None, check_same_thread=False
            )
            self._configure(synchronous)
            self._check()
            self._migrate()
            # Every priority a job has had since the file was opened: a
            # superset of those with waiting jobs, so GetJob skips the rest.
            self._priorities = {
                row[0] for row in self._db.execute("SELECT DISTINCT priority FROM jobs")
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

    def _configure(self, synchronous: str) -> None:
        db = self._db
        # Another process holding the write lock is waited for, not failed;
        # every request waits with it, so not for long.
        db.execute(f"PRAGMA busy_timeout = {BUSY_MS}")
        # Pages freed by deleted jobs go back to the file system when the
        # pruner asks (incremental_vacuum). It only takes effect on a new
        # file, before its first table; older files keep their setting, and
        # are not written to here (one may be read-only).
        if db.execute("PRAGMA page_count").fetchone()[0] == 0:
            db.execute("PRAGMA auto_vacuum = INCREMENTAL")
        mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode.lower() != "wal" and self.path != ":memory:":
            raise StoreError(f"cannot switch {self.path!r} to WAL mode (got {mode})")
        # PRAGMA takes no parameters; the value was checked against a whitelist.
        db.execute(f"PRAGMA synchronous = {synchronous}")

    def _check(self) -> None:
        """Refuse a damaged file at start rather than fail writes later.
        quick_check reads every page once: seconds for millions of jobs."""
        try:
            problems = [row[0] for row in self._db.execute("PRAGMA quick_check")]
        except sqlite3.OperationalError as error:
            if "readonly" not in str(error):
                raise
            # A read-only file with a journal left by a crash cannot be
            # checked; it is served for reading all the same.
            return
        if problems != ["ok"]:
            raise StoreError(f"{self.path!r} is damaged: {'; '.join(problems[:3])}")

    def _migrate(self) -> None:
        db = self._db
        if db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            # Read again under the write lock: another process may have
            # migrated the file in the meantime.
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path!r} has schema version {version}; this server knows "
                    f"up to {SCHEMA_VERSION}"
                )
            if version == 0:
                self._create_schema()
            else:
                for step in range(version, SCHEMA_VERSION):
                    for statement in _MIGRATIONS[step]:
                        db.execute(statement)
            # PRAGMA takes no parameters; the value is our own constant.
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    def _create_schema(self) -> None:
        tables = self._db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'jobs'"
        ).fetchall()
        if tables:
            raise StoreError(f"{self.path!r} has a jobs table this server did not create")
        # The schema's comments hold no semicolons, so each piece is one statement.
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                self._db.execute(statement)

    def close(self) -> None:
        self._db.close()

    # Transactions. The writer opens one, gives each request a savepoint so
    # that a failing request undoes only its own changes, and commits once.

    @property
    def total_changes(self) -> int:
        return self._db.total_changes

    @property
    def in_transaction(self) -> bool:
        return self._db.in_transaction

    def begin(self) -> None:
        if self.stopping and not self._short_wait:
            self._db.execute(f"PRAGMA busy_timeout = {STOPPING_BUSY_MS}")
            self._short_wait = True
        self._db.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self._db.execute("COMMIT")

    def rollback(self) -> None:
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")
        self._load_flow_control()

    def savepoint(self) -> None:
        self._db.execute("SAVEPOINT request")

    def release(self) -> None:
        self._db.execute("RELEASE request")

    def rollback_savepoint(self) -> None:
        self._db.execute("ROLLBACK TO request")
        self._db.execute("RELEASE request")
        self._load_flow_control()

    # Rows.

    def insert(
        self,
        *,
        created: str,
        state: str,
        name: str,
        next_run: str,
        repeat: str,
        data: str,
        priority: int,
        parent_id: int = 0,
        retry_after: str = "",
        policy: RetryPolicy | None = None,
        flow: FlowOptions = PLAIN,
        ended: str = "",
    ) -> int:
        if flow != PLAIN or ended:
            cursor = self._db.execute(
                "INSERT INTO jobs (created, state, name, nextRun, repeat, data, "
                "priority, parentJobID, retryAfter, cost, timeWindows, timeZone, ended) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    created, state, name, next_run, repeat, data, priority, parent_id,
                    retry_after, flow.cost, flow.windows, flow.zone, ended,
                ),
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
                (created, state, name, next_run, repeat, data, priority, parent_id, retry_after),
            )
        else:
            cursor = self._db.execute(
                "INSERT INTO jobs (created, state, name, nextRun, repeat, data, "
                "priority, parentJobID, retryAfter, maxAttempts, retryBackoff, retryDelay, "
                "retryMaxDelay) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    created, state, name, next_run, repeat, data, priority, parent_id,
                    retry_after, policy.max_attempts, policy.backoff, policy.delay,
                    policy.max_delay,
                ),
            )
        self._priorities.add(priority)
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
        blocked: Sequence[str] = (),
        skipped: Sequence[int] = (),
    ) -> list[Job]:
        """Due QUEUED/RUNQUEUED jobs, highest priority first, then oldest nextRun.

        Either `pattern` (a GLOB) or `names` (exact names) selects the jobs.
        One index range per priority, so that no query scans jobs that are
        not due yet; priorities no job has ever used are not asked about.
        Jobs whose name matches a `blocked` GLOB, and the `skipped` jobIDs,
        are left out.
        """
        if pattern is not None and not _GLOB_SPECIALS.isdisjoint(pattern):
            source, name_clause, name_args = "jobs", "name GLOB ?", [pattern]
        else:
            # Exact names: seek each one in the name index, however many
            # jobs of other names are due.
            names = [pattern] if pattern is not None else list(names)
            source = "jobs INDEXED BY jobsReadyName"
            name_clause = f"name IN ({', '.join('?' for _ in names)})"
            name_args = names
        if blocked:
            name_clause += " AND NOT (" + " OR ".join("name GLOB ?" for _ in blocked) + ")"
            name_args = [*name_args, *blocked]
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

    def datetime_after(self, start: str, modifiers: Iterable[str]) -> str | None:
        """Apply SQLite date modifiers to `start`, one bound parameter each.

        `START OF HOUR` is not an SQLite modifier, so it is a STRFTIME step.
        Returns None when SQLite cannot compute the time.
        """
        current: str | None = start
        for modifier in modifiers:
            if current is None:
                return None
            if modifier == "START OF HOUR":
                row = self._db.execute(
                    "SELECT STRFTIME('%Y-%m-%d %H:00:00', ?)", (current,)
                ).fetchone()
            else:
                row = self._db.execute("SELECT DATETIME(?, ?)", (current, modifier)).fetchone()
            current = row[0]
        if current is None:
            return None
        return self._db.execute("SELECT DATETIME(?)", (current,)).fetchone()[0]

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
        marks = ", ".join("?" for _ in states)
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM jobs WHERE parentJobID != 0 AND parentJobID = ? AND state IN ({marks}) "
            "ORDER BY jobID",
            (parent_id, *states),
        ).fetchall()
        return [Job(*row) for row in rows]

    def has_children(self, parent_id: int, states: Sequence[str] | None = None) -> bool:
        if states is None:
            row = self._db.execute(
                "SELECT 1 FROM jobs WHERE parentJobID != 0 AND parentJobID = ? LIMIT 1", (parent_id,)
            ).fetchone()
        else:
            marks = ", ".join("?" for _ in states)
            row = self._db.execute(
                f"SELECT 1 FROM jobs WHERE parentJobID != 0 AND parentJobID = ? AND state IN ({marks}) LIMIT 1",
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

    def json_patch(self, target: str, patch: str) -> str:
        """RFC 7396 merge of two JSON objects, by SQLite's JSON_PATCH."""
        return self._db.execute("SELECT JSON_PATCH(?, ?)", (target, patch)).fetchone()[0]

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

    def free_pages(self) -> int:
        return int(self._db.execute("PRAGMA freelist_count").fetchone()[0])

    def reclaim(self, pages: int) -> None:
        """Give up to `pages` free pages back to the file system (files
        created with auto_vacuum INCREMENTAL; a no-op on others)."""
        # Python's sqlite3 steps this PRAGMA once, and each step gives back
        # one page whatever the argument, so it is run once per page; inside
        # the open transaction that costs microseconds each.
        for _ in range(min(pages, self.free_pages())):
            self._db.execute("PRAGMA incremental_vacuum(1)")


# Read-only SQL for the `Query` command. It runs on its own connection,
# opened read-only, with an authorizer that allows nothing but reading and a
# progress handler that stops it at its deadline.

# Longest text or blob a query may build: enough for any row of the jobs
# table, small enough that a hostile zeroblob() or printf() cannot exhaust
# memory.
QUERY_MAX_LENGTH = 16 * 1024 * 1024

_QUERY_ALLOWED = frozenset(
    (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE)
)


class QueryTimeout(Exception):
    pass


def _read_only_uri(path: str) -> str:
    """A URI that opens `path` read-only. An absolute path gets an empty
    authority (`file://` + path): after a bare `file:`, a path starting with
    `//` would make its first directory the URI's authority."""
    authority = "//" if path.startswith("/") else ""
    return f"file:{authority}{quote(path)}?mode=ro"


def read_only_query(
    path: str, sql: str, seconds: float, max_rows: int
) -> tuple[list[str], list[tuple[object, ...]]]:
    """Run one read-only statement; return column names and rows.

    Raises sqlite3.Error for bad SQL or anything that is not a read,
    QueryTimeout when it runs past `seconds`, and OverflowError when it
    returns more than `max_rows` rows.
    """
    db = sqlite3.connect(_read_only_uri(path), uri=True, isolation_level=None)
    try:
        db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, QUERY_MAX_LENGTH)
        db.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        db.set_authorizer(_authorize)
        deadline = monotonic() + seconds
        db.set_progress_handler(lambda: monotonic() > deadline, 1000)
        try:
            cursor = db.execute(sql)
            rows = cursor.fetchmany(max_rows + 1)
        except sqlite3.OperationalError as error:
            if monotonic() > deadline and "interrupt" in str(error):
                raise QueryTimeout() from error
            raise
        if len(rows) > max_rows:
            raise OverflowError(max_rows)
        headers = [column[0] for column in cursor.description or ()]
        return headers, rows
    finally:
        db.close()


def prune_pending(
    path: str, before: Mapping[str, str], min_free_pages: int, now: str
) -> bool:
    """Whether the pruner has work, asked on a connection of its own so that
    an idle server adds no transaction: a standalone job in a state of
    `before` that ended before its time there, a reply kept past its grace
    period (expired at `now`), or free pages to reclaim."""
    db = sqlite3.connect(_read_only_uri(path), uri=True, isolation_level=None)
    try:
        for state, cutoff in before.items():
            row = db.execute(
                "SELECT 1 FROM jobs INDEXED BY jobsEnded WHERE state IN ('FINISHED', 'FAILED') "
                "AND parentJobID = 0 AND state = ? AND ended < ? LIMIT 1",
                (state, cutoff),
            ).fetchone()
            if row is not None:
                return True
        row = db.execute("SELECT 1 FROM replies WHERE expires <= ? LIMIT 1", (now,)).fetchone()
        if row is not None:
            return True
        return int(db.execute("PRAGMA freelist_count").fetchone()[0]) >= min_free_pages
    finally:
        db.close()


def _authorize(action: int, arg1: str | None, arg2: str | None, *_: object) -> int:
    if action not in _QUERY_ALLOWED:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and arg2 and arg2.lower() == "load_extension":
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK
