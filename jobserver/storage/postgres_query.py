"""Query on PostgreSQL: the client's SQL, on a connection that logs in as a
role of its own, one statement, within its time and its reply bound.

What holds it there is PostgreSQL's, not the text's:

- The connection logs in as the queue's Query role (not SET ROLE, which a
  statement can undo with set_config): LOGIN, NOSUPERUSER, NOCREATEDB,
  NOCREATEROLE, NOINHERIT, NOREPLICATION, NOBYPASSRLS, a member of no role,
  with a CONNECTION LIMIT, USAGE on the queue's schema and SELECT on its
  job tables. It cannot read server files, run programs, signal the nodes'
  backends or read another queue's schema. One role per queue (database and
  schema); the node creates it at start when its own database user may
  create roles, with a random password kept in the schema where only the
  nodes' user can read it. Otherwise the operator names a role of their
  own (--query-db-url), checked at start; until then Query answers 501.
- One statement: the extended query protocol, which PostgreSQL refuses to
  split (`SELECT 1; DELETE ...` is an error, not two statements).
- A READ ONLY transaction that is rolled back, never committed, on a
  connection closed after each Query: nothing the statement did (a NOTIFY,
  a large object, a session advisory lock) outlives it.
- The node's own clock: a thread cancels the statement on the server at
  --query-timeout (and again until it has stopped), whatever the statement
  set; statement_timeout is only a backstop for a node that cannot reach
  PostgreSQL to cancel.
- Its temporary files: the role's temp_file_limit (QUERY_TEMP_FILE_LIMIT),
  set on it by a node whose user is a superuser; the role's sessions can
  neither raise nor reset it. A node that may only create roles cannot
  set it, and says so: the operator sets it (SECURITY.md).
- The reply's bound: each row is measured by PostgreSQL before it is sent
  (jobserver_query_row_fits), so no row larger than the whole reply may be
  reaches the node, and rows come one at a time (single-row mode).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import ExecStatus

from jobserver.storage import postgres_schema
from jobserver.storage.postgres_schema import JOB_TABLES, ident
from jobserver.storage.reader_types import (
    BadQuery,
    QueryRows,
    QueryTimeout,
    QueryUnavailable,
    ReplyTooLarge,
)
from jobserver.storage.sqlite_schema import StoreError

log = logging.getLogger("jobserver")

# The Query role's connections at once, on every node together: 4 at a time
# per node (core/commands/dispatch.QUERY_THREADS), for up to 16 nodes.
QUERY_ROLE_CONNECTIONS = 64
ROLE_PREFIX = "jobserver_query_"
# The temporary files one Query statement may write (a sort or a hash past
# work_mem): a sort of random text wrote 1.8 GB on SQLite before its
# timeout, and the role's 64 connections at this bound are 16 GB at most
# of the disk the database writes to. As much as SQLite's Query process may
# hold in memory (192 MiB at the default --max-reply-bytes), rounded up.
QUERY_TEMP_FILE_LIMIT = "256MB"
# How often a statement past its time is cancelled again, until it stops.
CANCEL_AGAIN_SECONDS = 0.25
# How long one cancel request may take to reach PostgreSQL.
CANCEL_SECONDS = 3.0

NOT_SET_UP = (
    "Query needs a PostgreSQL role of its own: start the server as a database user "
    "that may create roles, or with --query-db-url (docs/nodes.md, Query's own role)"
)
UNUSABLE = (
    "Query's PostgreSQL role {role} cannot log in, or may do more than read (the server's "
    "log says why): fix it, or start the server with --query-db-url "
    "(docs/nodes.md, Query's own role)"
)

# Opens a connection for Query, logged in as its role.
Connect = Callable[[], "psycopg.Connection[Any]"]


def role_name(database: str, schema: str) -> str:
    """The Query role of the queue in `schema` of `database`: roles belong
    to the whole cluster, so the name tells every queue of it apart, and
    fits PostgreSQL's 63 bytes whatever the names are."""
    digest = hashlib.sha256(f"{database}\0{schema}".encode()).hexdigest()
    return ROLE_PREFIX + digest[:24]


