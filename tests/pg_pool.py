"""Schemas kept for the next test: each test process keeps the schemas its
tests have finished with, emptied, and gives them to its next tests, in
place of a new schema each (pg.fresh_schema), whose creation, migration by
the first node and drop cost some 0.6 s a test where emptying costs some
0.05 s.

A schema given out holds jobserver's tables at the current version, with
no rows, its job IDs starting at 1 again, and no Query role: what a fresh
schema is once a node has migrated it, except that the node that starts
on it finds the migration done. Tests that need an empty schema (a first
node's migration, an older version, tables that are not jobserver's) ask
for pg.fresh_schema. A schema whose shape a test changed (a table, a
column, an index, a function, a privilege, the schema version), or that
cannot be emptied, is dropped rather than kept.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import pg
import psycopg

from jobserver.storage import postgres_query
from jobserver.storage.postgres import PostgresStore

# Tables whose rows belong to the schema, not to a test: the version, and
# the nodes' lock rows.
KEPT_TABLES = frozenset({"jobserver_schema", "jobserver_locks"})
# A table this large (with its indexes) is truncated, a smaller one has
# its rows deleted (a TRUNCATE of the eight tables cost 0.5 s, a DELETE of
# their few rows 0.05 s). The rows deleted stay in the table's pages until
# it grows past this (the CI machine's PostgreSQL runs no autovacuum), so a
# test never searches more than this many dead rows of earlier tests; an
# empty jobs table with its indexes is some 0.2 MB.
TRUNCATE_ABOVE_BYTES = 1 << 20
# How long emptying waits for a lock before the schema is given up: a
# session of the test still open would otherwise hold the next test.
LOCK_TIMEOUT = "5s"

# Everything about a schema that a test could change and emptying does not
# undo, as one digest: its objects with their owners and privileges, the
# tables' columns, constraints, indexes and triggers, the functions' text,
# default privileges, the kept tables' rows, and the planner's statistics
# (a test's ANALYZE or VACUUM of many rows would change the plans of the
# next test's queries): its tables' row estimates, which either sets, not
# their indexes', which a TRUNCATE resets too.
SHAPE = """
SELECT md5(concat_ws('|',
  (SELECT nspowner::text || coalesce(nspacl::text, '') FROM pg_namespace WHERE oid = s.oid),
  (SELECT string_agg(concat_ws(':', relname, relkind, relowner, relacl,
                               CASE WHEN relkind = 'r' THEN reltuples END),
                     ',' ORDER BY relname)
     FROM pg_class WHERE relnamespace = s.oid),
  (SELECT count(*) FROM pg_statistic st JOIN pg_class c ON c.oid = st.starelid
     WHERE c.relnamespace = s.oid),
  (SELECT string_agg(concat_ws(':', c.relname, a.attname, format_type(a.atttypid, a.atttypmod),
                               a.attnotnull, pg_get_expr(d.adbin, d.adrelid), a.attacl),
                     ',' ORDER BY c.relname, a.attnum)
     FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
     LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
     WHERE c.relnamespace = s.oid AND a.attnum > 0 AND NOT a.attisdropped),
  (SELECT string_agg(pg_get_constraintdef(oid), ',' ORDER BY conname)
     FROM pg_constraint WHERE connamespace = s.oid),
  (SELECT string_agg(pg_get_indexdef(i.indexrelid), ',' ORDER BY 1)
     FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid WHERE c.relnamespace = s.oid),
  (SELECT string_agg(t.tgname, ',' ORDER BY t.tgname)
     FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
     WHERE c.relnamespace = s.oid AND NOT t.tgisinternal),
  (SELECT string_agg(concat_ws(':', pg_get_functiondef(oid), proowner, proacl), ','
                     ORDER BY proname, oid)
     FROM pg_proc WHERE pronamespace = s.oid),
  (SELECT string_agg(defaclacl::text, ',' ORDER BY 1)
     FROM pg_default_acl WHERE defaclnamespace = s.oid),
  (SELECT string_agg(version::text, ',') FROM {schema}.jobserver_schema),
  (SELECT count(*)::text || ':' || sum(slot)::text FROM {schema}.jobserver_locks)
))
FROM pg_namespace s WHERE s.nspname = %s
"""


@dataclass
class _Schema:
    name: str
    url: str
    # The tables a test writes rows to, and the sequences of their IDs.
    tables: tuple[str, ...]
    sequences: tuple[str, ...]
    # SHAPE as the schema was made.
    shape: str


# This process's schemas that no test holds (each xdist worker is a
# process, so each has its own).
_idle: list[_Schema] = []
# This process's connection for the pool's own statements, kept from test
# to test: a connection made and closed cost PostgreSQL some 10 ms of CPU
# (its backend's start and end), and a test on PostgreSQL made three.
_kept: psycopg.Connection | None = None


@contextlib.contextmanager
def _connection() -> Iterator[psycopg.Connection]:
    """The kept connection (autocommit), made at first use and again when
    it no longer answers (a test may end other sessions); closed on an
    error, so that the next use starts from a new one."""
    global _kept
    if _kept is not None:
        try:
            _kept.execute(b"SELECT 1")
        except psycopg.Error:
            _kept.close()
            _kept = None
    if _kept is None:
        _kept = psycopg.connect(pg.database_url(), autocommit=True)
    try:
        yield _kept
    except BaseException:
        _kept.close()
        _kept = None
        raise


@contextlib.contextmanager
def pooled_schema() -> Iterator[str]:
    """A URL whose jobserver tables, at the current version, are empty and
    its own while the block runs; kept for the next test after it."""
    schema = _take()
    try:
        yield schema.url
    finally:
        if _emptied(schema):
            _idle.append(schema)
        else:
            _drop(schema.name)


def _take() -> _Schema:
    """An idle schema that is still empty (a node a test left running may
    have written to one since), else a new one."""
    while _idle:
        schema = _idle.pop()
        if _is_empty(schema):
            return schema
        _drop(schema.name)
    return _new()


def _new() -> _Schema:
    """A schema migrated as a node does it (its own start), then emptied as
    a test's is, so that its shape is that of an emptied schema."""
    name = f"p_{secrets.token_hex(6)}"
    with _connection() as db:
        db.execute(f"CREATE SCHEMA {name}".encode())
    schema_url = pg.with_schema(pg.database_url(), name)
    PostgresStore(schema_url).close()
    with _connection() as db:
        tables = tuple(
            row[0]
            for row in db.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY 1", (name,)
            ).fetchall()
            if row[0] not in KEPT_TABLES
        )
        sequences = tuple(
            row[0]
            for row in db.execute(
                "SELECT sequencename FROM pg_sequences WHERE schemaname = %s ORDER BY 1", (name,)
            ).fetchall()
        )
    schema = _Schema(name, schema_url, tables, sequences, shape="")
    with _connection() as db:
        _empty(db, schema)
        schema.shape = _shape(db, name)
    return schema


