"""What a handler is given, and what it may raise: `Job`, `RetryLater`."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from jobserver.wire.limits import MAX_DELAY


class LeaseRenewal(Protocol):
    """How a job asks for its lease to be renewed (leases.py), and the
    token of that lease: the newest hand-out's, should the job be handed
    out again while it runs here (runner.py)."""

    lease_id: str | None
    # Set when the server answers 410 Job cancelled (leases.py).
    cancelled: threading.Event

    def renew(self) -> None: ...


class ClientSource(Protocol):
    """Where a job's `client` comes from (connection.JobClient)."""

    def get(self) -> Any: ...


@dataclass(frozen=True)
class Job:
    """A job as GetJobs handed it out, for a handler that asks for it.

    `attempt` and `max_attempts` are None for a job without a retry policy
    (protocol.md 14.1); `lease_id` is the lease token its report carries;
    `raw` is the whole job object (`parentData`, `finishedChildJobs`, ...)."""

    id: int
    name: str
    data: dict[str, Any]
    attempt: int | None
    max_attempts: int | None
    retry_after: str
    raw: dict[str, Any] = field(repr=False)
    lease: LeaseRenewal = field(repr=False, compare=False)
    # Its handler's retry policy, sent with a failure if the job has none
    # of its own (registry.Worker.handler).
    handler_policy: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # Where `client` comes from (connection.JobClient); None outside a worker.
    clients: ClientSource | None = field(default=None, repr=False, compare=False)

    @classmethod
    def handed_out(cls, raw: dict[str, Any], lease: LeaseRenewal) -> Job:
        data = raw.get("data")
        return cls(
            id=raw["jobID"],
            name=raw["name"],
            data=data if isinstance(data, dict) else {},
            attempt=raw.get("attempt"),
            max_attempts=raw.get("maxAttempts"),
            retry_after=raw.get("retryAfter") or "",
            raw=raw,
            lease=lease,
        )

    @property
    def lease_id(self) -> str | None:
        """The token of the job's lease: its hand-out's, or a later one's
        if the server handed the job out again while it ran here."""
        return self.lease.lease_id

    @property
    def client(self) -> Any:
        """A client of the worker's server, to enqueue jobs with (or any
        other command): the worker's addresses and token; a blocking
        `jobserver.client.Client` in a thread handler, an `AsyncClient`
        (await its methods) in an async one. Made on first use, one per
        job, closed when the handler ends."""
        if self.clients is None:
            raise RuntimeError("this job was not handed to a handler by a worker")
        return self.clients.get()

    @property
    def cancelled(self) -> threading.Event:
        """Set once the server said the job was cancelled while it ran
        (CancelJob with running: true, protocol.md 14.26): at its next lease
        renewal, a third of the way through its lease (10 s with the default
        --lease 30) or every --touch-interval. A thread handler checks it
        (`job.cancelled.is_set()`, or waits on it) and returns; an async
        handler's task is cancelled as well. Either way its result is not
        reported: the server has ended the job."""
        return self.lease.cancelled

    def renew_lease(self) -> None:
        """Renew the job's lease now (TouchJob), from a handler's thread or
        its task; returns at once, the renewal is sent in the background.
        Leases are renewed on their own too (a third of the way through);
        for a job without retryAfter, it is a sign of life for the server's
        --stale-after."""
        self.lease.renew()


class RetryLater(Exception):
    """Raised by a handler: put the job back to run again later (RetryJob),
    after `delay` seconds or at `next_run` (a datetime with a time zone, or
    the protocol's time text), ahead of the job's repeat; with
    neither, when the server decides (its repeat, else at once). Not a
    failed attempt: a job with a retry policy gets all its attempts again."""

    def __init__(self, delay: int | None = None, *, next_run: datetime | str | None = None) -> None:
        if delay is not None and next_run is not None:
            raise ValueError("RetryLater takes a delay or a next_run, not both")
        if delay is not None and not (type(delay) is int and 0 <= delay <= MAX_DELAY):
            raise ValueError(f"RetryLater's delay must be whole seconds from 0 to {MAX_DELAY}")
        if isinstance(next_run, datetime) and next_run.tzinfo is None:
            raise ValueError("RetryLater's next_run is a naive datetime: give it a time zone")
        super().__init__(delay if next_run is None else next_run)
        self.delay = delay
        self.next_run = next_run

    def params(self) -> dict[str, Any]:
        """RetryJob's parameters."""
        if self.next_run is not None:
            return {"next_run": self.next_run, "ignore_repeat": True}
        if self.delay is not None:
            return {"delay": self.delay, "ignore_repeat": True}
        return {}

    def text(self) -> str:
        """How the log says it."""
        if self.next_run is not None:
            return f"nextRun {self.next_run}"
        return "no delay" if self.delay is None else f"delay {self.delay}s"
