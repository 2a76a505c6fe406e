"""Queues: what the Queues command, the metrics, the dashboard and
`jobserver top` show of each queue.

A queue is a job name up to its first `/` (`email/send` is in `email`).
Its figures are its jobs by state, the age of its oldest ready job (due
now and waiting to be handed out): how far behind its workers are, and how
many jobs due now a paused pattern holds. A held job is not ready: a queue
paused on purpose is not behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import trio

from jobserver.core.commands import params
from jobserver.core.commands.route import Answer, Services
from jobserver.core.commands.views import ok
from jobserver.model import times
from jobserver.storage.reader_types import QueueStats
from jobserver.wire.framing import Request, Response


@dataclass(frozen=True)
class Queue:
    name: str
    jobs: dict[str, int]
    # Seconds the oldest ready job has waited; None when none is ready.
    oldest_ready_age: float | None
    # Jobs due now that a paused pattern holds.
    paused: int

    @property
    def total(self) -> int:
        return sum(self.jobs.values())

    def as_json(self) -> dict[str, object]:
        return {
            "queue": self.name,
            "jobs": dict(sorted(self.jobs.items())),
            "total": self.total,
            "oldestReadyAge": self.oldest_ready_age,
            "paused": self.paused,
        }


async def queues(services: Services, request: Request, peer: str) -> Answer:
    """Each queue's jobs by state and oldest ready age, read on a
    connection of the store's own in a thread: it reads every job, and
    must not hold up the writer."""
    limit = params.queue_limit(request)
    now = times.utcnow()
    store = services.store
    try:
        stats = await trio.to_thread.run_sync(
            store.queue_stats, times.to_millis(now), limiter=services.query_threads
        )
    except store.errors as error:
        return Answer(Response(f"503 Database unavailable: {error}"))
    listed = summarize(stats, now)
    body = {
        "queues": [queue.as_json() for queue in listed[:limit]],
        "more": max(0, len(listed) - limit),
    }
    return Answer(ok(body))


def summarize(stats: QueueStats, now: datetime) -> list[Queue]:
    """Every queue, the largest first (then by name, for a stable order)."""
    counts, oldest, held = stats
    jobs: dict[str, dict[str, int]] = {}
    for (queue, state), count in counts.items():
        jobs.setdefault(queue, {})[state] = count
    queues = [
        Queue(name, by_state, _age(oldest.get(name), now), held.get(name, 0))
        for name, by_state in jobs.items()
    ]
    return sorted(queues, key=lambda q: (-q.total, q.name))


def _age(due: str | None, now: datetime) -> float | None:
    if due is None:
        return None
    # A job due a moment after `now` was read (clocks of two nodes) has not waited.
    return round(max(0.0, (now - times.parse_stored(due)).total_seconds()), 3)
