"""A job's life: every move between states, and nothing else.

This is the only module that writes a job's row, and so the only one that
sets its `state` or `nextRun` (the storage's SQL aside: it creates the
schema and prunes; a new job's first row is creation.py's; the hand-out
and its give-back, with the rules of a lease, are named in leases.py, and
move the job through `_move` here).
Each transition is a named function that commands call; it checks that
the move is legal (`MOVES` in moves.py, the table protocol.md section 4.2
prints), writes the row, and does the bookkeeping that wakes waiting
GetJobs:

- a job that becomes due, or due later, is noted on the Context
  (`scheduled`), so the wait queue tries matching waiters after the commit
  or arms its clock for the later time;
- a job that stops running may have freed capacity of a concurrency limit,
  so every waiting GetJob is tried again (`wake_all`);
- a job that starts running, or is reported on, sets the clock for its
  stale deadline (stale.py);
- a move the history counts (created, handed out, finished, failed,
  retried: `_EVENTS`) is noted on the Context, which the engine adds to
  the history only once the transaction commits (engine/history.py).

A move asked of a job in a state that cannot make it is refused here, and
nowhere else: commands check no states. A move a client can ask for
carries the status line it is answered with (Bedrock's `405`s), raised as
`Refused`, a CommandError that undoes the request. Any other illegal move
is a bug in the caller: it raises IllegalMove, which the writer turns
into a `500` that undoes the request.

The few writes to a job that move it nowhere (a report on a RUNNING job,
new data, priority or repeat) are named functions here too, so that no
command writes a job's row itself.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from jobserver.core.engine import history
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import dependencies, flow, outcomes, schedule
from jobserver.core.rules.moves import GONE, MOVES, Refused, check, illegal
from jobserver.model.jobs import (
    ACTIVE,
    ENDED,
    ENDED_CHILDREN,
    PENDING,
    READY,
    Job,
    JobChanges,
    State,
)
from jobserver.storage.dependency_types import Outcome

# The moves the history counts (history.py), by the state they reach. A
# retry's event is its caller's to say (`retry`).
_EVENTS: dict[str, dict[str, int]] = {
    "hand out": {State.RUNNING: history.HANDED_OUT, State.RUNQUEUED: history.HANDED_OUT},
    "finish": {State.FINISHED: history.FINISHED, GONE: history.FINISHED},
    "expire a lease": {State.FAILED: history.FAILED},
    "fail": {State.FAILED: history.FAILED},
    "fail an attempt": {State.FAILED: history.FAILED, State.QUEUED: history.RETRIED},
    "time out a reply": {State.FAILED: history.FAILED, State.QUEUED: history.RETRIED},
    "fail for a dependency": {State.FAILED: history.FAILED},
}
# Where a job ends (issue 37): its dependents are told, from any state
# that had not ended.
_ENDS = (*ENDED, GONE)

# `kind`, not `name`: the compiled build (setup.py) does not keep `/`, and
# RetryJob's changes can hold `name` (a new name for the job).
def _move(ctx: Context, job: Job, kind: str, target: str, /, **changes: Any) -> None:
    move = MOVES[kind]
    if (job.state, target) not in move.pairs:
        raise illegal(job, kind, target)
    counted = _EVENTS.get(kind)
    if counted is not None:
        ctx.note(counted[target], job.name)
    if move.ends_run:
        _freed(ctx, job)
    if job.cancelRequested and target not in ACTIVE:
        # A pending cancel is the run's: whatever ends the run ends it.
        changes.setdefault("cancelRequested", 0)
    outcomes.on_move(ctx, job, kind, target, changes)
    if job.dependents and target in _ENDS and job.state not in ENDED:
        # A finished job deleted at once (no --keep-finished) finished.
        outcome = State.FINISHED if kind == "finish" else target
        _tell_dependents(ctx, job, outcome, changes.get("data", job.data))
    # Fenced by the state the move starts from: a job another node moved
    # first (read unlocked, as FAILED or as a PAUSED child) stays as it left it.
    if target == GONE:
        ctx.store.delete([job.jobID], (job.state,))
        if job.dependencies:
            ctx.store.forget_dependencies([job.jobID])
        return
    ctx.store.set_state_if([job.jobID], (job.state,), target, JobChanges(**changes))
    if target in READY or target == State.WAITING:
        # A WAITING job's nextRun is its reply deadline: the clock must
        # hear of it as of any other due time.
        ctx.scheduled(changes.get("name", job.name), changes.get("nextRun", job.nextRun))
    elif target == State.RUNNING and "lastReport" in changes:
        _watch_for_staleness(ctx)


def hand_out_plain(ctx: Context, job: Job, token: str, worker: str) -> None:
    """Hand out a QUEUED job without a lease of its own, a retry policy or
    a cancel asked for (leases.hand_out says which) under lease `token`:
    the move `_move` makes of it ("hand out" to RUNNING, its history's
    count and the stale-job clock), its write named in storage
    (`hand_out_plain`) rather than built of changes, as most hand-outs of
    a drain are."""
    ctx.note(history.HANDED_OUT, job.name)
    ctx.store.hand_out_plain(
        job.jobID, token, worker, ctx.settings.node, ctx.now_s, ctx.now_ms
    )
    _watch_for_staleness(ctx)


def _tell_dependents(ctx: Context, job: Job, target: str, data: str) -> None:
    """`job` ends: its dependents learn it, and those that it decides move
    (protocol.md 14.25), by this module's moves (dependencies.tell)."""
    outcome = Outcome(job.jobID, dependencies.outcome_state(target), data)
    dependencies.tell(ctx, [outcome], _make)


