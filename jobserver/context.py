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

    @property
    def now_s(self) -> str:
        return times.to_seconds(self.now)

    @property
    def now_ms(self) -> str:
        return times.to_millis(self.now)

    def scheduled(self, name: str, next_run: str) -> None:
        """Note that a job called `name` now waits to run at `next_run`."""
        if next_run <= self.now_ms:
            self.ready.add(name)
        elif self.due is None or next_run < self.due:
            self.due = next_run
