"""The `jobserver` command: `serve`, `worker-manager`, `worker` and the client commands."""

from __future__ import annotations

import argparse

from jobserver import __version__, workers
from jobserver.cli import commands, serve
from jobserver.worker import arguments as worker


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jobserver",
        description="A durable job queue that speaks Bedrock::Jobs' text protocol.",
        epilog=commands.EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"jobserver {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    serve.add_parser(sub)
    manager = sub.add_parser(
        "worker-manager",
        help="take jobs and run a program for each",
        description=(
            "Take jobs from the server (blocking, never polling) and run each "
            "as a process from --worker-path, within --max-workers (and "
            "--max-load, if given); report each outcome. SIGTERM or SIGINT drain it."
        ),
    )
    workers.add_arguments(manager)
    python_worker = sub.add_parser(
        "worker",
        help="run the handlers of a Python Worker (MODULE:ATTR) in this process",
        description=worker.DESCRIPTION,
    )
    worker.add_arguments(python_worker)
    commands.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve.run(args)
    if args.command == "worker-manager":
        return workers.run(args)
    if args.command == "worker":
        return worker.run(args)
    return commands.run(args)
