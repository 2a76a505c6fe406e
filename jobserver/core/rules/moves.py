"""The table of a job's moves (protocol.md 4.2 prints it): the states
each move may leave and reach, and what a client is answered when it asks
a move of a job in a state that cannot make it. lifecycle.py makes the
moves, checking each against this table as it makes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from itertools import product

from jobserver.core.errors import CommandError
from jobserver.model.jobs import ACTIVE, ENDED_CHILDREN, READY, Job, State

# The two ends of a life that are not states: before CreateJob stores a
# job, and after it is deleted (a finished job without a parent is not
# kept, protocol.md 4.2).
NEW = "new"
GONE = "deleted"

ALL = tuple(State)


@dataclass(frozen=True)
class Move:
    """A named transition: the (from, to) pairs it may make, whether it can
    end a run (so capacity of a concurrency limit may be free), and, for a
    move a client asks for, the status line it is refused with in each
    state it cannot leave this way."""

    pairs: frozenset[tuple[str, str]]
    ends_run: bool = True
    refusals: Mapping[str, str] = field(default_factory=dict)

    @cached_property
    def sources(self) -> frozenset[str]:
        # Asked at every report on a job (`check`): made once.
        return frozenset(source for source, _ in self.pairs)


# What a refusal names: one status line for every state a move cannot
# leave, or a status line per state.
Refusal = str | Mapping[str, str] | None


def _between(
    sources: tuple[str, ...],
    targets: tuple[str, ...],
    ends_run: bool = True,
    refused: Refusal = None,
) -> Move:
    return Move(frozenset(product(sources, targets)), ends_run, _refusals(sources, refused))


def _in_place(states: tuple[str, ...], refused: Refusal = None) -> Move:
    """A move that changes when a job runs, not its state."""
    return Move(frozenset((s, s) for s in states), False, _refusals(states, refused))


def _refusals(sources: tuple[str, ...], refused: Refusal) -> Mapping[str, str]:
    if refused is None:
        return {}
    if isinstance(refused, str):
        return {state: refused for state in ALL if state not in sources}
    return refused


# FinishJob's and RetryJob's refusal: every move that ends a run they report.
NOT_HANDED_OUT = "405 Can only retry/finish RUNNING and RUNQUEUED jobs"
# What a handed-out job's worker is told once its cancel was asked for
# (protocol.md 14.26): the report is not taken, the job ended CANCELLED.
JOB_CANCELLED = "410 Job cancelled"


MOVES: dict[str, Move] = {
    "create": _between((NEW,), (State.QUEUED, State.PAUSED), ends_run=False),
    # Dependencies (protocol.md 14.25): a job created with dependsOn waits
    # BLOCKED until they end; then it is queued, or ends as its
    # onDependencyFailure says when one of them did not finish.
    "block on dependencies": _between((NEW,), (State.BLOCKED,), ends_run=False),
    "unblock": _between((State.BLOCKED,), (State.QUEUED,), ends_run=False),
    "fail for a dependency": _between((State.BLOCKED,), (State.FAILED,), ends_run=False),
    "cancel for a dependency": _between((State.BLOCKED,), (State.CANCELLED,), ends_run=False),
    "hand out": _between(READY, ACTIVE, ends_run=False),
    "expire a lease": _between(READY, (State.FAILED,), ends_run=False),
    "wait for a window": _in_place(READY),
    # TouchJob's refusal: a RUNNING job's touch is a report, not this move
    # (lifecycle.touch).
    "extend a lease": _in_place((State.RUNQUEUED,), "405 Can only touch RUNNING or RUNQUEUED jobs"),
    "reschedule": _in_place(ALL),
    "finish": _between(ACTIVE, (State.FINISHED, GONE), refused=NOT_HANDED_OUT),
    "retry": _between(ACTIVE, (State.QUEUED,), refused=NOT_HANDED_OUT),
    "fail an attempt": _between(
        ACTIVE, (State.FAILED, State.QUEUED), refused="405 Can only fail RUNNING or RUNQUEUED jobs"
    ),
    "time out a reply": _between((State.WAITING,), (State.FAILED, State.QUEUED)),
    "fail": _between(ACTIVE, (State.FAILED,)),
    "wait for a reply": _between(
        ACTIVE,
        (State.WAITING,),
        refused="405 Can only await a reply for RUNNING or RUNQUEUED jobs",
    ),
    "deliver a reply": _between((*ACTIVE, State.WAITING), (State.QUEUED,)),
    "requeue": _between(ALL, (State.QUEUED,)),
    "pause for children": _between(ACTIVE, (State.PAUSED,), refused=NOT_HANDED_OUT),
    "release a child": _between((State.PAUSED,), (State.QUEUED,)),
    "resume a parent": _between((State.PAUSED,), (State.QUEUED,)),
    "cancel": _between(
        (
            State.QUEUED, State.RUNQUEUED, State.FAILED, State.CANCELLED, State.WAITING,
            State.BLOCKED,
        ),
        (State.CANCELLED,),
    ),
    # CancelJob with running: true marks a handed-out job (14.26) ...
    "ask to cancel": _in_place(ACTIVE),
    # ... and its next report, its lease's end or its stale deadline ends it.
    "cancel a run": _between(ACTIVE, (State.CANCELLED,)),
    "delete": _between(
        tuple(s for s in ALL if s not in (State.RUNNING, State.PAUSED)),
        (GONE,),
        refused={
            State.RUNNING: "405 Can't delete a RUNNING job",
            # A PAUSED job is a parent waiting for its children, or a
            # child waiting for its running parent: Bedrock's words name
            # the first.
            State.PAUSED: "405 Can't delete a parent jobs with children running",
        },
    ),
    "delete ended children": _between(ENDED_CHILDREN, (GONE,)),
    "give back": _between(ACTIVE, READY),
    # Retention: done by the storage's SQL (Storage.prune), listed for the table.
    "prune": _between((State.FINISHED, State.FAILED), (GONE,), ends_run=False),
}


class IllegalMove(Exception):
    """A transition was asked of a job in a state it cannot leave that way:
    a bug in the caller, unless it is `Refused`."""


class Refused(IllegalMove, CommandError):
    """A move a client asked of a job in a state that cannot make it: the
    client is answered with the move's status line, and the request is
    undone."""

    def __init__(self, status: str, detail: str) -> None:
        Exception.__init__(self, f"{status} ({detail})")
        self.status = status


def illegal(job: Job, name: str, target: str) -> IllegalMove:
    detail = f"{name}: job {job.jobID} cannot go from {job.state} to {target}"
    status = MOVES[name].refusals.get(job.state)
    return IllegalMove(detail) if status is None else Refused(status, detail)


def check(job: Job, name: str) -> None:
    """Refuse at once the move `name` of a job in a state it cannot leave
    that way, for a command that reads more of its request before it
    makes the move: the refusal comes before the request's other checks,
    as in Bedrock."""
    if job.state not in MOVES[name].sources:
        raise illegal(job, name, "anywhere")


def legal_moves(source: str, target: str) -> list[str]:
    """The names of the moves from `source` to `target`, in table order."""
    return [name for name, move in MOVES.items() if (source, target) in move.pairs]
