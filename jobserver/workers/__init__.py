"""The worker manager: takes jobs from the server and runs each one as a process.

One trio task asks the server for work with a blocking GetJobs, but only when
there is a free worker slot and the load average allows it; each job it gets
runs as a child process in a task of its own; one more task reports results
(FinishJob, RetryJob, FailJob) over a second connection, in order, holding
them and retrying while the server cannot be reached. So waiting for jobs,
waiting for workers and reporting all happen at once, and nothing polls.

Leases: every report carries the job's lease token, so a result for a job
that has since been handed to another worker is refused (409) and dropped.
A leased job's lease is renewed (TouchJob) while its worker runs, at a
third of the lease or every --touch-interval seconds, whichever is sooner.

The worker contract (README, "Worker manager"): the job object as JSON on
stdin; JOB_ID, JOB_NAME and JOBSERVER_SERVER in the environment; exit 0 to
finish (a JSON object on stdout becomes the job's data; one with an
`awaitReply` key, `{"awaitReply": {"key": K, "timeout": S}}`, makes the job
wait for an external reply instead), 75 to retry (optionally `{"delay": S}`
or `{"nextRun": "..."}` on stdout), anything else to fail. A worker still
running after --worker-timeout is killed and its job failed (a failed
attempt for the job's retry policy).

Exit status of the manager: 0 after a clean stop (signal or --max-iterations),
1 after a forced stop (second signal) or when results could not be reported
before giving up, 2 for bad options, when the server refuses our GetJobs, or
when TLS cannot be set up with it (TLSFailed: trying again would not help).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import ssl
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

import trio

from jobserver.cli.options import (
    AUTH_TOKEN_HELP,
    DEFAULT_SERVER,
    LOG_LEVELS,
    add_tls_arguments,
    log_level,
    number,
    server_address,
    tls_option,
)
from jobserver.client import (
    AsyncClient,
    Conflict,
    ConnectionFailed,
    IllegalState,
    InvalidRequest,
    JobNotFound,
    JobServerError,
    ServerError,
    TLSFailed,
    auth_token,
    parse_address,
    tls_context,
)
from jobserver.core.repeat import offset_seconds

log = logging.getLogger("jobserver.workers")


# sysexits.h: "temporary failure, the user is invited to retry" -- the one
# exit status with that meaning that tools already use (sendmail, procmail).
EX_TEMPFAIL = 75
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
# A worker told to stop (SIGTERM) gets this long to clean up before SIGKILL.
KILL_AFTER = 5.0
# After a worker exits, how long its output pipes may stay open: a background
# grandchild can hold them forever, and its output is not the job's.
OUTPUT_DRAIN = 2.0
# stdout can become job data, and the server refuses data over 1 MiB anyway.
STDOUT_LIMIT = 1024 * 1024
# stderr is kept only for the error report; its end says what went wrong.
STDERR_LIMIT = 64 * 1024
# How much of stderr goes into a failed job's data: enough for a traceback,
# small enough to keep the job readable in QueryJob.
STDERR_IN_DATA = 2000
# Retrying an unreachable server: quick at first (a restart takes a moment),
# then no more often than every 5 s, so a long outage costs nothing.
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 5.0
# A report refused with a 5xx other than 503 (the server's "unavailable") may
# be refused the same way forever (502 Failed to compute nextRun): after this
# many tries it is given up, so that it does not hold up the reports behind it.
REPORT_TRIES_ON_ERROR = 5
# After a signalled stop, results still unreported once the workers are done
# get this long for the server to come back before the manager gives up.
REPORT_DRAIN = 10.0
# RetryJob's delay is at most 8 digits (protocol.md section 3).
MAX_DELAY = 99_999_999
# A lease is renewed after a third of it has passed: two more tries fit
# before it runs out if the server does not answer one.
TOUCH_FRACTION = 1 / 3
# The server counts a lease from the start of the current second, so it can
# be up to this much shorter than its retryAfter says.
LEASE_ROUNDING = 1.0
# Renewing more often than this is only load, whatever the lease.
MIN_TOUCH_INTERVAL = 0.1


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cpus = _cpu_count()
    parser.add_argument(
        "--worker-path",
        required=True,
        metavar="DIR",
        help="directory of worker executables; job 'a/b/Name?x' runs DIR/Name (required)",
    )
    parser.add_argument(
        "--job-name",
        default="*",
        metavar="PATTERN",
        help="GetJobs name: a GLOB pattern, or a comma-separated list of names (default: *)",
    )
    parser.add_argument(
        "--max-load",
        type=number(float, 0, above=True),
        default=None,
        metavar="F",
        help="take no jobs while the 1-minute load average is F or more, F > 0 (default: "
        "no load limit; --max-workers is the limit). In a container the load average is "
        "usually the whole host's",
    )
    parser.add_argument(
        "--max-workers",
        type=number(int, 1),
        default=cpus,
        metavar="N",
        help=f"run at most N workers at once, N >= 1 (default: {cpus}, the number of CPUs)",
    )
    parser.add_argument(
        "--worker-timeout",
        type=number(float, 0, above=True),
        default=3600.0,
        metavar="S",
        help="kill a worker still running after S seconds, S > 0, and fail its job, a "
        "failed attempt for its retry policy (default: 3600)",
    )
    parser.add_argument(
        "--max-iterations",
        type=number(int, 1),
        default=None,
        metavar="N",
        help="exit cleanly after N GetJobs rounds, N >= 1 (default: no limit)",
    )
    parser.add_argument(
        "--server",
        type=server_address,
        metavar="HOST:PORT",
        help=f"the job server, PORT 1 to 65535 (default: $JOBSERVER_SERVER, else "
        f"{DEFAULT_SERVER})",
    )
    parser.add_argument("--auth-token-file", metavar="FILE", help=AUTH_TOKEN_HELP)
    add_tls_arguments(parser)
    parser.add_argument(
        "--grace",
        type=number(float, 0),
        default=30.0,
        metavar="S",
        help="on SIGTERM/SIGINT, running workers get S seconds, S >= 0, then are killed "
        "(default: 30)",
    )
    parser.add_argument(
        "--touch-interval",
        type=number(float, 0, above=True),
        default=30.0,
        metavar="S",
        help="renew the lease of a running leased job (TouchJob) at least every S seconds, "
        "S > 0, and after a third of its retryAfter if that is sooner (default: 30)",
    )
    parser.add_argument(
        "--log-level",
        type=log_level,
        choices=LOG_LEVELS,
        default="INFO",
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING or ERROR (default: INFO)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the manager until it is stopped; the exit status (module docstring)."""
    # Does nothing if the caller has set up logging already.
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s jobserver %(levelname)s %(message)s",
    )
    try:
        server = args.server or parse_address(os.environ.get("JOBSERVER_SERVER") or DEFAULT_SERVER)
    except ValueError as error:
        log.error("$JOBSERVER_SERVER: %s", error)
        return 2
    directory = os.path.realpath(args.worker_path)
    if not os.path.isdir(directory):
        log.error("--worker-path %s is not a directory", args.worker_path)
        return 2
    try:
        token = auth_token(args.auth_token_file)
    except OSError as error:
        log.error("cannot read --auth-token-file: %s", error)
        return 2
    try:
        tls = tls_context(tls_option(args))
    except ValueError as error:
        log.error("cannot use --tls-ca: %s", error)
        return 2
    manager = Manager(
        host=server[0],
        port=server[1],
        token=token,
        tls=tls,
        directory=directory,
        pattern=args.job_name,
        max_load=args.max_load,
        max_workers=args.max_workers,
        worker_timeout=args.worker_timeout,
        max_iterations=args.max_iterations,
        grace=args.grace,
        touch_interval=args.touch_interval,
    )
    return trio.run(manager.serve)


