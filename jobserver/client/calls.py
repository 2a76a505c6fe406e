"""What each command sends and what its reply means, shared by every client.

Each function here builds the `Call` for the client method of the same
name; its docstring is that method's, on Client and the async clients alike
(`documented_by`), so they all say the same thing from one place.

Here are the `Call` itself (whether it may be sent again, how long the
server may hold it, its reply's meaning) and the calls of a job's life up
to its hand-out: create, get, update, query, cancel, delete, and replies.
What a worker reports of a job it was handed is in report_calls.py, an
operator's commands in operating_calls.py; a batch's in batches.py,
AwaitJob's in await_calls.py.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

from jobserver.client.errors import OutcomeUnknown, error_for
from jobserver.wire.client_framing import Reply
from jobserver.wire.limits import DEFAULT_WAIT_MS, MAX_DEPENDENCIES, MAX_JOB_ID, MAX_WAIT_MS

T = TypeVar("T")
Method = TypeVar("Method", bound=Callable[..., Any])
# A time for firstRun or nextRun: text the server reads (protocol.md 4.3),
# or a timezone-aware datetime.
When = str | datetime

# Commands that change nothing, so sending one twice does no harm.
_READ_ONLY = frozenset(
    {"queryjob", "ping", "status", "queues", "query", "history", "runningjobs"}
)
# Commands that hand jobs out: sent again, they may hand out more, but a
# job handed out in a reply that never arrived is not run twice: the server
# puts it back when the reply cannot be delivered; otherwise (the node
# died, or the reply was lost on the way) it comes back when its lease
# (retryAfter) or --stale-after runs out.
_HAND_OUT = frozenset({"getjob", "getjobs"})
# What reading a reply's body raises when it is not what its command
# answers: JSON that does not parse (or nests past the stack), a field
# missing or of another type. `Call.outcome` turns them into UnreadableReply.
_UNREADABLE = (ValueError, KeyError, TypeError, IndexError, RecursionError)


class UnreadableReply(Exception):
    """A reply's body is not what its command answers; the client says so
    as a MalformedReply, naming the server."""


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request, and how to turn its reply into the method's result."""

    method: str
    params: dict[str, object]
    result: Callable[[Reply], T]
    # GetJob/GetJobs: what `404 No job found`, an empty queue, returns.
    none_found: Callable[[], T] | None = None
    # How long the server may work on it before it answers (Backup).
    held: float = 0.0
    # Changes nothing, whatever its command (keys_probe): sent again freely.
    harmless: bool = False

    def outcome(self, reply: Reply, earlier_lost: bool = False) -> T:
        """The method's result, or the exception for a refusal. After a try
        whose reply was lost (`earlier_lost`), a 5xx to a write sent again
        under its idempotency key says nothing of that first try, which
        may have been carried out: OutcomeUnknown, naming the key."""
        if reply.code == 404 and self.none_found is not None:
            return self.none_found()
        if not 200 <= reply.code <= 299:
            key = self.params.get("idempotencyKey")
            if earlier_lost and key and reply.code >= 500:
                raise OutcomeUnknown(
                    reply.status,
                    "the reply to an earlier try was lost, and it may have been carried "
                    f"out: send it again with idempotency key {key}",
                )
            # A refusal's detail, if any, is in its `error` header (protocol.md 2).
            raise error_for(reply.status, reply.headers.get("error"))
        try:
            return self.result(reply)
        except _UNREADABLE as error:
            answered = f"{self.verb} answered {_shown(reply.status)}"
            raise UnreadableReply(f"{answered}: {error}") from error

    @property
    def verb(self) -> str:
        return self.method.split(" ", 1)[0]

    @property
    def read_only(self) -> bool:
        """Whether sending it twice does no harm."""
        return self.method.split(" ", 1)[0].lower() in _READ_ONLY

    @property
    def repeatable(self) -> bool:
        """Whether it may be sent again after its connection broke: no work
        is done twice if the first was carried out."""
        return (
            self.harmless
            or self.read_only
            or self.method.split(" ", 1)[0].lower() in _HAND_OUT
        )

    @property
    def keyed(self) -> bool:
        """A create under an idempotency key: it may be sent again to a
        server that keeps keys, which creates nothing twice."""
        return bool(self.params.get("idempotencyKey"))

    @property
    def wait_seconds(self) -> float:
        """How long the server may hold this request before it answers."""
        lowered = {name.lower(): value for name, value in self.params.items()}
        if str(lowered.get("connection")).lower() != "wait":
            return self.held
        timeout = lowered.get("timeout")
        if timeout is None or timeout == "":
            return DEFAULT_WAIT_MS / 1000
        try:
            millis = int(str(timeout))
        except ValueError:
            return 0.0  # refused at once with 402 Malformed timeout
        return min(max(millis, 0), MAX_WAIT_MS) / 1000


