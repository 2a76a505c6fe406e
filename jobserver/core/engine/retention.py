"""Retention: deleting finished and failed jobs once they are old enough,
replies once their grace period is over, idempotency keys once their keep
is, ended jobs' outcomes once --keep-outcomes is, and giving the freed pages back to
the file system (protocol.md 14.10).

A background task looks every few seconds, on a read-only connection of
its own, whether there is anything to do. If there is, it deletes in small
batches, each one request to the writer, so requests queued meanwhile run
between two batches instead of waiting for the whole clean-up.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from functools import partial

import trio

from jobserver.core.engine.clock import Clock
from jobserver.core.engine.context import Context
from jobserver.core.engine.engine import Engine
from jobserver.core.errors import CommandError
from jobserver.model import times
from jobserver.model.jobs import State
from jobserver.model.limits import handouts_cutoff
from jobserver.storage.interface import Storage

log = logging.getLogger("jobserver")

# Jobs deleted per transaction: a few milliseconds of work, so a request
# that arrives meanwhile waits no longer than for an ordinary batch.
PRUNE_BATCH = 500
# How often the pruner looks, by default: "a few seconds" late is nothing
# for a retention counted in minutes or days.
PRUNE_INTERVAL = 5.0


def cutoffs(now: datetime, keep_finished: float, keep_failed: float | None) -> dict[str, str]:
    """For each state the pruner deletes, the `ended` before which a job goes.
    FAILED and CANCELLED jobs are kept forever unless `keep_failed` is set."""
    found: dict[str, str] = {
        State.FINISHED: times.to_seconds(now - timedelta(seconds=keep_finished))
    }
    if keep_failed is not None:
        found[State.FAILED] = times.to_seconds(now - timedelta(seconds=keep_failed))
        # A standalone CANCELLED job (protocol.md 14.25, 14.26) is kept as
        # long as a FAILED one.
        found[State.CANCELLED] = found[State.FAILED]
    return found


def prune_step(ctx: Context, before: dict[str, str]) -> bool:
    """One batch: delete expired jobs, reclaim free pages. True when more
    work is left."""
    store = ctx.store
    more = False
    pruned = 0
    for state, cutoff in before.items():
        deleted = store.prune(state, cutoff, PRUNE_BATCH)
        pruned += deleted
        more = more or deleted == PRUNE_BATCH
    # Replies past their grace period: an unclaimed early one is lost by
    # then anyway, and a delivered one no longer needs refusing.
    expired = store.prune_replies(ctx.now_ms, PRUNE_BATCH)
    pruned += expired
    more = more or expired == PRUNE_BATCH
    # Outcomes past --keep-outcomes: an AwaitJob of their job is a 404.
    dropped = store.prune_outcomes(ctx.now_ms, PRUNE_BATCH)
    pruned += dropped
    more = more or dropped == PRUNE_BATCH
    # Idempotency keys past --idempotency-keep: a request sent again with
    # one is done anew.
    forgotten = store.prune_idempotency(ctx.now_ms, PRUNE_BATCH)
    pruned += forgotten
    more = more or forgotten == PRUNE_BATCH
    # Hand-outs under rates older than any window: of keys that have had
    # none since (a key's own are forgotten at its next hand-out).
    counted = store.prune_handouts(handouts_cutoff(ctx.now_ms), PRUNE_BATCH)
    pruned += counted
    more = more or counted >= PRUNE_BATCH
    return store.reclaim_space(pruned > 0) or more


async def run_pruner(
    engine: Engine,
    store: Storage,
    clock: Clock,
    keep_finished: float,
    keep_failed: float | None,
    interval: float,
) -> None:
    while True:
        await trio.sleep(interval)
        now = clock.now()
        before = cutoffs(now, keep_finished, keep_failed)
        try:
            pending = await trio.to_thread.run_sync(
                store.prune_pending, before, times.to_millis(now)
            )
        except Exception as error:  # noqa: BLE001 - the pruner lives on and looks again later
            log.warning("pruner cannot read the database: %s", error)
            continue
        while pending:
            try:
                pending = await engine.call(partial(prune_step, before=before), heavy=True)
            except CommandError as error:
                log.warning("pruning failed: %s", error.status)
                break
