"""Waiting GetJobs' tries: a pass over a group of waiters in one
transaction, which a costly pattern's search may carry on into later ones
(scan.py)."""

from __future__ import annotations

from dataclasses import dataclass

from jobserver.core.engine.context import Context
from jobserver.core.rules import scan as scan_rules
from jobserver.core.rules.holds import Holds
from jobserver.core.rules.selection import JobQuery, Taken, take


@dataclass(frozen=True, slots=True)
class Carry:
    """A pass of waiters' tries that goes on in a later transaction: from
    after `after` for its first waiter's search, and with the selectors
    the pass found nothing for (`empty`), which its later waiters share."""

    after: tuple[int, str, str, int] | None = None
    empty: frozenset[tuple[object, ...]] = frozenset()


def serve_waiters(
    ctx: Context, queries: list[JobQuery], carry: Carry | None = None
) -> tuple[list[list[Taken] | None], str | None, Carry | None]:
    """Try waiting GetJobs oldest first. A selector that found nothing is
    not tried again in the same pass, so ten thousand waiters on one name
    cost one query, not ten thousand. A costly pattern's search shares
    the pass's time (scan.py): once it is spent, the pass ends without the
    rest, answered for the waiters it tried, and goes on later (Carry)."""
    empty: set[tuple[object, ...]] = set(carry.empty) if carry is not None else set()
    after = carry.after if carry is not None else None
    handed: list[list[Taken] | None] = []
    # One budget and one count of usage for the whole pass.
    holds = Holds(ctx) if ctx.store.limits or ctx.store.paused else None
    with ctx.store.holding_writes():
        for query in queries:
            if query.selector in empty:
                handed.append(None)
                continue
            scan = scan_rules.costly(query.patterns, after)
            after = None
            if scan is not None:
                scan.begin(ctx.scan_share)
            taken = take(ctx, query, holds, scan)
            if scan is not None and scan.carried:
                return handed, ctx.store.next_due(ctx.now_ms), Carry(scan.after, frozenset(empty))
            if not taken:
                empty.add(query.selector)
            handed.append(taken or None)
    return handed, ctx.store.next_due(ctx.now_ms), None