# Finding the worker for a job.


class Refused(Exception):
    """The job cannot run: its name names no usable worker."""


def find_worker(directory: str, name: str) -> str:
    """The executable for job `name`: the last '/'-separated component of the
    name without its '?...' suffix, inside `directory` (already resolved).
    Anything that could reach outside `directory` is refused."""
    if "\0" in name:  # it could not even be passed in JOB_NAME
        raise Refused(f"job name {name!r} holds a NUL")
    component = name.split("?", 1)[0].rsplit("/", 1)[-1]
    if not component:
        raise Refused(f"job name {name!r} names no worker: its last component is empty")
    if component in (".", ".."):
        raise Refused(f"job name {name!r} names no worker: {component!r} is not a file name")
    if component.startswith("."):
        raise Refused(f"job name {name!r} names a hidden file {component!r}, which is never run")
    if "\\" in component:
        raise Refused(f"job name {name!r} holds a backslash in its worker name")
    path = os.path.join(directory, component)
    resolved = os.path.realpath(path)
    if os.path.commonpath([directory, resolved]) != directory:
        raise Refused(f"worker {path} resolves to {resolved}, outside the worker path")
    if not os.path.exists(resolved):
        raise Refused(f"no worker {path}")
    if not os.path.isfile(resolved):
        raise Refused(f"worker {path} is not a file")
    if not os.access(resolved, os.X_OK):
        raise Refused(f"worker {path} is not executable")
    return resolved


