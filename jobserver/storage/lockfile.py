"""One server per database file.

Two servers on one SQLite file would both run, but neither would see the
other's waiting GetJobs or running jobs: a job created through one would
not wake a worker waiting on the other, and concurrency limits would be
counted twice. So a server holds an exclusive lock on `DB.lock` for as long
as it runs, and says in that file who it is; a second server finds the lock
taken and refuses to start, naming the first. The operating system drops
the lock when the process ends, however it ends, so a crash never leaves a
lock behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os

from jobserver.storage.sqlite_schema import StoreError

log = logging.getLogger("jobserver")

SUFFIX = ".lock"
# Tries to lock a lock file that another server deletes at that moment.
_ATTEMPTS = 10


class DatabaseInUse(StoreError):
    """Another server holds the database's lock."""


class ServerLock:
    def __init__(self, path: str, fd: int | None, writable: bool = True) -> None:
        self.path = path
        self._fd = fd
        self._writable = writable

    def announce(self, address: str) -> None:
        """Say who holds the lock, for a second server's message."""
        if self._fd is None or not self._writable:
            return
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()}\naddress {address}\n".encode(), 0)

    def release(self) -> None:
        """Delete the file while still holding it, then let go: a server
        starting now either fails to lock the old file or makes a new one."""
        if self._fd is None:
            return
        if self._writable:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        os.close(self._fd)
        self._fd = None


def acquire(db: str) -> ServerLock:
    """Lock `db`'s lock file, or raise DatabaseInUse naming its holder."""
    path = os.path.realpath(db) + SUFFIX
    for _ in range(_ATTEMPTS):
        fd, writable = _open(path)
        if fd is None:
            return ServerLock(path, None)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = _read(fd)
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise DatabaseInUse(
                    f"{db!r} is in use by another jobserver ({holder}); "
                    "stop it first, or give this server its own --db"
                ) from None
            raise _cannot_lock(path, error) from None
        if _same_file(fd, path):
            if writable:
                # What a killed server said of itself is no longer true.
                os.ftruncate(fd, 0)
            return ServerLock(path, fd, writable)
        # The holder deleted the file between our open and our lock: the
        # lock we got is on a file nobody else will ever look at.
        os.close(fd)
    raise DatabaseInUse(f"cannot lock {path!r}: it keeps being replaced")


def _open(path: str) -> tuple[int | None, bool]:
    """The lock file open, and whether it could be opened for writing."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644), True
    except OSError as error:
        if error.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            # A missing directory, a directory in the file's place: a
            # mistake in --db, to be named as such (not as the port's).
            raise _cannot_lock(path, error) from None
    # A read-only directory or file system: an existing lock file can still
    # be locked; without one, nothing can protect the database, but a
    # server that can only read it cannot harm it either.
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC), False
    except OSError:
        log.warning("cannot create %s: another server on this database would not be noticed", path)
        return None, False


def _cannot_lock(path: str, error: OSError) -> StoreError:
    return StoreError(f"cannot lock {path!r} (is --db right?): {error.strerror or error}")


def _same_file(fd: int, path: str) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def _read(fd: int) -> str:
    """The holder as its lock file describes it."""
    try:
        text = os.pread(fd, 256, 0).decode("utf-8", "replace")
    except OSError:
        text = ""
    fields = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
    if "pid" not in fields:
        return "it has not said which; it may still be starting"
    where = f", serving {fields['address']}" if "address" in fields else ""
    return f"pid {fields['pid']}{where}"
