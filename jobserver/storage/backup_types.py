"""What the Backup command asks of a store and gets back: where copies
go, a copy made, and the ways a copy is refused or fails (each text says
why). Apart from interface.py, whose Protocols use them, because the
command, the CLI and both backends speak of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackupCopy:
    """A backup made and checked: its size on disk and the jobs it holds."""

    bytes: int
    jobs: int


class BackupFailed(Exception):
    """The copy could not be made, or failed its check; nothing is left at
    its path. The text says why."""


class BackupUnsupported(Exception):
    """This backend makes no copies of itself; the text says what to use
    instead."""


@dataclass(frozen=True)
class BackupDirectory:
    """Where Backup writes its files (--backup-dir): an absolute path;
    `create`: made, mode 0700, when missing (the default beside the
    database is; a directory the operator names must exist)."""

    path: str
    create: bool = False


class BackupNameTaken(Exception):
    """The name is a file already (or its -journal or -wal is), or one of
    the live database's: nothing was written. The text says which."""


class BackupNameIsLive(BackupNameTaken):
    """In the database's own directory, the name begins with the database's
    file name: its journal, log, shared memory or lock, now or later."""


class BackupDirectoryUnusable(Exception):
    """The backup directory cannot be written safely (missing, a symbolic
    link, writable by others, ...): the operator's to fix. The text says why."""