def documented_by(build: Callable[..., Call[Any]]) -> Callable[[Method], Method]:
    """Give a client method the docstring of the function building its call."""

    def document(method: Method) -> Method:
        method.__doc__ = build.__doc__
        return method

    return document


def _reply(reply: Reply) -> Reply:
    return reply


def _nothing(reply: Reply) -> None:
    return None


def reply_object(reply: Reply) -> dict[str, Any]:
    """A reply's body, which every command answers with a JSON object: a
    list, a number or null would fail a reader's `.get` with an error no
    caller expects (an AttributeError ended a worker)."""
    body = reply.json()
    if not isinstance(body, dict):
        raise ValueError(f"a body that is not an object: {_shown(body)}")
    return body


def _body(reply: Reply) -> dict[str, Any]:
    return reply_object(reply)


def _field(name: str) -> Callable[[Reply], Any]:
    return lambda reply: reply_object(reply)[name]


def _no_job() -> None:
    return None


def _job(value: object) -> dict[str, Any]:
    """A job object as GetJob hands it out, checked for what every worker
    relies on: a jobID (its running jobs are kept by it) and a name (its
    handler is picked by it)."""
    if not isinstance(value, dict):
        raise ValueError(f"a job that is not an object: {_shown(value)}")
    job_id, name = value.get("jobID"), value.get("name")
    if type(job_id) is not int or not 1 <= job_id <= MAX_JOB_ID:
        raise ValueError(f"a job whose jobID is {_shown(job_id)}")
    if not isinstance(name, str):
        raise ValueError(f"job {job_id}, whose name is {_shown(name)}")
    return value


def _one_job(reply: Reply) -> dict[str, Any]:
    return _job(reply_object(reply))


def _jobs(reply: Reply) -> list[dict[str, Any]]:
    jobs = reply_object(reply)["jobs"]
    if not isinstance(jobs, list):
        raise ValueError(f"jobs that are not a list: {_shown(jobs)}")
    return [_job(job) for job in jobs]


def _shown(value: object) -> str:
    """A value from a reply, cut short for a message: it came from a peer."""
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


def _time_text(when: When | None) -> str | None:
    if not isinstance(when, datetime):
        return when
    if when.tzinfo is None:
        raise ValueError("a naive datetime is ambiguous: give one with a time zone")
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _wait_params(wait: float | None) -> dict[str, object]:
    if wait is None:
        return {}
    return {"Connection": "wait", "timeout": round(wait * 1000)}


def _on_job(method: str, job_id: int, **params: object) -> Call[None]:
    return Call(method, {"jobID": job_id, **params}, _nothing)


def request(method: str, params: Mapping[str, object]) -> Call[Reply]:
    """Send any command; parameters that are None are left out. Returns
    a 2xx reply and raises JobServerError for any other."""
    return Call(method, dict(params), _reply)


