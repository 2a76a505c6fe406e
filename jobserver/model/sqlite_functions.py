"""SQLite's date and JSON functions, wherever the jobs are stored.

The protocol promises SQLite's semantics for repeat rules and retryAfter
(DATETIME modifiers) and for unique=true's merge of data (JSON_PATCH). They
are computed here, on a private in-memory database per thread that holds no
tables, so that every storage backend gives the same results.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable

# Not an SQLite modifier; it is a STRFTIME step.
START_OF_HOUR = "START OF HOUR"

_local = threading.local()


def connection() -> sqlite3.Connection:
    """This thread's in-memory database, only for its functions."""
    db: sqlite3.Connection | None = getattr(_local, "db", None)
    if db is None:
        db = _local.db = sqlite3.connect(":memory:")
    return db


def datetime_after(start: str, modifiers: Iterable[str]) -> str | None:
    """Apply SQLite date modifiers to `start`, one bound parameter each;
    None when SQLite cannot compute the time."""
    db = connection()
    current: str | None = start
    for modifier in modifiers:
        if current is None:
            return None
        if modifier == START_OF_HOUR:
            row = db.execute("SELECT STRFTIME('%Y-%m-%d %H:00:00', ?)", (current,)).fetchone()
        else:
            row = db.execute("SELECT DATETIME(?, ?)", (current, modifier)).fetchone()
        current = row[0]
    if current is None:
        return None
    result: str | None = db.execute("SELECT DATETIME(?)", (current,)).fetchone()[0]
    return result


def json_patch(target: str, patch: str) -> str:
    """RFC 7396 merge of two JSON objects, as SQLite's JSON_PATCH writes it."""
    merged: str = connection().execute("SELECT JSON_PATCH(?, ?)", (target, patch)).fetchone()[0]
    return merged
