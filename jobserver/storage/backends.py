"""Which backend a `--db` names: a PostgreSQL URL, or a SQLite file."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

from jobserver.model.limits import Limit
from jobserver.storage.interface import Storage
from jobserver.storage.sqlite import Store
from jobserver.storage.sqlite_schema import StoreError

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
# What reads as a URL: a scheme (RFC 3986: a letter, then letters, digits,
# +, - or .) and `://`. A SQLite file is a path, never a URL.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
MEMORY = ":memory:"
# Transactions a PostgreSQL node runs at once by default (--writers), each
# on a connection of its own: while one waits for the database, another's
# Python runs (a drain, 5,800 jobs a second with one and 7,500 with two:
# docs/benchmarks.md; a third adds nothing on two cores). A SQLite file
# has one writer.
DEFAULT_WRITERS = 2
MAX_WRITERS = 16

log = logging.getLogger("jobserver")


def is_postgres(db: str) -> bool:
    return db.startswith(POSTGRES_SCHEMES)


def check_db(db: str) -> str:
    """A --db as given, or ValueError if it looks like a URL of a scheme no
    backend speaks (`postgresq://...`): taken as a SQLite path, it would
    become a file of that odd name. The message names the scheme, never the
    rest, which may hold a password."""
    url = _URL.match(db)
    if url is not None and not is_postgres(db):
        known = " or ".join(f"{scheme}..." for scheme in POSTGRES_SCHEMES)
        raise ValueError(
            f"{url.group()}... is no database URL this server knows: give {known} for "
            "PostgreSQL, or a SQLite file's path (./NAME for a file whose name looks like a URL)"
        )
    return db


def open_store(
    db: str,
    synchronous: str,
    limits: Mapping[str, Limit],
    query_url: str | None = None,
    writers: int = DEFAULT_WRITERS,
) -> Storage:
    """A PostgreSQL URL opens PostgreSQL (psycopg must be installed: the
    `postgres` extra) with `writers` connections for transactions, whose
    Query logs in as the role `query_url` names when it is given; anything
    else is a SQLite file (one writer)."""
    if not is_postgres(db):
        return Store(sqlite_file(db), synchronous, limits)
    try:
        from jobserver.storage.postgres import PostgresStore
    except ImportError as error:
        raise StoreError(
            f"--db {db.split('://')[0]}://... needs psycopg, which is not installed: "
            f"pip install 'jobserverd[postgres]' ({error})"
        ) from error
    return PostgresStore(db, limits, query_url, writers)


def sqlite_file(db: str) -> str:
    """The file a SQLite `--db` names, symbolic links resolved: SQLite keeps
    its -wal and -shm beside the file a link points to, and the server must
    sync, check and back up those, not look for them beside the link."""
    if db == MEMORY:
        return db
    real = os.path.realpath(db)
    if real == os.path.abspath(db):
        return db
    log.info("--db %s is a symbolic link: serving %s", db, real)
    return real
