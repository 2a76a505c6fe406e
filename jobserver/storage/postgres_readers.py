"""Read-only PostgreSQL connections of their own, outside the writer: how
Query logs in and what its rows look like, the pruner's look for work, the
queues' figures, Status' limits, the dashboard's search and pages,
RunningJobs, and the history's depth sample. Each opens a connection for
its read (named READ_APPLICATION in pg_stat_activity) in a thread, so the
writer's transaction and the event loop never wait for one; the store
(postgres.py) answers the interface's readers with these, as sqlite.py
does with sqlite_readers.py.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from decimal import Decimal
from functools import partial
from typing import Any

import psycopg

from jobserver.model.globmatch import glob_to_regex
from jobserver.model.jobs import Job
from jobserver.model.limits import handouts_cutoff
from jobserver.storage import postgres_query, sql
from jobserver.storage.postgres_connection import QUERY_APPLICATION, READ_APPLICATION, connect
from jobserver.storage.postgres_statistics import StatisticsKeeper
from jobserver.storage.reader_types import (
    LaterJobs,
    QueryRows,
    QueueStats,
    RunningJob,
    RunningStats,
)
from jobserver.storage.sql import COLUMNS, POSTGRES

log = logging.getLogger("jobserver")

# Query's result columns, spelled as on SQLite: PostgreSQL folds unquoted
# identifiers to lower case.
_SPELLING = {
    column.lower(): column
    for column in (
        *COLUMNS, "pattern", "capacity", "rate", "ratePer", "perKey", "received", "expires",
        "blockers", "dependsOn",
    )
}


def query_login(
    db: psycopg.Connection[Any], url: str, query_url: str | None, schema: str
) -> postgres_query.QueryLogin:
    """How Query logs in: as the role --query-db-url names (checked, or
    the node does not start), else as the queue's own role, set up now
    if this node's user may; or not at all (501), said in the log."""
    row = db.execute("SELECT session_user, current_database()").fetchone()
    assert row is not None
    node_user, database = str(row[0]), str(row[1])
    if query_url is not None:
        given = partial(connect, query_url, application_name=QUERY_APPLICATION)
        user = postgres_query.check_operator_role(given, node_user, database, schema)
        log.info("Query logs in to PostgreSQL as %s (--query-db-url)", user)
        return postgres_query.QueryLogin(user, given)
    role = postgres_query.role_name(database, schema)
    password = postgres_query.own_role_password(db, role, schema)
    if password is None:
        log.warning("Query is off (501): %s", postgres_query.NOT_SET_UP)
        return postgres_query.QueryLogin(role, None)
    own = partial(
        connect, url, user=role, password=password, application_name=QUERY_APPLICATION
    )
    try:
        _, wrong = postgres_query.problems(own, node_user, database, schema)
    except psycopg.Error as error:
        wrong = [f"cannot log in: {str(error).strip()}"]
    if wrong:
        log.warning("Query is off (501): its role %s %s", role, "; ".join(wrong))
        return postgres_query.QueryLogin(
            role, None, postgres_query.UNUSABLE.format(role=role)
        )
    log.info("Query logs in to PostgreSQL as %s", role)
    return postgres_query.QueryLogin(role, own)


def run_query(
    login: postgres_query.QueryLogin, schema: str, text: str, seconds: float, rows: QueryRows
) -> None:
    """The client's SQL as Query's own role (postgres_query.py)."""
    postgres_query.run(login, schema, text, seconds, _AsOnSQLite(rows))


def prune_pending(url: str, before: Mapping[str, str], now: str) -> bool:
    with connect(url, application_name=READ_APPLICATION) as db:
        for state, cutoff in before.items():
            if db.execute(sql.prunable(POSTGRES), (state, cutoff)).fetchone() is not None:
                return True
        if db.execute(sql.expired_handout(POSTGRES), (handouts_cutoff(now),)).fetchone():
            return True
        return any(
            db.execute(expired, (now,)).fetchone() is not None
            for expired in (
                sql.expired_reply(POSTGRES), sql.expired_idempotency_key(POSTGRES),
                sql.expired_outcome(POSTGRES),
            )
        )


def queue_stats(url: str, now: str) -> QueueStats:
    """Counts by queue and state, the oldest due job of each queue, and the
    due jobs a pause holds: by the patterns paused as committed, which a
    node's writers each read again only as their transactions begin."""
    with connect(url, application_name=READ_APPLICATION) as db:
        paused = [str(row[0]) for row in db.execute("SELECT pattern FROM paused").fetchall()]
        counts = {
            (str(queue), str(state)): int(count)
            for queue, state, count in db.execute(
                "SELECT split_part(name, '/', 1) AS queue, state, COUNT(*) FROM jobs "
                "GROUP BY queue, state"
            ).fetchall()
        }
        oldest: dict[str, str] = {}
        held: dict[str, int] = {}
        # Each name due is matched once: jobs share names.
        for queue, due, count in db.execute(
            "SELECT split_part(name, '/', 1) AS queue, MIN(first) FILTER (WHERE NOT held), "
            "COALESCE(SUM(jobs) FILTER (WHERE held), 0) FROM ("
            "SELECT name, MIN(nextRun) AS first, COUNT(*) AS jobs, "
            "name ~ ANY(%s::text[]) AS held FROM jobs "
            f"WHERE state IN ({sql.READY_SQL}) AND nextRun <= %s GROUP BY name"
            ") AS due GROUP BY queue",
            ([glob_to_regex(pattern) for pattern in sorted(paused)], now),
        ).fetchall():
            if due is not None:
                oldest[str(queue)] = str(due)
            if count:
                held[str(queue)] = int(count)
    return counts, oldest, held


