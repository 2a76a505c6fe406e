"""The `jobserver` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import ssl
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import trio

from jobserver import __version__, workers
from jobserver.cli.options import (
    AUTH_TOKEN_HELP,
    DEFAULT_SERVER,
    LOG_LEVELS,
    MAX_JOB_ID,
    add_tls_arguments,
    duration,
    job_id,
    log_level,
    number,
    server_address,
    tls_option,
)
from jobserver.client import (
    Client,
    Conflict,
    ConnectionFailed,
    IllegalState,
    JobNotFound,
    JobServerError,
    ServerError,
    auth_token,
    parse_address,
)
from jobserver.core.context import DEFAULT_REPLY_GRACE, DEFAULT_STALE_AFTER
from jobserver.core.times import duration_text
from jobserver.server.app import Config, Server
from jobserver.storage.sqlite import SYNCHRONOUS_MODES, StoreError
from jobserver.wire import jsonbody

log = logging.getLogger("jobserver")


# The ranges of the serve options; README's serve table lists them.
MAX_PORT = 65535
# One file descriptor each, and the kernel's usual ceiling is 1,048,576.
MAX_CONNECTIONS = 1_000_000
# A Query holds a reader thread and a snapshot of the database.
MAX_QUERY_SECONDS = 3600.0
# A worker between jobs is idle; longer than a day, it is gone.
MAX_IDLE_SECONDS = 86400.0
# The largest request (4 MiB of head, 1 MiB of body) arrives within this
# over any link still worth serving.
MAX_REQUEST_SECONDS = 3600.0
# Ten years: for retention, longer is an archive, not a queue; for the
# stale-job net, longer is the same as never.
MAX_DURATION_SECONDS = 3650 * 86400.0
# An early reply waits at most as long as an AwaitReply may (30 days).
MIN_REPLY_GRACE_SECONDS = 1.0
MAX_REPLY_GRACE_SECONDS = 30 * 86400.0


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="run the job server",
        description=(
            "Run the job server in the foreground. Jobs are kept in one SQLite "
            "file; a write is acknowledged only once it is on disk. SIGINT or "
            "SIGTERM stop it cleanly. Try it with: nc 127.0.0.1 8888"
        ),
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
    )
    serve.add_argument(
        "--port",
        type=number(int, 0, MAX_PORT),
        default=8888,
        help=f"TCP port, 0 to {MAX_PORT}; 0 picks a free one (default: 8888)",
    )
    serve.add_argument(
        "--db", default="jobs.db", help="SQLite database file, created if missing (default: jobs.db)"
    )
    serve.add_argument(
        "--synchronous",
        choices=SYNCHRONOUS_MODES,
        default="FULL",
        help=(
            "SQLite synchronous mode. FULL syncs every commit to disk before "
            "its reply. NORMAL is faster, but a power loss or OS crash (not a "
            "server crash) can lose the last acknowledged writes (default: FULL)"
        ),
    )
    serve.add_argument(
        "--max-connections",
        type=number(int, 1, MAX_CONNECTIONS),
        default=Config.max_connections,
        metavar="N",
        help=f"connections beyond this, 1 to {MAX_CONNECTIONS:,}, are answered "
        f"'503 Too many connections' (default: {Config.max_connections})",
    )
    serve.add_argument(
        "--allow-remote-query",
        action="store_true",
        help="accept the read-only Query command from non-loopback clients (default: off)",
    )
    serve.add_argument(
        "--query-timeout",
        type=number(float, 0, MAX_QUERY_SECONDS, above=True, unit="seconds"),
        default=Config.query_seconds,
        metavar="SECONDS",
        help=f"a Query running longer, above 0 and at most {MAX_QUERY_SECONDS:g}, is "
        f"stopped with '555 Timeout' (default: {Config.query_seconds:g})",
    )
    serve.add_argument(
        "--idle-timeout",
        type=number(float, 0, MAX_IDLE_SECONDS, above=True, unit="seconds"),
        default=Config.idle_timeout,
        metavar="SECONDS",
        help=f"close a connection with no request under way for this long, above 0 and "
        f"at most {MAX_IDLE_SECONDS:g} (default: {Config.idle_timeout:g})",
    )
    serve.add_argument(
        "--request-timeout",
        type=number(float, 0, MAX_REQUEST_SECONDS, above=True, unit="seconds"),
        default=Config.request_timeout,
        metavar="SECONDS",
        help=f"a request must arrive whole within this of its first byte, above 0 and "
        f"at most {MAX_REQUEST_SECONDS:g}, else '408 Request timeout' and the "
        f"connection is closed (default: {Config.request_timeout:g})",
    )
    serve.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="require every request to carry the token in this file in an "
        "'authToken' header; others get '401 Unauthorized' (default: no token)",
    )
    serve.add_argument(
        "--limit",
        action="append",
        type=_limit,
        default=[],
        metavar="PATTERN=MAX",
        help="a concurrency limit: jobs whose name matches the GLOB PATTERN may "
        "together cost at most MAX (1 or more) while running; repeatable; "
        "SetLimit changes them at run time (default: none)",
    )
    serve.add_argument(
        "--keep-finished",
        type=duration(0.0, MAX_DURATION_SECONDS),
        default=0.0,
        metavar="DURATION",
        help="keep finished jobs, with their final data, this long: 0 to "
        f"{duration_text(MAX_DURATION_SECONDS)}, such as 90s, 30m, 12h or 7d "
        "(default: 0, deleted at once, as Bedrock does)",
    )
    serve.add_argument(
        "--keep-failed",
        type=duration(0.0, MAX_DURATION_SECONDS),
        metavar="DURATION",
        help="delete FAILED jobs this long after they failed: 0 to "
        f"{duration_text(MAX_DURATION_SECONDS)} (default: kept until deleted or requeued)",
    )
    serve.add_argument(
        "--reply-grace",
        type=duration(MIN_REPLY_GRACE_SECONDS, MAX_REPLY_GRACE_SECONDS),
        default=DEFAULT_REPLY_GRACE,
        metavar="DURATION",
        help="keep a reply that comes before its AwaitReply this long, and remember a "
        "delivered one as long to refuse a second delivery: "
        f"{duration_text(MIN_REPLY_GRACE_SECONDS)} to "
        f"{duration_text(MAX_REPLY_GRACE_SECONDS)} "
        f"(default: {duration_text(DEFAULT_REPLY_GRACE)})",
    )
    serve.add_argument(
        "--stale-after",
        type=duration(0.0, MAX_DURATION_SECONDS),
        default=DEFAULT_STALE_AFTER,
        metavar="DURATION",
        help="a RUNNING job with no report (FinishJob, FailJob, RetryJob, UpdateJob, "
        "TouchJob) for this long counts as a failed attempt: retried by its retry policy, "
        f"else FAILED; 0 (never, as Bedrock) or 1s to {duration_text(MAX_DURATION_SECONDS)} "
        f"(default: {duration_text(DEFAULT_STALE_AFTER)})",
    )
    serve.add_argument(
        "--tls-cert", metavar="FILE", help="serve TLS with this certificate, PEM (default: plain TCP)"
    )
    serve.add_argument(
        "--tls-key", metavar="FILE", help="the private key for --tls-cert, PEM (default: none)"
    )
    serve.add_argument(
        "--log-level",
        type=log_level,
        choices=LOG_LEVELS,
        default="INFO",
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING or ERROR, in any case (default: INFO)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jobserver",
        description="A durable job queue that speaks Bedrock::Jobs' text protocol.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"jobserver {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    _add_serve(sub)
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
    _add_client_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "worker-manager":
        return workers.run(args)
    return _run_client_command(args)


def _limit(text: str) -> tuple[str, int]:
    pattern, sep, number = text.rpartition("=")
    if not sep or not pattern or not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"not PATTERN=MAX with MAX >= 1: {text!r}")
    return pattern, int(number)


def _read_token(path: str) -> str:
    token = open(path, encoding="utf-8").read().strip()
    if not token:
        raise ValueError(f"{path} is empty")
    return token


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level,
        format="%(asctime)s jobserver %(levelname)s %(message)s",
    )
    if bool(args.tls_cert) != bool(args.tls_key):
        log.error("--tls-cert and --tls-key go together")
        return 2
    for path in filter(None, (args.tls_cert, args.tls_key)):
        if not os.path.isfile(path):
            log.error("no such TLS file: %s", path)
            return 2
    try:
        token = _read_token(args.auth_token_file) if args.auth_token_file else None
    except (OSError, ValueError) as error:
        log.error("cannot use --auth-token-file: %s", error)
        return 2
    config = Config(
        host=args.host,
        port=args.port,
        db=args.db,
        synchronous=args.synchronous,
        max_connections=args.max_connections,
        allow_remote_query=args.allow_remote_query,
        query_seconds=args.query_timeout,
        idle_timeout=args.idle_timeout,
        request_timeout=args.request_timeout,
        auth_token=token,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        limits=dict(args.limit),
        keep_finished=args.keep_finished,
        keep_failed=args.keep_failed,
        reply_grace=args.reply_grace,
        stale_after=args.stale_after,
    )
    try:
        trio.run(Server(config).run)
    except StoreError as error:
        log.error("%s", error)
        return 2
    except ssl.SSLError as error:
        log.error("cannot use the TLS certificate or key: %s", error)
        return 2
    except OSError as error:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, error)
        return 1
    return 0


# The command-line client. Each subcommand is one call of jobserver.client;
# its result is printed as JSON, a refusal as the status line on stderr with
# an exit status a script can test.

EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_ILLEGAL_STATE = 3
EXIT_SERVER_ERROR = 4
EXIT_CONNECTION = 5
# Ctrl-C, as shells report it.
EXIT_INTERRUPTED = 130

EXIT_STATUS_HELP = f"""\
exit status of the client commands (create, get, query, ...):
  0  done; the result is on stdout as JSON
  {EXIT_NOT_FOUND}  not found (404): no job to hand out, or no such job
  {EXIT_USAGE}  usage error, or the server refused the request as invalid (401, 402, other 4xx)
  {EXIT_ILLEGAL_STATE}  the job's state does not allow it (405, 409)
  {EXIT_SERVER_ERROR}  server error (5xx) or an unexpected reply
  {EXIT_CONNECTION}  cannot connect, or the connection broke during the request
