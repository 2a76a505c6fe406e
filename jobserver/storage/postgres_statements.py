"""How a PostgreSQL node's statements reach its connection (the hooks of
sql_statements.Statements): one at a time, many of one statement, two in a
row, and held writes, the last three each in one round trip (a pipeline).
Every one counts what it changed; a failed statement counts as a change,
because in PostgreSQL it spoils the transaction until the savepoint around
it is undone. Also the two statements PostgreSQL has of its own: jobIDs
taken in advance, and the nodes' named locks.

A CreateJobs' new jobs are sent as they are made: once STREAM_AFTER of
their inserts are kept, a COPY is opened with their rows, and the rows of
the jobs made after them go to it at once; the COPY ends before any other
statement, and when the command ends. PostgreSQL stores the rows sent while
the node makes the next ones, on two cores at once where a COPY sent at the
end ran after them. A command that fails meanwhile ends the COPY with its
error, which spoils the transaction: counted as a failed statement, so
that the writer runs its batch again with a savepoint per request."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import psycopg

from jobserver.storage import held_writes, postgres_schema
from jobserver.storage.held_writes import Batch, HeldWrites, Write
from jobserver.storage.sql_statements import Statement, Statements, rows_of

log = logging.getLogger("jobserver")

# Held writes that may be kept back after their command (`_send_last`):
# a job's update or delete. Not a savepoint left open around them: undone
# after the command, it would take the writes kept before it too.
_KEPT_BACK = ("UPDATE jobs ", "DELETE FROM jobs ")

# A value kept back as text is one its column takes, whatever it is (a
# value PostgreSQL refused would fail the statement sent after it, not its
# own command): a text in a text column (lastRun takes NULL too), an
# integer (not a bool) in an integer column's range. Never a double
# precision column's: a float's literal is a numeric, which PostgreSQL
# rounds half away from zero into an INTEGER (2.5 to 3, where a float8
# parameter gives 2) and which has no -0.0. Nor a column not named here.
# tests/test_pg_transaction.py holds this to the table PostgreSQL makes.
_INTEGER = range(-(2**31), 2**31)
_BIGINT = range(-(2**63), 2**63)


def _text(value: object) -> bool:
    return isinstance(value, str)


def _text_or_null(value: object) -> bool:
    return value is None or isinstance(value, str)


def _integer(value: object) -> bool:
    return type(value) is int and value in _INTEGER


def _bigint(value: object) -> bool:
    return type(value) is int and value in _BIGINT


def _never(value: object) -> bool:
    return False


TAKES: dict[str, Callable[[object], bool]] = {
    **dict.fromkeys(
        (
            "created", "state", "name", "nextrun", "repeat", "data", "retryafter",
            "retrybackoff", "lasterror", "leaseid", "timewindows", "timezone", "ended",
            "replykey", "lastreport", "worker", "node", "key", "ondependencyfailure",
        ),
        _text,
    ),
    "lastrun": _text_or_null,
    **dict.fromkeys(
        (
            "priority", "maxattempts", "attempts", "cost", "lease", "dependencies",
            "blockers", "dependents", "cancelrequested", "awaited",
        ),
        _integer,
    ),
    **dict.fromkeys(("jobid", "parentjobid"), _bigint),
}


def _quotable(write: Write) -> bool:
    """Whether every value of `write` is one its column takes (TAKES), and
    its fence's are texts (a lease)."""
    return (
        len(write.columns) == len(write.head_args)
        and all(
            TAKES.get(column.lower(), _never)(value)
            for column, value in zip(write.columns, write.head_args, strict=True)
        )
        and all(map(_text, write.fence_args))
    )


def _stores_any_text(db: psycopg.Connection[Any]) -> bool:
    """Whether every text psycopg can send on `db` is one its database
    stores: the session's encoding (UTF8: postgres_connection) is the
    database's, or the database's is SQL_ASCII (which takes any bytes). Not
    so across encodings, where PostgreSQL refuses a character it cannot
    convert only as the statement runs: "€" to a LATIN1 database."""
    server = db.info.parameter_status("server_encoding")
    return server == "SQL_ASCII" or server == db.info.parameter_status("client_encoding")


# New jobs' inserts kept before their rows go to a COPY left open: a
# CreateJobs of a few jobs sends them at its end, in one round trip with
# its other writes.
STREAM_AFTER = 64


@dataclass(slots=True)
class _OpenCopy:
    """A COPY of new jobs' rows, open until `_end_stream` or
    `_abandon_inserts` (psycopg's `copy()`, entered: it holds the
    connection's lock meanwhile, so nothing else may be sent)."""

    columns: tuple[str, ...]
    block: AbstractContextManager[psycopg.Copy]
    copy: psycopg.Copy


