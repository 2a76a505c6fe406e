"""The command-line client: each subcommand is one call of jobserver.client.

Its result is printed as JSON, a refusal as the status line on stderr with
an exit status a script can test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Callable
from typing import Any

from jobserver.cli import backup
from jobserver.cli.options import (
    AUTH_TOKEN_HELP,
    DEFAULT_SERVER,
    add_tls_arguments,
    job_id,
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
from jobserver.wire import jsonbody
from jobserver.wire.limits import (
    DEFAULT_LISTED,
    DEFAULT_PRIORITY,
    MAX_DELAY,
    MAX_JOB_ID,
    MAX_LISTED,
    MAX_WAIT_MS,
    PRIORITIES,
)

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

# Lowest first: argparse lists the choices in this order when one is refused.
PRIORITY_CHOICES = tuple(sorted(PRIORITIES))
PRIORITIES_TEXT = ", ".join(map(str, PRIORITY_CHOICES[:-1])) + f" or {PRIORITY_CHOICES[-1]}"
# A waiting get's longest wait, in the seconds --wait takes.
MAX_WAIT = MAX_WAIT_MS // 1000
JOB_ID_HELP = f"a jobID, 1 to {MAX_JOB_ID}"

Action = Callable[[Client, argparse.Namespace], Any]


def add_parsers(sub: Any) -> None:
    """The client subcommands, each one call of jobserver.client."""
    command = _command_factory(sub)
    _add_taking(command)
    _add_reporting(command)
    _add_operating(command)
    backup.add_parser(command)


def _add_taking(command: Callable[[str, Action, str, str], argparse.ArgumentParser]) -> None:
    """Creating, taking and looking at jobs."""
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


def _add_reporting(command: Callable[[str, Action, str, str], argparse.ArgumentParser]) -> None:
    """Reporting on a job, or removing it."""
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


def _add_operating(command: Callable[[str, Action, str, str], argparse.ArgumentParser]) -> None:
    """An operator's commands: the server's state, the dead set, replies."""
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
        type=number(int, 1, MAX_LISTED),
        metavar="N",
        help=f"list at most N jobs, 1 to {MAX_LISTED} (default: {DEFAULT_LISTED})",
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
        choices=PRIORITY_CHOICES,
        metavar="P",
        help=f"{PRIORITIES_TEXT}; higher runs first (default: {DEFAULT_PRIORITY})",
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


def run(args: argparse.Namespace) -> int:
    """Run the subcommand's call and print its result; the exit status."""
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
