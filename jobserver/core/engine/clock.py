"""Where the core reads the time of day.

Every moment the core writes or compares (a job's nextRun, a lease's end,
the clock's next firing) comes from one Clock, given to the writer, the
wait queue and the pruner when the server starts. The server uses the
system's clock; tests give one that follows trio's MockClock, so that
hours of leases and deadlines pass in no time and in a fixed order.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from jobserver.model import times


class Clock(Protocol):
    def now(self) -> datetime:
        """The current moment, timezone-aware, in UTC."""
        ...


class SystemClock:
    """The machine's wall clock."""

    def now(self) -> datetime:
        return times.utcnow()


def seconds_until(clock: Clock, stored: str) -> float:
    """Seconds from now to a stored time; 0 if it has passed."""
    return max(0.0, (times.parse_stored(stored) - clock.now()).total_seconds())
