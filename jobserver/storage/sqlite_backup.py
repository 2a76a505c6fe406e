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

Where the copy goes is the operator's choice, not the client's: the
client gives a plain name, and the file is created in the backup
directory (opened with O_NOFOLLOW, owned by the server's user, writable
by nobody else) with O_EXCL|O_NOFOLLOW relative to that directory, so no
symbolic link is followed, nothing is overwritten, and no file of the
live database is ever a backup's name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import stat
from collections.abc import Callable

from jobserver.storage.backup_types import (
    BackupCopy,
    BackupDirectory,
    BackupDirectoryUnusable,
    BackupFailed,
    BackupNameIsLive,
    BackupNameTaken,
)
from jobserver.storage.sqlite_readers import _read_only_uri

# How often SQLite asks whether to stop: every this many steps of its
# virtual machine, well under a millisecond of work.
STOP_CHECK_STEPS = 10_000

# Files SQLite keeps next to a database. One already there would be read
# as part of the copy (a journal rolled back into it, a log replayed onto
# it), so its presence refuses the name as the file's would.
_COMPANIONS = ("", "-journal", "-wal")

# The directory: opened as a directory, never through a symbolic link.
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# The copy: a new file, never one that is there, nor a symbolic link.
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def backup(
    source: str, directory: BackupDirectory, name: str, stopped: Callable[[], bool]
) -> BackupCopy:
    """Copy the database file `source` into the new file `name` in
    `directory` (Storage.backup); only that file, and SQLite's journal of
    it, are ever written or removed."""
    dir_fd = open_directory(directory)
    try:
        _refuse_taken(source, dir_fd, name)
        fd = _create(dir_fd, name)
        try:
            return _fill(source, os.path.join(directory.path, name), fd, dir_fd, stopped)
        except BaseException:
            _remove(dir_fd, name)
            raise
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def open_directory(directory: BackupDirectory) -> int:
    """The directory, opened without following a symbolic link at its end,
    and checked: only its owner, the server's user or root, may write in
    it, so nobody else can put a name or a link in the copy's way."""
    try:
        fd = _open_directory(directory)
    except OSError as error:
        raise BackupDirectoryUnusable(f"{directory.path} {_why(directory.path, error)}") from error
    try:
        status = os.fstat(fd)
        if status.st_uid not in (0, os.geteuid()):
            raise BackupDirectoryUnusable(f"{directory.path} belongs to another user")
        if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise BackupDirectoryUnusable(f"{directory.path} is writable by other users")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_directory(directory: BackupDirectory) -> int:
    try:
        return os.open(directory.path, _DIRECTORY_FLAGS)
    except FileNotFoundError:
        if not directory.create:
            raise
    # mkdir does not follow a link either: one in the way is EEXIST, then
    # refused by the open.
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory.path, 0o700)
    return os.open(directory.path, _DIRECTORY_FLAGS)


def _why(path: str, error: OSError) -> str:
    # O_NOFOLLOW with O_DIRECTORY says ENOTDIR of a link, on Linux.
    if error.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
        return "is a symbolic link"
    if error.errno == errno.ENOTDIR:
        return "is not a directory"
    if error.errno == errno.ENOENT:
        return "does not exist"
    return f"cannot be opened: {error.strerror or error}"


def _refuse_taken(source: str, dir_fd: int, name: str) -> None:
    """The name, its journal and its log must not be there; in the
    database's own directory, no name may begin with the database's file
    name: its -journal, -wal, -shm, .lock, and whatever SQLite may add."""
    here = os.fstat(dir_fd)
    for live in {os.path.abspath(source), os.path.realpath(source)}:
        try:
            home = os.stat(os.path.dirname(live))
        except OSError:
            continue
        same_directory = (home.st_dev, home.st_ino) == (here.st_dev, here.st_ino)
        if same_directory and name.startswith(os.path.basename(live)):
            raise BackupNameIsLive(f"{name} is a name of the live database's files")
    for suffix in _COMPANIONS:
        try:
            os.lstat(name + suffix, dir_fd=dir_fd)
        except FileNotFoundError:
            continue
        except OSError as error:
            raise BackupDirectoryUnusable(error.strerror or str(error)) from error
        raise BackupNameTaken(f"{name + suffix} exists")


def _create(dir_fd: int, name: str) -> int:
    try:
        return os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=dir_fd)
    except OSError as error:
        if error.errno in (errno.EEXIST, errno.ELOOP):
            # Appeared since it was looked for.
            raise BackupNameTaken(f"{name} exists") from error
        raise BackupDirectoryUnusable(error.strerror or str(error)) from error


def _fill(
    source: str, path: str, fd: int, dir_fd: int, stopped: Callable[[], bool]
) -> BackupCopy:
    """VACUUM INTO names the file by its path: once it is written, the
    path must still lead to the file created, or the copy went elsewhere."""
    _copy(source, path, stopped)
    try:
        mine, written = os.fstat(fd), os.stat(path)
    except OSError as error:
        raise BackupFailed(error.strerror or str(error)) from error
    if (mine.st_dev, mine.st_ino) != (written.st_dev, written.st_ino):
        raise BackupFailed("the backup directory changed while the copy was written")
    try:
        os.fsync(fd)
        os.fsync(dir_fd)
    except OSError as error:
        raise BackupFailed(error.strerror or str(error)) from error
    return BackupCopy(os.fstat(fd).st_size, _check(path, stopped))


def _copy(source: str, path: str, stopped: Callable[[], bool]) -> None:
    db = sqlite3.connect(_read_only_uri(source), uri=True, isolation_level=None)
    try:
        db.set_progress_handler(stopped, STOP_CHECK_STEPS)
        db.execute("VACUUM INTO ?", (path,))
    except sqlite3.Error as error:
        raise _failed(error) from error
    finally:
        db.close()


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


def _remove(dir_fd: int, name: str) -> None:
    """The copy, and the journal SQLite may have left while writing it."""
    for leftover in (name, name + "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover, dir_fd=dir_fd)