def telling_at_end(ctx: Context) -> AbstractContextManager[None]:
    """Within: the ends of jobs with dependents are told at the end, all
    at once (dependencies.telling_at_end)."""
    return dependencies.telling_at_end(ctx, _make)


def resume_cascade(ctx: Context) -> None:
    """Settle dependents a cascade left for later (dependencies.resume)."""
    dependencies.resume(ctx, _make)


def make(ctx: Context, steps: list[dependencies.Step]) -> None:
    """The moves dependencies.link decided for new jobs."""
    for step in steps:
        _make(ctx, step)


def _make(ctx: Context, step: dependencies.Step) -> None:
    _move(ctx, step.job, step.move, step.target, **step.changes)


def _write(ctx: Context, job: Job, **changes: Any) -> None:
    """The one write of a job's row that moves it nowhere."""
    ctx.store.amend([job.jobID], JobChanges(**changes))


def _freed(ctx: Context, job: Job) -> None:
    """A job stops running: if it held capacity of a concurrency limit,
    every waiting GetJob may now get a job."""
    if job.state in ACTIVE:
        _freed_name(ctx, job.name)


def _freed_name(ctx: Context, name: str) -> None:
    if ctx.store.limits and flow.index_of(ctx.store).verdict(name).limits:
        ctx.wake_all()


def _watch_for_staleness(ctx: Context) -> None:
    """A job became RUNNING or was reported on just now: the clock must fire
    when it would become stale (stale.py), unless it fires sooner anyway."""
    if ctx.settings.stale_after:
        ctx.fire_at(ctx.stale_at())


# Handing out: the hand-out, its lease and its give-back are leases.py's.


def wait_for_window(ctx: Context, job: Job, start: str) -> None:
    """A due job outside its time windows moves to the next one's start."""
    _move(ctx, job, "wait for a window", job.state, nextRun=start)


# Reports on a running job.