def create_job(
    name: str,
    data: dict[str, Any] | None,
    first_run: When | None,
    repeat: str | None,
    priority: int | None,
    retry_after: str | None,
    unique: bool,
    parent_job_id: int | None,
    max_attempts: int | None,
    retry_backoff: str | None,
    retry_delay: float | None,
    retry_max_delay: float | None,
    cost: int | None,
    time_windows: str | None,
    time_zone: str | None,
    overwrite: bool,
    idempotency_key: str | None,
    key: str | None,
    depends_on: Sequence[int] | None = None,
    on_dependency_failure: str | None = None,
) -> Call[int]:
    """Create a job; returns its jobID. `max_attempts` gives it a retry
    policy: FailJob queues it again after `retry_delay` seconds
    (`retry_backoff` "fixed" or "exponential", the latter capped at
    `retry_max_delay`) until that many attempts have failed. `cost` is what
    it counts against concurrency limits; `time_windows`
    ("01:00-05:00,22:00-23:30") keep it to those hours of `time_zone` (an
    IANA name, default UTC), which is also the zone of a CRON `repeat`
    ("CRON 0 9 * * MON-FRI", protocol.md 6.1). `key` says whose job it is
    (a tenant, a customer; at most 255 bytes, no control characters), for
    limits set `per_key` or `fair` (set_limit). With `unique`, the oldest job
    of this name is reused, `data` merged into its data unless `overwrite`
    is False. With `depends_on` (at most 1,000 jobIDs, protocol.md 14.25)
    it waits, BLOCKED, until each of those jobs has ended, and runs if all
    FINISHED; if one did not, `on_dependency_failure` says what it does:
    "fail" (the server's default), "cancel", or "run" anyway.

    The request carries an idempotency key (protocol.md 14.22):
    `idempotency_key`, or a random one. Under it the job is created once
    however often the request is sent, so a reply lost on a broken
    connection is asked for again, once, on a new connection (to another
    node, if there is one). Give your own key (an order ID, a UUID you
    keep) to send it again yourself later, after a ConnectionFailed or an
    OutcomeUnknown, without creating the job twice. `idempotency_key=""`
    sends none: the server keeps no row for it (a key costs a lone create
    a quarter of its throughput or so, bench/idempotency_cost.py), and a
    lost reply is then ConnectionFailed."""
    params: dict[str, object] = {
        "name": name,
        "data": data,
        "firstRun": _time_text(first_run),
        "repeat": repeat,
        "jobPriority": priority,
        "retryAfter": retry_after,
        # Flags that are off are left out: absent means false to the server.
        "unique": unique or None,
        "parentJobID": parent_job_id,
        "maxAttempts": max_attempts,
        "retryBackoff": retry_backoff,
        "retryDelay": retry_delay,
        "retryMaxDelay": retry_max_delay,
        "cost": cost,
        "timeWindows": time_windows,
        "timeZone": time_zone,
        "key": key,
        "dependsOn": _dependencies(depends_on),
        "onDependencyFailure": on_dependency_failure,
        # Absent means true: only the refusal to overwrite is sent.
        "overwrite": None if overwrite else False,
        "idempotencyKey": _key(idempotency_key),
    }
    return Call("CreateJob", params, _field("jobID"))


def create_jobs(jobs: list[dict[str, Any]], idempotency_key: str | None) -> Call[list[int]]:
    """Create several jobs, all or none. Each dict holds CreateJob's
    parameters by their protocol names (`name`, `data`, `jobPriority`,
    `key`...). An idempotency key goes with the request as with create_job: the
    jobs are created once however often it is sent."""
    params: dict[str, object] = {
        "jobs": jobs, "idempotencyKey": _key(idempotency_key),
    }
    return Call("CreateJobs", params, _field("jobIDs"))


def _dependencies(job_ids: Sequence[int] | None) -> list[int] | None:
    """`depends_on` as sent, checked as the server would check it first."""
    listed = list(job_ids or ())
    if not listed:
        return None
    if len(listed) > MAX_DEPENDENCIES:
        raise ValueError(f"depends_on holds at most {MAX_DEPENDENCIES} jobIDs, not {len(listed)}")
    if not all(isinstance(job_id, int) and not isinstance(job_id, bool) for job_id in listed):
        raise ValueError(f"depends_on that is not a list of jobIDs: {_shown(listed)}")
    return listed


def _key(given: str | None) -> str | None:
    """The key a create is sent with: the caller's, a random one for None,
    none for "" (a caller that never sends a create again, and saves the
    server the key's row)."""
    if given is None:
        return new_idempotency_key()
    return given or None


def keys_probe() -> Call[Reply]:
    """A request that creates nothing (`401 Invalid JSON`) and shows whether
    the server keeps idempotency keys (client/endpoint.py)."""
    return Call("CreateJobs", {"jobs": [], "idempotencyKey": "probe"}, _reply, harmless=True)


def new_idempotency_key() -> str:
    """A key no other request has: 128 random bits."""
    return secrets.token_hex(16)


