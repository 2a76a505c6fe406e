"""Which concurrency limits and paused patterns hold a job's name, at a
bounded cost however many patterns are set.

Limits and pauses are GLOB patterns that clients set (SetLimit, PauseJobs),
and every candidate of a GetJob must be checked against them. Testing
every due job against every pattern (in the search's SQL, then again in
Python) made a GetJob over many jobs and many patterns hold the event loop
for minutes. Here:

- the patterns sit in a table of an in-memory SQLite database, matched by
  SQLite's own GLOB in C (the same matching the SQLite backend does, which
  `globmatch` copies for PostgreSQL): nothing to compile, no cache to
  overflow, and a name is matched against a thousand patterns in a
  fraction of a millisecond;
- what holds a name is remembered per name (`MAX_CACHED_NAMES` of them)
  until the patterns change, so a queue of many jobs of few names costs
  one match per name;
- a search spends from a `Budget`: a name not yet remembered costs what
  testing it against every pattern may cost (`globmatch.match_cost`: one
  unit for a plain pattern, over a thousand for one of 255 bytes that
  SQLite's GLOB tries at each place in a name), a limit's usage (a query)
  `usage_cost`; when the budget is spent the GetJob answers with what it
  found.

The count of patterns is capped (`--max-limits`), and so is what they cost
a name together (`MAX_PATTERNS_COST`, commands.flow_control), so every
name can be judged within one search's budget.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

from jobserver.model.globmatch import literal_start, match_cost
from jobserver.model.limits import Limit
from jobserver.storage.interface import Storage

# Names whose verdict is remembered: enough for every queue of a large
# deployment. A verdict is tuples of the limits and paused patterns that
# match the name, so the cache also holds at most this many of them in all
# (8 bytes each), however many patterns match each name.
MAX_CACHED_NAMES = 10_000
MAX_CACHED_LIMITS = 1_000_000
# What one search (one GetJob or GetJobs) may spend: tests of a name
# against a pattern, done in C, in units of a plain test (about 50 ns;
# globmatch.match_cost), so that the worst search holds the writer for
# tens of milliseconds, not seconds: when each test counted one, however
# costly, 999 paused patterns of about 630 units, each tested against
# 100 names of 255 bytes, held it 4 to 5 s.
SEARCH_BUDGET = 1_000_000
# What the limits and paused patterns may cost a name together, so any
# name is judged within a search, five at least. A plain pattern
# (`email/*`) costs one unit, `*-123` 26: --max-limits' 10,000 limits and
# 10,000 pauses of the first kind cost 20,000, a thousand of each of the
# second 50,900; 156 of `*` and 254 letters fill it (a name judged in 6 ms).
MAX_PATTERNS_COST = 200_000
# A limit's usage is a query over its running jobs, counted as this many
# units: an index range when the pattern starts with a literal character,
# else a pass over every running job.
USAGE_COST = 5_000
USAGE_SCAN_COST = 50_000
# With more limits and paused patterns than this, a hand-out is heavy (is_heavy).
HEAVY_PATTERNS = 64
# Indexes kept for recently seen sets of patterns: more than one store may
# live in a process (tests run several servers), each with its own set.
MAX_INDEXES = 4


@dataclass(frozen=True)
class Verdict:
    """What holds a name: the paused patterns that match it, and the
    limits whose patterns match it, in the store's order."""

    paused: tuple[str, ...]
    limits: tuple[str, ...]


