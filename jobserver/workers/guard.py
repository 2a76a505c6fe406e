"""The guard: a small process the worker manager starts beside itself, which
outlives it for one purpose. When the manager is gone, however it went
(kill -9, a crash, the OOM killer), the guard stops the manager's workers
and hands their jobs back to the server at once, instead of leaving the
workers running as orphans and the jobs RUNNING until a lease or the
server's --stale-after ends.

The manager tells the guard what it holds through a pipe that only it can
write to; the pipe's end (EOF) is how the guard learns that the manager is
gone, since the kernel closes it whatever ended the manager. One line each:

    job ID LEASE   the manager took job ID, handed out with lease LEASE
    done ID        its result is delivered (or dropped): nothing to hand back
    group PGID     a worker runs in process group PGID
    reaped PGID    that worker has exited and been reaped

At EOF the guard sends SIGTERM to every group still listed, SIGKILL after
KILL_AFTER seconds to those still there, then sends RetryJob (due now, its
repeat ignored) for every job still listed, each with its lease, so the
server refuses any that has moved on since (409, or 404/405 once
reported). It tries for HAND_BACK_FOR seconds while the server cannot be
reached, then gives up on what is left: those jobs wait for their lease or
--stale-after, as before. A manager that exits cleanly lists nothing by
then, and the guard exits at once.

Why a process and a pipe rather than PR_SET_PDEATHSIG in each worker: that
signal fires when the *thread* that forked the worker ends, and trio forks
in the threads of its cache, which end after a few idle seconds; it kills
the worker alone, not the processes it started in its group; and it is
Linux's only. The pipe works on every POSIX system and also covers the
jobs. See ARCHITECTURE.md ("The worker manager's guard").

The guard runs in a session of its own (a signal to the manager's process
group does not reach it) and ignores SIGINT, SIGTERM and SIGHUP: only the
pipe's end stops it. It connects to the server only at the end, with the
manager's addresses (all the nodes, if several), token
($JOBSERVER_AUTH_TOKEN in its environment, never its command line) and
TLS setting.

It runs as a script (`python -P .../guard.py`), so that starting it imports
the standard library only, not the worker manager (nor trio) that
`jobserver.workers` would bring: a guard spends its life waiting, and the
client is imported only if there are jobs to hand back.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from jobserver.wire.counts import counted

if TYPE_CHECKING:
    from jobserver.client import Client
    from jobserver.client.endpoint import TLS

log = logging.getLogger("jobserver.workers")

# A worker told to stop gets this long before SIGKILL, as after a timeout.
KILL_AFTER = 5.0
# How often the guard looks whether the stopped groups are gone.
POLL = 0.05
# How long the guard keeps trying to reach a server that does not answer.
HAND_BACK_FOR = 30.0
HAND_BACK_RETRY = 1.0
# The longest line the manager writes is `job ID LEASE`: far below this.
MAX_LINE = 512
# Where the guard finds the token, as every client does.
TOKEN_VARIABLE = "JOBSERVER_AUTH_TOKEN"


# The guard's side.


@dataclass
class Held:
    """What the manager holds, as the pipe has told it so far."""

    jobs: dict[int, str] = field(default_factory=dict)  # jobID -> leaseID
    groups: set[int] = field(default_factory=set)

    def apply(self, line: bytes) -> bool:
        """Take one line into account; False if it is not one the manager writes."""
        try:
            verb, first, *rest = line.decode("ascii").split()
        except (UnicodeDecodeError, ValueError):
            return False
        if not first.isdigit() or not 0 < int(first) < 2**63:
            return False
        number = int(first)
        if verb == "job" and len(rest) == 1:
            self.jobs[number] = rest[0]
        elif verb == "done" and not rest:
            self.jobs.pop(number, None)
        elif verb == "group" and not rest and number > 1:
            # Never group 1: init's, which killpg would reach for root.
            self.groups.add(number)
        elif verb == "reaped" and not rest:
            self.groups.discard(number)
        else:
            return False
        return True


def read_until_eof(pipe: IO[bytes], held: Held) -> None:
    """Follow the manager's lines until its end of the pipe is closed."""
    while line := pipe.readline(MAX_LINE):
        if not held.apply(line):
            log.warning("worker guard: ignoring a line it cannot read: %r", line[:80])


def stop_groups(groups: Iterable[int]) -> None:
    """SIGTERM the groups, then SIGKILL any still there after KILL_AFTER."""
    left = {group for group in groups if _signal_group(group, signal.SIGTERM)}
    deadline = time.monotonic() + KILL_AFTER
    while left and time.monotonic() < deadline:
        time.sleep(POLL)
        left = {group for group in left if _signal_group(group, 0)}
    for group in left:
        _signal_group(group, signal.SIGKILL)