# Results.


def printable(name: str) -> str:
    """A job name for the log: control characters escaped, so that a name
    cannot forge or break log lines."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)


@dataclass
class Report:
    """A result waiting to be sent: one FinishJob, RetryJob or FailJob."""

    job_id: int
    name: str  # printable(), for the log
    verb: str  # "finish", "retry", "fail" or "await" (AwaitReply)
    params: dict[str, Any]
    # The connection broke during an attempt, so the server may have applied
    # it: a later 404 or 405 then means "already done", not "refused".
    uncertain: bool = False
    # The hand-out's lease token: the server refuses the report if the job
    # has been handed out again since.
    lease_id: str | None = None

    @property
    def method(self) -> str:
        """The client method that sends it."""
        return "await_reply" if self.verb == "await" else f"{self.verb}_job"

    @property
    def command(self) -> str:
        """The protocol command, for the log."""
        return "AwaitReply" if self.verb == "await" else f"{self.verb.capitalize()}Job"

    def bare(self) -> Report | None:
        """The same report with no parameters (so nothing the server could
        refuse: data, nextRun, delay), or None if it has none already. An
        AwaitReply keeps its key and timeout, without which it means nothing."""
        kept = {k: v for k, v in self.params.items() if self.verb == "await" and k != "data"}
        if kept == self.params:
            return None
        return Report(self.job_id, self.name, self.verb, kept, self.uncertain, self.lease_id)


@dataclass
class Lease:
    """A running job's lease, renewed while its worker runs."""

    job_id: int
    name: str  # printable(), for the log
    lease_id: str
    period: float  # seconds between renewals
    due: float  # trio time of the next renewal


def touch_period(retry_after: str, interval: float) -> float:
    """How often to renew a lease of `retry_after`: after a third of its
    shortest length, at most every `interval` seconds (also when its length
    depends on the moment)."""
    length = offset_seconds(retry_after)
    if length is None:
        return interval
    shortest = length - LEASE_ROUNDING
    return max(min(interval, shortest * TOUCH_FRACTION), MIN_TOUCH_INTERVAL)


@dataclass
class Outcome:
    """How a job ended: what to report, and what to log."""

    report: Report
    text: str


