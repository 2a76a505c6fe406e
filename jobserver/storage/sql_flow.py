"""Flow control in the SQL both backends speak: concurrency limits,
paused patterns, rates and fair rounds (protocol.md 14.7 to 14.9, 14.23),
for the writer's connection.

Its tables (limits, paused, handouts, fairServed) are the store's only
state kept in memory too: every hand-out reads the limits and paused
patterns, so the store keeps copies (`limits`, `paused`), read again whenever a transaction is
rolled back. Apart from the jobs' own operations (sql_store.py) because
nothing here writes a job: it counts what the running jobs use and what
the hand-outs under a rate or a fair pattern were.
"""

from __future__ import annotations

from typing import Any

from jobserver.model.limits import Limit, Rate
from jobserver.storage.sql_statements import Statements


def flow_control(before: str = "") -> str:
    """Limits (with their capacity) and paused patterns (with none), in one
    query; each row's columns after `before` (columns of constants)."""
    return (
        f"SELECT {before}pattern, capacity, rate, ratePer, perKey, fair FROM limits "
        f"UNION ALL SELECT {before}pattern, NULL, 0, 0, 0, 0 FROM paused"
    )


FLOW_CONTROL = flow_control()


class FlowStatements(Statements):
    """The named operations on limits and paused patterns, and the copies
    of them in memory."""

    # Limits given at start (--limit) are the base; those set by SetLimit
    # are stored and win.
    _base_limits: dict[str, Limit]
    limits: dict[str, Limit]
    paused: frozenset[str]

    # Flow control: concurrency limits and paused patterns. The tables are
    # tiny; the copies in memory are read again whenever a transaction (or
    # a savepoint) is rolled back, so they never disagree with what is stored.

    def _load_flow_control(self) -> None:
        try:
            rows = self._execute(FLOW_CONTROL).fetchall()
        except self.errors:
            # A failing database: the rollback that brought us here is what
            # matters; the copies are read again after the next one.
            return
        self._set_flow_control(rows)

    def _set_flow_control(self, rows: list[tuple[Any, ...]]) -> None:
        limits = {
            **self._base_limits,
            **{row[0]: _limit(row) for row in rows if row[1] is not None},
        }
        # In one order on every node: hand-outs take the limits' locks in it.
        self.limits = dict(sorted(limits.items()))
        self.paused = frozenset(row[0] for row in rows if row[1] is None)

    def set_limit(self, pattern: str, limit: Limit) -> None:
        """Store a limit; one that holds nothing removes it (a --limit one
        until restart). What its rate counted is forgotten when the rate or
        its keys change, and its round when its fairness does: a new max
        alone does not open a spent window."""
        m = self.dialect.mark
        was = self.limits.get(pattern, Limit())
        if (was.rate, was.per_key) != (limit.rate, limit.per_key):
            self._execute(f"DELETE FROM handouts WHERE pattern = {m}", (pattern,))
        if was.fair != limit.fair:
            self._execute(f"DELETE FROM fairServed WHERE pattern = {m}", (pattern,))
        if limit.is_set:
            rate = limit.rate
            self._execute(
                "INSERT INTO limits (pattern, capacity, rate, ratePer, perKey, fair) "
                f"VALUES ({m}, {m}, {m}, {m}, {m}, {m}) ON CONFLICT (pattern) DO UPDATE SET "
                "capacity = excluded.capacity, rate = excluded.rate, "
                "ratePer = excluded.ratePer, perKey = excluded.perKey, fair = excluded.fair",
                (
                    pattern, limit.max, rate.count if rate else 0, rate.window_ms if rate else 0,
                    int(limit.per_key), int(limit.fair),
                ),
            )
            self.limits = dict(sorted({**self.limits, pattern: limit}.items()))
        else:
            self._execute(f"DELETE FROM limits WHERE pattern = {m}", (pattern,))
            self._base_limits.pop(pattern, None)
            self.limits = {p: c for p, c in self.limits.items() if p != pattern}

    def usage(self, pattern: str, now: str, key: str | None = None) -> int:
        """The cost of the running jobs a limit's pattern matches: RUNNING,
        and RUNQUEUED whose lease has not run out; of one `key` alone when
        one is given."""
        clause, args = self.dialect.matches("name", pattern)
        if key is not None:
            clause += f" AND key = {self.dialect.mark}"
            args = [*args, key]
        row = self._one(
            f"SELECT COALESCE(SUM(cost), 0) FROM jobs WHERE {clause} AND {self.dialect.holding()}",
            (*args, now),
        )
        return int(row[0])

    def usage_by_key(self, pattern: str, now: str) -> dict[str, int]:
        """What the running jobs a per-key limit's pattern matches use, by key."""
        clause, args = self.dialect.matches("name", pattern)
        rows = self._execute(
            f"SELECT key, SUM(cost) FROM jobs WHERE {clause} AND {self.dialect.holding()} "
            "GROUP BY key",
            (*args, now),
        )
        return {str(key): int(cost) for key, cost in rows.fetchall()}

    def usage_by_name(self, now: str, most: int) -> list[tuple[str, str, int]]:
        rows = self._execute(
            f"SELECT name, key, SUM(cost) FROM jobs WHERE {self.dialect.holding()} "
            f"GROUP BY name, key LIMIT {self.dialect.mark}",
            (now, most + 1),
        )
        return [(str(name), str(key), int(cost)) for name, key, cost in rows.fetchall()]

    # Rates and fairness (protocol.md 14.23).

    def handouts_by_key(self, pattern: str, since: str) -> dict[str, tuple[int, str]]:
        """For each key, how many hand-outs under a rate's `pattern` came
        after `since`, and the earliest of them."""
        m = self.dialect.mark
        rows = self._execute(
            f"SELECT key, COUNT(*), MIN(at) FROM handouts WHERE pattern = {m} AND at > {m} "
            "GROUP BY key",
            (pattern, since),
        )
        return {str(k): (int(count), str(first)) for k, count, first in rows.fetchall()}

    def note_handout(self, pattern: str, key: str, at: str, forget_before: str) -> None:
        """Count a hand-out under a rate, and forget those of its key that
        no window can hold any more."""
        m = self.dialect.mark
        self._execute(
            f"DELETE FROM handouts WHERE pattern = {m} AND key = {m} AND at <= {m}",
            (pattern, key, forget_before),
        )
        self._execute(
            f"INSERT INTO handouts (pattern, key, at) VALUES ({m}, {m}, {m})", (pattern, key, at)
        )

    def served_keys(self, pattern: str) -> list[str]:
        """The keys a fair pattern has served in its current round."""
        rows = self._execute(
            f"SELECT key FROM fairServed WHERE pattern = {self.dialect.mark}", (pattern,)
        )
        return [str(row[0]) for row in rows.fetchall()]

    def note_served(self, pattern: str, key: str) -> None:
        m = self.dialect.mark
        self._execute(
            f"INSERT INTO fairServed (pattern, key) VALUES ({m}, {m}) ON CONFLICT DO NOTHING",
            (pattern, key),
        )

    def new_round(self, pattern: str) -> None:
        """A fair pattern's next round: no key has been served in it."""
        self._execute(f"DELETE FROM fairServed WHERE pattern = {self.dialect.mark}", (pattern,))

    def pause(self, pattern: str) -> None:
        self._execute(
            f"INSERT INTO paused (pattern) VALUES ({self.dialect.mark}) ON CONFLICT DO NOTHING",
            (pattern,),
        )
        self.paused = self.paused | {pattern}

    def resume(self, pattern: str) -> bool:
        """Forget a paused pattern; False if it was not paused."""
        rows = self._execute(f"DELETE FROM paused WHERE pattern = {self.dialect.mark}", (pattern,))
        self.paused = self.paused - {pattern}
        return rows.rowcount > 0

    # Retention (protocol.md 14.10).

    def prune_handouts(self, before: str, batch: int) -> int:
        """Delete hand-outs under rates from before `before` (older than
        the longest window), about `batch` at most; how many went."""
        d = self.dialect
        rows = self._execute(
            f"DELETE FROM handouts WHERE at IN (SELECT at FROM handouts WHERE at < {d.mark} "
            f"ORDER BY at LIMIT {d.mark})",
            (before, batch),
        )
        return max(rows.rowcount, 0)


def _limit(row: tuple[Any, ...]) -> Limit:
    """A stored limit: pattern, capacity, rate, ratePer, perKey, fair."""
    _, capacity, rate, per, per_key, fair = row
    return Limit(
        max=int(capacity),
        rate=Rate(int(rate), int(per)) if rate else None,
        per_key=bool(per_key),
        fair=bool(fair),
    )
