"""What the clock does when it fires, and when it must fire next.

The engine's clock (engine.py) fires at the earliest time something
is due: a future job, a lease's end, a reply deadline, a running job's
stale deadline. When it fires, `tick` runs in the writer: dependents a
cascade left BLOCKED are settled (core/rules/cascade.py), waiting jobs whose
reply deadline passed and running jobs past --stale-after are failed
through their retry policies, leased jobs whose cancel is pending end
CANCELLED once their lease has, and the next time to fire is returned.
"""

from __future__ import annotations

from datetime import UTC, datetime

from jobserver.core.commands import replies
from jobserver.core.engine import stale
from jobserver.core.engine.context import Context, Settings
from jobserver.core.rules import lifecycle
from jobserver.model import times
from jobserver.storage.interface import Storage

# A moment passed: the clock fires at once.
_LONG_AGO = times.to_millis(datetime(2000, 1, 1, tzinfo=UTC))


def tick(ctx: Context) -> str | None:
    lifecycle.resume_cascade(ctx)
    replies.expire(ctx)
    stale.expire(ctx)
    stale.end_cancelled_leases(ctx)
    return _earliest(
        ctx.store.next_due(ctx.now_ms), stale.next_deadline(ctx.store, ctx.settings)
    )


def at_start(store: Storage, settings: Settings) -> str | None:
    """Deadlines kept in the database, passed or not: they fire at start
    (at once for reply deadlines that passed while the server was down,
    and for dependents a cascade left BLOCKED when it stopped: cascade.py)."""
    left = _LONG_AGO if store.behind(0, 1) else None
    return _earliest(left, store.first_deadline(), stale.next_deadline(store, settings))


def _earliest(*moments: str | None) -> str | None:
    return min((m for m in moments if m is not None), default=None)
