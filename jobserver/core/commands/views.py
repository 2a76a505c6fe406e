"""Jobs as replies show them: the JSON objects of QueryJob, GetJob and
FailedJobs, and the reply that hands jobs out."""

from __future__ import annotations

from typing import Any

from jobserver.core.rules import dependencies
from jobserver.model.jobs import ENDED_CHILDREN, Job, State
from jobserver.storage.interface import Storage
from jobserver.wire import jsonbody
from jobserver.wire.framing import Response
from jobserver.wire.jsonbody import Raw, quote

OK = "200 OK"


def ok(body: Any = None) -> Response:
    return Response(OK, b"" if body is None else jsonbody.encode(body))


def job_object(job: Job, with_state: bool = False) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "created": job.created,
        "data": Raw(job.data),
        "jobID": job.jobID,
        "lastRun": job.lastRun or "",
        "name": job.name,
        "nextRun": job.nextRun,
        "priority": job.priority,
        "repeat": job.repeat,
        "retryAfter": job.retryAfter,
    }
    if with_state:
        obj["state"] = str(job.state)
        if job.maxAttempts:
            # Only jobs with a policy: Bedrock's ten keys stay as they are.
            obj["attempt"] = job.attempts
            obj["maxAttempts"] = job.maxAttempts
            obj["lastError"] = job.lastError
            obj["retryBackoff"] = job.retryBackoff
            obj["retryDelay"] = _number(job.retryDelay)
            obj["retryMaxDelay"] = _number(job.retryMaxDelay)
    if with_state and job.dependencies and job.lastError:
        # Which dependency ended it (protocol.md 14.25).
        obj["lastError"] = job.lastError
    if with_state and job.state == State.WAITING:
        # The deadline is the nextRun; named again so nobody has to know.
        obj["replyKey"] = job.replyKey
        obj["replyDeadline"] = job.nextRun
    # Flow control, only for jobs that use it.
    if job.cost != 1:
        obj["cost"] = job.cost
    if job.timeWindows:
        obj["timeWindows"] = job.timeWindows
    if job.timeZone:
        # A job with windows always has one; a CRON repeat may have one alone.
        obj["timeZone"] = job.timeZone
    if job.key:
        obj["key"] = job.key
    return obj


# How many keys job_object always writes: a reply object with no more is a
# plain job's, which `handout_json` writes from a template.
_PLAIN_KEYS = 9


def handout_json(obj: dict[str, Any]) -> bytes:
    """A handed-out job's reply object as jsonbody.encode writes it. A
    plain job's (job_object's keys alone, the common hand-out) is written
    from a template of its keys in their sorted order: encoding the dict
    key by key cost 50,000 instructions a GetJob, the template 9,000
    (callgrind)."""
    if len(obj) != _PLAIN_KEYS:
        return jsonbody.encode(obj)
    q = quote
    return (
        f'{{"created":{q(obj["created"])},"data":{obj["data"]},"jobID":{obj["jobID"]},'
        f'"lastRun":{q(obj["lastRun"])},"name":{q(obj["name"])},'
        f'"nextRun":{q(obj["nextRun"])},"priority":{obj["priority"]},'
        f'"repeat":{q(obj["repeat"])},"retryAfter":{q(obj["retryAfter"])}}}'
    ).encode()


def _number(value: float) -> int | float:
    """Seconds as the client most likely wrote them: 30, not 30.0."""
    return int(value) if value.is_integer() else value


def handout_object(store: Storage, job: Job) -> dict[str, Any]:
    """A job as GetJob hands it out: with its parent's data, and the data
    of its children that ended."""
    obj = job_object(job)
    if job.parentJobID:
        parent = store.get(job.parentJobID)
        obj["parentJobID"] = job.parentJobID
        obj["parentData"] = Raw(parent.data if parent else "{}")
    done = store.children(job.jobID, ENDED_CHILDREN)
    if done:
        finished = [c for c in done if c.state == State.FINISHED]
        cancelled = [c for c in done if c.state == State.CANCELLED]
        obj["finishedChildJobs"] = [_child(c) for c in finished]
        obj["cancelledChildJobs"] = [_child(c) for c in cancelled]
    if job.dependencies:
        obj["dependencies"] = dependencies.handout_entries(store, job)
    return obj


def _child(job: Job) -> dict[str, Any]:
    return {"data": Raw(job.data), "jobID": job.jobID}


def failed_object(job: Job) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "created": job.created,
        "jobID": job.jobID,
        "lastError": job.lastError,
        "lastRun": job.lastRun or "",
        "name": job.name,
    }
    if job.maxAttempts:
        obj["attempt"] = job.attempts
        obj["maxAttempts"] = job.maxAttempts
    return obj
