"""Bulk actions (protocol.md 14.19): RequeueFailedJobs, DeleteFailedJobs
and CancelQueuedJobs act on every job in one state whose name matches a
pattern (or of a queue, or of a list of jobIDs), up to MAX_BULK jobs per
request, in the request's one transaction.

Each finds its jobs in the state it is for, holds them (read again, locked
where other nodes write), and moves each one through lifecycle.py, which
fences every write by the state it read: a job another request moved
meanwhile is passed over, never moved from a state the action is not for.
With `dryRun: true` nothing is moved: the reply says how many jobs match
and which would be acted on, for a confirmation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jobserver.core.commands import params
from jobserver.core.commands.views import ok
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import lifecycle
from jobserver.core.rules.selection import name_selector
from jobserver.model.globmatch import match_cost
from jobserver.model.jobs import Job, State
from jobserver.storage.searches import Found, NameMatch
from jobserver.wire.framing import Request, Response
from jobserver.wire.limits import BULK_TEST_BUDGET, MAX_BULK, MAX_BULK_EXAMINED, MAX_NAME

Act = Callable[[Context, Job], None]


@dataclass(frozen=True)
class Selection:
    """The jobs a bulk action is asked about: those a NameMatch takes, or
    the listed jobIDs (in the order given, without repeats)."""

    match: NameMatch | None
    ids: tuple[int, ...] = ()

# What `dryRun` may be.
DRY_RUN_VALUES = {"true": True, "1": True, "false": False, "0": False}


def requeue_failed_jobs(ctx: Context, request: Request) -> Response:
    """FAILED jobs back to QUEUED, due now, with every attempt again."""
    return _bulk(ctx, request, State.FAILED, lifecycle.requeue)


def delete_failed_jobs(ctx: Context, request: Request) -> Response:
    return _bulk(ctx, request, State.FAILED, lifecycle.delete)


def cancel_queued_jobs(ctx: Context, request: Request) -> Response:
    """QUEUED jobs taken out of the queue: a child CANCELLED (as CancelJob
    does), a standalone job deleted (lifecycle.cancel_queued says why)."""
    return _bulk(ctx, request, State.QUEUED, lifecycle.cancel_queued)


def _bulk(ctx: Context, request: Request, state: str, act: Act) -> Response:
    selection = _selection(request)
    limit = params.bulk_limit(request)
    dry_run = _dry_run(request)
    with ctx.store.holding_writes(), lifecycle.telling_at_end(ctx):
        found, jobs = _found(ctx, selection, state, limit)
        if not dry_run:
            for job in jobs:
                act(ctx, job)
    acted = 0 if dry_run else len(jobs)
    reply: dict[str, object] = {
        "matched": found.matched,
        "acted": acted,
        "remaining": max(found.matched - acted, 0),
        "jobIDs": [job.jobID for job in jobs],
    }
    if selection.match is None:
        # Listed jobs that are gone or in another state: passed over.
        reply["skipped"] = len(selection.ids) - found.matched
    if not found.complete:
        # More may match than were found: not "nothing", nor "all".
        reply["complete"] = False
        reply["examined"] = found.examined
    if dry_run:
        reply["dryRun"] = True
    return ok(reply)


def _found(ctx: Context, selection: Selection, state: str, limit: int) -> tuple[Found, list[Job]]:
    """What the search for jobs in `state` found (listed jobs: all those
    in it), and the first `limit` of them, held."""
    if selection.match is None:
        jobs = _held(ctx, list(selection.ids), state)
        return Found([job.jobID for job in jobs], len(jobs), len(selection.ids), True), jobs[:limit]
    found = ctx.store.in_state(state, selection.match, limit, _examined(selection.match))
    return found, _held(ctx, found.job_ids, state)


def _held(ctx: Context, ids: list[int], state: str) -> list[Job]:
    """The jobs still in `state`, held: read again in one statement (locked
    where other nodes write), so each is moved from the state it is in now."""
    store = ctx.store
    store.hold(ids)
    return [job for job in map(store.get, ids) if job is not None and job.state == state]


def _examined(match: NameMatch) -> int:
    """How many jobs a search may examine: MAX_BULK_EXAMINED, fewer for a
    costly pattern: BULK_TEST_BUDGET over what testing a name may cost
    (globmatch.match_cost; its literal start is the index's range)."""
    if match.pattern is None:
        return MAX_BULK_EXAMINED
    return min(MAX_BULK_EXAMINED, BULK_TEST_BUDGET // match_cost(match.pattern))


def _dry_run(request: Request) -> bool:
    """`dryRun`: true or false, 1 or 0, or absent (false). Anything else is
    refused rather than read as false as Bedrock's flags are: a typo in it
    must not act on a thousand jobs."""
    value = request.get("dryrun")
    if value is None:
        return False
    word = value.strip().lower()
    if word not in DRY_RUN_VALUES:
        raise CommandError("402 Malformed dryRun: true or false")
    return DRY_RUN_VALUES[word]


def _selection(request: Request) -> Selection:
    """Exactly one of `name` (a GLOB pattern, or a comma list of exact
    names), `queue` and `jobIDs`."""
    given = [key for key in ("name", "queue", "jobids") if params.present(request, key)]
    if not given:
        raise CommandError("402 Missing name, queue or jobIDs")
    if len(given) > 1:
        raise CommandError("402 Give one of name, queue or jobIDs")
    if given[0] == "jobids":
        # Counted before they are parsed: a megabyte of them is refused at once.
        if params.require(request, "jobids").count(",") >= MAX_BULK:
            raise CommandError(f"413 Too many jobIDs (max {MAX_BULK})")
        ids = params.job_ids(request)
        if len(ids) > MAX_BULK:
            raise CommandError(f"413 Too many jobIDs (max {MAX_BULK})")
        return Selection(None, tuple(dict.fromkeys(ids)))
    if given[0] == "queue":
        return Selection(NameMatch(queue=_queue(request)))
    pattern, names = name_selector(params.require(request, "name"))
    return Selection(NameMatch(pattern=pattern, names=names))


def _queue(request: Request) -> str:
    """A queue's name (protocol.md 14.17): a job name up to its first `/`."""
    value = params.require(request, "queue")
    if len(value.encode("utf-8")) > MAX_NAME:
        raise params.too_large("queue", MAX_NAME)
    if params.has_control(value) or "/" in value:
        raise CommandError("402 Malformed queue")
    return value
