"""The PostgreSQL backend of storage (interface.py): several jobserver
nodes, on one machine or many, serving one queue.

The named operations are sql_store.py's, in PostgreSQL's dialect (sql.py);
this module adds the connection, the transactions, the hand-out search,
the locks and the readers. What SQLite gets from being one file served by
one process, PostgreSQL gets from locks that every node's transactions
respect:

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
RECONNECT_SECONDS.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from decimal import Decimal
from functools import partial
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import TransactionStatus

from jobserver.model.globmatch import glob_to_regex, is_glob
from jobserver.model.jobs import Job
from jobserver.model.limits import Limit, handouts_cutoff
from jobserver.storage import postgres_listen, postgres_query, postgres_schema, sql
from jobserver.storage.backup_types import BackupCopy, BackupDirectory, BackupUnsupported
from jobserver.storage.interface import (
    LaterJobs,
    OutcomeUnknown,
    QueryRows,
    QueueStats,
    RunningJob,
    RunningStats,
)
from jobserver.storage.searches import NOTHING_PASSED, PassedOver, pair_text
from jobserver.storage.sql import COLUMNS, JOB, POSTGRES, priorities_from
from jobserver.storage.sql_store import FLOW_CONTROL, SqlStore
from jobserver.storage.sqlite_schema import StoreError

log = logging.getLogger("jobserver")

# The oldest PostgreSQL a node runs on (as server_version_num).
MIN_SERVER_VERSION = 130000

# How long a connection attempt may take, and how long after a failed one
# the next is tried: meanwhile requests fail at once with 503.
CONNECT_SECONDS = 3
RECONNECT_SECONDS = 0.5
# How long a node that lost its connection while COMMIT was under way asks
# PostgreSQL, on new connections, whether that transaction committed,
# before its requests are answered `504 Outcome unknown`; and how long it
# waits between two asks. The writer waits meanwhile: no other batch could
# commit on a database it cannot reach.
OUTCOME_SECONDS = 10.0
OUTCOME_POLL_SECONDS = 0.2
# The same, once the server is stopping: its shutdown waits for no longer.
STOPPING_OUTCOME_SECONDS = 1.0
# The longest one ask's statements may take, whatever PostgreSQL does.
ASK_MILLISECONDS = 2000

# The longest NOTIFY payload PostgreSQL takes is 8000 bytes; past this the
# notice says "anything may be ready" instead of listing names.
MAX_NOTICE_BYTES = 7000

# Query's result columns, spelled as on SQLite: PostgreSQL folds unquoted
# identifiers to lower case.
_SPELLING = {
    column.lower(): column
    for column in (
        *COLUMNS, "pattern", "capacity", "rate", "ratePer", "perKey", "received", "expires",
        "blockers", "dependsOn",
    )
}


def redact(url: str) -> str:
    """The URL without its password, for logs and Status."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


# How Query's connections name themselves to PostgreSQL (pg_stat_activity).
QUERY_APPLICATION = "jobserver query"
# How the short reads off the writer (Queues, Status' limits, the
# dashboard's search, RunningJobs, the history's depth sample) name theirs:
# apart from the node's lasting connections (the writer, the listener),
# which keep "jobserver".
READ_APPLICATION = "jobserver read"

# libpq settings a URL does not give: a PostgreSQL that stops answering
# without closing the connection (a cable pulled, a host gone) is noticed
# within seconds, so the node answers 503 instead of hanging for the
# minutes TCP would wait.
CONNECTION_DEFAULTS = {
    "connect_timeout": str(CONNECT_SECONDS),
    "application_name": "jobserver",
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
    "tcp_user_timeout": "10000",
}


def connect(url: str, **overrides: str) -> psycopg.Connection[Any]:
    """A connection to `url`, with libpq settings of `overrides` (such as
    another user) taking the place of the URL's."""
    given = conninfo_to_dict(url)
    settings = {
        **CONNECTION_DEFAULTS,
        **{k: str(v) for k, v in given.items() if v is not None},
        **overrides,
    }
    return psycopg.connect(make_conninfo("", **settings), autocommit=True)