def touch(ctx: Context, job: Job, lease: int = 0) -> str | None:
    """TouchJob. A RUNNING job's report is noted (the stale-job safety net
    counts from now): None. A leased job is due again only when a new lease
    ends, from the moment it was due: that end is returned. `lease` (0:
    none) replaces the seconds its taker asked for, a handler's own lease;
    a job with retryAfter keeps its own. Raises RepeatStalled for a lease
    that would end at once."""
    if job.state == State.RUNNING:
        _note_report(ctx, job)
        return None
    check(job, "extend a lease")
    changes: dict[str, Any] = {}
    # Its own lease, else the one its taker asked for (protocol.md 14.24).
    seconds = 0 if job.retryAfter else job.lease
    if seconds and lease and lease != seconds:
        seconds = changes["lease"] = lease
    next_run = schedule.lease_end(ctx, job, schedule.due_moment(job), seconds)
    if next_run is None:
        raise CommandError("502 Failed to compute nextRun")
    _move(ctx, job, "extend a lease", State.RUNQUEUED, nextRun=next_run, **changes)
    return next_run


def _note_report(ctx: Context, job: Job) -> None:
    """A RUNNING job was reported on: the stale-job safety net counts from now."""
    ctx.store.note_report([job.jobID], ctx.now_ms)
    _watch_for_staleness(ctx)


def update(ctx: Context, job: Job, next_run: str | None, **changes: Any) -> None:
    """UpdateJob: new data, priority or repeat, and a new nextRun (in
    whatever state the job is) if `next_run` is given. On a RUNNING job it
    is a report: the stale-job safety net counts from now."""
    if job.state == State.RUNNING:
        changes["lastReport"] = ctx.now_ms
    if next_run is None:
        _write(ctx, job, **changes)
    else:
        _move(ctx, job, "reschedule", job.state, nextRun=next_run, **changes)


def amend(ctx: Context, job: Job, next_run: str | None = None, **changes: Any) -> None:
    """New data, priority, repeat or zone for a job in whatever state it
    is, which moves it nowhere: CreateJob with unique=true finding the job
    of its name; with `next_run`, a new nextRun too (a new CRON rule or zone)."""
    if next_run is None:
        _write(ctx, job, **changes)
    else:
        _move(ctx, job, "reschedule", job.state, nextRun=next_run, **changes)


def parent_of_ending_run(ctx: Context, job: Job) -> Job | None:
    """The parent of a job whose run FinishJob or RetryJob ends, once the
    report may end it: the job is handed out, and a child's parent waits
    for it, PAUSED. The parent's state is a precondition of the move, not
    a check of the request: a family's states move together (a parent is
    queued again when its last child ends), so whether a child's run may
    end depends on its parent's state."""
    check(job, "finish")
    parent = ctx.store.get(job.parentJobID) if job.parentJobID else None
    if parent is not None and parent.state != State.PAUSED:
        raise Refused(
            "405 Can only retry/finish child job when parent is PAUSED",
            f"finish: job {job.jobID}'s parent is {parent.state}",
        )
    return parent


def finish(ctx: Context, job: Job, parent: Job | None, **changes: Any) -> None:
    """A run ended well and the job does not run again: a child is kept
    FINISHED for its parent (which may now resume); a standalone job is
    kept for retention (--keep-finished) or deleted."""
    if parent is not None:
        _move(ctx, job, "finish", State.FINISHED, **changes)
        resume_parent_if_done(ctx, parent)
    elif ctx.settings.keep_finished:
        # Retention (protocol.md 14.10): kept with its final data until
        # the pruner deletes it.
        _move(ctx, job, "finish", State.FINISHED, ended=ctx.now_s, **changes)
    else:
        # Its data goes to its dependents, if any, and to its outcome
        # (AwaitJob): its result.
        _move(ctx, job, "finish", GONE, **changes)


def finish_plain_runs(
    ctx: Context, runs: list[tuple[int, str | None]], named: list[int]
) -> set[int]:
    """Finish at once, in one statement, the runs (jobID, and the leaseID
    their report holds or None) whose finish is only the delete of a
    RUNNING standalone job (storage's finish_plain_runs says which, having
    locked every job of `named`, the request's), with what `finish` and
    `_move` do beside it: the history's count, the outcome, capacity
    freed. The jobIDs finished; the caller finishes the others one by one.
    None with --keep-finished: a finished job stays."""
    if ctx.settings.keep_finished:
        return set()
    finished = ctx.store.finish_plain_runs(runs, named, outcomes.kept_at_plain_finish(ctx))
    for run in finished:
        ctx.note(history.FINISHED, run.name)
        _freed_name(ctx, run.name)
        if run.awaited:
            outcomes.awaited_end(ctx, run.jobID)
    return {run.jobID for run in finished}


