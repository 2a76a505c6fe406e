"""How a PostgreSQL node's statements reach its connection (the hooks of
sql_statements.Statements): one at a time, many of one statement, two in a
row, and held writes, the last three each in one round trip (a pipeline).
Every one counts what it changed; a failed statement counts as a change,
because in PostgreSQL it spoils the transaction until the savepoint around
it is undone. Also the two statements PostgreSQL has of its own: jobIDs
taken in advance, and the nodes' named locks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from jobserver.storage import held_writes, postgres_schema
from jobserver.storage.held_writes import Batch
from jobserver.storage.sql_statements import Statement, Statements, rows_of


class PostgresStatements(Statements):
    """PostgresStore's connection, as its statements use it."""

    _db: psycopg.Connection[Any]
    # Rows changed (and statements failed) on it, read by total_changes.
    _changes: int

    def _run(self, statement: str, args: Sequence[Any] = ()) -> psycopg.Cursor[Any]:
        if statement.startswith(held_writes.COPY):
            return self._copy(statement, args[0])
        try:
            cursor = self._db.execute(statement, args)
        except psycopg.Error:
            self._changes += 1
            raise
        self._count(statement, cursor)
        return cursor

    def _copy(self, statement: str, rows: list[tuple[Any, ...]]) -> psycopg.Cursor[Any]:
        """New jobs' rows by COPY (held_writes._insert_rows)."""
        cursor = self._db.cursor()
        try:
            with cursor.copy(statement) as copy:
                for row in rows:
                    copy.write_row(row)
        except BaseException:
            # Whatever ends a COPY early spoils the transaction (psycopg
            # sends CopyFail), a text the connection's encoding cannot hold
            # too, which fails in Python: counted as a failed statement is,
            # so that the writer does not go on to commit the rest.
            self._changes += 1
            raise
        self._changes += len(rows)
        return cursor

    def _count(self, statement: str, cursor: psycopg.Cursor[Any]) -> None:
        if cursor.rowcount > 0 and not statement.startswith("SELECT"):
            self._changes += cursor.rowcount

    def _run_many(self, statement: str, args: list[list[Any]]) -> None:
        # psycopg sends them in one pipeline: one round trip for all.
        try:
            with self._db.cursor() as cursor:
                cursor.executemany(statement, args)
        except psycopg.Error:
            self._changes += 1
            raise
        self._changes += max(cursor.rowcount, len(args))

    def _run_pair(self, first: Statement, second: Statement) -> tuple[list[Any], list[Any]]:
        # In one pipeline: PostgreSQL begins the second (and takes its
        # snapshot) once the first has ended, one round trip for both.
        try:
            with self._db.pipeline():
                cursors = [self._db.execute(*first), self._db.execute(*second)]
            rows = rows_of(cursors[0]), rows_of(cursors[1])
        except psycopg.Error:
            self._changes += 1
            raise
        self._count(first[0], cursors[0])
        self._count(second[0], cursors[1])
        return rows

    def _run_batches(self, sent: list[Batch]) -> None:
        """Held writes of several statements in one round trip (a
        pipeline): a FinishJobs' deletes and its outcomes' insert were
        two. A statement that fails fails the pipeline, and PostgreSQL
        skips the rest, as if they had been sent one at a time."""
        if len(sent) < 2 or any(s.startswith(held_writes.COPY) for s, _ in sent):
            # A pipeline cannot carry a COPY: one at a time.
            super()._run_batches(sent)
            return
        ran: list[tuple[psycopg.Cursor[Any], int]] = []
        try:
            with self._db.pipeline():
                for statement, args in sent:
                    cursor = self._db.cursor()
                    if len(args) == 1:
                        cursor.execute(statement, args[0])
                    else:
                        cursor.executemany(statement, args)
                    ran.append((cursor, len(args)))
        except psycopg.Error:
            self._changes += 1
            raise
        # Counted as _run and _run_many count them.
        for cursor, times in ran:
            self._changes += max(cursor.rowcount, times) if times > 1 else max(cursor.rowcount, 0)

    def _next_ids(self, count: int) -> list[int]:
        # From the column's own sequence: an ID is never handed out twice,
        # whether the insert that takes it commits or not. One row, the
        # array's text: a row of a thousand made by psycopg one by one was
        # a twentieth of a bulk insert's Python.
        (text,) = self._one(
            "SELECT array_agg(n ORDER BY n)::text FROM (SELECT "
            "nextval(pg_get_serial_sequence('jobs', 'jobid')) AS n "
            "FROM generate_series(1, %s)) AS ids",
            (count,),
        )
        return [int(n) for n in text[1:-1].split(",")] if text else []

    def _lock(self, purpose: str, key: str) -> None:
        """A transaction lock on `key` for `purpose`, shared by every node
        on this schema; released at commit or rollback. A row lock on a
        table of the nodes' own (postgres_schema.LOCK_SLOTS says why)."""
        self._execute(
            "SELECT slot FROM jobserver_locks WHERE slot = %s FOR UPDATE",
            (postgres_schema.lock_slot(purpose, key),),
        )
