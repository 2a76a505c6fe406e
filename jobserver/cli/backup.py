"""`jobserver backup NAME`: the server copies its SQLite database into the
file NAME of its backup directory while it keeps serving (the Backup
command, protocol.md 14.18). A client command like the others
(client_command.py runs it and prints its result)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from jobserver.client import Client

DESCRIPTION = (
    "Have the server copy its SQLite database, as it is at one moment, into the new "
    "file NAME in its backup directory while it keeps serving; the copy is synced, "
    "checked with SQLite's quick_check and its jobs counted before the reply. Prints "
    '{"bytes": N, "jobs": N, "name": NAME, "path": P, "seconds": S}, P being where '
    "the server wrote it: DIR/NAME, DIR the server's --backup-dir (default: DB.backups "
    "beside its database). Restore by starting a server on the copy: jobserver serve "
    "--db P. NAME is a name, not a path: 1 to 128 letters, digits, '.', '_' and '-', "
    "starting with a letter or digit. The server does it for a client on its machine "
    "(loopback), or for any client when it runs with --auth-token-file. An existing "
    "file is never overwritten (exit 2, '402 Backup file already exists'); while "
    "another backup runs, exits 3 with '409 Backup already running'. On PostgreSQL "
    "the server refuses (exit 4): use pg_dump."
)


def add_parser(command: Callable[..., argparse.ArgumentParser]) -> None:
    """The backup subcommand, made by commands.py's factory of client commands."""
    parser = command("backup", _backup, "copy the server's database while it serves", DESCRIPTION)
    parser.add_argument(
        "name",
        metavar="NAME",
        help="the new file's name in the server's backup directory (not a path)",
    )


def _backup(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    return client.backup(args.name)