class PostgresStore(SqlStore):
    dialect = POSTGRES
    blocking = True
    needs_sync = False

    def __init__(
        self, url: str, limits: Mapping[str, Limit] | None = None, query_url: str | None = None
    ) -> None:
        self.path = redact(url)
        self._url = url
        self.errors: tuple[type[Exception], ...] = (psycopg.Error,)
        self.transient: tuple[type[Exception], ...] = (
            psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure,
        )
        self._changes = 0
        self._retry_at = 0.0
        # The open transaction's ID (PostgreSQL's xid8, as text) and the
        # backend running it: what is asked about if its COMMIT is cut off.
        self._xid = ""
        self._backend = 0
        self._stopping = False
        # Idempotency keys kept in the open transaction, written with its
        # COMMIT (keep_idempotent): key -> (request, reply, expires).
        self._kept_keys: dict[str, tuple[str, str, str]] = {}
        # Whether a reconnection has failed since the last success.
        self._lost = False
        # The notice to send with the next COMMIT (announce).
        self._notice: str | None = None
        self._base_limits = dict(limits or {})
        self.limits: dict[str, Limit] = dict(self._base_limits)
        self.paused: frozenset[str] = frozenset()
        # Names this node in the notices it sends, so it can skip its own.
        self.node = secrets.token_hex(6)
        try:
            self._db = connect(url)
            _check_version(self._db, self.path)
            self.schema = postgres_schema.prepare(self._db, self.path)
            self._query = self._query_login(query_url)
            self._load_flow_control()
        except psycopg.Error as error:
            raise StoreError(f"cannot use {self.path} as a job database: {error}") from error
        self.channel = postgres_schema.channel(self.schema)
        # Advisory locks are the database's: the schema's name keeps two
        # queues in one database apart.

    def _query_login(self, query_url: str | None) -> postgres_query.QueryLogin:
        """How Query logs in: as the role --query-db-url names (checked, or
        the node does not start), else as the queue's own role, set up now
        if this node's user may; or not at all (501), said in the log."""
        row = self._db.execute("SELECT session_user, current_database()").fetchone()
        assert row is not None
        node_user, database = str(row[0]), str(row[1])
        if query_url is not None:
            given = partial(connect, query_url, application_name=QUERY_APPLICATION)
            user = postgres_query.check_operator_role(given, node_user, database, self.schema)
            log.info("Query logs in to PostgreSQL as %s (--query-db-url)", user)
            return postgres_query.QueryLogin(user, given)
        role = postgres_query.role_name(database, self.schema)
        password = postgres_query.own_role_password(self._db, role, self.schema)
        if password is None:
            log.warning("Query is off (501): %s", postgres_query.NOT_SET_UP)
            return postgres_query.QueryLogin(role, None)
        own = partial(
            connect, self._url, user=role, password=password, application_name=QUERY_APPLICATION
        )
        try:
            _, wrong = postgres_query.problems(own, node_user, database, self.schema)
        except psycopg.Error as error:
            wrong = [f"cannot log in: {str(error).strip()}"]
        if wrong:
            log.warning("Query is off (501): its role %s %s", role, "; ".join(wrong))
            return postgres_query.QueryLogin(
                role, None, postgres_query.UNUSABLE.format(role=role)
            )
        log.info("Query logs in to PostgreSQL as %s", role)
        return postgres_query.QueryLogin(role, own)

    def close(self) -> None:
        self._db.close()

    def stop_waiting_long(self) -> None:
        """A lock wait is bounded by the other node's transaction, and a
        connection attempt by CONNECT_SECONDS; asking what became of a
        COMMIT cut off (`_committed`) stops after STOPPING_OUTCOME_SECONDS."""
        self._stopping = True

    # Statements. Every one goes through _execute, which counts what it
    # changed; a failed statement counts as a change, because in PostgreSQL
    # it spoils the transaction until the savepoint around it is undone.

    def _run(self, statement: str, args: Sequence[Any] = ()) -> psycopg.Cursor[Any]:
        try:
            cursor = self._db.execute(statement, args)
        except psycopg.Error:
            self._changes += 1
            raise
        if cursor.rowcount > 0 and not statement.startswith("SELECT"):
            self._changes += cursor.rowcount
        return cursor

    def _run_many(self, statement: str, args: list[list[Any]]) -> None:
        # psycopg sends them in one pipeline: one round trip for all.
        try:
            with self._db.cursor() as cursor:
                cursor.executemany(statement, args)
        except psycopg.Error:
            self._changes += 1
            raise
        self._changes += max(cursor.rowcount, len(args))

    def _next_ids(self, count: int) -> list[int]:
        # From the column's own sequence: an ID is never handed out twice,
        # whether the insert that takes it commits or not.
        return self._ids(
            "SELECT nextval(pg_get_serial_sequence('jobs', 'jobid')) "
            "FROM generate_series(1, %s) ORDER BY 1",
            (count,),
        )

    def _lock(self, purpose: str, key: str) -> None:
        """A transaction lock on `key` for `purpose`, shared by every node
        on this schema; released at commit or rollback. A row lock on a
        table of the nodes' own (postgres_schema.LOCK_SLOTS says why)."""
        self._execute(
            "SELECT slot FROM jobserver_locks WHERE slot = %s FOR UPDATE",
            (postgres_schema.lock_slot(purpose, key),),
        )

    # Transactions.

    @property
    def total_changes(self) -> int:
        return self._changes

    @property
    def in_transaction(self) -> bool:
        if self._db.closed:
            return False
        return self._db.info.transaction_status in (
            TransactionStatus.INTRANS, TransactionStatus.INERROR,
        )

    def begin(self) -> None:
        if self._db.closed or self._db.broken:
            self._reconnect()
        self._notice = None
        self._kept_keys = {}
        # One round trip for all three (a pipeline): BEGIN; the
        # transaction's ID, known before anything is written, so that a
        # COMMIT whose reply is lost can be asked about (commit); and what
        # another node changed of limits and pauses since the last batch.
        # The ID is taken even if the batch only reads: a transaction that
        # wrote has one anyway, and one that did not costs PostgreSQL a
        # commit record.
        try:
            with self._db.pipeline():
                self._db.execute(b"BEGIN")
                xid = self._db.execute(b"SELECT pg_current_xact_id()::text, pg_backend_pid()")
                flow = self._db.execute(FLOW_CONTROL)
        except psycopg.Error:
            self._changes += 1
            # A pipeline cut off midway can leave the connection in a state
            # psycopg does not call broken ("cannot exit pipeline mode while
            # busy"): the next batch starts on a new one.
            self._db.close()
            raise
        row = xid.fetchone()
        assert row is not None
        self._xid, self._backend = str(row[0]), int(row[1])
        self._set_flow_control(flow.fetchall())

    def try_begin(self) -> bool:
        self.begin()
        return True

    def _reconnect(self) -> None:
        """A new connection at once, unless the last attempt failed less
        than RECONNECT_SECONDS ago: a connection ended alone (its backend
        terminated) costs the next batch a connection, while a PostgreSQL
        out of reach is not hammered."""
        if time.monotonic() < self._retry_at:
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
        self._db = db
        self._lost = False
        log.info("reconnected to %s", self.path)

    def commit(self) -> None:
        """Commit; return only if PostgreSQL committed. A COMMIT cut off
        with its connection may have been carried out: the node asks on a
        new connection (`_committed`) before it says either way."""
        notice, self._notice = self._notice, None
        kept, self._kept_keys = self._kept_keys, {}
        # The idempotency keys, the notice and the commit in one round trip.
        try:
            with self._db.pipeline():
                if kept:
                    self._db.execute(KEEP_KEYS, [list(column) for column in _columns(kept)])
                if notice is not None:
                    self._db.execute("SELECT pg_notify(%s, %s)", (self.channel, notice))
                done = self._db.execute(b"COMMIT")
        except psycopg.Error as error:
            self._changes += 1
            if self._committed(error):
                return
            raise
        if done.statusmessage != "COMMIT":
            # PostgreSQL answers COMMIT of a transaction that an error
            # spoiled with ROLLBACK, not with an error.
            raise psycopg.OperationalError(
                f"the transaction was rolled back instead of committed ({done.statusmessage})"
            )

    def _committed(self, error: psycopg.Error) -> bool:
        """Whether the open transaction committed, after its COMMIT raised
        `error`: the connection is closed (it may be in any state), and
        PostgreSQL is asked on new connections what became of the
        transaction, for up to OUTCOME_SECONDS (STOPPING_OUTCOME_SECONDS once
        the server stops). One still in progress (the
        old connection's backend lives on, cut off from this node) is
        ended first, so that the answer is final. Raises OutcomeUnknown
        when no answer came."""
        xid, backend = self._xid, self._backend
        self._db.close()
        log.warning(
            "COMMIT of transaction %s failed (%s); asking PostgreSQL whether it committed",
            xid, str(error).strip(),
        )
        began = time.monotonic()
        failure = str(error).strip()
        while True:
            try:
                db = connect(self._url)
            except psycopg.Error as connecting:
                failure = str(connecting).strip()
            else:
                try:
                    # A PostgreSQL, or a path to it, that takes the ask and
                    # never answers does not hold it past its time.
                    with cut_off_after(db, ASK_MILLISECONDS / 1000):
                        status = _transaction_status(db, xid, backend)
                except psycopg.Error as asking:
                    failure = str(asking).strip()
                    status = None
                if status in ("committed", "aborted"):
                    self._db, self._lost, self._retry_at = db, False, 0.0
                    log.warning("transaction %s was %s", xid, status)
                    return status == "committed"
                db.close()
            patience = STOPPING_OUTCOME_SECONDS if self._stopping else OUTCOME_SECONDS
            if time.monotonic() + OUTCOME_POLL_SECONDS > began + patience:
                log.error("whether transaction %s committed is unknown: %s", xid, failure)
                raise OutcomeUnknown(
                    f"the connection to PostgreSQL was lost during COMMIT ({failure})"
                )
            time.sleep(OUTCOME_POLL_SECONDS)

    def sync(self) -> None:
        """Commits are durable when COMMIT returns."""

    def checkpoint_if_due(self) -> None:
        """PostgreSQL checkpoints by itself."""

    def rollback(self) -> None:
        self._notice = None
        self._kept_keys = {}
        if self.in_transaction:
            try:
                self._db.execute(b"ROLLBACK")
            except psycopg.Error:
                # Nothing is committed on a connection that cannot roll
                # back; the next batch starts on a new one.
                self._db.close()
                raise
        self._load_flow_control()

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
            self._execute(KEEP_KEYS, [list(column) for column in _columns(kept)])
        return super().prune_idempotency(now, batch)

    async def listen(self, heard: postgres_listen.Heard) -> None:
        await postgres_listen.listen(
            lambda: connect(self._url), self.channel, self.node, heard
        )

    def announce(self, ready: set[str], due: str | None, ended: set[int]) -> None:
        """Tell the other nodes, when this transaction commits, which names
        it made due, the earliest future time it wrote, and which awaited
        jobs it ended (only those: a job nobody awaits adds nothing)."""
        notice: dict[str, Any] = {"node": self.node, "ready": sorted(ready), "due": due}
        if ended:
            notice["ended"] = sorted(ended)
        payload = json.dumps(notice, separators=(",", ":"))
        if len(payload.encode()) > MAX_NOTICE_BYTES:
            # Too long: "anything", which the listeners then look for.
            cut = {"node": self.node, "ready": None, "due": due}
            if ended:
                cut["ended"] = None
            payload = json.dumps(cut)
        # Sent with the COMMIT (see commit).
        self._notice = payload

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
        (postgres_functions.FIND_READY_AFTER_FUNCTION)."""
        exact: list[str] | None = None
        regex: str | None = None
        if any(map(is_glob, patterns)):
            # Each translation is anchored at both ends: a job matching any.
            regex = "|".join(map(glob_to_regex, patterns))
        else:
            exact = list(patterns or names)
        after = passed.after or (None, None, None, None)
        found = self._jobs(
            f"SELECT {JOB} FROM jobserver_find_ready_after"
            "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (
                now, list(priorities_from(priorities, passed.after)), limit, regex, exact,
                sorted(passed.names), [glob_to_regex(held) for held in passed.patterns],
                sorted(pair_text(name, key) for name, key in passed.pairs),
                [glob_to_regex(pattern) for pattern, _ in passed.keyed],
                [key for _, key in passed.keyed],
                *after,
            ),
        )
        return self._found(found)

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

    # Connections of their own, for other threads.

    def prune_pending(self, before: Mapping[str, str], now: str) -> bool:
        with connect(self._url, application_name=READ_APPLICATION) as db:
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

    def run_query(self, text: str, seconds: float, rows: QueryRows) -> None:
        """The client's SQL as Query's own role (postgres_query.py)."""
        postgres_query.run(self._query, self.schema, text, seconds, _AsOnSQLite(rows))

    def queue_stats(self, now: str) -> QueueStats:
        with connect(self._url, application_name=READ_APPLICATION) as db:
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
                ([glob_to_regex(pattern) for pattern in sorted(self.paused)], now),
            ).fetchall():
                if due is not None:
                    oldest[str(queue)] = str(due)
                if count:
                    held[str(queue)] = int(count)
        return counts, oldest, held

    def ready_by_queue(self) -> dict[str, int]:
        with connect(self._url, application_name=READ_APPLICATION) as db:
            return {
                str(queue): int(count)
                for queue, count in db.execute(
                    "SELECT split_part(name, '/', 1) AS queue, COUNT(*) FROM jobs "
                    f"WHERE state IN ({sql.READY_SQL}) GROUP BY queue"
                ).fetchall()
            }

    def running_by_name(self, now: str) -> list[tuple[str, str, int]]:
        with connect(self._url, application_name=READ_APPLICATION) as db:
            rows = db.execute(sql.running_by_name(POSTGRES), (now,)).fetchall()
        return [(str(name), str(key), int(cost)) for name, key, cost in rows]

    def handouts_in_windows(self, windows: Mapping[str, str]) -> dict[str, int]:
        # One snapshot for every window: they are of the same moment.
        with connect(self._url, application_name=READ_APPLICATION) as db, db.transaction():
            db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            return sql.read_windows(
                POSTGRES, windows,
                lambda statement, args: db.execute(statement, args).fetchall(),
            )

    def find_matching(self, pattern: str, limit: int) -> list[Job]:
        with connect(self._url, application_name=READ_APPLICATION) as db:
            rows = db.execute(*sql.find_matching(POSTGRES, pattern, limit)).fetchall()
        return [Job(*row) for row in rows]

    def later_jobs(self, now: str, retrying: bool, limit: int, most: int) -> LaterJobs:
        listed, counted = sql.later_jobs(POSTGRES, now, retrying, limit, most)
        # One snapshot for both: the count is of the same moment.
        with connect(self._url, application_name=READ_APPLICATION) as db, db.transaction():
            db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            jobs = [Job(*row) for row in db.execute(*listed).fetchall()]
            counted_to = int((db.execute(*counted).fetchone() or (0,))[0])
        return LaterJobs(jobs, min(counted_to, most), counted_to <= most)

    def running_jobs(
        self, now: str, pattern: str | None, limit: int, newest: bool = False
    ) -> RunningStats:
        listed, counted = sql.running_jobs(POSTGRES, now, pattern, limit, newest)
        # One snapshot for both: the count is of the same moment.
        with connect(self._url, application_name=READ_APPLICATION) as db, db.transaction():
            db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            jobs = [RunningJob(*row) for row in db.execute(*listed).fetchall()]
            row = db.execute(*counted).fetchone()
        return jobs, int(row[0]) if row else 0

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


@contextmanager
def cut_off_after(db: psycopg.Connection[Any], seconds: float) -> Iterator[None]:
    """Within: the connection's socket is shut down if the block has not
    ended after `seconds`, so that a statement whose answer never comes
    (PostgreSQL hung, or a path that takes requests and drops them)
    fails instead of waiting for good. libpq's own timeouts cover a
    connection attempt and a peer that stops acknowledging, not this."""
    guard = threading.Lock()
    ended = False
    fd = db.pgconn.socket

    def cut() -> None:
        with guard:
            if ended:
                return
            with suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(seconds, cut)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with guard:
            ended = True
        timer.cancel()


# The idempotency keys a transaction kept, written in one statement.
KEEP_KEYS = (
    "INSERT INTO idempotency (idempotencyKey, request, reply, expires) "
    "SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[]) "
    "ON CONFLICT (idempotencyKey) DO UPDATE SET request = excluded.request, "
    "reply = excluded.reply, expires = excluded.expires"
)


def _columns(kept: Mapping[str, tuple[str, str, str]]) -> tuple[tuple[str, ...], ...]:
    """Keys kept, as the four columns KEEP_KEYS takes."""
    rows = [(key, *values) for key, values in kept.items()]
    return tuple(zip(*rows, strict=True))


def _check_version(db: psycopg.Connection[Any], where: str) -> None:
    """A PostgreSQL that has what a node needs: 13 for a transaction's ID as
    xid8 and pg_xact_status, with which a COMMIT cut off is asked about."""
    version = db.info.server_version
    if version < MIN_SERVER_VERSION:
        raise StoreError(
            f"{where} runs PostgreSQL {version // 10000}: jobserver needs "
            f"{MIN_SERVER_VERSION // 10000} or later"
        )


def _transaction_status(db: psycopg.Connection[Any], xid: str, backend: int) -> str | None:
    """What PostgreSQL says of transaction `xid`: committed, aborted, or
    None while it is in progress. A transaction in progress is the node's
    own, on a backend its lost connection left behind: that backend is
    terminated (end_own_backend), so the next ask gets a final answer;
    unless it waits for a synchronous standby to confirm its commit, which
    a termination would leave committed here and not on the standby."""
    row = db.execute("SELECT pg_xact_status(%s::xid8)", (xid,)).fetchone()
    status = None if row is None else row[0]
    if status in ("committed", "aborted"):
        return str(status)
    end_own_backend(db, xid, backend, unless_waiting="SyncRep")
    return None


def end_own_backend(
    db: psycopg.Connection[Any], xid: str, backend: int, unless_waiting: str = ""
) -> None:
    """Terminate `backend` if it still runs transaction `xid`, the node's
    own (a backend's process ID is reused, a transaction ID is not), and
    does not wait on `unless_waiting`."""
    db.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE pid = %s AND backend_xid::text = (%s::xid8::text::bigint %% 4294967296)::text "
        "AND wait_event IS DISTINCT FROM %s",
        (backend, xid, unless_waiting or None),
    )


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
