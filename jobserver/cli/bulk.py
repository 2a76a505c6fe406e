"""The bulk actions' subcommands (protocol.md 14.19): requeue-failed,
delete-failed and cancel-queued, each one call of RequeueFailedJobs,
DeleteFailedJobs or CancelQueuedJobs, with --dry-run to see first what it
would act on."""

from __future__ import annotations

import argparse
from typing import Any

from jobserver.cli.client_command import CommandAdder
from jobserver.cli.options import JOB_ID_HELP, JOB_NAMES_HELP, job_id, job_names, number, pattern
from jobserver.client import Client
from jobserver.wire.limits import MAX_BULK, MAX_BULK_EXAMINED

REPLY_HELP = (
    'Prints {"matched": N, "acted": N, "remaining": N, "jobIDs": [...]}: how many jobs '
    "matched, how many it acted on (at most --limit) and how many are left, which were "
    f"acted on, oldest first. It acts on at most {MAX_BULK} jobs at a time: run it again "
    "while 'remaining' is not 0. With --dry-run nothing changes and jobIDs lists those "
    f"it would act on. A run examines at most {MAX_BULK_EXAMINED:,} jobs (fewer for a long "
    'pattern); when more could match it adds "complete": false and "examined": N, and '
    "counts only what it found: run it again while it acts on some; if it found none, "
    "narrow the selection (--queue, or a pattern that begins with more of the name)."
)


def add_parsers(command: CommandAdder) -> None:
    _add(
        command,
        "requeue-failed",
        "RequeueFailedJobs",
        "requeue every FAILED job of a pattern, queue or list",
        "Put back in the queue, due now and with all the attempts of their retry policy, "
        "the FAILED jobs whose name matches PATTERN, of --queue, or listed with --ids "
        "(RequeueFailedJobs). Jobs in any other state are never touched.",
    )
    _add(
        command,
        "delete-failed",
        "DeleteFailedJobs",
        "delete every FAILED job of a pattern, queue or list",
        "Delete the FAILED jobs whose name matches PATTERN, of --queue, or listed with "
        "--ids (DeleteFailedJobs). Jobs in any other state are never touched.",
    )
    _add(
        command,
        "cancel-queued",
        "CancelQueuedJobs",
        "take every QUEUED job of a pattern, queue or list out of the queue",
        "Take out of the queue the QUEUED jobs (due now or later) whose name matches "
        "PATTERN, of --queue, or listed with --ids (CancelQueuedJobs): a child job is "
        "cancelled as 'jobserver cancel' does, any other job deleted. Running jobs, and "
        "jobs a worker holds under a lease (RUNQUEUED), are never touched.",
    )


def _add(command: CommandAdder, name: str, verb: str, summary: str, text: str) -> None:
    parser = command(name, _action(verb), summary, f"{text} {REPLY_HELP}")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("pattern", type=job_names, metavar="PATTERN", nargs="?", help=JOB_NAMES_HELP)
    which.add_argument(
        "--queue",
        type=queue_name,
        metavar="QUEUE",
        help="the jobs of a queue: named QUEUE, or QUEUE/ followed by anything",
    )
    which.add_argument(
        "--ids", type=job_id, nargs="+", metavar="ID", help=f"these jobs ({JOB_ID_HELP} each)"
    )
    parser.add_argument(
        "--limit",
        type=number(int, 1, MAX_BULK),
        metavar="N",
        help=f"act on at most N jobs, 1 to {MAX_BULK} (default: {MAX_BULK})",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="change nothing: print how many jobs match and which it would act on",
    )


def queue_name(text: str) -> str:
    """A queue's name: a job name up to its first `/` (protocol.md 14.17)."""
    if "/" in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a queue: a queue is a name up to its first /"
        )
    return pattern(text)


def _action(verb: str) -> Any:
    def act(client: Client, args: argparse.Namespace) -> dict[str, Any]:
        params = {
            "name": args.pattern,
            "queue": args.queue,
            "jobIDs": ",".join(map(str, args.ids)) if args.ids else None,
            "limit": args.limit,
            "dryRun": "true" if args.dry_run else None,
        }
        reply: dict[str, Any] = client.request(verb, params).json()
        return reply

    return act
