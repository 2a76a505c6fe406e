"""The `jobserver` command."""

from __future__ import annotations

import argparse
import logging
import sys

import trio

from . import __version__
from .server import Config, Server
from .store import SYNCHRONOUS_MODES, StoreError

log = logging.getLogger("jobserver")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jobserver",
        description="A durable job queue that speaks Bedrock::Jobs' text protocol.",
    )
    parser.add_argument("--version", action="version", version=f"jobserver {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    serve = sub.add_parser(
        "serve",
        help="run the job server",
        description=(
            "Run the job server in the foreground. Jobs are kept in one SQLite "
            "file; a write is acknowledged only once it is on disk. SIGINT or "
            "SIGTERM stop it cleanly. Try it with: nc 127.0.0.1 8888"
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8888, help="TCP port (0 picks a free one)")
    serve.add_argument("--db", default="jobs.db", help="SQLite database file")
    serve.add_argument(
        "--synchronous",
        choices=SYNCHRONOUS_MODES,
        default="FULL",
        help=(
            "SQLite synchronous mode. FULL syncs every commit to disk before "
            "its reply. NORMAL is faster, but a power loss or OS crash (not a "
            "server crash) can lose the last acknowledged writes."
        ),
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        default=Config.max_connections,
        help="connections beyond this are answered '503 Too many connections'",
    )
    serve.add_argument(
        "--allow-remote-query",
        action="store_true",
        help="accept the read-only Query command from non-loopback clients",
    )
    serve.add_argument(
        "--query-timeout",
        type=float,
        default=Config.query_seconds,
        help="seconds a Query may run before it is stopped with '555 Timeout'",
    )
    serve.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="%(asctime)s jobserver %(levelname)s %(message)s",
    )
    if args.command == "serve":
        return _serve(args)
    return 2


def _serve(args: argparse.Namespace) -> int:
    config = Config(
        host=args.host,
        port=args.port,
        db=args.db,
        synchronous=args.synchronous,
        max_connections=args.max_connections,
        allow_remote_query=args.allow_remote_query,
        query_seconds=args.query_timeout,
    )
    try:
        trio.run(Server(config).run)
    except StoreError as error:
        log.error("%s", error)
        return 2
    except OSError as error:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, error)
        return 1
    return 0
