"""Calling one handler: a plain function in a thread, an `async def` as a
task of the worker's event loop, each within its timeout and, once the
worker stops, within the grace period.

A thread cannot be killed. A plain function still running at its timeout
(or at the end of the grace period) is left to run on: its job is reported
at once, the worker stops waiting for it, and whatever it returns or raises
later is ignored. A task is cancelled instead (anyio's cancellation).

A job cancelled while it runs (410 Job cancelled, protocol.md 14.26) is
not reported, however its handler ends: a task is cancelled at once; a
thread is told through `job.cancelled` and waited for as long as its
timeout allows."""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import anyio
import anyio.to_thread

from jobserver.worker import outcome
from jobserver.worker.job import Job
from jobserver.worker.leases import Renewal
from jobserver.worker.outcome import Outcome
from jobserver.worker.registry import Handler
from jobserver.workers.contract import printable

log = logging.getLogger("jobserver.worker")


class Caller:
    """Calls handlers: each gets until its timeout, and all of them until
    the grace deadline once the worker stops."""

    def __init__(self, timeout: float, concurrency: int) -> None:
        self.timeout = timeout  # for handlers without their own
        # anyio's default is 40 threads; the worker's concurrency is the limit.
        self.threads = anyio.CapacityLimiter(concurrency)
        self.grace_deadline = math.inf
        self.scopes: set[anyio.CancelScope] = set()  # one per running handler
        self.abandoned = 0  # threads left running after their timeout or the grace

    def stop(self, grace: float) -> None:
        """Running handlers get `grace` more seconds (or less, if they had less)."""
        self.grace_deadline = min(self.grace_deadline, anyio.current_time() + grace)
        for scope in self.scopes:
            scope.deadline = min(scope.deadline, self.grace_deadline)

    async def call(self, handler: Handler, job: Job, started: float, lease: Renewal) -> Outcome:
        """Run `handler` on `job`, whose `lease` hears of a cancel; how it ended."""
        if lease.cancelled.is_set():
            return outcome.cancelled(job)
        timeout = handler.timeout or self.timeout
        timeout_at = started + timeout
        scope = anyio.CancelScope(deadline=min(timeout_at, self.grace_deadline))
        self.scopes.add(scope)
        if handler.is_async:
            lease.scope = scope
        try:
            with scope:
                result = await self._invoke(handler, job)
        except Exception as error:  # noqa: BLE001 - whatever a handler raises fails its job
            if lease.cancelled.is_set():
                return outcome.cancelled(job)
            return outcome.raised(job, error, handler.function)
        finally:
            self.scopes.discard(scope)
            lease.scope = None
        if lease.cancelled.is_set():
            return outcome.cancelled(job)
        if not scope.cancelled_caught:
            return outcome.finished(job, result)
        if not handler.is_async:
            self._abandon(handler, job)
        if anyio.current_time() >= timeout_at:
            return outcome.timed_out(job, timeout, thread=not handler.is_async)
        return outcome.handed_back(job, "still running at the end of the grace period, handed back")

    async def _invoke(self, handler: Handler, job: Job) -> Any:
        call = (
            functools.partial(handler.function, job.data, job=job)
            if handler.wants_job
            else functools.partial(handler.function, job.data)
        )
        if handler.is_async:
            return await call()
        return await anyio.to_thread.run_sync(call, abandon_on_cancel=True, limiter=self.threads)

    def _abandon(self, handler: Handler, job: Job) -> None:
        self.abandoned += 1
        log.warning(
            "job %s %s: the thread of its handler %s cannot be stopped; it runs on, "
            "its result ignored",
            job.id,
            printable(job.name),
            handler.label,
        )