def _compact(job: dict[str, Any]) -> bytes:
    """The job as the server writes JSON: compact, UTF-8."""
    return json.dumps(job, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # the server would refuse it too


def json_object(raw: bytes) -> dict[str, Any] | None:
    """`raw` as a JSON object, strictly (no NaN or Infinity); None if it is not one."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def retry_options(stdout: bytes) -> tuple[dict[str, Any], str]:
    """RetryJob parameters from an exit-75 worker's stdout, and how to log them.
    A delay or nextRun the worker asked for wins over the job's repeat."""
    options = json_object(stdout) or {}
    next_run = options.get("nextRun")
    if isinstance(next_run, str) and next_run.strip():
        return {"next_run": next_run, "ignore_repeat": True}, f"nextRun {next_run}"
    delay = options.get("delay")
    if delay is not None:
        if type(delay) is int and 0 <= delay <= MAX_DELAY:
            return {"delay": delay, "ignore_repeat": True}, f"delay {delay}s"
        log.warning(
            "ignoring delay %r: not a whole number of seconds from 0 to %d", delay, MAX_DELAY
        )
    return {}, "no delay"


def _error_detail(returncode: int, stderr: bytes) -> dict[str, Any]:
    detail: dict[str, Any]
    if returncode < 0:
        try:
            detail = {"signal": signal.Signals(-returncode).name}
        except ValueError:
            detail = {"signal": str(-returncode)}
    else:
        detail = {"exitStatus": returncode}
    detail["stderr"] = stderr.decode("utf-8", "replace")[-STDERR_IN_DATA:]
    return detail


class Head:
    """The first `limit` bytes of a stream; the rest is counted and dropped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - room)


class Tail:
    """The last `limit` bytes of a stream."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > 2 * self.limit:  # trim in batches, not per chunk
            del self.data[: -self.limit]

    def content(self) -> bytes:
        return bytes(self.data[-self.limit :])


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


class Backoff:
    """Exponential waits while the server cannot be reached."""

    def __init__(self) -> None:
        self.delay = 0.0

    @property
    def failing(self) -> bool:
        return self.delay > 0

    def next(self) -> float:
        self.delay = min(self.delay * 2, BACKOFF_MAX) if self.delay else BACKOFF_FIRST
        return self.delay


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


class Manager:
    def __init__(
        self,
        *,
        host: str,
        port: int,
        directory: str,
        pattern: str,
        max_load: float | None,
        max_workers: int,
        worker_timeout: float,
        max_iterations: int | None,
        grace: float,
        touch_interval: float = 30.0,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.token = token
        self.tls = tls
        self.directory = directory
        self.pattern = pattern
        self.max_load = max_load
        self.load_notice = Every(LOAD_NOTICE_INTERVAL)
        self.max_workers = max_workers
        self.worker_timeout = worker_timeout
        self.max_iterations = max_iterations
        self.grace = grace
        self.touch_interval = touch_interval

        self.running = 0  # worker tasks started and not yet ended
        self.changed = trio.Event()  # set (and replaced) whenever a worker ends
        self.stopping = False
        self.signalled = False
        self.forced = False
        self.exit_status = 0
        self.grace_deadline = math.inf
        self.fetch_scope = trio.CancelScope()
        self.worker_scopes: set[trio.CancelScope] = set()
        self.live: dict[int, tuple[int, str]] = {}  # pid -> job, for the forced-exit log

        self.reports: deque[Report] = deque()
        self.report_added = trio.Event()
        self.reports_closed = False
        self.report_scope = trio.CancelScope()
        self.given_up = 0  # results the server would not take

        self.leases: dict[str, Lease] = {}  # by lease token: running leased jobs
        self.leases_changed = trio.Event()

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def client(self) -> AsyncClient:
        return AsyncClient(self.host, self.port, auth_token=self.token, tls=self.tls)

    # Top level.

    async def serve(self) -> int:
        async with trio.open_nursery() as root:
            await root.start(self.watch_signals, root.cancel_scope)
            log.info(
                "worker manager started: server %s%s, jobs %r, workers from %s, "
                "at most %d at once, %s",
                self.address,
                " (TLS)" if self.tls else "",
                self.pattern,
                self.directory,
                self.max_workers,
                "no load limit" if self.max_load is None else f"load below {self.max_load:g}",
            )
            reporter_done = trio.Event()
            root.start_soon(self.report_loop, reporter_done)
            root.start_soon(self.touch_loop)
            async with trio.open_nursery() as workers:
                await self.fetch_loop(workers)
            self.reports_closed = True
            self.report_added.set()
            if self.signalled or self.exit_status:
                self.report_scope.deadline = trio.current_time() + REPORT_DRAIN
            await reporter_done.wait()
            root.cancel_scope.cancel()  # the signal watcher and the lease renewer
        if self.forced:
            for job_id, name in self.live.values():
                log.error(
                    "job %s %s abandoned: worker killed, job still RUNNING on the server",
                    job_id,
                    name,
                )
        self._log_unreported()
        if self.forced or self.reports or self.given_up:
            log.error("worker manager stopped; results were lost (logged above)")
            return 1
        log.info("worker manager stopped")
        return self.exit_status

    async def watch_signals(
        self, root: trio.CancelScope, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if not self.signalled:
                    self.signalled = True
                    log.info(
                        "received %s: taking no more jobs; %d running workers get %gs to finish",
                        name,
                        self.running,
                        self.grace,
                    )
                    self.stop(grace=self.grace)
                    if self.reports_closed:
                        self.report_scope.deadline = trio.current_time() + REPORT_DRAIN
                else:
                    log.warning("received %s again: killing all workers and exiting now", name)
                    self.forced = True
                    root.cancel()
                    return

    def stop(self, grace: float) -> None:
        """Take no more jobs; running workers get `grace` more seconds."""
        self.stopping = True
        self.fetch_scope.cancel()
        self.grace_deadline = min(self.grace_deadline, trio.current_time() + grace)
        for scope in self.worker_scopes:
            scope.deadline = min(scope.deadline, self.grace_deadline)

    # Fetching.

    async def fetch_loop(self, workers: trio.Nursery) -> None:
        rounds = 0
        backoff = Backoff()
        client = self.client()
        try:
            with self.fetch_scope:
                while self.max_iterations is None or rounds < self.max_iterations:
                    free = await self.free_slots()
                    try:
                        if backoff.failing:
                            # A blocking GetJobs may not answer for a minute:
                            # make sure the server is back, and say so, first.
                            await client.ping()
                            log.info("server %s reachable again; taking jobs", self.address)
                            backoff = Backoff()
                        jobs = await client.get_jobs(self.pattern, min(free, 1000), wait=FETCH_WAIT)
                    except TLSFailed as error:
                        # Trying again cannot help: the options must change.
                        log.error("cannot get jobs: %s", error)
                        self.exit_status = 2
                        return
                    except (ConnectionFailed, ServerError) as error:
                        if not backoff.failing:
                            log.warning(
                                "cannot get jobs (%s); running workers carry on, "
                                "retrying with backoff up to %gs",
                                error,
                                BACKOFF_MAX,
                            )
                        await self._close(client)
                        client = self.client()
                        await trio.sleep(backoff.next())
                        continue
                    except JobServerError as error:
                        log.error(
                            "the server refused GetJobs for %r: %s %s",
                            self.pattern,
                            error.code,
                            error.reason,
                        )
                        self.exit_status = 2
                        return
                    rounds += 1
                    for job in jobs:
                        self.running += 1
                        workers.start_soon(self.run_job, job)
            if self.max_iterations is not None and rounds >= self.max_iterations:
                log.info(
                    "%d GetJobs rounds done; waiting for %d running workers", rounds, self.running
                )
        finally:
            # A cancelled GetJobs leaves the connection mid-request; closing it
            # tells the server, which puts back any job it took for us.
            await self._close(client)

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

    @staticmethod
    async def _close(client: AsyncClient) -> None:
        with trio.CancelScope(shield=True):
            await client.aclose()

    # Running one job.

    async def run_job(self, job: dict[str, Any]) -> None:
        started = trio.current_time()
        job_id, name = job["jobID"], printable(job["name"])
        try:
            if self.stopping:
                outcome = Outcome(
                    Report(job_id, name, "retry", {"delay": 0, "ignore_repeat": True}),
                    "returned to the queue (stopping)",
                )
            else:
                try:
                    path = find_worker(self.directory, job["name"])
                except Refused as refusal:
                    outcome = self._failed(job, str(refusal), f"failed ({refusal})")
                else:
                    held = self._hold_lease(job)
                    try:
                        outcome = await self.run_process(job, path, started)
                    finally:
                        if held is not None:
                            self.leases.pop(held, None)
        finally:
            self.running -= 1
            self.changed.set()
            self.changed = trio.Event()
        duration = trio.current_time() - started
        log.info("job %s %s %s in %.3fs", job_id, name, printable(outcome.text), duration)
        outcome.report.lease_id = job.get("leaseID")
        self.report(outcome.report)

    def _failed(self, job: dict[str, Any], error: Any, text: str) -> Outcome:
        data = job.get("data")
        data = {**data, "error": error} if isinstance(data, dict) else {"error": error}
        return Outcome(Report(job["jobID"], printable(job["name"]), "fail", {"data": data}), text)

    async def run_process(self, job: dict[str, Any], path: str, started: float) -> Outcome:
        job_id, name = job["jobID"], job["name"]
        env = {
            **os.environ,
            "JOB_ID": str(job_id),
            "JOB_NAME": name,
            "JOBSERVER_SERVER": self.address,
        }
        try:
            proc = await trio.lowlevel.open_process(
                [path],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,  # its own process group, which we can kill whole
            )
        except OSError as error:
            reason = f"cannot start worker {path}: {error.strerror or error}"
            return self._failed(job, reason, f"failed ({reason})")
        self.live[proc.pid] = (job_id, printable(name))
        stdout, stderr = Head(STDOUT_LIMIT), Tail(STDERR_LIMIT)
        stopped = None  # why we stopped it: "timeout" or "shutdown"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_feed, proc.stdin, _compact(job))
                out_done, err_done = trio.Event(), trio.Event()
                nursery.start_soon(_collect, proc.stdout, stdout, out_done)
                nursery.start_soon(_collect, proc.stderr, stderr, err_done)
                scope = trio.CancelScope(
                    deadline=min(started + self.worker_timeout, self.grace_deadline)
                )
                self.worker_scopes.add(scope)
                try:
                    with scope:
                        await proc.wait()
                finally:
                    self.worker_scopes.discard(scope)
                if proc.returncode is None:
                    timed_out = trio.current_time() >= started + self.worker_timeout
                    stopped = "timeout" if timed_out else "shutdown"
                    await _terminate(proc)
                with trio.move_on_after(OUTPUT_DRAIN):
                    await out_done.wait()
                    await err_done.wait()
                nursery.cancel_scope.cancel()
        finally:
            if proc.returncode is None:  # cancelled: a forced exit
                _signal_group(proc.pid, signal.SIGKILL)
            with trio.CancelScope(shield=True):
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        await stream.aclose()
                await proc.wait()
        del self.live[proc.pid]
        return self._outcome(job, proc.returncode, stopped, stdout, stderr)

    def _outcome(
        self, job: dict[str, Any], returncode: int, stopped: str | None, stdout: Head, stderr: Tail
    ) -> Outcome:
        job_id, name = job["jobID"], printable(job["name"])
        if stopped == "timeout":
            # A failed attempt, like any failure: the job's retry policy
            # decides (backoff, dead set), so a worker that always hangs
            # cannot keep its job coming back forever.
            error = f"timed out after {self.worker_timeout:g}s (worker killed)"
            return Outcome(Report(job_id, name, "fail", {"error": error}), f"failed ({error})")
        if stopped is not None:
            # Our shutdown, not the job's fault: it goes back as it was.
            params = {"delay": 0, "ignore_repeat": True}
            text = "still running at the end of the grace period, killed, retried"
            return Outcome(Report(job_id, name, "retry", params), text)
        if returncode == 0:
            data = None if stdout.dropped else json_object(bytes(stdout.data))
            if stdout.dropped:
                log.warning(
                    "job %s %s: stdout over %d bytes; data left unchanged",
                    job_id,
                    name,
                    STDOUT_LIMIT,
                )
            if data is not None and "awaitReply" in data:
                return self._awaiting(job, data)
            params = {} if data is None else {"data": data}
            return Outcome(Report(job_id, name, "finish", params), "finished")
        if returncode == EX_TEMPFAIL:
            params, how = retry_options(bytes(stdout.data))
            return Outcome(Report(job_id, name, "retry", params), f"retried ({how})")
        detail = _error_detail(returncode, stderr.content())
        how = f"signal {detail['signal']}" if "signal" in detail else f"exit status {returncode}"
        return self._failed(job, detail, f"failed ({how})")

    def _awaiting(self, job: dict[str, Any], output: dict[str, Any]) -> Outcome:
        """Exit 0 with {"awaitReply": {"key": K, "timeout": S}}: the job waits
        for a reply (AwaitReply); the other keys, if any, become its data."""
        job_id, name = job["jobID"], printable(job["name"])
        request = output.pop("awaitReply")
        key = request.get("key") if isinstance(request, dict) else None
        timeout = request.get("timeout") if isinstance(request, dict) else None
        if not isinstance(key, str) or not (timeout is None or type(timeout) is int):
            reason = 'awaitReply must be {"key": "...", "timeout": seconds}'
            return self._failed(job, reason, f"failed ({reason})")
        params: dict[str, Any] = {"key": key, "timeout": timeout}
        if output:
            params["data"] = output
        return Outcome(Report(job_id, name, "await", params), f"awaiting a reply on {key!r}")

    # Renewing leases.

    def _hold_lease(self, job: dict[str, Any]) -> str | None:
        """Renew this job's lease while it runs; its token, or None for a
        job without a lease."""
        lease_id, retry_after = job.get("leaseID"), job.get("retryAfter")
        if not (isinstance(lease_id, str) and lease_id):
            return None
        if not (isinstance(retry_after, str) and retry_after):
            return None
        period = touch_period(retry_after, self.touch_interval)
        name = printable(job["name"])
        self.leases[lease_id] = Lease(
            job["jobID"], name, lease_id, period, trio.current_time() + period
        )
        self.leases_changed.set()
        return lease_id

    async def touch_loop(self) -> None:
        """Renew each running job's lease when it is due, on a connection of
        its own; runs until the manager cancels it."""
        client = self.client()
        failing = False
        try:
            while True:
                self.leases_changed = trio.Event()
                if not self.leases:
                    await self.leases_changed.wait()
                    continue
                lease = min(self.leases.values(), key=lambda held: held.due)
                if lease.due > trio.current_time():
                    with trio.move_on_at(lease.due):
                        await self.leases_changed.wait()
                    continue
                lease.due = trio.current_time() + lease.period
                try:
                    await client.touch_job(lease.job_id, lease_id=lease.lease_id)
                except (ConnectionFailed, ServerError) as error:
                    if not failing:
                        log.warning(
                            "cannot renew the lease of job %s (%s); trying again in %gs",
                            lease.job_id,
                            error,
                            lease.period,
                        )
                        failing = True
                    await self._close(client)
                    client = self.client()
                    continue
                except JobServerError as error:
                    # Unless the job ended meanwhile (its report is on its
                    # way), the lease is gone: 409 when another worker has
                    # the job now. The worker runs on; its result will be
                    # refused if so.
                    if self.leases.pop(lease.lease_id, None) is not None:
                        log.warning(
                            "job %s %s: lost its lease (%s %s); the worker runs on",
                            lease.job_id,
                            lease.name,
                            error.code,
                            error.reason,
                        )
                    continue
                if failing:
                    log.info("server %s reachable again; renewing leases", self.address)
                    failing = False
        finally:
            await self._close(client)

    # Reporting.

    def report(self, report: Report) -> None:
        self.reports.append(report)
        self.report_added.set()

    async def report_loop(self, done: trio.Event) -> None:
        client = self.client()
        try:
            with self.report_scope:
                while True:
                    if not self.reports:
                        if self.reports_closed:
                            return
                        self.report_added = trio.Event()
                        await self.report_added.wait()
                        continue
                    client = await self.deliver(self.reports[0], client)
                    self.reports.popleft()
        finally:
            await self._close(client)
            done.set()

    async def deliver(self, report: Report, client: AsyncClient) -> AsyncClient:
        """Send `report` until the server gives a definite answer; the client
        to use next (a new one after a broken connection)."""
        backoff = Backoff()
        held_since = trio.current_time()
        errors = 0
        while True:
            try:
                await getattr(client, report.method)(
                    report.job_id, lease_id=report.lease_id, **report.params
                )
            except (ConnectionFailed, ServerError) as error:
                report.uncertain = report.uncertain or isinstance(error, ConnectionFailed)
                if isinstance(error, ServerError) and error.code != 503:
                    errors += 1
                    if errors >= REPORT_TRIES_ON_ERROR:
                        log.error(
                            "job %s %s: giving up reporting %s %s after %d tries: %s",
                            report.job_id,
                            report.name,
                            report.command,
                            json.dumps(report.params),
                            errors,
                            error.status,
                        )
                        self.given_up += 1
                        return client
                if not backoff.failing:
                    log.warning(
                        "cannot report job %s (%s); holding %d results, "
                        "retrying with backoff up to %gs",
                        report.job_id,
                        error,
                        len(self.reports),
                        BACKOFF_MAX,
                    )
                await self._close(client)
                client = self.client()
                await trio.sleep(backoff.next())
                continue
            except Conflict as error:
                if report.verb == "await" and error.reason != "Lease expired":
                    # Another job waits on the key: this job cannot wait,
                    # and must not stay RUNNING with nobody to report it.
                    log.warning(
                        "job %s %s: AwaitReply refused (%s %s); failing the job",
                        report.job_id, report.name, error.code, error.reason,
                    )
                    report = Report(
                        report.job_id, report.name, "fail", {"error": error.status},
                        report.uncertain, report.lease_id,
                    )
                    continue
                log.warning(
                    "job %s %s: %s refused (%s %s): another worker has the job now; "
                    "this result is dropped",
                    report.job_id,
                    report.name,
                    report.command,
                    error.code,
                    error.reason,
                )
                return client
            except (JobNotFound, IllegalState) as error:
                if report.uncertain:
                    log.info(
                        "job %s %s: already reported (%s %s after a reply was lost)",
                        report.job_id,
                        report.name,
                        error.code,
                        error.reason,
                    )
                else:
                    log.warning(
                        "job %s %s: the server refused %s: %s %s",
                        report.job_id,
                        report.name,
                        report.command,
                        error.code,
                        error.reason,
                    )
                return client
            except InvalidRequest as error:
                bare = report.bare()
                log.warning(
                    "job %s %s: the server refused %s (%s %s)%s",
                    report.job_id,
                    report.name,
                    report.command,
                    error.code,
                    error.reason,
                    "; sending it without data" if bare else "",
                )
                if bare is None:
                    return client
                report = bare
                continue
            except JobServerError as error:
                log.error(
                    "job %s %s: the server refused %s: %s",
                    report.job_id,
                    report.name,
                    report.command,
                    error.status,
                )
                self.given_up += 1
                return client
            if backoff.failing:
                log.info(
                    "server %s reachable again; reported job %s after %.1fs",
                    self.address,
                    report.job_id,
                    trio.current_time() - held_since,
                )
            return client

    def _log_unreported(self) -> None:
        for report in self.reports:
            log.error(
                "job %s %s: result not reported (the server may or may not have it): %s %s",
                report.job_id,
                report.name,
                report.command,
                json.dumps(report.params),
            )


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
