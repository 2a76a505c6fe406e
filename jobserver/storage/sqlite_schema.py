"""Opening a SQLite jobs database: its settings, a check that it is whole,
its schema, and the steps that bring older files up to date (the schema
version is `PRAGMA user_version`)."""

from __future__ import annotations

import sqlite3

SCHEMA_VERSION = 11


class StoreError(Exception):
    """The database file cannot be used (wrong file, newer schema, ...)."""


def prepare(db: sqlite3.Connection, path: str, synchronous: str, busy_ms: int) -> None:
    """Configure a new connection, check the file and bring it up to date."""
    _configure(db, path, synchronous, busy_ms)
    _check(db, path)
    _migrate(db, path)

SCHEMA = """
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
    lastReport    TEXT NOT NULL DEFAULT '',
    -- Who took the job at its last hand-out (RunningJobs): the peer address
    -- of the connection, and the node it was taken on.
    worker        TEXT NOT NULL DEFAULT '',
    node          TEXT NOT NULL DEFAULT '',
    -- Whose job it is (a tenant, a customer): per-key limits count each
    -- key apart, and fair ones rotate between keys (protocol.md 14.23).
    key           TEXT NOT NULL DEFAULT '',
    -- Seconds of the lease the taker asked for at the hand-out (the lease
    -- of GetJob), for TouchJob to renew, or 0 (protocol.md 14.24).
    lease         INTEGER NOT NULL DEFAULT 0,
    -- Dependencies (protocol.md 14.25): how many jobs this one depends on,
    -- how many of them have not ended yet, how many jobs depend on it (a
    -- job with none is told nothing when it ends), and what it does when
    -- one of them does not finish ('' is 'fail').
    dependencies  INTEGER NOT NULL DEFAULT 0,
    blockers      INTEGER NOT NULL DEFAULT 0,
    dependents    INTEGER NOT NULL DEFAULT 0,
    onDependencyFailure TEXT NOT NULL DEFAULT '',
    -- 1 once CancelJob with running: true asked a handed-out job to stop:
    -- its worker's next report is answered 410 and the job ends CANCELLED
    -- (protocol.md 14.26).
    cancelRequested INTEGER NOT NULL DEFAULT 0,
    -- 1 once an AwaitJob waits for the job (protocol.md 14.27): its end is
    -- announced to the other nodes and its outcome kept.
    awaited       INTEGER NOT NULL DEFAULT 0
);
-- GetJob with a pattern: per priority, the due jobs in hand-out order
-- (nextRun, name, then jobID, which every index ends with), so the first
-- job is read straight from the index with no sort of jobs due together.
-- Also the earliest future job, for the timer that wakes waiting GetJobs,
-- and the dashboard's Scheduled: a range per priority (sqlite_ready.py).
CREATE INDEX jobsReadyPriority ON jobs (priority, nextRun, name)
    WHERE state IN ('QUEUED', 'RUNQUEUED');
-- GetJob with exact names, and GLOB patterns with a literal prefix.
CREATE INDEX jobsReadyName ON jobs (name, priority, nextRun)
    WHERE state IN ('QUEUED', 'RUNQUEUED');
-- The dashboard's Retries: queued jobs with a failed attempt, by when
-- their backoff ends (only retried jobs are in it: nothing for a create).
CREATE INDEX jobsRetrying ON jobs (nextRun) WHERE state = 'QUEUED' AND attempts > 0;
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
    WHERE state IN ('FINISHED', 'FAILED', 'CANCELLED') AND parentJobID = 0;
CREATE TABLE limits (
    pattern  TEXT PRIMARY KEY,
    capacity INTEGER NOT NULL,
    -- A rate (protocol.md 14.23): `rate` hand-outs in any `ratePer` ms.
    rate     INTEGER NOT NULL DEFAULT 0,
    ratePer  INTEGER NOT NULL DEFAULT 0,
    perKey   INTEGER NOT NULL DEFAULT 0,
    fair     INTEGER NOT NULL DEFAULT 0
);
-- Hand-outs under a rate-limited pattern, for each key it counts apart
-- ('' when it counts them together): those of the last window.
CREATE TABLE handouts (
    pattern TEXT NOT NULL,
    key     TEXT NOT NULL,
    at      TEXT NOT NULL
);
CREATE INDEX handoutsKeyAt ON handouts (pattern, key, at);
CREATE INDEX handoutsAt ON handouts (at);
-- The keys a fair pattern has served in its current round.
CREATE TABLE fairServed (
    pattern TEXT NOT NULL,
    key     TEXT NOT NULL,
    PRIMARY KEY (pattern, key)
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
-- RunningJobs: the jobs handed out, the longest running first.
CREATE INDEX jobsActiveStarted ON jobs (lastRun)
    WHERE state IN ('RUNNING', 'RUNQUEUED');
-- Idempotency keys (protocol.md 14.22): the fingerprint of the CreateJob
-- or CreateJobs that first came with a key, and its reply, until expires.
CREATE TABLE idempotency (
    idempotencyKey TEXT PRIMARY KEY,
    request        TEXT NOT NULL,
    reply          TEXT NOT NULL,
    expires        TEXT NOT NULL
);
CREATE INDEX idempotencyExpires ON idempotency (expires);
-- The edges of the graph of dependencies: jobID waits for dependsOn.
CREATE TABLE jobDependencies (
    jobID     INTEGER NOT NULL,
    dependsOn INTEGER NOT NULL,
    PRIMARY KEY (jobID, dependsOn)
);
CREATE INDEX jobDependenciesOn ON jobDependencies (dependsOn);
-- How a job that others depend on ended (its final state, and a FINISHED
-- job's data, its result), kept for them after it is gone.
CREATE TABLE dependencyOutcomes (
    jobID INTEGER PRIMARY KEY,
    state TEXT NOT NULL,
    data  TEXT NOT NULL
);
-- Leased jobs whose cancel is pending, by their lease's end: the clock
-- ends them then if no GetJob does (protocol.md 14.26).
CREATE INDEX jobsCancelling ON jobs (nextRun) WHERE state = 'RUNQUEUED' AND cancelRequested = 1;
-- Outcomes of ended jobs, for AwaitJob (protocol.md 14.27), until expires
-- (--keep-outcomes after the end).
CREATE TABLE outcomes (
    jobID     INTEGER PRIMARY KEY,
    name      TEXT NOT NULL,
    state     TEXT NOT NULL,
    data      TEXT NOT NULL,
    lastError TEXT NOT NULL,
    ended     TEXT NOT NULL,
    expires   TEXT NOT NULL
);
CREATE INDEX outcomesExpires ON outcomes (expires);
"""

