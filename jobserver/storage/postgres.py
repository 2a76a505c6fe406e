"""The PostgreSQL backend of storage (interface.py): several jobserver
nodes, on one machine or many, serving one queue.

The named operations are sql_store.py's, in PostgreSQL's dialect (sql.py);
this module adds the connection, the transactions, the hand-out search
and the locks (how a connection is made, and how a COMMIT cut off with it
is asked about, are postgres_connection.py's; how a batch begins,
postgres_begin.py's; what its begin and commit send, postgres_commit.py's;
the search's statement,
postgres_search.py's; the readers, on connections of their own,
postgres_readers.py's). What SQLite gets from being one file
served by one process, PostgreSQL gets from locks that every node's
transactions respect:

- a job is handed out once: `find_ready` locks the rows it returns
  (`FOR UPDATE SKIP LOCKED`), so a second node passes over them, and every
  other read of a job by its ID locks it too (`get`), so two nodes never
  change one job on the strength of what they read before the other wrote;
- a job read without a lock (a search of FAILED jobs, of children) and
  moved by two nodes at once moves once: `set_state_if` changes only the
  jobs still in the state it expects, once the other node has committed;
- a concurrency limit holds across nodes: `usage` takes the limit's
  transaction lock before it counts, so hand-outs under one limit commit
  one after the other and each counts what the last one took;
- a reply meets its waiting job: `reply` and `waiting_on` take the key's
  lock, so a DeliverReply and an AwaitReply on two nodes are ordered;
- unique=true creates one job: `find_by_name` takes the name's lock;
- limits and pauses are read again at the start of every transaction, so
  a change made through one node holds on all from their next batch;
- the pruner works on one node at a time (a lock it only tries to take).

Every call may wait on the network, so the writer runs each batch in a
thread (`blocking`). A commit is durable when PostgreSQL says so
(synchronous_commit), so there is nothing to sync afterwards. When the
connection is lost, transactions fail (`503`) until `begin` has
reconnected: at once, and after a failed attempt at most every
RECONNECT_SECONDS, or as soon as another connection of the node was made.
"""

from __future__ import annotations

import copy
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg

from jobserver.model.jobs import Job
from jobserver.model.limits import Limit
from jobserver.storage import (
    postgres_commit,
    postgres_listen,
    postgres_readers,
    postgres_schema,
    postgres_search,
)
from jobserver.storage.backends import DEFAULT_WRITERS, MAX_WRITERS
from jobserver.storage.backup_types import BackupCopy, BackupDirectory, BackupUnsupported
from jobserver.storage.postgres_alone import Company
from jobserver.storage.postgres_begin import PostgresBegin
from jobserver.storage.postgres_connection import (
    ASK_MILLISECONDS,
    READ_APPLICATION,
    check_version,
    committed,
    connect,
    cut_off_after,
    end_own_backend,
    redact,
)
from jobserver.storage.postgres_statistics import StatisticsKeeper
from jobserver.storage.searches import NOTHING_PASSED, PassedOver
from jobserver.storage.sql import POSTGRES
from jobserver.storage.sql_store import SqlStore
from jobserver.storage.sqlite_schema import StoreError

log = logging.getLogger("jobserver")

# How long after a failed connection attempt the next is tried: meanwhile
# requests fail at once with 503.
RECONNECT_SECONDS = 0.5

# What a commit's notice tells (postgres_commit.notice): the names made
# due, the earliest future time written, the awaited jobs ended.
Announced = tuple[set[str], str | None, set[int]]