def ready_by_queue(url: str) -> dict[str, int]:
    with connect(url, application_name=READ_APPLICATION) as db:
        return {
            str(queue): int(count)
            for queue, count in db.execute(
                "SELECT split_part(name, '/', 1) AS queue, COUNT(*) FROM jobs "
                f"WHERE state IN ({sql.READY_SQL}) GROUP BY queue"
            ).fetchall()
        }


def running_by_name(url: str, now: str) -> list[tuple[str, str, int]]:
    with connect(url, application_name=READ_APPLICATION) as db:
        rows = db.execute(sql.running_by_name(POSTGRES), (now,)).fetchall()
    return [(str(name), str(key), int(cost)) for name, key, cost in rows]


def handouts_in_windows(url: str, windows: Mapping[str, str]) -> dict[str, int]:
    # One snapshot for every window: they are of the same moment.
    with connect(url, application_name=READ_APPLICATION) as db, db.transaction():
        db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        return sql.read_windows(
            POSTGRES, windows,
            lambda statement, args: db.execute(statement, args).fetchall(),
        )


def find_matching(url: str, pattern: str, limit: int) -> list[Job]:
    with connect(url, application_name=READ_APPLICATION) as db:
        rows = db.execute(*sql.find_matching(POSTGRES, pattern, limit)).fetchall()
    return [Job(*row) for row in rows]


def later_jobs(url: str, now: str, retrying: bool, limit: int, most: int) -> LaterJobs:
    listed, counted = sql.later_jobs(POSTGRES, now, retrying, limit, most)
    # One snapshot for both: the count is of the same moment.
    with connect(url, application_name=READ_APPLICATION) as db, db.transaction():
        db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        jobs = [Job(*row) for row in db.execute(*listed).fetchall()]
        counted_to = int((db.execute(*counted).fetchone() or (0,))[0])
    return LaterJobs(jobs, min(counted_to, most), counted_to <= most)


def running_jobs(
    url: str, now: str, pattern: str | None, limit: int, newest: bool = False
) -> RunningStats:
    listed, counted = sql.running_jobs(POSTGRES, now, pattern, limit, newest)
    # One snapshot for both: the count is of the same moment.
    with connect(url, application_name=READ_APPLICATION) as db, db.transaction():
        db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        jobs = [RunningJob(*row) for row in db.execute(*listed).fetchall()]
        row = db.execute(*counted).fetchone()
    return jobs, int(row[0]) if row else 0


class _AsOnSQLite:
    """Query's rows as SQLite gives them: the job tables' columns spelled
    as there, and numbers as numbers (_plain)."""

    def __init__(self, rows: QueryRows) -> None:
        self._rows = rows
        self.max_rows = rows.max_rows
        self.max_bytes = rows.max_bytes

    def start(self, headers: list[str]) -> None:
        self._rows.start([_SPELLING.get(name, name) for name in headers])

    def add(self, row: tuple[object, ...]) -> None:
        self._rows.add(tuple(_plain(value) for value in row))


def _plain(value: object) -> object:
    """A value as SQLite would give it: numbers as int or float (SUM of a
    BIGINT is NUMERIC in PostgreSQL), anything without a JSON form as text."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if value is None or isinstance(value, int | float | str | bytes):
        return value
    return str(value)


class ReaderCalls:
    """PostgresStore's reads on connections of their own, for other threads
    than the writer's: each opens its connection, or uses Query's login or
    the statistics keeper's."""

    _url: str
    _query: postgres_query.QueryLogin
    _statistics: StatisticsKeeper
    schema: str

    def keep_statistics(self) -> bool:
        return self._statistics.keep()

    def prune_pending(self, before: Mapping[str, str], now: str) -> bool:
        return prune_pending(self._url, before, now)

    def run_query(self, text: str, seconds: float, rows: QueryRows) -> None:
        run_query(self._query, self.schema, text, seconds, rows)

    def queue_stats(self, now: str) -> QueueStats:
        return queue_stats(self._url, now)

    def ready_by_queue(self) -> dict[str, int]:
        return ready_by_queue(self._url)

    def running_by_name(self, now: str) -> list[tuple[str, str, int]]:
        return running_by_name(self._url, now)

    def handouts_in_windows(self, windows: Mapping[str, str]) -> dict[str, int]:
        return handouts_in_windows(self._url, windows)

    def find_matching(self, pattern: str, limit: int) -> list[Job]:
        return find_matching(self._url, pattern, limit)

    def later_jobs(self, now: str, retrying: bool, limit: int, most: int) -> LaterJobs:
        return later_jobs(self._url, now, retrying, limit, most)

    def running_jobs(
        self, now: str, pattern: str | None, limit: int, newest: bool = False
    ) -> RunningStats:
        return running_jobs(self._url, now, pattern, limit, newest)
