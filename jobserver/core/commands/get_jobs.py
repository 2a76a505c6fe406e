"""GetJob and GetJobs: jobs taken now, or waited for (`Connection: wait`).

A GetJob that waits goes down and comes back up one way: the connection
awaits the dispatcher, which awaits this route, which awaits the engine's
`wait` (engine.py), which returns the jobs the wait queue's try took in
the writer (selection.serve_waiters). The jobs are the caller's from the
moment the wait returns: nothing between here and the connection's record
of them as undelivered gives trio a chance to cancel.
"""

from __future__ import annotations

from functools import partial

import trio

from jobserver.core.commands import params
from jobserver.core.commands.route import Answer, Services, Undo, worker_name
from jobserver.core.engine.engine import Engine
from jobserver.core.rules import flow, selection
from jobserver.core.rules.selection import JobQuery, Taken
from jobserver.model import globmatch
from jobserver.wire.framing import Request, Response

NO_JOB = "404 No job found"


def waits_for_jobs(request: Request) -> bool:
    """Whether a request is a GetJob or GetJobs that waits for jobs."""
    return (
        request.verb.lower() in ("getjob", "getjobs")
        and (request.get("connection") or "").lower() == "wait"
    )


async def get_jobs(services: Services, request: Request, peer: str) -> Answer:
    query = selection.query_of(request, worker_name(peer))
    engine = services.engine
    if waits_for_jobs(request):
        timeout = params.wait_seconds(request)
        matcher = await _compiled(query, services.pattern_compiles)
        services.count(request.verb.lower(), 0)
        waited = await engine.wait(query, timeout, matcher)
        if not waited:
            return Answer(Response(NO_JOB), waited=True)
        return _handing_out(engine, query, waited, waited=True)
    # A GLOB's search of a long queue, or a search under many limits and
    # pauses, runs off the event loop.
    heavy = query.scans or flow.is_heavy(services.store)
    taken: list[Taken] = await engine.call(partial(selection.take, query=query), heavy)
    if not taken:
        # Jobs failed on the way (out of leases) stay failed.
        return Answer(Response(NO_JOB))
    return _handing_out(engine, query, taken, waited=False)


async def _compiled(
    query: JobQuery, limiter: trio.CapacityLimiter
) -> globmatch.Matcher | None:
    """A waiting GetJob's GLOBs as one function of a name, with which the
    names of new jobs are matched on the event loop: each compiled in a
    thread, once per pattern (a long pattern's regular expressions take
    milliseconds, which a hundred waiters at once would hold the loop for).
    An exact name's is a comparison, made here once."""
    matchers = [await _pattern_matcher(pattern, limiter) for pattern in query.patterns]
    if not matchers:
        return None
    if len(matchers) == 1:
        return matchers[0]
    return lambda name: any(match(name) for match in matchers)


async def _pattern_matcher(pattern: str, limiter: trio.CapacityLimiter) -> globmatch.Matcher:
    if not globmatch.is_glob(pattern):
        return globmatch.matcher(pattern)
    kept = globmatch.compiled(pattern)
    if kept is not None:
        return kept
    return await trio.to_thread.run_sync(globmatch.matcher, pattern, limiter=limiter)


def _handing_out(engine: Engine, query: JobQuery, taken: list[Taken], waited: bool) -> Answer:
    try:
        response = selection.reply(query, taken)
    except BaseException:
        engine.give_back(taken)
        raise
    return Answer(response, Undo(tuple(taken), engine), waited)
