"""How a PostgreSQL node's batch begins (postgres.PostgresStore.begin):
BEGIN, the statement prepared for it (postgres_commit.BEGIN: the
transaction's ID, and the limits and pauses other nodes left), at most
once a second whether the node is alone (postgres_alone.py), and, for a
batch of waiters' tries, its first try's savepoint, in one query; begun
again on a new connection if the one it had was lost while idle."""

from __future__ import annotations

import logging
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.pq import TransactionStatus

from jobserver.storage import postgres_commit
from jobserver.storage.postgres_alone import Company
from jobserver.storage.postgres_statements import PostgresStatements

log = logging.getLogger("jobserver")


class PostgresBegin(PostgresStatements):
    """The begin of PostgresStore's transactions."""

    _company: Company
    _xid: str
    _backend: int
    _prepared_on: psycopg.Connection[Any] | None
    _notice: object | None
    _kept_keys: dict[str, tuple[str, str, str]]

    if TYPE_CHECKING:
        # PostgresStore's, and sql_flow.FlowStatements'.
        def _reconnect(self) -> None: ...

        def _set_flow_control(self, rows: list[tuple[Any, ...]]) -> None: ...

    @property
    def in_transaction(self) -> bool:
        if self._db.closed:
            return False
        return self._db.info.transaction_status in (
            TransactionStatus.INTRANS, TransactionStatus.INERROR,
        )

    def begin(self, savepoint: bool = False) -> None:
        self._notice = None
        self._kept_keys = {}
        self._released = None
        self._unsent = []
        for _ in range(2):
            new = self._db.closed or self._db.broken
            if new:
                self._reconnect()
            try:
                self._begin_on_connection(savepoint)
                return
            except psycopg.Error as error:
                self._changes += 1
                # A query cut off midway can leave the connection in a state
                # psycopg does not call broken: it is not used again.
                self._db.close()
                if new:
                    raise
                # Lost while it was idle (a writer no batch used while the
                # database was away): nothing of the batch has run, so it
                # begins again on a new connection.
                log.info("a transaction could not begin (%s); beginning it on a new connection",
                         error)

    def _begin_on_connection(self, savepoint: bool) -> None:
        # One round trip for BEGIN and what the batch needs to know first:
        # the transaction's ID, known before anything is written, so that a
        # COMMIT whose reply is lost can be asked about (commit); and what
        # another node changed of limits and pauses since the last batch.
        # The ID is taken even if the batch only reads: a transaction that
        # wrote has one anyway, and one that did not costs PostgreSQL a
        # commit record. One query (no parameters: the simple protocol),
        # whose results come one after the other: as a pipeline it took
        # twice the node's CPU, and every batch begins.
        # And, at most once a second, whether any other session is on the
        # database (postgres_alone.py). And the savepoint a batch's first
        # work runs in, if it runs in one (a batch of waiters' tries): a
        # round trip of its own was a tenth of a wake across nodes.
        if self._prepared_on is not self._db:
            self._prepare_statements()
        company = self._company
        now = time.monotonic()
        looking = company.look_due(now)
        begin = postgres_commit.BEGIN + b"; " + company.look() if looking else postgres_commit.BEGIN
        if savepoint:
            begin += postgres_commit.SAVEPOINT
        results = self._db.execute(begin)
        results.nextset()
        self._xid, self._backend, flow = postgres_commit.began(results.fetchall())
        self._set_flow_control(flow)
        if looking:
            results.nextset()
            seen = results.fetchone()
            company.saw(seen is None or bool(seen[0]), now)

    def _prepare_statements(self) -> None:
        """The begin's and the next due time's statements
        (postgres_commit.PREPARE) prepared on this connection: on a new one,
        and after a rollback, whose ROLLBACK status psycopg answers by
        deallocating every prepared statement of the session (DEALLOCATE
        ALL) if it has prepared any of its own. Prepared and deallocated
        together, they are both there or neither: a PREPARE outside a
        transaction that finds the first there fails alone, and both are
        used as they are."""
        with suppress(psycopg.errors.DuplicatePreparedStatement):
            self._db.execute(postgres_commit.PREPARE, prepare=False)
        self._prepared_on = self._db

    def try_begin(self) -> bool:
        self.begin()
        return True
