"""What the engine runs in the writer's transactions: four kinds of work.

A `Call` is a request (a command, a prune step), whose caller awaits its
outcome. The other three are the engine's own: trying waiting GetJobs
(`Serve`), putting back jobs whose reply never reached the client
(`GiveBack`), and what the clock does when it fires (`Tick`). Each runs on
the transaction's Context and says whether it is heavy (its batch then
runs in a thread). Their outcomes come back to the engine (engine.py),
which reads each by its kind: nothing here is called back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from jobserver.core.engine import deadlines
from jobserver.core.engine.context import Context
from jobserver.core.engine.waiters import Waiter
from jobserver.core.rules import cascade, flow, selection
from jobserver.core.rules.selection import Taken
from jobserver.storage.interface import Storage


@dataclass(eq=False, slots=True)
class Call:
    run: Callable[[Context], Any]
    # Runs long enough to hold up the event loop: its batch goes to a thread.
    heavy: bool = False
    # The task awaiting the outcome (Engine.call), woken with it; None
    # when nobody waits for it.
    task: trio.lowlevel.Task | None = None
    # With no task: given the result, on the event loop, if it succeeded
    # (the engine's own look for ended awaited jobs).
    then: Callable[[Any], None] | None = None


@dataclass(eq=False, slots=True)
class Serve:
    """Try waiters, oldest first; `later` for a group that hands out the
    next one when it is served (waiters.WaitQueue.next_later)."""

    waiters: list[Waiter]
    later: bool = False
    # A GLOB's search of a long queue, or a search under many limits and
    # pauses, runs off the event loop.
    heavy: bool = False

    @staticmethod
    def of(waiters: list[Waiter], later: bool, store: Storage) -> Serve:
        """The try of `waiters`, heavy if one of them scans the queue or
        the store's flow control is."""
        heavy = any(w.selector.scans for w in waiters) or flow.is_heavy(store)
        return Serve(waiters, later, heavy)

    def run(self, ctx: Context) -> list[list[Taken] | None]:
        return selection.serve_waiters(ctx, [waiter.query for waiter in self.waiters])


@dataclass(eq=False, slots=True)
class GiveBack:
    taken: list[Taken]
    heavy: bool = False

    def run(self, ctx: Context) -> None:
        selection.give_back(ctx, self.taken)


@dataclass(eq=False, slots=True)
class Tick:
    heavy: bool = False

    @staticmethod
    def of(store: Storage) -> Tick:
        """The clock's tick, heavy if a cascade left for later is."""
        return Tick(heavy=cascade.is_heavy(store))

    def run(self, ctx: Context) -> str | None:
        return deadlines.tick(ctx)


Work = Call | Serve | GiveBack | Tick


def refuse_abort(raise_cancel: Any) -> trio.lowlevel.Abort:
    """A Call's task waits for its outcome through a cancellation: the
    request is on its way to the disk, so nothing is left half-reported."""
    return trio.lowlevel.Abort.FAILED
