"""The AwaitJobs waiting on this node, by the job each waits for.

An AwaitJob (core/commands/await_job.py) joins here, looks at its job in a
transaction, and, if the job has not ended, sleeps until it is woken: by a
commit on this node that ended an awaited job (Committed.ended), or by a
notice from another node that did (storage's `listen`). Woken, it looks
again; nothing here polls. The number waiting at once is bounded
(MAX_AWAITING): past it a new one is refused, not queued.
"""

from __future__ import annotations

from collections.abc import Iterable

import trio

from jobserver.core.engine.context import Context
from jobserver.wire.limits import MAX_AWAITING


class TooManyAwaiting(Exception):
    """MAX_AWAITING AwaitJobs wait already."""


class Awaiter:
    """One waiting AwaitJob: the job it waits for, and the event that
    wakes it, made anew before each look so that a wake during a look is
    never lost."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        self.event = trio.Event()

    def arm(self) -> None:
        """Before a look: only what ends the job from now on wakes it."""
        self.event = trio.Event()


class Awaits:
    def __init__(self, most: int = MAX_AWAITING) -> None:
        self._most = most
        self._by_job: dict[int, set[Awaiter]] = {}
        self._count = 0
        self.closed = False

    def __len__(self) -> int:
        return self._count

    def join(self, job_id: int) -> Awaiter:
        if self._count >= self._most:
            raise TooManyAwaiting
        awaiter = Awaiter(job_id)
        self._by_job.setdefault(job_id, set()).add(awaiter)
        self._count += 1
        return awaiter

    def leave(self, awaiter: Awaiter) -> None:
        waiting = self._by_job.get(awaiter.job_id)
        if waiting is None or awaiter not in waiting:
            return
        waiting.discard(awaiter)
        self._count -= 1
        if not waiting:
            del self._by_job[awaiter.job_id]

    def ended(self, ids: Iterable[int]) -> None:
        """These jobs ended: wake whoever waits for them."""
        by_job = self._by_job
        for job_id in ids:
            for awaiter in by_job.get(job_id, ()):
                awaiter.event.set()

    def awaited(self) -> list[int]:
        """The jobs waited for (a look after notices may have been lost)."""
        return list(self._by_job)

    def close(self) -> None:
        """The server stops: every awaiter is woken, and answered that its
        job has not ended (the client asks again of the next server)."""
        self.closed = True
        for waiting in self._by_job.values():
            for awaiter in waiting:
                awaiter.event.set()


def ended_of(ctx: Context, ids: list[int]) -> list[int]:
    """Which of the awaited jobs `ids` have an outcome kept: run in a
    transaction when notices of other nodes may have been lost."""
    return ctx.store.ended_of(ids, ctx.now_ms)
