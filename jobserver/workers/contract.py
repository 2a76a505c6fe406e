"""The worker contract: what a worker is, what it is given, and what its
exit means. A worker script follows this; docs/worker-manager.md
says the same for users.

- Which executable: the last '/'-separated part of the job's name, without
  any '?...' suffix, names a file in --worker-path (`find_worker`). A name
  that could reach outside that directory, or names no executable file,
  fails the job with the reason added to its data as "error".
- stdin: the job as GetJobs handed it out, as compact JSON, then end of file.
- Environment: the manager's own, plus JOB_ID, JOB_NAME (the whole name)
  and JOBSERVER_SERVER (host:port).
- Exit 0 finishes the job (FinishJob): a JSON object on stdout becomes the
  job's data (stdout over 1 MiB is ignored, the data left as it was). A
  JSON object with an "awaitReply" key, {"awaitReply": {"key": K,
  "timeout": S}}, makes the job wait for an external reply instead
  (AwaitReply); its other keys become the data.
- Exit 75 (EX_TEMPFAIL) retries it (RetryJob), when stdout asks
  ({"delay": S} or {"nextRun": "..."}), else as the server decides.
- Any other exit, or death by a signal, fails it (FailJob): the data gets
  "error" with the exit status or signal and the end of stderr.
- A worker still running after --worker-timeout is killed and its job
  failed: a failed attempt for the job's retry policy. One still running
  when the manager's grace period ends is killed and its job retried, as
  it was: the stop is not its fault.

Each way a job ends is an `Outcome`: the `Report` to send, and what to log.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

from jobserver.wire.limits import MAX_DELAY
from jobserver.workers.supervision import STDOUT_LIMIT, Ended

log = logging.getLogger("jobserver.workers")

# sysexits.h: "temporary failure, the user is invited to retry" -- the one
# exit status with that meaning that tools already use (sendmail, procmail).
EX_TEMPFAIL = 75
# How much of stderr goes into a failed job's data: enough for a traceback,
# small enough to keep the job readable in QueryJob.
STDERR_IN_DATA = 2000


# Which executable runs a job.


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


# What a worker is given.


def worker_input(job: dict[str, Any]) -> bytes:
    """The job as the server writes JSON: compact, UTF-8."""
    return json.dumps(job, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def worker_environment(job: dict[str, Any], server: str) -> dict[str, str]:
    return {
        **os.environ,
        "JOB_ID": str(job["jobID"]),
        "JOB_NAME": job["name"],
        "JOBSERVER_SERVER": server,
    }


# What the manager sends back.


def printable(name: str) -> str:
    """A job name for the log: control characters escaped, so that a name
    cannot forge or break log lines."""
    if name.isprintable():  # nearly every name: no copy made
        return name
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)


@dataclass
class Report:
    """A result waiting to be sent: one FinishJob, RetryJob, FailJob or AwaitReply."""

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

    def bare(self) -> Report:
        """The same report without the parameters the server could refuse
        (data, nextRun, delay). An AwaitReply keeps its key and timeout,
        without which it means nothing."""
        kept = {k: v for k, v in self.params.items() if self.verb == "await" and k != "data"}
        return Report(self.job_id, self.name, self.verb, kept, self.uncertain, self.lease_id)

    def failing(self, error: str) -> Report:
        """A FailJob for the same job, with `error` as its last error."""
        return Report(
            self.job_id, self.name, "fail", {"error": error}, self.uncertain, self.lease_id
        )


@dataclass
class Outcome:
    """How a job ended: what to report, and what to log."""

    report: Report
    text: str
    # False for a job whose run was cancelled (410 Job cancelled, protocol.md
    # 14.26): the server has ended it, and takes no report of it.
    reported: bool = True


def failed(job: dict[str, Any], error: Any, text: str) -> Outcome:
    """A FailJob adding `error` to the job's data; `text` says why in the log."""
    data = job.get("data")
    data = {**data, "error": error} if isinstance(data, dict) else {"error": error}
    report = Report(job["jobID"], printable(job["name"]), "fail", {"data": data})
    return Outcome(report, f"failed ({text}{fate(job.get('attempt'), job.get('maxAttempts'))})")


# A failure's fate in the log when the job has no retry policy.
NO_POLICY = "; no retry policy: FAILED"


def fate(attempt: object, max_attempts: object) -> str:
    """What a FailJob does to a job, for the log line of its failure: the
    server retries an attempt that was not the last of its retry policy
    (after its backoff, protocol.md 14.1), and fails the job for good
    otherwise. `attempt` and `max_attempts` as the hand-out's reply gave
    them (absent for a job without a policy)."""
    if type(attempt) is not int or type(max_attempts) is not int:
        return NO_POLICY
    if attempt < max_attempts:
        return f"; attempt {attempt} of {max_attempts}, retried after its backoff"
    return f"; attempt {attempt} of {max_attempts}, the last: FAILED"


