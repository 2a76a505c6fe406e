"""What a command sees while it runs in the writer, and what it reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from jobserver.core.engine.history import Events, add_events, new_events
from jobserver.model import times
from jobserver.storage.interface import Storage
from jobserver.wire.limits import (
    DEFAULT_IDEMPOTENCY_KEEP,
    DEFAULT_KEEP_OUTCOMES,
    DEFAULT_MAX_LIMITS,
    DEFAULT_MAX_REPLY_BYTES,
)

if TYPE_CHECKING:
    from jobserver.core.rules.selection import Taken

# hipq's default job timeout: a day is longer than any job should run
# without a word from its worker, and short enough that a job lost with
# its worker still runs the same week.
DEFAULT_STALE_AFTER = 86400.0
# An hour: far longer than any worker takes between sending a request and
# committing its AwaitReply, short enough that unclaimed replies do not pile up.
DEFAULT_REPLY_GRACE = 3600.0


@dataclass(frozen=True)
class Settings:
    """The server's options that commands act on."""

    # Retention (--keep-finished): a finished standalone job stays FINISHED
    # until the pruner deletes it, instead of being deleted at once.
    keep_finished: bool = False
    # Seconds a reply is kept: early ones for a job to await, delivered ones
    # to refuse a second delivery (--reply-grace).
    reply_grace: float = DEFAULT_REPLY_GRACE
    # Seconds a RUNNING job may go without a report before it counts as a
    # failed attempt (--stale-after); 0 never.
    stale_after: float = DEFAULT_STALE_AFTER
    # When this server started (stored-time text): a worker cannot report
    # while the server is down, so silence is counted from here at the most.
    serving_since: str = ""
    # The largest reply a command may build (--max-reply-bytes).
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    # The most concurrency limits, and the most paused patterns, SetLimit
    # and PauseJobs may add (--max-limits).
    max_limits: int = DEFAULT_MAX_LIMITS
    # This server's name as a job handed out here records it (its listen
    # address): which of several nodes a worker took a job from.
    node: str = ""
    # Seconds an idempotency key and its reply are kept (--idempotency-keep).
    idempotency_keep: float = DEFAULT_IDEMPOTENCY_KEEP
    # Seconds an ended job's outcome is kept for AwaitJob (--keep-outcomes);
    # 0: only the outcomes of jobs an AwaitJob waits for, a minute.
    keep_outcomes: float = DEFAULT_KEEP_OUTCOMES


@dataclass
class Context:
    store: Storage
    now: datetime
    settings: Settings = Settings()
    # Names of jobs this request made due now; waiting GetJobs are matched
    # against them once the transaction commits.
    ready: set[str] = field(default_factory=set)
    # The earliest future nextRun this request wrote, for the wake-up timer.
    due: str | None = None
    # Jobs an AwaitJob waits for that this request ended: their awaiters,
    # on every node, are woken once it commits (core/rules/outcomes.py).
    ended: set[int] = field(default_factory=set)
    # `now` as stored text; the writer formats it once for a whole batch,
    # whose requests share one moment as they share one commit.
    now_ms: str = ""
    now_s: str = field(init=False)
    # When a job that runs from now becomes stale (--stale-after), made at
    # the first hand-out or report that asks: a GetJobs asks for each job.
    _stale_at: str | None = field(default=None, init=False, repr=False)
    # What this request's moves count in the history (history.py), by
    # kind and job name: made at its first event, added up only if its
    # transaction commits.
    events: Events | None = field(default=None, init=False, repr=False)
    # The jobs this request handed out: given back if whether its
    # transaction committed cannot be learned (Engine._delivered).
    taken: list[Taken] = field(default_factory=list, init=False, repr=False)
    # Ends of jobs with dependents that a command over many jobs tells
    # their dependents of at its end, all at once (lifecycle.telling_at_end);
    # None while each is told as it happens.
    ends: list[Any] | None = field(default=None, init=False, repr=False)
    # Whether a cascade left dependents BLOCKED for a later transaction:
    # the engine looks for them once this one commits (cascade.look_again).
    cascade_left: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        # Formatted once: handlers compare against these many times.
        if not self.now_ms:
            self.now_ms = times.to_millis(self.now)
        self.now_s = self.now_ms[:19]

    def scheduled(self, name: str, next_run: str) -> None:
        """Note that a job called `name` now waits to run at `next_run`."""
        if next_run <= self.now_ms:
            self.ready.add(name)
        elif self.due is None or next_run < self.due:
            self.due = next_run

    def fire_at(self, moment: str) -> None:
        """Note a time the clock must fire at, for something other than a
        job becoming due (a running job's stale deadline)."""
        if self.due is None or moment < self.due:
            self.due = moment

    def note(self, kind: int, name: str) -> None:
        """Count an event of `kind` (history.CREATED, ...) for job `name`:
        a dict's increment, for every job a batch moves."""
        events = self.events
        if events is None:
            events = self.events = new_events()
        counts = events[kind]
        counts[name] = counts.get(name, 0) + 1

    def stale_at(self) -> str:
        """now + --stale-after, to the millisecond, as nextRun is stored."""
        if self._stale_at is None:
            self._stale_at = times.later_millis(self.now, self.now_ms, self.settings.stale_after)
        return self._stale_at

    def wake_all(self) -> None:
        """Note that jobs of any name may have become available (capacity
        freed, a pattern resumed): a due time of now makes the wait queue's
        clock try every waiting GetJob as soon as this commits."""
        if self.due is None or self.now_ms < self.due:
            self.due = self.now_ms

    def part(self) -> Context:
        """A context for one part of this request that may fail on its own
        (an element of FinishJobs): what it notes counts only once joined."""
        part = Context(self.store, self.now, self.settings, now_ms=self.now_ms)
        if self.ends is not None:
            part.ends = []
        return part

    def join(self, part: Context) -> None:
        """Count what a part that succeeded noted as this request's own."""
        self.ready |= part.ready
        self.ended |= part.ended
        self.cascade_left = self.cascade_left or part.cascade_left
        if part.ends and self.ends is not None:
            self.ends += part.ends
        if part.due is not None:
            self.fire_at(part.due)
        if part.events is not None:
            if self.events is None:
                self.events = new_events()
            add_events(self.events, part.events)
