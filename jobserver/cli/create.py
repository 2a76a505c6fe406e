"""The client subcommand that creates jobs: one job from options, or many
from a file of JSON lines (create_from.py). One call of jobserver.client
(client_command.py runs it)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

from jobserver.cli import create_from
from jobserver.cli.client_command import CommandAdder, UsageError, add_check
from jobserver.cli.options import (
    add_priority,
    idempotency_key,
    job_id,
    job_ids,
    job_key,
    json_object,
    number,
    retry_seconds,
    time_windows,
    time_zone,
)
from jobserver.client import Client, ConnectionFailed, OutcomeUnknown, calls
from jobserver.client.calls import new_idempotency_key
from jobserver.wire.limits import (
    BACKOFFS,
    DEFAULT_BACKOFF,
    DEFAULT_MAX_RETRY_DELAY,
    DEFAULT_PRIORITY,
    DEFAULT_RETRY_DELAY,
    MAX_ATTEMPTS,
    MAX_COST,
    MAX_DELAY,
    MAX_DEPENDENCIES,
    ON_DEPENDENCY_FAILURE,
)

WHEN_HELP = (
    "year first, e.g. '2030-01-01 04:00:00': YYYY-MM-DD, YYYY-MM-DD HH:MM or "
    "YYYY-MM-DD HH:MM:SS ('T' or a space between), in UTC unless it ends in an offset "
    "such as +02:00"
)
REPEAT_HELP = (
    "e.g. 'FINISHED, +1 HOUR', DAILY or 'CRON 0 9 * * MON-FRI' (in the job's time zone), "
    "see protocol.md section 6"
)


def add_parser(command: CommandAdder) -> None:
    create = command(
        "create",
        _create,
        "create a job, or many from JSON lines",
        'Create a job and print {"jobID": N}. With --from, create a job for each line '
        "of FILE (- for standard input), a JSON object with CreateJobs' fields such as "
        '{"name": "email/send", "data": {"to": "ann"}, "jobPriority": 1000, "key": "acme"}, in '
        f"CreateJobs batches of up to {create_from.BATCH_JOBS}, and print "
        '{"jobIDs": [...]} in line order. Every line is checked before anything is sent: a '
        "bad one is named, exit 2, and nothing is created. If the server refuses a batch, "
        "the jobIDs of the batches before it are printed and the refused lines named. With "
        "--then NAME, FILE's jobs (1 to 1,000) and a completion job NAME that runs once "
        "each of them has ended, whichever way, are created in one request, all or none, "
        'the options describing the completion job, and {"jobIDs": [...], "thenJobID": N} '
        "is printed.",
    )
    create.add_argument(
        "name", metavar="NAME", nargs="?", help="the job's name, e.g. email/send (not with --from)"
    )
    create.add_argument(
        "--from",
        dest="from_file",
        metavar="FILE",
        help="create the jobs of FILE's lines instead, one JSON object a line; - reads "
        "standard input (default: one job, NAME)",
    )
    create.add_argument(
        "--then",
        metavar="NAME",
        help="with --from: make FILE's jobs a batch, with a completion job NAME that "
        "depends on each and runs once all have ended, finished or not (its "
        "onDependencyFailure is run); the other options describe it (default: no batch)",
    )
    create.add_argument(
        "--data",
        type=json_object,
        metavar="JSON",
        help="the job's data: a JSON object (default: {})",
    )
    create.add_argument(
        "--first-run", metavar="WHEN", help=f"when the job is first due, {WHEN_HELP} (default: now)"
    )
    create.add_argument(
        "--repeat",
        metavar="RULE",
        help=f"run again after each run, {REPEAT_HELP} (default: run once)",
    )
    add_priority(create, f"higher runs first (default: {DEFAULT_PRIORITY})")
    create.add_argument(
        "--retry-after",
        metavar="M",
        help="a lease, e.g. '+5 MINUTES': if the job is not finished, retried or failed "
        "by then, it is handed out again (default: no lease)",
    )
    create.add_argument(
        "--parent",
        type=job_id,
        metavar="ID",
        help="make it a child of job ID, which must be RUNNING, RUNQUEUED or PAUSED "
        "(protocol.md section 8) (default: no parent)",
    )
    create.add_argument(
        "--unique",
        action="store_true",
        help="if a job of this NAME exists, create none: merge --data into the oldest "
        "one's data and print its jobID (default: always create)",
    )
    create.add_argument(
        "--no-overwrite",
        action="store_true",
        help="with --unique: leave an existing job as it is (default: merge --data into it)",
    )
    _add_retry_policy_options(create)
    _add_flow_options(create)
    add_check(create, _options_needed)


def _add_retry_policy_options(create: argparse.ArgumentParser) -> None:
    """A retry policy (protocol.md 14.1)."""
    create.add_argument(
        "--max-attempts",
        type=number(int, 1, MAX_ATTEMPTS),
        metavar="N",
        help=f"give it a retry policy: a failed attempt (fail, an expired lease) queues it "
        f"again after a backoff until N attempts have failed, 1 to {MAX_ATTEMPTS} "
        "(default: no policy, the first failure is final)",
    )
    create.add_argument(
        "--retry-backoff",
        choices=BACKOFFS,
        help=f"with --max-attempts: how the delay grows (default: {DEFAULT_BACKOFF})",
    )
    create.add_argument(
        "--retry-delay",
        type=retry_seconds,
        metavar="SECONDS",
        help=f"with --max-attempts: the delay after the first failed attempt, 0 to "
        f"{MAX_DELAY}, up to 3 decimals (default: {DEFAULT_RETRY_DELAY:g})",
    )
    create.add_argument(
        "--retry-max-delay",
        type=retry_seconds,
        metavar="SECONDS",
        help=f"with --max-attempts: the longest exponential delay, 0 to {MAX_DELAY}, up to "
        f"3 decimals (default: {DEFAULT_MAX_RETRY_DELAY:g})",
    )


def _add_flow_options(create: argparse.ArgumentParser) -> None:
    """Cost, key and time windows (protocol.md 14.7, 14.8, 14.23)."""
    create.add_argument(
        "--cost",
        type=number(int, 1, MAX_COST),
        metavar="N",
        help=f"what it counts against each concurrency limit its name matches while it "
        f"runs, 1 to {MAX_COST} (default: 1)",
    )
    create.add_argument(
        "--key",
        type=job_key,
        metavar="KEY",
        help="whose job it is (a tenant, a customer), at most 255 bytes: a limit set "
        "--per-key counts each key apart, a --fair one rotates between keys "
        "(default: none)",
    )
    create.add_argument(
        "--time-windows",
        type=time_windows,
        metavar="WINDOWS",
        help="run it only within these daily windows of local time, HH:MM-HH:MM, "
        "comma-separated, up to 20, e.g. '01:00-05:00,22:00-23:30' (default: any time)",
    )
    create.add_argument(
        "--time-zone",
        type=time_zone,
        metavar="ZONE",
        help="the IANA time zone of --time-windows and of a CRON --repeat, e.g. "
        "Europe/Paris (default: UTC)",
    )
    create.add_argument(
        "--depends-on",
        type=job_ids,
        metavar="IDS",
        help=f"jobIDs, comma-separated, 1 to {MAX_DEPENDENCIES}: the job waits (BLOCKED) until "
        "each of them has ended, and runs if all finished (default: none)",
    )
    create.add_argument(
        "--on-dependency-failure",
        choices=ON_DEPENDENCY_FAILURE,
        help="what the job does when a job it depends on fails for good, is cancelled or "
        "deleted: fail, cancel, or run anyway (default: fail; with --then, run)",
    )
    create.add_argument(
        "--idempotency-key",
        type=idempotency_key,
        metavar="KEY",
        help="create the job at most once under KEY, however often the command is run "
        "within the server's --idempotency-keep (a day, unless set): run again after a "
        "failure that may or may not have created it, it creates nothing twice; with "
        "--from, batch N goes under KEY/N, so a run again creates only the batches not "
        "yet created (with --then, the one request goes under KEY). 1 to 255 bytes "
        "(default: a new random key, named in the error when the outcome is unknown)",
    )


def _create(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    key = args.idempotency_key or new_idempotency_key()
    if args.from_file is not None and args.then is None:
        return _read(args.from_file, lambda stream: create_from.create_from(client, stream, key))
    try:
        if args.then is not None:
            then = _then_job(args)
            return _read(
                args.from_file,
                lambda stream: create_from.create_batch_from(client, stream, then, key),
            )
        return {"jobID": _create_one(client, args, key)}
    except (ConnectionFailed, OutcomeUnknown) as error:
        advice = create_from.run_again(key)
        what = "the batch" if args.then is not None else "the job"
        if isinstance(error, ConnectionFailed):
            if not error.sent:
                raise
            message = f"{error}; {what} may or may not have been created: {advice}"
            raise ConnectionFailed(message, sent=True) from None
        raise OutcomeUnknown(error.status, f"{error.detail or 'unknown'}; {advice}") from None


def _create_one(client: Client, args: argparse.Namespace, key: str) -> int:
    return client.create_job(**_one_job(args, args.name), idempotency_key=key)


def _then_job(args: argparse.Namespace) -> dict[str, Any]:
    """The completion job of `--then NAME` as a CreateJobs element: its
    options by their protocol names, those not given left out."""
    sent = calls.create_job(**_one_job(args, args.then), idempotency_key="").params
    return {name: value for name, value in sent.items() if value is not None}


def _one_job(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """create_job's arguments for job `name` from the options."""
    return dict(
        name=name,
        data=args.data,
        first_run=args.first_run,
        repeat=args.repeat,
        priority=args.priority,
        retry_after=args.retry_after,
        unique=args.unique,
        parent_job_id=args.parent,
        max_attempts=args.max_attempts,
        retry_backoff=args.retry_backoff,
        retry_delay=args.retry_delay,
        retry_max_delay=args.retry_max_delay,
        cost=args.cost,
        time_windows=args.time_windows,
        time_zone=args.time_zone,
        overwrite=not args.no_overwrite,
        key=args.key,
        depends_on=args.depends_on,
        on_dependency_failure=args.on_dependency_failure,
    )


