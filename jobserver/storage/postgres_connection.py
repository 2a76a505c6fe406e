"""A node's connections to PostgreSQL, and what it does when one goes dead.

How a connection is made (libpq settings that notice a PostgreSQL gone
quiet within seconds) and named (pg_stat_activity), its URL as logs show
it, the oldest PostgreSQL a node runs on, a statement cut off when its
answer never comes, and the one question a lost connection leaves that
matters: whether the COMMIT it was carrying was carried out. The store
(postgres.py) holds the connection and its transaction; the readers
(postgres_readers.py) and Query open connections of their own here.
Apart from the store so that these can be read, and tested, alone.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from jobserver.storage.interface import OutcomeUnknown
from jobserver.storage.sqlite_schema import StoreError

log = logging.getLogger("jobserver")

# The oldest PostgreSQL a node runs on (as server_version_num).
MIN_SERVER_VERSION = 130000

# How long a connection attempt may take.
CONNECT_SECONDS = 3
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


# What the node's SQL assumes of each of its sessions, whatever the URL or
# the database's defaults say: texts exchanged in UTF8 (on a SQL_ASCII
# database psycopg would hand them back as bytes, and the node could not
# start), and a backslash in a literal taken as it is (the schema's
# functions hold some; with standard_conforming_strings off, the node could
# not make them).
SESSION_ENCODING = "UTF8"
SESSION_OPTIONS = "-c standard_conforming_strings=on"


def connect(url: str, **overrides: str) -> psycopg.Connection[Any]:
    """A connection to `url`, with libpq settings of `overrides` (such as
    another user) taking the place of the URL's; the URL's own `options`
    are kept, SESSION_OPTIONS after them."""
    given = conninfo_to_dict(url)
    settings = {
        **CONNECTION_DEFAULTS,
        **{k: str(v) for k, v in given.items() if v is not None},
        **overrides,
    }
    settings["client_encoding"] = SESSION_ENCODING
    settings["options"] = f"{settings.get('options', '')} {SESSION_OPTIONS}".strip()
    return psycopg.connect(make_conninfo("", **settings), autocommit=True)


def check_version(db: psycopg.Connection[Any], where: str) -> None:
    """A PostgreSQL that has what a node needs: 13 for a transaction's ID as
    xid8 and pg_xact_status, with which a COMMIT cut off is asked about."""
    version = db.info.server_version
    if version < MIN_SERVER_VERSION:
        raise StoreError(
            f"{where} runs PostgreSQL {version // 10000}: jobserver needs "
            f"{MIN_SERVER_VERSION // 10000} or later"
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


def committed(
    url: str, xid: str, backend: int, error: psycopg.Error, stopping: Callable[[], bool]
) -> tuple[bool, psycopg.Connection[Any]]:
    """Whether transaction `xid`, on `backend`, committed, after its COMMIT
    raised `error` (its connection, which may be in any state, is closed):
    PostgreSQL is asked on new connections to `url` what became of the
    transaction, for up to OUTCOME_SECONDS (STOPPING_OUTCOME_SECONDS once
    the server stops). One still in progress (the
    old connection's backend lives on, cut off from this node) is
    ended first, so that the answer is final. The answer comes with the
    connection that gave it, for the store to go on with. Raises
    OutcomeUnknown when no answer came."""
    log.warning(
        "COMMIT of transaction %s failed (%s); asking PostgreSQL whether it committed",
        xid, str(error).strip(),
    )
    began = time.monotonic()
    failure = str(error).strip()
    while True:
        try:
            db = connect(url)
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
                log.warning("transaction %s was %s", xid, status)
                return status == "committed", db
            db.close()
        patience = STOPPING_OUTCOME_SECONDS if stopping() else OUTCOME_SECONDS
        if time.monotonic() + OUTCOME_POLL_SECONDS > began + patience:
            log.error("whether transaction %s committed is unknown: %s", xid, failure)
            raise OutcomeUnknown(
                f"the connection to PostgreSQL was lost during COMMIT ({failure})"
            )
        time.sleep(OUTCOME_POLL_SECONDS)


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
