"""How the named operations' statements reach the database: one at a
time, or, while a command holds writes back (held_writes.py), together.

SqlStore (sql_store.py) says what each operation asks; this class runs it
through `_execute`, which first sends the writes held back, so that every
statement sees every write made before it, and keeps the savepoints a
command opens while writes are held until a statement must run inside one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from jobserver.model.jobs import Job
from jobserver.storage.held_writes import Batch, HeldWrites, Write, batches
from jobserver.storage.sql import JOB, Dialect, Rows, insert_job

# A statement and its arguments.
Statement = tuple[str, Sequence[Any]]
# jobIDs taken from the sequence at once by reserve_ids.
RESERVE_CHUNK = 1000
# Statements that change no job: the copies of held rows stay right.
_LEAVES_JOBS_ALONE = ("SELECT", "SAVEPOINT", "RELEASE")


def rows_of(cursor: Rows) -> list[Any]:
    """A statement's rows; none if it returns none (a write without
    RETURNING)."""
    return [] if cursor.description is None else cursor.fetchall()


class Statements:
    """A backend's connection (`_run`, `_run_many`), and what holds
    writes back in front of it."""

    dialect: Dialect
    errors: tuple[type[Exception], ...]
    # While a command holds writes back.
    _held: HeldWrites | None = None

    # Hooks.

    def _run(self, statement: str, args: Sequence[Any] = ()) -> Rows:
        """Run one statement."""
        raise NotImplementedError

    def _run_many(self, statement: str, args: list[list[Any]]) -> None:
        """Run one statement for each of `args`, in one go."""
        raise NotImplementedError

    def _lock(self, purpose: str, key: str) -> None:
        """Until the transaction ends, no other node takes the same lock."""

    def _may_have_children(self, parent_id: int) -> bool:
        return True

    def _next_ids(self, count: int) -> list[int]:
        """`count` jobIDs no job has or will have, taken now; none where a
        new job's ID is its insert's own at no cost (SQLite)."""
        return []

    def _load_flow_control(self) -> None:
        """Read limits and pauses again, after a rollback."""

    # Statements: every one goes through _execute, which first sends the
    # writes held back, so that it sees them.

    def _execute(self, statement: str, args: Sequence[Any] = ()) -> Rows:
        self._settle(statement)
        return self._run(statement, args)

    def _settle(self, statement: str) -> None:
        """Before `statement` runs: send the held writes (and the savepoint
        they are in); if it may write jobs, forget the copies of held rows."""
        held = self._held
        if held is None:
            return
        if held.has_pending() or held.must_send_savepoint():
            self._send(held)
        if not statement.startswith(_LEAVES_JOBS_ALONE):
            held.forget()

    def _send(self, held: HeldWrites) -> None:
        self._run_batches(self._pending(held))

    def _pending(self, held: HeldWrites) -> list[Batch]:
        """The statements of the writes held, and of the savepoint they
        are in, in order; taken from `held`."""
        before, savepoint, since = held.take_pending()
        d = self.dialect
        sent = batches(before, d.mark, d.arrays)
        if savepoint is not None:
            sent.append((f'SAVEPOINT "{savepoint}"', [[]]))
        return sent + batches(since, d.mark, d.arrays)

    def _send_last(self, held: HeldWrites) -> None:
        """The writes held when the command ends: sent now (a backend may
        keep them for what it sends next)."""
        self._send(held)

    def _run_pair(self, first: Statement, second: Statement) -> tuple[list[Any], list[Any]]:
        """Run two statements, the second begun once the first has ended (a
        backend may send both in one round trip); the rows of each (none for
        a write that returns none)."""
        return rows_of(self._run(*first)), rows_of(self._run(*second))

    def _run_batches(self, sent: list[Batch]) -> None:
        """Run the statements, in order (a backend may send them at once)."""
        for statement, args in sent:
            if len(args) == 1:
                self._run(statement, args[0])
            else:
                self._run_many(statement, args)

    # Holding writes back (held_writes.py).

    @contextmanager
    def holding_writes(self) -> Iterator[None]:
        """Within: writes to held jobs (`hold`, and a search's finds) are
        kept and sent together, before any other statement and at the end.
        On an exception they are dropped: the caller's transaction or
        savepoint is being undone."""
        if self._held is not None:
            yield
            return
        held = self._held = HeldWrites()
        try:
            yield
            self._send_last(held)
        except BaseException as error:
            self._abandon_inserts(error)
            raise
        finally:
            self._held = None

    def _hold_insert(
        self, held: HeldWrites, columns: tuple[str, ...], row: tuple[Any, ...], job_id: int,
        parent_id: int,
    ) -> None:
        """Keep a new job's insert, `row` its `columns`' values (a backend
        may send it at once)."""
        write = Write(insert_job(self.dialect, columns), columns, row, job_id, insert=True)
        held.create(write, parent_id)

    def _abandon_inserts(self, error: BaseException) -> None:
        """The command failed while holding writes: inserts a backend sent
        ahead (`_hold_insert`) and has not ended are ended with `error`."""

    def hold(self, ids: Sequence[int]) -> None:
        """While writes are held: read these jobs in one statement, locked
        where other nodes write, then whether each has children (in the same
        round trip where the backend can); reads and writes of them are then
        answered here."""
        held = self._held
        wanted = sorted({job_id for job_id in ids if held is not None and job_id not in held.rows})
        if held is None or not wanted:
            return
        d = self.dialect
        by_id, args = d.any_of("jobID", wanted, "bigint")
        read = (f"SELECT {JOB} FROM jobs WHERE {by_id} ORDER BY jobID{d.lock}", args)
        maybe = [job_id for job_id in wanted if self._may_have_children(job_id)]
        if maybe:
            # Children are looked for in a statement of their own, begun once
            # the rows are locked: a statement sees what its snapshot, taken
            # before it waited for a lock, saw, and would miss a child that
            # the transaction it waited for created.
            by_parent, parent_args = d.any_of("parentJobID", maybe, "bigint")
            self._settle(read[0])
            rows, parents = self._run_pair(
                read,
                (
                    f"SELECT DISTINCT parentJobID FROM jobs WHERE parentJobID != 0 "
                    f"AND {by_parent}",
                    parent_args,
                ),
            )
        else:
            rows, parents = self._execute(*read).fetchall(), []
        with_children = {int(row[0]) for row in parents}
        for row in rows:
            job = Job(*row)
            held.rows[job.jobID] = job
            held.parents[job.jobID] = job.jobID in with_children

    def reserve_ids(self, count: int) -> None:
        """While writes are held: up to `count` jobs created next take
        jobIDs given in advance, and their inserts are held too."""
        held = self._held
        if held is not None and count > 1:
            held.ids_wanted = count

    def _reserved_id(self) -> int | None:
        """A jobID given in advance for the next new job, if any. They are
        taken RESERVE_CHUNK at a time, at the first job that is created:
        a CreateJobs whose first element is refused takes none, and one of
        a hundred thousand elements that fails on the second no more than
        a chunk."""
        held = self._held
        if held is None:
            return None
        if not held.new_ids and held.ids_wanted > 0:
            chunk = self._next_ids(min(held.ids_wanted, RESERVE_CHUNK))
            held.ids_wanted = held.ids_wanted - len(chunk) if chunk else 0
            held.new_ids = chunk[::-1]
        return held.new_ids.pop() if held.new_ids else None

    def _found(self, jobs: list[Job], children: dict[int, bool] | None = None) -> list[Job]:
        """A search's finds, locked (or this process's alone): held, while
        writes are; `children`, whether each has children, if the search
        said (PostgreSQL's)."""
        held = self._held
        if held is None or not jobs:
            return jobs
        # Whether each has children, which its hand-out reads: one
        # statement for all, not one each, where the search did not say.
        if children is None:
            children = self._children_of(
                [job.jobID for job in jobs if self._may_have_children(job.jobID)]
            )
        held.parents.update(children)
        for job in jobs:
            held.rows[job.jobID] = job
        return jobs

    def _children_of(self, maybe: list[int]) -> dict[int, bool]:
        """Whether each of these jobs has children."""
        if not maybe:
            return {}
        by_id, args = self.dialect.any_of("parentJobID", maybe, "bigint")
        parents = set(
            self._ids(
                f"SELECT DISTINCT parentJobID FROM jobs WHERE parentJobID != 0 AND {by_id}", args
            )
        )
        return {job_id: job_id in parents for job_id in maybe}

    def savepoint(self, name: str = "request") -> None:
        if self._held is not None and self._held.opens(name):
            return
        self._execute(f'SAVEPOINT "{name}"')

    def release(self, name: str = "request") -> None:
        held = self._held
        if held is not None and held.is_open(name) and not held.close():
            return
        self._execute(f'RELEASE SAVEPOINT "{name}"')

    def rollback_savepoint(self, name: str = "request") -> None:
        held = self._held
        if held is not None:
            if not held.is_open(name):
                held.drop()
            elif not held.undo():
                return
        self._run(f'ROLLBACK TO SAVEPOINT "{name}"')
        self._run(f'RELEASE SAVEPOINT "{name}"')
        self._load_flow_control()

    # Shorthands.

    def _one(self, statement: str, args: Sequence[Any] = ()) -> Any:
        return self._execute(statement, args).fetchone()

    def _jobs(self, statement: str, args: Sequence[Any] = ()) -> list[Job]:
        return [Job(*row) for row in self._execute(statement, args).fetchall()]

    def _job(self, statement: str, args: Sequence[Any] = ()) -> Job | None:
        """The first row as a job, if there is one."""
        row = self._execute(statement, args).fetchone()
        return None if row is None else Job(*row)

    def _ids(self, statement: str, args: Sequence[Any] = ()) -> list[int]:
        return [int(row[0]) for row in self._execute(statement, args).fetchall()]