A refusal prints the server's status line on stderr, e.g. "404 No job found"."""

PRIORITIES = (0, 250, 500, 750, 850, 1000)
# What the server takes (protocol.md section 3): a waiting GetJob's timeout,
# RetryJob's delay (8 digits), FailedJobs' limit.
MAX_WAIT = 3600
MAX_DELAY = 99_999_999
MAX_FAILED_LIMIT = 10_000
JOB_ID_HELP = f"a jobID, 1 to {MAX_JOB_ID}"

Action = Callable[[Client, argparse.Namespace], Any]


def _add_client_commands(sub: Any) -> None:
    command = _command_factory(sub)
    _add_create_options(
        command("create", _create, "create a job", 'Create a job and print {"jobID": N}.')
    )
    get = command(
        "get",
        _get,
        "take the next due job",
        "Take the next due job whose name matches PATTERN and print it. The job is "
        "then RUNNING (RUNQUEUED if it has a lease) until it is finished, retried "
        "or failed. Exits 1 with '404 No job found' on stderr when there is none.",
    )
    get.add_argument(
        "pattern",
        metavar="PATTERN",
        help="a GLOB pattern such as 'email/*', or a comma-separated list of exact names",
    )
    get.add_argument(
        "--wait",
        type=number(float, 0, MAX_WAIT),
        metavar="SECONDS",
        help=f"if no job is due, wait up to this long for one, 0 to {MAX_WAIT} "
        "(default: do not wait)",
    )
    _add_job_id(command("query", _query, "show a job", "Print a job, its state included."))
    finish = command(
        "finish",
        _finish,
        "report a job done",
        "Report a job that was handed out as done. Without a repeat it is deleted; "
        "with one it is queued for its next run. Prints {}.",
    )
    _add_job_id(finish)
    finish.add_argument(
        "--data",
        type=_json_object,
        metavar="JSON",
        help="replace the job's data with this JSON object (default: keep the data)",
    )
    fail = command(
        "fail",
        _fail,
        "report a job failed",
        "Report a job that was handed out as failed. It becomes FAILED and is kept until "
        "deleted or requeued (jobserver requeue); a job with a retry policy and attempts "
        "left is queued again after its backoff instead. Prints {}.",
    )
    _add_job_id(fail)
    fail.add_argument(
        "--error",
        metavar="TEXT",
        help="why it failed: the job's last error, as 'jobserver failed' lists it "
        "(default: none)",
    )
    retry = command(
        "retry",
        _retry,
        "put a job back in the queue",
        "Put a job that was handed out back in the queue: at once, after --delay, "
        "or at its repeat rule's next run. Prints {}.",
    )
    _add_job_id(retry)
    retry.add_argument(
        "--delay",
        type=number(int, 0, MAX_DELAY),
        metavar="SECONDS",
        help=f"seconds from now before it is due again, 0 to {MAX_DELAY} (default: at its "
        "repeat rule's next run, or now)",
    )
    delete = command(
        "delete", _delete, "delete a job", "Delete a job that is not RUNNING or PAUSED. Prints {}."
    )
    _add_job_id(delete)
    command(
        "status",
        _status,
        "show the server's status",
        "Print the server's status: jobs per state, waiting GetJobs, connections, "
        "database size, uptime and version.",
    )
    failed = command(
        "failed",
        _failed_jobs,
        "list dead jobs with their last error",
        "Print the FAILED jobs whose name matches PATTERN (default: all), oldest "
        'first, as {"jobs": [...]}, each with its jobID, name, created, lastRun and '
        "lastError (and attempt and maxAttempts for a job with a retry policy). "
        "Revive them with 'jobserver requeue ID...'.",
    )
    failed.add_argument(
        "pattern",
        metavar="PATTERN",
        nargs="?",
        default="*",
        help="a GLOB pattern such as 'email/*', or a comma-separated list of exact names",
    )
    failed.add_argument(
        "--limit",
        type=number(int, 1, MAX_FAILED_LIMIT),
        metavar="N",
        help=f"list at most N jobs, 1 to {MAX_FAILED_LIMIT} (default: 1000)",
    )
    requeue = command(
        "requeue",
        _requeue,
        "put jobs back in the queue, whatever their state",
        "Put the jobs back in the queue, due now, whatever their state (RequeueJobs): "
        "revives FAILED jobs, with all the attempts of their retry policy. IDs of jobs "
        "that do not exist are skipped. Prints {}.",
    )
    requeue.add_argument("ids", type=job_id, nargs="+", metavar="ID", help=JOB_ID_HELP)
    requeue.add_argument(
        "--name", metavar="NAME", help="rename every listed job (default: keep their names)"
    )
    deliver = command(
        "deliver",
        _deliver,
        "deliver an external reply to the job waiting on KEY",
        "Deliver a reply: the job waiting on KEY (AwaitReply) is queued again, due "
        'now, with the reply in its data under "reply". Prints {"jobID": N}; or, if '
        'no job waits on KEY yet, {"expires": "..."}: the reply is kept for the '
        "grace period for a job to await it. Exits 1 with '404 Reply already "
        "delivered' if this key's reply was delivered (or kept) already.",
    )
    deliver.add_argument("key", metavar="KEY", help="the correlation key")
    deliver.add_argument(
        "--data", type=_json_object, required=True, metavar="JSON",
        help="the reply, a JSON object (required)",
    )


