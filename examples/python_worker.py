"""The walkthrough's workers (examples/workers) as Python handlers, for
`jobserver worker` to run in one process. From the repository's root:

    jobserver worker examples.python_worker:worker

A plain function runs in a thread, an `async def` as a task on the
worker's event loop; each gets the job's data, and the Job too if it has a
parameter named `job`.
"""

import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jobserver.worker import Job, RetryLater, Worker

# The worker asks for the jobs its handlers' patterns match, and no others.
worker = Worker()


@worker.handler("*SendEmail")
def send_email(data: dict[str, Any], job: Job) -> dict[str, Any]:
    to = data.get("to")
    if not to:
        # Fails the job, with the traceback as its last error.
        raise ValueError(f'job {job.id} has no "to" in its data')
    print(f"sending job {job.id} ({job.name}) to {to}", file=sys.stderr)
    # The returned dict becomes the job's data.
    return {"to": to, "sentAt": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S")}


@worker.handler("*ResizeImage", timeout=60)
async def resize_image(data: dict[str, Any]) -> dict[str, Any]:
    source = Path(data.get("path", ""))
    width = int(data.get("width", 256))
    if not source.is_file():
        raise RetryLater(5)  # RetryJob: run again in 5 seconds
    # A real handler would resize here; this one records what it would have done.
    target = source.with_name(f"{source.stem}-{width}{source.suffix}")
    return {**data, "resized": str(target), "bytes": source.stat().st_size}
