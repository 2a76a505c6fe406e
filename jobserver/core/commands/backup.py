"""The Backup command: a consistent copy of the database, written into a
new file in the server's backup directory while the server keeps serving
(protocol.md 14.18).

The storage makes and checks the copy (Storage.backup) on a connection of
its own, in a worker thread, so the writer goes on committing meanwhile;
here are who may ask, one backup at a time, the name's rule, the status
lines and the reply.

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

import trio

from jobserver.core.commands.route import Answer, Services, is_loopback
from jobserver.core.commands.views import ok
from jobserver.storage.backup_types import (
    BackupDirectory,
    BackupDirectoryUnusable,
    BackupFailed,
    BackupNameIsLive,
    BackupNameTaken,
    BackupUnsupported,
)
from jobserver.storage.interface import Storage
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


async def backup(services: Services, request: Request, peer: str) -> Answer:
    # It writes a file, named by the client, as the server's user: only
    # for a client on this machine, or one that holds the token. (Over
    # HTTP, only with the token: web/app.py.)
    access = services.access
    if access.auth_token is None and not is_loopback(peer):
        return Answer(Response("401 Unauthorized"))
    place = access.backup_dir
    if place is None:
        return Answer(Response("501 Backup is off: the server has no backup directory"))
    if services.backing_up.locked():
        return Answer(Response("409 Backup already running"))
    async with services.backing_up:
        # Not abandoned on cancel: a shutdown stops the copy through
        # `cancelled`, and the thread removes what it had written.
        response = await trio.to_thread.run_sync(run, services.store, place, request, cancelled)
    # Its own connection may have copied commits not yet on disk.
    await services.engine.settled()
    return Answer(response)


def cancelled() -> bool:
    """From a worker thread: whether the request it works for was cancelled."""
    try:
        trio.from_thread.check_cancelled()
    except trio.Cancelled:
        return True
    return False


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
