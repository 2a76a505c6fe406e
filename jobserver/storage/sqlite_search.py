"""The hand-out search's statement on SQLite (sqlite.Store.find_ready):
one per priority, an index range of due jobs whose names match, less what
the search has passed over."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from jobserver.storage.searches import PassedOver, pair_text
from jobserver.storage.sql import (
    AFTER_IN_ORDER,
    HAND_OUT_ORDER,
    JOB,
    READY_SQL,
    Rows,
    priorities_from,
)

# The hand-out search's statements without exclusions, by whether they
# match GLOBs and how many names or patterns they bind: made once, not at
# every GetJob (the text cost a quarter of a search's instructions). Only
# for up to KEPT_SHAPE names or patterns: a list of exact names is bounded
# by its bytes alone (6,000 one-letter names), and a statement kept for
# every length a client sends would hold tens of megabytes.
STATEMENTS: dict[tuple[bool, int], str] = {}
KEPT_SHAPE = 32
AFTER = " AND " + AFTER_IN_ORDER.format("?")
UNTIL = " AND (nextRun, name, jobID) <= (?, ?, ?)"
# The due jobs of one priority in hand-out order, read in the index alone
# (no GLOB): where a costly pattern's page of `examine` jobs ends.
RANGE = (
    f"FROM jobs INDEXED BY jobsReadyPriority WHERE state IN ({READY_SQL}) "
    "AND priority = ? AND nextRun <= ?{after}"
)
NTH = f"SELECT priority, nextRun, name, jobID {RANGE} ORDER BY {HAND_OUT_ORDER} LIMIT 1 OFFSET ?"
COUNT = f"SELECT count(*) FROM (SELECT 1 {RANGE} LIMIT ?)"


def range_clause(priority: int, passed: PassedOver) -> tuple[str, tuple[str | int, ...]]:
    """The bounds of a page's range within `priority`, with their
    arguments: after the last job read, and up to `passed.until`."""
    clause, args = "", ()  # type: tuple[str, tuple[str | int, ...]]
    if passed.after is not None and passed.after[0] == priority:
        clause, args = AFTER, passed.after[1:]
    if passed.until is not None and passed.until[0] == priority:
        clause, args = clause + UNTIL, (*args, *passed.until[1:])
    return clause, args


def statement(globs: bool, count: int, passed: PassedOver, name_args: list[str | int]) -> str:
    """The search's statement for one priority, `{after}` left in it for
    where its range starts; what `passed` leaves out is appended to
    `name_args`. Either GLOBs, or exact names each sought in the name
    index, however many jobs of other names are due."""
    if globs:
        # A costly pattern's page is an index range of the due jobs, each
        # tested (a name's index would read every job of its prefix).
        source = "jobs INDEXED BY jobsReadyPriority" if passed.until else "jobs"
        name_clause = "(" + " OR ".join("name GLOB ?" for _ in range(count)) + ")"
    else:
        source = "jobs INDEXED BY jobsReadyName"
        name_clause = f"name IN ({', '.join('?' for _ in range(count))})"
    if passed.names:
        name_clause += " AND name NOT IN (SELECT value FROM json_each(?))"
        name_args.append(json.dumps(sorted(passed.names)))
    for held in passed.patterns:
        name_clause += " AND NOT (name GLOB ?)"
        name_args.append(held)
    if passed.pairs:
        name_clause += " AND (name || char(10) || key) NOT IN (SELECT value FROM json_each(?))"
        name_args.append(json.dumps(sorted(pair_text(n, k) for n, k in passed.pairs)))
    for held, key in passed.keyed:
        name_clause += " AND NOT (key = ? AND name GLOB ?)"
        name_args += (key, held)
    return (
        f"SELECT {JOB} FROM {source} "
        f"WHERE state IN ({READY_SQL}) AND priority = ? AND nextRun <= ?{{after}} "
        f"AND {name_clause} ORDER BY {HAND_OUT_ORDER} LIMIT ?"
    )


def examined_until(
    run: Callable[[str, Sequence[Any]], Rows],
    now: str,
    priorities: Sequence[int],
    after: tuple[int, str, str, int] | None,
    examine: int,
) -> tuple[int, str, str, int] | None:
    """The `examine`-th due job after `after` in hand-out order, over
    `priorities` (those in use), or None if fewer are left: read in the
    index, a priority's jobs counted only when it has fewer."""
    passed = PassedOver(after=after)
    for priority in priorities_from(priorities, after):
        clause, args = range_clause(priority, passed)
        row = run(NTH.format(after=clause), (priority, now, *args, examine - 1)).fetchone()
        if row is not None:
            return (int(row[0]), str(row[1]), str(row[2]), int(row[3]))
        count = run(COUNT.format(after=clause), (priority, now, *args, examine)).fetchone()
        examine -= int(count[0])
    return None
