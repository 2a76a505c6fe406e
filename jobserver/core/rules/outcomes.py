"""A job's end, kept for AwaitJob (protocol.md 14.27).

A job ends when it reaches FINISHED, FAILED for good or CANCELLED, or is
deleted from a state that had not ended (a FINISHED job without a parent
is deleted as it finishes, unless --keep-finished keeps it: its outcome
says FINISHED all the same). Every such move passes through
`lifecycle._move`, which calls `on_move` here; a move that is no end (a
retry, a failed attempt with attempts left, a repeat's run) costs a few
comparisons.

At an end, the job's outcome (name, final state, data, lastError, when)
is kept for --keep-outcomes seconds, written in the same transaction as
the move and held with the command's other writes (storage's
`keep_job_outcome`). A job that an AwaitJob waits for carries a mark
(`awaited`, set by `await_end` through lifecycle.py): its outcome is kept
even with --keep-outcomes 0 (for AWAITED_KEEP), and its jobID
is noted on the Context, so that its awaiters on this node, and on every
other node through the commit's notice, look again once it commits. A
job nobody awaits adds nothing to the notice.
"""

from __future__ import annotations

from typing import Any

from jobserver.core.engine.context import Context
from jobserver.core.rules.moves import GONE
from jobserver.model import times
from jobserver.model.jobs import ENDED, Job, JobOutcome, OutcomesKept, State

# The final state of a job deleted before it ended.
DELETED = "DELETED"
# With --keep-outcomes 0, an awaited job's outcome is kept this long: its
# awaiters, on every node, read it within moments of the notice.
AWAITED_KEEP = 60.0


def on_move(ctx: Context, job: Job, name: str, target: str, changes: dict[str, Any]) -> None:
    """`job` makes move `name` to `target` with `changes`: if that ends
    it, keep its outcome, and note it if someone awaits it."""
    if target == GONE:
        if job.state in ENDED:
            # Deleting what had ended already (an operator, a parent's
            # ended children) is no second end.
            return
        # A standalone job that finishes is deleted at once: it finished.
        final = State.FINISHED.value if name == "finish" else DELETED
    elif target in ENDED and target != job.state:
        final = str(target)
    else:
        return
    _keep(
        ctx, job.jobID, job.name, final, changes.get("data", job.data),
        changes.get("lastError", job.lastError), bool(job.awaited),
    )


def kept_at_plain_finish(ctx: Context) -> OutcomesKept:
    """How long the outcomes of the jobs a plain finish deletes
    (lifecycle.finish_plain_runs) are kept: as `_keep` keeps a finish's
    end, written by storage in the statement that deletes them."""
    keep = ctx.settings.keep_outcomes
    awaited_until = times.later_millis(ctx.now, ctx.now_ms, keep or AWAITED_KEEP)
    return OutcomesKept(ctx.now_ms, awaited_until if keep else None, awaited_until)


def awaited_end(ctx: Context, job_id: int) -> None:
    """An awaited job ended in this transaction: its awaiters look again
    once it commits."""
    ctx.ended.add(job_id)


def _keep(
    ctx: Context, job_id: int, name: str, final: str, data: str, last_error: str, awaited: bool
) -> None:
    keep = ctx.settings.keep_outcomes
    if not keep:
        if not awaited:
            return
        keep = AWAITED_KEEP
    expires = times.later_millis(ctx.now, ctx.now_ms, keep)
    ctx.store.keep_job_outcome(
        JobOutcome(job_id, name, final, data, last_error, ctx.now_ms, expires)
    )
    if awaited:
        awaited_end(ctx, job_id)


def of_row(job: Job) -> JobOutcome:
    """The outcome of a job still stored in the state it ended in (kept by
    --keep-finished, a FAILED job, a cancelled child), or that ended
    before outcomes were kept."""
    return JobOutcome(
        job.jobID, job.name, job.state, job.data, job.lastError, job.ended or job.lastRun or "",
        "",
    )
