"""Delivering reports (FinishJob, RetryJob, FailJob, AwaitReply) to the
server: one task sends them in order, over a connection of its own, holding
them while the server cannot be reached.

What happens to a report after each attempt is decided by POLICY below:
the server's answer (or the lack of one) -> what to do with the report, and
what to log. Every report carries its job's lease token, so a result for a
job that has since been handed to another worker is refused (409) and
dropped.

FinishJob, FailJob and RetryJob reports that wait together at the head of
the queue (jobs that ended while a report was on its way, or while the
server was down) go as one FinishJobs, one FailJobs and one RetryJobs
(MANY), so that a burst of failures costs what a burst of successes
costs. The server answers each job on its own, and each answer that is
not a success goes through POLICY as the answer to that job's own report
would. For a request as a whole, POLICY decides as for its first report:
a SEND_AGAIN sends it again after the backoff wait; anything else sends
its reports one at a time. A server that does not know one of the three
(430) gets those reports alone from then on.

A job's lease is renewed until its report is done with (leases.py): a
report that waits behind others, or through an outage, is not refused
for a lease that ran out meanwhile."""

from __future__ import annotations

import enum
import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import trio

from jobserver.client import (
    Conflict,
    ConnectionFailed,
    Fail,
    Finish,
    FinishResult,
    IllegalState,
    InvalidRequest,
    JobCancelled,
    JobNotFound,
    JobServerError,
    OutcomeUnknown,
    Retry,
    ServerError,
    UnrecognizedCommand,
)
from jobserver.wire.limits import MAX_FINISH_JOBS
from jobserver.workers.connection import BACKOFF_MAX, Backoff, Link, Server
from jobserver.workers.contract import Report
from jobserver.workers.guard import Guard
from jobserver.workers.leases import Leases

log = logging.getLogger("jobserver.workers")

# A report refused with a 5xx other than 503 (the server's "unavailable") may
# be refused the same way forever (502 Failed to compute nextRun): after this
# many tries it is given up, so that it does not hold up the reports behind it.
REPORT_TRIES_ON_ERROR = 5

# What an attempt can end with, besides success.
Failure: TypeAlias = ConnectionFailed | JobServerError


class Action(enum.Enum):
    """What to do with a report the server did not take."""

    # Hold it (and those behind it), reconnect, and send it again after the
    # next backoff wait. Logged on the first failure of an outage only.
    SEND_AGAIN = enum.auto()
    # The same, but give it up (GIVING_UP, and count it lost) at the
    # REPORT_TRIES_ON_ERROR-th such answer.
    SEND_AGAIN_OR_GIVE_UP = enum.auto()
    # Send it again at once without the parameters the server refused.
    SEND_BARE = enum.auto()
    # Send a FailJob instead, with the refusal as the job's last error.
    FAIL_INSTEAD = enum.auto()
    # Forget it: the server has it already, or another worker has the job.
    DROP = enum.auto()
    # Forget it, and count it lost: the manager exits with status 1.
    GIVE_UP = enum.auto()


def _always(report: Report, error: Failure) -> bool:
    return True


def _unavailable(report: Report, error: Failure) -> bool:
    """503: the server is stopping or overloaded, and says so."""
    return isinstance(error, ServerError) and error.code == 503


def _await_key_taken(report: Report, error: Failure) -> bool:
    """A 409 to an AwaitReply that is not about the lease: another job waits
    on the key, so this job cannot wait, and must not stay RUNNING with
    nobody to report it."""
    return (
        report.verb == "await" and isinstance(error, Conflict) and error.reason != "Lease expired"
    )


def _uncertain(report: Report, error: Failure) -> bool:
    """An earlier attempt may have been applied before its connection broke."""
    return report.uncertain


def _has_parameters(report: Report, error: Failure) -> bool:
    return report.bare() != report


@dataclass(frozen=True)
class Rule:
    """For answers of type `answer` when `when` holds: the action, and the
    log line (a %-format over the fields of _fields())."""

    answer: type[Exception] | tuple[type[Exception], ...]
    when: Callable[[Report, Failure], bool]
    action: Action
    level: int
    message: str

    def matches(self, report: Report, error: Failure) -> bool:
        return isinstance(error, self.answer) and self.when(report, error)


