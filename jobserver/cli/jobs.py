"""The client subcommands of a job's life after create (create.py): get,
query, await, update, touch, await-reply, finish, fail, retry, cancel and delete.
Each is one call of jobserver.client (client_command.py runs it)."""

from __future__ import annotations

import argparse
import re
from typing import Any

from jobserver.cli import create
from jobserver.cli.client_command import CommandAdder, PartlyRefused, add_check
from jobserver.cli.options import (
    JOB_ID_HELP,
    JOB_PATTERNS_HELP,
    KEY_HELP,
    add_job_id,
    add_lease_id,
    add_priority,
    job_id,
    json_object,
    lease_id,
    number,
    reply_key,
)
from jobserver.client import Client, JobNotFound, JobServerError
from jobserver.wire.counts import counted
from jobserver.wire.limits import (
    DEFAULT_REPLY_TIMEOUT,
    DEFAULT_WAIT_MS,
    MAX_DELAY,
    MAX_FINISH_JOBS,
    MAX_REPLY_TIMEOUT,
    MAX_RESULTS,
    MAX_WAIT_MS,
)

# A waiting get's longest wait, in the seconds --wait takes.
MAX_WAIT = MAX_WAIT_MS // 1000



def add_parsers(command: CommandAdder) -> None:
    """A job's subcommands, in the order of its life."""
    create.add_parser(command)
    _add_get(command)
    _add_query(command)
    _add_await(command)
    _add_update(command)
    _add_touch(command)
    _add_await_reply(command)
    _add_finish(command)
    _add_fail(command)
    _add_retry(command)
    _add_cancel_and_delete(command)


# get, query


def _add_get(command: CommandAdder) -> None:
    get = command(
        "get",
        _get,
        "take the next due job, or several",
        "Take the next due job whose name matches PATTERN and print it; with --count, "
        'up to N jobs at once (GetJobs), printed as {"jobs": [...]}. Each job is then '
        "RUNNING (RUNQUEUED if it has a lease) until it is finished, retried or failed, "
        "and carries its leaseID. Exits 1 with '404 No job found' on stderr when there "
        "is none.",
    )
    get.add_argument("pattern", metavar="PATTERN", help=JOB_PATTERNS_HELP)
    get.add_argument(
        "--wait",
        type=number(float, 0, MAX_WAIT),
        metavar="SECONDS",
        help=f"if no job is due, wait up to this long for one, 0 to {MAX_WAIT} "
        "(default: do not wait)",
    )
    get.add_argument(
        "--count",
        type=number(int, 1, MAX_RESULTS),
        metavar="N",
        help=f'take up to N jobs, 1 to {MAX_RESULTS}, and print {{"jobs": [...]}} '
        "(default: one job, printed as it is)",
    )
    add_priority(get, "only jobs of this priority (default: any)")


