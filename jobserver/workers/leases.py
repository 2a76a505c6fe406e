"""Lease renewal: while a leased job's worker runs (a job with retryAfter,
or any job taken under the lease --lease asks for), and until its report
is done with, its lease is renewed (TouchJob) after a third of it or every
--touch-interval seconds, whichever is sooner, so that a worker may run
longer than the lease without its job being handed out twice, and a
report that waits behind others (or through an outage) is not refused for
a lease that ran out meanwhile. Renewals go over a connection of their
own."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from jobserver.cli.options import number
from jobserver.client import (
    ConnectionFailed,
    JobCancelled,
    JobServerError,
    ServerError,
    UnrecognizedCommand,
)
from jobserver.model.repeat import offset_seconds
from jobserver.wire.limits import MAX_CANCEL_CHECK, MAX_LEASE, MIN_LEASE
from jobserver.workers.connection import Link, Server
from jobserver.workers.contract import printable

log = logging.getLogger("jobserver.workers")

# A lease is renewed after a third of it has passed: two more tries fit
# before it runs out if the server does not answer one.
TOUCH_FRACTION = 1 / 3
# The server counts a lease from the start of the current second, so it can
# be up to this much shorter than its retryAfter says.
LEASE_ROUNDING = 1.0
# Renewing more often than this is only load, whatever the lease.
MIN_TOUCH_INTERVAL = 0.1
# How often the running jobs are asked about (CancelledJobs, protocol.md
# 14.26), a read, so that a cancel is heard within about this long rather
# than a third of the lease; each one named is renewed at once, and that
# renewal's 410 ends it.
CANCEL_CHECK = 1.0
# Seconds of the lease both kinds of worker ask for by default (--lease,
# protocol.md 14.24): a killed worker's jobs are back within half a
# minute, for one renewal per running job every 10 s.
DEFAULT_LEASE = 30
LEASE_HELP = (
    f"ask for a lease of S seconds, 1 to {MAX_LEASE}, on each job without retryAfter, "
    "renewed (TouchJob) while it runs: a job whose worker died is handed out again when "
    f"its lease ends; 0 for none, the job RUNNING until the server's --stale-after "
    f"(default: {DEFAULT_LEASE})"
)


@dataclass
class Lease:
    """A running job's lease, renewed while its worker runs."""

    job_id: int
    name: str  # printable(), for the log
    lease_id: str
    period: float  # seconds between renewals
    due: float  # trio time of the next renewal
    # The worker has ended: the job's report is on its way.
    ended: bool = False
    # Seconds each renewal asks for (TouchJob's `lease`): a handler's own
    # lease; None renews by the one the job was taken under.
    seconds: int | None = None


def check_lease(value: int) -> None:
    """--lease: 0 (none), or what GetJob's `lease` takes. ValueError if not."""
    if not (type(value) is int and (value == 0 or MIN_LEASE <= value <= MAX_LEASE)):
        raise ValueError(f"lease must be 0 or {MIN_LEASE} to {MAX_LEASE} seconds, not {value!r}")


def add_lease_argument(parser: argparse.ArgumentParser) -> None:
    """--lease, the same for `jobserver worker` and the worker manager."""
    parser.add_argument(
        "--lease", type=number(int, 0, MAX_LEASE, unit="seconds"), default=DEFAULT_LEASE,
        metavar="S", help=LEASE_HELP,
    )


def touch_period(retry_after: str, interval: float) -> float:
    """How often to renew a lease of `retry_after`: after a third of its
    shortest length, at most every `interval` seconds (also when its length
    depends on the moment)."""
    length = offset_seconds(retry_after)
    if length is None:
        return interval
    shortest = length - LEASE_ROUNDING
    return max(min(interval, shortest * TOUCH_FRACTION), MIN_TOUCH_INTERVAL)


def renewal_period(job: dict[str, Any], interval: float, asked: int) -> float | None:
    """How often to renew the lease of a job handed out to a GetJobs that
    asked for `asked` seconds (0: none): by its own retryAfter if it has
    one, else by the lease asked for (protocol.md 14.24, counted to the
    millisecond); None for a job without a lease."""
    retry_after = job.get("retryAfter")
    if isinstance(retry_after, str) and retry_after:
        return touch_period(retry_after, interval)
    if not asked:
        return None
    return max(min(interval, asked * TOUCH_FRACTION), MIN_TOUCH_INTERVAL)


def policys_lease(
    job: dict[str, Any], asked: int, lease_for: Callable[[str], int | None]
) -> int | None:
    """The lease of the job's handler (or --policy), if it has one other
    than the `asked` seconds the job was taken for: it replaces that at the
    job's first renewal (TouchJob's `lease`, protocol.md 14.4). A job's own
    (retryAfter) wins, and one taken without a lease has none to renew."""
    if not asked or job.get("retryAfter"):
        return None
    seconds = lease_for(job["name"])
    return seconds if seconds != asked else None