_JOB = "job %(job)s %(name)s: "
# The first failure of an outage; then nothing until the server is back.
HOLDING = (
    "cannot report job %(job)s (%(error)s); holding %(held)d results, "
    "retrying with backoff up to %(backoff_max)gs"
)
GIVING_UP = _JOB + "giving up reporting %(command)s %(params)s after %(tries)d tries: %(status)s"

# The reporting policy: the first row that matches the answer wins.
POLICY: tuple[Rule, ...] = (
    # No answer: the server may be restarting. (A broken connection also
    # marks the report uncertain: the server may have applied it.) A 504
    # says the same of the server's database: uncertain, sent again.
    Rule((ConnectionFailed, OutcomeUnknown), _always, Action.SEND_AGAIN, logging.WARNING, HOLDING),
    # "Unavailable": the server says it will take it later.
    Rule(ServerError, _unavailable, Action.SEND_AGAIN, logging.WARNING, HOLDING),
    # Any other 5xx may be the same forever (502 Failed to compute nextRun).
    Rule(ServerError, _always, Action.SEND_AGAIN_OR_GIVE_UP, logging.WARNING, HOLDING),
    # Another job waits on the key: this one cannot wait, and must not stay
    # RUNNING with nobody to report it.
    Rule(
        Conflict, _await_key_taken, Action.FAIL_INSTEAD, logging.WARNING,
        _JOB + "AwaitReply refused (%(code)s %(reason)s); failing the job",
    ),
    # The lease moved on: another worker has the job, and reports it.
    Rule(
        Conflict, _always, Action.DROP, logging.WARNING,
        _JOB + "%(command)s refused (%(code)s %(reason)s): another worker has the job now; "
        "this result is dropped",
    ),
    # CancelJob with running: true (protocol.md 14.26): the server ended
    # the job CANCELLED at this report, and takes none.
    Rule(
        JobCancelled, _always, Action.DROP, logging.INFO,
        _JOB + "cancelled while it ran (%(code)s %(reason)s): its result is dropped",
    ),
    # No such job, or not RUNNING: after a lost reply, our own earlier try.
    Rule(
        (JobNotFound, IllegalState), _uncertain, Action.DROP, logging.INFO,
        _JOB + "already reported (%(code)s %(reason)s after a reply was lost)",
    ),
    Rule(
        (JobNotFound, IllegalState), _always, Action.DROP, logging.WARNING,
        _JOB + "the server refused %(command)s: %(code)s %(reason)s",
    ),
    # A parameter refused (data over 1 MiB, a bad nextRun): the result
    # still counts without it.
    Rule(
        InvalidRequest, _has_parameters, Action.SEND_BARE, logging.WARNING,
        _JOB + "the server refused %(command)s (%(code)s %(reason)s); sending it without data",
    ),
    Rule(
        InvalidRequest, _always, Action.DROP, logging.WARNING,
        _JOB + "the server refused %(command)s (%(code)s %(reason)s)",
    ),
    # Anything else the server will never take: the result is lost.
    Rule(
        JobServerError, _always, Action.GIVE_UP, logging.ERROR,
        _JOB + "the server refused %(command)s: %(status)s",
    ),
)


def rule_for(report: Report, error: Failure) -> Rule:
    """The POLICY row for this answer: there always is one, as both kinds
    of Failure have a row that takes them all."""
    return next(rule for rule in POLICY if rule.matches(report, error))


@dataclass
class Delivery:
    """One report on its way, through all its attempts."""

    report: Report
    backoff: Backoff = field(default_factory=Backoff)
    started: float = field(default_factory=trio.current_time)
    server_errors: int = 0  # 5xx answers other than 503


