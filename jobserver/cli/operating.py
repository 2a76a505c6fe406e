"""An operator's client subcommands: the server's state (status, queues,
ping), the dead set (failed, requeue), flow control (pause, resume,
set-limit) and replies (deliver). Each is one call of jobserver.client
(client_command.py runs it); `top` is in top.py."""

from __future__ import annotations

import argparse
from typing import Any

from jobserver.cli.client_command import CommandAdder, Text, add_check
from jobserver.cli.options import (
    JOB_ID_HELP,
    JOB_NAMES_HELP,
    KEY_HELP,
    job_id,
    job_names,
    json_object,
    number,
    pattern,
    rate,
    reply_key,
)
from jobserver.client import Client
from jobserver.model.limits import MAX_RATE
from jobserver.wire import last_error
from jobserver.wire.limits import (
    DEFAULT_LISTED,
    DEFAULT_QUEUES,
    MAX_CAPACITY,
    MAX_LISTED,
    MAX_NAME,
    MAX_QUEUES,
)

ONE_PATTERN_HELP = f"one GLOB pattern such as 'email/*', 1 to {MAX_NAME} bytes"


def add_parsers(command: CommandAdder) -> None:
    _add_looking(command)
    _add_dead_set(command)
    _add_flow_control(command)
    _add_deliver(command)


def _add_looking(command: CommandAdder) -> None:
    """The server's state."""
    command(
        "status",
        _status,
        "show the server's status",
        "Print the server's status: jobs per state, waiting GetJobs, connections, "
        "database size, uptime and version.",
    )
    queues = command(
        "queues",
        _queues,
        "list the queues with their depth and age",
        "Print the queues (a job name up to its first '/'), the largest first, as "
        '{"queues": [{"queue": NAME, "jobs": {STATE: N, ...}, "total": N, '
        '"oldestReadyAge": SECONDS or null, "paused": N}, ...], "more": N}: each queue\'s '
        "jobs by state, how long its oldest ready job has waited and the jobs due that "
        "a paused pattern holds (not ready); 'more' counts the queues "
        "past --limit. The server reads every job for it. 'jobserver top' shows the "
        "same, refreshed.",
    )
    queues.add_argument(
        "--limit",
        type=number(int, 1, MAX_QUEUES),
        metavar="N",
        help=f"list at most N queues, 1 to {MAX_QUEUES} (default: {DEFAULT_QUEUES})",
    )
    command(
        "ping",
        _ping,
        "check that the server answers",
        "Check that the server answers (Ping): prints {} and exits 0 if it does, exits "
        "5 if it cannot be reached.",
    )


