"""Why a SQLite database's path cannot be used, in words that name the
path and the reason: SQLite itself says only "unable to open database
file" or "attempt to write a readonly database", whatever the cause."""

from __future__ import annotations

import os

MEMORY = ":memory:"


def missing_place(path: str) -> str | None:
    """What makes `path` no place for a file at all (a directory on the
    way missing or not a directory, the path a directory), or None. No
    server could open it, so `serve --db` refuses it as a usage error."""
    if path == MEMORY:
        return None
    directory = os.path.dirname(os.path.abspath(path))
    existing = directory
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a directory"
    if existing != directory:
        return f"the directory {directory} does not exist"
    if os.path.isdir(path):
        return f"{path} is a directory"
    return None


def unwritable(path: str) -> str | None:
    """Why this process cannot write the database at `path` (a read-only
    file, a directory it cannot create files in, a read-only file system),
    or None. Asked after SQLite failed: a database whose files all exist
    may still work in a directory that is not writable."""
    if path == MEMORY:
        return None
    place = missing_place(path)
    if place is not None:
        return place
    directory = os.path.dirname(os.path.abspath(path))
    # access() says no to root too for an immutable file (chattr +i) and
    # on a read-only file system.
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        return f"the file {path} is read-only to this server"
    if not os.access(directory, os.W_OK | os.X_OK):
        return (
            f"the directory {directory} is not writable by this server (SQLite creates the "
            "database's -wal and -shm files beside it)"
        )
    return None
