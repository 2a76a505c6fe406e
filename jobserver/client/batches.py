"""Batches: N jobs and a completion job that runs once every one of them
has ended (protocol.md 14.25), what the clients' `create_batch` sends and
what `batch_progress` reads, written once for every client as calls.py is.

A batch is nothing the server keeps apart: it is one CreateJobs whose last
element depends on all the others (`"dependsOn": ["#0", ..., "#N-1"]`,
`"onDependencyFailure": "run"`), so the whole batch is created, or none of
it, in one transaction. The completion job is BLOCKED until the last job
of the batch ends (FINISHED, FAILED for good, CANCELLED or deleted), then
queued, and handed out with `dependencies`: each job's jobID, final state
and data. Its QueryJob counts them (`dependencyCounts`): that is the
batch's progress.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from jobserver.client.calls import Call, _key, reply_object
from jobserver.wire.client_framing import Reply
from jobserver.wire.limits import MAX_DEPENDENCIES

# A batch holds at most as many jobs as one job may depend on: its
# completion job depends on each. A larger one is refused before sending
# (ValueError): split it, or give each part a completion job of its own.
MAX_BATCH = MAX_DEPENDENCIES
# What the completion job does when a job of the batch does not finish:
# runs all the same (a batch's "finally"), unless `then` says otherwise.
DEFAULT_ON_FAILURE = "run"
# What a batch sets on its completion job itself.
_SET_BY_BATCH = "dependson"


class Batch(NamedTuple):
    """What create_batch created: the batch's jobIDs in the order given,
    and its completion job's (`then_id`)."""

    job_ids: list[int]
    then_id: int


@dataclass(frozen=True)
class BatchProgress:
    """How far a batch has come, from its completion job's QueryJob:
    `state` is the completion job's (BLOCKED while jobs of the batch are
    pending), the counts are of the batch's jobs."""

    job_id: int
    state: str
    total: int
    pending: int
    finished: int
    failed: int
    cancelled: int
    deleted: int

    @property
    def ended(self) -> int:
        """The jobs of the batch that have ended, whichever way."""
        return self.total - self.pending

    @property
    def unfinished(self) -> int:
        """The jobs that ended without finishing: failed, cancelled or deleted."""
        return self.failed + self.cancelled + self.deleted


def create_batch(
    jobs: Sequence[Mapping[str, Any]],
    then: str | Mapping[str, Any],
    idempotency_key: str | None,
) -> Call[Batch]:
    """Create a batch: `jobs` (each a dict of CreateJob's parameters by
    their protocol names, as create_jobs takes them) and a completion job,
    `then` (a name, or such a dict), that depends on every one of them with
    `onDependencyFailure: "run"`: it is handed out once each job of the
    batch has ended, whether it finished, failed, was cancelled or deleted,
    and carries `dependencies` (each job's jobID, final state and data).
    All are created in one request, all or none; returns a Batch of the
    jobIDs and the completion job's `then_id`.

    1 to 1,000 jobs (MAX_BATCH); more, none, a `then` without a name or
    with its own `dependsOn` is ValueError before sending. `then` may set
    `onDependencyFailure` itself (`"fail"` or `"cancel"`: it runs only if
    every job finished). A job of the batch may depend on another as
    `"#N"` (0-based in `jobs`). The batch is one request line: past its
    2 MiB the server refuses it whole (`414 Line too long`, a
    JobServerError). The idempotency key is as create_job's: the batch is
    created once however often the request is sent."""
    if not 1 <= len(jobs) <= MAX_BATCH:
        raise ValueError(f"create_batch takes 1 to {MAX_BATCH} jobs, not {len(jobs)}")
    completion = completion_job(then, len(jobs))
    elements = [dict(job) for job in jobs] + [completion]
    params: dict[str, object] = {"jobs": elements, "idempotencyKey": _key(idempotency_key)}
    return Call("CreateJobs", params, lambda reply: _batch(reply, len(jobs)))


def completion_job(then: str | Mapping[str, Any], count: int) -> dict[str, Any]:
    """The completion job's element of a batch's CreateJobs: `then`,
    depending on the `count` jobs before it; ValueError as create_batch's."""
    job: dict[str, Any] = {"name": then} if isinstance(then, str) else dict(then)
    # CreateJobs reads its elements' keys in any case (protocol.md 5.2).
    lowered = {key.lower() for key in job}
    if "name" not in lowered:
        raise ValueError('then needs a name: a string, or a dict with "name"')
    if _SET_BY_BATCH in lowered:
        raise ValueError("then's dependsOn is the batch's jobs: create_batch sets it")
    job["dependsOn"] = [f"#{index}" for index in range(count)]
    if "ondependencyfailure" not in lowered:
        job["onDependencyFailure"] = DEFAULT_ON_FAILURE
    return job


def _batch(reply: Reply, count: int) -> Batch:
    ids = reply_object(reply)["jobIDs"]
    if not isinstance(ids, list) or len(ids) != count + 1:
        raise ValueError(f"{count + 1} jobIDs expected, not {ids!r:.100}")
    return Batch(ids[:-1], ids[-1])


def batch_progress(job_id: int) -> Call[BatchProgress]:
    """How far the batch of completion job `job_id` has come: its state and
    the batch's jobs counted by how they ended (pending, finished, failed,
    cancelled, deleted), from its QueryJob's `dependencyCounts`.
    JobNotFound once the completion job is gone (finished and deleted). A
    job that depends on nothing counts 0 of each."""
    return Call("QueryJob", {"jobID": job_id}, _progress)


def _progress(reply: Reply) -> BatchProgress:
    body = reply_object(reply)
    # A job without dependencies has no counts: 0 of each.
    counts = body.get("dependencyCounts") or dict.fromkeys(_COUNTS, 0)
    return BatchProgress(
        job_id=_count(body["jobID"]),
        state=str(body["state"]),
        **{name: _count(counts[name]) for name in _COUNTS},
    )


_COUNTS = ("total", "pending", "finished", "failed", "cancelled", "deleted")


def _count(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"a count that is {value!r:.100}")
    return value
