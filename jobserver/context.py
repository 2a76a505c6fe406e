"""What a command sees while it runs in the writer, and what it reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from . import times
from .store import Store


@dataclass
class Context:
    store: Store
    now: datetime
    # Names of jobs this request made due now; waiting GetJobs are matched
    # against them once the transaction commits.
    ready: set[str] = field(default_factory=set)
    # The earliest future nextRun this request wrote, for the wake-up timer.
    due: str | None = None
    now_s: str = field(init=False)
    now_ms: str = field(init=False)

    def __post_init__(self) -> None:
        # Formatted once: handlers compare against these many times.
        self.now_ms = times.to_millis(self.now)
        self.now_s = self.now_ms[:19]

    def scheduled(self, name: str, next_run: str) -> None:
        """Note that a job called `name` now waits to run at `next_run`."""
        if next_run <= self.now_ms:
            self.ready.add(name)
        elif self.due is None or next_run < self.due:
            self.due = next_run

    def wake_all(self) -> None:
        """Note that jobs of any name may have become available (capacity
        freed, a pattern resumed): a due time of now makes the wait queue's
        clock try every waiting GetJob as soon as this commits."""
        if self.due is None or self.now_ms < self.due:
            self.due = self.now_ms
