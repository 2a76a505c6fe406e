"""Writes held back while one command works through many jobs, sent
together: a FinishJobs of a hundred jobs, a GetJobs of a hundred.

Done one at a time, each job's read and write is a statement of its own:
on PostgreSQL a round trip each, about five per job. While writes are held
(`Statements.holding_writes`, sql_statements.py):

- the jobs a command is about to change are read in one statement
  (`Statements.hold`), locked where other nodes write, with whether each has
  children; a search's hand-out candidates are held as found (they are
  locked already);
- a write to a held job is checked against the row as this transaction
  left it (its state, its lease), applied to that copy, and kept here; a
  read of a held job is answered from the copy. The answer is the one the
  database would give: nothing else can change a row this transaction
  holds (PostgreSQL's row lock; SQLite's single writer);
- before any other statement, and when the command ends, the kept writes
  are sent (`batches`), so that reads always see every write made before
  them: on PostgreSQL one statement per shape (`jobID = ANY` where they
  set the same values, a join to their rows where they differ, one
  multi-row insert); on SQLite, with no round trip to spare, one
  executemany per shape;
- a savepoint opened meanwhile (FinishJobs' one per element) is kept here
  too, and sent to the database only if a statement has to run inside it;
  undoing it drops the element's kept writes and restores the copies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jobserver.model.jobs import Job
from jobserver.storage.sql import NOT_TEXT, integers


# Plain, with slots: made for every write a command holds (three a job
# in a drain), and a frozen dataclass's __init__ costs five times as much.
@dataclass(slots=True)
class Write:
    """One job's write: `{head} WHERE jobID = ?{fence}`, bound to
    head_args, the jobID, fence_args; for an insert, `head` bound to
    head_args (the jobID among them). `columns` are those head_args set."""

    head: str
    columns: tuple[str, ...]
    head_args: tuple[Any, ...]
    job_id: int
    fence: str = ""
    fence_args: tuple[Any, ...] = ()
    # The same fence for a statement over many jobs by their key
    # (sql_store._fence says why it differs).
    many_fence: str = ""
    insert: bool = False
    # The table an insert goes to, and what it does on a row of the same
    # key (an upsert's `ON CONFLICT ...`): a job's outcome (AwaitJob) is
    # kept beside its end, in `outcomes`.
    table: str = "jobs"
    on_conflict: str = ""


# A group of writes sent as one: a statement and its parameters, once
# (a plain execute) or several times (executemany).
Batch = tuple[str, list[list[Any]]]


class HeldWrites:
    """The jobs a transaction holds, as its writes left them, and the
    writes not yet sent."""

    def __init__(self) -> None:
        # None: deleted by a kept write.
        self.rows: dict[int, Job | None] = {}
        # Of the held jobs, whether each has children (when read by `hold`).
        self.parents: dict[int, bool] = {}
        # jobIDs taken in advance for new jobs, whose inserts are then held,
        # and how many more the command may still create.
        self.new_ids: list[int] = []
        self.ids_wanted = 0
        self._pending: list[Write] = []
        # The open savepoint's name, where its kept writes start, and the
        # rows as they were before each write since it opened.
        self._savepoint: str | None = None
        self._mark = 0
        self._undo: list[tuple[int, Job | None]] = []
        self._savepoint_sent = False

    def write(
        self,
        write: Write,
        columns: dict[str, Any] | None,
        in_states: tuple[str, ...] | None,
        lease: str | None,
    ) -> bool:
        """Keep a write to a held job (columns None: delete it); False if
        its fence would leave the row as it is."""
        row = self.rows[write.job_id]
        if row is None:
            return False
        if in_states is not None and row.state not in in_states:
            return False
        if lease is not None and row.leaseID != lease:
            return False
        if self._savepoint is not None:
            self._undo.append((write.job_id, row))
        self.rows[write.job_id] = None if columns is None else _changed(row, columns)
        self._pending.append(write)
        return True

    def create(self, write: Write, parent_id: int) -> None:
        """Keep a new job's insert."""
        self.child_of(parent_id)
        self._pending.append(write)

    def child_of(self, parent_id: int) -> None:
        """A new job of `parent_id`, kept or sent: a held parent has children."""
        if parent_id in self.parents:
            self.parents[parent_id] = True

    def takes_inserts_now(self) -> bool:
        """Whether a new job's insert may be sent at once, ahead of the end
        of the command: nothing kept must go before it, and no savepoint is
        kept that it would have to be sent inside."""
        return not self._pending and self._savepoint is None

    def inserts_only(self) -> tuple[str, ...] | None:
        """The columns of the kept writes, if they are all new jobs' inserts
        of those columns and no savepoint is kept (a CreateJobs' plain
        elements): their rows may then go ahead of the end of the command."""
        if self._savepoint is not None or not self._pending:
            return None
        columns = self._pending[0].columns
        for write in self._pending:
            if not by_copy(write) or write.columns != columns:
                return None
        return columns

    def count(self) -> int:
        """How many writes are kept."""
        return len(self._pending)

    def take_inserts(self) -> list[Write]:
        """The kept writes, all inserts (inserts_only), to send now."""
        pending, self._pending = self._pending, []
        return pending

    def insert(self, write: Write) -> None:
        """Keep an insert into another table than the jobs' (an outcome)."""
        self._pending.append(write)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def pending(self) -> list[Write]:
        """The kept writes, left kept."""
        return list(self._pending)

    # Savepoints (one at a time: FinishJobs' per element).

    def opens(self, name: str) -> bool:
        """Keep savepoint `name` here; False if one is open already (the
        caller then sends it to the database)."""
        if self._savepoint is not None:
            return False
        self._savepoint, self._mark, self._undo = name, len(self._pending), []
        self._savepoint_sent = False
        return True

    def is_open(self, name: str) -> bool:
        return self._savepoint == name

    def must_send_savepoint(self) -> bool:
        """Whether the open savepoint must reach the database before the
        next statement: it has not yet."""
        return self._savepoint is not None and not self._savepoint_sent

    def take_pending(self) -> tuple[list[Write], str | None, list[Write]]:
        """The kept writes, to send: those from before the open savepoint,
        the savepoint's name if the database must now have it, and the
        writes since."""
        pending, self._pending = self._pending, []
        mark, self._mark = self._mark, 0
        if self._savepoint is None or self._savepoint_sent:
            return pending, None, []
        self._savepoint_sent = True
        return pending[:mark], self._savepoint, pending[mark:]

    def forget(self) -> None:
        """A statement that may change jobs runs: the copies may be wrong
        from here on, and reads and writes go to the database. An undo
        after this is the database's (the savepoint was sent before it)."""
        self.rows.clear()
        self.parents.clear()
        self._undo.clear()

    def drop(self) -> None:
        """The transaction is being rolled back past everything held."""
        self.forget()
        self._pending, self._mark = [], 0
        self._savepoint = None

    def close(self) -> bool:
        """Release the open savepoint; whether the database has it."""
        sent = self._savepoint_sent
        self._savepoint, self._undo = None, []
        return sent

    def undo(self) -> bool:
        """Drop the writes kept since the open savepoint and restore the
        rows; whether the database has the savepoint (to roll back there)."""
        del self._pending[self._mark :]
        for job_id, row in reversed(self._undo):
            self.rows[job_id] = row
        return self.close()