def put_back(job: dict[str, Any], text: str) -> Outcome:
    """A RetryJob that puts the job back as it was, due now: for a stop
    that is not the job's fault."""
    params = {"delay": 0, "ignore_repeat": True}
    return Outcome(Report(job["jobID"], printable(job["name"]), "retry", params), text)


def cannot_start(job: dict[str, Any], path: str, error: OSError) -> Outcome:
    reason = f"cannot start worker {path}: {error.strerror or error}"
    return failed(job, reason, reason)


def outcome(job: dict[str, Any], ended: Ended, worker_timeout: float) -> Outcome:
    """What a worker's end means for its job."""
    if ended.stopped == "cancelled":
        # The server ended the job (410 Job cancelled, protocol.md 14.26).
        report = Report(job["jobID"], printable(job["name"]), "finish", {})
        return Outcome(report, "cancelled while it ran (410 Job cancelled): worker stopped, "
                       "not reported", reported=False)
    if ended.stopped == "timeout":
        # A failed attempt, like any failure: the job's retry policy
        # decides (backoff, dead set), so a worker that always hangs
        # cannot keep its job coming back forever.
        error = f"timed out after {worker_timeout:g}s (worker killed)"
        report = Report(job["jobID"], printable(job["name"]), "fail", {"error": error})
        text = f"failed ({error}{fate(job.get('attempt'), job.get('maxAttempts'))})"
        return Outcome(report, text)
    if ended.stopped == "shutdown":
        # Our shutdown, not the job's fault: it goes back as it was.
        return put_back(job, "still running at the end of the grace period, killed, retried")
    if ended.returncode in (0, EX_TEMPFAIL):
        # A failure's stderr goes into its data; this would be lost.
        _log_stderr(job, ended.stderr.content())
    if ended.returncode == 0:
        return _finished(job, ended)
    if ended.returncode == EX_TEMPFAIL:
        params, how = retry_options(bytes(ended.stdout.data))
        report = Report(job["jobID"], printable(job["name"]), "retry", params)
        return Outcome(report, f"retried ({how})")
    detail = error_detail(ended.returncode, ended.stderr.content())
    how = f"signal {detail['signal']}" if "signal" in detail else f"exit status {ended.returncode}"
    return failed(job, detail, how)


def _log_stderr(job: dict[str, Any], stderr: bytes) -> None:
    """What a worker that did not fail wrote to stderr (warnings, progress),
    its last STDERR_IN_DATA characters, as one line."""
    text = stderr.decode("utf-8", "replace").strip()
    if text:
        log.info(
            "job %s %s wrote to stderr: %s",
            job["jobID"], printable(job["name"]), printable(text[-STDERR_IN_DATA:]),
        )


def _finished(job: dict[str, Any], ended: Ended) -> Outcome:
    """Exit 0: FinishJob, with stdout as the data if it is a JSON object."""
    job_id, name = job["jobID"], printable(job["name"])
    data = None if ended.stdout.dropped else json_object(bytes(ended.stdout.data))
    if ended.stdout.dropped:
        log.warning(
            "job %s %s: stdout over %d bytes; data left unchanged", job_id, name, STDOUT_LIMIT
        )
    if data is not None and "awaitReply" in data:
        return _awaiting(job, data)
    params = {} if data is None else {"data": data}
    return Outcome(Report(job_id, name, "finish", params), "finished")


def _awaiting(job: dict[str, Any], output: dict[str, Any]) -> Outcome:
    """Exit 0 with {"awaitReply": {"key": K, "timeout": S}}: the job waits
    for a reply (AwaitReply); the other keys, if any, become its data."""
    request = output.pop("awaitReply")
    key = request.get("key") if isinstance(request, dict) else None
    timeout = request.get("timeout") if isinstance(request, dict) else None
    if not isinstance(key, str) or not (timeout is None or type(timeout) is int):
        reason = 'awaitReply must be {"key": "...", "timeout": seconds}'
        return failed(job, reason, reason)
    params: dict[str, Any] = {"key": key, "timeout": timeout}
    if output:
        params["data"] = output
    report = Report(job["jobID"], printable(job["name"]), "await", params)
    return Outcome(report, f"awaiting a reply on {key!r}")


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


def error_detail(returncode: int, stderr: bytes) -> dict[str, Any]:
    """A failed worker's "error" for its job's data: its exit status or
    signal, and the end of its stderr."""
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
