"""What a job is: its states, its row, and the options it is created with.

Plain data, shared by the core and every storage backend. How a job moves
from state to state is lifecycle.py's business alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import NamedTuple


class State(StrEnum):
    """A job's state, stored as its name (protocol.md section 4.2)."""

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    RUNQUEUED = "RUNQUEUED"
    PAUSED = "PAUSED"
    FINISHED = "FINISHED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    WAITING = "WAITING"
    # Waiting for the jobs it depends on to end (protocol.md 14.25).
    BLOCKED = "BLOCKED"


# Due jobs in these states are handed out.
READY = (State.QUEUED, State.RUNQUEUED)
# Handed out to a worker: they hold capacity of concurrency limits.
ACTIVE = (State.RUNNING, State.RUNQUEUED)
# Children in these states hold their parent back; a WAITING child
# (protocol.md 14.12) holds it like a running one.
PENDING = (State.QUEUED, State.RUNQUEUED, State.RUNNING, State.PAUSED, State.WAITING)
# Children that ended, kept for their parent.
ENDED_CHILDREN = (State.FINISHED, State.CANCELLED)
# A job in these states has ended (issue 37's "end": its dependents are
# told when it reaches one from any other state, or is deleted before).
ENDED = (State.FINISHED, State.FAILED, State.CANCELLED)


@dataclass
class Job:
    """One row of the jobs table (protocol.md section 4.1)."""

    created: str
    jobID: int
    state: str
    name: str
    nextRun: str
    lastRun: str | None
    repeat: str
    data: str
    priority: int
    parentJobID: int
    retryAfter: str
    maxAttempts: int
    retryBackoff: str
    retryDelay: float
    retryMaxDelay: float
    attempts: int
    lastError: str
    leaseID: str
    cost: int = 1
    timeWindows: str = ""
    timeZone: str = ""
    ended: str = ""
    replyKey: str = ""
    lastReport: str = ""
    # Who took it at its last hand-out: the connection's peer address, and
    # the node (server) it was taken on; "" before its first.
    worker: str = ""
    node: str = ""
    # Whose job it is, for per-key and fair limits (protocol.md 14.23).
    key: str = ""
    # Seconds of the lease its taker asked for (GetJob's `lease`) when its
    # last hand-out was under one; 0 otherwise, and for a job with
    # retryAfter, whose own lease wins (protocol.md 14.24).
    lease: int = 0
    # Dependencies (protocol.md 14.25): how many jobs it depends on, how
    # many depend on it (so a job without either costs no statement more
    # when it ends or is handed out), and what it does when one fails
    # ("" is "fail").
    dependencies: int = 0
    dependents: int = 0
    onDependencyFailure: str = ""
    # 1 once CancelJob with running: true asked this handed-out job to
    # stop: its next report is answered 410 and it ends CANCELLED
    # (protocol.md 14.26).
    cancelRequested: int = 0
    # 1 once an AwaitJob waits for it (protocol.md 14.27): its end is then
    # announced to every node, and its outcome kept even with
    # --keep-outcomes 0 (core/rules/outcomes.py).
    awaited: int = 0


# Plain, with slots: made at every end of a job, and a frozen dataclass's
# __init__ costs five times as much. Nothing changes one once made.
@dataclass(slots=True)
class JobOutcome:
    """How a job ended: its final state (FINISHED, FAILED, CANCELLED, or
    DELETED before it ended), data and last error, when, and until when
    it is kept."""

    jobID: int
    name: str
    state: str
    data: str
    lastError: str
    ended: str
    expires: str


class FinishedRun(NamedTuple):
    """A job a plain finish deleted (storage's finish_plain_runs): what the
    history and its awaiters need of it."""

    jobID: int
    name: str
    awaited: bool


class OutcomesKept(NamedTuple):
    """How long the outcomes of the jobs a plain finish deletes are kept
    (storage's finish_plain_runs): ended at `ended`; kept until
    `awaited_until` for an awaited job, until `until` for any other, and
    not at all where that is None."""

    ended: str
    until: str | None
    awaited_until: str


@dataclass(frozen=True)
class FlowOptions:
    """What CreateJob's cost, timeWindows and timeZone ask for; the
    defaults are a plain Bedrock job."""

    cost: int = 1
    windows: str = ""
    zone: str = ""
    key: str = ""


PLAIN = FlowOptions()


@dataclass(frozen=True)
class RetryPolicy:
    """What CreateJob's maxAttempts, retryBackoff, retryDelay and
    retryMaxDelay ask for."""

    max_attempts: int
    backoff: str
    delay: float
    max_delay: float


# Plain, with slots: one per job created, and a frozen dataclass's __init__
# costs three times as much for its twelve fields. Nothing changes one once
# made.
@dataclass(slots=True)
class NewJob:
    """Everything CreateJob stores about a job, before it has an ID."""

    name: str
    next_run: str
    priority: int
    repeat: str = ""
    data: str = "{}"
    parent_id: int = 0
    retry_after: str = ""
    policy: RetryPolicy | None = None
    flow: FlowOptions = PLAIN
    # How many jobs it depends on (its edges are stored apart, once every
    # job of the request has its ID), how many of them have not ended, and
    # what it does when one does not finish ("" is "fail").
    dependencies: int = 0
    blockers: int = 0
    on_dependency_failure: str = ""


class _Keep(Enum):
    KEEP = "keep"


# A column a JobChanges leaves as it is.
KEEP = _Keep.KEEP


@dataclass
class JobChanges:
    """What a write sets of a job's row besides its state: every field left
    at KEEP stays as it is. The only columns a command may change, by name:
    a column's name never comes from a request. Not frozen: one is made for
    every write, and a frozen dataclass takes three times as long to make;
    none is changed once made."""

    name: str | _Keep = KEEP
    nextRun: str | _Keep = KEEP
    lastRun: str | _Keep | None = KEEP
    repeat: str | _Keep = KEEP
    data: str | _Keep = KEEP
    priority: int | _Keep = KEEP
    retryAfter: str | _Keep = KEEP
    # A retry policy a worker gave a job that had none (FailJob's).
    maxAttempts: int | _Keep = KEEP
    retryBackoff: str | _Keep = KEEP
    retryDelay: float | _Keep = KEEP
    retryMaxDelay: float | _Keep = KEEP
    attempts: int | _Keep = KEEP
    lastError: str | _Keep = KEEP
    leaseID: str | _Keep = KEEP
    ended: str | _Keep = KEEP
    replyKey: str | _Keep = KEEP
    lastReport: str | _Keep = KEEP
    worker: str | _Keep = KEEP
    node: str | _Keep = KEEP
    lease: int | _Keep = KEEP
    cancelRequested: int | _Keep = KEEP
    awaited: int | _Keep = KEEP
    # UpdateJob's, and a unique CreateJob's merge.
    timeZone: str | _Keep = KEEP

    def columns(self) -> dict[str, object]:
        """The columns set, by name, in a fixed order (the fields')."""
        # vars() is the fields in their order: a write's hot path, where
        # dataclasses.fields() cost more than the SQL.
        return {name: value for name, value in vars(self).items() if value is not KEEP}


NO_CHANGES = JobChanges()