def _emptied(schema: _Schema) -> bool:
    """Empties a schema a test has finished with; whether it has the shape
    it was made with, and so may be given out again."""
    try:
        with _connection() as db:
            db.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'".encode())
            _empty(db, schema)
            db.execute(b"RESET lock_timeout")
            return _shape(db, schema.name) == schema.shape
    except psycopg.Error:
        return False


def _empty(db: psycopg.Connection, schema: _Schema) -> None:
    """No rows, IDs from 1, no Query role (the next node makes it anew, as
    on a fresh schema)."""
    role = postgres_query.role_name(pg.DATABASE, schema.name)
    large = {
        str(row[0])
        for row in db.execute(
            "SELECT relname FROM pg_class WHERE relnamespace = %s::regnamespace "
            "AND relkind = 'r' AND pg_total_relation_size(oid) > %s",
            (schema.name, TRUNCATE_ABOVE_BYTES),
        ).fetchall()
    }
    with db.transaction():
        for table in schema.tables:
            verb = "TRUNCATE" if table in large else "DELETE FROM"
            db.execute(f"{verb} {schema.name}.{table}".encode())
        for sequence in schema.sequences:
            db.execute(f"ALTER SEQUENCE {schema.name}.{sequence} RESTART".encode())
        if db.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
            db.execute(f"DROP OWNED BY {role}".encode())
            db.execute(f"DROP ROLE {role}".encode())


def _shape(db: psycopg.Connection, name: str) -> str:
    row = db.execute(SHAPE.replace("{schema}", name).encode(), (name,)).fetchone()
    assert row is not None and row[0] is not None, name
    return str(row[0])


def _is_empty(schema: _Schema) -> bool:
    any_row = " UNION ALL ".join(
        f"(SELECT 1 FROM {schema.name}.{table} LIMIT 1)" for table in schema.tables
    )
    with _connection() as db:
        return db.execute(f"SELECT EXISTS ({any_row})".encode()).fetchone() == (False,)


def _drop(name: str) -> None:
    with _connection() as db:
        db.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE".encode())
        role = postgres_query.role_name(pg.DATABASE, name)
        db.execute(f"DROP ROLE IF EXISTS {role}".encode())