def _add_dead_set(command: CommandAdder) -> None:
    """FAILED jobs."""
    failed = command(
        "failed",
        _failed_jobs,
        "list dead jobs with their last error",
        "Print the FAILED jobs whose name matches PATTERN (default: all), oldest "
        "first: each job's jobID, name, last run (and attempt for a job with a retry "
        "policy), then its last error as text, indented: a worker's exit status or "
        "signal, then its stderr line by line; characters that are not printable are "
        'escaped. With --json, as {"jobs": [...]}, each with its jobID, name, created, '
        "lastRun and lastError as the server has it (and attempt and maxAttempts). "
        "Revive them with 'jobserver requeue ID...', or all of a pattern with "
        "'jobserver requeue-failed PATTERN'.",
    )
    failed.add_argument(
        "--json",
        action="store_true",
        help='print {"jobs": [...]} with each lastError as the server has it, for scripts '
        "(default: text for people)",
    )
    failed.add_argument(
        "pattern",
        type=job_names,
        metavar="PATTERN",
        nargs="?",
        default="*",
        help=f"{JOB_NAMES_HELP} (default: *)",
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


def _add_flow_control(command: CommandAdder) -> None:
    """Pauses and concurrency limits (protocol.md 14.7, 14.9)."""
    pause = command(
        "pause",
        _pause,
        "stop handing out jobs whose name matches PATTERN",
        "Stop handing out jobs whose name matches PATTERN (PauseJobs) until 'jobserver "
        "resume PATTERN'. They stay QUEUED; running jobs are not touched. The pause is "
        "stored, so it survives a restart; 'jobserver status' lists paused patterns. "
        "Prints {}.",
    )
    pause.add_argument("pattern", type=pattern, metavar="PATTERN", help=ONE_PATTERN_HELP)
    resume = command(
        "resume",
        _resume,
        "hand out again the jobs a pause of PATTERN held back",
        "Remove the pause of exactly PATTERN (ResumeJobs; other paused patterns that "
        "match the same jobs still hold them) and serve waiting workers at once. "
        "Resuming a pattern that is not paused does nothing. Prints {}.",
    )
    resume.add_argument("pattern", type=pattern, metavar="PATTERN", help=ONE_PATTERN_HELP)
    set_limit = command(
        "set-limit",
        _set_limit,
        "set, change or remove a limit: capacity, rate, per key, fair",
        "Limit the jobs whose name matches PATTERN (SetLimit, protocol.md 14.7 and 14.23): "
        "together they cost at most MAX while they run; with --rate N/DURATION, at most N of "
        "them are handed out in any window of DURATION; with --per-key, MAX and the rate "
        "count each job's key (create --key) apart; with --fair, hand-outs rotate between "
        "keys, so one key's many jobs do not hold up another's few. Each run replaces the "
        "pattern's whole limit: an option left out is off. MAX may be left out beside "
        "--rate or --fair (no capacity); MAX 0 alone removes the limit. Stored, so it "
        "survives a restart, and it takes precedence over a 'serve --limit' for the same "
        "pattern; 'jobserver status' lists limits as set, with their use. Prints {}.",
    )
    set_limit.add_argument("pattern", type=pattern, metavar="PATTERN", help=ONE_PATTERN_HELP)
    set_limit.add_argument(
        "max",
        type=number(int, 0, MAX_CAPACITY),
        metavar="MAX",
        nargs="?",
        help=f"the capacity in units of cost, 0 to {MAX_CAPACITY}; 0 alone removes the limit "
        "(required unless --rate or --fair is given; default then: no capacity)",
    )
    set_limit.add_argument(
        "--rate",
        type=rate,
        metavar="N/DURATION",
        help="hand out at most N matching jobs in any window of DURATION, across every "
        f"node: N 1 to {MAX_RATE}, DURATION 1s to 1d, as 5/1s, 100/1m, 1000/1h; a job held "
        "stays QUEUED (default: no rate)",
    )
    set_limit.add_argument(
        "--per-key",
        action="store_true",
        help="count MAX and --rate for each job key apart: 'mail/* 2 --per-key' runs at "
        "most two mail jobs of each key at once (default: all keys together)",
    )
    set_limit.add_argument(
        "--fair",
        action="store_true",
        help="rotate hand-outs between keys, a round at a time (default: in queue order)",
    )
    add_check(set_limit, _limit_needs)


def _limit_needs(args: argparse.Namespace) -> str | None:
    """MAX, unless a rate or fairness holds the jobs; --per-key alone would
    remove the limit, not set one. Said here, before sending."""
    if args.max is None and not (args.rate or args.fair):
        return "give MAX, --rate or --fair (MAX 0 alone removes the limit)"
    if args.per_key and not (args.max or args.rate or args.fair):
        return "--per-key needs MAX above 0, --rate or --fair"
    return None


def _add_deliver(command: CommandAdder) -> None:
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
    deliver.add_argument("key", type=reply_key, metavar="KEY", help=KEY_HELP)
    deliver.add_argument(
        "--data", type=json_object, required=True, metavar="JSON",
        help="the reply, a JSON object (required)",
    )


def _status(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    return client.status()


def _queues(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    return client.queues(args.limit)


def _ping(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.ping()
    return {}


def _failed_jobs(client: Client, args: argparse.Namespace) -> dict[str, Any] | Text:
    jobs = client.failed_jobs(args.pattern, limit=args.limit)
    if args.json:
        return {"jobs": jobs}
    if not jobs:
        return Text("No FAILED jobs.")
    return Text("\n\n".join(failed_job_text(job) for job in jobs))


def failed_job_text(job: dict[str, Any]) -> str:
    """A FAILED job as `jobserver failed` prints it: a line about the job,
    then its last error's lines, indented."""
    about = f"job {job.get('jobID')} {last_error.printable(str(job.get('name')))}"
    about += f", last run {job.get('lastRun') or 'never'}"
    if job.get("maxAttempts"):
        about += f", attempt {job.get('attempt')} of {job['maxAttempts']}"
    lines = last_error.describe(str(job.get("lastError") or "")).lines()
    return "\n".join([about] + ["    " + line for line in lines or ["(no error recorded)"]])


def _requeue(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.requeue_jobs(args.ids, name=args.name)
    return {}


def _pause(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.pause_jobs(args.pattern)
    return {}


def _resume(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.resume_jobs(args.pattern)
    return {}


def _set_limit(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.set_limit(
        args.pattern, args.max or 0, rate=args.rate, per_key=args.per_key, fair=args.fair
    )
    return {}


def _deliver(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    return client.deliver_reply(args.key, args.data)
