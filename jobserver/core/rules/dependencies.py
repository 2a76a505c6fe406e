"""Dependencies (protocol.md 14.25): what a job's end means to the jobs
that wait for it, and what a new job's dependencies mean to it.

A job created with dependencies waits BLOCKED, its row counting those not
ended yet (`blockers`). When a job with dependents ends (FINISHED, FAILED
for good, CANCELLED, or deleted before any of those: lifecycle._move), its
outcome is kept for them (its state, and its data: a FINISHED job's is its
result) in that same transaction, and each BLOCKED dependent counts its
blockers again from the outcomes kept, in that transaction or, past
cascade.py's bound on one, a later one. A dependent then moves by its
onDependencyFailure:

- the dependency did not finish, and the policy is `fail` (the default):
  FAILED at once, its lastError naming the dependency; `cancel`:
  CANCELLED; either is an end, which its own dependents hear in turn;
- otherwise, once no blocker is left: QUEUED (`run` runs whatever the
  outcomes were, a batch's "finally").

lifecycle.py makes the moves this module names: it is the only writer of
a job's row. A job with no dependents and no dependencies never reaches
this module, and costs no statement more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import cascade
from jobserver.model.jobs import ENDED, Job, State
from jobserver.storage.dependency_types import Outcome
from jobserver.storage.interface import Storage
from jobserver.wire.jsonbody import Raw
from jobserver.wire.limits import MAX_DEPENDENCY_DATA

# Ends told in one go (a few statements) at most.
ENDS_AT_ONCE = 1000
# The outcome of a job deleted before it ended.
DELETED = "DELETED"
CANCEL = "cancel"
RUN = "run"


@dataclass(frozen=True)
class Step:
    """A move of a dependent that lifecycle makes: the move's name in
    MOVES, its target and the row's changes."""

    job: Job
    move: str
    target: str
    changes: dict[str, Any]


# Makes one of the moves this module names (lifecycle's).
Make = Callable[[Context, Step], None]

# The requests telling dependents of ends, each with the ends still to
# tell (by id(ctx): a Context is not hashable): an end found meanwhile (a
# dependent failed, whose own dependents must hear) is queued here rather
# than told by a call inside the telling, so a chain of a thousand jobs is
# a loop, not a thousand nested calls.
_TELLING: dict[int, list[Outcome]] = {}


def tell(ctx: Context, outcomes: list[Outcome], make: Make) -> None:
    """Tell `outcomes` to their dependents and `make` the moves they
    decide, a batch at a time: the ends those moves make form the next
    batch (a cascade, one level a batch), within cascade.py's bound on a
    transaction's work. Within telling_at_end, kept for its end."""
    if ctx.ends is not None:
        ctx.ends += outcomes
        return
    _work(ctx, list(outcomes), [], make)


def resume(ctx: Context, make: Make) -> None:
    """Settle dependents a cascade left BLOCKED for a later transaction
    (cascade.py), and tell the ends that makes. Run by the clock's tick."""
    found = cascade.left_behind(ctx)
    if found:
        _work(ctx, [], found, make)


def _work(ctx: Context, outcomes: list[Outcome], dependents: list[int], make: Make) -> None:
    """Settle `dependents` and tell `outcomes`, and the ends their moves
    make in turn."""
    pending = _TELLING.get(id(ctx))
    if pending is not None:
        pending += outcomes
        for step in _settled(ctx, dependents):
            make(ctx, step)
        return
    pending = _TELLING[id(ctx)] = outcomes
    try:
        # The dependents' moves are sent together (storage's held_writes.py).
        with ctx.store.holding_writes():
            steps = _settled(ctx, dependents)
            while True:
                for step in steps:
                    make(ctx, step)
                if not pending:
                    break
                batch = pending[:]
                pending.clear()
                steps = ended(ctx, batch)
    finally:
        del _TELLING[id(ctx)]


@contextmanager
def telling_at_end(ctx: Context, make: Make) -> Iterator[None]:
    """Within: the ends of jobs with dependents are told at the end, all at
    once (a few statements, not a few per job); those of a part of the
    request that is undone are never told (Context.part, join)."""
    if ctx.ends is not None:
        yield
        return
    ctx.ends = []
    try:
        yield
        ends = ctx.ends
    finally:
        ctx.ends = None
    if ends:
        tell(ctx, ends, make)


def live_again(ctx: Context, job: Job) -> None:
    """`job` is requeued: if it had ended and jobs depend on it, its kept
    outcome goes. Kept, a job created to depend on it later counted it as
    ended (its old outcome), and its next end, kept already, was told to no
    one: its dependents stayed BLOCKED for good."""
    if job.dependents:
        ctx.store.forget_outcomes([job.jobID])


def outcome_state(target: str) -> str:
    """The outcome a dependent sees of a job that reached `target` (a
    state, or lifecycle's GONE) from a state that had not ended."""
    return target if target in ENDED else DELETED


def ended(ctx: Context, outcomes: Sequence[Outcome]) -> list[Step]:
    """`_ended` a thousand at a time: a cascade's batch may be a failed
    job's every dependent, and a statement's parameters are bounded
    (SQLite's 32,766)."""
    steps: list[Step] = []
    for start in range(0, len(outcomes), ENDS_AT_ONCE):
        steps += _ended(ctx, outcomes[start : start + ENDS_AT_ONCE])
    return steps


