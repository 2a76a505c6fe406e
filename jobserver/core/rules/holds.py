"""Whether a pause or a limit holds a job back, for the searches of one
transaction (selection.py's `_take` asks, job by job): a limit's capacity
(of each key, for a per-key one), its rate's window, its fair round; and
what held jobs whatever their cost, to be left out of the search's next
page (storage's PassedOver)."""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import dataclass
from datetime import timedelta

from jobserver.core.engine.context import Context
from jobserver.core.rules import flow
from jobserver.model import times
from jobserver.model.globmatch import is_glob
from jobserver.model.jobs import Job
from jobserver.model.limits import Limit, Rate
from jobserver.storage.searches import PassedOver

# A search reads this many limits' usage one statement each; past them it
# reads every limit's at once (Holds._used_of_all).
USAGES_ONE_BY_ONE = 8
# ... if the running jobs have at most this many names: a client that
# takes a million jobs and never reports would make each search read them.
MOST_RUNNING_NAMES = 10_000
# A pattern that has held this many names in one search is left out of its
# next pages as a pattern: names made for each job would otherwise make a
# list as long as the queue.
HELD_NAMES_BY_PATTERN = 8
# What reading a row of a pattern's usage by key, rate window by key or
# fair round costs a search's budget (about a microsecond each).
ROW_COST = 20