def _read(path: str, create: Callable[[BinaryIO], dict[str, Any]]) -> dict[str, Any]:
    """What `create` makes of the file at `path`, standard input for `-`."""
    if path == "-":
        return create(sys.stdin.buffer)
    try:
        with open(path, "rb") as stream:
            return create(stream)
    except ConnectionFailed:
        raise  # an OSError too, but of the request (create_from's is PartlyRefused)
    except OSError as error:
        # Opening or reading the file.
        raise UsageError(f"cannot read --from {path}: {error.strerror or error}") from None


# create's options that describe one job: with --from, each line does.
_JOB_OPTIONS = (
    "data", "first_run", "repeat", "priority", "retry_after", "parent", "unique",
    "no_overwrite", "max_attempts", "retry_backoff", "retry_delay", "retry_max_delay",
    "cost", "key", "time_windows", "time_zone", "depends_on", "on_dependency_failure",
)

# create's options that mean nothing without another, by their dests.
_NEEDS = {
    "no_overwrite": "unique",
    "retry_backoff": "max_attempts",
    "retry_delay": "max_attempts",
    "retry_max_delay": "max_attempts",
}


def _options_needed(args: argparse.Namespace) -> str | None:
    """NAME or --from, not both; and options that need another: the server
    would refuse most of these (402 Missing maxAttempts) or ignore them
    (overwrite without unique). Said here, before sending."""
    if args.then is not None:
        return _then_needs(args)
    if args.from_file is not None:
        given = [_flag(dest) for dest in _JOB_OPTIONS if getattr(args, dest) not in (None, False)]
        if args.name is not None or given:
            what = "NAME" if args.name is not None else given[0]
            return f"--from takes each job from its line: {what} cannot go with it"
        key = args.idempotency_key or ""
        if len(key.encode("utf-8", "surrogatepass")) > create_from.MAX_BATCH_KEY:
            return (
                f"with --from, --idempotency-key is at most {create_from.MAX_BATCH_KEY} bytes: "
                "batch N goes under KEY/N"
            )
        return None
    if args.name is None:
        return "give the job's NAME, or --from FILE"
    if args.on_dependency_failure is not None and args.depends_on is None:
        return "--on-dependency-failure needs --depends-on"
    return _one_job_needs(args)


def _then_needs(args: argparse.Namespace) -> str | None:
    """--then: the batch's jobs from --from, the options its completion
    job's, which is always a new job."""
    if args.from_file is None:
        return "--then needs --from FILE: the batch's jobs, one a line"
    if args.name is not None:
        return "with --then, the completion job's name is --then's: NAME cannot go with it"
    if args.unique:
        return "--unique cannot go with --then: a batch's completion job is always a new job"
    if args.parent is not None:
        return "--parent cannot go with --then: a job with dependencies is no child"
    if args.depends_on is not None:
        return "--depends-on cannot go with --then: the completion job depends on the batch's jobs"
    return _one_job_needs(args)


def _one_job_needs(args: argparse.Namespace) -> str | None:
    """Options of one job that need another."""
    for option, needed in _NEEDS.items():
        if getattr(args, option) not in (None, False) and getattr(args, needed) in (None, False):
            return f"{_flag(option)} needs {_flag(needed)}"
    from jobserver.model import cron  # only when checking a create: a client starts light

    if args.time_zone and not args.time_windows and not cron.is_cron(args.repeat or ""):
        return "--time-zone needs --time-windows or a CRON --repeat"
    return None


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")
