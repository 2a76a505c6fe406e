"""The Backup command: a consistent copy of the database, written into a
new file in the server's backup directory while the server keeps serving
(protocol.md 14.18).

The storage makes and checks the copy (Storage.backup) on a connection of
its own, in a worker thread, so the writer goes on committing meanwhile;
here are the name's rule, the status lines and the reply. Who may ask,
and one backup at a time, are the dispatcher's.

The client names the file; the operator chose the directory
(--backup-dir, or DB.backups beside the database). So a client cannot
write anywhere else, whatever its name holds, and the text of a job, which
the copy holds, cannot become a file the client chooses: a configuration
file, a crontab, a shell's profile.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable

from jobserver.core.commands.views import ok
from jobserver.storage.interface import (
    BackupDirectory,
    BackupDirectoryUnusable,
    BackupFailed,
    BackupNameIsLive,
    BackupNameTaken,
    BackupUnsupported,
    Storage,
)
from jobserver.wire.framing import Request, Response

log = logging.getLogger("jobserver")

# A backup's name: letters, digits, `.`, `_` and `-`, starting with a
# letter or digit (no hidden file, nothing an option parser takes for an
# option, no `..`), at most MAX_NAME characters. No `/`: a name, never a path.
MAX_NAME = 128
NAME_RULE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAME - 1}}}")
MALFORMED_NAME = (
    f"402 Malformed name: a backup's name is 1 to {MAX_NAME} letters, digits, "
    "'.', '_' and '-', starting with a letter or digit"
)
# Beside a SQLite database DB when --backup-dir is not given.
DEFAULT_SUFFIX = ".backups"


def directory(db: str, chosen: str | None) -> BackupDirectory:
    """Where backups of `db` go: the operator's --backup-dir, which must
    exist, or DB.backups beside the database, made at the first Backup."""
    if chosen is not None:
        return BackupDirectory(os.path.abspath(chosen))
    return BackupDirectory(os.path.abspath(db) + DEFAULT_SUFFIX, create=True)


def run(
    store: Storage, place: BackupDirectory, request: Request, stopped: Callable[[], bool]
) -> Response:
    """Answer a Backup request (blocking: call it from a worker thread).
    `stopped` says when to give up: the server is shutting down."""
    name = request.get("name") or ""
    if not name:
        if request.get("path"):
            return Response(
                "402 Backup takes a name, not a path: the server writes it "
                "in its backup directory (--backup-dir)"
            )
        return Response("402 Missing name")
    if not NAME_RULE.fullmatch(name):
        return Response(MALFORMED_NAME)
    started = time.monotonic()
    try:
        copy = store.backup(place, name, stopped)
    except BackupUnsupported as error:
        return Response(f"501 {error}")
    except BackupNameIsLive:
        return Response("402 Backup name is the live database's")
    except BackupNameTaken:
        return Response("402 Backup file already exists")
    except BackupDirectoryUnusable as error:
        log.error("cannot back up into %r: %s", place.path, error)
        return Response(f"500 Backup directory unusable: {error}")
    except BackupFailed as error:
        return _failed(name, str(error))
    seconds = round(time.monotonic() - started, 3)
    path = os.path.join(place.path, name)
    log.info(
        "backed up %s to %s: %d bytes, %d jobs, in %.3fs",
        store.path, path, copy.bytes, copy.jobs, seconds,
    )
    body = {"bytes": copy.bytes, "jobs": copy.jobs, "name": name, "path": path, "seconds": seconds}
    return ok(body)


def _failed(name: str, reason: str) -> Response:
    log.error("backup %s failed: %s", name, reason)
    return Response(f"500 Backup failed: {reason}")
