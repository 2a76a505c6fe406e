"""`jobserver worker --processes N`: N worker processes under one command,
for handlers that need more than one core (one event loop and the GIL
hold a process to one).

This process runs no handler. It starts N `jobserver worker` processes
with the same options and `--processes 1`, each with connections of its
own, in sessions of their own (so a terminal's Ctrl-C reaches only this
process), and:

- forwards SIGTERM and SIGINT to each: the first stops them cleanly (no
  more jobs, running ones get --grace), a second hands their running jobs
  back at once, as for one worker;
- restarts a process that exits while no stop was asked for (a crash, an
  OOM kill), after RESTART_DELAY, doubling up to RESTART_DELAY_MAX while
  it keeps exiting within a minute of its start; one that exits with
  status 2 (options, module or server that cannot work: starting it again
  would not help) stops all, and the command exits 2;
- exits once all have exited after a stop: 2 if one could not work,
  else 0 if each exited 0 (or was ended by the SIGTERM passed on, before
  its worker had started or after it had stopped), else the highest status
  (1 after a forced stop or lost results).

If this process is killed with SIGKILL, each worker notices within a
second that its parent is gone (PARENT_ENV, runner.watch_parent) and
stops as on SIGTERM: no worker runs on unwatched."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Sequence

import anyio
from anyio.abc import Process, TaskStatus

log = logging.getLogger("jobserver.worker")

# The parent's pid, in each worker process's environment: a worker whose
# parent has gone (killed with SIGKILL) stops (runner.watch_parent).
PARENT_ENV = "JOBSERVER_WORKER_PARENT"
RESTART_DELAY = 1.0
RESTART_DELAY_MAX = 30.0
# A process that ran this long before it exited is restarted after
# RESTART_DELAY again.
STEADY = 60.0
# Exit status of a worker that cannot work: not restarted.
CANNOT_WORK = 2


def run(command: Sequence[str], count: int) -> int:
    """Run `count` processes of `command` until stopped; the exit status."""
    return anyio.run(Processes(command, count).serve)


class Processes:
    """The worker processes, and the state of the stop."""

    def __init__(self, command: Sequence[str], count: int) -> None:
        self.command = list(command)
        self.count = count
        self.running: dict[int, Process] = {}  # by their number, 1 to count
        self.stopping = False
        self.stopped = anyio.Event()  # set at the first stop: restarts end
        self.statuses: list[int] = []  # of the processes that exited after the stop
        self.cannot_work = False  # one exited with CANNOT_WORK

    async def serve(self) -> int:
        async with anyio.create_task_group() as signals:
            await signals.start(self.watch_signals)
            async with anyio.create_task_group() as workers:
                for number in range(1, self.count + 1):
                    workers.start_soon(self.keep, number)
            signals.cancel_scope.cancel()
        status = CANNOT_WORK if self.cannot_work else max(self.statuses, default=0)
        log.info("%d worker processes stopped, exit status %d", self.count, status)
        return status

    async def watch_signals(self, *, task_status: TaskStatus[None]) -> None:
        """Forward SIGTERM and SIGINT to every worker process."""
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                log.info(
                    "received %s: passing SIGTERM on to %d worker processes",
                    signal.Signals(signum).name,
                    len(self.running),
                )
                self.stop()

    def stop(self) -> None:
        """Stop every worker process (SIGTERM), and restart none; a second
        call is a second signal to each."""
        self.stopping = True
        self.stopped.set()
        for process in self.running.values():
            # One that has just exited (two that cannot work end together)
            # is still listed until its own task sees it end: nothing to stop.
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)

    async def keep(self, number: int) -> None:
        """Keep worker process `number` running until the stop."""
        delay = RESTART_DELAY
        while not self.stopping:
            started = anyio.current_time()
            status = await self._run_one(number)
            if self.stopping:
                # Ended by the SIGTERM passed on, it had no signal handler
                # yet (still starting: no job taken) or no more (stopped).
                self.statuses.append(0 if status == 128 + signal.SIGTERM else status)
                return
            if status == CANNOT_WORK:
                log.error(
                    "worker process %d of %d exited with status 2 (it cannot work): "
                    "stopping the others",
                    number,
                    self.count,
                )
                self.cannot_work = True
                self.stop()
                return
            if anyio.current_time() - started >= STEADY:
                delay = RESTART_DELAY
            log.warning(
                "worker process %d of %d exited with status %d without being stopped; "
                "starting it again in %gs",
                number,
                self.count,
                status,
                delay,
            )
            with anyio.move_on_after(delay):
                await self.stopped.wait()
            delay = min(delay * 2, RESTART_DELAY_MAX)

    async def _run_one(self, number: int) -> int:
        """Start worker process `number` and wait for its end; its exit
        status (128 + N for a signal N, as a shell says it)."""
        process = await anyio.open_process(
            self.command,
            stdin=None,
            stdout=None,
            stderr=None,
            start_new_session=True,
            env={**os.environ, PARENT_ENV: str(os.getpid())},
        )
        self.running[number] = process
        log.info("worker process %d of %d started: pid %d", number, self.count, process.pid)
        if self.stopping:  # the stop came while it was being started
            process.send_signal(signal.SIGTERM)
        try:
            status = await process.wait()
        finally:
            del self.running[number]
        return status if status >= 0 else 128 - status


def take_parent_pid() -> int | None:
    """The pid of the `--processes` parent this worker process was started
    by, if any; taken out of the environment, so that a process a handler
    starts (another worker, say) does not take it for its own."""
    value = os.environ.pop(PARENT_ENV, "")
    return int(value) if value.isdigit() else None