class FlowIndex:
    """The limits and paused patterns of one moment, matched by name."""

    def __init__(self, limits: Mapping[str, Limit], paused: frozenset[str]) -> None:
        self.limits = dict(limits)
        self.paused = paused
        # A job costing no more than this fits every limit's capacity.
        self.min_capacity = min((limit.max for limit in limits.values() if limit.max), default=0)
        # What judging one name against all of them may cost.
        self.cost = patterns_cost([*self.limits, *paused])
        rows = [
            *((pattern, limit.max) for pattern, limit in self.limits.items()),
            *((pattern, None) for pattern in sorted(paused)),
        ]
        # A name is tested only against the patterns whose literal start it
        # begins with (no other can match it): what testing a name costs
        # is theirs, found by the lengths of those starts.
        self._cost_by_start: dict[str, int] = {}
        for pattern, _ in rows:
            start = literal_start(pattern)
            self._cost_by_start[start] = self._cost_by_start.get(start, 0) + match_cost(pattern)
        self._start_lengths = sorted({len(start) for start in self._cost_by_start})
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._db.execute(
            "CREATE TABLE flow (pattern TEXT NOT NULL, capacity INTEGER, start TEXT NOT NULL)"
        )
        self._db.execute("CREATE INDEX flowStart ON flow (start)")
        self._db.executemany(
            "INSERT INTO flow (pattern, capacity, start) VALUES (?, ?, ?)",
            [(pattern, capacity, literal_start(pattern)) for pattern, capacity in rows],
        )
        self._verdicts: dict[str, Verdict] = {}
        # The limits the remembered verdicts name, in all.
        self._cached_limits = 0
        # Writer threads of several servers in one process may share an index.
        self._lock = threading.Lock()

    def same(self, limits: Mapping[str, Limit], paused: frozenset[str]) -> bool:
        return self.paused == paused and self.limits == limits

    def cached(self, name: str) -> Verdict | None:
        return self._verdicts.get(name)

    def name_cost(self, name: str) -> int:
        """What judging `name` costs: a lookup for each length of the
        patterns' literal starts, and the tests of the patterns whose start
        the name begins with (5,000 paused `p<N>/*` cost a name a few units,
        not 5,000)."""
        tested = name.partition("\0")[0]  # what a GLOB reads of it
        return sum(
            1 + self._cost_by_start.get(tested[:length], 0)
            for length in self._start_lengths
            if length <= len(tested)
        )

    def verdict(self, name: str) -> Verdict:
        """What holds `name`: remembered, or matched now (`name_cost`)."""
        found = self._verdicts.get(name)
        if found is not None:
            return found
        with self._lock:
            found = self._verdicts.get(name)
            if found is not None:
                return found
            tested = name.partition("\0")[0]
            starts = [tested[:length] for length in self._start_lengths if length <= len(tested)]
            rows = self._db.execute(
                "SELECT pattern, capacity FROM flow "
                "WHERE start IN (SELECT value FROM json_each(?2)) AND ?1 GLOB pattern "
                "ORDER BY rowid",
                (name, json.dumps(starts)),
            ).fetchall()
            found = Verdict(
                paused=tuple(pattern for pattern, capacity in rows if capacity is None),
                limits=tuple(pattern for pattern, capacity in rows if capacity is not None),
            )
            self._cached_limits += len(found.limits) + len(found.paused)
            while self._verdicts and (
                len(self._verdicts) >= MAX_CACHED_NAMES
                or self._cached_limits > MAX_CACHED_LIMITS
            ):
                # The oldest first: dicts keep insertion order.
                oldest = self._verdicts.pop(next(iter(self._verdicts)))
                self._cached_limits -= len(oldest.limits) + len(oldest.paused)
            self._verdicts[name] = found
        return found


_indexes: list[FlowIndex] = []
_indexes_lock = threading.Lock()


def index_of(store: Storage) -> FlowIndex:
    """The index of the store's limits and paused patterns as they are now;
    built once for each set of patterns."""
    limits, paused = store.limits, store.paused
    with _indexes_lock:
        for index in _indexes:
            if index.same(limits, paused):
                return index
    index = FlowIndex(limits, paused)
    with _indexes_lock:
        _indexes.insert(0, index)
        del _indexes[MAX_INDEXES:]
    return index


def patterns_cost(patterns: Iterable[str]) -> int:
    """What testing one name against all of these patterns may cost."""
    return sum(map(_limit_cost, patterns))


# Remembered for more patterns than limits and pauses may be set together
# (--max-limits, 10,000 each, of 255 bytes at most: 8 MB): SetLimit and
# PauseJobs sum them all, and 5,000 pauses were a minute of set-up when
# each was weighed again. Not for other patterns, up to 12,750 bytes each.
@lru_cache(maxsize=32_768)
def _limit_cost(pattern: str) -> int:
    return match_cost(pattern)


def is_heavy(store: Storage) -> bool:
    """Whether a hand-out may spend long on limits and pauses: then its
    batch runs in a thread, where SQLite matches and counts (in C, without
    the GIL) while the event loop goes on answering."""
    return len(store.limits) + len(store.paused) > HEAVY_PATTERNS


@dataclass(frozen=True)
class Use:
    """What running jobs use of a limit: their cost, and how many keys
    they are of (the empty key counts as one)."""

    running: int = 0
    keys: int = 0


def running_under(
    limits: Iterable[str], running: Iterable[tuple[str, str, int]]
) -> dict[str, Use]:
    """What running jobs, given as (name, key, cost), use of each limit:
    every name against every pattern in one query, in C, which holds
    neither the GIL nor the cache of names (Status reads every running job)."""
    db = sqlite3.connect(":memory:")
    try:
        db.execute("CREATE TABLE limits (pattern TEXT NOT NULL)")
        db.execute(
            "CREATE TABLE running (name TEXT NOT NULL, key TEXT NOT NULL, cost INTEGER NOT NULL)"
        )
        used = {pattern: Use() for pattern in limits}
        db.executemany("INSERT INTO limits (pattern) VALUES (?)", ((p,) for p in used))
        db.executemany("INSERT INTO running (name, key, cost) VALUES (?, ?, ?)", running)
        for pattern, cost, keys in db.execute(
            "SELECT pattern, SUM(cost), COUNT(DISTINCT key) FROM limits JOIN running "
            "ON running.name GLOB limits.pattern GROUP BY pattern"
        ):
            used[pattern] = Use(cost, keys)
        return used
    finally:
        db.close()


def usage_cost(pattern: str) -> int:
    """What reading a limit's usage counts against a search's budget."""
    return USAGE_COST if pattern[:1] not in ("*", "?", "[") else USAGE_SCAN_COST


class Budget:
    """What one search may still spend."""

    def __init__(self, units: int = SEARCH_BUDGET) -> None:
        self.left = units

    def spend(self, units: int) -> bool:
        """Spend `units`; False when too few are left, and then nothing is left."""
        if units > self.left:
            self.left = 0
            return False
        self.left -= units
        return True