# Statements that bring a file of version N up to N + 1. They run in one
# transaction together with the new user_version, so a file is either
# wholly migrated or untouched. The result must equal _SCHEMA (a test
# compares the two).
MIGRATIONS: dict[int, tuple[str, ...]] = {
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
    5: (
        # Jobs handed out before the upgrade have no known taker: "".
        "ALTER TABLE jobs ADD COLUMN worker TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE jobs ADD COLUMN node TEXT NOT NULL DEFAULT ''",
        "CREATE INDEX jobsActiveStarted ON jobs (lastRun)\n"
        "    WHERE state IN ('RUNNING', 'RUNQUEUED')",
    ),
    6: (
        "CREATE TABLE idempotency (\n    idempotencyKey TEXT PRIMARY KEY,\n"
        "    request        TEXT NOT NULL,\n    reply          TEXT NOT NULL,\n"
        "    expires        TEXT NOT NULL\n)",
        "CREATE INDEX idempotencyExpires ON idempotency (expires)",
    ),
    7: (
        "ALTER TABLE jobs ADD COLUMN key TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE limits ADD COLUMN rate INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE limits ADD COLUMN ratePer INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE limits ADD COLUMN perKey INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE limits ADD COLUMN fair INTEGER NOT NULL DEFAULT 0",
        "CREATE TABLE handouts (\n    pattern TEXT NOT NULL,\n    key     TEXT NOT NULL,\n"
        "    at      TEXT NOT NULL\n)",
        "CREATE INDEX handoutsKeyAt ON handouts (pattern, key, at)",
        "CREATE INDEX handoutsAt ON handouts (at)",
        "CREATE TABLE fairServed (\n    pattern TEXT NOT NULL,\n    key     TEXT NOT NULL,\n"
        "    PRIMARY KEY (pattern, key)\n)",
    ),
    8: (
        "ALTER TABLE jobs ADD COLUMN lease INTEGER NOT NULL DEFAULT 0",
        # IF NOT EXISTS: a file made from an older text of the schema may
        # hold it already.
        "CREATE INDEX IF NOT EXISTS jobsRetrying ON jobs (nextRun) "
        "WHERE state = 'QUEUED' AND attempts > 0",
    ),
    # Issue 37's version, shared by its parts: each adds its statements here.
    9: (
        # Dependencies (protocol.md 14.25).
        "ALTER TABLE jobs ADD COLUMN dependencies  INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN blockers      INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN dependents    INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE jobs ADD COLUMN onDependencyFailure TEXT NOT NULL DEFAULT ''",
        "CREATE TABLE jobDependencies (\n    jobID     INTEGER NOT NULL,\n"
        "    dependsOn INTEGER NOT NULL,\n    PRIMARY KEY (jobID, dependsOn)\n)",
        "CREATE INDEX jobDependenciesOn ON jobDependencies (dependsOn)",
        "CREATE TABLE dependencyOutcomes (\n    jobID INTEGER PRIMARY KEY,\n"
        "    state TEXT NOT NULL,\n    data  TEXT NOT NULL\n)",
        # Cancelling a running job (protocol.md 14.26).
        "ALTER TABLE jobs ADD COLUMN cancelRequested INTEGER NOT NULL DEFAULT 0",
        "CREATE INDEX jobsCancelling ON jobs (nextRun) "
        "WHERE state = 'RUNQUEUED' AND cancelRequested = 1",
        # AwaitJob (protocol.md 14.27).
        "ALTER TABLE jobs ADD COLUMN awaited INTEGER NOT NULL DEFAULT 0",
        "CREATE TABLE outcomes (\n    jobID     INTEGER PRIMARY KEY,\n"
        "    name      TEXT NOT NULL,\n    state     TEXT NOT NULL,\n"
        "    data      TEXT NOT NULL,\n    lastError TEXT NOT NULL,\n"
        "    ended     TEXT NOT NULL,\n    expires   TEXT NOT NULL\n)",
        "CREATE INDEX outcomesExpires ON outcomes (expires)",
        # Standalone CANCELLED jobs (a BLOCKED job cancelled, by CancelJob or
        # for a dependency; a cancelled run) are pruned as FAILED ones are.
        "UPDATE jobs SET ended = COALESCE(lastRun, created) "
        "WHERE state = 'CANCELLED' AND ended = ''",
        "DROP INDEX jobsEnded",
        "CREATE INDEX jobsEnded ON jobs (state, ended)\n"
        "    WHERE state IN ('FINISHED', 'FAILED', 'CANCELLED') AND parentJobID = 0",
    ),
    10: (
        # jobsReadyPriority does its work (sqlite_ready.py), and it cost
        # every create and hand-out a page of the log. IF EXISTS: an older
        # version rebuilt from today's SCHEMA text (as tests do) has none.
        "DROP INDEX IF EXISTS jobsReadyNextRun",
    ),
}


def _configure(db: sqlite3.Connection, path: str, synchronous: str, busy_ms: int) -> None:
    # Another process holding the write lock is waited for, not failed;
    # every request waits with it, so not for long.
    db.execute(f"PRAGMA busy_timeout = {busy_ms}")
    # Pages freed by deleted jobs go back to the file system when the
    # pruner asks (incremental_vacuum). It only takes effect on a new
    # file, before its first table; older files keep their setting, and
    # are not written to here (one may be read-only).
    if db.execute("PRAGMA page_count").fetchone()[0] == 0:
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")
    mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if mode.lower() != "wal" and path != ":memory:":
        raise StoreError(f"cannot switch {path!r} to WAL mode (got {mode})")
    # PRAGMA takes no parameters; the value was checked against a whitelist.
    db.execute(f"PRAGMA synchronous = {synchronous}")

def _check(db: sqlite3.Connection, path: str) -> None:
    """Refuse a damaged file at start rather than fail writes later.
    quick_check reads every page once: seconds for millions of jobs."""
    try:
        problems = [row[0] for row in db.execute("PRAGMA quick_check")]
    except sqlite3.OperationalError as error:
        if "readonly" not in str(error):
            raise
        # A read-only file with a journal left by a crash cannot be
        # checked; it is served for reading all the same.
        return
    if problems != ["ok"]:
        raise StoreError(f"{path!r} is damaged: {'; '.join(problems[:3])}")

def _migrate(db: sqlite3.Connection, path: str) -> None:
    if db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        # Read again under the write lock: another process may have
        # migrated the file in the meantime.
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{path!r} has schema version {version}; this server knows "
                f"up to {SCHEMA_VERSION}"
            )
        if version == 0:
            _create_schema(db, path)
        else:
            for step in range(version, SCHEMA_VERSION):
                for statement in MIGRATIONS[step]:
                    db.execute(statement)
        # PRAGMA takes no parameters; the value is our own constant.
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise

def _create_schema(db: sqlite3.Connection, path: str) -> None:
    tables = db.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'jobs'"
    ).fetchall()
    if tables:
        raise StoreError(f"{path!r} has a jobs table this server did not create")
    # The schema's comments hold no semicolons, so each piece is one statement.
    for statement in SCHEMA.split(";"):
        if statement.strip():
            db.execute(statement)
