"""What a handler's end means for its job: the report to send (a
`jobserver.workers.contract.Report`, which the worker manager sends too)
and the words the log line uses.

- It returns: FinishJob; a dict it returns becomes the job's data, None
  leaves the data as it was. A dict that is not JSON fails the job: it
  could not be sent.
- It raises RetryLater: RetryJob, with the delay or nextRun it asked for.
- It raises anything else, returns anything else, or runs past its timeout:
  FailJob with the traceback (or the reason) as the job's last error, a
  failed attempt for the job's retry policy (protocol.md 14.1, 14.2).
- The worker stops before it ends: RetryJob at once, the job as it was (not
  its fault, and not an attempt of its policy).
- The server cancelled it while it ran (410 Job cancelled): nothing; the
  server has ended it (protocol.md 14.26)."""

from __future__ import annotations

import inspect
import json
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

from jobserver.core.commands.json_params import MAX_ERROR
from jobserver.worker.job import Job, RetryLater
from jobserver.workers.contract import Outcome, Report, fate, printable

__all__ = [
    "Outcome", "cancelled", "failed", "finished", "handed_back", "no_handler", "raised",
    "timed_out",
]


def finished(job: Job, result: Any) -> Outcome:
    if result is None:
        return Outcome(_report(job, "finish", {}), "finished")
    if isinstance(result, dict):
        try:
            json.dumps(result, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as error:
            return failed(job, f"the handler returned data that is not JSON: {error}")
        return Outcome(_report(job, "finish", {"data": result}), "finished")
    return failed(job, f"the handler returned {type(result).__name__}, not a dict or None")


def raised(job: Job, error: Exception, function: Callable[..., Any]) -> Outcome:
    """The handler `function` raised `error`."""
    if isinstance(error, RetryLater):
        return Outcome(_report(job, "retry", error.params()), f"retried ({error.text()})")
    text = "".join(traceback.format_exception(type(error), error, _from(function, error)))
    return Outcome(
        _report(job, "fail", {"error": _last_bytes(text, MAX_ERROR)}),
        f"failed ({printable(_first_line(error))}{_fate(job)})",
    )


def timed_out(job: Job, timeout: float, thread: bool) -> Outcome:
    """A failed attempt, like any failure: a handler that always hangs
    cannot keep its job coming back forever."""
    left = " (its thread runs on, its result ignored)" if thread else ""
    return failed(job, f"timed out after {timeout:g}s{left}")


def no_handler(job: Job) -> Outcome:
    return failed(job, f"no handler for job name {job.name!r}")


def handed_back(job: Job, text: str) -> Outcome:
    """RetryJob that puts the job back as it was, due now."""
    return Outcome(_report(job, "retry", {"delay": 0, "ignore_repeat": True}), text)


def cancelled(job: Job) -> Outcome:
    """Not reported: the server ended the job (CANCELLED) and refuses any report."""
    return Outcome(
        _report(job, "finish", {}), "cancelled while it ran (410 Job cancelled): not reported",
        reported=False,
    )


def failed(job: Job, reason: str) -> Outcome:
    text = f"failed ({printable(reason)}{_fate(job)})"
    return Outcome(_report(job, "fail", {"error": reason}), text)


def _report(job: Job, verb: str, params: dict[str, Any]) -> Report:
    if verb == "fail":
        # Its handler's policy, for a job created without one (protocol.md 14.1).
        params = {**params, **job.handler_policy}
    return Report(job.id, printable(job.name), verb, params, lease_id=job.lease_id)


def _fate(job: Job) -> str:
    """What the server does with the job's failure, for the log line."""
    if job.handler_policy:
        attempts = job.handler_policy["max_attempts"]
        return f"; the handler's retry policy decides ({attempts} attempts)"
    return fate(job.attempt, job.max_attempts)


def _from(function: Callable[..., Any], error: Exception) -> TracebackType | None:
    """The traceback of `error` from the handler's own frame on: the
    worker's frames (and anyio's, for a thread) above it say nothing."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code is not code:
        tb = tb.tb_next
    return tb or error.__traceback__


def _first_line(error: Exception) -> str:
    message = str(error).split("\n", 1)[0]
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _last_bytes(text: str, limit: int) -> str:
    """The end of `text` within `limit` bytes of UTF-8: a traceback's end
    says what went wrong."""
    # A lone surrogate (from data a client sent) has no UTF-8: replaced.
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return raw.decode("utf-8")
    return raw[-limit:].decode("utf-8", "ignore")