class PostgresStore(postgres_readers.ReaderCalls, PostgresBegin, SqlStore):
    dialect = POSTGRES
    blocking = True
    needs_sync = False

    def __init__(
        self,
        url: str,
        limits: Mapping[str, Limit] | None = None,
        query_url: str | None = None,
        writers: int = DEFAULT_WRITERS,
    ) -> None:
        self.path = redact(url)
        self._url = url
        self.errors: tuple[type[Exception], ...] = (psycopg.Error,)
        self.transient: tuple[type[Exception], ...] = (
            psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure,
        )
        if not 1 <= writers <= MAX_WRITERS:
            raise StoreError(f"a node runs 1 to {MAX_WRITERS} writers, not {writers}")
        self._stopping = False
        self._base_limits = dict(limits or {})
        # Names this node in the notices it sends, so it can skip its own.
        self.node = secrets.token_hex(6)
        # The first writer's store; the others (`writers`) were made from it.
        self.origin: PostgresStore = self
        self._others: list[PostgresStore] = []
        # Shared by the writers and the listener: whether the node is alone.
        self._company = Company()
        self._statistics = StatisticsKeeper(
            lambda: self._company.own("statistics", connect(url, application_name=READ_APPLICATION))
        )
        try:
            self._use(connect(url))
        except psycopg.Error as error:
            raise self._unusable(error) from error
        try:
            check_version(self._db, self.path)
            self.schema = postgres_schema.prepare(self._db, self.path)
            # Advisory locks are the database's: the schema's name keeps two
            # queues in one database apart.
            self.channel = postgres_schema.channel(self.schema)
            self._query = postgres_readers.query_login(self._db, url, query_url, self.schema)
            self._load_flow_control()
            for _ in range(writers - 1):
                self._others.append(self._another_writer())
        except psycopg.Error as error:
            self.close()
            raise self._unusable(error) from error

    def _unusable(self, error: psycopg.Error) -> StoreError:
        return StoreError(f"cannot use {self.path} as a job database: {error}")

    def _use(self, db: psycopg.Connection[Any]) -> None:
        """Run transactions on `db`, none begun yet."""
        # This writer's, among the node's own connections (postgres_alone.py).
        self._role = f"writer {id(self)}"
        self._db = self._company.own(self._role, db)
        self._changes = 0
        self._retry_at = 0.0
        # The connection postgres_commit.PREPARE's statements are known to
        # be prepared on, if any (_prepare_statements).
        self._prepared_on: psycopg.Connection[Any] | None = None
        # The open transaction's ID (PostgreSQL's xid8, as text) and the
        # backend running it: what is asked about if its COMMIT is cut off.
        self._xid = ""
        self._backend = 0
        # Idempotency keys kept in the open transaction, written with its
        # COMMIT (keep_idempotent): key -> (request, reply, expires).
        self._kept_keys: dict[str, tuple[str, str, str]] = {}
        self._unsent = []
        # Whether a reconnection has failed since the last success.
        self._lost = False
        # What the next COMMIT's notice tells (announce): its text is made
        # only if someone is there to hear it.
        self._notice: Announced | None = None
        self.limits: dict[str, Limit] = dict(self._base_limits)
        self.paused: frozenset[str] = frozenset()

    def _another_writer(self) -> PostgresStore:
        """A store for another of this node's writers: its own connection
        and transactions; the node's name (its listener skips the notices
        of all its writers, whose commits the engine hears itself), schema,
        Query role and statistics shared."""
        other = copy.copy(self)
        other._use(connect(self._url))
        other.origin, other._others = self, []
        other._load_flow_control()
        return other

    def writers(self) -> list[PostgresStore]:
        """This store and the node's other writers' (--writers)."""
        return [self, *self._others]

    def close(self) -> None:
        for other in self._others:
            other.close()
        self._db.close()
        if self.origin is self:
            self._statistics.close()

    def stop_waiting_long(self) -> None:
        """A lock wait is bounded by the other node's transaction, and a
        connection attempt by CONNECT_SECONDS; asking what became of a
        COMMIT cut off (`_committed`) stops after STOPPING_OUTCOME_SECONDS
        (postgres_connection.py)."""
        for writer in self.writers():
            writer._stopping = True

    # Transactions.

    @property
    def total_changes(self) -> int:
        return self._changes

    def _reconnect(self) -> None:
        """A new connection at once, unless the last attempt failed less
        than RECONNECT_SECONDS ago: a connection ended alone (its backend
        terminated) costs the next batch a connection, while a PostgreSQL
        out of reach is not hammered."""
        # Unless another of the node's connections was made since this one's
        # attempt failed: PostgreSQL is back, and the node answers as a whole.
        failed_at = self._retry_at - RECONNECT_SECONDS
        if time.monotonic() < self._retry_at and self._company.connected_at <= failed_at:
            raise psycopg.OperationalError("the connection to PostgreSQL is lost")
        db: psycopg.Connection[Any] | None = None
        try:
            db = connect(self._url)
            if self._xid:
                # Cut off from this node by the network, the last backend may
                # still hold its transaction, and the locks taken in it, for
                # as long as PostgreSQL takes to notice: the next batch would
                # wait on them.
                with cut_off_after(db, ASK_MILLISECONDS / 1000):
                    end_own_backend(db, self._xid, self._backend)
        except psycopg.Error as error:
            if db is not None:
                db.close()
            self._retry_at = time.monotonic() + RECONNECT_SECONDS
            if not self._lost:
                log.error("lost %s; reconnecting: %s", self.path, error)
            self._lost = True
            raise
        self._db.close()
        self._db = self._company.own(self._role, db)
        self._lost = False
        log.info("reconnected to %s", self.path)

    def commit(self) -> None:
        """Commit; return only if PostgreSQL committed. A COMMIT cut off
        with its connection may have been carried out: the node asks on a
        new connection (`_committed`) before it says either way."""
        self._commit(None)

    def commit_reading_next_due(self, after: str) -> str | None:
        """Commit as `commit` does, reading `next_due(after)` first in the
        COMMIT's own query. A commit whose answer was lost (asked about, and
        committed) returns `after`: when the next job falls due is not
        known, and a time already passed makes the clock look at once. On
        a connection where the statements are not known to be prepared (a
        ROLLBACK TO SAVEPOINT in this transaction may have deallocated
        them, and a PREPARE that failed here would spoil it), the read is a
        statement of its own."""
        if self._prepared_on is not self._db:
            due = self.next_due(after)
            self._commit(None)
            return due
        return self._commit(after)

    def _commit(self, after: str | None) -> str | None:
        """Commit, with the next due time after `after` read first if it
        is given; that time."""
        announced, self._notice = self._notice, None
        # COMMIT releases every savepoint: a RELEASE kept back goes unsent.
        # The writes kept back go with it.
        self._released = None
        unsent, self._unsent = self._unsent, []
        notice = None
        if announced is not None and self._company.must_tell(time.monotonic()):
            notice = postgres_commit.notice(self.node, *announced)
        # Else nobody else is on the database to hear it (postgres_alone.py).
        kept, self._kept_keys = self._kept_keys, {}
        try:
            status, due = postgres_commit.send_commit(
                self._db, self.channel, kept, notice, after, unsent
            )
        except psycopg.Error as error:
            self._changes += 1
            if self._committed(error):
                return after
            raise
        if status != "COMMIT":
            # PostgreSQL answers COMMIT of a transaction that an error
            # spoiled with ROLLBACK, not with an error.
            raise psycopg.OperationalError(
                f"the transaction was rolled back instead of committed ({status})"
            )
        if notice is not None:
            self._company.told()
        return due

    def _committed(self, error: psycopg.Error) -> bool:
        """Whether the open transaction committed, after its COMMIT raised
        `error`: the connection is closed (it may be in any state), and
        PostgreSQL asked on a new one (postgres_connection.committed),
        which the store goes on with."""
        xid, backend = self._xid, self._backend
        self._db.close()
        done, db = committed(self._url, xid, backend, error, lambda: self._stopping)
        self._db = self._company.own(self._role, db)
        self._lost, self._retry_at = False, 0.0
        return done

    def sync(self) -> None:
        """Commits are durable when COMMIT returns."""

    def checkpoint_if_due(self) -> None:
        """PostgreSQL checkpoints by itself."""

    def rollback(self) -> None:
        self._notice = None
        self._kept_keys = {}
        self._prepared_on = None
        self._released = None
        self._unsent = []
        if self.in_transaction:
            try:
                self._db.execute(b"ROLLBACK")
            except psycopg.Error:
                # Nothing is committed on a connection that cannot roll
                # back; the next batch starts on a new one.
                self._db.close()
                raise
        self._load_flow_control()

    def rollback_savepoint(self, name: str = "request") -> None:
        # A ROLLBACK TO SAVEPOINT may deallocate the prepared statements, as a
        # ROLLBACK does (_prepare_statements).
        self._prepared_on = None
        if self._held is None:
            # Writes kept back were made in it: a savepoint opened since
            # would have sent them.
            self._unsent = []
        super().rollback_savepoint(name)

    # Idempotency keys (protocol.md 14.22): each costs a create one round
    # trip, its claim; what the request kept goes with the COMMIT.

    def idempotent(self, key: str, now: str) -> tuple[str, str] | None:
        kept = self._kept_keys.get(key)
        if kept is None:
            return super().idempotent(key, now)
        # Kept by a request earlier in this transaction, not yet written.
        request, reply, expires = kept
        return None if expires <= now else (request, reply)

    def keep_idempotent(self, key: str, request: str, reply: str, expires: str) -> None:
        self._kept_keys[key] = (request, reply, expires)

    def prune_idempotency(self, now: str, batch: int) -> int:
        # What this transaction kept is written first, as if it had been
        # at once.
        kept, self._kept_keys = self._kept_keys, {}
        if kept:
            self._execute(postgres_commit.KEEP_KEYS, postgres_commit.kept_rows(kept))
        return super().prune_idempotency(now, batch)

    async def listen(self, heard: postgres_listen.Heard) -> None:
        company, url = self._company, self._url
        await postgres_listen.listen(
            lambda: company.own("listener", connect(url)), self.channel, self.node, heard
        )

    def announce(self, ready: set[str], due: str | None, ended: set[int]) -> None:
        """Tell the other nodes, when this transaction commits, which names
        it made due, the earliest future time it wrote, and which awaited
        jobs it ended (only those: a job nobody awaits adds nothing)."""
        # Sent with the COMMIT (see commit); nothing changes them meanwhile.
        self._notice = (ready, due, ended)

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
        """Due jobs (READY) in hand-out order, locked; jobs that
        another node's transaction holds are passed over, and so is what
        this search has `passed` over, in the query
        (postgres_functions.FIND_READY_AFTER_FUNCTION); with whether each
        has children, in the same statement."""
        rows = self._execute(
            postgres_search.STATEMENT,
            postgres_search.arguments(now, priorities, limit, patterns, names, passed),
        ).fetchall()
        return self._found(*postgres_search.found(rows))

    def hold_limits(self) -> None:
        """Take the limits' lock: hand-outs under limits, on any node, then
        commit one at a time, and `usage` sees every one committed before."""
        self._execute(
            "SELECT slot FROM jobserver_locks WHERE slot = %s FOR UPDATE",
            (postgres_schema.LIMITS_SLOT,),
        )

    # Retention: on one node at a time.

    def _may_prune(self) -> bool:
        row = self._one(
            "SELECT count(*) FROM (SELECT slot FROM jobserver_locks WHERE slot = %s "
            "FOR UPDATE SKIP LOCKED) AS taken",
            (postgres_schema.PRUNE_SLOT,),
        )
        return bool(row[0])

    def reclaim_space(self, pruned: bool) -> bool:
        """PostgreSQL's autovacuum reuses the space of deleted rows."""
        return False

    def size_bytes(self) -> int:
        row = self._one(
            "SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = current_schema() AND c.relkind = 'r'"
        )
        return int(row[0])

    def backup(
        self, directory: BackupDirectory, name: str, stopped: Callable[[], bool]
    ) -> BackupCopy:
        # pg_dump copies the queue consistently while the nodes serve, from
        # any machine; a node would only do it worse.
        raise BackupUnsupported(
            "Backup is for SQLite: back up PostgreSQL with pg_dump "
            "(docs/backups.md)"
        )
