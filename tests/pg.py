"""A real PostgreSQL for the tests that need one: each test gets a schema
of its own in one database, dropped at the end.

The server is found at $JOBSERVER_TEST_POSTGRES (default: the local
trust-authenticated `postgres` user on 127.0.0.1:5432). Where none answers,
the tests that need it are skipped, saying why, unless
$JOBSERVER_REQUIRE_POSTGRES is 1 (as in CI), when they fail instead.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from functools import cache
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
import pytest

from jobserver.storage import postgres_query

BASE_URL = os.environ.get(
    "JOBSERVER_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REQUIRED = os.environ.get("JOBSERVER_REQUIRE_POSTGRES") == "1"
# The tests' own database, so that nothing they do touches another's: one
# per run (named by the process that leads it, whose environment the xdist
# workers inherit), so that two runs on one machine never drop each
# other's database.
DATABASE_PREFIX = "jobserver_tests"
# A schema's drop, tried again when it lost a deadlock (_drop_schema).
DROP_TRIES = 5
DATABASE = os.environ.setdefault(
    "JOBSERVER_TEST_DATABASE", f"{DATABASE_PREFIX}_{os.getpid()}"
)


@cache
def database_url() -> str:
    """The tests' database, created if missing; fails or skips the test
    when PostgreSQL cannot be reached."""
    try:
        with psycopg.connect(BASE_URL, autocommit=True, connect_timeout=5) as db:
            exists = db.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)
            ).fetchone()
            if not exists:
                with suppress(psycopg.errors.DuplicateDatabase):
                    db.execute(f"CREATE DATABASE {DATABASE}".encode())
    except psycopg.Error as error:
        reason = f"PostgreSQL at {BASE_URL} cannot be reached: {error}".strip()
        if REQUIRED:
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return urlunsplit(urlsplit(BASE_URL)._replace(path=f"/{DATABASE}"))


def recreate_database() -> None:
    """The tests' database made anew, once per run, before any test: each
    test's schema, created and dropped, leaves dead rows in the database's
    catalogs, which a PostgreSQL without autovacuum (as on the CI machine)
    keeps for good; after many runs every catalog scan read hundreds of
    megabytes, and starting a node took a third of a second. The catalogs
    the whole server shares (roles: each schema's Query role is made and
    dropped) are vacuumed for the same reason. Nothing is done when
    PostgreSQL cannot be reached: the tests that need it say so. The
    databases of earlier runs whose process is gone are dropped too."""
    with suppress(psycopg.Error), psycopg.connect(
        BASE_URL, autocommit=True, connect_timeout=5
    ) as db:
        names = db.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s",
            (DATABASE_PREFIX + "%",),
        ).fetchall()
        for (name,) in names:
            if name == DATABASE or not _run_is_over(name):
                continue
            _drop_with_roles(db, name)
        _drop_with_roles(db, DATABASE)
        db.execute(f"CREATE DATABASE {DATABASE}".encode())
        db.execute(b"VACUUM pg_authid, pg_auth_members, pg_db_role_setting, pg_shdepend")


def drop_database() -> None:
    """At the end of a run: its database, and the roles of its schemas
    with it."""
    with suppress(psycopg.Error), psycopg.connect(
        BASE_URL, autocommit=True, connect_timeout=5
    ) as db:
        _drop_with_roles(db, DATABASE)


def _drop_with_roles(db: psycopg.Connection[Any], name: str) -> None:
    """Drop database `name`, then the Query roles of its schemas: a test
    drops its own schema's, but a pooled schema (pg_pool.py) keeps the one
    its last node made, and roles are the whole server's (each run left a
    few behind). Dropped after the database, where their privileges were."""
    schemas: list[str] = []
    with suppress(psycopg.Error), psycopg.connect(
        urlunsplit(urlsplit(BASE_URL)._replace(path=f"/{name}")), connect_timeout=5
    ) as there:
        schemas = [str(row[0]) for row in there.execute("SELECT nspname FROM pg_namespace")]
    db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())
    for schema in schemas:
        role = postgres_query.role_name(name, schema)
        db.execute(f"DROP ROLE IF EXISTS {role}".encode())


def _run_is_over(name: str) -> bool:
    """Whether the run a tests' database was made for has ended: its
    leading process is gone."""
    suffix = name.removeprefix(DATABASE_PREFIX).removeprefix("_")
    if not suffix.isdigit():
        return False
    try:
        os.kill(int(suffix), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def with_schema(url: str, schema: str) -> str:
    """The URL of a connection whose tables live in `schema`."""
    separator = "&" if "?" in url else "?"
    return f"{url}{separator}options={quote(f'-csearch_path={schema}')}"


def _drop_schema(db: psycopg.Connection[Any], schema: str) -> None:
    """DROP SCHEMA, again if PostgreSQL ended it as a deadlock's victim: a
    node's backend that has not yet seen its connection close (a node
    killed by the test, a reader thread's last statement) can still be
    locking the schema's tables while the drop waits for them (seen in CI:
    the drop's AccessExclusiveLock against a backend's RowShareLock)."""
    for attempt in range(DROP_TRIES):
        try:
            db.execute(f"DROP SCHEMA {schema} CASCADE".encode())
            return
        except psycopg.errors.DeadlockDetected:
            if attempt == DROP_TRIES - 1:
                raise
            time.sleep(0.2 * (attempt + 1))


@contextmanager
def fresh_schema() -> Iterator[str]:
    """A URL whose jobserver tables live in a new, empty schema."""
    url = database_url()
    schema = f"t_{secrets.token_hex(6)}"
    with psycopg.connect(url, autocommit=True) as db:
        db.execute(f"CREATE SCHEMA {schema}".encode())
    try:
        yield with_schema(url, schema)
    finally:
        with psycopg.connect(url, autocommit=True) as db:
            _drop_schema(db, schema)
            # The schema's Query role (roles are the cluster's, not the schema's).
            role = postgres_query.role_name(DATABASE, schema)
            db.execute(f"DROP ROLE IF EXISTS {role}".encode())
            _dropped[0] += 1
            if _dropped[0] % VACUUM_EVERY == 0:
                # Without autovacuum, a run's own schemas would slow its
                # later tests (recreate_database).
                db.execute(b"VACUUM pg_attribute, pg_class, pg_depend, pg_type")


@contextmanager
def database_in(encoding: str) -> Iterator[str]:
    """The URL of a new database whose server encoding is `encoding` (its
    tables in its public schema), dropped at the end with its Query role."""
    database_url()
    name = f"{DATABASE}_{encoding.lower()}_{secrets.token_hex(4)}"
    with psycopg.connect(BASE_URL, autocommit=True) as db:
        db.execute(
            f"CREATE DATABASE {name} ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' "
            "TEMPLATE template0".encode()
        )
    try:
        yield urlunsplit(urlsplit(BASE_URL)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(BASE_URL, autocommit=True) as db:
            db.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)".encode())
            role = postgres_query.role_name(name, "public")
            db.execute(f"DROP ROLE IF EXISTS {role}".encode())


# Schemas this process has dropped; every VACUUM_EVERY, the catalogs they
# leave dead rows in are vacuumed.
_dropped = [0]
VACUUM_EVERY = 100


def execute(url: str, sql: str, params: tuple[object, ...] = ()) -> int:
    """One statement on the queue's tables, committed; the rows it changed."""
    with psycopg.connect(url, autocommit=True) as db:
        return db.execute(sql.encode(), params).rowcount


def value(url: str, sql: str, params: tuple[object, ...] = ()) -> Any:
    """The first column of a query's first row (None without a row)."""
    with psycopg.connect(url, autocommit=True) as db:
        row = db.execute(sql.encode(), params).fetchone()
    return None if row is None else row[0]
