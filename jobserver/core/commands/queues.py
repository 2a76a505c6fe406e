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

from jobserver.model import times
from jobserver.storage.interface import QueueStats


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
