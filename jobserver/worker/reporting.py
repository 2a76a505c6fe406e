"""Delivering reports (FinishJob, RetryJob, FailJob) to the server: one
task sends them over a connection of its own, holding them while the
server cannot be reached, by the worker manager's policy
(jobserver.workers.reporting.POLICY: the server's answer -> what to do with
the report, and what to log).

Whatever waits in the queue goes at once: every FinishJob, FailJob and
RetryJob report waiting (up to 1,000 of each) as one FinishJobs, FailJobs
and RetryJobs (protocol.md 14.15; workers.reporting.MANY), then each other
report alone. So reports cost a round trip per batch, not per job, however
fast the handlers end and however many fail. An answer to one job of such
a request that is not a success goes through POLICY as that job's own
report's would; a failure of the whole request holds the batch and sends
it again after the backoff wait (SEND_AGAIN), or sends its reports one at
a time. A server that does not know one of the three (430) gets those
reports alone from then on. A job's lease is renewed until its report is
done with (leases.py)."""

from __future__ import annotations

import json
import logging
from typing import Any

import anyio

from jobserver.client import ConnectionFailed, JobServerError, OutcomeUnknown
from jobserver.wire.limits import MAX_FINISH_JOBS
from jobserver.worker.connection import BACKOFF_MAX, Backoff, Link, Server
from jobserver.worker.leases import Leases
from jobserver.workers.contract import Report
from jobserver.workers.reporting import (
    GIVING_UP,
    MANY,
    REPORT_TRIES_ON_ERROR,
    Action,
    Failure,
    Rule,
    batchable,
    rule_for,
    send_many,
    stop_batching_if_unknown,
)

log = logging.getLogger("jobserver.worker")


