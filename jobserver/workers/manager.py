"""The Manager: takes jobs from the server and runs each one as a worker
process, tying the parts together.

One trio task asks the server for work with a blocking GetJobs, but only
when there is a free worker slot and the load average allows it; each job
it gets runs in a task of its own (supervision.py, its meaning contract.py);
one more task reports results in order (reporting.py), and another renews
the leases of running jobs (leases.py), each over a connection of its own.
So waiting for jobs, waiting for workers and reporting all happen at once,
and nothing polls. A job handed out again while its worker runs is not
run twice: the worker under way takes over the new hand-out's lease
(`_adopt`). A reply that means nothing, or is larger than
--max-reply-bytes, is a broken connection: GetJobs is asked again after
the backoff wait, and the running workers go on. The guard (guard.py), a
process of its own, is told of every job taken and every worker started,
and stops the workers and hands the jobs back if the manager dies.

Exit status: 0 after a clean stop (signal or --max-iterations); 1 after a
forced stop (second signal) or when results could not be reported before
giving up; 2 when the server refuses our GetJobs, or when TLS cannot be set
up with it (TLSFailed: trying again would not help), or when the guard
cannot be started. arguments.py adds 2 for bad options.
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
from typing import Any

import trio

from jobserver.client import ConnectionFailed, JobServerError, ServerError, TLSFailed
from jobserver.client.endpoint import TLS
from jobserver.client.servers import Address
from jobserver.wire.counts import counted
from jobserver.wire.limits import DEFAULT_CLIENT_MAX_REPLY_BYTES
from jobserver.workers.connection import BACKOFF_MAX, Backoff, Link, Server
from jobserver.workers.contract import (
    Outcome,
    Refused,
    cannot_start,
    failed,
    find_worker,
    outcome,
    printable,
    put_back,
    worker_environment,
    worker_input,
)
from jobserver.workers.guard import Guard
from jobserver.workers.leases import DEFAULT_LEASE, Leases, check_lease
from jobserver.workers.policy import Policies
from jobserver.workers.reporting import Reporter
from jobserver.workers.supervision import Supervisor, spawn

log = logging.getLogger("jobserver.workers")

# A blocking GetJobs is sent again after this long without a job: well under
# the server's one-hour cap, and a silently dead connection is noticed within
# a minute.
FETCH_WAIT = 60.0
# The 1-minute load average changes slowly; looking once a second while it is
# too high costs nothing and starts work soon after it drops.
LOAD_RECHECK = 1.0
# While --max-load holds jobs back the log says so, but no more often than
# this: a busy host can stay busy for hours.
LOAD_NOTICE_INTERVAL = 60.0
# After a signalled stop, results still unreported once the workers are done
# get this long for the server to come back before the manager gives up.
REPORT_DRAIN = 10.0
# At its exit the manager waits this long for its guard to hand back what is
# left (jobs of killed workers, unreported results); the guard goes on alone
# after that, while the server does not answer.
GUARD_WAIT = 2.0


class Every:
    """Lets something happen at most once per `interval` seconds."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.last: float | None = None

    def ready(self, now: float) -> bool:
        """Whether it may happen at `now`; if so, counts it as happened."""
        if self.last is not None and now - self.last < self.interval:
            return False
        self.last = now
        return True


def lease_of(job: dict[str, Any]) -> str | None:
    """The job's lease token, if it came with one (a server's reply may
    hold anything there)."""
    lease_id = job.get("leaseID")
    return lease_id if isinstance(lease_id, str) else None


class GetJobsRefused(Exception):
    """The server refused GetJobs in a way that trying again cannot mend."""


