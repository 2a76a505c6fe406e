"""The Backup command: a consistent copy of the database, written into a
new file on the server's machine while the server keeps serving
(protocol.md 14.18).

The storage makes and checks the copy (Storage.backup) on a connection of
its own, in a worker thread, so the writer goes on committing meanwhile;
here are the parameter, the status lines and the reply. Who may ask, and
one backup at a time, are the dispatcher's.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable

from jobserver.core.views import ok
from jobserver.storage.interface import BackupFailed, BackupUnsupported, Storage
from jobserver.wire.framing import Request, Response

log = logging.getLogger("jobserver")

# Why the file could not be created, as the client is told: a problem with
# the path it gave (4xx). Any other failure to create it is the server's.
_REFUSALS = {
    errno.EEXIST: "402 Backup file already exists",
    errno.ENOENT: "402 Backup directory does not exist",
    errno.ENOTDIR: "402 Backup directory does not exist",
    errno.EACCES: "402 Backup directory is not writable",
    errno.EPERM: "402 Backup directory is not writable",
    errno.EROFS: "402 Backup directory is not writable",
    errno.EISDIR: "402 Backup path is a directory",
    errno.ENAMETOOLONG: "402 Malformed path",
    errno.ELOOP: "402 Malformed path",
}


def run(store: Storage, request: Request, stopped: Callable[[], bool]) -> Response:
    """Answer a Backup request (blocking: call it from a worker thread).
    `stopped` says when to give up: the server is shutting down."""
    path = request.get("path") or ""
    if not path:
        return Response("402 Missing path")
    if "\0" in path:
        return Response("402 Malformed path")
    if not os.path.isabs(path):
        return Response("402 Backup path is not absolute")
    started = time.monotonic()
    try:
        copy = store.backup(path, stopped)
    except BackupUnsupported as error:
        return Response(f"501 {error}")
    except OSError as error:
        refusal = _REFUSALS.get(error.errno or 0)
        if refusal is not None:
            return Response(refusal)
        return _failed(path, error.strerror or str(error))
    except BackupFailed as error:
        return _failed(path, str(error))
    seconds = round(time.monotonic() - started, 3)
    log.info(
        # The client's path in quotes, so that no text of its own makes a log line.
        "backed up %s to %r: %d bytes, %d jobs, in %.3fs",
        store.path, path, copy.bytes, copy.jobs, seconds,
    )
    return ok({"bytes": copy.bytes, "jobs": copy.jobs, "path": path, "seconds": seconds})


def _failed(path: str, reason: str) -> Response:
    log.error("backup to %r failed: %s", path, reason)
    return Response(f"500 Backup failed: {reason}")