class Reporter:
    """The queue of reports, and the task that delivers them."""

    def __init__(self, server: Server, guard: Guard, leases: Leases) -> None:
        self.server = server
        self.guard = guard  # told of each job whose report is done with
        self.leases = leases  # renewed until the job's report is done with
        self.pending: deque[Report] = deque()  # the first are being delivered
        self.added = trio.Event()  # set (and replaced) when a report is queued
        self.closed = False  # no more reports will come
        self.scope = trio.CancelScope()  # its deadline ends delivery early
        self.given_up = 0  # reports the server would not take
        # The verbs the server takes many at a time (MANY).
        self.batching = set(MANY)

    def add(self, report: Report) -> None:
        self.pending.append(report)
        self.added.set()

    def close(self) -> None:
        """No more reports will come: deliver_loop returns once the queue is empty."""
        self.closed = True
        self.added.set()

    def give_up_in(self, seconds: float) -> None:
        """Stop delivering after `seconds`, whatever is still queued."""
        self.scope.deadline = trio.current_time() + seconds

    async def deliver_loop(self, done: trio.Event) -> None:
        """Deliver the reports in order until closed and empty (or the
        scope's deadline); `done` is set at the end."""
        link = Link(self.server, "reports")
        try:
            with self.scope:
                while True:
                    if not self.pending:
                        if self.closed:
                            return
                        self.added = trio.Event()
                        await self.added.wait()
                        continue
                    batch = self._batch()
                    if len(batch) > 1:
                        await self.deliver_batch(batch, link)
                        continue
                    report = self.pending[0]
                    await self.deliver(report, link)
                    self._done(report)
        finally:
            await link.aclose()
            done.set()

    async def deliver(
        self, report: Report, link: Link, refused: JobServerError | None = None
    ) -> None:
        """Send `report` until POLICY says it is done with it. `refused`: the
        server's answer to it as part of a FinishJobs, to act on first."""
        delivery = Delivery(report)
        error: Failure | None = refused
        while True:
            if error is None:
                try:
                    await _send(link, delivery.report)
                except (ConnectionFailed, JobServerError) as failure:
                    error = failure
                else:
                    self._log_back(delivery, f"job {report.job_id}")
                    return
            if isinstance(error, ConnectionFailed | OutcomeUnknown):
                # The server may have applied it before the connection
                # broke: a later 404 or 405 may mean it did.
                delivery.report.uncertain = True
            if not await self._follow(rule_for(delivery.report, error), delivery, error, link):
                return
            error = None

    def _batch(self) -> list[Report]:
        """The reports at the head of the queue that go many to a request,
        as many as one request of each verb takes."""
        batch: list[Report] = []
        counts = dict.fromkeys(MANY, 0)
        for report in self.pending:
            if not batchable(report, self.batching) or counts[report.verb] == MAX_FINISH_JOBS:
                break
            counts[report.verb] += 1
            batch.append(report)
        return batch

    async def deliver_batch(self, batch: list[Report], link: Link) -> None:
        """Send `batch` as one request per verb (FinishJobs, FailJobs,
        RetryJobs), then each report the server refused as POLICY says;
        remove each from the queue as it is done with."""
        for verb in MANY:
            group = [report for report in batch if report.verb == verb]
            if len(group) > 1:
                await self._deliver_many(group, link)
            elif group:
                await self.deliver(group[0], link)
                self._done(group[0])

    async def _deliver_many(self, group: list[Report], link: Link) -> None:
        delivery = Delivery(group[0])
        while True:
            try:
                results = await send_many(link.client, group)
            except (ConnectionFailed, JobServerError) as error:
                if isinstance(error, ConnectionFailed | OutcomeUnknown):
                    for report in group:
                        report.uncertain = True
                rule = rule_for(group[0], error)
                if rule.action is Action.SEND_AGAIN:
                    if not delivery.backoff.failing:
                        log.log(rule.level, rule.message, self._fields(group[0], error))
                    await link.reconnect()
                    await trio.sleep(delivery.backoff.next())
                    continue
                stop_batching_if_unknown(self.batching, group[0], error, self.server.address)
                for report in group:
                    await self.deliver(report, link)
                    self._done(report)
                return
            self._log_back(delivery, f"job {group[0].job_id} and {len(group) - 1} more")
            for report, result in zip(group, results, strict=True):
                refused = result.error()
                if refused is not None:
                    await self.deliver(report, link, refused)
                self._done(report)
            return

    def _done(self, report: Report) -> None:
        """A report is done with (delivered, dropped or given up): its job
        is no longer the guard's to hand back, nor its lease to renew."""
        for index, queued in enumerate(self.pending):
            if queued is report:
                del self.pending[index]
                break
        self.guard.done(report.job_id)
        if report.lease_id is not None:
            self.leases.release(report.lease_id)

    def _log_back(self, delivery: Delivery, what: str) -> None:
        """After an outage, say that the server took reports again."""
        if delivery.backoff.failing:
            log.info(
                "server %s reachable again; reported %s after %.1fs",
                self.server.address,
                what,
                trio.current_time() - delivery.started,
            )

    def _fields(self, report: Report, error: Failure) -> dict[str, Any]:
        return _fields(report, error) | {"held": len(self.pending)}

    async def _follow(self, rule: Rule, delivery: Delivery, error: Failure, link: Link) -> bool:
        """Do what `rule` says with the report; whether to send it again."""
        report = delivery.report
        fields = self._fields(report, error)
        if rule.action is Action.SEND_AGAIN_OR_GIVE_UP:
            delivery.server_errors += 1
            if delivery.server_errors >= REPORT_TRIES_ON_ERROR:
                log.error(GIVING_UP, fields | {"tries": delivery.server_errors})
                self.given_up += 1
                return False
        if rule.action in (Action.SEND_AGAIN, Action.SEND_AGAIN_OR_GIVE_UP):
            if not delivery.backoff.failing:
                log.log(rule.level, rule.message, fields)
            await link.reconnect()
            await trio.sleep(delivery.backoff.next())
            return True
        log.log(rule.level, rule.message, fields)
        if rule.action is Action.SEND_BARE:
            delivery.report = report.bare()
            return True
        if rule.action is Action.FAIL_INSTEAD:
            delivery.report = report.failing(fields["status"])
            return True
        if rule.action is Action.GIVE_UP:
            self.given_up += 1
        return False  # dropped or given up: done with it

    def log_unreported(self) -> None:
        for report in self.pending:
            log.error(
                "job %s %s: result not reported (the server may or may not have it): %s %s",
                report.job_id,
                report.name,
                report.command,
                json.dumps(report.params),
            )