def _changed(row: Job, columns: dict[str, Any]) -> Job:
    """A copy of `row` with `columns` set (dataclasses.replace, at a
    third of its cost: no __init__)."""
    copy = object.__new__(Job)
    copy.__dict__ = {**row.__dict__, **columns}
    return copy


def batches(writes: list[Write], mark: str, arrays: bool) -> list[Batch]:
    """The statements that make `writes`, in an order that keeps each
    job's writes in theirs. Writes of one shape are grouped into one
    statement: where the database takes arrays (PostgreSQL), over `jobID =
    ANY` if they bind the same values, else over the rows of `unnest`;
    elsewhere, one executemany."""
    out: list[Batch] = []
    groups: dict[tuple[str, str], list[Write]] = {}
    seen: set[tuple[str, int]] = set()
    for write in writes:
        # A job's row and its outcome are two rows: sent in one statement
        # each, however many jobs a command ends.
        row = (write.table, write.job_id)
        if row in seen:
            # A second write to a row waits for everything before it.
            out += _grouped(groups, mark, arrays)
            groups, seen = {}, set()
        seen.add(row)
        groups.setdefault((write.head, write.fence), []).append(write)
    return out + _grouped(groups, mark, arrays)


def _grouped(groups: dict[tuple[str, str], list[Write]], mark: str, arrays: bool) -> list[Batch]:
    out: list[Batch] = []
    for writes in groups.values():
        if len(writes) == 1 or not arrays:
            out.append(_one_by_one(writes, mark))
        elif writes[0].insert:
            out.append(_insert_rows(writes, mark))
        elif _same_values(writes):
            out.append(_any_of(writes, mark))
        elif not writes[0].fence_args:
            out.append(_update_rows(writes, mark))
        else:
            out.append(_one_by_one(writes, mark))
    return out


