"""The dashboard's page of a job that is gone but whose outcome is kept
for AwaitJob (protocol.md 14.27): how it ended, its result or last error.
Asked as AwaitJob with timeout 0, which answers at once and marks nothing
(the job is not stored)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request

from jobserver.web import texts
from jobserver.wire.framing import Response as WireResponse

# The dashboard's way of asking a wire command (Dashboard._call).
Call = Callable[..., Awaitable[WireResponse]]


async def kept_outcome(call: Call, request: Request, job_id: int) -> dict[str, Any] | None:
    """outcome.html's context, or None if nothing of the job is kept."""
    reply = await call(request, "AwaitJob", jobID=str(job_id), timeout="0")
    if reply.code != 200:
        return None
    outcome = json.loads(reply.body)
    return {"outcome": outcome, "data": texts.pretty(json.dumps(outcome["data"]))}
