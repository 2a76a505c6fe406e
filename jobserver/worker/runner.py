"""The Runner: one run of a Worker against a server, tying the parts
together on an anyio event loop (asyncio or trio).

Two tasks ask the server for jobs with waiting GetJobs, each for the slots
(--concurrency) free when it asks and the jobs to hold beyond them
(prefetch.py), and only when there is room for one (fetching.py); the
jobs they get wait in a queue for a slot. Each slot is a task that takes the next job,
calls its handler (calling.py) and queues the report (outcome.py), up to
--concurrency of them, made as jobs first need them: a task per slot, not
per job. One more task reports (reporting.py), another renews leases
(leases.py), each over a connection of its own. So waiting for jobs,
running handlers and reporting all happen at once, and nothing polls.

Stopping: the first SIGTERM or SIGINT (or `stop()`) takes no more jobs:
each waiting GetJobs is ended by shutting its connection's sending side
(the server answers 404, or with jobs it was already handing out, which
are handed back at once), never cut off with a reply on its way. Running
handlers get the grace period, and those still running then are handed
back at once (RetryJob, due now). A second signal
hands back every running job at once, and gives the reports a few seconds.

A job handed out again while it runs here (the server counted its run as
lost: --stale-after, or a lease that could not be renewed, ran out) is
not run a second time: the run under way goes on, and takes over the new
hand-out's lease, so that its report is the one the server waits for
(`_adopt`). A reply that means nothing, or is larger than
--max-reply-bytes, is a broken connection: the fetcher that got it
reconnects after its backoff wait, and the running jobs go on
(fetching.py).

Exit status: 0 after a clean stop; 1 after a forced stop (second signal) or
when results could not be reported; 2 when the server refuses our GetJobs,
or TLS cannot be set up with it (trying again would not help)."""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal

import anyio
import trio
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from jobserver.wire.counts import counted
from jobserver.worker import outcome
from jobserver.worker.calling import Caller
from jobserver.worker.connection import JobClient, Server
from jobserver.worker.fetching import Fetchers
from jobserver.worker.job import Job
from jobserver.worker.leases import Leases, Renewal
from jobserver.worker.outcome import Outcome
from jobserver.worker.prefetch import PREFETCH_HORIZON, Prefetch
from jobserver.worker.processes import take_parent_pid
from jobserver.worker.registry import Worker
from jobserver.worker.reporting import Reporter
from jobserver.worker.settings import Settings
from jobserver.worker.tally import Tally
from jobserver.workers.contract import printable
from jobserver.workers.manager import REPORT_DRAIN

log = logging.getLogger("jobserver.worker")

Loop = Literal["asyncio", "trio"]
# After a second signal, what is left of the run (handing back the running
# jobs, reporting) gets this long: "at once", but a report takes a moment.
FORCED_DRAIN = 3.0
# How often a worker of `--processes` looks for its parent: a second's
# delay to stop is nothing beside a lease's, and a getppid is cheap.
PARENT_CHECK = 1.0

# A job taken, waiting for a slot: its job object and its lease.
Taken = tuple[dict[str, Any], "Renewal"]


@dataclass
class Running:
    """A job whose task runs: its name for the log, and its lease, whose
    token is replaced if the job is handed out again meanwhile."""

    name: str
    lease: Renewal


def run(worker: Worker, settings: Settings, loop: Loop = "asyncio") -> int:
    """Run `worker` until stopped, blocking; the exit status."""
    return anyio.run(serve, worker, settings, backend=loop)


async def serve(worker: Worker, settings: Settings) -> int:
    """Run `worker` on the running event loop until stopped; the exit status."""
    return await Runner(worker, settings).serve()


