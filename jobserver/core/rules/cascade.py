"""How much of a cascade one transaction tells (protocol.md 14.25), and
where the engine's clock picks up the rest.

A job may have any number of dependents, and they theirs: told in one
transaction, a FailJob of a job with 20,000 dependents held the writer
(and every other request) for seconds. So a transaction settles at most
MOVES_AT_ONCE dependents. Every end is still kept as an outcome in the
transaction that makes it; the dependents not settled yet stay BLOCKED
with a count of blockers their stored outcomes no longer agree with, or
with a failed outcome their policy has not acted on. That is how the rest
is found again, from the rows alone (`Dependencies.behind`): by this
node's clock, fired at once when the transaction that left them has
committed, MOVES_AT_ONCE at a time; after a crash or a
restart by the first tick (deadlines.at_start); by any node that starts
or leaves a cascade of its own, because settling a dependent counts its
blockers again from the outcomes and moves it from BLOCKED under its row
lock, so it happens once. Nothing tells the other nodes that one left
work: a node stopped mid-cascade leaves it until one of them looks. The
bound counts dependents, not the edges each is counted over again.

The order holds: a dependent leaves BLOCKED only when settled, and a
dependent is settled only from stored outcomes, so none runs before its
dependencies ended.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

from jobserver.core.engine.context import Context
from jobserver.storage.interface import Storage

# Dependents settled in one transaction at most: a few tens of
# milliseconds of the writer's time on either backend (about 0.1 s on
# SQLite on a busy machine of two cores).
MOVES_AT_ONCE = 1000
# BLOCKED jobs a tick looks at, at most, to find those left behind.
EXAMINE_AT_ONCE = 5000


@dataclass
class _Budget:
    # The transaction (its time, the same for all of a batch's requests)
    # the count is of, and how many dependents it has settled. One per
    # writer's store: two writers' transactions each have their own.
    transaction: str = ""
    settled: int = 0


@dataclass
class _Progress:
    # Where the look for dependents left behind goes on (after this jobID);
    # None: nothing is left. A server starts by looking.
    after: int | None = 0
    # How many times the look was begun again (look_again). A look that
    # began before the last of those neither moves `after` nor ends it: in
    # the transaction of another of the node's writers (PostgreSQL's
    # --writers) it may not have seen what that commit left.
    restarts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


# The look by the store of the node's first writer (Storage.origin), one
# per server, shared by its writers; the budget by each writer's store.
# Both gone with their store: keyed by id(), a new store given a stopped
# one's id took over its progress, and one whose look had ended never
# looked for what a restart left (a flaky CI failure).
_PROGRESS: weakref.WeakKeyDictionary[Storage, _Progress] = weakref.WeakKeyDictionary()
_BUDGETS: weakref.WeakKeyDictionary[Storage, _Budget] = weakref.WeakKeyDictionary()


def _progress(store: Storage) -> _Progress:
    origin = store.origin
    progress = _PROGRESS.get(origin)
    if progress is None:
        progress = _PROGRESS.setdefault(origin, _Progress())
    return progress


def _budget(store: Storage) -> _Budget:
    budget = _BUDGETS.get(store)
    if budget is None:
        budget = _BUDGETS[store] = _Budget()
    return budget


def is_heavy(store: Storage) -> bool:
    """Whether the clock's next tick may settle dependents left behind: it
    then runs in a thread, the event loop left to answer meanwhile."""
    progress = _PROGRESS.get(store.origin)
    return progress is None or progress.after is not None


def allowance(ctx: Context) -> int:
    """How many dependents this transaction may still settle."""
    budget = _budget(ctx.store)
    if budget.transaction != ctx.now_ms:
        budget.transaction, budget.settled = ctx.now_ms, 0
    return max(0, MOVES_AT_ONCE - budget.settled)


def spend(ctx: Context, settled: int) -> None:
    allowance(ctx)
    _budget(ctx.store).settled += settled


def left_over(ctx: Context) -> None:
    """Dependents were left BLOCKED for later: once this transaction has
    committed, the engine looks for them from the start (`look_again`),
    with the clock fired at once."""
    ctx.cascade_left = True
    ctx.wake_all()


def look_again(store: Storage) -> None:
    """A transaction that left dependents BLOCKED has committed: look for
    them from the start. Not in that transaction: a look in another
    writer's, begun before this commit, could miss them and end."""
    progress = _progress(store)
    with progress.lock:
        progress.restarts += 1
        progress.after = 0


def left_behind(ctx: Context) -> list[int]:
    """The dependents left behind that this transaction may settle (run by
    the clock's tick). Moves the look on; fires the clock again at once
    while there may be more."""
    progress = _progress(ctx.store)
    with progress.lock:
        after, restarts = progress.after, progress.restarts
    room = allowance(ctx)
    if after is None or room == 0:
        if after is not None:
            ctx.wake_all()
        return []
    rows = ctx.store.behind(after, EXAMINE_AT_ONCE)
    found: list[int] = []
    # Up to just before the first job taken: if this transaction is undone,
    # the next look finds it again; if not, it has left BLOCKED (or is
    # counted right), and the look passes it.
    resume = rows[-1][0] if rows else after
    for job_id, behind in rows:
        if not behind:
            continue
        if not found:
            resume = max(after, job_id - 1)
        if len(found) == room:
            break
        found.append(job_id)
    ended = not found and len(rows) < EXAMINE_AT_ONCE
    with progress.lock:
        if progress.restarts == restarts:
            progress.after = None if ended else resume
    if not ended:
        ctx.wake_all()
    return found