def _get(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    if args.count is not None:
        jobs = client.get_jobs(args.pattern, args.count, wait=args.wait, priority=args.priority)
        if not jobs:
            raise JobNotFound("404 No job found")
        return {"jobs": jobs}
    job = client.get_job(args.pattern, wait=args.wait, priority=args.priority)
    if job is None:
        # An empty queue is a normal answer for the library; a script wants it in the exit status.
        raise JobNotFound("404 No job found")
    return job


def _add_await(command: CommandAdder) -> None:
    wait = command(
        "await",
        _await,
        "wait until a job has ended, and print how it ended",
        "Wait until the job has ended (AwaitJob, protocol.md 14.27) and print its outcome: "
        '{"jobID", "name", "state", "data", "lastError", "ended"}, state being FINISHED, '
        "FAILED, CANCELLED or DELETED (deleted before it ended); a FINISHED job's data is "
        "its result. A job that has ended is answered at once while the server keeps its "
        "outcome (--keep-outcomes, an hour by default). Exits 6 with '202 Job not ended "
        "yet' on stderr if it has not ended within --timeout, 1 if there is no such job.",
    )
    add_job_id(wait)
    wait.add_argument(
        "--timeout",
        type=number(float, 0, MAX_WAIT),
        metavar="SECONDS",
        help=f"wait up to this long, 0 to {MAX_WAIT} (default: {DEFAULT_WAIT_MS // 1000})",
    )


def _await(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    outcome = client.await_job(args.id, args.timeout)
    if outcome is None:
        raise JobServerError("202 Job not ended yet")
    return outcome


# A whole number, as a person types a jobID: what `query` takes for one.
_WHOLE_NUMBER = re.compile(r"\s*[-+]?[0-9]+\s*")


def job_id_or_sql(text: str) -> int | str:
    """`query`'s argument: a whole number is a jobID (and must be one),
    anything else SQL."""
    if _WHOLE_NUMBER.fullmatch(text):
        return int(job_id(text.strip()))
    return text


def _add_query(command: CommandAdder) -> None:
    query = command(
        "query",
        _query,
        "show a job, or run a read-only SQL query",
        "With a jobID (a whole number), print that job, its state included (QueryJob). "
        "With anything else, run it as one read-only SQL statement ending in ';' "
        "(Query, protocol.md 5.15; from the server's own host only, unless it runs "
        'with --allow-remote-query) and print {"headers": [column names], "rows": '
        "[[values], ...]}, with integers and finite reals as numbers and everything "
        "else as text (NULL as \"\").",
    )
    query.add_argument(
        "target",
        type=job_id_or_sql,
        metavar="ID|SQL",
        help=f"{JOB_ID_HELP}; or SQL, e.g. 'SELECT jobID, state FROM jobs;'",
    )


def _query(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    if isinstance(args.target, int):
        return with_local_runs(client.query_job(args.target))
    return client.query(args.target)


def with_local_runs(job: dict[str, Any]) -> dict[str, Any]:
    """A CRON job's nextRuns (UTC) also as `nextRunsLocal`, on the wall
    clock of its timeZone, with the offset: `2027-03-29T09:00:00+02:00`."""
    runs = job.get("nextRuns")
    if not isinstance(runs, list):
        return job
    from jobserver.model import cron  # only for a CRON job: a client starts light

    zone = str(job.get("timeZone") or "UTC")
    return {**job, "nextRunsLocal": [cron.in_zone(run, zone).isoformat() for run in runs]}


# update, touch, await-reply


def _add_update(command: CommandAdder) -> None:
    update = command(
        "update",
        _update,
        "replace a job's data, and change its schedule or priority",
        "Replace a job's data, in any state, and optionally its repeat rule, priority "
        "and next run (UpdateJob); its state does not change. Prints {}.",
    )
    add_job_id(update)
    update.add_argument(
        "--data",
        type=json_object,
        required=True,
        metavar="JSON",
        help="the job's new data, a JSON object that replaces the old one whole (required)",
    )
    repeat = update.add_mutually_exclusive_group()
    repeat.add_argument(
        "--repeat",
        metavar="RULE",
        help=f"a new repeat rule, {create.REPEAT_HELP}; the next run follows from it unless "
        "--next-run is given (default: keep the rule)",
    )
    repeat.add_argument(
        "--clear-repeat",
        action="store_true",
        help="drop the repeat rule: the job runs once more (default: keep the rule)",
    )
    add_priority(update, "the job's new priority (default: keep it)")
    update.add_argument(
        "--next-run", metavar="WHEN", help=f"when the job is next due, {create.WHEN_HELP} "
        "(default: keep it, or follow --repeat)"
    )
    update.add_argument(
        "--time-zone",
        metavar="ZONE",
        help="a new IANA time zone for the job's time windows and CRON rule, e.g. "
        "Europe/Paris; a CRON job's next run moves into it (default: keep it)",
    )
    add_lease_id(update)


def _update(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.update_job(
        args.id,
        args.data,
        repeat=args.repeat,
        priority=args.priority,
        next_run=args.next_run,
        lease_id=args.lease_id,
        clear_repeat=args.clear_repeat,
        time_zone=args.time_zone,
    )
    return {}


def _add_touch(command: CommandAdder) -> None:
    touch = command(
        "touch",
        _touch,
        "show a handed-out job is still being worked on",
        "Tell the server a handed-out job is still being worked on (TouchJob). A leased "
        "(RUNQUEUED) job's lease is renewed to its retryAfter from now: prints "
        '{"nextRun": "..."}, the new end of the lease. A RUNNING job\'s stale-job count '
        'starts again: prints {"staleAt": "..."}, when it would be presumed lost, or {} '
        "if the server runs with --stale-after 0.",
    )
    add_job_id(touch)
    add_lease_id(touch)


def _touch(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    # The reply says which of the two deadlines it is; touch_job gives only the time.
    reply = client.request("TouchJob", {"jobID": args.id, "leaseID": args.lease_id})
    body: dict[str, Any] = reply.json()
    return body


def _add_await_reply(command: CommandAdder) -> None:
    await_reply = command(
        "await-reply",
        _await_reply,
        "park a handed-out job until a reply for KEY is delivered",
        "Park a handed-out job until a reply for KEY is delivered (AwaitReply, "
        "protocol.md 14.12): it is WAITING, holding no worker, until 'jobserver deliver "
        "KEY' queues it again with the reply in its data, or the timeout fails it. Prints "
        '{"replyDeadline": "...", "state": "WAITING"}; or {"state": "QUEUED"} when the '
        "reply had come already. Exits 3 with '409 Another job waits on this key'.",
    )
    add_job_id(await_reply)
    await_reply.add_argument("key", type=reply_key, metavar="KEY", help=KEY_HELP)
    await_reply.add_argument(
        "--timeout",
        type=number(int, 1, MAX_REPLY_TIMEOUT),
        metavar="SECONDS",
        help=f"fail the job (or retry it, per its retry policy) if no reply comes within "
        f"this long, 1 to {MAX_REPLY_TIMEOUT} (default: {DEFAULT_REPLY_TIMEOUT}, a day)",
    )
    await_reply.add_argument(
        "--data",
        type=json_object,
        metavar="JSON",
        help="replace the job's data with this JSON object (default: keep the data)",
    )
    add_lease_id(await_reply)


def _await_reply(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    return client.await_reply(
        args.id, args.key, timeout=args.timeout, lease_id=args.lease_id, data=args.data
    )


# finish, fail, retry


def _add_finish(command: CommandAdder) -> None:
    finish = command(
        "finish",
        _finish,
        "report jobs done",
        "Report a job that was handed out as done (FinishJob). Without a repeat it is "
        "deleted; with one it is queued for its next run. Prints {}. With several IDs, "
        "all are reported in one request (FinishJobs), each on its own: prints "
        '{"results": [{"jobID": N, "status": "200 OK"}, ...]} in the order given, each '
        "status the one finishing that job alone would have had. If any was refused, "
        "each refused one is also named on stderr ('job N: 409 Lease expired') and the "
        "exit status is that of the first refused; the others are finished all the same.",
    )
    finish.add_argument(
        "ids",
        type=job_id,
        nargs="+",
        metavar="ID",
        help=f"{JOB_ID_HELP}; up to {MAX_FINISH_JOBS} of them",
    )
    finish.add_argument(
        "--data",
        type=json_object,
        metavar="JSON",
        help="replace the data of each job with this JSON object (default: keep the data)",
    )
    finish.add_argument(
        "--lease-id",
        type=lease_id,
        action="append",
        metavar="LEASE",
        help="the leaseID the job was handed out with: refused with '409 Lease expired' "
        "(exit 3) if it has been handed out again since; with several IDs, give it once "
        "per ID, in the same order (default: none, whoever holds the jobs)",
    )
    add_check(finish, _finish_counts)


def _finish_counts(args: argparse.Namespace) -> str | None:
    if len(args.ids) > MAX_FINISH_JOBS:
        return f"at most {MAX_FINISH_JOBS} IDs, not {len(args.ids)}"
    if args.lease_id is not None and len(args.lease_id) != len(args.ids):
        return (
            f"{counted(len(args.ids), 'ID takes', 'IDs take')} {len(args.ids)} --lease-id, "
            f"one per ID in the same order, or none; {len(args.lease_id)} given"
        )
    return None


def _finish(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    leases = args.lease_id or [None] * len(args.ids)
    if len(args.ids) == 1:
        client.finish_job(args.ids[0], data=args.data, lease_id=leases[0])
        return {}
    results = client.finish_jobs(
        [(job, lease, args.data) for job, lease in zip(args.ids, leases, strict=True)]
    )
    printed = {"results": [{"jobID": r.job_id, "status": r.status} for r in results]}
    refused = [r for r in results if not r.ok]
    if refused:
        first = refused[0].error()
        assert first is not None
        complaints = [f"job {r.job_id}: {r.status}" for r in refused]
        raise PartlyRefused(printed, complaints, first)
    return printed


def _add_fail(command: CommandAdder) -> None:
    fail = command(
        "fail",
        _fail,
        "report a job failed",
        "Report a job that was handed out as failed. It becomes FAILED and is kept until "
        "deleted or requeued (jobserver requeue); a job with a retry policy and attempts "
        "left is queued again after its backoff instead. Prints {}.",
    )
    add_job_id(fail)
    fail.add_argument(
        "--error",
        metavar="TEXT",
        help="why it failed: the job's last error, as 'jobserver failed' lists it "
        "(default: none)",
    )
    fail.add_argument(
        "--data",
        type=json_object,
        metavar="JSON",
        help="replace the job's data with this JSON object (default: keep the data)",
    )
    add_lease_id(fail)


def _fail(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.fail_job(args.id, data=args.data, lease_id=args.lease_id, error=args.error)
    return {}


def _add_retry(command: CommandAdder) -> None:
    retry = command(
        "retry",
        _retry,
        "put a handed-out job back in the queue",
        "Put a job that was handed out back in the queue (RetryJob): at its repeat "
        "rule's next run if it has one, else at --next-run, after --delay, or now. "
        "Prints {}.",
    )
    add_job_id(retry)
    when = retry.add_mutually_exclusive_group()
    when.add_argument(
        "--delay",
        type=number(int, 0, MAX_DELAY),
        metavar="SECONDS",
        help=f"seconds from now before it is due again, 0 to {MAX_DELAY} (default: at its "
        "repeat rule's next run, or now)",
    )
    when.add_argument(
        "--next-run",
        metavar="WHEN",
        help=f"when it is due again, {create.WHEN_HELP} (default: at its repeat rule's next run, "
        "or now)",
    )
    retry.add_argument(
        "--ignore-repeat",
        action="store_true",
        help="use --delay or --next-run even if the job repeats (default: a repeating "
        "job follows its rule)",
    )
    retry.add_argument(
        "--data",
        type=json_object,
        metavar="JSON",
        help="replace the job's data with this JSON object (default: keep the data)",
    )
    retry.add_argument("--name", metavar="NAME", help="rename the job (default: keep its name)")
    add_priority(retry, "the job's new priority (default: keep it)")
    add_lease_id(retry)


def _retry(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.retry_job(
        args.id,
        delay=args.delay,
        next_run=args.next_run,
        data=args.data,
        name=args.name,
        priority=args.priority,
        ignore_repeat=args.ignore_repeat,
        lease_id=args.lease_id,
    )
    return {}


# cancel, delete


def _add_cancel_and_delete(command: CommandAdder) -> None:
    cancel = command(
        "cancel",
        _cancel,
        "cancel a child job",
        "Cancel a child job (CancelJob): one that is QUEUED, RUNQUEUED or FAILED becomes "
        "CANCELLED, and a PAUSED parent left with nothing to wait for is queued. A child "
        "that is FINISHED, RUNNING or PAUSED is left as it is. Prints {}. Exits 1 with "
        "'404 Invalid jobID - Cannot cancel a job without a parent' for a job that is not "
        "a child. With --running, any RUNNING or RUNQUEUED job is cancelled: its worker's "
        "next report is answered '410 Job cancelled' and the job ends CANCELLED.",
    )
    add_job_id(cancel)
    cancel.add_argument(
        "--running", action="store_true",
        help="also a job that is running, child or not (protocol.md 14.26) "
        "(default: children that are not running only)",
    )
    delete = command(
        "delete", _delete, "delete a job", "Delete a job that is not RUNNING or PAUSED. Prints {}."
    )
    add_job_id(delete)


def _cancel(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.cancel_job(args.id, running=args.running)
    return {}


def _delete(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    client.delete_job(args.id)
    return {}
