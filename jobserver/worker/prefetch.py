"""How many jobs the worker takes beyond its free slots (--prefetch): jobs
held here, RUNNING on the server, that start as slots come free, so that a
fast handler's slots do not wait a round trip (and a commit) for each
GetJobs.

A job held here waits, while another worker might be running it. So the
worker holds only what its handlers would start within PREFETCH_HORIZON at
the pace they end now: the mean time of the recent handler calls, one
slot each. A handler of a few milliseconds fills --prefetch; one of a
minute holds nothing beyond its slots, as before any handler has ended.

A slot whose call has run past STUCK_AFTER starts no held job meanwhile,
so it counts for none: with every slot stuck so, nothing is held, and the
jobs held already are handed back for other workers to run (a handler of
20 s among 2 ms ones held 812 jobs for its 20 s on one slot, issue 36)."""

from __future__ import annotations

# A held job should start within about this long.
PREFETCH_HORIZON = 0.5
# A call running longer than this no longer paces the held jobs: ten
# horizons, so that handlers a little slower than the horizon, which hold
# nothing anyway, never make held jobs go back and forth.
STUCK_AFTER = 10 * PREFETCH_HORIZON
# The weight of the latest handler call in the mean, once there have been
# 50: the mean follows about the last 50 (before, it is the plain mean,
# so that the first call, which may start a thread, does not weigh long).
RECENT = 0.02


class Prefetch:
    """The bound on jobs held beyond the free slots, and the pace it follows."""

    def __init__(self, most: int, concurrency: int) -> None:
        self.most = most  # --prefetch
        self.concurrency = concurrency
        self.mean: float | None = None  # seconds per handler call; None: none ended yet
        self.calls = 0
        self.began: dict[int, float] = {}  # the calls under way: when each began, by job ID

    def begin(self, job_id: int, now: float) -> None:
        """A handler call begins, at `now` (anyio's clock)."""
        self.began[job_id] = now

    def ended(self, job_id: int, seconds: float) -> None:
        """A handler call took `seconds`."""
        self.began.pop(job_id, None)
        self.calls += 1
        if self.mean is None:
            self.mean = seconds
        else:
            self.mean += max(RECENT, 1 / self.calls) * (seconds - self.mean)

    def allowed(self, now: float) -> int:
        """How many jobs may be held beyond the slots at `now`."""
        if self.mean is None or not self.most:
            return 0
        pacing = self.concurrency - sum(now - began > STUCK_AFTER for began in self.began.values())
        if pacing <= 0:
            return 0
        if self.mean <= 0:
            return self.most
        return min(self.most, int(pacing * PREFETCH_HORIZON / self.mean))
