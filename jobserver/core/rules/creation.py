"""A job's birth: storing a new job in its first state (QUEUED, PAUSED
under a running parent, BLOCKED on dependencies), and the rule of which
parents may be given a child.

Apart from lifecycle.py, which moves jobs that exist between states: a new
job has no state to move from, so no move of MOVES is checked here. The
bookkeeping is the same as a move's: the history's count of created jobs,
and a QUEUED job's name noted as ready for the waiting GetJobs.
"""

from __future__ import annotations

from jobserver.core.engine import history
from jobserver.core.engine.context import Context
from jobserver.core.rules.moves import JOB_CANCELLED, Refused
from jobserver.model.jobs import ACTIVE, Job, NewJob, State

# The states in which a job may be given a child.
ADOPTING = (*ACTIVE, State.PAUSED)


def check_parent(parent: Job) -> None:
    """A child may be created only while its parent runs, or waits PAUSED
    for its children. A precondition of the move, not a check of the
    request: a child's first state follows its parent's (it waits PAUSED
    until a running parent pauses for it), and only a parent that runs or
    waits will ever release it or wait for it."""
    if parent.cancelRequested:
        # Its run ends at its next report: a child would wait for good.
        raise Refused(JOB_CANCELLED, f"create: job {parent.jobID}'s cancel is pending")
    if parent.state not in ADOPTING:
        raise Refused(
            "405 Can only create child job when parent is RUNNING, RUNQUEUED or PAUSED",
            f"create: job {parent.jobID} cannot take a child in {parent.state}",
        )


def create(ctx: Context, new: NewJob, parent: Job | None) -> int:
    """Store a new job: QUEUED, or PAUSED while its parent runs (a child of
    a running parent waits until the parent finishes), or BLOCKED until its
    dependencies end (dependencies.link then decides whether it waits)."""
    if parent is not None:
        check_parent(parent)
    state = State.PAUSED if parent is not None and parent.state != State.PAUSED else State.QUEUED
    if new.dependencies:
        state = State.BLOCKED
    (job_id,) = ctx.store.create([new], created=ctx.now_s, state=state)
    _created(ctx, [new], state)
    return job_id


def create_plain(ctx: Context, jobs: list[NewJob]) -> list[int]:
    """Store new standalone jobs without dependencies, QUEUED, in one call
    (CreateJobs' plain elements): as `create` stores each."""
    ids = ctx.store.create(jobs, created=ctx.now_s, state=State.QUEUED)
    _created(ctx, jobs, State.QUEUED)
    return ids


def _created(ctx: Context, jobs: list[NewJob], state: State) -> None:
    """The history counts them; the waiting GetJobs hear of the QUEUED."""
    for new in jobs:
        ctx.note(history.CREATED, new.name)
        if state == State.QUEUED:
            ctx.scheduled(new.name, new.next_run)
