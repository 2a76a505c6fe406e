"""What a PostgreSQL node sends to begin and to commit a batch, each in
one round trip (postgres.PostgresStore.begin and commit): the begin's
statement, prepared on the connection; with the COMMIT, the idempotency
keys the batch kept, the notice the other nodes hear, and the next due
time a batch of waiters' tries reads (`send_commit`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.sql import SQL, Identifier, Literal

from jobserver.storage.sql_clock import next_due_statement
from jobserver.storage.sql_flow import flow_control

# A batch's begin: its transaction, then one statement for the
# transaction's ID and backend (the one row whose first column is not
# NULL) and the limits and pauses as other nodes left them (the rest,
# sql_flow.flow_control's columns after two NULLs). The statement is
# prepared on the connection (PREPARE; postgres.PostgresStore.
# _prepare_statements says when): planned again in every simple query, as
# the two statements it replaced were, it cost PostgreSQL 133 µs of CPU a
# batch more than a bare BEGIN, against 33 (bench/pg_begin.py), and every
# batch begins.
BEGIN_STATEMENT = "jobserver_begin"
# The next due time (sql_clock.next_due_statement), read in the COMMIT's
# query of a batch that served waiters (commit_reading_next_due): prepared
# beside the begin's, for the same reason.
NEXT_DUE_STATEMENT = "jobserver_next_due"
PREPARE = (
    f"PREPARE {BEGIN_STATEMENT} AS "
    "SELECT pg_current_xact_id()::text, pg_backend_pid(), NULL, NULL, NULL, NULL, NULL, NULL "
    f"UNION ALL {flow_control('NULL, NULL, ')}; "
    f"PREPARE {NEXT_DUE_STATEMENT}(text) AS {next_due_statement('$1')}"
).encode()
BEGIN = f"BEGIN; EXECUTE {BEGIN_STATEMENT}".encode()
# What a begin that opens the first work's savepoint too adds
# (sql_statements.Statements.savepoint's name).
SAVEPOINT = b'; SAVEPOINT "request"'


def read_next_due(db: psycopg.Connection[Any], after: str) -> bytes:
    """The query that reads the next due time after `after` (a time the
    node wrote, quoted as a literal all the same)."""
    return SQL("EXECUTE {}({})").format(Identifier(NEXT_DUE_STATEMENT), Literal(after)).as_bytes(db)


def began(rows: list[tuple[Any, ...]]) -> tuple[str, int, list[tuple[Any, ...]]]:
    """BEGIN's rows as the transaction's ID, its backend's process ID, and
    the rows of sql_flow.FLOW_CONTROL."""
    xid, backend = "", 0
    flow: list[tuple[Any, ...]] = []
    for row in rows:
        if row[0] is None:
            flow.append(row[2:])
        else:
            xid, backend = str(row[0]), int(row[1])
    if not xid:
        raise psycopg.OperationalError("the transaction's ID is missing from its begin")
    return xid, backend, flow


# The idempotency keys a transaction kept, written in one statement.
KEEP_KEYS = (
    "INSERT INTO idempotency (idempotencyKey, request, reply, expires) "
    "SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[]) "
    "ON CONFLICT (idempotencyKey) DO UPDATE SET request = excluded.request, "
    "reply = excluded.reply, expires = excluded.expires"
)

# The longest NOTIFY payload PostgreSQL takes is 8000 bytes; past this the
# notice says "anything may be ready" instead of listing names.
MAX_NOTICE_BYTES = 7000

# The quote of a dollar-quoted string (notify_and_commit).
_DOLLAR = "$jobserver$"


def kept_rows(kept: Mapping[str, tuple[str, str, str]]) -> list[list[str]]:
    """Keys kept (key -> request, reply, expires), as the four columns
    KEEP_KEYS takes."""
    rows = [(key, *values) for key, values in kept.items()]
    return [list(column) for column in zip(*rows, strict=True)]


def notice(node: str, ready: set[str], due: str | None, ended: set[int]) -> str:
    """The notice of a commit: which names it made due, the earliest future
    time it wrote, and which awaited jobs it ended; "anything" (null) in
    place of a list that would not fit, which the listeners then look for."""
    told: dict[str, Any] = {"node": node, "ready": sorted(ready), "due": due}
    if ended:
        told["ended"] = sorted(ended)
    payload = json.dumps(told, separators=(",", ":"))
    if len(payload.encode()) <= MAX_NOTICE_BYTES:
        return payload
    cut: dict[str, Any] = {"node": node, "ready": None, "due": due}
    if ended:
        cut["ended"] = None
    return json.dumps(cut)


def notify_and_commit(db: psycopg.Connection[Any], channel: str, notice: str) -> bytes:
    """`notice` sent on `channel`, then COMMIT, as one query. Both are
    dollar-quoted: taken as they are, with no escapes whatever the server's
    settings, and no Python work a character. ASCII (notice's JSON escapes
    the rest) reads the same in every client encoding. A text with a `$`
    (a job name can hold one), which could end the quote, is quoted by
    psycopg as a literal instead."""
    text = notice + channel
    if text.isascii() and "$" not in text:
        return (
            f"SELECT pg_notify({_DOLLAR}{channel}{_DOLLAR}, {_DOLLAR}{notice}{_DOLLAR}); COMMIT"
        ).encode()
    query = SQL("SELECT pg_notify({}, {}); COMMIT").format(Literal(channel), Literal(notice))
    return query.as_bytes(db)


def send_commit(
    db: psycopg.Connection[Any],
    channel: str,
    kept: Mapping[str, tuple[str, str, str]],
    notice: str | None,
    after: str | None,
    writes: list[str],
) -> tuple[str, str | None]:
    """COMMIT the open transaction in one round trip with the `writes` not
    sent yet (statements with their values in them), the idempotency
    keys it `kept`, its `notice` on `channel`, and, if `after` is given,
    the next due time after it read first (an EXECUTE of the statement
    PREPARE made): a pipeline where keys were kept (the writes then sent
    before it, a pipeline carrying one statement a query), else one query
    (the simple protocol, the notice a literal), at half the node's CPU. The
    COMMIT's status (ROLLBACK for a transaction an error spoiled) and the
    time read. COMMIT is never prepared (psycopg prepares a statement run
    five times, its Parse sent and answered before its Execute goes): each
    COMMIT is one message set that holds its text, which the tests' relay
    looks for to cut a connection at its COMMIT."""
    read = None if after is None else read_next_due(db, after)
    # The writes' values were quoted for the connection's encoding.
    encoding = db.info.encoding
    if kept and writes:
        db.execute("; ".join(writes).encode(encoding), prepare=False)
        writes = []
    if kept:
        with db.pipeline():
            db.execute(KEEP_KEYS, kept_rows(kept))
            if notice is not None:
                db.execute("SELECT pg_notify(%s, %s)", (channel, notice))
            due_read = None if read is None else db.execute(read, prepare=False)
            done = db.execute(b"COMMIT", prepare=False)
        due = None if due_read is None else _due(due_read.fetchone())
        return done.statusmessage or "", due
    query = b"COMMIT" if notice is None else notify_and_commit(db, channel, notice)
    due = None
    if read is not None:
        query = read + b"; " + query
    if writes:
        query = "; ".join(writes).encode(encoding) + b"; " + query
    done = db.execute(query, prepare=False)
    for _ in writes:
        done.nextset()
    if read is not None:
        due = _due(done.fetchone())
        done.nextset()
    if notice is not None:
        done.nextset()
    return done.statusmessage or "", due


def _due(row: tuple[Any, ...] | None) -> str | None:
    """The next due time in the row read_next_due's query returned."""
    return None if row is None or row[0] is None else str(row[0])