class Leases:
    """The leases of the running jobs, and the task that renews them."""

    def __init__(
        self,
        server: Server,
        touch_interval: float,
        lease: int = 0,
        lease_for: Callable[[str], int | None] = lambda name: None,
    ) -> None:
        self.server = server
        self.touch_interval = touch_interval
        self.lease = lease  # the seconds each GetJobs asks for (--lease)
        self.lease_for = lease_for  # a job name's --policy lease, if it has one
        self.held: dict[str, Lease] = {}  # by lease token
        self.changed = trio.Event()  # set (and replaced) when a lease is taken on
        self.failing = False  # the last renewal could not reach the server
        # Told of a job the server cancelled while it ran (410, protocol.md 14.26).
        self.on_cancel: Callable[[int], None] = lambda job_id: None

    def hold(self, job: dict[str, Any]) -> str | None:
        """Renew this job's lease while it runs; its token, or None for a
        job without a lease."""
        lease_id = job.get("leaseID")
        if not (isinstance(lease_id, str) and lease_id):
            return None
        seconds = policys_lease(job, self.lease, self.lease_for)
        period = renewal_period(job, self.touch_interval, seconds or self.lease)
        if period is None:
            return None
        name = printable(job["name"])
        # A policy's lease replaces the one asked for at once.
        due = trio.current_time() + (0 if seconds else period)
        self.held[lease_id] = Lease(job["jobID"], name, lease_id, period, due, seconds=seconds)
        self.changed.set()
        return lease_id

    def adopt(self, old: str | None, job: dict[str, Any]) -> str | None:
        """The job, running here under the lease `old`, was handed out
        again: renew the new hand-out's lease instead, the one its report
        will carry (`old` is no longer the job's). The new token, or None."""
        if old is not None:
            self.held.pop(old, None)
        return self.hold(job)

    def ended(self, lease_id: str | None) -> None:
        """The job's worker has ended: its lease (if held) is renewed until
        its report is done with (`release`)."""
        lease = self.held.get(lease_id) if lease_id is not None else None
        if lease is not None:
            lease.ended = True

    def release(self, lease_id: str | None) -> None:
        """Stop renewing a lease (if held): its job's report is done with."""
        if lease_id is not None:
            self.held.pop(lease_id, None)

    async def renew_loop(self) -> None:
        """Renew each held lease when it is due; runs until cancelled."""
        link = Link(self.server, "lease renewals")
        try:
            while True:
                lease = await self._next_due()
                lease.due = trio.current_time() + lease.period
                await self._renew(lease, link)
        finally:
            await link.aclose()

    async def cancel_check_loop(self) -> None:
        """Ask which running jobs have a cancel pending, every CANCEL_CHECK
        seconds while some run, and renew those now. Runs until cancelled,
        or until the server has no CancelledJobs (an older one)."""
        link = Link(self.server, "cancel checks")
        try:
            while True:
                await trio.sleep(CANCEL_CHECK)
                running = {
                    lease.job_id: lease for lease in self.held.values() if not lease.ended
                }
                ids = sorted(running)
                try:
                    for start in range(0, len(ids), MAX_CANCEL_CHECK):
                        chunk = ids[start:start + MAX_CANCEL_CHECK]
                        for job_id in await link.client.cancelled_jobs(chunk):
                            if job_id in running:
                                running[job_id].due = trio.current_time()
                                self.changed.set()
                except UnrecognizedCommand:
                    log.info("server %s has no CancelledJobs: cancels are heard at lease "
                             "renewals", self.server.address)
                    return
                except (ConnectionFailed, JobServerError):
                    await link.reconnect()  # the renewals say what is wrong
        finally:
            await link.aclose()

    async def _next_due(self) -> Lease:
        """Wait until a held lease is due for renewal; that lease."""
        while True:
            self.changed = trio.Event()
            if not self.held:
                await self.changed.wait()
                continue
            lease = min(self.held.values(), key=lambda held: held.due)
            if lease.due <= trio.current_time():
                return lease
            with trio.move_on_at(lease.due):
                await self.changed.wait()

    async def _renew(self, lease: Lease, link: Link) -> None:
        try:
            await link.client.touch_job(
                lease.job_id, lease_id=lease.lease_id, lease=lease.seconds
            )
        except (ConnectionFailed, ServerError) as error:
            if not self.failing:
                log.warning(
                    "cannot renew the lease of job %s (%s); trying again in %gs",
                    lease.job_id,
                    error,
                    lease.period,
                )
                self.failing = True
            await link.reconnect()
            return
        except JobCancelled:
            if self.held.pop(lease.lease_id, None) is not None and not lease.ended:
                log.info("job %s %s: cancelled (410 Job cancelled); stopping its worker",
                         lease.job_id, lease.name)
                self.on_cancel(lease.job_id)
            return
        except JobServerError as error:
            # The lease is gone: 409 when another worker has the job now (its
            # result will be refused), or the job's report was applied
            # before its lease was let go.
            if self.held.pop(lease.lease_id, None) is not None:
                log.log(
                    logging.INFO if lease.ended else logging.WARNING,
                    "job %s %s: lost its lease (%s %s); %s",
                    lease.job_id,
                    lease.name,
                    error.code,
                    error.reason,
                    "its report decides" if lease.ended else "the worker runs on",
                )
            return
        if self.failing:
            log.info("server %s reachable again; renewing leases", self.server.address)
            self.failing = False
