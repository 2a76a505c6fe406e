"""AwaitJob: wait until a job has ended, then answer how (protocol.md 14.27).

The route joins the engine's awaiters (engine/awaits.py), then looks at
the job in a transaction (`look`): an ended job is answered at once, from
its kept outcome (core/rules/outcomes.py) or from its row if it is still
stored in the state it ended in; a job that has not ended is marked as
awaited, so that whichever node ends it says so when it commits, and the
route sleeps until it is woken or its timeout passes. Woken, it looks
again. Nothing polls: an AwaitJob costs one transaction when it begins
and one each time an awaited job of its own ends.
"""

from __future__ import annotations

from functools import partial

import trio

from jobserver.core.commands import params
from jobserver.core.commands.route import Answer, Services
from jobserver.core.engine.awaits import TooManyAwaiting
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import lifecycle, outcomes
from jobserver.model.jobs import ENDED, JobOutcome
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request, Response
from jobserver.wire.limits import MAX_AWAITING

NOT_ENDED = "202 Job not ended yet"
TOO_MANY = f"503 Too many AwaitJobs waiting (max {MAX_AWAITING})"
NO_JOB = "404 No job with this jobID"


def awaits_job(request: Request) -> bool:
    """Whether a request is an AwaitJob, which the connection serves as it
    serves a waiting GetJob: watching for the client to hang up."""
    return request.verb.lower() == "awaitjob"


async def await_job(services: Services, request: Request, peer: str) -> Answer:
    job_id = params.job_id(request)
    # Waits as long as a waiting GetJob would: the same default and bound.
    timeout = params.wait_seconds(request)
    engine = services.engine
    if engine.awaits.closed:
        return _not_ended(job_id, "")
    try:
        awaiter = engine.awaits.join(job_id)
    except TooManyAwaiting:
        return Answer(Response(TOO_MANY))
    deadline = trio.current_time() + timeout
    try:
        while True:
            awaiter.arm()
            found: JobOutcome | str = await engine.call(partial(look, job_id=job_id))
            if isinstance(found, JobOutcome):
                return Answer(Response("200 OK", reply(found)))
            if engine.awaits.closed:
                return _not_ended(job_id, found)
            with trio.move_on_at(deadline):
                await awaiter.event.wait()
                if not engine.awaits.closed:
                    continue
            # The timeout, or the server stops: no look more.
            return _not_ended(job_id, found)
    finally:
        engine.awaits.leave(awaiter)


def look(ctx: Context, job_id: int) -> JobOutcome | str:
    """The outcome of the job if it has ended; else its state, the job
    marked as awaited. Raises `404` for a job neither stored nor kept."""
    job = ctx.store.get(job_id)
    if job is not None and job.state not in ENDED:
        lifecycle.await_end(ctx, job)
        return job.state
    kept = ctx.store.job_outcome(job_id, ctx.now_ms)
    if kept is not None:
        return kept
    if job is None:
        raise CommandError(NO_JOB)
    return outcomes.of_row(job)


def reply(outcome: JobOutcome) -> bytes:
    return jsonbody.encode({
        "jobID": outcome.jobID,
        "name": outcome.name,
        "state": outcome.state,
        "data": jsonbody.Raw(outcome.data),
        "lastError": outcome.lastError,
        "ended": outcome.ended,
    })


def _not_ended(job_id: int, state: str) -> Answer:
    body: dict[str, object] = {"jobID": job_id}
    if state:
        body["state"] = state
    return Answer(Response(NOT_ENDED, jsonbody.encode(body)))
