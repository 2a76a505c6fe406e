"""Backups of a SQLite jobs database while its server writes (the Backup
command): a copy made on a read-only connection of its own, in a thread
outside the writer, then synced and checked before it is reported.

`VACUUM INTO` reads the database in one read transaction, so the copy
holds exactly the commits made before that transaction began, whatever
the writer commits meanwhile: in WAL mode a reader neither waits for the
writer nor holds it up. The copy is compact (no free pages), keeps the
schema version and the file's settings, and is an ordinary file in
rollback-journal mode; a server started on it switches it to WAL as it
would any file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
from collections.abc import Callable

from jobserver.storage.interface import BackupCopy, BackupFailed
from jobserver.storage.sqlite_readers import _read_only_uri

# How often SQLite asks whether to stop: every this many steps of its
# virtual machine, well under a millisecond of work.
STOP_CHECK_STEPS = 10_000

# Files SQLite keeps next to a database. One already there would be read
# as part of the copy (a journal rolled back into it, a log replayed onto
# it), so its presence refuses the path as the file's would.
_COMPANIONS = ("-journal", "-wal")


def backup(source: str, path: str, stopped: Callable[[], bool]) -> BackupCopy:
    """Copy the database file `source` into a new file at `path`
    (Storage.backup); only that file is ever written or removed."""
    for suffix in _COMPANIONS:
        if os.path.lexists(path + suffix):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path + suffix)
    # Created here, exclusively: nothing at `path`, not even a symlink, is
    # ever written to. VACUUM INTO fills an empty file.
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    try:
        _copy(source, path, stopped)
        size = _sync(path)
        return BackupCopy(size, _check(path, stopped))
    except BaseException:
        _remove(path)
        raise


def _copy(source: str, path: str, stopped: Callable[[], bool]) -> None:
    db = sqlite3.connect(_read_only_uri(source), uri=True, isolation_level=None)
    try:
        db.set_progress_handler(stopped, STOP_CHECK_STEPS)
        db.execute("VACUUM INTO ?", (path,))
    except sqlite3.Error as error:
        raise _failed(error) from error
    finally:
        db.close()


def _sync(path: str) -> int:
    """Put the copy's content, and its name in its directory, on disk;
    its size."""
    try:
        size = _fsync(path, os.O_RDONLY)
        _fsync(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        raise BackupFailed(error.strerror or str(error)) from error
    return size


def _fsync(name: str, flags: int) -> int:
    fd = os.open(name, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _check(path: str, stopped: Callable[[], bool]) -> int:
    """quick_check on the copy (every page read once); its jobs, counted."""
    db = sqlite3.connect(_read_only_uri(path), uri=True, isolation_level=None)
    try:
        db.set_progress_handler(stopped, STOP_CHECK_STEPS)
        problems = [row[0] for row in db.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise BackupFailed(f"the copy failed its check: {'; '.join(problems[:3])}")
        return int(db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])
    except sqlite3.Error as error:
        raise _failed(error) from error
    finally:
        db.close()


def _failed(error: sqlite3.Error) -> BackupFailed:
    # Only the progress handler interrupts these connections: `stopped` said so.
    if error.sqlite_errorcode == sqlite3.SQLITE_INTERRUPT:
        return BackupFailed("stopped")
    return BackupFailed(str(error))


def _remove(path: str) -> None:
    """The copy, and the journal SQLite may have left while writing it."""
    for name in (path, path + "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