class Reporter:
    """The queue of reports, and the task that delivers them."""

    def __init__(self, server: Server, leases: Leases) -> None:
        self.server = server
        self.leases = leases  # renewed until the job's report is done with
        self.pending: list[Report] = []  # not yet taken by the delivering task
        self.sending: list[Report] = []  # taken, on their way
        self.added = anyio.Event()  # set (and replaced) when a report is queued
        self.closed = False  # no more reports will come
        self.scope = anyio.CancelScope()  # its deadline ends delivery early
        self.given_up = 0  # reports the server would not take
        # The verbs the server takes many at a time (MANY).
        self.batching = set(MANY)

    def add(self, report: Report) -> None:
        self.pending.append(report)
        self.added.set()

    def close(self) -> None:
        """No more reports will come: deliver_loop returns once all are sent."""
        self.closed = True
        self.added.set()

    def give_up_in(self, seconds: float) -> None:
        """Stop delivering after `seconds`, whatever is still queued."""
        self.scope.deadline = min(self.scope.deadline, anyio.current_time() + seconds)

    @property
    def unsent(self) -> list[Report]:
        return self.sending + self.pending

    async def deliver_loop(self, done: anyio.Event) -> None:
        """Deliver the reports until closed and empty (or the scope's
        deadline); `done` is set at the end."""
        link = Link(self.server, "reports")
        try:
            with self.scope:
                while True:
                    if not self.pending:
                        if self.closed:
                            return
                        self.added = anyio.Event()
                        await self.added.wait()
                        continue
                    self.sending, self.pending = self.pending, []
                    await self._deliver_all(link)
        finally:
            await link.aclose()
            done.set()

    async def _deliver_all(self, link: Link) -> None:
        """Deliver `sending`: those that go many to a request in batches of
        each verb, then the rest."""
        many = [r for r in self.sending if batchable(r, self.batching)]
        others = [r for r in self.sending if not batchable(r, self.batching)]
        for verb in MANY:
            reports = [r for r in many if r.verb == verb]
            for start in range(0, len(reports), MAX_FINISH_JOBS):
                batch = reports[start : start + MAX_FINISH_JOBS]
                if len(batch) > 1:
                    await self.deliver_many(batch, link)
                else:
                    await self.deliver(batch[0], link)
                self._sent(batch)
        for report in others:
            await self.deliver(report, link)
            self._sent([report])

    def _sent(self, reports: list[Report]) -> None:
        """These reports are done with (delivered, dropped or given up):
        their jobs' leases are no longer renewed."""
        done = {id(r) for r in reports}
        self.sending = [r for r in self.sending if id(r) not in done]
        for report in reports:
            if report.lease_id is not None:
                self.leases.release(report.lease_id)

    async def deliver_many(self, batch: list[Report], link: Link) -> None:
        """Send `batch`, reports of one verb, as one request until the server
        answers it, then each report it refused as POLICY says."""
        backoff, started = Backoff(), anyio.current_time()
        while True:
            try:
                results = await send_many(link.client, batch)
            except (ConnectionFailed, JobServerError) as error:
                if isinstance(error, ConnectionFailed | OutcomeUnknown):
                    for report in batch:
                        report.uncertain = True
                rule = rule_for(batch[0], error)
                if rule.action is Action.SEND_AGAIN:
                    if not backoff.failing:
                        log.log(rule.level, rule.message, self._fields(batch[0], error))
                    await link.reconnect()
                    await anyio.sleep(backoff.next())
                    continue
                stop_batching_if_unknown(self.batching, batch[0], error, self.server.address)
                for report in batch:
                    await self.deliver(report, link)
                return
            self._log_back(backoff, started, f"job {batch[0].job_id} and {len(batch) - 1} more")
            for report, result in zip(batch, results, strict=True):
                refused = result.error()
                if refused is not None:
                    await self.deliver(report, link, refused)
            return

    async def deliver(
        self, report: Report, link: Link, refused: JobServerError | None = None
    ) -> None:
        """Send `report` until POLICY says it is done with it. `refused`: the
        server's answer to it as part of a FinishJobs, to act on first."""
        backoff, started, server_errors = Backoff(), anyio.current_time(), 0
        error: Failure | None = refused
        while True:
            if error is None:
                try:
                    await _send(link, report)
                except (ConnectionFailed, JobServerError) as failure:
                    error = failure
                else:
                    self._log_back(backoff, started, f"job {report.job_id}")
                    return
            if isinstance(error, ConnectionFailed | OutcomeUnknown):
                report.uncertain = True  # a later 404 or 405 may mean it was applied
            rule = rule_for(report, error)
            fields = self._fields(report, error)
            if rule.action is Action.SEND_AGAIN_OR_GIVE_UP:
                server_errors += 1
                if server_errors >= REPORT_TRIES_ON_ERROR:
                    log.error(GIVING_UP, fields | {"tries": server_errors})
                    self.given_up += 1
                    return
            if rule.action in (Action.SEND_AGAIN, Action.SEND_AGAIN_OR_GIVE_UP):
                if not backoff.failing:
                    log.log(rule.level, rule.message, fields)
                await link.reconnect()
                await anyio.sleep(backoff.next())
            else:
                replacement = self._follow(rule, report, fields)
                if replacement is None:
                    return
                report = replacement
            error = None

    def _follow(self, rule: Rule, report: Report, fields: dict[str, Any]) -> Report | None:
        """Do what a rule that does not wait says; the report to send
        instead, or None when done with it."""
        log.log(rule.level, rule.message, fields)
        if rule.action is Action.SEND_BARE:
            return report.bare()
        if rule.action is Action.FAIL_INSTEAD:
            return report.failing(fields["status"])
        if rule.action is Action.GIVE_UP:
            self.given_up += 1
        return None

    def _log_back(self, backoff: Backoff, started: float, what: str) -> None:
        """After an outage, say that the server took reports again."""
        if backoff.failing:
            log.info(
                "server %s reachable again; reported %s after %.1fs",
                self.server.address,
                what,
                anyio.current_time() - started,
            )

    def _fields(self, report: Report, error: Failure) -> dict[str, Any]:
        """What the log lines of POLICY may name."""
        fields: dict[str, Any] = {
            "job": report.job_id,
            "name": report.name,
            "command": report.command,
            "params": json.dumps(report.params, default=str),
            "error": error,
            "backoff_max": BACKOFF_MAX,
            "held": len(self.unsent),
        }
        if isinstance(error, JobServerError):
            fields |= {"code": error.code, "reason": error.reason, "status": error.status}
        return fields

    def log_unreported(self) -> None:
        for report in self.unsent:
            log.error(
                "job %s %s: result not reported (the server may or may not have it): %s %s",
                report.job_id,
                report.name,
                report.command,
                json.dumps(report.params, default=str),
            )


async def _send(link: Link, report: Report) -> None:
    send = getattr(link.client, report.method)
    await send(report.job_id, lease_id=report.lease_id, **report.params)