@dataclass(frozen=True)
class Many:
    """The request that carries many reports of one verb: the client
    method, the element each report becomes, and the parameters an element
    can carry (a report with another goes alone)."""

    method: str
    element: Callable[..., Any]
    params: frozenset[str]
    command: str


# A handler's retry policy, sent with its failures (the Python worker's).
RETRY_POLICY = ("max_attempts", "retry_backoff", "retry_delay", "retry_max_delay")
MANY: dict[str, Many] = {
    "finish": Many("finish_jobs", Finish, frozenset({"data"}), "FinishJobs"),
    "fail": Many("fail_jobs", Fail, frozenset({"error", "data", *RETRY_POLICY}), "FailJobs"),
    "retry": Many(
        "retry_jobs", Retry, frozenset({"delay", "next_run", "data", "ignore_repeat"}), "RetryJobs"
    ),
}


def batchable(report: Report, verbs: set[str]) -> bool:
    """Whether `report` may go with others of its verb (one of `verbs`)."""
    many = MANY.get(report.verb)
    return many is not None and report.verb in verbs and set(report.params) <= many.params


async def send_many(client: Any, reports: list[Report]) -> list[FinishResult]:
    """Reports of one verb, in one request of `client` (a TrioClient or an
    AsyncClient); a result for each, in order."""
    many = MANY[reports[0].verb]
    elements = [many.element(r.job_id, r.lease_id, **r.params) for r in reports]
    results: list[FinishResult] = await getattr(client, many.method)(elements)
    return results


def stop_batching_if_unknown(verbs: set[str], report: Report, error: Failure, server: str) -> None:
    """A server that does not know a many-report command (430) gets those
    reports one at a time from then on."""
    if isinstance(error, UnrecognizedCommand) and report.verb in verbs:
        log.warning(
            "server %s does not take %s (%s); reporting each job alone",
            server, MANY[report.verb].command, error.status,
        )
        verbs.discard(report.verb)


async def _send(link: Link, report: Report) -> None:
    send = getattr(link.client, report.method)
    await send(report.job_id, lease_id=report.lease_id, **report.params)


def _fields(report: Report, error: Failure) -> dict[str, Any]:
    """What the log lines of POLICY may name."""
    fields: dict[str, Any] = {
        "job": report.job_id,
        "name": report.name,
        "command": report.command,
        "params": json.dumps(report.params),
        "error": error,
        "backoff_max": BACKOFF_MAX,
    }
    if isinstance(error, JobServerError):
        fields |= {"code": error.code, "reason": error.reason, "status": error.status}
    return fields
