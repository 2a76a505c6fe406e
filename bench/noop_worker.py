"""The handler bench/worker.py runs: a no-op for the drain's jobs."""

from typing import Any

from jobserver.worker import Worker

worker = Worker()


@worker.handler("drain")
async def noop(data: dict[str, Any]) -> None:
    return None
