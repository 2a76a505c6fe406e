"""Running one worker process: starting it in a process group of its own,
feeding its stdin, capturing its output within bounds, and stopping the
whole group at its deadline (--worker-timeout, or the end of the grace
period after a signal).

What the exit status and the output mean is contract.py's business; this
module only reports how the process ended (`Ended`)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
from dataclasses import dataclass
from typing import Literal

import trio

# A worker told to stop (SIGTERM) gets this long to clean up before SIGKILL.
KILL_AFTER = 5.0
# After a worker exits, how long its output pipes may stay open: a background
# grandchild can hold them forever, and its output is not the job's.
OUTPUT_DRAIN = 2.0
# stdout can become job data, and the server refuses data over 1 MiB anyway.
STDOUT_LIMIT = 1024 * 1024
# stderr is kept only for the error report; its end says what went wrong.
STDERR_LIMIT = 64 * 1024

# Why the manager stopped a worker that had not exited by itself.
Stopped = Literal["timeout", "shutdown", "cancelled"]


class Head:
    """The first `limit` bytes of a stream; the rest is counted and dropped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes | bytearray) -> None:
        room = self.limit - len(self.data)
        self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - room)


class Tail:
    """The last `limit` bytes of a stream."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()

    def add(self, chunk: bytes | bytearray) -> None:
        self.data += chunk
        if len(self.data) > 2 * self.limit:  # trim in batches, not per chunk
            del self.data[: -self.limit]

    def content(self) -> bytes:
        return bytes(self.data[-self.limit :])


@dataclass
class Ended:
    """How a worker process ended."""

    returncode: int  # as subprocess has it: negative for a signal
    stopped: Stopped | None  # None if it exited by itself
    stdout: Head
    stderr: Tail


async def spawn(path: str, env: dict[str, str]) -> trio.Process:
    """Start the worker at `path`; OSError if it cannot be started."""
    return await trio.lowlevel.open_process(
        [path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,  # its own process group, which we can kill whole
    )


class Supervisor:
    """Watches the running workers: each gets until --worker-timeout, and
    all of them until the grace deadline once the manager stops."""

    def __init__(self, worker_timeout: float) -> None:
        self.worker_timeout = worker_timeout
        self.grace_deadline = math.inf
        self.scopes: set[trio.CancelScope] = set()  # one per worker, waiting for its exit
        # pid -> (job ID, printable name): whom a forced exit abandons.
        self.live: dict[int, tuple[int, str]] = {}
        # Jobs the server cancelled while they ran (410, protocol.md 14.26),
        # and the scope each one's worker is waited for in.
        self.cancelled: set[int] = set()
        self.waits: dict[int, trio.CancelScope] = {}

    def cancel(self, job_id: int) -> None:
        """The server cancelled the job: stop its worker as at its timeout."""
        self.cancelled.add(job_id)
        scope = self.waits.get(job_id)
        if scope is not None:
            scope.cancel()

    def stop(self, grace: float) -> None:
        """Running workers get `grace` more seconds (or less, if they had less)."""
        self.grace_deadline = min(self.grace_deadline, trio.current_time() + grace)
        for scope in self.scopes:
            scope.deadline = min(scope.deadline, self.grace_deadline)

    async def supervise(
        self,
        proc: trio.Process,
        stdin: bytes,
        job: tuple[int, str],
        started: float,
        timeout: float | None = None,  # noqa: ASYNC109 (the worker's deadline, not this call's)
    ) -> Ended:
        """Feed `stdin` to the worker `proc`, collect its output, and wait for
        it to exit or stop it at its deadline (`timeout` seconds from
        `started`, default --worker-timeout). If this is cancelled (a forced
        exit) the worker is killed, and stays in `live`."""
        self.live[proc.pid] = job
        stdout, stderr = Head(STDOUT_LIMIT), Tail(STDERR_LIMIT)
        try:
            to_worker, from_stdout, from_stderr = _pipes(proc)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_feed, to_worker, stdin)
                out_done, err_done = trio.Event(), trio.Event()
                nursery.start_soon(_collect, from_stdout, stdout, out_done)
                nursery.start_soon(_collect, from_stderr, stderr, err_done)
                deadline = started + (timeout or self.worker_timeout)
                stopped = await self._wait(proc, deadline, job[0])
                with trio.move_on_after(OUTPUT_DRAIN):
                    await out_done.wait()
                    await err_done.wait()
                nursery.cancel_scope.cancel()
        finally:
            returncode = await _reap(proc)
        del self.live[proc.pid]
        return Ended(returncode, stopped, stdout, stderr)

    async def _wait(self, proc: trio.Process, timeout_at: float, job_id: int) -> Stopped | None:
        """Wait for the worker to exit, or stop it at its deadline or its
        job's cancel; why it was stopped, if it was."""
        scope = trio.CancelScope(deadline=min(timeout_at, self.grace_deadline))
        if job_id in self.cancelled:
            scope.cancel()
        self.scopes.add(scope)
        self.waits[job_id] = scope
        try:
            with scope:
                await proc.wait()
        finally:
            self.scopes.discard(scope)
            del self.waits[job_id]
        if job_id in self.cancelled:
            self.cancelled.discard(job_id)
            if proc.returncode is None:
                await _terminate(proc)
            return "cancelled"
        if proc.returncode is not None:
            return None
        stopped: Stopped = "timeout" if trio.current_time() >= timeout_at else "shutdown"
        await _terminate(proc)
        return stopped


def _pipes(
    proc: trio.Process,
) -> tuple[trio.abc.SendStream, trio.abc.ReceiveStream, trio.abc.ReceiveStream]:
    """The worker's stdin, stdout and stderr, which spawn() opens as pipes."""
    if proc.stdin is None or proc.stdout is None or proc.stderr is None:
        raise RuntimeError("worker started without pipes")
    return proc.stdin, proc.stdout, proc.stderr


async def _feed(stream: trio.abc.SendStream, payload: bytes) -> None:
    try:
        await stream.send_all(payload)
        await stream.aclose()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the worker did not read all of its stdin: its business


async def _collect(stream: trio.abc.ReceiveStream, sink: Head | Tail, done: trio.Event) -> None:
    try:
        while chunk := await stream.receive_some(65536):
            sink.add(chunk)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        done.set()


async def _terminate(proc: trio.Process) -> None:
    """SIGTERM the worker's process group, SIGKILL it if the worker is still
    there after KILL_AFTER, and SIGKILL whatever is left of the group."""
    _signal_group(proc.pid, signal.SIGTERM)
    with trio.move_on_after(KILL_AFTER):
        await proc.wait()
    # Members left behind by the worker: while any lives, the group ID cannot
    # be reused, and the leader was reaped only just now.
    _signal_group(proc.pid, signal.SIGKILL)
    await proc.wait()


async def _reap(proc: trio.Process) -> int:
    """Close the worker's pipes and wait for its exit; its exit status. A
    worker still running here is being abandoned (a forced exit): its
    group is killed first."""
    if proc.returncode is None:
        _signal_group(proc.pid, signal.SIGKILL)
    with trio.CancelScope(shield=True):
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                await stream.aclose()
        returncode = await proc.wait()
    return returncode


def _signal_group(pid: int, signum: int) -> None:
    # ProcessLookupError or PermissionError: the group is gone already.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)
