"""Every command, routed from one table.

The server gives each parsed request to `Dispatcher.dispatch` and gets back
the `Answer` to write; if the reply hands out jobs it carries an `Undo`,
which the server runs if the reply never reaches the client. A GetJob that
waits (`Connection: wait`) is awaited here like any other command: the
connection, which knows it from the request (`get_jobs.waits_for_jobs`),
reads ahead meanwhile so that a client that hangs up cancels the wait.

Every route has one signature (route.py); which command runs where (a
transaction, a thread for Query, Queues and Backup, nowhere for Ping) is
its handler's business. Commands that run in a transaction are the
functions of create.py, report.py, manage.py, bulk.py, flow_control.py
and replies.py, each wrapped in `InWriter`.
"""

from __future__ import annotations

import contextlib
import hmac
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

import trio

from jobserver.core.commands import (
    await_job,
    backup,
    bulk,
    create,
    flow_control,
    get_jobs,
    history,
    json_params,
    known_headers,
    manage,
    query,
    queues,
    replies,
    report,
    running,
    status,
)
from jobserver.core.commands.route import Answer, Route, Services
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.model import cron
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request, Response

# A request this large (a CreateJobs of hundreds of jobs) runs long enough
# to hold up every other connection: its batch runs in a thread.
HEAVY_REQUEST_BYTES = 16 * 1024
# JSON this large is parsed in a thread (parse_large_json): 64 KiB takes
# about 2 ms, small enough for the event loop, and a thread costs more
# than parsing the common few hundred bytes.
PARSE_IN_THREAD_BYTES = 64 * 1024
# Commands whose work has no small bound (every job of a pattern, a long
# list): always heavy.
# Commands of many jobs, each element a command of its own: heavy past
# this many elements.
MANY_JOB_VERBS = frozenset(("createjobs", "finishjobs", "failjobs", "retryjobs"))
HEAVY_ELEMENTS = 64
HEAVY_VERBS = frozenset((
    "requeuejobs", "failedjobs", "requeuefailedjobs", "deletefailedjobs", "cancelqueuedjobs",
))


class Command(Protocol):
    """A command run in a transaction. It takes `request` by that name: the
    engine calls it with the context alone, the request bound by keyword."""

    def __call__(self, ctx: Context, request: Request) -> Response: ...


class Dispatcher:
    def __init__(self, services: Services) -> None:
        self.services = services

    @property
    def answered(self) -> dict[tuple[str, int], int]:
        """Answers given, by (command name, status code): for metrics."""
        return self.services.answered

    async def dispatch(self, request: Request, peer: str) -> Answer:
        """The answer to one request from a client at address `peer`."""
        answer = await self._dispatch(request, peer)
        if not answer.waited:
            self.services.count(command_name(request), answer.response.code)
        ignored = known_headers.ignored_headers(request)
        return _with_ignored(answer, ignored) if ignored else answer

    async def _dispatch(self, request: Request, peer: str) -> Answer:
        if request.invalid_utf8:
            return Answer(Response("400 Request is not valid UTF-8"))
        if not self._authorized(request):
            return Answer(Response("401 Unauthorized"))
        route = ROUTES.get(request.verb.lower())
        if route is None:
            return Answer(Response("430 Unrecognized command"))
        try:
            return await route(self.services, request, peer)
        except CommandError as error:
            return Answer(Response(error.status))

    def _authorized(self, request: Request) -> bool:
        expected = self.services.access.auth_token
        if expected is None:
            return True
        given = request.get("authtoken") or ""
        # Constant time, so the reply's timing does not reveal a prefix.
        return hmac.compare_digest(given.encode(), expected.encode())


@dataclass(frozen=True)
class InWriter:
    """The route of a command run in a transaction of the engine."""

    command: Command

    async def __call__(self, services: Services, request: Request, peer: str) -> Answer:
        await parse_large_json(services, request)
        await _check_cron_first(services, request)
        work = partial(self.command, request=request)
        return Answer(await services.engine.call(work, _is_heavy(request)))


async def parse_large_json(services: Services, request: Request) -> None:
    """Parse the request's large JSON parameters in a thread, before the
    writer, which then finds them parsed (json_params.json_value). Parsing
    900 KB takes tens of milliseconds, in C that holds the GIL throughout:
    in a thread the event loop still waits while it runs, but between
    parses it serves others, and the writer never waits for one."""
    for header in json_params.JSON_PARAMETERS:
        text = request.get(header)
        if text is not None and len(text) > PARSE_IN_THREAD_BYTES:
            await trio.to_thread.run_sync(
                _parse_quietly, request, header, limiter=services.json_parsing
            )


def _parse_quietly(request: Request, header: str) -> None:
    """Parse a parameter for later: a ValueError is kept with the request,
    and raised when the command reads the parameter, in its turn."""
    with contextlib.suppress(ValueError), jsonbody.collection_paused():
        json_params.json_value(request, header)


