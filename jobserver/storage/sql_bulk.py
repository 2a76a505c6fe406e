"""The SQL of a bulk action's search (protocol.md 14.19), for both
dialects: the window of a state's jobs whose names could match, read
through an index of names, and the matches among them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jobserver.model.globmatch import after_prefix, is_glob, literal_start
from jobserver.model.jobs import READY, State
from jobserver.storage import sql
from jobserver.storage.searches import NameMatch
from jobserver.storage.sql import Dialect

# A bulk search reads a state's jobs through its partial index of names
# (SQLite is told to use it, or it may read the table), and the states
# that index holds: QUEUED's holds RUNQUEUED jobs too.
_NAME_INDEXES = {
    State.FAILED: ("jobsFailedName", (State.FAILED,)),
    State.QUEUED: ("jobsReadyName", READY),
}


def window(d: Dialect, state: str, match: NameMatch) -> tuple[str, list[Any]]:
    """The jobs a bulk search may examine, as `SELECT jobID, name` of the
    state's index (a LIMIT to follow): those of the names a match takes
    exactly, and of the range of names that begin with a queue's name
    and `/`, or with a pattern's literal start. Each a SELECT of its own,
    joined by UNION ALL: ORed, SQLite read the whole index."""
    index, held = _NAME_INDEXES[State(state)]
    head = f"SELECT jobID, name FROM jobs {d.indexed_by(index)} WHERE {_in_states(held)}"
    names, start = _names_and_start(match)
    parts: list[str] = []
    args: list[Any] = []
    if names:
        clause, named = d.any_of("name", names)
        parts.append(f"{head} AND {clause}")
        args += named
    if start is not None:
        end = after_prefix(start)
        if end is None:
            parts.append(f"{head} AND name >= {d.mark}")
            args.append(start)
        else:
            parts.append(f"{head} AND name >= {d.mark} AND name < {d.mark}")
            args += (start, end)
    return " UNION ALL ".join(parts), args


def _names_and_start(match: NameMatch) -> tuple[tuple[str, ...], str | None]:
    """The names a match takes exactly, and the start of the names of its
    range (None: no range). A queue's jobs are its name and the names that
    start with it and `/` (compared as text: a queue's name may hold
    GLOB's `*`); a pattern without a wildcard is one exact name, as GetJob
    reads it."""
    if match.queue is not None:
        return (match.queue,), match.queue + "/"
    if match.pattern is None:
        return match.names, None
    if not is_glob(match.pattern):
        return (match.pattern,), None
    return (), literal_start(match.pattern)


def found_in(d: Dialect, state: str, match: NameMatch, window: str) -> tuple[str, list[Any]]:
    """The jobIDs of the window's jobs in `state` whose name matches: the
    pattern tried on each, and, where the index holds other states, the
    state of each that matches read by its jobID. A subquery, the same
    work whatever the plan: joined, PostgreSQL merged the window with
    every jobID below its last; NOT EXISTS of a RUNQUEUED job, it read
    every RUNQUEUED job's index entry for each job of the window."""
    found = f"SELECT w.jobID FROM ({window}) AS w"
    where: list[str] = []
    args: list[Any] = []
    if match.pattern is not None and is_glob(match.pattern):
        clause, args = d.matches("w.name", match.pattern)
        where.append(clause)
    if _NAME_INDEXES[State(state)][1] != (state,):
        where.append(
            f"(SELECT j.state FROM jobs AS j WHERE j.jobID = w.jobID) = {sql.states((state,))}"
        )
    return (f"{found} WHERE {' AND '.join(where)}" if where else found), args


def _in_states(states: Sequence[str]) -> str:
    """A job is in one of `states`, as a partial index's WHERE says it."""
    if len(states) == 1:
        return f"state = {sql.states(states)}"
    return f"state IN ({sql.states(states)})"
