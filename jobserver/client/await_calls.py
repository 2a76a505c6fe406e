"""AwaitJob's call (protocol.md 14.27), shared by every client: wait until
a job has ended and get how it ended. Apart from calls.py, which is long
enough already."""

from __future__ import annotations

from typing import Any

from jobserver.client.calls import Call, reply_object
from jobserver.wire.client_framing import Reply
from jobserver.wire.limits import DEFAULT_WAIT_MS, MAX_WAIT_MS

# The status of an AwaitJob whose job had not ended within its timeout.
NOT_ENDED = 202


def await_job(job_id: int, timeout: float | None = None) -> Call[dict[str, Any] | None]:
    """Wait up to `timeout` seconds (default 110, at most 3,600) until the
    job has ended: FINISHED, FAILED for good, CANCELLED, or DELETED before
    it ended. Returns its outcome, {"jobID", "name", "state", "data",
    "lastError", "ended"} (a FINISHED job's data is its result), at once if
    it has ended already; None if it has not ended in time. A job neither
    stored nor kept (its outcome is kept for the server's --keep-outcomes,
    an hour by default) raises JobNotFound. Safe to send again: it only
    waits."""
    millis = DEFAULT_WAIT_MS if timeout is None else round(max(timeout, 0) * 1000)
    params: dict[str, object] = {"jobID": job_id}
    if timeout is not None:
        params["timeout"] = millis
    return Call(
        "AwaitJob", params, _outcome, held=min(millis, MAX_WAIT_MS) / 1000, harmless=True
    )


def _outcome(reply: Reply) -> dict[str, Any] | None:
    if reply.code == NOT_ENDED:
        return None
    body = reply_object(reply)
    if not isinstance(body.get("state"), str):
        raise ValueError("no state")
    return body
