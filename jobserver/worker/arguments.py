"""The command line of `jobserver worker MODULE:ATTR`: its options, their
checks, loading the Worker, and running it. What the parser cannot check
(the module, the server from the environment, the token file, the TLS CA)
is checked before the worker starts: exit
status 2, as for a bad option."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import threading

from jobserver.cli.options import (
    AUTH_TOKEN_HELP,
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
from jobserver.worker.registry import MAX_JOBS_PATTERN, Worker, check_pattern
from jobserver.worker.settings import (
    MAX_CONCURRENCY,
    MAX_GRACE,
    MAX_PREFETCH,
    MAX_PROCESSES,
    MAX_TIMEOUT,
    MAX_TOUCH_INTERVAL,
    Settings,
)
from jobserver.workers.leases import add_lease_argument

log = logging.getLogger("jobserver.worker")

DESCRIPTION = (
    "Run the handlers of a Worker (jobserver.worker) in this process: take jobs "
    "in batches (GetJobs, waiting when there are none), call the handler whose "
    "pattern matches each job, plain functions in threads and async ones as tasks, "
    "up to --concurrency at once, and report the results in batches (FinishJobs). "
    "A return finishes the job (a returned dict becomes its data), RetryLater "
    "retries it, any other exception or the timeout fails it with the traceback "
    "as its last error, so its retry policy applies. SIGTERM or SIGINT: no more "
    "jobs, running ones get --grace, then are handed back; a second signal hands "
    "them back at once."
)


def jobs_pattern(text: str) -> str:
    """--job-name: a GetJobs name, as the server takes it."""
    try:
        check_pattern(text, MAX_JOBS_PATTERN, commas=True)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def worker_reference(text: str) -> tuple[str, str]:
    """MODULE:ATTR: a module to import and the name of its Worker."""
    module, colon, attr = text.partition(":")
    if not colon or not module or not attr:
        raise argparse.ArgumentTypeError(
            f"must be MODULE:ATTR, such as myapp.jobs:worker, not {text!r}"
        )
    return module, attr


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "worker",
        type=worker_reference,
        metavar="MODULE:ATTR",
        help="the Worker to run: ATTR of the module MODULE, imported with the current "
        "directory on the path (e.g. myapp.jobs:worker)",
    )
    parser.add_argument(
        "--job-name",
        type=jobs_pattern,
        metavar="PATTERN",
        help="the GetJobs name to ask with: a GLOB pattern, or a comma-separated list of "
        "names (default: the one pattern of the handlers, or their names if none is a "
        "pattern). A job that no handler takes fails",
    )
    parser.add_argument(
        "--concurrency",
        type=number(int, 1, MAX_CONCURRENCY),
        default=8,
        metavar="N",
        help=f"run at most N jobs at once, 1 to {MAX_CONCURRENCY} (default: 8); GetJobs asks "
        "for as many as are free, and for those --prefetch allows",
    )
    parser.add_argument(
        "--prefetch",
        type=number(int, 0, MAX_PREFETCH),
        default=1000,
        metavar="N",
        help=f"hold at most N jobs beyond the free slots, 0 to {MAX_PREFETCH} (default: 1000), "
        "and only as many as the handlers would start within half a second at the pace "
        "they end now: none for slow handlers, or before any has ended. Held jobs are "
        "RUNNING on the server; on SIGTERM/SIGINT they are handed back at once",
    )
    parser.add_argument(
        "--processes",
        type=number(int, 1, MAX_PROCESSES),
        default=1,
        metavar="N",
        help=f"run N worker processes, 1 to {MAX_PROCESSES} (default: 1), each with these "
        "options and connections of its own, for handlers that need more than one core; "
        "SIGTERM/SIGINT is passed on to each, and one that exits unasked is started again "
        "(after 1 s, doubling to 30 s), unless it exits 2 (it cannot work): then all stop",
    )
    parser.add_argument(
        "--timeout",
        type=number(float, 0, MAX_TIMEOUT, above=True),
        default=3600.0,
        metavar="S",
        help=f"fail a job whose handler still runs after S seconds, 0 < S <= {MAX_TIMEOUT:g}, "
        "a failed attempt for its retry policy, unless the handler has its own timeout "
        "(default: 3600). A thread cannot be stopped: it runs on, its result ignored",
    )
    parser.add_argument(
        "--grace",
        type=number(float, 0, MAX_GRACE),
        default=30.0,
        metavar="S",
        help=f"on SIGTERM/SIGINT, running jobs get S seconds, 0 to {MAX_GRACE:g}, then are "
        "handed back to the queue, due at once (default: 30)",
    )
    parser.add_argument(
        "--touch-interval",
        type=number(float, 0, MAX_TOUCH_INTERVAL, above=True),
        default=30.0,
        metavar="S",
        help="renew the lease of a running job with retryAfter (TouchJob) at least every S "
        f"seconds, 0 < S <= {MAX_TOUCH_INTERVAL:g}, and after a third of its retryAfter if "
        "that is sooner (default: 30)",
    )
    add_lease_argument(parser)
    parser.add_argument(
        "--loop",
        choices=("asyncio", "trio"),
        default="asyncio",
        help="the event loop async handlers run on: asyncio or trio (default: asyncio)",
    )
    parser.add_argument(
        "--server",
        type=server_address,
        metavar=SERVER_METAVAR,
        help=SERVER_HELP,
    )
    parser.add_argument("--auth-token-file", metavar="FILE", help=AUTH_TOKEN_HELP)
    add_tls_arguments(parser)
    add_max_reply_bytes(parser)
    parser.add_argument(
        "--log-level",
        type=log_level,
        choices=LOG_LEVELS,
        default="INFO",
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING or ERROR (default: INFO: a line per job that did not "
        "finish and for the first 10 finished jobs of each second, and every minute how "
        "many jobs ended how; DEBUG: a line per job)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the worker until it is stopped; the exit status (runner.py), or
    2 for options that cannot work."""
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level,
        format="%(asctime)s jobserver %(levelname)s %(message)s",
    )
    # Here, not at the top: the other commands (and --help) do without
    # anyio, whose import is slow.
    from jobserver.worker import runner

    worker = load_worker(*args.worker)
    settings = settings_from(args)
    if worker is None or settings is None:
        return 2
    try:
        if settings.jobs is None:
            worker.get_jobs_name()
    except ValueError as error:
        log.error("%s", error)
        return 2
    if args.processes > 1:
        from jobserver.worker import processes

        command = [sys.executable, "-m", "jobserver", *args.words, "--processes", "1"]
        return processes.run(command, args.processes)
    status = runner.run(worker, settings, args.loop)
    if threads_left_running():
        # A handler's thread past its timeout cannot be stopped, and the
        # interpreter would wait for it at exit.
        logging.shutdown()
        os._exit(status)
    return status


