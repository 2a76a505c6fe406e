"""Jobs that wait for an external reply (protocol.md 14.11).

AwaitReply parks a handed-out job as WAITING on a correlation key, with a
deadline; DeliverReply puts it back in the queue, due now, with the reply
in its data under `reply`. Nothing runs while a job waits: the deadline is
the job's nextRun, so the clock that wakes blocked GetJobs for future jobs
also fires for it, and `expire` fails the jobs whose deadline passed.

A reply that comes before its AwaitReply (the external service was faster
than the worker) is kept for a grace period as an early reply; an
AwaitReply on its key takes it at once. A delivered reply is remembered for
the same period, so a second delivery of it is refused instead of kept as
an early reply for a job that will never come.
"""

from __future__ import annotations

import re
from datetime import timedelta

from jobserver.core.commands import json_params, params
from jobserver.core.commands.lookup import cancelled_run, check_lease, load_job
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import lifecycle
from jobserver.model import times
from jobserver.model.jobs import State
from jobserver.wire import jsonbody
from jobserver.wire.framing import Request, Response
from jobserver.wire.limits import DEFAULT_REPLY_TIMEOUT, MAX_REPLY_KEY, MAX_REPLY_TIMEOUT

_DIGITS = re.compile(r"[0-9]{1,8}")

# The data field a delivered reply goes into.
REPLY_FIELD = "reply"
# The last error of a job whose deadline passed with no reply.
REPLY_TIMEOUT = "reply timeout"
# Overdue jobs expired per clock tick: the rest follow in the next tick,
# so a backlog (a server down for a day) never makes one long transaction.
EXPIRE_BATCH = 500


def await_reply(ctx: Context, request: Request) -> Response:
    """RUNNING/RUNQUEUED -> WAITING on `key`; or back to QUEUED at once if
    the reply came early."""
    job = load_job(ctx, request)
    check_lease(request, job)
    cancelled = cancelled_run(ctx, job)
    if cancelled is not None:
        return cancelled
    key = _key(request)
    seconds = _timeout(request)
    lifecycle.check(job, "wait for a reply")
    other = ctx.store.waiting_on(key)
    if other is not None:
        raise CommandError("409 Another job waits on this key")
    new_data = json_params.data(request) if params.present(request, "data") else None
    data = new_data or _run_done(job.data)
    kept = ctx.store.reply(key, ctx.now_ms)
    if kept is not None and kept[1] == 0:
        ctx.store.claim_reply(key, job.jobID)
        lifecycle.deliver_reply(ctx, job, _with_reply(data, kept[0]))
        return Response("200 OK", jsonbody.encode({"state": State.QUEUED}))
    deadline = times.to_millis(ctx.now + timedelta(seconds=seconds))
    lifecycle.wait_for_reply(ctx, job, key, deadline, data)
    return Response(
        "200 OK", jsonbody.encode({"state": State.WAITING, "replyDeadline": deadline})
    )


def deliver_reply(ctx: Context, request: Request) -> Response:
    """Give `data` to the job waiting on `key`, or keep it as an early reply."""
    key = _key(request)
    if params.present(request, "data") is None:
        raise CommandError("402 Missing data")
    reply = json_params.data(request)
    assert reply is not None
    expires = times.to_millis(ctx.now + timedelta(seconds=ctx.settings.reply_grace))
    job = ctx.store.waiting_on(key)
    if job is not None:
        ctx.store.keep_reply(key, reply, ctx.now_ms, expires, job.jobID)
        lifecycle.deliver_reply(ctx, job, _with_reply(job.data, reply))
        return Response("200 OK", b'{"jobID":%d}' % job.jobID)
    if ctx.store.reply(key, ctx.now_ms) is not None:
        # Delivered already (to a job, or kept early): exactly one delivery.
        raise CommandError("404 Reply already delivered")
    ctx.store.keep_reply(key, reply, ctx.now_ms, expires, 0)
    return Response("202 Reply kept", jsonbody.encode({"expires": expires}))


def expire(ctx: Context) -> None:
    """Fail WAITING jobs whose deadline passed, through their retry policy.
    Runs in the writer when the clock fires (deadlines.tick)."""
    overdue = ctx.store.overdue(ctx.now_ms, EXPIRE_BATCH)
    for job in overdue:
        lifecycle.time_out_reply(ctx, job, REPLY_TIMEOUT)
    if len(overdue) == EXPIRE_BATCH:
        ctx.wake_all()


def _with_reply(data_text: str, reply: str) -> str:
    """The job's data with the reply in it."""
    data = jsonbody.parse_object(data_text, stored=True)
    data[REPLY_FIELD] = jsonbody.parse(reply)
    return jsonbody.compact(data)


def _run_done(text: str) -> str:
    """The data of a run that ended by awaiting, when AwaitReply sends none:
    like FinishJob, the Bedrock lease counter goes; so does the reply of an
    earlier wait, so that a run after a timeout never sees a stale one."""
    if '"retryAfterCount"' not in text and f'"{REPLY_FIELD}"' not in text:
        return text
    data = jsonbody.parse_object(text, stored=True)
    data.pop("retryAfterCount", None)
    data.pop(REPLY_FIELD, None)
    return jsonbody.compact(data)


def _key(request: Request) -> str:
    key = params.require(request, "key")
    if len(key.encode("utf-8")) > MAX_REPLY_KEY:
        raise params.too_large("key", MAX_REPLY_KEY)
    return key


def _timeout(request: Request) -> int:
    text = params.present(request, "timeout")
    if text is None:
        return DEFAULT_REPLY_TIMEOUT
    if not _DIGITS.fullmatch(text) or not 1 <= int(text) <= MAX_REPLY_TIMEOUT:
        raise CommandError("402 Malformed timeout")
    return int(text)
