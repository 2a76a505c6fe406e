"""PgQueuer's side of bench/pg_peers.py: one process doing one shape, told
when to start on stdin, reporting on stdout (the protocol is in
bench/pg_peers_drivers.py's docstring).

    VENV/bin/python pgqueuer_driver.py MODE [ARGS]   with BENCH_DATABASE_URL

It runs in the venv the bench made for PgQueuer, on asyncpg, the driver
PgQueuer's documentation shows first.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any

import asyncpg  # type: ignore[import-not-found]
from pgqueuer.db import AsyncpgDriver  # type: ignore[import-not-found]
from pgqueuer.models import Job  # type: ignore[import-not-found]
from pgqueuer.qm import QueueManager  # type: ignore[import-not-found]
from pgqueuer.queries import Queries  # type: ignore[import-not-found]
from pgqueuer.types import QueueExecutionMode  # type: ignore[import-not-found]

URL = os.environ["BENCH_DATABASE_URL"]
PAYLOAD = b'{"p":"' + b"x" * 90 + b'"}'
# Jobs per dequeue, and so per batch of completions logged (pg_peers.py's
# --pgqueuer-batch).
BATCH_SIZE = int(os.environ["BENCH_PGQUEUER_BATCH"])


async def read_line() -> str | None:
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    return line or None


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def queries() -> tuple[asyncpg.Connection, Queries]:
    connection = await asyncpg.connect(URL)
    return connection, Queries(AsyncpgDriver(connection))


async def install() -> None:
    connection, q = await queries()
    await q.install()
    await connection.close()
    say("done")


async def single(count: str) -> None:
    connection, q = await queries()
    say("ready")
    await read_line()
    for _ in range(int(count)):
        await q.enqueue("enq", PAYLOAD)
    say("done")
    await read_line()
    await connection.close()


async def batch(count: str, size: str, task: str) -> None:
    connection, q = await queries()
    n = int(size)
    names, payloads, priorities = [task] * n, [PAYLOAD] * n, [0] * n
    say("ready")
    await read_line()
    for _ in range(int(count)):
        await q.enqueue(names, payloads, priorities)
    say("done")
    await read_line()
    await connection.close()


async def drain(count: str) -> None:
    connection, q = await queries()
    qm = QueueManager(q)
    done = 0

    @qm.entrypoint("noop")
    async def noop(job: Job) -> None:
        nonlocal done
        done += 1

    say("ready")
    await read_line()
    # Drain mode returns once the queue is empty and the completions logged.
    await qm.run(batch_size=BATCH_SIZE, mode=QueueExecutionMode.drain)
    say(f"done {done}")
    await read_line()
    await connection.close()


async def work() -> None:
    connection, q = await queries()
    qm = QueueManager(q)

    @qm.entrypoint("wake")
    async def wake(job: Job) -> None:
        say(f"started {time.monotonic_ns()}")

    running = asyncio.create_task(
        qm.run(batch_size=BATCH_SIZE, dequeue_timeout=timedelta(seconds=30))
    )
    say("ready")
    await read_line()
    qm.shutdown.set()
    await running
    await connection.close()


async def produce() -> None:
    connection, q = await queries()
    say("ready")
    while await read_line() is not None:
        sent = time.monotonic_ns()
        await q.enqueue("wake", PAYLOAD)
        say(f"sent {sent}")
    await connection.close()


MODES: dict[str, Callable[..., Coroutine[Any, Any, None]]] = {
    "install": install, "single": single, "batch": batch, "drain": drain,
    "work": work, "produce": produce,
}

if __name__ == "__main__":
    asyncio.run(MODES[sys.argv[1]](*sys.argv[2:]))
