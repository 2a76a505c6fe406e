"""A costly GLOB's search of the due jobs, bounded by its time in each
transaction (SECURITY.md, "a GetJob's GLOB over the due jobs").

A pattern within the bounds may still cost SQLite's GLOB a millisecond a
255-byte name (a list of ten `*[xa]x...z*`), so one GetJob over 10,000
due jobs that it matches none of held the writer, and every neighbour's
request behind it, 10 s. A search of such a pattern reads the due jobs a
page at a time, each page an index range of a few jobs (their names tested
in the query), and stops once its share of the transaction is spent: it
then takes nothing, and goes on in a later transaction from after the
last job it examined, with other requests committed in between. What
became ready behind it meanwhile is the wait queue's to see (waiters.py:
a try that went on over several transactions is tried again if a match
became ready while it ran), so the answer stays right.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import lru_cache

from jobserver.model.globmatch import is_glob, match_cost
from jobserver.storage.interface import Storage
from jobserver.storage.searches import PassedOver

# A list of patterns costing a name more than this (globmatch.match_cost)
# is searched a page at a time: `*`, `email/*` and `*-123` (26) are not,
# nor is a star and a dozen letters; a star and 13 letters (66) is.
COSTLY = 64
# A search's share of one transaction, and what one page may cost: 5 units
# a byte took SQLite up to 0.15 µs a unit (ten `*[xa]x{128}z*` against a
# name of 5 digits and 250 `x`: 7,110 units, about 1 ms a name), so a page
# of that list examines 3 jobs, about 4 ms.
SHARE_SECONDS = 0.02
PAGE_UNITS = 26_000
# A page examines no more than this many jobs, whatever the cost.
MOST_EXAMINED = 1024


@lru_cache(maxsize=1024)
def cost(patterns: tuple[str, ...]) -> int:
    """What a list of patterns costs a name, if it holds a wildcard."""
    return sum(match_cost(pattern) for pattern in patterns if is_glob(pattern))


@dataclass(slots=True)
class Scan:
    """A costly search's progress: where it goes on (after the last job
    examined), and, once its share of a transaction is spent without a
    job found, `carried` (it goes on in a later one from `after`)."""

    units: int
    after: tuple[int, str, str, int] | None = None
    carried: bool = False
    # When the share of the run of requests ends (time.perf_counter), and
    # whether this search opened it and has run a page: the first search
    # of a run always does, so the run progresses; the others may not.
    until: float = 0.0
    opened: bool = False
    paged: bool = False

    def begin(self, share: list[float]) -> None:
        """Its part of the run's share (Context.scan_share) begins: the
        share opens, SHARE_SECONDS long, with the run's first search."""
        if not share[0]:
            share[0] = time.perf_counter() + SHARE_SECONDS
            self.opened = True
        self.until = share[0]
        self.carried = self.paged = False

    def spent(self) -> bool:
        return (self.paged or not self.opened) and time.perf_counter() >= self.until

    def carry(self, after: tuple[int, str, str, int] | None) -> None:
        self.after, self.carried = after, True

    def page(
        self, store: Storage, now: str, priorities: tuple[int, ...], passed: PassedOver
    ) -> PassedOver:
        """`passed` with the end of the next page: its last job examined."""
        self.paged = True
        examine = max(1, min(MOST_EXAMINED, PAGE_UNITS // self.units))
        until = store.examined_until(
            now=now, priorities=priorities, after=passed.after, examine=examine
        )
        return replace(passed, until=until)


def costly(
    patterns: tuple[str, ...], after: tuple[int, str, str, int] | None = None
) -> Scan | None:
    """A Scan for a query's patterns if they are costly, else None."""
    units = cost(patterns) if patterns else 0
    return Scan(units, after) if units > COSTLY else None