@dataclass(frozen=True)
class QueryLogin:
    """How Query connects (`connect`), or, when it cannot, the status text
    that says how to enable it."""

    role: str
    connect: Connect | None
    unavailable: str = NOT_SET_UP


# Setting up the queue's own role (when the nodes' user may create roles).


def own_role_password(db: psycopg.Connection[Any], role: str, schema: str) -> str | None:
    """Create or bring up to date the Query role of this queue, under the
    schema's migration lock, so that every node finds it as the first one
    made it; its password, or None when this node may not manage roles and
    finds no password kept by one that could."""
    with postgres_schema.migration_lock(db):
        kept = _kept_password(db)
        if not _may_manage_roles(db):
            return kept
        try:
            with db.transaction():
                password = kept or _keep_new_password(db)
                _create_or_alter(db, role, password)
                _grant_only_reads(db, role, schema)
                _bound_temporary_files(db, role)
        except psycopg.errors.InsufficientPrivilege as error:
            log.warning("cannot set up Query's role %s: %s", role, str(error).strip())
            return kept
        return password


def _kept_password(db: psycopg.Connection[Any]) -> str | None:
    try:
        with db.transaction():
            row = db.execute("SELECT password FROM jobserver_query_login LIMIT 1").fetchone()
    except psycopg.errors.InsufficientPrivilege:
        return None
    return str(row[0]) if row else None


def _may_manage_roles(db: psycopg.Connection[Any]) -> bool:
    row = db.execute(
        "SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user"
    ).fetchone()
    return bool(row and row[0])


def _keep_new_password(db: psycopg.Connection[Any]) -> str:
    password = secrets.token_urlsafe(32)
    db.execute("INSERT INTO jobserver_query_login (password) VALUES (%s)", (password,))
    return password


def _create_or_alter(db: psycopg.Connection[Any], role: str, password: str) -> None:
    # The password goes to PostgreSQL as a SCRAM verifier computed here, so
    # it is in no statement a server log could show; SCRAM also serves
    # pg_hba's md5 method.
    verifier = db.pgconn.encrypt_password(password.encode(), role.encode(), b"scram-sha-256")
    exists = db.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
    attributes = sql.SQL(
        "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOREPLICATION NOBYPASSRLS "
        "CONNECTION LIMIT {} PASSWORD {} VALID UNTIL 'infinity'"
    ).format(sql.Literal(QUERY_ROLE_CONNECTIONS), sql.Literal(verifier.decode()))
    verb = sql.SQL("ALTER ROLE" if exists else "CREATE ROLE")
    db.execute(sql.SQL("{} {} ").format(verb, sql.Identifier(role)) + attributes)
    groups = db.execute(
        "SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid "
        "JOIN pg_roles r ON r.oid = m.member WHERE r.rolname = %s",
        (role,),
    ).fetchall()
    for (group,) in groups:
        db.execute(
            sql.SQL("REVOKE {} FROM {}").format(sql.Identifier(group), sql.Identifier(role))
        )


def _grant_only_reads(db: psycopg.Connection[Any], role: str, schema: str) -> None:
    statements = (
        "REVOKE ALL ON SCHEMA {schema} FROM {role}",
        "GRANT USAGE ON SCHEMA {schema} TO {role}",
        "REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {role}",
        "REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {role}",
        "GRANT SELECT ON {tables} TO {role}",
    )
    tables = sql.SQL(", ").join(sql.Identifier(schema, table) for table in JOB_TABLES)
    for statement in statements:
        db.execute(
            sql.SQL(statement).format(
                schema=sql.Identifier(schema), role=sql.Identifier(role), tables=tables
            )
        )


