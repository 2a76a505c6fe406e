"""Every command, routed from one table; what the server is to do with it.

The server gives each parsed request to `Dispatcher.dispatch` and gets back
one of two things:

- an `Answer`: the reply to write. If the reply hands out jobs it carries
  an `Undo`, which the server runs if the reply never reaches the client;
- a `WaitForJobs`: a GetJob that waits (`Connection: wait`). The server
  awaits its `take()` while it watches the client, and writes the Answer
  that comes back; a client that hangs up cancels the wait.

The server moves bytes and owns tasks; which command runs where (the
writer's transaction, a thread for Query and Backup, nowhere for Ping) is
decided here.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Protocol

import trio

from jobserver import __version__
from jobserver.core.commands import (
    backup,
    create,
    flow_control,
    known_headers,
    manage,
    params,
    query,
    queues,
    replies,
    report,
)
from jobserver.core.commands.views import ok
from jobserver.core.engine.context import Context
from jobserver.core.engine.waiters import Selector, WaitQueue
from jobserver.core.engine.writer import Writer
from jobserver.core.errors import CommandError
from jobserver.core.rules import flow, selection
from jobserver.core.rules.selection import JobQuery, Taken
from jobserver.model import cron, times
from jobserver.model.jobs import State
from jobserver.storage.interface import BackupDirectory, Storage
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request, Response
from jobserver.wire.limits import DEFAULT_MAX_REPLY_BYTES

# Query runs in worker threads; a few at once is plenty for people typing.
QUERY_THREADS = 4

# A request this large (a CreateJobs of hundreds of jobs) runs long enough
# to hold up every other connection: its batch runs in a thread.
HEAVY_REQUEST_BYTES = 16 * 1024
# Commands whose work has no small bound (every job of a pattern, a long
# list): always heavy.
HEAVY_VERBS = frozenset(("requeuejobs", "failedjobs"))


def is_loopback(host: str) -> bool:
    """Whether an address (or a --host) is this machine's own."""
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1", "localhost")


@dataclass(frozen=True)
class Undo:
    """What to do if a reply never reaches its client: the jobs it hands
    out go back to the queue."""

    job_ids: tuple[int, ...]
    run: Callable[[], None]


@dataclass(frozen=True)
class Answer:
    response: Response
    undo: Undo | None = None


@dataclass(frozen=True)
class WaitForJobs:
    """Wait for jobs by awaiting `take()`; the Answer it returns is the
    reply, and its jobs are the caller's from the moment it returns."""

    take: Callable[[], Awaitable[Answer]]


class Command(Protocol):
    """A command run in the writer. It takes `request` by that name: the
    writer calls it with the context alone, the request bound by keyword."""

    def __call__(self, ctx: Context, request: Request) -> Response: ...


class ServerGauges(Protocol):
    """What Status reports of the server around the core."""

    @property
    def open_connections(self) -> int: ...

    @property
    def commands_served(self) -> int: ...


@dataclass(frozen=True)
class Access:
    """Who may do what (--auth-token-file, --allow-remote-query)."""

    auth_token: str | None = None
    allow_remote_query: bool = False
    query_seconds: float = query.DEFAULT_SECONDS
    # The largest reply Query may build (--max-reply-bytes).
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    # Where Backup writes (--backup-dir); None: nowhere (no file database).
    backup_dir: BackupDirectory | None = None


