"""The hand-out search's statement on SQLite (sqlite.Store.find_ready):
one per priority, an index range of due jobs whose names match, less what
the search has passed over."""

from __future__ import annotations

import json

from jobserver.storage.searches import PassedOver, pair_text
from jobserver.storage.sql import AFTER_IN_ORDER, HAND_OUT_ORDER, JOB, READY_SQL

# The hand-out search's statements without exclusions, by whether they
# match GLOBs and how many names or patterns they bind: made once, not at
# every GetJob (the text cost a quarter of a search's instructions). Only
# for up to KEPT_SHAPE names or patterns: a list of exact names is bounded
# by its bytes alone (6,000 one-letter names), and a statement kept for
# every length a client sends would hold tens of megabytes.
STATEMENTS: dict[tuple[bool, int], str] = {}
KEPT_SHAPE = 32
AFTER = " AND " + AFTER_IN_ORDER.format("?")


def statement(globs: bool, count: int, passed: PassedOver, name_args: list[str | int]) -> str:
    """The search's statement for one priority, `{after}` left in it for
    where its range starts; what `passed` leaves out is appended to
    `name_args`. Either GLOBs, or exact names each sought in the name
    index, however many jobs of other names are due."""
    if globs:
        source = "jobs"
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
        f"WHERE state IN ({READY_SQL}) AND priority = ? AND nextRun <= ? "
        f"AND {name_clause}{{after}} ORDER BY {HAND_OUT_ORDER} LIMIT ?"
    )