def _bound_temporary_files(db: psycopg.Connection[Any], role: str) -> None:
    """Set temp_file_limit on the role, read at each of its logins. It is a
    superuser's setting: only a superuser may set it on a role (CREATEROLE
    is not enough), and for the same reason the role's sessions can neither
    SET, set_config nor RESET it (checked on PostgreSQL 15)."""
    limit = sql.SQL("ALTER ROLE {} SET temp_file_limit = {}").format(
        sql.Identifier(role), sql.Literal(QUERY_TEMP_FILE_LIMIT)
    )
    try:
        with db.transaction():  # a savepoint: the rest of the set-up stays
            db.execute(limit)
    except psycopg.errors.InsufficientPrivilege:
        if _has_temp_file_limit(db, role):
            return  # an operator's
        log.warning(
            "cannot bound the temporary files of Query's role %s (only a superuser may): "
            "a database superuser should run ALTER ROLE %s SET temp_file_limit = '%s'",
            role, role, QUERY_TEMP_FILE_LIMIT,
        )


def _has_temp_file_limit(db: psycopg.Connection[Any], role: str) -> bool:
    row = db.execute(
        "SELECT EXISTS (SELECT FROM pg_roles r, unnest(r.rolconfig) c "
        "WHERE r.rolname = %s AND c LIKE 'temp\\_file\\_limit=%%')",
        (role,),
    ).fetchone()
    return bool(row and row[0])


# Checking the role a Query connection logs in as.


def problems(connect: Connect, node_user: str, database: str, schema: str) -> tuple[str, list[str]]:
    """The role Query logs in as, and what is wrong with it: anything that
    lets it do more than read the queue's job tables (empty if nothing)."""
    with connect() as db:
        row = db.execute(
            "SELECT current_user, current_database(), rolsuper, rolcreaterole, rolcreatedb, "
            "rolreplication, rolbypassrls, ARRAY(SELECT g.rolname::text FROM pg_auth_members m "
            "JOIN pg_roles g ON g.oid = m.roleid WHERE m.member = r.oid ORDER BY 1), "
            "has_schema_privilege(%s, 'USAGE') FROM pg_roles r WHERE rolname = current_user",
            (schema,),
        ).fetchone()
        assert row is not None
        user, at, superuser, createrole, createdb, replication, bypassrls, groups, usage = row
        found = [
            text
            for wrong, text in (
                (user == node_user, "is the server's own database user"),
                (superuser, "is a superuser"),
                (createrole, "may create roles (CREATEROLE)"),
                (createdb, "may create databases (CREATEDB)"),
                (replication, "has REPLICATION"),
                (bypassrls, "has BYPASSRLS"),
                (bool(groups), f"is a member of {', '.join(groups)}, whose rights it can take"),
                (at != database, f"connects to the database {at}, not {database}"),
                (not usage, f"has no USAGE on the schema {schema}"),
            )
            if wrong
        ]
        for table in JOB_TABLES:
            name = f"{ident(schema)}.{ident(table)}"
            reads, writes = db.execute(
                "SELECT has_table_privilege(%s, 'SELECT'), has_table_privilege(%s, "
                "'INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER')",
                (name, name),
            ).fetchone() or (False, False)
            if not reads:
                found.append(f"cannot read {schema}.{table}")
            if writes:
                found.append(f"may change {schema}.{table}")
    return str(user), found


def check_operator_role(connect: Connect, node_user: str, database: str, schema: str) -> str:
    """The role named by --query-db-url, once it is known to log in and to
    be fit for Query; else StoreError, saying what is wrong."""
    try:
        user, wrong = problems(connect, node_user, database, schema)
    except psycopg.Error as error:
        raise StoreError(f"--query-db-url cannot log in: {str(error).strip()}") from error
    if wrong:
        raise StoreError(
            f"--query-db-url must name a role that can only read the queue's tables, "
            f"but {user} " + "; ".join(wrong) + f" (create a LOGIN role that is a member "
            f"of no other, GRANT it USAGE ON SCHEMA {schema} and SELECT ON "
            + ", ".join(JOB_TABLES) + "; docs/nodes.md, Query's own role)"
        )
    return user