async def _check_cron_first(services: Services, request: Request) -> None:
    """A CRON rule is checked, and its next run found, by searching for its
    moments (cron.py), which can take tens of milliseconds the first time
    and walk decades: done here, one request at a time, in a thread that
    does not hold up the writer, which then finds the verdict and the next
    run remembered (its jobs, however many, search no more)."""
    rules = _repeat_rules(request)
    distinct = {(rule, zone) for rule, zone in rules if cron.is_cron(rule)}
    if len(distinct) > cron.MOST_RULES_A_REQUEST:
        # More than are remembered at once would be searched again in the
        # writer, a millisecond or more each (7,000 held it 5 s).
        raise CommandError(
            f"402 Too many CRON rules ({cron.MOST_RULES_A_REQUEST} distinct rules "
            "and time zones a request at most)"
        )
    now = services.engine.now()
    if cron.unchecked(rules, now):
        await trio.to_thread.run_sync(cron.warm, rules, now, limiter=services.rule_checks)


def _with_ignored(answer: Answer, ignored: str) -> Answer:
    # A new Response: handlers may answer with a shared one. The request's
    # own headers come before those of its `jobs` elements.
    reply = answer.response
    inner = reply.headers.get("ignoredHeaders")
    headers = {**reply.headers, "ignoredHeaders": f"{ignored}, {inner}" if inner else ignored}
    return replace(answer, response=Response(reply.status, reply.body, headers))


def command_name(request: Request) -> str:
    """The command a request runs, as metrics name it: its verb lower-cased,
    `query` for the `Query: SQL` shorthand, `unknown` for a verb no route
    takes (so that what a client sends cannot make labels without end)."""
    verb = request.verb.lower()
    return verb.removesuffix(":") if verb in ROUTES else "unknown"


def _is_heavy(request: Request) -> bool:
    verb = request.verb.lower()
    if verb in HEAVY_VERBS:
        return True
    if verb in MANY_JOB_VERBS and (request.get("jobs") or "").count("{") > HEAVY_ELEMENTS:
        # A thousand small elements fit under HEAVY_REQUEST_BYTES, and each
        # may cost half a millisecond (a retry policy's backoff placed in a
        # job's time windows): an upper bound on the elements, counted
        # without parsing.
        return True
    return sum(map(len, request.headers.values())) > HEAVY_REQUEST_BYTES


# Every verb, lower-cased (protocol.md section 5 and 14).
ROUTES: dict[str, Route] = {
    "ping": status.ping,
    "status": status.status,
    "queues": queues.queues,
    "history": history.history_command,
    "query": query.query,
    "query:": query.query,
    "createjob": InWriter(create.create_job),
    "createjobs": InWriter(create.create_jobs),
    "getjob": get_jobs.get_jobs,
    "getjobs": get_jobs.get_jobs,
    "queryjob": InWriter(manage.query_job),
    "updatejob": InWriter(manage.update_job),
    "finishjob": InWriter(report.finish_job),
    "finishjobs": InWriter(report.finish_jobs),
    "failjobs": InWriter(report.fail_jobs),
    "retryjobs": InWriter(report.retry_jobs),
    "retryjob": InWriter(report.retry_job),
    "failjob": InWriter(report.fail_job),
    "canceljob": InWriter(manage.cancel_job),
    "cancelledjobs": InWriter(manage.cancelled_jobs),
    "deletejob": InWriter(manage.delete_job),
    "requeuejobs": InWriter(manage.requeue_jobs),
    "touchjob": InWriter(report.touch_job),
    "failedjobs": InWriter(manage.failed_jobs),
    "requeuefailedjobs": InWriter(bulk.requeue_failed_jobs),
    "deletefailedjobs": InWriter(bulk.delete_failed_jobs),
    "cancelqueuedjobs": InWriter(bulk.cancel_queued_jobs),
    "setlimit": InWriter(flow_control.set_limit),
    "pausejobs": InWriter(flow_control.pause_jobs),
    "resumejobs": InWriter(flow_control.resume_jobs),
    "awaitreply": InWriter(replies.await_reply),
    "deliverreply": InWriter(replies.deliver_reply),
    "awaitjob": await_job.await_job,
    "backup": backup.backup,
    "runningjobs": running.running_jobs,
}


def _repeat_rules(request: Request) -> list[tuple[str, str]]:
    """The repeat rules a CreateJob, UpdateJob or CreateJobs carries, each
    with the time zone it is read in, found without parsing more than the
    `jobs` JSON; [] for anything else."""
    verb = request.verb.lower()
    if verb in ("createjob", "updatejob"):
        text = request.get("repeat")
        return [(text, request.get("timeZone") or "")] if text else []
    if verb != "createjobs" or '"repeat"' not in (request.get("jobs") or "").lower():
        return []
    try:
        elements = json_params.json_value(request, "jobs")
    except ValueError:  # not JSON, or nested too deeply: the writer says so
        return []
    if not isinstance(elements, list):
        return []
    found = (_rule_and_zone(element) for element in elements if isinstance(element, dict))
    return [pair for pair in found if pair is not None]


def _rule_and_zone(element: dict[str, object]) -> tuple[str, str] | None:
    """A CreateJobs element's repeat and timeZone, its keys read in any
    case as the writer reads them; None without a repeat."""
    values = {key.lower(): value for key, value in element.items()}
    rule, zone = values.get("repeat"), values.get("timezone")
    if not isinstance(rule, str) or not rule:
        return None
    return rule, zone if isinstance(zone, str) else ""
