"""The job store: the only module that speaks SQL.

One SQLite file, one `jobs` table, WAL mode. The store never decides what a
command means; it offers named operations on rows and the transaction
primitives the writer uses to commit many requests at once. Every value
reaches SQLite as a bound parameter.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from time import monotonic
from urllib.parse import quote

SCHEMA_VERSION = 2

SYNCHRONOUS_MODES = ("FULL", "NORMAL")

READY_STATES = ("QUEUED", "RUNQUEUED")

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
    leaseID       TEXT NOT NULL DEFAULT ''
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
}

_COLUMNS = (
    "created, jobID, state, name, nextRun, lastRun, repeat, data, priority, "
    "parentJobID, retryAfter, maxAttempts, retryBackoff, retryDelay, retryMaxDelay, "
    "attempts, lastError, leaseID"
)

# The columns commands may change; `update` refuses any other name, so a
# column name never comes from a request.
_UPDATABLE = frozenset(
    (
        "state", "name", "nextRun", "lastRun", "repeat", "data", "priority", "retryAfter",
        "attempts", "lastError", "leaseID",
    )
)


_GLOB_SPECIALS = frozenset("*?[")


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


@dataclass(frozen=True)
class RetryPolicy:
    """What CreateJob's maxAttempts, retryBackoff, retryDelay and
    retryMaxDelay ask for."""

    max_attempts: int
    backoff: str
    delay: float
    max_delay: float


class Store:
    def __init__(self, path: str, synchronous: str = "FULL") -> None:
        if synchronous not in SYNCHRONOUS_MODES:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS_MODES}")
        self.path = path
        try:
            self._db = sqlite3.connect(
                path, isolation_level=None, check_same_thread=False
            )
            self._configure(synchronous)
            self._migrate()
            # Every priority a job has had since the file was opened: a
            # superset of those with waiting jobs, so GetJob skips the rest.
            self._priorities = {
                row[0] for row in self._db.execute("SELECT DISTINCT priority FROM jobs")
            }
        except sqlite3.DatabaseError as error:
            raise StoreError(f"cannot use {path!r} as a job database: {error}") from error

    def _configure(self, synchronous: str) -> None:
        db = self._db
        # Another process holding the write lock is waited for, not failed.
        db.execute("PRAGMA busy_timeout = 5000")
        mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode.lower() != "wal" and self.path != ":memory:":
            raise StoreError(f"cannot switch {self.path!r} to WAL mode (got {mode})")
        # PRAGMA takes no parameters; the value was checked against a whitelist.
        db.execute(f"PRAGMA synchronous = {synchronous}")

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
        self._db.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self._db.execute("COMMIT")

    def rollback(self) -> None:
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    def savepoint(self) -> None:
        self._db.execute("SAVEPOINT request")

    def release(self) -> None:
        self._db.execute("RELEASE request")

    def rollback_savepoint(self) -> None:
        self._db.execute("ROLLBACK TO request")
        self._db.execute("RELEASE request")

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
    ) -> int:
        if policy is None:
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
    ) -> list[Job]:
        """Due QUEUED/RUNQUEUED jobs, highest priority first, then oldest nextRun.

        Either `pattern` (a GLOB) or `names` (exact names) selects the jobs.
        One index range per priority, so that no query scans jobs that are
        not due yet; priorities no job has ever used are not asked about.
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
        """The earliest nextRun later than `after` among waiting jobs."""
        row = self._db.execute(
            "SELECT MIN(nextRun) FROM jobs WHERE state IN ('QUEUED', 'RUNQUEUED') "
            "AND nextRun > ?",
            (after,),
        ).fetchone()
        return row[0]

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
            f"SELECT {_COLUMNS} FROM jobs WHERE name = ? ORDER BY jobID LIMIT 1", (name,)
        ).fetchone()
        return Job(*row) if row else None

    def json_patch(self, target: str, patch: str) -> str:
        """RFC 7396 merge of two JSON objects, by SQLite's JSON_PATCH."""
        return self._db.execute("SELECT JSON_PATCH(?, ?)", (target, patch)).fetchone()[0]


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


def read_only_query(
    path: str, sql: str, seconds: float, max_rows: int
) -> tuple[list[str], list[tuple[object, ...]]]:
    """Run one read-only statement; return column names and rows.

    Raises sqlite3.Error for bad SQL or anything that is not a read,
    QueryTimeout when it runs past `seconds`, and OverflowError when it
    returns more than `max_rows` rows.
    """
    db = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, isolation_level=None)
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


def _authorize(action: int, arg1: str | None, arg2: str | None, *_: object) -> int:
    if action not in _QUERY_ALLOWED:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and arg2 and arg2.lower() == "load_extension":
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK
