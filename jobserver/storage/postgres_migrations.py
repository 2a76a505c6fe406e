"""The steps that bring an older PostgreSQL queue schema up to date, from
version 5 on (postgres_schema.py runs them, in order, under the schema's
migration lock; the earlier ones, which a new schema runs too, are
there). Each is written to run again harmlessly (IF NOT EXISTS, CREATE OR
REPLACE), so that a schema brought back from an older version's number
by hand is upgraded rather than refused.
"""

from __future__ import annotations

import psycopg

from jobserver.storage.postgres_functions import FIND_READY_AFTER_FUNCTION

# Version 5's columns and index (in SCHEMA for a new schema); IF NOT
# EXISTS, so that a schema that has them already (brought back from an
# older version's number by hand) is upgraded rather than refused.
_VERSION_5 = (
    "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS worker TEXT COLLATE \"C\" NOT NULL DEFAULT ''",
    "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS node TEXT COLLATE \"C\" NOT NULL DEFAULT ''",
    "CREATE INDEX IF NOT EXISTS jobsActiveStarted ON jobs (lastRun, jobID) "
    "WHERE state IN ('RUNNING', 'RUNQUEUED')",
)


def version_5(db: psycopg.Connection) -> None:
    # Jobs handed out before the upgrade have no known taker: "". Adding a
    # column with a constant default rewrites no rows.
    _run_all(db, _VERSION_5)


# Version 6's table (in SCHEMA for a new schema), IF NOT EXISTS as above;
# and the index of names with their jobIDs: a unique create's search for
# the oldest job of a name (`ORDER BY jobID LIMIT 1`) walked the whole
# table in jobID order over an index of names alone (15 ms at 100,000 jobs,
# each element of a CreateJobs).
_VERSION_6 = (
    'CREATE TABLE IF NOT EXISTS idempotency (idempotencyKey TEXT COLLATE "C" PRIMARY KEY, '
    'request TEXT COLLATE "C" NOT NULL, reply TEXT COLLATE "C" NOT NULL, '
    'expires TEXT COLLATE "C" NOT NULL)',
    "CREATE INDEX IF NOT EXISTS idempotencyExpires ON idempotency (expires)",
    "DROP INDEX IF EXISTS jobsName",
    "CREATE INDEX jobsName ON jobs (name, jobID)",
)


def version_6(db: psycopg.Connection) -> None:
    _run_all(db, _VERSION_6)


def version_7(db: psycopg.Connection) -> None:
    # Version 7's search, jobserver_find_ready_after of 11 arguments, is
    # made and dropped again by version 8's step.
    db.execute(
        "DROP FUNCTION IF EXISTS jobserver_find_ready"
        "(TEXT, INTEGER[], INTEGER, TEXT, TEXT[], TEXT[], BIGINT[])"
    )


# Version 8's columns and tables (protocol.md 14.23), IF NOT EXISTS as
# version 5's.
_VERSION_8 = (
    "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS key TEXT COLLATE \"C\" NOT NULL DEFAULT ''",
    "ALTER TABLE limits ADD COLUMN IF NOT EXISTS rate INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE limits ADD COLUMN IF NOT EXISTS ratePer BIGINT NOT NULL DEFAULT 0",
    "ALTER TABLE limits ADD COLUMN IF NOT EXISTS perKey INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE limits ADD COLUMN IF NOT EXISTS fair INTEGER NOT NULL DEFAULT 0",
    'CREATE TABLE IF NOT EXISTS handouts (pattern TEXT COLLATE "C" NOT NULL, '
    'key TEXT COLLATE "C" NOT NULL, at TEXT COLLATE "C" NOT NULL)',
    "CREATE INDEX IF NOT EXISTS handoutsKeyAt ON handouts (pattern, key, at)",
    "CREATE INDEX IF NOT EXISTS handoutsAt ON handouts (at)",
    'CREATE TABLE IF NOT EXISTS fairServed (pattern TEXT COLLATE "C" NOT NULL, '
    'key TEXT COLLATE "C" NOT NULL, PRIMARY KEY (pattern, key))',
)
# The search's arguments, by type: version 7's, and version 8's.
_FIND_READY_7 = (
    "TEXT, INTEGER[], INTEGER, TEXT, TEXT[], TEXT[], TEXT[], INTEGER, TEXT, TEXT, BIGINT"
)
FIND_READY_8 = (
    "TEXT, INTEGER[], INTEGER, TEXT, TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], "
    "INTEGER, TEXT, TEXT, BIGINT"
)


def version_8(db: psycopg.Connection) -> None:
    _run_all(db, _VERSION_8)
    db.execute(FIND_READY_AFTER_FUNCTION.encode())
    # It runs with its caller's rights (a role without the nodes' grants
    # reads nothing through it); only the nodes need to call it at all.
    db.execute(
        f"REVOKE EXECUTE ON FUNCTION jobserver_find_ready_after({FIND_READY_8}) FROM PUBLIC"
        .encode()
    )
    db.execute(f"DROP FUNCTION IF EXISTS jobserver_find_ready_after({_FIND_READY_7})".encode())


def version_9(db: psycopg.Connection) -> None:
    db.execute("ALTER TABLE jobs ADD COLUMN IF NOT EXISTS lease INTEGER NOT NULL DEFAULT 0")
    db.execute(
        "CREATE INDEX IF NOT EXISTS jobsRetrying ON jobs (nextRun, jobID) "
        "WHERE state = 'QUEUED' AND attempts > 0"
    )


# Issue 37's version, shared by its parts: each adds its statements here,
# IF NOT EXISTS as version 5's.
_VERSION_10 = (
    # Dependencies (protocol.md 14.25).
    "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS dependencies INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS blockers INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS dependents INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS onDependencyFailure TEXT COLLATE \"C\" "
    "NOT NULL DEFAULT ''",
    "CREATE TABLE IF NOT EXISTS jobDependencies (jobID BIGINT NOT NULL, "
    "dependsOn BIGINT NOT NULL, PRIMARY KEY (jobID, dependsOn))",
    "CREATE INDEX IF NOT EXISTS jobDependenciesOn ON jobDependencies (dependsOn)",
    "CREATE TABLE IF NOT EXISTS dependencyOutcomes (jobID BIGINT PRIMARY KEY, "
    'state TEXT COLLATE "C" NOT NULL, data TEXT COLLATE "C" NOT NULL)',
    # Cancelling a running job (protocol.md 14.26).
    "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS cancelRequested INTEGER NOT NULL DEFAULT 0",
    "CREATE INDEX IF NOT EXISTS jobsCancelling ON jobs (nextRun) "
    "WHERE state = 'RUNQUEUED' AND cancelRequested = 1",
    # AwaitJob (protocol.md 14.27).
    "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS awaited INTEGER NOT NULL DEFAULT 0",
    'CREATE TABLE IF NOT EXISTS outcomes (jobID BIGINT PRIMARY KEY, '
    'name TEXT COLLATE "C" NOT NULL, state TEXT COLLATE "C" NOT NULL, '
    'data TEXT COLLATE "C" NOT NULL, lastError TEXT COLLATE "C" NOT NULL, '
    'ended TEXT COLLATE "C" NOT NULL, expires TEXT COLLATE "C" NOT NULL)',
    "CREATE INDEX IF NOT EXISTS outcomesExpires ON outcomes (expires)",
    # Standalone CANCELLED jobs are pruned as FAILED ones are.
    "UPDATE jobs SET ended = COALESCE(lastRun, created) WHERE state = 'CANCELLED' AND ended = ''",
    "DROP INDEX IF EXISTS jobsEnded",
    "CREATE INDEX jobsEnded ON jobs (state, ended) "
    "WHERE state IN ('FINISHED', 'FAILED', 'CANCELLED') AND parentJobID = 0",
)


def version_10(db: psycopg.Connection) -> None:
    _run_all(db, _VERSION_10)


def _run_all(db: psycopg.Connection, statements: tuple[str, ...]) -> None:
    """A step's statements, in order, in the migration's transaction."""
    for statement in statements:
        db.execute(statement.encode())