class Dispatcher:
    def __init__(
        self,
        store: Storage,
        writer: Writer,
        waits: WaitQueue,
        gauges: ServerGauges,
        access: Access,
    ) -> None:
        self.store = store
        self.writer = writer
        self.waits = waits
        self.gauges = gauges
        self.access = access
        self.started = time.monotonic()
        self._query_limiter = trio.CapacityLimiter(QUERY_THREADS)
        # Status counts what running jobs use of each limit one at a time.
        self._status_limiter = trio.CapacityLimiter(1)
        self._rule_check_limiter = trio.CapacityLimiter(1)
        # One backup at a time: each reads the whole database and holds
        # its log from being checkpointed until it is done.
        self._backing_up = trio.Lock()
        # Answers given, by (command_name, status code): for metrics. A
        # waiting GetJob counts when it waits.
        self.answered: dict[tuple[str, int], int] = {}

    async def dispatch(self, request: Request, peer: str) -> Answer | WaitForJobs:
        """What to do about one request from a client at address `peer`."""
        action = await self._dispatch(request, peer)
        key = (command_name(request), _code(action))
        self.answered[key] = self.answered.get(key, 0) + 1
        ignored = known_headers.ignored_headers(request)
        if not ignored:
            return action
        if isinstance(action, WaitForJobs):
            return WaitForJobs(partial(_naming_ignored, action.take, ignored))
        return _with_ignored(action, ignored)

    async def _dispatch(self, request: Request, peer: str) -> Answer | WaitForJobs:
        if request.invalid_utf8:
            return Answer(Response("400 Request is not valid UTF-8"))
        if not self._authorized(request):
            return Answer(Response("401 Unauthorized"))
        route = ROUTES.get(request.verb.lower())
        if route is None:
            return Answer(Response("430 Unrecognized command"))
        try:
            return await route(self, request, peer)
        except CommandError as error:
            return Answer(Response(error.status))

    def _authorized(self, request: Request) -> bool:
        expected = self.access.auth_token
        if expected is None:
            return True
        given = request.get("authtoken") or ""
        # Constant time, so the reply's timing does not reveal a prefix.
        return hmac.compare_digest(given.encode(), expected.encode())

    # Routes.

    async def in_writer(self, handler: Command, request: Request) -> Answer:
        await self._check_cron_first(request)
        response = await self.writer.call(partial(handler, request=request), _is_heavy(request))
        return Answer(response)

    async def get_jobs(self, request: Request) -> Answer | WaitForJobs:
        job_query = selection.query_of(request)
        if (request.get("connection") or "").lower() == "wait":
            timeout = params.wait_seconds(request)
            return WaitForJobs(partial(self._wait_for_jobs, job_query, timeout))
        # A GLOB's search of a long queue, or a search under many limits
        # and pauses, runs off the event loop.
        heavy = job_query.scans or flow.is_heavy(self.store)
        taken = await self.writer.call(partial(selection.take, query=job_query), heavy)
        if not taken:
            # Jobs failed on the way (out of leases) stay failed.
            return Answer(Response("404 No job found"))
        return self._handing_out(job_query, taken)

    # The timeout is GetJob's: it ends in a 404 reply, not in a cancellation.
    async def _wait_for_jobs(self, job_query: JobQuery, timeout: float) -> Answer:  # noqa: ASYNC109
        selector = Selector(job_query.pattern, frozenset(job_query.names))
        taken = await self.waits.wait(selector, job_query, timeout)
        if not taken:
            return Answer(Response("404 No job found"))
        return self._handing_out(job_query, taken)

    def _handing_out(self, job_query: JobQuery, taken: list[Taken]) -> Answer:
        try:
            response = selection.reply(job_query, taken)
        except BaseException:
            self.waits.give_back(taken)
            raise
        ids = tuple(t.job.jobID for t in taken)
        return Answer(response, Undo(ids, partial(self.waits.give_back, taken)))

    async def status(self) -> Answer:
        counts, limits, paused, early, size = await self.writer.call(_status_snapshot)
        try:
            in_use = await self._limits_in_use(limits)
        except self.store.errors as error:
            return Answer(Response(f"503 Database unavailable: {error}"))
        body = {
            "version": __version__,
            "uptime": round(time.monotonic() - self.started, 3),
            "database": {"path": self.store.path, "bytes": size},
            "jobs": counts,
            "waitingGetJobs": len(self.waits),
            "connections": self.gauges.open_connections,
            "commandsServed": self.gauges.commands_served,
            "transactions": self.writer.batches,
            "limits": in_use,
            "paused": sorted(paused),
            "replies": {"waiting": counts.get(State.WAITING, 0), "early": early},
        }
        return Answer(ok(body))

    async def _limits_in_use(self, limits: dict[str, int]) -> dict[str, Any]:
        """Each limit and what running jobs use of it, read on a connection
        of the store's own in a thread, one Status at a time: matching
        every running job's name against every limit must hold up neither
        the writer nor the event loop."""
        if not limits:
            return {}
        now = times.to_millis(times.utcnow())
        running = await trio.to_thread.run_sync(
            lambda: flow.running_under(limits, self.store.running_by_name(now)),
            limiter=self._status_limiter,
        )
        return {
            pattern: {"max": capacity, "running": running[pattern]}
            for pattern, capacity in sorted(limits.items())
        }

    async def queues(self, request: Request) -> Answer:
        """Each queue's jobs by state and oldest ready age, read on a
        connection of the store's own in a thread: it reads every job, and
        must not hold up the writer."""
        limit = params.queue_limit(request)
        now = times.utcnow()
        try:
            stats = await trio.to_thread.run_sync(
                self.store.queue_stats, times.to_millis(now), limiter=self._query_limiter
            )
        except self.store.errors as error:
            return Answer(Response(f"503 Database unavailable: {error}"))
        listed = queues.summarize(stats, now)
        body = {
            "queues": [queue.as_json() for queue in listed[:limit]],
            "more": max(0, len(listed) - limit),
        }
        return Answer(ok(body))

    async def query(self, request: Request, peer: str) -> Answer:
        if not (self.access.allow_remote_query or is_loopback(peer)):
            return Answer(Response("401 Unauthorized"))
        response = await trio.to_thread.run_sync(
            query.run, self.store, request, self.access.query_seconds,
            self.access.max_reply_bytes,
            limiter=self._query_limiter,
            # A shutdown does not wait for a query; it stops itself at its deadline.
            abandon_on_cancel=True,
        )
        # Its own connection may have read commits not yet on disk.
        await self.writer.settled()
        return Answer(response)

    async def backup(self, request: Request, peer: str) -> Answer:
        # It writes a file, named by the client, as the server's user: only
        # for a client on this machine, or one that holds the token. (Over
        # HTTP, only with the token: web/app.py.)
        if self.access.auth_token is None and not is_loopback(peer):
            return Answer(Response("401 Unauthorized"))
        place = self.access.backup_dir
        if place is None:
            return Answer(Response("501 Backup is off: the server has no backup directory"))
        if self._backing_up.locked():
            return Answer(Response("409 Backup already running"))
        async with self._backing_up:
            # Not abandoned on cancel: a shutdown stops the copy through
            # `_cancelled`, and the thread removes what it had written.
            response = await trio.to_thread.run_sync(
                backup.run, self.store, place, request, _cancelled
            )
        # Its own connection may have copied commits not yet on disk.
        await self.writer.settled()
        return Answer(response)

    async def _check_cron_first(self, request: Request) -> None:
        """A CRON rule is checked by searching for its next moment
        (cron.py), which can take tens of milliseconds the first time:
        done here, one request at a time, in a thread that does not hold up
        the writer, which then finds the verdict remembered."""
        texts = _repeat_rules(request)
        if cron.unchecked(texts):
            await trio.to_thread.run_sync(cron.warm, texts, limiter=self._rule_check_limiter)