class Holds:
    """Whether a pause or a limit (its capacity, its rate, its rotation
    between keys) holds a job back, for the searches of one transaction.
    What a limit has used, its rate's window and its fair round are read
    once per search for the whole pattern (every key at once, for a
    per-key one), when a job under it is first considered, and counted on
    from there. What holds jobs whatever their cost (a pause, a full limit,
    a spent rate, a key served this round) is kept, to be left out of the
    search's next page: the names it held (of one key, for a per-key or
    fair limit), and, once one pattern (of one key) has held
    HELD_NAMES_BY_PATTERN names, the pattern."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._index = flow.index_of(ctx.store)
        self._budget = flow.Budget()
        self._locked = False
        # By (pattern, key): key "" for a limit that counts keys together.
        self._usage: dict[tuple[str, str], int] = {}
        # Per-key limits whose every key's usage is in _usage.
        self._usage_read: set[str] = set()
        self._rates: dict[tuple[str, str], _Window] = {}
        self._rates_read: set[str] = set()
        # The keys each fair pattern has served in its round, once read;
        # what of it is not yet stored: the patterns whose round began anew
        # and the keys served since (write_rounds).
        self._served: dict[str, set[str]] = {}
        self._restarted: set[str] = set()
        self._newly_served: dict[str, set[str]] = {}
        self._held_names: set[str] = set()
        self._names_by_pattern: dict[str, int] = {}
        self._held_patterns: set[str] = set()
        # Held names and patterns of one key, as (name or pattern, key).
        self._held_pairs: set[tuple[str, str]] = set()
        self._pairs_by_pattern: dict[tuple[str, str], int] = {}
        self._held_keyed: set[tuple[str, str]] = set()
        # What fair patterns held, by pattern: the keys, and the pairs and
        # keyed patterns they put in the lists above, taken out again when
        # the pattern begins a new round (new_rounds).
        self._fair_keys: dict[str, set[str]] = {}
        self._fair_holds: dict[str, set[tuple[str, str]]] = {}
        # The pattern whose turn each held (name, key) pair waits for.
        self._fair_pairs: dict[tuple[str, str], str] = {}
        # Fair patterns that have met one key alone in this search.
        self.uncontested: set[str] = set()
        # Fair patterns whose round this search began for itself alone: it
        # asks for some of their names only, and the keys it cannot see
        # keep their turns (nothing of such a round is stored).
        self._local: set[str] = set()
        # What the search asks for: its patterns and names (begin_search).
        self._asked: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        # The (pattern, key) whose turn the job last held back waits for.
        self.waiting_turn: tuple[str, str] | None = None
        self._read_all_tried = False
        self._all_read = False

    def held_on_sight(self, job: Job, has_room: Callable[[tuple[str, str]], bool]) -> bool:
        """Whether a job of a page is held by what held one before it in
        the same page (its name, or its name and key): a set's test, where
        judging it again costs microseconds, and the pages of a round of a
        thousand keys hold a hundred thousand such jobs. A job its key's
        turn may still keep (the turns have room) is judged."""
        if job.name in self._held_names:
            return True
        pair = (job.name, job.key)
        if pair not in self._held_pairs:
            return False
        pattern = self._fair_pairs.get(pair)
        return pattern is None or not has_room((pattern, job.key))

    def begin_search(self, patterns: tuple[str, ...], names: tuple[str, ...]) -> None:
        """A search begins (the waiters of one pass share their holds):
        a key alone under a fair pattern in another's search need not be
        alone in this one, and a round another began for itself alone is
        not this one's."""
        self.uncontested = set()
        self._asked = (patterns, names)
        for pattern in self._local:
            self._served.pop(pattern, None)
        self._local = set()

    def _asks_for_all(self, pattern: str) -> bool:
        """Whether the search asks for every name `pattern` may match."""
        patterns, names = self._asked
        return any(asked in ("*", pattern) for asked in patterns) or (
            not is_glob(pattern) and pattern in names
        )

    def holds_back(self, job: Job) -> bool | None:
        """True if the job must wait, False if it may go, None when the
        budget is spent before that is known."""
        self.waiting_turn = None
        verdict = self._verdict(job.name)
        if verdict is None:
            return None
        if verdict.paused:
            self._hold_all(job.name, verdict.paused)
            return True
        for pattern in verdict.limits:
            limit = self._index.limits[pattern]
            key = job.key if limit.per_key else ""
            held = self._holds(pattern, limit, key, job)
            if held is not False:
                return held
        return False

    def _holds(self, pattern: str, limit: Limit, key: str, job: Job) -> bool | None:
        """Whether one limit holds the job: its capacity, its rate, its turn."""
        if limit.max:
            used = self._used(pattern, key, limit.per_key)
            if used is None:
                return None
            if used + job.cost > limit.max:
                if used >= limit.max:
                    # Full: no job under it fits, whatever it costs.
                    self._hold_for(job.name, pattern, key, limit.per_key)
                return True
        if limit.rate is not None:
            window = self._window(pattern, key, limit.rate)
            if window is None:
                return None
            if window.count >= limit.rate.count:
                self._ctx.fire_at(window.frees_at(limit.rate))
                self._hold_for(job.name, pattern, key, limit.per_key)
                return True
        if limit.fair and pattern not in self.uncontested:
            served = self._served_keys(pattern)
            if served is None:
                return None
            if job.key in served:
                self._hold_turn(job.name, pattern, job.key)
                return True
        return False

    def count(self, job: Job) -> None:
        """A job was handed out: its cost now counts against its limits,
        the hand-out against their rates, its key as served."""
        ctx = self._ctx
        for pattern in self._index.verdict(job.name).limits:
            limit = self._index.limits[pattern]
            key = job.key if limit.per_key else ""
            if limit.max:
                # A scope read at once with every other may have had none.
                self._usage[pattern, key] = self._usage.get((pattern, key), 0) + job.cost
            if limit.rate is not None:
                self._rates[pattern, key].count += 1
                forget = _before(ctx.now_ms, limit.rate.window_ms)
                ctx.store.note_handout(pattern, key, ctx.now_ms, forget)
            if limit.fair and pattern in self._served:
                self._served[pattern].add(job.key)
                if pattern not in self._local:
                    self._newly_served.setdefault(pattern, set()).add(job.key)

    def passed_over(self, after: tuple[int, str, str, int] | None) -> PassedOver:
        """What the search's next page leaves out, having read up to `after`."""
        return PassedOver(
            after=after,
            names=frozenset(self._held_names),
            patterns=tuple(sorted(self._held_patterns)),
            pairs=frozenset(self._held_pairs),
            keyed=tuple(sorted(self._held_keyed)),
        )

    def new_rounds(
        self, patterns: set[str] | None = None, alone: Set[str] = frozenset()
    ) -> bool:
        """Begin a new round of each of `patterns` (by default, every fair
        pattern that held a key back in this search); False if there are
        none, or the budget is spent. A pattern under which one key alone
        waited has no other key to rotate to: it holds none for the rest
        of the search (a GetJobs of 100 jobs of one customer is one
        search, not 100)."""
        if patterns is None:
            patterns = set(self._fair_keys)
            alone = {p for p, keys in self._fair_keys.items() if len(keys) == 1}
        if not patterns or not self._budget.spend(ROW_COST * len(patterns)):
            return False
        for pattern in patterns:
            if self._asks_for_all(pattern):
                # Written once, when the search ends (write_rounds): a
                # GetJobs of 1,000 jobs of two keys is 500 rounds.
                self._restarted.add(pattern)
                self._newly_served.pop(pattern, None)
            else:
                # A GetJob of one customer's names would otherwise begin a
                # new round for every customer, and the others' turns be lost.
                self._local.add(pattern)
            self._served[pattern] = set()
            for held in self._fair_holds.pop(pattern, set()):
                self._held_pairs.discard(held)
                self._held_keyed.discard(held)
                self._fair_pairs.pop(held, None)
            self._fair_keys.pop(pattern, None)
        self.uncontested |= alone
        return True

    def forget_turns(self) -> None:
        """Leave out of the next pages no job for its key's turn alone:
        the search begins again, in the same round."""
        for held in set().union(*self._fair_holds.values()):
            self._held_pairs.discard(held)
            self._held_keyed.discard(held)
        self._fair_holds = {}
        self._fair_pairs = {}
        self._fair_keys = {}

    def write_rounds(self) -> None:
        """Store what this search did to fair rounds: a round begun anew,
        and the keys served since."""
        store = self._ctx.store
        for pattern in self._restarted:
            store.new_round(pattern)
        for pattern, keys in self._newly_served.items():
            for key in sorted(keys):
                store.note_served(pattern, key)
        self._restarted = set()
        self._newly_served = {}

    def _hold_all(self, name: str, patterns: tuple[str, ...]) -> None:
        """Every job of `name` is held, by each of `patterns`, whatever it costs."""
        if name in self._held_names or not self._held_patterns.isdisjoint(patterns):
            return
        self._held_names.add(name)
        for pattern in patterns:
            count = self._names_by_pattern.get(pattern, 0) + 1
            self._names_by_pattern[pattern] = count
            if count >= HELD_NAMES_BY_PATTERN:
                # Names of their own for each job (`report/2026-11-29/7`):
                # one test of the pattern instead of a list without end.
                self._held_patterns.add(pattern)

    def _hold_for(
        self, name: str, pattern: str, key: str, per_key: bool
    ) -> list[tuple[str, str]]:
        """Every job of `name` that a limit holds whatever it costs: of any
        key, or of `key` alone for a per-key limit. What it adds to the
        lists of one key's holds (a name, and past
        HELD_NAMES_BY_PATTERN names the pattern, each with the key)."""
        if not per_key:
            self._hold_all(name, (pattern,))
            return []
        if (pattern, key) in self._held_keyed or (name, key) in self._held_pairs:
            return []
        added = [(name, key)]
        self._held_pairs.add((name, key))
        count = self._pairs_by_pattern.get((pattern, key), 0) + 1
        self._pairs_by_pattern[pattern, key] = count
        if count >= HELD_NAMES_BY_PATTERN:
            self._held_keyed.add((pattern, key))
            added.append((pattern, key))
        return added

    def _hold_turn(self, name: str, pattern: str, key: str) -> None:
        """A fair pattern has served `key` in this round: its jobs wait for
        the next, which begins when no other key's job is left (new_rounds)."""
        self.waiting_turn = (pattern, key)
        self._fair_keys.setdefault(pattern, set()).add(key)
        added = self._hold_for(name, pattern, key, per_key=True)
        self._fair_holds.setdefault(pattern, set()).update(added)
        if added:
            self._fair_pairs[added[0]] = pattern

    def _verdict(self, name: str) -> flow.Verdict | None:
        found = self._index.cached(name)
        if found is None and self._budget.spend(self._index.name_cost(name)):
            found = self._index.verdict(name)
        return found

    def _lock(self) -> None:
        """Before the first count: from here on no other node hands out a
        job under any limit until this transaction ends."""
        if not self._locked:
            self._locked = True
            self._ctx.store.hold_limits()

    def _read(self) -> bool:
        """Spend what one grouped read costs, whatever its rows (one per
        key with running jobs, hand-outs in the window, or a turn served):
        charged by the row, 50,000 served keys spent the whole budget and a
        fair pattern answered 404 with jobs ready. Its rows are bounded by
        the keys that have jobs, read once per search."""
        return self._budget.spend(flow.USAGE_COST)

    def _used(self, pattern: str, key: str, per_key: bool) -> int | None:
        if (pattern, key) in self._usage:
            return self._usage[pattern, key]
        if self._all_read or pattern in self._usage_read:
            # Every (name, key) with a running job was read.
            return self._usage.setdefault((pattern, key), 0)
        self._lock()
        if len(self._usage) >= USAGES_ONE_BY_ONE and not self._read_all_tried:
            return self._used_of_all(pattern, key, per_key)
        if per_key:
            # Every key's at once: one statement, however many keys.
            by_key = self._ctx.store.usage_by_key(pattern, self._ctx.now_ms)
            if not self._read():
                return None
            self._usage.update(((pattern, k), cost) for k, cost in by_key.items())
            self._usage_read.add(pattern)
            return self._usage.setdefault((pattern, key), 0)
        if not self._budget.spend(flow.usage_cost(pattern)):
            return None
        used = self._ctx.store.usage(pattern, self._ctx.now_ms)
        self._usage[pattern, key] = used
        return used

    def _used_of_all(self, pattern: str, key: str, per_key: bool) -> int | None:
        """Every limit's usage at once, from the running jobs' costs by name
        and key and what holds each name: read one by one, 200 full limits
        in front of a free job spent the search's budget, and every GetJob
        answered 404 while they waited."""
        self._read_all_tried = True
        by_name = self._ctx.store.usage_by_name(self._ctx.now_ms, MOST_RUNNING_NAMES)
        if len(by_name) > MOST_RUNNING_NAMES:
            # More running names than a search may read: each limit's
            # usage an index range of its own again.
            return self._used(pattern, key, per_key)
        if not self._budget.spend(flow.USAGE_SCAN_COST + len(by_name)):
            return None
        # Counted from the start: the hand-outs of this search are running.
        usage: dict[tuple[str, str], int] = {}
        for name, job_key, cost in by_name:
            verdict = self._verdict(name)
            if verdict is None:
                return None
            for limit_pattern in verdict.limits:
                limit = self._index.limits[limit_pattern]
                if limit.max:
                    scope = (limit_pattern, job_key if limit.per_key else "")
                    usage[scope] = usage.get(scope, 0) + cost
        # A limit (or a key of one) without a running job uses nothing.
        self._usage = usage
        self._all_read = True
        return usage.setdefault((pattern, key), 0)

    def _window(self, pattern: str, key: str, rate: Rate) -> _Window | None:
        """The hand-outs of a rate's current window (of one key): every
        key's read at once."""
        if pattern not in self._rates_read:
            self._lock()
            ctx = self._ctx
            since = _before(ctx.now_ms, rate.window_ms)
            by_key = ctx.store.handouts_by_key(pattern, since)
            if not self._read():
                return None
            for counted_key, (count, earliest) in by_key.items():
                self._rates[pattern, counted_key] = _Window(count, earliest)
            self._rates_read.add(pattern)
        return self._rates.setdefault((pattern, key), _Window(0, self._ctx.now_ms))

    def _served_keys(self, pattern: str) -> set[str] | None:
        """The keys a fair pattern has served in its current round."""
        served = self._served.get(pattern)
        if served is None:
            self._lock()
            keys = self._ctx.store.served_keys(pattern)
            if not self._read():
                return None
            served = self._served[pattern] = set(keys)
        return served


def _before(moment: str, window_ms: int) -> str:
    """The moment `window_ms` before `moment` (stored text, UTC)."""
    return times.to_millis(times.parse_stored(moment) - timedelta(milliseconds=window_ms))


@dataclass
class _Window:
    """A rate's hand-outs in the window that ends now: how many, and when
    the earliest was."""

    count: int
    earliest: str

    def frees_at(self, rate: Rate) -> str:
        """When the earliest leaves the window, and the rate may allow one
        more (or, past a lowered rate, when the next check is due)."""
        moment = times.parse_stored(self.earliest) + timedelta(milliseconds=rate.window_ms)
        return times.to_millis(moment)
