"""The client subcommands, all registered here: a job's (jobs.py), an
operator's (operating.py), the bulk actions (bulk.py), `backup`
(backup.py) and `top` (top.py). client_command.py holds what they share:
the connection options, running them, the exit statuses."""

from __future__ import annotations

from typing import Any

from jobserver.cli import backup, bulk, jobs, operating, top
from jobserver.cli.client_command import EXIT_STATUS_HELP, command_factory, run

__all__ = ["EXIT_STATUS_HELP", "add_parsers", "run"]


def add_parsers(sub: Any) -> None:
    """Every client subcommand, in the order `jobserver --help` lists them."""
    command = command_factory(sub)
    jobs.add_parsers(command)
    operating.add_parsers(command)
    bulk.add_parsers(command)
    backup.add_parser(command)
    top.add_parser(sub)