def retry(
    ctx: Context, job: Job, next_run: str, /, repeats: bool = False, **changes: Any
) -> None:
    """A run ended and the job runs again at `next_run` (RetryJob, or a
    repeat), or at the start of its next time window after that. The
    history counts a repeat's run as finished, a RetryJob's as retried."""
    next_run = schedule.in_window(job.timeWindows, job.timeZone, next_run)
    _move(ctx, job, "retry", State.QUEUED, nextRun=next_run, **changes)
    ctx.note(history.FINISHED if repeats else history.RETRIED, job.name)


def fail_attempt(ctx: Context, job: Job, error: str, **changes: Any) -> None:
    """A run of `job` failed with `error`: FAILED; or, with a retry policy
    that has attempts left, QUEUED again after its backoff delay."""
    _fail_attempt(ctx, job, "fail an attempt", error, **changes)


def _fail_attempt(ctx: Context, job: Job, move: str, error: str, **changes: Any) -> None:
    if job.maxAttempts and job.attempts < job.maxAttempts:
        delay = schedule.backoff_delay(job, job.attempts)
        next_run = schedule.in_window(
            job.timeWindows, job.timeZone, schedule.retry_time(ctx, delay)
        )
        _move(ctx, job, move, State.QUEUED, nextRun=next_run, lastError=error, **changes)
        return
    _move(ctx, job, move, State.FAILED, lastError=error, ended=ctx.now_s, **changes)


def fail(ctx: Context, job: Job, error: str, **changes: Any) -> None:
    """FAILED whatever its retry policy: a repeat that would run the job
    again for the same base moment would only meet the same rule."""
    _move(ctx, job, "fail", State.FAILED, lastError=error, ended=ctx.now_s, **changes)


# Replies (protocol.md 14.12).


def wait_for_reply(ctx: Context, job: Job, key: str, deadline: str, data: str) -> None:
    """WAITING on `key` until `deadline`, which is its nextRun, so the clock
    that wakes GetJobs fires for it too."""
    _move(ctx, job, "wait for a reply", State.WAITING, replyKey=key, nextRun=deadline, data=data)


def deliver_reply(ctx: Context, job: Job, data: str) -> None:
    """Back to QUEUED, due now, with `data` holding the reply. The wait
    ended well, so the next run gets every attempt of its policy again."""
    changes: dict[str, Any] = {"nextRun": ctx.now_ms, "replyKey": "", "data": data}
    if job.maxAttempts:
        changes["attempts"] = 0
    _move(ctx, job, "deliver a reply", State.QUEUED, **changes)


def time_out_reply(ctx: Context, job: Job, error: str) -> None:
    """A WAITING job's deadline passed with no reply: a failed attempt."""
    _fail_attempt(ctx, job, "time out a reply", error, replyKey="")


# Operators' moves.


def requeue(ctx: Context, job: Job, **changes: Any) -> None:
    """QUEUED again, with every attempt of its retry policy, due at once (or
    at its next window). A job still in its life is due at its creation
    time, as in Bedrock; one that had ended (a FAILED job revived) is due
    from now: its wait in the queue starts again, and a creation time days
    old would read as a queue that has not moved for days."""
    due = job.created if job.state in PENDING else ctx.now_ms
    next_run = schedule.in_window(job.timeWindows, job.timeZone, due)
    dependencies.live_again(ctx, job)
    _move(ctx, job, "requeue", State.QUEUED, nextRun=next_run, attempts=0, **changes)


