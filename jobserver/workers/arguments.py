"""The command line of `jobserver worker-manager`: its options, their checks,
and running the manager they describe. Options the parser cannot check
(the server from the environment, the worker directory, the token file,
the TLS CA) are checked here before the manager starts: exit status 2."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import trio

from jobserver.cli.options import (
    AUTH_TOKEN_HELP,
    JOB_PATTERNS_HELP,
    LOG_LEVELS,
    SERVER_HELP,
    SERVER_METAVAR,
    add_max_reply_bytes,
    add_tls_arguments,
    chosen_server,
    log_level,
    number,
    server_address,
    tls_option,
)
from jobserver.client import auth_token, tls_context
from jobserver.workers.leases import add_lease_argument
from jobserver.workers.manager import Manager
from jobserver.workers.policy import POLICY_HELP, Policies, parse_policy

log = logging.getLogger("jobserver.workers")


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


DESCRIPTION = (
    "Take jobs from the server (blocking, never polling) and run each "
    "as a process from --worker-path, within --max-workers (and "
    "--max-load, if given); report each outcome. SIGTERM or SIGINT drain it."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_job_arguments(parser)
    _add_limit_arguments(parser)
    _add_server_arguments(parser)
    _add_timing_arguments(parser)
    parser.add_argument(
        "--log-level",
        type=log_level,
        choices=LOG_LEVELS,
        default="INFO",
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING or ERROR (default: INFO)",
    )


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """Which jobs, and which workers run them."""
    parser.add_argument(
        "--worker-path",
        required=True,
        metavar="DIR",
        help="directory of worker executables; job 'a/b/Name?x' runs DIR/Name (required)",
    )
    parser.add_argument(
        "--job-name",
        default="*",
        metavar="PATTERN",
        help=f"GetJobs name: {JOB_PATTERNS_HELP} (default: *)",
    )
    parser.add_argument(
        "--policy",
        type=parse_policy,
        action="append",
        default=[],
        metavar="PATTERN:KEY=VALUE,...",
        help=POLICY_HELP,
    )


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """How much runs at once, for how long, and how many rounds."""
    cpus = _cpu_count()
    parser.add_argument(
        "--max-load",
        type=number(float, 0, above=True),
        default=None,
        metavar="F",
        help="take no jobs while the 1-minute load average is F or more, F > 0 (default: "
        "no load limit; --max-workers is the limit). In a container the load average is "
        "usually the whole host's",
    )
    parser.add_argument(
        "--max-workers",
        type=number(int, 1),
        default=cpus,
        metavar="N",
        help=f"run at most N workers at once, N >= 1 (default: {cpus}, the number of CPUs)",
    )
    parser.add_argument(
        "--worker-timeout",
        type=number(float, 0, above=True),
        default=3600.0,
        metavar="S",
        help="kill a worker still running after S seconds, S > 0, and fail its job, a "
        "failed attempt for its retry policy (default: 3600)",
    )
    parser.add_argument(
        "--max-iterations",
        type=number(int, 1),
        default=None,
        metavar="N",
        help="exit cleanly after N GetJobs rounds, N >= 1 (default: no limit)",
    )


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the server is, and how to speak to it."""
    parser.add_argument(
        "--server",
        type=server_address,
        metavar=SERVER_METAVAR,
        help=SERVER_HELP,
    )
    parser.add_argument("--auth-token-file", metavar="FILE", help=AUTH_TOKEN_HELP)
    add_tls_arguments(parser)
    add_max_reply_bytes(parser)


def _add_timing_arguments(parser: argparse.ArgumentParser) -> None:
    """How long workers get after a signal, and how often leases are renewed."""
    parser.add_argument(
        "--grace",
        type=number(float, 0),
        default=30.0,
        metavar="S",
        help="on SIGTERM/SIGINT, running workers get S seconds, S >= 0, then are killed "
        "(default: 30)",
    )
    parser.add_argument(
        "--touch-interval",
        type=number(float, 0, above=True),
        default=30.0,
        metavar="S",
        help="renew the lease of a running leased job (TouchJob) at least every S seconds, "
        "S > 0, and after a third of its retryAfter if that is sooner (default: 30)",
    )
    add_lease_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Run the manager until it is stopped; the exit status (manager.py),
    or 2 for options that cannot work."""
    # Does nothing if the caller has set up logging already.
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s jobserver %(levelname)s %(message)s",
    )
    manager = manager_from(args)
    if manager is None:
        return 2
    return trio.run(manager.serve)


def manager_from(args: argparse.Namespace) -> Manager | None:
    """The manager the options describe; None, once the reason is logged,
    if they cannot work."""
    try:
        servers = chosen_server(args.server)
    except ValueError as error:
        log.error("%s", error)
        return None
    directory = os.path.realpath(args.worker_path)
    if not os.path.isdir(directory):
        log.error("--worker-path %s is not a directory", args.worker_path)
        return None
    try:
        token = auth_token(args.auth_token_file)
    except OSError as error:
        log.error("cannot read --auth-token-file: %s", error)
        return None
    try:
        tls = tls_context(tls_option(args))
    except ValueError as error:
        log.error("cannot use --tls-ca: %s", error)
        return None
    return Manager(
        servers=servers,
        token=token,
        tls=tls,
        tls_setting=tls_option(args),
        directory=directory,
        pattern=args.job_name,
        max_load=args.max_load,
        max_workers=args.max_workers,
        worker_timeout=args.worker_timeout,
        max_iterations=args.max_iterations,
        grace=args.grace,
        touch_interval=args.touch_interval,
        lease=args.lease,
        policies=Policies(args.policy),
        max_reply_bytes=args.max_reply_bytes,
    )