def _command_factory(sub: Any) -> Callable[[str, Action, str, str], argparse.ArgumentParser]:
    """Adds a client subcommand: --server, the exit statuses, and what it runs."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--server",
        type=server_address,
        metavar="HOST:PORT",
        help=f"the server, PORT 1 to 65535 (default: $JOBSERVER_SERVER, else {DEFAULT_SERVER})",
    )
    common.add_argument("--auth-token-file", metavar="FILE", help=AUTH_TOKEN_HELP)
    add_tls_arguments(common)

    def command(name: str, action: Action, help: str, description: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = sub.add_parser(
            name,
            parents=[common],
            help=help,
            # Wrapped here: the raw formatter keeps the epilog's table as written.
            description=textwrap.fill(description),
            epilog=EXIT_STATUS_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.set_defaults(action=action)
        return parser

    return command


def _add_job_id(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", type=job_id, metavar="ID", help=JOB_ID_HELP)


def _add_create_options(create: argparse.ArgumentParser) -> None:
    create.add_argument("name", metavar="NAME", help="the job's name, e.g. email/send")
    create.add_argument(
        "--data",
        type=_json_object,
        metavar="JSON",
        help="the job's data: a JSON object (default: {})",
    )
    create.add_argument(
        "--first-run",
        metavar="WHEN",
        help="when the job is first due, year first, e.g. '2030-01-01 04:00:00': "
        "YYYY-MM-DD, YYYY-MM-DD HH:MM or YYYY-MM-DD HH:MM:SS ('T' or a space between), "
        "in UTC unless it ends in an offset such as +02:00 (default: now)",
    )
    create.add_argument(
        "--repeat",
        metavar="RULE",
        help="run again after each run, e.g. 'FINISHED, +1 HOUR' or DAILY, see protocol.md "
        "section 6 (default: run once)",
    )
    create.add_argument(
        "--priority",
        type=int,
        choices=PRIORITIES,
        metavar="P",
        help="0, 250, 500, 750, 850 or 1000; higher runs first (default: 500)",
    )
    create.add_argument(
        "--retry-after",
        metavar="M",
        help="a lease, e.g. '+5 MINUTES': if the job is not finished, retried or failed "
        "by then, it is handed out again (default: no lease)",
    )


def _json_object(text: str) -> dict[str, Any]:
    try:
        return jsonbody.parse_object(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"must be a JSON object such as '{{\"to\": \"ann\"}}' ({error}): {text!r}"
        ) from error


def _create(client: Client, args: argparse.Namespace) -> dict[str, int]:
    job_id = client.create_job(
        args.name,
        data=args.data,
        first_run=args.first_run,
        repeat=args.repeat,
        priority=args.priority,
        retry_after=args.retry_after,
    )
    return {"jobID": job_id}


def _get(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    job = client.get_job(args.pattern, wait=args.wait)
    if job is None:
        # An empty queue is a normal answer for the library; a script wants it in the exit status.
        raise JobNotFound("404 No job found")
    return job


def _query(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    return client.query_job(args.id)


def _finish(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.finish_job(args.id, data=args.data)
    return {}


def _fail(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.fail_job(args.id, error=args.error)
    return {}


def _requeue(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.requeue_jobs(args.ids, name=args.name)
    return {}


def _retry(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.retry_job(args.id, delay=args.delay)
    return {}


def _delete(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.delete_job(args.id)
    return {}


def _deliver(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    return client.deliver_reply(args.key, args.data)


def _status(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    return client.status()


def _failed_jobs(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    return {"jobs": client.failed_jobs(args.pattern, limit=args.limit)}


def _run_client_command(args: argparse.Namespace) -> int:
    try:
        host, port = args.server or parse_address(
            os.environ.get("JOBSERVER_SERVER") or DEFAULT_SERVER
        )
    except ValueError as error:
        print(f"jobserver: $JOBSERVER_SERVER: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        token = auth_token(args.auth_token_file)
        client = Client(host, port, auth_token=token, tls=tls_option(args))
    except (ValueError, OSError) as error:
        print(f"jobserver: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with client:
            result = args.action(client, args)
    except JobServerError as error:
        print(error.status, file=sys.stderr)
        return _exit_status(error)
    except ConnectionFailed as error:
        print(f"jobserver: {error}", file=sys.stderr)
        return EXIT_CONNECTION
    except KeyboardInterrupt:
        # Closing the connection ends a waiting get; the server keeps its job.
        return EXIT_INTERRUPTED
    print(json.dumps(result))
    return 0


def _exit_status(error: JobServerError) -> int:
    if isinstance(error, JobNotFound):
        return EXIT_NOT_FOUND
    if isinstance(error, (IllegalState, Conflict)):
        return EXIT_ILLEGAL_STATE
    if isinstance(error, ServerError) or not 400 <= error.code <= 499:
        return EXIT_SERVER_ERROR
    return EXIT_USAGE