def load_worker(module_name: str, attr: str) -> Worker | None:
    """The Worker at MODULE:ATTR; None, once the reason is logged."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception:
        log.exception("cannot import %s", module_name)
        return None
    value: object = module
    for part in attr.split("."):
        value = getattr(value, part, None)
    if not isinstance(value, Worker):
        log.error(
            "%s:%s is %s, not a jobserver.worker.Worker",
            module_name,
            attr,
            "missing" if value is None else type(value).__name__,
        )
        return None
    if not value.handlers:
        log.error("%s:%s has no handlers", module_name, attr)
        return None
    return value


def settings_from(args: argparse.Namespace) -> Settings | None:
    """The settings the options describe; None, once the reason is logged,
    if they cannot work."""
    try:
        servers = chosen_server(args.server)
    except ValueError as error:  # names $JOBSERVER_SERVER: --server was checked
        log.error("%s", error)
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
    return Settings(
        servers=servers,
        token=token,
        tls=tls,
        concurrency=args.concurrency,
        prefetch=args.prefetch,
        timeout=args.timeout,
        grace=args.grace,
        touch_interval=args.touch_interval,
        lease=args.lease,
        jobs=args.job_name,
        max_reply_bytes=args.max_reply_bytes,
    )


def threads_left_running() -> bool:
    """Whether a thread other than this one is still running (a handler's,
    left behind by its timeout)."""
    current = threading.current_thread()
    return any(t is not current and not t.daemon and t.is_alive() for t in threading.enumerate())