def _signal_group(group: int, signum: int) -> bool:
    """Whether the group was still there."""
    try:
        os.killpg(group, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def hand_back(client: Client, jobs: dict[int, str]) -> None:
    """RetryJob, due now and as it was, for each job the manager held."""
    from jobserver.client import ConnectionFailed, JobServerError, ServerError

    deadline = time.monotonic() + HAND_BACK_FOR
    left = dict(jobs)
    while left:
        for job_id, lease_id in list(left.items()):
            try:
                client.retry_job(job_id, delay=0, ignore_repeat=True, lease_id=lease_id)
            except (ConnectionFailed, ServerError) as error:
                if time.monotonic() >= deadline:
                    log.error(
                        "worker guard: job %s not handed back (%s); it waits for its lease "
                        "or --stale-after",
                        job_id,
                        error,
                    )
                    del left[job_id]
                continue
            except JobServerError as error:
                log.info("worker guard: job %s has moved on (%s)", job_id, error.status)
            else:
                log.info("worker guard: job %s handed back to the queue", job_id)
            del left[job_id]
        if left:
            client.close()
            time.sleep(HAND_BACK_RETRY)


def guard(pipe: IO[bytes], args: argparse.Namespace) -> None:
    held = Held()
    read_until_eof(pipe, held)
    if not (held.groups or held.jobs):
        return
    log.warning(
        "worker guard: the worker manager is gone; stopping %s and handing back %s",
        counted(len(held.groups), "worker"),
        counted(len(held.jobs), "job"),
    )
    stop_groups(held.groups)
    if held.jobs:
        with connect(args) as client:
            hand_back(client, held.jobs)


def connect(args: argparse.Namespace) -> Client:
    from jobserver.client import Client

    tls: TLS = True if args.tls_ca == "system" else args.tls_ca
    token = os.environ.get(TOKEN_VARIABLE) or None
    return Client.from_address(args.servers, auth_token=token, tls=tls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="guard.py")
    parser.add_argument("servers", help="HOST:PORT, or several separated by commas")
    parser.add_argument("--tls-ca", help="the CA file, or 'system' for the system's CAs")
    args = parser.parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    logging.basicConfig(
        stream=sys.stderr, level="INFO", format="%(asctime)s jobserver %(levelname)s %(message)s"
    )
    guard(sys.stdin.buffer, args)
    return 0


# The manager's side.


class Guard:
    """The manager's handle on its guard: starts it, and tells it what the
    manager holds. Until started, and once it is gone, it tells nothing."""

    def __init__(self, servers: str, token: str | None, tls: TLS) -> None:
        """`servers`: HOST:PORT, or several separated by commas."""
        self.servers, self.token, self.tls = servers, token, tls
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the guard process; OSError if it cannot be started."""
        # -P: the script's directory is not put on sys.path, where its
        # neighbours would hide modules of the same names.
        command = [sys.executable, "-P", os.path.abspath(__file__), self.servers]
        if self.tls:
            command += ["--tls-ca", "system" if self.tls is True else str(self.tls)]
        env = {k: v for k, v in os.environ.items() if k != TOKEN_VARIABLE}
        if self.token:
            env[TOKEN_VARIABLE] = self.token
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=env,
            bufsize=0,
            start_new_session=True,
        )

    def job(self, job_id: int, lease_id: object) -> None:
        # Without a lease a hand-back could not be fenced: not listed.
        if isinstance(lease_id, str) and lease_id.isascii() and lease_id.isalnum():
            self._tell(f"job {job_id} {lease_id}")

    def done(self, job_id: int) -> None:
        self._tell(f"done {job_id}")

    def group(self, pgid: int) -> None:
        self._tell(f"group {pgid}")

    def reaped(self, pgid: int) -> None:
        self._tell(f"reaped {pgid}")

    def _tell(self, line: str) -> None:
        # One short line, written whole (under PIPE_BUF) and at once: what
        # the manager does next must not get ahead of what the guard knows.
        if self.proc is None or self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(line.encode("ascii") + b"\n")
        except OSError as error:
            log.error(
                "the worker guard is gone (%s): if this manager dies, its workers run on "
                "and its jobs stay RUNNING",
                error,
            )
            self._close_pipe()

    def _close_pipe(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            self.proc.stdin = None

    def close(self, wait: float) -> None:
        """Close the pipe, as the manager's exit would: the guard hands back
        what is still listed, and is waited for up to `wait` seconds (after
        which it finishes on its own)."""
        self._close_pipe()
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)


if __name__ == "__main__":
    sys.exit(main())
