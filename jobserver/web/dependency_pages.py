"""The job page's Dependencies section: how the jobs a job depends on have
ended (a batch's progress, on its completion job's page: docs/batches.md),
from QueryJob's `dependencyCounts` (protocol.md 14.25), and what the job
does when one of them does not finish. Asked only for a job that has
dependencies: others cost no request more."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request

from jobserver.model.jobs import Job
from jobserver.wire.framing import Response as WireResponse

# The dashboard's way of asking a wire command (Dashboard._call).
Call = Callable[..., Awaitable[WireResponse]]

# What a job does when a job it depends on does not finish, by its
# onDependencyFailure ("" is the default, fail).
ON_DEPENDENCY_FAILURE = {
    "fail": "it fails, never handed out",
    "cancel": "it is cancelled",
    "run": "run all the same",
}


async def dependencies(call: Call, request: Request, job: Job) -> dict[str, Any]:
    """The job page's `dependencies` (the counts, None for a job without
    dependencies or when QueryJob is refused) and `on_failure`."""
    counts = None
    if job.dependencies:
        reply = await call(request, "QueryJob", jobID=str(job.jobID))
        if reply.code == 200:
            counts = json.loads(reply.body).get("dependencyCounts")
    return {
        "dependencies": counts,
        "on_failure": ON_DEPENDENCY_FAILURE.get(job.onDependencyFailure or "fail", ""),
    }