async def _naming_ignored(take: Callable[[], Awaitable[Answer]], ignored: str) -> Answer:
    """A waiting GetJob's answer, when it comes, names what it ignored."""
    return _with_ignored(await take(), ignored)


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


def _cancelled() -> bool:
    """From a worker thread: whether the request it works for was cancelled."""
    try:
        trio.from_thread.check_cancelled()
    except trio.Cancelled:
        return True
    return False


def _code(action: Answer | WaitForJobs) -> int:
    """The status code of an answer; 0 for a GetJob that waits."""
    return action.response.code if isinstance(action, Answer) else 0


def _is_heavy(request: Request) -> bool:
    if request.verb.lower() in HEAVY_VERBS:
        return True
    return sum(map(len, request.headers.values())) > HEAVY_REQUEST_BYTES


def _status_snapshot(
    ctx: Context,
) -> tuple[dict[str, int], dict[str, int], frozenset[str], int, int]:
    """Job counts, the concurrency limits, the paused patterns, the early
    replies not yet awaited, and the database's size (a query, on PostgreSQL)."""
    store = ctx.store
    return (
        store.count_by_state(), dict(store.limits), store.paused,
        store.early_replies(ctx.now_ms), store.size_bytes(),
    )


Route = Callable[[Dispatcher, Request, str], Awaitable[Answer | WaitForJobs]]