def cancel(ctx: Context, job: Job) -> None:
    """CancelJob of a child: CANCELLED, and its parent queued again if no
    child is left QUEUED or handed out. A FINISHED, RUNNING or PAUSED child
    is left as it is: Bedrock answers 200 and changes nothing, so it is not
    a refusal."""
    if job.state not in MOVES["cancel"].sources:
        return
    # When it ended: a standalone one (a BLOCKED job) is pruned from then.
    _move(ctx, job, "cancel", State.CANCELLED, ended=ctx.now_s)
    parent = ctx.store.get(job.parentJobID)
    if parent is not None:
        # PAUSED siblings do not hold the parent back here, as in Bedrock.
        resume_parent_if_done(ctx, parent, (State.QUEUED, *ACTIVE))


# The lastError of a job whose run was cancelled (protocol.md 14.26).
CANCELLED_WHILE_RUNNING = "cancelled while running (CancelJob)"


def ask_to_cancel(ctx: Context, job: Job) -> None:
    """CancelJob with running: true of a handed-out job: marked, so that
    its worker's next report ends it (cancel_run). A RUNQUEUED job whose
    lease has already ended has no worker to tell: it ends now."""
    if job.state == State.RUNQUEUED and job.nextRun <= ctx.now_ms:
        cancel_run(ctx, job)
        return
    _move(ctx, job, "ask to cancel", job.state, cancelRequested=1)


def cancel_run(ctx: Context, job: Job) -> None:
    """A handed-out job whose cancel was asked for ends CANCELLED: at its
    worker's next report, its lease's end, or its stale deadline. Never
    retried, never repeated; a child's PAUSED parent may now resume."""
    _move(
        ctx, job, "cancel a run", State.CANCELLED,
        lastError=CANCELLED_WHILE_RUNNING, ended=ctx.now_s,
    )
    parent = ctx.store.get(job.parentJobID) if job.parentJobID else None
    if parent is not None:
        resume_parent_if_done(ctx, parent)


def delete(ctx: Context, job: Job) -> None:
    _move(ctx, job, "delete", GONE)


def await_end(ctx: Context, job: Job) -> None:
    """An AwaitJob waits for `job`: marked, so that whichever node ends it
    keeps its outcome and tells every node (outcomes.py)."""
    if not job.awaited:
        _write(ctx, job, awaited=1)


def cancel_queued(ctx: Context, job: Job) -> None:
    """CancelQueuedJobs: a QUEUED child is cancelled as CancelJob cancels
    it (its parent may resume); a standalone job is deleted, as DeleteJob
    deletes it: CANCELLED is the state a parent's children end in, and a
    standalone job left in it would never be pruned."""
    if job.parentJobID:
        cancel(ctx, job)
    else:
        delete(ctx, job)


# Parents and children (protocol.md section 8).


def pause_for_children(ctx: Context, job: Job, **changes: Any) -> None:
    """A parent that finishes waits, PAUSED, for its children to run; its
    PAUSED children are queued."""
    next_run = job.lastRun or ctx.now_s
    _move(ctx, job, "pause for children", State.PAUSED, nextRun=next_run, **changes)
    for child in ctx.store.children(job.jobID, (State.PAUSED,)):
        _move(ctx, child, "release a child", State.QUEUED)


def resume_parent_if_done(
    ctx: Context, parent: Job, pending: tuple[str, ...] | None = None
) -> None:
    """A PAUSED parent is queued again once no child in `pending` states is
    left (by default every state that holds a parent back)."""
    if parent.state == State.PAUSED and not ctx.store.has_children(
        parent.jobID, pending if pending is not None else PENDING
    ):
        _move(ctx, parent, "resume a parent", State.QUEUED)


def delete_ended_children(ctx: Context, parent: Job) -> None:
    """A parent's run ended: its FINISHED and CANCELLED children go, in one
    write (they hold no capacity and wake nobody)."""
    ctx.store.delete_children(parent.jobID, ENDED_CHILDREN)
