"""Handing a job out under a lease, and giving it back.

A hand-out is the one move of a job's life with rules of its own: the
lease token that names this run, the lease the job runs under (its own
retryAfter, or the seconds its taker asked for), the lost leases it
counts (MAX_LEASES, or its retry policy's attempts) and the failure when
they run out, and, when its reply never reached the client, the give-back
that undoes exactly this hand-out. They live here, apart from the other
moves, so that lifecycle.py stays the table of moves and this the rules
of a lease. The row is still written by lifecycle's one move function
(`lifecycle._move`), checked against `MOVES` with its wake-up and history
bookkeeping, as every other move; a plain hand-out (a QUEUED job with no
lease of its own, retry policy or cancel asked for, under no taker's
lease: most of a drain's) by `lifecycle.hand_out_plain`, the same move
with its write named, which costs a drain a tenth less of the node's CPU.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import Any

from jobserver.core.engine.context import Context
from jobserver.core.rules import lifecycle, schedule
from jobserver.model.jobs import ACTIVE, Job, State
from jobserver.wire import jsonbody

# Bedrock's limit: a job whose lease expired this many times without a
# report is failed instead of being handed out again.
MAX_LEASES = 10
OUT_OF_LEASES = f"out of leases: handed out {MAX_LEASES} times without a report"
# Names with this prefix are retried forever and never counted, as in Bedrock.
UNCOUNTED_PREFIX = "manual"
# Random bytes per lease token: 2^64 tokens make a collision between two
# hand-outs of one job practically impossible.
LEASE_BYTES = 8
# The last error of a job whose lease ran out without a report.
LEASE_EXPIRED = "lease expired without a report"
# Lease tokens drawn from the system's random source at once: one call
# (getrandom) per this many hand-outs instead of one each.
TOKENS_PER_DRAW = 512


class _Tokens:
    """Lease tokens cut from random bytes drawn TOKENS_PER_DRAW at a time,
    from the same source as `secrets.token_hex`: a token is as hard to guess
    as one drawn alone, and no two hand-outs share bytes. Locked, since a
    batch's writer may run in a thread."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Draw anew at the next token (and, in a forked child, with a lock
        no thread of the parent can be holding)."""
        self._lock = threading.Lock()
        self._pool = b""
        self._at = 0

    def next(self) -> str:
        with self._lock:
            if self._at >= len(self._pool):
                self._pool = os.urandom(LEASE_BYTES * TOKENS_PER_DRAW)
                self._at = 0
            at = self._at
            self._at = at + LEASE_BYTES
            return self._pool[at : at + LEASE_BYTES].hex()


_tokens = _Tokens()
# A process forked from this one (a test's, a worker's) must not hand out
# the tokens this one will.
os.register_at_fork(after_in_child=_tokens.forget)
# What a token is: LEASE_BYTES bytes in lowercase hex.
_TOKEN = re.compile(f"[0-9a-f]{{{2 * LEASE_BYTES}}}")


def is_token(text: str) -> bool:
    """Whether `text` has the form of a lease token (a hand-out's leaseID)."""
    return _TOKEN.fullmatch(text) is not None


# Plain, with slots: made at every hand-out, and a frozen dataclass's
# __init__ costs five times as much. Nothing changes one once made.
@dataclass(slots=True)
class Lease:
    """What a hand-out wrote: its lease token, and the job's data and
    nextRun after it (a give-back restores the job only if nobody changed
    them since)."""

    token: str
    data: str
    next_run: str


def hand_out(ctx: Context, job: Job, worker: str = "", lease: int = 0) -> Lease | None:
    """Mark a due job as handed out to `worker` (its address) on this node:
    RUNNING, or RUNQUEUED until the end of its lease: its own (retryAfter),
    else the `lease` seconds its taker asked for, if any. None if the job
    was failed instead: out of leases or attempts, or a lease that cannot
    be computed."""
    token = _tokens.next()
    if (
        job.state == State.QUEUED and not lease and not job.lease and not job.maxAttempts
        and not job.retryAfter and not job.cancelRequested
    ):
        # Most hand-outs: no lease, policy, lost lease or cancel to write of.
        lifecycle.hand_out_plain(ctx, job, token, worker)
        return Lease(token, job.data, job.nextRun)
    # Who took it goes in the hand-out's own write (RunningJobs).
    changes: dict[str, Any] = {
        "lastRun": ctx.now_s, "leaseID": token, "worker": worker, "node": ctx.settings.node,
    }
    if job.lease:
        # The last taker's lease is not this one's.
        changes["lease"] = 0
    if job.cancelRequested:
        # Its lease ended with a cancel pending: the run is over (14.26).
        lifecycle.cancel_run(ctx, job)
        return None
    if job.state == State.RUNQUEUED and not _counts_lost_lease(ctx, job, changes):
        return None
    if job.maxAttempts:
        changes["attempts"] = job.attempts + 1
    if job.retryAfter:
        return _hand_out_leased(ctx, job, changes)
    if lease:
        return _hand_out_under_takers_lease(ctx, job, lease, changes)
    lifecycle._move(ctx, job, "hand out", State.RUNNING, lastReport=ctx.now_ms, **changes)
    return Lease(token, job.data, job.nextRun)


def _counts_lost_lease(ctx: Context, job: Job, changes: dict[str, Any]) -> bool:
    """A job due while still leased: its last hand-out's lease ran out. With
    a retry policy that was an attempt; under a lease its taker asked for,
    one of MAX_LEASES, counted in `attempts` (Bedrock's counter in the data
    is retryAfter's alone). False if the job was failed for it."""
    if job.maxAttempts:
        changes["lastError"] = LEASE_EXPIRED
        if job.attempts >= job.maxAttempts:
            _expire(ctx, job, LEASE_EXPIRED)
            return False
    elif not job.retryAfter:
        changes["lastError"] = LEASE_EXPIRED
        changes["attempts"] = job.attempts + 1
        if changes["attempts"] >= MAX_LEASES:
            _expire(ctx, job, OUT_OF_LEASES)
            return False
    return True


def _hand_out_leased(ctx: Context, job: Job, changes: dict[str, Any]) -> Lease | None:
    """RUNQUEUED until the end of the job's own lease (retryAfter, section 7)."""
    data = jsonbody.parse_object(job.data, stored=True)
    counted = not job.name.startswith(UNCOUNTED_PREFIX)
    # A policy's maxAttempts replaces Bedrock's counter in the data.
    count_leases = counted and not job.maxAttempts
    count = data.get("retryAfterCount", 0) if count_leases else 0
    if not isinstance(count, int) or isinstance(count, bool):
        count = 0
    if count >= MAX_LEASES:
        _expire(ctx, job, OUT_OF_LEASES)
        return None
    next_run = _lease_end(ctx, job, 0)
    if next_run is None:
        return None
    if count_leases:
        data["retryAfterCount"] = count + 1
    scheduled = counted and "SCHEDULED" in job.repeat
    if scheduled:
        data["originalNextRun"] = job.nextRun
    # A plain leased job's data is written back at every hand-out, as it
    # always was; a policy job's only when it records originalNextRun.
    if not job.maxAttempts or scheduled:
        changes["data"] = jsonbody.compact(data)
    lifecycle._move(ctx, job, "hand out", State.RUNQUEUED, nextRun=next_run, **changes)
    return Lease(changes["leaseID"], changes.get("data", job.data), next_run)


def _hand_out_under_takers_lease(
    ctx: Context, job: Job, seconds: int, changes: dict[str, Any]
) -> Lease | None:
    """RUNQUEUED until the end of the lease its taker asked for (GetJob's
    `lease`, protocol.md 14.24); its data gains no counter, only a SCHEDULED
    repeat's originalNextRun, as under retryAfter."""
    next_run = _lease_end(ctx, job, seconds)
    if next_run is None:
        return None
    if "SCHEDULED" in job.repeat:
        data = {**jsonbody.parse_object(job.data, stored=True), "originalNextRun": job.nextRun}
        changes["data"] = jsonbody.compact(data)
    changes["lease"] = seconds
    lifecycle._move(ctx, job, "hand out", State.RUNQUEUED, nextRun=next_run, **changes)
    return Lease(changes["leaseID"], changes.get("data", job.data), next_run)


def _lease_end(ctx: Context, job: Job, seconds: int) -> str | None:
    """The end of a hand-out's lease; None, the job failed, if there is none."""
    try:
        # Handed out for its nextRun, even when that is an ended lease's end.
        next_run = schedule.lease_end(ctx, job, job.nextRun, seconds)
    except schedule.RepeatStalled as stalled:
        # A lease that ends at once would hand the job out again and again.
        _expire(ctx, job, str(stalled))
        return None
    if next_run is None:
        # A stored time SQLite cannot read (imported from elsewhere, written
        # by hand) must not block the queue: fail the job, as Bedrock does.
        _expire(ctx, job, "cannot compute the end of the lease")
    return next_run


def _expire(ctx: Context, job: Job, error: str) -> None:
    lifecycle._move(ctx, job, "expire a lease", State.FAILED, lastError=error, ended=ctx.now_s)


def give_back(ctx: Context, job: Job, lease: Lease) -> None:
    """Undo a hand-out whose reply never reached its client; `job` is the
    row as it was before. A job that has moved on since (its lease ran out
    and another worker has it, or it was requeued) is left alone, and data
    or a nextRun that an UpdateJob set meanwhile is kept: only this
    hand-out is undone."""
    current = ctx.store.get(job.jobID)
    if current is None or current.state not in ACTIVE or current.leaseID != lease.token:
        return
    if current.cancelRequested:
        # Cancelled before its worker ever had it: it ends here.
        lifecycle.cancel_run(ctx, current)
        return
    lifecycle._move(
        ctx,
        current,
        "give back",
        job.state,
        nextRun=job.nextRun if current.nextRun == lease.next_run else current.nextRun,
        lastRun=job.lastRun,
        data=job.data if current.data == lease.data else current.data,
        attempts=job.attempts,
        lastError=job.lastError,
        leaseID=job.leaseID,
        lastReport=job.lastReport,
        worker=job.worker,
        node=job.node,
        lease=job.lease,
    )