def _in_writer(handler: Command) -> Route:
    async def route(d: Dispatcher, request: Request, peer: str) -> Answer:
        return await d.in_writer(handler, request)

    return route


async def _ping(d: Dispatcher, request: Request, peer: str) -> Answer:
    return Answer(Response("200 OK"))


async def _status(d: Dispatcher, request: Request, peer: str) -> Answer:
    return await d.status()


async def _queues(d: Dispatcher, request: Request, peer: str) -> Answer:
    return await d.queues(request)


async def _query(d: Dispatcher, request: Request, peer: str) -> Answer:
    return await d.query(request, peer)


async def _get_jobs(d: Dispatcher, request: Request, peer: str) -> Answer | WaitForJobs:
    return await d.get_jobs(request)


async def _backup(d: Dispatcher, request: Request, peer: str) -> Answer:
    return await d.backup(request, peer)


# Every verb, lower-cased (protocol.md section 5 and 14).
ROUTES: dict[str, Route] = {
    "ping": _ping,
    "status": _status,
    "queues": _queues,
    "query": _query,
    "query:": _query,
    "createjob": _in_writer(create.create_job),
    "createjobs": _in_writer(create.create_jobs),
    "getjob": _get_jobs,
    "getjobs": _get_jobs,
    "queryjob": _in_writer(manage.query_job),
    "updatejob": _in_writer(manage.update_job),
    "finishjob": _in_writer(report.finish_job),
    "finishjobs": _in_writer(report.finish_jobs),
    "retryjob": _in_writer(report.retry_job),
    "failjob": _in_writer(report.fail_job),
    "canceljob": _in_writer(manage.cancel_job),
    "deletejob": _in_writer(manage.delete_job),
    "requeuejobs": _in_writer(manage.requeue_jobs),
    "touchjob": _in_writer(report.touch_job),
    "failedjobs": _in_writer(manage.failed_jobs),
    "setlimit": _in_writer(flow_control.set_limit),
    "pausejobs": _in_writer(flow_control.pause_jobs),
    "resumejobs": _in_writer(flow_control.resume_jobs),
    "awaitreply": _in_writer(replies.await_reply),
    "deliverreply": _in_writer(replies.deliver_reply),
    "backup": _backup,
}


def _repeat_rules(request: Request) -> list[str]:
    """The repeat rules a CreateJob, UpdateJob or CreateJobs carries, found
    without parsing more than the `jobs` JSON; [] for anything else."""
    verb = request.verb.lower()
    if verb in ("createjob", "updatejob"):
        text = request.get("repeat")
        return [text] if text else []
    if verb != "createjobs" or '"repeat"' not in (jobs := request.get("jobs") or "").lower():
        return []
    try:
        elements = jsonbody.parse(jobs)
    except ValueError:  # not JSON, or nested too deeply: the writer says so
        return []
    if not isinstance(elements, list):
        return []
    return [
        value
        for element in elements
        if isinstance(element, dict)
        for key, value in element.items()
        if key.lower() == "repeat" and isinstance(value, str)
    ]