# Running one Query.


def run(login: QueryLogin, schema: str, text: str, seconds: float, rows: QueryRows) -> None:
    """Run the client's SQL (`text`, ending in `;`) as Query's role."""
    if login.connect is None:
        raise QueryUnavailable(login.unavailable)
    db = login.connect()
    watchdog = _Watchdog(db, seconds)
    try:
        _run(db, schema, text, seconds, rows)
    except psycopg.Error as error:
        if watchdog.fired or isinstance(error, psycopg.errors.QueryCanceled):
            raise QueryTimeout() from error
        if error.sqlstate == postgres_schema.ROW_TOO_LARGE:
            raise ReplyTooLarge(rows.max_bytes) from error
        if db.broken:
            raise
        raise BadQuery(str(error).strip()) from error
    finally:
        watchdog.stop()
        db.close()


def _run(
    db: psycopg.Connection[Any], schema: str, text: str, seconds: float, rows: QueryRows
) -> None:
    if "\x00" in text:
        # libpq would end the text there, and the wrapper with it.
        raise BadQuery("the query contains a null character")
    statement = text.rstrip()
    while statement.endswith(";"):
        statement = statement[:-1].rstrip()
    # A backstop, for a node cut off from PostgreSQL that cannot cancel.
    backstop_ms = int((2 * seconds + 1) * 1000)
    db.execute(b"BEGIN READ ONLY")
    db.execute(
        "SELECT set_config('search_path', %s, true), set_config('statement_timeout', %s, true)",
        (ident(schema), str(backstop_ms)),
    )
    rows.start(_columns(db, statement))
    bounded = _bounded(statement, schema, rows.max_bytes).encode(db.info.encoding)
    for row in db.cursor().stream(bounded):
        rows.add(row)
    db.execute(b"ROLLBACK")


def _columns(db: psycopg.Connection[Any], statement: str) -> list[str]:
    """The statement's column names, from PostgreSQL's parse of it alone as
    one prepared statement: a text that is not exactly one statement is
    refused here, before it is wrapped (_bounded)."""
    encoding = db.info.encoding
    try:
        command = statement.encode(encoding)
    except UnicodeEncodeError as error:
        raise BadQuery(f"the query is not valid {encoding}") from error
    prepared = db.pgconn.prepare(b"", command)
    if prepared.status != ExecStatus.COMMAND_OK:
        raise psycopg.errors.error_from_result(prepared, encoding=encoding)
    described = db.pgconn.describe_prepared(b"")
    if described.status != ExecStatus.COMMAND_OK:
        raise psycopg.errors.error_from_result(described, encoding=encoding)
    return [(described.fname(i) or b"").decode(encoding) for i in range(described.nfields)]


def _bounded(statement: str, schema: str, max_bytes: int) -> str:
    """The statement as a subquery whose every row PostgreSQL measures
    before it sends it. Since the statement parsed alone as exactly one
    (_columns), its tokens are balanced and it is exactly the subquery: the
    outer query returns its rows and nothing else. (The newline ends a
    `--` comment at its end.)"""
    return (
        f"SELECT jobserver_query.* FROM (\n{statement}\n) AS jobserver_query "
        f"WHERE {ident(schema)}.jobserver_query_row_fits("
        f"pg_catalog.octet_length(jobserver_query.*::text), {int(max_bytes)})"
    )


class _Watchdog:
    """Cancels the connection's statement on the server once `seconds`
    have passed, and again every CANCEL_AGAIN_SECONDS until stopped: a
    cancel that arrives between two statements is not the last."""

    def __init__(self, db: psycopg.Connection[Any], seconds: float) -> None:
        self.fired = False
        self._db = db
        self._seconds = seconds
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="query-timeout", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._stopped.wait(self._seconds):
            return
        self.fired = True
        while True:
            with suppress(psycopg.Error):
                self._db.cancel_safe(timeout=CANCEL_SECONDS)
            if self._stopped.wait(CANCEL_AGAIN_SECONDS):
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
