"""`jobserver backup DEST`: the server copies its SQLite database into DEST
while it keeps serving (the Backup command, protocol.md 14.18). A client
command like the others (client_command.py runs it and prints its result)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from jobserver.client import Client

DESCRIPTION = (
    "Have the server copy its SQLite database, as it is at one moment, into the new "
    "file DEST while it keeps serving; the copy is synced, checked with SQLite's "
    "quick_check and its jobs counted before the reply. Prints "
    '{"bytes": N, "jobs": N, "path": DEST, "seconds": S}. Restore by starting a '
    "server on the copy: jobserver serve --db DEST. The server writes DEST itself, "
    "so it is a path on the server's machine; it does so for a client on that machine "
    "(loopback), or for any client when it runs with --auth-token-file. An existing "
    "file is never overwritten (exit 2, '402 Backup file already exists'); while "
    "another backup runs, exits 3 with '409 Backup already running'. On PostgreSQL "
    "the server refuses (exit 4): use pg_dump."
)


def add_parser(command: Callable[..., argparse.ArgumentParser]) -> None:
    """The backup subcommand, made by commands.py's factory of client commands."""
    parser = command("backup", _backup, "copy the server's database while it serves", DESCRIPTION)
    parser.add_argument(
        "dest",
        metavar="DEST",
        # Made absolute here: the server has no current directory of ours.
        type=os.path.abspath,
        help="where the server writes the copy, a new file; a relative path is taken "
        "from the current directory",
    )


def _backup(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    return client.backup(args.dest)
