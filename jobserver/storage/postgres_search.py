"""The hand-out search's statement on PostgreSQL (postgres.PostgresStore.
find_ready): the search function (postgres_functions.FIND_READY_AFTER_FUNCTION)
over due jobs whose names match, less what the search has passed over,
with whether each job found has children, in the same statement."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jobserver.model.globmatch import glob_to_regex, is_glob
from jobserver.model.jobs import Job
from jobserver.storage.searches import PassedOver, pair_text
from jobserver.storage.sql import JOB, priorities_from

# Each job's children are looked up by its jobID (LATERAL, LIMIT 1): with
# EXISTS, PostgreSQL, expecting a thousand rows of the function, read every
# child in the table into a hash instead. (Returned by the function as a
# column beside the job's, each of the row's 33 fields was taken out of it
# again, about 11 µs a job.) WITH ORDINALITY keeps the search's order.
STATEMENT = (
    f"SELECT {JOB}, kids.one IS NOT NULL FROM jobserver_find_ready_after"
    "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
    "WITH ORDINALITY AS f LEFT JOIN LATERAL (SELECT 1 AS one FROM jobs c "
    "WHERE c.parentJobID != 0 AND c.parentJobID = f.jobID LIMIT 1) AS kids ON true "
    "ORDER BY f.ordinality"
)


def arguments(
    now: str,
    priorities: Sequence[int],
    limit: int,
    patterns: Sequence[str],
    names: Sequence[str],
    passed: PassedOver,
) -> tuple[Any, ...]:
    """STATEMENT's arguments: GLOB patterns as one regex, each translation
    anchored at both ends (a job matching any), or exact names; then what
    the search has passed over, and where its last page ended."""
    exact: list[str] | None = None
    regex: str | None = None
    if any(map(is_glob, patterns)):
        regex = "|".join(map(glob_to_regex, patterns))
    else:
        exact = list(patterns or names)
    after = passed.after or (None, None, None, None)
    return (
        now, list(priorities_from(priorities, passed.after)), limit, regex, exact,
        sorted(passed.names), [glob_to_regex(held) for held in passed.patterns],
        sorted(pair_text(name, key) for name, key in passed.pairs),
        [glob_to_regex(pattern) for pattern, _ in passed.keyed],
        [key for _, key in passed.keyed],
        *after,
    )


def found(rows: list[tuple[Any, ...]]) -> tuple[list[Job], dict[int, bool]]:
    """The jobs found, and whether each has children, by jobID."""
    return [Job(*row[:-1]) for row in rows], {int(row[1]): bool(row[-1]) for row in rows}