class Runner:
    """One run of a worker: its settings, and the state of the run. Made
    on the event loop it runs on."""

    def __init__(self, worker: Worker, settings: Settings) -> None:
        self.worker = worker
        self.settings = settings
        self.jobs_name = settings.jobs or worker.get_jobs_name()
        self.server = Server(
            settings.addresses, settings.token, settings.tls, settings.max_reply_bytes
        )

        self.running: dict[int, Running] = {}  # by job ID, from taken until its handler ends
        self.prefetch = Prefetch(settings.prefetch, settings.concurrency)
        self.slots = 0  # slot tasks made
        self.to_slots: MemoryObjectSendStream[Taken]
        self.queued: MemoryObjectReceiveStream[Taken]
        self.to_slots, self.queued = anyio.create_memory_object_stream[Taken](math.inf)
        self.tally = Tally()
        self.fetchers = Fetchers(
            self.server, self.jobs_name, settings, self.prefetch, self.running, self._refused
        )
        self.stopping = False
        self.signalled = False
        self.forced = False
        self.exit_status = 0
        self.root_scope: anyio.CancelScope | None = None

        self.caller = Caller(settings.timeout, settings.concurrency)
        # A job's handler is looked up for its lease only if one has a lease.
        leased = any(h.lease for h in worker.handlers)
        self.leases = Leases(
            self.server, settings.touch_interval, settings.lease,
            worker.lease_for if leased else lambda name: None,
        )
        self.reporter = Reporter(self.server, self.leases)

    # Top level.

    async def serve(self) -> int:
        """Run until stopped; the exit status (module docstring)."""
        async with anyio.create_task_group() as root:
            self.root_scope = root.cancel_scope
            if self.settings.signals:
                await root.start(self.watch_signals)
            self._log_start()
            reporter_done = anyio.Event()
            root.start_soon(self.reporter.deliver_loop, reporter_done)
            root.start_soon(self.leases.renew_loop)
            root.start_soon(self.leases.cancel_check_loop)
            root.start_soon(self.tally.summary_loop)
            root.start_soon(self.give_back_loop)
            parent = take_parent_pid()
            if parent is not None:
                root.start_soon(self.watch_parent, parent)
            async with anyio.create_task_group() as jobs:
                with self.to_slots:
                    await self.fetchers.fetch_loop(partial(self._take, jobs=jobs))
            self.tally.summarize()
            self.reporter.close()
            if self.stopping or self.exit_status:
                self.reporter.give_up_in(FORCED_DRAIN if self.forced else REPORT_DRAIN)
            await reporter_done.wait()
            root.cancel_scope.cancel()  # the signal watcher, the lease renewer, the summary
        return self._stopped()

    def _log_start(self) -> None:
        s = self.settings
        log.info(
            "worker started: server %s%s, jobs %r, %s, at most %d at once, on %s; "
            "up to %d more held while handlers are fast",
            self.server.address,
            " (TLS)" if s.tls else "",
            self.jobs_name,
            counted(len(self.worker.handlers), "handler"),
            s.concurrency,
            _event_loop(),
            s.prefetch,
        )
        if not s.lease and any(h.lease for h in self.worker.handlers):
            log.warning("--lease 0: jobs are taken without a lease, so the handlers' leases "
                        "do not apply")

    def _stopped(self) -> int:
        """Log what the stop left undone; the exit status."""
        for job_id, running in self.running.items():
            log.error("job %s %s abandoned: still RUNNING on the server", job_id, running.name)
        self.reporter.log_unreported()
        if self.caller.abandoned:
            log.warning(
                "%s still running when their jobs were reported",
                counted(self.caller.abandoned, "handler thread was", "handler threads were"),
            )
        if self.running or self.reporter.unsent or self.reporter.given_up:
            log.error("worker stopped; results were lost (logged above)")
            return 1
        log.info("worker stopped")
        return 1 if self.forced else self.exit_status

    async def watch_signals(self, *, task_status: TaskStatus[None]) -> None:
        """The first SIGTERM or SIGINT stops the worker cleanly; a second
        one hands back the running jobs at once."""
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if not self.signalled:
                    self.signalled = True
                    log.info(
                        "received %s: taking no more jobs; %s %gs to finish",
                        name,
                        counted(len(self.running), "running job gets", "running jobs get"),
                        self.settings.grace,
                    )
                    self.stop(self.settings.grace)
                else:
                    log.warning(
                        "received %s again: handing back %s and exiting now",
                        name,
                        counted(len(self.running), "running job"),
                    )
                    self.force()
                    return

    async def watch_parent(self, parent: int) -> None:
        """One of `--processes` workers (processes.py): stop, as on SIGTERM,
        once the parent that started this process is gone (killed with
        SIGKILL, it forwards no signal), rather than run on unwatched."""
        while True:  # no event says so: a parent's end is seen by asking
            await anyio.sleep(PARENT_CHECK)
            if os.getppid() != parent:
                break
        log.warning("the parent process (pid %d) is gone: stopping", parent)
        self.stop()

    def stop(self, grace: float | None = None) -> None:
        """Take no more jobs; running handlers get `grace` more seconds
        (default: the settings'), then their jobs are handed back. From
        the event loop's thread."""
        self.stopping = True
        self.fetchers.stop()
        self.caller.stop(self.settings.grace if grace is None else grace)

    def _refused(self) -> None:
        """The server refused our GetJobs, or TLS with it: trying again
        would not help (exit status 2)."""
        self.exit_status = 2
        self.stop()

    def force(self) -> None:
        """Hand back every running job now; the rest of the run gets
        FORCED_DRAIN seconds."""
        self.forced = True
        self.stop(0)
        self.reporter.give_up_in(FORCED_DRAIN)
        if self.root_scope is not None:
            self.root_scope.deadline = anyio.current_time() + FORCED_DRAIN + 1

    # Taking and holding jobs.

    def _take(self, raw: dict[str, Any], jobs: TaskGroup) -> bool:
        """Start the job's task in `jobs`, unless it runs here already;
        whether it was started."""
        running = self.running.get(raw["jobID"])
        if running is not None:
            self._adopt(running, raw)
            return False
        # Held here, not in its task: a second hand-out of the job may come
        # before the task starts (in the same reply, even), and takes over
        # this lease.
        lease = self.leases.renewal(self.leases.hold(raw))
        self.running[raw["jobID"]] = Running(printable(raw["name"]), lease)
        self.to_slots.send_nowait((raw, lease))
        # Queued rather than handed to a slot waiting for one: a new slot,
        # if there is room for one.
        if self.queued.statistics().current_buffer_used and self.slots < self.settings.concurrency:
            self.slots += 1
            jobs.start_soon(self.slot)
        return True

    def _adopt(self, running: Running, raw: dict[str, Any]) -> None:
        """The job runs here, and the server handed it out again: it took
        the run for lost (--stale-after, or a lease not renewed in time, ran
        out; a failed attempt) and gave the job a new lease token. Starting
        it again would run it twice at once here, and handing it back
        (RetryJob) would queue it for a third run while this one goes on.
        The run under way is the job's: it takes the new token, which its
        report will carry, so that the server takes that report as the new
        hand-out's (the old token would get 409 Lease expired)."""
        old = running.lease.lease_id
        running.lease.lease_id = self.leases.adopt(old, raw)
        log.warning(
            "job %s %s was handed out again while it runs here (the server took the run "
            "for lost): not run twice; the run under way reports it, under the new lease %s",
            raw["jobID"],
            running.name,
            running.lease.lease_id,
        )

    async def give_back_loop(self) -> None:
        """Hand back the held jobs beyond what may be held now: those behind
        slots stuck in long calls (prefetch.py), for other workers to run."""
        while True:
            await anyio.sleep(PREFETCH_HORIZON)
            # A slot without a call takes a held job at once: not beyond the slots.
            idle = self.settings.concurrency - len(self.prefetch.began)
            held = self.queued.statistics().current_buffer_used
            for _ in range(held - idle - self.prefetch.allowed(anyio.current_time())):
                try:
                    raw, lease = self.queued.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
                job = Job.handed_out(raw, lease)
                result = outcome.handed_back(job, "handed back (held behind long handler calls)")
                if lease.lease_id is not None:
                    self.leases.ended(lease.lease_id)  # renewed until reported
                del self.running[job.id]
                self.tally.ended(job.id, printable(job.name), result, 0.0)
                self.reporter.add(result.report)
            self.fetchers.slots_changed()

    # Running jobs.

    async def slot(self) -> None:
        """One slot: run the queued jobs one after the other, until the
        fetchers are done and the queue is empty."""
        async for raw, lease in self.queued:
            await self.run_job(raw, lease)

    async def run_job(self, raw: dict[str, Any], lease: Renewal) -> None:
        """Call the job's handler, log how it ended, and queue its report."""
        started, wall = anyio.current_time(), time.perf_counter()
        self.prefetch.begin(raw["jobID"], started)
        result: Outcome | None = None
        try:
            result = await self._run(raw, lease, started)
        finally:
            # A job whose task was cancelled (a forced stop that ran out of
            # time) stays in `running`, for _stopped to name as abandoned.
            if result is not None:
                del self.running[raw["jobID"]]
            self.fetchers.slots_changed()
        seconds = time.perf_counter() - wall
        self.prefetch.ended(raw["jobID"], seconds)
        self.tally.ended(raw["jobID"], printable(raw["name"]), result, seconds)
        if result.reported:
            self.reporter.add(result.report)
        elif lease.lease_id is not None:
            self.leases.release(lease.lease_id)  # cancelled: no report will come

    async def _run(self, raw: dict[str, Any], lease: Renewal, started: float) -> Outcome:
        job = Job.handed_out(raw, lease)
        try:
            ended = await self._call(job, started, lease)
        except BaseException:
            # No report will come: the lease is let go now.
            if lease.lease_id is not None:
                self.leases.release(lease.lease_id)
            raise
        if lease.lease_id is not None:
            # Renewed until the reporter is done with the job's report.
            self.leases.ended(lease.lease_id)
        return ended

    async def _call(self, job: Job, started: float, lease: Renewal) -> Outcome:
        handler = self.worker.handler_for(job.name)
        if handler is None:
            return outcome.no_handler(job)
        if self.stopping:
            return outcome.handed_back(job, "handed back (stopping)")
        if handler.policy and job.max_attempts is None:
            job = replace(job, handler_policy=handler.policy)
        clients = JobClient(self.server, handler.is_async)
        try:
            return await self.caller.call(handler, replace(job, clients=clients), started, lease)
        finally:
            await clients.aclose()


def _event_loop() -> str:
    """Which event loop runs this task, for the log: anyio runs on asyncio
    or trio, and only trio knows its token."""
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return "asyncio"
    return "trio"