class Manager:
    """One worker manager: its options, and the state of a run (serve())."""

    def __init__(
        self,
        *,
        servers: tuple[Address, ...],
        directory: str,
        pattern: str,
        max_load: float | None,
        max_workers: int,
        worker_timeout: float,
        max_iterations: int | None,
        grace: float,
        touch_interval: float = 30.0,
        lease: int = DEFAULT_LEASE,
        policies: Policies | None = None,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
        tls_setting: TLS = None,
        max_reply_bytes: int = DEFAULT_CLIENT_MAX_REPLY_BYTES,
    ) -> None:
        """`servers`: the server's address, or those of the nodes of one
        queue. `tls` is the context made from `tls_setting` (--tls,
        --tls-ca), which the guard is given to make its own."""
        self.server = Server(servers, token, tls, max_reply_bytes)
        self.guard = Guard(self.server.address, token, tls_setting)
        self.directory = directory
        self.pattern = pattern
        self.max_load = max_load
        self.load_notice = Every(LOAD_NOTICE_INTERVAL)
        self.max_workers = max_workers
        self.worker_timeout = worker_timeout
        self.max_iterations = max_iterations
        self.grace = grace
        self.policies = policies or Policies()

        self.running = 0  # worker tasks started and not yet ended
        self.jobs: dict[int, dict[str, Any]] = {}  # their jobs, by job ID
        self.changed = trio.Event()  # set (and replaced) whenever a worker ends
        self.stopping = False
        self.signalled = False
        self.forced = False
        self.exit_status = 0
        self.fetch_scope = trio.CancelScope()

        self.supervisor = Supervisor(worker_timeout)
        check_lease(lease)
        self.leases = Leases(self.server, touch_interval, lease, self.policies.lease_for)
        self.leases.on_cancel = self.supervisor.cancel
        self.reporter = Reporter(self.server, self.guard, self.leases)

    # Top level.

    async def serve(self) -> int:
        """Run until stopped; the exit status (module docstring)."""
        try:
            self.guard.start()
        except OSError as error:
            log.error("cannot start the worker guard: %s", error)
            return 2
        try:
            async with trio.open_nursery() as root:
                await root.start(self.watch_signals, root.cancel_scope)
                self._log_start()
                reporter_done = trio.Event()
                root.start_soon(self.reporter.deliver_loop, reporter_done)
                root.start_soon(self.leases.renew_loop)
                root.start_soon(self.leases.cancel_check_loop)
                async with trio.open_nursery() as workers:
                    await self.fetch_loop(workers)
                self.reporter.close()
                if self.signalled or self.exit_status:
                    self.reporter.give_up_in(REPORT_DRAIN)
                await reporter_done.wait()
                root.cancel_scope.cancel()  # the signal watcher and the lease renewer
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.guard.close, GUARD_WAIT)
        return self._stopped()

    def _log_start(self) -> None:
        log.info(
            "worker manager started: server %s%s, jobs %r, workers from %s, "
            "at most %d at once, %s",
            self.server.address,
            " (TLS)" if self.server.tls else "",
            self.pattern,
            self.directory,
            self.max_workers,
            "no load limit" if self.max_load is None else f"load below {self.max_load:g}",
        )

    def _stopped(self) -> int:
        """Log what the stop left undone; the exit status."""
        if self.forced:
            for job_id, name in self.supervisor.live.values():
                log.error(
                    "job %s %s abandoned: worker killed; the guard hands the job back",
                    job_id,
                    name,
                )
        self.reporter.log_unreported()
        if self.forced or self.reporter.pending or self.reporter.given_up:
            log.error("worker manager stopped; results were lost (logged above)")
            return 1
        log.info("worker manager stopped")
        return self.exit_status

    async def watch_signals(
        self, root: trio.CancelScope, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The first SIGTERM or SIGINT stops the manager cleanly; a second
        one ends it at once (cancelling `root`)."""
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if not self.signalled:
                    self.signalled = True
                    log.info(
                        "received %s: taking no more jobs; %s %gs to finish",
                        name,
                        counted(self.running, "running worker gets", "running workers get"),
                        self.grace,
                    )
                    self.stop(grace=self.grace)
                    if self.reporter.closed:
                        self.reporter.give_up_in(REPORT_DRAIN)
                else:
                    log.warning("received %s again: killing all workers and exiting now", name)
                    self.forced = True
                    root.cancel()
                    return

    def stop(self, grace: float) -> None:
        """Take no more jobs; running workers get `grace` more seconds."""
        self.stopping = True
        self.fetch_scope.cancel()
        self.supervisor.stop(grace)

    # Fetching.

    async def fetch_loop(self, workers: trio.Nursery) -> None:
        """Take jobs and start their workers in `workers` until stopped,
        refused, or --max-iterations rounds are done."""
        rounds = 0
        link, backoff = Link(self.server, "taking jobs"), Backoff()
        try:
            with self.fetch_scope:
                while self.max_iterations is None or rounds < self.max_iterations:
                    jobs = await self._get_jobs(link, backoff, await self.free_slots())
                    if jobs is None:
                        continue  # no answer; asked again after a backoff wait
                    rounds += 1
                    for job in jobs:
                        self._take(job, workers)
            if self.max_iterations is not None and rounds >= self.max_iterations:
                log.info(
                    "%s done; waiting for %s",
                    counted(rounds, "GetJobs round"),
                    counted(self.running, "running worker"),
                )
        except GetJobsRefused:
            self.exit_status = 2
        finally:
            # A cancelled GetJobs leaves the connection mid-request; closing it
            # tells the server, which puts back any job it took for us.
            await link.aclose()

    def _take(self, job: dict[str, Any], workers: trio.Nursery) -> None:
        """Start the job's worker in `workers`, unless it runs already."""
        running = self.jobs.get(job["jobID"])
        if running is not None:
            self._adopt(running, job)
            return
        self.guard.job(job["jobID"], job.get("leaseID"))
        self.running += 1
        self.jobs[job["jobID"]] = job
        workers.start_soon(self.run_job, job)

    def _adopt(self, running: dict[str, Any], job: dict[str, Any]) -> None:
        """`running`'s worker runs, and the server handed its job out again
        (as `job`): it took the run for lost (--stale-after, or a lease not
        renewed in time, ran out; a failed attempt) and gave the job a new
        lease token. A second worker would run the job twice at once, and
        handing it back (RetryJob) would queue a third run while this one
        goes on. The worker under way is the job's: its report carries the
        new token (run_job reads it from `running`), which the server takes
        as the new hand-out's; the old one would get 409 Lease expired."""
        self.leases.adopt(lease_of(running), job)
        running["leaseID"] = job.get("leaseID")
        self.guard.job(job["jobID"], job.get("leaseID"))  # hands back under the new one
        log.warning(
            "job %s %s was handed out again while its worker runs (the server took the run "
            "for lost): not run twice; the worker under way reports it, under the new lease %s",
            job["jobID"],
            printable(running["name"]),
            running["leaseID"],
        )

    async def _get_jobs(
        self, link: Link, backoff: Backoff, free: int
    ) -> list[dict[str, Any]] | None:
        """One GetJobs for up to `free` jobs; None if the server could not
        be reached (after the next backoff wait)."""
        try:
            if backoff.failing:
                # A blocking GetJobs may not answer for a minute: make sure
                # the server is back, and say so, first.
                await link.client.ping()
                log.info("server %s reachable again; taking jobs", self.server.address)
                backoff.reset()
            return await link.client.get_jobs(
                self.pattern, min(free, 1000), wait=FETCH_WAIT, lease=self.leases.lease or None
            )
        except TLSFailed as error:
            # Trying again cannot help: the options must change.
            log.error("cannot get jobs: %s", error)
            raise GetJobsRefused from error
        except (ConnectionFailed, ServerError) as error:
            if not backoff.failing:
                log.warning(
                    "cannot get jobs (%s); running workers carry on, "
                    "retrying with backoff up to %gs",
                    error,
                    BACKOFF_MAX,
                )
            await link.reconnect()
            await trio.sleep(backoff.next())
            return None
        except JobServerError as error:
            log.error(
                "the server refused GetJobs for %r: %s %s", self.pattern, error.code, error.reason
            )
            raise GetJobsRefused from error

    async def free_slots(self) -> int:
        """Wait until a worker may start; the number of free slots."""
        while True:
            if self.running >= self.max_workers:
                await self.changed.wait()
                continue
            if self.max_load is not None and (load := self._load()) >= self.max_load:
                if self.load_notice.ready(trio.current_time()):
                    log.info(
                        "load average %.2f is at or above --max-load %g: taking no jobs "
                        "until it drops",
                        load,
                        self.max_load,
                    )
                with trio.move_on_after(LOAD_RECHECK):
                    await self.changed.wait()
                continue
            return self.max_workers - self.running

    @staticmethod
    def _load() -> float:
        try:
            return os.getloadavg()[0]
        except OSError:
            return 0.0  # no load average on this system: no limit

    # Running one job.

    async def run_job(self, job: dict[str, Any]) -> None:
        """Run the job's worker, log how it ended, and queue its report."""
        started = trio.current_time()
        job_id, name = job["jobID"], printable(job["name"])
        try:
            result = await self._run(job, started)
        finally:
            self.running -= 1
            del self.jobs[job_id]
            self.changed.set()
            self.changed = trio.Event()
        duration = trio.current_time() - started
        result = self.policies.reported(job, result)
        log.info("job %s %s %s in %.3fs", job_id, name, printable(result.text), duration)
        # The newest hand-out's, should the job have been handed out again.
        result.report.lease_id = job.get("leaseID")
        if result.reported:
            self.reporter.add(result.report)
        else:
            # Cancelled: the server ended the job, and takes no report.
            self.guard.done(job_id)
            self.leases.release(result.report.lease_id)

    async def _run(self, job: dict[str, Any], started: float) -> Outcome:
        if self.stopping:
            return put_back(job, "returned to the queue (stopping)")
        try:
            path = find_worker(self.directory, job["name"])
        except Refused as refusal:
            return failed(job, str(refusal), str(refusal))
        self.leases.hold(job)
        try:
            ended = await self._run_worker(job, path, started)
        except BaseException:
            # No report will come: the lease is let go now.
            self.leases.release(lease_of(job))
            raise
        # Renewed until the reporter is done with the job's report. The
        # newest hand-out's lease (`_adopt`), as the report's.
        self.leases.ended(lease_of(job))
        return ended

    async def _run_worker(self, job: dict[str, Any], path: str, started: float) -> Outcome:
        try:
            proc = await spawn(path, worker_environment(job, self.server.address))
        except OSError as error:
            return cannot_start(job, path, error)
        self.guard.group(proc.pid)
        label = (job["jobID"], printable(job["name"]))
        timeout = self.policies.timeout(job["name"], self.worker_timeout)
        try:
            ended = await self.supervisor.supervise(
                proc, worker_input(job), label, started, timeout
            )
        finally:
            self.guard.reaped(proc.pid)  # supervise() reaps it, even when cancelled
        return outcome(job, ended, timeout)