def _one_by_one(writes: list[Write], mark: str) -> Batch:
    first = writes[0]
    if first.insert:
        return first.head, [list(w.head_args) for w in writes]
    statement = f"{first.head} WHERE jobID = {mark}{first.fence}"
    return statement, [[*w.head_args, w.job_id, *w.fence_args] for w in writes]


def _same_values(writes: list[Write]) -> bool:
    """Whether the writes bind the same values (a list, not a generator:
    one call, not one a job)."""
    first = writes[0]
    head, fence = first.head_args, first.fence_args
    return all([w.head_args == head and w.fence_args == fence for w in writes])


def _any_of(writes: list[Write], mark: str) -> Batch:
    first = writes[0]
    ids = integers([w.job_id for w in writes])
    statement = f"{first.head} WHERE jobID = ANY({mark}::bigint[]){first.many_fence}"
    return statement, [[*first.head_args, ids, *first.fence_args]]


def _rows(columns: tuple[str, ...], rows: list[tuple[Any, ...]], mark: str) -> tuple[str, str]:
    """A row source of `rows`, their columns named v0, v1, ... and typed
    as `columns`, and its one parameter: the rows as a JSON array of
    arrays (json.dumps is C; a list parameter is dumped in Python). A
    PostgreSQL text holds no NUL, so no stored value needs `\\u0000`.
    Read as jsonb, parsed once: each `->>` of a json value parses its
    element's text again, which cost a hand-out of 100 jobs about 4 µs a
    job of PostgreSQL's CPU and an outcomes insert 3 (docs/benchmarks.md)."""
    typed = ", ".join(
        f"(e->>{i}){_CASTS.get(column, '')} AS v{i}" for i, column in enumerate(columns)
    )
    source = f"(SELECT {typed} FROM jsonb_array_elements({mark}::jsonb) AS e)"
    return source, json.dumps(rows, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


# How a batch of new jobs' rows begins (_insert_rows): a backend runs it
# as COPY, its one argument the rows themselves, not as a statement with
# parameters.
COPY = "COPY"


def by_copy(write: Write) -> bool:
    """Whether the write is a new job's insert, whose row COPY can carry
    (an upsert has no COPY)."""
    return write.insert and write.table == "jobs" and not write.on_conflict


def _insert_rows(writes: list[Write], mark: str) -> Batch:
    columns = writes[0].columns
    if by_copy(writes[0]):
        # New jobs (a CreateJobs) by COPY, the rows written by psycopg in
        # C: PostgreSQL's CPU a job 6.8-8.0 µs against 8.5-10.2 through
        # jsonb (postgres_statements._copy). An upsert has no COPY.
        return f"{COPY} jobs ({', '.join(columns)}) FROM STDIN", [[[w.head_args for w in writes]]]
    source, rows = _rows(columns, [w.head_args for w in writes], mark)
    statement = (
        f"INSERT INTO {writes[0].table} ({', '.join(columns)}) SELECT * FROM {source} AS v"
        f"{writes[0].on_conflict}"
    )
    return statement, [[rows]]


def _update_rows(writes: list[Write], mark: str) -> Batch:
    """Writes of the same columns with different values (a hand-out's
    lease token each): one UPDATE joined to their rows. The rows' columns
    are named v0, v1, ... so that the fence's names stay the table's."""
    first = writes[0]
    columns = ("jobID", *first.columns)
    source, rows = _rows(columns, [(w.job_id, *w.head_args) for w in writes], mark)
    sets = ", ".join(f"{column} = v.v{i}" for i, column in enumerate(first.columns, 1))
    # The jobIDs again, as an array: the planner then finds the rows by
    # their key. Joined on v.v0 alone it scanned every job of the fence's
    # states into a hash (12 ms for 100 of 40,000 queued jobs: the time
    # grew with the queue), its statistics of a queue table never current.
    ids = integers([w.job_id for w in writes])
    statement = (
        f"UPDATE jobs SET {sets} FROM {source} AS v "
        f"WHERE jobID = ANY({mark}::bigint[]) AND jobID = v.v0{first.many_fence}"
    )
    return statement, [[rows, ids]]


# Casts of the columns that are not text, from a JSON value's text.
_CASTS = {column: f"::{kind}" for column, kind in NOT_TEXT.items()}