def _ended(ctx: Context, outcomes: Sequence[Outcome]) -> list[Step]:
    """Jobs have ended with `outcomes` (outcome_state's states): keep them,
    and return the moves of their dependents that they decide, as many as
    this transaction may still make (cascade.py; the rest are left for
    later, found again from the outcomes kept here). A job that had ended
    before (its dependents heard of it then), or that nobody depends on any
    more, decides nothing. A few statements for any number of ends: a
    FinishJobs of a thousand dependencies tells them at once."""
    kept = ctx.store.keep_outcomes(outcomes, only_if_depended_on=True)
    if not kept:
        return []
    room = cascade.allowance(ctx)
    dependents = ctx.store.blocked_dependents(kept, room + 1)
    if len(dependents) > room:
        dependents = dependents[:room]
        cascade.left_over(ctx)
    return _settled(ctx, dependents)


def _settled(ctx: Context, dependents: Sequence[int]) -> list[Step]:
    """Count again what each of `dependents` waits for, from the outcomes
    kept, and return the moves that decides."""
    if not dependents:
        return []
    cascade.spend(ctx, len(dependents))
    steps = []
    for job, blockers, failed in ctx.store.settle(dependents):
        step = _decided(ctx, job, [failed] if failed is not None else [], blockers)
        if step is not None:
            steps.append(step)
    return steps


def _decided(ctx: Context, job: Job, outcomes: Sequence[Outcome], blockers: int) -> Step | None:
    """What a BLOCKED job does, given outcomes it has just learned and the
    count of its dependencies still to end; None: it waits on."""
    policy = job.onDependencyFailure
    if policy != RUN:
        failed = next((o for o in outcomes if o.state != State.FINISHED), None)
        if failed is not None:
            error = f"dependency {failed.job_id} ended {failed.state}"
            changes = {"lastError": error, "ended": ctx.now_s}
            if policy == CANCEL:
                return Step(job, "cancel for a dependency", State.CANCELLED, changes)
            return Step(job, "fail for a dependency", State.FAILED, changes)
    if blockers <= 0:
        return Step(job, "unblock", State.QUEUED, {})
    return None


@dataclass(frozen=True)
class Known:
    """The existing jobs a request's new jobs depend on, read (and locked)
    before any is created: those that exist, and the kept outcomes of
    those that are gone."""

    jobs: dict[int, Job]
    gone: dict[int, Outcome]

    def outcome(self, job_id: int) -> Outcome | None:
        """Its outcome if it has ended, else None."""
        job = self.jobs.get(job_id)
        if job is None:
            return self.gone[job_id]
        if job.state in ENDED:
            return Outcome(job_id, job.state, job.data)
        return None


def read(ctx: Context, ids: Sequence[int]) -> Known:
    """The existing jobs of `ids`; a jobID that names no job (and no kept
    outcome: a finished job deleted since) is refused."""
    jobs = ctx.store.depended_on(ids)
    missing = [job_id for job_id in ids if job_id not in jobs]
    gone = ctx.store.outcomes_of(missing) if missing else {}
    for job_id in missing:
        if job_id not in gone:
            raise CommandError(f"404 Dependency {job_id} does not exist")
    return Known(jobs, gone)


def link(
    ctx: Context, known: Known, new: Sequence[tuple[int, Sequence[int]]]
) -> list[Step]:
    """Store the edges of the request's new jobs (jobID, the jobIDs it
    depends on), keep the outcomes of dependencies that had ended already,
    and return the moves of the new jobs those decide."""
    edges = [(job_id, on) for job_id, ons in new for on in ons]
    ctx.store.add_dependencies(edges)
    ended_before: dict[int, Outcome] = {}
    for on in sorted({on for _, on in edges}):
        outcome = known.outcome(on) if on in known.jobs or on in known.gone else None
        if outcome is not None:
            ended_before[on] = outcome
    # Kept for the new dependents (those that ended before any had one).
    ctx.store.keep_outcomes(
        [o for on, o in ended_before.items() if on in known.jobs], only_if_depended_on=False
    )
    steps = []
    for job_id, ons in new:
        outcomes = [ended_before[on] for on in ons if on in ended_before]
        if not outcomes:
            continue
        job = ctx.store.get(job_id)
        if job is None or job.state != State.BLOCKED:
            continue
        step = _decided(ctx, job, outcomes, len(ons) - len(outcomes))
        if step is not None:
            steps.append(step)
    return steps


def handout_entries(store: Storage, job: Job) -> list[dict[str, Any]]:
    """A hand-out's `dependencies`: each dependency's jobID, final state
    and data, by jobID; past MAX_DEPENDENCY_DATA bytes of data in all,
    `"dataOmitted": true` in place of the data."""
    entries: list[dict[str, Any]] = []
    for outcome in store.dependency_outcomes(job.jobID, MAX_DEPENDENCY_DATA):
        entry: dict[str, Any] = {"jobID": outcome.job_id, "state": outcome.state}
        if outcome.omitted:
            entry["dataOmitted"] = True
        elif outcome.state:
            entry["data"] = Raw(outcome.data)
        entries.append(entry)
    return entries


def counts(ctx: Context, job: Job) -> dict[str, int]:
    """QueryJob's `dependencyCounts`."""
    by_state = ctx.store.dependency_counts(job.jobID)
    return {
        "total": sum(by_state.values()),
        "pending": by_state.get("", 0),
        "finished": by_state.get(State.FINISHED, 0),
        "failed": by_state.get(State.FAILED, 0),
        "cancelled": by_state.get(State.CANCELLED, 0),
        "deleted": by_state.get(DELETED, 0),
    }
