"""The job a command names, and whether its sender still holds it."""

from __future__ import annotations

from jobserver.core.commands import params
from jobserver.core.engine.context import Context
from jobserver.core.errors import CommandError
from jobserver.core.rules import lifecycle
from jobserver.core.rules.moves import JOB_CANCELLED
from jobserver.model.jobs import Job
from jobserver.wire.framing import Request, Response


def load_job(ctx: Context, request: Request) -> Job:
    job = ctx.store.get(params.job_id(request))
    if job is None:
        raise CommandError("404 No job with this jobID")
    return job


def check_lease(request: Request, job: Job) -> None:
    """A report that names a lease must hold the job's latest one: if the
    job was handed out again since, its sender no longer owns it."""
    lease = params.lease_id(request)
    if lease is not None and lease != job.leaseID:
        raise CommandError("409 Lease expired")


def cancelled_run(ctx: Context, job: Job) -> Response | None:
    """A report on a job whose cancel was asked for (CancelJob with
    running: true, protocol.md 14.26) is not taken: the job ends CANCELLED
    and its worker is told so. Returned, not raised, so that the end stays."""
    if not job.cancelRequested:
        return None
    lifecycle.cancel_run(ctx, job)
    return Response(JOB_CANCELLED)
