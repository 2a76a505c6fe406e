"""Blocked GetJob calls, and the clock that wakes them for future jobs.

Waiting never polls. A waiter is tried once when it arrives; after that it
is tried again only when a commit made a job of a matching name due, or
when the clock reaches the earliest future nextRun. Tries go to the writer
as one "serve" request holding every waiter to try, oldest first, so the
longest-waiting worker gets the job. This module knows nothing of SQL: the
serve and undo functions come from outside.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from functools import partial
from typing import Any

import outcome
import trio

from jobserver.core.engine.clock import Clock, seconds_until
from jobserver.core.engine.writer import Work, Writer
from jobserver.model import times
from jobserver.model.globmatch import glob_match, is_glob

log = logging.getLogger("jobserver")

# After a failed transaction (the database locked past its busy timeout, a
# full disk), what the clock and the give-backs still owe is tried again
# this long after: soon enough for a waiting worker, slow enough not to spin.
RETRY_SECONDS = 1.0
# New names times waiting patterns: up to this many matches are made as a
# commit's outcome is delivered. Past it (thousands of waiters with
# patterns, and a batch of many names) the rest is matched by
# `run_matcher`, a slice at a time, so the event loop goes on serving
# every connection meanwhile: one match of a hostile pattern costs ~10 µs.
MATCH_AT_ONCE = 4096
MATCH_SLICE = 512
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
    """The names a waiter wants: one GLOB pattern, or a set of exact names."""

    pattern: str | None
    names: frozenset[str] = frozenset()

    def matches(self, name: str) -> bool:
        if self.pattern is not None:
            return glob_match(self.pattern, name)
        return name in self.names

    @property
    def scans(self) -> bool:
        """Whether trying it searches the due jobs one by one (a GLOB), where
        exact names are looked up in an index."""
        return self.pattern is not None and is_glob(self.pattern)


class _State(Enum):
    IDLE = "idle"  # registered, nothing to try until a job may be ready
    TRYING = "trying"  # part of a serve request in the writer
    DONE = "done"  # handed its jobs, or gone


@dataclass(eq=False)
class Waiter:
    selector: Selector
    # Opaque to this module; handed to the serve function.
    query: Any
    seq: int = 0
    state: _State = _State.IDLE
    # A matching job became ready while this waiter was being tried.
    poked: bool = False
    # Younger waiters that such a job could have gone to: they are tried
    # after this waiter's try ends, with it, so the job cannot pass it.
    held: list[Waiter] = field(default_factory=list)
    gone: bool = False
    jobs: Any = None
    woken: trio.Event = field(default_factory=trio.Event)
    tried: trio.Event = field(default_factory=trio.Event)


# serve(ctx, queries) -> (one result per query, None when nothing was found;
# the earliest future nextRun). It runs in the writer.
Serve = Callable[[Any, list[Any]], tuple[list[Any], "str | None"]]
# undo(ctx, jobs) puts jobs handed to a waiter that left back in the queue.
Undo = Callable[[Any, Any], None]
# tick(ctx) -> the earliest future due time: what else must happen when the
# clock fires (reply deadlines passing). It runs in the writer.
Tick = Callable[[Any], "str | None"]


class WaitQueue:
    def __init__(
        self,
        writer: Writer,
        clock: Clock,
        serve: Serve,
        undo: Undo,
        tick: Tick | None = None,
        serve_is_heavy: Callable[[], bool] = lambda: False,
    ) -> None:
        self._writer = writer
        self._clock = clock
        self._serve = serve
        # Whether serving waiters may take long (many limits and pauses):
        # its batch then runs in a thread.
        self._serve_is_heavy = serve_is_heavy
        self._undo = undo
        self._tick = tick
        self._seq = itertools.count()
        # Grouped by selector, so a new job is matched once per distinct
        # pattern rather than once per waiter.
        self._by_selector: dict[Selector, dict[Waiter, None]] = {}
        self._next_due: str | None = None
        self._rearm = trio.Event()
        self._closed = False
        # Names made due whose waiters run_matcher has still to find.
        self._unmatched: set[str] = set()
        self._match_later = trio.Event()
        # Groups of waiters beyond the first TRY_AT_ONCE of one _try, sent
        # to the writer one at a time.
        self._try_later: deque[list[Waiter]] = deque()
        self._trying_later = False
        # Give-backs whose transaction failed: tried again when the clock
        # next fires, so no job is left RUNNING without an owner.
        self._owed: list[Any] = []

    def __len__(self) -> int:
        return sum(len(group) for group in self._by_selector.values())

    # The timeout is GetJob's: it ends in None (a 404 reply), not in a cancellation.
    async def wait(self, selector: Selector, query: Any, timeout: float) -> Any:  # noqa: ASYNC109
        """Wait up to `timeout` seconds for jobs; None if none came.

        Jobs that are returned have been taken: if the caller cannot deliver
        them it must give them back with `give_back`.
        """
        if self._closed:
            return None
        waiter = Waiter(selector, query, next(self._seq))
        self._by_selector.setdefault(selector, {})[waiter] = None
        self._try([waiter])
        deadline = trio.current_time() + timeout
        try:
            # The first try is always seen through, so even `timeout: 0`
            # gets a job that is due now.
            await waiter.tried.wait()
            with trio.move_on_at(deadline):
                await waiter.woken.wait()
        except BaseException:
            if waiter.jobs is not None:
                self.give_back(waiter.jobs)
            raise
        finally:
            if waiter.jobs is None:
                waiter.gone = True
                self._forget(waiter)
        return waiter.jobs

    def give_back(self, jobs: Any) -> None:
        """Return undeliverable jobs to the queue (through the writer), as
        many times as it takes."""
        self._writer.submit(
            Work(lambda ctx: self._undo(ctx, jobs), partial(self._given_back, jobs))
        )

    def _given_back(self, jobs: Any, result: outcome.Maybe[Any]) -> None:
        if isinstance(result, outcome.Error):
            log.error(
                "could not put undelivered jobs back: %s; trying again in %gs",
                result.error, RETRY_SECONDS,
            )
            self._owed.append(jobs)
            self._retry_soon()

    def notify(self, ready: set[str], due: str | None) -> None:
        """Called after each commit: these names became due; `due` is the
        earliest future nextRun that commit wrote."""
        self._lower_due(due)
        if not ready or not self._by_selector:
            return
        if len(ready) * len(self._by_selector) <= MATCH_AT_ONCE:
            self._try(self._matching(ready))
        else:
            self._unmatched |= ready
            self._match_later.set()

    async def run_matcher(self) -> None:
        """Find the waiters of names that notify left for later, a slice of
        matches at a time, trying each slice's waiters as they are found.
        A waiter that arrives meanwhile is tried on arrival, as always."""
        while True:
            await self._match_later.wait()
            self._match_later = trio.Event()
            names, self._unmatched = self._unmatched, set()
            found: list[Waiter] = []
            matched = 0
            for selector, group in list(self._by_selector.items()):
                for name in names:
                    if matched == MATCH_SLICE:
                        self._try(found)
                        found, matched = [], 0
                        await trio.lowlevel.checkpoint()
                    matched += 1
                    if selector.matches(name):
                        found += group
                        break
            self._try(found)

    def recheck(self) -> None:
        """Another node may have changed what is due (or a notice of it was
        lost): run the tick now, which asks the store when the clock must
        next fire, and try every waiter."""
        if self._closed:
            return
        if self._tick is not None:
            self._writer.submit(Work(self._tick, self._ticked))
        self._try(self._all_waiters())

    def close(self) -> None:
        """Answer every waiter now (with no jobs) and accept no more."""
        self._closed = True
        # Those whose try was not yet sent are answered now too.
        for later in self._try_later:
            for waiter in later:
                waiter.state = _State.IDLE
        self._try_later.clear()
        for group in list(self._by_selector.values()):
            for waiter in list(group):
                if waiter.state is _State.IDLE:
                    waiter.woken.set()

    def start_clock_at(self, due: str | None) -> None:
        """What the store holds at start that the clock must fire for."""
        self._lower_due(due)

    async def run_clock(self) -> None:
        """Wake waiters when the earliest future job becomes due, and run
        the tick then, even with nobody waiting."""
        while True:
            self._rearm = trio.Event()
            due = self._next_due
            if due is None:
                await self._rearm.wait()
                continue
            with trio.move_on_after(seconds_until(self._clock, due)):
                await self._rearm.wait()
                continue
            self._next_due = None
            owed, self._owed = self._owed, []
            for jobs in owed:
                self.give_back(jobs)
            if self._tick is not None:
                self._writer.submit(Work(self._tick, self._ticked))
            self._try(self._all_waiters())

    def _ticked(self, result: outcome.Maybe[Any]) -> None:
        if isinstance(result, outcome.Error):
            log.error(
                "the clock's tick failed: %s; trying again in %gs", result.error, RETRY_SECONDS
            )
            # The due time that fired was cleared: without this the clock
            # would sleep until some later commit happened to write one.
            self._retry_soon()
            return
        self._lower_due(result.value)

    def _retry_soon(self) -> None:
        self._lower_due(times.to_millis(self._clock.now() + timedelta(seconds=RETRY_SECONDS)))

    def _lower_due(self, due: str | None) -> None:
        if due is not None and (self._next_due is None or due < self._next_due):
            self._next_due = due
            self._rearm.set()

    def _matching(self, ready: Iterable[str]) -> list[Waiter]:
        names = list(ready)
        found: list[Waiter] = []
        for selector, group in self._by_selector.items():
            if any(selector.matches(name) for name in names):
                found += group
        return found

    def _all_waiters(self) -> list[Waiter]:
        return [w for group in self._by_selector.values() for w in group]

    def _forget(self, waiter: Waiter) -> None:
        group = self._by_selector.get(waiter.selector)
        if group is not None:
            group.pop(waiter, None)
            if not group:
                del self._by_selector[waiter.selector]

    def _try(self, waiters: list[Waiter]) -> None:
        batch: list[Waiter] = []
        blocker: Waiter | None = None
        for waiter in sorted(waiters, key=lambda w: w.seq):
            if waiter.gone or waiter.state is _State.DONE:
                continue
            if waiter.state is _State.TRYING:
                # Its try may have looked before this job was there.
                waiter.poked = True
                blocker = blocker or waiter
            elif blocker is not None:
                # Trying it now could hand it the job the older waiter
                # missed: first come, first served.
                blocker.held.append(waiter)
            else:
                waiter.state = _State.TRYING
                batch.append(waiter)
        if not batch:
            return
        first, *rest = _groups(batch)
        self._submit(first)
        self._try_later.extend(rest)
        if not self._trying_later:
            self._submit_later()

    def _submit(self, batch: list[Waiter], later: bool = False) -> None:
        queries = [w.query for w in batch]
        self._writer.submit(
            Work(
                lambda ctx: self._serve(ctx, queries),
                lambda o: self._served(batch, o, later),
                # A GLOB's search of a long queue, or a search under many
                # limits and pauses, runs off the event loop.
                heavy=any(w.selector.scans for w in batch) or self._serve_is_heavy(),
            )
        )

    def _submit_later(self) -> None:
        self._trying_later = bool(self._try_later)
        if self._try_later:
            self._submit(self._try_later.popleft(), later=True)

    def _served(self, batch: list[Waiter], result: outcome.Maybe[Any], later: bool) -> None:
        if later:
            self._submit_later()
        if isinstance(result, outcome.Error):
            log.error("serving waiting GetJobs failed: %s", result.error)
            handed: list[Any] = [None] * len(batch)
            # Whatever made them worth trying may still hold.
            self._retry_soon()
        else:
            handed, due = result.value
            self._lower_due(due)
        again: list[Waiter] = []
        for waiter, jobs in zip(batch, handed, strict=False):
            waiter.tried.set()
            held, waiter.held = waiter.held, []
            again += [w for w in held if w.state is _State.IDLE and not w.gone]
            if jobs is not None:
                waiter.state = _State.DONE
                if waiter.gone:
                    self.give_back(jobs)
                    continue
                waiter.jobs = jobs
                self._forget(waiter)
                waiter.woken.set()
                continue
            waiter.state = _State.IDLE
            if self._closed:
                waiter.woken.set()
            elif waiter.poked and not waiter.gone:
                waiter.poked = False
                again.append(waiter)
        if again:
            self._try(list(dict.fromkeys(again)))


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

