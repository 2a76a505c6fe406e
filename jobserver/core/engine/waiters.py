"""The wait queue: blocked GetJobs, which of them to try, and in what order.

Waiting never polls. A waiter is tried once when it arrives; after that it
is tried again only when a commit made a job of a matching name due, or
when the clock reached the earliest future nextRun. This module keeps the
book and decides; it runs nothing. The engine (engine.py) asks it which
waiters to try for the names a batch made ready (`ready`), tries them in
the writer with `selection.serve_waiters`, and tells it what each try
found (`served`).

A waiter moves through the states of `MOVES`, each move checked:

- IDLE: registered; tried again only when a matching job may be ready.
- HELD: idle, and behind an older waiter whose try is still running: a
  job that try missed could otherwise pass the older waiter, so it is
  tried only once that try ends (first come, first served).
- TRYING: part of a try in the writer (or queued to be).
- POKED: trying, and a matching job became ready meanwhile: the try may
  have looked before it was there, so it is tried again if it found nothing.
- LEAVING: its GetJob ended (timeout, hang-up) while it was being tried:
  its query is withdrawn, so the try takes nothing more for it
  (selection.serve_waiters), and what it took already goes back.
- SERVED: handed its jobs. GONE: its GetJob ended. Both are final.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum

import trio

from jobserver.core.rules.selection import JobQuery, Taken
from jobserver.model.globmatch import Matcher, glob_match, is_glob

# Matching the names a commit made due against the waiting patterns holds
# the event loop, and a pattern's cost is not its size: two stars, 30 sets
# and a run of `x`, against a 255-byte name that fits them at a hundred
# places, cost 40 to 300 µs a pair (a GetJob's list of ten patterns of a
# set each, 230 to 300 µs), where `email/*` costs 0.3 µs: 7 waiters of
# such lists and 512 names, 4,096 pairs matched at once, held both ports
# 1 s; 100 waiters and 1,000 names, 512 pairs at a time, held /healthz
# 0.3 to 1 s. So matching is bounded by the time it takes: a commit's
# pairs are matched as its outcome is delivered only if they are at most
# MATCH_AT_ONCE and take at most MATCH_SECONDS; else they all go to the
# engine's matcher, which matches MATCH_SECONDS at a time and sleeps
# MATCH_PAUSE between (engine.py: the writer's thread needs the GIL too).
# Measured with those 100 waiters: a pause as long as the slice left
# /healthz 0.1 to 0.2 s at worst, twice as long 0.03 to 0.06 s, as on an
# idle server (two loaded cores).
MATCH_AT_ONCE = 4096
MATCH_SECONDS = 0.0005
MATCH_PAUSE = 0.001
# Trying many waiters (the clock fired, another node may have changed
# anything) goes to the writer in groups, each sent once the one before it
# is served, so other requests run between them. A group holds every
# waiter of at most this many GLOB patterns, each of whose tries may scan
# every due job, or of this many selectors in all (exact names are looked
# up in an index). Waiters of one selector stay together: the writer tries
# a selector that found nothing only once per group.
SCANS_AT_ONCE = 4
SELECTORS_AT_ONCE = 64


@dataclass(frozen=True)
class Selector:
    """The names a waiter wants: GLOB patterns (one or more), or a set of
    exact names. The patterns' matcher is compiled before the waiter joins
    (get_jobs.py, in a thread: a long pattern's regular expressions take
    milliseconds), and kept here, so matching on the event loop never
    compiles."""

    patterns: tuple[str, ...]
    names: frozenset[str] = frozenset()
    matcher: Matcher | None = field(default=None, compare=False, hash=False, repr=False)

    def matches(self, name: str) -> bool:
        if self.matcher is not None:
            return self.matcher(name)
        if self.patterns:
            return any(glob_match(pattern, name) for pattern in self.patterns)
        return name in self.names

    @property
    def scans(self) -> bool:
        """Whether trying it searches the due jobs one by one (a GLOB), where
        exact names are looked up in an index."""
        return any(map(is_glob, self.patterns))


class Phase(Enum):
    IDLE = "idle"
    HELD = "held"
    TRYING = "trying"
    POKED = "poked"
    LEAVING = "leaving"
    SERVED = "served"
    GONE = "gone"


# Every legal move of a waiter (see the module's docstring).
MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.HELD, Phase.TRYING, Phase.GONE}),
    Phase.HELD: frozenset({Phase.TRYING, Phase.GONE}),
    Phase.TRYING: frozenset({Phase.POKED, Phase.IDLE, Phase.SERVED, Phase.LEAVING}),
    Phase.POKED: frozenset({Phase.IDLE, Phase.SERVED, Phase.LEAVING}),
    Phase.LEAVING: frozenset({Phase.GONE}),
    Phase.SERVED: frozenset(),
    Phase.GONE: frozenset(),
}
# A try of a waiter in these is under way (queued, in the writer, or
# waiting for its sync).
_TRYING = (Phase.TRYING, Phase.POKED)
# A waiter in these may be tried.
_WAITING = (Phase.IDLE, Phase.HELD)


class IllegalWaiterMove(Exception):
    """A move that MOVES does not allow: a bug in the wait queue."""


@dataclass(eq=False)
class Waiter:
    selector: Selector
    query: JobQuery
    seq: int = 0
    # When its GetJob began to wait (Status shows who waits since when).
    since: datetime | None = None
    phase: Phase = Phase.IDLE
    # While trying: younger waiters that a job this try missed could have
    # gone to (HELD); they are tried once it ends, so the job cannot pass it.
    held: list[Waiter] = field(default_factory=list)
    jobs: list[Taken] | None = None
    woken: trio.Event = field(default_factory=trio.Event)
    tried: trio.Event = field(default_factory=trio.Event)

    def move(self, to: Phase) -> None:
        if to not in MOVES[self.phase]:
            raise IllegalWaiterMove(f"a waiter cannot go from {self.phase.name} to {to.name}")
        self.phase = to


@dataclass
class Served:
    """What a try's end asks of the engine: waiters to try again, and jobs
    handed to waiters that had left, to give back."""

    again: list[Waiter] = field(default_factory=list)
    unwanted: list[list[Taken]] = field(default_factory=list)


class WaitQueue:
    def __init__(self) -> None:
        self._seq = itertools.count()
        # Grouped by selector, so a new job is matched once per distinct
        # pattern rather than once per waiter.
        self._by_selector: dict[Selector, dict[Waiter, None]] = {}
        # By selector, its waiters being tried (TRYING or POKED).
        self._trying: dict[Selector, _BeingTried] = {}
        self._count = 0
        self.closed = False
        # Names made due whose waiters the matcher has still to find.
        self._unmatched: set[str] = set()
        self._match_later = trio.Event()
        # Groups of waiters beyond the first of one `to_try`, tried one at
        # a time: the next is handed out once the one before is served.
        self._later: deque[list[Waiter]] = deque()
        self._trying_later = False

    def __len__(self) -> int:
        # A count kept as waiters join and go, not a sum over the groups:
        # the writer's thread asks it while the event loop changes them
        # (iterating the dict there raised "changed size during iteration"
        # and failed a whole transaction).
        return self._count

    def join(
        self, query: JobQuery, since: datetime | None = None, matcher: Matcher | None = None
    ) -> Waiter:
        """A new waiter, IDLE: the engine tries it at once. `matcher`: its
        GLOB, compiled (globmatch.matcher)."""
        selector = Selector(query.patterns, frozenset(query.names), matcher)
        waiter = Waiter(selector, query, next(self._seq), since)
        self._by_selector.setdefault(waiter.selector, {})[waiter] = None
        self._count += 1
        return waiter

    def oldest(self, limit: int) -> list[Waiter]:
        """The `limit` waiters that have waited longest, oldest first. Each
        selector's group is in the order its waiters joined, so they are in
        the groups whose first waiters are the `limit` oldest: those are
        merged, and not every waiter is read."""
        firsts = heapq.nsmallest(
            limit, (next(iter(group)) for group in self._by_selector.values()),
            key=lambda w: w.seq,
        )
        groups = [self._by_selector[first.selector] for first in firsts]
        merged = heapq.merge(*groups, key=lambda w: w.seq)
        return list(itertools.islice(merged, limit))

    def by_selector(self, limit: int) -> list[tuple[Selector, int]]:
        """The `limit` selectors most waiters wait on, with how many."""
        counts = ((selector, len(group)) for selector, group in self._by_selector.items())
        return heapq.nsmallest(limit, counts, key=lambda pair: -pair[1])

    def leave(self, waiter: Waiter) -> None:
        """Its GetJob ended without jobs: a try still under way hands
        whatever it finds back (LEAVING), and takes nothing more for it."""
        waiter.query.withdrawn = True
        waiter.move(Phase.LEAVING if waiter.phase in _TRYING else Phase.GONE)
        self._forget(waiter)

    def ready(self, names: set[str]) -> list[Waiter]:
        """The waiters of these names, made due by a commit, if they are
        found within MATCH_AT_ONCE pairs and MATCH_SECONDS; else none, and
        the matcher finds them all (what was found here is dropped, so that
        no waiter is tried twice for one name)."""
        if not names or not self._by_selector:
            return []
        if len(names) * len(self._by_selector) <= MATCH_AT_ONCE:
            found, done = next(self._slices(names))
            if done:
                return found
        self._unmatched |= names
        self._match_later.set()
        return []

    async def unmatched(self) -> set[str]:
        """Names that `ready` left for the matcher, once there are some."""
        await self._match_later.wait()
        self._match_later = trio.Event()
        names, self._unmatched = self._unmatched, set()
        return names

    def matching_slices(self, names: set[str]) -> Iterator[list[Waiter]]:
        """The waiters of `names`, found MATCH_SECONDS of matching at a time."""
        return (found for found, _ in self._slices(names))

    def _slices(self, names: set[str]) -> Iterator[tuple[list[Waiter], bool]]:
        """The waiters of `names` found in each MATCH_SECONDS of matching,
        each with whether it is the last (a slice's last pair may take
        longer: the patterns of one GetJob, 32 wildcards between them,
        took up to 2.3 ms against one name)."""
        found: list[Waiter] = []
        until = time.perf_counter() + MATCH_SECONDS
        for selector, group in list(self._by_selector.items()):
            for name in names:
                if time.perf_counter() >= until:
                    yield found, False
                    found, until = [], time.perf_counter() + MATCH_SECONDS
                if selector.matches(name):
                    found += group
                    break
        yield found, True

    def everyone(self) -> list[Waiter]:
        return [w for group in self._by_selector.values() for w in group]

    def to_try(self, waiters: Iterable[Waiter]) -> list[tuple[list[Waiter], bool]]:
        """Mark the waiters that may be tried now TRYING, oldest first, and
        cut them into groups: those to try now, each with whether it is a
        later group (whose end hands out the next, `next_later`). A waiter
        being tried is POKED instead, and younger ones behind it HELD: those
        given here, and those of its selector (a try in another writer's
        transaction, PostgreSQL's --writers, is one being tried)."""
        batch: list[Waiter] = []
        blocker: Waiter | None = None
        for waiter in sorted(waiters, key=lambda w: w.seq):
            if waiter.phase in _TRYING:
                if waiter.phase is Phase.TRYING:
                    # Its try may have looked before this job was there.
                    waiter.move(Phase.POKED)
                blocker = blocker or waiter
                continue
            if waiter.phase not in _WAITING:
                continue
            ahead = blocker or self._tried_ahead(waiter)
            if ahead is not None:
                # Trying it now could hand it the job the older waiter
                # missed: first come, first served.
                if waiter.phase is Phase.IDLE:
                    waiter.move(Phase.HELD)
                ahead.held.append(waiter)
            else:
                waiter.move(Phase.TRYING)
                batch.append(waiter)
        # Noted as being tried only now: those of this call are tried in
        # one pass, oldest first, and hold none of each other.
        for waiter in batch:
            self._trying.setdefault(waiter.selector, _BeingTried()).add(waiter)
        if not batch:
            return []
        first, *rest = _groups(batch)
        self._later.extend(rest)
        tries = [(first, False)]
        if not self._trying_later:
            later = self.next_later()
            if later is not None:
                tries.append((later, True))
        return tries

    def _tried_ahead(self, waiter: Waiter) -> Waiter | None:
        """The oldest waiter of `waiter`'s selector being tried, if older:
        a try begun apart (a waiter tried again after its own try) may run
        beside it in another transaction and take the job it would miss."""
        trying = self._trying.get(waiter.selector)
        oldest = trying.oldest() if trying is not None else None
        return oldest if oldest is not None and oldest.seq < waiter.seq else None

    def _tried(self, waiter: Waiter) -> None:
        """`waiter`'s try ended, or it left."""
        trying = self._trying.get(waiter.selector)
        if trying is not None and trying.discard(waiter):
            del self._trying[waiter.selector]

    def next_later(self) -> list[Waiter] | None:
        """The next later group to try, once the one before is served."""
        self._trying_later = bool(self._later)
        return self._later.popleft() if self._later else None

    def served(self, waiters: list[Waiter], handed: list[list[Taken] | None]) -> Served:
        """A try ended: each waiter's jobs, or None (nothing found, or the
        try failed)."""
        result = Served()
        # First, whatever follows: a waiter left noted as being tried would
        # hold every younger one of its names for good.
        for waiter in waiters:
            self._tried(waiter)
        for waiter, jobs in zip(waiters, handed, strict=True):
            waiter.tried.set()
            held, waiter.held = waiter.held, []
            result.again += [w for w in held if w.phase in _WAITING]
            if waiter.phase is Phase.LEAVING:
                waiter.move(Phase.GONE)
                if jobs is not None:
                    result.unwanted.append(jobs)
                continue
            if jobs is not None:
                waiter.move(Phase.SERVED)
                waiter.jobs = jobs
                self._forget(waiter)
                waiter.woken.set()
                continue
            poked = waiter.phase is Phase.POKED
            waiter.move(Phase.IDLE)
            if self.closed:
                waiter.woken.set()
            elif poked:
                result.again.append(waiter)
        result.again = list(dict.fromkeys(result.again))
        return result

    def close(self) -> None:
        """Answer every waiter not being tried now (with no jobs), and the
        others once their tries end."""
        self.closed = True
        # Those whose try was not yet sent are answered now too.
        for later in self._later:
            for waiter in later:
                waiter.move(Phase.GONE if waiter.phase is Phase.LEAVING else Phase.IDLE)
        self._later.clear()
        for waiter in self.everyone():
            if waiter.phase in _WAITING:
                waiter.woken.set()

    def _forget(self, waiter: Waiter) -> None:
        self._tried(waiter)
        group = self._by_selector.get(waiter.selector)
        if group is not None and waiter in group:
            del group[waiter]
            self._count -= 1
            if not group:
                del self._by_selector[waiter.selector]


class _BeingTried:
    """A selector's waiters being tried, and the oldest of them in
    logarithmic time (a heap; what left it is dropped when it comes up):
    ten thousand waiters of one name may be tried at once, and each GetJob
    that joins them asks."""

    def __init__(self) -> None:
        self._members: set[Waiter] = set()
        self._heap: list[tuple[int, Waiter]] = []

    def add(self, waiter: Waiter) -> None:
        if waiter not in self._members:
            self._members.add(waiter)
            heapq.heappush(self._heap, (waiter.seq, waiter))

    def discard(self, waiter: Waiter) -> bool:
        """Drop `waiter`; whether none is left."""
        self._members.discard(waiter)
        return not self._members

    def oldest(self) -> Waiter | None:
        heap = self._heap
        while heap and heap[0][1] not in self._members:
            heapq.heappop(heap)
        return heap[0][1] if heap else None


def _groups(batch: list[Waiter]) -> list[list[Waiter]]:
    """Waiters to try, oldest first, cut into the groups the writer tries
    one at a time (SCANS_AT_ONCE, SELECTORS_AT_ONCE)."""
    by_selector: dict[Selector, list[Waiter]] = {}
    for waiter in batch:
        by_selector.setdefault(waiter.selector, []).append(waiter)
    groups: list[list[Waiter]] = [[]]
    scans = selectors = 0
    for selector, waiters in by_selector.items():
        if scans == SCANS_AT_ONCE or selectors == SELECTORS_AT_ONCE:
            groups.append([])
            scans = selectors = 0
        groups[-1] += waiters
        scans += selector.scans
        selectors += 1
    return groups
