"""What a worker says of a job it was handed, shared by every client: done
(FinishJob), failed (FailJob), back in the queue (RetryJob), for one job or
for up to 1,000 in one request (FinishJobs, FailJobs, RetryJobs: a result
per job), and still at work (TouchJob).

Apart from calls.py, which holds the `Call` these build and the other
commands of a job's life, so that each module stays short; the docstrings
are the client methods' as there (`documented_by`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from jobserver.client.calls import Call, When, _on_job, _shown, _time_text, reply_object
from jobserver.client.errors import JobServerError, error_for
from jobserver.wire.client_framing import Reply, without_lone_surrogates
from jobserver.wire.limits import MAX_FINISH_JOBS


def finish_job(job_id: int, data: dict[str, Any] | None, lease_id: str | None) -> Call[None]:
    """Report a handed-out job done: it is deleted, or queued for its next
    run if it repeats. `data` replaces its data."""
    return _on_job("FinishJob", job_id, data=data, leaseID=lease_id)


class Finish(NamedTuple):
    """One job for finish_jobs: as finish_job's job_id, lease_id and data.
    A plain (job_id, lease_id, data) tuple does as well."""

    job_id: int
    lease_id: str | None = None
    data: dict[str, Any] | None = None


@dataclass(frozen=True)
class FinishResult:
    """What finish_jobs (fail_jobs, retry_jobs) did with one job. `status`
    is the status line that finish_job (fail_job, retry_job) would have had
    for it; `job_id` the jobID as the server read it (None if it was not an
    integer)."""

    job_id: int | None
    status: str

    @property
    def code(self) -> int:
        return int(self.status[:3])

    @property
    def ok(self) -> bool:
        return 200 <= self.code <= 299

    def error(self) -> JobServerError | None:
        """The exception the one-job call would have raised, or None for success."""
        return None if self.ok else error_for(self.status)


# A job's status in a FinishJobs reply: a status line, as its own reply's.
_STATUS = re.compile(r"[1-5][0-9][0-9](?: .*)?", re.DOTALL)


def _finish_results(count: int) -> Callable[[Reply], list[FinishResult]]:
    """The results of a FinishJobs (FailJobs, RetryJobs) of `count` jobs,
    checked: a reporter pairs them with its reports, one each, and reads
    each status's code, so a hostile reply of another shape must be a
    MalformedReply, not an exception that ends the worker."""

    def results(reply: Reply) -> list[FinishResult]:
        listed = reply_object(reply)["results"]
        if not isinstance(listed, list) or len(listed) != count:
            raise ValueError(f"{count} results expected, not {_shown(listed)}")
        return [_result(result) for result in listed]

    return results


def _result(value: object) -> FinishResult:
    if not isinstance(value, dict):
        raise ValueError(f"a result that is not an object: {_shown(value)}")
    job_id, status = value.get("jobID"), value.get("status")
    if not (job_id is None or type(job_id) is int):
        raise ValueError(f"a result whose jobID is {_shown(job_id)}")
    if not (isinstance(status, str) and _STATUS.fullmatch(status)):
        raise ValueError(f"a result whose status is {_shown(status)}")
    return FinishResult(job_id, status)


def finish_jobs(
    jobs: Sequence[tuple[int, str | None, dict[str, Any] | None]],
) -> Call[list[FinishResult]]:
    """Report many handed-out jobs done in one request: each Finish(job_id,
    lease_id, data) as finish_job would report it, in order, 1 to 1,000 of
    them (ValueError otherwise, before sending). Returns a FinishResult per
    job, in the same order. A job the server refuses does not stop the
    others: its result is not `ok`, and `error()` is what finish_job would
    have raised (Conflict for a lease that moved on, JobNotFound...); the
    call itself raises only when the whole request fails."""
    if not 1 <= len(jobs) <= MAX_FINISH_JOBS:
        raise ValueError(f"finish_jobs takes 1 to {MAX_FINISH_JOBS} jobs, not {len(jobs)}")
    elements = [_element(job_id, lease_id, data=data) for job_id, lease_id, data in jobs]
    return Call("FinishJobs", {"jobs": elements}, _finish_results(len(elements)))


def fail_job(
    job_id: int,
    data: dict[str, Any] | None,
    lease_id: str | None,
    error: str | None,
    max_attempts: int | None = None,
    retry_backoff: str | None = None,
    retry_delay: float | None = None,
    retry_max_delay: float | None = None,
) -> Call[None]:
    """Report a job failed; `error` becomes its last error. With a retry
    policy and attempts left, the server queues it again. A job created
    without a policy takes the one given here (`max_attempts`, and
    `retry_backoff`, `retry_delay`, `retry_max_delay` as create_job's), as
    a worker gives its handler's; a job's own wins."""
    policy = _policy(max_attempts, retry_backoff, retry_delay, retry_max_delay)
    return _on_job("FailJob", job_id, data=data, error=error, leaseID=lease_id, **policy)


class Fail(NamedTuple):
    """One job for fail_jobs: as fail_job's job_id, lease_id, error, data
    and retry policy."""

    job_id: int
    lease_id: str | None = None
    error: str | None = None
    data: dict[str, Any] | None = None
    max_attempts: int | None = None
    retry_backoff: str | None = None
    retry_delay: float | None = None
    retry_max_delay: float | None = None


class Retry(NamedTuple):
    """One job for retry_jobs: as retry_job's job_id, lease_id, delay,
    next_run, data and ignore_repeat."""

    job_id: int
    lease_id: str | None = None
    delay: int | None = None
    next_run: When | None = None
    data: dict[str, Any] | None = None
    ignore_repeat: bool = False


def fail_jobs(jobs: Sequence[Fail]) -> Call[list[FinishResult]]:
    """Report many handed-out jobs failed in one request: each
    Fail(job_id, lease_id, error, data) as fail_job would report it, 1 to
    1,000 of them (ValueError otherwise, before sending). Returns a
    FinishResult per job, in order, as finish_jobs does."""
    elements = [
        _element(
            job.job_id, job.lease_id, data=job.data, error=_text(job.error),
            **_policy(job.max_attempts, job.retry_backoff, job.retry_delay, job.retry_max_delay),
        )
        for job in jobs
    ]
    return _reports("FailJobs", elements)


def _policy(
    max_attempts: int | None, backoff: str | None, delay: float | None, max_delay: float | None
) -> dict[str, object]:
    """A failure's retry policy, for a job created without one (protocol.md
    14.1): its parameters, None for those not given."""
    return {
        "maxAttempts": max_attempts, "retryBackoff": backoff, "retryDelay": delay,
        "retryMaxDelay": max_delay,
    }


def _text(text: str | None) -> str | None:
    """A text for a string inside `jobs`: a lone surrogate (an error made of
    a client's data) becomes U+FFFD, as it does in a header; the server
    refuses one as a JSON escape (protocol.md 3)."""
    return None if text is None else without_lone_surrogates(text)


def retry_job(
    job_id: int,
    delay: int | None,
    next_run: When | None,
    data: dict[str, Any] | None,
    name: str | None,
    priority: int | None,
    ignore_repeat: bool,
    lease_id: str | None,
) -> Call[None]:
    """Put a handed-out job back in the queue, after `delay` seconds or at `next_run`."""
    return _on_job(
        "RetryJob",
        job_id,
        delay=delay,
        nextRun=_time_text(next_run),
        data=data,
        name=name,
        jobPriority=priority,
        ignoreRepeat=ignore_repeat or None,
        leaseID=lease_id,
    )


def retry_jobs(jobs: Sequence[Retry]) -> Call[list[FinishResult]]:
    """Put many handed-out jobs back in the queue in one request: each
    Retry(job_id, lease_id, delay, next_run, data, ignore_repeat) as
    retry_job would, 1 to 1,000 of them (ValueError otherwise, before
    sending). Returns a FinishResult per job, in order, as finish_jobs does."""
    elements = [
        _element(
            job.job_id, job.lease_id, delay=job.delay, nextRun=_time_text(job.next_run),
            data=job.data, ignoreRepeat=job.ignore_repeat or None,
        )
        for job in jobs
    ]
    return _reports("RetryJobs", elements)


def _element(job_id: int, lease_id: str | None, **params: object) -> dict[str, Any]:
    """One job of a many-job report: its parameters that are not None."""
    element: dict[str, Any] = {"jobID": job_id}
    if lease_id is not None:
        element["leaseID"] = lease_id
    element |= {name: value for name, value in params.items() if value is not None}
    return element


def _reports(method: str, elements: list[dict[str, Any]]) -> Call[list[FinishResult]]:
    if not 1 <= len(elements) <= MAX_FINISH_JOBS:
        raise ValueError(
            f"{method} takes 1 to {MAX_FINISH_JOBS} jobs, not {len(elements)}"
        )
    return Call(method, {"jobs": elements}, _finish_results(len(elements)))


def touch_job(job_id: int, lease_id: str | None, lease: int | None = None) -> Call[str | None]:
    """Show a handed-out job is still being worked on; returns by when it
    must next be reported on. A leased (RUNQUEUED) job's lease is extended
    to retryAfter (or the lease its taker asked for) from now: the new end
    of the lease, its nextRun. `lease` (seconds) replaces the one its taker
    asked for, from this renewal on; a job's retryAfter wins. A RUNNING
    job's stale-job count starts again: when it would be presumed lost
    (staleAt), or None if the server never presumes so (--stale-after 0)."""
    return Call(
        "TouchJob", {"jobID": job_id, "leaseID": lease_id, "lease": lease}, _report_deadline
    )


def _report_deadline(reply: Reply) -> str | None:
    body = reply_object(reply)
    deadline = body.get("nextRun", body.get("staleAt"))
    if not (deadline is None or isinstance(deadline, str)):
        raise ValueError(f"a deadline that is {_shown(deadline)}")
    return deadline