def get_job(
    name: str, wait: float | None, priority: int | None, lease: int | None = None
) -> Call[dict[str, Any] | None]:
    """Take a due job whose name matches the pattern; None if there is
    none. With `wait`, wait up to that many seconds for one. With `lease`,
    a job without retryAfter is due again that many seconds from now unless
    renewed (touch_job) or reported (protocol.md 14.24)."""
    params = {
        "name": name, "jobPriority": priority, "includeLeaseID": True, "lease": lease,
        **_wait_params(wait),
    }
    return Call("GetJob", params, _one_job, _no_job)


def get_jobs(
    name: str,
    num_results: int,
    wait: float | None,
    priority: int | None,
    lease: int | None = None,
) -> Call[list[dict[str, Any]]]:
    """Take up to `num_results` due jobs; an empty list if there are none.
    `lease` as for get_job."""
    params: dict[str, object] = {
        "name": name,
        "numResults": num_results,
        "jobPriority": priority,
        "includeLeaseID": True,
        "lease": lease,
    }
    params.update(_wait_params(wait))
    return Call("GetJobs", params, _jobs, list)


def update_job(
    job_id: int,
    data: dict[str, Any],
    repeat: str | None,
    priority: int | None,
    next_run: When | None,
    lease_id: str | None,
    clear_repeat: bool,
    time_zone: str | None = None,
) -> Call[None]:
    """Replace a job's data; optionally its repeat, priority and next run.
    `clear_repeat` makes it run once (it wins over `repeat`). `time_zone`
    (IANA) is the zone of its time windows and CRON rule: a CRON job's next
    run moves into it (protocol.md 5.6)."""
    params: dict[str, object] = {
        "jobID": job_id,
        "data": data,
        "repeat": repeat,
        "shouldClearRepeat": clear_repeat or None,
        "jobPriority": priority,
        "nextRun": _time_text(next_run),
        "leaseID": lease_id,
        "timeZone": time_zone,
    }
    return Call("UpdateJob", params, _nothing)


def query_job(job_id: int) -> Call[dict[str, Any]]:
    """A job as it is, state included."""
    return Call("QueryJob", {"jobID": job_id}, _body)


def await_reply(
    job_id: int,
    key: str,
    timeout: int | None,
    lease_id: str | None,
    data: dict[str, Any] | None,
) -> Call[dict[str, Any]]:
    """Park a handed-out job until a reply for `key` is delivered, or
    `timeout` seconds (default a day) pass. Returns {"state": "WAITING",
    "replyDeadline": ...}, or {"state": "QUEUED"} when the reply had
    already come. Conflict (409) if another job waits on `key`."""
    params = {"jobID": job_id, "key": key, "timeout": timeout, "leaseID": lease_id, "data": data}
    return Call("AwaitReply", params, _body)


def deliver_reply(key: str, data: dict[str, Any]) -> Call[dict[str, Any]]:
    """Deliver the reply for `key`: {"jobID": N} for the job that waited
    on it, or {"expires": ...} when it is kept for a job to await it.
    JobNotFound (404) if this key's reply was delivered already."""
    return Call("DeliverReply", {"key": key, "data": data}, _body)


def cancel_job(job_id: int, running: bool = False) -> Call[None]:
    """Cancel a child job: a QUEUED, RUNQUEUED or FAILED child becomes
    CANCELLED, and a PAUSED parent left with nothing to wait for is queued.
    A FINISHED, RUNNING or PAUSED child is left as it is. With `running`,
    any RUNNING or RUNQUEUED job, a child or not, is cancelled: its worker's
    next report raises JobCancelled and the job ends CANCELLED (protocol.md
    14.26)."""
    return _on_job("CancelJob", job_id, running=True if running else None)


def cancelled_jobs(job_ids: Sequence[int]) -> Call[list[int]]:
    """Of these jobs (a worker's running ones, at most 1,000), the jobIDs of
    those whose cancel is pending (protocol.md 14.26): a read, cheaper than
    a lease renewal, after which a TouchJob of each ends it (410)."""
    return Call("CancelledJobs", {"jobIDs": ",".join(map(str, job_ids))}, _job_ids)


def _job_ids(reply: Reply) -> list[int]:
    ids = reply_object(reply)["jobIDs"]
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise ValueError(f"jobIDs that are not a list of integers: {_shown(ids)}")
    return ids


def delete_job(job_id: int) -> Call[None]:
    """Delete a job that is not RUNNING or PAUSED; its children stay."""
    return _on_job("DeleteJob", job_id)


