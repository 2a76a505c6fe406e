"""When the engine's clock fires next.

The earliest time something is due that the engine has been told of: a
future job, a lease's end, a reply deadline or a stale deadline (by a
commit, by another node's notice, by the tick, by the store at start), or
a retry after a failed transaction. An earlier time set meanwhile makes
the wait look again; a later one changes nothing. What the clock does
when it fires (the tick, the give-backs owed, trying every waiter) is the
engine's (`Engine._run_clock`).

Apart from the engine (engine.py) so that the one moving part of its
clock, a time and the event that re-arms it, is read in one place.
"""

from __future__ import annotations

from datetime import timedelta

import trio

from jobserver.core.engine.clock import Clock, seconds_until
from jobserver.model import times

# After a failed transaction (the database locked past its busy timeout, a
# full disk), what the clock and the give-backs still owe is tried again
# this long after: soon enough for a waiting worker, slow enough not to spin.
RETRY_SECONDS = 1.0


class Alarm:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        # When the clock fires next, and the event that makes it look again.
        self._next_due: str | None = None
        self._rearm = trio.Event()

    async def rings(self) -> None:
        """Until the earliest time set comes, which is then cleared."""
        while True:
            self._rearm = trio.Event()
            due = self._next_due
            if due is None:
                await self._rearm.wait()
                continue
            with trio.move_on_after(seconds_until(self._clock, due)):
                await self._rearm.wait()
                continue
            self._next_due = None
            return

    def retry_soon(self) -> None:
        """Fire RETRY_SECONDS from now, if nothing is due before."""
        self.lower(times.to_millis(self._clock.now() + timedelta(seconds=RETRY_SECONDS)))

    def lower(self, due: str | None) -> None:
        """Fire at `due`, if nothing is due before."""
        if due is not None and (self._next_due is None or due < self._next_due):
            self._next_due = due
            self._rearm.set()
