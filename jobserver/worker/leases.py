"""Lease renewal, as the worker manager does it (jobserver.workers.leases):
while a job with a lease (retryAfter, or the one --lease asks for) runs,
and until its report is done with, its lease is renewed (TouchJob) after a
third of it or every --touch-interval seconds, whichever is sooner, over a
connection of its own. A handler may also ask for a renewal now
(`Job.renew_lease`), from its thread or its task.

A job whose handler has a lease of its own (`@worker.handler(...,
lease=S)`) is taken under the worker's (--lease: the handler is known only
once the job is), and its first renewal, due at once, asks for the
handler's (TouchJob's `lease`, protocol.md 14.4), as do the ones after,
at a third of it. A job with retryAfter keeps its own lease.

A renewal answered `410 Job cancelled` (protocol.md 14.26) tells the job's
handler. So that a cancel is heard within about a second rather than a
third of a lease, the running jobs are also asked about every
CANCEL_CHECK seconds with CancelledJobs, a read; each one it names is
renewed at once, and that renewal's 410 ends it."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread

from jobserver.client import (
    ConnectionFailed,
    JobCancelled,
    JobServerError,
    ServerError,
    UnrecognizedCommand,
)
from jobserver.wire.limits import MAX_CANCEL_CHECK
from jobserver.worker.connection import Link, Server
from jobserver.workers.contract import printable
from jobserver.workers.leases import Lease, policys_lease, renewal_period

log = logging.getLogger("jobserver.worker")

# How often the running jobs are asked about (CancelledJobs): one read of at
# most MAX_CANCEL_CHECK jobs a request, only while some job runs.
CANCEL_CHECK = 1.0


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
        self.lease_for = lease_for  # a job name's handler's lease, if it has one
        self.held: dict[str, Lease] = {}  # by lease token
        # Each running job's way to hear of its cancel, by lease token.
        self.renewals: dict[str, Renewal] = {}
        self.changed = anyio.Event()  # set (and replaced) when one is due sooner
        self.failing = False  # the last renewal could not reach the server
        self.loop_thread = threading.get_ident()  # made on the event loop

    def hold(self, job: dict[str, Any]) -> str | None:
        """Keep this job's lease while it runs: renewed on a schedule if it
        has one (retryAfter, or the lease --lease asked for), else only when
        its handler asks. Its token, or None for a job handed out without one."""
        lease_id = job.get("leaseID")
        if not (isinstance(lease_id, str) and lease_id):
            return None
        seconds = policys_lease(job, self.lease, self.lease_for)
        period = renewal_period(job, self.touch_interval, seconds or self.lease)
        if period is None:
            period = math.inf  # RUNNING: the stale-job net's 24 h is its own
        # A handler's lease replaces the worker's at once.
        due = anyio.current_time() + (0 if seconds else period)
        self.held[lease_id] = Lease(
            job["jobID"], printable(job["name"]), lease_id, period, due, seconds=seconds
        )
        if period != math.inf:
            self._wake()  # the renewer may be waiting for a later one
        return lease_id

    def adopt(self, old: str | None, job: dict[str, Any]) -> str | None:
        """The job, running here under the lease `old`, was handed out
        again: renew the new hand-out's lease instead, the one its report
        will carry (`old` is no longer the job's). The new token, or None."""
        renewal = None
        if old is not None:
            self.held.pop(old, None)
            renewal = self.renewals.pop(old, None)
        new = self.hold(job)
        if renewal is not None and new is not None:
            self.renewals[new] = renewal
        return new

    def ended(self, lease_id: str) -> None:
        """The job's handler has ended: its lease is renewed until its
        report is done with (`release`)."""
        lease = self.held.get(lease_id)
        if lease is not None:
            lease.ended = True

    def release(self, lease_id: str) -> None:
        """Stop renewing a lease: its job's report is done with."""
        self.held.pop(lease_id, None)
        self.renewals.pop(lease_id, None)

    def renewal(self, lease_id: str | None) -> Renewal:
        """What a job's `renew_lease` calls, and how it hears of a cancel."""
        renewal = Renewal(self, lease_id)
        if lease_id is not None:
            self.renewals[lease_id] = renewal
        return renewal

    def renew_now(self, lease_id: str) -> None:
        """Renew this lease at once, if its job still runs (event loop only)."""
        lease = self.held.get(lease_id)
        if lease is not None:
            lease.due = anyio.current_time()
            self._wake()

    def _wake(self) -> None:
        self.changed.set()

    async def renew_loop(self) -> None:
        """Renew each held lease when it is due; runs until cancelled."""
        link = Link(self.server, "lease renewals")
        try:
            while True:
                lease = await self._next_due()
                lease.due = anyio.current_time() + lease.period
                await self._renew(lease, link)
        finally:
            await link.aclose()

    async def cancel_check_loop(self) -> None:
        """Ask which running jobs have a cancel pending, every CANCEL_CHECK
        seconds while some run, and renew those now: the renewal's 410 ends
        each. Runs until cancelled, or until the server says it has no
        CancelledJobs (an older one: renewals alone tell, then)."""
        link = Link(self.server, "cancel checks")
        try:
            while True:
                await anyio.sleep(CANCEL_CHECK)
                running = {
                    lease.job_id: lease.lease_id
                    for lease in self.held.values() if not lease.ended
                }
                ids = sorted(running)
                try:
                    for start in range(0, len(ids), MAX_CANCEL_CHECK):
                        chunk = ids[start:start + MAX_CANCEL_CHECK]
                        for job_id in await link.client.cancelled_jobs(chunk):
                            if job_id in running:
                                self.renew_now(running[job_id])
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
            self.changed = anyio.Event()
            if not self.held:
                await self.changed.wait()
                continue
            lease = min(self.held.values(), key=lambda held: held.due)
            now = anyio.current_time()
            if lease.due <= now:
                return lease
            with anyio.move_on_after(lease.due - now):
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
                    min(lease.period, self.touch_interval),
                )
                self.failing = True
            if lease.period == math.inf:
                lease.due = anyio.current_time() + self.touch_interval
            await link.reconnect()
            return
        except JobCancelled:
            # CancelJob with running: true (protocol.md 14.26): the server
            # ended the job; its handler is told, and it is not reported.
            self.held.pop(lease.lease_id, None)
            renewal = self.renewals.get(lease.lease_id)
            if renewal is not None and not lease.ended:
                log.info("job %s %s: cancelled (410 Job cancelled); stopping its handler",
                         lease.job_id, lease.name)
                renewal.cancel()
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
                    "its report decides" if lease.ended else "the handler runs on",
                )
            return
        if self.failing:
            log.info("server %s reachable again; renewing leases", self.server.address)
            self.failing = False


class Renewal:
    """One job's way to ask for a renewal, from its handler's thread or
    task; `lease_id` is replaced when the job is handed out again."""

    def __init__(self, leases: Leases, lease_id: str | None) -> None:
        self.leases = leases
        self.lease_id = lease_id
        self.cancelled = threading.Event()  # the job's `cancelled`
        # The cancel scope of an async handler's call, cancelled with it.
        self.scope: anyio.CancelScope | None = None

    def cancel(self) -> None:
        """The server ended the job (410): tell its handler (event loop only)."""
        self.cancelled.set()
        if self.scope is not None:
            self.scope.cancel()

    def renew(self) -> None:
        if self.lease_id is None:
            return  # handed out without a token: nothing to renew
        if threading.get_ident() == self.leases.loop_thread:
            self.leases.renew_now(self.lease_id)
            return
        # RuntimeError: a thread left behind by its timeout, or the worker
        # has stopped; its job is over.
        with contextlib.suppress(RuntimeError):
            anyio.from_thread.run_sync(self.leases.renew_now, self.lease_id)