def _write_row(copy: psycopg.Copy, row: tuple[Any, ...]) -> None:
    """A row to a COPY. A text the connection's encoding cannot hold (a node
    on a LATIN1 client_encoding) fails in Python: a database error, as it
    would be in a statement's parameter, so that its request is refused
    with 502 and one log line, not 500 and a traceback."""
    try:
        copy.write_row(row)
    except UnicodeEncodeError as error:
        raise psycopg.DataError(f"a value the connection's encoding cannot hold: {error}") from None


class PostgresStatements(Statements):
    """PostgresStore's connection, as its statements use it."""

    _db: psycopg.Connection[Any]
    # Rows changed (and statements failed) on it, read by total_changes.
    _changes: int
    # A CreateJobs' COPY, open while its command makes more jobs.
    _stream: _OpenCopy | None = None
    # A savepoint released outside held writes (`release`) whose RELEASE is
    # not sent yet: it goes in one query with the next SAVEPOINT, alone
    # before any other statement, and not at all before a COMMIT or a
    # ROLLBACK, which end every savepoint. A waiter's try runs in a
    # savepoint of its own: each then costs one round trip less, and the
    # last of a batch two.
    _released: str | None = None
    # The writes a command held and left at its end (`_send_last`), as
    # statements with their values in them, not sent yet: they go in one
    # query with the next statement sent as text (a SAVEPOINT, a kept
    # RELEASE, the COMMIT), alone before any other statement, and not at
    # all once a ROLLBACK undoes them. A waiter's try then hands out its
    # jobs in the round trip of its COMMIT, or of the next try's SAVEPOINT.
    _unsent: list[str]
    # The jobIDs' sequence (_id_sequence).
    _sequence: str | None = None

    def _hold_insert(
        self, held: HeldWrites, columns: tuple[str, ...], row: tuple[Any, ...], job_id: int,
        parent_id: int,
    ) -> None:
        stream = self._stream
        if stream is not None and columns == stream.columns and held.takes_inserts_now():
            held.child_of(parent_id)
            self._send_row(stream, row)
            return
        super()._hold_insert(held, columns, row, job_id, parent_id)
        if stream is None and held.count() == STREAM_AFTER:
            kept = held.inserts_only()
            if kept is not None:
                self._open_stream(kept, held.take_inserts())

    def savepoint(self, name: str = "request") -> None:
        if self._held is not None:
            super().savepoint(name)
            return
        self._run_simple(f'SAVEPOINT "{name}"')

    def release(self, name: str = "request") -> None:
        if self._held is not None:
            super().release(name)
            return
        if self._released is not None:
            # One RELEASE is kept at a time (savepoints in savepoints).
            self._send_kept()
        self._released = name

    def _send_kept(self) -> None:
        """Send what is kept back, if anything: the unsent writes, then
        the RELEASE."""
        if self._unsent or self._released is not None:
            self._run_simple("")

    def _run_simple(self, query: str) -> None:
        """A query of statements without parameters (the simple protocol),
        after what is kept back for it."""
        if self._stream is not None:
            self._end_stream()
        kept = self._unsent
        if self._released is not None:
            kept.append(f'RELEASE SAVEPOINT "{self._released}"')
        self._unsent, self._released = [], None
        try:
            # As text: psycopg encodes it as the connection's encoding
            # asks, which the values kept back were quoted for.
            self._db.execute("; ".join([*kept, query] if query else kept), prepare=False)
        except psycopg.Error:
            self._changes += 1
            raise

    def _before_statement(self) -> None:
        """What must reach PostgreSQL before any other statement: the end
        of an open COPY, the unsent writes and a RELEASE kept back."""
        if self._stream is not None:
            self._end_stream()
        self._send_kept()

    def _send_last(self, held: HeldWrites) -> None:
        """Kept back as text (`_unsent`) if they are updates and deletes of
        one job (a value PostgreSQL could refuse would then fail another
        statement than its own: no insert), with no COPY open; else sent
        now, as any held writes are. One job's: a statement sent as text is
        planned again each time, where psycopg prepares one it sends five
        times. For one job's UPDATE that is 35 µs more of PostgreSQL's CPU
        (90 against 55 here), for a round trip spared that costs a wake
        hundreds of microseconds; for a GetJobs' hand-out of a hundred, 2 to 3
        µs a job of a drain's 37 (bench/pg_peers.py), whose many
        connections a round trip spared does not speed."""
        pending = held.pending()
        quotable = (
            self._stream is None
            and len({write.job_id for write in pending}) == 1
            and all(map(_quotable, pending))
            and _stores_any_text(self._db)
        )
        sent = self._pending(held)
        text = self._as_text(sent) if quotable else None
        if text is None:
            self._run_batches(sent)
            return
        self._unsent += text
        self._changes += len(text)

    def _as_text(self, sent: list[Batch]) -> list[str] | None:
        """The statements with their values in them (psycopg's literals, as
        it quotes them for a client-side cursor); None if there are none,
        if any is not kept back, or if a value cannot be written as text
        here (the statement sent as it is then fails as it would have)."""
        if not sent or not all(statement.startswith(_KEPT_BACK) for statement, _ in sent):
            return None
        try:
            mogrify = psycopg.ClientCursor(self._db).mogrify
            return [mogrify(statement, args) for statement, many in sent for args in many]
        except Exception:  # noqa: BLE001 (sent as it is, it fails where it should)
            return None

    def _open_stream(self, columns: tuple[str, ...], writes: list[Write]) -> None:
        self._before_statement()
        block = self._db.cursor().copy(f"COPY jobs ({', '.join(columns)}) FROM STDIN")
        try:
            copy = block.__enter__()
        except BaseException:
            self._changes += 1
            raise
        stream = self._stream = _OpenCopy(columns, block, copy)
        for write in writes:
            self._send_row(stream, write.head_args)

    def _send_row(self, stream: _OpenCopy, row: tuple[Any, ...]) -> None:
        # A row psycopg cannot write (a text the connection's encoding
        # cannot hold) fails the command, which ends the COPY.
        # psycopg sends them 32 KiB at a time. Sent more often, the rows
        # were stored no sooner (four pairs, 128 rows a send against 32 KiB:
        # 46-59k jobs a second both): PostgreSQL's COPY stores its rows
        # 64 KB at a time, and the last of them once the COPY ends.
        _write_row(stream.copy, row)
        self._changes += 1

    def _end_stream(self) -> None:
        """End the open COPY, if any, before anything else is sent."""
        stream, self._stream = self._stream, None
        if stream is None:
            return
        try:
            stream.block.__exit__(None, None, None)
        except BaseException:
            self._changes += 1
            raise

    def _abandon_inserts(self, error: BaseException) -> None:
        stream, self._stream = self._stream, None
        if stream is None:
            return
        self._changes += 1
        # psycopg sends CopyFail with the error's text, and logs, not
        # raises, a failure to (the connection lost); `error` is what the
        # command ends with either way.
        try:
            stream.block.__exit__(type(error), error, error.__traceback__)
        except Exception as ended:  # noqa: BLE001 (the command's own error goes on)
            log.warning("ending a COPY after %r failed: %s", error, ended)

    def _run(self, statement: str, args: Sequence[Any] = ()) -> psycopg.Cursor[Any]:
        self._before_statement()
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
                    _write_row(copy, row)
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
        self._before_statement()
        # psycopg sends them in one pipeline: one round trip for all.
        try:
            with self._db.cursor() as cursor:
                cursor.executemany(statement, args)
        except psycopg.Error:
            self._changes += 1
            raise
        self._changes += max(cursor.rowcount, len(args))

    def _run_pair(self, first: Statement, second: Statement) -> tuple[list[Any], list[Any]]:
        self._before_statement()
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
        self._before_statement()
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
        # a twentieth of a bulk insert's Python. The sequence by its name,
        # looked up once: pg_get_serial_sequence in the statement ran for
        # every row, 3.1 ms of PostgreSQL's time for 1,000 IDs against 0.8,
        # before any row of the CreateJobs could be sent.
        (text,) = self._one(
            "SELECT array_agg(n ORDER BY n)::text FROM (SELECT nextval(%s::regclass) AS n "
            "FROM generate_series(1, %s)) AS ids",
            (self._id_sequence(), count),
        )
        return [int(n) for n in text[1:-1].split(",")] if text else []

    def _id_sequence(self) -> str:
        """The jobIDs' sequence, by its name with its schema's."""
        if self._sequence is None:
            (self._sequence,) = self._one("SELECT pg_get_serial_sequence('jobs', 'jobid')")
        return self._sequence

    def _lock(self, purpose: str, key: str) -> None:
        """A transaction lock on `key` for `purpose`, shared by every node
        on this schema; released at commit or rollback. A row lock on a
        table of the nodes' own (postgres_schema.LOCK_SLOTS says why)."""
        self._execute(
            "SELECT slot FROM jobserver_locks WHERE slot = %s FOR UPDATE",
            (postgres_schema.lock_slot(purpose, key),),
        )
